//! `model.safetensors.index.json`: the Hugging Face convention (`metadata.total_size` and
//! `weight_map`: tensor → file), extended with metadata naming the saver manifest. Its atomic
//! rename into place is the commit point of a checkpoint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{format_version_of, Manifest, FORMAT_NAME};
use crate::manifest::CheckpointRef;
use crate::naming::manifest_name;

/// The `metadata` object of the index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexMetadata {
    /// Sum of all tensor byte lengths.
    pub total_size: u64,
    /// Always "saver".
    pub format: String,
    /// The saver format version.
    pub saver_format_version: u32,
    /// The committed save.
    pub saver_save_id: String,
    /// File name of the global manifest.
    pub saver_manifest: String,
    /// CRC32 of the manifest file's bytes.
    pub saver_manifest_crc32: u32,
}

sealed_document! {
/// The global index. Read only through [`Index::parse`], built only for a manifest
/// (`Index::for_manifest`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index parsed as RawIndex, serde(deny_unknown_fields) {
    /// Metadata.
    pub metadata: IndexMetadata,
    /// Tensor name → data file.
    pub weight_map: BTreeMap<String, String>,
}
}

impl Index {
    /// The index of a committed manifest.
    #[doc(hidden)]
    pub fn for_manifest(m: &Manifest, manifest_crc32: u32) -> Index {
        let mut weight_map = BTreeMap::new();
        for t in m.tensor_refs() {
            weight_map.insert(t.name.clone(), t.file.clone());
        }
        Index {
            metadata: IndexMetadata {
                total_size: m.total_tensor_bytes(),
                format: FORMAT_NAME.into(),
                saver_format_version: format_version_of(
                    m.parent.as_ref(),
                    m.is_compressed(),
                    !m.row_tables.is_empty(),
                ),
                saver_save_id: m.save_id.clone(),
                saver_manifest: manifest_name(&m.save_id),
                saver_manifest_crc32: manifest_crc32,
            },
            weight_map,
            sealed: super::Sealed,
        }
    }

    /// The save this index commits.
    pub fn committed(&self) -> CheckpointRef {
        CheckpointRef {
            save_id: self.metadata.saver_save_id.clone(),
            manifest_crc32: self.metadata.saver_manifest_crc32,
        }
    }
}

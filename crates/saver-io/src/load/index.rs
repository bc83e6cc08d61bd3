//! `model.safetensors.index.json`: the Hugging Face convention (`metadata.total_size` and
//! `weight_map`: tensor → file), extended with metadata naming the saver manifest. Its atomic
//! rename into place is the commit point of a checkpoint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use saver_core::manifest::format_version_of;
use saver_core::naming::{check_save_id, manifest_name};
use saver_core::{Manifest, DELTA_FORMAT_VERSION, FORMAT_VERSION};

use crate::error::{Error, Result};
use crate::storage::check_file_name;

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

/// The global index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// Metadata.
    pub metadata: IndexMetadata,
    /// Tensor name → data file.
    pub weight_map: BTreeMap<String, String>,
}

impl Index {
    /// The index of a committed manifest.
    pub fn for_manifest(m: &Manifest, manifest_crc32: u32) -> Index {
        let mut weight_map = BTreeMap::new();
        for t in m.tensor_refs() {
            weight_map.insert(t.name.clone(), t.file.clone());
        }
        Index {
            metadata: IndexMetadata {
                total_size: m.total_tensor_bytes(),
                format: "saver".into(),
                saver_format_version: format_version_of(m.parent.as_ref()),
                saver_save_id: m.save_id.clone(),
                saver_manifest: manifest_name(&m.save_id),
                saver_manifest_crc32: manifest_crc32,
            },
            weight_map,
        }
    }

    /// Parses and checks an index: known version, safe names.
    pub fn parse(bytes: &[u8], file: &str) -> Result<Index> {
        // The version first, from a probe that skips everything else without building it.
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            metadata: Option<ProbeMetadata>,
        }
        #[derive(Deserialize)]
        struct ProbeMetadata {
            #[serde(default)]
            saver_format_version: Option<serde_json::Value>,
        }
        let probe: Probe = serde_json::from_slice(bytes).map_err(|e| Error::Corrupt {
            file: file.into(),
            what: format!("not valid JSON: {e}"),
        })?;
        if let Some(found) = probe.metadata.and_then(|m| m.saver_format_version) {
            if !found.as_u64().is_some_and(|v| {
                (u64::from(FORMAT_VERSION)..=u64::from(DELTA_FORMAT_VERSION)).contains(&v)
            }) {
                return Err(Error::UnsupportedVersion {
                    file: file.into(),
                    found: found.to_string(),
                    supported: DELTA_FORMAT_VERSION,
                });
            }
        }
        let index: Index = serde_json::from_slice(bytes).map_err(|e| Error::Corrupt {
            file: file.into(),
            what: format!("not a saver index: {e}"),
        })?;
        if index.metadata.format != "saver" {
            return Err(Error::Corrupt {
                file: file.into(),
                what: format!(
                    "metadata.format is {:?}, not \"saver\"",
                    index.metadata.format
                ),
            });
        }
        check_save_id(&index.metadata.saver_save_id).map_err(|e| Error::Corrupt {
            file: file.into(),
            what: e.to_string(),
        })?;
        check_file_name(&index.metadata.saver_manifest, file)?;
        for f in index.weight_map.values() {
            check_file_name(f, file)?;
        }
        Ok(index)
    }
}

//! Reading the documents of a checkpoint that say what it is: which save is committed, and a
//! shard's manifest.

use std::path::Path;

use saver_core::manifest::CheckpointRef;
use saver_core::naming::{shard_manifest_name, INDEX_FILE};
use saver_core::ShardManifest;

use crate::error::{Error, Result};
use crate::load::index::Index;
use crate::storage::Storage;

/// Largest manifest or index read whole.
pub(crate) const MAX_JSON_BYTES: u64 = 1 << 30;

/// The committed checkpoint in `storage`, if any.
pub fn committed(storage: &dyn Storage) -> Result<Option<CheckpointRef>> {
    if !storage.exists(INDEX_FILE)? {
        return Ok(None);
    }
    let index = Index::parse(&storage.get(INDEX_FILE, MAX_JSON_BYTES)?, INDEX_FILE)?;
    Ok(Some(CheckpointRef {
        save_id: index.metadata.saver_save_id,
        manifest_crc32: index.metadata.saver_manifest_crc32,
    }))
}

pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    file: &str,
    what: &str,
) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Corrupt {
        file: file.to_string(),
        what: format!("not {what}: {e}"),
    })
}

/// Reads and parses shard `shard`'s manifest of `save_id`.
pub(crate) fn read_shard_manifest(
    storage: &dyn Storage,
    save_id: &str,
    shard: u32,
) -> Result<ShardManifest> {
    let name = shard_manifest_name(save_id, shard);
    parse_json(
        &storage.get(&name, MAX_JSON_BYTES)?,
        &name,
        "a shard manifest",
    )
}

/// Checks a parent path as a manifest gives it: relative, non-empty, no control characters.
pub fn check_parent_path(path: &str) -> std::result::Result<(), String> {
    if path.is_empty() {
        return Err("path is empty".into());
    }
    if path.chars().any(char::is_control) {
        return Err(format!("path {path:?} contains a control character"));
    }
    if Path::new(path).is_absolute() || path.starts_with('\\') {
        return Err(format!(
            "path {path:?} is absolute: a parent is named relative to its child"
        ));
    }
    Ok(())
}

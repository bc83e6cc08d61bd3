//! Reading the documents of a checkpoint from storage: which save is committed, the manifest it
//! commits, a shard's manifest. They are parsed and checked by saver-core
//! ([`saver_core::manifest`]), the one place that can build them; this module only fetches their
//! bytes, within [`MAX_JSON_BYTES`].

use saver_core::manifest::{CheckpointRef, Index, MAX_DOCUMENT_BYTES};
use saver_core::naming::{shard_manifest_name, INDEX_FILE};
use saver_core::ShardManifest;

use crate::error::{Error, Result};
use crate::storage::Storage;

/// Largest manifest, index or marker read whole.
pub(crate) const MAX_JSON_BYTES: u64 = MAX_DOCUMENT_BYTES;

/// The committed checkpoint in `storage`, if any.
pub(crate) fn committed(storage: &dyn Storage) -> Result<Option<CheckpointRef>> {
    let Some(bytes) = get_if_exists(storage, INDEX_FILE, MAX_JSON_BYTES)? else {
        return Ok(None);
    };
    Ok(Some(Index::parse(&bytes, INDEX_FILE)?.committed()))
}

/// [`Storage::get`] of `name`, `None` if there is no such file: one read, not a look-up and a
/// read, which on an object store are a round trip each (a save asks for the index before it
/// writes and at its commit, an open before it reads).
pub(crate) fn get_if_exists(
    storage: &dyn Storage,
    name: &str,
    limit: u64,
) -> Result<Option<Vec<u8>>> {
    match storage.get(name, limit) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Parses one of saver's small JSON files that are not checkpoint documents (a policy, a claim,
/// a marker), naming `file` and `what` it should have been when it is not.
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

/// Reads and checks shard `shard`'s manifest of `save_id`.
pub(crate) fn read_shard_manifest(
    storage: &dyn Storage,
    save_id: &str,
    shard: u32,
) -> Result<ShardManifest> {
    let name = shard_manifest_name(save_id, shard);
    let m = ShardManifest::parse(&storage.get(&name, MAX_JSON_BYTES)?, &name)?;
    if m.save_id != save_id || m.shard != shard {
        return Err(Error::Corrupt {
            file: name,
            what: format!(
                "holds shard {} of save {}, not shard {shard} of save {save_id}",
                m.shard, m.save_id
            ),
        });
    }
    Ok(m)
}

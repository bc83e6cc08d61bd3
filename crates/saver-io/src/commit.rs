//! Committing a checkpoint: shard manifests, the commit claim, the global manifest and index.
//!
//! Protocol (see `docs/FORMAT.md`):
//!
//! 1. Each shard writes its data files (temporary name, fsync, rename), syncs the directory, then
//!    writes its shard manifest the same way. A shard manifest therefore only exists once the
//!    shard's data are durable.
//! 2. A process that finds all `shard_num` shard manifests of its save tries to create the commit
//!    claim exclusively (`O_CREAT|O_EXCL`). Exactly one succeeds; it merges the shard manifests,
//!    writes the global manifest, then the index. The index's rename is the commit point.
//! 3. After the commit, files of other saves (an older checkpoint being replaced, leftovers of a
//!    crashed attempt) are removed. Until the commit, the older checkpoint is untouched, since its
//!    files have other names.

use std::thread;
use std::time::{Duration, Instant};

use saver_core::naming::{commit_claim_name, manifest_name, shard_manifest_name, INDEX_FILE};
use saver_core::{Manifest, ShardManifest};

use crate::error::{Error, Result};
use crate::index::Index;
use crate::storage::Storage;

/// Largest manifest or index read whole.
pub(crate) const MAX_JSON_BYTES: u64 = 1 << 30;

/// What a commit attempt found.
#[derive(Debug, PartialEq, Eq)]
pub enum CommitState {
    /// This call wrote the index.
    CommittedHere,
    /// The save is committed (by another process, or earlier).
    Committed,
    /// Another process holds the claim and is committing.
    Claimed,
    /// Shards are still missing.
    Missing(Vec<u32>),
}

/// The save id of the committed index in `storage`, if any.
pub fn committed_save_id(storage: &dyn Storage) -> Result<Option<String>> {
    if !storage.exists(INDEX_FILE)? {
        return Ok(None);
    }
    let bytes = storage.get(INDEX_FILE, MAX_JSON_BYTES)?;
    Ok(Some(
        Index::parse(&bytes, INDEX_FILE)?.metadata.saver_save_id,
    ))
}

fn missing_shards(storage: &dyn Storage, save_id: &str, shard_num: u32) -> Result<Vec<u32>> {
    let names: std::collections::HashSet<String> = storage.list()?.into_iter().collect();
    Ok((0..shard_num)
        .filter(|&s| !names.contains(&shard_manifest_name(save_id, s)))
        .collect())
}

/// Reads and parses shard `shard`'s manifest of `save_id`.
pub(crate) fn read_shard_manifest(
    storage: &dyn Storage,
    save_id: &str,
    shard: u32,
) -> Result<ShardManifest> {
    let name = shard_manifest_name(save_id, shard);
    let bytes = storage.get(&name, MAX_JSON_BYTES)?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
        file: name,
        what: format!("not a shard manifest: {e}"),
    })
}

/// Commits `save_id` if all its shards are present and nobody else is committing it.
pub fn try_commit(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    durable: bool,
) -> Result<CommitState> {
    if committed_save_id(storage)?.as_deref() == Some(save_id) {
        return Ok(CommitState::Committed);
    }
    let missing = missing_shards(storage, save_id, shard_num)?;
    if !missing.is_empty() {
        return Ok(CommitState::Missing(missing));
    }
    let claim = commit_claim_name(save_id);
    let who = format!("pid {}\n", std::process::id());
    if !storage.create_exclusive(&claim, who.as_bytes())? {
        return Ok(if committed_save_id(storage)?.as_deref() == Some(save_id) {
            CommitState::Committed
        } else {
            CommitState::Claimed
        });
    }
    let result = (|| {
        let shards = (0..shard_num)
            .map(|s| read_shard_manifest(storage, save_id, s))
            .collect::<Result<Vec<_>>>()?;
        let manifest = Manifest::merge(shards)?;
        let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
        storage.put(&manifest_name(save_id), &json, durable)?;
        // Compact on purpose: with no insignificant whitespace, every byte of the index carries
        // meaning, so any change to it is detected (the index has no checksum of its own).
        let index = serde_json::to_vec(&Index::for_manifest(&manifest, crc32fast::hash(&json)))
            .expect("indexes serialize");
        storage.put(INDEX_FILE, &index, durable)?;
        collect_garbage(storage, save_id);
        Ok(())
    })();
    if result.is_err() {
        // Give a retry the chance to claim again; the index was not written.
        let _ = storage.remove(&claim);
    }
    result.map(|()| CommitState::CommittedHere)
}

/// Whether `name` is a file saver writes (data, manifests, claims, temporaries).
pub(crate) fn is_saver_file(name: &str) -> bool {
    (name.starts_with("model-")
        && (name.ends_with(".safetensors") || name.contains(".safetensors.tmp-")))
        || name.starts_with("saver-")
        || name.starts_with("model.safetensors.index.json.tmp-")
}

/// Whether `name` belongs to save `save_id`.
fn belongs_to(name: &str, save_id: &str) -> bool {
    name.strip_prefix("model-")
        .or_else(|| name.strip_prefix("saver-"))
        .and_then(|rest| rest.strip_prefix(save_id))
        .is_some_and(|rest| rest.starts_with(['-', '.']))
}

/// Removes every saver file that does not belong to the committed save. Best effort: a file that
/// cannot be removed is left for the next save, never merged (names carry the save id).
fn collect_garbage(storage: &dyn Storage, committed: &str) {
    let Ok(names) = storage.list() else { return };
    for name in names {
        if is_saver_file(&name) && !belongs_to(&name, committed) {
            let _ = storage.remove(&name);
        }
    }
}

/// Removes leftovers of an earlier attempt of the same save for the given shards (temporary files
/// and stale shard manifests), so they can never be mistaken for this attempt's.
pub(crate) fn clear_own_leftovers(
    storage: &dyn Storage,
    save_id: &str,
    shards: &[u32],
    all_shards: bool,
) -> Result<()> {
    for name in storage.list()? {
        if !belongs_to(&name, save_id) {
            continue;
        }
        let is_tmp = name.contains(crate::storage::local_tmp_mark());
        let mine = all_shards
            || shards.iter().any(|&s| {
                name.starts_with(&format!("model-{save_id}-s{s:05}-"))
                    || name == shard_manifest_name(save_id, s)
            });
        let claim = name == commit_claim_name(save_id);
        if (mine && (is_tmp || name.ends_with(".shard.json"))) || (all_shards && claim) {
            storage.remove(&name)?;
        }
    }
    Ok(())
}

/// Waits until `save_id` is committed, committing it if this process completes the set.
pub fn wait_for_commit(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    durable: bool,
    timeout: Duration,
) -> Result<CommitState> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let state = try_commit(storage, save_id, shard_num, durable)?;
        if matches!(state, CommitState::Committed | CommitState::CommittedHere) {
            return Ok(state);
        }
        if start.elapsed() >= timeout {
            return Err(match state {
                CommitState::Missing(missing) => Error::Timeout {
                    save_id: save_id.to_string(),
                    missing,
                    waited: start.elapsed(),
                },
                // Every shard is there, but the process that claimed the commit never finished it.
                _ => Error::Incomplete {
                    dir: storage.location().into(),
                    what: format!(
                        "all shards of save {save_id} are written, but the process that claimed the commit \
                         ({}) did not finish within {:?}; if it died, remove that file and save again, \
                         or save under a new save id",
                        commit_claim_name(save_id),
                        start.elapsed()
                    ),
                },
            });
        }
        thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_of_names() {
        assert!(belongs_to("model-abc-s00001-f0000.safetensors", "abc"));
        assert!(belongs_to("saver-abc.manifest.json", "abc"));
        assert!(belongs_to("saver-abc-s00000.shard.json", "abc"));
        assert!(!belongs_to("saver-abcd.manifest.json", "abc"));
        assert!(!belongs_to("model-ab-s00001-f0000.safetensors", "abc"));
        assert!(is_saver_file("model-x-s00000-f0000.safetensors.tmp-12-3"));
        assert!(!is_saver_file("notes.txt"));
        assert!(!is_saver_file("model.safetensors"));
    }
}

//! A commit that came too late: its commit lock's lease ran out between the commit's last check
//! and its index (the process was paused, or cut off from the store), so another process may
//! have taken the lock and committed meanwhile. The index it wrote is taken back, under the lock
//! taken again: the directory's index becomes what it would have been without the late write
//! (the checkpoint it replaced, or a save committed over that one meanwhile), and the late save
//! fails, naming what the directory holds. It never removes the checkpoint it replaced.

use saver_core::manifest::CheckpointRef;
use saver_core::naming::{manifest_name, rejected_name, SaverFile, INDEX_FILE};
use saver_core::{Index, Manifest};

use crate::error::{Error, Result};
use crate::load::documents::{committed, get_if_exists, MAX_JSON_BYTES};
use crate::save::owned::mark_rejected;
use crate::storage::{Storage, COMMIT_LOCK_WAIT};

/// Takes back the index `save_id` wrote over `replaced` after its lock was lost (`lost`, the
/// error that showed it), and returns the save's error: rejected, naming what the directory now
/// holds, and whether taking back failed (the late index then still stands, and its files too).
pub(crate) fn put_back(
    storage: &dyn Storage,
    save_id: &str,
    replaced: &Option<CheckpointRef>,
    lost: Error,
) -> Error {
    let undone = take_back(storage, save_id, replaced);
    let now = match committed(storage) {
        Ok(Some(c)) => format!("save {c}"),
        Ok(None) => "no checkpoint".into(),
        Err(e) => format!("an index that does not read ({e})"),
    };
    match undone {
        Ok(()) => {
            let why = format!(
                "{lost}; its commit came after that and was taken back, since another process \
                 may have committed meanwhile: the directory holds {now}"
            );
            mark_rejected(storage, save_id, &why).unwrap_or_else(|e| e)
        }
        Err(e) => Error::Rejected {
            dir: storage.location().into(),
            save_id: save_id.to_string(),
            why: format!(
                "{lost}; its commit came after that, and taking it back failed ({e}): the \
                 directory holds {now}"
            ),
        },
    }
}

fn take_back(storage: &dyn Storage, save_id: &str, replaced: &Option<CheckpointRef>) -> Result<()> {
    let lock = storage.lock_commit(COMMIT_LOCK_WAIT)?;
    let Some(index_now) = get_if_exists(storage, INDEX_FILE, MAX_JSON_BYTES)? else {
        return Ok(());
    };
    if Index::parse(&index_now, INDEX_FILE)?.committed().save_id != save_id {
        // Committed over since: that commit saw the late one and stands.
        return Ok(());
    }
    let hidden = hidden(storage, save_id, replaced.clone())?;
    lock.check_held()?;
    match hidden {
        None => storage.remove(INDEX_FILE),
        // Only over the late index itself, so that a commit made since stands.
        Some((manifest, crc)) => {
            let index = serde_json::to_vec(&Index::for_manifest(&manifest, crc))
                .expect("indexes serialize");
            storage
                .put_if_unchanged(INDEX_FILE, &index, Some(&index_now), true)
                .map(|_| ())
        }
    }
}

/// What the late index hid: the checkpoint it replaced, or the last of the saves committed over
/// that one meanwhile (each manifest names the checkpoint its save replaced), with its manifest
/// and the manifest's CRC32. `None` where the directory held no checkpoint. A manifest is
/// written only once its save passed every check of its commit, so one whose process died
/// before its index is taken for committed here: the index then names a whole checkpoint that
/// its process never reported.
fn hidden(
    storage: &dyn Storage,
    late: &str,
    replaced: Option<CheckpointRef>,
) -> Result<Option<(Manifest, u32)>> {
    let names = storage.list()?;
    let mut manifests = Vec::new();
    for name in &names {
        let Some(SaverFile::Save { save_id }) = SaverFile::parse(name) else {
            continue;
        };
        // A rejected save's manifest (written before its compare-and-swap failed) was never
        // committed.
        if save_id == late
            || *name != manifest_name(save_id)
            || names.contains(&rejected_name(save_id))
        {
            continue;
        }
        // A manifest that does not read is no checkpoint's: it cannot have been committed.
        let Some(bytes) = get_if_exists(storage, name, MAX_JSON_BYTES)? else {
            continue;
        };
        if let Ok(m) = Manifest::parse(&bytes, name) {
            manifests.push((m, crc32fast::hash(&bytes)));
        }
    }
    let mut at = replaced;
    // Each step follows one manifest, and none twice: a cycle of edited manifests ends it.
    for _ in 0..manifests.len() {
        let next = manifests
            .iter()
            .find(|(m, _)| m.replaces == at && at.as_ref().is_none_or(|a| a.save_id != m.save_id));
        let Some((m, crc)) = next else { break };
        at = Some(CheckpointRef {
            save_id: m.save_id.clone(),
            manifest_crc32: *crc,
        });
    }
    let Some(at) = at else { return Ok(None) };
    match manifests
        .into_iter()
        .find(|(m, crc)| m.save_id == at.save_id && *crc == at.manifest_crc32)
    {
        Some(found) => Ok(Some(found)),
        None => Err(Error::Incomplete {
            dir: storage.location().into(),
            what: format!(
                "the checkpoint the late commit replaced, save {}, has no manifest of CRC32 {:08x}",
                at.save_id, at.manifest_crc32
            ),
        }),
    }
}

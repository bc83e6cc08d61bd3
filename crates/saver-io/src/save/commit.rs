//! Committing a checkpoint: writer claims, the commit lock, the compare-and-swap of the index, and
//! removing exactly what the commit replaced.
//!
//! Protocol (see `docs/FORMAT.md`, "Commit protocol"):
//!
//! 1. Before writing anything, the writer of shard `s` of save `X` creates the claim
//!    `saver-X-s<s>.writer.json` exclusively. A second writer of that shard finds it, marks `X`
//!    rejected (`saver-X.rejected`, under the commit lock) and fails, naming both writers: a save
//!    whose shard had two writers never commits.
//! 2. Each shard writes its data files (temporary name, fsync, rename), then its shard manifest,
//!    which records the writer, the checkpoint committed when the writer started (`replaces`),
//!    and the replicated state (tables, dense tensors with a checksum of their content, step,
//!    user metadata).
//! 3. A process that finds all shard manifests takes the directory's commit lock, and under it:
//!    checks that the shards belong to one save (claims, replicated state, dense tensors written
//!    once) and that the committed checkpoint is still one its shards saw (a compare-and-swap);
//!    then writes the global manifest and the index. The index's rename is the commit point.
//!    Anything that fails those checks marks the save rejected, with the reason.
//! 4. After the commit, the files of the checkpoint it replaced, as its manifest lists them, are
//!    removed; nothing else is.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use saver_core::manifest::CheckpointRef;
use saver_core::naming::{
    legacy_commit_claim_name, manifest_name, shard_manifest_name, writer_claim_name, SaverFile,
    INDEX_FILE,
};
use saver_core::{Index, Manifest};

use crate::error::{Error, Result};
use crate::load::documents::{committed, get_if_exists, read_shard_manifest, MAX_JSON_BYTES};
use crate::save::late;
use crate::save::owned::{check_not_rejected, is_committed, mark_rejected, read_claim};
use crate::storage::at_once::{all_at_once, calls_at_once};
use crate::storage::{CommitLock, Storage, COMMIT_LOCK_WAIT};

/// What a commit attempt found.
#[derive(Debug, PartialEq, Eq)]
pub enum CommitState {
    /// This call wrote the index.
    CommittedHere,
    /// The save is committed (by another process, or earlier).
    Committed,
    /// Shards are still missing.
    Missing(Vec<u32>),
}

fn missing_shards(storage: &dyn Storage, save_id: &str, shard_num: u32) -> Result<Vec<u32>> {
    let names: HashSet<String> = storage.list()?.into_iter().collect();
    Ok((0..shard_num)
        .filter(|&s| !names.contains(&shard_manifest_name(save_id, s)))
        .collect())
}

/// A rule beyond the directory's own that a save must pass at its commit, checked under a lock of
/// the rule's that is taken before the directory's commit lock and held until the index is
/// written: how a checkpoint manager keeps its rules (a root's steps only grow, a delta's parent
/// is still the save it was made from) at the commit itself, not only when the save starts.
pub trait CommitRule: Send + Sync {
    /// Takes the rule's lock (every save the rule relates must take the same one).
    fn lock(&self) -> Result<Box<dyn CommitLock>>;
    /// Why the save whose manifest is `manifest` may not commit now, or `None` if it may.
    fn refusal(&self, manifest: &Manifest) -> Result<Option<String>>;
}

/// Commits `save_id` if all its shards are present; see the module docs for the checks.
pub fn try_commit(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    durable: bool,
) -> Result<CommitState> {
    commit_under(storage, save_id, shard_num, durable, None)
}

/// [`try_commit`], refused unless `rule` (if any) lets the save commit.
pub(crate) fn commit_under(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    durable: bool,
    rule: Option<&dyn CommitRule>,
) -> Result<CommitState> {
    if is_committed(storage, save_id)? {
        return Ok(CommitState::Committed);
    }
    check_not_rejected(storage, save_id)?;
    let missing = missing_shards(storage, save_id, shard_num)?;
    if !missing.is_empty() {
        return Ok(CommitState::Missing(missing));
    }
    stop_point("ready");
    // The rule's lock first, always: a rule's lock is never taken under a directory's.
    let rule_lock = rule.map(CommitRule::lock).transpose()?;
    let lock = storage.lock_commit(COMMIT_LOCK_WAIT)?;
    stop_point("locked");
    // Another process of this save may have committed it since the check above (under the lock
    // before ours, or, on an object store without conditional writes, with no lock at all): that
    // is this save's commit, not a rival's.
    let index_now = get_if_exists(storage, INDEX_FILE, MAX_JSON_BYTES)?;
    let current = index_now
        .as_deref()
        .map(|bytes| Index::parse(bytes, INDEX_FILE).map(|i| i.committed()))
        .transpose()?;
    if current.as_ref().is_some_and(|c| c.save_id == save_id) {
        return Ok(CommitState::Committed);
    }
    check_not_rejected(storage, save_id)?;
    let mut manifest = match check_shards(storage, save_id, shard_num, &current)? {
        Ok(m) => m,
        Err(why) => return Err(mark_rejected(storage, save_id, &why)?),
    };
    if let Some(why) = rule.map(|r| r.refusal(&manifest)).transpose()?.flatten() {
        return Err(mark_rejected(storage, save_id, &why)?);
    }
    manifest.replaces = current.clone();
    let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
    storage.put(&manifest_name(save_id), &json, durable)?;
    // Compact on purpose: with no insignificant whitespace, every byte of the index carries
    // meaning, so any change to it is detected (the index has no checksum of its own).
    let index = serde_json::to_vec(&Index::for_manifest(&manifest, crc32fast::hash(&json)))
        .expect("indexes serialize");
    let locks = [rule_lock.as_deref(), Some(&*lock)];
    let index_now = index_now.as_deref();
    if let Some(lost) = write_index(storage, save_id, &index, index_now, &locks, durable)? {
        // Its own locks go first: taking the index back takes the directory's lock anew.
        drop(lock);
        drop(rule_lock);
        return Err(late::put_back(storage, save_id, &current, lost));
    }
    drop(lock);
    drop(rule_lock);
    if let Some(old) = current {
        remove_replaced(storage, &old);
    }
    Ok(CommitState::CommittedHere)
}

/// Writes `index` (of `save_id`), fenced: only while `locks` are still this process's, as a
/// compare-and-swap of `index_now` (the index read under them); and checked again once written,
/// since a holder paused between the check and the write may have lost them meanwhile. `Some`
/// (the error that shows it) when the index was written after the locks may have been taken
/// by another process: the caller takes it back ([`late::put_back`]).
fn write_index(
    storage: &dyn Storage,
    save_id: &str,
    index: &[u8],
    index_now: Option<&[u8]>,
    locks: &[Option<&dyn CommitLock>],
    durable: bool,
) -> Result<Option<Error>> {
    stop_point("checked");
    let held_for = still_held(locks).map_err(|e| match e {
        Error::LockLost { lock, why } => Error::LockLost {
            lock,
            why: format!("{why}; save {save_id} was not committed"),
        },
        e => e,
    })?;
    let fenced = Instant::now();
    stop_point("fenced");
    let swapped = storage.put_if_unchanged(INDEX_FILE, index, index_now, durable)?;
    let landed = fenced.elapsed();
    if !swapped {
        let now = committed(storage)?.map_or("none".into(), |c| format!("save {c}"));
        let why = format!(
            "another save committed first: the directory now holds {now} (this save's commit \
             lock ran out before its commit)"
        );
        return Err(mark_rejected(storage, save_id, &why)?);
    }
    stop_point("indexed");
    // Written before the locks could run out: it stands, whatever happens to them from here
    // (who takes them next sees this commit). Otherwise it may have come after another process
    // took them.
    if landed < held_for {
        return Ok(None);
    }
    Ok(still_held(locks).err())
}

/// How long from now all of `locks` are surely still held; fails if any may have been taken by
/// another process since it was taken.
fn still_held(locks: &[Option<&dyn CommitLock>]) -> Result<Duration> {
    locks
        .iter()
        .flatten()
        .try_fold(Duration::MAX, |held, l| Ok(held.min(l.check_held()?)))
}

/// Stops this process (SIGSTOP) at the commit's step `step` if `SAVER_STOP_AT` names it
/// (`commit:ready`, before its locks; `commit:locked`, `commit:checked`, `commit:fenced`,
/// `commit:indexed`): how the tests pause a committer before its locks and past its lock's lease
/// at every step of its commit, as a frozen machine would.
fn stop_point(step: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let at = AT.get_or_init(|| std::env::var("SAVER_STOP_AT").ok());
    if at.as_deref().and_then(|a| a.strip_prefix("commit:")) == Some(step) {
        // SAFETY: raise has no preconditions; the process goes on when it is continued.
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}

/// Reads every shard manifest of `save_id` and checks they make one save that may replace
/// `current`. `Ok(Err(why))` when they do not: the save can never commit.
fn check_shards(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    current: &Option<CheckpointRef>,
) -> Result<std::result::Result<Manifest, String>> {
    // Read several at once on an object store (two round trips a shard), checked in shard order
    // after, so that the error reported is the first shard's whatever the order of the answers.
    let read = all_at_once((0..shard_num).collect(), calls_at_once(storage), |s| {
        (
            read_shard_manifest(storage, save_id, s),
            read_claim(storage, save_id, s),
        )
    });
    let mut shards = Vec::with_capacity(shard_num as usize);
    for (s, (m, claim)) in (0..shard_num).zip(read) {
        let m = m?;
        let claim = match claim {
            Ok(c) => c,
            Err(e) => return Ok(Err(format!("shard {s} has no readable writer claim: {e}"))),
        };
        if m.writer.as_ref() != Some(&claim) {
            let wrote = m
                .writer
                .as_ref()
                .map_or("an unknown writer".into(), |w| w.to_string());
            return Ok(Err(format!(
                "shard {s} has two writers: it was claimed by {claim} but written by {wrote}"
            )));
        }
        shards.push(m);
    }
    let seen: Vec<Option<CheckpointRef>> = shards.iter().map(|s| s.replaces.clone()).collect();
    if !seen.contains(current) {
        let saw = seen[0]
            .as_ref()
            .map_or("no checkpoint".into(), |c| format!("save {c}"));
        let now = current
            .as_ref()
            .map_or("none".into(), |c| format!("save {c}"));
        return Ok(Err(format!(
            "another save committed first: the directory now holds {now}, and this save's writers \
             saw {saw} when they started; a save replaces only the checkpoint it saw"
        )));
    }
    Ok(Manifest::merge(shards).map_err(|e| e.to_string()))
}

/// Removes the files of checkpoint `old`, which a commit just replaced: the data files its
/// manifest lists (only names carrying its save id, so an edited manifest cannot make a commit
/// delete anything else), its shard manifests, manifest and writer claims. Only if its manifest
/// is still the one its index named. Best effort: what is not removed stays, never referenced.
fn remove_replaced(storage: &dyn Storage, old: &CheckpointRef) {
    let name = manifest_name(&old.save_id);
    let Ok(bytes) = storage.get(&name, MAX_JSON_BYTES) else {
        return;
    };
    if crc32fast::hash(&bytes) != old.manifest_crc32 {
        return;
    }
    let Ok(m) = Manifest::parse(&bytes, &name) else {
        return;
    };
    // Each group several at once on an object store, and the groups in this order.
    let remove_all = |names: Vec<String>| {
        all_at_once(names, calls_at_once(storage), |n| storage.remove(&n));
    };
    remove_all(
        m.files
            .iter()
            .filter(|f| SaverFile::parse(&f.name).is_some_and(|p| p.save_id() == old.save_id))
            .map(|f| f.name.clone())
            .collect(),
    );
    remove_all(
        (0..m.shard_num)
            .map(|s| shard_manifest_name(&old.save_id, s))
            .collect(),
    );
    let _ = storage.remove(&legacy_commit_claim_name(&old.save_id));
    let _ = storage.remove(&name);
    // The claims go last: while they exist, no new save can take the old id, so nothing of a new
    // save can be taken for the old checkpoint's files above.
    remove_all(
        (0..m.shard_num)
            .map(|s| writer_claim_name(&old.save_id, s))
            .collect(),
    );
}

/// Files in `storage` that belong to no part of the committed save `save_id`: other saves' files
/// (in progress, or left by a save that failed or crashed) and files that are not saver's. The
/// index and the commit lock are not listed.
pub(crate) fn files_left_alone(storage: &dyn Storage, save_id: &str) -> Result<Vec<String>> {
    Ok(storage
        .list()?
        .into_iter()
        .filter(|n| n != INDEX_FILE && !saver_core::naming::is_commit_lock(n))
        .filter(|n| SaverFile::parse(n).is_none_or(|f| f.save_id() != save_id))
        .collect())
}

/// Waits until `save_id` is committed, committing it (under `rule`) if this process completes
/// the set.
pub(crate) fn wait_for_commit(
    storage: &dyn Storage,
    save_id: &str,
    shard_num: u32,
    durable: bool,
    timeout: Duration,
    rule: Option<&dyn CommitRule>,
) -> Result<CommitState> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let state = commit_under(storage, save_id, shard_num, durable, rule)?;
        let CommitState::Missing(missing) = state else {
            return Ok(state);
        };
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                save_id: save_id.to_string(),
                missing,
                waited: start.elapsed(),
            });
        }
        std::thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

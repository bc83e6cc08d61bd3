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

use saver_core::manifest::{CheckpointRef, WriterInfo};
use saver_core::naming::{
    legacy_commit_claim_name, manifest_name, rejected_name, shard_manifest_name, writer_claim_name,
    SaverFile, INDEX_FILE,
};
use saver_core::{Index, Manifest};

use crate::error::{Error, Result};
use crate::load::documents::{committed, parse_json, read_shard_manifest, MAX_JSON_BYTES};
use crate::storage::at_once::{all_at_once, calls_at_once};
use crate::storage::{CommitLock, Storage};

/// Largest writer claim or rejection marker read.
const MAX_MARKER_BYTES: u64 = 64 << 10;

/// How long a commit waits for another process's commit into the same directory to finish. The
/// lock is held only to check the shards and write the manifest and index.
pub const COMMIT_LOCK_WAIT: Duration = Duration::from_secs(60);

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

fn is_committed(storage: &dyn Storage, save_id: &str) -> Result<bool> {
    Ok(committed(storage)?.is_some_and(|c| c.save_id == save_id))
}

fn missing_shards(storage: &dyn Storage, save_id: &str, shard_num: u32) -> Result<Vec<u32>> {
    let names: HashSet<String> = storage.list()?.into_iter().collect();
    Ok((0..shard_num)
        .filter(|&s| !names.contains(&shard_manifest_name(save_id, s)))
        .collect())
}

fn read_claim(storage: &dyn Storage, save_id: &str, shard: u32) -> Result<WriterInfo> {
    let name = writer_claim_name(save_id, shard);
    parse_json(
        &storage.get(&name, MAX_MARKER_BYTES)?,
        &name,
        "a writer claim",
    )
}

fn rejected(storage: &dyn Storage, save_id: &str, why: String) -> Error {
    Error::Rejected {
        dir: storage.location().into(),
        save_id: save_id.to_string(),
        why,
    }
}

/// Fails if `save_id` was marked rejected, with the reason recorded.
pub(crate) fn check_not_rejected(storage: &dyn Storage, save_id: &str) -> Result<()> {
    let name = rejected_name(save_id);
    if !storage.exists(&name)? {
        return Ok(());
    }
    let why = storage.get(&name, MAX_MARKER_BYTES)?;
    Err(rejected(
        storage,
        save_id,
        String::from_utf8_lossy(&why).into_owned(),
    ))
}

/// Marks `save_id` rejected for `why` (the first reason recorded stays), unless it is committed.
/// Call with the commit lock held, so a commit cannot slip in between the check and the mark.
fn mark_rejected(storage: &dyn Storage, save_id: &str, why: &str) -> Result<Error> {
    if is_committed(storage, save_id)? {
        return Ok(rejected(
            storage,
            save_id,
            format!("it is already committed; {why}"),
        ));
    }
    storage.create_exclusive(&rejected_name(save_id), why.as_bytes())?;
    Ok(match check_not_rejected(storage, save_id) {
        Err(e) => e,
        Ok(()) => rejected(storage, save_id, why.to_string()),
    })
}

/// What a writer claim holds: the writer, and where this host can tell that it has ended (its
/// pid namespace and start time), so that the leftovers of a crashed save can be reclaimed once
/// its writers are provably gone (`CheckpointManager::clean`). Read as a [`WriterInfo`], the
/// extra fields are ignored.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct ClaimRecord {
    #[serde(flatten)]
    pub writer: WriterInfo,
    /// The writer's pid namespace ([`crate::storage::identity::pid_namespace`]).
    #[serde(default)]
    pub namespace: Option<String>,
    /// When the writer's process started ([`crate::storage::identity::process_start`]).
    #[serde(default)]
    pub process_start: Option<u64>,
}

impl ClaimRecord {
    fn of(writer: &WriterInfo) -> Self {
        Self {
            writer: writer.clone(),
            namespace: crate::storage::identity::pid_namespace().map(str::to_string),
            process_start: crate::storage::identity::process_start(writer.pid),
        }
    }

    /// Whether the writer is known to have ended: only a process of this pid namespace can be.
    pub fn writer_has_ended(&self) -> bool {
        match (&self.namespace, self.process_start) {
            (Some(ns), Some(start)) => {
                crate::storage::identity::has_ended(ns, self.writer.pid, start)
            }
            _ => false,
        }
    }
}

/// Claims shard `shard` of `save_id` for `writer`, before any of its files is written. If another
/// writer claimed it first, the save is marked rejected (so that neither writer's shard is ever
/// committed with the other shards) and the error names both writers.
pub(crate) fn claim_shard(
    storage: &dyn Storage,
    save_id: &str,
    shard: u32,
    writer: &WriterInfo,
) -> Result<()> {
    let name = writer_claim_name(save_id, shard);
    let json = serde_json::to_vec(&ClaimRecord::of(writer)).expect("claims serialize");
    if storage.create_exclusive(&name, &json)? {
        return Ok(());
    }
    let first = match read_claim(storage, save_id, shard) {
        Ok(w) => w.to_string(),
        Err(e) => format!("an unreadable claim ({e})"),
    };
    let why = format!(
        "shard {shard} has two writers: {first} claimed it first, then {writer}; a save id names \
         one save, so give every save (and every retry of one) a new save id"
    );
    let _lock = storage.lock_commit(COMMIT_LOCK_WAIT)?;
    Err(mark_rejected(storage, save_id, &why)?)
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
    // The rule's lock first, always: a rule's lock is never taken under a directory's.
    let rule_lock = rule.map(CommitRule::lock).transpose()?;
    let lock = storage.lock_commit(COMMIT_LOCK_WAIT)?;
    // Another process of this save may have committed it since the check above (under the lock
    // before ours, or, on an object store without conditional writes, with no lock at all): that
    // is this save's commit, not a rival's.
    let current = committed(storage)?;
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
    storage.put(INDEX_FILE, &index, durable)?;
    drop(lock);
    drop(rule_lock);
    if let Some(old) = current {
        remove_replaced(storage, &old);
    }
    Ok(CommitState::CommittedHere)
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

/// What of a save to remove when it fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leftovers {
    /// Data files and shard manifests: the shards were written, but will never be committed.
    Shards,
    /// Also the writer claims: the shards were never finished, so their ids may be used again.
    ShardsAndClaims,
    /// Everything the save wrote (a single-process save owns all of it): the claims, the
    /// rejection marker and the global manifest too.
    Everything,
}

/// Removes this save's files of `shards` after a failure, as `what` says. Never touches a
/// committed save, nor another save's files, nor files of shards it was not given.
pub(crate) fn remove_own(storage: &dyn Storage, save_id: &str, shards: &[u32], what: Leftovers) {
    if is_committed(storage, save_id).unwrap_or(true) {
        return;
    }
    let Ok(names) = storage.list() else { return };
    let mut claims = Vec::new();
    for name in &names {
        let ours = match SaverFile::parse(name) {
            Some(SaverFile::Data { save_id: id, shard }) => {
                id == save_id && shards.contains(&shard)
            }
            Some(SaverFile::Shard { save_id: id, shard }) if id == save_id => {
                if shards.contains(&shard) && name.contains(".writer.json") {
                    if what != Leftovers::Shards {
                        claims.push(name);
                    }
                    false
                } else {
                    shards.contains(&shard)
                }
            }
            Some(SaverFile::Save { save_id: id }) => id == save_id && what == Leftovers::Everything,
            _ => false,
        };
        if ours {
            let _ = storage.remove(name);
        }
    }
    for name in claims {
        let _ = storage.remove(name);
    }
}

/// The saves that have files among `names`, with the shards those files name.
pub(crate) fn saves_in(names: &[String]) -> std::collections::BTreeMap<&str, Vec<u32>> {
    let mut saves: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for n in names {
        match SaverFile::parse(n) {
            Some(SaverFile::Data { save_id, shard } | SaverFile::Shard { save_id, shard }) => {
                saves.entry(save_id).or_default().push(shard);
            }
            Some(SaverFile::Save { save_id }) => {
                saves.entry(save_id).or_default();
            }
            None => {}
        }
    }
    for shards in saves.values_mut() {
        shards.sort_unstable();
        shards.dedup();
    }
    saves
}

/// Whether every writer of save `save_id` (whose files among `names` name `shards`) has
/// provably ended, as its writer claims record it: `Ok(())`, or why it may still be running.
pub(crate) fn writers_have_ended(
    storage: &dyn Storage,
    names: &[String],
    save_id: &str,
    shards: &[u32],
) -> Result<std::result::Result<(), String>> {
    let mut claims = 0;
    for &s in shards {
        let name = writer_claim_name(save_id, s);
        if !names.contains(&name) {
            continue;
        }
        let bytes = storage.get(&name, MAX_MARKER_BYTES)?;
        match serde_json::from_slice::<ClaimRecord>(&bytes) {
            Ok(c) if c.writer_has_ended() => claims += 1,
            Ok(c) => {
                return Ok(Err(format!(
                    "save {save_id}: its writer {} may still be running (it is not a process \
                     of this host that has ended)",
                    c.writer
                )))
            }
            Err(_) => return Ok(Err(format!("save {save_id}: claim {name} is unreadable"))),
        }
    }
    if claims == 0 {
        return Ok(Err(format!(
            "save {save_id}: no writer claim tells who writes it"
        )));
    }
    Ok(Ok(()))
}

/// A save's leftovers: its id, the shards its files name, and those files.
pub(crate) type Leftover = (String, Vec<u32>, Vec<String>);

/// The saves in `storage` other than `keep` and the committed one whose writers have all
/// provably ended (what killed or crashed saves left), with their files.
pub(crate) fn ended_saves(storage: &dyn Storage, keep: &str) -> Result<Vec<Leftover>> {
    let names = storage.list()?;
    let committed = committed(storage)?.map(|c| c.save_id);
    let mut ended = Vec::new();
    for (save_id, shards) in saves_in(&names) {
        if save_id == keep || committed.as_deref() == Some(save_id) {
            continue;
        }
        if writers_have_ended(storage, &names, save_id, &shards)?.is_err() {
            continue;
        }
        let files = names
            .iter()
            .filter(|n| SaverFile::parse(n).is_some_and(|f| f.save_id() == save_id))
            .cloned()
            .collect();
        ended.push((save_id.to_string(), shards, files));
    }
    Ok(ended)
}

/// Removes the files of [`ended_saves`] (claims last: see [`remove_own`]); returns the names
/// removed. The files of a save that may still run, and files that are not saver's, stay.
pub(crate) fn reclaim_ended_saves(storage: &dyn Storage, keep: &str) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for (save_id, shards, files) in ended_saves(storage, keep)? {
        remove_own(storage, &save_id, &shards, Leftovers::Everything);
        let left = storage.list()?;
        removed.extend(files.into_iter().filter(|n| !left.contains(n)));
    }
    Ok(removed)
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

//! What a save owns in a directory, and how it comes to own it: the writer claims of its shards,
//! created before anything of them is written; its rejection marker; its leftovers after a
//! failure, and those of saves whose writers have provably ended.
//!
//! A writer claim `saver-X-s<s>.writer.json`, created exclusively, makes its writer the one owner
//! of shard `s` of save `X` (see `commit` for the rest of the protocol): a second writer of that
//! shard marks `X` rejected and fails.
//!
//! The rejection marker `saver-X.rejected`: a save that can never commit (two writers of one
//! shard, shards that do not make one save, a rule that refused it), with the first reason
//! recorded. Written under the commit lock, read by every later step of that save.

use saver_core::manifest::WriterInfo;
use saver_core::naming::{rejected_name, writer_claim_name, SaverFile};

use crate::error::{Error, Result};
use crate::load::documents::{committed, parse_json};
use crate::storage::at_once::{calls_at_once, each_at_once};
use crate::storage::Storage;
use crate::storage::COMMIT_LOCK_WAIT;

/// Largest writer claim read.
pub(crate) const MAX_CLAIM_BYTES: u64 = 64 << 10;

/// The writer that claimed shard `shard` of `save_id`.
pub(crate) fn read_claim(storage: &dyn Storage, save_id: &str, shard: u32) -> Result<WriterInfo> {
    let name = writer_claim_name(save_id, shard);
    parse_json(
        &storage.get(&name, MAX_CLAIM_BYTES)?,
        &name,
        "a writer claim",
    )
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
    pub(crate) fn writer_has_ended(&self) -> bool {
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

/// Claims `shards` of `save_id` for `writer`, several at once on an object store (a round trip
/// each). The first refusal stops the claims after its batch, and those this call made are
/// taken back.
pub(crate) fn claim_shards(
    storage: &dyn Storage,
    save_id: &str,
    shards: &[u32],
    writer: &WriterInfo,
) -> Result<()> {
    let claimed = each_at_once(
        shards.to_vec(),
        calls_at_once(storage),
        |s| (s, claim_shard(storage, save_id, s, writer)),
        |(_, r)| r.is_ok(),
    );
    if claimed.iter().any(|(_, r)| r.is_err()) {
        let made: Vec<u32> = claimed
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|&(s, _)| s)
            .collect();
        remove_own(storage, save_id, &made, Leftovers::ShardsAndClaims);
        if let Some(Err(e)) = claimed.into_iter().map(|(_, r)| r).find(Result::is_err) {
            return Err(e);
        }
    }
    Ok(())
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
        let bytes = storage.get(&name, MAX_CLAIM_BYTES)?;
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

/// Largest rejection marker read.
const MAX_MARKER_BYTES: u64 = 64 << 10;

/// Whether `save_id` is the committed save of `storage`.
pub(crate) fn is_committed(storage: &dyn Storage, save_id: &str) -> Result<bool> {
    Ok(committed(storage)?.is_some_and(|c| c.save_id == save_id))
}

/// The error of a rejected save.
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
pub(crate) fn mark_rejected(storage: &dyn Storage, save_id: &str, why: &str) -> Result<Error> {
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

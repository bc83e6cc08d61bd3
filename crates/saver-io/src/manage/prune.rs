//! Retention: which committed steps a root keeps, and removing the others so that every step
//! left is whole at every moment of the removal.
//!
//! The kept set is computed from committed, whole steps only ([`Root::list`]): a save under way
//! is not one of them, so it never stands in for the checkpoint it will replace. Every link a
//! kept step's chain needs is kept with it. Steps are removed newest first, so a removed step's
//! parent, if it goes too, goes after it; each removal writes [`PRUNE_MARKER`], then removes the
//! index (from then on the step is not committed, and nothing reads it), then every other file
//! of the save, then the marker and the directory. A removal cut short at any point leaves the
//! remaining steps whole and the step either committed and untouched or uncommitted with its
//! marker, which the next prune or clean finishes. Two prunes of one root at once remove the same
//! files, each tolerating the other's removals.

use std::collections::BTreeSet;

use serde::Serialize;

use saver_core::naming::{SaverFile, INDEX_FILE};

use crate::error::Result;
use crate::manage::policy::Retention;
use crate::manage::root::{Root, StepInfo, PRUNE_MARKER};
use crate::storage::COMMIT_LOCK_WAIT;

/// What [`PRUNE_MARKER`] holds: the step and the saves whose files are being removed.
#[derive(Debug, Serialize, serde::Deserialize)]
pub(crate) struct PruneMarker {
    pub step: u64,
    pub save_ids: Vec<String>,
}

/// What a prune kept and removed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PruneReport {
    /// Steps kept, ascending.
    pub kept: Vec<u64>,
    /// Steps removed (or that would be, with a dry run), newest first.
    pub removed: Vec<u64>,
    /// Bytes of the removed steps' data files.
    pub bytes_removed: u64,
    /// Files removed.
    pub files_removed: usize,
    /// Whether nothing was removed because it was a dry run.
    pub dry_run: bool,
}

/// The steps `rules` keep among the committed, whole `steps` (ascending), with every link their
/// chains need.
pub(crate) fn kept_steps(steps: &[StepInfo], rules: &Retention) -> BTreeSet<u64> {
    let mut kept = BTreeSet::new();
    kept.extend(
        steps
            .iter()
            .rev()
            .take(rules.keep_latest.max(1))
            .map(|s| s.step),
    );
    if let Some(n) = rules.keep_every {
        kept.extend(
            steps
                .iter()
                .filter(|s| s.step.is_multiple_of(n))
                .map(|s| s.step),
        );
    }
    if let Some(secs) = rules.keep_one_per_seconds {
        // The newest step of each period: steps ascend, so the last one seen in a period wins.
        let mut newest: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
        for s in steps.iter().filter(|s| s.started_unix_ms > 0) {
            newest.insert(s.started_unix_ms / 1000 / secs, s.step);
        }
        kept.extend(newest.values());
    }
    kept.extend(
        steps
            .iter()
            .filter(|s| rules.keep_steps.contains(&s.step))
            .map(|s| s.step),
    );
    if let Some(best) = &rules.keep_best {
        let mut scored: Vec<(f64, u64)> = steps
            .iter()
            .filter_map(|s| {
                let v: f64 = s.user_metadata.get(&best.metric)?.parse().ok()?;
                v.is_finite().then_some((v, s.step))
            })
            .collect();
        scored.sort_by(|a, b| {
            let o = a.0.total_cmp(&b.0);
            if best.higher_is_better {
                o.reverse()
            } else {
                o
            }
        });
        kept.extend(scored.iter().take(best.count).map(|s| s.1));
    }
    // Every link of a kept step's chain.
    let by_step: std::collections::BTreeMap<u64, &StepInfo> =
        steps.iter().map(|s| (s.step, s)).collect();
    let mut todo: Vec<u64> = kept.iter().copied().collect();
    while let Some(s) = todo.pop() {
        if let Some(p) = by_step.get(&s).and_then(|i| i.parent) {
            if kept.insert(p) {
                todo.push(p);
            }
        }
    }
    kept
}

/// Applies `rules` to `root`: removes every committed step they do not keep (with `dry_run`,
/// only says which). Steps that are not committed or whose chains are broken are left alone:
/// they are [`crate::manage::CheckpointManager::clean`]'s.
///
/// The decision and the removal of each removed step's index are made under the root's commit
/// lock, which every managed commit takes too: a delta whose parent a prune removes either commits
/// before (and keeps the parent, a link of the newest chain) or fails at its commit naming the
/// parent, never commits over a removed one. The other files go after the lock is released.
pub fn prune(root: &Root, rules: &Retention, dry_run: bool) -> Result<PruneReport> {
    rules.check()?;
    let lock = (!dry_run)
        .then(|| root.storage().lock_commit(COMMIT_LOCK_WAIT))
        .transpose()?;
    let listing = root.list()?;
    let kept = kept_steps(&listing.steps, rules);
    let mut report = PruneReport {
        kept: kept.iter().copied().collect(),
        dry_run,
        ..PruneReport::default()
    };
    let removed: Vec<&StepInfo> = listing
        .steps
        .iter()
        .rev()
        .filter(|s| !kept.contains(&s.step))
        .collect();
    for s in &removed {
        report.removed.push(s.step);
        report.bytes_removed += s.bytes;
        if let Some(lock) = &lock {
            // A pruner paused past its lock's lease decided on a listing that may be old now.
            lock.check_held()?;
            report.files_removed += uncommit_step(root, s.step, &s.save_id)?;
        }
    }
    drop(lock);
    if !dry_run {
        for s in removed {
            report.files_removed += remove_step(root, s.step, std::slice::from_ref(&s.save_id))?;
        }
    }
    Ok(report)
}

/// The first two removals of a step, in the order the module docs give: its marker, then its
/// index if it commits `save_id`. Returns the number of files removed.
fn uncommit_step(root: &Root, step: u64, save_id: &str) -> Result<usize> {
    let storage = root.step_storage(step)?;
    put_marker(&*storage, step, std::slice::from_ref(&save_id.to_string()))?;
    let committed = crate::load::documents::committed(&*storage)?;
    if committed.is_none_or(|c| c.save_id != save_id) {
        return Ok(0);
    }
    storage.remove(INDEX_FILE)?;
    storage.sync_dir()?;
    Ok(1)
}

fn put_marker(storage: &dyn crate::storage::Storage, step: u64, save_ids: &[String]) -> Result<()> {
    let marker = PruneMarker {
        step,
        save_ids: save_ids.to_vec(),
    };
    let json = serde_json::to_vec(&marker).expect("a marker serializes");
    storage.put(PRUNE_MARKER, &json, true)
}

/// Removes the files of the saves `save_ids` from step `step`'s directory in the order the module
/// docs give (the index first, if it commits one of them), and the directory if nothing else is
/// left in it: the files of any other save (one that started meanwhile) stay. Returns the number
/// of files removed.
pub(crate) fn remove_step(root: &Root, step: u64, save_ids: &[String]) -> Result<usize> {
    // Another prune of the root may remove the same files meanwhile (each removal tolerates
    // the other's, but a file can vanish between a listing and its removal, or a temporary
    // before its rename): try again, until the step is gone or the error is not of that kind.
    let mut attempt = 0;
    loop {
        match remove_step_files(root, step, save_ids) {
            Err(_) if is_gone(root, step) => return Ok(0),
            Err(e) if attempt < 4 && e.is_not_found() => {
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_millis(10 << attempt));
            }
            r => return r,
        }
    }
}

/// Whether step `step`'s directory is gone (an object store's: holds nothing).
fn is_gone(root: &Root, step: u64) -> bool {
    let path = root.step_path(step);
    match crate::storage::location_url(&path) {
        None => !path.exists(),
        Some(_) => root
            .step_storage(step)
            .and_then(|s| s.list())
            .is_ok_and(|l| l.is_empty()),
    }
}

fn remove_step_files(root: &Root, step: u64, save_ids: &[String]) -> Result<usize> {
    let storage = root.step_storage(step)?;
    put_marker(&*storage, step, save_ids)?;
    let mut removed = 0;
    let committed = crate::load::documents::committed(&*storage)?;
    if committed.is_some_and(|c| save_ids.contains(&c.save_id)) {
        storage.remove(INDEX_FILE)?;
        storage.sync_dir()?;
        removed += 1;
    }
    for name in storage.list()? {
        let ours = match SaverFile::parse(&name) {
            Some(f) => save_ids.iter().any(|id| id == f.save_id()),
            // A temporary of the marker, left by a removal killed while it wrote the marker.
            None => name.starts_with(PRUNE_MARKER) && name != PRUNE_MARKER,
        };
        if ours {
            storage.remove(&name)?;
            removed += 1;
        }
    }
    storage.sync_dir()?;
    // The marker goes last; the directory too, if nothing else is in it (another save's files
    // are left alone, and keep it).
    storage.remove(PRUNE_MARKER)?;
    let others = storage
        .list()?
        .into_iter()
        .any(|n| !saver_core::naming::is_commit_lock(&n));
    if !others {
        crate::storage::remove_dir_if_empty(&root.step_path(step));
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// Step `step`, started at `secs`, a delta of `parent` if given.
    fn step(step: u64, secs: u64, parent: Option<u64>) -> StepInfo {
        StepInfo {
            step,
            path: PathBuf::from(format!("step-{step}")),
            save_id: format!("s{step}"),
            parent,
            links: 1,
            bytes: 1,
            shards: 1,
            started_unix_ms: secs * 1000,
            writers: Vec::new(),
            user_metadata: Default::default(),
        }
    }

    #[test]
    fn one_per_period_keeps_the_newest_of_each_period_with_its_chain() {
        // Periods of 100 s: [0, 100) holds 1, 2; [100, 200) holds 3 (a delta of 2) and 4; then 5.
        let steps = vec![
            step(1, 10, None),
            step(2, 90, None),
            step(3, 110, Some(2)),
            step(4, 150, None),
            step(5, 250, None),
        ];
        let rules = Retention {
            keep_latest: 1,
            keep_one_per_seconds: Some(100),
            ..Retention::default()
        };
        let kept: Vec<u64> = kept_steps(&steps, &rules).into_iter().collect();
        assert_eq!(kept, vec![2, 4, 5]);
        // A delta that is the newest of its period keeps its parent.
        let steps = vec![step(1, 10, None), step(2, 90, None), step(3, 110, Some(2))];
        let kept: Vec<u64> = kept_steps(&steps, &rules).into_iter().collect();
        assert_eq!(kept, vec![2, 3]);
    }
}

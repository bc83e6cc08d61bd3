//! Reclaiming what crashed saves and cut-short removals left in a root's step directories.
//!
//! A step directory without a committed checkpoint holds a save under way, a crashed save's
//! files, or a removal cut short ([`PRUNE_MARKER`]). Only the last two are reclaimed: a removal's
//! leftovers always, a save's files only once every writer that claimed one of its shards is
//! provably gone (a process of this host's pid namespace that has ended, as the writer's claim
//! records it). A save on another host, or one whose writers cannot be told, is left alone and
//! named in the report.

use serde::Serialize;

use crate::error::Result;
use crate::load::documents::committed;
use crate::manage::prune::{remove_step, PruneMarker};
use crate::manage::root::{Root, PRUNE_MARKER};
use crate::save::owned::{ended_saves, reclaim_ended_saves, saves_in, writers_have_ended};

/// What a clean reclaimed and what it left alone.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CleanReport {
    /// Steps whose leftovers were reclaimed (or would be, with a dry run).
    pub reclaimed: Vec<u64>,
    /// Files removed.
    pub files_removed: usize,
    /// Steps left alone, and why: uncommitted ones whose saves may still run, and ones whose
    /// index cannot be read.
    pub left_alone: Vec<(u64, String)>,
    /// Whether nothing was removed because it was a dry run.
    pub dry_run: bool,
}

/// Reclaims the leftovers in `root` (see the module docs).
pub fn clean(root: &Root, dry_run: bool) -> Result<CleanReport> {
    let mut report = CleanReport {
        dry_run,
        ..CleanReport::default()
    };
    for step in root.step_dirs()? {
        let storage = root.step_storage(step)?;
        match committed(&*storage) {
            Ok(Some(c)) => {
                // A committed step may hold what a killed save of the same step left beside it.
                let removed = if dry_run {
                    ended_saves(&*storage, &c.save_id)?
                        .iter()
                        .map(|(_, _, files)| files.len())
                        .sum()
                } else {
                    reclaim_ended_saves(&*storage, &c.save_id)?.len()
                };
                if removed > 0 {
                    report.reclaimed.push(step);
                    report.files_removed += removed;
                }
                continue;
            }
            Ok(None) => {}
            // One step's damage is that step's: named, and the others cleaned.
            Err(e) if e.is_about_the_checkpoint() => {
                report
                    .left_alone
                    .push((step, format!("its index cannot be read: {e}")));
                continue;
            }
            Err(e) => return Err(e),
        }
        let names = storage.list()?;
        let over = if names.iter().any(|n| n == PRUNE_MARKER) {
            // A removal cut short: the saves its marker names.
            let bytes = storage.get(PRUNE_MARKER, 1 << 20)?;
            serde_json::from_slice::<PruneMarker>(&bytes)
                .map(|m| m.save_ids)
                .map_err(|e| format!("its removal marker is unreadable: {e}"))
        } else {
            all_ended(&*storage, &names)?
        };
        match over {
            Ok(save_ids) => {
                report.reclaimed.push(step);
                if !dry_run {
                    report.files_removed += remove_step(root, step, &save_ids)?;
                }
            }
            Err(why) => report.left_alone.push((step, why)),
        }
    }
    Ok(report)
}

/// The saves whose files are in `names` when every one of them is provably over, or why one may
/// still be running.
fn all_ended(
    storage: &dyn crate::storage::Storage,
    names: &[String],
) -> Result<std::result::Result<Vec<String>, String>> {
    let mut ended = Vec::new();
    for (save_id, shards) in saves_in(names) {
        if let Err(why) = writers_have_ended(storage, names, save_id, &shards)? {
            return Ok(Err(why));
        }
        ended.push(save_id.to_string());
    }
    Ok(Ok(ended))
}

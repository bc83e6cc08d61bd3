//! Saving: the options and report of a save, its one pass, deltas, and the background save.
//!
//! A save goes one way, for a full checkpoint and a delta alike, each step in its module and
//! entered once (`save_on_this_thread`, then `pipeline::save_prepared`, read as this list):
//!
//! 1. `decide`: its name, what it replaces, that its options hold, a delta's parent (opened);
//! 2. `delta` (a delta only): its changes against the parent, spooled as tables;
//! 3. `owned`: the shards claimed, so that it is their one writer;
//! 4. `pipeline`: planned (saver-core's plan) and written, durable, with its shard manifests
//!    (`schedule`, `sink`, `compressing` move the bytes, `checksum` sums them);
//! 5. `commit`: committed under the directory's lock; what it replaced removed.
//!
//! `owned` holds all that a save owns in a directory: its claims, its rejection marker (a save
//! that can never commit, which the claim, the commit and the decision of a retry read) and its
//! leftovers.

pub(crate) mod background;
mod checksum;
pub(crate) mod commit;
mod compressing;
pub(crate) mod decide;
pub(crate) mod delta;
mod late;
mod options;
pub(crate) mod owned;
pub(crate) mod pipeline;
mod report;
mod schedule;
mod settings;
mod sink;

use std::path::Path;
use std::sync::Arc;

use saver_core::plan::TableRef;
use saver_core::SaveInput;

use crate::error::{Error, Result};
use crate::storage::{LocalFs, Storage};

pub use commit::{try_commit, CommitRule, CommitState};
pub use options::{DirectIo, Progress, ProgressFn, SaveOptions};
pub use report::{DeltaMethod, SaveReport};
pub use settings::SaveSettings;

use crate::save::pipeline::save_prepared;

/// Saves a model into directory `dir` (created if needed). See [`save_to`].
///
/// A save that fails into a directory it made removes the directory, if nothing else is in it.
///
/// ```
/// use saver_core::{DenseTensor, Dtype, EmbeddingTable, KeyDtype, SaveInput, SlotSpec};
/// use saver_io::{save, verify, SaveOptions, Status};
///
/// # let dir = tempfile::tempdir()?;
/// let table = EmbeddingTable::new("item", KeyDtype::I64, vec![
///     SlotSpec::new("embedding", Dtype::F32, vec![4]),
///     SlotSpec::new("adagrad", Dtype::F32, vec![4]),
/// ])?;
/// table.upsert(7, |row| row.slot_mut::<f32>(0).fill(1.0));
/// let mlp = [0.25f32; 16];
/// let input = SaveInput::new()
///     .table(&table)
///     .dense(DenseTensor::from_f32("mlp.weight", vec![4, 4], &mlp)?);
/// let report = save(dir.path(), input, &SaveOptions { step: Some(1200), ..Default::default() })?;
/// assert!(report.bytes_written > 0);
/// assert_eq!(verify(dir.path(), 2)?.status, Status::Ok);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn save(dir: impl AsRef<Path>, input: SaveInput<'_>, opts: &SaveOptions) -> Result<SaveReport> {
    let dir = dir.as_ref();
    let made = !dir.exists();
    save_to(&*storage_for_save(dir, opts)?, input, opts).inspect_err(|_| {
        if made {
            crate::storage::remove_dir_if_empty(dir);
        }
    })
}

/// Where a save into `dir` writes: the object-store prefix a URL names, or the local directory,
/// created if needed, with direct I/O as `opts` says.
pub(crate) fn storage_for_save(dir: &Path, opts: &SaveOptions) -> Result<Arc<dyn Storage>> {
    if crate::storage::location_url(dir).is_some() {
        return crate::storage::create_location(dir);
    }
    let storage = LocalFs::create_dir(dir)?;
    let direct = match opts.direct_io {
        DirectIo::Auto => opts.durable && storage.suits_direct_io(),
        DirectIo::On => true,
        DirectIo::Off => false,
    };
    Ok(Arc::new(storage.with_direct_io(direct)))
}

/// Saves a model into `storage`: plans, writes every planned shard in parallel, makes it durable,
/// writes the shard manifests and commits (single-process), or commits if this process completes
/// the set of shards (multi-process).
///
/// The save creates only files named after its save id, after claiming its shards; on failure it
/// removes what it wrote; after its commit it removes the files of the checkpoint it replaced,
/// as that checkpoint's manifest lists them, and nothing else ([`SaveReport::left_alone`]).
///
/// Tables of in-process workers ([`SaveInput::shard_table`]) are saved by one call: every shard,
/// all at one moment, one commit.
pub fn save_to(
    storage: &dyn Storage,
    input: SaveInput<'_>,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    in_pool_of_its_own(|| save_on_this_thread(storage, input, opts))
}

/// Runs `save` on a rayon pool of its own, which its scans and copies use. Never one pool for
/// several saves: a save that waits (for its threads, for the commit) on a thread of a shared
/// pool runs that pool's other jobs meanwhile, or leaves them waiting for the thread, and one of
/// them can be another save of the same checkpoint that waits for this one's commit.
fn in_pool_of_its_own<R: Send>(save: impl FnOnce() -> R + Send) -> R {
    match rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("saver-save-{i}"))
        .build()
    {
        Ok(pool) => pool.install(save),
        Err(_) => save(),
    }
}

/// [`save_to`] on the calling thread: what a background save, which runs on a pool of its own,
/// calls.
pub(crate) fn save_on_this_thread(
    storage: &dyn Storage,
    input: SaveInput<'_>,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let workers = input.worker_tables(opts.plan.shard_num, opts.plan.foreign_rows)?;
    if !workers.is_empty() && opts.plan.shard_index.is_some() {
        return Err(Error::InvalidOption {
            option: "shard_index",
            why: "tables given per shard (SaveInput::shard_table) are saved by one call that \
                  writes every shard: leave shard_index unset"
                .into(),
        });
    }
    // The workers' tables in place of their shards' tables.
    let mut joined = input.view();
    joined.shard_tables.clear();
    joined
        .tables
        .extend(workers.iter().map(|w| TableRef::Borrowed(w)));
    // One pass. Decided first, for a full save and a delta alike: the save's name, what it
    // replaces, that its options hold, a delta's parent, before a row is read or compared.
    let decided = decide::decide(storage, &joined, opts)?;
    let Some(parent) = &decided.parent else {
        // Claimed, planned, written, committed.
        return save_prepared(storage, joined, opts, &decided, None);
    };
    // A delta: its changes found against the parent, then saved as any input is. An error on
    // the way names the parent if it was replaced meanwhile.
    let mut tables = joined;
    let dense = std::mem::take(&mut tables.dense);
    let delta::Changes {
        rows,
        dense,
        row_chunks,
        delta,
        opts,
    } = delta::find(&tables, dense, opts, parent).map_err(|e| parent.explain(e))?;
    let mut input = rows.input();
    input.dense = dense;
    input.row_chunks = row_chunks;
    save_prepared(storage, input, &opts, &decided, Some(delta)).map_err(|e| parent.explain(e))
}

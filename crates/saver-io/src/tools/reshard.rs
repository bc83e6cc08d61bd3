//! Rewriting a checkpoint for another number of shards, and compacting a chain into one
//! checkpoint.

use std::path::Path;

use crate::error::Result;
use crate::load::checkpoint::Checkpoint;
use crate::load::link::Link;
use crate::save::{save, SaveOptions, SaveReport};
use crate::source::first_trainer_state;
use crate::source::{save_input, SourceTables};

/// Rewrites the newest state of `src` (a delta resolved over its chain) into `out` as a full
/// checkpoint of `opts.plan.shard_num` shards. Tables, slots, dense tensors and user metadata are
/// kept; trainer state is per worker and does not map onto a new worker count, so shard 0's state
/// is given to every new shard.
///
/// Streams: the rows are read from `src` as the save writes them, in the order they lie in its
/// files, so the rewrite holds what a save holds (`opts.plan`'s buffers) plus the dense tensors,
/// whatever the number of rows. Every byte read is checked against its checksum.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    src.refuse_row_tables("reshard and compact")?;
    let tables = SourceTables::of_checkpoint(src)?;
    let dense = src.dense_tensors(None, &mut crate::LoadReport::default())?;
    rewrite(src.newest(), tables, dense, out, opts)
}

/// Compacts the checkpoint in `dir` (a delta and its chain) into `out`: one full checkpoint
/// holding the newest state, which reads without its parents, with `opts.plan.shard_num` shards
/// (keep the chain's to compact without resharding). What `saver compact` runs; [`reshard`] of
/// the opened checkpoint, opened anew if it is replaced while it is read.
pub fn compact(dir: &Path, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    crate::load::link::read_latest(dir, || reshard(&Checkpoint::open(dir)?, out, opts))
}

/// Saves `tables` and `dense` with `src`'s trainer state and user metadata.
fn rewrite(
    src: &Link,
    tables: SourceTables<'_>,
    dense: Vec<crate::LoadedDense>,
    out: &Path,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let input = save_input(&tables, &dense)?;
    let mut opts = opts.clone();
    opts.plan.shard_index = None;
    opts.parent = None;
    if opts.trainer_state.is_none() {
        opts.trainer_state = first_trainer_state(src);
    }
    for (k, v) in &src.manifest().user_metadata {
        opts.user_metadata
            .entry(k.clone())
            .or_insert_with(|| v.clone());
    }
    save(out, input, &opts)
}

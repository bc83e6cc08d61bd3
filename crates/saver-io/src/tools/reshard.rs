//! Rewriting a checkpoint for another number of shards, and compacting a chain into one
//! checkpoint.

use std::path::Path;

use crate::error::Result;
use crate::load::chain::Chain;
use crate::load::checkpoint::Checkpoint;
use crate::load::stored::StoredTable;
use crate::save::{save, SaveOptions, SaveReport};
use crate::source::first_trainer_state;
use crate::source::{save_input, SourceTables};

/// Rewrites `src` into `out` with `opts.plan.shard_num` shards. Tables, slots, dense tensors and
/// user metadata are kept; trainer state is per worker and does not map onto a new worker count,
/// so shard 0's state is given to every new shard.
///
/// Streams: the rows are read from `src` as the save writes them ([`StoredTable`]), in the
/// order they lie in its files, so the rewrite holds what a save holds (`opts.plan`'s buffers)
/// plus the dense tensors, whatever the number of rows. Every source tensor read whole is
/// checked against its CRC32.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    let tables = SourceTables::Stored(StoredTable::all(src, &[], &[])?);
    let dense = crate::source::Source::checkpoint_dense(src)?;
    rewrite(src, tables, dense, out, opts)
}

/// Rewrites the newest state of `chain` (a delta resolved over its parents, or one full
/// checkpoint) into `out` as a full checkpoint of `opts.plan.shard_num` shards, as [`reshard`]
/// does: what `saver compact` and `saver reshard` of a delta run.
pub fn reshard_chain(chain: &Chain, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    if !chain.is_delta() {
        // One full checkpoint: its rows are read straight from their segments.
        return reshard(chain.newest(), out, opts);
    }
    let tables = SourceTables::Chain(chain.tables(&[], &[])?);
    let dense = chain.read_dense(None, &mut crate::LoadReport::default())?;
    rewrite(chain.newest(), tables, dense, out, opts)
}

/// Compacts the checkpoint or chain in `dir` into `out`: one full checkpoint holding the newest
/// state, which reads without its parents, with `opts.plan.shard_num` shards (keep the chain's
/// to compact without resharding). What `saver compact` runs; [`reshard_chain`] of the opened
/// chain.
pub fn compact(dir: &Path, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    crate::load::checkpoint::read_latest(dir, || reshard_chain(&Chain::open(dir)?, out, opts))
}

/// Saves `tables` and `dense` with `src`'s trainer state and user metadata.
fn rewrite(
    src: &Checkpoint,
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

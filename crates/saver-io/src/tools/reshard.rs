//! Rewriting a checkpoint for another number of shards, and compacting a chain into one
//! checkpoint.

use std::path::Path;

use saver_core::RowRangeChunk;

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
/// Row-range tables are cut anew into one chunk of rows per new shard (all their columns), their
/// deltas' changed rows put over their parents'.
///
/// Memory: the rows of hashed tables are read from `src` as the save writes them, in the order
/// they lie in its files, so the rewrite holds what a save holds (`opts.plan`'s buffers) plus the
/// dense tensors and the row-range tables, whatever the number of hashed rows. Every byte read is
/// checked against its checksum.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    let tables = SourceTables::of_checkpoint(src)?;
    let dense = src.dense_tensors(None, &mut crate::LoadReport::default())?;
    let chunks = row_chunks(src, opts.plan.shard_num, None)?;
    rewrite(src.newest(), tables, dense, chunks, out, opts)
}

/// The row-range tables of `src` (resolved over its chain) as chunks of rows for `shards`
/// shards: table rows cut into `shards` even ranges ([`Checkpoint::load_row_tables`]), each
/// range of every slot (all its columns) one chunk; only shard `only`'s when given, for a process
/// of a multi-process save.
pub fn row_chunks(
    src: &Checkpoint,
    shards: u32,
    only: Option<u32>,
) -> Result<Vec<RowRangeChunk<'static>>> {
    let mut chunks = Vec::new();
    for shard in saver_core::Shard::selected(shards, only) {
        for t in src.load_row_tables(Some(shard))?.0 {
            // A shard of no rows is a chunk too: it keeps a table of no rows in the copy.
            for s in t.slots {
                let rows = t.rows.clone();
                let chunk =
                    RowRangeChunk::of_rows(&t.name, &s.name, s.dtype, &s.shape, rows, s.values);
                chunks.push(chunk?);
            }
        }
    }
    Ok(chunks)
}

/// Compacts the checkpoint in `dir` (a delta and its chain) into `out`: one full checkpoint
/// holding the newest state, which reads without its parents, with `opts.plan.shard_num` shards
/// (keep the chain's to compact without resharding). What `saver compact` runs; [`reshard`] of
/// the opened checkpoint, opened anew if it is replaced while it is read.
pub fn compact(dir: &Path, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    crate::load::link::read_latest(dir, || reshard(&Checkpoint::open(dir)?, out, opts))
}

/// Saves `tables`, `dense` and `chunks` with `src`'s trainer state and user metadata.
fn rewrite(
    src: &Link,
    tables: SourceTables<'_>,
    dense: Vec<crate::LoadedDense>,
    chunks: Vec<RowRangeChunk<'static>>,
    out: &Path,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let mut input = save_input(&tables, &dense)?;
    input.row_chunks = chunks;
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

//! Rewriting a checkpoint for another number of shards.

use std::path::Path;

use saver_core::table::ColumnTable;
use saver_core::SaveInput;

use crate::error::Result;
use crate::import::{first_trainer_state, with_dense};
use crate::reader::Checkpoint;
use crate::restore::LoadOptions;
use crate::writer::{save, SaveOptions, SaveReport};

/// Rewrites `src` into `out` with `opts.plan.shard_num` shards. Tables, slots, dense tensors and
/// user metadata are kept; trainer state is per worker and does not map onto a new worker count,
/// so shard 0's state is given to every new shard. The whole model is held in memory meanwhile.
///
/// The rows go through arrays ([`Checkpoint::load_columns`], then [`ColumnTable`]s), not
/// hashtables: no allocation or insert per row, and since the source rows are already in bucket
/// order, the save copies them in long runs.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    let columns = src.load_columns(&LoadOptions {
        parallel: opts.plan.parallel,
        ..LoadOptions::default()
    })?;
    let tables = columns
        .tables
        .into_iter()
        .map(|t| ColumnTable::new(t.name, t.key_dtype, t.slots, t.ids, t.data))
        .collect::<saver_core::Result<Vec<_>>>()?;
    let mut input = SaveInput::new();
    for t in &tables {
        input = input.table(t);
    }
    let input = with_dense(input, &columns.dense)?;
    let mut opts = opts.clone();
    opts.plan.shard_index = None;
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

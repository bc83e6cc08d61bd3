//! Rewriting a checkpoint for another number of shards.

use std::path::Path;

use crate::error::Result;
use crate::import::Model;
use crate::reader::Checkpoint;
use crate::restore::LoadOptions;
use crate::writer::{save, SaveOptions, SaveReport};

/// Rewrites `src` into `out` with `opts.plan.shard_num` shards. Tables, slots, dense tensors and
/// user metadata are kept; trainer state is per worker and does not map onto a new worker count,
/// so shard 0's state is given to every new shard. The whole model is held in memory meanwhile.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    let restored = src.restore(&LoadOptions {
        parallel: opts.plan.parallel,
        ..LoadOptions::default()
    })?;
    let model = Model::from_restored(restored, src)?;
    let mut opts = opts.clone();
    opts.plan.shard_index = None;
    if opts.trainer_state.is_none() {
        opts.trainer_state = model.trainer_state.clone();
    }
    for (k, v) in &model.user_metadata {
        opts.user_metadata
            .entry(k.clone())
            .or_insert_with(|| v.clone());
    }
    save(out, model.input()?, &opts)
}

//! # saver
//!
//! Checkpoints for large recommendation models: sharded safetensors files written in parallel,
//! committed crash-safely, loadable by any number of workers. This crate re-exports the two
//! libraries so that a trainer depends on one crate:
//!
//! * [`core`] (`saver-core`): tables, dense tensors, filters, the partition rule, the save plan;
//! * [`io`] (`saver-io`): save, commit, open, restore with resharding, verify.
//!
//! The most used items are also re-exported at the top level.

pub use saver_core as core;
pub use saver_io as io;

pub use saver_core::{
    BlockKind, ColumnTable, DenseTensor, Dtype, EmbeddingTable, Filters, ForeignRows, KeyDtype,
    PartitionRule, PlanOptions, SaveInput, SlotSpec, SparseTable,
};
pub use saver_io::{
    save, save_async, verify, Checkpoint, DirectIo, LoadOptions, SaveHandle, SaveOptions, Status,
};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

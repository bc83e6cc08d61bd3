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

/// Everything a trainer needs, for `use saver::prelude::*;` (also re-exported at the top level):
/// tables, snapshots and rows, dense tensors, filters, save and load options and reports, the
/// background save, verify and export, and the checkpoint manager of a training job.
pub mod prelude {
    pub use saver_core::table::moment;
    pub use saver_core::table::{RowChunk, RowMut, TableSemantics};
    pub use saver_core::{
        BlockKind, ColumnTable, Compression, DenseTensor, Dtype, EmbeddingTable, Filters,
        ForeignRows, KeyDtype, PartitionRule, PlanOptions, RowView, SaveInput, SlotSpec,
        SparseTable, TableRef, TableSnapshot,
    };
    pub use saver_io::tools::export::{export, ExportOptions, ExportReport};
    pub use saver_io::{
        save, save_async, verify, Checkpoint, CheckpointManager, DeltaMethod, DirectIo,
        LoadOptions, LoadReport, LoadedDense, Policy, Progress, Restored, RestoredShard, Retention,
        SaveHandle, SaveOptions, SaveReport, Status, TableSink, VerifyReport,
    };
}

pub use prelude::*;
/// The error of saving, loading and verifying (it wraps `saver::core::Error`).
pub use saver_io::Error;

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

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

#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

pub use saver_core as core;
pub use saver_io as io;

/// Everything a trainer needs, for `use saver::prelude::*;` (also re-exported at the top level):
/// tables, snapshots and rows, dense tensors, filters, save and load options and reports, the
/// background save, verify and export, and the checkpoint manager of a training job.
pub mod prelude {
    // Not inlined: each item's page is its own crate's, where the links in its docs resolve
    // (inlined here, links to items this crate does not re-export render as literal `[…]`).
    #[doc(no_inline)]
    pub use saver_core::table::moment;
    #[doc(no_inline)]
    pub use saver_core::table::{RowChunk, RowMut, TableSemantics};
    #[doc(no_inline)]
    pub use saver_core::{
        BlockKind, ColumnTable, Compression, DenseTensor, Dtype, EmbeddingTable, Filters,
        ForeignRows, KeyDtype, PartitionRule, PlanOptions, RowView, SaveInput, Shard, SlotSpec,
        SparseTable, TableRef, TableSnapshot,
    };
    #[doc(no_inline)]
    pub use saver_io::manage::{
        CleanReport, KeepBest, ManagedSave, PruneReport, Started, StepInfo, WhenBusy,
    };
    #[doc(no_inline)]
    pub use saver_io::tools::export::{export, ExportOptions, ExportReport};
    #[doc(no_inline)]
    pub use saver_io::{
        save, save_async, verify, Checkpoint, CheckpointManager, DeltaMethod, DirectIo,
        LoadOptions, LoadReport, LoadedDense, Policy, Progress, Restored, RestoredShard, Retention,
        SaveHandle, SaveOptions, SaveReport, Status, TableSink, VerifyReport,
    };
}

pub use prelude::*;
/// The error a table's own code returns (`saver::core::Error`): what [`SparseTable`]'s and
/// [`TableSink`]'s methods return, in a table of your own, as `saver::Result<T, TableError>`.
pub use saver_core::Error as TableError;
/// The error of saving, loading and verifying (it wraps `saver::core::Error`).
pub use saver_io::Error;

/// The result of every operation of saver: `saver::Result<T>` fails with [`Error`]; a table's
/// own methods use `saver::Result<T, TableError>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

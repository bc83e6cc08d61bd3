//! # saver
//!
//! Checkpoints for large recommendation models: sharded safetensors files written in parallel,
//! committed crash-safely, loadable by any number of workers. This crate re-exports the two
//! libraries so that a trainer depends on one crate:
//!
//! * [`core`] (`saver-core`): tables, dense tensors, filters, the partition rule, the save plan;
//! * [`io`] (`saver-io`): save, commit, open, restore with resharding, verify.
//!
//! The most used items are also re-exported at the top level, and in [`prelude`].
//!
//! A training job saves step after step in the background through a [`CheckpointManager`],
//! which keeps what its [`Policy`] keeps, and restarts from the newest whole step with any
//! number of workers, each restoring exactly its rows:
//!
//! ```
//! use std::sync::Arc;
//! use saver::prelude::*;
//!
//! # fn main() -> saver::Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?; let root = dir.path(); // or "s3://bucket/run7" (feature s3)
//! let slots = vec![SlotSpec::new("embedding", Dtype::F32, vec![8])];
//! let table = Arc::new(EmbeddingTable::new("item", KeyDtype::I64, slots)?);
//! table.upsert(42, |row| row.slot_mut::<f32>(0).fill(0.5)); // training threads write on...
//!
//! let manager = CheckpointManager::open(root, Policy::default())?;
//! // Returns once the step's moment is fixed; the save and its commit go on in the background.
//! manager.save_async(100, SaveInput::new().table(Arc::clone(&table)), &SaveOptions::default())?;
//! manager.wait()?;
//!
//! // A restart with 4 workers: worker 2 restores its rows of the newest committed step.
//! let (step, restored) = manager
//!     .restore_latest(&LoadOptions::for_shard(Shard { index: 2, count: 4 }))?
//!     .expect("a committed step");
//! assert_eq!((step, restored.shards.len()), (100, 1));
//! # Ok(()) }
//! ```
//!
//! One save without a manager is [`save()`](fn@save) (or [`save_async`]), one load is
//! [`Checkpoint::open`] and [`Checkpoint::restore`]; [`verify()`](fn@verify) checks every byte.

#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]
#![warn(unreachable_pub, missing_debug_implementations)]

pub use saver_core as core;
pub use saver_io as io;

/// Everything a trainer needs, for `use saver::prelude::*;` (also re-exported at the top level):
/// tables, dense tensors, filters, save and load options and reports, the
/// background save, verify and export, and the checkpoint manager of a training job.
pub mod prelude {
    // Not inlined: each item's page is its own crate's, where the links in its docs resolve
    // (inlined here, links to items this crate does not re-export render as literal `[…]`).
    #[doc(no_inline)]
    pub use saver_core::table::{moment, RowMut};
    #[doc(no_inline)]
    pub use saver_core::{
        Compression, DenseTensor, Dtype, EmbeddingTable, Filters, ForeignRows, KeyDtype,
        PartitionRule, PlanOptions, RowRangeChunk, RowRangeTable, SaveInput, Shard, SlotSpec,
        SparseTable,
    };
    #[doc(no_inline)]
    pub use saver_io::tools::export::{export, ExportOptions};
    #[doc(no_inline)]
    pub use saver_io::{
        save, save_async, verify, Checkpoint, CheckpointManager, DeltaMethod, LoadOptions,
        LoadReport, LoadedDense, Policy, Progress, Restored, Retention, RowsInto, SaveHandle,
        SaveOptions, SaveReport, Status, TableSink,
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

#[doc = include_str!("../docs/GUIDE.md")]
#[cfg(doctest)]
pub struct GuideDoctests;

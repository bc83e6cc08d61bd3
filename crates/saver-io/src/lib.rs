//! # saver-io
//!
//! Turns a [`saver_core::SavePlan`] into a checkpoint on storage, and a checkpoint back into
//! tables. Six rooms, each importing only from the rooms before it, in the direction the data
//! flows (a test, `tests/layering.rs`, keeps it so):
//!
//! 1. [`storage`]: where bytes go: a local directory (with direct I/O), an object store, and a
//!    storage that injects faults; the process's identity, spill and write-behind files.
//! 2. [`load`]: reading a committed checkpoint, through one type: [`Checkpoint::open`] opens
//!    it with every link of its chain (a full checkpoint is a chain of one [`Link`]), each
//!    link's index, manifest and headers validated before any tensor byte;
//!    [`Checkpoint::restore`] loads for shard `j` of any `M` into tables,
//!    [`Checkpoint::load_columns`] into arrays, reading only the byte ranges that shard needs,
//!    every byte checked against a CRC32.
//! 3. [`source`]: the models a save reads in bounded memory: plain safetensors files, stored
//!    checkpoints and chains.
//! 4. [`save`](mod@save): [`save()`](fn@save) / [`save_to`]: plan, write every planned shard with `parallel`
//!    threads, CRC32 every tensor, make files durable, write the shard manifests, and commit once
//!    ([`save::try_commit`]); a delta when [`SaveOptions::parent`] is set; [`save_async`], which returns once the save's
//!    moment is fixed.
//! 5. [`tools`]: [`verify()`], digests, export, reshard and compact.
//! 6. [`manage`]: a training job's checkpoints in one root: [`CheckpointManager`] saves step
//!    after step, full or delta by its [`Policy`], keeps what its [`Retention`] keeps, and
//!    restarts from the newest committed step.
//!
//! All file access goes through the [`storage::Storage`] trait.

#![warn(missing_docs)]
// What is `pub` is reachable by users (the rest is `pub(crate)`), and every type a user can
// hold prints with `{:?}`.
#![warn(unreachable_pub, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

pub mod error;
pub mod load;
pub mod manage;
pub mod save;
pub mod source;
pub mod storage;
pub mod tools;

pub use error::{Error, Result};
pub use load::checkpoint::{
    ChainTable, Checkpoint, LoadRequest, Loaded, LoadedRowSlot, LoadedRowTable, RowsInto,
    RowsLoaded, SinkFor,
};
pub use load::link::Link;
pub use load::restore::{LoadOptions, LoadReport, LoadedDense, Restored, RestoredShard, TableSink};
pub use manage::{CheckpointManager, Policy, Retention};
pub use save::background::{save_async, SaveHandle};
pub use save::{
    save, save_to, DeltaMethod, DirectIo, Progress, ProgressFn, SaveOptions, SaveReport,
    SaveSettings,
};
pub use tools::verify::{verify, verify_storage, Problem, Status, VerifyReport};

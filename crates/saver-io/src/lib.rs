//! # saver-io
//!
//! Turns a [`saver_core::SavePlan`] into a checkpoint on storage, and a checkpoint back into tables.
//!
//! * [`save`] / [`save_to`]: plan, write every planned shard with `parallel` threads using
//!   positional writes and bounded buffers, CRC32 every tensor on the way, make files durable,
//!   write the shard manifest, and commit. Multi-process saves (one process per shard, in any order,
//!   possibly on several hosts sharing a filesystem) commit exactly once, under the directory's
//!   commit lock, as a compare-and-swap of the committed checkpoint ([`commit`]); a save creates
//!   and removes only files it owns. [`SaveOptions::wait`] waits for the set with a timeout naming
//!   the missing shards.
//! * [`save_async`]: the same, on a thread of its own, returning to the trainer once the save's
//!   moment is fixed; tables that support it ([`saver_core::EmbeddingTable`]) are saved as they
//!   were at that moment while training goes on.
//! * [`Checkpoint::open`]: validates index, manifest and every header without reading data.
//! * [`Checkpoint::restore`] / [`Checkpoint::load_into`]: load for shard `j` of any `M`, reading
//!   only the byte ranges that shard needs.
//! * [`verify()`]: recomputes every CRC32 and reports, per file and tensor, what is missing,
//!   truncated or corrupt; tells "incomplete" (never committed) from "corrupt".
//!
//! All file access goes through the [`storage::Storage`] trait; [`storage::LocalFs`] is the POSIX
//! backend and [`storage::FaultyStorage`] injects failures for tests.

#![warn(missing_docs)]

pub mod background;
pub mod chain;
pub mod columns;
pub mod commit;
pub mod delta;
pub mod digest;
pub mod error;
pub mod export;
pub mod header;
pub mod import;
pub mod index;
mod memory;
mod open_files;
mod owner;
mod pieces;
pub mod reader;
pub mod reshard;
pub mod restore;
mod schedule;
pub mod source;
pub mod spill;
pub mod storage;
pub mod verify;
mod write_behind;
pub mod writer;

pub use background::{save_async, SaveHandle};
pub use chain::{Chain, ChainTable};
pub use error::{Error, Result};
pub use reader::Checkpoint;
pub use restore::{LoadOptions, LoadReport, LoadedDense, Restored, RestoredShard, TableSink};
pub use verify::{verify, verify_storage, Status, VerifyReport};
pub use writer::{
    save, save_to, DeltaMethod, DirectIo, Progress, ProgressFn, SaveOptions, SaveReport,
};

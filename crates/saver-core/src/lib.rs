//! # saver-core
//!
//! The data model and the save plan of **saver**, a checkpoint framework for large recommendation
//! models. This crate does no file I/O: it describes a model, decides what goes where, and produces
//! the bytes; `saver-io` writes, commits, reads and reshards.
//!
//! ## The model
//!
//! A recommendation model is mostly *sparse* state: embedding hashtables keyed by 64-bit feature
//! ids ([`SparseTable`]), each row holding several *slots* ([`SlotSpec`]): the embedding, optimizer
//! state such as an Adagrad accumulator or Adam's m and v, counters such as frequency or last
//! update step. The rest is *dense* ([`DenseTensor`]): MLP weights and dense optimizer state.
//! [`EmbeddingTable`] is a ready concurrent table on `dashmap` that trainers can use directly and
//! that loads restore into by default.
//!
//! ## The partition rule
//!
//! Training runs as N workers, each owning one partition of every table. [`PartitionRule`] says
//! which: an id hashes into one of 2^16 buckets, and shard `j` of `M` owns a contiguous range of
//! buckets. Rows are written grouped by bucket with a bucket index, so a checkpoint saved by N
//! workers can be loaded by any M workers reading only the rows each needs.
//!
//! ## Saving
//!
//! A save is planned ([`plan()`]) from a [`SaveInput`] and [`PlanOptions`]:
//!
//! * the output is made of *write blocks*, one tensor each: the ids of a table partition, one slot
//!   of that partition (rows aligned with the ids), a bucket index, or one dense tensor;
//! * [`Filters`] (closures) keep or drop blocks and rows: drop optimizer slots for serving, keep
//!   rows seen at least 5 times, keep some tables. A table stays consistent whatever they do;
//! * the [`SavePlan`] fixes every file, header and byte offset before a byte is written, and then
//!   produces bytes lazily, chunk by chunk, from any number of threads (saver-io's writers).
//!
//! ```
//! use saver_core::{plan, Dtype, EmbeddingTable, Filters, KeyDtype, PlanOptions, SaveInput, SlotSpec};
//!
//! let table = EmbeddingTable::new("user", KeyDtype::I64, vec![
//!     SlotSpec::new("embedding", Dtype::F32, vec![4]),
//!     SlotSpec::new("freq", Dtype::I64, vec![]),
//! ])?;
//! for id in -50i64..50 {
//!     table.upsert(id as u64, |row| {
//!         row.slot_mut::<f32>(0).fill(id as f32);
//!         row.slot_mut::<i64>(1)[0] = id.rem_euclid(7);
//!     });
//! }
//! let mut opts = PlanOptions::default();
//! opts.shard_num = 4;
//! // Serving export: no counters, and only rows seen at least 3 times.
//! opts.filters = Filters::new().exclude_slots("freq")?.keep_rows(|row| row.scalar("freq").unwrap() >= 3.0);
//! let input = SaveInput::new().table(&table);
//! let plan = plan(&input, &opts)?;
//! let rows: usize = plan.shards().iter().flat_map(|s| &s.partitions).map(|p| p.rows.len()).sum();
//! assert_eq!(rows, (-50i64..50).filter(|id| id.rem_euclid(7) >= 3).count());
//! # Ok::<(), saver_core::Error>(())
//! ```
//!
//! The manifest types ([`Manifest`], [`ShardManifest`]) describe a written checkpoint; the format
//! is specified in `docs/FORMAT.md`.
//!
//! ## What is not API
//!
//! Items marked `#[doc(hidden)]` (the plan's execution, the commit protocol's file names, the
//! documents' own checks) are public only because saver-io, another crate, calls them: they carry
//! no promise between versions, and nothing but saver-io may call them (`tests/public_api.rs`
//! lists them apart and checks that the CLI, the Python module, the facade and the examples do
//! not).

#![warn(missing_docs)]
// What is `pub` is reachable by users (the rest is `pub(crate)`), and every type a user can
// hold prints with `{:?}`.
#![warn(unreachable_pub, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

pub mod cast;
pub mod compress;
pub mod dtype;
pub mod error;
pub mod filter;
pub mod manifest;
pub mod moment_copy;
pub mod naming;
pub mod partition;
pub mod plan;
pub mod prefetch;
pub mod quantize;
pub mod row_range;
// Models generated from a spec, for benchmarks and tests: not part of a trainer's build.
#[cfg(any(test, feature = "synthetic"))]
pub mod synthetic;
pub mod table;
pub mod tensor;

pub use dtype::{Dtype, KeyDtype};
pub use error::{Error, Result};
pub use filter::{BlockInfo, BlockKind, Filters, ScalarCondition};
pub use manifest::{
    BlockCrcs, Codec, Index, Manifest, ParentRef, ShardManifest, COMPRESSED_DELTA_FORMAT_VERSION,
    COMPRESSED_FORMAT_VERSION, DELTA_FORMAT_VERSION, FORMAT_VERSION, NEWEST_FORMAT_VERSION,
};
pub use partition::{PartitionRule, Shard};
pub use plan::{
    plan, Compression, ForeignRows, PlanOptions, SaveInput, SavePlan, Stored, TableRef, TensorCrc,
};
pub use row_range::{RowRangeChunk, RowRangeTable, RowsMut};
pub use table::{
    ChangeTracking, ColumnTable, EmbeddingTable, RowView, SlotSpec, SparseTable, TableSchema,
    TableSnapshot,
};
pub use tensor::{ByteSource, DenseTensor};

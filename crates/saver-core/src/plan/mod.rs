//! The save plan: every file, header and byte range of a save, computed before any byte is written.
//!
//! [`plan`] takes the model ([`SaveInput`]) and [`PlanOptions`] and returns a [`SavePlan`]:
//!
//! 1. *Scan*: each table is snapshotted; its ids (and, only if a row filter needs them, its slot
//!    values) are scanned once; rows kept by the filters and owned by a planned shard are counted
//!    per bucket and grouped by the bucket's high byte, in memory or, past
//!    [`PlanOptions::plan_memory`], in a [`Spill`] store. From here on the set of saved rows is
//!    fixed. Each group is sorted by (bucket, id) when the writer first needs it (`rows`).
//! 2. *Layout*: each planned shard gets one partition per table (the rows of its bucket range),
//!    cut into segments at bucket boundaries so no tensor is unbounded; dense tensors are spread
//!    over shards by bytes; each shard's blocks are packed into files by bytes; every header is
//!    rendered with placeholder checksums of the final width, fixing every offset.
//!
//! The plan is pure and deterministic: the same tables, tensors and options always give the same
//! plan and, written, the same bytes, whatever `parallel` is and whether one process plans all
//! shards or each process plans its own.

mod bucket_starts;
mod chunks;
pub mod header;
mod input;
mod layout;
mod rows;
mod scan;

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use bucket_starts::BucketStarts;
pub use chunks::{Chunk, ChunkBuffer, Piece, PieceSink};
use header::{render_header, FileFacts, HeaderTensor, StoredTensor};
pub use input::{SaveInput, TableRef};
pub use rows::Spill;
use scan::ScannedTable;

use crate::error::{Error, Result};
use crate::filter::{BlockInfo, BlockKind, Filters};
use crate::manifest::{
    format_version_of, BlockCrcs, ChangedRowsManifest, Codec, DenseGiven, DenseManifest,
    FileManifest, PartitionManifest, RowChunkManifest, RowPatchManifest, RowSlotManifest,
    RowTableManifest, SegmentManifest, ShardManifest, TableManifest, TensorRef, FORMAT_NAME,
};
use crate::naming::{check_dense_name, check_plan_table_name, check_save_id};
use crate::partition::PartitionRule;
use crate::row_range::{check_chunks, is_chunk_tensor_name_of, RowRangeChunk};
use crate::table::moment::{self, MomentHook};
use crate::table::SparseTable;
use crate::tensor::DenseTensor;

/// Data per file below which [`PlanOptions::split_files`] does not cut a shard further.
pub const SPLIT_FILE_BYTES: u64 = 256 << 20;

/// The largest checksummed block of a tensor ([`BlockCrcs`]). A read of part of a tensor reads at
/// most one block more at each end of what it wants, so this bounds the read amplification of
/// resharding loads (8 → 3 shards of a 2 GiB model: 1.004–1.010 at 256 KiB, 1.004–1.033 at
/// 1 MiB); the manifest holds 8 hex digits per block (32 KiB per GiB of data).
pub const CRC_BLOCK_BYTES: u64 = 256 << 10;

/// The smallest checksummed block: a tensor no longer than this has only its CRC32.
pub const MIN_CRC_BLOCK_BYTES: u64 = 1 << 10;

/// The size of the checksummed blocks of a tensor of `len` bytes, if it has any: about a
/// sixteenth of it (a power of two), from [`MIN_CRC_BLOCK_BYTES`] to [`CRC_BLOCK_BYTES`]. Small
/// tensors get blocks too, so that a small model's resharding loads read about what they keep;
/// at most 16 block CRC32s each.
#[doc(hidden)]
pub fn crc_block_bytes(len: u64) -> Option<u64> {
    (len > MIN_CRC_BLOCK_BYTES).then(|| {
        (len / 16)
            .next_power_of_two()
            .clamp(MIN_CRC_BLOCK_BYTES, CRC_BLOCK_BYTES)
    })
}

/// The checksums of one written tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorCrc {
    /// CRC32 of the whole tensor, as its file header and manifest record it.
    pub crc32: u32,
    /// CRC32 of each block, for a tensor with blocks (`crc_block_bytes`).
    pub blocks: Option<BlockCrcs>,
    /// Where a compressed save stored the tensor; `None` where it lies as planned.
    pub stored: Option<Stored>,
}

/// Where a tensor of a compressed save lies in its file, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// Offset of its stored bytes within the data section.
    pub start: u64,
    /// End of its stored bytes within the data section.
    pub end: u64,
    /// How it is compressed; `None` when stored as it is.
    pub codec: Option<Codec>,
}

/// How a save compresses its tensors (format versions 3 and 4; see docs/FORMAT.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compression {
    /// zstd's level, 1 (fastest) to 19.
    pub level: i32,
}

impl Default for Compression {
    fn default() -> Self {
        Self { level: 1 }
    }
}

/// The largest slot tensor a compressed save cuts a partition into. A writer keeps a segment's
/// later tensors in memory until the tensors before them in the file are stored, since their
/// offsets are known only then: small segments bound that memory.
pub const COMPRESSED_SEGMENT_BYTES: u64 = 4 << 20;

pub use crate::table::workers::ForeignRows;

/// How to plan a save.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Number of shards of the checkpoint (≥ 1).
    pub shard_num: u32,
    /// `Some(i)`: plan only shard `i` (one process of a multi-process save). `None`: every shard.
    pub shard_index: Option<u32>,
    /// Writer threads. Does not change the layout, only how it is written.
    pub parallel: usize,
    /// Largest data file (bytes); a single tensor larger than this gets a file of its own.
    pub max_file_size: u64,
    /// A shard is cut into at least one file per [`SPLIT_FILE_BYTES`] of data, up to this many,
    /// even below `max_file_size` (1: as few files as `max_file_size` allows). Writer threads
    /// writing one file serialise on its lock; spread over files, they do not. Only the data's
    /// size decides the file count, never `parallel`, so the layout stays deterministic.
    pub split_files: usize,
    /// Largest tensor a table partition is cut into (bytes per slot tensor).
    pub max_block_bytes: u64,
    /// Bytes a writer thread produces at a time; its buffer size.
    pub chunk_bytes: u64,
    /// Most bytes the plan may hold of scanned ids and row handles (16 per row), over all tables.
    /// A table that would go past it waits in the [`Spill`] store given to [`plan_with_spill`]
    /// (saves put it in nameless temporary files of the checkpoint directory), and then takes
    /// at most 16 MiB of scan buffers while scanning, and per writer thread about one unit of
    /// rows being written: at most `chunk_bytes / 8` bytes of ids and handles (64 Ki rows, 1 MiB,
    /// at the default chunk). Without a store, everything stays in memory. A table whose snapshot
    /// lists rows by bucket ([`crate::table::TableSnapshot::rows_in_buckets`], e.g. a plain
    /// safetensors input) keeps nothing aside past the budget: the writer has each unit's rows
    /// listed again.
    ///
    /// Default 16 MiB (a million rows): a save then holds about 64 MiB + `parallel` ×
    /// `chunk_bytes` beyond the model, whatever its size. Spilling writes and reads 16 bytes a row
    /// once more; on a local disk that took no measurable time (docs/benchmarks/HISTORY.md). Raise it
    /// where that I/O costs more than memory, e.g. a checkpoint on a network filesystem.
    pub plan_memory: u64,
    /// The data section of every file starts at a multiple of this (a power of two, ≥ 8).
    pub alignment: u64,
    /// Block and row filters.
    pub filters: Filters,
    /// What to do with rows owned by shards this process does not plan.
    pub foreign_rows: ForeignRows,
    /// Identifies the save; part of every file name. See `docs/FORMAT.md`.
    pub save_id: String,
    /// Called once the save's moment is fixed (every table's snapshot taken), before any row is
    /// read. Default none.
    pub on_moment: Option<MomentHook>,
    /// Compress the tensors where it pays (`None`, the default: store every tensor as it is).
    /// Segments are then cut at most [`COMPRESSED_SEGMENT_BYTES`] a slot tensor.
    pub compression: Option<Compression>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            shard_num: 1,
            shard_index: None,
            parallel: std::thread::available_parallelism().map_or(2, usize::from),
            max_file_size: 2 << 30,
            split_files: 4,
            max_block_bytes: 256 << 20,
            chunk_bytes: 8 << 20,
            plan_memory: 16 << 20,
            alignment: 4096,
            filters: Filters::new(),
            foreign_rows: ForeignRows::Error,
            save_id: "checkpoint".into(),
            on_moment: None,
            compression: None,
        }
    }
}

impl PlanOptions {
    /// Checks every option, naming the first bad one.
    #[doc(hidden)]
    pub fn validate(&self) -> Result<()> {
        PartitionRule::check_shard(self.shard_index.unwrap_or(0), self.shard_num)?;
        let bad = |option, why: &str| {
            Err(Error::InvalidOption {
                option,
                why: why.into(),
            })
        };
        if self.parallel == 0 {
            return bad("parallel", "must be at least 1");
        }
        if self.max_file_size < 4096 {
            return bad("max_file_size", "must be at least 4 KiB");
        }
        if self.split_files == 0 {
            return bad("split_files", "must be at least 1");
        }
        if self.max_block_bytes < 4096 {
            return bad("max_block_bytes", "must be at least 4 KiB");
        }
        if !(4096..=1 << 30).contains(&self.chunk_bytes) {
            return bad("chunk_bytes", "must be between 4 KiB and 1 GiB");
        }
        if !self.alignment.is_power_of_two() || !(8..=1 << 20).contains(&self.alignment) {
            return bad("alignment", "must be a power of two between 8 and 1 MiB");
        }
        if let Some(c) = self.compression {
            if !(1..=19).contains(&c.level) {
                return bad("compression", "the zstd level must be between 1 and 19");
            }
        }
        check_save_id(&self.save_id)
    }
}

/// Where a tensor is within its shard: file number and tensor number in that file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Loc {
    /// Index into [`ShardPlan::files`].
    pub file: usize,
    /// Index into [`FilePlan::tensors`].
    pub tensor: usize,
}

/// One segment: a run of rows of a partition covering a contiguous bucket range.
#[derive(Clone, Debug)]
pub struct SegmentPlan {
    /// Segment number within the partition.
    pub index: u32,
    /// Buckets covered.
    pub buckets: Range<u32>,
    /// Rows, as a range of the table's sorted ids.
    pub rows: Range<usize>,
    /// The bucket index tensor's values.
    pub bucket_index: Vec<u64>,
    /// Where the ids go.
    pub ids: Loc,
    /// Where the bucket index goes.
    pub index_loc: Loc,
    /// Where each kept slot goes (order of [`PartitionPlan::slots`]).
    pub slots: Vec<Loc>,
}

/// One table's rows in one shard.
#[derive(Clone, Debug)]
pub struct PartitionPlan {
    /// Index of the table in the plan.
    pub table: usize,
    /// The shard's bucket range.
    pub buckets: Range<u32>,
    /// Rows, as a range of the table's sorted ids.
    pub rows: Range<usize>,
    /// Kept slots (indices into the table's slots).
    pub slots: Vec<usize>,
    /// Segments in bucket order.
    pub segments: Vec<SegmentPlan>,
}

/// A dense tensor placed in a shard.
#[derive(Clone, Debug)]
pub struct DensePlan {
    /// Index of the tensor in the input.
    pub dense: usize,
    /// Where it goes.
    pub loc: Loc,
}

/// One data file.
#[derive(Clone, Debug)]
pub struct FilePlan {
    /// File name (see `crate::naming::data_file_name`).
    pub name: String,
    /// File number within the shard.
    pub index: u32,
    /// Offset of the data section: the header's exact length.
    pub data_start: u64,
    /// Length of the data section.
    pub data_len: u64,
    /// Tensors in data order, with offsets relative to the data section.
    pub tensors: Vec<HeaderTensor>,
}

impl FilePlan {
    /// Total file size.
    #[doc(hidden)]
    pub fn file_len(&self) -> u64 {
        self.data_start + self.data_len
    }
}

/// Everything one shard writes.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    /// The shard.
    pub shard: u32,
    /// Its data files.
    pub files: Vec<FilePlan>,
    /// One partition per table whose ids block is kept.
    pub partitions: Vec<PartitionPlan>,
    /// Dense tensors placed here.
    pub dense: Vec<DensePlan>,
}

/// A complete plan. Holds the table snapshots, so rows removed by training threads meanwhile can
/// still be written.
pub struct SavePlan<'a> {
    opts: PlanOptions,
    tables: Vec<ScannedTable<'a>>,
    /// The dense tensors given, then the values of the row-range chunks given: both are written
    /// whole, as one tensor each.
    dense: Vec<DenseTensor<'a>>,
    /// The shard each dense tensor (and chunk) is assigned to, whether or not this process
    /// writes it.
    dense_shard: Vec<u32>,
    /// Where in the row-range tables each chunk of `dense` is (`dense[given_dense + k]` is
    /// chunk `k`'s).
    chunks: Vec<ChunkPlace>,
    /// A delta's chunks of which no row changed, by the shard that records them: they cover
    /// their rectangles without a tensor.
    unchanged: Vec<(u32, ChunkPlace)>,
    /// Chunks of no element, by the shard that records them: they cover nothing, but keep
    /// their table and slot in the checkpoint (a table of 0 rows or 0 columns is a table).
    empty: Vec<(u32, ChunkPlace)>,
    /// How many of `dense` are dense tensors given.
    given_dense: usize,
    shards: Vec<ShardPlan>,
}

/// Where a tensor of a row-range chunk goes in its table: what its manifest entry records.
#[derive(Clone, Debug)]
pub(crate) struct ChunkPlace {
    pub table: String,
    pub slot: String,
    pub whole: Vec<u64>,
    pub offset: Vec<u64>,
    /// The chunk's rectangle.
    pub shape: Vec<u64>,
    /// The slot's dtype.
    pub dtype: crate::Dtype,
    pub part: ChunkPart,
}

/// Which tensor of a chunk a [`ChunkPlace`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChunkPart {
    /// A whole chunk's values.
    Values,
    /// A delta's changed rows of the chunk: their row numbers.
    ChangedRows,
    /// Their values.
    ChangedValues,
}

/// The entry of `place`'s slot in `tables`, its table's and its own made if missing.
fn slot_entry<'t>(
    tables: &'t mut Vec<RowTableManifest>,
    place: &ChunkPlace,
) -> &'t mut RowSlotManifest {
    let t = match tables.iter().position(|t| t.name == place.table) {
        Some(i) => i,
        None => {
            tables.push(RowTableManifest {
                name: place.table.clone(),
                rows: place.whole[0],
                slots: Vec::new(),
            });
            tables.len() - 1
        }
    };
    let slots = &mut tables[t].slots;
    let s = match slots.iter().position(|s| s.name == place.slot) {
        Some(i) => i,
        None => {
            slots.push(RowSlotManifest {
                name: place.slot.clone(),
                dtype: place.dtype,
                shape: place.whole.clone(),
                chunks: Vec::new(),
                patches: Vec::new(),
            });
            slots.len() - 1
        }
    };
    &mut slots[s]
}

impl ChunkPlace {
    fn of(c: &RowRangeChunk<'_>, part: ChunkPart) -> Self {
        Self {
            table: c.table().to_string(),
            slot: c.slot().to_string(),
            whole: c.whole().to_vec(),
            offset: c.offset().to_vec(),
            shape: c.shape().to_vec(),
            dtype: c.values().dtype(),
            part,
        }
    }
}

/// Checks names and cross-input collisions before anything is snapshotted.
fn validate_input(input: &SaveInput<'_>) -> Result<()> {
    let mut tables = HashSet::new();
    for t in &input.tables {
        check_plan_table_name(t.name())?;
        if !tables.insert(t.name()) {
            return Err(Error::DuplicateName {
                what: "table",
                name: t.name().into(),
            });
        }
    }
    check_chunks(&input.row_chunks)?;
    let row_tables: HashSet<&str> = input.row_chunks.iter().map(|c| c.table()).collect();
    if let Some(t) = row_tables.iter().find(|t| tables.contains(*t)) {
        return Err(Error::NameCollision {
            name: t.to_string(),
            first: "a hashed table".into(),
            second: "a row-range table".into(),
        });
    }
    let mut dense = HashSet::new();
    for d in &input.dense {
        check_dense_name(d.name())?;
        // A dense tensor named like a chunk of a row-range table would collide in its file.
        if let Some(t) = row_tables
            .iter()
            .find(|t| is_chunk_tensor_name_of(d.name(), t))
        {
            return Err(Error::NameCollision {
                name: d.name().into(),
                first: format!("row-range table {t:?}"),
                second: "a dense tensor".into(),
            });
        }
        if !dense.insert(d.name()) {
            return Err(Error::DuplicateName {
                what: "dense tensor",
                name: d.name().into(),
            });
        }
        // A dense tensor named like a sparse tensor of a known table would collide in the index.
        if let Some((prefix, suffix)) = d.name().rsplit_once(':') {
            let table = prefix.split('/').next().unwrap_or("");
            let sparse_like = suffix.strip_prefix('s').is_some_and(|s| {
                s.split_once('.').is_some_and(|(a, b)| {
                    !a.is_empty()
                        && !b.is_empty()
                        && (a.to_owned() + b).bytes().all(|c| c.is_ascii_digit())
                })
            });
            if sparse_like && prefix.contains('/') && tables.contains(table) {
                return Err(Error::NameCollision {
                    name: d.name().into(),
                    first: format!("table {table:?}"),
                    second: "a dense tensor".into(),
                });
            }
        }
    }
    Ok(())
}

/// Which of `tables` would take the plan past `plan_memory` (16 bytes a row): tables in input
/// order stay in memory while they fit, the rest spill (given a [`Spill`] store).
#[doc(hidden)]
pub fn tables_past_budget<'t>(
    tables: impl IntoIterator<Item = &'t (dyn SparseTable + 't)>,
    plan_memory: u64,
) -> Vec<bool> {
    let mut budget = plan_memory;
    tables
        .into_iter()
        .map(|t| {
            let need = t.len() as u64 * 16;
            let past = need > budget;
            if !past {
                budget -= need;
            }
            past
        })
        .collect()
}

/// Plans a save, every table's rows in memory. See the module docs.
pub fn plan<'a>(input: &'a SaveInput<'_>, opts: &PlanOptions) -> Result<SavePlan<'a>> {
    plan_with_spill(input, opts, None)
}

/// Plans a save; tables whose rows would take the plan past [`PlanOptions::plan_memory`] wait
/// in `spill` until written. The plan, and the bytes written, are the same either way.
pub fn plan_with_spill<'a>(
    input: &'a SaveInput<'_>,
    opts: &PlanOptions,
    spill: Option<Arc<dyn Spill>>,
) -> Result<SavePlan<'a>> {
    opts.validate()?;
    let capped;
    let opts = if opts.compression.is_some() && opts.max_block_bytes > COMPRESSED_SEGMENT_BYTES {
        capped = PlanOptions {
            max_block_bytes: COMPRESSED_SEGMENT_BYTES,
            ..opts.clone()
        };
        &capped
    } else {
        opts
    };
    if !input.shard_tables.is_empty() {
        return Err(Error::InvalidOption {
            option: "shard_table",
            why: "the tables of in-process workers are planned joined: plan the input's \
                  SaveInput::worker_tables (saver_io::save does)"
                .into(),
        });
    }
    validate_input(input)?;
    let shards: Vec<u32> = match opts.shard_index {
        Some(i) => vec![i],
        None => (0..opts.shard_num).collect(),
    };
    let spills: Vec<Option<Arc<dyn Spill>>> =
        tables_past_budget(input.all_tables(), opts.plan_memory)
            .into_iter()
            .map(|past| spill.as_ref().filter(|_| past).map(Arc::clone))
            .collect();
    // Every table's snapshot first, at one moment: the save shows every table as it was then.
    // For this save: the shards of one save, planned by several threads, share one moment.
    let snapshots = moment::for_save(&opts.save_id, || {
        moment::at_one_moment(|| {
            input
                .tables
                .iter()
                .map(|t| t.snapshot())
                .collect::<Result<Vec<_>>>()
        })
    })?;
    if let Some(hook) = &opts.on_moment {
        (hook.0)();
    }
    // Scan buffers, handed from part to part across every table's scan.
    let buffers = rows::RunBufferPool::default();
    let mut tables: Vec<ScannedTable<'a>> = input
        .tables
        .par_iter()
        .zip(snapshots)
        .zip(spills)
        .map(|((t, snapshot), spill)| {
            scan::scan_table(
                &**t,
                snapshot,
                opts.shard_num,
                &shards,
                &opts.filters,
                opts.foreign_rows,
                scan::RowsTo {
                    spill,
                    unit_rows: rows::unit_rows(opts.chunk_bytes),
                    buffers: &buffers,
                },
            )
        })
        .collect::<Result<_>>()?;
    drop(buffers);
    let mut dense: Vec<DenseTensor<'a>> = input.dense.iter().map(DenseTensor::view).collect();
    let mut dense_shard = layout::assign_dense(&dense, opts.shard_num);
    let given_dense = dense.len();
    // A process's chunks are its shard's; a save of every shard spreads them by bytes. An empty
    // chunk covers nothing; a delta's chunk of no changed rows holds nothing to write, but
    // covers its rectangle.
    let chunks_given: Vec<&RowRangeChunk<'_>> = input
        .row_chunks
        .iter()
        .filter(|c| !c.shape().contains(&0))
        .collect();
    let chunk_shard = match opts.shard_index {
        Some(i) => vec![i; chunks_given.len()],
        None => layout::assign_chunks(&chunks_given, opts.shard_num),
    };
    let empty: Vec<(u32, ChunkPlace)> = input
        .row_chunks
        .iter()
        .filter(|c| c.shape().contains(&0))
        .map(|c| {
            (
                opts.shard_index.unwrap_or(0),
                ChunkPlace::of(c, ChunkPart::Values),
            )
        })
        .collect();
    let mut chunks: Vec<ChunkPlace> = Vec::new();
    let mut unchanged = Vec::new();
    for (c, shard) in chunks_given.iter().zip(chunk_shard) {
        match c.changed_rows() {
            None => {
                chunks.push(ChunkPlace::of(c, ChunkPart::Values));
                dense.push(c.values().view());
                dense_shard.push(shard);
            }
            Some([]) => unchanged.push((shard, ChunkPlace::of(c, ChunkPart::ChangedRows))),
            Some(rows) => {
                let names = crate::row_range::patch_tensor_names(c.table(), c.slot(), c.offset());
                let ids: Vec<u8> = rows.iter().flat_map(|r| r.to_le_bytes()).collect();
                chunks.push(ChunkPlace::of(c, ChunkPart::ChangedRows));
                dense.push(DenseTensor::new(
                    names.0,
                    crate::Dtype::U64,
                    vec![rows.len() as u64],
                    ids,
                )?);
                chunks.push(ChunkPlace::of(c, ChunkPart::ChangedValues));
                dense.push(c.values().view());
                dense_shard.extend([shard, shard]);
            }
        }
    }
    let shard_plans = shards
        .par_iter()
        .enumerate()
        .map(|(pos, &s)| {
            layout::layout_shard(
                s,
                pos,
                &tables,
                layout::Dense {
                    tensors: &dense,
                    shard_of: &dense_shard,
                    chunks: &chunks,
                    given: given_dense,
                },
                &opts.filters,
                opts,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    for t in &mut tables {
        t.bucket_start = BucketStarts::Freed;
    }
    place_moment_copies(&shard_plans, &dense);
    Ok(SavePlan {
        opts: opts.clone(),
        tables,
        dense,
        dense_shard,
        chunks,
        unchanged,
        empty,
        given_dense,
        shards: shard_plans,
    })
}

/// Tells each background save's copy where within a page its file puts it, so that the next
/// save's copy of the tensor is placed alike and written straight from its memory
/// ([`crate::moment_copy`]).
fn place_moment_copies(shards: &[ShardPlan], dense: &[DenseTensor<'_>]) {
    for shard in shards {
        for dp in &shard.dense {
            if let Some(copy) = dense[dp.dense].moment_copy() {
                let file = &shard.files[dp.loc.file];
                let at = file.data_start + file.tensors[dp.loc.tensor].start;
                copy.place_in_page((at % crate::moment_copy::PAGE as u64) as usize);
            }
        }
    }
}

impl<'a> SavePlan<'a> {
    /// Every dense tensor this process was given, with a CRC32 of its content and whether the
    /// block filters keep it in the shard the plan assigns it to (whichever process writes that
    /// shard): what every process of a save must agree on, and what must be written once.
    /// A tensor read on demand ([`DenseTensor::deferred`]) is read for it, a piece at a time.
    #[doc(hidden)]
    pub fn dense_given(&self) -> Result<Vec<DenseGiven>> {
        self.dense[..self.given_dense]
            .par_iter()
            .zip(&self.dense_shard)
            .map(|(d, &shard)| {
                Ok(DenseGiven {
                    name: d.name().to_string(),
                    dtype: d.dtype(),
                    shape: d.shape().to_vec(),
                    crc32: d.crc32()?,
                    kept: self.opts.filters.keep_block(&BlockInfo {
                        kind: BlockKind::Dense,
                        table: None,
                        slot: None,
                        dense: Some(d.name()),
                        shard,
                    }),
                })
            })
            .collect()
    }

    /// The options the plan was made with.
    pub fn options(&self) -> &PlanOptions {
        &self.opts
    }

    /// The planned shards, in shard order.
    pub fn shards(&self) -> &[ShardPlan] {
        &self.shards
    }

    /// The sorted ids of a partition (as raw bits), in the order they are written.
    pub fn partition_ids(&self, part: &PartitionPlan) -> Result<Vec<u64>> {
        let (mut ids, mut handles) = (Vec::new(), Vec::new());
        let table = &self.tables[part.table];
        table.rows.copy(
            &*table.snapshot,
            part.rows.clone(),
            false,
            &mut ids,
            &mut handles,
        )?;
        Ok(ids)
    }

    /// The most bytes of pre-images the tables' snapshots kept at once for their moment so far
    /// (each table's peak, summed): what copy-on-write costs this save in memory.
    #[doc(hidden)]
    pub fn copy_on_write_peak(&self) -> u64 {
        self.tables
            .iter()
            .map(|t| t.snapshot.copy_on_write_peak())
            .sum()
    }

    /// Lets every table's snapshot check what it read ([`TableSnapshot::finish`]): called once
    /// the plan is written, before the save commits.
    ///
    /// [`TableSnapshot::finish`]: crate::table::TableSnapshot::finish
    #[doc(hidden)]
    pub fn finish_reads(&self) -> Result<()> {
        self.tables.iter().try_for_each(|t| t.snapshot.finish())
    }

    /// Rows of other shards' this process left out of its shard, over all tables
    /// ([`ForeignRows::Skip`]; with [`ForeignRows::Error`] they are refused).
    pub fn skipped_rows(&self) -> u64 {
        self.tables.iter().map(|t| t.skipped).sum()
    }

    /// Rows of the tables that wait in the spill store rather than memory.
    pub fn spilled_rows(&self) -> u64 {
        self.tables
            .iter()
            .filter(|t| t.rows.spilled())
            .map(|t| t.row_count)
            .sum()
    }

    /// Name of the table a partition belongs to.
    pub fn table_name(&self, table: usize) -> &str {
        &self.tables[table].name
    }

    /// Total bytes of tensor data over all planned files.
    pub fn data_bytes(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| &s.files)
            .map(|f| f.data_len)
            .sum()
    }

    /// The final header of file `file` of planned shard `pos`, with the tensors' checksums and,
    /// in a compressed save, where each is stored.
    pub fn header(&self, pos: usize, file: usize, crcs: &[TensorCrc]) -> Result<Vec<u8>> {
        let shard = &self.shards[pos];
        let f = &shard.files[file];
        let facts = FileFacts {
            save_id: &self.opts.save_id,
            shard: shard.shard,
            shard_num: self.opts.shard_num,
            file: f.index,
        };
        let whole: Vec<u32> = crcs.iter().map(|c| c.crc32).collect();
        if self.opts.compression.is_none() {
            let h = render_header(&facts, &f.tensors, &whole, self.opts.alignment);
            debug_assert_eq!(h.len() as u64, f.data_start);
            return Ok(h);
        }
        let stored = crcs
            .iter()
            .zip(&f.tensors)
            .map(|(c, t)| {
                let s = c.stored.as_ref().ok_or_else(|| Error::InvalidOption {
                    option: "compression",
                    why: format!("internal: tensor {:?} was not stored", t.name),
                })?;
                Ok(StoredTensor {
                    start: s.start,
                    end: s.end,
                    filter: s.codec.as_ref().map(|c| c.filter.clone()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        header::render_compressed_header(&facts, &f.tensors, &stored, &whole, f.data_start)
            .ok_or_else(|| Error::HeaderTooLarge {
                file: f.name.clone(),
                tensors: f.tensors.len(),
                bytes: f.data_start,
                limit: f.data_start,
            })
    }

    /// The data bytes of file `file` of planned shard `pos` as written: its stored tensors'
    /// in a compressed save.
    fn data_len_written(&self, pos: usize, file: usize, crcs: &[TensorCrc]) -> u64 {
        let f = &self.shards[pos].files[file];
        crcs.iter()
            .map(|c| c.stored.as_ref().map_or(0, |s| s.end))
            .max()
            .filter(|_| self.opts.compression.is_some())
            .unwrap_or(f.data_len)
    }

    /// The manifest of planned shard `pos` once written: `crcs[file][tensor]` are the checksums.
    pub fn shard_manifest(
        &self,
        pos: usize,
        crcs: &[Vec<TensorCrc>],
        user_metadata: &BTreeMap<String, String>,
        trainer_state: Option<String>,
    ) -> Result<ShardManifest> {
        let shard = &self.shards[pos];
        let tref = |loc: Loc| {
            let f = &shard.files[loc.file];
            let t = &f.tensors[loc.tensor];
            let c = &crcs[loc.file][loc.tensor];
            TensorRef {
                file: f.name.clone(),
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: f.data_start + c.stored.as_ref().map_or(t.start, |s| s.start),
                len: t.end - t.start,
                crc32: c.crc32,
                blocks: c.blocks.clone(),
                codec: c.stored.as_ref().and_then(|s| s.codec.clone()),
            }
        };
        let tables = shard
            .partitions
            .iter()
            .map(|p| {
                let t = &self.tables[p.table];
                let slots: Vec<_> = p.slots.iter().map(|&s| t.slots[s].clone()).collect();
                TableManifest {
                    name: t.name.clone(),
                    key_dtype: t.key_dtype,
                    rows: p.rows.len() as u64,
                    partitions: vec![PartitionManifest {
                        shard: shard.shard,
                        buckets: [p.buckets.start, p.buckets.end],
                        rows: p.rows.len() as u64,
                        slots: slots.iter().map(|s| s.name.clone()).collect(),
                        segments: p
                            .segments
                            .iter()
                            .map(|s| SegmentManifest {
                                index: s.index,
                                buckets: [s.buckets.start, s.buckets.end],
                                rows: s.rows.len() as u64,
                                ids: tref(s.ids),
                                bucket_index: tref(s.index_loc),
                                slots: s.slots.iter().map(|&l| tref(l)).collect(),
                            })
                            .collect(),
                    }],
                    slots,
                }
            })
            .collect();
        let mut m = ShardManifest {
            format: FORMAT_NAME.into(),
            format_version: 0,
            save_id: self.opts.save_id.clone(),
            partition: PartitionRule::default(),
            shard_num: self.opts.shard_num,
            shard: shard.shard,
            tables,
            dense: shard
                .dense
                .iter()
                .filter(|d| d.dense < self.given_dense)
                .map(|d| DenseManifest {
                    shard: shard.shard,
                    tensor: tref(d.loc),
                })
                .collect(),
            files: shard
                .files
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    Ok(FileManifest {
                        name: f.name.clone(),
                        shard: shard.shard,
                        bytes: f.data_start + self.data_len_written(pos, i, &crcs[i]),
                        data_start: f.data_start,
                        tensors: f.tensors.len() as u32,
                        header_crc32: crc32fast::hash(&self.header(pos, i, &crcs[i])?),
                    })
                })
                .collect::<Result<_>>()?,
            user_metadata: user_metadata.clone(),
            trainer_state,
            writer: None,
            replaces: None,
            step: None,
            tables_given: Vec::new(),
            dense_given: Vec::new(),
            parent: None,
            dense_in_parent: Vec::new(),
            row_tables: self.row_tables_of(shard, tref),
            sealed: crate::manifest::Sealed,
        };
        m.format_version = format_version_of(None, m.is_compressed(), !m.row_tables.is_empty());
        Ok(m)
    }

    /// The row-range tables of the chunks `shard` writes, as its manifest records them.
    fn row_tables_of(
        &self,
        shard: &ShardPlan,
        tref: impl Fn(Loc) -> TensorRef,
    ) -> Vec<RowTableManifest> {
        let mut tables: Vec<RowTableManifest> = Vec::new();
        for d in shard.dense.iter().filter(|d| d.dense >= self.given_dense) {
            let place = &self.chunks[d.dense - self.given_dense];
            let slot = slot_entry(&mut tables, place);
            match place.part {
                ChunkPart::Values => slot.chunks.push(RowChunkManifest {
                    shard: shard.shard,
                    offset: place.offset.clone(),
                    tensor: tref(d.loc),
                }),
                // Its two tensors lie in one shard, rows first.
                ChunkPart::ChangedRows => slot.patches.push(RowPatchManifest {
                    shard: shard.shard,
                    offset: place.offset.clone(),
                    shape: place.shape.clone(),
                    changed: Some(ChangedRowsManifest {
                        rows: tref(d.loc),
                        values: tref(d.loc),
                    }),
                }),
                ChunkPart::ChangedValues => {
                    if let Some(c) = slot
                        .patches
                        .iter_mut()
                        .rev()
                        .find(|p| p.offset == place.offset)
                        .and_then(|p| p.changed.as_mut())
                    {
                        c.values = tref(d.loc);
                    }
                }
            }
        }
        for (_, place) in self.empty.iter().filter(|(s, _)| *s == shard.shard) {
            slot_entry(&mut tables, place);
        }
        for (_, place) in self.unchanged.iter().filter(|(s, _)| *s == shard.shard) {
            let slot = slot_entry(&mut tables, place);
            slot.patches.push(RowPatchManifest {
                shard: shard.shard,
                offset: place.offset.clone(),
                shape: place.shape.clone(),
                changed: None,
            });
        }
        tables.sort_by(|a, b| a.name.cmp(&b.name));
        for t in &mut tables {
            t.slots.sort_by(|a, b| a.name.cmp(&b.name));
            for s in &mut t.slots {
                s.chunks.sort_by(|a, b| a.offset.cmp(&b.offset));
                s.patches.sort_by(|a, b| a.offset.cmp(&b.offset));
            }
        }
        tables
    }
}

impl std::fmt::Debug for SavePlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavePlan")
            .field("opts", &self.opts)
            .field("tables", &self.tables.len())
            .field("dense", &self.dense.len())
            .finish_non_exhaustive()
    }
}

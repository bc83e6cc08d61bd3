//! Loading a checkpoint for shard `j` of `M` workers, whatever `N` it was saved with.
//!
//! For each selected table, each saved segment whose bucket range overlaps the target's is read:
//! whole if it lies inside the target's range, otherwise only the rows of the target's buckets,
//! found through the segment's bucket index. Rows go to a [`TableSink`] in chunks, through reused
//! buffers, from `parallel` threads.
//!
//! Integrity: a tensor read whole is checked against its CRC32. A tensor read in part (resharding)
//! cannot be, so its ids are checked structurally instead: every id must hash into the bucket the
//! index says, in the target's range, in sorted order. [`crate::verify()`] checks everything.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use globset::{Glob, GlobSet, GlobSetBuilder};
use rayon::prelude::*;
use serde::Serialize;

use saver_core::manifest::{SegmentManifest, TableManifest, TensorRef};
use saver_core::{Dtype, EmbeddingTable, KeyDtype, PartitionRule, Shard, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::link::Link;
use crate::load::pieces::{self, EdgeGaps, Piece};

/// Where restored rows go. Implemented by [`EmbeddingTable`]; implement it for your own table.
///
/// Its methods are named apart from [`SparseTable`]'s (`wanted_…`), so that a table that is
/// both saved and restored implements both traits and calls either without naming the trait.
pub trait TableSink: Send + Sync {
    /// Id dtype the sink expects.
    fn wanted_key_dtype(&self) -> KeyDtype;
    /// Slots the sink wants, by name, with the dtype and row shape it expects.
    fn wanted_slots(&self) -> &[SlotSpec];
    /// Inserts rows: `slots[s]` holds `ids.len()` rows of `self.wanted_slots()[s]`.
    fn insert_chunk(&self, ids: &[u64], slots: &[&[u8]]) -> saver_core::Result<()>;
}

impl TableSink for EmbeddingTable {
    fn wanted_key_dtype(&self) -> KeyDtype {
        SparseTable::key_dtype(self)
    }
    fn wanted_slots(&self) -> &[SlotSpec] {
        SparseTable::slots(self)
    }
    fn insert_chunk(&self, ids: &[u64], slots: &[&[u8]]) -> saver_core::Result<()> {
        EmbeddingTable::insert_chunk(self, ids, slots)
    }
}

/// A table filter closure.
pub type NameFilter = dyn Fn(&str) -> bool + Send + Sync;

/// What to load, and for which target shard.
#[derive(Clone)]
pub struct LoadOptions {
    /// Number of target shards `M` (default 1).
    pub shard_num: u32,
    /// `Some(j)`: load only shard `j` of `M`. `None`: every target shard.
    pub shard_index: Option<u32>,
    /// Reader threads; at least 8 for a checkpoint in an object store, whose reads mostly wait
    /// on round trips (memory: one `chunk_bytes` chunk per thread; from an object store, a load
    /// into arrays reads chunks of at least 16 MiB).
    pub parallel: usize,
    /// Bytes read per chunk (buffer size per thread).
    pub chunk_bytes: u64,
    /// Globs of tables to load (empty: all).
    pub tables: Vec<String>,
    /// A closure over table names, applied after `tables`.
    pub table_filter: Option<Arc<NameFilter>>,
    /// Globs of slots not to load (e.g. `adagrad*` for embeddings only).
    pub exclude_slots: Vec<String>,
    /// Globs of dense tensors to load (empty: all; use `load_dense: false` for none).
    pub dense: Vec<String>,
    /// Whether to load dense tensors at all.
    pub load_dense: bool,
    /// Link table name → name in the target.
    pub rename: BTreeMap<String, String>,
    /// Tables that must be in the checkpoint (by checkpoint name).
    pub required_tables: Vec<String>,
    /// Ask the kernel for transparent huge pages for the arrays of [`crate::Checkpoint::load_columns`]:
    /// about twice as fast when huge pages are free, but a stall while the kernel compacts memory
    /// when they are not (see `docs/benchmarks/HISTORY.md`). Off by default.
    pub huge_pages: bool,
    /// Restore into tables with change tracking on, whose baseline is the loaded checkpoint
    /// (the newest link of a chain): a delta saved next with that checkpoint as parent writes
    /// what was written since the load, without comparing ([`EmbeddingTable::set_baseline`]).
    /// Off by default: tracking takes 8 bytes more a row.
    pub change_tracking: bool,
}

impl LoadOptions {
    /// The options of a load of target shard `shard` (of `shard.count`): the rows the partition
    /// rule gives that shard, whatever shard count the checkpoint was saved with.
    ///
    /// ```
    /// use saver_core::Shard;
    /// use saver_io::LoadOptions;
    /// let opts = LoadOptions::for_shard(Shard { index: 1, count: 3 });
    /// assert_eq!((opts.shard_num, opts.shard_index), (3, Some(1)));
    /// ```
    pub fn for_shard(shard: Shard) -> Self {
        Self {
            shard_num: shard.count,
            shard_index: Some(shard.index),
            ..Self::default()
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            shard_num: 1,
            shard_index: None,
            parallel: std::thread::available_parallelism().map_or(2, usize::from),
            chunk_bytes: 8 << 20,
            tables: Vec::new(),
            table_filter: None,
            exclude_slots: Vec::new(),
            dense: Vec::new(),
            load_dense: true,
            rename: BTreeMap::new(),
            required_tables: Vec::new(),
            huge_pages: false,
            change_tracking: false,
        }
    }
}

pub(crate) fn globs(option: &'static str, patterns: &[String]) -> Result<Option<GlobSet>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        b.add(Glob::new(p).map_err(|e| Error::InvalidOption {
            option,
            why: format!("{p:?}: {e}"),
        })?);
    }
    b.build().map(Some).map_err(|e| Error::InvalidOption {
        option,
        why: e.to_string(),
    })
}

/// Figures of a load.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LoadReport {
    /// Rows delivered to sinks.
    pub rows: u64,
    /// Bytes the checkpoint's files delivered to the load, counted at the storage layer (ids,
    /// slots, bucket indexes, dense tensors, the rest of blocks read to check them, and the gaps
    /// of merged ranged reads).
    pub bytes_read: u64,
    /// Bytes delivered (ids, selected slots, dense).
    pub bytes_kept: u64,
    /// `bytes_read / bytes_kept` (1.0 when nothing was kept).
    pub read_amplification: f64,
    /// Wall time.
    pub load_seconds: f64,
    /// Tensors whose CRC32 was checked (read whole).
    pub tensors_checked: u64,
}

/// A dense tensor loaded into memory.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedDense {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes.
    pub data: Vec<u8>,
}

impl LoadedDense {
    fn values<T: bytemuck::Pod>(&self, want: Dtype, from: fn(&[u8]) -> T) -> Result<Vec<T>> {
        if self.dtype != want {
            return Err(Error::Mismatch(format!(
                "dense tensor {:?} is {}, not {want}",
                self.name, self.dtype
            )));
        }
        Ok(self
            .data
            .chunks_exact(std::mem::size_of::<T>())
            .map(from)
            .collect())
    }

    /// The values of an F32 tensor (an error naming the tensor for another dtype).
    pub fn as_f32(&self) -> Result<Vec<f32>> {
        self.values(Dtype::F32, |b| f32::from_le_bytes(b.try_into().unwrap()))
    }

    /// The values of an F64 tensor.
    pub fn as_f64(&self) -> Result<Vec<f64>> {
        self.values(Dtype::F64, |b| f64::from_le_bytes(b.try_into().unwrap()))
    }

    /// The values of an I64 tensor.
    pub fn as_i64(&self) -> Result<Vec<i64>> {
        self.values(Dtype::I64, |b| i64::from_le_bytes(b.try_into().unwrap()))
    }

    /// The values of an I32 tensor.
    pub fn as_i32(&self) -> Result<Vec<i32>> {
        self.values(Dtype::I32, |b| i32::from_le_bytes(b.try_into().unwrap()))
    }

    /// The values of a U64 tensor.
    pub fn as_u64(&self) -> Result<Vec<u64>> {
        self.values(Dtype::U64, |b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

/// The tables of one target shard.
#[derive(Debug)]
pub struct RestoredShard {
    /// Target shard index.
    pub shard: u32,
    /// One table per selected checkpoint table, under its target name.
    pub tables: Vec<EmbeddingTable>,
}

impl RestoredShard {
    /// The table restored under `name`.
    pub fn table(&self, name: &str) -> Option<&EmbeddingTable> {
        self.tables.iter().find(|t| SparseTable::name(*t) == name)
    }

    /// The tables by name, each in an `Arc`: what trainer threads and background saves share.
    pub fn into_shared(self) -> BTreeMap<String, Arc<EmbeddingTable>> {
        self.tables
            .into_iter()
            .map(|t| (SparseTable::name(&t).to_string(), Arc::new(t)))
            .collect()
    }
}

/// The result of an owning restore: fresh tables, so a failed restore leaves nothing half-loaded.
#[derive(Debug)]
pub struct Restored {
    /// Target shards, in order.
    pub shards: Vec<RestoredShard>,
    /// Dense tensors, in name order.
    pub dense: Vec<LoadedDense>,
    /// Figures.
    pub report: LoadReport,
}

impl Restored {
    /// The tables of target shard `shard`.
    pub fn shard(&self, shard: u32) -> Option<&RestoredShard> {
        self.shards.iter().find(|s| s.shard == shard)
    }

    /// The table `name` of a restore of one target shard (`LoadOptions::shard_index`, or one
    /// shard in all); `None` if there is no such table, or several target shards to choose from
    /// (ask [`Self::shard`]).
    pub fn table(&self, name: &str) -> Option<&EmbeddingTable> {
        match self.shards.as_slice() {
            [one] => one.table(name),
            _ => None,
        }
    }

    /// The dense tensor restored under `name`.
    pub fn dense(&self, name: &str) -> Option<&LoadedDense> {
        self.dense.iter().find(|d| d.name == name)
    }
}

/// The rows of one segment that one target needs.
pub(crate) struct SegmentRead<'m> {
    pub table: &'m TableManifest,
    pub seg: &'m SegmentManifest,
    /// Which of the segment's slot tensors feed the target's slots, in target order.
    pub slot_map: Arc<Vec<usize>>,
    pub rows: Range<u64>,
    pub target: Range<u32>,
    pub whole: bool,
}

/// Ids to scan for the first row of `bucket`, an edge (0: start, 1: end) of read `read`'s target.
struct EdgeScan {
    read: usize,
    edge: usize,
    bucket: u32,
    rows: Range<u64>,
    ids: Vec<u8>,
}

/// Where the first row of a bucket lies, as far as a bucket index tells.
enum RowOf {
    /// This row.
    Found(u64),
    /// Among these rows, found by scanning their ids.
    Scan(Range<u64>),
}

impl<'m> SegmentRead<'m> {
    /// Bytes of one row as delivered (id plus wanted slots).
    pub(crate) fn row_bytes(&self) -> u64 {
        self.columns().map(|(_, width)| width).sum()
    }

    /// The tensors the read delivers, the ids and then the wanted slots in target order, each
    /// with its bytes per row.
    pub(crate) fn columns(&self) -> impl Iterator<Item = (&'m TensorRef, u64)> + '_ {
        let rows = self.seg.rows.max(1);
        let slots = self.slot_map.iter().map(move |&k| {
            let t = &self.seg.slots[k];
            (t, t.len / rows)
        });
        std::iter::once((&self.seg.ids, 8)).chain(slots)
    }

    /// The row range cut into runs of about `chunk_bytes`.
    pub(crate) fn chunks(&self, chunk_bytes: u64) -> impl Iterator<Item = Range<u64>> + '_ {
        let step = (chunk_bytes / self.row_bytes()).max(1);
        (self.rows.start..self.rows.end)
            .step_by(step as usize)
            .map(move |r| r..(r + step).min(self.rows.end))
    }
}

/// Chunks a load keeps in flight from a remote store, whatever `parallel` says: its threads
/// mostly wait on round trips, and a store serves many requests at once faster than few.
pub(crate) const REMOTE_CHUNKS_IN_FLIGHT: usize = 8;

/// The smallest chunk a load reads from a remote store: its ids and slots go as
/// requests of a few MiB each, which Garage served at 0.78 of plain 8 MiB GETs' rate where 8 MiB
/// chunks (requests of about 2.7 MiB) got 0.71. Memory: this much per reader thread.
pub(crate) const REMOTE_CHUNK_BYTES: u64 = 16 << 20;

/// Edge-tensor checks a load keeps in flight from a remote store: each waits on one small read.
pub(crate) const REMOTE_CHECKS_IN_FLIGHT: usize = 32;

/// The reader threads of a load of `ck` with `parallel` asked: at least
/// [`REMOTE_CHUNKS_IN_FLIGHT`] when its files are remote.
pub(crate) fn reader_threads(ck: &Link, parallel: usize) -> usize {
    if ck.is_remote() {
        parallel.max(REMOTE_CHUNKS_IN_FLIGHT)
    } else {
        parallel
    }
}

/// The thread pool of one load.
pub(crate) fn reader_pool(parallel: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(parallel.max(1))
        .thread_name(|i| format!("saver-read-{i}"))
        .build()
        .map_err(|e| Error::InvalidOption {
            option: "parallel",
            why: e.to_string(),
        })
}

/// The pieces of one tensor a load read, keyed by the tensor's address in the manifest.
pub(crate) struct PieceCrc {
    key: usize,
    pieces: Vec<Piece>,
}

impl Link {
    /// The tables of this link that `opts` selects, in manifest order (see
    /// [`select_tables`]); a delta's are refused, as they are only what changed.
    pub(crate) fn selected_tables(&self, opts: &LoadOptions) -> Result<Vec<&TableManifest>> {
        if let Some(p) = &self.manifest().parent {
            // A delta's tables hold only what changed: read alone they would be a wrong model.
            return Err(Error::Mismatch(format!(
                "{} is a delta checkpoint of {}: its rows are only what changed since then; \
                 read it through its chain (saver_io::Checkpoint::open, or any saver command), or \
                 compact it into a full checkpoint (saver compact)",
                self.location(),
                p.path
            )));
        }
        select_tables(self, opts)
    }

    /// Slots of `t` a restore keeps.
    pub(crate) fn kept_slots(t: &TableManifest, exclude: &Option<GlobSet>) -> Vec<SlotSpec> {
        t.slots
            .iter()
            .filter(|s| exclude.as_ref().is_none_or(|g| !g.is_match(&s.name)))
            .cloned()
            .collect()
    }

    /// The entries of `seg`'s bucket index, read as `raw`: checked against its CRC32 and for
    /// order, and that they name only the segment's buckets and rows.
    fn bucket_entries(seg: &SegmentManifest, raw: &[u8]) -> Result<Vec<u64>> {
        let t = &seg.bucket_index;
        if crc32fast::hash(raw) != t.crc32 {
            return Err(Error::Corrupt {
                file: t.file.clone(),
                what: format!("tensor {:?} fails its CRC32 check", t.name),
            });
        }
        let entries: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let corrupt = |what: &str| Error::Corrupt {
            file: t.file.clone(),
            what: format!("bucket index {:?} {what}", t.name),
        };
        let mut prev: Option<(u64, u64)> = None;
        for &e in &entries {
            let (b, r) = (e >> 48, e & ((1 << 48) - 1));
            if prev.is_some_and(|(pb, pr)| b <= pb || r <= pr)
                || r >= seg.rows
                || (prev.is_none() && r != 0)
            {
                return Err(corrupt("is not strictly increasing within the segment"));
            }
            if b < u64::from(seg.buckets[0]) || b >= u64::from(seg.buckets[1]) {
                return Err(corrupt("names a bucket outside the segment"));
            }
            prev = Some((b, r));
        }
        Ok(entries)
    }

    /// Where the first row of `bucket` lies in a segment with bucket index `entries`: the row
    /// itself, or the rows whose ids must be scanned for it. The index may name only every k-th
    /// non-empty bucket (see FORMAT.md): the first row of `bucket` then lies in the group that
    /// starts at the last entry at or before it.
    fn first_row_of(seg: &SegmentManifest, entries: &[u64], bucket: u32) -> RowOf {
        let row_of = |e: u64| e & ((1 << 48) - 1);
        if bucket >= seg.buckets[1] {
            return RowOf::Found(seg.rows);
        }
        let pos = entries.partition_point(|&e| (e >> 48) <= u64::from(bucket));
        if pos == 0 {
            return RowOf::Found(0);
        }
        let start = row_of(entries[pos - 1]);
        if entries[pos - 1] >> 48 == u64::from(bucket) {
            return RowOf::Found(start);
        }
        let end = entries.get(pos).map_or(seg.rows, |&e| row_of(e));
        RowOf::Scan(start..end)
    }

    /// Checks that table `t` of the checkpoint can fill a target with `key` ids and `wanted` slots.
    pub(crate) fn check_target(
        &self,
        t: &TableManifest,
        key: KeyDtype,
        wanted: &[SlotSpec],
    ) -> Result<()> {
        if key != t.key_dtype {
            return Err(Error::Mismatch(format!(
                "table {:?} has {} ids, the target expects {key}",
                t.name, t.key_dtype
            )));
        }
        for want in wanted {
            let have = t
                .slots
                .iter()
                .find(|s| s.name == want.name)
                .ok_or_else(|| {
                    Error::Mismatch(format!(
                        "table {:?} has no slot {:?} in {}",
                        t.name,
                        want.name,
                        self.location()
                    ))
                })?;
            if have.dtype != want.dtype || have.shape != want.shape {
                return Err(Error::Mismatch(format!(
                    "table {:?} slot {:?} is {} {:?} in the checkpoint, the target expects {} {:?}",
                    t.name, want.name, have.dtype, have.shape, want.dtype, want.shape
                )));
            }
        }
        Ok(())
    }

    /// The reads that deliver each request `(table, wanted slots, target buckets)`: one per
    /// segment overlapping the target, with its row range found through the segment's bucket
    /// index. The bucket indexes of the segments cut by a target's edges (of every table) are
    /// read in one batch, then the ids scanned at those edges in a second: two rounds of
    /// requests to a remote store, not two a segment. A segment read whole needs neither: its
    /// index is read and checked with its first rows.
    pub(crate) fn segment_reads<'m>(
        &'m self,
        requests: &[(&'m TableManifest, &[SlotSpec], Range<u32>)],
        report: &mut LoadReport,
    ) -> Result<Vec<Vec<SegmentRead<'m>>>> {
        let mut reads = Vec::new();
        let mut owner = Vec::new();
        for (n, (t, wanted, target)) in requests.iter().enumerate() {
            for p in &t.partitions {
                let slot_map = Arc::new(slot_map(t, p, wanted)?);
                for seg in &p.segments {
                    let lo = seg.buckets[0].max(target.start);
                    let hi = seg.buckets[1].min(target.end);
                    if lo >= hi {
                        continue;
                    }
                    let whole = seg.buckets[0] >= target.start && seg.buckets[1] <= target.end;
                    reads.push(SegmentRead {
                        table: t,
                        seg,
                        slot_map: slot_map.clone(),
                        rows: 0..seg.rows,
                        target: lo..hi,
                        whole,
                    });
                    owner.push(n);
                }
            }
        }
        // The bucket index is read (and CRC-checked) even when the whole segment is wanted: it
        // costs 8 bytes per non-empty bucket, and a load must refuse a corrupt checkpoint
        // whatever tensor the corruption hit. A whole segment's rows need nothing of it, so its
        // index is read with its first rows, beside them in the file ([`Self::read_rows_into`]),
        // instead of in this batch, which the rows of the segments cut by a target's edges wait on.
        let first = |r: &SegmentRead<'_>| !index_with_rows(r);
        let mut raws: Vec<Vec<u8>> = reads
            .iter()
            .map(|r| {
                let len = if first(r) { r.seg.bucket_index.len } else { 0 };
                vec![0u8; len as usize]
            })
            .collect();
        let mut batch: Vec<(&TensorRef, u64, &mut [u8])> = reads
            .iter()
            .zip(raws.iter_mut())
            .filter(|(r, _)| first(r))
            .map(|(r, raw)| (&r.seg.bucket_index, 0, raw.as_mut_slice()))
            .collect();
        self.read_tensor_ranges(&mut batch)?;
        drop(batch);
        // The first row of each read's target edges; an edge the index does not pin down is
        // found by scanning ids, queued here.
        let mut edges = vec![[0u64; 2]; reads.len()];
        let mut scans: Vec<EdgeScan> = Vec::new();
        for (i, (r, raw)) in reads.iter().zip(&raws).enumerate() {
            // Counted here, checked here or with the segment's first rows.
            report.tensors_checked += 1;
            if !first(r) {
                edges[i] = [0, r.seg.rows];
                continue;
            }
            let entries = Self::bucket_entries(r.seg, raw)?;
            for (k, bucket) in [r.target.start, r.target.end].into_iter().enumerate() {
                match Self::first_row_of(r.seg, &entries, bucket) {
                    RowOf::Found(row) => edges[i][k] = row,
                    RowOf::Scan(rows) => {
                        let ids = vec![0u8; ((rows.end - rows.start) * 8) as usize];
                        scans.push(EdgeScan {
                            read: i,
                            edge: k,
                            bucket,
                            rows,
                            ids,
                        });
                    }
                }
            }
        }
        drop(raws);
        let mut batch: Vec<(&TensorRef, u64, &mut [u8])> = scans
            .iter_mut()
            .map(|e| {
                (
                    &reads[e.read].seg.ids,
                    e.rows.start * 8,
                    e.ids.as_mut_slice(),
                )
            })
            .collect();
        self.read_tensor_ranges(&mut batch)?;
        drop(batch);
        for EdgeScan {
            read: i,
            edge: k,
            bucket,
            rows,
            ids,
        } in scans
        {
            let skip = ids
                .chunks_exact(8)
                .position(|c| {
                    PartitionRule::bucket_of(u64::from_le_bytes(c.try_into().expect("8 bytes")))
                        >= bucket
                })
                .map_or(rows.end - rows.start, |n| n as u64);
            edges[i][k] = rows.start + skip;
        }
        let mut out: Vec<Vec<SegmentRead<'m>>> = requests.iter().map(|_| Vec::new()).collect();
        for ((mut r, [lo, hi]), n) in reads.into_iter().zip(edges).zip(owner) {
            r.rows = lo..hi;
            debug_assert!(!r.whole || r.rows == (0..r.seg.rows));
            out[n].push(r);
        }
        Ok(out)
    }

    /// Reads rows `rows` of `r`: ids (8 bytes each) into `ids`, wanted slots into `slots`. Records
    /// the CRC32 pieces read (for [`Link::check_pieces`]), and checks the ids against the
    /// bucket rule and order.
    pub(crate) fn read_rows_into(
        &self,
        r: &SegmentRead<'_>,
        rows: Range<u64>,
        ids: &mut [u8],
        slots: &mut [&mut [u8]],
        pieces: &mut Vec<PieceCrc>,
        gaps: &EdgeGaps,
    ) -> Result<u64> {
        // The ids and wanted slots of these rows in one call: neighbours in one file (all of a
        // segment's tensors, when the rows are the whole segment) become one request.
        let outs = std::iter::once(&mut *ids).chain(slots.iter_mut().map(|s| &mut **s));
        let mut reads: Vec<(&TensorRef, u64, &mut [u8])> = r
            .columns()
            .zip(outs)
            .map(|((t, width), out)| (t, rows.start * width, out))
            .collect();
        // The rest of the blocks these rows cut, which their checks need: it touches the rows'
        // bytes, so it travels in their requests.
        let beside: Vec<(&TensorRef, Range<u64>)> = reads
            .iter()
            .flat_map(|(t, at, buf)| {
                gaps.take_beside(t, &(*at..*at + buf.len() as u64))
                    .into_iter()
                    .map(move |g| (*t, g))
            })
            .collect();
        let mut gap_bufs: Vec<Vec<u8>> = beside
            .iter()
            .map(|(_, g)| vec![0; (g.end - g.start) as usize])
            .collect();
        for ((t, g), buf) in beside.iter().zip(gap_bufs.iter_mut()) {
            reads.push((t, g.start, buf.as_mut_slice()));
        }
        // A whole segment's bucket index, with its first rows ([`Self::segment_reads`]).
        let index_here = index_with_rows(r) && rows.start == 0;
        let index_len = if index_here {
            r.seg.bucket_index.len
        } else {
            0
        };
        let mut index = vec![0u8; index_len as usize];
        let rows_and_gaps = reads.len();
        if !index.is_empty() {
            reads.push((&r.seg.bucket_index, 0, index.as_mut_slice()));
        }
        self.read_tensor_ranges(&mut reads)?;
        for (t, offset, buf) in &reads[..rows_and_gaps] {
            let mut of_tensor = Vec::new();
            pieces::push(t, *offset, buf, &mut of_tensor);
            pieces.push(PieceCrc {
                key: pieces::key(t),
                pieces: of_tensor,
            });
        }
        drop(reads);
        if index_here {
            Self::bucket_entries(r.seg, &index)?;
        }
        // Ids must be in the target's buckets and sorted by (bucket, id): a corrupt id is named
        // as such, before the CRC32 checks at the end would call its tensor corrupt.
        let mut prev: Option<(u32, u64)> = None;
        for c in ids.chunks_exact(8) {
            let id = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            let b = PartitionRule::bucket_of(id);
            if !r.target.contains(&b) || prev.is_some_and(|p| p >= (b, id)) {
                return Err(Error::Corrupt {
                    file: r.seg.ids.file.clone(),
                    what: format!(
                        "tensor {:?} holds id {} out of bucket order (table {:?})",
                        r.seg.ids.name,
                        r.table.key_dtype.format_id(id),
                        r.table.name
                    ),
                });
            }
            prev = Some((b, id));
        }
        Ok(ids.len() as u64 + slots.iter().map(|s| s.len() as u64).sum::<u64>())
    }

    /// The bytes that the checks of `reads` will need besides their rows: the rest of each
    /// checksummed block cut by a read's first or last row ([`pieces::planned_gaps`]), for
    /// [`Self::read_rows_into`] to read with the rows beside them.
    pub(crate) fn edge_gaps<'r, 'm: 'r>(
        reads: impl Iterator<Item = &'r SegmentRead<'m>>,
    ) -> EdgeGaps {
        let mut by: HashMap<usize, (&TensorRef, Vec<Range<u64>>)> = HashMap::new();
        for r in reads.filter(|r| !r.whole && !r.rows.is_empty()) {
            for (t, width) in r.columns() {
                by.entry(pieces::key(t))
                    .or_insert_with(|| (t, Vec::new()))
                    .1
                    .push(r.rows.start * width..r.rows.end * width);
            }
        }
        let mut gaps = EdgeGaps::default();
        for (t, ranges) in by.into_values() {
            gaps.plan(t, &ranges);
        }
        gaps
    }

    pub(crate) fn load_sinks(
        &self,
        sinks: &[(u32, &TableManifest, &dyn TableSink)],
        opts: &LoadOptions,
    ) -> Result<LoadReport> {
        let start = Instant::now();
        let mut report = LoadReport::default();
        let mut requests = Vec::with_capacity(sinks.len());
        // The sinks' slots were checked against the tables' by the load (see
        // `Checkpoint::restore`).
        for &(j, t, sink) in sinks {
            let target = PartitionRule::bucket_range(j, opts.shard_num);
            requests.push((t, sink.wanted_slots(), target));
        }
        let mut reads = Vec::new();
        let mut work = Vec::new();
        let chunk_bytes = if self.is_remote() {
            opts.chunk_bytes.max(REMOTE_CHUNK_BYTES)
        } else {
            opts.chunk_bytes
        };
        for (i, of_sink) in self
            .segment_reads(&requests, &mut report)?
            .into_iter()
            .enumerate()
        {
            for r in of_sink {
                for rows in r.chunks(chunk_bytes) {
                    work.push((i, reads.len(), rows));
                }
                reads.push(r);
            }
        }
        let gaps = Self::edge_gaps(reads.iter());
        let pool = reader_pool(reader_threads(self, opts.parallel))?;
        let results: Result<Vec<(u64, u64, Vec<PieceCrc>)>> = pool.install(|| {
            work.par_iter()
                .map_init(
                    || (Vec::<u8>::new(), Vec::<Vec<u8>>::new(), Vec::<u64>::new()),
                    |(idbuf, slotbufs, ids), &(sink, read, ref rows)| {
                        let r: &SegmentRead<'_> = &reads[read];
                        let n = (rows.end - rows.start) as usize;
                        idbuf.resize(n * 8, 0);
                        slotbufs.resize_with(r.slot_map.len(), Vec::new);
                        for (k, &s) in r.slot_map.iter().enumerate() {
                            slotbufs[k].resize(n * (r.seg.slots[s].len / r.seg.rows) as usize, 0);
                        }
                        let mut pieces = Vec::new();
                        let bytes = {
                            let mut outs: Vec<&mut [u8]> =
                                slotbufs.iter_mut().map(Vec::as_mut_slice).collect();
                            self.read_rows_into(
                                r,
                                rows.clone(),
                                idbuf,
                                &mut outs,
                                &mut pieces,
                                &gaps,
                            )?
                        };
                        ids.clear();
                        ids.extend(
                            idbuf
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
                        );
                        let slices: Vec<&[u8]> = slotbufs.iter().map(Vec::as_slice).collect();
                        sinks[sink].2.insert_chunk(ids, &slices)?;
                        Ok((n as u64, bytes, pieces))
                    },
                )
                .collect()
        });
        let mut pieces = Vec::new();
        for (rows, bytes, p) in results? {
            report.rows += rows;
            report.bytes_kept += bytes;
            pieces.extend(p);
        }
        pool.install(|| self.check_pieces(pieces, &mut report))?;
        report.load_seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Checks the CRC32s of every tensor a load read, whole or in part. In a tensor read only in
    /// part (a segment at the edge of the target's buckets), each checksummed block the load
    /// touched is completed by reading the bytes the load left out of it, so that every byte
    /// returned was checked (those reads count in the checkpoint's [`Link::bytes_fetched`],
    /// and so in the load's read amplification); the tensors count in `report.tensors_checked`.
    pub(crate) fn check_pieces(
        &self,
        pieces: Vec<PieceCrc>,
        report: &mut LoadReport,
    ) -> Result<()> {
        let mut by: HashMap<usize, Vec<Piece>> = HashMap::new();
        for p in pieces {
            by.entry(p.key).or_default().extend(p.pieces);
        }
        let mut tensors = Vec::with_capacity(by.len());
        for t in self.manifest().tensor_refs() {
            if let Some(ps) = by.remove(&pieces::key(t)) {
                tensors.push((t, ps));
            }
        }
        // Completing edge tensors reads from many files; on a remote store, one at a time would
        // cost a round trip each. Each check is mostly a wait for one small read, so a remote
        // store's checks run [`REMOTE_CHECKS_IN_FLIGHT`] at once, whatever the load's threads.
        let remote_many = self.is_remote() && tensors.len() > REMOTE_CHUNKS_IN_FLIGHT;
        let threads = REMOTE_CHECKS_IN_FLIGHT.min(tensors.len());
        let check_all = || -> Result<Vec<u64>> {
            tensors
                .into_par_iter()
                .map(|(t, ps)| {
                    pieces::check(self, t, ps)?.ok_or_else(|| Error::Corrupt {
                        file: t.file.clone(),
                        what: format!("tensor {:?} fails its CRC32 check", t.name),
                    })
                })
                .collect()
        };
        let checked = if remote_many {
            reader_pool(threads)?.install(check_all)?
        } else {
            check_all()?
        };
        report.tensors_checked += checked.len() as u64;
        Ok(())
    }
}

/// Whether the bucket index of `r`'s segment is read and checked with its first rows rather
/// than before any: when the whole segment is read, whose rows need nothing of it.
fn index_with_rows(r: &SegmentRead<'_>) -> bool {
    r.whole && r.seg.rows > 0
}

/// Which of partition `p`'s slot tensors holds each of the `wanted` slots of table `t`; an error
/// naming the slot and shard if the save filtered one out.
pub(crate) fn slot_map(
    t: &TableManifest,
    p: &saver_core::manifest::PartitionManifest,
    wanted: &[SlotSpec],
) -> Result<Vec<usize>> {
    wanted
        .iter()
        .map(|want| {
            p.slots.iter().position(|s| *s == want.name).ok_or_else(|| {
                Error::Mismatch(format!(
                    "table {:?} slot {:?} was not saved for shard {} (filtered out)",
                    t.name, want.name, p.shard
                ))
            })
        })
        .collect()
}

/// The tables of `link`'s manifest that `opts` selects, in manifest order (the companion tables
/// of removed ids are not tables): `opts.tables`' globs, then `opts.table_filter`, after
/// checking that every `opts.required_tables` is there.
pub(crate) fn select_tables<'l>(
    link: &'l Link,
    opts: &LoadOptions,
) -> Result<Vec<&'l TableManifest>> {
    let tables = || {
        link.manifest()
            .tables
            .iter()
            .filter(|t| saver_core::naming::removed_table_of(&t.name).is_none())
    };
    for r in &opts.required_tables {
        if tables().all(|t| &t.name != r) {
            return Err(Error::Mismatch(format!(
                "required table {r:?} is not in the checkpoint {} (it has: {})",
                link.location(),
                tables()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let set = globs("tables", &opts.tables)?;
    Ok(tables()
        .filter(|t| set.as_ref().is_none_or(|s| s.is_match(&t.name)))
        .filter(|t| opts.table_filter.as_ref().is_none_or(|f| f(&t.name)))
        .collect())
}

/// Rows of `t` a target owning buckets `range` should receive: each saved partition's rows prorated
/// by the share of its buckets the target owns (the rule spreads ids evenly over buckets). Sizing
/// a table up front spares it rehashing every row each time it doubles. Bounded by the manifest's
/// row counts, which `Link::open` checked against the tensors present in the files.
pub(crate) fn expected_rows(t: &TableManifest, range: Range<u32>) -> usize {
    let rows: u64 = t
        .partitions
        .iter()
        .map(|p| {
            let [lo, hi] = p.buckets;
            let overlap = u64::from(hi.min(range.end).saturating_sub(lo.max(range.start)));
            let width = u64::from(hi.saturating_sub(lo)).max(1);
            (u128::from(p.rows) * u128::from(overlap)).div_ceil(u128::from(width)) as u64
        })
        .sum();
    usize::try_from(rows).unwrap_or(usize::MAX)
}

/// Reads whole the dense tensors of `refs` (each from the checkpoint given with it) that `set`
/// selects (all if `None`), each checked against its CRC32, counted into `report`.
pub(crate) fn read_dense_refs<'a>(
    refs: impl IntoIterator<Item = (&'a Link, &'a saver_core::manifest::DenseManifest)>,
    set: &Option<GlobSet>,
    report: &mut LoadReport,
) -> Result<Vec<LoadedDense>> {
    let wanted: Vec<_> = refs
        .into_iter()
        .filter(|(_, d)| set.as_ref().is_none_or(|s| s.is_match(&d.tensor.name)))
        .collect();
    // Several at once: from a remote store, each waits on a round trip.
    let out: Vec<LoadedDense> = wanted
        .into_par_iter()
        .map(|(ckpt, d)| {
            Ok(LoadedDense {
                name: d.tensor.name.clone(),
                dtype: d.tensor.dtype,
                shape: d.tensor.shape.clone(),
                data: ckpt.read_dense(&d.tensor.name)?,
            })
        })
        .collect::<Result<_>>()?;
    for d in &out {
        report.bytes_kept += d.data.len() as u64;
        report.tensors_checked += 1;
    }
    Ok(out)
}

/// `table`, with change tracking on if `opts` asks for it.
pub(crate) fn tracked_if(table: EmbeddingTable, opts: &LoadOptions) -> Result<EmbeddingTable> {
    Ok(if opts.change_tracking {
        table.with_change_tracking()?
    } else {
        table
    })
}

/// Makes the save `save_id` the baseline of every restored table, when tracking.
pub(crate) fn set_baselines(
    shards: &[RestoredShard],
    opts: &LoadOptions,
    save_id: &str,
) -> Result<()> {
    if opts.change_tracking {
        for t in shards.iter().flat_map(|s| &s.tables) {
            t.set_baseline(save_id)?;
        }
    }
    Ok(())
}

pub(crate) fn target_shards(opts: &LoadOptions) -> Result<Vec<u32>> {
    PartitionRule::check_shard(opts.shard_index.unwrap_or(0), opts.shard_num)?;
    Ok(match opts.shard_index {
        Some(j) => vec![j],
        None => (0..opts.shard_num).collect(),
    })
}

pub(crate) fn finish_report(r: &mut LoadReport) {
    r.read_amplification = if r.bytes_kept == 0 {
        1.0
    } else {
        r.bytes_read as f64 / r.bytes_kept as f64
    };
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("shard_num", &self.shard_num)
            .field("shard_index", &self.shard_index)
            .field("parallel", &self.parallel)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("tables", &self.tables)
            .field("table_filter", &self.table_filter.as_ref().map(|_| "<fn>"))
            .field("exclude_slots", &self.exclude_slots)
            .field("dense", &self.dense)
            .field("load_dense", &self.load_dense)
            .field("rename", &self.rename)
            .field("required_tables", &self.required_tables)
            .field("huge_pages", &self.huge_pages)
            .field("change_tracking", &self.change_tracking)
            .finish()
    }
}

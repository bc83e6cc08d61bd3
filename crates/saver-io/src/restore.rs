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

use crc32fast::Hasher;
use globset::{Glob, GlobSet, GlobSetBuilder};
use rayon::prelude::*;
use serde::Serialize;

use saver_core::manifest::{SegmentManifest, TableManifest, TensorRef};
use saver_core::{Dtype, EmbeddingTable, KeyDtype, PartitionRule, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::reader::Checkpoint;

/// Where restored rows go. Implemented by [`EmbeddingTable`]; implement it for your own table.
pub trait TableSink: Send + Sync {
    /// Id dtype the sink expects.
    fn key_dtype(&self) -> KeyDtype;
    /// Slots the sink wants, by name, with the dtype and row shape it expects.
    fn slots(&self) -> &[SlotSpec];
    /// Inserts rows: `slots[s]` holds `ids.len()` rows of `self.slots()[s]`.
    fn insert_chunk(&self, ids: &[u64], slots: &[&[u8]]) -> saver_core::Result<()>;
}

impl TableSink for EmbeddingTable {
    fn key_dtype(&self) -> KeyDtype {
        SparseTable::key_dtype(self)
    }
    fn slots(&self) -> &[SlotSpec] {
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
    /// Reader threads.
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
    /// Checkpoint table name → name in the target.
    pub rename: BTreeMap<String, String>,
    /// Tables that must be in the checkpoint (by checkpoint name).
    pub required_tables: Vec<String>,
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
        }
    }
}

fn globs(option: &'static str, patterns: &[String]) -> Result<Option<GlobSet>> {
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
    /// Tensor bytes read from storage (ids, slots, bucket indexes, dense).
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

/// The tables of one target shard.
pub struct RestoredShard {
    /// Target shard index.
    pub shard: u32,
    /// One table per selected checkpoint table, under its target name.
    pub tables: Vec<EmbeddingTable>,
}

/// The result of an owning restore: fresh tables, so a failed restore leaves nothing half-loaded.
pub struct Restored {
    /// Target shards, in order.
    pub shards: Vec<RestoredShard>,
    /// Dense tensors, in name order.
    pub dense: Vec<LoadedDense>,
    /// Figures.
    pub report: LoadReport,
}

/// One unit of read work.
struct Work<'m> {
    sink: usize,
    table: &'m TableManifest,
    seg: &'m SegmentManifest,
    /// Which of the segment's slot tensors feed the sink's slots, in sink order.
    slot_map: Arc<Vec<usize>>,
    rows: Range<u64>,
    target: Range<u32>,
    whole: bool,
}

struct PieceCrc {
    key: usize,
    offset: u64,
    hasher: Hasher,
}

impl Checkpoint {
    /// The selected tables, in manifest order.
    fn selected_tables(&self, opts: &LoadOptions) -> Result<Vec<&TableManifest>> {
        let set = globs("tables", &opts.tables)?;
        for r in &opts.required_tables {
            if self.manifest().table(r).is_none() {
                return Err(Error::Mismatch(format!(
                    "required table {r:?} is not in the checkpoint {} (it has: {})",
                    self.location(),
                    self.manifest()
                        .tables
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        Ok(self
            .manifest()
            .tables
            .iter()
            .filter(|t| set.as_ref().is_none_or(|s| s.is_match(&t.name)))
            .filter(|t| opts.table_filter.as_ref().is_none_or(|f| f(&t.name)))
            .collect())
    }

    /// Slots of `t` a restore keeps.
    fn kept_slots(t: &TableManifest, exclude: &Option<GlobSet>) -> Vec<SlotSpec> {
        t.slots
            .iter()
            .filter(|s| exclude.as_ref().is_none_or(|g| !g.is_match(&s.name)))
            .cloned()
            .collect()
    }

    /// Restores into fresh [`EmbeddingTable`]s: every target shard of `opts.shard_num`, or only
    /// `opts.shard_index`. Either everything loads, or an error is returned and nothing is kept.
    pub fn restore(&self, opts: &LoadOptions) -> Result<Restored> {
        let exclude = globs("exclude_slots", &opts.exclude_slots)?;
        let tables = self.selected_tables(opts)?;
        let targets = target_shards(opts)?;
        let mut shards = Vec::new();
        for &j in &targets {
            let mut ts = Vec::new();
            for t in &tables {
                let name = opts
                    .rename
                    .get(&t.name)
                    .cloned()
                    .unwrap_or_else(|| t.name.clone());
                ts.push(EmbeddingTable::new(
                    name,
                    t.key_dtype,
                    Self::kept_slots(t, &exclude),
                )?);
            }
            shards.push(RestoredShard {
                shard: j,
                tables: ts,
            });
        }
        let sinks: Vec<(u32, &TableManifest, &dyn TableSink)> = shards
            .iter()
            .flat_map(|s| {
                s.tables
                    .iter()
                    .zip(&tables)
                    .map(move |(sink, t)| (s.shard, *t, sink as &dyn TableSink))
            })
            .collect();
        let mut report = self.load_sinks(&sinks, opts)?;
        let dense = if opts.load_dense {
            self.load_dense(opts, &mut report)?
        } else {
            Vec::new()
        };
        finish_report(&mut report);
        Ok(Restored {
            shards,
            dense,
            report,
        })
    }

    /// Loads target shard `shard` of `opts.shard_num` into user sinks: `sink_for` returns the sink
    /// for a checkpoint table (by manifest entry), or `None` to skip it. Dense tensors are not
    /// loaded (see [`Self::load_dense_tensors`]). A sink may hold part of the rows if this fails:
    /// load into a fresh table and swap it in on success, as [`Self::restore`] does.
    pub fn load_into<'s>(
        &self,
        shard: u32,
        opts: &LoadOptions,
        sink_for: &dyn Fn(&TableManifest) -> Option<&'s dyn TableSink>,
    ) -> Result<LoadReport> {
        if shard >= opts.shard_num {
            return Err(saver_core::Error::ShardOutOfRange {
                index: shard,
                num: opts.shard_num,
            }
            .into());
        }
        let tables = self.selected_tables(opts)?;
        let sinks: Vec<(u32, &TableManifest, &dyn TableSink)> = tables
            .iter()
            .filter_map(|t| sink_for(t).map(|s| (shard, *t, s)))
            .collect();
        let mut report = self.load_sinks(&sinks, opts)?;
        finish_report(&mut report);
        Ok(report)
    }

    /// Loads the selected dense tensors, CRC-checked.
    pub fn load_dense_tensors(&self, opts: &LoadOptions) -> Result<Vec<LoadedDense>> {
        let mut r = LoadReport::default();
        self.load_dense(opts, &mut r)
    }

    fn load_dense(&self, opts: &LoadOptions, report: &mut LoadReport) -> Result<Vec<LoadedDense>> {
        let set = globs("dense", &opts.dense)?;
        let mut out = Vec::new();
        for d in &self.manifest().dense {
            if set.as_ref().is_some_and(|s| !s.is_match(&d.tensor.name)) {
                continue;
            }
            let data = self.read_dense(&d.tensor.name)?;
            report.bytes_read += data.len() as u64;
            report.bytes_kept += data.len() as u64;
            report.tensors_checked += 1;
            out.push(LoadedDense {
                name: d.tensor.name.clone(),
                dtype: d.tensor.dtype,
                shape: d.tensor.shape.clone(),
                data,
            });
        }
        Ok(out)
    }

    /// Reads the row range of `seg` within buckets `target`, using the bucket index.
    fn rows_in(
        &self,
        seg: &SegmentManifest,
        target: &Range<u32>,
        report: &mut u64,
    ) -> Result<Range<u64>> {
        let t = &seg.bucket_index;
        let mut raw = vec![0u8; t.len as usize];
        self.read_tensor_range(t, 0, &mut raw)?;
        *report += t.len;
        if crc32fast::hash(&raw) != t.crc32 {
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
        let first_row_at = |bucket: u32| -> u64 {
            entries
                .iter()
                .find(|&&e| (e >> 48) >= u64::from(bucket))
                .map_or(seg.rows, |&e| e & ((1 << 48) - 1))
        };
        Ok(first_row_at(target.start)..first_row_at(target.end))
    }

    fn load_sinks(
        &self,
        sinks: &[(u32, &TableManifest, &dyn TableSink)],
        opts: &LoadOptions,
    ) -> Result<LoadReport> {
        let start = Instant::now();
        let mut report = LoadReport::default();
        let mut work = Vec::new();
        for (i, &(j, t, sink)) in sinks.iter().enumerate() {
            if sink.key_dtype() != t.key_dtype {
                return Err(Error::Mismatch(format!(
                    "table {:?} has {} ids, the target expects {}",
                    t.name,
                    t.key_dtype,
                    sink.key_dtype()
                )));
            }
            for want in sink.slots() {
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
            let target = PartitionRule::bucket_range(j, opts.shard_num);
            for p in &t.partitions {
                let slot_map: Vec<usize> = sink
                    .slots()
                    .iter()
                    .map(|want| {
                        p.slots.iter().position(|s| *s == want.name).ok_or_else(|| {
                            Error::Mismatch(format!(
                                "table {:?} slot {:?} was not saved for shard {} (filtered out)",
                                t.name, want.name, p.shard
                            ))
                        })
                    })
                    .collect::<Result<_>>()?;
                let slot_map = Arc::new(slot_map);
                for seg in &p.segments {
                    let lo = seg.buckets[0].max(target.start);
                    let hi = seg.buckets[1].min(target.end);
                    if lo >= hi {
                        continue;
                    }
                    let whole = seg.buckets[0] >= target.start && seg.buckets[1] <= target.end;
                    let rows = if whole {
                        0..seg.rows
                    } else {
                        self.rows_in(seg, &(lo..hi), &mut report.bytes_read)?
                    };
                    let row_bytes = 8 + slot_map
                        .iter()
                        .map(|&k| seg.slots[k].len / seg.rows.max(1))
                        .sum::<u64>();
                    let step = (opts.chunk_bytes / row_bytes).max(1);
                    let mut r = rows.start;
                    while r < rows.end {
                        let end = (r + step).min(rows.end);
                        work.push(Work {
                            sink: i,
                            table: t,
                            seg,
                            slot_map: slot_map.clone(),
                            rows: r..end,
                            target: lo..hi,
                            whole,
                        });
                        r = end;
                    }
                }
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.parallel.max(1))
            .thread_name(|i| format!("saver-read-{i}"))
            .build()
            .map_err(|e| Error::InvalidOption {
                option: "parallel",
                why: e.to_string(),
            })?;
        let results: Result<Vec<(u64, u64, Vec<PieceCrc>)>> = pool.install(|| {
            work.par_iter()
                .map_init(
                    || (Vec::<u8>::new(), Vec::<Vec<u8>>::new()),
                    |(idbuf, slotbufs), w| self.read_work(w, sinks[w.sink].2, idbuf, slotbufs),
                )
                .collect()
        });
        let mut pieces = Vec::new();
        for (rows, bytes, p) in results? {
            report.rows += rows;
            report.bytes_read += bytes;
            report.bytes_kept += bytes;
            pieces.extend(p);
        }
        report.tensors_checked += self.check_whole_crcs(pieces)?;
        report.load_seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    fn read_work(
        &self,
        w: &Work<'_>,
        sink: &dyn TableSink,
        idbuf: &mut Vec<u8>,
        slotbufs: &mut Vec<Vec<u8>>,
    ) -> Result<(u64, u64, Vec<PieceCrc>)> {
        let n = (w.rows.end - w.rows.start) as usize;
        let mut pieces = Vec::new();
        let mut read = |t: &TensorRef, row_bytes: u64, buf: &mut Vec<u8>| -> Result<()> {
            buf.resize(n * row_bytes as usize, 0);
            let offset = w.rows.start * row_bytes;
            self.read_tensor_range(t, offset, buf)?;
            if w.whole {
                let mut hasher = Hasher::new();
                hasher.update(buf);
                pieces.push(PieceCrc {
                    key: t as *const TensorRef as usize,
                    offset,
                    hasher,
                });
            }
            Ok(())
        };
        read(&w.seg.ids, 8, idbuf)?;
        slotbufs.resize_with(w.slot_map.len(), Vec::new);
        for (k, &s) in w.slot_map.iter().enumerate() {
            let t = &w.seg.slots[s];
            read(t, t.len / w.seg.rows, &mut slotbufs[k])?;
        }
        let ids: Vec<u64> = idbuf
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // Ids must be in the target's buckets and sorted by (bucket, id): catches corrupt bytes in
        // partially read tensors, which no CRC covers.
        let mut prev: Option<(u32, u64)> = None;
        for &id in &ids {
            let b = PartitionRule::bucket_of(id);
            if !w.target.contains(&b) || prev.is_some_and(|p| p >= (b, id)) {
                return Err(Error::Corrupt {
                    file: w.seg.ids.file.clone(),
                    what: format!(
                        "tensor {:?} holds id {} out of bucket order (table {:?})",
                        w.seg.ids.name,
                        w.table.key_dtype.format_id(id),
                        w.table.name
                    ),
                });
            }
            prev = Some((b, id));
        }
        let slices: Vec<&[u8]> = slotbufs.iter().map(Vec::as_slice).collect();
        sink.insert_chunk(&ids, &slices)?;
        let bytes = idbuf.len() as u64 + slices.iter().map(|s| s.len() as u64).sum::<u64>();
        Ok((n as u64, bytes, pieces))
    }

    /// Combines the CRCs of tensors read whole and compares them with the manifest.
    fn check_whole_crcs(&self, pieces: Vec<PieceCrc>) -> Result<u64> {
        let mut by: HashMap<usize, Vec<PieceCrc>> = HashMap::new();
        for p in pieces {
            by.entry(p.key).or_default().push(p);
        }
        let mut checked = 0;
        for t in self.manifest().tensor_refs() {
            let Some(mut ps) = by.remove(&(t as *const TensorRef as usize)) else {
                continue;
            };
            ps.sort_by_key(|p| p.offset);
            let mut h = Hasher::new();
            for p in &ps {
                h.combine(&p.hasher);
            }
            if h.finalize() != t.crc32 {
                return Err(Error::Corrupt {
                    file: t.file.clone(),
                    what: format!("tensor {:?} fails its CRC32 check", t.name),
                });
            }
            checked += 1;
        }
        Ok(checked)
    }
}

fn target_shards(opts: &LoadOptions) -> Result<Vec<u32>> {
    if opts.shard_num == 0 {
        return Err(saver_core::Error::ZeroShards.into());
    }
    match opts.shard_index {
        Some(j) if j >= opts.shard_num => Err(saver_core::Error::ShardOutOfRange {
            index: j,
            num: opts.shard_num,
        }
        .into()),
        Some(j) => Ok(vec![j]),
        None => Ok((0..opts.shard_num).collect()),
    }
}

fn finish_report(r: &mut LoadReport) {
    r.read_amplification = if r.bytes_kept == 0 {
        1.0
    } else {
        r.bytes_read as f64 / r.bytes_kept as f64
    };
}

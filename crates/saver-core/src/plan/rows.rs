//! The rows a table's scan kept, from the scan until the writer takes them.
//!
//! The scan groups rows by the bucket's high byte (256 *regions*) and counts every bucket, which is
//! all the layout needs. A region is sorted by (bucket, id) only when the writer first reaches it,
//! and dropped once the writer has taken all its rows. So the sort runs in the writer threads,
//! between writes, on a region that fits in cache, instead of holding up the first write; and the
//! scanned rows can wait in a [`Spill`] store instead of memory, which bounds the plan of a table
//! of billions of rows to the scan's buffers and the few *units* being written.
//!
//! A unit is what is sorted and held at once: a region, or, for a spilled region of more than
//! [`unit_rows`] rows (at the default chunk size, tables of more than about 16 M rows), a run of
//! its buckets. Such a region
//! is split the first time the writer reaches it: its spilled rows are read back a run at a time
//! and appended again, by unit. That costs one more pass over the region's 16 bytes a row, and
//! keeps what a writer thread holds at a few MiB, where a whole region of a table of a billion
//! rows would be 64 MiB.
//!
//! A table whose snapshot lists the rows of a bucket range on demand (files already grouped by
//! bucket) is neither held nor spilled past the plan memory: the scan only counts its buckets,
//! and each unit's rows are listed again when the writer reaches it ([`Store::Relisted`]).

use std::io;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::partition::{PartitionRule, BUCKETS};
use crate::table::TableSnapshot;

/// Scratch storage for the rows a plan keeps out of memory (see `PlanOptions::plan_memory`):
/// append-only, read back at the offsets `append` returned, private to the process, and gone
/// when dropped.
pub trait Spill: Send + Sync {
    /// Stores `bytes`; returns the offset to read them back from.
    fn append(&self, bytes: &[u8]) -> io::Result<u64>;
    /// Fills `buf` with the bytes stored at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// Bytes all threads scanning a spilled table may buffer at once (256 regions of ids and handles
/// each): what a spilled plan holds, whatever the table's size.
const SPILL_BUFFER_BYTES: usize = 16 << 20;

/// Most rows of one region a scanning thread buffers before appending them: 16 KiB appends.
const SPILL_ROWS_MAX: usize = 2048;

/// Fewest: below this, appends get small enough for their system call to dominate.
const SPILL_ROWS_MIN: usize = 64;

/// Most rows of a spilled region a writer thread sorts and holds at once: 16 bytes each, an
/// eighth of its chunk buffer (64 Ki rows, 1 MiB, at the default 8 MiB chunk), so that the one
/// knob which sizes a writer thread's memory sizes this too. A larger region is split into units
/// of whole buckets (a single bucket may exceed it).
pub(crate) fn unit_rows(chunk_bytes: u64) -> usize {
    usize::try_from(chunk_bytes / 128).map_or(usize::MAX, |n| n.max(1))
}

/// Bytes a thread splitting a region buffers, across all of the region's units.
const SPLIT_BUFFER_BYTES: usize = 1 << 20;

/// The region of an id: its bucket's high byte.
pub(crate) fn high_byte(id: u64) -> usize {
    (PartitionRule::bucket_of(id) >> 8) as usize
}

/// Part of a table's rows held in memory, ordered by region: `high[h]..high[h + 1]` is region `h`.
pub(crate) struct MemoryPart {
    pub ids: Vec<u64>,
    /// One per id, or empty when the part came without handles.
    pub handles: Vec<u64>,
    pub high: Vec<usize>,
}

/// A run of one region's rows in the spill.
#[derive(Clone, Copy)]
struct Extent {
    ids_at: u64,
    handles_at: u64,
    rows: usize,
}

/// Where a table's spilled rows are: the store and, per region, its runs.
pub(crate) struct Spilled {
    table: String,
    spill: Arc<dyn Spill>,
    extents: Mutex<Vec<Vec<Extent>>>,
    /// Rows a scanning thread buffers per region.
    run_rows: usize,
}

impl Spilled {
    pub(super) fn new(table: &str, spill: Arc<dyn Spill>) -> Self {
        let threads = rayon::current_num_threads().max(1);
        Self {
            table: table.to_string(),
            spill,
            extents: Mutex::new(vec![Vec::new(); 256]),
            run_rows: (SPILL_BUFFER_BYTES / (threads * 256 * 16))
                .clamp(SPILL_ROWS_MIN, SPILL_ROWS_MAX),
        }
    }

    fn error(&self, source: io::Error) -> Error {
        Error::Spill {
            table: self.table.clone(),
            source,
        }
    }

    /// Buffers for one scanning thread, taken from `pool` when it has some of the right size.
    pub(super) fn buffer<'p>(&self, pool: &'p RunBufferPool) -> SpillBuffer<'_, 'p> {
        SpillBuffer {
            to: self,
            runs: pool.take(256, self.run_rows),
            pool,
        }
    }

    /// Files `run` as one of region `h`'s.
    fn record(&self, h: usize, run: Extent) {
        self.extents.lock().unwrap_or_else(PoisonError::into_inner)[h].push(run);
    }

    /// Stores one run of rows (`handles`: one per id) and returns where it is.
    fn append_run(&self, ids: &[u64], handles: &[u64]) -> Result<Extent> {
        let ids_at = self
            .spill
            .append(bytemuck::cast_slice(ids))
            .map_err(|e| self.error(e))?;
        let handles_at = self
            .spill
            .append(bytemuck::cast_slice(handles))
            .map_err(|e| self.error(e))?;
        Ok(Extent {
            ids_at,
            handles_at,
            rows: ids.len(),
        })
    }

    /// Appends the rows of `runs` to `ids` and, with `with_handles`, their handles to `handles`.
    fn read_runs(
        &self,
        runs: &[Extent],
        with_handles: bool,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> Result<()> {
        for run in runs {
            let at = ids.len();
            ids.resize(at + run.rows, 0);
            self.spill
                .read_at(run.ids_at, bytemuck::cast_slice_mut(&mut ids[at..]))
                .map_err(|e| self.error(e))?;
            if with_handles {
                handles.resize(at + run.rows, 0);
                self.spill
                    .read_at(run.handles_at, bytemuck::cast_slice_mut(&mut handles[at..]))
                    .map_err(|e| self.error(e))?;
            }
        }
        Ok(())
    }
}

/// A scanning thread's buffers into a [`Spilled`]: one run per region, appended when full.
pub(crate) struct SpillBuffer<'s, 'p> {
    to: &'s Spilled,
    runs: RunBuffers,
    pool: &'p RunBufferPool,
}

impl SpillBuffer<'_, '_> {
    /// Moves rows out of `ids` and `handles` (one per id, or empty: handles are then zero, and
    /// the table is read by id) into the buffers. `buckets` holds each id's bucket, computed
    /// once by the scan for every use it has there.
    pub(super) fn take(
        &mut self,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
        buckets: &[u32],
    ) -> Result<()> {
        debug_assert_eq!(ids.len(), buckets.len());
        for (i, (&id, &bucket)) in ids.iter().zip(buckets).enumerate() {
            let h = (bucket >> 8) as usize;
            let handle = handles.get(i).copied().unwrap_or(0);
            if let Some(run) = self.runs.push(self.to, h, id, handle)? {
                self.to.record(h, run);
            }
        }
        ids.clear();
        handles.clear();
        Ok(())
    }

    /// Appends what is left, and gives the (empty) buffers back to the pool for the next part.
    pub(super) fn finish(self) -> Result<()> {
        let SpillBuffer { to, mut runs, pool } = self;
        for h in 0..256 {
            if let Some(run) = runs.flush(to, h)? {
                to.record(h, run);
            }
        }
        pool.give(runs);
        Ok(())
    }
}

/// Empty [`RunBuffers`] that scans of parts hand on to each other. A plan scans hundreds of
/// parts (every spilled table's); when each part made its buffers anew, 512 vectors grew from
/// empty by doubling, part after part. The pool holds at most as many buffers as parts were
/// scanned at once, and lives as long as the plan's scan.
#[derive(Default)]
pub(crate) struct RunBufferPool(Mutex<Vec<RunBuffers>>);

impl RunBufferPool {
    /// Empty buffers for `keys` keys of `run_rows` rows.
    fn take(&self, keys: usize, run_rows: usize) -> RunBuffers {
        let mut idle = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match idle
            .iter()
            .position(|b| b.lens.len() == keys && b.run_rows == run_rows)
        {
            Some(i) => idle.swap_remove(i),
            None => RunBuffers::new(keys, run_rows),
        }
    }

    fn give(&self, runs: RunBuffers) {
        debug_assert!(runs.lens.iter().all(|&n| n == 0), "buffers given back full");
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(runs);
    }
}

/// Rows buffered by key (a region while scanning, a part while splitting a region), each key's
/// appended to the spill as a run once `run_rows` have gathered.
///
/// One flat array of ids and one of handles, `run_rows` slots per key: a row's push is two
/// stores and a length update, with no per-key vector to look up, grow or reallocate.
struct RunBuffers {
    ids: Vec<u64>,
    handles: Vec<u64>,
    /// Rows buffered per key.
    lens: Vec<usize>,
    run_rows: usize,
}

impl RunBuffers {
    fn new(keys: usize, run_rows: usize) -> Self {
        // Zeroed memory: the kernel maps its pages only as rows reach them.
        Self {
            ids: vec![0; keys * run_rows],
            handles: vec![0; keys * run_rows],
            lens: vec![0; keys],
            run_rows,
        }
    }

    /// Buffers one row under `key`; returns the run appended to `to` when that fills the buffer.
    #[inline]
    fn push(&mut self, to: &Spilled, key: usize, id: u64, handle: u64) -> Result<Option<Extent>> {
        let n = self.lens[key];
        let at = key * self.run_rows + n;
        self.ids[at] = id;
        self.handles[at] = handle;
        self.lens[key] = n + 1;
        if n + 1 < self.run_rows {
            return Ok(None);
        }
        self.flush(to, key)
    }

    /// Appends what `key` holds to `to`, if anything; returns the run.
    fn flush(&mut self, to: &Spilled, key: usize) -> Result<Option<Extent>> {
        let n = self.lens[key];
        if n == 0 {
            return Ok(None);
        }
        let at = key * self.run_rows;
        let run = to.append_run(&self.ids[at..at + n], &self.handles[at..at + n])?;
        self.lens[key] = 0;
        Ok(Some(run))
    }
}

/// Where a table's scanned rows wait.
pub(crate) enum Store {
    Memory(Vec<MemoryPart>),
    Spilled(Spilled),
    /// Nowhere: each unit's rows are listed again by the table's snapshot
    /// ([`TableSnapshot::rows_in_buckets`]) and those of the buckets this plan keeps are taken.
    Relisted(KeptBuckets),
}

/// The buckets whose rows a plan keeps (of the shards it plans, not all blocks dropped).
pub(crate) struct KeptBuckets(Vec<u64>);

impl KeptBuckets {
    /// The buckets `keep` says yes to.
    pub(super) fn new(keep: impl Fn(u32) -> bool) -> Self {
        let mut bits = vec![0u64; BUCKETS as usize / 64];
        for b in 0..BUCKETS {
            if keep(b) {
                bits[b as usize / 64] |= 1 << (b % 64);
            }
        }
        Self(bits)
    }

    fn contains(&self, bucket: u32) -> bool {
        self.0[bucket as usize / 64] >> (bucket % 64) & 1 == 1
    }
}

/// A unit's sorted rows while the writer still needs them.
#[derive(Default)]
struct Cached {
    sorted: Option<Arc<SortedUnit>>,
    /// Rows of the unit the writer has taken.
    taken: usize,
}

/// One unit's rows, sorted by (bucket, id bits).
struct SortedUnit {
    ids: Vec<u64>,
    handles: Vec<u64>,
}

/// What is sorted and held at once: a whole region, or one part of a split region.
#[derive(Clone, Copy)]
struct Unit {
    region: usize,
    /// `Some(p)`: part `p` of the region's [`Split`].
    part: Option<usize>,
}

/// A spilled region too large to sort at once, cut into units of whole buckets.
struct Split {
    /// The part of each bucket of the region, by the bucket's low byte.
    part_of_low: Vec<usize>,
    parts: usize,
    /// Each part's runs in the spill, once the region has been split.
    runs: Mutex<Option<Arc<Vec<Vec<Extent>>>>>,
}

/// A table's scanned rows, in the order they are written, produced unit by unit.
pub(crate) struct TableRows {
    table: String,
    key_dtype: KeyDtype,
    store: Store,
    with_handles: bool,
    units: Vec<Unit>,
    /// `unit_start[u]..unit_start[u + 1]`: unit `u`'s rows in the table's sorted order.
    unit_start: Vec<usize>,
    /// Per region: how it is split, when it is.
    splits: Vec<Option<Split>>,
    cache: Vec<Mutex<Cached>>,
}

impl TableRows {
    /// Rows waiting in `store`. `bucket_start` (one per bucket, and the end) comes from the scan's
    /// bucket counts; `with_handles` is false when some rows came without a handle. A spilled
    /// region of more than `unit_rows` rows is sorted in units of at most that many (see the
    /// module docs): [`unit_rows`] of the plan's `chunk_bytes`.
    pub(super) fn new(
        table: &str,
        key_dtype: KeyDtype,
        store: Store,
        with_handles: bool,
        bucket_start: &[u64],
        unit_rows: usize,
    ) -> Self {
        // Units of a table out of memory are bounded; one in memory is sorted a region at a time.
        let spilled = !matches!(store, Store::Memory(_));
        let start = |b: usize| bucket_start[b] as usize;
        let (mut units, mut unit_start, mut splits) = (Vec::new(), Vec::new(), Vec::new());
        for h in 0..256 {
            if !spilled || start((h + 1) << 8) - start(h << 8) <= unit_rows {
                units.push(Unit {
                    region: h,
                    part: None,
                });
                unit_start.push(start(h << 8));
                splits.push(None);
                continue;
            }
            // Whole buckets, in order, while they fit.
            let mut part_of_low = vec![0; 256];
            let (mut part, mut rows) = (0, 0);
            for (low, part_of) in part_of_low.iter_mut().enumerate() {
                let b = (h << 8) | low;
                let n = start(b + 1) - start(b);
                if low == 0 || (rows > 0 && rows + n > unit_rows) {
                    if low > 0 {
                        part += 1;
                    }
                    units.push(Unit {
                        region: h,
                        part: Some(part),
                    });
                    unit_start.push(start(b));
                    rows = 0;
                }
                *part_of = part;
                rows += n;
            }
            splits.push(Some(Split {
                part_of_low,
                parts: part + 1,
                runs: Mutex::new(None),
            }));
        }
        unit_start.push(start(bucket_start.len() - 1));
        Self {
            table: table.to_string(),
            key_dtype,
            store,
            with_handles,
            cache: units.iter().map(|_| Mutex::default()).collect(),
            units,
            unit_start,
            splits,
        }
    }

    /// Whether the rows wait in a spill store.
    pub(super) fn spilled(&self) -> bool {
        matches!(self.store, Store::Spilled(_))
    }

    /// Puts the ids of `range` (positions in the table's sorted order) in `ids` and, when the
    /// table has handles, their handles in `handles` (else leaves it empty). With `take`, the
    /// rows count as written: a unit is freed once all its rows are taken. Reading without
    /// taking never keeps a unit in memory. `snapshot` is the table's, which lists the rows of
    /// a [`Store::Relisted`] table.
    pub(super) fn copy(
        &self,
        snapshot: &dyn TableSnapshot,
        range: Range<usize>,
        take: bool,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> Result<()> {
        ids.clear();
        handles.clear();
        let mut at = range.start;
        while at < range.end {
            // The last unit starting at or before `at`: the one holding it (empty units start
            // where the next one does).
            let u = self.unit_start.partition_point(|&s| s <= at) - 1;
            let base = self.unit_start[u];
            let end = self.unit_start[u + 1].min(range.end);
            let sorted = self.unit(snapshot, u, if take { end - at } else { 0 })?;
            ids.extend_from_slice(&sorted.ids[at - base..end - base]);
            if self.with_handles {
                handles.extend_from_slice(&sorted.handles[at - base..end - base]);
            }
            at = end;
        }
        Ok(())
    }

    /// Unit `u`, sorted; `take` of its rows count as written.
    fn unit(&self, snapshot: &dyn TableSnapshot, u: usize, take: usize) -> Result<Arc<SortedUnit>> {
        let len = self.unit_start[u + 1] - self.unit_start[u];
        // Held while sorting, so that two writer threads needing the unit sort it once.
        let mut cached = self.cache[u].lock().unwrap_or_else(PoisonError::into_inner);
        let sorted = match &cached.sorted {
            Some(r) => Arc::clone(r),
            None => Arc::new(self.sort(snapshot, self.units[u], len)?),
        };
        if take > 0 {
            cached.taken += take;
            cached.sorted = (cached.taken < len).then(|| Arc::clone(&sorted));
        }
        Ok(sorted)
    }

    /// Gathers unit `unit`'s `len` rows and sorts them.
    fn sort(&self, snapshot: &dyn TableSnapshot, unit: Unit, len: usize) -> Result<SortedUnit> {
        let h = unit.region;
        let mut ids = Vec::with_capacity(len);
        let mut handles = Vec::with_capacity(if self.with_handles { len } else { 0 });
        match &self.store {
            Store::Memory(parts) => {
                for p in parts {
                    let r = p.high[h]..p.high[h + 1];
                    ids.extend_from_slice(&p.ids[r.clone()]);
                    if self.with_handles {
                        handles.extend_from_slice(&p.handles[r]);
                    }
                }
            }
            Store::Spilled(s) => match unit.part {
                None => {
                    let runs = s.extents.lock().unwrap_or_else(PoisonError::into_inner)[h].clone();
                    s.read_runs(&runs, self.with_handles, &mut ids, &mut handles)?;
                }
                Some(p) => {
                    let runs = self.split(h, s)?;
                    s.read_runs(&runs[p], self.with_handles, &mut ids, &mut handles)?;
                }
            },
            Store::Relisted(kept) => {
                let buckets = self.unit_buckets(unit);
                if !snapshot.rows_in_buckets(buckets.clone(), &mut ids, &mut handles)? {
                    return Err(Error::Table {
                        table: self.table.clone(),
                        message: "the snapshot no longer lists rows by bucket".into(),
                    });
                }
                if handles.len() != ids.len() {
                    return Err(Error::Table {
                        table: self.table.clone(),
                        message: format!(
                            "buckets {buckets:?} listed {} ids with {} handles",
                            ids.len(),
                            handles.len()
                        ),
                    });
                }
                let mut n = 0;
                for i in 0..ids.len() {
                    let b = PartitionRule::bucket_of(ids[i]);
                    if buckets.contains(&b) && kept.contains(b) {
                        ids[n] = ids[i];
                        handles[n] = handles[i];
                        n += 1;
                    }
                }
                ids.truncate(n);
                handles.truncate(if self.with_handles { n } else { 0 });
            }
        }
        if ids.len() != len {
            return Err(Error::Table {
                table: self.table.clone(),
                message: format!(
                    "internal: a unit of bucket region {h} holds {} rows, the scan counted {len}",
                    ids.len()
                ),
            });
        }
        sort_region(&mut ids, &mut handles);
        // Equal ids share a bucket, so a duplicate is always adjacent to its twin here.
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateId {
                table: self.table.clone(),
                id: self.key_dtype.format_id(w[0]),
            });
        }
        Ok(SortedUnit { ids, handles })
    }

    /// The buckets of `unit`: its region's, or those of its part.
    fn unit_buckets(&self, unit: Unit) -> Range<u32> {
        let h = unit.region as u32;
        match (unit.part, &self.splits[unit.region]) {
            (Some(p), Some(split)) => {
                let first = split.part_of_low.iter().position(|&q| q == p).unwrap_or(0);
                let end = split
                    .part_of_low
                    .iter()
                    .rposition(|&q| q == p)
                    .map_or(0, |l| l + 1);
                (h << 8) + first as u32..(h << 8) + end as u32
            }
            _ => h << 8..(h + 1) << 8,
        }
    }

    /// The runs of each part of split region `h`, splitting it on first use: its spilled runs
    /// are read back one at a time and their rows appended again, by part.
    fn split(&self, h: usize, s: &Spilled) -> Result<Arc<Vec<Vec<Extent>>>> {
        let Some(split) = &self.splits[h] else {
            unreachable!("a part of region {h}, which is not split")
        };
        // Held while splitting, so that threads needing other parts wait for this one split.
        let mut done = split.runs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(runs) = &*done {
            return Ok(Arc::clone(runs));
        }
        let scanned = s.extents.lock().unwrap_or_else(PoisonError::into_inner)[h].clone();
        let run_rows =
            (SPLIT_BUFFER_BYTES / (split.parts * 16)).clamp(SPILL_ROWS_MIN, SPILL_ROWS_MAX);
        let mut buffers = RunBuffers::new(split.parts, run_rows);
        let mut runs = vec![Vec::new(); split.parts];
        let (mut ids, mut handles) = (Vec::new(), Vec::new());
        for run in &scanned {
            ids.clear();
            handles.clear();
            // Handles too, even zeros, so that every run has both, as the scan's do.
            s.read_runs(std::slice::from_ref(run), true, &mut ids, &mut handles)?;
            for (&id, &handle) in ids.iter().zip(&handles) {
                let p = split.part_of_low[(PartitionRule::bucket_of(id) & 0xff) as usize];
                if let Some(run) = buffers.push(s, p, id, handle)? {
                    runs[p].push(run);
                }
            }
        }
        for (p, part_runs) in runs.iter_mut().enumerate() {
            if let Some(run) = buffers.flush(s, p)? {
                part_runs.push(run);
            }
        }
        // The scan's runs of the region are dead space in the spill now; their list goes.
        s.extents.lock().unwrap_or_else(PoisonError::into_inner)[h] = Vec::new();
        let runs = Arc::new(runs);
        *done = Some(Arc::clone(&runs));
        Ok(runs)
    }

    /// Rows of each unit, in order (tests check no unit is larger than it must be).
    #[cfg(test)]
    pub(super) fn unit_rows(&self) -> Vec<usize> {
        self.unit_start.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Sorts one region by the bucket's low byte, then each bucket by id, moving `handles` (empty, or
/// one per id) along.
///
/// An American-flag pass (each misplaced id swapped straight into its place) writes to only 256
/// bucket heads, which stay in cache; the per-bucket sorts are tiny. The result depends only on
/// the set of ids, whatever order the table produced them in.
fn sort_region(ids: &mut [u64], handles: &mut [u64]) {
    let low = flag_pass(ids, handles, |id| {
        (PartitionRule::bucket_of(id) & 0xff) as usize
    });
    let mut pairs = Vec::new();
    for b in 0..256 {
        let range = low[b]..low[b + 1];
        if handles.is_empty() {
            ids[range].sort_unstable();
        } else {
            pairs.clear();
            pairs.extend(
                ids[range.clone()]
                    .iter()
                    .zip(&handles[range.clone()])
                    .map(|(&i, &h)| (i, h)),
            );
            pairs.sort_unstable_by_key(|p| p.0);
            for (k, (id, h)) in pairs.iter().enumerate() {
                ids[range.start + k] = *id;
                handles[range.start + k] = *h;
            }
        }
    }
}

/// One in-place American-flag pass over 256 regions by `key(id) < 256`, moving `handles` (empty,
/// or one per id) along. Returns the 257 region starts.
pub(crate) fn flag_pass(
    ids: &mut [u64],
    handles: &mut [u64],
    key: impl Fn(u64) -> usize,
) -> Vec<usize> {
    let mut start = vec![0usize; 257];
    for &id in ids.iter() {
        start[key(id) + 1] += 1;
    }
    for r in 0..256 {
        start[r + 1] += start[r];
    }
    let mut next = start.clone();
    for r in 0..256 {
        while next[r] < start[r + 1] {
            let i = next[r];
            let target = key(ids[i]);
            if target == r {
                next[r] += 1;
            } else {
                // Everything before next[target] is already in place, so that slot is free.
                let j = next[target];
                ids.swap(i, j);
                if !handles.is_empty() {
                    handles.swap(i, j);
                }
                next[target] += 1;
            }
        }
    }
    start
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A spill store in a vector.
    #[derive(Default)]
    pub(crate) struct MemorySpill(Mutex<Vec<u8>>);

    impl Spill for MemorySpill {
        fn append(&self, bytes: &[u8]) -> io::Result<u64> {
            let mut v = self.0.lock().unwrap();
            let at = v.len() as u64;
            v.extend_from_slice(bytes);
            Ok(at)
        }

        fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            let v = self.0.lock().unwrap();
            let at = offset as usize;
            buf.copy_from_slice(&v[at..at + buf.len()]);
            Ok(())
        }
    }

    #[test]
    fn a_part_hands_its_emptied_buffers_to_the_next() {
        let pool = RunBufferPool::default();
        let spilled = Spilled::new("t", Arc::new(MemorySpill::default()));
        let ids: Vec<u64> = (0..3000).collect();
        let buckets: Vec<u32> = ids.iter().map(|&i| PartitionRule::bucket_of(i)).collect();
        let mut first = spilled.buffer(&pool);
        // A second part scanned meanwhile gets buffers of its own.
        let second = spilled.buffer(&pool);
        let memory = [&first, &second].map(|b| b.runs.ids.as_ptr());
        assert_ne!(memory[0], memory[1]);
        let handles: Vec<u64> = ids.iter().map(|&i| !i).collect();
        first
            .take(&mut ids.clone(), &mut handles.clone(), &buckets)
            .unwrap();
        first.finish().unwrap();
        second.finish().unwrap();

        // Every row went to the spill, each in a run of its own region.
        let extents = spilled.extents.lock().unwrap().clone();
        let spilled_rows: usize = extents.iter().flatten().map(|e| e.rows).sum();
        assert_eq!(spilled_rows, ids.len());
        for (h, runs) in extents.iter().enumerate() {
            let (mut got, mut got_handles) = (Vec::new(), Vec::new());
            spilled
                .read_runs(runs, true, &mut got, &mut got_handles)
                .unwrap();
            assert!(got.iter().all(|&i| high_byte(i) == h));
            assert!(got.iter().zip(&got_handles).all(|(&i, &g)| g == !i));
        }

        // The next part reuses the first part's memory, with nothing left in it.
        let next = spilled.buffer(&pool);
        assert!(memory.contains(&next.runs.ids.as_ptr()));
        assert!(next.runs.lens.iter().all(|&n| n == 0));
    }

    /// A spill store whose disk is full.
    pub(crate) struct FailingSpill;

    impl Spill for FailingSpill {
        fn append(&self, _: &[u8]) -> io::Result<u64> {
            Err(io::Error::other("disk full"))
        }

        fn read_at(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Err(io::Error::other("disk full"))
        }
    }
}

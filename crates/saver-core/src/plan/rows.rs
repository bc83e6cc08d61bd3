//! The rows a table's scan kept, from the scan until the writer takes them.
//!
//! The scan groups rows by the bucket's high byte (256 *regions*) and counts every bucket, which is
//! all the layout needs. A region is sorted by (bucket, id) only when the writer first reaches it,
//! and dropped once the writer has taken all its rows. So the sort runs in the writer threads,
//! between writes, on a region that fits in cache, instead of holding up the first write; and the
//! scanned rows can wait in a [`Spill`] store instead of memory, which bounds the plan of a table
//! of billions of rows to the scan's buffers and the few regions being written.

use std::io;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::partition::PartitionRule;

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
    pub fn new(table: &str, spill: Arc<dyn Spill>) -> Self {
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

    /// Buffers for one scanning thread.
    pub fn buffer(&self) -> SpillBuffer<'_> {
        SpillBuffer {
            to: self,
            ids: vec![Vec::new(); 256],
            handles: vec![Vec::new(); 256],
        }
    }

    fn append(&self, h: usize, ids: &[u64], handles: &[u64]) -> Result<()> {
        let ids_at = self
            .spill
            .append(bytemuck::cast_slice(ids))
            .map_err(|e| self.error(e))?;
        let handles_at = self
            .spill
            .append(bytemuck::cast_slice(handles))
            .map_err(|e| self.error(e))?;
        self.extents.lock().unwrap_or_else(PoisonError::into_inner)[h].push(Extent {
            ids_at,
            handles_at,
            rows: ids.len(),
        });
        Ok(())
    }
}

/// A scanning thread's buffers into a [`Spilled`]: one run per region, appended when full.
pub(crate) struct SpillBuffer<'s> {
    to: &'s Spilled,
    ids: Vec<Vec<u64>>,
    handles: Vec<Vec<u64>>,
}

impl SpillBuffer<'_> {
    /// Moves rows out of `ids` and `handles` (one per id, or empty: handles are then zero, and
    /// the table is read by id) into the buffers.
    pub fn take(&mut self, ids: &mut Vec<u64>, handles: &mut Vec<u64>) -> Result<()> {
        for (i, &id) in ids.iter().enumerate() {
            let h = high_byte(id);
            self.ids[h].push(id);
            self.handles[h].push(handles.get(i).copied().unwrap_or(0));
            if self.ids[h].len() >= self.to.run_rows {
                self.flush(h)?;
            }
        }
        ids.clear();
        handles.clear();
        Ok(())
    }

    fn flush(&mut self, h: usize) -> Result<()> {
        if !self.ids[h].is_empty() {
            self.to.append(h, &self.ids[h], &self.handles[h])?;
            self.ids[h].clear();
            self.handles[h].clear();
        }
        Ok(())
    }

    /// Appends what is left.
    pub fn finish(mut self) -> Result<()> {
        (0..256).try_for_each(|h| self.flush(h))
    }
}

/// Where a table's scanned rows wait.
pub(crate) enum Store {
    Memory(Vec<MemoryPart>),
    Spilled(Spilled),
}

/// A region's sorted rows while the writer still needs them.
#[derive(Default)]
struct Cached {
    region: Option<Arc<Region>>,
    /// Rows of the region the writer has taken.
    taken: usize,
}

/// One region's rows, sorted by (bucket, id bits).
struct Region {
    ids: Vec<u64>,
    handles: Vec<u64>,
}

/// A table's scanned rows, in the order they are written, produced region by region.
pub(crate) struct TableRows {
    table: String,
    key_dtype: KeyDtype,
    store: Store,
    with_handles: bool,
    /// `region_start[h]..region_start[h + 1]`: region `h`'s rows in the table's sorted order.
    region_start: Vec<usize>,
    cache: Vec<Mutex<Cached>>,
}

impl TableRows {
    /// Rows waiting in `store`. `region_start` comes from the scan's bucket counts;
    /// `with_handles` is false when some rows came without a handle.
    pub fn new(
        table: &str,
        key_dtype: KeyDtype,
        store: Store,
        with_handles: bool,
        region_start: Vec<usize>,
    ) -> Self {
        Self {
            table: table.to_string(),
            key_dtype,
            store,
            with_handles,
            region_start,
            cache: (0..256).map(|_| Mutex::default()).collect(),
        }
    }

    /// Whether the rows wait in a spill store.
    pub fn spilled(&self) -> bool {
        matches!(self.store, Store::Spilled(_))
    }

    /// Puts the ids of `range` (positions in the table's sorted order) in `ids` and, when the
    /// table has handles, their handles in `handles` (else leaves it empty). With `take`, the
    /// rows count as written: a region is freed once all its rows are taken. Reading without
    /// taking never keeps a region in memory.
    pub fn copy(
        &self,
        range: Range<usize>,
        take: bool,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> Result<()> {
        ids.clear();
        handles.clear();
        let mut at = range.start;
        while at < range.end {
            // The last region starting at or before `at`: the one holding it (empty regions
            // start where the next one does).
            let h = self.region_start.partition_point(|&s| s <= at) - 1;
            let base = self.region_start[h];
            let end = self.region_start[h + 1].min(range.end);
            let region = self.region(h, if take { end - at } else { 0 })?;
            ids.extend_from_slice(&region.ids[at - base..end - base]);
            if self.with_handles {
                handles.extend_from_slice(&region.handles[at - base..end - base]);
            }
            at = end;
        }
        Ok(())
    }

    /// Region `h`, sorted; `take` of its rows count as written.
    fn region(&self, h: usize, take: usize) -> Result<Arc<Region>> {
        let len = self.region_start[h + 1] - self.region_start[h];
        // Held while sorting, so that two writer threads needing the region sort it once.
        let mut cached = self.cache[h].lock().unwrap_or_else(PoisonError::into_inner);
        let region = match &cached.region {
            Some(r) => Arc::clone(r),
            None => Arc::new(self.sort(h, len)?),
        };
        if take > 0 {
            cached.taken += take;
            cached.region = (cached.taken < len).then(|| Arc::clone(&region));
        }
        Ok(region)
    }

    /// Gathers region `h`'s `len` rows and sorts them.
    fn sort(&self, h: usize, len: usize) -> Result<Region> {
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
            Store::Spilled(s) => {
                let extents = s.extents.lock().unwrap_or_else(PoisonError::into_inner)[h].clone();
                for run in extents {
                    let at = ids.len();
                    ids.resize(at + run.rows, 0);
                    s.spill
                        .read_at(run.ids_at, bytemuck::cast_slice_mut(&mut ids[at..]))
                        .map_err(|e| s.error(e))?;
                    if self.with_handles {
                        handles.resize(at + run.rows, 0);
                        s.spill
                            .read_at(run.handles_at, bytemuck::cast_slice_mut(&mut handles[at..]))
                            .map_err(|e| s.error(e))?;
                    }
                }
            }
        }
        if ids.len() != len {
            return Err(Error::Table {
                table: self.table.clone(),
                message: format!(
                    "internal: bucket region {h} holds {} rows, the scan counted {len}",
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
        Ok(Region { ids, handles })
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

//! One table of a chain, resolved: [`ChainTable`], a k-way merge of the links' rows in bucket
//! order.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use saver_core::naming::removed_table_name;
use saver_core::partition::BUCKETS;
use saver_core::table::{RowChunk, TableSnapshot};
use saver_core::TableSchema;
use saver_core::{SlotSpec, SparseTable};

use super::ahead::Wanted;
use super::Checkpoint;
use crate::error::{Error, Result};
use crate::load::rows::{core_error as core, handles_of, BucketRows, SlotBuffers, VisitRows};
use crate::load::stored::StoredTable;
use crate::load::stored::ROW_BITS;

mod runs;
pub(super) use runs::{Run, RunReader};

/// Bits of a chain row handle below the link number: a [`StoredTable`] handle.
const LINK_SHIFT: u32 = 58;

/// What [`ChainTable::merge`] calls with each run of live rows: their ids, and the handle of
/// the first (the others follow it, rows of one link's segment).
type Emit<'a> = dyn FnMut(&[u64], u64) -> Result<()> + 'a;

/// What [`ChainTable::resolve_batches`] calls with each batch: its ids and runs, to take or
/// leave.
pub(super) type ResolvedBatch<'a> = dyn FnMut(&mut Vec<u64>, &mut Vec<Run>) -> Result<()> + 'a;

/// Ids read at a time by each link's cursor.
const CURSOR_IDS: u64 = 8192;

/// One link's part of a [`ChainTable`]: its rows, and for a delta, its removed ids.
struct Link<'c> {
    rows: StoredTable<'c>,
    removed: Option<StoredTable<'c>>,
}

/// A table of a [`Checkpoint`], resolved: the rows a full save of the newest state would hold.
pub struct ChainTable<'c> {
    schema: TableSchema,
    row_bytes: Vec<u64>,
    /// Newest first: the consecutive links that hold the table.
    links: Vec<Link<'c>>,
    /// Bucket ranges, each within one segment of every link: the scan parts.
    pub(super) parts: Vec<Range<u32>>,
    /// The number of live rows, counted (a merge of the ids of every link) when first asked:
    /// loads never ask, so they read only their buckets.
    rows: std::sync::OnceLock<u64>,
    /// Bytes of ids and rows read from the links' files so far.
    bytes_read: AtomicU64,
}

impl<'c> ChainTable<'c> {
    /// Table `name` of `chain` with slots `slots` (of the newest link's table).
    pub fn new(chain: &'c Checkpoint, name: &str, slots: Vec<SlotSpec>) -> Result<Self> {
        let newest = chain.newest().manifest();
        let Some(t) = newest.table(name) else {
            return Err(Error::Mismatch(format!(
                "table {name:?} is not in the checkpoint {}",
                chain.newest().location()
            )));
        };
        let mut links = Vec::new();
        for (i, ckpt) in chain.links.iter().enumerate() {
            let Some(tm) = ckpt.manifest().table(name) else {
                break;
            };
            let at_link = |e: Error| Error::Chain {
                link: chain.dirs[i].display().to_string(),
                message: format!("table {name:?}: {e}"),
            };
            if tm.key_dtype != t.key_dtype {
                return Err(at_link(Error::Mismatch(format!(
                    "ids are {}, the newest link's {}",
                    tm.key_dtype, t.key_dtype
                ))));
            }
            let rows = StoredTable::new(ckpt, tm, slots.clone()).map_err(at_link)?;
            let removed = match ckpt.manifest().parent {
                None => None,
                Some(_) => {
                    let rname = removed_table_name(name);
                    let rm = ckpt
                        .manifest()
                        .table(&rname)
                        .ok_or_else(|| Error::Corrupt {
                            file: ckpt.location(),
                            what: format!("delta without the table {rname:?} of removed ids"),
                        })?;
                    Some(StoredTable::new(ckpt, rm, Vec::new()).map_err(at_link)?)
                }
            };
            for table in std::iter::once(&rows).chain(&removed) {
                if table.segment_count() >= 1 << (LINK_SHIFT - ROW_BITS) {
                    return Err(at_link(Error::Mismatch(format!(
                        "{} segments, more than a chain can address",
                        table.segment_count()
                    ))));
                }
            }
            links.push(Link { rows, removed });
        }
        let mut bounds: Vec<u32> = vec![0, BUCKETS];
        for l in &links {
            bounds.extend(l.rows.boundaries());
            if let Some(r) = &l.removed {
                bounds.extend(r.boundaries());
            }
        }
        bounds.sort_unstable();
        bounds.dedup();
        let parts: Vec<Range<u32>> = bounds
            .windows(2)
            .map(|w| w[0]..w[1])
            .filter(|r| !r.is_empty())
            .collect();
        let row_bytes = slots
            .iter()
            .map(|s| s.row_bytes())
            .collect::<saver_core::Result<_>>()?;
        Ok(Self {
            schema: TableSchema::new(name, t.key_dtype, slots),
            row_bytes,
            links,
            parts,
            rows: std::sync::OnceLock::new(),
            bytes_read: AtomicU64::new(0),
        })
    }

    /// Counts the live rows: a merge of every link's ids.
    fn count_rows(&self) -> Result<u64> {
        if self.links.len() == 1 && self.links[0].removed.is_none() {
            return Ok(self.links[0].rows.rows());
        }
        self.count_buckets(0..BUCKETS)
    }

    /// The number of live rows. A chain whose ids cannot be read counts 0 here; reading its rows
    /// then fails with the reason.
    fn live_rows(&self) -> u64 {
        *self.rows.get_or_init(|| self.count_rows().unwrap_or(0))
    }

    /// Bytes of ids and rows read from the links' files so far (binary searches aside).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Checks every tensor of every link read only in part so far (a link's rows that later
    /// links replaced are not read) against its CRC32: see `StoredTable::finish_checks`. Call
    /// before returning or committing what was read.
    /// The bytes it reads count in [`Self::bytes_read`].
    pub(crate) fn finish_checks(&self) -> Result<()> {
        // Links at once: on a remote store, each waits on its requests.
        let read: u64 = self
            .links
            .par_iter()
            .flat_map_iter(|l| std::iter::once(&l.rows).chain(&l.removed))
            .map(StoredTable::finish_checks)
            .sum::<Result<u64>>()?;
        self.bytes_read.fetch_add(read, Ordering::Relaxed);
        Ok(())
    }

    /// Tensors of the links whose CRC32 was checked so far.
    pub(crate) fn tensors_checked(&self) -> u64 {
        self.links.iter().map(|l| l.rows.tensors_checked()).sum()
    }

    /// At least the live rows of `buckets`, from the links' manifests: their rows added up, an
    /// upper bound that a load sizes its tables with, so that their maps never grow (and
    /// rehash) on the way.
    pub(super) fn rows_at_most(&self, buckets: Range<u32>) -> usize {
        self.links
            .iter()
            .map(|l| crate::load::restore::expected_rows(l.rows.manifest(), buckets.clone()))
            .fold(0, usize::saturating_add)
    }

    /// What a load of `buckets` reads of every link first, for reading ahead: the bytes of each
    /// tensor `StoredTable::tensors_within` names (all of it), with their links.
    pub(super) fn tensors_within(&self, buckets: &Range<u32>) -> Vec<Wanted<'c>> {
        self.stored()
            .flat_map(|t| {
                let link = t.checkpoint();
                t.tensors_within(buckets)
                    .into_iter()
                    .map(move |r| (link, r, 0..r.len))
            })
            .collect()
    }

    /// What a load of `buckets` reads of every link next, once [`Self::tensors_within`] is held:
    /// the target's rows of the segments that straddle its edges (see
    /// `StoredTable::straddling_within`), with their links.
    pub(super) fn straddling_within(&self, buckets: &Range<u32>) -> Result<Vec<Wanted<'c>>> {
        let mut out = Vec::new();
        for t in self.stored() {
            let link = t.checkpoint();
            out.extend(
                t.straddling_within(buckets)?
                    .into_iter()
                    .map(|(r, bytes)| (link, r, bytes)),
            );
        }
        Ok(out)
    }

    /// Every link's tables: its rows, and its removed ids.
    fn stored(&self) -> impl Iterator<Item = &StoredTable<'c>> {
        self.links
            .iter()
            .flat_map(|l| std::iter::once(&l.rows).chain(&l.removed))
    }

    /// Bytes of one whole row: id and every slot.
    pub(super) fn full_row_bytes(&self) -> u64 {
        8 + self.row_bytes.iter().sum::<u64>()
    }

    /// Calls `emit(ids, handle)` for the live rows of `buckets` (within one part), in (bucket,
    /// id bits) order: `ids` are consecutive rows of one link's segment, from row `handle`.
    fn merge(&self, buckets: Range<u32>, emit: &mut Emit<'_>) -> Result<()> {
        let mut cursors = Vec::new();
        for (i, l) in self.links.iter().enumerate() {
            for (table, removal) in
                std::iter::once((&l.rows, false)).chain(l.removed.as_ref().map(|r| (r, true)))
            {
                if let Some((seg, rows)) = table.rows_of_buckets(buckets.clone())? {
                    if !rows.is_empty() {
                        cursors.push(Cursor::new(table, &self.bytes_read, i, removal, seg, rows));
                    }
                }
            }
        }
        // The cursor with the most rows (the full checkpoint's, as a rule) is emitted in runs up
        // to the next key of any other. The others are merged a batch at a time: every entry
        // they hold up to the least of their last keys, gathered in rank order and sorted by key
        // with a stable sort (which merges their sorted runs), so that the first entry of a key
        // is the one that decides it. A heap did the same a row at a time: `perf` gave it 40 %
        // more samples than the sort and the bulk's emission together.
        // On a remote store, each link's first ids at once rather than a round trip after
        // another.
        if cursors.len() > 1 && cursors.iter().any(|c| c.table.checkpoint().is_remote()) {
            cursors
                .par_iter_mut()
                .try_for_each(|c| c.fill().map(|_| ()))?;
        }
        let Some(b) = (0..cursors.len()).max_by_key(|&c| cursors[c].end - cursors[c].first) else {
            return Ok(());
        };
        let mut bulk = cursors.swap_remove(b);
        cursors.sort_by_key(Cursor::rank);
        let mut batch: Vec<Entry> = Vec::new();
        loop {
            let mut bound: Option<u128> = None;
            if cursors.len() > 1 && cursors.iter().any(|c| c.table.checkpoint().is_remote()) {
                cursors
                    .par_iter_mut()
                    .try_for_each(|c| c.fill().map(|_| ()))?;
            }
            for c in cursors.iter_mut() {
                if c.fill()? {
                    let last = c.keys[c.keys.len() - 1];
                    bound = Some(bound.map_or(last, |b| b.min(last)));
                }
            }
            let Some(bound) = bound else {
                return bulk.emit_below(None, emit);
            };
            batch.clear();
            for c in cursors.iter_mut() {
                let keys = &c.keys[c.pos..];
                let n = keys.partition_point(|&k| k <= bound);
                let rank = c.rank();
                batch.extend(keys[..n].iter().enumerate().map(|(i, &key)| Entry {
                    key,
                    handle: c.handle_at(c.pos + i),
                    rank,
                }));
                c.pos += n;
            }
            batch.sort_by_key(|e| e.key);
            let mut i = 0;
            while i < batch.len() {
                let Entry {
                    key,
                    mut handle,
                    mut rank,
                } = batch[i];
                bulk.emit_below(Some(key), emit)?;
                if bulk.fill()? && bulk.key() == key {
                    if bulk.rank() < rank {
                        (rank, handle) = (bulk.rank(), bulk.handle());
                    }
                    bulk.pos += 1;
                }
                i += 1;
                while i < batch.len() && batch[i].key == key {
                    i += 1;
                }
                if rank & 1 == 0 {
                    emit(&[key as u64], handle)?;
                }
            }
        }
    }

    /// Calls `each(ids, runs)` for the live rows of `buckets` in (bucket, id bits) order, at most
    /// `batch` at a time: their ids, and the runs of link rows that hold their slots (`at`
    /// counted from the batch's first row), for [`RunReader::fill`]. `each` may take both.
    pub(super) fn resolve_batches(
        &self,
        buckets: Range<u32>,
        batch: usize,
        each: &mut ResolvedBatch<'_>,
    ) -> Result<()> {
        let batch = batch.max(1);
        // Sized once for the batch, or for all the links' rows of `buckets` when that is less (a
        // vector doubling its way up to millions of ids copies them twice over), within a bound
        // that no manifest's row counts can raise.
        let rows = batch.min(self.rows_at_most(buckets.clone())).min(1 << 22);
        let mut ids = Vec::with_capacity(rows);
        let mut runs = Vec::with_capacity(rows / 8);
        for part in &self.parts {
            let r = part.start.max(buckets.start)..part.end.min(buckets.end);
            if r.is_empty() {
                continue;
            }
            self.merge(r, &mut |mut more, mut h| {
                while !more.is_empty() {
                    let n = more.len().min(batch - ids.len());
                    Run::push(&mut runs, h, ids.len(), n as u64);
                    ids.extend_from_slice(&more[..n]);
                    (more, h) = (&more[n..], h + n as u64);
                    if ids.len() >= batch {
                        each(&mut ids, &mut runs)?;
                        ids.clear();
                        runs.clear();
                    }
                }
                Ok(())
            })?;
        }
        if !ids.is_empty() {
            each(&mut ids, &mut runs)?;
        }
        Ok(())
    }

    /// The live ids of `buckets` in (bucket, id bits) order, and the runs of link rows that hold
    /// their slots (`at` counted from the first), for [`RunReader::fill`].
    pub(super) fn resolve(&self, buckets: Range<u32>) -> Result<(Vec<u64>, Vec<Run>)> {
        let mut out = (Vec::new(), Vec::new());
        self.resolve_batches(buckets, usize::MAX, &mut |ids, runs| {
            out = (std::mem::take(ids), std::mem::take(runs));
            Ok(())
        })?;
        Ok(out)
    }

    /// Visits the live rows of `buckets` in (bucket, id bits) order, at most `batch` at a time.
    pub(crate) fn visit_buckets(
        &self,
        buckets: Range<u32>,
        batch: usize,
        visit: &mut VisitRows<'_>,
    ) -> Result<()> {
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); self.schema.slots.len()];
        let mut reader = RunReader::default();
        self.resolve_batches(buckets, batch, &mut |ids, runs| {
            for (b, &w) in bufs.iter_mut().zip(&self.row_bytes) {
                b.resize(ids.len() * w as usize, 0);
            }
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            reader.fill(self, runs, &mut outs)?;
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            Ok(visit(ids, &views)?)
        })
    }

    /// The number of live rows of `buckets`: a merge of the links' ids, no slot read.
    pub(super) fn count_buckets(&self, buckets: Range<u32>) -> Result<u64> {
        let mut n = 0u64;
        for part in &self.parts {
            let r = part.start.max(buckets.start)..part.end.min(buckets.end);
            if !r.is_empty() {
                self.merge(r, &mut |ids, _| {
                    n += ids.len() as u64;
                    Ok(())
                })?;
            }
        }
        Ok(n)
    }

    /// Finds the live row of `id`: its handle, or `None` when the chain does not hold it.
    fn locate(&self, id: u64) -> Result<Option<u64>> {
        for (i, l) in self.links.iter().enumerate() {
            if let Some((s, r)) = l.rows.locate(id)? {
                return Ok(Some(
                    ((i as u64) << LINK_SHIFT) | ((s as u64) << ROW_BITS) | r,
                ));
            }
            if let Some(removed) = &l.removed {
                if removed.locate(id)?.is_some() {
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }
}

/// An entry of a link other than the merge's bulk one: its key, the handle of its row, and its
/// [`Cursor::rank`].
#[derive(Clone, Copy)]
struct Entry {
    key: u128,
    handle: u64,
    rank: u32,
}

/// Reads the ids of one link's rows (or removed ids) over a row range of one segment.
struct Cursor<'t, 'c> {
    table: &'t StoredTable<'c>,
    read: &'t AtomicU64,
    link: usize,
    removal: bool,
    seg: usize,
    /// Row of `ids[0]`.
    first: u64,
    end: u64,
    ids: Vec<u64>,
    /// The merge's key of each of `ids`: [`key_of`].
    keys: Vec<u128>,
    pos: usize,
    raw: Vec<u8>,
}

/// The order of a chain's rows as one number: (bucket, id bits), of id `id` in bucket `bucket`.
fn key_of(bucket: u32, id: u64) -> u128 {
    (u128::from(bucket) << 64) | u128::from(id)
}

impl<'t, 'c> Cursor<'t, 'c> {
    fn new(
        table: &'t StoredTable<'c>,
        read: &'t AtomicU64,
        link: usize,
        removal: bool,
        seg: usize,
        rows: Range<u64>,
    ) -> Self {
        Self {
            table,
            read,
            link,
            removal,
            seg,
            first: rows.start,
            end: rows.end,
            ids: Vec::new(),
            keys: Vec::new(),
            pos: 0,
            raw: Vec::new(),
        }
    }

    /// The handle of the current row.
    fn handle(&self) -> u64 {
        self.handle_at(self.pos)
    }

    /// The handle of row `at` of the ids held.
    fn handle_at(&self, at: usize) -> u64 {
        ((self.link as u64) << LINK_SHIFT)
            | ((self.seg as u64) << ROW_BITS)
            | (self.first + at as u64)
    }

    /// Emits the rows before key `next` (all rows when `None`) in runs, unless they are
    /// removals; stops at the first row of `next` or above.
    fn emit_below(&mut self, next: Option<u128>, emit: &mut Emit<'_>) -> Result<()> {
        while self.fill()? {
            let keys = &self.keys[self.pos..];
            let n = match next {
                None => keys.len(),
                Some(k) => keys.iter().position(|&x| x >= k).unwrap_or(keys.len()),
            };
            if n > 0 && !self.removal {
                emit(&self.ids[self.pos..self.pos + n], self.handle())?;
            }
            self.pos += n;
            if self.pos < self.ids.len() {
                break;
            }
        }
        Ok(())
    }

    /// Which entry of a key decides it, least first: the newest link's, its row before its
    /// removal.
    fn rank(&self) -> u32 {
        (self.link as u32) << 1 | u32::from(self.removal)
    }

    /// The current row's key; [`Cursor::fill`] said there is one.
    fn key(&self) -> u128 {
        self.keys[self.pos]
    }

    /// Whether there is a current row, reading the next ids when needed.
    fn fill(&mut self) -> Result<bool> {
        if self.pos < self.ids.len() {
            return Ok(true);
        }
        let start = self.first + self.ids.len() as u64;
        if start >= self.end {
            return Ok(false);
        }
        let n = (self.end - start).min(CURSOR_IDS);
        self.raw.resize(n as usize * 8, 0);
        let last = self.keys.last().map(|&k| ((k >> 64) as u32, k as u64));
        self.ids.clear();
        self.keys.clear();
        let (ids, keys) = (&mut self.ids, &mut self.keys);
        self.table
            .read_ids(self.seg, start, &mut self.raw, last, |id, b| {
                ids.push(id);
                keys.push(key_of(b, id));
            })?;
        self.read.fetch_add(n * 8, Ordering::Relaxed);
        self.first = start;
        self.pos = 0;
        Ok(true)
    }
}

impl SparseTable for ChainTable<'_> {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }
    /// A hint, as the trait allows: the rows of every link, at least the live rows (counting
    /// them exactly takes a pass over every link's ids; [`BucketRows::rows`] does).
    fn len(&self) -> usize {
        let all: u64 = self.links.iter().map(|l| l.rows.rows()).sum();
        usize::try_from(all).unwrap_or(usize::MAX)
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(
            ChainSnapshot::new(self).map_err(|e| core(&self.schema.name, e))?,
        ))
    }
    /// Committed checkpoints do not change: the rows are the chain's, whole.
    fn point_in_time(&self) -> bool {
        true
    }
    fn in_bucket_order(&self) -> Option<&dyn saver_core::table::BucketRows> {
        Some(self)
    }
}

impl BucketRows for ChainTable<'_> {
    fn row_bytes(&self) -> &[u64] {
        &self.row_bytes
    }
    fn rows(&self) -> u64 {
        self.live_rows()
    }
    fn visit_in_bucket_order(
        &self,
        batch: usize,
        visit: &mut VisitRows<'_>,
    ) -> saver_core::Result<()> {
        Ok(self.visit_buckets(0..BUCKETS, batch, visit)?)
    }
    fn finish_checks(&self) -> saver_core::Result<()> {
        Ok(ChainTable::finish_checks(self)?)
    }
}

struct ChainSnapshot<'t, 'c> {
    table: &'t ChainTable<'c>,
}

impl<'t, 'c> ChainSnapshot<'t, 'c> {
    fn new(table: &'t ChainTable<'c>) -> Result<Self> {
        Ok(Self { table })
    }

    /// Reads the rows of `handles` into `out` (see [`RunReader::fill`]).
    fn read_handles(&self, handles: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let mut runs = Vec::new();
        for (at, &h) in handles.iter().enumerate() {
            Run::push(&mut runs, h, at, 1);
        }
        RunReader::default().fill(self.table, &mut runs, out)
    }
}

impl TableSnapshot for ChainSnapshot<'_, '_> {
    fn finish(&self) -> saver_core::Result<()> {
        self.table
            .finish_checks()
            .map_err(|e| crate::load::rows::core_error(&self.table.schema.name, e))
    }

    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        saver_core::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.table.parts.len()
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        let t = self.table;
        let Some(range) = t.parts.get(part) else {
            return Ok(());
        };
        let max_rows = max_rows.max(1);
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        let mut bufs = SlotBuffers::new(t.row_bytes.iter().map(|&b| b as usize));
        let mut flush = |ids: &mut Vec<u64>, handles: &mut Vec<u64>| -> Result<()> {
            if ids.is_empty() {
                return Ok(());
            }
            let slices = bufs.fill(ids.len(), with_values, |outs| {
                self.read_handles(handles, outs)
            })?;
            visit(RowChunk {
                ids,
                handles,
                slots: &slices,
            })?;
            ids.clear();
            handles.clear();
            Ok(())
        };
        t.merge(range.clone(), &mut |more, h| {
            for (id, h) in more.iter().zip(h..) {
                ids.push(*id);
                handles.push(h);
                if ids.len() >= max_rows {
                    flush(&mut ids, &mut handles)?;
                }
            }
            Ok(())
        })
        .and_then(|()| flush(&mut ids, &mut handles))
        .map_err(|e| core(&t.schema.name, e))
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver_core::Result<()> {
        let t = self.table;
        let handles = handles_of(&t.schema, "the checkpoint", ids, |id| t.locate(id))?;
        self.read_handles(&handles, out)
            .map_err(|e| core(&t.schema.name, e))
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver_core::Result<()> {
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        self.read_handles(handles, out)
            .map_err(|e| core(&self.table.schema.name, e))
    }
}

impl std::fmt::Debug for ChainTable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainTable")
            .field("table", &self.schema.name)
            .field("links", &self.links.len())
            .finish_non_exhaustive()
    }
}

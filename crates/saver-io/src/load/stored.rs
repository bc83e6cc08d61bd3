//! A checkpoint's table as a [`SparseTable`] that reads its rows from the files when asked: what
//! lets `reshard`, `save --from CHECKPOINT`, `digest` and `export` run in bounded memory.
//!
//! A checkpoint stores each table partition's rows sorted by (bucket, id), which is the order the
//! save plan writes them in. So a save from a [`StoredTable`] asks for rows in the order they lie
//! in the source files, and each request becomes a few positional reads straight into the
//! writer's buffers.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

use saver_core::manifest::{SegmentManifest, TableManifest, TensorRef};
use saver_core::table::{RowChunk, TableSnapshot};
use saver_core::TableSchema;
use saver_core::{PartitionRule, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::link::Link;
use crate::load::pieces::{self, Piece};
use crate::load::rows::{core_error as core, handles_of, SlotBuffers};

/// Bits of a row handle that hold the row's number within its segment; the segment is above.
pub(crate) const ROW_BITS: u32 = 40;

/// One segment of the table, in bucket order, with the tensors of the kept slots.
struct Segment<'c> {
    seg: &'c SegmentManifest,
    /// The segment's tensor of each kept slot, in [`StoredTable::slots`] order.
    slots: Vec<&'c TensorRef>,
}

/// Per (segment, slot or `usize::MAX` for ids): CRC32 pieces (offset, length, state) read so far.
/// With the bytes they cover in all.
type CrcPieces = HashMap<(usize, usize), (Pieces, u64)>;

/// A read of [`StoredTable::read_segments`]: segment, rows, and one buffer a kept slot (empty
/// where not wanted).
pub(crate) type SegmentRows<'b> = (usize, Range<u64>, Vec<&'b mut [u8]>);

/// CRC32 pieces of one tensor.
type Pieces = Vec<Piece>;

/// A table of an open checkpoint, all partitions together, rows read on demand.
pub struct StoredTable<'c> {
    ckpt: &'c Link,
    table: &'c TableManifest,
    schema: TableSchema,
    row_bytes: Vec<u64>,
    segments: Vec<Segment<'c>>,
    rows: u64,
    /// CRC pieces of the tensors read so far, checked as soon as a tensor is read whole.
    crcs: Mutex<CrcPieces>,
    /// Tensors whose CRC32 has been checked.
    checked: AtomicU64,
}

impl<'c> StoredTable<'c> {
    /// Table `table` of `ckpt` with the slots `slots` (a subset of the table's, in any order).
    pub fn new(ckpt: &'c Link, table: &'c TableManifest, slots: Vec<SlotSpec>) -> Result<Self> {
        ckpt.check_target(table, table.key_dtype, &slots)?;
        let mut partitions: Vec<_> = table.partitions.iter().collect();
        partitions.sort_by_key(|p| p.buckets[0]);
        let mut segments = Vec::new();
        for p in partitions {
            let map = crate::load::restore::slot_map(table, p, &slots)?;
            for seg in &p.segments {
                if seg.rows >= 1 << ROW_BITS {
                    return Err(Error::Corrupt {
                        file: seg.ids.file.clone(),
                        what: format!("segment {:?} has {} rows", seg.ids.name, seg.rows),
                    });
                }
                segments.push(Segment {
                    seg,
                    slots: map.iter().map(|&k| &seg.slots[k]).collect(),
                });
            }
        }
        if segments.len() >= 1 << (64 - ROW_BITS) {
            return Err(Error::Mismatch(format!(
                "table {:?} has {} segments",
                table.name,
                segments.len()
            )));
        }
        let row_bytes = slots
            .iter()
            .map(|s| s.row_bytes())
            .collect::<saver_core::Result<_>>()?;
        Ok(Self {
            ckpt,
            table,
            schema: TableSchema::new(table.name.clone(), table.key_dtype, slots),
            row_bytes,
            rows: segments.iter().map(|s| s.seg.rows).sum(),
            segments,
            crcs: Mutex::new(HashMap::new()),
            checked: AtomicU64::new(0),
        })
    }

    /// Every selected table of `ckpt` (globs `tables`, all if empty), without the slots matching
    /// `exclude_slots`, in manifest order.
    pub(crate) fn all(
        ckpt: &'c Link,
        tables: &[String],
        exclude_slots: &[String],
    ) -> Result<Vec<Self>> {
        let opts = crate::LoadOptions {
            tables: tables.to_vec(),
            ..crate::LoadOptions::default()
        };
        let exclude = crate::load::restore::globs("exclude_slots", exclude_slots)?;
        ckpt.selected_tables(&opts)?
            .into_iter()
            .map(|t| Self::new(ckpt, t, Link::kept_slots(t, &exclude)))
            .collect()
    }

    /// Bytes of one row of each slot, in [`SparseTable::slots`] order.
    pub fn row_bytes(&self) -> &[u64] {
        &self.row_bytes
    }

    /// The number of segments: the parts rows are visited in, in bucket order.
    pub(crate) fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Rows of segment `s`.
    pub(crate) fn segment_rows(&self, s: usize) -> u64 {
        self.segments[s].seg.rows
    }

    /// The buckets of segment `s`.
    pub(crate) fn segment_buckets(&self, s: usize) -> Range<u32> {
        let b = self.segments[s].seg.buckets;
        b[0]..b[1]
    }

    /// What a load of `buckets` reads whole, the first of two reads ahead from a remote store:
    /// every tensor (ids and kept slots) of the segments that lie inside `buckets`, and the ids
    /// of the segments that straddle an edge of `buckets`. The load finds its rows in a
    /// straddling segment by a binary search of its ids, a round trip a probe otherwise (17 in a
    /// row for 100 000 rows, on every link, for every task of the load).
    pub(crate) fn tensors_within(&self, buckets: &Range<u32>) -> Vec<&'c TensorRef> {
        self.segments
            .iter()
            .filter(|s| s.seg.buckets[0] < buckets.end && buckets.start < s.seg.buckets[1])
            .flat_map(|s| {
                let inside = buckets.start <= s.seg.buckets[0] && s.seg.buckets[1] <= buckets.end;
                let slots = if inside { &s.slots[..] } else { &[] };
                std::iter::once(&s.seg.ids).chain(slots.iter().copied())
            })
            .collect()
    }

    /// The second read ahead: the bytes of `buckets`' rows in each kept slot of the segments
    /// that straddle an edge of `buckets`, widened to the CRC blocks around them (what the check
    /// of those rows reads besides). Found by the binary search of [`Self::tensors_within`]'s
    /// ids, which the first read ahead holds.
    pub(crate) fn straddling_within(
        &self,
        buckets: &Range<u32>,
    ) -> Result<Vec<(&'c TensorRef, Range<u64>)>> {
        let mut out = Vec::new();
        for (index, segment) in self.segments.iter().enumerate() {
            let [first, last] = segment.seg.buckets;
            let straddles = first < buckets.end
                && buckets.start < last
                && (first < buckets.start || buckets.end < last);
            if !straddles || segment.slots.is_empty() {
                continue;
            }
            let Some((s, rows)) =
                self.rows_of_buckets(buckets.start.max(first)..buckets.end.min(last))?
            else {
                continue;
            };
            if s != index {
                continue;
            }
            for (t, &w) in segment.slots.iter().zip(&self.row_bytes) {
                let bytes = rows.start * w..rows.end * w;
                if !bytes.is_empty() && bytes.end <= t.len {
                    out.push((*t, pieces::blocks_around(t, bytes)));
                }
            }
        }
        Ok(out)
    }

    fn corrupt(&self, t: &TensorRef, what: impl std::fmt::Display) -> Error {
        Error::Corrupt {
            file: t.file.clone(),
            what: format!("tensor {:?} (table {:?}) {what}", t.name, self.table.name),
        }
    }

    /// Reads rows `rows` of segment `s`: ids into `ids` (8 bytes a row) unless it is empty, and the
    /// kept slots whose `slots[k]` is not empty. Checks the ids' buckets and order, and the CRC32
    /// of every tensor once all its bytes have been read.
    pub(crate) fn read_segment(
        &self,
        s: usize,
        rows: Range<u64>,
        ids: &mut [u8],
        slots: &mut [&mut [u8]],
    ) -> Result<()> {
        let segment = &self.segments[s];
        if !ids.is_empty() {
            self.read_ids(s, rows.start, ids, None, |_, _| {})?;
        }
        for (k, out) in slots.iter_mut().enumerate() {
            if out.is_empty() {
                continue;
            }
            let t = segment.slots[k];
            self.read_checked(s, k, t, rows.start * self.row_bytes[k], out)?;
        }
        Ok(())
    }

    /// [`Self::read_segment`] of the kept slots of several row ranges, `(segment, rows, one
    /// buffer a slot, empty where not wanted)`, in one batch of requests: a remote store fetches
    /// them at once instead of one round trip each.
    pub(crate) fn read_segments(&self, reads: &mut [SegmentRows<'_>]) -> Result<()> {
        let mut batch: Vec<(&TensorRef, u64, &mut [u8])> = Vec::new();
        let mut keys = Vec::new();
        for (s, rows, slots) in reads.iter_mut() {
            let segment = &self.segments[*s];
            for (k, out) in slots.iter_mut().enumerate() {
                if out.is_empty() {
                    continue;
                }
                let t = segment.slots[k];
                batch.push((t, rows.start * self.row_bytes[k], &mut **out));
                keys.push((*s, k));
            }
        }
        self.ckpt.read_tensor_ranges(&mut batch)?;
        for ((t, offset, buf), (s, k)) in batch.iter().zip(keys) {
            self.record(s, k, t, *offset, buf)?;
        }
        Ok(())
    }

    /// Reads the ids of segment `s` from row `first` into `ids` (8 bytes each), checks that they
    /// lie in the segment's buckets in (bucket, id bits) order, after `after` (the (bucket, id)
    /// of the row before `first`, when the caller read it), and calls `each(id, bucket)` for
    /// each in turn.
    pub(crate) fn read_ids(
        &self,
        s: usize,
        first: u64,
        ids: &mut [u8],
        after: Option<(u32, u64)>,
        mut each: impl FnMut(u64, u32),
    ) -> Result<()> {
        let t = &self.segments[s].seg.ids;
        self.read_checked(s, usize::MAX, t, first * 8, ids)?;
        let buckets = self.segment_buckets(s);
        let mut prev = after;
        for c in ids.chunks_exact(8) {
            let id = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            let b = PartitionRule::bucket_of(id);
            if !buckets.contains(&b) || prev.is_some_and(|p| p >= (b, id)) {
                return Err(self.corrupt(
                    t,
                    format_args!(
                        "holds id {} out of bucket order",
                        self.table.key_dtype.format_id(id)
                    ),
                ));
            }
            prev = Some((b, id));
            each(id, b);
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes of `t` at `offset` and records their CRC32; once `t` has been
    /// read whole, compares the combined CRC32 with the manifest's.
    fn read_checked(
        &self,
        s: usize,
        k: usize,
        t: &TensorRef,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        self.ckpt.read_tensor_range(t, offset, buf)?;
        self.record(s, k, t, offset, buf)
    }

    /// Records the CRC32 of `buf`, read from `t` at `offset`; once `t` has been read whole,
    /// compares the combined CRC32 with the manifest's.
    fn record(&self, s: usize, k: usize, t: &TensorRef, offset: u64, buf: &[u8]) -> Result<()> {
        let whole = {
            let mut crcs = self.crcs.lock().unwrap_or_else(PoisonError::into_inner);
            let (pieces, covered) = crcs.entry((s, k)).or_default();
            pieces::push(t, offset, buf, pieces);
            *covered += buf.len() as u64;
            if *covered < t.len {
                return Ok(());
            }
            crcs.remove(&(s, k)).expect("just used").0
        };
        // Pieces that tile the tensor leave no bytes to read.
        self.check_pieces(t, whole).map(|_| ())
    }

    /// The segment holding `bucket`, if any.
    pub(crate) fn segment_of_bucket(&self, bucket: u32) -> Option<usize> {
        self.segments
            .iter()
            .position(|s| (s.seg.buckets[0]..s.seg.buckets[1]).contains(&bucket))
    }

    /// The first row of segment `s` whose (bucket, id) is not below `key`: a binary search over
    /// the segment's ids.
    pub(crate) fn lower_bound(&self, s: usize, key: (u32, u64)) -> Result<u64> {
        let t = &self.segments[s].seg.ids;
        let (mut lo, mut hi) = (0, self.segments[s].seg.rows);
        let mut b = [0u8; 8];
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            self.ckpt.read_tensor_range(t, mid * 8, &mut b)?;
            let other = u64::from_le_bytes(b);
            if (PartitionRule::bucket_of(other), other) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }

    /// The rows of `buckets`, which must lie within one segment's range: that segment and the
    /// row range; `None` when no segment holds them.
    pub(crate) fn rows_of_buckets(
        &self,
        buckets: Range<u32>,
    ) -> Result<Option<(usize, Range<u64>)>> {
        if buckets.is_empty() {
            return Ok(None);
        }
        let Some(s) = self.segment_of_bucket(buckets.start) else {
            return Ok(None);
        };
        let seg = self.segments[s].seg;
        debug_assert!(buckets.end <= seg.buckets[1]);
        let lo = if buckets.start == seg.buckets[0] {
            0
        } else {
            self.lower_bound(s, (buckets.start, 0))?
        };
        let hi = if buckets.end >= seg.buckets[1] {
            seg.rows
        } else {
            self.lower_bound(s, (buckets.end, 0))?
        };
        Ok(Some((s, lo..hi.max(lo))))
    }

    /// Finds the row of `id`, if the table holds it: binary search over the ids of the segment
    /// that holds the id's bucket.
    pub(crate) fn locate(&self, id: u64) -> Result<Option<(usize, u64)>> {
        let bucket = PartitionRule::bucket_of(id);
        let Some(s) = self.segment_of_bucket(bucket) else {
            return Ok(None);
        };
        let at = self.lower_bound(s, (bucket, id))?;
        if at >= self.segments[s].seg.rows {
            return Ok(None);
        }
        let mut b = [0u8; 8];
        self.ckpt
            .read_tensor_range(&self.segments[s].seg.ids, at * 8, &mut b)?;
        Ok((u64::from_le_bytes(b) == id).then_some((s, at)))
    }

    /// The bucket boundaries of the segments.
    pub(crate) fn boundaries(&self) -> impl Iterator<Item = u32> + '_ {
        self.segments
            .iter()
            .flat_map(|s| [s.seg.buckets[0], s.seg.buckets[1]])
    }

    /// The table's manifest entry.
    pub fn manifest(&self) -> &'c TableManifest {
        self.table
    }

    /// Tensors whose CRC32 was checked so far: each one read whole, its pieces tiling it.
    pub(crate) fn tensors_checked(&self) -> u64 {
        self.checked.load(Ordering::Relaxed)
    }

    /// Checks the CRC32 of every tensor read only in part so far (a chain reads only the rows of
    /// a link that later links did not replace, a target shard only its buckets): reads the
    /// bytes between the pieces read and combines them with the pieces' CRC32s, or, where
    /// pieces overlap, reads the tensor whole. Every byte this table returned is then covered by
    /// a checksum that was checked; call it before what was read is returned or committed.
    /// Returns the bytes it read.
    pub(crate) fn finish_checks(&self) -> Result<u64> {
        let pending: Vec<((usize, usize), Pieces)> = {
            let mut crcs = self.crcs.lock().unwrap_or_else(PoisonError::into_inner);
            crcs.drain()
                .map(|(key, (pieces, _))| (key, pieces))
                .collect()
        };
        // Tensors at once: on a remote store, each check waits on its requests.
        pending
            .into_par_iter()
            .map(|((s, k), pieces)| {
                let t = if k == usize::MAX {
                    &self.segments[s].seg.ids
                } else {
                    self.segments[s].slots[k]
                };
                self.check_pieces(t, pieces)
            })
            .sum()
    }

    /// Compares `t`'s CRC32 with the manifest's, from the CRC32s of the `pieces` read of it and
    /// the bytes they leave out, read now. Returns the bytes it read.
    fn check_pieces(&self, t: &TensorRef, pieces: Pieces) -> Result<u64> {
        let Some(read) = pieces::check(self.ckpt, t, pieces)? else {
            return Err(self.corrupt(t, "fails its CRC32 check"));
        };
        self.checked.fetch_add(1, Ordering::Relaxed);
        Ok(read)
    }

    /// The checkpoint the table is read from.
    pub(crate) fn checkpoint(&self) -> &'c Link {
        self.ckpt
    }
}

impl crate::load::rows::BucketRows for StoredTable<'_> {
    fn row_bytes(&self) -> &[u64] {
        &self.row_bytes
    }

    fn finish_checks(&self) -> saver_core::Result<()> {
        Ok(StoredTable::finish_checks(self).map(|_| ())?)
    }

    fn rows(&self) -> u64 {
        self.rows
    }

    fn visit_in_bucket_order(
        &self,
        batch: usize,
        visit: &mut crate::load::rows::VisitRows<'_>,
    ) -> saver_core::Result<()> {
        Ok(self.visit_rows(batch, visit)?)
    }
}

impl StoredTable<'_> {
    /// Every row in storage order (segments lie in (bucket, id bits) order), `batch` at a time.
    fn visit_rows(&self, batch: usize, visit: &mut crate::load::rows::VisitRows<'_>) -> Result<()> {
        let widths: Vec<usize> = self.row_bytes.iter().map(|&b| b as usize).collect();
        let step = batch.max(1) as u64;
        let mut raw = Vec::new();
        let mut ids = Vec::new();
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
        for s in 0..self.segment_count() {
            let rows = self.segment_rows(s);
            let mut at = 0;
            while at < rows {
                let end = (at + step).min(rows);
                let n = (end - at) as usize;
                raw.resize(n * 8, 0);
                for (b, &w) in bufs.iter_mut().zip(&widths) {
                    b.resize(n * w, 0);
                }
                let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                self.read_segment(s, at..end, &mut raw, &mut outs)?;
                ids.clear();
                ids.extend(
                    raw.chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
                );
                let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                visit(&ids, &views)?;
                at = end;
            }
        }
        Ok(())
    }
}

impl SparseTable for StoredTable<'_> {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }
    fn len(&self) -> usize {
        usize::try_from(self.rows).unwrap_or(usize::MAX)
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(Snapshot(self)))
    }
    /// A committed checkpoint does not change, and its files are read through the handles
    /// opened with it: every row is as it was when it was saved.
    fn point_in_time(&self) -> bool {
        true
    }
    fn in_bucket_order(&self) -> Option<&dyn saver_core::table::BucketRows> {
        Some(self)
    }
}

struct Snapshot<'t, 'c>(&'t StoredTable<'c>);

impl TableSnapshot for Snapshot<'_, '_> {
    fn finish(&self) -> saver_core::Result<()> {
        self.0
            .finish_checks()
            .map(|_| ())
            .map_err(|e| core(&self.0.table.name, e))
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
        self.0.segments.len()
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        let t = self.0;
        let Some(segment) = t.segments.get(part) else {
            return Ok(());
        };
        let name = &t.table.name;
        let step = max_rows.max(1) as u64;
        let mut raw = Vec::new();
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        let mut values = SlotBuffers::new(t.row_bytes.iter().map(|&b| b as usize));
        let mut at = 0;
        while at < segment.seg.rows {
            let rows = at..(at + step).min(segment.seg.rows);
            let n = (rows.end - rows.start) as usize;
            raw.resize(n * 8, 0);
            t.read_segment(part, rows.clone(), &mut raw, &mut [])
                .map_err(|e| core(name, e))?;
            let slices = values
                .fill(n, with_values, |outs| {
                    t.read_segment(part, rows.clone(), &mut [], outs)
                })
                .map_err(|e| core(name, e))?;
            ids.clear();
            ids.extend(
                raw.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
            );
            handles.clear();
            handles.extend(rows.clone().map(|r| ((part as u64) << ROW_BITS) | r));
            visit(RowChunk {
                ids: &ids,
                handles: &handles,
                slots: &slices,
            })?;
            at = rows.end;
        }
        Ok(())
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver_core::Result<()> {
        let t = self.0;
        let handles = handles_of(&t.schema, "the checkpoint", ids, |id| {
            Ok(t.locate(id)?.map(|(s, r)| ((s as u64) << ROW_BITS) | r))
        })?;
        // SAFETY: the handles were just made by this table, for these ids.
        unsafe { self.read_rows_by_handle(ids, &handles, out) }
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver_core::Result<()> {
        let t = self.0;
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        let name = &t.table.name;
        // Runs of consecutive rows of one segment: the plan asks in source order, so a request
        // is a few long runs, each one read per slot.
        let mut i = 0;
        while i < handles.len() {
            let (s, r) = (
                (handles[i] >> ROW_BITS) as usize,
                handles[i] & ((1 << ROW_BITS) - 1),
            );
            let mut n = 1;
            while i + n < handles.len() && handles[i + n] == handles[i] + n as u64 {
                n += 1;
            }
            if s >= t.segments.len() || r + n as u64 > t.segments[s].seg.rows {
                return Err(saver_core::Error::Table {
                    table: name.clone(),
                    message: format!("row handle {:#x} is not this table's", handles[i]),
                });
            }
            let mut parts: Vec<&mut [u8]> = out
                .iter_mut()
                .zip(&t.row_bytes)
                .map(|(o, &b)| {
                    if o.is_empty() {
                        &mut [][..]
                    } else {
                        &mut o[i * b as usize..(i + n) * b as usize]
                    }
                })
                .collect();
            t.read_segment(s, r..r + n as u64, &mut [], &mut parts)
                .map_err(|e| core(name, e))?;
            i += n;
        }
        Ok(())
    }
}

impl std::fmt::Debug for StoredTable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredTable")
            .field("table", &self.schema.name)
            .field("rows", &self.rows)
            .field("segments", &self.segments.len())
            .finish_non_exhaustive()
    }
}

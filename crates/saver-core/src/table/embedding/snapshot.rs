//! Snapshots of an [`EmbeddingTable`]: a scan that hands out each row's address as its handle, and
//! reads by handle that touch each row once, in whatever order the save wants.
//!
//! A save reads rows in bucket order. The rows of neighbouring buckets share an arena (see `slab`),
//! but within it lie in the order they were inserted, which is random with respect to bucket
//! order unless the table was restored from a checkpoint. Looking each row up again in the map
//! costs several cache and TLB misses (the map's control bytes, its slot, then the row); reading
//! through the address found during the scan costs at most one, and since the addresses of the
//! next rows are known, that one can be prefetched.
//!
//! Two rules keep the addresses valid and the reads untorn:
//! - A row taken out of the map (removed, or replaced by `insert`) while any snapshot is alive is
//!   *retired* instead of freed, and goes back to the table's slabs for reuse only when the last
//!   snapshot ends, or until the snapshot has read the row's bucket whole (see `cow`) and so
//!   will not read the row again: then it is freed, at once if that has already happened.
//! - A read by handle takes no lock of the row's shard. It copies the row, then looks for the
//!   row's pre-image (under the pre-images' lock of the shard) and takes that instead if there
//!   is one.
//!
//! Why a read by handle is never torn nor late, with trainers writing the row meanwhile:
//! - Every write in place after the snapshot's moment keeps the row's pre-image, under the
//!   pre-images' lock, before its first word; or finds the row tagged with the moment (see
//!   `cow`), which only a write that kept the pre-image does, and that write happened before
//!   this one (both hold the shard's write lock). If the copy saw any word of such a write, the
//!   read's lock of the pre-images comes after the keeping write's (had it come before, the copy
//!   would have happened before the write: a read cannot see a write that happens after it), so
//!   the read finds the pre-image, and the copy is dropped. A save reads a run of rows of one
//!   shard this way, copies first, then one lock for their pre-images.
//! - A write that began before the moment, and so kept nothing, holds its shard's write lock
//!   until it ends; the scan takes that shard's read lock after the moment before it finds any
//!   of the shard's addresses, so every such write has ended before a read can start.
//! - A row that left the map is retired, never written again, and its memory stays until the
//!   last snapshot ends.
//! - A bucket whose every row a read has copied and checked is marked read (see `cow`) only
//!   then, and a write that finds its row's bucket marked keeps no pre-image: what it writes
//!   could only reach a later read of the row, and the snapshot refuses to read a row of a
//!   marked bucket again.
//!
//! So a copy that overlapped a write is never kept, and one that did not is the row at the
//! moment. The copy reads words a writer may be storing at that instant, with volatile loads,
//! as sequence locks do (`crossbeam`'s `AtomicCell` reads the same way), and is dropped in that
//! case. `model` below checks the argument over every interleaving of a writer and a reader, and
//! `loom_model` under the C11 memory model (see [`copy_racing`] for the ordering argument).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{EmbeddingTable, Row};
use crate::error::{Error, Result};
use crate::partition::PartitionRule;
use crate::table::{RowChunk, TableSnapshot};

/// Most bytes of ids, handles and values a scan copies out of a shard to hand them on after
/// releasing its lock (see `scan_part`).
const COLLECT_BYTES: usize = 32 << 20;

/// Buckets of a map shard a scan walks in one hold of the shard's read lock (about 7/8 as many
/// rows, some tens of microseconds): the longest a trainer's write to the shard waits for it.
const HOLD_BUCKETS: usize = if cfg!(test) { 16 } else { 4096 };

/// Listed ids a scan of a tracking table's changes looks up in one hold of the shard's lock.
const HOLD_ROWS: usize = if cfg!(test) { 16 } else { 2048 };

/// Walks of a map shard in short holds a scan tries before it walks the shard in one hold: a
/// walk starts again when a write grows or rehashes the shard meanwhile.
const WALK_TRIES: usize = 3;

/// Most rows a read by handle copies before it looks for their pre-images under one lock: the
/// longest a trainer's write to their shard may wait for the read.
const READ_RUN: usize = 64;

/// Rows ahead of the one being copied whose memory is prefetched.
const PREFETCH_AHEAD: usize = 16;

/// Copies the `out.len()` bytes at `addr` into `out`, bytes a writer may be storing to
/// meanwhile (see the module docs: such a copy is dropped for the row's pre-image).
///
/// Volatile loads (or their equal, inline assembly), so that the compiler neither assumes the
/// bytes stand still nor moves the loads past the look for a pre-image after them; 16 bytes a
/// load on x86_64 (SSE2, which every x86_64 has).
///
/// # Why the copy is never kept when it overlapped a write (the memory ordering)
///
/// The copy's loads are plain hardware loads of words a writer may be storing: what they may
/// return is what relaxed atomic loads may return (any value the location held, never one from
/// the future). The argument needs nothing stronger. A writer after the moment keeps the row's
/// pre-image under the shard's pre-image lock, *releases* that lock, and only then stores its
/// first word; the read copies, then *acquires* the same lock to look for a pre-image. Locks of
/// one mutex are totally ordered. Suppose the read's lock came before the writer's: the read's
/// unlock synchronises with the writer's lock, so every load of the copy happens before every
/// store of the write, and a load cannot return a store that happens after it (coherence): the
/// copy saw none of the write. So if the copy saw any byte of the write, the writer's lock came
/// first, its unlock synchronises with the read's lock, and the read finds the pre-image and
/// drops the copy. What releases the lock after the copy matters, not before: a look first and a
/// copy after has no such order (the `model` test shows the torn and late reads it allows).
///
/// `loom_model` below checks this protocol under the C11 memory model with loom (relaxed word
/// accesses, one mutex), over every interleaving and every value each relaxed load may return.
/// Miri cannot check the function itself: it rejects inline assembly, and the racing loads are,
/// by the letter of Rust's memory model, a data race with the writer's stores (as in every
/// sequence lock, `crossbeam`'s `AtomicCell` and the Linux kernel's seqlocks included); the
/// volatile loads keep the compiler from assuming anything of the values, and the copy is
/// dropped whenever they could differ from the moment's.
///
/// # Safety
/// `addr..addr + out.len()` lies in a row of the table's slabs that stays allocated while this
/// runs; `addr` is 8-byte aligned.
unsafe fn copy_racing(addr: u64, out: &mut [u8]) {
    let src = addr as *const u8;
    let mut at = 0;
    #[cfg(target_arch = "x86_64")]
    while at + 16 <= out.len() {
        let v: std::arch::x86_64::__m128i;
        // SAFETY: an unaligned 16-byte load within the bytes (the caller's guarantee). Inline
        // assembly is opaque to the compiler, as a volatile load is: it is neither assumed to
        // give what an earlier load gave nor moved past the lock taken after the copy.
        unsafe {
            std::arch::asm!(
                "movdqu {v}, [{p}]",
                p = in(reg) src.add(at),
                v = out(xmm_reg) v,
                options(nostack, readonly, preserves_flags)
            );
        }
        // SAFETY: `at + 16 <= out.len()`; an unaligned store.
        unsafe { std::arch::x86_64::_mm_storeu_si128(out.as_mut_ptr().add(at).cast(), v) };
        at += 16;
    }
    while at + 8 <= out.len() {
        // SAFETY: within the bytes, 8-byte aligned (`addr` is, and `at` is a multiple of 8).
        let w: u64 = unsafe { std::ptr::read_volatile(src.add(at).cast()) };
        out[at..at + 8].copy_from_slice(&w.to_ne_bytes());
        at += 8;
    }
    while at < out.len() {
        // SAFETY: within the bytes.
        out[at] = unsafe { std::ptr::read_volatile(src.add(at)) };
        at += 1;
    }
}

/// Rows taken out of the map while a snapshot was alive.
#[derive(Default)]
pub(super) struct Retired {
    /// Live snapshots. Changed only under `rows`'s lock; read without it on the fast path.
    live: AtomicUsize,
    rows: Mutex<RetiredRows>,
}

#[derive(Default)]
struct RetiredRows {
    /// The first version of each id to leave the map: what a read by id falls back to.
    by_id: HashMap<u64, Row>,
    /// Later versions of ids already in `by_id`: only kept alive for reads by handle.
    later: Vec<(u64, Row)>,
}

impl Retired {
    /// Keeps `row` until the last live snapshot ends; or, with no snapshot alive, returns it for
    /// the caller to free.
    ///
    /// Called with the row's map entry write-locked. A snapshot that saw the row did so under the
    /// shard's read lock, after registering; this caller took the write lock after that, so this
    /// load sees the registration.
    pub(super) fn retire(&self, id: u64, row: Row) -> Option<Row> {
        if self.live.load(Ordering::SeqCst) == 0 {
            return Some(row);
        }
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        if self.live.load(Ordering::SeqCst) == 0 {
            return Some(row);
        }
        let rows = &mut *rows;
        match rows.by_id.entry(id) {
            Entry::Vacant(v) => {
                v.insert(row);
            }
            // The first version stays findable by id; this one stays alive for handles.
            Entry::Occupied(_) => rows.later.push((id, row)),
        }
        None
    }

    /// Copies the retired row of `id` with `copy`, if there is one.
    fn with_row<R>(&self, id: u64, copy: impl FnOnce(&Row) -> R) -> Option<R> {
        let rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        rows.by_id.get(&id).map(copy)
    }

    /// Takes out the rows whose id `gone` says no snapshot can read any more, for the caller to
    /// free.
    fn take_unreadable(&self, gone: impl Fn(u64) -> bool) -> Vec<(u64, Row)> {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let rows = &mut *rows;
        let mut out: Vec<(u64, Row)> = rows.by_id.extract_if(|&id, _| gone(id)).collect();
        out.extend(rows.later.extract_if(.., |(id, _)| gone(*id)));
        out
    }

    fn begin(&self) {
        let _rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        self.live.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends a snapshot; returns, with their ids, the rows to free if it was the last one.
    fn end(&self) -> impl Iterator<Item = (u64, Row)> {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let freed = if self.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            std::mem::take(&mut *rows)
        } else {
            RetiredRows::default()
        };
        freed.by_id.into_iter().chain(freed.later)
    }

    /// Rows currently kept for live snapshots.
    #[cfg(test)]
    pub(super) fn kept(&self) -> usize {
        let rows = self.rows.lock().unwrap();
        rows.by_id.len() + rows.later.len()
    }
}

/// The snapshot [`EmbeddingTable::snapshot`] returns.
pub(super) struct EmbeddingSnapshot<'t> {
    table: &'t EmbeddingTable,
    /// Only rows written at or after this token (a tracking table's changes since a save).
    since: Option<u64>,
}

impl<'t> EmbeddingSnapshot<'t> {
    /// Opens a point-in-time snapshot: its moment is now, or the end of the enclosing
    /// `moment::at_one_moment`; or, while another snapshot of the table is open, that one's
    /// moment (refused once that one has freed rows it read).
    pub(super) fn new(
        table: &'t EmbeddingTable,
        since: Option<u64>,
        registered: &dyn Fn(u64),
    ) -> Result<Self> {
        if !table.pre.open(registered) {
            return Err(Error::Table {
                table: table.schema.name.clone(),
                message: "another save of this table is under way, and its moment has passed: \
                          a save started now would show the rows as they were then, under this \
                          save's step; wait for that save to finish (SaveHandle::wait) first"
                    .into(),
            });
        }
        table.retired.begin();
        Ok(Self { table, since })
    }

    /// An error about row `id`: "id <id> <what>".
    fn row_error(&self, id: u64, what: &str) -> Error {
        let t = self.table;
        Error::Table {
            table: t.schema.name.clone(),
            message: format!("id {} {what}", t.schema.key_dtype.format_id(id)),
        }
    }

    /// The rows of map shard `part` as they were at the moment (only those of `listed`, if
    /// given, and written since the snapshot's token): ids, handles, and values if asked; about
    /// `rows_here` of them.
    ///
    /// A position in a hash table does not survive a writer that grows or rehashes it, so the
    /// shard is walked a part at a time (`HOLD_BUCKETS` buckets, or `HOLD_ROWS` listed ids, a
    /// hold of its read lock), and the walk starts again if the shard was reshaped meanwhile
    /// (`reshaped`; after `WALK_TRIES`, under one hold). A row stays in its bucket until it is
    /// removed, and every write since the moment keeps the row's pre-image before it changes
    /// the row or the map. So when the walk ends, every row it copied whose id has no pre-image
    /// is the row at the moment, in the place it had then; and the ids with a pre-image, looked
    /// at once after the walk, are taken from it instead (those that had a row), wherever the
    /// walk met them, if it did.
    fn collect_part(
        &self,
        part: usize,
        listed: Option<Vec<u64>>,
        rows_here: usize,
        with_values: bool,
    ) -> Result<ScannedRows<'t>> {
        let t = self.table;
        let shard = &t.rows.shards()[part];
        let since = self.since;
        let stale = |words: &[u64]| since.is_some_and(|g| t.stamp_of(words) < g);
        let mut rows = ScannedRows::new(t, with_values, rows_here);
        match listed {
            Some(listed) => {
                for ids in listed.chunks(HOLD_ROWS) {
                    let guard = shard.read();
                    for (id, row) in t.listed_rows(&guard, ids, with_values) {
                        let words = t.slabs.words(row);
                        if !stale(words) {
                            rows.push(id, row.addr(), words);
                        }
                    }
                }
            }
            None => {
                let mut tries = 0;
                'walk: loop {
                    rows.clear();
                    tries += 1;
                    let mut start: Option<(u64, usize)> = None;
                    let mut at = 0;
                    loop {
                        let guard = shard.read();
                        let now = (t.reshaped[part].load(Ordering::Relaxed), guard.buckets());
                        if *start.get_or_insert(now) != now {
                            continue 'walk;
                        }
                        let end = if tries >= WALK_TRIES {
                            now.1
                        } else {
                            (at + HOLD_BUCKETS).min(now.1)
                        };
                        for i in at..end {
                            // SAFETY: `i` is below the map's bucket count, and the guard keeps
                            // the map unmodified while the bucket and the row are read.
                            if unsafe { guard.is_bucket_full(i) } {
                                let (id, row) = unsafe { guard.bucket(i).as_ref() };
                                let (row, words) = (row.get(), t.slabs.words(row.get()));
                                if !stale(words) {
                                    rows.push(*id, row.addr(), words);
                                }
                            }
                        }
                        at = end;
                        if at == now.1 {
                            break 'walk;
                        }
                    }
                }
            }
        }
        // The ids written since the moment: as they were then, or not at all if they had no row
        // (inserted since); those removed since are among them.
        let pre = t.pre.shard(part);
        if pre.is_empty() {
            return Ok(rows);
        }
        let written: std::collections::HashSet<u64, super::IdHashBuilder> =
            pre.keys().copied().collect();
        let mut then = ScannedRows::new(t, with_values, 0);
        for (&id, p) in pre.iter() {
            match (&p.words, p.read) {
                (Some(words), false) if !stale(words) => then.push(id, 0, words),
                (Some(_), false) | (None, _) => {}
                (Some(_), true) => return Err(self.row_error(id, "was read before it was scanned")),
            }
        }
        drop(pre);
        rows.retain(|id| !written.contains(&id));
        rows.append(then);
        Ok(rows)
    }
}

/// Rows a scan copied out of a map shard: ids, handles and, if asked, each slot's values.
struct ScannedRows<'t> {
    table: &'t EmbeddingTable,
    with_values: bool,
    ids: Vec<u64>,
    handles: Vec<u64>,
    values: Vec<Vec<u8>>,
}

impl<'t> ScannedRows<'t> {
    fn new(table: &'t EmbeddingTable, with_values: bool, capacity: usize) -> Self {
        Self {
            table,
            with_values,
            ids: Vec::with_capacity(capacity),
            handles: Vec::with_capacity(capacity),
            values: vec![Vec::new(); table.schema.slots.len()],
        }
    }

    fn push(&mut self, id: u64, handle: u64, words: &[u64]) {
        self.ids.push(id);
        self.handles.push(handle);
        if self.with_values {
            let t = self.table;
            let bytes: &[u8] = bytemuck::cast_slice(words);
            for (s, v) in self.values.iter_mut().enumerate() {
                let off = t.slot_offsets[s];
                v.extend_from_slice(&bytes[off..off + t.slot_bytes[s]]);
            }
        }
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.handles.clear();
        self.values.iter_mut().for_each(Vec::clear);
    }

    /// Keeps the rows whose id `keep` accepts, in their order.
    fn retain(&mut self, keep: impl Fn(u64) -> bool) {
        let slot_bytes = &self.table.slot_bytes;
        let mut to = 0;
        for from in 0..self.ids.len() {
            if !keep(self.ids[from]) {
                continue;
            }
            self.ids[to] = self.ids[from];
            self.handles[to] = self.handles[from];
            for (v, &b) in self.values.iter_mut().zip(slot_bytes) {
                if !v.is_empty() {
                    v.copy_within(from * b..(from + 1) * b, to * b);
                }
            }
            to += 1;
        }
        self.ids.truncate(to);
        self.handles.truncate(to);
        for (v, &b) in self.values.iter_mut().zip(slot_bytes) {
            v.truncate(to * b);
        }
    }

    fn append(&mut self, mut other: Self) {
        self.ids.append(&mut other.ids);
        self.handles.append(&mut other.handles);
        for (v, o) in self.values.iter_mut().zip(&mut other.values) {
            v.append(o);
        }
    }

    /// Hands the rows to `visit`, `max_rows` at a time.
    fn emit(
        &self,
        max_rows: usize,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        let slot_bytes = &self.table.slot_bytes;
        let mut r = 0;
        while r < self.ids.len() {
            let n = max_rows.min(self.ids.len() - r);
            let slices: Vec<&[u8]> = if self.with_values {
                self.values
                    .iter()
                    .zip(slot_bytes)
                    .map(|(v, &b)| &v[r * b..(r + n) * b])
                    .collect()
            } else {
                Vec::new()
            };
            visit(RowChunk {
                ids: &self.ids[r..r + n],
                handles: &self.handles[r..r + n],
                slots: &slices,
            })?;
            r += n;
        }
        Ok(())
    }
}

impl Drop for EmbeddingSnapshot<'_> {
    fn drop(&mut self) {
        let t = self.table;
        t.pre.close(|| t.clear_tags());
        for (id, row) in t.retired.end() {
            t.slabs.free(t.arena(id), row);
        }
    }
}

impl TableSnapshot for EmbeddingSnapshot<'_> {
    fn copy_on_write_peak(&self) -> u64 {
        self.table.pre.moment_peak() as u64
    }

    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        crate::table::scan_every_part(self, max_rows, with_values, visit)
    }

    /// One part per dashmap shard: each is a separate lock and a separate allocation.
    fn scan_parts(&self) -> usize {
        self.table.rows.shards().len()
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        let t = self.table;
        let Some(shard) = t.rows.shards().get(part) else {
            return Ok(());
        };
        let max_rows = max_rows.max(1);
        // A tracking table's changes: only the rows listed as written since the token.
        let listed = self.since.and_then(|g| t.written_since(part, g));
        let rows_here = listed.as_ref().map_or_else(|| shard.read().len(), Vec::len);
        let row_bytes = 16 + if with_values { t.row_words * 8 } else { 0 };
        // A trainer writing to the shard waits while the scan holds its read lock. A shard whose
        // ids and handles (and values, if asked) fit in `COLLECT_BYTES` is copied out in short
        // holds (`collect_part`) and handed to `visit` with no lock held: the snapshot's reads
        // need none from the scan on (pre-images and retired rows keep them right). A larger
        // shard is walked under one hold and handed out meanwhile, `visit` under the lock: then
        // a row filter may read the table but must not write to it.
        if rows_here.saturating_mul(row_bytes) <= COLLECT_BYTES {
            let rows = self.collect_part(part, listed, rows_here, with_values)?;
            return rows.emit(max_rows, visit);
        }
        let guard = shard.read();
        let mut rows = ScannedRows::new(t, with_values, max_rows.min(1 << 16));
        // The rows written since the moment, as they were then. Trainers change them only under
        // this shard's write lock, so they stand still while it is read-locked here.
        let pre = t.pre.shard(part);
        let since = self.since;
        let mut push = |id: u64, handle: u64, words: &[u64]| -> Result<()> {
            if since.is_some_and(|g| t.stamp_of(words) < g) {
                return Ok(());
            }
            rows.push(id, handle, words);
            if rows.ids.len() == max_rows {
                rows.emit(max_rows, visit)?;
                rows.clear();
            }
            Ok(())
        };
        let mut visit_row = |id: u64, row: &Row| -> Result<()> {
            match pre.get(&id) {
                // Written since the moment: saved as it was then, or not at all if it had no row.
                Some(p) => match &p.words {
                    Some(words) => push(id, row.addr(), words),
                    None => Ok(()),
                },
                None => push(id, row.addr(), t.slabs.words(row)),
            }
        };
        match listed {
            Some(listed) => {
                for (id, row) in t.listed_rows(&guard, &listed, with_values) {
                    visit_row(id, row)?;
                }
            }
            None => {
                // SAFETY: the guard keeps the table alive and unmodified for as long as the
                // iterator and the references it yields are used (all within this block).
                for bucket in unsafe { guard.iter() } {
                    // SAFETY: as above; the bucket was just yielded by the iterator.
                    let (id, row) = unsafe { bucket.as_ref() };
                    visit_row(*id, row.get())?;
                }
            }
        }
        // Rows removed since the moment: saved as they were then.
        for (id, p) in pre.iter() {
            if let (false, Some(words)) = (p.in_map, &p.words) {
                push(*id, 0, words)?;
            }
        }
        drop(pre);
        drop(guard);
        rows.emit(max_rows, visit)
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let read = self.buckets_read_whole(ids)?;
        self.copy_rows(ids, out)?;
        self.mark_read(read);
        Ok(())
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        let read = self.buckets_read_whole(ids)?;
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.copy_rows_by_handle(ids, handles, out) }?;
        self.mark_read(read);
        Ok(())
    }
}

impl EmbeddingSnapshot<'_> {
    /// Marks `buckets` read (see `cow`), and frees the rows of them that left the map since the
    /// moment: the snapshot, which alone could read them, will not.
    fn mark_read(&self, buckets: std::ops::Range<u32>) {
        let t = self.table;
        if !t.pre.mark_read_buckets(buckets.clone()) {
            return;
        }
        for (id, row) in t
            .retired
            .take_unreadable(|id| buckets.contains(&PartitionRule::bucket_of(id)))
        {
            t.slabs.free(t.arena(id), row);
        }
    }

    /// Checks that no row of `ids` lies in a bucket already read whole (see `cow`: a write may
    /// have changed it since without keeping its pre-image), and returns the buckets that these
    /// ids read whole, to be marked once they are read: when `ids` come in bucket order (a
    /// save's chunk of a segment), every bucket after the first one's and before the last one's.
    /// The first and last buckets may have rows in the chunks before and after.
    fn buckets_read_whole(&self, ids: &[u64]) -> Result<std::ops::Range<u32>> {
        let pre = &self.table.pre;
        let mut in_order = true;
        let (mut first, mut last) = (None, 0);
        for &id in ids {
            let b = PartitionRule::bucket_of(id);
            if pre.bucket_read(b) {
                return Err(self.row_error(
                    id,
                    "was asked for again after the save read every row of its bucket",
                ));
            }
            in_order &= first.is_none() || b >= last;
            first.get_or_insert(b);
            last = b;
        }
        Ok(match first {
            Some(first) if in_order && last > first + 1 => first + 1..last,
            _ => 0..0,
        })
    }

    /// The pre-images of `ids` (rows of map shard `shard`, copied already), taken out of the
    /// shard's map under its lock (see [`PreImages::take_run`](super::cow::PreImages::take_run)),
    /// to copy and free after it.
    fn take_pre_images(
        &self,
        shard: usize,
        ids: &[u64],
        may_free: &mut Option<bool>,
    ) -> Result<super::cow::Taken<'_>> {
        let pre = &self.table.pre;
        pre.take_run(&mut pre.shard(shard), ids, may_free)
            .map_err(|id| {
                self.row_error(id, "had no row at the snapshot's moment, or was read twice")
            })
    }

    /// [`TableSnapshot::read_rows`] without the marking of read buckets.
    fn copy_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let t = self.table;
        let shards = t.rows.shards();
        let mut may_free = None;
        for (r, id) in ids.iter().enumerate() {
            // The live row first, then its pre-image over it if there is one: a write after the
            // moment keeps the pre-image before it changes the row, so a row with no pre-image
            // after it was copied was copied as it was at the moment.
            let live = match t.rows.get(id) {
                Some(row) => {
                    t.copy_row_into(t.slabs.words(&row), r, out);
                    true
                }
                None => false,
            };
            let shard = t.rows.determine_map(id);
            let guard = shards[shard].read();
            let taken = self.take_pre_images(shard, std::slice::from_ref(id), &mut may_free)?;
            if let Some(kept) = &taken.words[0] {
                t.copy_row_into(kept, r, out);
                continue;
            }
            if live {
                continue;
            }
            drop(guard);
            // Left the map since the scan: its first retired version.
            t.retired
                .with_row(*id, |row| t.copy_row_into(t.slabs.words(row), r, out))
                .ok_or_else(|| {
                    self.row_error(*id, "was in the snapshot but can no longer be read")
                })?;
        }
        Ok(())
    }

    /// [`TableSnapshot::read_rows_by_handle`] with a handle for every id, without the marking
    /// of read buckets.
    ///
    /// # Safety
    /// As [`TableSnapshot::read_rows_by_handle`]'s.
    unsafe fn copy_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let t = self.table;
        let row_bytes = t.row_words * 8;
        for &h in handles.iter().take(PREFETCH_AHEAD) {
            super::prefetch_bytes(h, row_bytes);
        }
        let mut may_free = None;
        let mut r = 0;
        while r < ids.len() {
            // A run of rows of one map shard (a save reads in bucket order, and every row of a
            // bucket lives in one shard): their pre-images are looked for under one lock.
            let shard = t.rows.determine_map(&ids[r]);
            let mut end = r + 1;
            while end < ids.len() && end - r < READ_RUN && t.rows.determine_map(&ids[end]) == shard
            {
                end += 1;
            }
            // No lock of the rows' shard, so a trainer's write never waits for this read: the
            // rows are copied, straight into their places in `out`, and then their pre-images
            // looked for, which a writer keeps before it writes (see the module docs); a row
            // with one is copied again over the first copy, which may be torn.
            for k in r..end {
                if let Some(&ahead) = handles.get(k + PREFETCH_AHEAD) {
                    super::prefetch_bytes(ahead, row_bytes);
                }
                let h = handles[k];
                if h == 0 {
                    continue;
                }
                for (s, dst) in out.iter_mut().enumerate() {
                    if dst.is_empty() {
                        continue;
                    }
                    let b = t.slot_bytes[s];
                    // SAFETY: the caller guarantees `h` is the address this snapshot's scan
                    // found for `ids[k]` (0 for a row removed since the moment, which is not
                    // read). That row is in the map or retired (see `Retired::retire`), so its
                    // memory lives until this snapshot ends and holds `row_words` words, slot
                    // `s` at its 8-byte aligned offset.
                    unsafe {
                        copy_racing(h + t.slot_offsets[s] as u64, &mut dst[k * b..(k + 1) * b])
                    };
                }
            }
            let taken = self.take_pre_images(shard, &ids[r..end], &mut may_free)?;
            for k in r..end {
                if let Some(kept) = &taken.words[k - r] {
                    t.copy_row_into(kept, k, out);
                    continue;
                }
                if handles[k] == 0 {
                    return Err(
                        self.row_error(ids[k], "was in the snapshot but can no longer be read")
                    );
                }
            }
            drop(taken);
            r = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod model {
    //! The argument of the module docs, checked over every interleaving: one row of two words,
    //! a trainer that writes it twice after the moment (the first write keeps the pre-image,
    //! the second finds the row tagged and skips it), and a save that reads it by handle. Each step is one load, store or lock operation; the search
    //! runs every order of the two threads' steps that the lock allows and checks what the read
    //! returns. It also runs the read with its two halves swapped (the pre-image looked for
    //! before the copy), to show that the search finds the torn or late reads such an order
    //! allows.

    #[derive(Clone, Copy)]
    enum Step {
        Lock,
        Unlock,
        /// The writer keeps the pre-image, if none is kept yet.
        Keep,
        /// The writer stores word `k`.
        Store(usize, u64),
        /// The reader copies word `k`.
        Copy(usize),
        /// The reader looks for the pre-image.
        Look,
        /// The reader marks the row's bucket read (see `cow`), its read of it done.
        Mark,
        /// The writer looks whether the row's bucket is marked read: if so, it keeps nothing.
        CheckMark,
    }

    #[derive(Clone, Default)]
    struct State {
        words: [u64; 2],
        kept: Option<[u64; 2]>,
        /// Which thread holds the lock.
        holder: Option<usize>,
        copy: [u64; 2],
        seen: Option<[u64; 2]>,
        at: [usize; 2],
        marked: bool,
        /// The writer found the bucket marked read.
        skip: bool,
    }

    /// The first write keeps the pre-image under the lock, unless the row's bucket is marked
    /// read; the second finds the row tagged (see `cow`) and writes without the lock.
    fn trainer() -> Vec<Step> {
        vec![
            Step::CheckMark,
            Step::Lock,
            Step::Keep,
            Step::Unlock,
            Step::Store(0, 2),
            Step::Store(1, 2),
            Step::Store(0, 3),
            Step::Store(1, 3),
        ]
    }

    /// Every value the read can return, over all interleavings.
    fn outcomes(reader: &[Step]) -> Vec<[u64; 2]> {
        let programs = [trainer(), reader.to_vec()];
        let mut out = Vec::new();
        let mut stack = vec![State {
            words: [1, 1],
            ..State::default()
        }];
        while let Some(s) = stack.pop() {
            if s.at[1] == programs[1].len() {
                out.push(s.seen.unwrap_or(s.copy));
                continue;
            }
            for (t, program) in programs.iter().enumerate() {
                let Some(&step) = program.get(s.at[t]) else {
                    continue;
                };
                let mut n = s.clone();
                match step {
                    Step::Lock if s.holder.is_some() => continue,
                    Step::Lock => n.holder = Some(t),
                    Step::Unlock => n.holder = None,
                    Step::Keep if s.skip => {}
                    Step::Keep => {
                        n.kept.get_or_insert(s.words);
                    }
                    Step::Mark => n.marked = true,
                    Step::CheckMark => n.skip = s.marked,
                    Step::Store(k, v) => n.words[k] = v,
                    Step::Copy(k) => n.copy[k] = s.words[k],
                    Step::Look => n.seen = s.kept,
                }
                n.at[t] += 1;
                stack.push(n);
            }
        }
        out
    }

    #[test]
    fn a_read_sees_the_row_as_it_was_at_the_moment_in_every_interleaving() {
        // `read_rows_by_handle`: the copy, then the pre-image under the lock.
        let read = [
            Step::Copy(0),
            Step::Copy(1),
            Step::Lock,
            Step::Look,
            Step::Unlock,
        ];
        let seen = outcomes(&read);
        assert!(seen.len() > 100, "{} interleavings", seen.len());
        assert!(seen.iter().all(|&v| v == [1, 1]), "{seen:?}");
        // The read marks the row's bucket read once it is done: a writer that then keeps no
        // pre-image changes nothing the read returns.
        let marked: Vec<Step> = read.iter().copied().chain([Step::Mark]).collect();
        let seen = outcomes(&marked);
        assert!(seen.iter().all(|&v| v == [1, 1]), "{seen:?}");
        // But a second read after the mark may return a later value: why a snapshot refuses to
        // read a row of a bucket it marked.
        let twice: Vec<Step> = marked.iter().chain(&read).copied().collect();
        let seen = outcomes(&twice);
        assert!(seen.contains(&[3, 3]), "{seen:?}");
        // Marked before the copy, the read can be torn or late.
        let early = [
            Step::Mark,
            Step::Copy(0),
            Step::Copy(1),
            Step::Lock,
            Step::Look,
            Step::Unlock,
        ];
        let seen = outcomes(&early);
        assert!(seen.contains(&[2, 1]) && seen.contains(&[3, 3]), "{seen:?}");
        // The halves swapped: reads that are torn or late exist, and the search finds them.
        let swapped = [
            Step::Lock,
            Step::Look,
            Step::Unlock,
            Step::Copy(0),
            Step::Copy(1),
        ];
        let seen = outcomes(&swapped);
        assert!(seen.contains(&[2, 1]) && seen.contains(&[3, 3]), "{seen:?}");
    }
}

#[cfg(test)]
mod loom_model {
    //! The pre-image protocol under the C11 memory model, with loom: the row's words are relaxed
    //! atomics (what a plain hardware load of a word a writer stores may return), the shard's
    //! pre-image lock a mutex. A trainer writes the row twice after the moment (the first write
    //! keeps the pre-image, the second finds it kept, as a tagged row does); a save copies the
    //! row, then looks for its pre-image. Whatever interleaving and whichever value each relaxed
    //! load returns, what the read keeps is the row at the moment. With the look before the
    //! copy, loom finds a read that is not.

    use loom::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    struct Row {
        words: [AtomicU64; 2],
        pre_image: Mutex<Option<[u64; 2]>>,
    }

    /// The value a read by handle keeps: `copy_first` is the protocol, `false` its halves
    /// swapped.
    fn read_while_written(copy_first: bool) -> [u64; 2] {
        let row = Arc::new(Row {
            words: [AtomicU64::new(1), AtomicU64::new(1)],
            pre_image: Mutex::new(None),
        });
        let writer = {
            let row = row.clone();
            thread::spawn(move || {
                for value in [2, 3] {
                    {
                        let mut kept = row.pre_image.lock().unwrap();
                        if kept.is_none() {
                            *kept = Some([1, 1]);
                        }
                    }
                    for w in &row.words {
                        w.store(value, Relaxed);
                    }
                }
            })
        };
        let copy = |row: &Row| [row.words[0].load(Relaxed), row.words[1].load(Relaxed)];
        let kept = if copy_first {
            let copied = copy(&row);
            let pre = *row.pre_image.lock().unwrap();
            pre.unwrap_or(copied)
        } else {
            let pre = *row.pre_image.lock().unwrap();
            let copied = copy(&row);
            pre.unwrap_or(copied)
        };
        writer.join().unwrap();
        kept
    }

    #[test]
    fn a_read_keeps_the_row_at_the_moment_under_weak_memory() {
        loom::model(|| {
            let kept = read_while_written(true);
            assert_eq!(kept, [1, 1], "a torn or late read was kept");
        });
    }

    #[test]
    fn with_the_look_before_the_copy_loom_finds_a_torn_or_late_read() {
        let found = std::panic::catch_unwind(|| {
            loom::model(|| {
                assert_eq!(read_while_written(false), [1, 1]);
            })
        });
        assert!(
            found.is_err(),
            "loom found no bad read in the swapped protocol"
        );
    }
}

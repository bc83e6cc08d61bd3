//! [`EmbeddingTable`]: a concurrent sparse table on `dashmap`, ready to train with and to load into.

mod cow;
mod hasher;
mod slab;
mod snapshot;

use std::ops::Range;

use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::{DashMap, SharedValue};
use rayon::prelude::*;

use cow::PreImages;
use hasher::OrderedIdHashBuilder;
pub use hasher::{IdHashBuilder, IdHasher};
use slab::{Row, Slabs};
use snapshot::{EmbeddingSnapshot, Retired};

use super::{validate_slots, ChangeTracking, SlotSpec, SparseTable, TableSchema, TableSnapshot};
use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::naming::check_table_name;
use crate::partition::{PartitionRule, Shard};

/// Shards of the row map: each is one lock, held by a save's scan while it walks the shard, so a
/// trainer's write waits at most for the scan of one 1/`MAP_SHARDS` of the table.
const MAP_SHARDS: usize = 64;

/// One shard of the row map, as `dashmap` keeps it (its `raw-api`).
type RowMap = hashbrown::raw::RawTable<(u64, SharedValue<Row>)>;

/// How many rows ahead a bulk insert asks the CPU for the map memory a row will touch.
const PREFETCH_AHEAD: usize = 12;

/// Asks the CPU to bring in the control bytes and the slot where a probe for `hash` starts: a
/// map of millions of rows is far larger than the caches, and a bulk insert that waits for each
/// row's probe spent two thirds of its time in those two misses. Only a hint: it reads nothing
/// and cannot fault, whatever the address.
#[inline]
fn prefetch_slot(map: &RowMap, hash: u64) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // hashbrown's layout: the slots lie below `data_end`, slot `i` at `data_end - (i + 1)`,
        // and the control bytes start at `data_end`; a probe starts at `hash & (buckets - 1)`.
        let pos = (hash as usize) & (map.buckets() - 1);
        let end = map.data_end().as_ptr();
        let ctrl = end.cast::<i8>().wrapping_add(pos);
        let slot = end.wrapping_sub(pos + 1).cast::<i8>();
        // SAFETY: a prefetch is a hint that never faults and reads nothing the program sees;
        // the addresses are only computed (wrapping), never dereferenced.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(ctrl);
            _mm_prefetch::<_MM_HINT_T0>(slot);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (map, hash);
}

/// [`crate::prefetch::prefetch_range`] of the `bytes` bytes at `addr`.
#[inline(always)]
fn prefetch_bytes(addr: u64, bytes: usize) {
    crate::prefetch::prefetch_range(addr, bytes);
}

/// A concurrent embedding table: many threads insert, update, read and remove rows while another
/// thread saves it.
///
/// All slots of a row live side by side behind one map entry, so readers and the saver see a row
/// either wholly before or wholly after an update, never torn.
///
/// While a save runs, a trainer's write waits for the save at most while the save's scan copies
/// a few thousand ids and row addresses of the write's map shard out (one short hold of the
/// shard's read lock), or looks for the pre-images of a run of rows it read: the save reads rows
/// by address without any lock a writer takes, and takes the row's copy-on-write pre-image
/// instead wherever a write since the save's moment got there first (the argument, and its model
/// check, are in the `snapshot` module's source). The first write of a row after the moment
/// keeps its pre-image, unless the save has already read the row's whole bucket; the row then
/// carries the moment's tag, and the next writes of it cost what they cost with no save open,
/// but for one compare. A save reads each row once: asked for a row of a bucket it has read
/// whole, the snapshot returns an error rather than a value written after its moment. Rows are `u64` words, so that
/// every slot can be viewed as `f32`/`i64`/… in place (each slot starts 8-byte aligned), kept in
/// large slabs (see `slab`). Ids are raw 64-bit patterns; `i64` ids are stored as their
/// two's-complement bits.
pub struct EmbeddingTable {
    schema: TableSchema,
    slot_bytes: Vec<usize>,
    slot_offsets: Vec<usize>,
    row_words: usize,
    rows: DashMap<u64, Row, OrderedIdHashBuilder>,
    /// The rows' memory: arenas for equal parts of `buckets`.
    slabs: Slabs,
    /// The buckets whose rows the table expects (see [`Self::for_shard`]); their range is split
    /// into equal parts, one per arena of `slabs`.
    buckets: Range<u32>,
    /// Rows that left the map while a snapshot might still read them.
    retired: Retired,
    /// Rows as they were at the moment of the open point-in-time snapshot, kept by the first
    /// write after it (see `cow`).
    pre: PreImages,
    /// Change tracking, when turned on ([`EmbeddingTable::with_change_tracking`]).
    tracking: Option<Box<Tracking>>,
    /// Per map shard: how many times a write may have grown or rehashed it, moving its rows
    /// (see `find_or_slot`). Changed and read only under the shard's lock.
    reshaped: Box<[AtomicU64]>,
}

/// What a tracking table keeps beside its rows: each row also holds, in one word after its slots,
/// the clock's generation when it was last written (see [`ChangeTracking`]).
struct Tracking {
    /// Per map shard: every removal since the baseline's snapshot.
    removed: Box<[std::sync::Mutex<Vec<Removal>>]>,
    baseline: std::sync::Mutex<Option<(String, u64)>>,
    /// Saves that wrote the table but whose commit it has not seen, with their tokens: newer
    /// than the baseline, the oldest first (see [`ChangeTracking::written`]).
    written_saves: std::sync::Mutex<Vec<(String, u64)>>,
    last_snapshot: std::sync::atomic::AtomicU64,
    /// Per map shard: ids written since `floor`, each at least once (and maybe more than once);
    /// every row stamped at or after `floor` is listed. 0: no list kept yet (set to the first
    /// snapshot's generation before its moment, then raised to each committed save's).
    written: Box<[std::sync::Mutex<Vec<u64>>]>,
    floor: std::sync::atomic::AtomicU64,
}

/// A removed id and the clock's generation when it was removed.
type Removal = (u64, u64);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Mutable access to one row's slots, handed to update closures.
#[derive(Debug)]
pub struct RowMut<'a> {
    table: &'a EmbeddingTable,
    words: &'a mut [u64],
}

impl RowMut<'_> {
    /// The raw bytes of slot `s` (by index).
    pub fn slot_bytes_mut(&mut self, s: usize) -> &mut [u8] {
        let off = self.table.slot_offsets[s];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words[..]);
        &mut bytes[off..off + self.table.slot_bytes[s]]
    }

    /// Slot `s` viewed as elements of `T` (e.g. `f32` for an F32 slot). Panics if the slot's byte
    /// length is not a multiple of `size_of::<T>()`; alignment always holds up to 8 bytes.
    pub fn slot_mut<T: bytemuck::Pod>(&mut self, s: usize) -> &mut [T] {
        bytemuck::cast_slice_mut(self.slot_bytes_mut(s))
    }
}

impl EmbeddingTable {
    /// An empty table with the given slots, for a worker that holds every id (on a worker that
    /// holds one shard of the table, see [`Self::for_shard`]).
    pub fn new(name: impl Into<String>, key_dtype: KeyDtype, slots: Vec<SlotSpec>) -> Result<Self> {
        Self::with_capacity(name, key_dtype, slots, 0)
    }

    /// An empty table with room for `rows` rows before its map grows (loads know their row count:
    /// growing a map of millions of rows step by step rehashes every row several times), and
    /// whose first slabs hold that many rows, side by side in the order they are inserted.
    pub fn with_capacity(
        name: impl Into<String>,
        key_dtype: KeyDtype,
        slots: Vec<SlotSpec>,
        rows: usize,
    ) -> Result<Self> {
        Self::for_shard(name, key_dtype, slots, Shard::WHOLE, rows)
    }

    /// An empty table for a worker that holds `shard` of the table (its partition, see
    /// [`PartitionRule`]), with room for `rows` rows.
    ///
    /// ```
    /// use saver_core::partition::Shard;
    /// use saver_core::{Dtype, EmbeddingTable, KeyDtype, SlotSpec};
    ///
    /// let slots = vec![SlotSpec::new("embedding", Dtype::F32, vec![16])];
    /// // Worker 3 of 8, expecting about a million rows.
    /// let table = EmbeddingTable::for_shard("item", KeyDtype::I64, slots, Shard { index: 3, count: 8 }, 1 << 20)?;
    /// table.upsert(42, |row| row.slot_mut::<f32>(0)[0] = 0.5);
    /// assert_eq!(table.len(), 1);
    /// # Ok::<(), saver_core::Error>(())
    /// ```
    ///
    /// The table accepts any id, but lays its memory out for that shard's buckets: each of its
    /// arenas takes the rows of an equal part of them, and a save, which reads rows bucket by
    /// bucket, then reads one arena at a time. A table made with [`Self::new`] on a worker of
    /// many shards keeps every row in the few arenas of the worker's buckets, and its saves
    /// gather rows spread over more memory at a time, which is slower.
    pub fn for_shard(
        name: impl Into<String>,
        key_dtype: KeyDtype,
        slots: Vec<SlotSpec>,
        shard: Shard,
        rows: usize,
    ) -> Result<Self> {
        let Shard {
            index: shard,
            count: shard_num,
        } = shard.check()?;
        let name = name.into();
        check_table_name(&name)?;
        let slot_bytes = validate_slots(&name, &slots)?;
        let mut slot_offsets = Vec::with_capacity(slots.len());
        let mut off = 0usize;
        for &b in &slot_bytes {
            slot_offsets.push(off);
            off += b.div_ceil(8) * 8;
        }
        let buckets = PartitionRule::bucket_range(shard, shard_num);
        // Past 2^16 shards a shard may own no bucket at all: it still needs one arena.
        let arenas = (buckets.end - buckets.start).clamp(1, slab::ARENAS);
        let map = DashMap::with_capacity_and_hasher_and_shard_amount(
            rows,
            OrderedIdHashBuilder::for_rows(rows, MAP_SHARDS, buckets.clone()),
            MAP_SHARDS,
        );
        let map_shards = map.shards().len();
        let pre = PreImages::new(map_shards);
        Ok(Self {
            schema: TableSchema {
                name,
                key_dtype,
                slots,
            },
            slot_bytes,
            slot_offsets,
            row_words: off / 8,
            rows: map,
            slabs: Slabs::new(off / 8, arenas as usize, rows),
            buckets,
            retired: Retired::default(),
            reshaped: (0..map_shards).map(|_| AtomicU64::new(0)).collect(),
            pre,
            tracking: None,
        })
    }

    /// Turns change tracking on, for an empty table: each row then records when it was last
    /// written (8 bytes more a row) and each removal is recorded, so that a delta save whose
    /// parent is the table's last committed save writes the changed rows without comparing the
    /// table with the parent ([`ChangeTracking`]). A write costs one more load and store.
    pub fn with_change_tracking(mut self) -> Result<Self> {
        if !self.is_empty() {
            return Err(Error::Table {
                table: self.schema.name.clone(),
                message: "change tracking must be turned on before the first row".into(),
            });
        }
        let arenas = self.slabs.arenas();
        self.row_words += 1;
        self.slabs = Slabs::new(self.row_words, arenas, self.rows.capacity());
        self.tracking = Some(Box::new(Tracking {
            removed: (0..self.rows.shards().len())
                .map(|_| std::sync::Mutex::default())
                .collect(),
            baseline: std::sync::Mutex::new(None),
            written_saves: std::sync::Mutex::default(),
            last_snapshot: std::sync::atomic::AtomicU64::new(0),
            written: (0..self.rows.shards().len())
                .map(|_| std::sync::Mutex::default())
                .collect(),
            floor: std::sync::atomic::AtomicU64::new(0),
        }));
        Ok(self)
    }

    /// Declares that the table now holds exactly what the committed save `save_id` holds of it
    /// (it was just loaded from that save), so that a delta whose parent is that save writes
    /// what is written from now on without comparing. For a table with change tracking on.
    pub fn set_baseline(&self, save_id: &str) -> Result<()> {
        let Some(t) = &self.tracking else {
            return Err(Error::Table {
                table: self.schema.name.clone(),
                message: "a baseline needs change tracking (with_change_tracking)".into(),
            });
        };
        // A moment of its own: rows written before it are the save's, rows written after it
        // are stamped with it or later, and listed.
        let mut token = 0;
        crate::table::moment::register(|g| {
            token = g;
            let _ = t.floor.compare_exchange(
                0,
                g,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            );
        });
        self.committed(Some(save_id), token);
        Ok(())
    }

    /// Stamps the row of `id` being written with the clock, when tracking, and lists the id as
    /// written if this is its first write since the list's floor (`old`: the row's stamp before
    /// the write, `None` for a new row). Called under the row's lock, where the write is ordered
    /// with the moment a snapshot fixes.
    #[inline]
    fn stamp(&self, id: u64, words: &mut [u64], old: Option<u64>) {
        if let Some(t) = &self.tracking {
            if let Some(w) = words.last_mut() {
                *w = crate::table::moment::now();
            }
            let floor = t.floor.load(std::sync::atomic::Ordering::SeqCst);
            if floor != 0 && old.is_none_or(|o| o < floor) {
                lock(&t.written[self.rows.determine_map(&id)]).push(id);
            }
        }
    }

    /// The ids of map shard `shard` written since token `since`, sorted, if the list covers
    /// that token (a snapshot then reads those rows only, not the whole shard).
    fn written_since(&self, shard: usize, since: u64) -> Option<Vec<u64>> {
        let t = self.tracking.as_ref()?;
        let floor = t.floor.load(std::sync::atomic::Ordering::SeqCst);
        if floor == 0 || floor > since {
            return None;
        }
        let mut ids = lock(&t.written[shard]).clone();
        ids.sort_unstable();
        ids.dedup();
        Some(ids)
    }

    /// The generation a tracking table's row was last written at.
    fn stamp_of(&self, words: &[u64]) -> u64 {
        words.last().copied().unwrap_or(0)
    }

    /// The rows of `ids` in `map` (one of the table's shards, locked by the caller), `None` for
    /// an id it does not hold. Listed ids are scattered over a map far larger than the caches:
    /// each probe is prefetched ahead, so that the misses overlap.
    fn rows_of<'m>(&self, map: &'m RowMap, ids: &[u64]) -> Vec<Option<&'m Row>> {
        let hashes: Vec<u64> = ids
            .iter()
            .map(|id| self.rows.hash_usize(id) as u64)
            .collect();
        ids.iter()
            .enumerate()
            .map(|(k, &id)| {
                if let Some(&ahead) = hashes.get(k + PREFETCH_AHEAD) {
                    prefetch_slot(map, ahead);
                }
                map.find(hashes[k], |(key, _)| *key == id).map(|b| {
                    // SAFETY: the bucket was just found in the map the caller keeps locked,
                    // which the returned references borrow.
                    let (_, row) = unsafe { b.as_ref() };
                    row.get()
                })
            })
            .collect()
    }

    /// The rows `map` (one of the table's shards, locked by the caller) holds of the listed
    /// `ids`, with their ids. Listed ids are scattered over the map and the slabs, far larger
    /// than the caches: after their probes, their rows' stamps (or whole rows, if `whole`) are
    /// prefetched ahead of their reads, so that the misses overlap.
    fn listed_rows<'m>(
        &'m self,
        map: &'m RowMap,
        ids: &[u64],
        whole: bool,
    ) -> impl Iterator<Item = (u64, &'m Row)> + 'm {
        let found: Vec<(u64, &Row)> = ids
            .iter()
            .zip(self.rows_of(map, ids))
            .filter_map(|(&id, row)| Some((id, row?)))
            .collect();
        let wanted = if whole { self.row_words * 8 } else { 8 };
        let skip = (self.row_words * 8).saturating_sub(wanted) as u64;
        (0..found.len()).map(move |k| {
            if let Some(&(_, ahead)) = found.get(k + PREFETCH_AHEAD) {
                prefetch_bytes(self.slabs.words(ahead).as_ptr() as u64 + skip, wanted);
            }
            found[k]
        })
    }

    /// The table's name. (Also [`SparseTable::name`]; inherent, so that `t.name()` compiles
    /// with both `SparseTable` and `TableSink` in scope.)
    pub fn name(&self) -> &str {
        &self.schema.name
    }

    /// Whether ids are signed or unsigned (also [`SparseTable::key_dtype`]).
    pub fn key_dtype(&self) -> KeyDtype {
        self.schema.key_dtype
    }

    /// The slots every row has (also [`SparseTable::slots`]).
    pub fn slots(&self) -> &[SlotSpec] {
        &self.schema.slots
    }

    /// Index of a slot by name.
    pub fn slot_index(&self, name: &str) -> Option<usize> {
        self.schema.slots.iter().position(|s| s.name == name)
    }

    fn check_row(&self, values: &[&[u8]]) -> Result<()> {
        if values.len() != self.schema.slots.len() {
            return Err(Error::LengthMismatch {
                what: "row slot count of table",
                name: self.schema.name.clone(),
                expected: self.schema.slots.len() as u64,
                actual: values.len() as u64,
            });
        }
        for (s, v) in values.iter().enumerate() {
            if v.len() != self.slot_bytes[s] {
                return Err(Error::LengthMismatch {
                    what: "slot row",
                    name: format!("{}/{}", self.schema.name, self.schema.slots[s].name),
                    expected: self.slot_bytes[s] as u64,
                    actual: v.len() as u64,
                });
            }
        }
        Ok(())
    }

    /// The arena of `id`'s row: the one for its part of the table's buckets, or the first or last
    /// for a bucket before or past them.
    fn arena(&self, id: u64) -> usize {
        self.arena_of_bucket(PartitionRule::bucket_of(id))
    }

    fn arena_of_bucket(&self, bucket: u32) -> usize {
        let Range { start, end } = self.buckets;
        let b = bucket.clamp(start, end.max(start + 1) - 1);
        let len = u64::from(end - start).max(1);
        (u64::from(b - start) * self.slabs.arenas() as u64 / len) as usize
    }

    /// Writes row `r` of `slots` (each holding rows of its slot back to back) into `words`, and
    /// zeros into the padding after each slot: every word but a tracking table's stamp, which
    /// the insert writes. Rows come from slabs with whatever they held before, so that a fresh
    /// slab's pages are written once, by this copy, rather than cleared by the kernel, zeroed
    /// and then copied over.
    fn fill_row(&self, words: &mut [u64], slots: &[&[u8]], r: usize) {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(words);
        for (s, v) in slots.iter().enumerate() {
            let (off, b) = (self.slot_offsets[s], self.slot_bytes[s]);
            bytes[off..off + b].copy_from_slice(&v[r * b..(r + 1) * b]);
            bytes[off + b..off + b.div_ceil(8) * 8].fill(0);
        }
    }

    /// A zeroed row for `id`.
    fn zeroed_row(&self, id: u64) -> Row {
        let mut row = self.slabs.alloc(self.arena(id));
        self.slabs.words_mut(&mut row).fill(0);
        row
    }

    /// Frees `row`, which left the map as `id`'s, unless a live snapshot may still read it.
    fn retire(&self, id: u64, row: Row) {
        // The open moment's only snapshot has read the row's bucket whole and will not read the
        // row again (see `cow`): nothing can read it any more.
        if self.pre.active() && self.pre.bucket_read(PartitionRule::bucket_of(id)) {
            self.slabs.free(self.arena(id), row);
            return;
        }
        if let Some(row) = self.retired.retire(id, row) {
            self.slabs.free(self.arena(id), row);
        }
    }

    /// Inserts or replaces the row of `id`; `values[s]` holds the bytes of slot `s`.
    pub fn insert(&self, id: u64, values: &[&[u8]]) -> Result<()> {
        self.check_row(values)?;
        self.insert_rows(&[id], values);
        Ok(())
    }

    /// Inserts many rows: `slots[s]` holds `ids.len()` rows of slot `s` back to back. Used by
    /// loads; fastest when the ids come in bucket order, as a checkpoint holds them.
    #[doc(hidden)]
    pub fn insert_chunk(&self, ids: &[u64], slots: &[&[u8]]) -> Result<()> {
        if slots.len() != self.schema.slots.len() {
            return Err(Error::LengthMismatch {
                what: "slot count of chunk for table",
                name: self.schema.name.clone(),
                expected: self.schema.slots.len() as u64,
                actual: slots.len() as u64,
            });
        }
        for (s, v) in slots.iter().enumerate() {
            let expected = self.slot_bytes[s] as u64 * ids.len() as u64;
            if v.len() as u64 != expected {
                return Err(Error::LengthMismatch {
                    what: "slot chunk",
                    name: format!("{}/{}", self.schema.name, self.schema.slots[s].name),
                    expected,
                    actual: v.len() as u64,
                });
            }
        }
        self.insert_rows(ids, slots);
        Ok(())
    }

    /// Inserts or replaces rows of checked lengths in bulk: their memory is taken a run of one
    /// arena at a time, filled outside any map lock, and put into the map one shard at a time,
    /// under one write lock each. A lock a row (the map's and the arena's) made each insert wait
    /// at the lock's atomic instruction for the stores of the one before, into memory no cache
    /// held: a third of a restore's time.
    fn insert_rows(&self, ids: &[u64], slots: &[&[u8]]) {
        let mut rows = Vec::with_capacity(ids.len());
        let mut start = 0;
        while start < ids.len() {
            let arena = self.arena(ids[start]);
            let run = ids[start..]
                .iter()
                .position(|&id| self.arena(id) != arena)
                .unwrap_or(ids.len() - start);
            self.slabs.alloc_run(arena, run, &mut rows);
            start += run;
        }
        for (r, row) in rows.iter_mut().enumerate() {
            self.fill_row(self.slabs.words_mut(row), slots, r);
        }
        let hashes: Vec<u64> = ids
            .iter()
            .map(|id| self.rows.hash_usize(id) as u64)
            .collect();
        // The rows of each map shard together (a counting sort), in their order within it.
        let shards = self.rows.shards();
        let shard_of = |h: u64| self.rows.determine_shard(h as usize);
        let mut starts = vec![0usize; shards.len() + 1];
        for &h in &hashes {
            starts[shard_of(h) + 1] += 1;
        }
        for s in 0..shards.len() {
            starts[s + 1] += starts[s];
        }
        let mut next = starts.clone();
        let mut order = vec![0usize; ids.len()];
        for (i, &h) in hashes.iter().enumerate() {
            let s = shard_of(h);
            order[next[s]] = i;
            next[s] += 1;
        }
        for (s, shard) in shards.iter().enumerate() {
            let run = &order[starts[s]..starts[s + 1]];
            if run.is_empty() {
                continue;
            }
            let mut map = shard.write();
            for (k, &i) in run.iter().enumerate() {
                if let Some(&ahead) = run.get(k + PREFETCH_AHEAD) {
                    prefetch_slot(&map, hashes[ahead]);
                }
                let row = std::mem::replace(&mut rows[i], Row::placeholder());
                self.put_locked(&mut map, s, hashes[i], ids[i], row);
            }
        }
    }

    /// Keeps the pre-image of `id`'s row (`row`: its words now, `None` if it has none) for an
    /// open point-in-time snapshot whose moment has passed, before a write; `in_map`: whether the
    /// id will have a row after the write. Called with the id's map entry locked. Returns the
    /// moment's tag for the row that holds the id after the write (see `cow`), if a pre-image is
    /// kept for it. The only cost to a trainer's write while no save is open is the check of
    /// `pre.active()`.
    #[inline]
    fn before_write(&self, id: u64, row: Option<&Row>, in_map: bool) -> Option<u16> {
        if !self.pre.active() {
            return None;
        }
        let tag = self.pre.tag();
        // A row that carries the moment's tag has its pre-image kept (only a write that kept it
        // tags the row, and only with the tag of the moment it kept it for): most writes of a
        // row during a save end here, without a lock or a lookup. Not for a removal, which
        // records that the id leaves the map.
        if in_map && row.is_some_and(|r| r.tag() == tag) {
            return Some(tag);
        }
        // The save has read the row already (and will not again): nothing to keep.
        if self.pre.bucket_read(PartitionRule::bucket_of(id)) {
            return None;
        }
        let shard = self.rows.determine_map(&id);
        let words = row.map(|r| self.slabs.words(r));
        self.pre.before_write(shard, id, words, in_map)
    }

    /// The bucket of `id` (hash `hash`) in map shard `shard`, write-locked as `map`, or the slot
    /// to insert it in. Finding the slot may first grow or rehash the map, which moves its rows:
    /// that is counted in `reshaped` first, for scans that walk the shard a part at a time.
    #[allow(clippy::type_complexity)]
    fn find_or_slot(
        &self,
        map: &mut RowMap,
        shard: usize,
        hash: u64,
        id: u64,
    ) -> std::result::Result<
        hashbrown::raw::Bucket<(u64, SharedValue<Row>)>,
        hashbrown::raw::InsertSlot,
    > {
        // hashbrown reshapes before it looks when no slot is left to grow into (`capacity` is
        // the rows plus the slots left).
        if map.len() == map.capacity() {
            self.reshaped[shard].fetch_add(1, Ordering::Relaxed);
        }
        let rehash = |(k, _): &(u64, SharedValue<Row>)| self.rows.hash_usize(k) as u64;
        map.find_or_find_insert_slot(hash, |(k, _)| *k == id, rehash)
    }

    /// Takes every row's tag off (see `cow`), each map shard write-locked in turn.
    fn clear_tags(&self) {
        for shard in self.rows.shards() {
            let map = shard.write();
            // SAFETY: the write guard keeps the table unmodified by others while its buckets are
            // walked, and the references do not outlive the loop.
            for bucket in unsafe { map.iter() } {
                // SAFETY: as above; the bucket was just yielded by the iterator.
                unsafe { bucket.as_mut() }.1.get_mut().set_tag(0);
            }
            drop(map);
        }
    }

    /// Inserts or replaces the row of `id` (hash `hash`, in map shard `shard`, whose write lock
    /// `map` is) with a filled row; a replaced row may still be read by a snapshot.
    fn put_locked(&self, map: &mut RowMap, shard: usize, hash: u64, id: u64, mut row: Row) {
        match self.find_or_slot(map, shard, hash, id) {
            // Retired while the shard is still locked: a reader by id finds the old row in the map
            // or in `retired`, never in neither.
            Ok(bucket) => {
                // SAFETY: the bucket was just found in `map`, which this thread holds locked for
                // writing, and nothing changed the table since.
                let (_, value) = unsafe { bucket.as_mut() };
                let old = value.get_mut();
                if let Some(tag) = self.before_write(id, Some(&*old), true) {
                    row.set_tag(tag);
                }
                let stamp = self.stamp_of(self.slabs.words(old));
                self.stamp(id, self.slabs.words_mut(&mut row), Some(stamp));
                self.retire(id, std::mem::replace(old, row));
            }
            Err(slot) => {
                debug_assert_eq!(self.rows.determine_shard(hash as usize), shard);
                if let Some(tag) = self.before_write(id, None, true) {
                    row.set_tag(tag);
                }
                self.stamp(id, self.slabs.words_mut(&mut row), None);
                // SAFETY: the slot was just found by `find_or_find_insert_slot` of `map`, which
                // this thread holds locked for writing, and nothing changed the table since.
                unsafe { map.insert_in_slot(hash, slot, (id, SharedValue::new(row))) };
            }
        }
    }

    /// Updates the row of `id` in place under its lock; inserts a zeroed row first if absent.
    pub fn upsert<R>(&self, id: u64, update: impl FnOnce(&mut RowMut<'_>) -> R) -> R {
        let hash = self.rows.hash_usize(&id) as u64;
        let shard = self.rows.determine_shard(hash as usize);
        let mut map = self.rows.shards()[shard].write();
        let (entry, old) = match self.find_or_slot(&mut map, shard, hash, id) {
            Ok(bucket) => {
                // SAFETY: the bucket was just found in `map`, which this thread holds locked for
                // writing until it returns, after the last use of the reference.
                let row = unsafe { bucket.as_mut() }.1.get_mut();
                if let Some(tag) = self.before_write(id, Some(row), true) {
                    row.set_tag(tag);
                }
                let old = self.stamp_of(self.slabs.words(row));
                (row, Some(old))
            }
            Err(slot) => {
                let mut row = self.zeroed_row(id);
                if let Some(tag) = self.before_write(id, None, true) {
                    row.set_tag(tag);
                }
                // SAFETY: the slot was just found by `find_or_slot` of `map`, which this thread
                // holds locked for writing, and nothing changed the map since; the reference
                // ends before the lock does.
                let bucket = unsafe { map.insert_in_slot(hash, slot, (id, SharedValue::new(row))) };
                (unsafe { bucket.as_mut() }.1.get_mut(), None)
            }
        };
        let words = self.slabs.words_mut(entry);
        self.stamp(id, words, old);
        let mut row = RowMut { table: self, words };
        update(&mut row)
    }

    /// Updates the row of `id` in place if it exists; returns whether it did.
    pub fn update(&self, id: u64, update: impl FnOnce(&mut RowMut<'_>)) -> bool {
        match self.rows.get_mut(&id) {
            Some(mut entry) => {
                if let Some(tag) = self.before_write(id, Some(&entry), true) {
                    entry.set_tag(tag);
                }
                let old = self.stamp_of(self.slabs.words(&entry));
                let words = self.slabs.words_mut(&mut entry);
                self.stamp(id, words, Some(old));
                let mut row = RowMut { table: self, words };
                update(&mut row);
                true
            }
            None => false,
        }
    }

    /// A copy of the bytes of slot `slot` of the row of `id`.
    pub fn get_slot(&self, id: u64, slot: usize) -> Option<Vec<u8>> {
        let row = self.rows.get(&id)?;
        let bytes: &[u8] = bytemuck::cast_slice(self.slabs.words(&row));
        let off = self.slot_offsets[slot];
        Some(bytes[off..off + self.slot_bytes[slot]].to_vec())
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Appends the bytes of every slot of the row of `id`, in slot order, to `out`; returns
    /// whether the row exists.
    pub fn append_row(&self, id: u64, out: &mut Vec<u8>) -> bool {
        let Some(row) = self.rows.get(&id) else {
            return false;
        };
        let bytes: &[u8] = bytemuck::cast_slice(self.slabs.words(&row));
        for (s, &b) in self.slot_bytes.iter().enumerate() {
            let off = self.slot_offsets[s];
            out.extend_from_slice(&bytes[off..off + b]);
        }
        true
    }

    /// Whether the table holds `id`.
    pub fn contains(&self, id: u64) -> bool {
        self.rows.contains_key(&id)
    }

    /// Removes the row of `id`; returns whether it existed. A live snapshot keeps the removed row.
    ///
    /// The row's memory is reused by the table's next inserts; the table gives memory back to
    /// the system only when it is dropped (its rows live in large slabs, not a heap block each).
    pub fn remove(&self, id: u64) -> bool {
        let hash = self.rows.hash_usize(&id) as u64;
        let shard = self.rows.determine_shard(hash as usize);
        let mut map = self.rows.shards()[shard].write();
        let Some(bucket) = map.find(hash, |(k, _)| *k == id) else {
            return false;
        };
        // SAFETY: the bucket was just found in `map`, which this thread holds locked for writing;
        // the reference ends before the bucket is removed.
        let row = unsafe { bucket.as_mut() }.1.get_mut();
        self.before_write(id, Some(row), false);
        if let Some(t) = &self.tracking {
            lock(&t.removed[shard]).push((id, crate::table::moment::now()));
        }
        // Retired before the entry goes, under its lock (see `put`); the placeholder left
        // behind for that moment has no memory and nobody else can see it.
        self.retire(id, std::mem::replace(row, Row::placeholder()));
        // SAFETY: as above; removing never moves other buckets.
        unsafe { map.erase(bucket) };
        true
    }

    /// Removes every row for which `keep` returns false (e.g. eviction of cold rows). Their memory
    /// is reused by later inserts, as with [`EmbeddingTable::remove`].
    pub fn retain(&self, mut keep: impl FnMut(u64) -> bool) {
        let doomed: Vec<u64> = self
            .rows
            .iter()
            .filter(|e| !keep(*e.key()))
            .map(|e| *e.key())
            .collect();
        for id in doomed {
            self.remove(id);
        }
    }

    /// Bytes of rows kept now for an open point-in-time snapshot (the pre-images of rows written
    /// since its moment and not yet saved), and the most kept at once since the table was made:
    /// the memory a save while training costs.
    pub fn point_in_time_bytes(&self) -> (usize, usize) {
        (self.pre.kept_bytes(), self.pre.peak_bytes())
    }

    /// Bytes of one row of each slot.
    pub fn slot_row_bytes(&self) -> &[usize] {
        &self.slot_bytes
    }

    /// Every id currently held, unordered.
    pub fn ids(&self) -> Vec<u64> {
        self.rows.iter().map(|e| *e.key()).collect()
    }

    /// Copies every wanted slot of `row` into row `r` of `out` (empty `out[s]`: slot not wanted).
    fn copy_row_into(&self, row: &[u64], r: usize, out: &mut [&mut [u8]]) {
        let bytes: &[u8] = bytemuck::cast_slice(row);
        for (s, dst) in out.iter_mut().enumerate() {
            if dst.is_empty() {
                continue;
            }
            let b = self.slot_bytes[s];
            let off = self.slot_offsets[s];
            dst[r * b..(r + 1) * b].copy_from_slice(&bytes[off..off + b]);
        }
    }
}

impl SparseTable for EmbeddingTable {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }

    fn len(&self) -> usize {
        self.rows.len()
    }

    /// A point-in-time snapshot (see `table::moment`). A snapshot taken while another is open
    /// shares its moment only while that moment has not come (both taken in one
    /// [`moment::at_one_moment`](crate::table::moment::at_one_moment) group, as one save of
    /// several workers' tables does) or is held
    /// ([`moment::hold`](crate::table::moment::hold)), and the open one has freed no row it
    /// read; otherwise it is refused: it would show rows as they were before it was asked for.
    fn snapshot(&self) -> Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(self.open_snapshot(None)?))
    }

    fn point_in_time(&self) -> bool {
        true
    }

    fn change_tracking(&self) -> Option<&dyn ChangeTracking> {
        self.tracking.as_ref().map(|_| self as &dyn ChangeTracking)
    }
}

impl EmbeddingTable {
    /// A snapshot of every row, or with `since`, of the rows written at or after that token;
    /// records its token when tracking.
    fn open_snapshot(&self, since: Option<u64>) -> Result<EmbeddingSnapshot<'_>> {
        let snap = EmbeddingSnapshot::new(self, since, &|g| {
            // The first snapshot starts the list of written ids, before its moment comes.
            if let Some(t) = &self.tracking {
                let _ = t.floor.compare_exchange(
                    0,
                    g,
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                );
            }
        })?;
        if let Some(t) = &self.tracking {
            t.last_snapshot
                .store(self.pre.generation(), std::sync::atomic::Ordering::SeqCst);
        }
        Ok(snap)
    }
}

impl ChangeTracking for EmbeddingTable {
    fn baseline(&self) -> Option<(String, u64)> {
        self.tracking
            .as_ref()
            .and_then(|t| lock(&t.baseline).clone())
    }

    fn last_snapshot(&self) -> u64 {
        self.tracking.as_ref().map_or(0, |t| {
            t.last_snapshot.load(std::sync::atomic::Ordering::SeqCst)
        })
    }

    fn changed_since(&self, since: u64) -> Result<(Box<dyn TableSnapshot + '_>, u64)> {
        let snap = self.open_snapshot(Some(since))?;
        Ok((Box::new(snap), self.pre.generation()))
    }

    fn changed_hint(&self) -> usize {
        self.tracking
            .as_ref()
            .map_or(0, |t| t.written.iter().map(|w| lock(w).len()).sum())
    }

    fn removed_between(&self, since: u64, until: u64) -> Vec<u64> {
        let Some(t) = &self.tracking else {
            return Vec::new();
        };
        let mut ids: Vec<u64> = t
            .removed
            .iter()
            .flat_map(|s| {
                lock(s)
                    .iter()
                    .filter(|&&(_, g)| g >= since && g < until)
                    .map(|&(id, _)| id)
                    .collect::<Vec<_>>()
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn baseline_of(&self, save_id: &str) -> Option<u64> {
        let t = self.tracking.as_ref()?;
        if let Some((id, token)) = lock(&t.baseline).as_ref() {
            if id == save_id {
                return Some(*token);
            }
        }
        let token = lock(&t.written_saves)
            .iter()
            .find(|(id, _)| id == save_id)
            .map(|&(_, token)| token)?;
        // The list of written ids starts at the floor: changes since an older token are lost.
        if token < t.floor.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        // The caller found the save committed: it is the baseline from now on.
        self.committed(Some(save_id), token);
        self.baseline()
            .filter(|(id, _)| id == save_id)
            .map(|(_, token)| token)
    }

    fn written(&self, save_id: &str, token: u64) {
        let Some(t) = &self.tracking else { return };
        let baseline = lock(&t.baseline).as_ref().map_or(0, |b| b.1);
        if token < baseline {
            return;
        }
        let mut written = lock(&t.written_saves);
        written.push((save_id.to_string(), token));
        // Only recent saves become parents; a bounded list whatever the job's length.
        const KEPT: usize = 16;
        if written.len() > KEPT {
            written.remove(0);
        }
    }

    fn committed(&self, save_id: Option<&str>, token: u64) {
        let Some(t) = &self.tracking else { return };
        let mut baseline = lock(&t.baseline);
        // Saves commit in any order: keep the newest moment.
        if baseline.as_ref().is_some_and(|b| b.1 > token) {
            return;
        }
        *baseline = save_id.map(|id| (id.to_string(), token));
        // Saves written before it can no longer be a baseline: changes since them are pruned.
        lock(&t.written_saves).retain(|(id, g)| *g >= token && Some(id.as_str()) != save_id);
        // Removals before that moment are in that save (or an older one) now.
        for s in t.removed.iter() {
            lock(s).retain(|&(_, g)| g >= token);
        }
        // So are the rows written before it: the list keeps those written since. The floor is
        // raised first, and each shard pruned under its read lock, so that a write either
        // finds its row's stamp under the new floor and lists it, or was listed and is kept.
        t.floor.store(token, std::sync::atomic::Ordering::SeqCst);
        // Their rows' stamps are prefetched ahead, like the probes; shards in parallel.
        let stamp_at = (self.row_words * 8).saturating_sub(8) as u64;
        self.rows
            .shards()
            .par_iter()
            .enumerate()
            .for_each(|(s, shard)| {
                let guard = shard.read();
                let mut written = lock(&t.written[s]);
                let rows = self.rows_of(&guard, &written);
                let mut k = 0;
                // `retain` visits every element once, in order: `k` follows it.
                written.retain(|_| {
                    if let Some(Some(ahead)) = rows.get(k + PREFETCH_AHEAD) {
                        prefetch_bytes(self.slabs.words(ahead).as_ptr() as u64 + stamp_at, 8);
                    }
                    let keep = rows[k].is_some_and(|r| self.stamp_of(self.slabs.words(r)) >= token);
                    k += 1;
                    keep
                });
            });
    }
}

impl std::fmt::Debug for EmbeddingTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingTable")
            .field("schema", &self.schema)
            .field("rows", &self.rows.len())
            .field("buckets", &self.buckets)
            .field("tracking", &self.tracking.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::dtype::Dtype;
    use crate::partition::BUCKETS;

    fn table() -> EmbeddingTable {
        sized_table(0)
    }

    /// [`table`] sized for `rows` rows: past about 57,000, its map's hash keeps bucket order
    /// (see `hasher`).
    fn sized_table(rows: usize) -> EmbeddingTable {
        EmbeddingTable::with_capacity(
            "t",
            KeyDtype::I64,
            vec![
                SlotSpec::new("embedding", Dtype::F32, vec![3]),
                SlotSpec::new("freq", Dtype::I64, vec![]),
            ],
            rows,
        )
        .unwrap()
    }

    fn shard_table(shard: u32, shard_num: u32) -> Result<EmbeddingTable> {
        let slots = vec![SlotSpec::new("embedding", Dtype::F32, vec![3])];
        EmbeddingTable::for_shard(
            "t",
            KeyDtype::I64,
            slots,
            Shard {
                index: shard,
                count: shard_num,
            },
            0,
        )
    }

    proptest::proptest! {
        /// A shard's buckets split into contiguous, equal parts, one per arena, in bucket order:
        /// what lets a save read one arena at a time. Buckets outside the shard (ids the worker
        /// was not meant to hold) go to the first or last arena.
        #[test]
        fn arenas_take_equal_runs_of_the_shards_buckets(
            shard_num in proptest::prop_oneof![1u32..600, 60_000u32..70_000],
            pick in proptest::num::u32::ANY,
        ) {
            let shard = pick % shard_num;
            let t = shard_table(shard, shard_num).unwrap();
            let range = PartitionRule::bucket_range(shard, shard_num);
            let arenas = t.slabs.arenas();
            proptest::prop_assert_eq!(arenas, range.len().clamp(1, slab::ARENAS as usize));
            let mut runs = vec![0usize; arenas];
            let mut last = 0;
            for b in range.clone() {
                let a = t.arena_of_bucket(b);
                proptest::prop_assert!(a >= last, "bucket {} went back to arena {}", b, a);
                last = a;
                runs[a] += 1;
            }
            let (least, most) = (range.len() / arenas, range.len().div_ceil(arenas));
            proptest::prop_assert!(runs.iter().all(|&r| r >= least && r <= most), "{:?}", runs);
            proptest::prop_assert_eq!(t.arena_of_bucket(0), 0);
            proptest::prop_assert_eq!(t.arena_of_bucket(BUCKETS - 1), arenas - 1);
        }
    }

    /// An open snapshot, the rows it must read, and the ids written since it opened.
    type OpenSave<'a> = (Box<dyn TableSnapshot + 'a>, HashMap<u64, i64>, HashSet<u64>);

    /// One step of the copy-on-write property test.
    #[derive(Clone, Debug)]
    enum Step {
        Upsert(u64, i64),
        Insert(u64, i64),
        Remove(u64),
        /// `insert_chunk` of these rows, in this order (ids may repeat: the last row wins).
        Chunk(Vec<(u64, i64)>),
        /// Opens a snapshot (if none), or scans and reads it whole, then closes it.
        Save,
    }

    /// `insert_chunk` of `rows` into a table of [`table`]'s slots: embedding `[v, id, 1]`.
    fn insert_rows_as_chunk(t: &EmbeddingTable, rows: &[(u64, i64)]) {
        let ids: Vec<u64> = rows.iter().map(|r| r.0).collect();
        let emb: Vec<f32> = rows
            .iter()
            .flat_map(|&(id, v)| [v as f32, id as f32, 1.0])
            .collect();
        let freq: Vec<i64> = rows.iter().map(|r| r.1).collect();
        t.insert_chunk(
            &ids,
            &[bytemuck::cast_slice(&emb), bytemuck::cast_slice(&freq)],
        )
        .unwrap();
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u64..40, any::<i64>()).prop_map(|(id, v)| Step::Upsert(id, v)),
            2 => (0u64..40, any::<i64>()).prop_map(|(id, v)| Step::Insert(id, v)),
            2 => (0u64..40).prop_map(Step::Remove),
            1 => proptest::collection::vec((0u64..40, any::<i64>()), 0..12).prop_map(Step::Chunk),
            1 => Just(Step::Save),
        ]
    }

    proptest::proptest! {
        /// Whatever is written while a snapshot is open, it reads exactly the rows and values of
        /// its moment; its pre-images never outlive it, and never exceed one per row written
        /// since its moment, so saves back to back do not grow memory.
        #[test]
        fn copy_on_write_reads_the_moment_and_keeps_nothing_after(
            steps in proptest::collection::vec(step(), 1..200),
        ) {
            let t = table();
            let mut model: HashMap<u64, i64> = HashMap::new();
            let mut open: Option<OpenSave<'_>> = None;
            for s in steps {
                let id = match &s {
                    Step::Upsert(id, _) | Step::Insert(id, _) | Step::Remove(id) => Some(*id),
                    Step::Save | Step::Chunk(_) => None,
                };
                match s {
                    Step::Upsert(id, v) => {
                        t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = v);
                        model.insert(id, v);
                    }
                    Step::Insert(id, v) => {
                        t.insert(id, &[&[0u8; 12], &v.to_le_bytes()]).unwrap();
                        model.insert(id, v);
                    }
                    Step::Remove(id) => {
                        proptest::prop_assert_eq!(t.remove(id), model.remove(&id).is_some());
                    }
                    Step::Chunk(rows) => {
                        insert_rows_as_chunk(&t, &rows);
                        for &(id, v) in &rows {
                            model.insert(id, v);
                            if let Some((_, _, written)) = open.as_mut() {
                                written.insert(id);
                            }
                        }
                    }
                    Step::Save => match open.take() {
                        None => open = Some((t.snapshot().unwrap(), model.clone(), HashSet::new())),
                        Some((snap, at_moment, _)) => {
                            let (ids, handles) = scan_all(snap.as_ref());
                            let got = freqs(snap.as_ref(), &ids, &handles).unwrap();
                            let saved: HashMap<u64, i64> = ids.into_iter().zip(got).collect();
                            proptest::prop_assert_eq!(saved, at_moment);
                            drop(snap);
                            proptest::prop_assert_eq!(t.pre.entries(), 0);
                            proptest::prop_assert_eq!(t.point_in_time_bytes().0, 0);
                        }
                    },
                }
                if let (Some(id), Some((_, _, written))) = (id, open.as_mut()) {
                    written.insert(id);
                    proptest::prop_assert!(t.pre.entries() <= written.len());
                    proptest::prop_assert!(t.point_in_time_bytes().0 <= written.len() * 24);
                }
            }
            drop(open);
            proptest::prop_assert_eq!(t.pre.entries(), 0);
            proptest::prop_assert_eq!(t.point_in_time_bytes().0, 0);
        }
    }

    proptest::proptest! {
        /// A chunk inserts exactly what its rows inserted one by one would: the last row of a
        /// repeated id wins, replaced and removed rows' memory is reused without leaking their
        /// bytes into a new row, and rows of every arena and map shard land, whatever the order.
        #[test]
        fn a_chunk_inserts_what_its_rows_one_by_one_would(
            rounds in proptest::collection::vec(
                (
                    proptest::collection::vec(
                        (
                            proptest::prop_oneof![0u64..3000, proptest::num::u64::ANY],
                            proptest::num::i64::ANY,
                        ),
                        0..400,
                    ),
                    proptest::collection::vec(0u64..3000, 0..100),
                    proptest::bool::ANY,
                ),
                1..6,
            ),
            tracked in proptest::bool::ANY,
            sized in proptest::sample::select(vec![0usize, 60_000, 1 << 20]),
        ) {
            let chunked = if tracked {
                sized_table(sized).with_change_tracking().unwrap()
            } else {
                sized_table(sized)
            };
            let single = table();
            for (rows, removals, sorted) in rounds {
                let mut rows = rows;
                if sorted {
                    // A checkpoint's order: long runs of one arena.
                    rows.sort_by_key(|&(id, _)| (PartitionRule::bucket_of(id), id));
                }
                insert_rows_as_chunk(&chunked, &rows);
                for &(id, v) in &rows {
                    let emb = [v as f32, id as f32, 1.0];
                    single
                        .insert(id, &[bytemuck::cast_slice(&emb), &v.to_le_bytes()])
                        .unwrap();
                }
                for id in removals {
                    proptest::prop_assert_eq!(chunked.remove(id), single.remove(id));
                }
                proptest::prop_assert_eq!(chunked.len(), single.len());
                for id in single.ids() {
                    for s in 0..2 {
                        proptest::prop_assert_eq!(chunked.get_slot(id, s), single.get_slot(id, s));
                    }
                }
            }
        }
    }

    /// The hash is laid out for the map shards' real size: dashmap's split of the capacity and
    /// hashbrown's slots for it, as `OrderedIdHashBuilder::for_rows` computes them.
    #[test]
    fn the_ordered_hash_knows_the_map_shards_size() {
        for rows in [60_000, 1 << 20, 3_000_001] {
            let t = sized_table(rows);
            let bits = t.rows.hasher().slot_bits();
            for shard in t.rows.shards() {
                assert_eq!(shard.read().buckets(), 1 << bits, "{rows} rows");
            }
        }
    }

    /// A table sized up front whose map then grows to several times that size: every row is
    /// still found, with its values, and removed rows are gone.
    #[test]
    fn a_sized_table_keeps_its_rows_past_its_size() {
        // All buckets; a shard of a power of two (its hash ordered too); of three (plain hash).
        for (shard, shard_num) in [(0, 1), (1, 4), (2, 3)] {
            sized_shard_table_keeps_its_rows(shard, shard_num);
        }
    }

    fn sized_shard_table_keeps_its_rows(shard: u32, shard_num: u32) {
        let t = EmbeddingTable::for_shard(
            "t",
            KeyDtype::I64,
            vec![
                SlotSpec::new("embedding", Dtype::F32, vec![3]),
                SlotSpec::new("freq", Dtype::I64, vec![]),
            ],
            Shard {
                index: shard,
                count: shard_num,
            },
            60_000,
        )
        .unwrap();
        let mut model: HashMap<u64, i64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..5 {
            let mut rows: Vec<(u64, i64)> = (0..40_000)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 400_000, round * 100_000 + i)
                })
                .collect();
            rows.sort_by_key(|&(id, _)| (PartitionRule::bucket_of(id), id));
            rows.dedup_by_key(|r| r.0);
            insert_rows_as_chunk(&t, &rows);
            model.extend(rows.iter().copied());
            for &(id, _) in rows.iter().step_by(7) {
                assert!(t.remove(id));
                model.remove(&id);
            }
        }
        assert_eq!(t.len(), model.len());
        for id in 0..400_000u64 {
            let want = model.get(&id).map(|v| v.to_le_bytes().to_vec());
            assert_eq!(t.get_slot(id, 1), want, "id {id}");
        }
    }

    #[test]
    fn chunks_racing_with_each_other_and_readers_leave_whole_rows() {
        let t = table();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let ids: Vec<u64> = (0..2000).collect();
        std::thread::scope(|scope| {
            for w in 0..2i64 {
                let (t, ids) = (&t, &ids);
                scope.spawn(move || {
                    for round in 0..150i64 {
                        let v = round * 2 + w;
                        let rows: Vec<(u64, i64)> = ids.iter().map(|&id| (id, v)).collect();
                        insert_rows_as_chunk(t, &rows);
                    }
                });
            }
            let reader = scope.spawn(|| {
                let mut checked = 0u64;
                let mut row = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for &id in ids.iter().step_by(7) {
                        row.clear();
                        if t.append_row(id, &mut row) {
                            let emb: &[f32] = bytemuck::cast_slice(&row[..12]);
                            let freq = i64::from_le_bytes(row[12..20].try_into().unwrap());
                            assert_eq!(emb, [freq as f32, id as f32, 1.0], "row {id} torn");
                            checked += 1;
                        }
                    }
                }
                checked
            });
            // The reader runs while the writers do; the scope joins the writers at its end.
            while t.len() < ids.len() {
                std::thread::yield_now();
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(reader.join().unwrap() > 0);
        });
        assert_eq!(t.len(), ids.len());
        for &id in &ids {
            let freq = i64::from_le_bytes(t.get_slot(id, 1).unwrap().try_into().unwrap());
            assert!(
                freq == 298 || freq == 299,
                "id {id}: last round's value, not {freq}"
            );
        }
    }

    #[test]
    fn a_chunk_of_the_wrong_shape_is_refused_naming_the_slot() {
        let t = table();
        let e = t
            .insert_chunk(&[1, 2], &[&[0u8; 24], &[0u8; 8]])
            .unwrap_err();
        assert!(e.to_string().contains("t/freq"), "{e}");
        let e = t.insert_chunk(&[1], &[&[0u8; 12]]).unwrap_err();
        assert!(e.to_string().contains("slot count"), "{e}");
        assert!(t.is_empty());
    }

    #[test]
    fn a_table_for_a_shard_that_does_not_exist_is_refused() {
        assert!(matches!(shard_table(0, 0), Err(Error::ZeroShards)));
        assert!(matches!(
            shard_table(4, 4),
            Err(Error::ShardOutOfRange { index: 4, num: 4 })
        ));
    }

    #[test]
    fn a_shard_table_keeps_ids_of_other_shards() {
        let t = shard_table(1, 3).unwrap();
        let ids: Vec<u64> = (0..3000).collect();
        for &id in &ids {
            t.insert(id, &[bytemuck::cast_slice(&[id as f32; 3])])
                .unwrap();
        }
        assert_eq!(t.len(), ids.len());
        for &id in &ids {
            let want = [id as f32; 3];
            assert_eq!(
                t.get_slot(id, 0).unwrap(),
                bytemuck::cast_slice::<f32, u8>(&want)
            );
        }
    }

    #[test]
    fn insert_update_read() {
        let t = table();
        let e: Vec<u8> = [1f32, 2., 3.]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        t.insert(-5i64 as u64, &[&e, &7i64.to_le_bytes()]).unwrap();
        t.upsert(-5i64 as u64, |r| r.slot_mut::<i64>(1)[0] += 1);
        assert_eq!(t.get_slot(-5i64 as u64, 1).unwrap(), 8i64.to_le_bytes());
        assert_eq!(t.get_slot(-5i64 as u64, 0).unwrap(), e);
        let err = t.insert(1, &[&e[..8], &[0; 8]]).unwrap_err().to_string();
        assert!(err.contains("t/embedding"), "{err}");
    }

    /// Scans `snap`, returning ids and handles in scan order.
    fn scan_all(snap: &dyn TableSnapshot) -> (Vec<u64>, Vec<u64>) {
        let (mut ids, mut handles) = (Vec::new(), Vec::new());
        snap.scan(7, false, &mut |c| {
            ids.extend_from_slice(c.ids);
            handles.extend_from_slice(c.handles);
            Ok(())
        })
        .unwrap();
        (ids, handles)
    }

    #[test]
    fn scan_parts_together_visit_every_row_once_with_its_handle() {
        let t = table();
        for id in 0..5000u64 {
            t.upsert(id.wrapping_mul(0x9e37_79b9_7f4a_7c15), |r| {
                r.slot_mut::<i64>(1)[0] = id as i64
            });
        }
        let snap = t.snapshot().unwrap();
        assert!(snap.scan_parts() > 1, "a dashmap has several shards");
        let (whole_ids, whole_handles) = scan_all(snap.as_ref());
        let mut by_parts = Vec::new();
        for part in 0..=snap.scan_parts() {
            snap.scan_part(part, 100, false, &mut |c| {
                assert_eq!(c.ids.len(), c.handles.len());
                by_parts.extend(c.ids.iter().copied().zip(c.handles.iter().copied()));
                Ok(())
            })
            .unwrap();
        }
        let mut whole: Vec<(u64, u64)> = whole_ids.into_iter().zip(whole_handles).collect();
        whole.sort_unstable();
        by_parts.sort_unstable();
        assert_eq!(whole.len(), 5000);
        assert_eq!(
            by_parts, whole,
            "parts (one past the last is empty) = the whole scan"
        );
    }

    fn freqs(snap: &dyn TableSnapshot, ids: &[u64], handles: &[u64]) -> Result<Vec<i64>> {
        let mut emb = vec![0u8; 12 * ids.len()];
        let mut freq = vec![0u8; 8 * ids.len()];
        if handles.is_empty() {
            snap.read_rows(ids, &mut [&mut emb, &mut freq])?;
        } else {
            // SAFETY: the callers pass handles from this snapshot's scan, with these ids.
            unsafe { snap.read_rows_by_handle(ids, handles, &mut [&mut emb, &mut freq]) }?;
        }
        Ok(freq
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    #[test]
    fn a_read_by_handle_that_fails_still_frees_and_uncounts_what_it_took() {
        let t = table();
        for id in 0..10u64 {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
        }
        let snap = t.snapshot().unwrap();
        let (ids, handles) = scan_all(snap.as_ref());
        for id in 0..10 {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = -1);
        }
        let row_bytes = t.row_words * 8;
        assert_eq!(t.point_in_time_bytes().0, 10 * row_bytes);
        let at = |id: u64| handles[ids.iter().position(|&x| x == id).unwrap()];
        assert_eq!(freqs(snap.as_ref(), &[3], &[at(3)]).unwrap(), vec![3]);
        // 4's pre-image is taken, then 3 is refused (read already): the run fails, and 4's
        // words are freed and no longer counted all the same.
        let err = freqs(snap.as_ref(), &[4, 3], &[at(4), at(3)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("id 3"), "{err}");
        assert_eq!(t.point_in_time_bytes().0, 8 * row_bytes);
        drop(snap);
        assert_eq!(t.point_in_time_bytes().0, 0);
    }

    #[test]
    fn a_snapshot_shows_its_moment_whatever_is_written_after_it() {
        for by_handle in [true, false] {
            let t = table();
            for id in 0..100u64 {
                t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
            }
            let snap = t.snapshot().unwrap();
            // Written after the moment, some before the scan and some after it.
            for id in 0..25 {
                assert!(t.remove(id));
            }
            t.upsert(1000, |_| ());
            for id in 50..60 {
                t.insert(id, &[&[0u8; 12], &(-1i64).to_le_bytes()]).unwrap();
            }
            let (ids, handles) = scan_all(snap.as_ref());
            for id in 25..50 {
                assert!(t.remove(id));
            }
            for id in 60..70 {
                t.update(id, |r| r.slot_mut::<i64>(1)[0] = -2);
            }
            t.insert(10, &[&[0u8; 12], &(-3i64).to_le_bytes()]).unwrap();
            t.upsert(1001, |_| ());
            // Every row alive at the moment, and no other, with its value then.
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..100).collect::<Vec<_>>());
            let handles = if by_handle { handles } else { Vec::new() };
            let got = freqs(snap.as_ref(), &ids, &handles).unwrap();
            for (r, &id) in ids.iter().enumerate() {
                assert_eq!(got[r], id as i64, "id {id}");
            }
            let (kept, peak) = t.point_in_time_bytes();
            assert_eq!(kept, 0, "pre-images are freed as they are read");
            assert!(peak >= 62 * 24, "{peak}");
            // A pre-image is read once; reading it again is an error, not a later value.
            let err = freqs(snap.as_ref(), &[55], &[]).unwrap_err().to_string();
            assert!(err.contains("id 55"), "{err}");
            // A save cannot join a moment whose rows were already freed as they were read.
            let second = t
                .snapshot()
                .err()
                .expect("a late second snapshot is refused");
            assert!(second.to_string().contains("another save"), "{second}");
            drop(snap);
            assert_eq!(t.pre.entries(), 0, "no pre-image outlives its snapshot");
            // Writes with no snapshot open keep nothing.
            t.upsert(5000, |_| ());
            assert_eq!(t.pre.entries(), 0);
            assert_eq!(t.retired.kept(), 0);
            let snap = t.snapshot().unwrap();
            let (ids, _) = scan_all(snap.as_ref());
            assert!(ids.contains(&1001) && ids.contains(&5000) && !ids.contains(&0));
        }
    }

    /// A snapshot's ids and handles in (bucket, id) order, as a save reads them.
    fn in_bucket_order(snap: &dyn TableSnapshot) -> Vec<(u64, u64)> {
        let (ids, handles) = scan_all(snap);
        let mut rows: Vec<(u64, u64)> = ids.into_iter().zip(handles).collect();
        rows.sort_unstable_by_key(|&(id, _)| (PartitionRule::bucket_of(id), id));
        rows
    }

    #[test]
    fn writes_to_buckets_the_save_has_read_whole_keep_no_pre_image() {
        const ROWS: u64 = 20_000;
        for by_handle in [true, false] {
            let t = table();
            for id in 0..ROWS {
                t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
            }
            let snap = t.snapshot().unwrap();
            let rows = in_bucket_order(snap.as_ref());
            // The first half read, in chunks of consecutive rows as a save's writer takes them.
            let half = rows.len() / 2;
            for chunk in rows[..half].chunks(700) {
                let (ids, handles): (Vec<u64>, Vec<u64>) = chunk.iter().copied().unzip();
                let handles = if by_handle { handles } else { Vec::new() };
                let got = freqs(snap.as_ref(), &ids, &handles).unwrap();
                assert_eq!(got, ids.iter().map(|&id| id as i64).collect::<Vec<_>>());
            }
            // Then every row written: only rows the save has not read yet, or that share a
            // bucket with them (at the edges of the chunks), keep their pre-image.
            for id in 0..ROWS {
                t.update(id, |r| r.slot_mut::<i64>(1)[0] = -1);
            }
            let kept = t.pre.entries();
            let unread = rows.len() - half;
            assert!(
                kept >= unread && kept < unread + 29 * 10,
                "{kept} pre-images for {unread} unread rows"
            );
            // A row replaced or removed there is freed at once; elsewhere it is kept for the
            // snapshot until it ends.
            let (read_row, unread_row) = (rows[half / 2].0, rows[half + half / 2].0);
            t.insert(read_row, &[&[0u8; 12], &7i64.to_le_bytes()])
                .unwrap();
            assert!(t.remove(read_row));
            assert_eq!(t.retired.kept(), 0);
            t.insert(unread_row, &[&[0u8; 12], &7i64.to_le_bytes()])
                .unwrap();
            assert_eq!(t.retired.kept(), 1);
            // The rest still shows the moment; the row replaced there is freed once its bucket
            // is read.
            let (ids, handles): (Vec<u64>, Vec<u64>) = rows[half..].iter().copied().unzip();
            let handles = if by_handle { handles } else { Vec::new() };
            let got = freqs(snap.as_ref(), &ids, &handles).unwrap();
            assert_eq!(got, ids.iter().map(|&id| id as i64).collect::<Vec<_>>());
            assert_eq!(t.retired.kept(), 0);
            // A row of a bucket read whole cannot be read again: it may have changed since
            // without a pre-image, and a later value is never given for the moment's.
            let again = rows[half / 2].0;
            let err = freqs(snap.as_ref(), &[again], &[]).unwrap_err().to_string();
            assert!(err.contains("asked for again"), "{err}");
            drop(snap);
            assert_eq!(t.pre.entries(), 0);
        }
        // Another shard of the same save, in another thread, may still join the moment once
        // the first has marked buckets read: it reads other buckets, and gets an error for a
        // row of a marked one.
        let t = table();
        for id in 0..ROWS {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
        }
        let first = crate::table::moment::for_save("s", || t.snapshot()).unwrap();
        let rows = in_bucket_order(first.as_ref());
        let half = rows.len() / 2;
        for chunk in rows[..half].chunks(700) {
            let (ids, handles): (Vec<u64>, Vec<u64>) = chunk.iter().copied().unzip();
            freqs(first.as_ref(), &ids, &handles).unwrap();
        }
        for id in 0..ROWS {
            t.update(id, |r| r.slot_mut::<i64>(1)[0] = -1);
        }
        let second = std::thread::scope(|s| {
            s.spawn(|| crate::table::moment::for_save("s", || t.snapshot()))
                .join()
                .unwrap()
        })
        .expect("the same save joins its moment");
        // Its scan walks the marked buckets too (a plan keeps only its own shard's rows).
        assert_eq!(scan_all(second.as_ref()).0.len(), ROWS as usize);
        let (ids, handles): (Vec<u64>, Vec<u64>) = rows[half + 700..].iter().copied().unzip();
        let got = freqs(second.as_ref(), &ids, &handles).unwrap();
        assert_eq!(got, ids.iter().map(|&id| id as i64).collect::<Vec<_>>());
        let err = freqs(second.as_ref(), &[rows[half / 2].0], &[]).unwrap_err();
        assert!(err.to_string().contains("asked for again"), "{err}");
        // Two snapshots sharing a moment may each read every row: writes keep every pre-image.
        let t = table();
        for id in 0..ROWS {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
        }
        let (a, b) = crate::table::moment::at_one_moment(|| (t.snapshot(), t.snapshot()));
        let (a, b) = (a.unwrap(), b.unwrap());
        for snap in [&a, &b] {
            let rows = in_bucket_order(snap.as_ref());
            for chunk in rows.chunks(700) {
                let (ids, handles): (Vec<u64>, Vec<u64>) = chunk.iter().copied().unzip();
                freqs(snap.as_ref(), &ids, &handles).unwrap();
            }
        }
        for id in 0..ROWS {
            t.update(id, |r| r.slot_mut::<i64>(1)[0] = -1);
        }
        assert_eq!(t.pre.entries(), ROWS as usize);
    }

    #[test]
    fn a_snapshot_never_joins_a_moment_that_has_passed_unheld() {
        let t = table();
        for id in 0..10u64 {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = 1);
        }
        let first = t.snapshot().unwrap();
        // Written after the first moment: a second save now must not show the old value.
        t.update(3, |r| r.slot_mut::<i64>(1)[0] = 2);
        let err = t.snapshot().err().expect("refused").to_string();
        assert!(err.contains("its moment has passed"), "{err}");
        drop(first);
        let second = t.snapshot().unwrap();
        let got = freqs(second.as_ref(), &[3], &[]).unwrap();
        assert_eq!(got, vec![2]);
        drop(second);
        // Two snapshots of one group share its moment.
        let (a, b) = crate::table::moment::at_one_moment(|| (t.snapshot(), t.snapshot()));
        assert!(a.is_ok() && b.is_ok());
    }

    #[test]
    fn snapshots_open_together_share_one_moment_and_each_reads_every_row() {
        let t = table();
        for id in 0..50u64 {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
        }
        let held = crate::table::moment::hold([&t as &dyn SparseTable]).unwrap();
        t.update(7, |r| r.slot_mut::<i64>(1)[0] = -1);
        let a = t.snapshot().unwrap();
        let b = t.snapshot().unwrap();
        t.update(8, |r| r.slot_mut::<i64>(1)[0] = -1);
        t.upsert(100, |_| ());
        for snap in [&a, &b, &a] {
            let (ids, handles) = scan_all(snap.as_ref());
            assert_eq!(ids.len(), 50);
            let got = freqs(snap.as_ref(), &ids, &handles).unwrap();
            assert!(
                ids.iter().zip(&got).all(|(&id, &f)| f == id as i64),
                "{got:?}"
            );
        }
        assert_eq!(
            t.point_in_time_bytes().0,
            2 * 24,
            "kept until the last sharer ends"
        );
        drop((held, a, b));
        assert_eq!(t.point_in_time_bytes().0, 0);
        assert_eq!(t.pre.entries(), 0);
    }

    #[test]
    fn a_scan_in_short_holds_sees_the_moment_while_writers_grow_and_rehash_the_map() {
        // A writer inserts new ids (growing every map shard), removes ids and puts them back (in
        // other buckets, leaving tombstones that make the map rehash in place), and updates
        // others, while snapshots walk the shards a few buckets a hold. The writer pauses at
        // each snapshot's moment, so that the table can be read whole then: the snapshot must
        // show exactly those rows, each once, with their values then.
        use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::SeqCst};
        const RUN: u8 = 0;
        const PAUSE: u8 = 1;
        const PAUSED: u8 = 2;
        let (stop, state, next) = (
            AtomicBool::new(false),
            AtomicU8::new(RUN),
            AtomicU64::new(0),
        );
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, SeqCst);
            }
        }
        let freq = |t: &EmbeddingTable, id: u64| {
            t.get_slot(id, 1)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        };
        /// New ids a writer inserts in a round: ten times the rows the table starts with, enough
        /// to grow every map shard several times.
        const GROWTH_BOUND: u64 = 30_000;
        for round in 0..16u64 {
            let t = table();
            for id in 0..3000u64 {
                t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
            }
            stop.store(false, SeqCst);
            next.store(1_000_000, SeqCst);
            std::thread::scope(|s| {
                s.spawn(|| {
                    let mut k = round;
                    while !stop.load(SeqCst) {
                        if state.load(SeqCst) == PAUSE {
                            state.store(PAUSED, SeqCst);
                            while state.load(SeqCst) == PAUSED && !stop.load(SeqCst) {
                                std::thread::yield_now();
                            }
                        }
                        k = crate::partition::fmix64(k + 1);
                        let n = next.load(SeqCst);
                        // New ids up to a bound: grown without one, the table (and so each
                        // scan, and the time the writer has to grow it further) grows with
                        // however slowly the machine runs the scans.
                        let grow = n < 1_000_000 + GROWTH_BOUND;
                        match k % 4 {
                            0 if grow => {
                                for id in n..n + 50 {
                                    t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = -(id as i64));
                                }
                                next.store(n + 50, SeqCst);
                            }
                            1 => {
                                let id = k % 3000;
                                if t.remove(id) {
                                    t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = -2);
                                }
                            }
                            2 => {
                                t.remove(1_000_000 + k % (n - 999_999));
                            }
                            _ => {
                                t.update(k % 3000, |r| r.slot_mut::<i64>(1)[0] -= 7);
                            }
                        }
                        if round % 3 == 0 {
                            std::thread::yield_now();
                        }
                    }
                });
                let _stop = Stop(&stop);
                for _ in 0..6 {
                    // The moment, with the writer paused: every row of the table then.
                    state.store(PAUSE, SeqCst);
                    while state.load(SeqCst) != PAUSED {
                        std::thread::yield_now();
                    }
                    let snap = t.snapshot().unwrap();
                    let then: HashMap<u64, i64> = (0..3000)
                        .chain(1_000_000..next.load(SeqCst))
                        .filter_map(|id| Some((id, freq(&t, id)?)))
                        .collect();
                    assert_eq!(then.len(), t.len());
                    state.store(RUN, SeqCst);
                    // Scanned with values, parts in turn, while the writer runs.
                    let mut seen = HashMap::new();
                    let (mut ids, mut handles) = (Vec::new(), Vec::new());
                    for part in 0..snap.scan_parts() {
                        snap.scan_part(part, 64, true, &mut |c| {
                            for (r, &id) in c.ids.iter().enumerate() {
                                let f = i64::from_le_bytes(
                                    c.slots[1][r * 8..r * 8 + 8].try_into().unwrap(),
                                );
                                assert!(seen.insert(id, f).is_none(), "id {id} twice");
                            }
                            ids.extend_from_slice(c.ids);
                            handles.extend_from_slice(c.handles);
                            Ok(())
                        })
                        .unwrap();
                    }
                    assert_eq!(
                        seen, then,
                        "the scan's rows and values against the moment's"
                    );
                    // Reads by handle agree with the values the scan handed out.
                    let by_handle = freqs(snap.as_ref(), &ids, &handles).unwrap();
                    for (id, f) in ids.iter().zip(by_handle) {
                        assert_eq!(then[id], f, "id {id}");
                    }
                }
            });
        }
    }

    #[test]
    fn tags_are_cleared_before_they_come_round_again() {
        let t = table();
        for id in 0..500u64 {
            t.upsert(id, |r| r.slot_mut::<i64>(1)[0] = id as i64);
        }
        t.pre.set_tag_for_test(u16::MAX - 1);
        for round in 0..4i64 {
            let snap = t.snapshot().unwrap();
            // Written twice after the moment: the second write finds the row tagged.
            for _ in 0..2 {
                for id in 0..500u64 {
                    t.update(id, |r| r.slot_mut::<i64>(1)[0] += 1000);
                }
            }
            let (ids, handles) = scan_all(snap.as_ref());
            let freq = freqs(snap.as_ref(), &ids, &handles).unwrap();
            for (id, f) in ids.iter().zip(freq) {
                assert_eq!(f, *id as i64 + 2000 * round, "round {round}, id {id}");
            }
            drop(snap);
            if round == 1 {
                // The tag came round: no row keeps one.
                assert_eq!(t.pre.tag(), 1);
                for shard in t.rows.shards() {
                    // SAFETY: read-locked while its buckets are read.
                    let map = shard.read();
                    for b in unsafe { map.iter() } {
                        assert_eq!(unsafe { b.as_ref() }.1.get().tag(), 0);
                    }
                }
            }
        }
    }

    #[test]
    fn reads_by_handle_are_never_torn_while_rows_are_updated() {
        // Each row's two slots always hold the same value; writers keep bumping both under the
        // row's lock while a reader copies rows by handle. A torn copy would show unequal halves.
        let t = EmbeddingTable::new(
            "t",
            KeyDtype::U64,
            vec![
                SlotSpec::new("a", Dtype::U64, vec![]),
                SlotSpec::new("b", Dtype::U64, vec![]),
            ],
        )
        .unwrap();
        for id in 0..2000u64 {
            t.upsert(id, |_| ());
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        /// Stops the writer however the reader ends, so a failed assertion never hangs the test.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut v = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    v += 1;
                    for id in (0..2000u64).step_by(7) {
                        t.update(id, |r| {
                            r.slot_mut::<u64>(0)[0] = v;
                            r.slot_mut::<u64>(1)[0] = v;
                        });
                    }
                }
            });
            let _stop = Stop(&stop);
            let mut torn = 0;
            for _ in 0..200 {
                // Each snapshot reads every row once, live or from its pre-image.
                let snap = t.snapshot().unwrap();
                let (ids, handles) = scan_all(snap.as_ref());
                let mut a = vec![0u8; 8 * ids.len()];
                let mut b = vec![0u8; 8 * ids.len()];
                // SAFETY: the handles came from this snapshot's scan, with these ids.
                unsafe { snap.read_rows_by_handle(&ids, &handles, &mut [&mut a, &mut b]) }.unwrap();
                torn += a.chunks(8).zip(b.chunks(8)).filter(|(x, y)| x != y).count();
            }
            assert_eq!(torn, 0, "rows copied while half-updated");
        });
    }
}

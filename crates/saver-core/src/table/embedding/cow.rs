//! Copy-on-write for point-in-time snapshots of an [`EmbeddingTable`](super::EmbeddingTable).
//!
//! While a snapshot is open, the first write to a row after the snapshot's moment (see
//! `table::moment`) keeps the row as it was: its words, or the fact that the id had no row then.
//! The snapshot reads kept rows instead of live ones, skips ids that had no row at its moment, and
//! adds the rows that were removed since. Kept rows are freed as the save reads them, and all at
//! once when the snapshot ends, so memory is bounded by the rows written during the save.
//!
//! A write keeps a pre-image under the write lock of the id's dashmap shard and the lock of the
//! shard's pre-images; a save's reads look for it under the latter (the `snapshot` module says
//! why that is enough). Both hold that lock as briefly as they can, since each waits for the
//! other there: the write copies the row before it (the map shard's write lock keeps the row
//! still), and a read takes the pre-images of a run of rows out of the map under it and copies
//! and frees them after.
//!
//! Each moment has a tag, and a row whose pre-image is kept carries the moment's tag (see
//! `slab::Row`): the trainer's next writes of the row in that moment, which are most of its
//! writes when it trains on a hot set, see the tag and skip the lock and the lookup. Tags cycle
//! through `1..=u16::MAX`; before one comes round again, every row's tag is cleared.
//!
//! A save reads the rows bucket by bucket, and once it has read every row of a bucket, a
//! pre-image of a row there serves nothing: the moment's only snapshot marks such buckets *read*
//! ([`PreImages::mark_read_buckets`]), and a write to a row of a read bucket keeps nothing. With
//! trainers that write rows all over the table, that is about half of the pre-images a save
//! would otherwise keep (and copy, and free); and a row replaced or removed during the save is
//! freed once its bucket is read (at once if it already was) instead of kept until the save
//! ends. A snapshot that shares its moment marks nothing
//! (each may read the same rows), and one that has marked a bucket refuses to read a row of it
//! again: that row may have been written since without a pre-image.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crossbeam_utils::CachePadded;

use super::hasher::IdHashBuilder;
use crate::partition::BUCKETS;
use crate::table::moment;

/// The pre-images of one map shard: keyed by ids, which `IdHashBuilder` hashes in a few cycles
/// (a first write during a save looks its id up here).
pub(super) type ShardPreImages = HashMap<u64, PreImage, IdHashBuilder>;

/// What a point-in-time snapshot kept of one row.
pub(super) struct PreImage {
    /// The row's words at the moment, or `None` if the id had no row then.
    pub(super) words: Option<Box<[u64]>>,
    /// Whether the id is in the table's map now (false: removed after the moment).
    pub(super) in_map: bool,
    /// Whether the save has read (and so freed) it.
    pub(super) read: bool,
}

/// Who shares the open moment.
#[derive(Default)]
struct Sharing {
    /// Snapshots open on the moment. A pre-image is freed as it is read only while one is open:
    /// with several, each may read the same rows.
    open: usize,
    /// Whether a pre-image was freed: a snapshot can no longer join the moment.
    freed_any: bool,
    /// The save the moment was opened for (see `moment::for_save`).
    save: Option<String>,
}

/// The pre-images of the open point-in-time snapshots, one map per dashmap shard.
///
/// Each part that one side writes often lies on cache lines of its own: every write of a
/// trainer reads `moment`, which changes only when a moment opens or closes, and would
/// otherwise miss the cache each time the save's reads had just written the byte counts, the
/// sharing lock or a neighbouring shard's lock on the same line.
pub(super) struct PreImages {
    moment: CachePadded<Moment>,
    sharing: CachePadded<Mutex<Sharing>>,
    shards: Box<[CachePadded<Mutex<ShardPreImages>>]>,
    bytes: CachePadded<KeptBytes>,
    /// One bit per bucket: whether the open moment's snapshot has read every row of it (see the
    /// module docs). Cleared when a moment opens, before its generation is published.
    read_buckets: Box<[AtomicU64]>,
}

/// What every write during a save reads: which moment is open.
struct Moment {
    /// Generation of the open moment (0: none).
    generation: AtomicU64,
    /// The tag of the open moment, or of the next one (see the module docs).
    tag: AtomicU16,
}

/// Bytes of row words kept.
struct KeptBytes {
    /// Kept now, and the most kept at once since the table was made.
    kept: AtomicUsize,
    peak: AtomicUsize,
    /// The most kept at once since the open moment began: what this moment's saves cost.
    moment_peak: AtomicUsize,
}

/// Pre-images a save's read took out of their shard's map ([`PreImages::take_run`]), to copy
/// after it lets the shard's lock go; freed, and counted as no longer kept (once for the run),
/// when dropped.
pub(super) struct Taken<'a> {
    /// Per row of the run: its kept words, if it had a pre-image.
    pub(super) words: Vec<Option<Box<[u64]>>>,
    /// Bytes of words taken out of the map.
    bytes: usize,
    kept: &'a AtomicUsize,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.kept.fetch_sub(self.bytes, Ordering::SeqCst);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PreImages {
    pub(super) fn new(shards: usize) -> Self {
        Self {
            moment: CachePadded::new(Moment {
                generation: AtomicU64::new(0),
                tag: AtomicU16::new(1),
            }),
            sharing: CachePadded::default(),
            shards: (0..shards).map(|_| CachePadded::default()).collect(),
            bytes: CachePadded::new(KeptBytes {
                kept: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
                moment_peak: AtomicUsize::new(0),
            }),
            read_buckets: (0..BUCKETS / 64).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The generation of the open moment (0: none).
    pub(super) fn generation(&self) -> u64 {
        self.moment.generation.load(Ordering::SeqCst)
    }

    /// Whether a write now must keep pre-images: one atomic load while no snapshot is open.
    #[inline]
    pub(super) fn active(&self) -> bool {
        moment::has_passed(self.moment.generation.load(Ordering::SeqCst))
    }

    /// Opens a snapshot. The first opens a moment (now, or at the end of the enclosing
    /// `moment::at_one_moment`); one opened while another is open joins its moment if that
    /// moment has not come yet (one group), is held, or was opened for the same save
    /// ([`moment::may_join`]), and the other has freed no row it read; otherwise `false`.
    /// `registered(g)` runs with the new moment's generation before the moment comes.
    pub(super) fn open(&self, registered: &dyn Fn(u64)) -> bool {
        let mut sharing = lock(&self.sharing);
        if sharing.open == 0 {
            // Nothing is kept with no moment open: this moment's peak starts at the bytes kept now.
            self.bytes
                .moment_peak
                .store(self.bytes.kept.load(Ordering::SeqCst), Ordering::SeqCst);
            // Before the generation is stored: a write that sees this moment's generation sees
            // no bucket of an earlier moment marked read.
            for w in self.read_buckets.iter() {
                w.store(0, Ordering::SeqCst);
            }
            moment::register(|g| {
                registered(g);
                self.moment.generation.store(g, Ordering::SeqCst)
            });
            *sharing = Sharing {
                open: 1,
                freed_any: false,
                save: moment::current_save(),
            };
            return true;
        }
        if sharing.freed_any || !moment::may_join(self.generation(), sharing.save.as_deref()) {
            return false;
        }
        sharing.open += 1;
        true
    }

    /// Closes a snapshot; the last one closes the moment, frees every pre-image and moves on to
    /// the next tag. Before a tag comes round again, `clear_tags` takes every row's tag off.
    pub(super) fn close(&self, clear_tags: impl FnOnce()) {
        let mut sharing = lock(&self.sharing);
        sharing.open -= 1;
        if sharing.open > 0 {
            return;
        }
        self.moment.generation.store(0, Ordering::SeqCst);
        for s in self.shards.iter() {
            let freed = std::mem::take(&mut *lock(s));
            let bytes: usize = freed.values().map(PreImage::bytes).sum();
            self.bytes.kept.fetch_sub(bytes, Ordering::SeqCst);
        }
        // After the generation is zeroed, so that a write that sees the next moment's generation
        // also sees its tag; under `sharing`, so that no moment opens while tags are cleared.
        let tag = self.moment.tag.load(Ordering::SeqCst);
        if tag == u16::MAX {
            clear_tags();
        }
        self.moment.tag.store(tag % u16::MAX + 1, Ordering::SeqCst);
    }

    /// The tag that a row whose pre-image the open moment keeps carries. Read after
    /// [`Self::active`]: a moment's tag is set before its generation.
    #[inline]
    pub(super) fn tag(&self) -> u16 {
        self.moment.tag.load(Ordering::SeqCst)
    }

    /// Called under the write lock of `id`'s shard `shard`, before a write while [`Self::active`]:
    /// keeps `row` (the row's words now, `None` if the id has none) unless a pre-image of `id` is
    /// kept already, and records whether the id will be in the map after the write. Returns the
    /// moment's tag, for the row written, if the moment is still open (so a pre-image of `id` is
    /// kept for it).
    pub(super) fn before_write(
        &self,
        shard: usize,
        id: u64,
        row: Option<&[u64]>,
        in_map: bool,
    ) -> Option<u16> {
        // Copied before the pre-images' lock, which a save's read of the shard's rows waits
        // for: the row cannot change meanwhile (its map shard is write-locked), and the copy,
        // into memory no cache holds, is most of what keeping a pre-image costs. Wasted only
        // for an untagged row whose pre-image is kept already (one removed and inserted again
        // during the save), which is rare.
        let words: Option<Box<[u64]>> = row.map(Into::into);
        let mut pre = lock(&self.shards[shard]);
        // Checked again under the lock: `close` clears each map after it zeroes the generation,
        // so a write that saw the snapshot open just before it closed keeps nothing stale; and
        // it moves on to the next tag only after it has cleared this map.
        if !self.active() {
            return None;
        }
        let tag = self.tag();
        if let Some(p) = pre.get_mut(&id) {
            p.in_map = in_map;
            return Some(tag);
        }
        let bytes = words.as_ref().map_or(0, |w| w.len() * 8);
        pre.insert(
            id,
            PreImage {
                words,
                in_map,
                read: false,
            },
        );
        // Counted before the shard's lock is let go: `close` and `mark_read` subtract a kept
        // row's bytes under that lock, and a count added after them wrapped below zero (a debug
        // build then panicked on the sum below).
        let now = self.bytes.kept.fetch_add(bytes, Ordering::SeqCst) + bytes;
        drop(pre);
        self.bytes.peak.fetch_max(now, Ordering::SeqCst);
        self.bytes.moment_peak.fetch_max(now, Ordering::SeqCst);
        Some(tag)
    }

    /// Whether the open moment's snapshot has read every row of bucket `b`, so that a write of a
    /// row there keeps no pre-image. A write asks under its row's map entry lock, after
    /// [`Self::active`]: the snapshot marked the bucket only after its copies of the bucket's rows
    /// and its looks for their pre-images, so a write that sees the mark cannot change what they
    /// found.
    #[inline]
    pub(super) fn bucket_read(&self, b: u32) -> bool {
        let b = b as usize;
        self.read_buckets[b / 64].load(Ordering::SeqCst) & (1 << (b % 64)) != 0
    }

    /// Marks `buckets` read: every row of them the snapshot will ever read has been read and
    /// checked against its pre-image. Only while one snapshot is open on the moment. A snapshot
    /// may still join the moment later: another shard of the same save, which reads other
    /// buckets (one that asks for a row of a marked bucket gets an error, as a second read
    /// does); joining is not refused here as it is once a pre-image is freed, because a scan,
    /// which walks every bucket of a map shard, needs every pre-image but no mark.
    /// Returns whether it marked them.
    pub(super) fn mark_read_buckets(&self, buckets: std::ops::Range<u32>) -> bool {
        if buckets.is_empty() {
            return false;
        }
        // Held while the bits are set, so that no snapshot joins in between.
        let sharing = lock(&self.sharing);
        if sharing.open != 1 {
            return false;
        }
        let (start, end) = (buckets.start as usize, buckets.end as usize);
        for w in start / 64..end.div_ceil(64) {
            let from = start.max(w * 64) - w * 64;
            let to = end.min(w * 64 + 64) - w * 64;
            let mask = (u64::MAX >> (64 - (to - from))) << from;
            self.read_buckets[w].fetch_or(mask, Ordering::SeqCst);
        }
        drop(sharing);
        true
    }

    /// The pre-images of shard `shard`, locked; call with the shard's map lock held.
    pub(super) fn shard(&self, shard: usize) -> MutexGuard<'_, ShardPreImages> {
        lock(&self.shards[shard])
    }

    /// Whether a read may free the pre-images it reads: only while no other snapshot shares
    /// the moment; and from then on none may join it.
    fn may_free(&self) -> bool {
        let mut sharing = lock(&self.sharing);
        if sharing.open > 1 {
            return false;
        }
        sharing.freed_any = true;
        true
    }

    /// A save's read of a run of rows of one shard (`pre`, its pre-images, locked by the
    /// caller; `ids`, the run): takes the words of those that have a pre-image out of the map,
    /// marked read, so that the caller copies and frees them after it lets the lock go, which
    /// a trainer's first write to a row of the shard waits for. Where another snapshot shares
    /// the moment, the words are copied and stay. An id whose pre-image says it had no row at
    /// the moment, or was read already, is returned as the error (what the run took before it
    /// is freed and counted as no longer kept all the same).
    pub(super) fn take_run(
        &self,
        pre: &mut ShardPreImages,
        ids: &[u64],
        may_free: &mut Option<bool>,
    ) -> std::result::Result<Taken<'_>, u64> {
        let mut taken = Taken {
            words: Vec::with_capacity(ids.len()),
            bytes: 0,
            kept: &self.bytes.kept,
        };
        for &id in ids {
            let Some(p) = pre.get_mut(&id) else {
                taken.words.push(None);
                continue;
            };
            if p.read || p.words.is_none() {
                return Err(id);
            }
            // Asked once a call, and only for a run that read a pre-image: a read that takes
            // none must not keep other shards of the save from joining the moment.
            if *may_free.get_or_insert_with(|| self.may_free()) {
                let words = p.words.replace(Box::default());
                taken.bytes += words.as_ref().map_or(0, |w| w.len() * 8);
                p.read = true;
                taken.words.push(words);
            } else {
                taken.words.push(p.words.clone());
            }
        }
        Ok(taken)
    }

    /// Bytes of pre-images kept now.
    pub(super) fn kept_bytes(&self) -> usize {
        self.bytes.kept.load(Ordering::SeqCst)
    }

    /// The most bytes of pre-images kept at once.
    pub(super) fn peak_bytes(&self) -> usize {
        self.bytes.peak.load(Ordering::SeqCst)
    }

    /// The most bytes of pre-images kept at once since the open moment (or the last one) began.
    pub(super) fn moment_peak(&self) -> usize {
        self.bytes.moment_peak.load(Ordering::SeqCst)
    }

    /// Sets the next moment's tag.
    #[cfg(test)]
    pub(super) fn set_tag_for_test(&self, tag: u16) {
        self.moment.tag.store(tag, Ordering::SeqCst);
    }

    /// Pre-image entries (kept or already read) of the open snapshot.
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

impl PreImage {
    fn bytes(&self) -> usize {
        self.words.as_ref().map_or(0, |w| w.len() * 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_the_buckets_marked_read_are_read_and_only_with_one_snapshot_open() {
        let pre = PreImages::new(1);
        assert!(pre.open(&|_| {}));
        for range in [3..130, 64..128, 200..201, 1000..1000, 65_000..65_536] {
            pre.mark_read_buckets(range);
        }
        let marked = |b: u32| (3..130).contains(&b) || b == 200 || (65_000..65_536).contains(&b);
        for b in 0..crate::partition::BUCKETS {
            assert_eq!(pre.bucket_read(b), marked(b), "bucket {b}");
        }
        pre.close(|| {});
        // A new moment starts with nothing read; with two snapshots on it, nothing is marked.
        let both = moment::at_one_moment(|| pre.open(&|_| {}) && pre.open(&|_| {}));
        assert!(both);
        assert!((0..crate::partition::BUCKETS).all(|b| !pre.bucket_read(b)));
        pre.mark_read_buckets(300..400);
        assert!(!pre.bucket_read(350));
        pre.close(|| {});
        pre.close(|| {});
    }
}

//! Row memory of an [`EmbeddingTable`](super::EmbeddingTable): rows side by side in large slabs,
//! instead of one heap block each.
//!
//! Why slabs:
//! - A table of millions of rows is millions of heap blocks: 16 bytes of allocator header a row,
//!   one allocation a row on every load, and a free a row when the table is dropped (5.5 s for the
//!   16.9 M rows of criteo-kaggle ×0.5).
//! - Rows land in memory in the order they are inserted. A table restored from a checkpoint is
//!   inserted in the checkpoint's order, which is the order the next save reads it in; so that
//!   save's row gather walks memory forwards instead of at random, and a random walk costs a TLB
//!   miss a row.
//!
//! Each table has [`ARENAS`] arenas, one for each 256th of its bucket range, so that the rows of
//! neighbouring buckets lie in one arena: a save reads rows bucket by bucket, and then walks one
//! 256th of the table at a time (a few megabytes for a table of a gigabyte, within the reach of
//! the TLB and the caches) instead of the whole table. Arenas by dashmap shard, as first built,
//! spread every bucket's rows over an eighth of the table, and the save's row gather took three
//! times as long (`benches/gather.rs`). A freed row goes on its arena's free list and is reused by the
//! next insert there; slabs are only given back when the table is dropped.
//!
//! An arena of a table that grows by inserts takes its first [`POOLED_ROWS`] rows from one of a
//! few pools shared by neighbouring arenas, and gets slabs of its own only past them. Without
//! pools, a model of hundreds of tables of some thousands of rows would leave a third of its
//! memory in the unfilled ends of 256 small slabs per table (200 tables of 20 000 rows took
//! 992 MB instead of 703 MB); with them, a small table's rows fill a few slabs, and a large
//! table's first 256 rows per arena, a small part of it, are all that lie outside their arena.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;
use std::sync::Mutex;

/// Arenas of a table, at most: one for each 256th of its bucket range.
pub(super) const ARENAS: u32 = 256;

/// Rows an arena takes from its pool before it gets slabs of its own.
const POOLED_ROWS: usize = 256;

/// Pools of a table, at most: each serves the first rows of a range of neighbouring arenas.
const POOLS: usize = 8;

/// Rows of the smallest slab. Small, because a model may have hundreds of small tables.
const MIN_SLAB_ROWS: usize = 16;

/// The largest slab. Slabs double up to this, so at most about half of an arena's memory is
/// reserved ahead of its rows, and never more than this; the kernel maps a slab's pages only when
/// rows are written to them.
const MAX_SLAB_BYTES: usize = 64 << 20;

/// The memory of one row: `row_words` words inside a slab of the table's [`Slabs`].
///
/// Not `Clone`, and freed only by handing it back to [`Slabs::free`]: whoever holds a `Row` owns
/// its memory. Dropping one without freeing it leaks its words until the table is dropped.
///
/// The pointer's top [`TAG_BITS`] bits, which no user address on a 64-bit platform uses (every
/// slab is checked), hold a tag: the point-in-time moment whose pre-image of the row is kept
/// (see `cow`), so that a trainer's write during a save finds that out in the map entry it has
/// in hand, without a lock or a lookup, and the row costs no memory more.
pub(super) struct Row(NonNull<u64>);

/// Bits of a row's pointer that hold its tag.
const TAG_BITS: u32 = 16;

/// Where the tag starts: above every address a slab may have.
#[cfg(target_pointer_width = "64")]
const TAG_SHIFT: u32 = usize::BITS - TAG_BITS;

// SAFETY: a `Row` is an exclusive claim on words that only its holder reads or writes (through
// `&Row` / `&mut Row`), like the `Box<[u64]>` it replaces.
unsafe impl Send for Row {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Row {}

impl Row {
    /// A placeholder for a moment under a map entry's lock; it has no words and is never read.
    pub(super) fn placeholder() -> Self {
        Row(NonNull::dangling())
    }

    /// The row's address: what snapshots hand out as its handle.
    pub(super) fn addr(&self) -> u64 {
        self.ptr() as u64
    }

    /// The row's words, its tag taken off.
    fn ptr(&self) -> *mut u64 {
        #[cfg(target_pointer_width = "64")]
        return self.0.as_ptr().map_addr(|a| a & ((1 << TAG_SHIFT) - 1));
        #[cfg(not(target_pointer_width = "64"))]
        return self.0.as_ptr();
    }

    /// The row's tag: 0 for a row never tagged (see [`Row`]).
    pub(super) fn tag(&self) -> u16 {
        #[cfg(target_pointer_width = "64")]
        return (self.0.as_ptr().addr() >> TAG_SHIFT) as u16;
        // No bits to spare: no row is ever tagged.
        #[cfg(not(target_pointer_width = "64"))]
        return 0;
    }

    /// Sets the row's tag.
    pub(super) fn set_tag(&mut self, tag: u16) {
        #[cfg(target_pointer_width = "64")]
        {
            let tagged = self.ptr().map_addr(|a| a | (tag as usize) << TAG_SHIFT);
            // SAFETY: the address without its tag is not null (it is a `NonNull`'s), and a tag
            // only adds bits.
            self.0 = unsafe { NonNull::new_unchecked(tagged) };
        }
        #[cfg(not(target_pointer_width = "64"))]
        let _ = tag;
    }
}

/// The slabs of one table.
pub(super) struct Slabs {
    row_words: usize,
    arenas: Box<[Mutex<Arena>]>,
    /// Where arenas take their first rows from (see the module docs).
    pools: Box<[Mutex<Arena>]>,
}

/// One slab: zeroed words, held by a raw pointer rather than a `Box`, because rows inside it are
/// read and written through pointers of their own while the arena adds slabs; a `Box` would claim
/// the whole slab each time it is touched.
struct Slab {
    ptr: NonNull<u64>,
    words: usize,
}

impl Slab {
    fn new(words: usize) -> Self {
        let layout = Self::layout(words);
        // SAFETY: `words` is at least 1 (callers never ask for an empty slab), so the layout's size
        // is not zero.
        let ptr = unsafe { alloc_zeroed(layout) }.cast::<u64>();
        let ptr = NonNull::new(ptr).unwrap_or_else(|| handle_alloc_error(layout));
        // Rows keep a tag in their pointers' top bits. Linux hands out user memory below 2^47 on
        // x86_64 and below 2^48 (or 2^52 when a program asks for it with an address hint, which
        // allocators do not) on aarch64; a slab above would have its rows' addresses cut, so
        // it is refused outright rather than risked.
        #[cfg(target_pointer_width = "64")]
        assert!(
            (ptr.as_ptr() as usize + words * 8) >> TAG_SHIFT == 0,
            "saver: the allocator returned table memory at {:#x}, above the {}-bit addresses \
             whose top bits EmbeddingTable rows use as tags",
            ptr.as_ptr() as usize,
            TAG_SHIFT
        );
        Slab { ptr, words }
    }

    fn layout(words: usize) -> Layout {
        Layout::array::<u64>(words).expect("a slab is at most MAX_SLAB_BYTES")
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, and freed only here.
        unsafe { dealloc(self.ptr.as_ptr().cast(), Self::layout(self.words)) }
    }
}

/// One arena's (or pool's) slabs and free rows.
struct Arena {
    slabs: Vec<Slab>,
    /// Rows of the last slab not yet handed out start at this index of it.
    next: usize,
    free: Vec<Row>,
    /// Rows the next slab will hold.
    grow: usize,
    /// Rows still to take from the pool before this arena adds a slab of its own.
    pooled: usize,
}

impl Arena {
    fn new(first: usize, pooled: usize) -> Mutex<Self> {
        Mutex::new(Self {
            slabs: Vec::new(),
            next: 0,
            free: Vec::new(),
            grow: first,
            pooled,
        })
    }

    /// A row never handed out before, from the last slab or a new one.
    fn fresh(&mut self, row_words: usize) -> Row {
        let rows_in_last = self.slabs.last().map_or(0, |s| s.words / row_words);
        if self.next == rows_in_last {
            let rows = self.grow;
            self.slabs.push(Slab::new(rows * row_words));
            self.next = 0;
            self.grow = (rows * 2).min(max_slab_rows(row_words));
        }
        let at = self.next * row_words;
        self.next += 1;
        let slab = self.slabs.last().expect("a slab was just ensured");
        // SAFETY: this row of the last slab (`at + row_words <= words`) was never handed out.
        Row(unsafe { NonNull::new_unchecked(slab.ptr.as_ptr().add(at)) })
    }

    #[cfg(test)]
    fn reserved_bytes(&self) -> usize {
        self.slabs.iter().map(|s| s.words * 8).sum()
    }
}

fn lock(arena: &Mutex<Arena>) -> std::sync::MutexGuard<'_, Arena> {
    // A poisoned arena only means a panic elsewhere while it was locked; its lists are updated by
    // single pushes and pops, never left half-changed.
    arena.lock().unwrap_or_else(|e| e.into_inner())
}

// SAFETY: the arena owns its slabs (plain memory, freed by whichever thread drops the table), and
// its free rows point into them; it moves between threads only inside its `Mutex`.
unsafe impl Send for Arena {}

/// Rows of each arena's first slab, for `expected` rows spread over `arenas` arenas.
fn first_slab_rows(expected: usize, arenas: usize, max: usize) -> usize {
    // Ids spread over the arenas by hash, unevenly: an arena's share of the rows varies by about
    // its square root. 1/16 more and three times that keeps almost every arena's load in its
    // first slab.
    let share = expected.div_ceil(arenas);
    (share + share / 16 + 3 * share.isqrt()).clamp(MIN_SLAB_ROWS.min(max), max)
}

/// How a table's arenas and pools start.
struct Firsts {
    /// Rows of an arena's first slab of its own.
    first: usize,
    /// Rows an arena takes from its pool first.
    pooled: usize,
    /// Rows of a pool's first slab.
    pool_first: usize,
}

impl Firsts {
    fn new(row_words: usize, arenas: usize, expected_rows: usize) -> Self {
        let max = max_slab_rows(row_words);
        let pool_first = first_slab_rows(expected_rows, POOLS.min(arenas), max);
        // A load of enough rows fills every arena's first slab: no pool needed.
        if expected_rows.div_ceil(arenas) >= POOLED_ROWS {
            Self {
                first: first_slab_rows(expected_rows, arenas, max),
                pooled: 0,
                pool_first,
            }
        } else {
            Self {
                first: POOLED_ROWS.min(max),
                pooled: POOLED_ROWS,
                pool_first,
            }
        }
    }
}

/// Rows of the largest slab.
fn max_slab_rows(row_words: usize) -> usize {
    (MAX_SLAB_BYTES / (row_words * 8).max(1)).max(1)
}

impl Slabs {
    /// Slabs for rows of `row_words` words in `arenas` arenas; `expected_rows` (a load's row
    /// count, or 0) sizes the first slab of each arena so that a load's rows sit in one slab.
    pub(super) fn new(row_words: usize, arenas: usize, expected_rows: usize) -> Self {
        let arenas = arenas.max(1);
        let pools = POOLS.min(arenas);
        let Firsts {
            first,
            pooled,
            pool_first,
        } = Firsts::new(row_words, arenas, expected_rows);
        Self {
            row_words,
            arenas: (0..arenas).map(|_| Arena::new(first, pooled)).collect(),
            pools: (0..pools).map(|_| Arena::new(pool_first, 0)).collect(),
        }
    }

    /// A row from arena `arena` (taken modulo the arena count). Its words hold whatever the last
    /// row there held, zeros if none: the caller writes all of them.
    pub(super) fn alloc(&self, arena: usize) -> Row {
        if self.row_words == 0 {
            return Row::placeholder();
        }
        let arena = arena % self.arenas.len();
        let mut a = lock(&self.arenas[arena]);
        if let Some(row) = a.free.pop() {
            return row;
        }
        if a.pooled == 0 {
            return a.fresh(self.row_words);
        }
        a.pooled -= 1;
        // One lock at a time: the pool is never locked while holding another arena's lock.
        drop(a);
        lock(&self.pools[arena * self.pools.len() / self.arenas.len()]).fresh(self.row_words)
    }

    /// `n` rows from arena `arena`, appended to `rows`, under one lock of the arena (and at most
    /// one of its pool): a load inserts runs of rows of one arena, since a checkpoint holds its
    /// rows in bucket order, and a lock a row made every row wait, at the lock's atomic
    /// instruction, for the stores into the row before it. Their words hold whatever the last
    /// rows there held, zeros if none: the caller writes all of them.
    pub(super) fn alloc_run(&self, arena: usize, n: usize, rows: &mut Vec<Row>) {
        if self.row_words == 0 {
            rows.extend((0..n).map(|_| Row::placeholder()));
            return;
        }
        let arena = arena % self.arenas.len();
        let mut a = lock(&self.arenas[arena]);
        let reused = n.min(a.free.len());
        let at = a.free.len() - reused;
        rows.extend(a.free.drain(at..));
        let pooled = (n - reused).min(a.pooled);
        if pooled > 0 {
            a.pooled -= pooled;
            // One lock at a time, as in `alloc`.
            drop(a);
            let mut pool = lock(&self.pools[arena * self.pools.len() / self.arenas.len()]);
            for _ in 0..pooled {
                rows.push(pool.fresh(self.row_words));
            }
            drop(pool);
            a = lock(&self.arenas[arena]);
        }
        for _ in 0..n - reused - pooled {
            rows.push(a.fresh(self.row_words));
        }
    }

    /// Gives `row`, taken from arena `arena`, back for reuse. The caller must be sure that no one
    /// still reads it: no snapshot that saw it is alive.
    pub(super) fn free(&self, arena: usize, mut row: Row) {
        if self.row_words > 0 {
            // The next holder of the row starts with no tag (see `Row`).
            row.set_tag(0);
            lock(&self.arenas[arena % self.arenas.len()]).free.push(row);
        }
    }

    /// Arenas of the table.
    pub(super) fn arenas(&self) -> usize {
        self.arenas.len()
    }

    /// The words of `row`.
    pub(super) fn words<'a>(&'a self, row: &'a Row) -> &'a [u64] {
        // SAFETY: every `Row` but a placeholder (which has no words here, or is never read: see
        // `Row::placeholder`) was made by `alloc` of these slabs and points at `row_words` words
        // of a slab that lives as long as `self`. Rows never overlap, and `&Row` excludes a
        // `&mut Row` to the same row.
        unsafe { std::slice::from_raw_parts(row.ptr(), self.row_words) }
    }

    /// The words of `row`, to write.
    pub(super) fn words_mut<'a>(&'a self, row: &'a mut Row) -> &'a mut [u64] {
        // SAFETY: as in `words`; `&mut Row` is the only access to these words.
        unsafe { std::slice::from_raw_parts_mut(row.ptr(), self.row_words) }
    }

    /// Slabs, over all arenas and pools.
    #[cfg(test)]
    pub(super) fn slab_count(&self) -> usize {
        self.arenas
            .iter()
            .chain(self.pools.iter())
            .map(|a| lock(a).slabs.len())
            .sum()
    }

    /// Bytes of slab memory reserved, handed out or not.
    #[cfg(test)]
    pub(super) fn reserved_bytes(&self) -> usize {
        self.arenas
            .iter()
            .chain(self.pools.iter())
            .map(|a| lock(a).reserved_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_never_overlap_and_freed_rows_are_reused() {
        let slabs = Slabs::new(3, 2, 0);
        let mut rows: Vec<Row> = (0..5000).map(|i| slabs.alloc(i)).collect();
        for (i, row) in rows.iter_mut().enumerate() {
            slabs.words_mut(row).fill(i as u64);
        }
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(slabs.words(row), [i as u64; 3], "row {i} was overwritten");
        }
        let reserved = slabs.reserved_bytes();
        // Slabs double, so at most about half the memory waits for rows.
        assert!(
            reserved <= 2 * 5000 * 24 + 2 * MIN_SLAB_ROWS * 24,
            "{reserved}"
        );
        let freed = rows.pop().unwrap();
        let addr = freed.addr();
        slabs.free(4999, freed);
        assert_eq!(
            slabs.alloc(4999).addr(),
            addr,
            "a freed row is reused first"
        );
        assert_eq!(slabs.reserved_bytes(), reserved);
    }

    #[test]
    fn a_load_sized_first_slab_holds_the_load_in_one_slab() {
        let slabs = Slabs::new(2, 4, 4000);
        let first: Vec<u64> = (0..1000).map(|_| slabs.alloc(1).addr()).collect();
        assert!(
            first.windows(2).all(|w| w[1] == w[0] + 16),
            "rows of one arena follow each other"
        );
        // 1000 rows an arena, and 1/16 and 3 × √1000 more for an uneven spread.
        assert_eq!(slabs.reserved_bytes(), (1000 + 62 + 93) * 16);
    }

    proptest::proptest! {
        /// Under any mix of allocations and frees over any arenas, live rows never share memory
        /// (each keeps what was written to it), and each arena's slabs stay within twice the
        /// most rows it had live plus its first slab.
        #[test]
        fn live_rows_keep_their_words_under_any_allocs_and_frees(
            row_words in 1usize..6,
            arenas in 1usize..5,
            expected in 0usize..2000,
            ops in proptest::collection::vec((0usize..8, proptest::bool::ANY), 1..400),
        ) {
            let slabs = Slabs::new(row_words, arenas, expected);
            let mut live: Vec<(usize, u64, Row)> = Vec::new();
            // Live rows of each arena now, and the most it had.
            let mut now = vec![0usize; arenas];
            let mut most = vec![0usize; arenas];
            for (k, (arena, alloc)) in ops.into_iter().enumerate() {
                if alloc || live.is_empty() {
                    let mut row = slabs.alloc(arena);
                    slabs.words_mut(&mut row).fill(k as u64);
                    live.push((arena, k as u64, row));
                    now[arena % arenas] += 1;
                    most[arena % arenas] = most[arena % arenas].max(now[arena % arenas]);
                } else {
                    let (arena, _, row) = live.swap_remove(k % live.len());
                    slabs.free(arena, row);
                    now[arena % arenas] -= 1;
                }
                for (_, mark, row) in &live {
                    proptest::prop_assert!(slabs.words(row).iter().all(|w| w == mark));
                }
            }
            // Each arena's rows come from its pool, then from slabs of its own; either doubles.
            let f = Firsts::new(row_words, arenas, expected);
            let bound: usize = most.iter().map(|m| 2 * m + f.first).sum::<usize>()
                + POOLS.min(arenas) * f.pool_first;
            proptest::prop_assert!(slabs.reserved_bytes() <= bound * row_words * 8);
        }
    }

    #[test]
    fn a_small_table_fills_a_few_pooled_slabs() {
        let slabs = Slabs::new(16, ARENAS as usize, 0);
        // 20 000 rows, about 78 an arena: all from the pools.
        for i in 0..20_000 {
            slabs.alloc(i * 7919);
        }
        // Eight pools, each doubling from 16 to 2048 rows: 8 slabs each. Without pools, each of
        // the 256 arenas would have its own few small slabs, mostly unfilled.
        assert!(slabs.slab_count() <= 8 * 8, "{}", slabs.slab_count());
    }

    #[test]
    fn an_arena_past_its_pooled_rows_lays_its_rows_side_by_side() {
        let slabs = Slabs::new(2, ARENAS as usize, 0);
        let addrs: Vec<u64> = (0..2000).map(|_| slabs.alloc(3).addr()).collect();
        let own = &addrs[POOLED_ROWS..POOLED_ROWS * 2];
        assert!(
            own.windows(2).all(|w| w[1] == w[0] + 16),
            "rows past the pooled ones follow each other in the arena's own slab"
        );
    }

    #[test]
    fn rows_without_words_take_no_memory() {
        let slabs = Slabs::new(0, 8, 100);
        let mut row = slabs.alloc(3);
        assert!(slabs.words_mut(&mut row).is_empty());
        slabs.free(3, row);
        assert_eq!(slabs.reserved_bytes(), 0);
    }
}

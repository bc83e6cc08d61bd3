//! One moment for a save: the point in time T its snapshots show, for one table or several.
//!
//! A point-in-time snapshot keeps, from its moment on, the pre-image of every row a trainer writes
//! for the first time after it (copy-on-write), so that the save reads each row as it was at T
//! while training goes on. T is a *generation* of one process-wide clock. A snapshot registers
//! with its table under the next generation, which is then published by one atomic store; a
//! trainer's write, made under the row's lock, compares the table's registered generation with
//! the clock. Every write is thus either before the store (its value is the value at T) or after
//! it (the pre-image is kept), and tables registered under one generation before it is published
//! share exactly one T, whatever the trainer threads do meanwhile.
//!
//! [`at_one_moment`] groups the snapshots of several tables under one generation; a snapshot taken
//! outside a group gets a generation, and so a moment, of its own. Custom tables can build on the
//! same clock: register with [`register`], and test [`has_passed`] in every write.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::table::{SparseTable, TableSnapshot};

/// The newest published generation.
static CLOCK: AtomicU64 = AtomicU64::new(0);
/// Generations held open by [`hold`], once per live [`Held`].
static HELD: Mutex<Vec<u64>> = Mutex::new(Vec::new());
/// The last generation handed out; held while a group registers, so groups publish in order.
static NEXT: Mutex<u64> = Mutex::new(0);

thread_local! {
    /// The generation of the group this thread is registering, if any.
    static PENDING: Cell<Option<u64>> = const { Cell::new(None) };
    /// The save whose snapshots this thread takes, if it said ([`for_save`]).
    static SAVE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Runs `take`, which takes snapshots for the save `save_id`: a snapshot of a table that another
/// worker of the same save (a thread of this process saving another shard of it) holds open may
/// share that snapshot's moment, even once it has passed ([`may_join`]): every shard of one save
/// shows one moment, and a save under another id never shows a moment before its call.
pub fn for_save<R>(save_id: &str, take: impl FnOnce() -> R) -> R {
    let before = SAVE.with(|s| s.replace(Some(save_id.to_string())));
    /// Restores the outer save, even if `take` panics.
    struct Restore(Option<String>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SAVE.with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(before);
    take()
}

/// The save this thread takes snapshots for ([`for_save`]), if any.
pub fn current_save() -> Option<String> {
    SAVE.with(|s| s.borrow().clone())
}

/// Runs `take`, which takes the snapshots of a save, so that every point-in-time snapshot taken in
/// it (on this thread) shows one moment: the moment `at_one_moment` returns. Nested calls join the
/// outer group. Taking a snapshot is cheap (no row is copied), so the trainers' writes are not held
/// up; other groups wait for this one.
pub fn at_one_moment<R>(take: impl FnOnce() -> R) -> R {
    if PENDING.with(Cell::get).is_some() {
        return take();
    }
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    *next += 1;
    let generation = *next;
    /// Clears the pending generation and publishes it, even if `take` panics.
    struct Publish(u64);
    impl Drop for Publish {
        fn drop(&mut self) {
            PENDING.with(|p| p.set(None));
            CLOCK.store(self.0, Ordering::SeqCst);
        }
    }
    PENDING.with(|p| p.set(Some(generation)));
    let publish = Publish(generation);
    let out = take();
    drop(publish);
    drop(next);
    out
}

/// Registers a point-in-time snapshot: `record(generation)` stores the generation with the table
/// (where its writes will compare it with the clock). The moment comes when the enclosing
/// [`at_one_moment`] returns, or at once outside one.
pub fn register(record: impl FnOnce(u64)) {
    at_one_moment(|| record(PENDING.with(Cell::get).expect("set by at_one_moment")));
}

/// The clock now: the newest published generation. A write that records it (under its row's
/// lock, as [`has_passed`] is tested) came after the moment of every generation up to it and
/// before the moment of every later one: what change tracking stamps rows with.
#[inline]
pub fn now() -> u64 {
    CLOCK.load(Ordering::SeqCst)
}

/// Whether the moment of `generation` has come: a write for which this is true must keep the row's
/// pre-image (once) before changing it. Always false for generation 0 (no snapshot open).
#[inline]
pub fn has_passed(generation: u64) -> bool {
    generation != 0 && CLOCK.load(Ordering::SeqCst) >= generation
}

/// Whether a snapshot taken now may show the moment of `generation`, which another snapshot of
/// the same table opened for the save `opened_for`: while that moment has not come (the
/// snapshots are taken in one [`at_one_moment`] group), while a [`Held`] moment holds it, or when
/// both snapshots are for one save ([`for_save`]: the shards of one checkpoint). A moment that has
/// passed would otherwise make a later save show rows as they were before it was called (under
/// the later save's step and trainer state): such a save must take a moment of its own.
pub fn may_join(generation: u64, opened_for: Option<&str>) -> bool {
    !has_passed(generation)
        || HELD
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&generation)
        || opened_for.is_some_and(|id| current_save().as_deref() == Some(id))
}

/// Called once a save's moment is fixed (every table's snapshot taken), before any row is read:
/// what lets a trainer that started a save in the background go on training
/// ([`PlanOptions::on_moment`](crate::PlanOptions::on_moment)).
#[derive(Clone)]
pub struct MomentHook(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for MomentHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MomentHook")
    }
}

/// Snapshots of several tables held open at one moment: every point-in-time snapshot of those
/// tables taken while it lives shares that moment. For several in-process workers that each save
/// their shard of the same tables: hold the tables at the step to save, start the workers' saves,
/// and drop the hold once they have returned (or at least planned). While held, rows written
/// since the moment are kept until the hold and every save sharing it end.
pub struct Held<'a> {
    _snapshots: Vec<Box<dyn TableSnapshot + 'a>>,
    generation: u64,
}

impl std::fmt::Debug for Held<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Held({} tables)", self._snapshots.len())
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = held.iter().position(|&g| g == self.generation) {
            held.swap_remove(at);
        }
    }
}

/// Fixes one moment for `tables` now and holds it (see [`Held`]): for a save's whole input,
/// `hold(input.all_tables())`.
pub fn hold<'a>(tables: impl IntoIterator<Item = &'a (dyn SparseTable + 'a)>) -> Result<Held<'a>> {
    let (snapshots, generation) = at_one_moment(|| {
        let snapshots = tables
            .into_iter()
            .map(|t| t.snapshot())
            .collect::<Result<Vec<_>>>();
        let generation = PENDING.with(Cell::get).expect("set by at_one_moment");
        // Held before the moment comes, so that no save in between finds it passed and unheld.
        HELD.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(generation);
        (snapshots, generation)
    });
    // Made first, so that a failed snapshot lets go of the generation as it drops.
    let mut held = Held {
        _snapshots: Vec::new(),
        generation,
    };
    held._snapshots = snapshots?;
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_publishes_one_generation_when_it_ends() {
        let mut seen = Vec::new();
        at_one_moment(|| {
            register(|g| seen.push(g));
            register(|g| seen.push(g));
            // Registered, not yet passed: writes now are before the moment.
            assert!(!has_passed(seen[0]));
        });
        assert_eq!(seen[0], seen[1]);
        assert!(has_passed(seen[0]));
        let mut alone = 0;
        register(|g| alone = g);
        assert!(alone > seen[0] && has_passed(alone));
        assert!(!has_passed(0));
    }
}

//! A large plain table's slot rows distributed a round of groups at a time, on a thread of their
//! own, while the save reads the rounds already made.
//!
//! Why: a single pass puts the whole table in temporary files before the save reads any of it,
//! and past the kernel's dirty-page limit (`vm.dirty_background_ratio`, a tenth of memory by
//! default) the kernel writes those rows to the disk, only for them to be deleted seconds later:
//! a durable import of 6 GiB wrote 10.4 GB to the disk where a copy writes 6.1 GB, and took twice
//! the copy's time on a fast disk. In rounds, the temporary files hold [`AHEAD`] rounds of
//! `1/AHEAD` of that limit each (more only while the save reads more rounds at once), which stay
//! in the page cache, and the distribution of the next round overlaps the writing of the last.
//!
//! The price is one read of the whole input per round (the first pass writes the ids and the
//! first [`AHEAD`] rounds together), so rounds are used only where the input is a local file
//! that fits comfortably in the page cache ([`rounds_for`]); elsewhere a table is distributed in
//! one pass. Each large table of a model has rounds of its own: a model of several keeps about
//! [`AHEAD`] rounds of each.
//!
//! A round is a cache of the input's rows, never their only copy: once every slot row of its
//! groups has been read once ([`Rounds::served`]), its files are dropped, and a later read of
//! them (a second save of the same table) has the round made again.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::distribute::{Content, Output, Pass, Runs, TableInput, TemporaryFiles};
use crate::error::{Error, Result};

/// Rounds made ahead of the save and not yet read, at most (a round being made counts).
const AHEAD: usize = 2;

/// Most rounds of a table: each reads the whole input once more.
const MAX_ROUNDS: usize = 8;

/// No round is smaller than this: under a dirty limit of a few MiB (`vm.dirty_background_bytes`
/// set low), rounds of a fraction of it would buy nothing for their reads of the input.
const MIN_ROUND_BYTES: u64 = 64 << 20;

/// How many rounds to distribute a local table of `table_bytes` in, split into `groups` groups:
/// 1 (a single pass) when it fits under the kernel's dirty-page limit anyway, or when it does
/// not fit twice in the memory available for the page cache (each round would read the input
/// from the disk again).
pub(super) fn rounds_for(table_bytes: u64, groups: usize) -> usize {
    match (available_bytes(), dirty_background_bytes()) {
        (Some(available), Some(dirty)) => rounds_given(table_bytes, groups, available, dirty),
        _ => 1,
    }
}

/// [`rounds_for`] with `available` bytes of memory and the kernel writing back past `dirty`.
fn rounds_given(table_bytes: u64, groups: usize, available: u64, dirty: u64) -> usize {
    if table_bytes <= dirty || table_bytes > available / 2 {
        return 1;
    }
    // Rounds of dirty / 3 (8 rounds of 768 MiB on the 6 GiB model) took 6.8–7.4 s, of dirty / 2
    // (6 rounds) 6.0–6.1 s: every round reads the whole input once more.
    let round = (dirty / AHEAD as u64).max(MIN_ROUND_BYTES);
    (table_bytes.div_ceil(round) as usize)
        .clamp(1, MAX_ROUNDS)
        .min(groups)
}

/// The groups of round `r`, of `groups` groups taken `per_round` a round.
fn round_groups(r: usize, per_round: usize, groups: usize) -> Range<usize> {
    r * per_round..((r + 1) * per_round).min(groups)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The dirty bytes past which the kernel starts writing them back: `vm.dirty_background_bytes`,
/// or `vm.dirty_background_ratio` of the available memory.
fn dirty_background_bytes() -> Option<u64> {
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/proc/sys/vm/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    match read("dirty_background_bytes")? {
        0 => Some(available_bytes()? / 100 * read("dirty_background_ratio")?),
        bytes => Some(bytes),
    }
}

/// One round's slot rows: per group of the table (empty outside the round), its runs in
/// `files`, each run every slot's rows back to back.
pub(super) struct RoundData {
    pub files: TemporaryFiles,
    pub runs: Runs,
}

enum Slot {
    Absent,
    Making,
    Ready(Arc<RoundData>),
}

struct State {
    rounds: Vec<Slot>,
    /// Whether each round was made at least once (the thread makes each once unasked).
    made: Vec<bool>,
    /// Rounds a reader waits for.
    wanted: BTreeSet<usize>,
    /// Why the thread stopped, if a pass failed.
    failed: Option<String>,
}

struct Shared {
    input: TableInput,
    table: String,
    shift: u32,
    groups: usize,
    per_round: usize,
    parts: Vec<Range<u64>>,
    /// Per round and part: the bytes the part's file holds.
    sizes: Vec<Vec<u64>>,
    scratch: PathBuf,
    /// Per group: slot rows a save reads, each once (rows × slots).
    need: Vec<u64>,
    /// Per group: slot rows read since its round was last made.
    served: Vec<AtomicU64>,
    /// Per round: groups all of whose slot rows were read (or that have none).
    consumed: Vec<AtomicUsize>,
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

/// A table's slot rows in rounds, made by a thread of their own (see the module docs).
pub(super) struct Rounds {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Rounds {
    /// Distributes table `table` (`input`, read by `parts`) in `groups` groups of buckets
    /// `>> shift`, `per_round` groups a round, in temporary files in `scratch`: its ids, and the
    /// slot rows of its first [`AHEAD`] rounds, in one pass (the reads of the input are what
    /// rounds cost); then starts the thread that makes the other rounds. Returns the ids' files
    /// and, per group, their runs, and the rounds.
    pub(super) fn distribute(
        input: TableInput,
        table: &str,
        shift: u32,
        groups: usize,
        per_round: usize,
        parts: Vec<Range<u64>>,
        scratch: PathBuf,
    ) -> Result<(TemporaryFiles, Runs, Self)> {
        let per_round = per_round.max(1);
        let count = groups.div_ceil(per_round);
        let slot_bytes: u64 = input.row_bytes.iter().map(|&b| b as u64).sum();
        let round_groups = |r: usize| round_groups(r, per_round, groups);
        let first = AHEAD.min(count);
        let mut outputs = vec![Output {
            groups: 0..groups,
            content: Content::Ids,
            sizes: parts.iter().map(|p| (p.end - p.start) * 8).collect(),
        }];
        // A round's share of a part's rows is known only after this pass: reserved as its share
        // of the buckets, and a sixteenth more (ids spread over buckets by hash, evenly).
        outputs.extend((0..first).map(|r| {
            Output {
                groups: round_groups(r),
                content: Content::Slots,
                sizes: parts
                    .iter()
                    .map(|p| {
                        let share =
                            (p.end - p.start) * round_groups(r).len() as u64 / groups as u64;
                        (share + share / 16 + 64) * slot_bytes
                    })
                    .collect(),
            }
        }));
        let mut made = Pass {
            input: &input,
            shift,
            parts: &parts,
            outputs,
            scratch: &scratch,
            cancel: None,
        }
        .run()?
        .into_iter();
        let (ids, id_runs) = made.next().expect("the ids' output");
        // Rows of each group in each part: what each round's files will hold.
        let mut rows = vec![vec![0u64; groups]; parts.len()];
        for (g, rs) in id_runs.iter().enumerate() {
            for &(f, _, n) in rs {
                rows[f][g] += n;
            }
        }
        let sizes = (0..count)
            .map(|r| {
                rows.iter()
                    .map(|of_part| of_part[round_groups(r)].iter().sum::<u64>() * slot_bytes)
                    .collect()
            })
            .collect();
        let slots = input.row_bytes.len() as u64;
        let need: Vec<u64> = (0..groups)
            .map(|g| rows.iter().map(|p| p[g]).sum::<u64>() * slots)
            .collect();
        let shared = Arc::new(Shared {
            table: table.to_string(),
            shift,
            groups,
            per_round,
            parts,
            sizes,
            scratch,
            served: (0..groups).map(|_| AtomicU64::new(0)).collect(),
            consumed: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            state: Mutex::new(State {
                rounds: (0..count).map(|_| Slot::Absent).collect(),
                made: (0..count).map(|r| r < first).collect(),
                wanted: BTreeSet::new(),
                failed: None,
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            need,
            input,
        });
        for r in 0..count {
            shared.consumed[r].store(shared.empty_groups(r), Ordering::Relaxed);
        }
        {
            let mut state = shared.lock();
            for (r, (files, runs)) in made.enumerate() {
                state.rounds[r] = Slot::Ready(Arc::new(RoundData { files, runs }));
            }
        }
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("saver-distribute".into())
            .spawn(move || worker.make_rounds())
            .map_err(|e| Error::Io {
                op: "start a distributing thread for",
                path: shared.scratch.clone(),
                source: e,
            })?;
        Ok((
            ids,
            id_runs,
            Self {
                shared,
                thread: Some(thread),
            },
        ))
    }

    /// The round that holds group `g`'s slot rows, made if it is not (waiting for it).
    pub(super) fn of_group(&self, g: usize) -> Result<Arc<RoundData>> {
        let s = &self.shared;
        let r = g / s.per_round;
        let mut state = s.lock();
        loop {
            if let Slot::Ready(data) = &state.rounds[r] {
                return Ok(Arc::clone(data));
            }
            if let Some(why) = &state.failed {
                return Err(Error::Mismatch(format!(
                    "distributing the rows of table {:?} failed: {why}",
                    s.table
                )));
            }
            if matches!(state.rounds[r], Slot::Absent) && state.wanted.insert(r) {
                s.changed.notify_all();
            }
            state = s
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Records that `units` slot rows of group `g` were read (a row of two slots is two). Once
    /// every slot row of a round's groups was read, the round's files are let go.
    pub(super) fn served(&self, g: usize, units: u64) {
        let s = &self.shared;
        let Some(served) = s.served.get(g) else {
            return;
        };
        let old = served.fetch_add(units, Ordering::Relaxed);
        if old >= s.need[g] || old + units < s.need[g] {
            return;
        }
        let r = g / s.per_round;
        if s.consumed[r].fetch_add(1, Ordering::AcqRel) + 1 < s.round_groups(r).len() {
            return;
        }
        let dropped = {
            let mut state = s.lock();
            for g in s.round_groups(r) {
                s.served[g].store(0, Ordering::Relaxed);
            }
            s.consumed[r].store(s.empty_groups(r), Ordering::Relaxed);
            let dropped = match state.rounds[r] {
                Slot::Ready(_) => std::mem::replace(&mut state.rounds[r], Slot::Absent),
                _ => Slot::Absent,
            };
            s.changed.notify_all();
            dropped
        };
        // Closing the files frees their pages: outside the lock, which readers wait on.
        drop(dropped);
    }
}

impl Drop for Rounds {
    fn drop(&mut self) {
        {
            // Under the lock: the thread checks `stop` and waits in one hold of it, so it
            // cannot miss this.
            let _state = self.shared.lock();
            self.shared.stop.store(true, Ordering::Relaxed);
        }
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            // A pass that panicked has already failed its readers; nothing more to report.
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is changed by single assignments, never left half-changed by a panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn round_groups(&self, r: usize) -> Range<usize> {
        round_groups(r, self.per_round, self.groups)
    }

    fn empty_groups(&self, r: usize) -> usize {
        self.round_groups(r).filter(|&g| self.need[g] == 0).count()
    }

    /// The thread: makes the rounds readers wait for first, else the next never made while
    /// fewer than [`AHEAD`] are made and unread; stops when asked or when a pass fails.
    fn make_rounds(&self) {
        // A panicking pass must not leave readers waiting for a round that never comes.
        struct FailOnPanic<'s>(&'s Shared);
        impl Drop for FailOnPanic<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.lock().failed = Some("its thread panicked".into());
                    self.0.changed.notify_all();
                }
            }
        }
        let _guard = FailOnPanic(self);
        loop {
            let Some(r) = self.next_round() else {
                return;
            };
            let made = self.make(r);
            let mut state = self.lock();
            match made {
                Ok(data) => state.rounds[r] = Slot::Ready(Arc::new(data)),
                Err(e) => {
                    state.rounds[r] = Slot::Absent;
                    state.failed = Some(e.to_string());
                    self.changed.notify_all();
                    return;
                }
            }
            self.changed.notify_all();
        }
    }

    fn next_round(&self) -> Option<usize> {
        let mut state = self.lock();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            let wanted = state
                .wanted
                .iter()
                .copied()
                .find(|&r| matches!(state.rounds[r], Slot::Absent));
            let State {
                rounds,
                wanted: asked,
                ..
            } = &mut *state;
            asked.retain(|&r| matches!(rounds[r], Slot::Absent) && Some(r) != wanted);
            let live = state
                .rounds
                .iter()
                .filter(|s| !matches!(s, Slot::Absent))
                .count();
            let next = wanted.or_else(|| {
                (live < AHEAD)
                    .then(|| state.made.iter().position(|&m| !m))
                    .flatten()
            });
            if let Some(r) = next {
                state.rounds[r] = Slot::Making;
                state.made[r] = true;
                return Some(r);
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn make(&self, r: usize) -> Result<RoundData> {
        let (files, runs) = Pass {
            input: &self.input,
            shift: self.shift,
            parts: &self.parts,
            outputs: vec![Output {
                groups: self.round_groups(r),
                content: Content::Slots,
                sizes: self.sizes[r].clone(),
            }],
            scratch: &self.scratch,
            cancel: Some(&self.stop),
        }
        .run()?
        .pop()
        .expect("one output");
        Ok(RoundData { files, runs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Rounds only for a table past the dirty limit that fits twice in memory; then at
        /// most [`MAX_ROUNDS`], one per group at most, each (but when capped) within
        /// 1/[`AHEAD`] of the dirty limit, so that the rounds alive at once stay under it.
        #[test]
        fn rounds_suit_the_table_and_the_machine(
            table in 0u64..1 << 40,
            groups in 1usize..5000,
            available in 0u64..1 << 40,
            dirty in 0u64..1 << 36,
        ) {
            let r = rounds_given(table, groups, available, dirty);
            prop_assert!(r >= 1 && r <= MAX_ROUNDS.min(groups));
            if table <= dirty || table > available / 2 {
                prop_assert_eq!(r, 1);
            } else if r < MAX_ROUNDS.min(groups) {
                let round = (dirty / AHEAD as u64).max(MIN_ROUND_BYTES);
                prop_assert!(table.div_ceil(r as u64) <= round);
            }
        }
    }
}

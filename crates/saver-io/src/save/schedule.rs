//! The order in which the save writer's threads take chunks.
//!
//! Each thread keeps to one file and writes it front to back, so that:
//! - threads rarely write into the same file at once (buffered writes to one file serialise on
//!   its inode lock, and a page two threads share waits for the other's writeback);
//! - the writes form one advancing front per file being written, so direct I/O only holds the
//!   windows at those fronts, whatever the checkpoint's size.
//!
//! A thread whose file is done starts the next file nobody has started; once all are started, it
//! helps in the file with the most chunks left, so no thread idles while work remains.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Work grouped by file, shared by the writer threads.
pub(crate) struct FileQueues<T> {
    /// Each file's work, in file order.
    files: Vec<Vec<T>>,
    /// Next unclaimed item of each file.
    next: Vec<AtomicUsize>,
    /// Files started so far.
    started: AtomicUsize,
}

/// A writer thread's place in the queues.
#[derive(Default)]
pub(crate) struct Claimer {
    file: Option<usize>,
}

impl<T> FileQueues<T> {
    /// Groups `work`, each item tagged with the file it writes into, keeping each file's items
    /// in their given order; files are started in key order.
    pub(super) fn new<K: Ord>(work: impl IntoIterator<Item = (K, T)>) -> Self {
        let mut by_file: BTreeMap<K, Vec<T>> = BTreeMap::new();
        for (file, item) in work {
            by_file.entry(file).or_default().push(item);
        }
        let files: Vec<Vec<T>> = by_file.into_values().collect();
        Self {
            next: files.iter().map(|_| AtomicUsize::new(0)).collect(),
            files,
            started: AtomicUsize::new(0),
        }
    }

    fn left(&self, f: usize) -> usize {
        self.files[f]
            .len()
            .saturating_sub(self.next[f].load(Ordering::Relaxed))
    }

    /// The next item for the thread at `at`; `None` once every item is claimed. Every item is
    /// handed out exactly once over all threads.
    pub(super) fn claim(&self, at: &mut Claimer) -> Option<&T> {
        loop {
            if let Some(f) = at.file {
                if let Some(item) = self.files[f].get(self.next[f].fetch_add(1, Ordering::Relaxed))
                {
                    return Some(item);
                }
            }
            let fresh = self.started.fetch_add(1, Ordering::Relaxed);
            at.file = if fresh < self.files.len() {
                Some(fresh)
            } else {
                // All started: help where most is left.
                let f = (0..self.files.len()).max_by_key(|&f| self.left(f))?;
                if self.left(f) == 0 {
                    return None;
                }
                Some(f)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn one_thread_writes_the_files_one_after_the_other_in_order(
            keys in prop::collection::vec(0u8..6, 0..200),
        ) {
            let queues = FileQueues::new(keys.iter().copied().zip(0..));
            let mut at = Claimer::default();
            let mut got = Vec::new();
            while let Some(&i) = queues.claim(&mut at) {
                got.push(i);
            }
            let mut want: Vec<usize> = (0..keys.len()).collect();
            want.sort_by_key(|&i| keys[i]); // stable: each file keeps its order
            prop_assert_eq!(got, want);
        }

        #[test]
        fn threads_claim_every_item_exactly_once_and_each_file_in_order(
            keys in prop::collection::vec(0u8..5, 0..400),
            threads in 1usize..5,
        ) {
            let queues = FileQueues::new(keys.iter().copied().zip(0..));
            let claimed = Mutex::new(Vec::new());
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| {
                        let mut at = Claimer::default();
                        let mut mine = Vec::new();
                        while let Some(&i) = queues.claim(&mut at) {
                            mine.push(i);
                        }
                        claimed.lock().unwrap().push(mine);
                    });
                }
            });
            let per_thread = claimed.into_inner().unwrap();
            // Within a thread, a file's items come in file order.
            for mine in &per_thread {
                for k in 0..5u8 {
                    let of_file: Vec<usize> =
                        mine.iter().copied().filter(|&i| keys[i] == k).collect();
                    prop_assert!(of_file.windows(2).all(|w| w[0] < w[1]), "{:?}", of_file);
                }
            }
            let mut all: Vec<usize> = per_thread.into_iter().flatten().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..keys.len()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn threads_start_on_different_files() {
        let queues = FileQueues::new([(0, 'a'), (0, 'b'), (1, 'c'), (2, 'd')]);
        let (mut x, mut y) = (Claimer::default(), Claimer::default());
        assert_eq!(queues.claim(&mut x), Some(&'a'));
        assert_eq!(queues.claim(&mut y), Some(&'c'));
        assert_eq!(queues.claim(&mut y), Some(&'d'));
        // Nothing unstarted: y helps in x's file.
        assert_eq!(queues.claim(&mut y), Some(&'b'));
        assert_eq!(queues.claim(&mut x), None);
        assert_eq!(queues.claim(&mut y), None);
    }
}

//! Storage calls sent several at once where each waits on a network round trip.
//!
//! On an object store a creation, a commit, a read of a small document or a removal is a round
//! trip that costs this process almost nothing but waits on the store (on Garage here, 20–45 ms
//! during a save or an open): a save of 32 shards that read its shard manifests and writer
//! claims one after the other spent 1.4 s of its commit waiting (docs/benchmarks/HISTORY.md, "Round
//! trips of a save of many shards"). On a local directory the same calls take microseconds, and
//! run one at a time.

use super::Storage;

/// Calls to a remote store that run at once.
pub(crate) const STORE_CALLS_AT_ONCE: usize = 8;

/// How many of `storage`'s calls to run at once: [`STORE_CALLS_AT_ONCE`] where each waits on
/// the network ([`Storage::is_remote`]), else one.
pub(crate) fn calls_at_once(storage: &dyn Storage) -> usize {
    if storage.is_remote() {
        STORE_CALLS_AT_ONCE
    } else {
        1
    }
}

/// `f` of the items, in order, run `at_once` at a time (on threads of their own when more than
/// one: for calls that wait on a store's round trips, not on the CPU). Stops after the first
/// batch with a result that `go_on` refuses, so the results may be fewer than the items.
pub(crate) fn each_at_once<T: Send, R: Send>(
    items: Vec<T>,
    at_once: usize,
    f: impl Fn(T) -> R + Sync,
    go_on: impl Fn(&R) -> bool,
) -> Vec<R> {
    let mut out = Vec::with_capacity(items.len());
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        let batch: Vec<T> = items.by_ref().take(at_once.max(1)).collect();
        let done = out.len();
        if batch.len() == 1 {
            out.extend(batch.into_iter().map(&f));
        } else {
            std::thread::scope(|s| {
                let running: Vec<_> = batch.into_iter().map(|x| s.spawn(|| f(x))).collect();
                out.extend(
                    running
                        .into_iter()
                        .map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p))),
                );
            });
        }
        if !out[done..].iter().all(&go_on) {
            break;
        }
    }
    out
}

/// `f` of every item, `at_once` at a time, each result in its item's place.
pub(crate) fn all_at_once<T: Send, R: Send>(
    items: Vec<T>,
    at_once: usize,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    each_at_once(items, at_once, f, |_| true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn results_keep_their_items_order_and_at_most_at_once_run_together() {
        for at_once in [1, 2, 3, 8] {
            let running = AtomicUsize::new(0);
            let most = AtomicUsize::new(0);
            let out = all_at_once((0..20u64).collect(), at_once, |i| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // Later items finish first within a batch, so that order is not by chance.
                std::thread::sleep(std::time::Duration::from_millis(20 - i));
                running.fetch_sub(1, Ordering::SeqCst);
                i * 10
            });
            assert_eq!(out, (0..20u64).map(|i| i * 10).collect::<Vec<_>>());
            assert!(most.load(Ordering::SeqCst) <= at_once, "at_once {at_once}");
            if at_once > 1 {
                assert!(
                    most.load(Ordering::SeqCst) > 1,
                    "at_once {at_once} ran one at a time"
                );
            }
        }
    }

    #[test]
    fn a_refused_result_stops_after_its_batch() {
        let out = each_at_once((0..10u32).collect(), 3, |i| i, |&r| r != 4);
        // Batches 0..3 and 3..6: the second holds the refused 4 and ends the calls.
        assert_eq!(out, vec![0, 1, 2, 3, 4, 5]);
    }
}

//! Writes handed to a thread of their own, so that a single-threaded producer (a sort, a merge)
//! goes on while the kernel copies its last buffer into the page cache, which on a busy machine
//! costs as much as producing it.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::{Scope, ScopedJoinHandle};

use crate::error::Result;

/// A write to run later.
pub(crate) type Job<'a> = Box<dyn FnOnce() -> Result<()> + Send + 'a>;

/// Jobs queued at most: what a producer can be ahead, in buffers.
const QUEUED: usize = 2;

/// Runs jobs in order on one scoped thread, stopping at the first failure.
pub(crate) struct WriteBehind<'scope> {
    tx: Option<SyncSender<Job<'scope>>>,
    thread: Option<ScopedJoinHandle<'scope, Result<()>>>,
}

impl<'scope> WriteBehind<'scope> {
    /// Starts the thread in `scope`.
    pub(crate) fn new<'env>(scope: &'scope Scope<'scope, 'env>) -> Self {
        let (tx, rx): (SyncSender<Job<'scope>>, Receiver<Job<'scope>>) = sync_channel(QUEUED);
        let thread = scope.spawn(move || {
            // On the first failure the queue is dropped, which stops the producer's next push.
            for job in rx {
                job()?;
            }
            Ok(())
        });
        Self {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Queues `job`, waiting while [`QUEUED`] jobs are ahead of it. An error means the thread
    /// stopped; [`Self::finish`] says why, so end with [`Self::finish_after`].
    pub(crate) fn push(&self, job: Job<'scope>) -> Result<()> {
        match self.tx.as_ref().map(|tx| tx.send(job)) {
            Some(Ok(())) => Ok(()),
            _ => Err(crate::error::Error::Mismatch(
                "the write-behind thread stopped".into(),
            )),
        }
    }

    /// Waits for the queued jobs; the failed job's error if one failed, else `produced`'s.
    pub(crate) fn finish_after<T>(self, produced: Result<T>) -> Result<T> {
        let finished = self.finish();
        finished.and(produced)
    }

    /// Waits for every queued job; the error of the one that failed, if any.
    fn finish(mut self) -> Result<()> {
        drop(self.tx.take());
        match self.thread.take().map(ScopedJoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Ok(()),
        }
    }
}

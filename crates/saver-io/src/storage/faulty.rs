//! [`FaultyStorage`]: wraps a storage and fails on command, to test every failure path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Lent, ReadHandle, Storage, WriteHandle};
use crate::error::{Error, Result};

/// Which operation fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The n-th positional write (counting from 0) fails, as with a full disk (ENOSPC).
    WriteNumber(u64),
    /// Every write after `n` bytes in total fails with ENOSPC: a disk of that size.
    DiskFullAfter(u64),
    /// The n-th commit (fsync + rename) fails, as with an I/O error at fsync.
    CommitNumber(u64),
    /// The commit of the global index fails, as with a disk that fills up while a process
    /// commits the checkpoint: every data file and manifest before it is written.
    CommitOfIndex,
}

/// A storage that injects one kind of fault into an inner storage.
#[derive(Debug)]
pub struct FaultyStorage<S> {
    inner: S,
    fault: Fault,
    state: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    writes: AtomicU64,
    bytes: AtomicU64,
    commits: AtomicU64,
}

impl<S: Storage> FaultyStorage<S> {
    /// Wraps `inner`, failing as `fault` says.
    pub fn new(inner: S, fault: Fault) -> Self {
        Self {
            inner,
            fault,
            state: Arc::default(),
        }
    }
}

fn injected(what: &str) -> Error {
    Error::Io {
        op: "write",
        path: "(injected fault)".into(),
        source: std::io::Error::new(std::io::ErrorKind::StorageFull, what.to_string()),
    }
}

struct FaultyWrite {
    inner: Box<dyn WriteHandle>,
    is_index: bool,
    fault: Fault,
    state: Arc<Counters>,
}

impl FaultyWrite {
    /// Counts a write of `len` bytes: the injected failure if it is this one.
    fn count_write(&self, len: usize) -> Result<()> {
        let n = self.state.writes.fetch_add(1, Ordering::SeqCst);
        let total = self.state.bytes.fetch_add(len as u64, Ordering::SeqCst) + len as u64;
        match self.fault {
            Fault::WriteNumber(k) if n == k => Err(injected("no space left on device (injected)")),
            Fault::DiskFullAfter(limit) if total > limit => {
                Err(injected("no space left on device (injected)"))
            }
            _ => Ok(()),
        }
    }
}

impl WriteHandle for FaultyWrite {
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.count_write(buf.len())?;
        self.inner.write_at(offset, buf)
    }

    fn lend(&self, offset: u64, len: usize) -> Result<Option<Lent>> {
        self.inner.lend(offset, len)
    }

    fn write_lent(&self, lent: Lent) -> Result<()> {
        self.count_write(lent.as_ref().len())?;
        self.inner.write_lent(lent)
    }

    fn start_writeback(&self, offset: u64, len: u64) {
        self.inner.start_writeback(offset, len)
    }

    fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }

    fn truncate(&self, len: u64) -> Result<()> {
        self.inner.truncate(len)
    }

    fn commit(self: Box<Self>, durable: bool) -> Result<()> {
        let n = self.state.commits.fetch_add(1, Ordering::SeqCst);
        if self.fault == Fault::CommitNumber(n)
            || (self.fault == Fault::CommitOfIndex && self.is_index)
        {
            self.inner.abort();
            return Err(injected("I/O error at fsync (injected)"));
        }
        self.inner.commit(durable)
    }

    fn abort(self: Box<Self>) {
        self.inner.abort()
    }
}

impl<S: Storage> Storage for FaultyStorage<S> {
    fn location(&self) -> String {
        self.inner.location()
    }

    fn create(&self, name: &str, len: u64) -> Result<Box<dyn WriteHandle>> {
        Ok(Box::new(FaultyWrite {
            inner: self.inner.create(name, len)?,
            is_index: name == saver_core::naming::INDEX_FILE,
            fault: self.fault,
            state: self.state.clone(),
        }))
    }

    fn create_exclusive(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        self.inner.create_exclusive(name, bytes)
    }

    fn open(&self, name: &str) -> Result<Box<dyn ReadHandle>> {
        self.inner.open(name)
    }

    fn exists(&self, name: &str) -> Result<bool> {
        self.inner.exists(name)
    }

    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }

    fn remove(&self, name: &str) -> Result<()> {
        self.inner.remove(name)
    }

    fn sync_dir(&self) -> Result<()> {
        self.inner.sync_dir()
    }

    fn lock_commit(&self, wait: std::time::Duration) -> Result<Box<dyn super::CommitLock>> {
        self.inner.lock_commit(wait)
    }

    fn spill(&self) -> Result<std::sync::Arc<dyn saver_core::plan::Spill>> {
        self.inner.spill()
    }
}

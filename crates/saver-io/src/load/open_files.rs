//! The data files of open checkpoints, kept open within the process's file-descriptor budget.
//!
//! A checkpoint keeps its data files open from [`crate::Link::open`] on, so that one replaced
//! (its files removed) after it was opened stays readable on a local disk. But a chain opens every
//! link: 64 links of 16 shards are 1,024 files, the usual soft limit. So local files are kept open
//! only while the process holds fewer than half its descriptor limit for them; the others are
//! closed once their header has been checked and reopened for each read, where their size and
//! change times must still be those seen at open. A file that changed is corrupt; one that is gone
//! is reported missing, as for a reader that opened it late, and [`crate::load::link::read_latest`]
//! starts over on the checkpoint that replaced it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::error::{Error, Result};
use crate::storage::{FileVersion, ReadHandle, Storage};

/// Descriptors held by kept data files, process-wide.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// How many data files the process keeps open at most: half the soft descriptor limit, the
/// other half left to everything else (sockets, the files being written, a trainer's own).
fn budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit to the pointer it is given.
        let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            lim.rlim_cur
        } else {
            1024
        };
        (soft.min(1 << 20) as usize / 2).max(4)
    })
}

/// One descriptor of the budget, given back when dropped.
struct Kept;

impl Kept {
    fn take() -> Option<Self> {
        KEPT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < budget()).then_some(n + 1)
        })
        .ok()
        .map(|_| Kept)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        KEPT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A handle kept open, with the descriptor of the budget it holds (none for a remote file).
type KeptHandle = (Arc<dyn ReadHandle>, Option<Kept>);

/// A data file of an open checkpoint: its handle while it is kept open, and what tells it from
/// another file at its name when it has to be reopened.
pub(crate) struct DataFile {
    name: String,
    storage: Arc<dyn Storage>,
    version: Option<FileVersion>,
    remote: bool,
    open: Mutex<Option<KeptHandle>>,
}

impl DataFile {
    /// Data file `name` of `storage`, just opened as `handle` and checked: kept open if the
    /// budget allows (or if it holds no descriptor), closed otherwise.
    pub(super) fn new(
        storage: Arc<dyn Storage>,
        name: &str,
        handle: Box<dyn ReadHandle>,
    ) -> Result<Self> {
        let version = handle.version()?;
        let remote = handle.is_remote();
        let kept = if remote {
            Some((Arc::from(handle), None))
        } else {
            Kept::take().map(|k| (Arc::from(handle), Some(k)))
        };
        Ok(Self {
            name: name.to_string(),
            storage,
            version,
            remote,
            open: Mutex::new(kept),
        })
    }

    /// Whether reads of the file wait on network round trips.
    pub(super) fn is_remote(&self) -> bool {
        self.remote
    }

    /// A handle to read the file through: the kept one, or the file opened again (and kept if
    /// the budget now allows), checked to be the file that was opened first.
    pub(super) fn handle(&self) -> Result<Arc<dyn ReadHandle>> {
        if let Some((h, _)) = &*self.open.lock().unwrap_or_else(PoisonError::into_inner) {
            return Ok(h.clone());
        }
        let h: Arc<dyn ReadHandle> = Arc::from(self.storage.open(&self.name)?);
        if h.version()? != self.version {
            return Err(Error::Corrupt {
                file: self.name.clone(),
                what: "changed since the checkpoint was opened (its size or modification time \
                       differ)"
                    .into(),
            });
        }
        if let Some(k) = Kept::take() {
            let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
            if open.is_none() {
                *open = Some((h.clone(), Some(k)));
            }
        }
        Ok(h)
    }
}

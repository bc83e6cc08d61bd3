//! Where checkpoint files live.
//!
//! Everything saver-io does to files goes through [`Storage`]: positional writes into new files,
//! durable commit by rename, exclusive creation (for the commit claim), listing and positional
//! reads. [`LocalFs`] implements it on a local or shared POSIX filesystem; `FaultyStorage` (feature `fixtures`)
//! wraps any storage and injects failures, to test that every failure path leaves no half-valid
//! checkpoint behind. `ObjectStorage` (feature `s3`) keeps a checkpoint under a prefix of an
//! S3-compatible bucket. [`open_location`] and [`create_location`] take either: a path, or a
//! URL (`s3://bucket/prefix`), which never silently becomes a local path.
//!
//! Names are single file names relative to the checkpoint directory. Every backend must refuse
//! names that could leave it (`check_file_name`).

pub(crate) mod at_once;
mod direct;
// A test fixture: storage that fails on purpose. Not part of a trainer's build.
#[cfg(any(test, feature = "fixtures"))]
mod faulty;
pub(crate) mod identity;
mod local;
#[cfg(feature = "s3")]
mod object;
mod preallocate;
pub(crate) mod spill;
pub(crate) mod write_behind;

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use saver_core::plan::Spill;

pub use direct::Lent;
#[cfg(any(test, feature = "fixtures"))]
pub use faulty::{Fault, FaultyStorage};
pub use local::LocalFs;
pub use local::LocalLock;
#[cfg(feature = "s3")]
pub use object::{
    on_slow_request, ObjectStorage, FILLING_IN_MEMORY, LEASE, MIN_PART_SIZE, UPLOADS_IN_FLIGHT,
};
pub(crate) use preallocate::allocate;
pub use spill::FileSpill;

use crate::error::{Error, Result};

/// Refuses names that are empty, contain a path separator, are `.`/`..`, or contain NUL: a
/// manifest or index from an untrusted source must not make us read or write outside the directory.
/// `named_in` says where the name was found, for the message. The rule is saver-core's
/// ([`saver_core::naming::check_file_name`]), which the documents are checked with as they are parsed.
pub(crate) fn check_file_name(name: &str, named_in: &str) -> Result<()> {
    Ok(saver_core::naming::check_file_name(name, named_in)?)
}

/// Schemes of object stores and remote filesystems: `s3:bucket/x` or `s3:/bucket/x` is a
/// mistyped URL, never a local directory named `s3:`.
const REMOTE_SCHEMES: [&str; 11] = [
    "s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https", "hdfs",
];

/// The URL in `location`, if it is one (`scheme://…`, or a remote scheme with a colon such as a
/// mistyped `s3:/bucket`): a location that must not be taken for a local path.
pub fn location_url(location: &Path) -> Option<&str> {
    let s = location.to_str()?;
    let (scheme, rest) = s.split_once(':')?;
    let is_scheme = !scheme.is_empty()
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    let remote = REMOTE_SCHEMES.contains(&scheme.to_ascii_lowercase().as_str());
    (is_scheme && (rest.starts_with("//") || remote)).then_some(s)
}

/// The storage a URL names: `s3://bucket/prefix`, or an error naming what this build supports.
fn url_storage(url: &str) -> Result<Arc<dyn Storage>> {
    if !url.contains("://") {
        return Err(Error::InvalidOption {
            option: "location",
            why: format!(
                "{url}: not a URL (a location on an object store is written s3://bucket/prefix) \
                 and not taken for a local path either; for a local directory whose name has a \
                 colon, write ./{url}"
            ),
        });
    }
    if url.starts_with("s3://") {
        #[cfg(feature = "s3")]
        return Ok(Arc::new(ObjectStorage::from_url(url)?));
        #[cfg(not(feature = "s3"))]
        return Err(Error::InvalidOption {
            option: "location",
            why: format!("{url}: this build of saver has no S3 support (cargo feature `s3`)"),
        });
    }
    Err(Error::InvalidOption {
        option: "location",
        why: format!(
            "{url}: unsupported URL scheme (saver reads and writes local paths and s3://bucket/prefix)"
        ),
    })
}

/// Whether `a` and `b` are one location: the same directory (symbolic links resolved), or the
/// same bucket and prefix.
pub(crate) fn same_location(a: &Path, b: &Path) -> bool {
    match (location_url(a), location_url(b)) {
        (None, None) => match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        },
        (Some(a), Some(b)) => normalized_url(a) == normalized_url(b),
        _ => false,
    }
}

/// A URL with its path's empty, `.` and `..` segments resolved; `None` if they leave the root.
fn normalized_url(url: &str) -> Option<(String, Vec<String>)> {
    let (scheme, rest) = url.split_once("://")?;
    let (root, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut segs: Vec<String> = Vec::new();
    for s in path.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                segs.pop()?;
            }
            s => segs.push(s.to_string()),
        }
    }
    Some((format!("{scheme}://{root}"), segs))
}

/// `to` relative to `from` where either is a URL: `Ok(None)` where both are local paths, an error
/// where they are not under one store root (a chain's links name each other relatively).
pub(crate) fn relative_url(from: &Path, to: &Path) -> Result<Option<String>> {
    let (a, b) = match (location_url(from), location_url(to)) {
        (None, None) => return Ok(None),
        (Some(a), Some(b)) => (normalized_url(a), normalized_url(b)),
        _ => (None, None),
    };
    let unrelated = || Error::InvalidOption {
        option: "parent",
        why: format!(
            "{} and {} are not in one bucket: a delta names its parent relative to itself, so \
             both must be in one store",
            from.display(),
            to.display()
        ),
    };
    let ((root_a, a), (root_b, b)) = a.zip(b).ok_or_else(unrelated)?;
    if root_a != root_b {
        return Err(unrelated());
    }
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut rel: Vec<&str> = vec![".."; a.len() - common];
    rel.extend(b[common..].iter().map(String::as_str));
    Ok(Some(if rel.is_empty() {
        ".".to_string()
    } else {
        rel.join("/")
    }))
}

/// Where temporary files of work on `location` go: the directory itself (its filesystem), or
/// the system's temporary directory for an object store.
pub(crate) fn scratch_dir(location: &Path) -> std::path::PathBuf {
    match location_url(location) {
        Some(_) => std::env::temp_dir(),
        None => location.to_path_buf(),
    }
}

/// Removes the local directory `location` if nothing but commit locks is in it: what a save that
/// made the directory and failed before it wrote anything leaves. An object store has no
/// directories; anything else in the directory keeps it.
pub(crate) fn remove_dir_if_empty(location: &Path) {
    if location_url(location).is_some() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(location) else {
        return;
    };
    let names: Vec<_> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    if names
        .iter()
        .all(|n| n.to_str().is_some_and(saver_core::naming::is_commit_lock))
    {
        for n in names {
            let _ = std::fs::remove_file(location.join(n));
        }
        let _ = std::fs::remove_dir(location);
    }
}

/// The existing checkpoint directory or object-store prefix at `location`.
pub fn open_location(location: &Path) -> Result<Arc<dyn Storage>> {
    match location_url(location) {
        Some(url) => url_storage(url),
        None => Ok(Arc::new(LocalFs::open_dir(location)?)),
    }
}

/// The checkpoint directory (created if needed) or object-store prefix at `location`, to write
/// into.
pub fn create_location(location: &Path) -> Result<Arc<dyn Storage>> {
    match location_url(location) {
        Some(url) => url_storage(url),
        None => Ok(Arc::new(LocalFs::create_dir(location)?)),
    }
}

/// A file being written. Becomes visible under its final name only on [`WriteHandle::commit`].
pub trait WriteHandle: Send + Sync {
    /// Writes `buf` at `offset`. Callable from several threads at once on disjoint ranges.
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()>;
    /// Memory for the `len` bytes at `offset`, where the file writes from memory of its own
    /// (direct I/O needs it aligned): the caller fills it whole and gives it back with
    /// [`WriteHandle::write_lent`], and the file writes from it without the copy that
    /// [`WriteHandle::write_at`] would make. `None` (the default): the file writes from any
    /// memory, so the caller uses its own and `write_at`.
    fn lend(&self, _offset: u64, _len: usize) -> Result<Option<Lent>> {
        Ok(None)
    }
    /// Writes memory that [`WriteHandle::lend`] gave, filled, at the offset it was lent for.
    /// Callable from several threads at once on disjoint ranges, as `write_at`.
    fn write_lent(&self, lent: Lent) -> Result<()> {
        self.write_at(lent.offset(), lent.as_ref())
    }
    /// Hints that `[offset, offset + len)` is final and may be written back now, so that the
    /// eventual durable commit has little left to flush. Default: nothing.
    fn start_writeback(&self, _offset: u64, _len: u64) {}
    /// Whether this file's data goes around the page cache (direct I/O), so a report can say
    /// which write path a save took. Default: false.
    fn is_direct(&self) -> bool {
        false
    }
    /// Ends the file at `len`, short of the length it was created with: a compressed save
    /// knows its files' lengths only once their data are written. Bytes past `len` must never
    /// have been written. Default: refused, for handles that cannot.
    fn truncate(&self, len: u64) -> Result<()> {
        Err(Error::Mismatch(format!(
            "internal: this file cannot be cut to {len} bytes"
        )))
    }
    /// Makes the data durable (if asked), then atomically gives the file its final name.
    fn commit(self: Box<Self>, durable: bool) -> Result<()>;
    /// Discards the file.
    fn abort(self: Box<Self>);
}

/// A file being read.
pub trait ReadHandle: Send + Sync {
    /// File length.
    fn len(&self) -> u64;
    /// Whether the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fills `buf` from `offset`; an error if the file ends first.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Fills each `(offset, buf)` of `reads`; an error if the file ends first. Default: one
    /// [`ReadHandle::read_at`] each. A store where every request costs a round trip merges
    /// neighbouring ranges and sends the requests concurrently.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        for (offset, buf) in reads.iter_mut() {
            self.read_at(*offset, buf)?;
        }
        Ok(())
    }
    /// [`ReadHandle::read_many`], returning the bytes the storage delivered for it: the
    /// buffers' bytes, and where a store merges neighbouring ranges into one request, the gaps
    /// between them too. What a load's read amplification counts.
    fn read_many_counted(&self, reads: &mut [(u64, &mut [u8])]) -> Result<u64> {
        self.read_many(reads)?;
        Ok(reads.iter().map(|(_, b)| b.len() as u64).sum())
    }
    /// Whether a read waits on a network round trip (so reads of several files are better sent
    /// at once). Default: false.
    fn is_remote(&self) -> bool {
        false
    }
    /// What tells the file's content now from its content when it was opened: for a local file,
    /// its size and its modification and status-change times (a write changes them). `None`
    /// where the store cannot tell. What reads a file more than once (an import in rounds)
    /// compares it before it commits.
    fn version(&self) -> Result<Option<FileVersion>> {
        Ok(None)
    }
}

/// A file's size and change times, as [`ReadHandle::version`] gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileVersion {
    /// Length in bytes.
    pub len: u64,
    /// Last modification, in nanoseconds since the epoch.
    pub modified_ns: i128,
    /// Last status change (set by the kernel on every write), in nanoseconds since the epoch.
    pub changed_ns: i128,
}

/// Held while a process commits into a storage; dropping it releases the lock.
pub trait CommitLock: Send {
    /// How long from now the lock is surely still this process's; fails
    /// ([`Error::LockLost`]) if another process may have taken it since
    /// this one took it: a lock whose lease ran out while its holder was paused or cut off from
    /// the store. A holder checks it right before its commit point, and again after it if the
    /// write took longer than that, and writes nothing more once it fails. A lock the operating
    /// system holds for a live process (a local `flock`) is never lost.
    fn check_held(&self) -> Result<std::time::Duration> {
        Ok(std::time::Duration::MAX)
    }
}

/// [`Storage::put_if_unchanged`] by a read, a comparison and a put: right where the commit lock
/// keeps every other writer out (a local directory's `flock`).
pub(crate) fn check_then_put(
    storage: &(impl Storage + ?Sized),
    name: &str,
    bytes: &[u8],
    expected: Option<&[u8]>,
    durable: bool,
) -> Result<bool> {
    let limit = expected.map_or(0, |e| e.len() as u64) + 1;
    let now = match storage.get(name, limit) {
        Ok(now) => Some(now),
        Err(e) if e.is_not_found() => None,
        // Larger than what was expected: not it.
        Err(Error::Corrupt { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    if now.as_deref() != expected {
        return Ok(false);
    }
    storage.put(name, bytes, durable)?;
    Ok(true)
}

/// How long a commit waits for another process's commit into the same directory to finish. The
/// lock is held only to check the shards and write the manifest and index.
pub const COMMIT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A directory of checkpoint files.
pub trait Storage: Send + Sync + fmt::Debug {
    /// A description for messages (the directory path, a bucket URL, …).
    fn location(&self) -> String;
    /// Whether creating, committing or reading a file waits on network round trips, so that
    /// several are better sent at once. Default: false.
    fn is_remote(&self) -> bool {
        false
    }
    /// Starts writing `name` (of final size `len`) under a temporary name.
    fn create(&self, name: &str, len: u64) -> Result<Box<dyn WriteHandle>>;
    /// Writes a small file whole and atomically (temporary name, fsync if durable, rename).
    fn put(&self, name: &str, bytes: &[u8], durable: bool) -> Result<()> {
        let h = self.create(name, bytes.len() as u64)?;
        if let Err(e) = h.write_at(0, bytes) {
            h.abort();
            return Err(e);
        }
        h.commit(durable)
    }
    /// Writes `bytes` as `name` only if `name` now holds exactly `expected` (`None`: no such
    /// file); `Ok(false)`, writing nothing, if it does not. The index's compare-and-swap: a
    /// conditional write where the store has one, else a check then a put under the commit
    /// lock.
    fn put_if_unchanged(
        &self,
        name: &str,
        bytes: &[u8],
        expected: Option<&[u8]>,
        durable: bool,
    ) -> Result<bool> {
        check_then_put(self, name, bytes, expected, durable)
    }
    /// Creates `name` with `bytes` only if it does not exist; `Ok(false)` if it did. A reader
    /// never sees the file partly written (other processes read claims and rejection reasons
    /// while they are made). Not made
    /// durable by itself (writer claims and rejection markers are its uses: one lost to a power
    /// failure makes a save fail at its commit, never commit wrongly).
    fn create_exclusive(&self, name: &str, bytes: &[u8]) -> Result<bool>;
    /// Opens `name` for reading. Refuses anything but a regular file (no symlinks).
    fn open(&self, name: &str) -> Result<Box<dyn ReadHandle>>;
    /// Reads a whole small file, refusing files over `limit` bytes.
    fn get(&self, name: &str, limit: u64) -> Result<Vec<u8>> {
        let h = self.open(name)?;
        if h.len() > limit {
            return Err(Error::Corrupt {
                file: name.to_string(),
                what: format!(
                    "{} bytes, more than the {limit} allowed for this kind of file",
                    h.len()
                ),
            });
        }
        let mut buf = vec![0u8; h.len() as usize];
        h.read_at(0, &mut buf)?;
        Ok(buf)
    }
    /// Whether `name` exists.
    fn exists(&self, name: &str) -> Result<bool>;
    /// Names of all files (not directories) in the directory.
    fn list(&self) -> Result<Vec<String>>;
    /// Names of the directories in the directory (an object store's common prefixes): what a
    /// managed root's steps are found by. Default: an error saying the storage cannot list
    /// them.
    fn list_dirs(&self) -> Result<Vec<String>> {
        Err(Error::InvalidOption {
            option: "root",
            why: format!("{}: this storage cannot list directories", self.location()),
        })
    }
    /// Removes `name`; not an error if it is already gone.
    fn remove(&self, name: &str) -> Result<()>;
    /// Makes completed renames durable (fsync of the directory on POSIX).
    fn sync_dir(&self) -> Result<()>;
    /// Takes the storage's commit lock, waiting up to `wait` for another holder to release it.
    /// Commits into one storage run one at a time under it, so that each can compare the
    /// committed checkpoint with what its save expected and swap it in without a race. A holder
    /// that dies must release it (the OS drops a dead process's file locks; an object store's
    /// lease expires): a crashed committer never blocks the next.
    fn lock_commit(&self, wait: std::time::Duration) -> Result<Box<dyn CommitLock>>;
    /// Removes what writers that are known to have ended (processes of this host that are gone)
    /// left unfinished where nobody can see it, such as an object store's incomplete multipart
    /// uploads; returns the names of what it cleaned. A save calls it before writing. Default:
    /// nothing (a local file is visible, and left alone as another save's).
    fn clean_ended_writers(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// Where a save's plan spills the rows it keeps out of memory (`PlanOptions::plan_memory`).
    /// Default: a nameless file in the system's temporary directory.
    fn spill(&self) -> Result<Arc<dyn Spill>> {
        Ok(Arc::new(FileSpill::in_dir(&std::env::temp_dir())?))
    }
}

//! [`LocalFs`]: a checkpoint directory on a POSIX filesystem, local or shared (NFS, Lustre, …).

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use saver_core::naming::{COMMIT_LOCK, TMP_MARK};

use super::direct::{BufferPool, DirectWrites, Lent};
use super::preallocate::allocate;
use super::{check_file_name, ReadHandle, Storage, WriteHandle};
use crate::error::{io_err, Error, Result};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A checkpoint directory on a POSIX filesystem.
#[derive(Clone, Debug)]
pub struct LocalFs {
    dir: PathBuf,
    direct_io: bool,
    /// Direct-I/O buffers, reused by every file this storage (and its clones) writes.
    buffers: Arc<BufferPool>,
}

impl LocalFs {
    /// Uses `dir`, creating it (and its parents) if needed.
    pub fn create_dir(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
        Ok(Self {
            dir,
            direct_io: false,
            buffers: Arc::default(),
        })
    }

    /// Uses an existing directory.
    pub fn open_dir(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        let meta = fs::metadata(&dir).map_err(io_err("open directory", &dir))?;
        if !meta.is_dir() {
            return Err(Error::Io {
                op: "open directory",
                path: dir,
                source: std::io::Error::new(ErrorKind::NotADirectory, "not a directory"),
            });
        }
        Ok(Self {
            dir,
            direct_io: false,
            buffers: Arc::default(),
        })
    }

    /// Writes new files with direct I/O (`O_DIRECT`, around the page cache) where the filesystem
    /// supports it, through the page cache where it does not. For durable saves: the data go
    /// to the disk without a kernel copy or a later writeback, written by two background threads
    /// while the writer threads produce the next bytes. Costs a chunk's buffer per writer thread
    /// (lent to the gather, [`WriteHandle::lend`]) and up to 16 MiB in flight, kept with the two
    /// threads until the `LocalFs` and its clones are dropped. See `storage/direct/`.
    pub fn with_direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    /// Whether the directory is on a filesystem known to do direct I/O well: a local disk
    /// filesystem (ext4, XFS). Network filesystems may accept `O_DIRECT` but turn each write into
    /// a synchronous round trip, FUSE filesystems vary, tmpfs refuses it, and btrfs checksums
    /// direct writes at a cost.
    pub fn suits_direct_io(&self) -> bool {
        const EXT4_SUPER_MAGIC: u64 = 0xEF53;
        const XFS_SUPER_MAGIC: u64 = 0x5846_5342;
        let Ok(path) = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: a NUL-terminated path and a buffer of the right type, read only on success.
        if unsafe { libc::statfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
            return false;
        }
        // SAFETY: statfs succeeded and filled the buffer.
        // f_type is i64 on x86-64 glibc, a 32-bit integer elsewhere.
        let kind = unsafe { st.assume_init() }.f_type as u64;
        matches!(kind, EXT4_SUPER_MAGIC | XFS_SUPER_MAGIC)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A temporary name for `name` that no other writer can produce: `<name>.tmp-<pid>-<process
    /// token>-<n>`.
    fn tmp_path(&self, name: &str) -> PathBuf {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!(
            "{name}{TMP_MARK}{}-{}-{n}",
            std::process::id(),
            crate::storage::identity::process_token()
        ))
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        check_file_name(name, &format!("a request to {}", self.dir.display()))?;
        Ok(self.dir.join(name))
    }
}

struct LocalWrite {
    file: File,
    /// Set when the file is written with direct I/O.
    direct: Option<DirectWrites>,
    tmp: PathBuf,
    dest: PathBuf,
    dir: PathBuf,
}

impl WriteHandle for LocalWrite {
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        match &self.direct {
            Some(d) => d.write_at(offset, buf),
            None => self.file.write_all_at(buf, offset),
        }
        .map_err(io_err("write", &self.tmp))
    }

    fn lend(&self, offset: u64, len: usize) -> Result<Option<Lent>> {
        match &self.direct {
            Some(d) => d
                .lend(offset, len)
                .map(Some)
                .map_err(io_err("write", &self.tmp)),
            None => Ok(None),
        }
    }

    fn write_lent(&self, lent: Lent) -> Result<()> {
        match &self.direct {
            Some(d) => d.write_lent(lent),
            None => self.file.write_all_at(lent.as_ref(), lent.offset()),
        }
        .map_err(io_err("write", &self.tmp))
    }

    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    fn truncate(&self, len: u64) -> Result<()> {
        if let Some(d) = &self.direct {
            // The file itself is cut at commit, once its pieces in flight are written.
            return d.truncate(len).map_err(io_err("truncate", &self.tmp));
        }
        // The file was allocated at its planned length when created.
        let planned = self
            .file
            .metadata()
            .map_err(io_err("truncate", &self.tmp))?
            .len();
        if len > planned {
            return Err(Error::Mismatch(format!(
                "internal: {} cannot grow from {planned} to {len} bytes by a truncate",
                self.tmp.display()
            )));
        }
        self.file
            .set_len(len)
            .map_err(io_err("truncate", &self.tmp))
    }

    fn start_writeback(&self, offset: u64, len: u64) {
        if self.direct.is_some() {
            return; // nothing waits in the page cache
        }
        // SAFETY: a valid open descriptor; the call only schedules writeback of existing pages.
        // Failure (e.g. on filesystems without support) only loses the head start.
        unsafe {
            libc::sync_file_range(
                self.file.as_raw_fd(),
                offset as i64,
                len as i64,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }

    fn commit(self: Box<Self>, durable: bool) -> Result<()> {
        let result = (|| {
            if let Some(d) = &self.direct {
                d.finish(&self.file).map_err(io_err("write", &self.tmp))?;
            }
            if durable {
                self.file.sync_all().map_err(io_err("fsync", &self.tmp))?;
            }
            fs::rename(&self.tmp, &self.dest).map_err(io_err("rename", &self.dest))?;
            if durable {
                sync_dir(&self.dir)?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&self.tmp);
        }
        result
    }

    fn abort(self: Box<Self>) {
        let _ = fs::remove_file(&self.tmp);
    }
}

struct LocalRead {
    file: File,
    len: u64,
    path: PathBuf,
}

impl ReadHandle for LocalRead {
    fn len(&self) -> u64 {
        self.len
    }

    fn version(&self) -> Result<Option<super::FileVersion>> {
        use std::os::unix::fs::MetadataExt;
        let m = self
            .file
            .metadata()
            .map_err(crate::error::io_err("stat", &self.path))?;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Ok(Some(super::FileVersion {
            len: m.len(),
            modified_ns: ns(m.mtime(), m.mtime_nsec()),
            changed_ns: ns(m.ctime(), m.ctime_nsec()),
        }))
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == ErrorKind::UnexpectedEof {
                Error::Corrupt {
                    file: self.path.display().to_string(),
                    what: format!("ends before byte {} (truncated)", offset + buf.len() as u64),
                }
            } else {
                Error::Io {
                    op: "read",
                    path: self.path.clone(),
                    source: e,
                }
            }
        })
    }
}

/// Why [`open_regular`] refused a path.
pub(crate) enum Opened {
    /// A symlink, FIFO, socket, device or directory.
    NotRegular,
    /// The OS refused.
    Io(std::io::Error),
}

/// Opens `path` only if it is a regular file. Opened without following a symlink and
/// without blocking (a FIFO would otherwise wait for a writer forever), then checked on the open
/// descriptor, so nothing can be swapped in between the check and the use.
/// `how` says the access (read, write, create); the flags that refuse links and blocking are
/// added here.
pub(crate) fn open_regular(
    path: &Path,
    how: &mut OpenOptions,
) -> std::result::Result<(File, fs::Metadata), Opened> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = how
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Opened::NotRegular,
            _ => Opened::Io(e),
        })?;
    let meta = file.metadata().map_err(Opened::Io)?;
    if !meta.file_type().is_file() {
        return Err(Opened::NotRegular);
    }
    Ok((file, meta))
}

/// The commit lock of a [`LocalFs`] directory: an exclusive `flock` on its lock file, which the
/// kernel releases when the holder's descriptor closes, whether it exits or is killed.
#[derive(Debug)]
pub struct LocalLock {
    _file: File,
}

impl super::CommitLock for LocalLock {}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync directory", dir))
}

impl Storage for LocalFs {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn create(&self, name: &str, len: u64) -> Result<Box<dyn WriteHandle>> {
        let dest = self.path(name)?;
        let tmp = self.tmp_path(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        if let Err(e) = allocate(&file, len) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("allocate", &tmp)(e));
        }
        let direct = if self.direct_io {
            DirectWrites::open(&tmp, &file, len, Arc::clone(&self.buffers))
        } else {
            None
        };
        Ok(Box::new(LocalWrite {
            file,
            direct,
            tmp,
            dest,
            dir: self.dir.clone(),
        }))
    }

    /// Written whole under a temporary name, then hard-linked to `name`, which fails if `name`
    /// exists: a reader never sees the file empty or half-written (a claim's writer, a rejection's
    /// reason), and of two racing creators exactly one succeeds.
    fn create_exclusive(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        let path = self.path(name)?;
        let tmp = self.tmp_path(name);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        let linked = f
            .write_all(bytes)
            .map_err(io_err("write", &tmp))
            .and_then(|()| match fs::hard_link(&tmp, &path) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(io_err("create", &path)(e)),
            });
        let _ = fs::remove_file(&tmp);
        linked
    }

    fn open(&self, name: &str) -> Result<Box<dyn ReadHandle>> {
        let path = self.path(name)?;
        let (file, meta) =
            open_regular(&path, OpenOptions::new().read(true)).map_err(|e| match e {
                Opened::NotRegular => Error::UnsafePath {
                    name: name.to_string(),
                    named_in: self.dir.display().to_string(),
                    why: "not a regular file (symlinks, FIFOs, sockets and devices are refused)",
                },
                Opened::Io(e) => io_err("open", &path)(e),
            })?;
        Ok(Box::new(LocalRead {
            file,
            len: meta.len(),
            path,
        }))
    }

    fn exists(&self, name: &str) -> Result<bool> {
        let path = self.path(name)?;
        match fs::symlink_metadata(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("stat", &path)(e)),
        }
    }

    fn list(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
            if let (true, Some(name)) = (is_file, entry.file_name().to_str()) {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn list_dirs(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
            if let (true, Some(name)) = (is_dir, entry.file_name().to_str()) {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn remove(&self, name: &str) -> Result<()> {
        let path = self.path(name)?;
        match fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io_err("remove", &path)(e)),
            _ => Ok(()),
        }
    }

    fn sync_dir(&self) -> Result<()> {
        sync_dir(&self.dir)
    }

    fn lock_commit(&self, wait: Duration) -> Result<Box<dyn super::CommitLock>> {
        let path = self.dir.join(COMMIT_LOCK);
        let mut how = OpenOptions::new();
        how.read(true).write(true).create(true).truncate(false);
        let (file, _) = open_regular(&path, &mut how).map_err(|e| match e {
            Opened::NotRegular => Error::UnsafePath {
                name: COMMIT_LOCK.into(),
                named_in: self.dir.display().to_string(),
                why: "not a regular file",
            },
            Opened::Io(e) => io_err("open the commit lock", &path)(e),
        })?;
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Box::new(LocalLock { _file: file })),
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(e)) => return Err(io_err("lock", &path)(e)),
            }
            let waited = start.elapsed();
            if waited >= wait {
                return Err(Error::LockTimeout { lock: path, waited });
            }
            std::thread::sleep(pause.min(wait - waited));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Beside the checkpoint: the same filesystem, which has room for the checkpoint, while the
    /// system's temporary directory may be small or in memory.
    fn spill(&self) -> Result<std::sync::Arc<dyn saver_core::plan::Spill>> {
        Ok(std::sync::Arc::new(
            crate::storage::spill::FileSpill::in_dir(&self.dir)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exclusive_file_is_seen_whole_or_not_at_all_and_created_once() {
        let dir = tempfile::tempdir().unwrap();
        let fs = LocalFs::open_dir(dir.path()).unwrap();
        let body = vec![b'x'; 64 << 10];
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            // A reader polls each name as the creators make it.
            let reader = s.spawn(|| {
                let mut seen = 0;
                while !done.load(Ordering::Relaxed) {
                    for i in 0..200 {
                        if let Ok(bytes) = fs.get(&format!("claim{i}"), 1 << 20) {
                            assert_eq!(bytes.len(), body.len(), "claim{i} seen partly written");
                            seen += 1;
                        }
                    }
                }
                seen
            });
            let created: Vec<usize> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        (0..200)
                            .filter(|i| fs.create_exclusive(&format!("claim{i}"), &body).unwrap())
                            .count()
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect();
            done.store(true, Ordering::Relaxed);
            assert_eq!(created.iter().sum::<usize>(), 200, "each name created once");
            assert!(reader.join().unwrap() > 0);
        });
        let names = fs.list().unwrap();
        assert_eq!(names.len(), 200, "no temporary left: {names:?}");
    }
}

//! The plan's spill store on disk: a nameless temporary file (see `PlanOptions::plan_memory`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use saver_core::plan::Spill;

use crate::error::{Error, Result};

/// Spilled plan rows in a temporary file that has no name (`O_TMPFILE` where the filesystem
/// supports it, else created and unlinked at once), so it disappears with the process, even
/// after a crash, and never shows up in the checkpoint directory.
#[derive(Debug)]
pub struct FileSpill {
    file: File,
    dir: PathBuf,
    len: AtomicU64,
}

impl FileSpill {
    /// A new, empty spill file in `dir`.
    pub fn in_dir(dir: &Path) -> Result<Self> {
        let file = tempfile::tempfile_in(dir).map_err(|source| Error::Io {
            op: "create a plan spill file in",
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(Self {
            file,
            dir: dir.to_path_buf(),
            len: AtomicU64::new(0),
        })
    }

    fn context(&self, op: &str, e: io::Error) -> io::Error {
        io::Error::new(
            e.kind(),
            format!("{op} the spill file in {}: {e}", self.dir.display()),
        )
    }
}

impl Spill for FileSpill {
    fn append(&self, bytes: &[u8]) -> io::Result<u64> {
        // Appends from several threads get disjoint ranges; positional writes need no lock.
        let at = self.len.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.file
            .write_all_at(bytes, at)
            .map_err(|e| self.context("write to", e))?;
        Ok(at)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| self.context("read from", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_read_back_where_they_were_put_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileSpill::in_dir(dir.path()).unwrap();
        let a = s.append(b"hello").unwrap();
        let b = s.append(&[7u8; 10_000]).unwrap();
        let mut buf = [0u8; 5];
        s.read_at(a, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        let mut big = vec![0u8; 10_000];
        s.read_at(b, &mut big).unwrap();
        assert!(big.iter().all(|&x| x == 7));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let err = s.read_at(b + 9_999, &mut big).unwrap_err();
        assert!(err.to_string().contains("spill file in"), "{err}");
    }

    #[test]
    fn a_missing_directory_is_named() {
        let err = FileSpill::in_dir(Path::new("/nonexistent/saver-spill")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/saver-spill"),
            "{err}"
        );
    }
}

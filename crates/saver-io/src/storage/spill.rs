//! The plan's spill store on disk: a nameless temporary file (see `PlanOptions::plan_memory`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use saver_core::plan::Spill;

use crate::error::{Error, Result};
use crate::storage::preallocate::reserve;

/// Spilled plan rows in temporary files that have no name (`O_TMPFILE` where the filesystem
/// supports it, else created and unlinked at once), so they disappear with the process, even
/// after a crash, and never show up in the checkpoint directory.
///
/// One file per scanning thread (up to `STRIPES`, 16): a filesystem serialises buffered writes to
/// one file on its inode lock, and with a single file the scan's threads spent much of the spill
/// waiting for each other there.
#[derive(Debug)]
pub struct FileSpill {
    stripes: Vec<Stripe>,
    dir: PathBuf,
}

/// One of a spill's files and the bytes appended to it so far.
#[derive(Debug)]
struct Stripe {
    file: File,
    len: AtomicU64,
}

/// Most files one spill opens.
pub(crate) const STRIPES: usize = 16;

/// Bits of an offset that hold the position in its stripe; the stripe is in the bits above.
const POSITION_BITS: u32 = 56;

/// A spill file's blocks are reserved this many bytes at a time, ahead of the appends: writes
/// into allocated blocks skip the filesystem's per-page reservation.
const RESERVE_BYTES: u64 = 64 << 20;

impl FileSpill {
    /// A new, empty spill in `dir`, with one file per thread of the current rayon pool.
    pub fn in_dir(dir: &Path) -> Result<Self> {
        let stripes = (0..rayon::current_num_threads().clamp(1, STRIPES))
            .map(|_| {
                let file = tempfile::tempfile_in(dir).map_err(|source| Error::Io {
                    op: "create a plan spill file in",
                    path: dir.to_path_buf(),
                    source,
                })?;
                Ok(Stripe {
                    file,
                    len: AtomicU64::new(0),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            stripes,
            dir: dir.to_path_buf(),
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
        // Threads outside a rayon pool share the first stripe; sharing is only slower.
        let s = rayon::current_thread_index().unwrap_or(0) % self.stripes.len();
        let stripe = &self.stripes[s];
        // Appends from several threads get disjoint ranges; positional writes need no lock.
        let at = stripe.len.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if at + bytes.len() as u64 >= 1 << POSITION_BITS {
            return Err(self.context(
                "append to",
                io::Error::other("more than 64 PiB spilled to one file"),
            ));
        }
        // Appends tile the file, so each reservation chunk starts inside exactly one append,
        // whose thread reserves it. The first chunk is not reserved: most spills are small.
        let end = at + bytes.len() as u64;
        let mut chunk = at.div_ceil(RESERVE_BYTES).max(1) * RESERVE_BYTES;
        while chunk < end {
            // Only a speed-up: a chunk may reach past the spill's end, so a disk too full for it
            // is left to the writes to report, when they need the space.
            let _ = reserve(&stripe.file, chunk, RESERVE_BYTES);
            chunk += RESERVE_BYTES;
        }
        stripe
            .file
            .write_all_at(bytes, at)
            .map_err(|e| self.context("write to", e))?;
        Ok((s as u64) << POSITION_BITS | at)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let stripe = self
            .stripes
            .get((offset >> POSITION_BITS) as usize)
            .ok_or_else(|| {
                self.context(
                    "read from",
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("offset {offset:#x} names no file of this spill"),
                    ),
                )
            })?;
        stripe
            .file
            .read_exact_at(buf, offset & ((1 << POSITION_BITS) - 1))
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

    /// The scan's pattern: every thread of a pool appends runs, and any thread reads them back.
    #[test]
    fn appends_from_many_threads_each_read_back_intact() {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let s = pool.install(|| FileSpill::in_dir(dir.path())).unwrap();
        assert_eq!(s.stripes.len(), 4);
        // Every thread of the pool appends 50 runs of its own.
        let runs: Vec<(u64, Vec<u8>)> = pool
            .broadcast(|ctx| {
                (0..50u32)
                    .map(|k| {
                        let i = ctx.index() as u32 * 50 + k;
                        let run: Vec<u8> = (0..i * 37 % 5000 + 1).map(|j| (i ^ j) as u8).collect();
                        (s.append(&run).unwrap(), run)
                    })
                    .collect::<Vec<_>>()
            })
            .into_iter()
            .flatten()
            .collect();
        let stripes: std::collections::HashSet<u64> =
            runs.iter().map(|(at, _)| at >> POSITION_BITS).collect();
        assert_eq!(stripes.len(), 4, "one file per thread");
        for (at, run) in &runs {
            let mut back = vec![0u8; run.len()];
            s.read_at(*at, &mut back).unwrap();
            assert!(&back == run, "run at {at:#x} differs");
        }
        let err = s.read_at(9 << POSITION_BITS, &mut [0u8; 1]).unwrap_err();
        assert!(err.to_string().contains("names no file"), "{err}");
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

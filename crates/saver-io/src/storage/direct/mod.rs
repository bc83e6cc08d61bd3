//! Direct I/O for [`super::LocalFs`]: positional writes of any size and offset, assembled into
//! aligned windows that go to the disk with `O_DIRECT`, around the page cache.
//!
//! A durable save has to get every byte to the disk anyway; through the page cache that costs a
//! kernel copy per byte and a writeback before the fsync can return, and `benches/write_paths.rs`
//! measured direct writes of the same data at half the time. `O_DIRECT` needs the offset, the
//! length and the memory of every write aligned to the device's blocks, which a save's pieces
//! (tensor rows at any offset) are not: each piece is copied into the window it falls in, and a
//! window is written, whole and aligned, once every byte of it has arrived.
//!
//! Memory stays bounded: the save writer takes its chunks in file order, so the only windows
//! being filled are those at each writer thread's position; a file's first window, which waits
//! for the header until every tensor is written, goes through the page cache instead of being
//! held; and window buffers are reused from a [`WindowPool`] rather than allocated per window.
//! Complete windows are written by the pool's background threads (`flusher.rs`), so that the
//! writer threads go on producing bytes while the disk writes.
//! Callers must write every byte of the file exactly once: a window still unfilled at commit is
//! an error, never a file with a hole.

mod flusher;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use memmap2::MmapMut;

pub(super) use flusher::WindowPool;
use flusher::{DirectFile, WINDOW};

/// A window being filled.
struct Window {
    /// `None` once the window is complete and on its way to the disk.
    buf: Option<MmapMut>,
    /// Bytes of the window written so far.
    filled: u64,
}

/// The direct-I/O side of one file being written.
pub(super) struct DirectWrites {
    file: Arc<DirectFile>,
    /// The file's final length: as planned, or as [`DirectWrites::truncate`] cut it.
    len: AtomicU64,
    pool: Arc<WindowPool>,
    open: Mutex<HashMap<u64, Arc<Mutex<Window>>>>,
}

impl DirectWrites {
    /// Opens `path` (already created as `buffered`, of final length `len`) for direct writes;
    /// `None` where the filesystem does not support them (tmpfs, some network filesystems), so
    /// the caller writes through the page cache instead.
    pub fn open(path: &Path, buffered: &File, len: u64, pool: Arc<WindowPool>) -> Option<Self> {
        let direct = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()?;
        Some(Self::with_files(
            direct,
            buffered.try_clone().ok()?,
            len,
            pool,
        ))
    }

    fn with_files(direct: File, buffered: File, len: u64, pool: Arc<WindowPool>) -> Self {
        Self {
            file: Arc::new(DirectFile::new(direct, buffered)),
            len: AtomicU64::new(len),
            pool,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    fn window_len(&self, w: u64) -> u64 {
        WINDOW.min(self.len() - w * WINDOW)
    }

    /// Ends the file at `len`, before any byte past it was written (a compressed save learns its
    /// files' lengths only at their end): the window holding the new end, if now complete, goes
    /// to the disk; windows past it must never have been opened.
    pub fn truncate(&self, len: u64) -> io::Result<()> {
        if len > self.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "cannot grow from {} to {len} bytes by a truncate",
                    self.len()
                ),
            ));
        }
        let last = len.div_ceil(WINDOW);
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&w) = open.keys().find(|&&w| w >= last) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bytes past {len} were written (window at {})", w * WINDOW),
            ));
        }
        self.len.store(len, Ordering::Release);
        // The new last window (the first one goes through the page cache, and is never open).
        let Some(w) = last.checked_sub(1) else {
            return Ok(());
        };
        let window_len = self.window_len(w);
        let full = match open.get(&w) {
            Some(win) => {
                let mut win = win.lock().unwrap_or_else(PoisonError::into_inner);
                if win.filled > window_len {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("bytes past {len} were written"),
                    ));
                }
                (win.filled == window_len).then(|| win.buf.take()).flatten()
            }
            None => None,
        };
        if let Some(buf) = full {
            open.remove(&w);
            drop(open);
            self.pool
                .write_behind(&self.file, w * WINDOW, buf, window_len as usize);
        }
        Ok(())
    }

    /// Copies `buf` into the windows it covers, handing each window it completes to the pool's
    /// background writers. `buffered` is the file without `O_DIRECT`, for the first window. Fails
    /// if an earlier window of the file failed to be written.
    pub fn write_at(&self, offset: u64, buf: &[u8], buffered: &File) -> io::Result<()> {
        if offset + buf.len() as u64 > self.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "write of {} bytes at {offset} past the planned length {}",
                    buf.len(),
                    self.len()
                ),
            ));
        }
        self.file.check()?;
        let mut at = offset;
        let mut rest = buf;
        if at < WINDOW {
            // The first window waits for the header, written last: holding it would keep one
            // buffer per file for the whole save.
            let n = rest.len().min((WINDOW - at) as usize);
            buffered.write_all_at(&rest[..n], at)?;
            at += n as u64;
            rest = &rest[n..];
        }
        while !rest.is_empty() {
            let w = at / WINDOW;
            let in_window = (at - w * WINDOW) as usize;
            let window_len = self.window_len(w);
            let n = rest.len().min(window_len as usize - in_window);
            let window = {
                let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
                match open.get(&w) {
                    Some(win) => Arc::clone(win),
                    None => {
                        let win = Arc::new(Mutex::new(Window {
                            buf: Some(self.pool.take()?),
                            filled: 0,
                        }));
                        open.insert(w, Arc::clone(&win));
                        win
                    }
                }
            };
            let full = {
                let mut win = window.lock().unwrap_or_else(PoisonError::into_inner);
                let Some(buf) = win.buf.as_mut() else {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("bytes {at}..{} written twice", at + n as u64),
                    ));
                };
                buf[in_window..in_window + n].copy_from_slice(&rest[..n]);
                win.filled += n as u64;
                (win.filled >= window_len).then(|| win.buf.take()).flatten()
            };
            if let Some(buf) = full {
                self.open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&w);
                self.pool
                    .write_behind(&self.file, w * WINDOW, buf, window_len as usize);
            }
            at += n as u64;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Waits for the file's windows to be written, checks every byte was, and cuts the last
    /// window's padding off.
    pub fn finish(&self, buffered: &File) -> io::Result<()> {
        self.file.settle()?;
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((&w, window)) = open.iter().min_by_key(|(&w, _)| w) {
            let filled = window.lock().unwrap_or_else(PoisonError::into_inner).filled;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} of the bytes {}..{} were never written ({} incomplete windows in all)",
                    self.window_len(w) - filled,
                    w * WINDOW,
                    w * WINDOW + self.window_len(w),
                    open.len()
                ),
            ));
        }
        if buffered.metadata()?.len() != self.len() {
            buffered.set_len(self.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use proptest::prelude::*;

    use super::*;

    /// A file of length `len` opened both ways, in a directory beside the sources rather than in
    /// /tmp, which may be a tmpfs without O_DIRECT.
    fn open_file(len: u64, pool: &Arc<WindowPool>) -> (tempfile::TempDir, File, DirectWrites) {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("f");
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        buffered.set_len(len).unwrap();
        let direct = DirectWrites::open(&path, &buffered, len, Arc::clone(pool))
            .expect("the test directory's filesystem supports O_DIRECT");
        (dir, buffered, direct)
    }

    fn read_back(dir: &tempfile::TempDir) -> Vec<u8> {
        std::fs::read(dir.path().join("f")).unwrap()
    }

    /// Writes `data` as pieces cut at `cuts`, shuffled by `seed`, from two threads, with window
    /// buffers that already held another file's bytes.
    fn write_in_pieces(data: &[u8], cuts: &[usize], seed: u64) -> Vec<u8> {
        let pool = Arc::new(WindowPool::default());
        let stale = vec![0xA5; 3 * WINDOW as usize + 7];
        let (_d, buffered, direct) = open_file(stale.len() as u64, &pool);
        for piece in stale.chunks(WINDOW as usize / 3) {
            let at = piece.as_ptr() as usize - stale.as_ptr() as usize;
            direct.write_at(at as u64, piece, &buffered).unwrap();
        }
        direct.finish(&buffered).unwrap();

        let (dir, buffered, direct) = open_file(data.len() as u64, &pool);
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| c % (data.len() + 1)).collect();
        bounds.extend([0, data.len()]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut pieces: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
        // A fixed shuffle, so that windows fill out of order.
        let mut x = seed | 1;
        for i in (1..pieces.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            pieces.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let (a, b) = pieces.split_at(pieces.len() / 2);
        std::thread::scope(|s| {
            for half in [a, b] {
                let (direct, buffered) = (&direct, &buffered);
                s.spawn(move || {
                    for &(lo, hi) in half {
                        direct.write_at(lo as u64, &data[lo..hi], buffered).unwrap();
                    }
                });
            }
        });
        direct.finish(&buffered).unwrap();
        drop(direct);
        read_back(&dir)
    }

    /// A file written front to back and cut short of its planned length (as a compressed save
    /// writes): at every kind of cut, it reads back as written; a cut below bytes written, or
    /// past the planned length, is refused.
    #[test]
    fn a_file_cut_before_its_commit_reads_back_as_written() {
        let pool = Arc::new(WindowPool::default());
        let planned = 6 * WINDOW + 100;
        for cut in [
            100,
            WINDOW,
            WINDOW + 1,
            2 * WINDOW,
            3 * WINDOW + 4097,
            6 * WINDOW + 99,
        ] {
            let data: Vec<u8> = (0..cut).map(|i| (i * 7 % 251) as u8).collect();
            let (dir, buffered, direct) = open_file(planned, &pool);
            for piece in data.chunks(100_003) {
                let at = piece.as_ptr() as usize - data.as_ptr() as usize;
                direct.write_at(at as u64, piece, &buffered).unwrap();
            }
            direct.truncate(cut).unwrap();
            direct.finish(&buffered).unwrap();
            drop(direct);
            assert!(read_back(&dir) == data, "cut at {cut}");
        }
        let (_dir, buffered, direct) = open_file(planned, &pool);
        direct.write_at(2 * WINDOW, &[1; 10], &buffered).unwrap();
        assert!(direct.truncate(WINDOW + 5).is_err());
        assert!(direct.truncate(2 * WINDOW + 5).is_err());
        assert!(direct.truncate(planned + 1).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn pieces_in_any_order_give_the_file_written_in_one_go(
            len in prop_oneof![1usize..10_000, 1_000_000usize..3_200_000],
            cuts in prop::collection::vec(any::<usize>(), 0..40),
            seed: u64,
        ) {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let read = write_in_pieces(&data, &cuts, seed);
            prop_assert_eq!(read.len(), data.len());
            prop_assert!(read == data, "content differs");
        }
    }

    #[test]
    fn a_write_past_the_planned_length_is_refused() {
        let (_d, buffered, direct) = open_file(100, &Arc::default());
        let err = direct.write_at(90, &[1; 20], &buffered).unwrap_err();
        assert!(err.to_string().contains("past the planned length"), "{err}");
    }

    #[test]
    fn bytes_never_written_are_an_error_at_commit_not_a_hole() {
        let len = 3 * WINDOW + 100;
        let (_d, buffered, direct) = open_file(len, &Arc::default());
        let data = vec![7u8; len as usize];
        let gap = 2 * WINDOW + 10..2 * WINDOW + 20;
        direct
            .write_at(0, &data[..gap.start as usize], &buffered)
            .unwrap();
        direct
            .write_at(gap.end, &data[gap.end as usize..], &buffered)
            .unwrap();
        let err = direct.finish(&buffered).unwrap_err().to_string();
        let window = format!("{}..{}", 2 * WINDOW, 3 * WINDOW);
        assert!(
            err.contains(&format!("10 of the bytes {window} were never written")),
            "{err}"
        );
    }

    /// The save writer's pattern: threads take fixed-size chunks in file order.
    #[test]
    fn writing_in_order_keeps_a_few_windows_whatever_the_file_size() {
        let pool = Arc::new(WindowPool::default());
        let len = 24 * WINDOW + 5;
        let (dir, buffered, direct) = open_file(len, &pool);
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        let chunk = 700_001;
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| loop {
                    let lo = next.fetch_add(1, Ordering::Relaxed) * chunk;
                    if lo >= data.len() {
                        break;
                    }
                    let hi = (lo + chunk).min(data.len());
                    direct
                        .write_at(lo as u64, &data[lo..hi], &buffered)
                        .unwrap();
                });
            }
        });
        direct.finish(&buffered).unwrap();
        assert!(read_back(&dir) == data, "content differs");
        assert!(
            pool.allocated() <= 6 + WindowPool::IN_FLIGHT,
            "{} window buffers for two writers",
            pool.allocated()
        );
    }

    /// A background write that fails (here: a descriptor not open for writing) stops the next
    /// write of the file and its commit; it is never lost with the thread that saw it.
    #[test]
    fn a_failed_background_write_fails_the_next_write_and_the_finish() {
        let pool = Arc::new(WindowPool::default());
        let len = 4 * WINDOW;
        let (dir, buffered, _) = open_file(len, &pool);
        let read_only = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(dir.path().join("f"))
            .unwrap();
        let direct = DirectWrites::with_files(read_only, buffered.try_clone().unwrap(), len, pool);
        let data = vec![3u8; len as usize];
        // The first window goes through the page cache; the second is the first written behind.
        direct
            .write_at(0, &data[..2 * WINDOW as usize], &buffered)
            .unwrap();
        let finished = direct.finish(&buffered);
        let err = finished.expect_err("the window's write failed").to_string();
        assert!(err.contains("Bad file descriptor"), "{err}");
        let again = direct.write_at(2 * WINDOW, &data[..WINDOW as usize], &buffered);
        assert!(again.is_err(), "a later write must not succeed");
    }
}

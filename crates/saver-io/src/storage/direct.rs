//! Direct I/O for [`super::LocalFs`]: positional writes of any size and offset, assembled into
//! aligned windows that go to the disk with `O_DIRECT`, around the page cache.
//!
//! A durable save has to get every byte to the disk anyway; through the page cache that costs a
//! kernel copy per byte and a writeback before the fsync can return, and `benches/write_paths.rs`
//! measured direct writes of the same data at half the time. `O_DIRECT` needs the offset, the
//! length and the memory of every write aligned to the device's blocks, which a save's pieces
//! (tensor rows at any offset) are not: each piece is copied into the window it falls in, and a
//! window is written, whole and aligned, once every byte of it has arrived. Callers must write
//! every byte of the file exactly once (the save writer checks that before committing); whatever
//! is still open at commit is written then.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

/// Bytes per window: large enough for the disk to stream, small enough that the windows a save
/// keeps open (one per tensor being written, and the first of each file until its header comes)
/// stay a few MiB.
const WINDOW: u64 = 1 << 20;

/// Alignment of offsets, lengths and memory for `O_DIRECT` (the largest logical block size in
/// common use).
const ALIGN: usize = 4096;

/// A zeroed, `ALIGN`-aligned buffer of `WINDOW` bytes.
struct AlignedBuf {
    ptr: *mut u8,
}

// SAFETY: the buffer is owned memory with no thread affinity; access goes through &mut.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(WINDOW as usize, ALIGN).expect("valid layout")
    }

    fn new() -> Self {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(Self::layout());
        }
        Self { ptr }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds WINDOW initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, WINDOW as usize) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout()) }
    }
}

/// A window being filled.
struct Window {
    buf: AlignedBuf,
    /// Bytes of the window written so far.
    filled: u64,
}

/// The direct-I/O side of one file being written.
pub(super) struct DirectWrites {
    /// The file, opened a second time with `O_DIRECT`.
    direct: File,
    /// The file's final length.
    len: u64,
    open: Mutex<HashMap<u64, Arc<Mutex<Window>>>>,
}

impl DirectWrites {
    /// Opens `path` (already created, of final length `len`) for direct writes; `None` where the
    /// filesystem does not support them (tmpfs, some network filesystems), so the caller writes
    /// through the page cache instead.
    pub fn open(path: &Path, len: u64) -> Option<Self> {
        let direct = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()?;
        Some(Self {
            direct,
            len,
            open: Mutex::new(HashMap::new()),
        })
    }

    fn window_len(&self, w: u64) -> u64 {
        WINDOW.min(self.len - w * WINDOW)
    }

    /// Copies `buf` into the windows it covers, writing each window it completes. `buffered` is
    /// the same file without `O_DIRECT`, for a device that refuses the alignment.
    pub fn write_at(&self, offset: u64, buf: &[u8], buffered: &File) -> io::Result<()> {
        if offset + buf.len() as u64 > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "write of {} bytes at {offset} past the planned length {}",
                    buf.len(),
                    self.len
                ),
            ));
        }
        let mut at = offset;
        let mut rest = buf;
        while !rest.is_empty() {
            let w = at / WINDOW;
            let in_window = (at - w * WINDOW) as usize;
            let window_len = self.window_len(w);
            let n = rest.len().min(window_len as usize - in_window);
            let window = Arc::clone(
                self.open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(w)
                    .or_insert_with(|| {
                        Arc::new(Mutex::new(Window {
                            buf: AlignedBuf::new(),
                            filled: 0,
                        }))
                    }),
            );
            let full = {
                let mut win = window.lock().unwrap_or_else(PoisonError::into_inner);
                win.buf.bytes()[in_window..in_window + n].copy_from_slice(&rest[..n]);
                win.filled += n as u64;
                win.filled >= window_len
            };
            if full {
                self.open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&w);
                let mut win = window.lock().unwrap_or_else(PoisonError::into_inner);
                self.write_window(w, &mut win.buf, buffered)?;
            }
            at += n as u64;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Writes window `w` whole; the last window of the file is padded to the alignment (the
    /// padding is cut off by [`Self::finish`]).
    fn write_window(&self, w: u64, buf: &mut AlignedBuf, buffered: &File) -> io::Result<()> {
        let len = self.window_len(w) as usize;
        let padded = len.next_multiple_of(ALIGN);
        match self.direct.write_all_at(&buf.bytes()[..padded], w * WINDOW) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                buffered.write_all_at(&buf.bytes()[..len], w * WINDOW)
            }
            other => other,
        }
    }

    /// Writes the windows still open (bytes never written stay zero, as in a preallocated file)
    /// and cuts the last window's padding off.
    pub fn finish(&self, buffered: &File) -> io::Result<()> {
        let open: Vec<(u64, Arc<Mutex<Window>>)> = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .collect();
        for (w, window) in open {
            let mut win = window.lock().unwrap_or_else(PoisonError::into_inner);
            self.write_window(w, &mut win.buf, buffered)?;
        }
        if buffered.metadata()?.len() != self.len {
            buffered.set_len(self.len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Writes `data` as pieces cut at `cuts`, in the order `order` gives, from two threads.
    fn write_in_pieces(data: &[u8], cuts: &[usize], seed: u64) -> Vec<u8> {
        // Beside the sources rather than in /tmp, which may be a tmpfs without O_DIRECT.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("f");
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        buffered.set_len(data.len() as u64).unwrap();
        let direct = DirectWrites::open(&path, data.len() as u64)
            .expect("the test directory's filesystem supports O_DIRECT");
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
        std::fs::read(&path).unwrap()
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
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("f");
        let buffered = File::create(&path).unwrap();
        buffered.set_len(100).unwrap();
        let direct = DirectWrites::open(&path, 100).unwrap();
        let err = direct.write_at(90, &[1; 20], &buffered).unwrap_err();
        assert!(err.to_string().contains("past the planned length"), "{err}");
    }
}

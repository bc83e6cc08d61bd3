//! Window buffers, and the threads that write full windows while the writer threads go on
//! producing the next bytes.
//!
//! A direct write blocks its caller until the device has the data. When the writer thread that
//! completed a window wrote it too, a save alternated between gathering rows (CPU) and waiting for
//! the disk, and took about the sum of the two; handing full windows to background threads lets
//! them overlap. The windows waiting for those threads are bounded ([`QUEUED`]): when the disk is
//! slower than the gather, writer threads wait for it instead of memory growing.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use memmap2::MmapMut;

/// Bytes per window: large enough for the disk to stream, small enough that the windows a save
/// keeps open (one per tensor a writer thread is in, and the next) stay a few MiB. Half a MiB
/// wrote as fast as 1 MiB in an A/B on criteo (docs/BENCHMARKS.md) for half the memory.
pub(super) const WINDOW: u64 = 1 << 19;

/// Alignment of offsets and lengths for `O_DIRECT` (the largest logical block size in common
/// use). Window memory is page-aligned, being an anonymous mapping.
pub(super) const ALIGN: usize = 4096;

/// Background writer threads. One already streams a local disk (a 512 KiB `O_DIRECT` write at
/// a time ran at `dd`'s 8 MiB speed here); the second keeps the device busy while the first
/// returns and takes the next window, and serves a second file at once on devices with more
/// queues.
const WRITERS: usize = 2;

/// Full windows that may wait for a background writer: 4 MiB. A writer thread completes a burst
/// of windows as it hands over each chunk's pieces, and this lets it go on to gather the next
/// chunk while the burst is written.
const QUEUED: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new error like `e`: `io::Error` cannot be cloned, and a file's first failure is reported to
/// every later call.
fn replay(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

/// One file written with direct I/O, and the state of its windows handed to the background.
pub(super) struct DirectFile {
    /// Opened with `O_DIRECT`.
    direct: File,
    /// The same file through the page cache, for devices that refuse the alignment.
    buffered: File,
    progress: Mutex<Progress>,
    settled: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Windows handed over and not yet written.
    pending: usize,
    /// The first write that failed.
    error: Option<io::Error>,
}

impl Progress {
    /// The file's writes so far: the first failure, if any.
    fn outcome(&self) -> io::Result<()> {
        match &self.error {
            Some(e) => Err(replay(e)),
            None => Ok(()),
        }
    }
}

impl DirectFile {
    pub fn new(direct: File, buffered: File) -> Self {
        Self {
            direct,
            buffered,
            progress: Mutex::default(),
            settled: Condvar::new(),
        }
    }

    /// Writes `buf[..len]` at `offset`, padded to the alignment (the padding is cut off when the
    /// file is finished).
    fn write(&self, offset: u64, buf: &[u8], len: usize) -> io::Result<()> {
        let padded = len.next_multiple_of(ALIGN);
        match self.direct.write_all_at(&buf[..padded], offset) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.buffered.write_all_at(&buf[..len], offset)
            }
            other => other,
        }
    }

    fn done(&self, result: io::Result<()>) {
        let mut progress = lock(&self.progress);
        progress.pending -= 1;
        if let Err(e) = result {
            progress.error.get_or_insert(e);
        }
        self.settled.notify_all();
    }

    /// Fails if a window of this file already failed to be written, so that a save stops at its
    /// next write rather than at commit.
    pub fn check(&self) -> io::Result<()> {
        lock(&self.progress).outcome()
    }

    /// Waits until every window handed over is written; the first failure, if any.
    pub fn settle(&self) -> io::Result<()> {
        let mut progress = lock(&self.progress);
        while progress.pending > 0 {
            progress = self
                .settled
                .wait(progress)
                .unwrap_or_else(PoisonError::into_inner);
        }
        progress.outcome()
    }
}

/// A full window on its way to the disk.
struct Job {
    file: Arc<DirectFile>,
    offset: u64,
    buf: MmapMut,
    len: usize,
}

impl Job {
    fn run(self, buffers: &Buffers) {
        let result = self.file.write(self.offset, &self.buf, self.len);
        buffers.give(self.buf);
        self.file.done(result);
    }
}

#[derive(Debug, Default)]
struct Buffers {
    free: Mutex<Vec<MmapMut>>,
    /// Buffers ever allocated.
    allocated: AtomicUsize,
}

impl Buffers {
    fn give(&self, buf: MmapMut) {
        lock(&self.free).push(buf);
    }
}

#[derive(Debug)]
struct Flusher {
    queue: SyncSender<Job>,
    threads: Vec<JoinHandle<()>>,
}

impl Flusher {
    fn start(buffers: &Arc<Buffers>) -> io::Result<Self> {
        let (queue, jobs) = sync_channel::<Job>(QUEUED);
        let jobs = Arc::new(Mutex::new(jobs));
        let mut threads = Vec::with_capacity(WRITERS);
        for _ in 0..WRITERS {
            let (jobs, buffers) = (Arc::clone(&jobs), Arc::clone(buffers));
            let thread = std::thread::Builder::new()
                .name("saver-direct-io".into())
                .spawn(move || serve(&jobs, &buffers));
            match thread {
                Ok(t) => threads.push(t),
                // Fewer writers than asked still work; none at all is the caller's fallback.
                Err(e) if threads.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(Self { queue, threads })
    }
}

fn serve(jobs: &Mutex<Receiver<Job>>, buffers: &Buffers) {
    loop {
        // The lock is held while waiting, so one idle thread waits on the queue and the others
        // on the lock: either way the next job goes to one of them.
        let job = lock(jobs).recv();
        match job {
            Ok(job) => job.run(buffers),
            Err(_) => return, // the pool is gone and the queue drained
        }
    }
}

/// Window buffers and the background writers, shared by every file a storage writes: a save's
/// window memory is the most it ever had in flight at once rather than one fresh buffer per
/// window, and its threads are started by the first full window and stopped with the pool.
#[derive(Debug, Default)]
pub(in crate::storage) struct WindowPool {
    buffers: Arc<Buffers>,
    flusher: Mutex<Option<Flusher>>,
}

impl WindowPool {
    /// A window buffer, reused if one is free.
    pub(super) fn take(&self) -> io::Result<MmapMut> {
        if let Some(buf) = lock(&self.buffers.free).pop() {
            return Ok(buf);
        }
        // An anonymous mapping: page-aligned, as O_DIRECT needs, and returned to the system
        // whole when the pool goes, unlike heap memory.
        let buf = MmapMut::map_anon(WINDOW as usize)?;
        self.buffers.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(buf)
    }

    /// Has `buf[..len]` written at `offset` of `file` by a background thread, then reused.
    /// Blocks while [`QUEUED`] windows are waiting. Where no thread can be started, writes here.
    pub(super) fn write_behind(
        &self,
        file: &Arc<DirectFile>,
        offset: u64,
        buf: MmapMut,
        len: usize,
    ) {
        lock(&file.progress).pending += 1;
        let job = Job {
            file: Arc::clone(file),
            offset,
            buf,
            len,
        };
        let queue = {
            let mut flusher = lock(&self.flusher);
            if flusher.is_none() {
                *flusher = Flusher::start(&self.buffers).ok();
            }
            flusher.as_ref().map(|f| f.queue.clone())
        };
        match queue {
            Some(queue) => {
                if let Err(unsent) = queue.send(job) {
                    unsent.0.run(&self.buffers);
                }
            }
            None => job.run(&self.buffers),
        }
    }

    /// Buffers allocated so far: the most windows that were ever open or in flight at once.
    #[cfg(test)]
    pub fn allocated(&self) -> usize {
        self.buffers.allocated.load(Ordering::Relaxed)
    }

    /// The most windows that can be handed over and not yet written.
    #[cfg(test)]
    pub const IN_FLIGHT: usize = QUEUED + WRITERS;
}

impl Drop for WindowPool {
    /// Lets the threads write what is queued, then joins them: no write of a file outlives the
    /// storage that made it.
    fn drop(&mut self) {
        if let Some(Flusher { queue, threads }) = lock(&self.flusher).take() {
            drop(queue);
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

//! Page-aligned buffers, and the threads that write full pages of them while the writer threads
//! go on producing the next bytes.
//!
//! A direct write blocks its caller until the device has the data. When the writer thread that
//! gathered a piece wrote it too, a save alternated between gathering rows (CPU) and waiting for
//! the disk, and took about the sum of the two; handing the pieces to background threads lets
//! them overlap. The bytes handed over and not yet written are bounded ([`IN_FLIGHT`]): when the
//! disk is slower than the gather, writer threads wait for it instead of memory growing.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use memmap2::MmapMut;

/// Alignment of offsets, lengths and memory for `O_DIRECT` (the largest logical block size in
/// common use, and the page size). Buffer memory is page-aligned, being an anonymous mapping.
pub(super) const ALIGN: usize = 4096;

/// Background writer threads. This disk wrote faster the more writes it had queued: with two
/// threads, a save whose four writer threads wrote four files at once took 0.85-0.91 s for 1 GiB,
/// with four 0.71 s, as fast as with the 512 KiB windows of the design before (`saver save
/// --direct-io --parallel 4`, tables=8,rows=250045,dim=64; docs/benchmarks/HISTORY.md). The threads
/// sleep in the disk's writes, so more of them cost little CPU.
const WRITERS: usize = 4;

/// The most bytes one background write sends. A piece's pages are cut into writes of this size,
/// which the background threads share, so that the disk has a write queued per thread even when
/// few pieces are in flight. Each write wakes a background thread, which on two cores busy with
/// gathering rows waits for one: 512 KiB writes left the 2 GiB durable save of `compare` at
/// 1.60 s (median of six rounds alternated with 4 MiB writes, which took 1.47 s; the disk's
/// requests are at most 4 MiB here). The disk still has one write queued per thread: a piece
/// larger than this is cut, and [`IN_FLIGHT`] holds four of these. With two threads, one write
/// per piece of 4 MiB was slower (docs/benchmarks/HISTORY.md, "Rows gathered straight into the memory
/// the disk reads").
const PART: usize = 4 << 20;

/// Bytes handed to the background writers and not yet written: about two writer threads'
/// chunks (8 MiB each by default), so that each can hand over a chunk's pieces and gather the
/// next while they are written. A piece larger than this is still taken when nothing else is in
/// flight.
pub(super) const IN_FLIGHT: usize = 16 << 20;

/// Buffers are allocated in these steps, so that pieces of slightly different lengths (chunks
/// of tables with other row widths) reuse each other's buffers.
const STEP: usize = 256 << 10;

/// Bytes of free buffers kept for reuse; past it the oldest are unmapped. The pieces of a save
/// come in a few lengths (a chunk's slots, its ids), which the buffers in use and in flight
/// already have; the free ones are those between a background write and the next loan, and the
/// odd lengths of segments' last chunks.
const FREE: usize = 16 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new error like `e`: `io::Error` cannot be cloned, and a file's first failure is reported to
/// every later call.
fn replay(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

/// One file written with direct I/O, and the state of its pieces handed to the background.
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
    /// Pieces handed over and not yet written.
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
    pub(super) fn new(direct: File, buffered: File) -> Self {
        Self {
            direct,
            buffered,
            progress: Mutex::default(),
            settled: Condvar::new(),
        }
    }

    /// Writes `bytes` (aligned in memory, offset and length) at `offset`.
    fn write(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        match self.direct.write_all_at(bytes, offset) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.buffered.write_all_at(bytes, offset)
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

    /// Fails if a piece of this file already failed to be written, so that a save stops at its
    /// next write rather than at commit.
    pub(super) fn check(&self) -> io::Result<()> {
        lock(&self.progress).outcome()
    }

    /// Waits until every piece handed over is written; the first failure, if any.
    pub(super) fn settle(&self) -> io::Result<()> {
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

/// A pool buffer lent for a piece, shared by the writes its pages are cut into: back to the
/// pool when the last of them lets go of it, whichever thread that is.
pub(super) struct Pooled {
    map: Option<MmapMut>,
    buffers: Arc<Buffers>,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(m) = self.map.take() {
            self.buffers.give(m);
        }
    }
}

/// The caller's memory, lent to the background writes of [`BufferPool::write_borrowed`] for
/// as long as that call waits for them: it says it is done when the last of them lets go.
pub(super) struct Borrowed {
    ptr: *const u8,
    len: usize,
    done: Arc<(Mutex<bool>, Condvar)>,
}

// SAFETY: the memory is only read, and `write_borrowed` keeps it alive and unchanged until the
// last holder drops it.
unsafe impl Send for Borrowed {}
unsafe impl Sync for Borrowed {}

impl Drop for Borrowed {
    fn drop(&mut self) {
        let (done, cv) = &*self.done;
        *lock(done) = true;
        cv.notify_all();
    }
}

/// Memory whose whole pages go to the disk.
pub(super) enum Memory {
    /// A pool buffer ([`BufferPool::share`]).
    Pooled(Arc<Pooled>),
    /// A page assembled from the ends of neighbouring pieces, in heap memory (its pages range
    /// is the aligned page within it).
    Page(Vec<u8>),
    /// The caller's memory ([`BufferPool::write_borrowed`]).
    Borrowed(Arc<Borrowed>),
}

impl Memory {
    fn bytes(&self) -> &[u8] {
        match self {
            Memory::Pooled(m) => m.map.as_deref().unwrap_or_default(),
            Memory::Page(v) => v,
            // SAFETY: valid for `len` bytes while any holder lives (see `Borrowed`).
            Memory::Borrowed(b) => unsafe { std::slice::from_raw_parts(b.ptr, b.len) },
        }
    }
}

/// Whole pages of a buffer on their way to the disk.
struct Job {
    file: Arc<DirectFile>,
    offset: u64,
    buf: Memory,
    pages: Range<usize>,
    /// Bytes of the whole write this job is a part of: in flight until its last part is done.
    whole: usize,
    /// Parts of that write not done yet, this one among them.
    parts_left: Arc<AtomicUsize>,
}

/// A job written: whether it was the last of its piece's writes, and what its file is told.
struct Written {
    file: Arc<DirectFile>,
    result: io::Result<()>,
    last: bool,
}

impl Written {
    /// Tells the file its write is done (after the caller released what the piece held in
    /// flight, so that a settled file has nothing of its own in flight).
    fn report(self) {
        self.file.done(self.result);
    }
}

impl Job {
    /// Writes the job's pages.
    fn run(self) -> Written {
        let Job {
            file,
            offset,
            buf,
            pages,
            parts_left,
            ..
        } = self;
        let result = file.write(offset, &buf.bytes()[pages]);
        // Each part lets go of the memory before it counts itself done, so that when the last
        // one counts, the buffer is back in the pool. Which part is last is decided by the
        // count alone: asking the shared buffer whether it was the only holder left (as a first
        // version did) let two parts finishing together each see the other still holding it,
        // and the write stayed in flight for good.
        drop(buf);
        let last = parts_left.fetch_sub(1, Ordering::AcqRel) == 1;
        Written { file, result, last }
    }
}

#[derive(Debug, Default)]
struct Buffers {
    /// Oldest first.
    free: Mutex<VecDeque<MmapMut>>,
    /// Bytes of every buffer allocated and not yet unmapped.
    allocated: AtomicUsize,
    /// The most `allocated` ever was.
    peak: AtomicUsize,
}

impl Buffers {
    /// Keeps `buf` for reuse, unmapping the oldest free buffers past [`FREE`] bytes.
    fn give(&self, buf: MmapMut) {
        let dropped: Vec<MmapMut> = {
            let mut free = lock(&self.free);
            free.push_back(buf);
            let mut kept: usize = free.iter().map(|b| b.len()).sum();
            let mut dropped = Vec::new();
            while kept > FREE {
                let Some(b) = free.pop_front() else { break };
                kept -= b.len();
                dropped.push(b);
            }
            dropped
        };
        for b in dropped {
            self.allocated.fetch_sub(b.len(), Ordering::Relaxed);
        }
    }

    /// A buffer of at least `len` bytes: the smallest free one that fits without wasting more
    /// than a quarter of it (a chunk's ids must not take the buffer its slots will want), or a
    /// new one.
    fn take(&self, len: usize) -> io::Result<MmapMut> {
        let want = len.max(1).next_multiple_of(STEP);
        {
            let mut free = lock(&self.free);
            let fit = (0..free.len())
                .filter(|&i| (want..=want + want / 4).contains(&free[i].len()))
                .min_by_key(|&i| free[i].len());
            if let Some(b) = fit.and_then(|i| free.remove(i)) {
                return Ok(b);
            }
        }
        // An anonymous mapping: page-aligned, as O_DIRECT needs, and returned to the system
        // whole when dropped, unlike heap memory.
        let buf = MmapMut::map_anon(want)?;
        let now = self.allocated.fetch_add(buf.len(), Ordering::Relaxed) + buf.len();
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(buf)
    }
}

/// Jobs waiting for a background writer, and the bytes handed over and not yet written.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    in_flight: usize,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// A job was queued, or the queue closed.
    ready: Condvar,
    /// A job was written: there may be room.
    room: Condvar,
}

struct Flusher {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Flusher {
    fn start() -> io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::with_capacity(WRITERS);
        for _ in 0..WRITERS {
            let shared = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name("saver-direct-io".into())
                .spawn(move || serve(&shared));
            match thread {
                Ok(t) => threads.push(t),
                // Fewer writers than asked still work; none at all is the caller's fallback.
                Err(e) if threads.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(Self { shared, threads })
    }
}

fn serve(shared: &Shared) {
    loop {
        let job = {
            let mut queue = lock(&shared.queue);
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break job;
                }
                if queue.closed {
                    return;
                }
                queue = shared
                    .ready
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let whole = job.whole;
        let written = job.run();
        if written.last {
            lock(&shared.queue).in_flight -= whole;
            shared.room.notify_all();
        }
        written.report();
    }
}

/// Buffers and the background writers, shared by every file a storage writes: a save's buffer
/// memory is the most it ever had in use at once rather than one fresh buffer per piece, and
/// its threads are started by the first piece handed over and stopped with the pool.
pub(in crate::storage) struct BufferPool {
    buffers: Arc<Buffers>,
    flusher: Mutex<Option<Flusher>>,
    /// The most bytes one background write sends: [`PART`], smaller in tests, so that the
    /// writes of one piece finish at about the same time on different threads.
    part: usize,
}

impl Default for BufferPool {
    fn default() -> Self {
        Self {
            buffers: Arc::default(),
            flusher: Mutex::default(),
            part: PART,
        }
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("buffers", &self.buffers)
            .finish_non_exhaustive()
    }
}

impl BufferPool {
    /// A page-aligned buffer of at least `len` bytes, reused if one is free.
    pub(super) fn take(&self, len: usize) -> io::Result<MmapMut> {
        self.buffers.take(len)
    }

    /// Takes back a buffer that was not handed over.
    pub(super) fn give(&self, buf: MmapMut) {
        self.buffers.give(buf);
    }

    /// `buf`, taken from this pool, as memory to hand to [`Self::write_behind`]: back to the
    /// pool once its last write is done.
    pub(super) fn share(&self, buf: MmapMut) -> Memory {
        Memory::Pooled(Arc::new(Pooled {
            map: Some(buf),
            buffers: Arc::clone(&self.buffers),
        }))
    }

    /// Has `bytes[pages]` (aligned) written at `offset` of `file` from the caller's memory by the
    /// background threads, as [`Self::write_behind`] does, and returns once they are written
    /// (their outcome goes to the file, as theirs does): no copy into a buffer of the pool.
    pub(super) fn write_borrowed(
        &self,
        file: &Arc<DirectFile>,
        offset: u64,
        bytes: &[u8],
        pages: Range<usize>,
    ) {
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        let borrowed = Borrowed {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            done: Arc::clone(&done),
        };
        self.write_behind(file, offset, Memory::Borrowed(Arc::new(borrowed)), pages);
        // The writes hold the caller's memory: the call lasts until the last one let go of it.
        let (written, cv) = &*done;
        let mut written = lock(written);
        while !*written {
            written = cv.wait(written).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Has `buf[pages]` (aligned) written at `offset` of `file` by the background threads, in
    /// writes of at most [`PART`], then reused. Blocks while [`IN_FLIGHT`] bytes are handed over
    /// and not written. Where no thread can be started, writes here.
    pub(super) fn write_behind(
        &self,
        file: &Arc<DirectFile>,
        offset: u64,
        buf: Memory,
        pages: Range<usize>,
    ) {
        debug_assert!(offset.is_multiple_of(ALIGN as u64));
        debug_assert!((buf.bytes().as_ptr() as usize + pages.start).is_multiple_of(ALIGN));
        debug_assert!(pages.len().is_multiple_of(ALIGN));
        let shared = {
            let mut flusher = lock(&self.flusher);
            if flusher.is_none() {
                *flusher = Flusher::start().ok();
            }
            flusher.as_ref().map(|f| Arc::clone(&f.shared))
        };
        let mut parts = Vec::new();
        let mut at = pages.start;
        while at < pages.end {
            let end = (at + self.part).min(pages.end);
            parts.push(at..end);
            at = end;
        }
        let last = parts.len().saturating_sub(1);
        let mut buf = Some(buf);
        let whole = pages.len();
        let parts_left = Arc::new(AtomicUsize::new(parts.len()));
        let jobs: Vec<Job> = parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| {
                // The last part takes `buf` itself; a page's heap memory is one page, never cut.
                let mem = match (i == last, &buf) {
                    (false, Some(Memory::Pooled(m))) => Memory::Pooled(Arc::clone(m)),
                    (false, Some(Memory::Borrowed(b))) => Memory::Borrowed(Arc::clone(b)),
                    _ => buf.take().expect("only the last part takes the buffer"),
                };
                Job {
                    file: Arc::clone(file),
                    offset: offset + (part.start - pages.start) as u64,
                    buf: mem,
                    pages: part,
                    whole,
                    parts_left: Arc::clone(&parts_left),
                }
            })
            .collect();
        lock(&file.progress).pending += jobs.len();
        let Some(shared) = shared else {
            for job in jobs {
                job.run().report();
            }
            return;
        };
        // The whole write is admitted at once: its buffer is held until its last part is done.
        let mut queue = lock(&shared.queue);
        while queue.in_flight > 0 && queue.in_flight + whole > IN_FLIGHT {
            queue = shared
                .room
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
        queue.in_flight += whole;
        queue.jobs.extend(jobs);
        drop(queue);
        shared.ready.notify_all();
    }

    /// A pool whose background writes send at most `part` bytes (a multiple of [`ALIGN`]).
    #[cfg(test)]
    pub(crate) fn with_part(part: usize) -> Self {
        assert!(part > 0 && part.is_multiple_of(ALIGN));
        Self {
            buffers: Arc::default(),
            flusher: Mutex::default(),
            part,
        }
    }

    /// Bytes handed to the background writers and not yet written, by their count.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        lock(&self.flusher)
            .as_ref()
            .map_or(0, |f| lock(&f.shared.queue).in_flight)
    }

    /// The most bytes of buffers this pool ever held at once.
    #[cfg(test)]
    pub(crate) fn peak_bytes(&self) -> usize {
        self.buffers.peak.load(Ordering::Relaxed)
    }
}

impl Drop for BufferPool {
    /// Lets the threads write what is queued, then joins them: no write of a file outlives the
    /// storage that made it.
    fn drop(&mut self) {
        if let Some(Flusher { shared, threads }) = lock(&self.flusher).take() {
            lock(&shared.queue).closed = true;
            shared.ready.notify_all();
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;

    use super::*;

    /// The writes one buffer is cut into, finishing on two threads at the same instant: exactly
    /// one of them is the last, however they interleave, and the buffer goes back to the pool.
    /// If neither counted itself last, the whole write stayed in flight for good.
    #[test]
    fn exactly_one_write_of_a_buffer_is_its_last() {
        // Writes to /dev/null take the same short time on both threads, so that they finish
        // together as often as possible.
        let f = File::options().write(true).open("/dev/null").unwrap();
        let file = Arc::new(DirectFile::new(f.try_clone().unwrap(), f));
        let pool = BufferPool::default();
        let start = Barrier::new(2);
        let rounds = 50_000;
        let lasts = AtomicUsize::new(0);
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Mutex::new(rx);
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..rounds {
                    let job = lock(&rx).recv().unwrap();
                    start.wait();
                    let written = job.run();
                    if written.last {
                        lasts.fetch_add(1, Ordering::Relaxed);
                    }
                    written.report();
                }
            });
            for _ in 0..rounds {
                let mem = pool.share(pool.take(2 * ALIGN).unwrap());
                let Memory::Pooled(mem) = mem else {
                    unreachable!("a pool buffer")
                };
                let parts_left = Arc::new(AtomicUsize::new(2));
                let mut jobs = (0..2).map(|i| Job {
                    file: Arc::clone(&file),
                    offset: (i * ALIGN) as u64,
                    buf: Memory::Pooled(Arc::clone(&mem)),
                    pages: i * ALIGN..(i + 1) * ALIGN,
                    whole: 2 * ALIGN,
                    parts_left: Arc::clone(&parts_left),
                });
                let (mine, theirs) = (jobs.next().unwrap(), jobs.next().unwrap());
                drop(mem);
                lock(&file.progress).pending += 2;
                tx.send(theirs).unwrap();
                start.wait();
                let written = mine.run();
                if written.last {
                    lasts.fetch_add(1, Ordering::Relaxed);
                }
                written.report();
            }
        });
        assert_eq!(
            lasts.load(Ordering::Relaxed),
            rounds,
            "writes whose last part was missed"
        );
        file.settle().unwrap();
        // Every buffer came back: one allocation, reused each round.
        assert_eq!(
            pool.peak_bytes(),
            pool.buffers.allocated.load(Ordering::Relaxed)
        );
        assert!(
            pool.peak_bytes() <= 2 * STEP,
            "{} bytes of buffers",
            pool.peak_bytes()
        );
    }
}

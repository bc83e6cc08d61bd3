//! Direct I/O for [`super::LocalFs`]: positional writes of any size and offset, written with
//! `O_DIRECT`, around the page cache, from page-aligned memory.
//!
//! A durable save has to get every byte to the disk anyway; through the page cache that costs a
//! kernel copy per byte and a writeback before the fsync can return, and `benches/write_paths.rs`
//! measured direct writes of the same data at half the time. `O_DIRECT` needs the offset, the
//! length and the memory of every write aligned to the device's blocks, which a save's pieces
//! (tensor rows at any offset) are not. So a piece is gathered into memory the file lends
//! ([`DirectWrites::lend`]), placed at the same offset within a page as in the file:
//! - the pages the piece covers whole go to the disk straight from that memory, written by the
//!   pool's background threads (`flusher.rs`) while the writer threads go on producing bytes;
//! - the parts of its first and last page that it shares with its neighbours (less than a page
//!   at each end) are copied into that page's buffer, where the neighbours' parts join them;
//!   the piece that makes the page whole copies it into its own memory and writes it with its
//!   other pages.
//!
//! A piece given in the caller's memory ([`DirectWrites::write_at`]) is copied into lent memory
//! first, or, under two pages, into the buffers of the pages it touches. An earlier design
//! copied every piece into 512 KiB windows and wrote each window once complete: a second copy of
//! every byte, a quarter of a save's CPU (docs/benchmarks/HISTORY.md). Writing the shared pages through
//! the page cache instead was tried and is slower: a buffered write takes the inode's lock
//! exclusively, so the writer thread waited for the direct writes in flight.
//!
//! Memory stays bounded: buffers are reused from a [`BufferPool`], and the bytes on their way to
//! the disk are bounded, so that writer threads wait for the disk rather than memory growing.
//! Callers must write every byte of the file exactly once: bytes never written are an error at
//! commit, never a file with a hole.

mod flusher;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use memmap2::MmapMut;

pub(super) use flusher::BufferPool;
use flusher::{DirectFile, Memory, ALIGN};

/// Pieces shorter than this, given in the caller's memory, go into the buffers of the pages
/// they touch: a copy into lent memory would send at most a page or two straight to the disk.
const SMALL: usize = 2 * ALIGN;

/// Pieces at least this long, placed in the caller's memory as in the file, are written straight
/// from it: shorter ones are copied, which costs less than waiting for their write.
const BORROWED_FROM: usize = 64 << 10;

/// The first and the last page boundary within the `len` bytes at `offset`: the pages between
/// them are covered whole; the bytes before `first` and from `last` on share their pages.
fn page_bounds(offset: u64, len: usize) -> (u64, u64) {
    let a = ALIGN as u64;
    let end = offset + len as u64;
    let first = offset.next_multiple_of(a).min(end);
    (first, (end / a * a).max(first))
}

/// A page of the file that pieces share, being assembled.
struct SharedPage {
    /// Twice a page, so that an aligned page lies within it.
    mem: Vec<u8>,
    /// Where the aligned page starts in `mem`.
    at: usize,
    /// Bytes of the page given so far.
    filled: usize,
}

/// Memory a file written with direct I/O lends for bytes it is to be given: see
/// [`crate::storage::WriteHandle::lend`].
pub struct Lent {
    buf: MmapMut,
    /// Where the bytes start in `buf`: the file offset's place within its page.
    start: usize,
    len: usize,
    offset: u64,
}

impl Lent {
    /// The file offset the bytes are for.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl AsMut<[u8]> for Lent {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The direct-I/O side of one file being written.
pub(super) struct DirectWrites {
    file: Arc<DirectFile>,
    /// The file's final length: as planned, or as [`DirectWrites::truncate`] cut it.
    len: AtomicU64,
    /// Bytes given so far.
    written: AtomicU64,
    /// The end of the furthest bytes given.
    end: AtomicU64,
    /// Pages that pieces share, by page number, until each is whole.
    shared: Mutex<HashMap<u64, SharedPage>>,
    pool: Arc<BufferPool>,
}

impl DirectWrites {
    /// Opens `path` (already created as `buffered`, of final length `len`) for direct writes;
    /// `None` where the filesystem does not support them (tmpfs, some network filesystems), so
    /// the caller writes through the page cache instead.
    pub(super) fn open(
        path: &Path,
        buffered: &File,
        len: u64,
        pool: Arc<BufferPool>,
    ) -> Option<Self> {
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

    fn with_files(direct: File, buffered: File, len: u64, pool: Arc<BufferPool>) -> Self {
        Self {
            file: Arc::new(DirectFile::new(direct, buffered)),
            len: AtomicU64::new(len),
            written: AtomicU64::new(0),
            end: AtomicU64::new(0),
            shared: Mutex::default(),
            pool,
        }
    }

    /// Bytes of page `page` within the file: a whole page, or the file's last bytes.
    fn page_len(&self, page: u64) -> usize {
        let start = page * ALIGN as u64;
        self.len().saturating_sub(start).min(ALIGN as u64) as usize
    }

    /// Copies `bytes` into page `page` from `in_page` on: the page, once all its bytes have come,
    /// for the caller to write (the last page of the file padded with zeros:
    /// [`DirectWrites::finish`] cuts it).
    fn share(&self, page: u64, in_page: usize, bytes: &[u8]) -> io::Result<Option<SharedPage>> {
        let page_len = self.page_len(page);
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let p = shared.entry(page).or_insert_with(|| {
            let mem = vec![0; 2 * ALIGN];
            let at = mem.as_ptr().align_offset(ALIGN);
            SharedPage { mem, at, filled: 0 }
        });
        p.mem[p.at + in_page..p.at + in_page + bytes.len()].copy_from_slice(bytes);
        p.filled += bytes.len();
        if p.filled > page_len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bytes of page {page} were written twice"),
            ));
        }
        if p.filled < page_len {
            return Ok(None);
        }
        Ok(shared.remove(&page))
    }

    /// Has a whole shared page written by itself.
    fn write_page(&self, page: u64, p: SharedPage) {
        self.pool.write_behind(
            &self.file,
            page * ALIGN as u64,
            Memory::Page(p.mem),
            p.at..p.at + ALIGN,
        );
    }

    /// [`DirectWrites::share`]s `bytes`, at `offset`, page by page, writing the pages they make
    /// whole.
    fn share_all(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let mut at = 0;
        while at < bytes.len() {
            let off = offset + at as u64;
            let in_page = off as usize % ALIGN;
            let n = (ALIGN - in_page).min(bytes.len() - at);
            let page = off / ALIGN as u64;
            if let Some(p) = self.share(page, in_page, &bytes[at..at + n])? {
                self.write_page(page, p);
            }
            at += n;
        }
        Ok(())
    }

    fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    /// An error unless `len` bytes at `offset` lie within the file, and no earlier write of it
    /// failed.
    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len())
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "write of {len} bytes at {offset} past the planned length {}",
                    self.len()
                ),
            ));
        }
        self.file.check()
    }

    fn given(&self, offset: u64, len: usize) {
        self.written.fetch_add(len as u64, Ordering::AcqRel);
        self.end.fetch_max(offset + len as u64, Ordering::AcqRel);
    }

    /// Ends the file at `len`, after its bytes up to `len` were given and none past it (a
    /// compressed save learns its files' lengths only at their end).
    pub(super) fn truncate(&self, len: u64) -> io::Result<()> {
        if len > self.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "cannot grow from {} to {len} bytes by a truncate",
                    self.len()
                ),
            ));
        }
        let end = self.end.load(Ordering::Acquire);
        if end > len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bytes past {len} were written (up to {end})"),
            ));
        }
        self.len.store(len, Ordering::Release);
        // The page holding the new end may be whole now.
        let page = len / ALIGN as u64;
        if !len.is_multiple_of(ALIGN as u64) {
            if let Some(p) = self.share(page, 0, &[])? {
                self.write_page(page, p);
            }
        }
        Ok(())
    }

    /// Page-aligned memory for the `len` bytes at `offset`, to fill and give back with
    /// [`DirectWrites::write_lent`].
    pub(super) fn lend(&self, offset: u64, len: usize) -> io::Result<Lent> {
        self.check(offset, len)?;
        let start = offset as usize % ALIGN;
        Ok(Lent {
            buf: self.pool.take(start + len)?,
            start,
            len,
            offset,
        })
    }

    /// Writes memory [`DirectWrites::lend`] gave: the pages it covers whole by a background
    /// thread, straight from it; its ends into the pages it shares with its neighbours. A shared
    /// page this piece makes whole is copied into the lent memory around the piece and written
    /// with it, so that shared pages cost no write of their own. Fails if an earlier piece of the
    /// file failed to be written.
    pub(super) fn write_lent(&self, lent: Lent) -> io::Result<()> {
        let Lent {
            mut buf,
            start,
            len,
            offset,
        } = lent;
        self.check(offset, len)?;
        self.given(offset, len);
        let a = ALIGN as u64;
        let (first, last) = page_bounds(offset, len);
        let (head, tail) = ((first - offset) as usize, (last - offset) as usize);
        // Where file offset `at` (within the piece's pages) is in `buf`: the piece's first page
        // starts at 0.
        let index = |at: u64| (at - (offset - start as u64)) as usize;
        let mut pages = first..last;
        if head > 0 {
            let page = offset / a;
            if let Some(p) = self.share(page, start, &buf[start..start + head])? {
                buf[0..ALIGN].copy_from_slice(&p.mem[p.at..p.at + ALIGN]);
                pages = page * a..pages.end.max(page * a + a);
            }
        }
        if tail < len {
            let page = last / a;
            let bytes = &buf[start + tail..start + len];
            if let Some(p) = self.share(page, 0, bytes)? {
                // `buf` reaches the end of the piece's last page: lent lengths are whole pages.
                let i = index(last);
                buf[i..i + ALIGN].copy_from_slice(&p.mem[p.at..p.at + ALIGN]);
                let from = if pages.is_empty() { last } else { pages.start };
                pages = from..last + a;
            }
        }
        if pages.is_empty() {
            self.pool.give(buf);
        } else {
            let range = index(pages.start)..index(pages.end);
            self.pool
                .write_behind(&self.file, pages.start, self.pool.share(buf), range);
        }
        Ok(())
    }

    /// Writes `buf` at `offset`, from the caller's memory: its whole pages straight from it where
    /// it lies at the same place within a page as in the file (a background save's copy placed
    /// so: `saver_core::moment_copy`), waiting for them; else copied into lent memory, or under
    /// two pages into the pages it touches. Fails if an earlier piece of the file failed to be
    /// written.
    pub(super) fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        if buf.len() >= BORROWED_FROM && buf.as_ptr() as usize % ALIGN == offset as usize % ALIGN {
            return self.write_in_place(offset, buf);
        }
        if buf.len() < SMALL {
            self.check(offset, buf.len())?;
            self.given(offset, buf.len());
            return self.share_all(offset, buf);
        }
        let mut lent = self.lend(offset, buf.len())?;
        lent.as_mut().copy_from_slice(buf);
        self.write_lent(lent)
    }

    /// [`DirectWrites::write_at`] of bytes placed in memory as in the file: the pages they cover
    /// whole written from that memory, their ends shared with their neighbours' pages.
    fn write_in_place(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.check(offset, buf.len())?;
        self.given(offset, buf.len());
        let (first, last) = page_bounds(offset, buf.len());
        let (head, tail) = ((first - offset) as usize, (last - offset) as usize);
        self.share_all(offset, &buf[..head])?;
        self.share_all(last, &buf[tail..])?;
        if tail > head {
            self.pool.write_borrowed(&self.file, first, buf, head..tail);
        }
        Ok(())
    }

    /// Waits for the file's pieces to be written, checks every byte was given once, and cuts
    /// the file to its length (the last page was written padded, or a truncate shortened it).
    pub(super) fn finish(&self, buffered: &File) -> io::Result<()> {
        self.file.settle()?;
        {
            let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((&page, p)) = shared.iter().min_by_key(|(&page, _)| page) {
                let from = page * ALIGN as u64;
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} of the bytes {from}..{} were never written ({} incomplete pages in all)",
                        self.page_len(page) - p.filled,
                        from + self.page_len(page) as u64,
                        shared.len()
                    ),
                ));
            }
        }
        let (written, len) = (self.written.load(Ordering::Acquire), self.len());
        if written != len {
            let what = if written < len {
                format!("{} of its {len} bytes were never written", len - written)
            } else {
                format!("{written} bytes were written for its {len}: some twice")
            };
            return Err(io::Error::new(io::ErrorKind::InvalidData, what));
        }
        if buffered.metadata()?.len() != len {
            buffered.set_len(len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use proptest::prelude::*;

    use super::*;

    const MIB: u64 = 1 << 20;

    /// A file of length `len` opened both ways, in a directory beside the sources rather than in
    /// /tmp, which may be a tmpfs without O_DIRECT.
    fn open_file(len: u64, pool: &Arc<BufferPool>) -> (tempfile::TempDir, File, DirectWrites) {
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

    /// Gives `bytes` at `offset` in memory the file lends, as the save writer does.
    fn write_lending(direct: &DirectWrites, offset: u64, bytes: &[u8]) {
        let mut lent = direct.lend(offset, bytes.len()).unwrap();
        assert_eq!(lent.offset(), offset);
        lent.as_mut().copy_from_slice(bytes);
        direct.write_lent(lent).unwrap();
    }

    /// Writes `data` in lent memory from two threads that take pieces of `piece` bytes in file
    /// order, as the save writer's threads take chunks.
    fn write_in_order(direct: &DirectWrites, data: &[u8], piece: usize) {
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| loop {
                    let lo = next.fetch_add(1, Ordering::Relaxed) * piece;
                    if lo >= data.len() {
                        break;
                    }
                    let hi = (lo + piece).min(data.len());
                    write_lending(direct, lo as u64, &data[lo..hi]);
                });
            }
        });
    }

    /// Writes `data` as pieces cut at `cuts`, shuffled by `seed`, from two threads, some in
    /// lent memory and some in the caller's, with buffers that already held another file's
    /// bytes. With `in_place`, the caller's memory lies at the same place within a page as the
    /// file's bytes (as a background save's copy does), so its long pieces are written from it.
    fn write_in_pieces(data: &[u8], cuts: &[usize], seed: u64, in_place: bool) -> Vec<u8> {
        let mut placed = vec![0u8; data.len() + ALIGN];
        let data = if in_place {
            let at = placed.as_ptr().align_offset(ALIGN);
            placed[at..at + data.len()].copy_from_slice(data);
            &placed[at..at + data.len()]
        } else {
            data
        };
        let pool = Arc::new(BufferPool::default());
        let stale = vec![0xA5; 3 * MIB as usize + 7];
        let (_d, buffered, direct) = open_file(stale.len() as u64, &pool);
        for piece in stale.chunks(MIB as usize / 3) {
            let at = piece.as_ptr() as usize - stale.as_ptr() as usize;
            write_lending(&direct, at as u64, piece);
        }
        direct.finish(&buffered).unwrap();

        let (dir, buffered, direct) = open_file(data.len() as u64, &pool);
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| c % (data.len() + 1)).collect();
        bounds.extend([0, data.len()]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut pieces: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
        // A fixed shuffle, so that pages shared by two pieces get their parts in either order.
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
                let direct = &direct;
                s.spawn(move || {
                    for &(lo, hi) in half {
                        if (lo ^ seed as usize) & 1 == 0 {
                            write_lending(direct, lo as u64, &data[lo..hi]);
                        } else {
                            direct.write_at(lo as u64, &data[lo..hi]).unwrap();
                        }
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
        let pool = Arc::new(BufferPool::default());
        let planned = 6 * MIB + 100;
        for cut in [100, MIB, MIB + 1, 2 * MIB, 3 * MIB + 4097, 6 * MIB + 99] {
            let data: Vec<u8> = (0..cut).map(|i| (i * 7 % 251) as u8).collect();
            let (dir, buffered, direct) = open_file(planned, &pool);
            for piece in data.chunks(100_003) {
                let at = piece.as_ptr() as usize - data.as_ptr() as usize;
                direct.write_at(at as u64, piece).unwrap();
            }
            direct.truncate(cut).unwrap();
            direct.finish(&buffered).unwrap();
            drop(direct);
            assert!(read_back(&dir) == data, "cut at {cut}");
        }
        let (_dir, _buffered, direct) = open_file(planned, &pool);
        direct.write_at(2 * MIB, &[1; 10]).unwrap();
        assert!(direct.truncate(MIB + 5).is_err());
        assert!(direct.truncate(2 * MIB + 5).is_err());
        assert!(direct.truncate(planned + 1).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn pieces_in_any_order_give_the_file_written_in_one_go(
            len in prop_oneof![1usize..10_000, 1_000_000usize..3_200_000],
            cuts in prop::collection::vec(any::<usize>(), 0..40),
            seed: u64,
            in_place: bool,
        ) {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let read = write_in_pieces(&data, &cuts, seed, in_place);
            prop_assert_eq!(read.len(), data.len());
            prop_assert!(read == data, "content differs");
        }
    }

    #[test]
    fn a_write_past_the_planned_length_is_refused() {
        let (_d, _buffered, direct) = open_file(100, &Arc::default());
        let err = direct.write_at(90, &[1; 20]).unwrap_err();
        assert!(err.to_string().contains("past the planned length"), "{err}");
        let err = direct.lend(90, 20).unwrap_err();
        assert!(err.to_string().contains("past the planned length"), "{err}");
    }

    #[test]
    fn bytes_never_written_are_an_error_at_commit_not_a_hole() {
        let len = 3 * MIB + 100;
        let (_d, buffered, direct) = open_file(len, &Arc::default());
        let data = vec![7u8; len as usize];
        let gap = 2 * MIB + 10..2 * MIB + 20;
        direct.write_at(0, &data[..gap.start as usize]).unwrap();
        direct.write_at(gap.end, &data[gap.end as usize..]).unwrap();
        let err = direct.finish(&buffered).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "10 of the bytes {}..{} were never written",
                2 * MIB,
                2 * MIB + ALIGN as u64
            )),
            "{err}"
        );
    }

    /// The save writer's pattern: threads take fixed-size chunks in file order; the buffers
    /// are those in the threads' hands and in flight, whatever the file size.
    #[test]
    fn writing_in_order_keeps_a_few_buffers_whatever_the_file_size() {
        let pool = Arc::new(BufferPool::default());
        let len = 48 * MIB + 5;
        let (dir, buffered, direct) = open_file(len, &pool);
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        write_in_order(&direct, &data, 700_001);
        direct.finish(&buffered).unwrap();
        assert!(read_back(&dir) == data, "content differs");
        // In flight, plus one in each writer's hands and one more each flusher may hold.
        let bound = flusher::IN_FLIGHT + 4 * MIB as usize;
        assert!(
            pool.peak_bytes() <= bound,
            "{} MiB of buffers for two writers",
            pool.peak_bytes() >> 20
        );
    }

    /// Pieces cut into many background writes, which finish on different threads at about the
    /// same time: once every file is finished, nothing counts as in flight. A write whose parts
    /// each thought another one was the last kept its bytes counted for good, and a save stopped
    /// for ever once such leaks filled the bound (seen in a 2 GiB benchmark's save).
    #[test]
    fn every_write_cut_into_parts_leaves_the_in_flight_count() {
        // 4 KiB parts: a 64 KiB piece is 16 writes for 4 threads.
        let pool = Arc::new(BufferPool::with_part(ALIGN));
        let len = 4 * MIB;
        let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
        for round in 0..8 {
            let (dir, buffered, direct) = open_file(len, &pool);
            write_in_order(&direct, &data, 64 << 10);
            direct.finish(&buffered).unwrap();
            assert_eq!(
                pool.in_flight(),
                0,
                "round {round}: bytes left counted in flight"
            );
            assert!(read_back(&dir) == data, "round {round}: content differs");
        }
    }

    /// A background write that fails (here: a descriptor not open for writing) stops the next
    /// write of the file and its commit; it is never lost with the thread that saw it.
    #[test]
    fn a_failed_background_write_fails_the_next_write_and_the_finish() {
        let pool = Arc::new(BufferPool::default());
        let len = 4 * MIB;
        let (dir, buffered, _) = open_file(len, &pool);
        let read_only = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(dir.path().join("f"))
            .unwrap();
        let direct = DirectWrites::with_files(read_only, buffered.try_clone().unwrap(), len, pool);
        let data = vec![3u8; len as usize];
        direct.write_at(0, &data[..2 * MIB as usize]).unwrap();
        let finished = direct.finish(&buffered);
        let err = finished.expect_err("the piece's write failed").to_string();
        assert!(err.contains("Bad file descriptor"), "{err}");
        let again = direct.write_at(2 * MIB, &data[..MIB as usize]);
        assert!(again.is_err(), "a later write must not succeed");
    }
}

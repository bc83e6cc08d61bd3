//! One pass of a plain table's distribution: the input read window by window, each row appended
//! to its group's runs in nameless temporary files (see [`super::plain`]'s module docs).
//!
//! A pass owns what it reads ([`TableInput`]), so that a table distributed in rounds
//! ([`super::rounds`]) can run its passes on a thread of its own while a save reads the rounds
//! already made.

use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use saver_core::PartitionRule;

use crate::error::{Error, Result};
use crate::storage::{allocate, FileVersion, ReadHandle};

/// Most bytes of row buffers one distributing thread holds (spread over the groups).
const DISTRIBUTE_BUFFER_BYTES: usize = 64 << 20;

/// Bytes a distributing thread gathers for a group before it appends them, as one run, to its
/// temporary file, while the groups' buffers fit in [`DISTRIBUTE_BUFFER_BYTES`]. Runs of 32 KiB
/// cost a quarter more time than these: every run is a write, and a read per column later.
const RUN_BYTES: usize = 128 << 10;

/// Bytes of input one distributing thread reads at a time.
const WINDOW_BYTES: u64 = 8 << 20;

/// Per group: its runs in the temporary files of a pass, (file, offset, rows), in row order.
pub(super) type Runs = Vec<Vec<(usize, u64, u64)>>;

/// One column of a table in the input: the file's handle and where the tensor's bytes are.
#[derive(Clone)]
pub(super) struct InputColumn {
    pub handle: Arc<dyn ReadHandle>,
    /// The file it is in, and the file's version when the input was opened.
    pub file: String,
    pub opened: Option<FileVersion>,
    /// The tensor's name, for errors.
    pub name: String,
    /// Absolute offset of the tensor's first byte in its file.
    pub offset: u64,
    /// The tensor's length in bytes.
    pub len: u64,
}

impl InputColumn {
    /// Reads `buf.len()` bytes of the tensor from byte `offset` within it.
    pub(super) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if offset + buf.len() as u64 > self.len {
            return Err(Error::Mismatch(format!(
                "read of {} bytes at {offset} is outside tensor {:?} ({} bytes)",
                buf.len(),
                self.name,
                self.len
            )));
        }
        self.handle.read_at(self.offset + offset, buf)
    }

    /// An error if the tensor's file changed since the input was opened: rows read before and
    /// after the change would be saved together.
    pub(super) fn check_unchanged(&self) -> Result<()> {
        let Some(opened) = self.opened else {
            return Ok(());
        };
        match self.handle.version()? {
            Some(now) if now == opened => Ok(()),
            now => Err(Error::Mismatch(format!(
                "tensor {:?}: input file {} changed while it was read (opened with {} bytes, \
                 now {}): rows read before and after the change would be saved together; save \
                 from a copy that nothing writes to",
                self.name,
                self.file,
                opened.len,
                now.map_or("unknown".to_string(), |n| n.len.to_string()) + " bytes, changed"
            ))),
        }
    }
}

/// A plain table's columns in the input, owned.
#[derive(Clone)]
pub(super) struct TableInput {
    pub ids: InputColumn,
    pub slots: Vec<InputColumn>,
    /// Bytes of one row of each slot.
    pub row_bytes: Vec<usize>,
    pub rows: u64,
}

impl TableInput {
    /// An error naming table `table` if any of its files changed since the input was opened
    /// ([`InputColumn::check_unchanged`]).
    pub(super) fn check_unchanged(&self, table: &str) -> Result<()> {
        std::iter::once(&self.ids)
            .chain(&self.slots)
            .try_for_each(InputColumn::check_unchanged)
            .map_err(|e| Error::Mismatch(format!("table {table:?}: {e}")))
    }

    /// Reads rows `rows` of the input: ids, and every slot's rows unless `slots` is `None`.
    pub(super) fn read(
        &self,
        rows: Range<u64>,
        ids: &mut Vec<u8>,
        slots: Option<&mut [Vec<u8>]>,
    ) -> Result<()> {
        let n = (rows.end - rows.start) as usize;
        ids.resize(n * 8, 0);
        self.ids.read(rows.start * 8, ids)?;
        for ((buf, c), &b) in slots
            .into_iter()
            .flatten()
            .zip(&self.slots)
            .zip(&self.row_bytes)
        {
            buf.resize(n * b, 0);
            c.read(rows.start * b as u64, buf)?;
        }
        Ok(())
    }

    /// The input's rows split into `parallel` contiguous parts, one per distributing thread.
    pub(super) fn parts(&self, parallel: usize) -> Vec<Range<u64>> {
        let per = self.rows.div_ceil(parallel.max(1) as u64).max(1);
        (0..parallel.max(1) as u64)
            .map(|p| (p * per).min(self.rows)..((p + 1) * per).min(self.rows))
            .filter(|r| !r.is_empty())
            .collect()
    }
}

/// What a pass writes of each row it takes: a run holds its rows' ids, then each slot's rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Content {
    /// Ids and slots.
    Rows,
    /// Ids only.
    Ids,
    /// Slots only.
    Slots,
}

impl Content {
    fn ids(self) -> bool {
        self != Content::Slots
    }
    fn slots(self) -> bool {
        self != Content::Ids
    }
}

/// A pass over a table's input: one read of it, window by window, writing one or more outputs.
pub(super) struct Pass<'a> {
    pub input: &'a TableInput,
    /// A row's group is its bucket `>> shift`.
    pub shift: u32,
    /// One thread per part, in part order, and one temporary file per part and output.
    pub parts: &'a [Range<u64>],
    pub outputs: Vec<Output>,
    pub scratch: &'a Path,
    /// Set to give up early (the pass then fails).
    pub cancel: Option<&'a AtomicBool>,
}

/// What a pass writes to one set of temporary files (one per part).
pub(super) struct Output {
    /// The groups whose rows it takes; the others' rows are skipped.
    pub groups: Range<usize>,
    pub content: Content,
    /// Bytes each part's file is reserved for before the first row is read: what it will hold,
    /// or an estimate.
    pub sizes: Vec<u64>,
}

/// A distribution's temporary files, one per distributing thread.
pub(super) struct TemporaryFiles(pub Vec<File>);

impl std::ops::Deref for TemporaryFiles {
    type Target = [File];
    fn deref(&self) -> &[File] {
        &self.0
    }
}

impl Drop for TemporaryFiles {
    /// Closes the files side by side: closing the last descriptor of a nameless file frees its
    /// cached pages and blocks, about a second for 6 GiB, with the CPU and the disk otherwise idle.
    fn drop(&mut self) {
        let files = std::mem::take(&mut self.0);
        if files.len() > 1 {
            std::thread::scope(|scope| {
                for f in files {
                    scope.spawn(move || drop(f));
                }
            });
        }
    }
}

/// One part's buffers and runs for one output.
struct PartOutput<'o> {
    output: &'o Output,
    file: &'o File,
    /// Rows a group gathers before they are appended as one run.
    cap: usize,
    /// Per taken group (from `output.groups.start`): its rows' count, ids (little-endian
    /// bytes) and each slot's rows.
    bufs: Vec<(usize, Vec<u8>, Vec<Vec<u8>>)>,
    runs: Runs,
    at: u64,
}

impl Pass<'_> {
    /// Runs the pass: every row of a group an output takes goes to that group's runs in the
    /// output's files, each part's rows in input order, the parts' runs in part order. Returns,
    /// per output, its files and, per group of the whole table (`groups.end` at least), its runs.
    pub(super) fn run(&self) -> Result<Vec<(TemporaryFiles, Runs)>> {
        let io = |op, e| Error::Io {
            op,
            path: self.scratch.to_path_buf(),
            source: e,
        };
        let files: Vec<Vec<File>> = self
            .outputs
            .iter()
            .map(|o| {
                o.sizes
                    .iter()
                    .take(self.parts.len())
                    .map(|&size| {
                        let file = tempfile::tempfile_in(self.scratch)
                            .map_err(|e| io("create a temporary file in", e))?;
                        // Writes into allocated blocks skip the filesystem's per-page reservation
                        // (a sixth of a distribution's time on ext4), and a full disk is reported
                        // before the first row is read.
                        allocate(&file, size)
                            .map_err(|e| io("reserve space for a temporary file in", e))?;
                        Ok(file)
                    })
                    .collect::<Result<_>>()
            })
            .collect::<Result<_>>()?;
        let results: Vec<Result<Vec<Runs>>> = std::thread::scope(|scope| {
            let workers: Vec<_> = self
                .parts
                .iter()
                .enumerate()
                .map(|(f, part)| {
                    let files: Vec<&File> = files.iter().map(|of| &of[f]).collect();
                    scope.spawn(move || self.part(f, part.clone(), &files))
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a distributing thread panicked"))
                .collect()
        });
        let mut runs: Vec<Runs> = self
            .outputs
            .iter()
            .map(|o| vec![Vec::new(); o.groups.end])
            .collect();
        for r in results {
            for ((o, of_part), all) in self.outputs.iter().zip(r?).zip(&mut runs) {
                for (g, mut rs) in of_part.into_iter().enumerate() {
                    all[o.groups.start + g].append(&mut rs);
                }
            }
        }
        Ok(files.into_iter().map(TemporaryFiles).zip(runs).collect())
    }

    /// One part's rows into file `f` of each output: per output, per taken group, its runs.
    fn part(&self, f: usize, part: Range<u64>, files: &[&File]) -> Result<Vec<Runs>> {
        let input = self.input;
        let slot_bytes = input.row_bytes.iter().sum::<usize>();
        let budget = DISTRIBUTE_BUFFER_BYTES / self.outputs.len().max(1);
        let mut outs: Vec<PartOutput<'_>> = self
            .outputs
            .iter()
            .zip(files)
            .map(|(output, &file)| {
                let taken = output.groups.len();
                let width = usize::from(output.content.ids()) * 8
                    + usize::from(output.content.slots()) * slot_bytes;
                let cap =
                    ((RUN_BYTES * taken.max(1)).min(budget) / taken.max(1) / width.max(1)).max(16);
                PartOutput {
                    output,
                    file,
                    cap,
                    bufs: vec![(0, Vec::new(), vec![Vec::new(); input.row_bytes.len()]); taken],
                    runs: vec![Vec::new(); taken],
                    at: 0,
                }
            })
            .collect();
        let with_slots = self.outputs.iter().any(|o| o.content.slots());
        let window = (WINDOW_BYTES / (8 + slot_bytes) as u64).max(1);
        let mut ids = Vec::new();
        let mut slots = vec![Vec::new(); input.row_bytes.len()];
        let mut lo = part.start;
        while lo < part.end {
            if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::Mismatch(format!(
                    "the distribution of {:?} was stopped",
                    input.ids.name
                )));
            }
            let hi = (lo + window).min(part.end);
            input.read(lo..hi, &mut ids, with_slots.then_some(slots.as_mut_slice()))?;
            for (r, c) in ids.chunks_exact(8).enumerate() {
                let id = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                let g = (PartitionRule::bucket_of(id) >> self.shift) as usize;
                for out in &mut outs {
                    if !out.output.groups.contains(&g) {
                        continue;
                    }
                    let k = g - out.output.groups.start;
                    let buf = &mut out.bufs[k];
                    buf.0 += 1;
                    if out.output.content.ids() {
                        buf.1.extend_from_slice(c);
                    }
                    if out.output.content.slots() {
                        for ((dst, src), &b) in buf.2.iter_mut().zip(&slots).zip(&input.row_bytes) {
                            dst.extend_from_slice(&src[r * b..(r + 1) * b]);
                        }
                    }
                    if buf.0 >= out.cap {
                        self.flush(f, out, k)?;
                    }
                }
            }
            lo = hi;
        }
        for out in &mut outs {
            for k in 0..out.bufs.len() {
                self.flush(f, out, k)?;
            }
        }
        Ok(outs.into_iter().map(|o| o.runs).collect())
    }

    /// Appends taken group `k`'s gathered rows, as one run, to `out`'s file of part `f`.
    fn flush(&self, f: usize, out: &mut PartOutput<'_>, k: usize) -> Result<()> {
        let buf = &mut out.bufs[k];
        if buf.0 == 0 {
            return Ok(());
        }
        let mut parts = Vec::with_capacity(1 + buf.2.len());
        parts.push(buf.1.as_slice());
        parts.extend(buf.2.iter().map(Vec::as_slice));
        let len = write_all_vectored_at(out.file, &parts, out.at).map_err(|e| Error::Io {
            op: "write a temporary file in",
            path: self.scratch.to_path_buf(),
            source: e,
        })?;
        out.runs[k].push((f, out.at, buf.0 as u64));
        out.at += len;
        buf.0 = 0;
        buf.1.clear();
        buf.2.iter_mut().for_each(Vec::clear);
        Ok(())
    }
}

/// Writes `parts`, back to back, at `at` of `file` (one `pwritev` when the kernel takes them
/// whole), without first copying them into one buffer. Returns the bytes written.
pub(super) fn write_all_vectored_at(
    file: &File,
    parts: &[&[u8]],
    mut at: u64,
) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| libc::iovec {
            iov_base: p.as_ptr() as *mut libc::c_void,
            iov_len: p.len(),
        })
        .collect();
    let mut first = 0;
    while first < iov.len() {
        let count = (iov.len() - first).min(libc::UIO_MAXIOV as usize) as libc::c_int;
        let offset = libc::off_t::try_from(at)
            .map_err(|_| std::io::Error::other("offset past the largest file offset"))?;
        // SAFETY: every iovec points into a live slice of `parts`, which outlives the call.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov[first..].as_ptr(), count, offset) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let mut n = n as usize;
        at += n as u64;
        // Skip what was written: whole iovecs, then the front of a partly written one.
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: `n` is less than this iovec's length, so the pointer stays inside it.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(total as u64)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Parts written at an offset read back as their concatenation there, however many (past
        /// the kernel's limit of iovecs per call) and however long (empty ones included).
        #[test]
        fn vectored_writes_put_the_parts_back_to_back(
            lens in proptest::collection::vec(0usize..40, 0..1500),
            at in 0u64..10_000,
        ) {
            let parts: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
                .collect();
            let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            let file = tempfile::tempfile().unwrap();
            let written = write_all_vectored_at(&file, &views, at).unwrap();
            let whole = parts.concat();
            prop_assert_eq!(written, whole.len() as u64);
            let mut back = vec![0u8; whole.len()];
            file.read_exact_at(&mut back, at).unwrap();
            prop_assert_eq!(back, whole);
        }
    }
}

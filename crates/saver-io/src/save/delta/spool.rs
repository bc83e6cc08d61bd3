//! Rows kept aside in a nameless temporary file until the save writes them: the changed rows
//! and removed ids a delta comparison finds, in (bucket, id bits) order. A spool of at most
//! `MEMORY_BYTES` (256 KiB) stays in memory: a delta has two spools a table, mostly small, and a file
//! costs more to create than they take to hold.
//!
//! Each row is stored whole, id first, then every slot, so a run of rows the save asks for is
//! one read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use saver_core::table::{RowChunk, TableSnapshot};
use saver_core::TableSchema;
use saver_core::{KeyDtype, PartitionRule, SlotSpec, SparseTable};

use crate::error::{io_err, Result};
use crate::load::rows::{core_error as core, handles_of, SlotBuffers};

/// Bytes gathered before they are written.
const WRITE_BUFFER: usize = 4 << 20;

/// Most bytes of a spool kept in memory rather than in a file.
const MEMORY_BYTES: usize = 256 << 10;

/// Rows of a spool the save's planner scans per part.
const PART_ROWS: u64 = 1 << 16;

/// Where a spool's rows are.
enum Stored {
    File(File),
    Memory(Vec<u8>),
}

/// Rows being appended.
pub(crate) struct Spool {
    /// Created when the rows first outgrow the write buffer.
    file: Option<File>,
    dir: PathBuf,
    widths: Vec<usize>,
    buf: Vec<u8>,
    written: u64,
    rows: u64,
}

impl Spool {
    /// An empty spool of rows of `slots`, in memory or in a nameless temporary file in `dir`.
    pub(crate) fn new(dir: &Path, slots: &[SlotSpec]) -> Result<Self> {
        let widths = slots
            .iter()
            .map(|s| s.row_bytes().map(|b| b as usize))
            .collect::<saver_core::Result<_>>()?;
        Ok(Self {
            file: None,
            dir: dir.to_path_buf(),
            widths,
            buf: Vec::new(),
            written: 0,
            rows: 0,
        })
    }

    /// Appends a row: its id and each slot's bytes.
    pub(crate) fn push(&mut self, id: u64, slots: &[&[u8]]) -> Result<()> {
        debug_assert_eq!(slots.len(), self.widths.len());
        self.buf.extend_from_slice(&id.to_le_bytes());
        for s in slots {
            self.buf.extend_from_slice(s);
        }
        self.rows += 1;
        if self.buf.len() >= WRITE_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(
                tempfile::tempfile_in(&self.dir)
                    .map_err(io_err("create a temporary file in", &self.dir))?,
            ),
        };
        file.write_all_at(&self.buf, self.written)
            .map_err(io_err("write a temporary file in", &self.dir))?;
        self.written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    /// The rows as table `name`.
    pub(crate) fn finish(
        mut self,
        name: &str,
        key_dtype: KeyDtype,
        slots: &[SlotSpec],
        point_in_time: bool,
    ) -> Result<SpoolTable> {
        let stored = if self.file.is_none() && self.buf.len() <= MEMORY_BYTES {
            Stored::Memory(std::mem::take(&mut self.buf))
        } else {
            self.flush()?;
            Stored::File(self.file.take().expect("a flush creates the file"))
        };
        let width = 8 + self.widths.iter().sum::<usize>();
        Ok(SpoolTable {
            schema: TableSchema::new(name, key_dtype, slots.to_vec()),
            widths: self.widths,
            width,
            stored,
            dir: self.dir,
            rows: self.rows,
            point_in_time,
        })
    }
}

/// Spooled rows as a [`SparseTable`]; row handles are row numbers.
pub(crate) struct SpoolTable {
    schema: TableSchema,
    widths: Vec<usize>,
    width: usize,
    stored: Stored,
    dir: PathBuf,
    rows: u64,
    point_in_time: bool,
}

impl SpoolTable {
    fn read(&self, rows: std::ops::Range<u64>, buf: &mut Vec<u8>) -> Result<()> {
        buf.resize((rows.end - rows.start) as usize * self.width, 0);
        let at = rows.start * self.width as u64;
        match &self.stored {
            Stored::File(f) => f
                .read_exact_at(buf, at)
                .map_err(io_err("read a temporary file in", &self.dir)),
            Stored::Memory(m) => {
                let n = buf.len();
                let rows = usize::try_from(at)
                    .ok()
                    .and_then(|at| m.get(at..at.checked_add(n)?))
                    .ok_or_else(|| past_the_end(&self.schema.name))?;
                buf.copy_from_slice(rows);
                Ok(())
            }
        }
    }

    /// Copies the rows of `buf` (whole rows from `first`) into `out` from row `at` on.
    fn scatter(&self, buf: &[u8], out: &mut [&mut [u8]], at: usize) {
        for (r, row) in buf.chunks_exact(self.width).enumerate() {
            let mut o = 8;
            for (k, &w) in self.widths.iter().enumerate() {
                if !out[k].is_empty() {
                    out[k][(at + r) * w..(at + r + 1) * w].copy_from_slice(&row[o..o + w]);
                }
                o += w;
            }
        }
    }

    fn id_at(&self, row: u64) -> Result<u64> {
        let at = row * self.width as u64;
        let mut b = [0u8; 8];
        match &self.stored {
            Stored::File(f) => f
                .read_exact_at(&mut b, at)
                .map_err(io_err("read a temporary file in", &self.dir))?,
            Stored::Memory(m) => b.copy_from_slice(
                usize::try_from(at)
                    .ok()
                    .and_then(|at| m.get(at..at.checked_add(8)?))
                    .ok_or_else(|| past_the_end(&self.schema.name))?,
            ),
        }
        Ok(u64::from_le_bytes(b))
    }

    /// The row of `id`: a binary search, the rows being in (bucket, id bits) order.
    fn find(&self, id: u64) -> Result<Option<u64>> {
        let key = (PartitionRule::bucket_of(id), id);
        let (mut lo, mut hi) = (0, self.rows);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let other = self.id_at(mid)?;
            match (PartitionRule::bucket_of(other), other).cmp(&key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(Some(mid)),
            }
        }
        Ok(None)
    }
}

/// A read past a spool's rows: a caller's bug, reported rather than a panic.
fn past_the_end(table: &str) -> crate::error::Error {
    crate::error::Error::Mismatch(format!("a read past the spooled rows of table {table:?}"))
}

impl SparseTable for SpoolTable {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }
    fn len(&self) -> usize {
        usize::try_from(self.rows).unwrap_or(usize::MAX)
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(SpoolSnapshot(self)))
    }
    /// The rows were copied when the delta was found: as point-in-time as the table they came
    /// from.
    fn point_in_time(&self) -> bool {
        self.point_in_time
    }
}

struct SpoolSnapshot<'a>(&'a SpoolTable);

impl TableSnapshot for SpoolSnapshot<'_> {
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        saver_core::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.0.rows.div_ceil(PART_ROWS).max(1) as usize
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        let t = self.0;
        let start = part as u64 * PART_ROWS;
        let end = (start + PART_ROWS).min(t.rows);
        let mut buf = Vec::new();
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        let mut values = SlotBuffers::new(t.widths.iter().copied());
        let mut at = start;
        while at < end {
            let stop = (at + max_rows.max(1) as u64).min(end);
            t.read(at..stop, &mut buf)
                .map_err(|e| core(&t.schema.name, e))?;
            ids.clear();
            ids.extend(
                buf.chunks_exact(t.width)
                    .map(|r| u64::from_le_bytes(r[..8].try_into().expect("8 bytes"))),
            );
            handles.clear();
            handles.extend(at..stop);
            let slices = values.fill(ids.len(), with_values, |outs| {
                t.scatter(&buf, outs, 0);
                Ok::<_, saver_core::Error>(())
            })?;
            visit(RowChunk {
                ids: &ids,
                handles: &handles,
                slots: &slices,
            })?;
            at = stop;
        }
        Ok(())
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver_core::Result<()> {
        let t = self.0;
        let handles = handles_of(&t.schema, "the delta", ids, |id| t.find(id))?;
        // SAFETY: the handles are this table's row numbers of these ids.
        unsafe { self.read_rows_by_handle(ids, &handles, out) }
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver_core::Result<()> {
        let t = self.0;
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        let mut buf = Vec::new();
        let mut i = 0;
        while i < handles.len() {
            let mut n = 1;
            while i + n < handles.len() && handles[i + n] == handles[i] + n as u64 {
                n += 1;
            }
            if handles[i] + n as u64 > t.rows {
                return Err(saver_core::Error::Table {
                    table: t.schema.name.clone(),
                    message: format!("row handle {} is not this table's", handles[i]),
                });
            }
            t.read(handles[i]..handles[i] + n as u64, &mut buf)
                .map_err(|e| core(&t.schema.name, e))?;
            t.scatter(&buf, out, i);
            i += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use saver_core::Dtype;

    use super::*;

    /// Spools of `rows` rows of a 24-byte slot, in bucket order, and what they hold.
    fn spooled(dir: &Path, rows: u64) -> (SpoolTable, Vec<(u64, Vec<u8>)>) {
        let slots = vec![SlotSpec::new("e", Dtype::F32, vec![6])];
        let mut expected: Vec<(u64, Vec<u8>)> = (0..rows)
            .map(|k| {
                let id = saver_core::partition::fmix64(k + 1);
                (id, (0..24).map(|b| (id as u8).wrapping_add(b)).collect())
            })
            .collect();
        expected.sort_by_key(|(id, _)| (PartitionRule::bucket_of(*id), *id));
        let mut spool = Spool::new(dir, &slots).unwrap();
        for (id, row) in &expected {
            spool.push(*id, &[row]).unwrap();
        }
        let table = spool.finish("t", KeyDtype::U64, &slots, true).unwrap();
        (table, expected)
    }

    /// A spool small enough to stay in memory and one that goes to a file read back the same:
    /// by scan, by handle, and by id.
    #[test]
    fn spools_in_memory_and_in_files_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let per_row = 8 + 24;
        for rows in [0, 1, 100, (MEMORY_BYTES / per_row) as u64, 200_000] {
            let (table, expected) = spooled(dir.path(), rows);
            let in_memory = matches!(table.stored, Stored::Memory(_));
            assert_eq!(
                in_memory,
                rows as usize * per_row <= MEMORY_BYTES,
                "{rows} rows"
            );
            let snap = table.snapshot().unwrap();
            let mut seen = Vec::new();
            snap.scan(1000, true, &mut |c| {
                for (k, &id) in c.ids.iter().enumerate() {
                    seen.push((id, c.slots[0][k * 24..(k + 1) * 24].to_vec()));
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, expected, "{rows} rows, scanned");
            if let Some(last) = expected.last() {
                let mut out = vec![0u8; 24];
                snap.read_rows(&[last.0], &mut [&mut out[..]]).unwrap();
                assert_eq!(out, last.1, "{rows} rows, read by id");
                // SAFETY: a handle past the rows is refused, not read.
                let past =
                    unsafe { snap.read_rows_by_handle(&[last.0], &[rows], &mut [&mut out[..]]) };
                assert!(past.is_err(), "{rows} rows: a handle past the end");
            }
        }
    }
}

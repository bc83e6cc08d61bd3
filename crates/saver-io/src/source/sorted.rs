//! A table's rows in ascending id order, in bounded memory: an external merge sort.
//!
//! A checkpoint stores rows by (bucket, id), and the bucket is a hash: rows by id are spread over
//! the whole table. So the table is read front to back in *runs* of at most [`RUN_BYTES`], each
//! sorted by id in memory and written to a nameless temporary file; then the runs are merged,
//! each read through a buffer of its share of [`MERGE_BYTES`]. A table of at most
//! [`RUN_BYTES`] is one run, sorted in memory, with no temporary file.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::slice::ParallelSliceMut;

use std::sync::mpsc::sync_channel;

use crate::error::{io_err, Result};
use crate::load::rows::{BucketRows, VisitRows};
use crate::storage::write_behind::WriteBehind;

/// Most bytes of rows sorted in memory at once.
pub(crate) const RUN_BYTES: usize = 32 << 20;

/// Bytes of read buffers the merge holds, over all runs (each at least one row).
pub(crate) const MERGE_BYTES: usize = 32 << 20;

/// Rows handed to the visitor at a time, at most.
const BATCH_ROWS: usize = 1 << 14;

/// Visits every row of `t` in ascending id order (as its key dtype orders ids), at most a few
/// thousand rows at a time: ids, and each kept slot's rows. Runs of at most `run_bytes` of rows
/// ([`RUN_BYTES`] is a good size) go to a nameless temporary file in `scratch`.
pub(crate) fn visit_by_id(
    t: &dyn BucketRows,
    scratch: &Path,
    run_bytes: usize,
    visit: &mut VisitRows<'_>,
) -> Result<()> {
    let widths: Vec<usize> = t.row_bytes().iter().map(|&b| b as usize).collect();
    let row = 8 + widths.iter().sum::<usize>();
    let run_rows = (run_bytes / row).clamp(1, u32::MAX as usize);
    let key = t.key_dtype();
    if t.rows() <= run_rows as u64 {
        // One run: sorted and handed over from memory.
        let mut run = RunBuffer::new(&widths);
        read_runs(t, usize::MAX, &widths, &mut |run_rows: &mut RunBuffer| {
            std::mem::swap(&mut run, run_rows);
            Ok(())
        })?;
        return run.visit_in(&run.order(key), &widths, visit);
    }
    let file =
        tempfile::tempfile_in(scratch).map_err(io_err("create a temporary file in", scratch))?;
    let runs = std::thread::scope(|scope| {
        let behind = WriteBehind::new(scope);
        // Two buffers of sorted rows: one filled here while the other is written.
        let (give_back, recycled) = sync_channel::<Vec<u8>>(2);
        for _ in 0..2 {
            let _ = give_back.send(Vec::new());
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut at = 0u64;
        let file = &file;
        let produced = read_runs(t, run_rows, &widths, &mut |run: &mut RunBuffer| {
            let mut sorted = recycled.recv().unwrap_or_default();
            sorted.clear();
            for (_, i) in run.order(key) {
                let i = i as usize;
                sorted.extend_from_slice(&run.ids[i].to_le_bytes());
                for (s, &w) in run.slots.iter().zip(&widths) {
                    sorted.extend_from_slice(&s[i * w..(i + 1) * w]);
                }
            }
            runs.push((at, run.ids.len() as u64));
            let offset = at;
            at += sorted.len() as u64;
            let back = give_back.clone();
            behind.push(Box::new(move || {
                file.write_all_at(&sorted, offset)
                    .map_err(io_err("write a temporary file in", scratch))?;
                let _ = back.send(sorted);
                Ok(())
            }))
        });
        behind.finish_after(produced).map(|()| runs)
    })?;
    merge(&file, &runs, row, &widths, key, scratch, visit)
}

/// Reads `t` front to back into runs of at most `run_rows` rows, handing each full run (and the
/// last) to `full`, which may take its contents.
fn read_runs(
    t: &dyn BucketRows,
    run_rows: usize,
    widths: &[usize],
    full: &mut dyn FnMut(&mut RunBuffer) -> Result<()>,
) -> Result<()> {
    let mut run = RunBuffer::new(widths);
    t.visit_in_bucket_order(run_rows.clamp(1, 1 << 16), &mut |ids, slots| {
        let mut i = 0;
        while i < ids.len() {
            let n = (run_rows - run.ids.len()).min(ids.len() - i);
            run.ids.extend_from_slice(&ids[i..i + n]);
            for ((buf, s), &w) in run.slots.iter_mut().zip(slots).zip(widths) {
                buf.extend_from_slice(&s[i * w..(i + n) * w]);
            }
            i += n;
            if run.ids.len() >= run_rows {
                full(&mut run)?;
                run.clear();
            }
        }
        Ok(())
    })?;
    if !run.ids.is_empty() {
        full(&mut run)?;
    }
    Ok(())
}

/// Rows being gathered into a run, column by column.
struct RunBuffer {
    ids: Vec<u64>,
    slots: Vec<Vec<u8>>,
}

impl RunBuffer {
    fn new(widths: &[usize]) -> Self {
        Self {
            ids: Vec::new(),
            slots: vec![Vec::new(); widths.len()],
        }
    }

    /// Each row's sort key and number, sorted.
    fn order(&self, key: saver_core::KeyDtype) -> Vec<(u64, u32)> {
        let mut order: Vec<(u64, u32)> = self
            .ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (key.order_key(id), i as u32))
            .collect();
        order.par_sort_unstable();
        order
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.slots.iter_mut().for_each(Vec::clear);
    }

    /// Hands the rows over in `order`, in batches.
    fn visit_in(
        &self,
        order: &[(u64, u32)],
        widths: &[usize],
        visit: &mut VisitRows<'_>,
    ) -> Result<()> {
        let mut ids = Vec::with_capacity(BATCH_ROWS);
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
        for chunk in order.chunks(BATCH_ROWS) {
            ids.clear();
            bufs.iter_mut().for_each(Vec::clear);
            for &(_, i) in chunk {
                let i = i as usize;
                ids.push(self.ids[i]);
                for ((b, s), &w) in bufs.iter_mut().zip(&self.slots).zip(widths) {
                    b.extend_from_slice(&s[i * w..(i + 1) * w]);
                }
            }
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            visit(&ids, &views)?;
        }
        Ok(())
    }
}

/// One run being merged: its place in the file, rows left, and a buffer of its next rows.
struct RunReader {
    next: u64,
    left: u64,
    buf: Vec<u8>,
    pos: usize,
}

/// Merges sorted runs of rows (`row` bytes: id, then each slot) from `file`.
fn merge(
    file: &File,
    runs: &[(u64, u64)],
    row: usize,
    widths: &[usize],
    key: saver_core::KeyDtype,
    scratch: &Path,
    visit: &mut VisitRows<'_>,
) -> Result<()> {
    let per_run = ((MERGE_BYTES / runs.len().max(1)) / row).max(1) as u64;
    let mut readers: Vec<RunReader> = runs
        .iter()
        .map(|&(at, rows)| RunReader {
            next: at,
            left: rows,
            buf: Vec::new(),
            pos: 0,
        })
        .collect();
    let refill = |r: &mut RunReader| -> Result<()> {
        let n = per_run.min(r.left);
        r.buf.resize(n as usize * row, 0);
        file.read_exact_at(&mut r.buf, r.next)
            .map_err(io_err("read a temporary file in", scratch))?;
        r.next += n * row as u64;
        r.left -= n;
        r.pos = 0;
        Ok(())
    };
    let id_at =
        |r: &RunReader| u64::from_le_bytes(r.buf[r.pos..r.pos + 8].try_into().expect("8 bytes"));
    let mut heap = BinaryHeap::with_capacity(readers.len());
    for (k, r) in readers.iter_mut().enumerate() {
        refill(r)?;
        if !r.buf.is_empty() {
            heap.push(Reverse((key.order_key(id_at(r)), k)));
        }
    }
    let mut ids = Vec::with_capacity(BATCH_ROWS);
    let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
    while let Some(Reverse((_, k))) = heap.pop() {
        let r = &mut readers[k];
        ids.push(id_at(r));
        let mut off = r.pos + 8;
        for (b, &w) in bufs.iter_mut().zip(widths) {
            b.extend_from_slice(&r.buf[off..off + w]);
            off += w;
        }
        r.pos += row;
        if r.pos == r.buf.len() && r.left > 0 {
            refill(r)?;
        }
        if r.pos < r.buf.len() {
            heap.push(Reverse((key.order_key(id_at(r)), k)));
        }
        if ids.len() == BATCH_ROWS {
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            visit(&ids, &views)?;
            ids.clear();
            bufs.iter_mut().for_each(Vec::clear);
        }
    }
    if !ids.is_empty() {
        let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        visit(&ids, &views)?;
    }
    Ok(())
}

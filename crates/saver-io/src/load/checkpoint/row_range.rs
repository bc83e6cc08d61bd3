//! Loads of row-range tables ([`saver_core::row_range`]): any range of rows (and of each slot's
//! columns) read from the chunks it overlaps, straight into the caller's buffers, each byte
//! checked against its chunk's CRC32s.
//!
//! A chunk's bytes are row-major, so a range of whole chunk rows is one read; a range of some of
//! a chunk's columns is one read per row. What a read leaves of a checksummed block is read
//! beside it, to be hashed (`crate::load::pieces`): a load of a few rows of a large chunk reads
//! up to a block more at each end, one of some columns reads the rest of every block it touches.

use std::ops::Range;

use rayon::prelude::*;

use saver_core::manifest::{RowSlotManifest, RowTableManifest, TensorRef};

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::load::link::Link;
use crate::load::pieces;

/// One slot a row-range load fills: columns `cols` of the rows asked for (`None`: all of the
/// slot's columns; a slot of one value per row has one), into `out`, rows × columns values of
/// the slot's dtype, row-major, little-endian.
#[derive(Debug)]
pub struct RowsInto<'b> {
    /// The slot.
    pub slot: String,
    /// Its columns wanted.
    pub cols: Option<Range<u64>>,
    /// Where they go.
    pub out: &'b mut [u8],
}

impl<'b> RowsInto<'b> {
    /// Every column of `slot` into `out`.
    pub fn new(slot: &str, out: &'b mut [u8]) -> Self {
        Self {
            slot: slot.to_string(),
            cols: None,
            out,
        }
    }

    /// Only columns `cols` of the slot.
    pub fn columns(mut self, cols: Range<u64>) -> Self {
        self.cols = Some(cols);
        self
    }
}

/// What a row-range load read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowsLoaded {
    /// Bytes the caller asked for.
    pub bytes_wanted: u64,
    /// Bytes read from storage: those asked for, plus what the checks of partly read blocks
    /// took beside them.
    pub bytes_read: u64,
    /// Chunks read from.
    pub chunks: u64,
}

impl Checkpoint {
    /// The row-range table `name`, as the checkpoint holds it: rows, slots (dtype, shape) and
    /// chunks. `None` if it holds none of that name.
    pub fn row_table(&self, name: &str) -> Option<&RowTableManifest> {
        self.manifest().row_tables.iter().find(|t| t.name == name)
    }

    /// An error naming `what` when the checkpoint holds row-range tables: for the operations
    /// that do not carry them yet (a reshard, a compaction, a save from it, a delta of it, `saver
    /// load`, a digest of version 1), which would otherwise give or write the checkpoint without
    /// them.
    pub fn refuse_row_tables(&self, what: &str) -> Result<()> {
        let names: Vec<&str> = self
            .manifest()
            .row_tables
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidOption {
            option: "checkpoint",
            why: format!(
                "{} holds row-range tables {names:?}, which {what} does not carry yet; read them \
                 with Checkpoint::load_rows",
                self.dirs()[0].display()
            ),
        })
    }

    /// Reads rows `rows` of row-range table `table` into the caller's buffers, one per slot
    /// wanted ([`RowsInto`]): only the bytes of the chunks the range overlaps, whatever split
    /// the checkpoint was saved with, each checked against its chunk's CRC32s.
    ///
    /// ```
    /// use saver_core::{RowRangeChunk, SaveInput};
    /// use saver_io::{save, Checkpoint, RowsInto, SaveOptions};
    ///
    /// # let dir = tempfile::tempdir()?;
    /// // Saved by two workers' chunks: rows 0..6 and 6..10 of a table of 10 rows of 4 values.
    /// let a: Vec<f32> = (0..24).map(|v| v as f32).collect();
    /// let b: Vec<f32> = (24..40).map(|v| v as f32).collect();
    /// let input = SaveInput::new()
    ///     .row_chunk(RowRangeChunk::from_f32("item", "weight", vec![6, 4], &a)?.at(&[0, 0], &[10, 4])?)
    ///     .row_chunk(RowRangeChunk::from_f32("item", "weight", vec![4, 4], &b)?.at(&[6, 0], &[10, 4])?);
    /// save(dir.path(), input, &SaveOptions::default())?;
    /// // Rows 5..7, columns 1..3, straight into a buffer of ours.
    /// let mut out = vec![0f32; 2 * 2];
    /// let ck = Checkpoint::open(dir.path())?;
    /// ck.load_rows("item", 5..7, &mut [
    ///     RowsInto::new("weight", bytemuck::cast_slice_mut(&mut out)).columns(1..3),
    /// ])?;
    /// assert_eq!(out, [21.0, 22.0, 25.0, 26.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load_rows(
        &self,
        table: &str,
        rows: Range<u64>,
        into: &mut [RowsInto<'_>],
    ) -> Result<RowsLoaded> {
        // Filled again from the start if the checkpoint is replaced meanwhile.
        let into = std::cell::RefCell::new(into);
        self.on_latest(|c| c.load_rows_once(table, rows.clone(), &mut into.borrow_mut()))
    }

    fn load_rows_once(
        &self,
        table: &str,
        rows: Range<u64>,
        into: &mut [RowsInto<'_>],
    ) -> Result<RowsLoaded> {
        let link = self.newest();
        let Some(t) = self.row_table(table) else {
            let held: Vec<&str> = self
                .manifest()
                .row_tables
                .iter()
                .map(|t| t.name.as_str())
                .collect();
            return Err(Error::InvalidOption {
                option: "table",
                why: format!(
                    "{} holds no row-range table {table:?} (it holds {held:?})",
                    self.dirs()[0].display()
                ),
            });
        };
        if rows.start > rows.end || rows.end > t.rows {
            return Err(Error::InvalidOption {
                option: "rows",
                why: format!(
                    "rows {rows:?} are not within row-range table {table:?}'s {} rows",
                    t.rows
                ),
            });
        }
        let slots = into
            .iter()
            .map(|target| {
                t.slots
                    .iter()
                    .find(|s| s.name == target.slot)
                    .ok_or_else(|| Error::InvalidOption {
                        option: "slot",
                        why: format!(
                            "row-range table {table:?} has no slot {:?} (it has {:?})",
                            target.slot,
                            t.slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>()
                        ),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        // Each target is its own buffer: they are filled at once, a slot's chunks in turn.
        let parts = into
            .par_iter_mut()
            .zip(slots)
            .map(|(target, slot)| fill_slot(link, table, slot, &rows, target))
            .collect::<Result<Vec<_>>>()?;
        Ok(parts
            .into_iter()
            .fold(RowsLoaded::default(), |a, b| RowsLoaded {
                bytes_wanted: a.bytes_wanted + b.bytes_wanted,
                bytes_read: a.bytes_read + b.bytes_read,
                chunks: a.chunks + b.chunks,
            }))
    }
}

/// Fills one target from the chunks of `slot` that rows `rows` overlap.
fn fill_slot(
    link: &Link,
    table: &str,
    slot: &RowSlotManifest,
    rows: &Range<u64>,
    target: &mut RowsInto<'_>,
) -> Result<RowsLoaded> {
    let mut loaded = RowsLoaded::default();
    let loaded = &mut loaded;
    let width = slot.shape.get(1).copied().unwrap_or(1);
    let cols = target.cols.clone().unwrap_or(0..width);
    let invalid = |why: String| Error::InvalidOption {
        option: "into",
        why: format!("row-range table {table:?} slot {:?}: {why}", slot.name),
    };
    if cols.start > cols.end || cols.end > width {
        return Err(invalid(format!(
            "columns {cols:?} are not within its {width} columns"
        )));
    }
    let el = slot
        .dtype
        .byte_len(1)
        .filter(|_| slot.dtype.bits().is_multiple_of(8))
        .ok_or_else(|| invalid(format!("{} has no whole bytes per value", slot.dtype)))?;
    let out_row = (cols.end - cols.start) * el;
    let want = (rows.end - rows.start)
        .checked_mul(out_row)
        .ok_or_else(|| invalid("the range is too large".into()))?;
    if target.out.len() as u64 != want {
        return Err(invalid(format!(
            "the buffer has {} bytes; {} rows of columns {cols:?} of {} take {want}",
            target.out.len(),
            rows.end - rows.start,
            slot.dtype
        )));
    }
    loaded.bytes_wanted += want;
    for chunk in &slot.chunks {
        let t = &chunk.tensor;
        let c_rows = chunk.offset[0]..chunk.offset[0] + t.shape[0];
        let (c0, c_width) = match (chunk.offset.get(1), t.shape.get(1)) {
            (Some(&o), Some(&w)) => (o, w),
            _ => (0, 1),
        };
        let r = rows.start.max(c_rows.start)..rows.end.min(c_rows.end);
        let x = cols.start.max(c0)..cols.end.min(c0 + c_width);
        if r.is_empty() || x.is_empty() {
            continue;
        }
        loaded.chunks += 1;
        // (offset in the chunk's tensor, offset in `out`, length): whole rows of both at once.
        let whole_rows = x.start == c0 && x.end == c0 + c_width && x == cols;
        let pieces_of: Vec<(u64, u64, u64)> = if whole_rows {
            vec![(
                (r.start - c_rows.start) * c_width * el,
                (r.start - rows.start) * out_row,
                (r.end - r.start) * out_row,
            )]
        } else {
            r.clone()
                .map(|row| {
                    (
                        ((row - c_rows.start) * c_width + (x.start - c0)) * el,
                        (row - rows.start) * out_row + (x.start - cols.start) * el,
                        (x.end - x.start) * el,
                    )
                })
                .collect()
        };
        read_checked(link, table, t, &pieces_of, target.out, loaded)?;
    }
    Ok(std::mem::take(loaded))
}

/// Reads `spans` (tensor offset, `out` offset, length; increasing and disjoint in `out`) of `t`
/// into `out` in one batch, then checks every block they touch.
fn read_checked(
    link: &Link,
    table: &str,
    t: &TensorRef,
    spans: &[(u64, u64, u64)],
    out: &mut [u8],
    loaded: &mut RowsLoaded,
) -> Result<()> {
    let mut reads: Vec<(&TensorRef, u64, &mut [u8])> = Vec::with_capacity(spans.len());
    let mut rest = out;
    let mut at = 0u64;
    for &(from, to, len) in spans {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((to - at) as usize);
        let (piece, tail) = tail.split_at_mut(len as usize);
        reads.push((t, from, piece));
        rest = tail;
        at = to + len;
    }
    link.read_tensor_ranges(&mut reads)?;
    let mut ps = Vec::new();
    for (_, from, buf) in &reads {
        pieces::push(t, *from, buf, &mut ps);
    }
    let extra = pieces::check(link, t, ps)?.ok_or_else(|| Error::Corrupt {
        file: t.file.clone(),
        what: format!(
            "tensor {:?} (a chunk of row-range table {table:?}) fails its CRC32 check",
            t.name
        ),
    })?;
    loaded.bytes_read += spans.iter().map(|s| s.2).sum::<u64>() + extra;
    Ok(())
}

//! Loads of row-range tables ([`saver_core::row_range`]): any range of rows (and of each slot's
//! columns) read from the chunks it overlaps, straight into the caller's buffers, each byte
//! checked against its chunk's CRC32s.
//!
//! A chunk's bytes are row-major, so a range of whole chunk rows is one read; a range of some of
//! a chunk's columns is one read per row. What a read leaves of a checksummed block is read
//! beside it, to be hashed (`crate::load::pieces`): a load of a few rows of a large chunk reads
//! up to a block more at each end, one of some columns reads the rest of every block it touches.
//!
//! In a chain, a delta's slot holds chunks and patches (the rows of a rectangle changed since its
//! parent). A range that overlaps a patch is read from the parent first, then the patch's
//! changed rows in the range are put over it: the links the range needs are read oldest first.
//! A patch's row numbers are read whole, its values only for the rows in the range.

use std::ops::Range;

use rayon::prelude::*;

use saver_core::manifest::{RowPatchManifest, RowSlotManifest, RowTableManifest, TensorRef};

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

impl std::ops::AddAssign for RowsLoaded {
    /// Adds another load's figures: those of several loads together.
    fn add_assign(&mut self, other: Self) {
        self.bytes_wanted += other.bytes_wanted;
        self.bytes_read += other.bytes_read;
        self.chunks += other.chunks;
    }
}

/// One row-range table's rows as a request's whole row-range tables (`LoadRequest::row_tables`)
/// read them, into memory of their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedRowTable {
    /// The table's name.
    pub name: String,
    /// The rows read.
    pub rows: Range<u64>,
    /// Its slots, by name: each the values of those rows, all columns.
    pub slots: Vec<LoadedRowSlot>,
}

/// One slot of a [`LoadedRowTable`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedRowSlot {
    /// The slot's name.
    pub name: String,
    /// Its dtype.
    pub dtype: saver_core::Dtype,
    /// The whole slot's shape: `[rows]` or `[rows, cols]`.
    pub shape: Vec<u64>,
    /// The rows read, row-major, little-endian.
    pub values: Vec<u8>,
}

impl Checkpoint {
    /// Every row-range table's rows of `shard` ([`saver_core::Shard::rows_of`]), each slot whole
    /// into memory of its own: a request's `LoadRequest::row_tables`.
    pub(crate) fn load_row_tables_once(
        &self,
        shard: saver_core::Shard,
    ) -> Result<(Vec<LoadedRowTable>, RowsLoaded)> {
        let mut tables = Vec::new();
        let mut total = RowsLoaded::default();
        for t in &self.manifest().row_tables {
            let rows = shard.rows_of(t.rows);
            let mut slots: Vec<LoadedRowSlot> = t
                .slots
                .iter()
                .map(|s| {
                    let width = s.shape.get(1).copied().unwrap_or(1);
                    let row = s.dtype.byte_len(width).unwrap_or(0);
                    LoadedRowSlot {
                        name: s.name.clone(),
                        dtype: s.dtype,
                        shape: s.shape.clone(),
                        values: vec![0u8; ((rows.end - rows.start) * row) as usize],
                    }
                })
                .collect();
            let mut into: Vec<RowsInto<'_>> = slots
                .iter_mut()
                .map(|s| RowsInto::new(&s.name, &mut s.values))
                .collect();
            total += self.load_rows_once(&t.name, rows.clone(), &mut into)?;
            tables.push(LoadedRowTable {
                name: t.name.clone(),
                rows,
                slots,
            });
        }
        Ok((tables, total))
    }

    /// The checks of a request's `LoadRequest::into_table` target that need no data: the
    /// checkpoint holds a row-range table of its name and rows, and each of its slots of the same
    /// dtype and row shape.
    pub(crate) fn check_into_table(&self, table: &saver_core::RowRangeTable) -> Result<()> {
        let held = self
            .row_table(table.name())
            .ok_or_else(|| Error::InvalidOption {
                option: "table",
                why: format!(
                    "{} holds no row-range table {:?}",
                    self.dirs()[0].display(),
                    table.name()
                ),
            })?;
        if held.rows != table.table_rows() {
            return Err(Error::InvalidOption {
                option: "table",
                why: format!(
                    "row-range table {:?} has {} rows in the checkpoint, {} in the table given",
                    table.name(),
                    held.rows,
                    table.table_rows()
                ),
            });
        }
        for spec in table.slots() {
            let saved = held.slots.iter().find(|s| s.name == spec.name);
            if !saved.is_some_and(|s| s.dtype == spec.dtype && s.shape[1..] == spec.shape[..]) {
                return Err(Error::InvalidOption {
                    option: "table",
                    why: format!(
                        "row-range table {:?} slot {:?} of {} rows of {:?} is not in the \
                         checkpoint so",
                        table.name(),
                        spec.name,
                        spec.dtype,
                        spec.shape
                    ),
                });
            }
        }
        Ok(())
    }

    /// Fills a trainer's row-range table, checked by [`Self::check_into_table`], from this
    /// opening.
    pub(crate) fn load_into_table_once(
        &self,
        table: &saver_core::RowRangeTable,
    ) -> Result<RowsLoaded> {
        let mut total = RowsLoaded::default();
        let mut failed = None;
        let filled = table.fill(|spec, rows, out| {
            // The load's own error (corrupt, not found, ...) is returned whole, below.
            match self.load_rows_once(table.name(), rows, &mut [RowsInto::new(&spec.name, out)]) {
                Ok(loaded) => {
                    total += loaded;
                    Ok(())
                }
                Err(e) => {
                    failed = Some(e);
                    Err(saver_core::Error::InvalidOption {
                        option: "checkpoint",
                        why: "the load failed".into(),
                    })
                }
            }
        });
        match (failed, filled) {
            (Some(e), _) => Err(e),
            (None, Err(e)) => Err(e.into()),
            (None, Ok(())) => Ok(total),
        }
    }

    /// The row-range table `name`, as the checkpoint holds it: rows, slots (dtype, shape) and
    /// chunks. `None` if it holds none of that name.
    pub fn row_table(&self, name: &str) -> Option<&RowTableManifest> {
        self.manifest().row_tables.iter().find(|t| t.name == name)
    }

    /// An error naming `what` when the checkpoint holds row-range tables: for what does not
    /// carry them (a digest of version 1, which holds the model in memory as hashed tables), and
    /// would otherwise give the checkpoint without them.
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

    /// [`Self::load_rows`] of this opening only: an error, not a load of another save, where
    /// the checkpoint was replaced meanwhile. For a reader of many ranges that must all come from
    /// one save (a reshard's), and retries the whole.
    pub(crate) fn load_rows_once(
        &self,
        table: &str,
        rows: Range<u64>,
        into: &mut [RowsInto<'_>],
    ) -> Result<RowsLoaded> {
        let slots = self.check_rows(table, &rows, into)?;
        self.fill_checked_rows(table, &rows, into, &slots)
    }

    /// Fills `into`, rows `rows` of `table`, whose targets [`Self::check_rows`] passed and
    /// found `slots` for.
    pub(crate) fn fill_checked_rows(
        &self,
        table: &str,
        rows: &Range<u64>,
        into: &mut [RowsInto<'_>],
        slots: &[&RowSlotManifest],
    ) -> Result<RowsLoaded> {
        // Each target is its own buffer: they are filled at once, a slot's chunks in turn.
        let parts = into
            .par_iter_mut()
            .zip(slots)
            .map(|(target, slot)| self.fill_slot(table, slot, rows, target))
            .collect::<Result<Vec<_>>>()?;
        Ok(parts
            .into_iter()
            .fold(RowsLoaded::default(), |mut all, part| {
                all += part;
                all
            }))
    }

    /// The checks of a load of rows `rows` of `table` into `into` that need no data: the table,
    /// the rows, each target's slot, columns and buffer size. Returns each target's slot.
    pub(crate) fn check_rows(
        &self,
        table: &str,
        rows: &Range<u64>,
        into: &[RowsInto<'_>],
    ) -> Result<Vec<&RowSlotManifest>> {
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
        into.iter()
            .map(|target| {
                let slot = t
                    .slots
                    .iter()
                    .find(|s| s.name == target.slot)
                    .ok_or_else(|| Error::InvalidOption {
                        option: "slot",
                        why: format!(
                            "row-range table {table:?} has no slot {:?} (it has {:?})",
                            target.slot,
                            t.slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>()
                        ),
                    })?;
                target_shape(table, slot, rows, target)?;
                Ok(slot)
            })
            .collect()
    }

    /// Fills one target: from the chunks of `slot` (the newest link's) that rows `rows`
    /// overlap and, where it holds patches there, from its parent's first.
    fn fill_slot(
        &self,
        table: &str,
        slot: &RowSlotManifest,
        rows: &Range<u64>,
        target: &mut RowsInto<'_>,
    ) -> Result<RowsLoaded> {
        let TargetShape {
            cols,
            el,
            out_row,
            want,
        } = target_shape(table, slot, rows, target)?;
        // The links the range needs, newest first: a link's patches there need its parent.
        let mut needed: Vec<(&Link, &RowSlotManifest)> = Vec::new();
        for (i, link) in self.links.iter().enumerate() {
            let s = if i == 0 {
                slot
            } else {
                match parent_slot(link.manifest(), table, slot) {
                    Some(s) => s,
                    None => {
                        return Err(Error::Chain {
                            link: self.dirs[i].display().to_string(),
                            message: parent_lacks(table, slot),
                        })
                    }
                }
            };
            needed.push((link, s));
            let patched = s
                .patches
                .iter()
                .any(|p| !overlap(&p.offset, &p.shape, rows, &cols).0.is_empty());
            if !patched {
                break;
            }
            if i + 1 == self.links.len() {
                return Err(Error::Chain {
                    link: self.dirs[i].display().to_string(),
                    message: format!(
                        "row-range table {table:?} slot {:?} holds changed rows of a parent, but \
                         the chain ends here",
                        slot.name
                    ),
                });
            }
        }
        let mut loaded = RowsLoaded {
            bytes_wanted: want,
            ..RowsLoaded::default()
        };
        let at = Target {
            rows,
            cols: &cols,
            el,
            out_row,
        };
        for (link, s) in needed.into_iter().rev() {
            fill_from_chunks(link, table, s, &at, target.out, &mut loaded)?;
            for p in &s.patches {
                apply_patch(link, table, p, &at, target.out, &mut loaded)?;
            }
        }
        Ok(loaded)
    }
}

/// Where a load puts values: rows `rows`, columns `cols` of `el`-byte values, `out_row` bytes a
/// row in the caller's buffer.
struct Target<'r> {
    rows: &'r Range<u64>,
    cols: &'r Range<u64>,
    el: u64,
    out_row: u64,
}

/// The rows and columns a rectangle at `offset` of `shape` shares with `rows` × `cols`; and the
/// rectangle's first column and width.
fn overlap(
    offset: &[u64],
    shape: &[u64],
    rows: &Range<u64>,
    cols: &Range<u64>,
) -> (Range<u64>, Range<u64>, u64, u64) {
    let (c0, width) = match (offset.get(1), shape.get(1)) {
        (Some(&o), Some(&w)) => (o, w),
        _ => (0, 1),
    };
    let r = rows.start.max(offset[0])..rows.end.min(offset[0] + shape[0]);
    let x = cols.start.max(c0)..cols.end.min(c0 + width);
    if r.is_empty() || x.is_empty() {
        return (0..0, 0..0, c0, width);
    }
    (r, x, c0, width)
}

/// Fills `out` from the chunks of `slot` in `link` that the target overlaps.
fn fill_from_chunks(
    link: &Link,
    table: &str,
    slot: &RowSlotManifest,
    at: &Target<'_>,
    out: &mut [u8],
    loaded: &mut RowsLoaded,
) -> Result<()> {
    let (rows, cols, el, out_row) = (at.rows, at.cols, at.el, at.out_row);
    for chunk in &slot.chunks {
        let t = &chunk.tensor;
        let (r, x, c0, c_width) = overlap(&chunk.offset, &t.shape, rows, cols);
        if r.is_empty() {
            continue;
        }
        let c_row0 = chunk.offset[0];
        loaded.chunks += 1;
        // (offset in the chunk's tensor, offset in `out`, length): whole rows of both at once.
        let whole_rows = x.start == c0 && x.end == c0 + c_width && x == *cols;
        if whole_rows && t.codec.is_none() {
            let from = (r.start - c_row0) * c_width * el;
            let to = (r.start - rows.start) * out_row;
            let len = (r.end - r.start) * out_row;
            let dst = &mut out[to as usize..(to + len) as usize];
            read_in_parts(link, table, t, from, dst, loaded)?;
            continue;
        }
        if !whole_rows && (c_width - (x.end - x.start)) * el <= COALESCE_BYTES {
            scatter_columns(
                link,
                table,
                t,
                (&r, c_row0, c_width),
                (&x, c0),
                at,
                out,
                loaded,
            )?;
            continue;
        }
        let pieces_of: Vec<(u64, u64, u64)> = if whole_rows {
            vec![(
                (r.start - c_row0) * c_width * el,
                (r.start - rows.start) * out_row,
                (r.end - r.start) * out_row,
            )]
        } else {
            r.clone()
                .map(|row| {
                    (
                        ((row - c_row0) * c_width + (x.start - c0)) * el,
                        (row - rows.start) * out_row + (x.start - cols.start) * el,
                        (x.end - x.start) * el,
                    )
                })
                .collect()
        };
        read_checked(link, table, t, &pieces_of, out, loaded)?;
    }
    Ok(())
}

/// A column slice whose rows' other columns are at most this many bytes: its rows are read
/// whole, in long runs, and the columns scattered in memory, where a read a row waited on the
/// device (or a round trip) for every row (1 M rows into 4 column shards: 3.7 s).
const COALESCE_BYTES: u64 = 4096;

/// Bytes of a chunk's whole rows read at a time for a column slice ([`scatter_columns`]).
const SCATTER_WINDOW: u64 = 8 << 20;

/// Fills columns `x` (the chunk's first column `c0`) of rows `r` of `out` from the chunk `t`
/// (its first row `c_row0`, `c_width` columns): its rows read whole, [`SCATTER_WINDOW`] bytes
/// at a time, their CRCs checked over all the windows together, the columns copied out.
#[allow(clippy::too_many_arguments)]
fn scatter_columns(
    link: &Link,
    table: &str,
    t: &TensorRef,
    (r, c_row0, c_width): (&Range<u64>, u64, u64),
    (x, c0): (&Range<u64>, u64),
    at: &Target<'_>,
    out: &mut [u8],
    loaded: &mut RowsLoaded,
) -> Result<()> {
    let el = at.el;
    let row_bytes = c_width * el;
    let window_rows = (SCATTER_WINDOW / row_bytes.max(1)).max(1);
    let mut scratch = vec![0u8; (window_rows.min(r.end - r.start) * row_bytes) as usize];
    let (len, from_col, to_col) = (
        ((x.end - x.start) * el) as usize,
        ((x.start - c0) * el) as usize,
        ((x.start - at.cols.start) * el) as usize,
    );
    let mut ps = Vec::new();
    let mut row = r.start;
    while row < r.end {
        let n = window_rows.min(r.end - row);
        let from = (row - c_row0) * row_bytes;
        let buf = &mut scratch[..(n * row_bytes) as usize];
        link.read_tensor_ranges(&mut [(t, from, &mut *buf)])?;
        pieces::push(t, from, buf, &mut ps);
        for (k, src) in buf.chunks_exact(row_bytes as usize).enumerate() {
            let dst = ((row + k as u64 - at.rows.start) * at.out_row) as usize + to_col;
            out[dst..dst + len].copy_from_slice(&src[from_col..from_col + len]);
        }
        row += n;
    }
    let extra = check_pieces(link, table, t, ps)?;
    loaded.bytes_read += (r.end - r.start) * row_bytes + extra;
    Ok(())
}

/// Slot `slot` of row-range table `table` as a link's parent (`parent`, its manifest) holds
/// it, if it holds it as the child does (the same dtype and shape): what the child's patches of
/// it are put over. `None` makes the chain unreadable there ([`parent_lacks`]).
pub(crate) fn parent_slot<'m>(
    parent: &'m saver_core::Manifest,
    table: &str,
    slot: &RowSlotManifest,
) -> Option<&'m RowSlotManifest> {
    parent
        .row_tables
        .iter()
        .find(|t| t.name == table)
        .and_then(|t| t.slots.iter().find(|s| s.name == slot.name))
        .filter(|s| s.dtype == slot.dtype && s.shape == slot.shape)
}

/// Why a parent without [`parent_slot`] cannot be read under its child's patches.
pub(crate) fn parent_lacks(table: &str, slot: &RowSlotManifest) -> String {
    format!(
        "its child patches row-range table {table:?} slot {:?} ({} of shape {:?}), which it does \
         not hold so",
        slot.name, slot.dtype, slot.shape
    )
}

/// The check of a patch's changed-row numbers, given as their little-endian bytes cut anywhere:
/// they must increase strictly within the patch's rows.
pub(crate) struct ChangedRowsOrder {
    rows: Range<u64>,
    last: Option<u64>,
    /// The bytes of a number cut by the end of what was fed.
    carry: Vec<u8>,
    bad: bool,
}

impl ChangedRowsOrder {
    /// For the changed rows of patch `p`.
    pub(crate) fn of(p: &RowPatchManifest) -> Self {
        Self {
            rows: p.offset[0]..p.offset[0] + p.shape[0],
            last: None,
            carry: Vec::new(),
            bad: false,
        }
    }

    /// The next bytes of the row numbers.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && !self.bad {
            let take = (8 - self.carry.len()).min(bytes.len());
            self.carry.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.carry.len() < 8 {
                return;
            }
            let row = u64::from_le_bytes(self.carry[..].try_into().expect("8 bytes"));
            self.carry.clear();
            self.bad = !self.rows.contains(&row) || self.last.is_some_and(|l| l >= row);
            self.last = Some(row);
        }
    }

    /// Fails, naming tensor `rows` of table `table`, unless every number fed was in order.
    pub(crate) fn check(&self, table: &str, rows: &TensorRef) -> Result<()> {
        if !self.bad && self.carry.is_empty() {
            return Ok(());
        }
        Err(Error::Corrupt {
            file: rows.file.clone(),
            what: format!(
                "tensor {:?} (changed rows of row-range table {table:?}) is not increasing row \
                 numbers within {:?}",
                rows.name, self.rows
            ),
        })
    }
}

/// Puts the changed rows of patch `p` (of `link`) that the target overlaps over `out`.
fn apply_patch(
    link: &Link,
    table: &str,
    p: &RowPatchManifest,
    at: &Target<'_>,
    out: &mut [u8],
    loaded: &mut RowsLoaded,
) -> Result<()> {
    let (rows, cols, el, out_row) = (at.rows, at.cols, at.el, at.out_row);
    let (r, x, c0, p_width) = overlap(&p.offset, &p.shape, rows, cols);
    let Some(changed) = p.changed.as_ref().filter(|_| !r.is_empty()) else {
        return Ok(());
    };
    let mut ids_bytes = vec![0u8; changed.rows.len as usize];
    read_checked(
        link,
        table,
        &changed.rows,
        &[(0, 0, changed.rows.len)],
        &mut ids_bytes,
        loaded,
    )?;
    let ids: Vec<u64> = ids_bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    let mut order = ChangedRowsOrder::of(p);
    order.feed(&ids_bytes);
    order.check(table, &changed.rows)?;
    let lo = ids.partition_point(|&id| id < r.start);
    let hi = ids.partition_point(|&id| id < r.end);
    if lo == hi {
        return Ok(());
    }
    let p_row = p_width * el;
    let mut values = vec![0u8; ((hi - lo) as u64 * p_row) as usize];
    read_checked(
        link,
        table,
        &changed.values,
        &[(lo as u64 * p_row, 0, values.len() as u64)],
        &mut values,
        loaded,
    )?;
    let len = ((x.end - x.start) * el) as usize;
    let from = ((x.start - c0) * el) as usize;
    let to = ((x.start - cols.start) * el) as usize;
    for (i, &row) in ids[lo..hi].iter().enumerate() {
        let src = i * p_row as usize + from;
        let dst = ((row - rows.start) * out_row) as usize + to;
        out[dst..dst + len].copy_from_slice(&values[src..src + len]);
    }
    Ok(())
}

/// Bytes of a tensor a thread reads and checks at a time, in a load of whole rows: the reads of
/// one thread are in flight while another checks what it read, so that the CRCs of a cold
/// restore overlap its reads instead of following them (a multiple of every CRC block size).
const READ_PART: u64 = 8 << 20;

/// Reads `dst.len()` bytes of `t` from tensor offset `from` into `dst`, in parts of
/// [`READ_PART`] (cut at multiples of it in the tensor) read and checked by the pool's threads
/// at once.
fn read_in_parts(
    link: &Link,
    table: &str,
    t: &TensorRef,
    from: u64,
    dst: &mut [u8],
    loaded: &mut RowsLoaded,
) -> Result<()> {
    let mut parts: Vec<(u64, &mut [u8])> = Vec::new();
    let (mut at, mut rest) = (from, dst);
    while !rest.is_empty() {
        let end = ((at / READ_PART + 1) * READ_PART).min(at + rest.len() as u64);
        let (part, tail) = std::mem::take(&mut rest).split_at_mut((end - at) as usize);
        parts.push((at, part));
        (at, rest) = (end, tail);
    }
    let read = parts
        .into_par_iter()
        .map(|(at, part)| {
            let mut l = RowsLoaded::default();
            let len = part.len() as u64;
            read_checked(link, table, t, &[(at, 0, len)], part, &mut l)?;
            Ok(l)
        })
        .collect::<Result<Vec<RowsLoaded>>>()?;
    for l in read {
        loaded.bytes_read += l.bytes_read;
    }
    Ok(())
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
    let extra = check_pieces(link, table, t, ps)?;
    loaded.bytes_read += spans.iter().map(|s| s.2).sum::<u64>() + extra;
    Ok(())
}

/// Checks the CRC32s of the blocks of `t` (a chunk of row-range table `table`) that pieces `ps`
/// touch, reading what of them the pieces leave out: the bytes read for the check.
fn check_pieces(link: &Link, table: &str, t: &TensorRef, ps: Vec<pieces::Piece>) -> Result<u64> {
    pieces::check(link, t, ps)?.ok_or_else(|| Error::Corrupt {
        file: t.file.clone(),
        what: format!(
            "tensor {:?} (a chunk of row-range table {table:?}) fails its CRC32 check",
            t.name
        ),
    })
}

/// The shape of one row-range target: the columns it takes, a value's bytes, a target row's
/// bytes, and the bytes it wants.
struct TargetShape {
    cols: Range<u64>,
    el: u64,
    out_row: u64,
    want: u64,
}

/// Checks `target` against `slot` (its columns within the slot's, whole bytes per value, a
/// buffer of the size the rows and columns take), and returns its shape.
fn target_shape(
    table: &str,
    slot: &RowSlotManifest,
    rows: &Range<u64>,
    target: &RowsInto<'_>,
) -> Result<TargetShape> {
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
    Ok(TargetShape {
        cols,
        el,
        out_row,
        want,
    })
}

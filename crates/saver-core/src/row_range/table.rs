//! A row-range table saver holds for a trainer: rows kept in blocks, each shared with the saves
//! that took it and copied only when the trainer writes to it while one of them still holds it
//! (copy-on-write), so that a background save's moment copies nothing, and afterwards only the
//! blocks the trainer writes to before the save has read them.
//!
//! A tensor the trainer owns (a PyTorch parameter) is given as borrowed chunks instead
//! ([`RowRangeChunk`]); a background save copies those at its call.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use crate::error::{Error, Result};
use crate::naming::{check_slot_name, check_table_name};
use crate::row_range::RowRangeChunk;
use crate::table::SlotSpec;

/// Rows of a block unless [`RowRangeTable::with_block_rows`] says otherwise: the unit of
/// copy-on-write and of the chunks a save writes.
pub const DEFAULT_BLOCK_ROWS: u64 = 16_384;

/// Rows `rows` of a row-range table of `table_rows` rows, every column of each slot, held in
/// blocks of rows: what one process of a row-wise sharded table holds (all of it for one
/// process).
///
/// Writes ([`Self::update`]) are atomic with respect to a save's moment ([`Self::moment`]): a
/// save holds the table as it was between two updates, every slot alike.
///
/// ```
/// use saver_core::{Dtype, RowRangeTable, SaveInput, SlotSpec};
///
/// let table = RowRangeTable::new("item", 1000, 0..1000, vec![
///     SlotSpec::new("weight", Dtype::F32, vec![4]),
///     SlotSpec::new("steps", Dtype::I64, vec![]),
/// ])?;
/// table.update(10..12, |mut rows| {
///     rows.slot_mut::<f32>(0)?.fill(0.5);
///     rows.slot_mut::<i64>(1)?.fill(7);
///     Ok(())
/// })?;
/// // The moment: no row is copied, and writes after it copy only the blocks they touch.
/// let input = SaveInput::new().row_table(&table)?;
/// table.update(10..11, |mut rows| {
///     rows.slot_mut::<f32>(0)?.fill(1.0);
///     Ok(())
/// })?;
/// assert_eq!(table.blocks_copied(), 1);
/// # Ok::<(), saver_core::Error>(())
/// ```
#[derive(Debug)]
pub struct RowRangeTable {
    name: String,
    table_rows: u64,
    rows: Range<u64>,
    block_rows: u64,
    slots: Vec<Slot>,
    /// Updates hold it shared; a moment holds it alone, so that it falls between updates.
    moment: RwLock<()>,
    copied: AtomicU64,
}

#[derive(Debug)]
struct Slot {
    spec: SlotSpec,
    /// Bytes of one row.
    row_bytes: u64,
    blocks: Vec<Mutex<Arc<Vec<u8>>>>,
}

/// The rows of one block an [`RowRangeTable::update`] call writes: each slot's values of those
/// rows, row-major. A slot's block is copied (when a save still holds it) only if it is asked for.
pub struct RowsMut<'t> {
    first: u64,
    count: u64,
    slots: Vec<SlotRows<'t>>,
    copied: &'t AtomicU64,
}

struct SlotRows<'t> {
    spec: &'t SlotSpec,
    block: &'t mut Arc<Vec<u8>>,
    at: Range<usize>,
}

impl RowsMut<'_> {
    /// The table row of the first row here.
    pub fn first_row(&self) -> u64 {
        self.first
    }

    /// How many rows are here.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// Whether no row is here.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Slot `slot`'s values of these rows, as `T` (which must be the slot's dtype's size).
    pub fn slot_mut<T: bytemuck::Pod>(&mut self, slot: usize) -> Result<&mut [T]> {
        let held = self.slots.len();
        let spec = self
            .slots
            .get(slot)
            .ok_or_else(|| Error::InvalidOption {
                option: "slot",
                why: format!("slot {slot} of a table of {held} slots"),
            })?
            .spec;
        if std::mem::size_of::<T>() * 8 != spec.dtype.bits() as usize {
            return Err(Error::InvalidOption {
                option: "slot",
                why: format!(
                    "slot {:?} holds {}, not values of {} bytes",
                    spec.name,
                    spec.dtype,
                    std::mem::size_of::<T>()
                ),
            });
        }
        let bytes = self.slot_bytes_mut(slot).expect("checked above");
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| Error::InvalidOption {
            option: "slot",
            why: format!("slot {:?}: {e}", spec.name),
        })
    }

    /// Slot `slot`'s bytes of these rows.
    pub fn slot_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        let s = self.slots.get_mut(slot)?;
        // Shared with a save that has not read it yet: copied, and the save keeps the old.
        if Arc::strong_count(s.block) > 1 {
            self.copied.fetch_add(1, Ordering::Relaxed);
        }
        Some(&mut Arc::make_mut(s.block)[s.at.clone()])
    }
}

impl RowRangeTable {
    /// Rows `rows` of table `name` of `table_rows` rows, with slots `slots` (a row of each: `[]`
    /// for one value, `[cols]`), zeroed.
    pub fn new(
        name: &str,
        table_rows: u64,
        rows: Range<u64>,
        slots: Vec<SlotSpec>,
    ) -> Result<Self> {
        Self::with_block_rows(name, table_rows, rows, slots, DEFAULT_BLOCK_ROWS)
    }

    /// As [`Self::new`], with blocks of `block_rows` rows: smaller blocks copy less when the
    /// trainer writes during a save, and make more chunks.
    pub fn with_block_rows(
        name: &str,
        table_rows: u64,
        rows: Range<u64>,
        slots: Vec<SlotSpec>,
        block_rows: u64,
    ) -> Result<Self> {
        check_table_name(name)?;
        let invalid = |why: String| Error::InvalidOption {
            option: "row-range table",
            why: format!("table {name:?}: {why}"),
        };
        if rows.start > rows.end || rows.end > table_rows {
            return Err(invalid(format!(
                "rows {rows:?} are not within its {table_rows} rows"
            )));
        }
        if block_rows == 0 {
            return Err(invalid("blocks of no rows".into()));
        }
        let count = rows.end - rows.start;
        let blocks = count.div_ceil(block_rows);
        let slots = slots
            .into_iter()
            .map(|spec| {
                check_slot_name(&spec.name)?;
                if spec.shape.len() > 1 || !spec.dtype.bits().is_multiple_of(8) {
                    return Err(invalid(format!(
                        "slot {:?}: rows of shape {:?} of {}; a row-range slot's row is one \
                         value or one vector of whole bytes",
                        spec.name, spec.shape, spec.dtype
                    )));
                }
                let width = spec.shape.first().copied().unwrap_or(1);
                let row_bytes = spec
                    .dtype
                    .byte_len(width)
                    .ok_or_else(|| invalid(format!("slot {:?} is too wide", spec.name)))?;
                let blocks = (0..blocks)
                    .map(|b| {
                        let n = (count - b * block_rows).min(block_rows);
                        Mutex::new(Arc::new(vec![0u8; (n * row_bytes) as usize]))
                    })
                    .collect();
                Ok(Slot {
                    spec,
                    row_bytes,
                    blocks,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            name: name.to_string(),
            table_rows,
            rows,
            block_rows,
            slots,
            moment: RwLock::new(()),
            copied: AtomicU64::new(0),
        })
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rows held.
    pub fn rows(&self) -> Range<u64> {
        self.rows.clone()
    }

    /// The whole table's rows.
    pub fn table_rows(&self) -> u64 {
        self.table_rows
    }

    /// Its slots.
    pub fn slots(&self) -> impl Iterator<Item = &SlotSpec> {
        self.slots.iter().map(|s| &s.spec)
    }

    /// Blocks copied since the table was made because a save still held them when the trainer
    /// wrote to them: what copy-on-write cost.
    pub fn blocks_copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    /// Writes rows `rows` (table rows, within [`Self::rows`]): `write` is called once per block
    /// the range overlaps, with every slot's values of the rows of that block, in row order. The
    /// whole call falls on one side of any save's moment.
    pub fn update(
        &self,
        rows: Range<u64>,
        mut write: impl FnMut(RowsMut<'_>) -> Result<()>,
    ) -> Result<()> {
        self.check_rows(&rows)?;
        let _between_moments = self.moment.read().unwrap_or_else(PoisonError::into_inner);
        for (b, within) in self.blocks_of(&rows) {
            let mut guards: Vec<MutexGuard<'_, Arc<Vec<u8>>>> = self
                .slots
                .iter()
                .map(|s| s.blocks[b].lock().unwrap_or_else(PoisonError::into_inner))
                .collect();
            let slots = self
                .slots
                .iter()
                .zip(guards.iter_mut())
                .map(|(s, g)| SlotRows {
                    spec: &s.spec,
                    block: g,
                    at: (within.start * s.row_bytes) as usize..(within.end * s.row_bytes) as usize,
                })
                .collect();
            write(RowsMut {
                first: self.rows.start + b as u64 * self.block_rows + within.start,
                count: within.end - within.start,
                slots,
                copied: &self.copied,
            })?;
        }
        Ok(())
    }

    /// Reads rows `rows`: `read` is called once per block the range overlaps with the table row
    /// of its first row and each slot's bytes of those rows.
    pub fn read(
        &self,
        rows: Range<u64>,
        mut read: impl FnMut(u64, &[&[u8]]) -> Result<()>,
    ) -> Result<()> {
        self.check_rows(&rows)?;
        for (b, within) in self.blocks_of(&rows) {
            // Shared, not locked across the call: a write copies the block first if it must.
            let held: Vec<Arc<Vec<u8>>> = self
                .slots
                .iter()
                .map(|s| Arc::clone(&s.blocks[b].lock().unwrap_or_else(PoisonError::into_inner)))
                .collect();
            let parts: Vec<&[u8]> = self
                .slots
                .iter()
                .zip(&held)
                .map(|(s, h)| {
                    &h[(within.start * s.row_bytes) as usize..(within.end * s.row_bytes) as usize]
                })
                .collect();
            read(
                self.rows.start + b as u64 * self.block_rows + within.start,
                &parts,
            )?;
        }
        Ok(())
    }

    /// The table at this moment as chunks, one per block and slot, sharing the blocks' bytes:
    /// nothing is copied, and a write after it copies the block it writes to
    /// ([`Self::blocks_copied`]). What [`crate::SaveInput::row_table`] gives a save.
    pub fn moment(&self) -> Result<Vec<RowRangeChunk<'static>>> {
        let taken: Vec<Vec<Arc<Vec<u8>>>> = {
            let _alone = self.moment.write().unwrap_or_else(PoisonError::into_inner);
            self.slots
                .iter()
                .map(|s| {
                    s.blocks
                        .iter()
                        .map(|b| Arc::clone(&b.lock().unwrap_or_else(PoisonError::into_inner)))
                        .collect()
                })
                .collect()
        };
        let mut chunks = Vec::new();
        for (s, blocks) in self.slots.iter().zip(taken) {
            let width = s.spec.shape.first().copied();
            for (b, bytes) in blocks.into_iter().enumerate() {
                let first = self.rows.start + b as u64 * self.block_rows;
                let n = bytes.len() as u64 / s.row_bytes.max(1);
                let (shape, offset, whole) = match width {
                    Some(w) => (vec![n, w], vec![first, 0], vec![self.table_rows, w]),
                    None => (vec![n], vec![first], vec![self.table_rows]),
                };
                chunks.push(
                    RowRangeChunk::shared(&self.name, &s.spec.name, s.spec.dtype, shape, bytes)?
                        .at(&offset, &whole)?,
                );
            }
        }
        Ok(chunks)
    }

    /// Fills the table from `load`, called once per block and slot with its rows and its
    /// buffer: what a restart does (saver-io's `LoadRequest::into_table`).
    pub fn fill(
        &self,
        mut load: impl FnMut(&SlotSpec, Range<u64>, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let _between_moments = self.moment.read().unwrap_or_else(PoisonError::into_inner);
        for s in &self.slots {
            for (b, block) in s.blocks.iter().enumerate() {
                let mut g = block.lock().unwrap_or_else(PoisonError::into_inner);
                let bytes = Arc::make_mut(&mut g);
                let first = self.rows.start + b as u64 * self.block_rows;
                let n = bytes.len() as u64 / s.row_bytes.max(1);
                load(&s.spec, first..first + n, bytes)?;
            }
        }
        Ok(())
    }

    fn check_rows(&self, rows: &Range<u64>) -> Result<()> {
        if rows.start > rows.end || rows.start < self.rows.start || rows.end > self.rows.end {
            return Err(Error::InvalidOption {
                option: "rows",
                why: format!(
                    "rows {rows:?} of table {:?}, which holds rows {:?}",
                    self.name, self.rows
                ),
            });
        }
        Ok(())
    }

    /// The blocks `rows` overlaps, each with the rows of it within the block.
    fn blocks_of(&self, rows: &Range<u64>) -> Vec<(usize, Range<u64>)> {
        let (a, z) = (rows.start - self.rows.start, rows.end - self.rows.start);
        let mut out = Vec::new();
        let mut at = a;
        while at < z {
            let b = at / self.block_rows;
            let end = ((b + 1) * self.block_rows).min(z);
            out.push((
                b as usize,
                at - b * self.block_rows..end - b * self.block_rows,
            ));
            at = end;
        }
        out
    }
}

impl std::fmt::Debug for RowsMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowsMut")
            .field("first", &self.first)
            .field("count", &self.count)
            .field(
                "slots",
                &self.slots.iter().map(|s| &s.spec.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn table(block_rows: u64) -> RowRangeTable {
        RowRangeTable::with_block_rows(
            "t",
            100,
            10..60,
            vec![
                SlotSpec::new("w", Dtype::F32, vec![3]),
                SlotSpec::new("n", Dtype::I64, vec![]),
            ],
            block_rows,
        )
        .unwrap()
    }

    #[test]
    fn an_update_sees_its_rows_block_by_block_and_a_moment_shares_them() {
        let t = table(16);
        t.update(12..40, |mut r| {
            let first = r.first_row() as f32;
            for (i, v) in r.slot_mut::<f32>(0)?.iter_mut().enumerate() {
                *v = first + (i / 3) as f32;
            }
            r.slot_mut::<i64>(1)?.fill(5);
            Ok(())
        })
        .unwrap();
        let chunks = t.moment().unwrap();
        // 50 rows in blocks of 16: 4 blocks a slot.
        assert_eq!(chunks.len(), 8);
        assert_eq!(chunks[1].rows(), 26..42);
        let w: &[f32] = bytemuck::cast_slice(chunks[1].values().data().unwrap());
        assert_eq!(w[0], 26.0);
        assert_eq!(t.blocks_copied(), 0);
        // A write after the moment copies the one block it touches, in each slot.
        t.update(30..31, |mut r| {
            r.slot_mut::<f32>(0)?.fill(-1.0);
            r.slot_mut::<i64>(1)?.fill(-1);
            Ok(())
        })
        .unwrap();
        assert_eq!(t.blocks_copied(), 2);
        let w: &[f32] = bytemuck::cast_slice(chunks[1].values().data().unwrap());
        assert_eq!(
            w[4 * 3],
            30.0,
            "the moment holds the value before the write"
        );
        let mut seen = 0;
        t.read(30..31, |first, parts| {
            let w: &[f32] = bytemuck::cast_slice(parts[0]);
            assert_eq!((first, w[0]), (30, -1.0));
            seen += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, 1);
    }

    #[test]
    fn bad_rows_and_types_are_refused_by_name() {
        let t = table(16);
        let e = t.update(0..20, |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("holds rows 10..60"), "{e}");
        let e = t
            .update(10..11, |mut r| r.slot_mut::<f64>(0).map(|_| ()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"w\""), "{e}");
        let e = RowRangeTable::new("t", 10, 0..11, vec![])
            .unwrap_err()
            .to_string();
        assert!(e.contains("within"), "{e}");
    }
}

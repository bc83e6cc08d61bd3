//! Row-range tables: embedding tables whose ids are their row numbers `0..rows`, as PyTorch
//! (`nn.Embedding`, `nn.EmbeddingBag`) and TorchRec keep them: a dense tensor per slot (the
//! weights, each optimizer state), sharded by rows, columns or both.
//!
//! Such a table is saved as it is held, without ids and without a sort: each process gives the
//! chunks it holds ([`RowRangeChunk`]: a rectangle of one slot, at its global row and column
//! offsets), each chunk is written by the shard of the process that gives it, and the commit
//! checks that the chunks of every shard tile each slot exactly, no overlap and no gap. A load
//! of any row and column range reads only the bytes of the chunks it overlaps, straight into the
//! caller's buffer. Hashed tables ([`crate::SparseTable`]) stay what a model of sparse 64-bit
//! ids needs; `docs/FORMAT.md` says when to pick which.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::naming::{check_slot_name, check_table_name};
use crate::tensor::DenseTensor;

mod table;
pub use table::{RowRangeTable, RowsMut, DEFAULT_BLOCK_ROWS};

/// One rectangle of one slot of a row-range table, as a process holds it: rows
/// `offset[0]..offset[0] + shape[0]` (and, for a slot of two dimensions, columns
/// `offset[1]..offset[1] + shape[1]`) of a slot whose whole shape is `whole`.
///
/// ```
/// use saver_core::{Dtype, RowRangeChunk};
///
/// // Rows 1000..1500 of a table of 4000 rows of dimension 8, all its columns.
/// let values = vec![0.5f32; 500 * 8];
/// let chunk = RowRangeChunk::from_f32("item", "weight", vec![500, 8], &values)?
///     .at(&[1000, 0], &[4000, 8])?;
/// assert_eq!(chunk.rows(), 1000..1500);
/// # Ok::<(), saver_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct RowRangeChunk<'a> {
    table: String,
    slot: String,
    whole: Vec<u64>,
    offset: Vec<u64>,
    values: DenseTensor<'a>,
    /// Set when the chunk holds only some rows of its rectangle ([`Self::only_rows`]).
    changed: Option<ChangedRows>,
}

/// The rows of a chunk's rectangle that a delta holds, and the rectangle's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ChangedRows {
    rows: Vec<u64>,
    shape: Vec<u64>,
}

impl<'a> RowRangeChunk<'a> {
    /// A chunk of slot `slot` of table `table` holding `data` (little-endian, row-major) of
    /// `dtype` and `shape` (`[rows]` for a slot of one value per row, `[rows, cols]` otherwise):
    /// the whole slot, until [`Self::at`] places it in a larger one.
    pub fn new(
        table: &str,
        slot: &str,
        dtype: Dtype,
        shape: Vec<u64>,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<Self> {
        Self::named(table, slot, shape.len(), |name| {
            DenseTensor::new(name, dtype, shape, data)
        })
    }

    /// A chunk of `table`'s `slot` over the tensor `values` makes under the chunk's tensor name
    /// (of a chunk of `rank` dimensions at the slot's origin), the names checked first.
    fn named(
        table: &str,
        slot: &str,
        rank: usize,
        values: impl FnOnce(String) -> Result<DenseTensor<'a>>,
    ) -> Result<Self> {
        check_table_name(table)?;
        check_slot_name(slot)?;
        let values = values(chunk_tensor_name(table, slot, &vec![0; rank]))?;
        Self::of_values(table, slot, values)
    }

    /// A chunk over bytes shared with their holder (see [`DenseTensor::shared`]): what a
    /// [`RowRangeTable`]'s moment gives, with no copy.
    pub fn shared(
        table: &str,
        slot: &str,
        dtype: Dtype,
        shape: Vec<u64>,
        data: std::sync::Arc<Vec<u8>>,
    ) -> Result<RowRangeChunk<'static>> {
        RowRangeChunk::named(table, slot, shape.len(), |name| {
            DenseTensor::shared(name, dtype, shape, data)
        })
    }

    fn of_values(table: &str, slot: &str, values: DenseTensor<'a>) -> Result<Self> {
        let dtype = values.dtype();
        let rank = values.shape().len();
        if !(1..=2).contains(&rank) {
            return Err(Error::BadShape {
                name: format!("{table}/{slot}"),
                shape: values.shape().to_vec(),
                dtype: dtype.name().to_string(),
                why: "a row-range slot has one dimension (a value per row) or two (rows, \
                      columns)",
            });
        }
        Ok(Self {
            table: table.to_string(),
            slot: slot.to_string(),
            whole: values.shape().to_vec(),
            offset: vec![0; rank],
            values,
            changed: None,
        })
    }

    /// The chunk of rows `rows` (all their columns) of a slot of shape `whole`, holding
    /// `values`: a shard's part of a whole slot.
    pub fn of_rows(
        table: &str,
        slot: &str,
        dtype: Dtype,
        whole: &[u64],
        rows: std::ops::Range<u64>,
        values: Vec<u8>,
    ) -> Result<RowRangeChunk<'static>> {
        let (shape, offset) = rows_within(whole, rows);
        RowRangeChunk::new(table, slot, dtype, shape, values)?.at(&offset, whole)
    }

    /// A chunk like [`Self::new`] whose `dtype` values of `shape` are read from `source` as the
    /// save writes them ([`DenseTensor::deferred`]), a writer's chunk at a time: a tensor in
    /// device memory staged through a bounded host ring, or a tool's copy of a table larger
    /// than memory.
    pub fn deferred(
        table: &str,
        slot: &str,
        dtype: Dtype,
        shape: Vec<u64>,
        source: std::sync::Arc<dyn crate::ByteSource + 'a>,
    ) -> Result<Self> {
        Self::named(table, slot, shape.len(), |name| {
            DenseTensor::deferred(name, dtype, shape, source)
        })
    }

    /// A chunk like [`Self::deferred`] whose source holds its bytes unchanged for as long as any
    /// save reads it ([`DenseTensor::lasting`]): a background save keeps it as it is.
    pub fn lasting(
        table: &str,
        slot: &str,
        dtype: Dtype,
        shape: Vec<u64>,
        source: std::sync::Arc<dyn crate::ByteSource>,
    ) -> Result<Self> {
        Self::named(table, slot, shape.len(), |name| {
            DenseTensor::lasting(name, dtype, shape, source)
        })
    }

    /// The chunk of rows `rows` (all their columns) of a slot of shape `whole`, whose values are
    /// read from `source` as the save writes them ([`Self::deferred`]).
    pub fn of_rows_deferred(
        table: &str,
        slot: &str,
        dtype: Dtype,
        whole: &[u64],
        rows: std::ops::Range<u64>,
        source: std::sync::Arc<dyn crate::ByteSource + 'a>,
    ) -> Result<Self> {
        let (shape, offset) = rows_within(whole, rows);
        Self::deferred(table, slot, dtype, shape, source)?.at(&offset, whole)
    }

    /// A chunk of `f32` values, borrowed without copy where the platform is little-endian.
    pub fn from_f32(table: &str, slot: &str, shape: Vec<u64>, values: &'a [f32]) -> Result<Self> {
        Self::new(
            table,
            slot,
            Dtype::F32,
            shape,
            bytemuck::cast_slice::<f32, u8>(values),
        )
    }

    /// The chunk placed at `offset` (row, and column for a slot of two dimensions) of a slot
    /// whose whole shape is `whole` (its rows are the table's rows), or an error naming the
    /// chunk if it does not fit there.
    pub fn at(mut self, offset: &[u64], whole: &[u64]) -> Result<Self> {
        if self.changed.is_some() {
            return Err(Error::InvalidOption {
                option: "row-range chunk",
                why: format!(
                    "table {:?} slot {:?}: a chunk is placed before it is reduced to its \
                     changed rows",
                    self.table, self.slot
                ),
            });
        }
        let shape = self.values.shape();
        let fits = offset.len() == shape.len()
            && whole.len() == shape.len()
            && (0..shape.len()).all(|d| {
                offset[d]
                    .checked_add(shape[d])
                    .is_some_and(|end| end <= whole[d])
            });
        if !fits {
            return Err(Error::InvalidOption {
                option: "row-range chunk",
                why: format!(
                    "table {:?} slot {:?}: a chunk of shape {shape:?} at offset {offset:?} does \
                     not fit in a slot of shape {whole:?}",
                    self.table, self.slot
                ),
            });
        }
        self.offset = offset.to_vec();
        self.whole = whole.to_vec();
        self.values = self
            .values
            .renamed(chunk_tensor_name(&self.table, &self.slot, offset));
        Ok(self)
    }

    /// The chunk reduced to rows `rows` of its rectangle (global row numbers, increasing, within
    /// [`Self::rows`]), `values` their values (row-major, all of the chunk's columns): what a
    /// delta holds of a chunk whose other rows did not change since its parent. A delta's save
    /// makes these from the chunks it is given, by comparing them with the parent; a full save
    /// refuses them.
    pub fn only_rows(self, rows: Vec<u64>, values: impl Into<Cow<'a, [u8]>>) -> Result<Self> {
        let shape = self.shape().to_vec();
        let span = self.rows();
        let invalid = |why: String| Error::InvalidOption {
            option: "row-range chunk",
            why: format!("table {:?} slot {:?}: {why}", self.table, self.slot),
        };
        if self.changed.is_some() {
            return Err(invalid(
                "the chunk is reduced to its changed rows already".into(),
            ));
        }
        if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(invalid(format!(
                "changed rows {} and {} are not increasing",
                w[0], w[1]
            )));
        }
        if let Some(r) = rows.iter().find(|r| !span.contains(r)) {
            return Err(invalid(format!(
                "changed row {r} is outside the chunk's rows {span:?}"
            )));
        }
        let mut kept = shape.clone();
        kept[0] = rows.len() as u64;
        let values = DenseTensor::new(
            patch_tensor_names(&self.table, &self.slot, &self.offset).1,
            self.values.dtype(),
            kept,
            values,
        )?;
        Ok(Self {
            values,
            changed: Some(ChangedRows { rows, shape }),
            ..self
        })
    }

    /// The rows of its rectangle the chunk holds, when it holds only some ([`Self::only_rows`]).
    pub fn changed_rows(&self) -> Option<&[u64]> {
        self.changed.as_ref().map(|c| c.rows.as_slice())
    }

    /// The shape of the chunk's rectangle of its slot.
    pub fn shape(&self) -> &[u64] {
        match &self.changed {
            Some(c) => &c.shape,
            None => self.values.shape(),
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The whole slot's shape: `[rows]` or `[rows, cols]`.
    pub fn whole(&self) -> &[u64] {
        &self.whole
    }

    /// Where the chunk starts: its first row, and first column for a slot of two dimensions.
    pub fn offset(&self) -> &[u64] {
        &self.offset
    }

    /// The table rows the chunk holds.
    pub fn rows(&self) -> std::ops::Range<u64> {
        self.offset[0]..self.offset[0] + self.shape()[0]
    }

    /// The chunk's values, as the tensor the checkpoint stores (named by
    /// [`chunk_tensor_name`]; by `patch_tensor_names` when it holds only some rows).
    pub fn values(&self) -> &DenseTensor<'a> {
        &self.values
    }

    /// The same chunk over the same bytes, borrowed: no copy.
    pub fn view(&self) -> RowRangeChunk<'_> {
        RowRangeChunk {
            table: self.table.clone(),
            slot: self.slot.clone(),
            whole: self.whole.clone(),
            offset: self.offset.clone(),
            values: self.values.view(),
            changed: self.changed.clone(),
        }
    }

    /// The chunk with bytes of its own (see [`DenseTensor::into_owned`]).
    pub fn into_owned(self) -> Result<RowRangeChunk<'static>> {
        Ok(RowRangeChunk {
            table: self.table,
            slot: self.slot,
            whole: self.whole,
            offset: self.offset,
            values: self.values.into_owned()?,
            changed: self.changed,
        })
    }
}

/// The shape and offset of rows `rows` (all their columns) of a slot of shape `whole`.
fn rows_within(whole: &[u64], rows: std::ops::Range<u64>) -> (Vec<u64>, Vec<u64>) {
    let mut shape = whole.to_vec();
    let mut offset = vec![0; whole.len()];
    if let (Some(n), Some(at)) = (shape.first_mut(), offset.first_mut()) {
        *n = rows.end.saturating_sub(rows.start);
        *at = rows.start;
    }
    (shape, offset)
}

/// The name of the tensor that holds the chunk of `table`'s `slot` at `offset` in a data file:
/// `table/slot:r<row>.c<col>` (`table/slot:r<row>` for a slot of one dimension). The `:` keeps it
/// apart from every dense tensor a user may name alike ([`mod@crate::plan`] refuses those).
pub fn chunk_tensor_name(table: &str, slot: &str, offset: &[u64]) -> String {
    match offset {
        [row] => format!("{table}/{slot}:r{row}"),
        [row, col, ..] => format!("{table}/{slot}:r{row}.c{col}"),
        [] => format!("{table}/{slot}:r0"),
    }
}

/// The names of the two tensors that hold a delta's changed rows of the chunk of `table`'s
/// `slot` at `offset` ([`RowRangeChunk::only_rows`]): the chunk's name ([`chunk_tensor_name`])
/// with `.rows` (their row numbers) and `.values` (their values).
pub(crate) fn patch_tensor_names(table: &str, slot: &str, offset: &[u64]) -> (String, String) {
    let chunk = chunk_tensor_name(table, slot, offset);
    (format!("{chunk}.rows"), format!("{chunk}.values"))
}

/// Whether `name` has the form of a chunk tensor's name ([`chunk_tensor_name`]) of table
/// `table`, or of a delta's changed rows of one (`patch_tensor_names`).
pub(crate) fn is_chunk_tensor_name_of(name: &str, table: &str) -> bool {
    let Some(rest) = name.strip_prefix(table).and_then(|r| r.strip_prefix('/')) else {
        return false;
    };
    let rest = rest
        .strip_suffix(".rows")
        .or_else(|| rest.strip_suffix(".values"))
        .unwrap_or(rest);
    let Some((_, at)) = rest.rsplit_once(':') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    at.strip_prefix('r')
        .is_some_and(|r| match r.split_once(".c") {
            Some((a, b)) => digits(a) && digits(b),
            None => digits(r),
        })
}

/// Why the rectangles `pieces` (offset, shape) do not tile a slot of shape `whole`: one out of
/// bounds, two overlapping, or (when `complete`) some element covered by none. `None` when they
/// do. Empty pieces cover nothing and are ignored.
pub(crate) fn tiling_problem(
    whole: &[u64],
    pieces: &[(&[u64], &[u64])],
    complete: bool,
) -> Option<String> {
    let rank = whole.len();
    let mut boxes: Vec<(Vec<u64>, Vec<u64>)> = Vec::with_capacity(pieces.len());
    for &(offset, shape) in pieces {
        if offset.len() != rank || shape.len() != rank {
            return Some(format!(
                "a chunk at {offset:?} of shape {shape:?} does not have the slot's {rank} \
                 dimensions"
            ));
        }
        let mut end = Vec::with_capacity(rank);
        for d in 0..rank {
            match offset[d].checked_add(shape[d]) {
                Some(e) if e <= whole[d] => end.push(e),
                _ => {
                    return Some(format!(
                        "a chunk at {offset:?} of shape {shape:?} lies outside the slot's shape \
                         {whole:?}"
                    ))
                }
            }
        }
        if shape.contains(&0) {
            continue;
        }
        boxes.push((offset.to_vec(), end));
    }
    boxes.sort();
    // Sorted by first row: a box can overlap only boxes that start before it ends.
    for i in 0..boxes.len() {
        for j in i + 1..boxes.len() {
            if boxes[j].0[0] >= boxes[i].1[0] {
                break;
            }
            let overlap =
                (0..rank).all(|d| boxes[i].0[d] < boxes[j].1[d] && boxes[j].0[d] < boxes[i].1[d]);
            if overlap {
                return Some(format!(
                    "the chunks at {:?} and {:?} overlap",
                    boxes[i].0, boxes[j].0
                ));
            }
        }
    }
    if complete {
        let area = |lo: &[u64], hi: &[u64]| -> u128 {
            (0..rank).map(|d| u128::from(hi[d] - lo[d])).product()
        };
        let covered: u128 = boxes.iter().map(|(lo, hi)| area(lo, hi)).sum();
        let total: u128 = whole.iter().map(|&d| u128::from(d)).product();
        // No two overlap, so the areas add up to the whole exactly when nothing is missing.
        if covered != total {
            return Some(format!(
                "the chunks cover {covered} of the slot's {total} elements (shape {whole:?}): \
                 some rows or columns were given by no process"
            ));
        }
    }
    None
}

/// Checks the chunks one process gives: per table, one row count for every slot; per slot, one
/// dtype and one whole shape; chunks inside it, none overlapping another.
pub(crate) fn check_chunks(chunks: &[RowRangeChunk<'_>]) -> Result<()> {
    // (table, slot) -> (dtype, whole, pieces)
    type Pieces<'c> = (Dtype, &'c [u64], Vec<(&'c [u64], &'c [u64])>);
    let mut slots: BTreeMap<(&str, &str), Pieces<'_>> = BTreeMap::new();
    let mut rows: BTreeMap<&str, u64> = BTreeMap::new();
    let invalid = |table: &str, slot: &str, why: String| Error::InvalidOption {
        option: "row-range chunk",
        why: format!("table {table:?} slot {slot:?}: {why}"),
    };
    for c in chunks {
        let n = *rows.entry(&c.table).or_insert(c.whole[0]);
        if n != c.whole[0] {
            return Err(invalid(
                &c.table,
                &c.slot,
                format!(
                    "its slots are given {} and {n} rows; every slot of a table has the table's \
                     rows",
                    c.whole[0]
                ),
            ));
        }
        let entry = slots
            .entry((&c.table, &c.slot))
            .or_insert_with(|| (c.values.dtype(), &c.whole, Vec::new()));
        if entry.0 != c.values.dtype() || entry.1 != c.whole.as_slice() {
            return Err(invalid(
                &c.table,
                &c.slot,
                format!(
                    "chunks of dtype {} and shape {:?}, and of dtype {} and shape {:?}: one slot \
                     has one dtype and one shape",
                    entry.0,
                    entry.1,
                    c.values.dtype(),
                    c.whole
                ),
            ));
        }
        entry.2.push((&c.offset, c.shape()));
    }
    for ((table, slot), (_, whole, pieces)) in &slots {
        if let Some(why) = tiling_problem(whole, pieces, false) {
            return Err(invalid(table, slot, why));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Cuts `[0, rows) × [0, cols)` into a grid at the given row and column cuts.
    fn grid(rows: u64, cols: u64, row_cuts: &[u64], col_cuts: &[u64]) -> Vec<(Vec<u64>, Vec<u64>)> {
        let edges = |n: u64, cuts: &[u64]| {
            let mut e: Vec<u64> = cuts.iter().map(|c| c % (n + 1)).collect();
            e.push(0);
            e.push(n);
            e.sort_unstable();
            e.dedup();
            e
        };
        let (r, c) = (edges(rows, row_cuts), edges(cols, col_cuts));
        let mut out = Vec::new();
        for rw in r.windows(2) {
            for cw in c.windows(2) {
                out.push((vec![rw[0], cw[0]], vec![rw[1] - rw[0], cw[1] - cw[0]]));
            }
        }
        out
    }

    proptest! {
        /// Any grid tiles its slot; without any one of its non-empty pieces it does not; with a
        /// piece repeated or grown by a row it overlaps or leaves the slot.
        #[test]
        fn a_grid_tiles_and_any_change_to_it_is_found(
            rows in 1u64..50, cols in 1u64..10,
            row_cuts in proptest::collection::vec(0u64..60, 0..4),
            col_cuts in proptest::collection::vec(0u64..12, 0..3),
            pick in any::<prop::sample::Index>(),
        ) {
            let pieces = grid(rows, cols, &row_cuts, &col_cuts);
            let as_refs = |p: &[(Vec<u64>, Vec<u64>)]| -> Vec<(Vec<u64>, Vec<u64>)> { p.to_vec() };
            let check = |p: &[(Vec<u64>, Vec<u64>)], complete| {
                let refs: Vec<(&[u64], &[u64])> = p.iter().map(|(o, s)| (o.as_slice(), s.as_slice())).collect();
                tiling_problem(&[rows, cols], &refs, complete)
            };
            prop_assert_eq!(check(&pieces, true), None);
            let k = pick.index(pieces.len());
            let mut missing = as_refs(&pieces);
            missing.remove(k);
            prop_assert!(check(&missing, true).is_some());
            prop_assert_eq!(check(&missing, false), None);
            let mut twice = as_refs(&pieces);
            twice.push(pieces[k].clone());
            prop_assert!(check(&twice, false).unwrap().contains("overlap"));
            let mut grown = as_refs(&pieces);
            grown[k].1[0] += 1;
            prop_assert!(check(&grown, false).is_some());
        }
    }

    #[test]
    fn chunk_names_are_told_apart_from_dense_names() {
        assert_eq!(chunk_tensor_name("t", "w", &[10, 4]), "t/w:r10.c4");
        assert_eq!(chunk_tensor_name("t", "m", &[10]), "t/m:r10");
        assert!(is_chunk_tensor_name_of("t/w:r10.c4", "t"));
        assert!(is_chunk_tensor_name_of("t/m:r10", "t"));
        assert!(!is_chunk_tensor_name_of("t/w:s0.1", "t"));
        assert!(!is_chunk_tensor_name_of("t/w:r", "t"));
        assert!(!is_chunk_tensor_name_of("u/w:r1", "t"));
        let (rows, values) = patch_tensor_names("t", "w", &[10, 4]);
        assert!(is_chunk_tensor_name_of(&rows, "t") && is_chunk_tensor_name_of(&values, "t"));
        assert!(!is_chunk_tensor_name_of("t/w:r10.c4.other", "t"));
    }

    #[test]
    fn chunks_that_disagree_or_overlap_are_refused_by_name() {
        let v = vec![0f32; 40];
        let a = RowRangeChunk::from_f32("t", "w", vec![10, 4], &v)
            .unwrap()
            .at(&[0, 0], &[20, 4])
            .unwrap();
        let b = RowRangeChunk::from_f32("t", "w", vec![10, 4], &v)
            .unwrap()
            .at(&[5, 0], &[20, 4])
            .unwrap();
        let e = check_chunks(&[a.clone(), b]).unwrap_err().to_string();
        assert!(e.contains("\"t\"") && e.contains("overlap"), "{e}");
        let c = RowRangeChunk::from_f32("t", "m", vec![10], &v[..10])
            .unwrap()
            .at(&[10], &[30])
            .unwrap();
        let e = check_chunks(&[a.clone(), c]).unwrap_err().to_string();
        assert!(e.contains("rows"), "{e}");
        let e = RowRangeChunk::from_f32("t", "w", vec![10, 4], &v)
            .unwrap()
            .at(&[15, 0], &[20, 4])
            .unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
    }
}

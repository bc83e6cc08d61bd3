//! [`ColumnTable`]: a read-only table over rows already held in arrays, one buffer per slot.
//!
//! Saving rows that are already in memory as arrays (a checkpoint loaded with `load_columns`, to be
//! resharded; arrays a trainer exported) needs no hashtable: the scan hands out each row's index
//! as its handle and the save copies rows straight out of the arrays. Rows that were adjacent in
//! the arrays usually stay adjacent in the save (a checkpoint's rows are already in bucket order),
//! so runs of them are copied at once.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::OnceLock;

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::naming::check_table_name;

use super::{validate_slots, RowChunk, SlotSpec, SparseTable, TableSchema, TableSnapshot};

/// Rows per scan part: parts are scanned on separate threads.
const PART_ROWS: usize = if cfg!(test) { 64 } else { 1 << 20 };

/// How many rows ahead a read by handle asks the CPU for a row's id and slots. A save reads rows
/// in bucket order, which is random in arrays kept in any other order: without the hint each
/// row waits for two or three misses in turn (`benches/gather.rs`).
const PREFETCH_AHEAD: usize = 16;

/// A read-only table whose rows are in arrays: `ids[r]` is row `r`'s id and `data[s]` holds every
/// row of slot `s` back to back (little-endian, row-major), as [`SparseTable`] for saving. The
/// arrays are its own ([`Self::new`]) or borrowed for `'a` ([`Self::borrowed`]: saved in place).
#[derive(Debug)]
pub struct ColumnTable<'a> {
    schema: TableSchema,
    slot_bytes: Vec<usize>,
    ids: Cow<'a, [u64]>,
    data: Vec<Cow<'a, [u8]>>,
    /// Row of each id, built only if a read by id (no handles) ever asks.
    by_id: OnceLock<HashMap<u64, usize>>,
}

impl ColumnTable<'static> {
    /// A table over `ids` and `data` (one buffer per slot of `slots`, `ids.len()` rows each),
    /// taken without a copy. Duplicate ids are refused when the table is saved.
    pub fn new(
        name: impl Into<String>,
        key_dtype: KeyDtype,
        slots: Vec<SlotSpec>,
        ids: Vec<u64>,
        data: Vec<Vec<u8>>,
    ) -> Result<Self> {
        let data = data.into_iter().map(Cow::Owned).collect();
        Self::with(name.into(), key_dtype, slots, Cow::Owned(ids), data)
    }

    /// This table as a snapshot that owns it: what a custom [`SparseTable`] whose rows cannot be
    /// read at a moment otherwise returns from [`SparseTable::snapshot`], after copying its rows
    /// under its own lock. The copy is the moment: point-in-time, at the cost of one copy of the
    /// table's rows (for small tables; large ones want copy-on-write, see `table::moment`).
    pub fn into_snapshot(self) -> Box<dyn TableSnapshot> {
        Box::new(ColumnSnapshot {
            table: Box::new(self),
        })
    }
}

impl<'a> ColumnTable<'a> {
    /// [`Self::new`] over arrays borrowed for `'a`: a save reads the rows where they are, so
    /// they must not change until it ends.
    pub fn borrowed(
        name: impl Into<String>,
        key_dtype: KeyDtype,
        slots: Vec<SlotSpec>,
        ids: &'a [u64],
        data: Vec<&'a [u8]>,
    ) -> Result<Self> {
        let data = data.into_iter().map(Cow::Borrowed).collect();
        Self::with(name.into(), key_dtype, slots, Cow::Borrowed(ids), data)
    }

    fn with(
        name: String,
        key_dtype: KeyDtype,
        slots: Vec<SlotSpec>,
        ids: Cow<'a, [u64]>,
        data: Vec<Cow<'a, [u8]>>,
    ) -> Result<Self> {
        check_table_name(&name)?;
        let slot_bytes = validate_slots(&name, &slots)?;
        let bad = |message: String| Error::Table {
            table: name.clone(),
            message,
        };
        if data.len() != slots.len() {
            return Err(bad(format!(
                "{} slot buffers for {} slots",
                data.len(),
                slots.len()
            )));
        }
        for (s, buf) in data.iter().enumerate() {
            let want = ids.len() as u128 * slot_bytes[s] as u128;
            if buf.len() as u128 != want {
                return Err(bad(format!(
                    "slot {:?} has {} bytes, {} rows of {} bytes need {want}",
                    slots[s].name,
                    buf.len(),
                    ids.len(),
                    slot_bytes[s]
                )));
            }
        }
        Ok(Self {
            schema: TableSchema {
                name,
                key_dtype,
                slots,
            },
            slot_bytes,
            ids,
            data,
            by_id: OnceLock::new(),
        })
    }

    /// This table with its ids and rows copied (by every core: see
    /// `crate::moment_copy::copy_on_every_core`), for a save that outlives the arrays it was given.
    pub fn copied(&self) -> ColumnTable<'static> {
        ColumnTable {
            schema: self.schema.clone(),
            slot_bytes: self.slot_bytes.clone(),
            ids: Cow::Owned(crate::moment_copy::copy_on_every_core(&self.ids)),
            data: self
                .data
                .iter()
                .map(|d| Cow::Owned(crate::moment_copy::copy_on_every_core(d)))
                .collect(),
            by_id: OnceLock::new(),
        }
    }

    /// The ids, one per row.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// Slot `s`'s rows, back to back.
    pub fn slot_data(&self, s: usize) -> Option<&[u8]> {
        self.data.get(s).map(|d| &**d)
    }

    /// Copies rows `from..from + n` of every wanted slot into rows `to..to + n` of `out`.
    fn copy_rows(&self, from: usize, to: usize, n: usize, out: &mut [&mut [u8]]) {
        for (s, dst) in out.iter_mut().enumerate() {
            if dst.is_empty() {
                continue;
            }
            let b = self.slot_bytes[s];
            dst[to * b..(to + n) * b].copy_from_slice(&self.data[s][from * b..(from + n) * b]);
        }
    }

    /// Asks the CPU for row `from`'s id and the bytes of every slot `out` wants.
    #[inline(always)]
    fn prefetch_row(&self, from: usize, out: &[&mut [u8]]) {
        if from >= self.ids.len() {
            return;
        }
        crate::prefetch::prefetch_range(&self.ids[from] as *const u64 as u64, 8);
        for (s, dst) in out.iter().enumerate() {
            if dst.is_empty() {
                continue;
            }
            let b = self.slot_bytes[s];
            crate::prefetch::prefetch(&self.data[s][from * b..(from + 1) * b]);
        }
    }

    fn gone(&self, what: String) -> Error {
        Error::Table {
            table: self.schema.name.clone(),
            message: what,
        }
    }
}

impl SparseTable for ColumnTable<'_> {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }

    fn len(&self) -> usize {
        self.ids.len()
    }

    fn snapshot(&self) -> Result<Box<dyn TableSnapshot + '_>> {
        // The table is immutable: it is its own snapshot.
        Ok(Box::new(ColumnSnapshot { table: self }))
    }

    /// Immutable, so any snapshot shows one moment.
    fn point_in_time(&self) -> bool {
        true
    }
}

/// A snapshot over a borrowed table (its own snapshot) or an owned one ([`ColumnTable::into_snapshot`]).
struct ColumnSnapshot<T> {
    table: T,
}

impl<'c, T: std::ops::Deref<Target = ColumnTable<'c>> + Send + Sync> TableSnapshot
    for ColumnSnapshot<T>
{
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        crate::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.table.ids.len().div_ceil(PART_ROWS).max(1)
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        let t: &ColumnTable<'c> = &self.table;
        let start = part.saturating_mul(PART_ROWS).min(t.ids.len());
        let end = start.saturating_add(PART_ROWS).min(t.ids.len());
        let max_rows = max_rows.max(1);
        let mut handles = Vec::with_capacity(max_rows.min(end - start));
        let mut r = start;
        while r < end {
            let n = max_rows.min(end - r);
            handles.clear();
            handles.extend(r as u64..(r + n) as u64);
            // Values are handed out in place: the rows are already back to back.
            let slots: Vec<&[u8]> = if with_values {
                (0..t.schema.slots.len())
                    .map(|s| &t.data[s][r * t.slot_bytes[s]..(r + n) * t.slot_bytes[s]])
                    .collect()
            } else {
                Vec::new()
            };
            visit(RowChunk {
                ids: &t.ids[r..r + n],
                handles: &handles,
                slots: &slots,
            })?;
            r += n;
        }
        Ok(())
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let t: &ColumnTable<'c> = &self.table;
        let by_id = t
            .by_id
            .get_or_init(|| t.ids.iter().enumerate().map(|(r, &id)| (id, r)).collect());
        for (r, id) in ids.iter().enumerate() {
            let &from = by_id.get(id).ok_or_else(|| {
                t.gone(format!(
                    "no row has id {}",
                    t.schema.key_dtype.format_id(*id)
                ))
            })?;
            t.copy_rows(from, r, 1, out);
        }
        Ok(())
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let t: &ColumnTable<'c> = &self.table;
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        // Every row up to PREFETCH_AHEAD past the one being copied has been asked for.
        let mut asked = 0;
        let mut r = 0;
        while r < handles.len() {
            while asked < handles.len().min(r + PREFETCH_AHEAD) {
                t.prefetch_row(handles[asked] as usize, out);
                asked += 1;
            }
            // A handle is a row index; checked, so that even a broken caller cannot read past
            // the arrays or pair an id with another id's row.
            let from = handles[r] as usize;
            if t.ids.get(from) != Some(&ids[r]) {
                return Err(t.gone(format!(
                    "handle {} does not hold id {}",
                    handles[r],
                    t.schema.key_dtype.format_id(ids[r])
                )));
            }
            // Rows adjacent here and in the arrays are copied as one run.
            let mut n = 1;
            while r + n < handles.len()
                && handles[r + n] == handles[r] + n as u64
                && t.ids.get(from + n) == Some(&ids[r + n])
            {
                n += 1;
            }
            t.copy_rows(from, r, n, out);
            r += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;
    use crate::dtype::Dtype;

    fn slots() -> Vec<SlotSpec> {
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![2]),
            SlotSpec::new("freq", Dtype::I64, vec![]),
        ]
    }

    /// Row `r` holds id `ids[r]`, embedding bytes all equal to the id's low byte, freq = id.
    fn table_of(ids: &[u64]) -> ColumnTable<'static> {
        let emb = ids.iter().flat_map(|&i| [i as u8; 8]).collect();
        let freq = ids.iter().flat_map(|&i| i.to_le_bytes()).collect();
        ColumnTable::new("t", KeyDtype::U64, slots(), ids.to_vec(), vec![emb, freq]).unwrap()
    }

    fn assert_rows(ids: &[u64], emb: &[u8], freq: &[u8]) {
        for (r, &id) in ids.iter().enumerate() {
            assert_eq!(emb[r * 8..r * 8 + 8], [id as u8; 8], "row {r}");
            assert_eq!(freq[r * 8..r * 8 + 8], id.to_le_bytes(), "row {r}");
        }
    }

    #[test]
    fn wrong_buffer_sizes_are_named() {
        let err = ColumnTable::new(
            "t",
            KeyDtype::U64,
            slots(),
            vec![1, 2],
            vec![vec![0; 16], vec![0; 15]],
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("\"freq\"") && err.contains("15 bytes"),
            "{err}"
        );
        let err = ColumnTable::new("t", KeyDtype::U64, slots(), vec![1], vec![vec![0; 8]])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("1 slot buffers for 2 slots"), "{err}");
    }

    #[test]
    fn a_borrowed_table_reads_as_the_owned_one_and_checks_the_same() {
        let ids: Vec<u64> = (0..300).map(|i| i * 7 + 1).collect();
        let owned = table_of(&ids);
        let data: Vec<&[u8]> = (0..2).map(|s| owned.slot_data(s).unwrap()).collect();
        let borrowed = ColumnTable::borrowed("t", KeyDtype::U64, slots(), &ids, data).unwrap();
        let snap = borrowed.snapshot().unwrap();
        let (mut seen, mut handles) = (Vec::new(), Vec::new());
        snap.scan(64, false, &mut |c| {
            seen.extend_from_slice(c.ids);
            handles.extend_from_slice(c.handles);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, ids);
        let (mut emb, mut freq) = (vec![0u8; 8 * ids.len()], vec![0u8; 8 * ids.len()]);
        // SAFETY: the handles came from this snapshot's scan, with these ids.
        unsafe { snap.read_rows_by_handle(&seen, &handles, &mut [&mut emb, &mut freq]) }.unwrap();
        assert_rows(&seen, &emb, &freq);
        let short = vec![0u8; 7];
        let err = ColumnTable::borrowed("t", KeyDtype::U64, slots(), &ids, vec![&short, &short])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("\"embedding\" has 7 bytes"), "{err}");
    }

    #[test]
    fn handles_that_do_not_match_their_ids_are_refused() {
        let t = table_of(&[5, 6, 7]);
        let snap = t.snapshot().unwrap();
        let (mut emb, mut freq) = (vec![0u8; 16], vec![0u8; 16]);
        for handles in [[0u64, 9], [1, 1], [u64::MAX, 1]] {
            // SAFETY: an implementation that checks its handles; the point of the test.
            let r =
                unsafe { snap.read_rows_by_handle(&[5, 6], &handles, &mut [&mut emb, &mut freq]) };
            assert!(r.is_err(), "{handles:?}");
        }
        let err = snap
            .read_rows(&[8], &mut [&mut emb[..8], &mut freq[..8]])
            .unwrap_err();
        assert!(err.to_string().contains("no row has id 8"), "{err}");
        // A bad handle among many: asked for ahead of its turn, then refused in it.
        let ids: Vec<u64> = (0..100).collect();
        let t = table_of(&ids);
        let snap = t.snapshot().unwrap();
        let mut handles: Vec<u64> = (0..100).rev().collect();
        let want: Vec<u64> = handles.clone();
        handles[40] = u64::MAX / 2;
        let (mut emb, mut freq) = (vec![0u8; 800], vec![0u8; 800]);
        // SAFETY: as above.
        let r = unsafe { snap.read_rows_by_handle(&want, &handles, &mut [&mut emb, &mut freq]) };
        assert!(r.is_err());
    }

    proptest! {
        #[test]
        fn reads_by_handle_and_by_id_give_each_ids_own_row(
            ids in vec(any::<u64>(), 0..300),
            picks in vec(any::<prop::sample::Index>(), 0..200),
            max_rows in 1usize..50,
        ) {
            let t = table_of(&ids);
            let snap = t.snapshot().unwrap();
            let (mut seen, mut handles) = (Vec::new(), Vec::new());
            for p in 0..=snap.scan_parts() {
                snap.scan_part(p, max_rows, true, &mut |c| {
                    assert!(c.ids.len() <= max_rows);
                    assert_rows(c.ids, c.slots[0], c.slots[1]);
                    seen.extend_from_slice(c.ids);
                    handles.extend_from_slice(c.handles);
                    Ok(())
                }).unwrap();
            }
            prop_assert_eq!(&seen, &ids);

            // Any selection of scanned rows, in any order, runs of adjacent rows included.
            let sel: Vec<usize> = if ids.is_empty() { Vec::new() } else { picks.iter().map(|i| i.index(ids.len())).collect() };
            let want: Vec<u64> = sel.iter().map(|&r| ids[r]).collect();
            let sel_handles: Vec<u64> = sel.iter().map(|&r| handles[r]).collect();
            let (mut emb, mut freq) = (vec![0u8; 8 * sel.len()], vec![0u8; 8 * sel.len()]);
            // SAFETY: the handles came from this snapshot's scan, with these ids.
            unsafe { snap.read_rows_by_handle(&want, &sel_handles, &mut [&mut emb, &mut freq]) }.unwrap();
            assert_rows(&want, &emb, &freq);

            let mut unique = ids.clone();
            unique.sort_unstable();
            unique.dedup();
            if unique.len() == ids.len() {
                let (mut emb, mut freq) = (vec![0u8; 8 * want.len()], vec![0u8; 8 * want.len()]);
                snap.read_rows(&want, &mut [&mut emb, &mut freq]).unwrap();
                assert_rows(&want, &emb, &freq);
            }
        }
    }
}

//! Sparse tables: the trait a trainer's hashtable implements, [`EmbeddingTable`], a ready one, and
//! [`ColumnTable`], read-only rows already in arrays (a loaded checkpoint being resharded).
//!
//! A table has 64-bit ids and, per id, one row of every *slot*: the embedding, optimizer state
//! (Adagrad accumulator, Adam m and v), counters. saver reads a table in two passes:
//!
//! 1. [`SparseTable::snapshot`] fixes the set of rows to save. The planner scans the snapshot's ids
//!    (and, only when a row filter needs them, its slot values) to decide which rows to keep and
//!    where they go. From then on, the set of saved rows is fixed: rows inserted later are not saved,
//!    rows removed later are still readable through the snapshot.
//! 2. The writer asks the snapshot for the rows of a bounded list of ids at a time
//!    ([`TableSnapshot::read_rows`]), all slots of a row together, so a saved row is never torn:
//!    its embedding and its optimizer state come from the same moment.
//!
//! ## Writes during a save
//!
//! Trainers keep writing while a save runs. Every snapshot must, whatever is written meanwhile,
//! give each row whole (never torn) and keep every row its scan gave readable until it is dropped,
//! removed rows included: a row it can no longer read fails the save. A snapshot is
//! *point-in-time* ([`SparseTable::point_in_time`], reported per table by the save) if it also
//! gives every row as it was at one moment, its snapshot's, and exactly the rows alive then. Two
//! ways to get there:
//!
//! * copy-on-write, as [`EmbeddingTable`] does: register the snapshot with the process-wide clock
//!   of [`moment`], and in every write, under the row's lock, keep the row's pre-image (once) when
//!   [`moment::has_passed`] says the snapshot's moment has come. The trainer pays a check per
//!   write, and memory for the rows written during the save. Tables registered in one
//!   [`moment::at_one_moment`] group (a save's tables are) share one moment exactly.
//! * copy the rows at snapshot time, under the table's own lock, into a [`ColumnTable`] and return
//!   [`ColumnTable::into_snapshot`]: simple, for small tables, at the cost of one copy of the
//!   table and of holding writers off while it is made.
//!
//! Trainer state saved with a checkpoint belongs to the moment the trainer fixed it at: pass it
//! with the save call (or `save_async`'s options) from the thread that runs the
//! training steps, between two steps.

pub mod bucket_order;
mod columns;
mod embedding;
pub mod moment;
mod schema;
pub mod workers;

pub use bucket_order::{BucketRows, VisitRows};
pub use columns::ColumnTable;
pub use embedding::{EmbeddingTable, IdHashBuilder, IdHasher, RowMut};
pub use schema::TableSchema;
pub use workers::WorkerTable;

use serde::{Deserialize, Serialize};

use crate::dtype::{Dtype, KeyDtype};
use crate::error::{Error, Result};
use crate::naming::check_slot_name;
use crate::tensor::byte_len;

/// One slot of a table: its name, element type and the shape of one row of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlotSpec {
    /// Slot name, e.g. `embedding`, `adagrad`, `freq`.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape of one row: `[64]` for a 64-wide embedding, `[]` for a scalar counter.
    pub shape: Vec<u64>,
}

impl SlotSpec {
    /// A slot spec.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<u64>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Bytes of one row of this slot, checked.
    pub fn row_bytes(&self) -> Result<u64> {
        byte_len(&self.name, self.dtype, &self.shape)
    }
}

/// Validates a table's slot list: names legal and distinct, row sizes whole bytes and sane.
/// Returns each slot's row byte size.
#[doc(hidden)]
pub fn validate_slots(table: &str, slots: &[SlotSpec]) -> Result<Vec<usize>> {
    let mut sizes = Vec::with_capacity(slots.len());
    for (i, slot) in slots.iter().enumerate() {
        check_slot_name(&slot.name)?;
        if slots[..i].iter().any(|s| s.name == slot.name) {
            return Err(Error::DuplicateName {
                what: "slot",
                name: format!("{table}/{}", slot.name),
            });
        }
        let bytes = byte_len(&format!("{table}/{}", slot.name), slot.dtype, &slot.shape)?;
        // A single row over 1 GiB is certainly a mistake (a transposed shape, say), and refusing it
        // keeps every buffer sized from a row count bounded.
        if bytes > 1 << 30 {
            return Err(Error::BadShape {
                name: format!("{table}/{}", slot.name),
                shape: slot.shape.clone(),
                dtype: slot.dtype.name().into(),
                why: "makes one row larger than 1 GiB",
            });
        }
        sizes.push(bytes as usize);
    }
    Ok(sizes)
}

/// A bounded run of rows handed out by [`TableSnapshot::scan`]: ids, and when asked for, the
/// matching rows of every slot.
#[derive(Debug)]
pub struct RowChunk<'a> {
    /// Raw id bits, one per row.
    pub ids: &'a [u64],
    /// Either empty, or one opaque handle per row that the snapshot gets back, with its id, in
    /// [`TableSnapshot::read_rows_by_handle`] (e.g. the row's address, to skip a second lookup).
    pub handles: &'a [u64],
    /// `slots[s]` holds `ids.len()` rows of slot `s`, back to back; empty when values were not asked for.
    pub slots: &'a [&'a [u8]],
}

/// One row as a row filter sees it.
#[derive(Clone, Copy, Debug)]
pub struct RowView<'a> {
    table: &'a str,
    key_dtype: KeyDtype,
    id: u64,
    specs: &'a [SlotSpec],
    values: &'a [&'a [u8]],
}

impl<'a> RowView<'a> {
    /// A view of one row; `values[s]` is the row's bytes of slot `s`.
    pub fn new(
        table: &'a str,
        key_dtype: KeyDtype,
        id: u64,
        specs: &'a [SlotSpec],
        values: &'a [&'a [u8]],
    ) -> Self {
        Self {
            table,
            key_dtype,
            id,
            specs,
            values,
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.table
    }

    /// The id's raw bits.
    pub fn id_bits(&self) -> u64 {
        self.id
    }

    /// The id as a signed number (meaningful for I64 tables).
    pub fn id_i64(&self) -> i64 {
        self.id as i64
    }

    /// The table's key dtype.
    pub fn key_dtype(&self) -> KeyDtype {
        self.key_dtype
    }

    /// The raw bytes of a slot of this row, or `None` if the table has no such slot.
    pub fn slot_bytes(&self, slot: &str) -> Option<&'a [u8]> {
        let i = self.specs.iter().position(|s| s.name == slot)?;
        self.values.get(i).copied()
    }

    /// A scalar slot as `f64`, whatever its numeric dtype (for thresholds such as `freq >= 5`).
    /// `None` if the slot is missing, not a one-element row, or not a plain numeric dtype.
    pub fn scalar(&self, slot: &str) -> Option<f64> {
        let i = self.specs.iter().position(|s| s.name == slot)?;
        let spec = &self.specs[i];
        if crate::tensor::element_count(&spec.shape) != Some(1) {
            return None;
        }
        scalar_as_f64(spec.dtype, self.values.get(i)?)
    }

    /// A slot as `f32` values, if its dtype is F32.
    pub fn f32s(&self, slot: &str) -> Option<Vec<f32>> {
        let i = self.specs.iter().position(|s| s.name == slot)?;
        if self.specs[i].dtype != Dtype::F32 {
            return None;
        }
        Some(
            self.values[i]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    }
}

/// Reads one little-endian element of a plain numeric dtype as `f64`.
pub(crate) fn scalar_as_f64(dtype: Dtype, b: &[u8]) -> Option<f64> {
    fn arr<const N: usize>(b: &[u8]) -> Option<[u8; N]> {
        b.get(..N)?.try_into().ok()
    }
    Some(match dtype {
        Dtype::BOOL | Dtype::U8 => f64::from(*b.first()?),
        Dtype::I8 => f64::from(*b.first()? as i8),
        Dtype::I16 => f64::from(i16::from_le_bytes(arr(b)?)),
        Dtype::U16 => f64::from(u16::from_le_bytes(arr(b)?)),
        Dtype::I32 => f64::from(i32::from_le_bytes(arr(b)?)),
        Dtype::U32 => f64::from(u32::from_le_bytes(arr(b)?)),
        Dtype::I64 => i64::from_le_bytes(arr(b)?) as f64,
        Dtype::U64 => u64::from_le_bytes(arr(b)?) as f64,
        Dtype::F32 => f64::from(f32::from_le_bytes(arr(b)?)),
        Dtype::F64 => f64::from_le_bytes(arr(b)?),
        _ => return None,
    })
}

/// A sparse embedding table, as saver sees it. Implement this for your trainer's hashtable.
pub trait SparseTable: Send + Sync {
    /// The table's name, key dtype and slots.
    fn schema(&self) -> &TableSchema;
    /// The table's name; unique within a model. No `/`, `:` or control characters.
    fn name(&self) -> &str {
        &self.schema().name
    }
    /// Whether ids are signed or unsigned.
    fn key_dtype(&self) -> KeyDtype {
        self.schema().key_dtype
    }
    /// The slots every row has, in a fixed order.
    fn slots(&self) -> &[SlotSpec] {
        &self.schema().slots
    }
    /// Current number of rows (a hint: it may change while training runs).
    fn len(&self) -> usize;
    /// Whether the table has no rows (a hint, like [`Self::len`]).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fixes the set of rows a save will write. See the module docs for the contract.
    fn snapshot(&self) -> Result<Box<dyn TableSnapshot + '_>>;
    /// Whether [`Self::snapshot`] is point-in-time: every row it gives is the row's value at one
    /// moment (the snapshot's), and every row alive at that moment is given, however the table
    /// is written to meanwhile. The save reports it per table ([`TableSemantics`]). Default
    /// false: rows are read as the save reaches them.
    fn point_in_time(&self) -> bool {
        false
    }
    /// The table's record of its changes, if it keeps one ([`ChangeTracking`]): what lets a
    /// delta save write the rows changed since its parent without comparing every row with the
    /// parent's. Default `None`: a delta save compares rows.
    fn change_tracking(&self) -> Option<&dyn ChangeTracking> {
        None
    }
    /// The table as rows in storage order, if it gives them so as it is ([`BucketRows`]: a
    /// table read from files). A delta save then compares it with its parent as it reads it, in
    /// bounded memory, instead of sorting its ids in memory first. Default `None`.
    fn in_bucket_order(&self) -> Option<&dyn BucketRows> {
        None
    }
}

/// A table's record of which rows changed, and which ids were removed, since a save.
///
/// Changes are dated by *tokens*: the generations of the process-wide clock of [`moment`]. A
/// point-in-time snapshot shows its moment, the generation it registered under; a write stamped
/// with the clock (read under the row's lock, as [`moment::has_passed`] is) is before the moment of
/// every later generation and after that of every earlier or equal one. So "written at or after
/// token `g`" is exact relative to the snapshot of generation `g`: the rows that snapshot saved
/// as they were, and every write it did not see.
///
/// The save tells the table when a save of it commits ([`Self::committed`]), or, when the save
/// wrote the table but another process or call commits it, that it was written
/// ([`Self::written`]); a later delta save whose parent is that save asks for the rows written
/// since its token ([`Self::baseline_of`]), instead of comparing.
pub trait ChangeTracking: Send + Sync {
    /// The last committed save of the table this process knows of: its save id and the token of
    /// its snapshot. `None`: none since the table began tracking.
    fn baseline(&self) -> Option<(String, u64)>;
    /// The token of this table's snapshot in save `save_id`, which the caller found committed
    /// (it is the parent of a delta), if the table knows every change since that token: the
    /// save is its [`Self::baseline`], or a save that wrote the table ([`Self::written`]) and
    /// becomes the baseline now. `None`: the delta compares rows instead. The default knows only
    /// the baseline.
    fn baseline_of(&self, save_id: &str) -> Option<u64> {
        self.baseline()
            .filter(|(id, _)| id == save_id)
            .map(|(_, token)| token)
    }
    /// The token of the newest snapshot of the table (its generation).
    fn last_snapshot(&self) -> u64;
    /// A point-in-time snapshot of the rows written at or after token `since` (whole rows, as
    /// they were at the snapshot's moment), and the snapshot's own token.
    fn changed_since(&self, since: u64) -> Result<(Box<dyn TableSnapshot + '_>, u64)>;
    /// About how many rows [`Self::changed_since`] gives now (a hint for sizing; default 0).
    fn changed_hint(&self) -> usize {
        0
    }
    /// The ids removed at or after token `since` and before token `until`, ascending. An id
    /// removed and inserted again may be listed: its row, among the changed rows, wins.
    fn removed_between(&self, since: u64, until: u64) -> Vec<u64>;
    /// A save whose snapshot of the table had token `token` committed: `Some(save_id)` if it
    /// holds every row of the table as of that token, `None` if it does not (a row filter
    /// dropped some), which leaves no baseline.
    fn committed(&self, save_id: Option<&str>, token: u64);
    /// A save whose snapshot of the table had token `token` wrote every row of it durably, and
    /// did not see the commit (another process or call of the save commits): if a later delta
    /// names `save_id` as its parent, the save did commit, and [`Self::baseline_of`] takes it as
    /// the baseline then. The default forgets it (the delta compares).
    fn written(&self, save_id: &str, token: u64) {
        let _ = (save_id, token);
    }
}

/// What a save's rows of one table show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableSemantics {
    /// Every saved row is its value at one moment, and every row alive then is saved.
    PointInTime,
    /// Each row is read when the save reaches it: rows written during the save may show values
    /// from different moments (never torn within a row).
    AsRead,
}

/// [`TableSnapshot::scan`] of a snapshot that divides its rows into parts: every part in turn.
/// What a snapshot implementing [`TableSnapshot::scan_part`] returns from `scan`.
#[doc(hidden)]
pub fn scan_every_part(
    snapshot: &dyn TableSnapshot,
    max_rows: usize,
    with_values: bool,
    visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
) -> Result<()> {
    (0..snapshot.scan_parts()).try_for_each(|p| snapshot.scan_part(p, max_rows, with_values, visit))
}

/// A consistent view of a table's row set, taken by [`SparseTable::snapshot`].
pub trait TableSnapshot: Send + Sync {
    /// Visits every id of the snapshot exactly once, at most `max_rows` at a time. With
    /// `with_values`, each chunk also carries every slot's rows (row filters look at them);
    /// without, `RowChunk::slots` may be empty and the implementation should not copy rows.
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()>;

    /// Into how many parts [`Self::scan_part`] divides the rows. Planning scans the parts
    /// concurrently, so a table with billions of rows is not scanned by one thread. Default 1.
    fn scan_parts(&self) -> usize {
        1
    }

    /// Visits every id of part `part` (below [`Self::scan_parts`]) exactly once, like
    /// [`Self::scan`]; the parts together visit every id of the snapshot exactly once, and
    /// different parts may be scanned at the same time from different threads. The default, for
    /// one part, is [`Self::scan`].
    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        if part == 0 {
            self.scan(max_rows, with_values, visit)
        } else {
            Ok(())
        }
    }

    /// Lists again the rows whose bucket is in `buckets`: pushes each such id, and the handle
    /// [`Self::scan`] produced with it, to `ids` and `handles`, in any order. Returns false, and
    /// pushes nothing, when the snapshot cannot list a bucket range without a whole scan (the
    /// default). Asked with an empty range before a plan's scan, to learn whether it can.
    ///
    /// A plan past its memory (`PlanOptions::plan_memory`) asks a snapshot that can for each
    /// unit's rows when it writes them, instead of moving every scanned id and handle to its
    /// spill store and back: tables read from files grouped by bucket answer from what the write
    /// reads anyway. The answer must list exactly the rows the scan produced in those buckets.
    fn rows_in_buckets(
        &self,
        buckets: std::ops::Range<u32>,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> Result<bool> {
        let _ = (buckets, ids, handles);
        Ok(false)
    }

    /// Copies the rows of `ids` (all ids this snapshot's scan produced) into `out`: `out[s]` has
    /// room for exactly `ids.len()` rows of slot `s`, or is empty when slot `s` is not wanted. All slots of one row must come from the same
    /// moment. An id the snapshot cannot produce is an error, never a silently zeroed row. A save
    /// asks for each row once, and a snapshot may refuse to give a row a second time (an error,
    /// never a later value): [`EmbeddingTable`]'s frees what it kept of a row once read.
    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> Result<()>;

    /// [`Self::read_rows`], given also the handle [`Self::scan`] produced with each id (or no
    /// handles at all, `handles` empty). Tables whose handles locate rows directly make the save's
    /// second pass over rows a plain sequence of memory reads; the default ignores handles.
    ///
    /// # Safety
    /// `handles` is empty, or `handles[i]` is the handle this same snapshot's scan produced with
    /// `ids[i]`: an implementation may dereference it as an address.
    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let _ = handles;
        self.read_rows(ids, out)
    }

    /// The most bytes of pre-images kept at once for this snapshot's moment so far: what
    /// copy-on-write cost this save in memory (reported as
    /// `SaveReport::copy_on_write_peak_bytes`). Default 0, for snapshots that keep none.
    fn copy_on_write_peak(&self) -> u64 {
        0
    }

    /// Called once every row the save needs has been read, before the save commits: a snapshot
    /// of stored rows checks here whatever it could not check as it read (the checksums of
    /// tensors read only in part), so that bad input never becomes a checkpoint that verifies.
    /// Default: nothing to check.
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

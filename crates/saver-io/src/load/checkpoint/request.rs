//! One load request for both kinds of table: [`LoadRequest`], read by [`Checkpoint::load`].
//!
//! A request names where a load's hashed-table rows go (new tables, arrays, the caller's sinks,
//! or nowhere), which dense tensors it takes (those its [`LoadOptions`] select), and its
//! row-range targets (the caller's buffers by row and column range, a trainer's
//! [`RowRangeTable`], or whole tables into memory of their own). The whole request is read from
//! one save: every target's checks that need no data run before the first byte lands, and a
//! checkpoint replaced while it is read is read again from the start, every target with it
//! ([`Checkpoint::on_latest`]), so that no target holds rows of one save beside another's.

use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

use saver_core::manifest::{RowSlotManifest, TableManifest};
use saver_core::{RowRangeTable, Shard};

use super::row_range::{LoadedRowTable, RowsInto, RowsLoaded};
use super::Checkpoint;
use crate::error::Result;
use crate::load::arrays::TableColumns;
use crate::load::restore::{LoadOptions, LoadReport, LoadedDense, RestoredShard, TableSink};

/// Which sink a hashed table's rows go to, by its entry in the manifest; `None` skips it.
pub type SinkFor<'b> = dyn Fn(&TableManifest) -> Option<&'b dyn TableSink> + 'b;

/// Where a request's hashed-table rows go.
enum Hashed<'b> {
    /// Nowhere: only dense tensors (if the options select any) and row-range targets.
    Skip,
    /// Into new tables ([`Loaded::shards`]).
    Tables,
    /// Into arrays ([`Loaded::columns`]).
    Columns,
    /// Into the caller's sinks, for target shard `shard`.
    Sinks {
        shard: u32,
        sink_for: &'b SinkFor<'b>,
    },
}

/// Rows of one row-range table into the caller's buffers.
#[derive(Debug)]
struct RowsTarget<'b> {
    table: String,
    rows: Range<u64>,
    into: Vec<RowsInto<'b>>,
}

/// What one [`Checkpoint::load`] reads, and where it puts it. Start from the hashed tables'
/// target ([`Self::tables`], [`Self::columns`], [`Self::sinks`], or [`Self::dense_only`] /
/// [`Self::rows_only`] for none), then add row-range targets.
///
/// ```
/// use saver_core::{RowRangeChunk, SaveInput, Shard};
/// use saver_io::{save, Checkpoint, LoadOptions, LoadRequest, RowsInto, SaveOptions};
///
/// # let dir = tempfile::tempdir()?;
/// let w: Vec<f32> = (0..40).map(|v| v as f32).collect();
/// let input = SaveInput::new()
///     .row_chunk(RowRangeChunk::from_f32("item", "weight", vec![10, 4], &w)?)
///     .row_chunk(RowRangeChunk::from_f32("user", "weight", vec![10, 4], &w)?);
/// save(dir.path(), input, &SaveOptions::default())?;
/// let ck = Checkpoint::open(dir.path())?;
/// // Rows 2..4 of `item` into our buffer, and half of `user` into memory of its own: one save.
/// let mut out = vec![0f32; 2 * 4];
/// let loaded = ck.load(
///     LoadRequest::rows_only()
///         .rows("item", 2..4, [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut out))])
///         .row_tables(Shard { index: 1, count: 2 }),
/// )?;
/// assert_eq!(out[0], 8.0);
/// assert_eq!(loaded.row_tables.len(), 2);
/// assert_eq!(loaded.row_tables[1].rows, 5..10);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LoadRequest<'b> {
    options: Option<&'b LoadOptions>,
    hashed: Hashed<'b>,
    rows: Vec<RowsTarget<'b>>,
    into_tables: Vec<&'b RowRangeTable>,
    row_tables: Option<Shard>,
}

impl std::fmt::Debug for LoadRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hashed = match &self.hashed {
            Hashed::Skip => "none".to_string(),
            Hashed::Tables => "new tables".to_string(),
            Hashed::Columns => "arrays".to_string(),
            Hashed::Sinks { shard, .. } => format!("sinks of shard {shard}"),
        };
        f.debug_struct("LoadRequest")
            .field("options", &self.options)
            .field("hashed", &hashed)
            .field("rows", &self.rows)
            .field(
                "into_tables",
                &self
                    .into_tables
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>(),
            )
            .field("row_tables", &self.row_tables)
            .finish()
    }
}

impl<'b> LoadRequest<'b> {
    fn with(options: Option<&'b LoadOptions>, hashed: Hashed<'b>) -> Self {
        Self {
            options,
            hashed,
            rows: Vec::new(),
            into_tables: Vec::new(),
            row_tables: None,
        }
    }

    /// The hashed tables `options` selects into fresh [`EmbeddingTable`](saver_core::EmbeddingTable)s
    /// (every target shard of `options.shard_num`, or only `options.shard_index`), and its dense
    /// tensors.
    pub fn tables(options: &'b LoadOptions) -> Self {
        Self::with(Some(options), Hashed::Tables)
    }

    /// The hashed tables `options` selects into arrays (all rows, or those of
    /// `options.shard_index`), and its dense tensors.
    pub fn columns(options: &'b LoadOptions) -> Self {
        Self::with(Some(options), Hashed::Columns)
    }

    /// Target shard `shard` of `options.shard_num` into the caller's sinks: `sink_for` returns
    /// the sink for a checkpoint table, or `None` to skip it; each sink gets the slots it asks
    /// for ([`TableSink::wanted_slots`], checked against the checkpoint's before any row is
    /// read). The dense tensors `options` selects come back in [`Loaded::dense`]. A sink may hold
    /// part of the rows if the load fails: load into fresh tables and swap them in on success.
    pub fn sinks(options: &'b LoadOptions, shard: u32, sink_for: &'b SinkFor<'b>) -> Self {
        Self::with(Some(options), Hashed::Sinks { shard, sink_for })
    }

    /// No hashed table; the dense tensors `options` selects.
    pub fn dense_only(options: &'b LoadOptions) -> Self {
        Self::with(Some(options), Hashed::Skip)
    }

    /// No hashed table and no dense tensor: only the row-range targets added.
    pub fn rows_only() -> Self {
        Self::with(None, Hashed::Skip)
    }

    /// Rows `rows` of row-range table `table` into the caller's buffers, one per slot wanted
    /// ([`RowsInto`]): only the bytes of the chunks the range overlaps, whatever split the
    /// checkpoint was saved with, each checked against its chunk's CRC32s.
    pub fn rows(
        mut self,
        table: &str,
        rows: Range<u64>,
        into: impl IntoIterator<Item = RowsInto<'b>>,
    ) -> Self {
        self.rows.push(RowsTarget {
            table: table.to_string(),
            rows,
            into: into.into_iter().collect(),
        });
        self
    }

    /// A trainer's row-range table, filled with its rows from the checkpoint's table of its
    /// name, each block of each slot read straight into its memory. Every slot of `table` must
    /// be in the checkpoint, of the same dtype and row shape, in a table of the same rows.
    pub fn into_table(mut self, table: &'b RowRangeTable) -> Self {
        self.into_tables.push(table);
        self
    }

    /// Every row-range table's rows of `shard` (rows `rows·j/M..rows·(j+1)/M`,
    /// [`Shard::rows_of`]; [`Shard::WHOLE`] for all), each slot whole, into memory of their own
    /// ([`Loaded::row_tables`]).
    pub fn row_tables(mut self, shard: Shard) -> Self {
        self.row_tables = Some(shard);
        self
    }
}

/// What a [`Checkpoint::load`] read: each field holds what its request asked for, and is empty
/// otherwise.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Loaded {
    /// New tables of each target shard ([`LoadRequest::tables`]), in order.
    pub shards: Vec<RestoredShard>,
    /// Arrays ([`LoadRequest::columns`]).
    pub columns: Vec<TableColumns>,
    /// Dense tensors, in name order.
    pub dense: Vec<LoadedDense>,
    /// Whole row-range tables ([`LoadRequest::row_tables`]).
    pub row_tables: Vec<LoadedRowTable>,
    /// The hashed tables' and dense tensors' figures.
    pub report: LoadReport,
    /// The row-range targets' figures.
    pub rows: RowsLoaded,
    /// The step the checkpoint was saved at, if any.
    pub step: Option<u64>,
    /// The save it read.
    pub save_id: String,
}

impl Checkpoint {
    /// Reads `request`: every target it names, from this one save. The checks of every
    /// row-range target (tables, rows, slots, columns, buffer sizes) and of every sink run
    /// before the first byte lands. If the checkpoint is replaced while it is read, the whole
    /// request is read again from the one there now (see [`Self::on_latest`]; not for a
    /// [`Self::pinned`] checkpoint, whose load fails instead); the caller's buffers are then
    /// filled again from the start.
    pub fn load(&self, request: LoadRequest<'_>) -> Result<Loaded> {
        let request = RefCell::new(request);
        self.on_latest(|c| c.load_once(&mut request.borrow_mut()))
    }

    fn load_once(&self, request: &mut LoadRequest<'_>) -> Result<Loaded> {
        let slots = request
            .rows
            .iter()
            .map(|t| self.check_rows(&t.table, &t.rows, &t.into))
            .collect::<Result<Vec<_>>>()?;
        for t in &request.into_tables {
            self.check_into_table(t)?;
        }
        let none = LoadOptions {
            load_dense: false,
            ..LoadOptions::default()
        };
        let opts = request.options.unwrap_or(&none);
        let mut loaded = Loaded {
            step: self.manifest().step,
            save_id: self.manifest().save_id.clone(),
            ..Loaded::default()
        };
        match &request.hashed {
            Hashed::Tables => {
                let r = self.restore_once(opts)?;
                (loaded.shards, loaded.dense, loaded.report) = (r.shards, r.dense, r.report);
            }
            Hashed::Columns => {
                let c = self.load_columns_once(opts)?;
                (loaded.columns, loaded.dense, loaded.report) = (c.tables, c.dense, c.report);
            }
            Hashed::Sinks { shard, sink_for } => {
                (loaded.report, loaded.dense) =
                    self.timed_with_dense(opts, || self.load_into_once(*shard, opts, *sink_for))?;
            }
            Hashed::Skip => {
                (loaded.report, loaded.dense) =
                    self.timed_with_dense(opts, || Ok(LoadReport::default()))?;
            }
        }
        loaded.rows = self.fill_rows(&mut request.rows, &slots)?;
        for t in &request.into_tables {
            loaded.rows += self.load_into_table_once(t)?;
        }
        if let Some(shard) = request.row_tables {
            let (tables, read) = self.load_row_tables_once(shard)?;
            loaded.row_tables = tables;
            loaded.rows += read;
        }
        Ok(loaded)
    }

    /// Reads rows `rows` of row-range table `table` into the caller's buffers, one per slot
    /// wanted ([`RowsInto`]): only the bytes of the chunks the range overlaps, whatever split
    /// the checkpoint was saved with, each checked against its chunk's CRC32s. The shorthand of
    /// [`Self::load`] with [`LoadRequest::rows`].
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
        let into = into.iter_mut().map(|t| RowsInto {
            slot: t.slot.clone(),
            cols: t.cols.clone(),
            out: &mut *t.out,
        });
        Ok(self
            .load(LoadRequest::rows_only().rows(table, rows, into))?
            .rows)
    }

    /// `load` beside the dense tensors `opts` selects ([`Self::with_dense`]), its report
    /// finished with the duration and the bytes read of both.
    fn timed_with_dense(
        &self,
        opts: &LoadOptions,
        load: impl FnOnce() -> Result<LoadReport>,
    ) -> Result<(LoadReport, Vec<LoadedDense>)> {
        let (start, fetched) = (Instant::now(), self.bytes_fetched());
        let ((), report, dense) = self.with_dense(opts, || Ok(((), load()?)))?;
        Ok((self.finished(report, start, fetched), dense))
    }

    /// Fills every caller-buffer target of a request, checked already (`slots`: each target's
    /// slots), all tables at once, so that no core waits at the end of one table's reads while
    /// another table's are still to come.
    fn fill_rows(
        &self,
        targets: &mut [RowsTarget<'_>],
        slots: &[Vec<&RowSlotManifest>],
    ) -> Result<RowsLoaded> {
        use rayon::prelude::*;
        targets
            .par_iter_mut()
            .zip(slots)
            .map(|(t, slots)| self.fill_checked_rows(&t.table, &t.rows, &mut t.into, slots))
            .try_reduce(RowsLoaded::default, |mut a, b| {
                a += b;
                Ok(a)
            })
    }
}

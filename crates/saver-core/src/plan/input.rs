//! What a save is given: [`SaveInput`], the one input of a foreground save, a background save and
//! a held moment.
//!
//! Tables are given borrowed (`&table`, for a save that returns before the caller goes on) or
//! shared (`Arc`, which a background save keeps while it runs), through [`TableRef`]. A table
//! given with [`SaveInput::table`] is saved for every shard the call writes; tables given with
//! [`SaveInput::shard_table`] are the tables of one in-process worker, which holds the rows of its
//! shard: one call then saves every worker's shard at one moment, with one commit.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::plan::ForeignRows;
use crate::row_range::RowRangeChunk;
use crate::table::workers::WorkerTable;
use crate::table::SparseTable;
use crate::tensor::DenseTensor;

/// A table given to a save: borrowed for the call, or shared with it.
#[derive(Clone)]
pub enum TableRef<'a> {
    /// Borrowed: enough for [`save`](../../saver_io/fn.save.html), which returns before the
    /// caller goes on.
    Borrowed(&'a dyn SparseTable),
    /// Shared: what a background save, which outlives the call, needs.
    Shared(Arc<dyn SparseTable>),
}

impl<'a> Deref for TableRef<'a> {
    type Target = dyn SparseTable + 'a;
    fn deref(&self) -> &Self::Target {
        match self {
            TableRef::Borrowed(t) => *t,
            TableRef::Shared(t) => t.as_ref(),
        }
    }
}

impl<'a, T: SparseTable + 'a> From<&'a T> for TableRef<'a> {
    fn from(t: &'a T) -> Self {
        TableRef::Borrowed(t)
    }
}

impl<'a> From<&'a dyn SparseTable> for TableRef<'a> {
    fn from(t: &'a dyn SparseTable) -> Self {
        TableRef::Borrowed(t)
    }
}

impl<T: SparseTable + 'static> From<Arc<T>> for TableRef<'_> {
    fn from(t: Arc<T>) -> Self {
        TableRef::Shared(t)
    }
}

impl From<Arc<dyn SparseTable>> for TableRef<'_> {
    fn from(t: Arc<dyn SparseTable>) -> Self {
        TableRef::Shared(t)
    }
}

impl<'a> From<&Arc<dyn SparseTable>> for TableRef<'a> {
    fn from(t: &Arc<dyn SparseTable>) -> Self {
        TableRef::Shared(Arc::clone(t))
    }
}

/// The model to save: sparse tables and dense tensors.
///
/// In a multi-process save (one process per shard), every process passes the same tables (each
/// holding, at least, the rows of its shard) and **every dense tensor**: dense tensors are
/// replicated, and each process writes the ones the plan assigns to its shard, balanced by bytes.
/// The commit compares what each process was given (names, dtypes, shapes and a CRC32 of every
/// dense tensor's content) and fails, naming the tensor and the shards, if a dense tensor was
/// passed to some processes only, differs between them, or would not be written exactly once:
/// nothing is dropped silently.
///
/// In-process workers that each hold their shard of a table (`EmbeddingTable::for_shard`) give
/// their tables with [`Self::shard_table`]: one call saves all of them, every shard at one moment,
/// with one commit.
#[derive(Default, Clone)]
pub struct SaveInput<'a> {
    /// Sparse tables, saved for every shard the call writes.
    pub tables: Vec<TableRef<'a>>,
    /// Tables of in-process workers: `(shard, table)`, the table holding the rows of that shard.
    pub shard_tables: Vec<(u32, TableRef<'a>)>,
    /// Dense tensors: in a multi-process save, all of them in every process.
    pub dense: Vec<DenseTensor<'a>>,
    /// Chunks of row-range tables ([`crate::row_range`]): in a multi-process save, each process
    /// gives those it holds, and writes them in its shard; together they must tile every slot.
    pub row_chunks: Vec<RowRangeChunk<'a>>,
}

impl std::fmt::Debug for SaveInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveInput")
            .field(
                "tables",
                &self.tables.iter().map(|t| t.name()).collect::<Vec<_>>(),
            )
            .field(
                "shard_tables",
                &self
                    .shard_tables
                    .iter()
                    .map(|(s, t)| (s, t.name()))
                    .collect::<Vec<_>>(),
            )
            .field(
                "dense",
                &self.dense.iter().map(|d| d.name()).collect::<Vec<_>>(),
            )
            .field(
                "row_chunks",
                &self
                    .row_chunks
                    .iter()
                    .map(|c| c.values().name())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl<'a> SaveInput<'a> {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a table, borrowed (`&table`) or shared (`Arc`).
    pub fn table(mut self, table: impl Into<TableRef<'a>>) -> Self {
        self.tables.push(table.into());
        self
    }

    /// Adds the table of the in-process worker of shard `shard`: it holds that shard's rows (a
    /// row of another shard is refused, or skipped with [`ForeignRows::Skip`]). Every worker
    /// gives a table of every name, with the same key dtype and slots.
    pub fn shard_table(mut self, shard: u32, table: impl Into<TableRef<'a>>) -> Self {
        self.shard_tables.push((shard, table.into()));
        self
    }

    /// Adds a dense tensor.
    pub fn dense(mut self, tensor: DenseTensor<'a>) -> Self {
        self.dense.push(tensor);
        self
    }

    /// Adds a chunk of a row-range table.
    pub fn row_chunk(mut self, chunk: RowRangeChunk<'a>) -> Self {
        self.row_chunks.push(chunk);
        self
    }

    /// Adds `table` as it is now ([`crate::RowRangeTable::moment`]): its blocks shared, not copied, so
    /// that a background save of it copies nothing at its call.
    pub fn row_table(mut self, table: &crate::row_range::RowRangeTable) -> Result<Self> {
        self.row_chunks.extend(table.moment()?);
        Ok(self)
    }

    /// Every table given, as the save reads them: [`Self::tables`], then [`Self::shard_tables`].
    pub fn all_tables(&self) -> impl Iterator<Item = &(dyn SparseTable + 'a)> {
        self.tables
            .iter()
            .map(|t| &**t)
            .chain(self.shard_tables.iter().map(|(_, t)| &**t))
    }

    /// The same model, borrowed: no table or tensor is copied.
    pub fn view(&self) -> SaveInput<'_> {
        SaveInput {
            tables: self
                .tables
                .iter()
                .map(|t| TableRef::Borrowed(&**t))
                .collect(),
            shard_tables: self
                .shard_tables
                .iter()
                .map(|(s, t)| (*s, TableRef::Borrowed(&**t)))
                .collect(),
            dense: self.dense.iter().map(DenseTensor::view).collect(),
            row_chunks: self.row_chunks.iter().map(RowRangeChunk::view).collect(),
        }
    }

    /// The model with nothing borrowed, for a save that outlives the call: dense tensors are
    /// copied; every table must be shared (`Arc`), since a borrowed one cannot be kept.
    pub fn into_owned(self) -> Result<SaveInput<'static>> {
        let owned = |t: TableRef<'a>| match t {
            TableRef::Shared(t) => Ok(TableRef::Shared(t)),
            TableRef::Borrowed(t) => Err(Error::InvalidOption {
                option: "tables",
                why: format!(
                    "table {:?} is borrowed, and a background save outlives the call: give it \
                     as an Arc (SaveInput::table(Arc::clone(&table)))",
                    t.name()
                ),
            }),
        };
        Ok(SaveInput {
            tables: self.tables.into_iter().map(owned).collect::<Result<_>>()?,
            shard_tables: self
                .shard_tables
                .into_iter()
                .map(|(s, t)| owned(t).map(|t| (s, t)))
                .collect::<Result<_>>()?,
            dense: self
                .dense
                .into_iter()
                .map(DenseTensor::into_owned)
                .collect::<Result<_>>()?,
            row_chunks: self
                .row_chunks
                .into_iter()
                .map(RowRangeChunk::into_owned)
                .collect::<Result<_>>()?,
        })
    }

    /// The workers' tables of [`Self::shard_tables`] joined into one table per name, for a save
    /// of `shard_num` shards that writes every shard: each worker must give a table of every
    /// name, one per shard, with the same key dtype and slots. Empty when no worker tables were
    /// given.
    #[doc(hidden)]
    pub fn worker_tables(
        &self,
        shard_num: u32,
        foreign: ForeignRows,
    ) -> Result<Vec<WorkerTable<'_>>> {
        if self.shard_tables.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |why: String| Error::InvalidOption {
            option: "shard_table",
            why,
        };
        let mut by_name: BTreeMap<&str, Vec<Option<&dyn SparseTable>>> = BTreeMap::new();
        for (shard, t) in &self.shard_tables {
            if *shard >= shard_num {
                return Err(Error::ShardOutOfRange {
                    index: *shard,
                    num: shard_num,
                });
            }
            let members = by_name
                .entry(t.name())
                .or_insert_with(|| vec![None; shard_num as usize]);
            if members[*shard as usize].replace(&**t).is_some() {
                return Err(bad(format!(
                    "table {:?} was given twice for shard {shard}",
                    t.name()
                )));
            }
        }
        by_name
            .into_iter()
            .map(|(name, members)| {
                let missing: Vec<usize> = (0..members.len())
                    .filter(|&s| members[s].is_none())
                    .collect();
                if !missing.is_empty() {
                    return Err(bad(format!(
                        "table {name:?} was given by the workers of some shards but not by those \
                         of shards {missing:?}: one call saves every shard of {shard_num}, so \
                         every worker gives its table of every name (an empty one if it holds \
                         no rows)"
                    )));
                }
                WorkerTable::new(members.into_iter().flatten().collect(), foreign)
            })
            .collect()
    }
}

impl std::fmt::Debug for TableRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match self {
            TableRef::Borrowed(_) => "Borrowed",
            TableRef::Shared(_) => "Shared",
        };
        f.debug_tuple(how).field(&self.schema().name).finish()
    }
}

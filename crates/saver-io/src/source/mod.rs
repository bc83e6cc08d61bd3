//! Models read in bounded memory: a saver checkpoint's tables ([`crate::load::StoredTable`]) or a plain
//! safetensors input's ([`PlainTable`]), each a [`SparseTable`] whose rows are read from the files
//! when a save, a digest or an export asks for them. What `save --from`, `reshard`, `digest` and
//! `export` are built on, so that none of them holds the model.
//!
//! What they hold (see docs/FORMAT.md, "Memory of the commands"): dense tensors whole (small in
//! the models this is for), and beyond that a bounded amount, whatever the number of rows.

mod distribute;
pub mod import;
mod plain;
mod rounds;
pub(crate) mod sorted;

use std::collections::BTreeMap;
use std::path::Path;

use saver_core::naming::{SaverFile, INDEX_FILE};
use saver_core::{SaveInput, SparseTable};

pub use plain::{PlainInput, PlainTable, PlainTableSpec, PlainTensor, ROW_TABLES_KEY};

use crate::error::{Error, Result};
use crate::load::checkpoint::{ChainTable, Checkpoint};
use crate::load::documents::MAX_JSON_BYTES;
use crate::load::link::{describe_incomplete, Link};
use crate::load::restore::LoadedDense;
use crate::load::rows::BucketRows;
use crate::load::stored::StoredTable;
use saver_core::DenseTensor;

/// A model to read: a checkpoint or a plain input, opened (headers and manifests read, no data).
#[derive(Debug)]
pub enum Source {
    /// A saver checkpoint (a full one, or a delta and its chain of parents).
    Checkpoint(Box<Checkpoint>),
    /// Plain safetensors files.
    Plain(PlainInput),
}

/// The tables of a [`Source`], ready to be saved or hashed.
#[derive(Debug)]
pub enum SourceTables<'s> {
    /// A checkpoint's.
    Stored(Vec<StoredTable<'s>>),
    /// A delta's, resolved over its chain.
    Chain(Vec<ChainTable<'s>>),
    /// A plain input's, distributed by bucket.
    Plain(Vec<PlainTable<'s>>),
}

impl<'s> SourceTables<'s> {
    /// Every table of `ckpt`: a full checkpoint's read straight from their segments, a delta's
    /// resolved over its chain.
    pub fn of_checkpoint(ckpt: &'s Checkpoint) -> Result<Self> {
        Self::of_checkpoint_selected(ckpt, &[], &[])
    }

    /// The tables of `ckpt` that the globs `tables` select (all when empty), with the slots
    /// `exclude_slots` leaves, read as [`Self::of_checkpoint`] reads them: the one place, with
    /// the load loop's engine, where a reader of a checkpoint's rows chooses between one full
    /// checkpoint and a chain.
    pub(crate) fn of_checkpoint_selected(
        ckpt: &'s Checkpoint,
        tables: &[String],
        exclude_slots: &[String],
    ) -> Result<Self> {
        Ok(if ckpt.is_delta() {
            Self::Chain(ckpt.tables(tables, exclude_slots)?)
        } else {
            Self::Stored(StoredTable::all(ckpt.newest(), tables, exclude_slots)?)
        })
    }

    /// The tables as [`SparseTable`]s.
    pub(crate) fn as_dyn(&self) -> Vec<&dyn SparseTable> {
        match self {
            Self::Stored(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
            Self::Chain(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
            Self::Plain(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
        }
    }

    /// The tables as [`BucketRows`].
    pub(crate) fn as_bucket_rows(&self) -> Vec<&dyn BucketRows> {
        match self {
            Self::Stored(t) => t.iter().map(|t| t as &dyn BucketRows).collect(),
            Self::Chain(t) => t.iter().map(|t| t as &dyn BucketRows).collect(),
            Self::Plain(t) => t.iter().map(|t| t as &dyn BucketRows).collect(),
        }
    }
}

impl Source {
    /// Opens `path`: a saver checkpoint directory, a plain safetensors directory, or one plain
    /// safetensors file. A directory holding a saver save that was never committed is refused
    /// as incomplete: its data files are valid safetensors, but read as plain ones every sparse
    /// tensor would be taken for a dense one.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() || crate::storage::location_url(path).is_some() {
            if is_checkpoint(path) {
                return Ok(Self::Checkpoint(Box::new(Checkpoint::open(path)?)));
            }
            let storage = crate::storage::open_location(path)?;
            if !storage.exists(INDEX_FILE)?
                && storage
                    .list()?
                    .iter()
                    .any(|n| SaverFile::parse(n).is_some())
            {
                return Err(Error::Incomplete {
                    dir: path.into(),
                    what: describe_incomplete(&*storage)?,
                });
            }
        }
        Ok(Self::Plain(PlainInput::open(path)?))
    }

    /// The tables. A plain input's are distributed by bucket first, into nameless temporary
    /// files in `scratch`, read with `parallel` threads.
    pub fn tables(&self, scratch: &Path, parallel: usize) -> Result<SourceTables<'_>> {
        self.tables_in_rounds(scratch, parallel, None)
    }

    /// [`Self::tables`], a plain input's large tables distributed in `rounds` rounds (`None`: as
    /// many as suit the table and the machine; see [`PlainInput::tables_in_rounds`]).
    pub fn tables_in_rounds(
        &self,
        scratch: &Path,
        parallel: usize,
        rounds: Option<usize>,
    ) -> Result<SourceTables<'_>> {
        Ok(match self {
            Self::Checkpoint(c) => SourceTables::of_checkpoint(c)?,
            Self::Plain(p) => SourceTables::Plain(p.tables_in_rounds(
                scratch,
                parallel,
                plain::GROUP_BYTES,
                rounds,
            )?),
        })
    }

    /// Every dense tensor, read whole (a checkpoint's checked against its CRC32).
    pub fn dense(&self) -> Result<Vec<LoadedDense>> {
        match self {
            Self::Checkpoint(c) => c.dense_tensors(None, &mut crate::LoadReport::default()),
            Self::Plain(p) => p.read_dense(),
        }
    }

    /// Shard 0's trainer state, when the source is a checkpoint.
    pub fn trainer_state(&self) -> Option<String> {
        match self {
            Self::Checkpoint(c) => first_trainer_state(c.newest()),
            Self::Plain(_) => None,
        }
    }

    /// A checkpoint's user metadata, or every input file's `__metadata__` as `<file>:<key>`.
    pub fn user_metadata(&self) -> BTreeMap<String, String> {
        match self {
            Self::Checkpoint(c) => c.manifest().user_metadata.clone(),
            Self::Plain(p) => p.user_metadata.clone(),
        }
    }

    /// The checkpoint, when the source is one: what holds its row-range tables, which
    /// [`SourceTables`] does not.
    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Self::Checkpoint(c) => Some(c),
            Self::Plain(_) => None,
        }
    }

    /// Things about the input a user should hear of.
    pub fn warnings(&self) -> &[String] {
        match self {
            Self::Checkpoint(_) => &[],
            Self::Plain(p) => &p.warnings,
        }
    }
}

/// Save input of `tables` and `dense` (borrowed).
pub fn save_input<'a>(
    tables: &'a SourceTables<'_>,
    dense: &'a [LoadedDense],
) -> Result<SaveInput<'a>> {
    let mut input = SaveInput::new();
    input.tables = tables
        .as_dyn()
        .into_iter()
        .map(saver_core::plan::TableRef::Borrowed)
        .collect();
    with_dense(input, dense)
}

/// `input` with `dense` added, borrowed.
pub(crate) fn with_dense<'a>(
    mut input: SaveInput<'a>,
    dense: &'a [LoadedDense],
) -> Result<SaveInput<'a>> {
    for d in dense {
        input = input.dense(DenseTensor::new(
            d.name.clone(),
            d.dtype,
            d.shape.clone(),
            d.data.as_slice(),
        )?);
    }
    Ok(input)
}

/// Shard 0's trainer state: what a checkpoint rewritten for another worker count carries, since a
/// worker's state does not map onto a new worker count.
pub(crate) fn first_trainer_state(ckpt: &Link) -> Option<String> {
    ckpt.manifest()
        .shards
        .first()
        .and_then(|s| s.trainer_state.clone())
}

/// Whether `dir` holds a saver checkpoint (its index says so). Reads the index only if it is a
/// regular file.
pub(crate) fn is_checkpoint(dir: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        metadata: ProbeMetadata,
    }
    #[derive(serde::Deserialize)]
    struct ProbeMetadata {
        format: Option<String>,
    }
    crate::storage::open_location(dir)
        .and_then(|s| s.get(INDEX_FILE, MAX_JSON_BYTES))
        .ok()
        .and_then(|b| serde_json::from_slice::<Probe>(&b).ok())
        .is_some_and(|p| p.metadata.format.as_deref() == Some("saver"))
}

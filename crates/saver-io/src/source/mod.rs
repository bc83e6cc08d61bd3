//! Models read in bounded memory: a saver checkpoint's tables ([`StoredTable`]) or a plain
//! safetensors input's ([`PlainTable`]), each a [`SparseTable`] whose rows are read from the files
//! when a save, a digest or an export asks for them. What `save --from`, `reshard`, `digest` and
//! `export` are built on, so that none of them holds the model.
//!
//! What they hold (see docs/FORMAT.md, "Memory of the commands"): dense tensors whole (small in
//! the models this is for), and beyond that a bounded amount, whatever the number of rows.

mod distribute;
pub mod plain;
mod rounds;
pub mod sorted;
pub mod stored;

use std::collections::BTreeMap;
use std::path::Path;

use saver_core::naming::{SaverFile, INDEX_FILE};
use saver_core::{SaveInput, SparseTable};

pub use plain::{PlainInput, PlainTable};
pub use stored::StoredTable;

use crate::chain::{Chain, ChainTable};
use crate::error::{Error, Result};
use crate::import::{first_trainer_state, is_checkpoint, with_dense};
use crate::reader::{describe_incomplete, Checkpoint};
use crate::restore::LoadedDense;

/// What receives rows in batches: ids, and each slot's rows back to back (in the table's slot
/// order).
pub type VisitRows<'a> = dyn FnMut(&[u64], &[&[u8]]) -> Result<()> + 'a;

/// A table whose rows can be visited in storage order, (bucket, id bits): what the digest, the
/// export's sort and the delta's comparison read.
pub trait BucketRows: SparseTable {
    /// Bytes of one row of each slot, in [`SparseTable::slots`] order.
    fn row_bytes(&self) -> &[u64];
    /// The exact number of rows.
    fn rows(&self) -> u64;
    /// Visits every row in (bucket, id bits) order, at most `batch` rows at a time: ids, and each
    /// slot's rows back to back.
    fn visit_in_bucket_order(&self, batch: usize, visit: &mut VisitRows<'_>) -> Result<()>;
    /// Checks what was read only in part against its checksums (a chain's older links, a
    /// target's buckets): called before what was read is returned or committed. Default: every
    /// read was checked as it was made.
    fn finish_checks(&self) -> Result<()> {
        Ok(())
    }
}

/// A model to read: a checkpoint or a plain input, opened (headers and manifests read, no data).
#[derive(Debug)]
pub enum Source {
    /// A saver checkpoint.
    Checkpoint(Box<Checkpoint>),
    /// A delta checkpoint and its chain of parents.
    Chain(Box<Chain>),
    /// Plain safetensors files.
    Plain(PlainInput),
}

/// The tables of a [`Source`], ready to be saved or hashed.
pub enum SourceTables<'s> {
    /// A checkpoint's.
    Stored(Vec<StoredTable<'s>>),
    /// A chain's, resolved.
    Chain(Vec<ChainTable<'s>>),
    /// A plain input's, distributed by bucket.
    Plain(Vec<PlainTable<'s>>),
}

impl SourceTables<'_> {
    /// The tables as [`SparseTable`]s.
    pub fn as_dyn(&self) -> Vec<&dyn SparseTable> {
        match self {
            Self::Stored(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
            Self::Chain(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
            Self::Plain(t) => t.iter().map(|t| t as &dyn SparseTable).collect(),
        }
    }

    /// The tables as [`BucketRows`].
    pub fn as_bucket_rows(&self) -> Vec<&dyn BucketRows> {
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
                let ckpt = Checkpoint::open(path)?;
                if ckpt.manifest().parent.is_some() {
                    drop(ckpt);
                    return Ok(Self::Chain(Box::new(Chain::open(path)?)));
                }
                return Ok(Self::Checkpoint(Box::new(ckpt)));
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
            Self::Checkpoint(c) => SourceTables::Stored(StoredTable::all(c, &[], &[])?),
            Self::Chain(c) => SourceTables::Chain(c.tables(&[], &[])?),
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
            Self::Checkpoint(c) => Self::checkpoint_dense(c),
            Self::Chain(c) => c.read_dense(None, &mut crate::LoadReport::default()),
            Self::Plain(p) => p.read_dense(),
        }
    }

    /// Every dense tensor of `c`, read whole and checked against its CRC32.
    pub fn checkpoint_dense(c: &Checkpoint) -> Result<Vec<LoadedDense>> {
        let refs = c.manifest().dense.iter().map(|d| (c, d));
        crate::restore::read_dense_refs(refs, &None, &mut crate::LoadReport::default())
    }

    /// Shard 0's trainer state, when the source is a checkpoint.
    pub fn trainer_state(&self) -> Option<String> {
        match self {
            Self::Checkpoint(c) => first_trainer_state(c),
            Self::Chain(c) => first_trainer_state(c.newest()),
            Self::Plain(_) => None,
        }
    }

    /// A checkpoint's user metadata, or every input file's `__metadata__` as `<file>:<key>`.
    pub fn user_metadata(&self) -> BTreeMap<String, String> {
        match self {
            Self::Checkpoint(c) => c.manifest().user_metadata.clone(),
            Self::Chain(c) => c.newest().manifest().user_metadata.clone(),
            Self::Plain(p) => p.user_metadata.clone(),
        }
    }

    /// Things about the input a user should hear of.
    pub fn warnings(&self) -> &[String] {
        match self {
            Self::Checkpoint(_) | Self::Chain(_) => &[],
            Self::Plain(p) => &p.warnings,
        }
    }
}

/// An error of reading table `table`'s rows, as a table snapshot returns it.
pub(crate) fn core_error(table: &str, e: Error) -> saver_core::Error {
    match e {
        Error::Core(e) => e,
        e => saver_core::Error::Table {
            table: table.into(),
            message: e.to_string(),
        },
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

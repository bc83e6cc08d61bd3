//! Bringing models from elsewhere: a plain safetensors file or directory (with or without
//! `model.safetensors.index.json`), or an existing saver checkpoint of any shard count.
//!
//! In a plain input, a table is a 1-D I64/U64 tensor named `<table>/ids` with sibling tensors
//! `<table>/<slot>` whose first dimension equals the number of ids; every other tensor is dense.
//! This is also what [`crate::tools::export`] writes, so an export can be saved again.
//!
//! [`read_model`] takes the whole model into memory (tables as [`EmbeddingTable`]s). The commands
//! read in bounded memory through [`crate::source::Source`] instead.

use std::collections::BTreeMap;
use std::path::Path;

use saver_core::{EmbeddingTable, SaveInput, SlotSpec};

use crate::error::{Error, Result};
use crate::load::link::Link;
use crate::load::restore::{LoadOptions, LoadedDense, Restored};
use crate::source::{first_trainer_state, with_dense, PlainInput, Source};

/// A model held in memory, ready to save.
#[derive(Debug)]
pub struct Model {
    /// Tables.
    pub tables: Vec<EmbeddingTable>,
    /// Dense tensors.
    pub dense: Vec<LoadedDense>,
    /// Shard 0's trainer state, when the source was a saver checkpoint.
    pub trainer_state: Option<String>,
    /// User metadata: a saver checkpoint's, or every input file's `__metadata__` as
    /// `<file>:<key>` (so that a save `--from` the files keeps it).
    pub user_metadata: BTreeMap<String, String>,
    /// Things about the input a user should hear of (tensors that look like a misspelled table).
    pub warnings: Vec<String>,
}

impl Model {
    /// The model as save input (dense tensors borrowed).
    pub fn input(&self) -> Result<SaveInput<'_>> {
        let mut input = SaveInput::new();
        for t in &self.tables {
            input = input.table(t);
        }
        with_dense(input, &self.dense)
    }

    /// A model from a whole-checkpoint restore (one target shard).
    pub(crate) fn from_restored(r: Restored, ckpt: &Link) -> Result<Self> {
        let tables = r.shards.into_iter().flat_map(|s| s.tables).collect();
        Ok(Self {
            tables,
            dense: r.dense,
            trainer_state: first_trainer_state(ckpt),
            user_metadata: ckpt.manifest().user_metadata.clone(),
            warnings: Vec::new(),
        })
    }
}

/// Reads a model from `path`: a saver checkpoint directory, a plain safetensors directory, or one
/// plain safetensors file (what [`Source::open`] accepts and refuses). Every row is copied into
/// memory.
pub fn read_model(path: &Path, parallel: usize) -> Result<Model> {
    match Source::open(path)? {
        Source::Checkpoint(chain) => {
            let r = chain.restore(&LoadOptions {
                parallel,
                ..LoadOptions::default()
            })?;
            Model::from_restored(r, chain.newest())
        }
        Source::Plain(input) => read_plain_input(input),
    }
}

/// Reads a plain safetensors file or directory into memory (every row in an [`EmbeddingTable`]).
/// For bounded memory, open it as a [`PlainInput`] and save its [`PlainInput::tables`] instead.
pub fn read_plain(path: &Path) -> Result<Model> {
    read_plain_input(PlainInput::open(path)?)
}

/// An opened plain input's tables and dense tensors, in memory.
fn read_plain_input(input: PlainInput) -> Result<Model> {
    let mut tables = Vec::new();
    for spec in &input.tables {
        let slots: Vec<SlotSpec> = spec.slots.iter().map(|s| s.0.clone()).collect();
        let mut raw = vec![0u8; spec.ids.entry.len as usize];
        input.read(&spec.ids, 0, &mut raw)?;
        let ids: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        drop(raw);
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Mismatch(format!(
                "table {:?} (tensor {:?}) has duplicate id {}",
                spec.name,
                spec.ids.entry.name,
                spec.key_dtype.format_id(w[0])
            )));
        }
        drop(sorted);
        // Sized for its rows: the map is not rehashed as it grows, and the rows lie in the
        // table's first slabs in the file's order.
        let t = EmbeddingTable::with_capacity(spec.name.clone(), spec.key_dtype, slots, ids.len())?;
        let data: Vec<Vec<u8>> = spec
            .slots
            .iter()
            .map(|(_, tensor)| {
                let mut d = vec![0u8; tensor.entry.len as usize];
                input.read(tensor, 0, &mut d)?;
                Ok(d)
            })
            .collect::<Result<_>>()?;
        let sizes = t.slot_row_bytes().to_vec();
        const CHUNK: usize = 1 << 16;
        for (c, chunk) in ids.chunks(CHUNK).enumerate() {
            let lo = c * CHUNK;
            let hi = lo + chunk.len();
            let parts: Vec<&[u8]> = data
                .iter()
                .zip(&sizes)
                .map(|(d, &b)| &d[lo * b..hi * b])
                .collect();
            t.insert_chunk(chunk, &parts)?;
        }
        tables.push(t);
    }
    let dense = input.read_dense()?;
    Ok(Model {
        tables,
        dense,
        trainer_state: None,
        user_metadata: input.user_metadata,
        warnings: input.warnings,
    })
}

#[cfg(test)]
mod tests;

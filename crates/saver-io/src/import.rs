//! Bringing models from elsewhere: a plain safetensors file or directory (with or without
//! `model.safetensors.index.json`), or an existing saver checkpoint of any shard count.
//!
//! In a plain input, a table is a 1-D I64/U64 tensor named `<table>/ids` with sibling tensors
//! `<table>/<slot>` whose first dimension equals the number of ids; every other tensor is dense.
//! This is also what [`crate::export`] writes, so an export can be saved again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use saver_core::naming::{check_slot_name, check_table_name, SaverFile, INDEX_FILE};
use saver_core::{DenseTensor, Dtype, EmbeddingTable, KeyDtype, SaveInput, SlotSpec};

use crate::commit::MAX_JSON_BYTES;
use crate::error::{Error, Result};
use crate::header::{read_header, HeaderEntry};
use crate::reader::{describe_incomplete, Checkpoint};
use crate::restore::{LoadOptions, LoadedDense, Restored};
use crate::storage::{check_file_name, LocalFs, ReadHandle, Storage};

/// A model held in memory, ready to save.
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
    pub fn from_restored(r: Restored, ckpt: &Checkpoint) -> Result<Self> {
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
pub(crate) fn first_trainer_state(ckpt: &Checkpoint) -> Option<String> {
    ckpt.manifest()
        .shards
        .first()
        .and_then(|s| s.trainer_state.clone())
}

/// Whether `dir` holds a saver checkpoint (its index says so). Reads the index only if it is a
/// regular file.
pub fn is_checkpoint(dir: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        metadata: ProbeMetadata,
    }
    #[derive(serde::Deserialize)]
    struct ProbeMetadata {
        format: Option<String>,
    }
    LocalFs::open_dir(dir)
        .and_then(|s| s.get(INDEX_FILE, MAX_JSON_BYTES))
        .ok()
        .and_then(|b| serde_json::from_slice::<Probe>(&b).ok())
        .is_some_and(|p| p.metadata.format.as_deref() == Some("saver"))
}

/// Reads a model from `path`: a saver checkpoint directory, a plain safetensors directory, or one
/// plain safetensors file. Every row is copied into memory. A directory holding a saver save that
/// was never committed is refused as incomplete: its data files are valid safetensors, but read
/// as plain ones every sparse tensor would be taken for a dense one.
pub fn read_model(path: &Path, parallel: usize) -> Result<Model> {
    if path.is_dir() {
        if is_checkpoint(path) {
            let ckpt = Checkpoint::open(path)?;
            let r = ckpt.restore(&LoadOptions {
                parallel,
                ..LoadOptions::default()
            })?;
            return Model::from_restored(r, &ckpt);
        }
        let storage = LocalFs::open_dir(path)?;
        if !storage.exists(INDEX_FILE)?
            && storage
                .list()?
                .iter()
                .any(|n| SaverFile::parse(n).is_some())
        {
            return Err(Error::Incomplete {
                dir: path.into(),
                what: describe_incomplete(&storage)?,
            });
        }
    }
    read_plain(path)
}

fn plain_files(path: &Path) -> Result<(LocalFs, Vec<String>)> {
    let meta = std::fs::metadata(path).map_err(crate::error::io_err("open", path))?;
    if !meta.is_file() && !meta.is_dir() {
        return Err(Error::UnsafePath {
            name: path.display().to_string(),
            named_in: "the input path".into(),
            why: "neither a regular file nor a directory",
        });
    }
    if meta.is_file() {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::UnsafePath {
                name: path.display().to_string(),
                named_in: "the --from path".into(),
                why: "not a UTF-8 file name",
            })?;
        return Ok((LocalFs::open_dir(dir)?, vec![name.to_string()]));
    }
    let storage = LocalFs::open_dir(path)?;
    let files: Vec<String> = if storage.exists(INDEX_FILE)? {
        let bytes = storage.get(INDEX_FILE, MAX_JSON_BYTES)?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            file: INDEX_FILE.into(),
            what: format!("not valid JSON: {e}"),
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Corrupt {
                file: INDEX_FILE.into(),
                what: "no weight_map object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        files
    } else {
        storage
            .list()?
            .into_iter()
            .filter(|n| n.ends_with(".safetensors"))
            .collect()
    };
    if files.is_empty() {
        return Err(Error::Mismatch(format!(
            "{} holds no .safetensors file",
            path.display()
        )));
    }
    for f in &files {
        check_file_name(f, &path.join(INDEX_FILE).display().to_string())?;
    }
    Ok((storage, files))
}

/// Reads a plain safetensors file or directory.
pub fn read_plain(path: &Path) -> Result<Model> {
    let (storage, files) = plain_files(path)?;
    // name -> (file, entry)
    let mut tensors: BTreeMap<String, (String, HeaderEntry)> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    // One handle per file, kept for reading the tensors after their headers.
    let mut handles: HashMap<String, Box<dyn ReadHandle>> = HashMap::new();
    let mut user_metadata = BTreeMap::new();
    for f in &files {
        let h = storage.open(f)?;
        let header = read_header(h.as_ref(), f)?;
        for (k, v) in header.metadata {
            user_metadata.insert(format!("{f}:{k}"), v);
        }
        for t in header.tensors {
            if tensors.contains_key(&t.name) {
                return Err(Error::Mismatch(format!(
                    "tensor {:?} appears in two input files",
                    t.name
                )));
            }
            order.push(t.name.clone());
            tensors.insert(t.name.clone(), (f.clone(), t));
        }
        handles.insert(f.clone(), h);
    }
    let read = |name: &str| -> Result<Vec<u8>> {
        let (f, t) = &tensors[name];
        let h = &handles[f];
        let mut buf = vec![0u8; t.len as usize];
        h.read_at(t.offset, &mut buf)?;
        Ok(buf)
    };
    let table_names: Vec<String> = order
        .iter()
        .filter_map(|n| n.strip_suffix("/ids"))
        .filter(|t| check_table_name(t).is_ok())
        .map(str::to_string)
        .collect();
    let mut used = HashSet::new();
    let mut tables = Vec::new();
    for table in &table_names {
        let ids_name = format!("{table}/ids");
        let ids_entry = &tensors[&ids_name].1;
        let key = KeyDtype::from_dtype(ids_entry.dtype)
            .filter(|_| ids_entry.shape.len() == 1)
            .ok_or_else(|| {
                Error::Mismatch(format!(
                    "tensor {ids_name:?} must be a 1-D I64 or U64 tensor of ids, it is {} {:?}",
                    ids_entry.dtype, ids_entry.shape
                ))
            })?;
        let n = ids_entry.shape[0];
        used.insert(ids_name.clone());
        let prefix = format!("{table}/");
        let mut slots = Vec::new();
        for name in &order {
            let Some(slot) = name.strip_prefix(&prefix) else {
                continue;
            };
            if slot == "ids" || slot.contains('/') {
                continue;
            }
            let e = &tensors[name].1;
            if e.shape.first() != Some(&n) {
                return Err(Error::Mismatch(format!(
                    "tensor {name:?} has shape {:?} but table {table:?} has {n} ids: a slot's first dimension must equal the number of ids",
                    e.shape
                )));
            }
            check_slot_name(slot)?;
            slots.push((
                name.clone(),
                SlotSpec::new(slot, e.dtype, e.shape[1..].to_vec()),
            ));
            used.insert(name.clone());
        }
        let ids: Vec<u64> = read(&ids_name)?
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Mismatch(format!(
                "table {table:?} (tensor {ids_name:?}) has duplicate id {}",
                key.format_id(w[0])
            )));
        }
        drop(sorted);
        // Sized for its rows: the map is not rehashed as it grows, and the rows lie in the
        // table's first slabs in the file's order.
        let t = EmbeddingTable::with_capacity(
            table.clone(),
            key,
            slots.iter().map(|s| s.1.clone()).collect(),
            ids.len(),
        )?;
        let data: Vec<Vec<u8>> = slots
            .iter()
            .map(|(name, _)| read(name))
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
    let warnings = misspelled_tables(&order, &tensors, &table_names, &used);
    let mut dense = Vec::new();
    for name in &order {
        if used.contains(name) {
            continue;
        }
        let e = &tensors[name].1;
        dense.push(LoadedDense {
            name: name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data: read(name)?,
        });
    }
    Ok(Model {
        tables,
        dense,
        trainer_state: None,
        user_metadata,
        warnings,
    })
}

/// Warnings for groups of would-be dense tensors `P/…` that look like a table whose ids tensor is
/// misnamed (`users/id`, `users/ID`, `users/keys`): a 1-D integer tensor with an ids-like name, or
/// one beside siblings with as many rows. They are saved as dense tensors, which is rarely meant.
fn misspelled_tables(
    order: &[String],
    tensors: &BTreeMap<String, (String, HeaderEntry)>,
    tables: &[String],
    used: &HashSet<String>,
) -> Vec<String> {
    const IDS_LIKE: [&str; 7] = ["id", "ids", "key", "keys", "idx", "index", "indices"];
    let mut warnings = Vec::new();
    let mut seen = HashSet::new();
    for name in order.iter().filter(|n| !used.contains(*n)) {
        let Some((prefix, slot)) = name.rsplit_once('/') else {
            continue;
        };
        let e = &tensors[name].1;
        let integer = matches!(e.dtype, Dtype::I64 | Dtype::U64 | Dtype::I32 | Dtype::U32);
        if tables.iter().any(|t| t == prefix) || !integer || e.shape.len() != 1 {
            continue;
        }
        let rows = e.shape[0];
        let siblings = order.iter().any(|other| {
            other != name
                && other.rsplit_once('/').is_some_and(|(p, _)| p == prefix)
                && tensors[other].1.shape.first() == Some(&rows)
        });
        if (IDS_LIKE.contains(&slot.to_lowercase().as_str()) || siblings)
            && seen.insert(prefix.to_string())
        {
            warnings.push(format!(
                "tensors {prefix:?}/… look like a table, but there is no {prefix:?}/ids: {name:?} \
                 is a 1-D {} of {rows}{}; they are saved as dense tensors (name the ids tensor \
                 \"{prefix}/ids\", I64 or U64, to save them as a table)",
                e.dtype,
                if siblings {
                    ", beside slots of as many rows"
                } else {
                    ""
                }
            ));
        }
    }
    warnings
}

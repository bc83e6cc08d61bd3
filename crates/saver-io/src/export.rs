//! Consolidated plain safetensors exports, for serving systems and other tools: each table as
//! `<table>/ids` (ascending) plus `<table>/<slot>` rows in the same order, dense tensors under
//! their own names, split into files of at most `max_file_size` with a Hugging Face index.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use saver_core::cast::cast;
use saver_core::naming::INDEX_FILE;
use saver_core::plan::header::{render_header_with, HeaderTensor};
use saver_core::{Dtype, SparseTable};

use crate::error::{Error, Result};
use crate::reader::Checkpoint;
use crate::restore::LoadOptions;
use crate::storage::{LocalFs, Storage};

/// How to export.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Largest file (a single larger tensor gets its own file).
    pub max_file_size: u64,
    /// Globs of tables to export (empty: all).
    pub tables: Vec<String>,
    /// Globs of slots to leave out.
    pub exclude_slots: Vec<String>,
    /// Cast floating slots and dense tensors to this dtype (F32, F16 or BF16).
    pub dtype: Option<Dtype>,
    /// Replace an existing export in the directory.
    pub overwrite: bool,
    /// fsync files before renaming them.
    pub durable: bool,
    /// Reader threads.
    pub parallel: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            max_file_size: 2 << 30,
            tables: Vec::new(),
            exclude_slots: Vec::new(),
            dtype: None,
            overwrite: false,
            durable: true,
            parallel: std::thread::available_parallelism().map_or(2, usize::from),
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, Serialize)]
pub struct ExportReport {
    /// Files written.
    pub files: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// Wall time.
    pub seconds: f64,
}

/// The data files the index in `storage` lists, if it is the index of a plain export (not a saver
/// checkpoint's: that is refused, since replacing its index would lose the checkpoint).
fn previous_export_files(storage: &LocalFs) -> Result<Vec<String>> {
    if !storage.exists(INDEX_FILE)? {
        return Ok(Vec::new());
    }
    #[derive(serde::Deserialize)]
    struct PlainIndex {
        #[serde(default)]
        metadata: serde_json::Map<String, serde_json::Value>,
        weight_map: BTreeMap<String, String>,
    }
    let bytes = storage.get(INDEX_FILE, crate::commit::MAX_JSON_BYTES)?;
    let index: PlainIndex = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Mismatch(format!(
            "{} holds a {INDEX_FILE} that is not an export's ({e}); export into another directory",
            storage.location()
        ))
    })?;
    if index.metadata.get("format").and_then(|f| f.as_str()) == Some("saver") {
        return Err(Error::Mismatch(format!(
            "{} holds a saver checkpoint; export into another directory",
            storage.location()
        )));
    }
    let mut files: Vec<String> = index.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    for f in &files {
        crate::storage::check_file_name(f, INDEX_FILE)?;
    }
    Ok(files)
}

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    data: Vec<u8>,
}

/// Exports `ckpt` into directory `out`.
pub fn export(ckpt: &Checkpoint, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    let start = Instant::now();
    if let Some(d) = opts.dtype {
        if !matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(Error::InvalidOption {
                option: "dtype",
                why: format!("{d} (export casts to f32, f16 or bf16)"),
            });
        }
    }
    if opts.max_file_size < 4096 {
        return Err(Error::InvalidOption {
            option: "max_file_size",
            why: "must be at least 4 KiB".into(),
        });
    }
    let storage = LocalFs::create_dir(out)?;
    if storage.exists(INDEX_FILE)? && !opts.overwrite {
        return Err(Error::Exists {
            dir: out.into(),
            save_id: "export".into(),
        });
    }
    // The files of the export being replaced: its index lists them, and only they are removed.
    let previous = previous_export_files(&storage)?;
    let restored = ckpt.restore(&LoadOptions {
        tables: opts.tables.clone(),
        exclude_slots: opts.exclude_slots.clone(),
        parallel: opts.parallel,
        ..LoadOptions::default()
    })?;
    let convert = |dtype: Dtype, data: Vec<u8>| -> Result<(Dtype, Vec<u8>)> {
        match opts.dtype {
            Some(to) if dtype.is_float() && dtype != to => Ok((to, cast(&data, dtype, to)?)),
            _ => Ok((dtype, data)),
        }
    };
    let mut tensors = Vec::new();
    let mut tables: Vec<_> = restored.shards.iter().flat_map(|s| &s.tables).collect();
    tables.sort_by(|a, b| SparseTable::name(*a).cmp(SparseTable::name(*b)));
    for t in tables {
        let name = SparseTable::name(t);
        let key = t.key_dtype();
        let mut ids = t.ids();
        ids.sort_unstable_by_key(|&id| key.order_key(id));
        let snap = t.snapshot()?;
        let sizes = t.slot_row_bytes().to_vec();
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&b| vec![0u8; b * ids.len()]).collect();
        {
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            snap.read_rows(&ids, &mut outs)?;
        }
        tensors.push(Tensor {
            name: format!("{name}/ids"),
            dtype: key.dtype(),
            shape: vec![ids.len() as u64],
            data: ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
        });
        for (spec, data) in SparseTable::slots(t).iter().zip(bufs) {
            let mut shape = vec![ids.len() as u64];
            shape.extend_from_slice(&spec.shape);
            let (dtype, data) = convert(spec.dtype, data)?;
            tensors.push(Tensor {
                name: format!("{name}/{}", spec.name),
                dtype,
                shape,
                data,
            });
        }
    }
    for d in restored.dense {
        let (dtype, data) = convert(d.dtype, d.data)?;
        tensors.push(Tensor {
            name: d.name,
            dtype,
            shape: d.shape,
            data,
        });
    }
    // Fill files in order, starting a new one when the next tensor would overflow.
    let mut groups: Vec<Vec<Tensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let len = t.data.len() as u64;
        if size + len > opts.max_file_size && !groups.last().expect("one group").is_empty() {
            groups.push(Vec::new());
            size = 0;
        }
        size += len;
        groups.last_mut().expect("one group").push(t);
    }
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut written = 0u64;
    let mut total = 0u64;
    let mut names = Vec::new();
    let mut count = 0;
    for (i, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let mut off = 0;
        let headers: Vec<HeaderTensor> = group
            .iter()
            .map(|t| {
                let h = HeaderTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    start: off,
                    end: off + t.data.len() as u64,
                };
                off = h.end;
                h
            })
            .collect();
        let header = render_header_with(&[("format", "pt".to_string())], &headers, 64);
        let h = storage.create(&file, header.len() as u64 + off)?;
        let mut pos = 0;
        let result = (|| {
            h.write_at(0, &header)?;
            pos += header.len() as u64;
            for t in group {
                h.write_at(pos, &t.data)?;
                pos += t.data.len() as u64;
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = result {
            h.abort();
            return Err(e);
        }
        h.commit(opts.durable)?;
        for t in group {
            weight_map.insert(t.name.clone(), file.clone());
            total += t.data.len() as u64;
        }
        count += group.len();
        written += pos;
        names.push(file);
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    storage.put(
        INDEX_FILE,
        &serde_json::to_vec_pretty(&index).expect("json"),
        opts.durable,
    )?;
    // Files of the earlier export this one replaced, as its index listed them; a file that no
    // index named (a user's, another tool's) is never removed.
    for old in previous {
        if !names.contains(&old) {
            storage.remove(&old)?;
        }
    }
    Ok(ExportReport {
        files: n,
        tensors: count,
        bytes_written: written,
        seconds: start.elapsed().as_secs_f64(),
    })
}

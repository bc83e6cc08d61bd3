//! Consolidated plain safetensors exports, for serving systems and other tools: each table as
//! `<table>/ids` (ascending) plus `<table>/<slot>` rows in the same order, dense tensors under
//! their own names, split into files of at most `max_file_size` with a Hugging Face index.
//! Written in bounded memory (see [`export`]).
//!
//! For serving, the embedding slots can be exported row-wise quantized
//! ([`ExportOptions::quantize`]) in FBGEMM's fused layouts or TorchRec's split form
//! (`saver_core::quantize`); each file's `__metadata__` then names FBGEMM's conversion
//! (`quantization`), the layout (`quantization_layout`: `fused` or `split`), the bit rate
//! (`quantization_bits`) and the quantized tensors it holds (`quantized_tensors`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use saver_core::cast::cast;
use saver_core::naming::INDEX_FILE;
use saver_core::plan::header::{render_header_with, HeaderTensor};
use saver_core::quantize::{QuantLayout, Quantization, QuantizedRows};
use saver_core::Dtype;

use crate::error::{Error, Result};
use crate::load::checkpoint::Checkpoint;
use crate::load::restore::LoadedDense;
use crate::load::rows::BucketRows;
use crate::source::sorted::{visit_by_id, RUN_BYTES};
use crate::storage::write_behind::WriteBehind;
use crate::storage::{Storage, WriteHandle};

/// How to export.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Largest file (a single larger tensor gets its own file).
    pub max_file_size: u64,
    /// Globs of tables to export (empty: all).
    pub tables: Vec<String>,
    /// Globs of slots to leave out.
    pub exclude_slots: Vec<String>,
    /// Cast floating slots and dense tensors to this dtype (F32, F16 or BF16). Quantized slots
    /// are quantized from their stored values, not from the cast ones.
    pub dtype: Option<Dtype>,
    /// Quantize the slots matching `quantize_slots` row-wise (their rows must be one dimension of
    /// f32, f16 or bf16). Ids, other slots and dense tensors are written as without it.
    pub quantize: Option<Quantization>,
    /// Globs of the slots to quantize. Default: `embedding`.
    pub quantize_slots: Vec<String>,
    /// Replace an existing export in the directory.
    pub overwrite: bool,
    /// fsync files before renaming them.
    pub durable: bool,
    /// Threads that sort runs.
    pub parallel: usize,
    /// Bytes of rows sorted in memory at once (each table's rows are put in id order by an
    /// external merge sort). Default `RUN_BYTES` (32 MiB).
    pub sort_memory: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            max_file_size: 2 << 30,
            tables: Vec::new(),
            exclude_slots: Vec::new(),
            dtype: None,
            quantize: None,
            quantize_slots: vec!["embedding".into()],
            overwrite: false,
            durable: true,
            parallel: std::thread::available_parallelism().map_or(2, usize::from),
            sort_memory: RUN_BYTES,
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
fn previous_export_files(storage: &dyn Storage) -> Result<Vec<String>> {
    if !storage.exists(INDEX_FILE)? {
        return Ok(Vec::new());
    }
    #[derive(serde::Deserialize)]
    struct PlainIndex {
        #[serde(default)]
        metadata: serde_json::Map<String, serde_json::Value>,
        weight_map: BTreeMap<String, String>,
    }
    let bytes = storage.get(INDEX_FILE, crate::load::documents::MAX_JSON_BYTES)?;
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

/// One tensor of the export: what it is, and where it goes.
struct OutTensor {
    name: String,
    /// Dtype in the checkpoint.
    from: Dtype,
    /// Dtype written.
    dtype: Dtype,
    shape: Vec<u64>,
    len: u64,
    /// Index of its file, and its absolute offset there.
    file: usize,
    offset: u64,
    /// The table (in export order) and the column of it (0 the ids, `k` slot `k - 1`) whose rows
    /// it holds; `None` for a dense tensor or a row-range table's slot.
    source: Option<(usize, usize)>,
    /// The row-range table (in export order) and the slot whose values it holds, whole.
    row_source: Option<(usize, usize)>,
    /// Set on the tensors of a quantized slot.
    quantized: Option<QuantPart>,
}

/// A column of the export: tensor name, slot name (`None` for ids), dtype, shape of a row, rows,
/// and where its values come from.
type ColumnOut<'a> = (String, Option<&'a str>, Dtype, Vec<u64>, u64, Src);

/// Where an output tensor's values come from.
#[derive(Clone, Copy)]
enum Src {
    /// Column `c` of table `t` (0 the ids, `k` slot `k - 1`).
    Column(usize, usize),
    /// Slot `s` of row-range table `t`, whole.
    Row(usize, usize),
    /// A dense tensor.
    Dense,
}

/// Which tensor of a quantized slot.
#[derive(Clone, Copy)]
enum QuantPart {
    /// The quantized rows (fused with their scales and biases, or the packed values of the split
    /// layout): how they are quantized, and the values a row.
    Rows(Quantization, usize),
    /// The split layout's scales.
    Scales,
    /// The split layout's biases.
    Biases,
}

/// Bytes of a tensor's rows gathered before they are cast and written.
const COLUMN_BUFFER_BYTES: usize = 4 << 20;

/// Exports the newest state of `ckpt` (a delta resolved over its chain) into directory `out`.
///
/// Streams: each table's rows are put in id order by an external merge sort
/// (`crate::source::sorted`, temporary files in `out`) and written as they come, so the
/// export holds bounded buffers (about 100 MiB) plus the dense tensors, whatever the number of
/// rows.
pub fn export(ckpt: &Checkpoint, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    let read_dense = || ckpt.dense_tensors(None, &mut crate::LoadReport::default());
    let rows = RowTables::of(ckpt, opts)?;
    let tables = crate::source::SourceTables::of_checkpoint_selected(
        ckpt,
        &opts.tables,
        &opts.exclude_slots,
    )?;
    export_tables(tables.as_bucket_rows(), rows, read_dense, out, opts)
}

/// The row-range tables an export writes, each slot as one consolidated tensor
/// `<table>/<slot>` of its whole shape, read from the checkpoint a batch of rows at a time.
struct RowTables<'c> {
    ckpt: &'c Checkpoint,
    /// Per table (by name): its name, rows, and its kept slots (name, dtype, whole shape).
    tables: Vec<RowTableOut>,
}

/// A row-range table an export writes: name, rows, kept slots (name, dtype, whole shape).
type RowTableOut = (String, u64, Vec<(String, Dtype, Vec<u64>)>);

impl<'c> RowTables<'c> {
    fn of(ckpt: &'c Checkpoint, opts: &ExportOptions) -> Result<Self> {
        let wanted = crate::load::restore::globs("tables", &opts.tables)?;
        let excluded = crate::load::restore::globs("exclude_slots", &opts.exclude_slots)?;
        let mut tables: Vec<RowTableOut> = ckpt
            .manifest()
            .row_tables
            .iter()
            .filter(|t| wanted.as_ref().is_none_or(|g| g.is_match(&t.name)))
            .map(|t| {
                let slots = t
                    .slots
                    .iter()
                    .filter(|s| excluded.as_ref().is_none_or(|g| !g.is_match(&s.name)))
                    .map(|s| (s.name.clone(), s.dtype, s.shape.clone()))
                    .collect();
                (t.name.clone(), t.rows, slots)
            })
            .collect();
        tables.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Self { ckpt, tables })
    }
}

fn export_tables(
    mut tables: Vec<&dyn BucketRows>,
    rows: RowTables<'_>,
    read_dense: impl FnOnce() -> Result<Vec<LoadedDense>>,
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    let start = Instant::now();
    check_options(opts)?;
    let storage = crate::storage::create_location(out)?;
    // The files of the export being replaced: its index lists them, and only they are removed.
    // Read first, so that a checkpoint there is refused as one (overwriting would not help).
    let previous = previous_export_files(&*storage)?;
    if storage.exists(INDEX_FILE)? && !opts.overwrite {
        return Err(Error::Mismatch(format!(
            "{} already holds an export; to replace it, pass --overwrite \
             (ExportOptions::overwrite in the library)",
            storage.location()
        )));
    }
    tables.sort_by(|a, b| a.name().cmp(b.name()));
    let dense = read_dense()?;
    let mut tensors = out_tensors(&tables, &rows, &dense, opts)?;
    let files = into_files(&tensors, opts.max_file_size);
    let row_tables: Vec<&str> = rows.tables.iter().map(|t| t.0.as_str()).collect();
    let (names, handles, written) =
        create_files(&*storage, &files, &mut tensors, opts.quantize, &row_tables)?;
    let filled = crate::load::restore::reader_pool(opts.parallel)
        .and_then(|pool| {
            pool.install(|| {
                fill(&tables, &dense, &tensors, &handles, out, opts.sort_memory)?;
                fill_row_tables(&rows, &tensors, &handles)
            })
        })
        // An export of bytes that fail their checksums is never committed.
        .and_then(|()| {
            tables
                .iter()
                .try_for_each(|t| t.finish_checks().map_err(Error::from))
        });
    if let Err(e) = filled {
        handles.into_iter().for_each(|h| h.abort());
        return Err(e);
    }
    for h in handles {
        h.commit(opts.durable)?;
    }
    let weight_map: BTreeMap<&str, &str> = tensors
        .iter()
        .map(|t| (t.name.as_str(), names[t.file].as_str()))
        .collect();
    let total: u64 = tensors.iter().map(|t| t.len).sum();
    let mut metadata = serde_json::json!({ "total_size": total });
    if let Some(q) = opts.quantize {
        metadata["quantization"] = q.format_name().into();
        metadata["quantization_layout"] = q.layout_name().into();
        metadata["quantization_bits"] = q.bits.bits().to_string().into();
    }
    let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
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
        files: files.len(),
        tensors: tensors.len(),
        bytes_written: written,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// An error naming the option `opts` holds out of range.
fn check_options(opts: &ExportOptions) -> Result<()> {
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
    Ok(())
}

/// The tensors of the export, in order: each table's ids and slots (tables by name), then the
/// dense tensors; floats cast to `opts.dtype` if given; quantized slots as one fused tensor, or
/// in the split layout as `<slot>`, `<slot>_qscale` and `<slot>_qbias`.
fn out_tensors(
    tables: &[&dyn BucketRows],
    rows: &RowTables<'_>,
    dense: &[LoadedDense],
    opts: &ExportOptions,
) -> Result<Vec<OutTensor>> {
    let out_dtype = |dtype: Dtype| match opts.dtype {
        Some(to) if dtype.is_float() => to,
        _ => dtype,
    };
    let quantized = match opts.quantize {
        Some(_) => crate::load::restore::globs("quantize_slots", &opts.quantize_slots)?,
        None => None,
    };
    let mut tensors = Vec::new();
    let mut add = |name: String,
                   from: Dtype,
                   dtype: Dtype,
                   shape: Vec<u64>,
                   src: Src,
                   quantized: Option<QuantPart>|
     -> Result<()> {
        let len = saver_core::tensor::byte_len(&name, dtype, &shape)?;
        let (source, row_source) = match src {
            Src::Column(t, c) => (Some((t, c)), None),
            Src::Row(t, s) => (None, Some((t, s))),
            Src::Dense => (None, None),
        };
        tensors.push(OutTensor {
            name,
            from,
            dtype,
            shape,
            len,
            file: 0,
            offset: 0,
            source,
            row_source,
            quantized,
        });
        Ok(())
    };
    // Every column, in the order of the files: each table's ids and slots (tables by name),
    // then each row-range table's slots whole: (tensor, slot name or `None` for ids, dtype,
    // shape of a row, rows, where its values come from).
    let mut columns: Vec<ColumnOut<'_>> = Vec::new();
    for (ti, t) in tables.iter().enumerate() {
        let (name, rows) = (t.name(), t.rows());
        let ids = t.key_dtype().dtype();
        columns.push((
            format!("{name}/ids"),
            None,
            ids,
            Vec::new(),
            rows,
            Src::Column(ti, 0),
        ));
        for (k, spec) in t.slots().iter().enumerate() {
            columns.push((
                format!("{name}/{}", spec.name),
                Some(&spec.name),
                spec.dtype,
                spec.shape.clone(),
                rows,
                Src::Column(ti, k + 1),
            ));
        }
    }
    for (ri, (name, rows, slots)) in rows.tables.iter().enumerate() {
        for (si, (slot, dtype, whole)) in slots.iter().enumerate() {
            columns.push((
                format!("{name}/{slot}"),
                Some(slot),
                *dtype,
                whole[1..].to_vec(),
                *rows,
                Src::Row(ri, si),
            ));
        }
    }
    let mut any_quantized = false;
    for (tensor, slot, dtype, row_shape, rows, source) in columns {
        let mut shape = vec![rows];
        shape.extend_from_slice(&row_shape);
        let Some(slot) = slot else {
            add(tensor, dtype, dtype, shape, source, None)?;
            continue;
        };
        let q = match (opts.quantize, &quantized) {
            (Some(q), Some(globs)) if globs.is_match(slot) => q,
            _ => {
                add(tensor, dtype, out_dtype(dtype), shape, source, None)?;
                continue;
            }
        };
        let dim = match row_shape[..] {
            [dim] if dtype.is_float() && dim > 0 => dim as usize,
            _ => {
                return Err(Error::InvalidOption {
                    option: "quantize_slots",
                    why: format!(
                        "{tensor} has rows of {dtype} {row_shape:?}; only rows of one dimension \
                         of f32, f16 or bf16 can be quantized"
                    ),
                })
            }
        };
        any_quantized = true;
        let how = Some(QuantPart::Rows(q, dim));
        if q.layout == QuantLayout::Split {
            let packed = q.bits.packed_bytes(dim) as u64;
            add(
                tensor.clone(),
                dtype,
                Dtype::U8,
                vec![rows, packed],
                source,
                how,
            )?;
            for (part, which) in [("qscale", QuantPart::Scales), ("qbias", QuantPart::Biases)] {
                let name = format!("{tensor}_{part}");
                add(name, dtype, Dtype::F16, vec![rows, 1], source, Some(which))?;
            }
        } else {
            let width = q.fused_row_bytes(dim) as u64;
            add(tensor, dtype, Dtype::U8, vec![rows, width], source, how)?;
        }
    }
    if opts.quantize.is_some() && !any_quantized {
        return Err(Error::InvalidOption {
            option: "quantize_slots",
            why: format!(
                "no slot of the exported tables matches {:?}",
                opts.quantize_slots
            ),
        });
    }
    for d in dense {
        let shape = d.shape.clone();
        add(
            d.name.clone(),
            d.dtype,
            out_dtype(d.dtype),
            shape,
            Src::Dense,
            None,
        )?;
    }
    // Tables come first, then dense tensors: a dense tensor may bear a name the export gives a
    // table's column (`t/ids`), and the split layout adds `<slot>_qscale` and `<slot>_qbias`,
    // which a model may already have.
    let mut names = std::collections::HashMap::new();
    for t in &tensors {
        let Some(first) = names.insert(t.name.as_str(), t) else {
            continue;
        };
        let split_part = |x: &OutTensor| {
            matches!(
                x.quantized,
                Some(QuantPart::Scales) | Some(QuantPart::Biases)
            )
        };
        if split_part(first) || split_part(t) {
            return Err(Error::InvalidOption {
                option: "quantize_layout",
                why: format!(
                    "the split layout would write tensor {:?}, which the model already has; \
                     use the fused layout or leave that slot out",
                    t.name
                ),
            });
        }
        return Err(Error::Mismatch(format!(
            "dense tensor {:?} bears the name the export gives a column of table {:?}: a plain \
             export names a table's tensors <table>/ids and <table>/<slot>, so rename the dense \
             tensor or leave the table out (--tables)",
            t.name,
            t.name.split('/').next().unwrap_or_default()
        )));
    }
    Ok(tensors)
}

/// The tensors of each file: filled in order, a new file started when the next tensor would
/// overflow `max_file_size` (a tensor larger than that has a file of its own).
fn into_files(tensors: &[OutTensor], max_file_size: u64) -> Vec<Vec<usize>> {
    // Fill files in order, starting a new one when the next tensor would overflow.
    let mut files: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if size + t.len > max_file_size && !files.last().expect("one file").is_empty() {
            files.push(Vec::new());
            size = 0;
        }
        size += t.len;
        files.last_mut().expect("one file").push(i);
    }
    files
}

/// The files of an export, created: their names, their handles, and their bytes.
type CreatedFiles = (Vec<String>, Vec<Box<dyn WriteHandle>>, u64);

/// Creates the export's files, each with its header written: their names, handles and bytes.
/// Records each tensor's file and offset. On error, removes what it created.
fn create_files(
    storage: &dyn Storage,
    files: &[Vec<usize>],
    tensors: &mut [OutTensor],
    quantize: Option<Quantization>,
    row_tables: &[&str],
) -> Result<CreatedFiles> {
    // Names the row-range tables, so that `save --from` the export reads them back as such
    // (their slots would otherwise be dense tensors); a quantized export's are not its
    // checkpoint's tables.
    let row_tables = (!row_tables.is_empty() && quantize.is_none())
        .then(|| serde_json::to_string(row_tables).expect("names serialize"));
    let n = files.len();
    let names: Vec<String> = (0..n)
        .map(|i| format!("model-{:05}-of-{n:05}.safetensors", i + 1))
        .collect();
    let mut handles = Vec::new();
    let mut written = 0u64;
    for (f, members) in files.iter().enumerate() {
        let mut off = 0;
        let headers: Vec<HeaderTensor> = members
            .iter()
            .map(|&i| {
                let t = &tensors[i];
                let h = HeaderTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    start: off,
                    end: off + t.len,
                };
                off = h.end;
                h
            })
            .collect();
        let mut metadata = vec![("format", "pt".to_string())];
        if let Some(names) = &row_tables {
            metadata.push((crate::source::ROW_TABLES_KEY, names.clone()));
        }
        // The quantized tensors of this file: a quantized slot's tensor, and in the split
        // layout its scales and biases.
        let quantized: Vec<&str> = members
            .iter()
            .filter(|&&i| tensors[i].quantized.is_some())
            .map(|&i| tensors[i].name.as_str())
            .collect();
        if let (Some(q), false) = (quantize, quantized.is_empty()) {
            metadata.push(("quantization", q.format_name().to_string()));
            metadata.push(("quantization_layout", q.layout_name().to_string()));
            metadata.push(("quantization_bits", q.bits.bits().to_string()));
            metadata.push(("quantized_tensors", quantized.join(",")));
        }
        let header = render_header_with(&metadata, &headers, 64);
        let hlen = header.len() as u64;
        for (&i, h) in members.iter().zip(&headers) {
            tensors[i].file = f;
            tensors[i].offset = hlen + h.start;
        }
        let result =
            storage
                .create(&names[f], hlen + off)
                .and_then(|h| match h.write_at(0, &header) {
                    Ok(()) => Ok(h),
                    Err(e) => {
                        h.abort();
                        Err(e)
                    }
                });
        match result {
            Ok(h) => handles.push(h),
            Err(e) => {
                handles.into_iter().for_each(|h| h.abort());
                return Err(e);
            }
        }
        written += hlen + off;
    }
    Ok((names, handles, written))
}

/// One output tensor of a column, and how many of its bytes are written.
struct Out<'a> {
    tensor: &'a OutTensor,
    handle: &'a dyn WriteHandle,
    at: u64,
}

/// Rows of one column of a table (its ids or one slot) on their way to the file: gathered, then
/// cast or quantized, and written at each output tensor's next offset by the write-behind
/// thread. A column has one output tensor, or three for a slot quantized in the split layout.
struct Column<'a, 'b> {
    outs: Vec<Out<'a>>,
    behind: &'b WriteBehind<'a>,
    buf: Vec<u8>,
    /// Rows quantized so far, for messages.
    rows: u64,
}

impl<'a, 'b> Column<'a, 'b> {
    /// The column whose output tensors are those of `tensors` that `of` picks, in their files.
    fn new(
        tensors: &'a [OutTensor],
        handles: &'a [Box<dyn WriteHandle>],
        behind: &'b WriteBehind<'a>,
        of: impl Fn(&OutTensor) -> bool,
    ) -> Self {
        Column {
            outs: tensors
                .iter()
                .filter(|x| of(x))
                .map(|tensor| Out {
                    tensor,
                    handle: handles[tensor.file].as_ref(),
                    at: 0,
                })
                .collect(),
            behind,
            buf: Vec::new(),
            rows: 0,
        }
    }

    /// The bytes of each output tensor for the rows in `buf`.
    fn convert(&mut self) -> Result<Vec<Vec<u8>>> {
        let t = self.outs[0].tensor;
        let Some(QuantPart::Rows(q, dim)) = t.quantized else {
            return Ok(vec![if t.dtype != t.from {
                cast(&self.buf, t.from, t.dtype)?
            } else {
                std::mem::replace(&mut self.buf, Vec::with_capacity(COLUMN_BUFFER_BYTES))
            }]);
        };
        let floats = if t.from == Dtype::F32 {
            std::borrow::Cow::Borrowed(&self.buf[..])
        } else {
            std::borrow::Cow::Owned(cast(&self.buf, t.from, Dtype::F32)?)
        };
        let values: Vec<f32> = floats
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let rows = (values.len() / dim) as u64;
        let mut into = QuantizedRows {
            values: Vec::with_capacity(rows as usize * q.fused_row_bytes(dim)),
            ..QuantizedRows::default()
        };
        q.quantize(&values, dim, &t.name, self.rows, &mut into)?;
        self.rows += rows;
        Ok(if q.layout == QuantLayout::Split {
            vec![into.values, into.scales, into.biases]
        } else {
            vec![into.values]
        })
    }

    fn flush(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let pieces = self.convert()?;
        self.buf.clear();
        for (out, bytes) in self.outs.iter_mut().zip(pieces) {
            let (handle, offset) = (out.handle, out.tensor.offset + out.at);
            out.at += bytes.len() as u64;
            self.behind.push(Box::new(move || {
                handle.write_at(offset, &bytes)?;
                // Final bytes: their writeback starts now, not at the commit's fsync.
                handle.start_writeback(offset, bytes.len() as u64);
                Ok(())
            }))?;
        }
        Ok(())
    }

    /// Writes what is left, and checks that every output tensor got all its bytes.
    fn finish(&mut self) -> Result<()> {
        self.flush()?;
        for out in &self.outs {
            if out.at != out.tensor.len {
                return Err(Error::Mismatch(format!(
                    "export of {:?} wrote {} bytes, {} expected",
                    out.tensor.name, out.at, out.tensor.len
                )));
            }
        }
        Ok(())
    }

    fn push(&mut self, bytes: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= COLUMN_BUFFER_BYTES {
            self.flush()?;
        }
        Ok(())
    }
}

/// Writes every tensor's bytes into the files of `handles`.
fn fill(
    tables: &[&dyn BucketRows],
    dense: &[LoadedDense],
    tensors: &[OutTensor],
    handles: &[Box<dyn WriteHandle>],
    scratch: &Path,
    sort_memory: usize,
) -> Result<()> {
    for (ti, t) in tables.iter().enumerate() {
        std::thread::scope(|scope| {
            let behind = WriteBehind::new(scope);
            let mut columns: Vec<Column<'_, '_>> = (0..=t.slots().len())
                .map(|c| Column::new(tensors, handles, &behind, |x| x.source == Some((ti, c))))
                .collect();
            let produced = visit_by_id(*t, scratch, sort_memory, &mut |ids, slots| {
                let (id_col, slot_cols) = columns.split_first_mut().expect("an ids column");
                for id in ids {
                    id_col.push(&id.to_le_bytes())?;
                }
                for (c, s) in slot_cols.iter_mut().zip(slots) {
                    c.push(s)?;
                }
                Ok(())
            })
            .and_then(|()| columns.iter_mut().try_for_each(Column::finish));
            drop(columns);
            behind.finish_after(produced)
        })?;
    }
    let dense_tensors = tensors
        .iter()
        .filter(|t| t.source.is_none() && t.row_source.is_none());
    for (d, tensor) in dense.iter().zip(dense_tensors) {
        let bytes = if tensor.dtype != tensor.from {
            cast(&d.data, tensor.from, tensor.dtype)?
        } else {
            d.data.clone()
        };
        handles[tensor.file].write_at(tensor.offset, &bytes)?;
    }
    Ok(())
}

/// Rows of a row-range table read at a time for an export.
const ROW_BATCH_BYTES: u64 = 4 << 20;

/// Writes every row-range table's slots, each as its whole tensor (cast or quantized as a
/// table's column is), a bounded batch of rows at a time.
fn fill_row_tables(
    rows: &RowTables<'_>,
    tensors: &[OutTensor],
    handles: &[Box<dyn WriteHandle>],
) -> Result<()> {
    for (ri, (name, count, slots)) in rows.tables.iter().enumerate() {
        for (si, (slot, dtype, whole)) in slots.iter().enumerate() {
            std::thread::scope(|scope| {
                let behind = WriteBehind::new(scope);
                let mut column = Column::new(tensors, handles, &behind, |x| {
                    x.row_source == Some((ri, si))
                });
                let row_bytes = dtype
                    .byte_len(whole.get(1).copied().unwrap_or(1))
                    .unwrap_or(0)
                    .max(1);
                let step = (ROW_BATCH_BYTES / row_bytes).max(1);
                let mut batch = Vec::new();
                let produced = (|| -> Result<()> {
                    let mut at = 0;
                    while at < *count {
                        let end = (at + step).min(*count);
                        batch.resize(((end - at) * row_bytes) as usize, 0);
                        rows.ckpt.load_rows(
                            name,
                            at..end,
                            &mut [crate::RowsInto::new(slot, &mut batch)],
                        )?;
                        column.push(&batch)?;
                        at = end;
                    }
                    column.finish()
                })();
                drop(column);
                behind.finish_after(produced)
            })?;
        }
    }
    Ok(())
}

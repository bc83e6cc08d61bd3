//! `saver._saver`: the native half of the `saver` Python package.
//!
//! The Python half (`python/saver/__init__.py`) checks and converts its arguments with numpy and
//! hands this module flat byte arrays with their dtype names and shapes; this module builds the
//! same `SaveInput` and `LoadOptions` the `saver` binary builds and runs saver-io with the GIL
//! released. Nothing of the core's logic is repeated here: a checkpoint saved from Python is the
//! checkpoint the library would save from the same arrays.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use saver_core::{
    ColumnTable, DenseTensor, Dtype, KeyDtype, RowRangeChunk, SaveInput, SlotSpec, SparseTable,
    TableRef,
};
use saver_io::tools::digest::{Content, DigestVersion};
use saver_io::{Checkpoint, LoadOptions, LoadRequest, SaveOptions};

create_exception!(
    _saver,
    SaverError,
    PyException,
    "An error of saving, loading or verifying a checkpoint: its message is the library's (and \
     the `saver` binary's) one-line message, naming the file, table, tensor or argument."
);

/// saver-io's error as a [`SaverError`].
fn err(e: impl std::fmt::Display) -> PyErr {
    SaverError::new_err(in_python_terms(e.to_string()))
}

/// The core's messages name the command line's flags and Rust's types where they say what to
/// do: said here as this package's arguments.
fn in_python_terms(mut msg: String) -> String {
    const SAID: [(&str, &str); 4] = [
        (
            "pass --overwrite (SaveOptions::overwrite in the library)",
            "pass overwrite=True",
        ),
        (
            "route ids with PartitionRule::shard_of, or set ForeignRows::Skip if every process \
             holds the whole table",
            "give each process the rows of its shard, or pass foreign_rows=\"skip\" if every \
             process holds the whole table",
        ),
        (
            "(overwrite replaces the newest step)",
            "(overwrite=True replaces the newest step)",
        ),
        ("SaveOptions::wait or --wait-seconds", "wait"),
    ];
    for (rust, python) in SAID {
        msg = msg.replace(rust, python);
    }
    msg
}

fn dtype(name: &str) -> PyResult<Dtype> {
    name.parse::<Dtype>().map_err(err)
}

fn key_dtype(name: &str) -> PyResult<KeyDtype> {
    KeyDtype::from_dtype(dtype(name)?)
        .ok_or_else(|| err(format!("id dtype {name:?}: ids must be int64 or uint64")))
}

/// One slot of a table from Python: name, dtype name, the shape of one row, and the rows' bytes.
type SlotIn<'py> = (String, String, Vec<u64>, PyReadonlyArray1<'py, u8>);

/// One table from Python: name, id dtype name, the ids' 64 bits, and its slots.
type TableIn<'py> = (String, String, PyReadonlyArray1<'py, u64>, Vec<SlotIn<'py>>);

/// A tensor's bytes from Python: a flat byte array read in place, or a source the save reads as
/// it writes, a writer's chunk at a time (a device tensor staged through the host seam's
/// bounded ring of host buffers, `saver/_staging.py`).
#[derive(FromPyObject)]
enum BytesIn<'py> {
    Array(PyReadonlyArray1<'py, u8>),
    Source(StagedSource),
}

/// One dense tensor from Python: name, dtype name, shape, bytes.
type DenseIn<'py> = (String, String, Vec<u64>, BytesIn<'py>);

/// Bytes read from a Python object as the save writes them: its `read_into(offset, address,
/// length)` fills the `length` bytes at `address` with its bytes from `offset` (the staging
/// ring copies them from the device through a host buffer). Called from the save's writer
/// threads, each taking the GIL for the call; the ring waits for its copies without it.
struct StagedSource {
    source: Py<PyAny>,
    len: u64,
    what: String,
    /// Whether its bytes stay as they are after the call returns (a copy of the moment in
    /// device memory), so that a background save reads them as it writes rather than copying
    /// them to the host during the call.
    lasting: bool,
}

impl<'a, 'py> FromPyObject<'a, 'py> for StagedSource {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self {
            len: obj.getattr("nbytes")?.extract()?,
            what: obj.getattr("what")?.extract()?,
            lasting: obj.getattr("lasting")?.extract()?,
            source: obj.to_owned().unbind(),
        })
    }
}

impl std::fmt::Debug for StagedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedSource")
            .field("what", &self.what)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl saver_core::ByteSource for StagedSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> saver_core::Result<()> {
        Python::attach(|py| {
            self.source
                .call_method1(
                    py,
                    "read_into",
                    (offset, out.as_mut_ptr() as usize, out.len()),
                )
                .map(drop)
        })
        .map_err(|e| saver_core::Error::External(format!("{}: {e}", self.what).into()))
    }
}

impl BytesIn<'_> {
    /// The tensor `name` of `dtype` and `shape` over these bytes.
    fn tensor<'a>(
        &'a self,
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
    ) -> PyResult<DenseTensor<'a>> {
        match self {
            BytesIn::Array(a) => DenseTensor::new(name, dtype, shape, Cow::Borrowed(a.as_slice()?)),
            BytesIn::Source(s) if s.lasting => {
                DenseTensor::lasting(name, dtype, shape, Arc::new(s.clone_ref()))
            }
            BytesIn::Source(s) => {
                DenseTensor::deferred(name, dtype, shape, Arc::new(s.clone_ref()))
            }
        }
        .map_err(err)
    }

    /// A row-range chunk of `table`'s `slot` of `dtype` and `shape` over these bytes.
    fn chunk<'a>(
        &'a self,
        table: &str,
        slot: &str,
        dtype: Dtype,
        shape: Vec<u64>,
    ) -> PyResult<RowRangeChunk<'a>> {
        match self {
            BytesIn::Array(a) => {
                RowRangeChunk::new(table, slot, dtype, shape, Cow::Borrowed(a.as_slice()?))
            }
            BytesIn::Source(s) if s.lasting => {
                RowRangeChunk::lasting(table, slot, dtype, shape, Arc::new(s.clone_ref()))
            }
            BytesIn::Source(s) => {
                RowRangeChunk::deferred(table, slot, dtype, shape, Arc::new(s.clone_ref()))
            }
        }
        .map_err(err)
    }
}

impl StagedSource {
    fn clone_ref(&self) -> Self {
        Python::attach(|py| Self {
            source: self.source.clone_ref(py),
            len: self.len,
            what: self.what.clone(),
            lasting: self.lasting,
        })
    }
}

/// One chunk of a row-range table from Python: table, slot, dtype name, the chunk's shape, its
/// offset in the slot, the slot's whole shape, bytes.
type ChunkIn<'py> = (
    String,
    String,
    String,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    BytesIn<'py>,
);

/// How to save: the keyword arguments of `saver.save` (see its docstring), as a dict.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct SaveArgs {
    shards: u32,
    shard_index: Option<u32>,
    save_id: Option<String>,
    parallel: Option<usize>,
    step: Option<u64>,
    metadata: BTreeMap<String, String>,
    overwrite: bool,
    durable: bool,
    skip_foreign_rows: bool,
    parent: Option<PathBuf>,
    exclude_slots: Vec<String>,
    keep_rows: Vec<String>,
    compress: Option<String>,
    direct_io: String,
    wait: Option<f64>,
}

impl SaveArgs {
    /// The save's options, through the library's one mapping of save settings: a refusal names
    /// the keyword (`keep_rows`, `wait`).
    fn options(self) -> PyResult<SaveOptions> {
        let settings = {
            saver_io::SaveSettings {
                shards: self.shards,
                shard_index: self.shard_index,
                save_id: self.save_id,
                parallel: self.parallel,
                step: self.step,
                metadata: self.metadata,
                overwrite: self.overwrite,
                durable: self.durable,
                skip_foreign_rows: self.skip_foreign_rows,
                parent: self.parent,
                exclude_slots: self.exclude_slots,
                keep_rows: self.keep_rows,
                compress: self.compress,
                direct_io: self.direct_io,
                wait_seconds: self.wait,
                ..Default::default()
            }
        };
        settings.options().map_err(|e| match e {
            saver_io::Error::InvalidOption { option, why } => {
                let keyword = if option == "wait_seconds" {
                    "wait"
                } else {
                    option
                };
                err(format!("{keyword}: {why}"))
            }
            e => err(e),
        })
    }
}

/// The tables of a save, over the caller's arrays (read in place, so they must not change until
/// the save ends).
fn borrowed_tables<'a>(tables: &'a [TableIn<'_>]) -> PyResult<Vec<ColumnTable<'a>>> {
    let mut columns = Vec::with_capacity(tables.len());
    for (name, key, ids, slots) in tables {
        let mut specs = Vec::with_capacity(slots.len());
        let mut data = Vec::with_capacity(slots.len());
        for (slot, dt, shape, bytes) in slots {
            specs.push(SlotSpec::new(slot.clone(), dtype(dt)?, shape.clone()));
            data.push(bytes.as_slice()?);
        }
        let table =
            ColumnTable::borrowed(name.clone(), key_dtype(key)?, specs, ids.as_slice()?, data);
        columns.push(table.map_err(err)?);
    }
    Ok(columns)
}

/// The dense tensors of a save, over the caller's arrays.
fn dense_tensors<'a>(dense: &'a [DenseIn<'_>]) -> PyResult<Vec<DenseTensor<'a>>> {
    let mut tensors = Vec::with_capacity(dense.len());
    for (name, dt, shape, bytes) in dense {
        tensors.push(bytes.tensor(name.clone(), dtype(dt)?, shape.clone())?);
    }
    Ok(tensors)
}

/// The chunks of row-range tables of a save, over the caller's arrays.
fn row_chunks<'a>(chunks: &'a [ChunkIn<'_>]) -> PyResult<Vec<RowRangeChunk<'a>>> {
    chunks
        .iter()
        .map(|(table, slot, dt, shape, offset, whole, bytes)| {
            bytes
                .chunk(table, slot, dtype(dt)?, shape.clone())?
                .at(offset, whole)
                .map_err(err)
        })
        .collect()
}

/// Runs `save` with the GIL released, on the tables, dense tensors and row-range chunks given,
/// read in place.
fn in_place<R: Send>(
    py: Python<'_>,
    tables: &[TableIn<'_>],
    dense: &[DenseIn<'_>],
    chunks: &[ChunkIn<'_>],
    save: impl FnOnce(SaveInput<'_>) -> saver_io::Result<R> + Send,
) -> PyResult<R> {
    let tables = borrowed_tables(tables)?;
    let dense = dense_tensors(dense)?;
    let chunks = row_chunks(chunks)?;
    let refs = tables.iter().map(|t| TableRef::from(t as &dyn SparseTable));
    py.detach(|| save(input(refs.collect(), dense, chunks)))
        .map_err(err)
}

/// Runs `start` with the GIL released, on copies of the tables and dense tensors given: what a
/// background save takes, so that the caller may change its arrays once it returns. The copies
/// are taken holding the GIL, so that no Python code changes the arrays while they are copied,
/// and by every core (rayon's threads need no GIL), so that the caller waits for them at the
/// machine's pace, not one core's. A staged source whose bytes last (a copy of the moment in
/// device memory) is not copied: the save reads it as it writes.
fn copied<R: Send>(
    py: Python<'_>,
    tables: &[TableIn<'_>],
    dense: &[DenseIn<'_>],
    chunks: &[ChunkIn<'_>],
    start: impl FnOnce(SaveInput<'static>) -> saver_io::Result<R> + Send,
) -> PyResult<R> {
    let tables: Vec<Arc<dyn SparseTable>> = borrowed_tables(tables)?
        .iter()
        .map(|t| Arc::new(t.copied()) as Arc<dyn SparseTable>)
        .collect();
    // A lasting source (a device copy of the moment) stays as it is: the save reads it as it
    // writes.
    let dense = dense_tensors(dense)?
        .into_iter()
        .map(DenseTensor::into_owned)
        .collect::<saver_core::Result<_>>()
        .map_err(err)?;
    let chunks = row_chunks(chunks)?
        .into_iter()
        .map(RowRangeChunk::into_owned)
        .collect::<saver_core::Result<_>>()
        .map_err(err)?;
    py.detach(|| {
        start(input(
            tables.iter().map(TableRef::from).collect(),
            dense,
            chunks,
        ))
    })
    .map_err(err)
}

fn input<'a>(
    tables: Vec<TableRef<'a>>,
    dense: Vec<DenseTensor<'a>>,
    row_chunks: Vec<RowRangeChunk<'a>>,
) -> SaveInput<'a> {
    let mut input = SaveInput::new();
    for t in tables {
        input = input.table(t);
    }
    for t in dense {
        input = input.dense(t);
    }
    input.row_chunks = row_chunks;
    input
}

fn report_dict<'py>(
    py: Python<'py>,
    report: &saver_io::SaveReport,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("save_id", &report.save_id)?;
    d.set_item("shards", &report.shards)?;
    d.set_item("files", report.files)?;
    d.set_item("rows", report.rows)?;
    d.set_item("bytes_written", report.bytes_written)?;
    d.set_item("skipped_rows", report.skipped_rows)?;
    d.set_item("plan_seconds", report.plan_seconds)?;
    d.set_item("write_seconds", report.write_seconds)?;
    d.set_item("commit_seconds", report.commit_seconds)?;
    d.set_item("committed", report.committed)?;
    Ok(d)
}

/// A managed save's report: the save's, and why it is full.
fn managed_dict<'py>(
    py: Python<'py>,
    saved: &saver_io::manage::ManagedSave,
) -> PyResult<Bound<'py, PyDict>> {
    let d = report_dict(py, &saved.save)?;
    d.set_item("full_because", &saved.full_because)?;
    Ok(d)
}

/// Saves tables and dense tensors into `path` (a directory or an `s3://` location); returns the
/// save's report as a dict. Every array is read in place.
#[pyfunction]
fn save<'py>(
    py: Python<'py>,
    path: PathBuf,
    tables: Vec<TableIn<'py>>,
    dense: Vec<DenseIn<'py>>,
    chunks: Vec<ChunkIn<'py>>,
    args: SaveArgs,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = args.options()?;
    let report = in_place(py, &tables, &dense, &chunks, |input| {
        saver_io::save(&path, input, &opts)
    })?;
    report_dict(py, &report)
}

/// A background save under way (see `saver.save_async`).
#[pyclass(module = "saver._saver")]
struct SaveHandle {
    handle: Mutex<Option<saver_io::SaveHandle>>,
}

#[pymethods]
impl SaveHandle {
    /// Whether the save has ended (committed or failed): `wait` then returns at once.
    fn done(&self) -> bool {
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        handle
            .as_ref()
            .is_none_or(saver_io::SaveHandle::is_finished)
    }

    /// Bytes written so far.
    fn bytes_written(&self) -> u64 {
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        handle
            .as_ref()
            .map_or(0, saver_io::SaveHandle::bytes_written)
    }

    /// Waits for the save to end, with the GIL released; returns its report, or raises its
    /// error. Only once.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
        let handle = handle.ok_or_else(|| err("this save was already waited for"))?;
        let report = py.detach(|| handle.wait()).map_err(err)?;
        report_dict(py, &report)
    }
}

/// Starts a save in the background and returns once its moment is fixed: the tables' rows and
/// the dense tensors copied, so the caller may change its arrays from then on.
#[pyfunction]
fn save_async<'py>(
    py: Python<'py>,
    path: PathBuf,
    tables: Vec<TableIn<'py>>,
    dense: Vec<DenseIn<'py>>,
    chunks: Vec<ChunkIn<'py>>,
    args: SaveArgs,
) -> PyResult<SaveHandle> {
    let opts = args.options()?;
    let handle = copied(py, &tables, &dense, &chunks, |input| {
        saver_io::save_async(&path, input, opts)
    })?;
    Ok(SaveHandle {
        handle: Mutex::new(Some(handle)),
    })
}

/// A step's entry of a managed root, as a dict.
fn step_dict<'py>(py: Python<'py>, s: &saver_io::manage::StepInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", s.step)?;
    d.set_item("path", s.path.to_string_lossy())?;
    d.set_item("save_id", &s.save_id)?;
    d.set_item("parent", s.parent)?;
    d.set_item("links", s.links)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("shards", s.shards)?;
    d.set_item("metadata", &s.user_metadata)?;
    Ok(d)
}

/// Steps, each with why it was passed over or left alone.
type StepsWhy = Vec<(u64, String)>;

/// The checkpoints of a training job under one root (see `saver.Manager`).
#[pyclass(module = "saver._saver")]
struct Manager {
    inner: saver_io::CheckpointManager,
}

#[pymethods]
impl Manager {
    #[new]
    #[pyo3(signature = (root, every_steps, full_every, max_chain_links, keep_latest, keep_every))]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        every_steps: u64,
        full_every: u32,
        max_chain_links: usize,
        keep_latest: usize,
        keep_every: Option<u64>,
    ) -> PyResult<Self> {
        let mut policy = {
            saver_io::Policy {
                every_steps,
                full_every,
                max_chain_links,
                ..Default::default()
            }
        };
        policy.retention.keep_latest = keep_latest;
        policy.retention.keep_every = keep_every;
        let inner = py
            .detach(|| saver_io::CheckpointManager::open(&root, policy))
            .map_err(err)?;
        Ok(Self { inner })
    }

    fn is_due(&self, step: u64) -> bool {
        self.inner.is_due(step)
    }

    /// Makes the next save full, whatever the policy says.
    fn force_full(&self) {
        self.inner.force_full()
    }

    /// Saves step `step` (full or a delta, by the policy), then applies retention.
    fn save<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tables: Vec<TableIn<'py>>,
        dense: Vec<DenseIn<'py>>,
        chunks: Vec<ChunkIn<'py>>,
        args: SaveArgs,
    ) -> PyResult<Bound<'py, PyDict>> {
        let opts = args.options()?;
        let saved = in_place(py, &tables, &dense, &chunks, |input| {
            self.inner.save(step, input, &opts)
        })?;
        managed_dict(py, &saved)
    }

    /// Starts saving step `step` in the background (after waiting for the previous one);
    /// returns once its moment is fixed.
    fn save_async<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tables: Vec<TableIn<'py>>,
        dense: Vec<DenseIn<'py>>,
        chunks: Vec<ChunkIn<'py>>,
        args: SaveArgs,
    ) -> PyResult<Option<u64>> {
        let opts = args.options()?;
        let started = copied(py, &tables, &dense, &chunks, |input| {
            self.inner.save_async(step, input, &opts)
        })?;
        // The step still running when this one was skipped, if it was.
        Ok(match started {
            saver_io::manage::Started::Saving { .. } => None,
            saver_io::manage::Started::Skipped { running, .. } => Some(running),
        })
    }

    /// The background save not yet waited for: its step and whether it has ended.
    fn in_flight(&self) -> Option<(u64, bool)> {
        self.inner.in_flight()
    }

    /// Applies the kept retention (or its `keep_latest`, if given) now.
    #[pyo3(signature = (dry_run, keep_latest=None))]
    fn prune<'py>(
        &self,
        py: Python<'py>,
        dry_run: bool,
        keep_latest: Option<usize>,
    ) -> PyResult<(Vec<u64>, Vec<u64>)> {
        let mut rules = self.inner.policy().retention.clone();
        if let Some(k) = keep_latest {
            rules.keep_latest = k;
        }
        let r = py
            .detach(|| self.inner.prune(Some(&rules), dry_run))
            .map_err(err)?;
        Ok((r.removed, r.kept))
    }

    /// Reclaims crashed saves' leftovers: the steps reclaimed, and those left alone with why.
    fn clean(&self, py: Python<'_>, dry_run: bool) -> PyResult<(Vec<u64>, StepsWhy)> {
        let r = py.detach(|| self.inner.clean(dry_run)).map_err(err)?;
        Ok((r.reclaimed, r.left_alone))
    }

    /// Waits for the background save, if one runs: its report, or `None`.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let saved = py.detach(|| self.inner.wait()).map_err(err)?;
        saved.map(|s| managed_dict(py, &s)).transpose()
    }

    /// The committed steps whose chains are whole, oldest first.
    fn steps<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let steps = py.detach(|| self.inner.steps()).map_err(err)?;
        steps.iter().map(|s| step_dict(py, s)).collect()
    }

    /// The newest committed step that verifies, and the newer ones passed over with why.
    fn latest_verified<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Option<Bound<'py, PyDict>>, StepsWhy)> {
        let found = py
            .detach(|| self.inner.root().latest_verified(2))
            .map_err(err)?;
        let step = found.step.map(|s| step_dict(py, &s)).transpose()?;
        Ok((step, found.passed_over))
    }

    /// The newest committed step whose chain is whole.
    fn latest<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let latest = py.detach(|| self.inner.latest()).map_err(err)?;
        latest.map(|s| step_dict(py, &s)).transpose()
    }
}

/// One loaded slot: name, dtype name, row shape, the rows' bytes (owned by the array).
type SlotOut<'py> = (String, &'static str, Vec<u64>, Bound<'py, PyArray1<u8>>);

/// One loaded table: name, id dtype name, ids, slots.
type TableOut<'py> = (
    String,
    &'static str,
    Bound<'py, PyArray1<u64>>,
    Vec<SlotOut<'py>>,
);

/// One loaded dense tensor: name, dtype name, shape, bytes.
type DenseOut<'py> = (String, &'static str, Vec<u64>, Bound<'py, PyArray1<u8>>);

/// A committed checkpoint (or chain) opened once (`saver.open`): every load of one request
/// reads through this opening, so that a request never mixes two saves. Its loads do not move
/// to a checkpoint that replaced this one: a load that fails on a replaced checkpoint says so
/// (`replaced()`), and the caller opens the new one and starts its request over.
#[pyclass(module = "saver._saver", frozen)]
struct Opened {
    ck: Checkpoint,
}

/// Opens the committed checkpoint at `path` (following a delta's parents), with the GIL
/// released.
#[pyfunction]
fn open(py: Python<'_>, path: PathBuf) -> PyResult<Opened> {
    // Pinned: a load through this opening reads this save or fails, never another save.
    let ck = py
        .detach(|| Checkpoint::open(&path).map(Checkpoint::pinned))
        .map_err(err)?;
    Ok(Opened { ck })
}

/// One slot a row-range load fills: slot, its columns (`None`: all), the caller's buffer as a
/// flat view of its bytes (borrowed writable below, where two targets over one memory are
/// refused rather than let numpy's borrow checker panic).
type RowsIntoIn<'py> = (String, Option<(u64, u64)>, Bound<'py, PyArray1<u8>>);

/// One row-range table a load fills: table, first and end row, its slots' targets.
type RowsLoadIn<'py> = (String, u64, u64, Vec<RowsIntoIn<'py>>);

#[pymethods]
impl Opened {
    /// Whether the checkpoint was replaced since it was opened (its location now holds another
    /// save).
    fn replaced(&self, py: Python<'_>) -> bool {
        py.detach(|| self.ck.was_replaced())
    }

    /// What the checkpoint holds, from its manifest: a dict.
    fn inspect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ckpt = &self.ck;
        let m = ckpt.manifest();
        let d = PyDict::new(py);
        d.set_item("save_id", &m.save_id)?;
        d.set_item("shards", m.shard_num)?;
        d.set_item("step", m.step)?;
        d.set_item("delta", ckpt.is_delta())?;
        d.set_item("format_version", m.format_version)?;
        d.set_item("metadata", &m.user_metadata)?;
        let tables = PyDict::new(py);
        for t in ckpt.table_manifests() {
            let info = PyDict::new(py);
            info.set_item("key_dtype", t.key_dtype.dtype().name())?;
            info.set_item("rows", t.rows)?;
            let slots = PyDict::new(py);
            for s in &t.slots {
                slots.set_item(&s.name, (s.dtype.name(), s.shape.clone()))?;
            }
            info.set_item("slots", slots)?;
            tables.set_item(&t.name, info)?;
        }
        d.set_item("tables", tables)?;
        let dense = PyDict::new(py);
        for (_, t) in ckpt.dense_refs().map_err(err)? {
            dense.set_item(
                &t.tensor.name,
                (t.tensor.dtype.name(), t.tensor.shape.clone()),
            )?;
        }
        d.set_item("dense", dense)?;
        let rows = PyDict::new(py);
        for t in &ckpt.manifest().row_tables {
            let info = PyDict::new(py);
            info.set_item("rows", t.rows)?;
            // What this checkpoint holds of it: a delta's patches hold only the changed rows.
            info.set_item("bytes", t.tensor_refs().map(|x| x.len).sum::<u64>())?;
            let slots = PyDict::new(py);
            for s in &t.slots {
                slots.set_item(&s.name, (s.dtype.name(), s.shape.clone()))?;
            }
            info.set_item("slots", slots)?;
            rows.set_item(&t.name, info)?;
        }
        d.set_item("row_tables", rows)?;
        Ok(d)
    }

    /// One load request through this opening, read with the GIL released: the hashed tables
    /// (all rows, or shard `shard_index` of `shards`; none unless `hashed`) and dense tensors into
    /// arrays that own the memory the core filled (handed to numpy without a copy), and rows of
    /// row-range tables into the caller's arrays, in place. Every target is checked before the
    /// first byte lands; a target whose memory another target of the request also covers is
    /// refused, naming it.
    #[pyo3(signature = (shards, shard_index, tables, exclude_slots, load_dense, parallel, hashed, rows))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn load<'py>(
        &self,
        py: Python<'py>,
        shards: u32,
        shard_index: Option<u32>,
        tables: Option<Vec<String>>,
        exclude_slots: Vec<String>,
        load_dense: bool,
        parallel: Option<usize>,
        hashed: bool,
        mut rows: Vec<RowsLoadIn<'py>>,
    ) -> PyResult<(Vec<TableOut<'py>>, Vec<DenseOut<'py>>, Bound<'py, PyDict>)> {
        let mut opts = {
            LoadOptions {
                shard_num: shards,
                shard_index,
                load_dense,
                exclude_slots,
                ..Default::default()
            }
        };
        if let Some(t) = tables {
            opts.required_tables = t.clone();
            opts.tables = t;
        }
        if let Some(p) = parallel {
            opts.parallel = p;
        }
        // Every row-range target borrowed before any is filled: one whose memory another target
        // of this load also covers is refused here, naming it, with nothing written yet.
        let mut borrowed: Vec<Vec<PyReadwriteArray1<'_, u8>>> = Vec::with_capacity(rows.len());
        for (table, _, _, into) in &rows {
            let mut views = Vec::with_capacity(into.len());
            for (slot, _, out) in into {
                views.push(out.try_readwrite().map_err(|_| {
                    err(format!(
                        "into[{table:?}][{slot:?}]: its buffer shares memory with another target \
                         of this load (the same array twice, or overlapping views of one); give \
                         each target memory of its own"
                    ))
                })?);
            }
            borrowed.push(views);
        }
        let mut targets = Vec::with_capacity(rows.len());
        for ((table, start, end, into), views) in rows.iter_mut().zip(&mut borrowed) {
            let mut slots = Vec::with_capacity(into.len());
            for ((slot, cols, _), out) in into.iter_mut().zip(views.iter_mut()) {
                let out = out
                    .as_slice_mut()
                    .map_err(|e| err(format!("table {table:?} slot {slot:?}: {e}")))?;
                let mut t = saver_io::RowsInto::new(slot, out);
                if let Some((a, b)) = *cols {
                    t = t.columns(a..b);
                }
                slots.push(t);
            }
            targets.push((table.as_str(), *start..*end, slots));
        }
        let ck = &self.ck;
        let loaded = py
            .detach(|| {
                let mut request = if hashed {
                    LoadRequest::columns(&opts)
                } else {
                    LoadRequest::dense_only(&opts)
                };
                for (table, rows, slots) in targets {
                    request = request.rows(table, rows, slots);
                }
                ck.load(request)
            })
            .map_err(err)?;
        let m = self.ck.manifest();
        let mut out = Vec::with_capacity(loaded.columns.len());
        for t in loaded.columns {
            let slots = t
                .slots
                .iter()
                .zip(t.data)
                .map(|(s, data)| {
                    let array = PyArray1::from_vec(py, data);
                    (s.name.clone(), s.dtype.name(), s.shape.clone(), array)
                })
                .collect();
            let ids = PyArray1::from_vec(py, t.ids);
            out.push((t.name, t.key_dtype.dtype().name(), ids, slots));
        }
        let dense = loaded
            .dense
            .into_iter()
            .map(|d| {
                let name = d.name;
                (
                    name,
                    d.dtype.name(),
                    d.shape,
                    PyArray1::from_vec(py, d.data),
                )
            })
            .collect();
        let r = &loaded.report;
        let report = PyDict::new(py);
        report.set_item("rows", r.rows)?;
        report.set_item("bytes_read", r.bytes_read)?;
        report.set_item("read_amplification", r.read_amplification)?;
        report.set_item("load_seconds", r.load_seconds)?;
        report.set_item("step", m.step)?;
        report.set_item("metadata", m.user_metadata.clone())?;
        let of_rows = PyDict::new(py);
        of_rows.set_item("bytes_wanted", loaded.rows.bytes_wanted)?;
        of_rows.set_item("bytes_read", loaded.rows.bytes_read)?;
        of_rows.set_item("chunks", loaded.rows.chunks)?;
        report.set_item("row_tables", of_rows)?;
        Ok((out, dense, report))
    }
}

/// Reads every byte of a checkpoint (or chain) and checks it against its CRCs: the report as a
/// dict (`status` "ok", or the problems found).
#[pyfunction]
#[pyo3(signature = (path, parallel))]
fn verify<'py>(py: Python<'py>, path: PathBuf, parallel: usize) -> PyResult<Bound<'py, PyDict>> {
    let report = py
        .detach(|| saver_io::verify(&path, parallel.max(1)))
        .map_err(err)?;
    let d = PyDict::new(py);
    d.set_item("status", format!("{:?}", report.status).to_lowercase())?;
    let problems: Vec<String> = report
        .problems
        .iter()
        .map(|p| match &p.tensor {
            Some(t) => format!("{}: tensor {t}: {}", p.file, p.detail),
            None => format!("{}: {}", p.file, p.detail),
        })
        .collect();
    d.set_item("problems", problems)?;
    Ok(d)
}

/// The content digest of a checkpoint or a plain safetensors model, as `saver digest` prints it.
#[pyfunction]
#[pyo3(signature = (path, parallel))]
fn digest(py: Python<'_>, path: PathBuf, parallel: usize) -> PyResult<String> {
    py.detach(|| {
        saver_io::tools::digest::digest(
            Content::At {
                path: &path,
                parallel,
            },
            DigestVersion::V2,
        )
    })
    .map_err(err)
}

/// Bytes of memory background saves keep for the next one's copy of the model.
#[pyfunction]
fn background_memory() -> u64 {
    saver_core::moment_copy::kept_bytes()
}

/// Frees the memory background saves keep for the next one's copy of the model.
#[pyfunction]
fn release_background_memory() {
    saver_core::moment_copy::release_kept()
}

/// The shard of `shards` that owns each id (given as its 64 bits: an int64 id as its two's
/// complement), by the partition rule every save uses: where a trainer routes a row so that
/// the process writing that shard holds it.
#[pyfunction]
fn shard_of<'py>(
    py: Python<'py>,
    ids: PyReadonlyArray1<'py, u64>,
    shards: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if shards == 0 {
        return Err(err("shard_of: shards must be at least 1"));
    }
    let ids = ids
        .as_slice()
        .map_err(|e| err(format!("shard_of: ids: {e}")))?;
    let owners: Vec<u32> = py.detach(|| {
        ids.iter()
            .map(|&id| saver_core::PartitionRule::shard_of(id, shards))
            .collect()
    });
    Ok(PyArray1::from_vec(py, owners))
}

/// The rows `start..end` of a row-range table of `rows` rows that shard `index` of `shards`
/// holds, by the partition rule's row cut (`saver_core::Shard::rows_of`).
#[pyfunction]
fn row_cut(rows: u64, shards: u32, index: u32) -> PyResult<(u64, u64)> {
    if shards == 0 || index >= shards {
        return Err(err(format!(
            "row_cut: shard {index} of {shards}: give 0 <= index < shards"
        )));
    }
    let r = saver_core::Shard {
        index,
        count: shards,
    }
    .rows_of(rows);
    Ok((r.start, r.end))
}

#[pymodule]
fn _saver(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SaverError", m.py().get_type::<SaverError>())?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<Manager>()?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(save_async, m)?)?;
    m.add_class::<Opened>()?;
    m.add_function(wrap_pyfunction!(open, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(digest, m)?)?;
    m.add_function(wrap_pyfunction!(shard_of, m)?)?;
    m.add_function(wrap_pyfunction!(row_cut, m)?)?;
    m.add_function(wrap_pyfunction!(background_memory, m)?)?;
    m.add_function(wrap_pyfunction!(release_background_memory, m)?)?;
    Ok(())
}

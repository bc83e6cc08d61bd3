//! Plain safetensors inputs (a file, or a directory with or without a Hugging Face index) and
//! their tables as [`SparseTable`]s read in bounded memory.
//!
//! In a plain input, a table is a 1-D I64/U64 tensor named `<table>/ids` with sibling tensors
//! `<table>/<slot>` whose first dimension equals the number of ids; every other tensor is dense.
//! This is also what [`crate::tools::export`] writes, so an export can be saved again.
//!
//! A plain table's rows are in no useful order, and a save writes them by bucket. So
//! [`PlainTable::distribute`] first reads the input once, window by window, and appends each row
//! to one of up to [`MAX_GROUPS`] *groups* of contiguous buckets, in nameless temporary files;
//! from then on the table is read group by group, one group (about [`GROUP_BYTES`]) held at a
//! time per reading thread. A table of at most [`GROUP_BYTES`] is one group, read straight from
//! the input. A table too large for the kernel to keep its temporary rows in the page cache is
//! distributed in rounds instead (see `source/rounds.rs`): its ids and its first rounds of slot
//! rows in one pass, then a round of groups at a time while the save reads them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use saver_core::naming::{check_slot_name, check_table_name, INDEX_FILE};
use saver_core::table::{validate_slots, RowChunk, TableSnapshot};
use saver_core::TableSchema;
use saver_core::{Dtype, KeyDtype, PartitionRule, RowRangeChunk, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::documents::MAX_JSON_BYTES;
use crate::load::header::{read_header, HeaderEntry};
use crate::load::restore::LoadedDense;
use crate::load::rows::{core_error as core, handles_of};
use crate::storage::{check_file_name, FileVersion, LocalFs, ReadHandle, Storage};

use super::distribute::{Content, InputColumn, Output, Pass, Runs, TableInput, TemporaryFiles};
use super::rounds::Rounds;

/// Rows of a group about this many bytes; a table up to this size is one group.
pub(super) const GROUP_BYTES: u64 = 16 << 20;

/// Most groups a table is distributed into. Beyond `GROUP_BYTES × MAX_GROUPS` (64 GiB) groups
/// grow with the table: a reading thread then holds `table / MAX_GROUPS`.
pub(super) const MAX_GROUPS: usize = 4096;

/// Rows a gather asks the CPU to load ahead of the one it copies: a group's rows are in no
/// useful order, so each row read is a cache miss the hardware cannot foresee.
const GATHER_AHEAD: usize = 8;

/// Bits of a row handle that hold the row's number within its group; the group is above.
const ROW_BITS: u32 = 40;

/// One tensor of a plain input.
#[derive(Clone, Debug)]
pub struct PlainTensor {
    /// The file it is in.
    pub file: String,
    /// Its header entry (absolute offset, length).
    pub entry: HeaderEntry,
}

/// Bytes `start..start + len` of a tensor of a plain input, read on demand.
struct PlainRows<'p> {
    input: &'p PlainInput,
    tensor: &'p PlainTensor,
    start: u64,
    len: u64,
}

impl std::fmt::Debug for PlainRows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainRows")
            .field("tensor", &self.tensor.entry.name)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

impl saver_core::ByteSource for PlainRows<'_> {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> saver_core::Result<()> {
        Ok(self.input.read(self.tensor, self.start + offset, out)?)
    }
}

/// A table found in a plain input.
#[derive(Clone, Debug)]
pub struct PlainTableSpec {
    /// Table name.
    pub name: String,
    /// Id dtype.
    pub key_dtype: KeyDtype,
    /// Number of rows (ids).
    pub rows: u64,
    /// The `<table>/ids` tensor.
    pub ids: PlainTensor,
    /// Slots, in input order, with their tensors.
    pub slots: Vec<(SlotSpec, PlainTensor)>,
}

/// A plain safetensors input, opened: headers read, tables and dense tensors told apart, no
/// data read.
pub struct PlainInput {
    location: PathBuf,
    /// Each file's handle, and its version when it was opened: an import reads a file more
    /// than once, and a file written to meanwhile fails the save instead of mixing two contents.
    files: HashMap<String, (Arc<dyn ReadHandle>, Option<FileVersion>)>,
    /// Whether the input is on the local filesystem (read more than once only then).
    local: bool,
    /// Tables, in input order.
    pub tables: Vec<PlainTableSpec>,
    /// Row-range tables (named by a file's `saver_row_tables` metadata, as a plain export
    /// writes it).
    pub row_tables: Vec<PlainRowTable>,
    /// Dense tensors, in input order.
    pub dense: Vec<PlainTensor>,
    /// Every input file's `__metadata__`, as `<file>:<key>`.
    pub user_metadata: BTreeMap<String, String>,
    /// Things about the input a user should hear of (tensors that look like a misspelled table).
    pub warnings: Vec<String>,
}

impl std::fmt::Debug for PlainInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainInput")
            .field("location", &self.location)
            .field("tables", &self.tables)
            .field("dense", &self.dense)
            .finish_non_exhaustive()
    }
}

fn plain_files(path: &Path) -> Result<(Arc<dyn Storage>, Vec<String>)> {
    if crate::storage::location_url(path).is_some() {
        let storage = crate::storage::open_location(path)?;
        let files = plain_dir_files(&*storage)?;
        return Ok((storage, files));
    }
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
        return Ok((Arc::new(LocalFs::open_dir(dir)?), vec![name.to_string()]));
    }
    let storage = LocalFs::open_dir(path)?;
    let files = plain_dir_files(&storage)?;
    Ok((Arc::new(storage), files))
}

/// The data files of a plain safetensors directory: those its index names, or all
/// `*.safetensors`.
fn plain_dir_files(storage: &dyn Storage) -> Result<Vec<String>> {
    let files: Vec<String> = if storage.exists(INDEX_FILE)? {
        #[derive(serde::Deserialize)]
        struct PlainIndex {
            weight_map: BTreeMap<String, String>,
        }
        let bytes = storage.get(INDEX_FILE, MAX_JSON_BYTES)?;
        let index: PlainIndex = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            file: INDEX_FILE.into(),
            what: format!("not a weight map: {e}"),
        })?;
        let mut files: Vec<String> = index.weight_map.into_values().collect();
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
        // DCP's own checkpoints are a pickle and torch.save'd tensors: Python reads them, and
        // the package's import says how, rather than a bare "no file".
        let dcp = storage
            .list()?
            .iter()
            .any(|n| n == ".metadata" || n.ends_with(".distcp"));
        let hint = if dcp {
            " (it is a checkpoint of PyTorch DCP's own files, .metadata and *.distcp: import it \
             with `python -m saver.dcp import DIR OUT`, from the Python package)"
        } else {
            ""
        };
        return Err(Error::Mismatch(format!(
            "{} holds no .safetensors file{hint}",
            storage.location()
        )));
    }
    for f in &files {
        check_file_name(f, &format!("{}/{INDEX_FILE}", storage.location()))?;
    }
    Ok(files)
}

impl PlainInput {
    /// Opens a plain safetensors file or directory: reads every header and finds the tables.
    pub fn open(path: &Path) -> Result<Self> {
        let (storage, files) = plain_files(path)?;
        let mut tensors: BTreeMap<String, PlainTensor> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        let mut opened: HashMap<String, (Arc<dyn ReadHandle>, Option<FileVersion>)> =
            HashMap::new();
        let mut user_metadata = BTreeMap::new();
        let mut row_table_names = std::collections::BTreeSet::new();
        for f in &files {
            let h = storage.open(f)?;
            let header = read_header(h.as_ref(), f)?;
            for (k, v) in header.metadata {
                if k == ROW_TABLES_KEY {
                    let names: Vec<String> =
                        serde_json::from_str(&v).map_err(|e| Error::Corrupt {
                            file: f.clone(),
                            what: format!(
                                "metadata {ROW_TABLES_KEY:?} is not a list of table names: {e}"
                            ),
                        })?;
                    row_table_names.extend(names);
                    continue;
                }
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
                tensors.insert(
                    t.name.clone(),
                    PlainTensor {
                        file: f.clone(),
                        entry: t,
                    },
                );
            }
            let version = h.version()?;
            opened.insert(f.clone(), (Arc::from(h), version));
        }
        let mut table_names = Vec::new();
        for t in order.iter().filter_map(|n| n.strip_suffix("/ids")) {
            match check_table_name(t) {
                Ok(()) => table_names.push(t.to_string()),
                // A nested name (`a/b/ids`, `/ids`) is a dense tensor's path; any other name
                // that cannot be a table's (too long, control characters) is said at once, not
                // half taken for a table and half for dense tensors.
                Err(_) if t.is_empty() || t.contains(['/', ':']) => {}
                Err(e) => {
                    return Err(Error::Mismatch(format!(
                        "tensor \"{}/ids\" names table {t:?}, which cannot be a table's name: \
                         {e}",
                        t.escape_debug()
                    )))
                }
            }
        }
        let mut used = HashSet::new();
        let mut tables = Vec::new();
        for table in &table_names {
            let ids_name = format!("{table}/ids");
            let ids = tensors[&ids_name].clone();
            let e = &ids.entry;
            let key_dtype = KeyDtype::from_dtype(e.dtype)
                .filter(|_| e.shape.len() == 1)
                .ok_or_else(|| {
                    Error::Mismatch(format!(
                        "tensor {ids_name:?} must be a 1-D I64 or U64 tensor of ids, it is {} {:?}",
                        e.dtype, e.shape
                    ))
                })?;
            let rows = e.shape[0];
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
                let t = &tensors[name];
                if t.entry.shape.first() != Some(&rows) {
                    return Err(Error::Mismatch(format!(
                        "tensor {name:?} has shape {:?} but table {table:?} has {rows} ids: a slot's first dimension must equal the number of ids",
                        t.entry.shape
                    )));
                }
                check_slot_name(slot)?;
                slots.push((
                    SlotSpec::new(slot, t.entry.dtype, t.entry.shape[1..].to_vec()),
                    t.clone(),
                ));
                used.insert(name.clone());
            }
            let specs: Vec<SlotSpec> = slots.iter().map(|s| s.0.clone()).collect();
            validate_slots(table, &specs)?;
            tables.push(PlainTableSpec {
                name: table.clone(),
                key_dtype,
                rows,
                ids,
                slots,
            });
        }
        let row_tables =
            plain_row_tables(&row_table_names, &order, &tensors, &table_names, &mut used)?;
        let warnings = misspelled_tables(&order, &tensors, &table_names, &used);
        let dense = order
            .iter()
            .filter(|n| !used.contains(*n))
            .map(|n| tensors[n].clone())
            .collect();
        Ok(Self {
            location: path.to_path_buf(),
            files: opened,
            local: crate::storage::location_url(path).is_none(),
            tables,
            row_tables,
            dense,
            user_metadata,
            warnings,
        })
    }

    /// The row-range tables' chunks of shards `0..shards` (or of shard `only`): each slot's rows
    /// of the shard (the partition rule's row cut), read from the input as the save writes them
    /// ([`RowRangeChunk::of_rows_deferred`]), never held whole.
    pub fn row_chunks(&self, shards: u32, only: Option<u32>) -> Result<Vec<RowRangeChunk<'_>>> {
        let mut chunks = Vec::new();
        for shard in saver_core::Shard::selected(shards, only) {
            for table in &self.row_tables {
                let mine = shard.rows_of(table.rows);
                for (slot, t) in &table.slots {
                    let e = &t.entry;
                    let row_bytes = e.len / table.rows.max(1);
                    let source = PlainRows {
                        input: self,
                        tensor: t,
                        start: mine.start * row_bytes,
                        len: (mine.end - mine.start) * row_bytes,
                    };
                    chunks.push(RowRangeChunk::of_rows_deferred(
                        &table.name,
                        slot,
                        e.dtype,
                        &e.shape,
                        mine.clone(),
                        Arc::new(source),
                    )?);
                }
            }
        }
        Ok(chunks)
    }

    /// Where the input is.
    pub fn location(&self) -> &Path {
        &self.location
    }

    /// Reads `buf.len()` bytes of `t` from byte `offset` within it.
    pub fn read(&self, t: &PlainTensor, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.column(t).read(offset, buf)
    }

    /// Tensor `t` as a column a distribution reads, owning its file's handle.
    fn column(&self, t: &PlainTensor) -> InputColumn {
        InputColumn {
            handle: Arc::clone(&self.files[&t.file].0),
            file: t.file.clone(),
            opened: self.files[&t.file].1,
            name: t.entry.name.clone(),
            offset: t.entry.offset,
            len: t.entry.len,
        }
    }

    /// Every dense tensor, read whole.
    pub fn read_dense(&self) -> Result<Vec<LoadedDense>> {
        self.dense
            .iter()
            .map(|t| {
                let mut data = vec![0u8; t.entry.len as usize];
                self.read(t, 0, &mut data)?;
                Ok(LoadedDense {
                    name: t.entry.name.clone(),
                    dtype: t.entry.dtype,
                    shape: t.entry.shape.clone(),
                    data,
                })
            })
            .collect()
    }

    /// Every table, distributed by bucket into temporary files in `scratch` with `parallel`
    /// threads (see the module docs).
    pub fn tables(&self, scratch: &Path, parallel: usize) -> Result<Vec<PlainTable<'_>>> {
        self.tables_grouped(scratch, parallel, GROUP_BYTES)
    }

    /// [`Self::tables`] with groups of about `group_bytes` (at least 4 KiB) instead of
    /// `GROUP_BYTES`: smaller groups hold less and cost more reads.
    pub(crate) fn tables_grouped(
        &self,
        scratch: &Path,
        parallel: usize,
        group_bytes: u64,
    ) -> Result<Vec<PlainTable<'_>>> {
        self.tables_in_rounds(scratch, parallel, group_bytes, None)
    }

    /// `Self::tables_grouped`, each table of more than one group distributed in `rounds`
    /// rounds (at most one per group; 1: a single pass) instead of as many as suit its size and
    /// the machine's memory (`None`, see the module docs).
    pub fn tables_in_rounds(
        &self,
        scratch: &Path,
        parallel: usize,
        group_bytes: u64,
        rounds: Option<usize>,
    ) -> Result<Vec<PlainTable<'_>>> {
        self.tables
            .iter()
            .map(|spec| {
                PlainTable::distribute(self, spec, scratch, parallel, group_bytes.max(4096), rounds)
            })
            .collect()
    }

    /// Table `spec`'s columns, owned (for a distribution's passes).
    fn table_input(&self, spec: &PlainTableSpec, row_bytes: &[usize]) -> TableInput {
        TableInput {
            ids: self.column(&spec.ids),
            slots: spec.slots.iter().map(|(_, t)| self.column(t)).collect(),
            row_bytes: row_bytes.to_vec(),
            rows: spec.rows,
        }
    }
}

/// Where one group's rows are.
enum Groups {
    /// One group: the input's own tensors.
    Direct,
    /// Groups in temporary files: per group, its runs (file, offset, rows), each run the
    /// rows' ids then each slot's rows, back to back; or, with `rounds`, only their ids, the
    /// slot rows being in the rounds' files.
    Spilled {
        files: TemporaryFiles,
        runs: Runs,
        shift: u32,
        dir: PathBuf,
        rounds: Option<Rounds>,
    },
}

/// One group's rows in memory, in distribution order.
struct Group {
    ids: Vec<u64>,
    slots: Vec<Vec<u8>>,
}

/// Which column of a group: its ids, or a slot's rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Column {
    Ids,
    Slot(usize),
}

/// Loaded columns by (group, column), most recent last.
type ColumnCache = Vec<((usize, Column), Arc<Vec<u8>>)>;

/// A table of a [`PlainInput`], distributed by bucket (see the module docs). Rows are read
/// group by group; each reading thread holds about one group.
pub struct PlainTable<'p> {
    spec: &'p PlainTableSpec,
    /// The table's columns in the input.
    columns: TableInput,
    schema: TableSchema,
    row_bytes: Vec<usize>,
    /// `row_bytes` as [`crate::load::rows::BucketRows`] gives them.
    row_bytes_u64: Vec<u64>,
    groups: Groups,
    /// Columns of groups recently loaded, most recent last.
    cache: Mutex<ColumnCache>,
    cache_columns: usize,
    /// Column buffers no longer used, for the next loads: a fresh buffer of a few MiB costs a
    /// page fault and the kernel's zeroing of every 4 KiB, more than reading into it.
    spare: Mutex<Vec<Vec<u8>>>,
    spare_buffers: usize,
    /// Groups recently ordered by bucket, most recent last (see [`GroupIndex`]).
    indexes: Mutex<Vec<Arc<GroupIndex>>>,
}

/// A group's rows ordered by bucket, built from its ids when a save lists a bucket range's rows
/// again ([`TableSnapshot::rows_in_buckets`]) instead of keeping every id and handle aside.
struct GroupIndex {
    group: usize,
    /// The group's first bucket.
    first: u32,
    /// `starts[b - first]..starts[b - first + 1]` are bucket `b`'s entries in `rows`.
    starts: Vec<u32>,
    /// (id, row in the group), by bucket.
    rows: Vec<(u64, u32)>,
}

impl<'p> PlainTable<'p> {
    /// Distributes table `spec` of `input` into groups of about `group_bytes` in nameless
    /// temporary files in `scratch` (unless it is one group), reading with `parallel` threads,
    /// in `rounds` rounds (see [`PlainInput::tables_in_rounds`]).
    pub(crate) fn distribute(
        input: &'p PlainInput,
        spec: &'p PlainTableSpec,
        scratch: &Path,
        parallel: usize,
        group_bytes: u64,
        rounds: Option<usize>,
    ) -> Result<Self> {
        let slots: Vec<SlotSpec> = spec.slots.iter().map(|s| s.0.clone()).collect();
        let row_bytes = validate_slots(&spec.name, &slots)?;
        let row = 8 + row_bytes.iter().sum::<usize>() as u64;
        let bytes = spec.rows.saturating_mul(row);
        let count = bytes
            .div_ceil(group_bytes.max(1))
            .next_power_of_two()
            .min(MAX_GROUPS as u64) as usize;
        let parallel = parallel.max(1);
        let mut table = Self {
            columns: input.table_input(spec, &row_bytes),
            spec,
            schema: TableSchema::new(spec.name.clone(), spec.key_dtype, slots),
            row_bytes_u64: row_bytes.iter().map(|&b| b as u64).collect(),
            row_bytes,
            groups: Groups::Direct,
            cache: Mutex::new(Vec::new()),
            // Each writer thread works on one slot of one group at a time, with its ids.
            cache_columns: 4 * parallel,
            spare: Mutex::new(Vec::new()),
            spare_buffers: parallel,
            indexes: Mutex::new(Vec::new()),
        };
        if count > 1 {
            let rounds = match rounds {
                Some(r) => r.clamp(1, count),
                None if input.local => super::rounds::rounds_for(bytes, count),
                None => 1,
            };
            table.groups = table.spill(count, rounds, scratch, parallel)?;
        }
        Ok(table)
    }

    fn group_count(&self) -> usize {
        match &self.groups {
            Groups::Direct => 1,
            Groups::Spilled { runs, .. } => runs.len(),
        }
    }

    /// Reads rows `rows` of the input: ids, and every slot's rows.
    fn read_input(
        &self,
        rows: std::ops::Range<u64>,
        ids: &mut Vec<u8>,
        slots: &mut [Vec<u8>],
    ) -> Result<()> {
        self.columns.read(rows, ids, Some(slots))
    }

    /// Appends every row to its group's runs, `parallel` threads each taking a contiguous part
    /// of the input and a file of its own: in one pass, or, in `rounds` rounds, the ids in one
    /// pass and the slot rows in rounds, made ahead of the save on a thread of their own.
    fn spill(
        &self,
        count: usize,
        rounds: usize,
        scratch: &Path,
        parallel: usize,
    ) -> Result<Groups> {
        let shift = 16 - count.trailing_zeros();
        let parts = self.columns.parts(parallel);
        if rounds > 1 {
            let (files, runs, rounds) = Rounds::distribute(
                self.columns.clone(),
                &self.spec.name,
                shift,
                count,
                count.div_ceil(rounds),
                parts,
                scratch.to_path_buf(),
            )?;
            return Ok(Groups::Spilled {
                files,
                runs,
                shift,
                dir: scratch.to_path_buf(),
                rounds: Some(rounds),
            });
        }
        let row = 8 + self.row_bytes.iter().sum::<usize>() as u64;
        let (files, runs) = Pass {
            input: &self.columns,
            shift,
            parts: &parts,
            outputs: vec![Output {
                groups: 0..count,
                content: Content::Rows,
                // Exactly the part's rows go to its file.
                sizes: parts.iter().map(|p| (p.end - p.start) * row).collect(),
            }],
            scratch,
            cancel: None,
        }
        .run()?
        .pop()
        .expect("one output");
        Ok(Groups::Spilled {
            files,
            runs,
            shift,
            dir: scratch.to_path_buf(),
            rounds: None,
        })
    }

    /// Records that `units` slot rows of group `g` were read, once each by a save: a table
    /// distributed in rounds lets a round go once all of its rows were read.
    fn served(&self, g: usize, units: u64) {
        if let Groups::Spilled {
            rounds: Some(r), ..
        } = &self.groups
        {
            r.served(g, units);
        }
    }

    /// The ids of group `g`, in its row order.
    fn group_ids(&self, g: usize) -> Result<Vec<u64>> {
        let raw = self.load_column(g, Column::Ids)?;
        let ids = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        self.give_back(raw);
        Ok(ids)
    }

    /// A buffer of `len` bytes for a column, reused if one was given back. Its bytes are
    /// whatever they were: the caller overwrites them all.
    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut buf = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    /// Keeps `buf` for a later [`Self::buffer`], up to a few.
    fn give_back(&self, buf: Vec<u8>) {
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() < self.spare_buffers {
            spare.push(buf);
        }
    }

    /// Lets go of a column from [`Self::column`]; the last holder gives its buffer back.
    fn release(&self, column: Arc<Vec<u8>>) {
        if let Some(buf) = Arc::into_inner(column) {
            self.give_back(buf);
        }
    }

    /// Group `g`, whole.
    fn load_group(&self, g: usize) -> Result<Group> {
        let mut slots = vec![Vec::new(); self.row_bytes.len()];
        match &self.groups {
            Groups::Direct => {
                let mut raw = Vec::new();
                self.read_input(0..self.spec.rows, &mut raw, &mut slots)?;
                let ids = raw
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                Ok(Group { ids, slots })
            }
            Groups::Spilled {
                rounds: Some(_), ..
            } => {
                let ids = self.group_ids(g)?;
                for (k, s) in slots.iter_mut().enumerate() {
                    *s = self.load_column(g, Column::Slot(k))?;
                }
                Ok(Group { ids, slots })
            }
            Groups::Spilled {
                files, runs, dir, ..
            } => {
                let total: u64 = runs[g].iter().map(|r| r.2).sum();
                let mut ids = Vec::with_capacity(total as usize);
                for (s, &b) in slots.iter_mut().zip(&self.row_bytes) {
                    s.reserve_exact(total as usize * b);
                }
                let mut raw = Vec::new();
                for &(f, at, n) in &runs[g] {
                    let n = n as usize;
                    raw.resize(n * (8 + self.row_bytes.iter().sum::<usize>()), 0);
                    files[f]
                        .read_exact_at(&mut raw, at)
                        .map_err(crate::error::io_err("read a temporary file in", dir))?;
                    ids.extend(
                        raw[..n * 8]
                            .chunks_exact(8)
                            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
                    );
                    let mut off = n * 8;
                    for (s, &b) in slots.iter_mut().zip(&self.row_bytes) {
                        s.extend_from_slice(&raw[off..off + n * b]);
                        off += n * b;
                    }
                }
                Ok(Group { ids, slots })
            }
        }
    }

    /// Column `column` of group `g`, read alone: a save asks for one slot's rows at a time.
    fn load_column(&self, g: usize, column: Column) -> Result<Vec<u8>> {
        let width = |c: Column| match c {
            Column::Ids => 8,
            Column::Slot(k) => self.row_bytes[k],
        };
        let b = width(column);
        match &self.groups {
            Groups::Direct => {
                let c = match column {
                    Column::Ids => &self.columns.ids,
                    Column::Slot(k) => &self.columns.slots[k],
                };
                let mut out = self.buffer(self.spec.rows as usize * b);
                c.read(0, &mut out)?;
                Ok(out)
            }
            Groups::Spilled {
                rounds: Some(rounds),
                dir,
                ..
            } if column != Column::Ids => {
                let Column::Slot(k) = column else {
                    unreachable!("ids are read from the table's own runs")
                };
                let round = rounds.of_group(g)?;
                let runs = &round.runs[g];
                let total: u64 = runs.iter().map(|r| r.2).sum();
                let mut out = self.buffer(total as usize * b);
                let mut at = 0;
                for &(f, run_at, n) in runs {
                    let n = n as usize;
                    // Within a round's run: each slot's rows.
                    let skip = n * self.row_bytes[..k].iter().sum::<usize>();
                    round.files[f]
                        .read_exact_at(&mut out[at..at + n * b], run_at + skip as u64)
                        .map_err(crate::error::io_err("read a temporary file in", dir))?;
                    at += n * b;
                }
                Ok(out)
            }
            Groups::Spilled {
                files,
                runs,
                dir,
                rounds,
                ..
            } => {
                let total: u64 = runs[g].iter().map(|r| r.2).sum();
                let mut out = self.buffer(total as usize * b);
                let mut at = 0;
                for &(f, run_at, n) in &runs[g] {
                    let n = n as usize;
                    // Within a run: ids, then each slot's rows (none when in rounds).
                    let skip: usize = match column {
                        Column::Ids => 0,
                        Column::Slot(k) => n * (8 + self.row_bytes[..k].iter().sum::<usize>()),
                    };
                    debug_assert!(rounds.is_none() || column == Column::Ids);
                    files[f]
                        .read_exact_at(&mut out[at..at + n * b], run_at + skip as u64)
                        .map_err(crate::error::io_err("read a temporary file in", dir))?;
                    at += n * b;
                }
                Ok(out)
            }
        }
    }

    /// Column `column` of group `g` from the cache, loaded if it is not there.
    fn column(&self, g: usize, column: Column) -> Result<Arc<Vec<u8>>> {
        let key = (g, column);
        {
            let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(k) = cache.iter().position(|c| c.0 == key) {
                let hit = cache.remove(k);
                let data = Arc::clone(&hit.1);
                cache.push(hit);
                return Ok(data);
            }
        }
        // Loaded outside the lock: other threads go on with the columns they have. Two threads
        // wanting the same column may both load it; the cache keeps one.
        let data = Arc::new(self.load_column(g, column)?);
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if !cache.iter().any(|c| c.0 == key) {
            let evicted = (cache.len() >= self.cache_columns).then(|| cache.remove(0));
            cache.push((key, Arc::clone(&data)));
            drop(cache);
            if let Some((_, column)) = evicted {
                self.release(column);
            }
        }
        Ok(data)
    }

    /// Visits every row of the table in (bucket, id) order, at most `batch` rows at a time: ids
    /// and each slot's rows. One group is held at a time. Fails on a duplicate id.
    pub(crate) fn visit_in_bucket_order(
        &self,
        batch: usize,
        visit: &mut crate::load::rows::VisitRows<'_>,
    ) -> Result<()> {
        let mut ids = Vec::new();
        let mut slots: Vec<Vec<u8>> = vec![Vec::new(); self.row_bytes.len()];
        for g in 0..self.group_count() {
            let group = self.load_group(g)?;
            self.served(g, (group.ids.len() * group.slots.len()) as u64);
            let mut order: Vec<(u32, u64, u32)> = group
                .ids
                .iter()
                .enumerate()
                .map(|(i, &id)| (PartitionRule::bucket_of(id), id, i as u32))
                .collect();
            order.sort_unstable();
            if let Some(w) = order.windows(2).find(|w| w[0].1 == w[1].1) {
                return Err(saver_core::Error::DuplicateId {
                    table: self.spec.name.clone(),
                    id: self.spec.key_dtype.format_id(w[0].1),
                }
                .into());
            }
            for part in order.chunks(batch.max(1)) {
                ids.clear();
                ids.extend(part.iter().map(|p| p.1));
                for ((out, src), &b) in slots.iter_mut().zip(&group.slots).zip(&self.row_bytes) {
                    out.clear();
                    for p in part {
                        let r = p.2 as usize;
                        out.extend_from_slice(&src[r * b..(r + 1) * b]);
                    }
                }
                let views: Vec<&[u8]> = slots.iter().map(Vec::as_slice).collect();
                visit(&ids, &views)?;
            }
        }
        Ok(())
    }

    /// The buckets of group `g`.
    fn group_buckets(&self, g: usize) -> std::ops::Range<u32> {
        match &self.groups {
            Groups::Direct => 0..saver_core::partition::BUCKETS,
            Groups::Spilled { shift, .. } => ((g as u32) << shift)..((g as u32 + 1) << shift),
        }
    }

    /// Group `g`'s rows by bucket, from the cache or built from its ids. Each writer thread
    /// works through one group at a time, so a few are kept.
    fn index(&self, g: usize) -> Result<Arc<GroupIndex>> {
        {
            let mut cache = self.indexes.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(k) = cache.iter().position(|i| i.group == g) {
                let hit = cache.remove(k);
                cache.push(Arc::clone(&hit));
                return Ok(hit);
            }
        }
        let buckets = self.group_buckets(g);
        let ids = self.column(g, Column::Ids)?;
        let n = ids.len() / 8;
        if n > u32::MAX as usize {
            return Err(Error::Corrupt {
                file: self.spec.ids.file.clone(),
                what: format!("table {:?} has a group of {n} rows", self.spec.name),
            });
        }
        let id = |r: usize| u64::from_le_bytes(ids[r * 8..r * 8 + 8].try_into().expect("8 bytes"));
        let mut starts = vec![0u32; (buckets.end - buckets.start) as usize + 1];
        let mut of_row = Vec::with_capacity(n);
        for r in 0..n {
            let b = PartitionRule::bucket_of(id(r)) - buckets.start;
            starts[b as usize + 1] += 1;
            of_row.push(b);
        }
        for b in 1..starts.len() {
            starts[b] += starts[b - 1];
        }
        let mut next = starts.clone();
        let mut rows = vec![(0u64, 0u32); n];
        for (r, &b) in of_row.iter().enumerate() {
            let at = &mut next[b as usize];
            rows[*at as usize] = (id(r), r as u32);
            *at += 1;
        }
        drop(of_row);
        self.release(ids);
        let index = Arc::new(GroupIndex {
            group: g,
            first: buckets.start,
            starts,
            rows,
        });
        let mut cache = self.indexes.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= self.spare_buffers.max(1) {
            cache.remove(0);
        }
        cache.push(Arc::clone(&index));
        Ok(index)
    }

    fn group_of(&self, id: u64) -> usize {
        self.group_of_bucket(PartitionRule::bucket_of(id))
    }

    fn group_of_bucket(&self, bucket: u32) -> usize {
        match &self.groups {
            Groups::Direct => 0,
            Groups::Spilled { shift, .. } => (bucket >> shift) as usize,
        }
    }
}

impl crate::load::rows::BucketRows for PlainTable<'_> {
    fn finish_checks(&self) -> saver_core::Result<()> {
        Ok(self.columns.check_unchanged(&self.spec.name)?)
    }

    fn row_bytes(&self) -> &[u64] {
        &self.row_bytes_u64
    }
    fn rows(&self) -> u64 {
        self.spec.rows
    }
    fn visit_in_bucket_order(
        &self,
        batch: usize,
        visit: &mut crate::load::rows::VisitRows<'_>,
    ) -> saver_core::Result<()> {
        Ok(PlainTable::visit_in_bucket_order(self, batch, visit)?)
    }
}

impl SparseTable for PlainTable<'_> {
    fn schema(&self) -> &TableSchema {
        &self.schema
    }
    fn len(&self) -> usize {
        usize::try_from(self.spec.rows).unwrap_or(usize::MAX)
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(PlainSnapshot(self)))
    }
    /// Input files are read through the handles opened with them; they are not expected to
    /// change while a save reads them.
    fn point_in_time(&self) -> bool {
        true
    }
    fn in_bucket_order(&self) -> Option<&dyn saver_core::table::BucketRows> {
        Some(self)
    }
}

struct PlainSnapshot<'t, 'p>(&'t PlainTable<'p>);

impl TableSnapshot for PlainSnapshot<'_, '_> {
    fn finish(&self) -> saver_core::Result<()> {
        self.0
            .columns
            .check_unchanged(&self.0.spec.name)
            .map_err(|e| core(&self.0.spec.name, e))
    }

    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        saver_core::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.0.group_count()
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        let t = self.0;
        if part >= t.group_count() {
            return Ok(());
        }
        let name = &t.spec.name;
        let ids = t.group_ids(part).map_err(|e| core(name, e))?;
        let values: Vec<Vec<u8>> = if with_values {
            (0..t.row_bytes.len())
                .map(|k| t.load_column(part, Column::Slot(k)))
                .collect::<Result<_>>()
                .map_err(|e| core(name, e))?
        } else {
            Vec::new()
        };
        let step = max_rows.max(1);
        let mut handles = Vec::with_capacity(step);
        for (c, chunk) in ids.chunks(step).enumerate() {
            let lo = c * step;
            handles.clear();
            handles.extend((lo..lo + chunk.len()).map(|r| ((part as u64) << ROW_BITS) | r as u64));
            let slices: Vec<&[u8]> = values
                .iter()
                .zip(&t.row_bytes)
                .map(|(s, &b)| &s[lo * b..(lo + chunk.len()) * b])
                .collect();
            visit(RowChunk {
                ids: chunk,
                handles: &handles,
                slots: &slices,
            })?;
        }
        values.into_iter().for_each(|v| t.give_back(v));
        Ok(())
    }

    fn rows_in_buckets(
        &self,
        buckets: std::ops::Range<u32>,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> saver_core::Result<bool> {
        let t = self.0;
        let buckets = buckets.start..buckets.end.min(saver_core::partition::BUCKETS);
        if buckets.is_empty() {
            return Ok(true);
        }
        let (first, last) = (
            t.group_of_bucket(buckets.start),
            t.group_of_bucket(buckets.end - 1),
        );
        for g in first..=last {
            let index = t.index(g).map_err(|e| core(&t.spec.name, e))?;
            let lo = buckets.start.max(index.first) - index.first;
            let hi = (buckets.end - index.first).min(index.starts.len() as u32 - 1);
            let rows =
                &index.rows[index.starts[lo as usize] as usize..index.starts[hi as usize] as usize];
            ids.extend(rows.iter().map(|r| r.0));
            handles.extend(
                rows.iter()
                    .map(|r| ((g as u64) << ROW_BITS) | u64::from(r.1)),
            );
        }
        Ok(true)
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver_core::Result<()> {
        let t = self.0;
        let mut positions: HashMap<usize, HashMap<u64, u64>> = HashMap::new();
        let handles = handles_of(&t.schema, "the input", ids, |id| {
            let g = t.group_of(id);
            if let std::collections::hash_map::Entry::Vacant(v) = positions.entry(g) {
                let group = t.group_ids(g)?;
                v.insert(
                    group
                        .iter()
                        .enumerate()
                        .map(|(r, &i)| (i, r as u64))
                        .collect(),
                );
            }
            Ok(positions[&g].get(&id).map(|r| ((g as u64) << ROW_BITS) | r))
        })?;
        // SAFETY: the handles were just made by this table, for these ids.
        unsafe { self.read_rows_by_handle(ids, &handles, out) }
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver_core::Result<()> {
        let t = self.0;
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        let name = &t.spec.name;
        let foreign = |h: u64| saver_core::Error::Table {
            table: name.clone(),
            message: format!("row handle {h:#x} is not this table's"),
        };
        // Runs of one group; per run, its ids (to check the handles) and each wanted slot.
        let mut i = 0;
        while i < handles.len() {
            let g = (handles[i] >> ROW_BITS) as usize;
            if g >= t.group_count() {
                return Err(foreign(handles[i]));
            }
            let n = handles[i..]
                .iter()
                .position(|&h| (h >> ROW_BITS) as usize != g)
                .unwrap_or(handles.len() - i);
            let run = i..i + n;
            let group_ids = t.column(g, Column::Ids).map_err(|e| core(name, e))?;
            let row = |h: u64| (h & ((1 << ROW_BITS) - 1)) as usize;
            // The row GATHER_AHEAD places on in the run, to prefetch, as rows are read at random.
            let ahead = |k: usize| handles[..run.end].get(k + GATHER_AHEAD).map(|&h| row(h));
            let prefetch = |column: &[u8], b: usize, r: Option<usize>| {
                if let Some(next) = r.and_then(|r| column.get(r * b..(r + 1) * b)) {
                    saver_core::prefetch::prefetch(next);
                }
            };
            for k in run.clone() {
                prefetch(&group_ids, 8, ahead(k));
                let r = row(handles[k]);
                if group_ids.get(r * 8..r * 8 + 8) != Some(&ids[k].to_le_bytes()[..]) {
                    return Err(foreign(handles[k]));
                }
            }
            for (s, (o, &b)) in out.iter_mut().zip(&t.row_bytes).enumerate() {
                if o.is_empty() {
                    continue;
                }
                let src = t.column(g, Column::Slot(s)).map_err(|e| core(name, e))?;
                for k in run.clone() {
                    prefetch(&src, b, ahead(k));
                    let r = row(handles[k]);
                    o[k * b..(k + 1) * b].copy_from_slice(&src[r * b..(r + 1) * b]);
                }
                t.release(src);
                t.served(g, n as u64);
            }
            t.release(group_ids);
            i += n;
        }
        Ok(())
    }
}

/// A row-range table of a plain input: each slot a tensor `<table>/<slot>` of the whole slot.
#[derive(Clone, Debug)]
pub struct PlainRowTable {
    /// The table's name.
    pub name: String,
    /// Its rows (every slot's first dimension).
    pub rows: u64,
    /// Its slots: name and tensor.
    pub slots: Vec<(String, PlainTensor)>,
}

/// The header metadata key of a plain file that names the row-range tables of a plain export
/// (a JSON list of names): their slots are tensors `<table>/<slot>` of the whole slot's shape.
pub const ROW_TABLES_KEY: &str = "saver_row_tables";

/// The row-range tables named in `names`, from the tensors `<table>/<slot>` not yet `used`
/// (marked used here): each slot of one or two dimensions, all of one row count.
fn plain_row_tables(
    names: &std::collections::BTreeSet<String>,
    order: &[String],
    tensors: &BTreeMap<String, PlainTensor>,
    hashed: &[String],
    used: &mut HashSet<String>,
) -> Result<Vec<PlainRowTable>> {
    let mut tables = Vec::new();
    for table in names {
        check_table_name(table)?;
        if hashed.contains(table) {
            return Err(Error::Mismatch(format!(
                "table {table:?} is named a row-range table by the input's metadata, and has a \
                 {table}/ids tensor of a hashed table"
            )));
        }
        let prefix = format!("{table}/");
        let mut slots = Vec::new();
        let mut rows = None;
        for name in order {
            let Some(slot) = name.strip_prefix(&prefix).filter(|s| !s.contains('/')) else {
                continue;
            };
            if used.contains(name) {
                continue;
            }
            check_slot_name(slot)?;
            let t = &tensors[name];
            let n = t.entry.shape.first().copied();
            if !(1..=2).contains(&t.entry.shape.len()) || rows.is_some_and(|r| Some(r) != n) {
                return Err(Error::Mismatch(format!(
                    "tensor {name:?} of shape {:?} is no slot of row-range table {table:?}: a \
                     slot is [rows] or [rows, columns], every slot of the same rows",
                    t.entry.shape
                )));
            }
            rows = n;
            slots.push((slot.to_string(), t.clone()));
            used.insert(name.clone());
        }
        let Some(rows) = rows else {
            return Err(Error::Mismatch(format!(
                "the input's metadata names row-range table {table:?}, but no tensor \
                 {table}/<slot> is there"
            )));
        };
        tables.push(PlainRowTable {
            name: table.clone(),
            rows,
            slots,
        });
    }
    Ok(tables)
}

/// Warnings for groups of would-be dense tensors `P/…` that look like a table whose ids tensor is
/// misnamed (`users/id`, `users/ID`, `users/keys`): a 1-D integer tensor with an ids-like name, or
/// one beside siblings with as many rows. They are saved as dense tensors, which is rarely meant.
fn misspelled_tables(
    order: &[String],
    tensors: &BTreeMap<String, PlainTensor>,
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
        let e = &tensors[name].entry;
        let integer = matches!(e.dtype, Dtype::I64 | Dtype::U64 | Dtype::I32 | Dtype::U32);
        // A prefix no table can be named (`a/b`, ``) is a path of dense tensors, not a table.
        if tables.iter().any(|t| t == prefix)
            || check_table_name(prefix).is_err()
            || !integer
            || e.shape.len() != 1
        {
            continue;
        }
        let rows = e.shape[0];
        let siblings = order.iter().any(|other| {
            other != name
                && other.rsplit_once('/').is_some_and(|(p, _)| p == prefix)
                && tensors[other].entry.shape.first() == Some(&rows)
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

impl std::fmt::Debug for PlainTable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainTable")
            .field("table", &self.schema.name)
            .finish_non_exhaustive()
    }
}

//! A content digest that depends only on what a checkpoint holds (table names, ids, slot rows,
//! dense tensors), not on shard count, file layout or row order: equal before and after a
//! reshard, and computable by other tools. The definitions are in `docs/FORMAT.md`; in short,
//! SHA-256 over tables by name (slots by name, rows in a fixed order) then dense tensors by name.
//!
//! One function, [`digest`], of any [`Content`]: tables in memory, a checkpoint's or plain
//! input's tables read from files, a restore, a columnar load.
//!
//! Two versions ([`DigestVersion`]). Version 2, the default, orders each table's rows by
//! (bucket, id): the order a checkpoint stores them in, so a checkpoint's digest is one
//! sequential read of its files, in bounded memory. Version 1 orders rows by id alone, which
//! takes a table's ids in memory; it stays computable for digests recorded before version 2.

use std::collections::BTreeMap;
use std::sync::mpsc::sync_channel;

use rayon::slice::ParallelSliceMut;
use sha2::{Digest, Sha256};

use saver_core::{KeyDtype, PartitionRule, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::arrays::{Columns, TableColumns};
use crate::load::restore::{LoadedDense, Restored};
use crate::load::rows::VisitRows;
use crate::source::SourceTables;

/// Version tag hashed first, so a changed definition never collides with the old one.
pub const DIGEST_TAG: &[u8] = b"saver-digest-v1\n";

/// Version 2's tag.
pub const DIGEST_TAG_V2: &[u8] = b"saver-digest-v2\n";

/// Which digest definition (see docs/FORMAT.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DigestVersion {
    /// Rows by id: the model's ids in memory.
    V1,
    /// Rows by (bucket, id): streams. The default.
    #[default]
    V2,
}

impl DigestVersion {
    /// The version's number, as `saver digest --digest-version` takes it.
    pub fn number(self) -> u32 {
        match self {
            DigestVersion::V1 => 1,
            DigestVersion::V2 => 2,
        }
    }

    fn tag(self) -> &'static [u8] {
        match self {
            DigestVersion::V1 => DIGEST_TAG,
            DigestVersion::V2 => DIGEST_TAG_V2,
        }
    }

    /// Where the row of `id` goes in this version's order: rows are hashed by this key,
    /// ascending.
    fn row_key(self, key: KeyDtype, id: u64) -> (u64, u64) {
        match self {
            DigestVersion::V1 => (0, key.order_key(id)),
            DigestVersion::V2 => (PartitionRule::bucket_of(id) as u64, id),
        }
    }
}

/// What a [`digest`] is taken of. The same content gives the same digest whatever holds it.
#[non_exhaustive]
pub enum Content<'a> {
    /// Tables in memory (any [`SparseTable`]; a table may be split in parts, e.g. one per
    /// restored shard, which must not share ids) and dense tensors. Holds 24 bytes per row
    /// beside the tables (version 1: a copy of the rows too).
    Tables {
        /// Each table's parts, by name.
        tables: &'a BTreeMap<String, Vec<&'a dyn SparseTable>>,
        /// The dense tensors.
        dense: &'a [LoadedDense],
    },
    /// The tables and dense tensors of a checkpoint or plain input, read from files in bounded
    /// memory (version 2 only): a checkpoint's rows lie in digest order already and are read
    /// once, front to back, each tensor checked against its CRC-32; a plain input's group by
    /// group (see `crate::source::plain`).
    Files {
        /// The tables ([`crate::source::Source::tables`]).
        tables: &'a SourceTables<'a>,
        /// The dense tensors ([`crate::source::Source::dense`]).
        dense: &'a [LoadedDense],
    },
    /// A checkpoint (with its row-range tables) or plain input, opened: its tables and dense
    /// tensors read as [`Content::Files`] with up to `parallel` threads, then its row-range
    /// tables row by row (version 2 only).
    Source {
        /// What is read.
        source: &'a crate::source::Source,
        /// Threads that read a plain model's groups.
        parallel: usize,
    },
    /// The checkpoint, chain or plain safetensors model at `path` (a directory, a file or an
    /// object-store URL), read from its files as [`Content::Files`] (version 2 only), with up
    /// to `parallel` threads; opened again if it is replaced while it is read
    /// ([`crate::load::checkpoint::read_latest`]).
    At {
        /// Where it is.
        path: &'a std::path::Path,
        /// Threads that read a plain model's groups.
        parallel: usize,
    },
    /// What a restore returned, all its shards together.
    Restored(&'a Restored),
    /// A columnar load (its tables must have distinct names).
    Columns(&'a Columns),
    /// A load's tables and dense tensors (`content`: [`Content::Restored`] or
    /// [`Content::Columns`]) with its row-range tables
    /// ([`crate::LoadRequest::row_tables`]): a load of all of them gives the digest of the
    /// checkpoint.
    WithRowTables {
        /// The tables and dense tensors.
        content: Box<Content<'a>>,
        /// The row-range tables.
        row_tables: &'a [crate::LoadedRowTable],
    },
}

impl<'a> From<&'a Restored> for Content<'a> {
    fn from(r: &'a Restored) -> Self {
        Content::Restored(r)
    }
}

impl<'a> From<&'a Columns> for Content<'a> {
    fn from(c: &'a Columns) -> Self {
        Content::Columns(c)
    }
}

/// The content digest (`version`) of `content`, as lowercase hex: what `saver digest` prints.
///
/// ```
/// use saver_core::{Dtype, EmbeddingTable, KeyDtype, SaveInput, SlotSpec};
/// use saver_io::tools::digest::{digest, DigestVersion};
/// use saver_io::{save, Checkpoint, LoadOptions, SaveOptions};
///
/// # let dir = tempfile::tempdir()?;
/// let table = EmbeddingTable::new("item", KeyDtype::I64, vec![
///     SlotSpec::new("embedding", Dtype::F32, vec![4]),
/// ])?;
/// table.upsert(7, |row| row.slot_mut::<f32>(0).fill(1.0));
/// save(dir.path(), SaveInput::new().table(&table), &SaveOptions::default())?;
/// // Restored as 3 shards, the content is the same.
/// let restored = Checkpoint::open(dir.path())?.restore(&LoadOptions::default())?;
/// let a = digest((&restored).into(), DigestVersion::V2)?;
/// let b = digest(
///     saver_io::tools::digest::Content::Tables {
///         tables: &[("item".to_string(), vec![&table as &dyn saver_core::SparseTable])]
///             .into_iter()
///             .collect(),
///         dense: &[],
///     },
///     DigestVersion::V2,
/// )?;
/// assert_eq!(a, b);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn digest(content: Content<'_>, version: DigestVersion) -> Result<String> {
    let mut h = Sha256::new();
    h.update(version.tag());
    let (content, loaded_rows) = match content {
        Content::WithRowTables {
            content,
            row_tables,
        } => (*content, row_tables),
        content => (content, &[][..]),
    };
    let dense = match content {
        Content::Tables { tables, dense } => {
            for (name, parts) in tables {
                hash_parts(&mut h, version, name, parts)?;
            }
            dense
        }
        Content::Restored(r) => {
            for (name, parts) in restored_parts(r) {
                let parts: Vec<&dyn SparseTable> =
                    parts.into_iter().map(|t| t as &dyn SparseTable).collect();
                hash_parts(&mut h, version, &name, &parts)?;
            }
            &r.dense
        }
        Content::Columns(c) => {
            let mut tables: Vec<&TableColumns> = c.tables.iter().collect();
            tables.sort_by(|a, b| a.name.cmp(&b.name));
            for t in tables {
                hash_columns(&mut h, version, t)?;
            }
            &c.dense
        }
        Content::At { path, parallel } => {
            return crate::load::checkpoint::read_latest(path, || {
                let source = crate::source::Source::open(path)?;
                digest(
                    Content::Source {
                        source: &source,
                        parallel,
                    },
                    version,
                )
            });
        }
        Content::Source { source, parallel } => {
            let tables = source.tables(&std::env::temp_dir(), parallel.max(1))?;
            let dense = source.dense()?;
            if version != DigestVersion::V2 {
                return Err(files_refuse_v1());
            }
            hash_files(&mut h, version, &tables)?;
            match source {
                crate::source::Source::Checkpoint(ck) => hash_row_tables(&mut h, ck)?,
                crate::source::Source::Plain(p) => hash_plain_row_tables(&mut h, p)?,
            }
            return Ok(hash_dense(h, &dense));
        }
        Content::Files { tables, dense } => {
            if version != DigestVersion::V2 {
                return Err(files_refuse_v1());
            }
            hash_files(&mut h, version, tables)?;
            dense
        }
        Content::WithRowTables { .. } => {
            return Err(Error::InvalidOption {
                option: "content",
                why: "row-range tables are given once, around a load's tables".into(),
            })
        }
    };
    let mut loaded: Vec<&crate::LoadedRowTable> = loaded_rows.iter().collect();
    loaded.sort_by(|a, b| a.name.cmp(&b.name));
    for t in loaded {
        let mut slots: Vec<&crate::LoadedRowSlot> = t.slots.iter().collect();
        slots.sort_by(|a, b| a.name.cmp(&b.name));
        let rows = t.rows.end - t.rows.start;
        let header: Vec<(&str, saver_core::Dtype, Vec<u64>)> = slots
            .iter()
            .map(|s| {
                let mut shape = s.shape.clone();
                shape[0] = rows;
                (s.name.as_str(), s.dtype, shape)
            })
            .collect();
        hash_row_table_header(&mut h, &t.name, rows, &header);
        for s in slots {
            h.update(&s.values);
        }
    }
    Ok(hash_dense(h, dense))
}

/// What the digest hashes of a row-range table before its values: its name, rows, and each
/// slot's name, dtype and shape, slots by name.
fn hash_row_table_header(
    h: &mut Sha256,
    name: &str,
    rows: u64,
    slots: &[(&str, saver_core::Dtype, Vec<u64>)],
) {
    h.update(b"rowtable\0");
    put_str(h, name);
    h.update(rows.to_le_bytes());
    h.update((slots.len() as u32).to_le_bytes());
    for (name, dtype, shape) in slots {
        put_str(h, name);
        put_str(h, dtype.name());
        put_shape(h, shape);
    }
}

/// Version 1 of content read from files: refused.
fn files_refuse_v1() -> Error {
    Error::InvalidOption {
        option: "digest version",
        why: "version 1 orders rows by id, which a read from files does not give: load the \
              tables into memory (saver digest --digest-version 1 does)"
            .into(),
    }
}

/// Hashes the tables of a checkpoint or plain input, read from files in digest order.
fn hash_files(h: &mut Sha256, version: DigestVersion, tables: &SourceTables<'_>) -> Result<()> {
    let mut tables = tables.as_bucket_rows();
    tables.sort_by(|a, b| a.name().cmp(b.name()));
    for t in tables {
        let step = (READ_ROWS_BYTES / (8 + t.row_bytes().iter().sum::<u64>())).max(1) as usize;
        hash_table(
            h,
            version,
            t.name(),
            t.key_dtype(),
            t.slots(),
            t.rows(),
            Box::new(move |visit| Ok(t.visit_in_bucket_order(step, visit)?)),
        )?;
        // No digest of bytes that fail their checksums.
        t.finish_checks()?;
    }
    Ok(())
}

/// Hashes the row-range tables of `ck` (see docs/FORMAT.md).
fn hash_row_tables(h: &mut Sha256, ck: &crate::Checkpoint) -> Result<()> {
    let tables: Vec<RowTableToHash<'_>> = ck
        .manifest()
        .row_tables
        .iter()
        .map(|t| {
            let slots = t.slots.iter();
            (
                t.name.as_str(),
                t.rows,
                slots
                    .map(|s| (s.name.as_str(), s.dtype, s.shape.clone()))
                    .collect(),
            )
        })
        .collect();
    hash_row_tables_read(h, tables, |table, slot, rows, buf| {
        ck.load_rows(table, rows, &mut [crate::RowsInto::new(slot, buf)])
            .map(|_| ())
    })
}

/// Hashes the row-range tables of a plain input (a plain export's): as a checkpoint's, so that
/// an export has its checkpoint's digest.
fn hash_plain_row_tables(h: &mut Sha256, p: &crate::source::PlainInput) -> Result<()> {
    let tables: Vec<RowTableToHash<'_>> = p
        .row_tables
        .iter()
        .map(|t| {
            let slots = t.slots.iter();
            let slots = slots.map(|(s, x)| (s.as_str(), x.entry.dtype, x.entry.shape.clone()));
            (t.name.as_str(), t.rows, slots.collect())
        })
        .collect();
    hash_row_tables_read(h, tables, |table, slot, rows, buf| {
        let t = p
            .row_tables
            .iter()
            .find(|t| t.name == table)
            .expect("listed");
        let (_, x) = t.slots.iter().find(|s| s.0 == slot).expect("listed");
        let row_bytes = x.entry.len / t.rows.max(1);
        p.read(x, rows.start * row_bytes, buf)
    })
}

/// A row-range table to hash: name, rows, slots (name, dtype, shape).
type RowTableToHash<'a> = (&'a str, u64, Vec<(&'a str, saver_core::Dtype, Vec<u64>)>);

/// Hashes row-range tables: by name, each its header, then each slot's values by name,
/// row-major, `read(table, slot, rows, buffer)` a bounded batch of rows at a time.
fn hash_row_tables_read(
    h: &mut Sha256,
    mut tables: Vec<RowTableToHash<'_>>,
    read: impl Fn(&str, &str, std::ops::Range<u64>, &mut [u8]) -> Result<()>,
) -> Result<()> {
    tables.sort_by(|a, b| a.0.cmp(b.0));
    for (name, rows, mut slots) in tables {
        slots.sort_by(|a, b| a.0.cmp(b.0));
        hash_row_table_header(h, name, rows, &slots);
        for (slot, dtype, shape) in &slots {
            let row_bytes = dtype
                .byte_len(shape.get(1).copied().unwrap_or(1))
                .unwrap_or(0)
                .max(1);
            let step = (READ_ROWS_BYTES / row_bytes).max(1);
            let mut buf = Vec::new();
            let mut at = 0;
            while at < rows {
                let end = (at + step).min(rows);
                buf.resize(((end - at) * row_bytes) as usize, 0);
                read(name, slot, at..end, &mut buf)?;
                h.update(&buf);
                at = end;
            }
        }
    }
    Ok(())
}

fn put_str(h: &mut Sha256, s: &str) {
    h.update(s.as_bytes());
    h.update([0u8]);
}

fn put_shape(h: &mut Sha256, shape: &[u64]) {
    h.update((shape.len() as u32).to_le_bytes());
    for d in shape {
        h.update(d.to_le_bytes());
    }
}

/// Bytes of rows hashed at a time: one `update` call per batch instead of three per row.
const BATCH: usize = 4 << 20;

/// Rows read at a time from a checkpoint, a plain input or a table's snapshot for the digest.
const READ_ROWS_BYTES: u64 = 4 << 20;

/// Hashes a columnar load's table: its rows put in the version's order by their index.
fn hash_columns(h: &mut Sha256, version: DigestVersion, t: &TableColumns) -> Result<()> {
    let mut order: Vec<((u64, u64), usize)> = t
        .ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (version.row_key(t.key_dtype, id), i))
        .collect();
    order.par_sort_unstable();
    let widths: Vec<usize> = t
        .slots
        .iter()
        .map(|s| s.row_bytes().unwrap_or(0) as usize)
        .collect();
    let order = &order;
    hash_table(
        h,
        version,
        &t.name,
        t.key_dtype,
        &t.slots,
        t.ids.len() as u64,
        Box::new(move |visit| {
            let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
            for chunk in order.chunks(1 << 14) {
                for ((b, d), &w) in bufs.iter_mut().zip(&t.data).zip(&widths) {
                    b.clear();
                    for &(_, i) in chunk {
                        b.extend_from_slice(&d[i * w..(i + 1) * w]);
                    }
                }
                let ids: Vec<u64> = chunk.iter().map(|&(_, i)| t.ids[i]).collect();
                let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                visit(&ids, &views)?;
            }
            Ok(())
        }),
    )
}

/// Hashes one table held in memory as `parts`: every part's ids, with their row handles, put in
/// (bucket, id) order, then the rows read through the parts' snapshots in that order, the one
/// order a snapshot is read in (a point-in-time snapshot lets a bucket go once it is read). For
/// version 1 the rows are gathered in memory and hashed by id.
fn hash_parts(
    h: &mut Sha256,
    version: DigestVersion,
    name: &str,
    parts: &[&dyn SparseTable],
) -> Result<()> {
    let Some(first) = parts.first() else {
        return Ok(());
    };
    let key = first.key_dtype();
    let snaps = parts
        .iter()
        .map(|t| t.snapshot())
        .collect::<saver_core::Result<Vec<_>>>()?;
    // (order key, id, part, handle)
    let mut rows: Vec<((u64, u64), u64, u32, u64)> = Vec::new();
    for (p, snap) in snaps.iter().enumerate() {
        snap.scan(1 << 16, false, &mut |c| {
            rows.extend(c.ids.iter().enumerate().map(|(i, &id)| {
                (
                    DigestVersion::V2.row_key(key, id),
                    id,
                    p as u32,
                    c.handles.get(i).copied().unwrap_or(u64::MAX),
                )
            }));
            Ok(())
        })?;
    }
    rows.par_sort_unstable();
    let slots = first.slots().to_vec();
    let widths: Vec<usize> = slots
        .iter()
        .map(|s| s.row_bytes().map(|b| b as usize))
        .collect::<saver_core::Result<_>>()?;
    let count = rows.len() as u64;
    let rows = &rows;
    let snaps = &snaps;
    let widths_ = widths.clone();
    let read = move |visit: &mut VisitRows<'_>| -> Result<()> {
        let widths = widths_;
        let step = (READ_ROWS_BYTES as usize / (8 + widths.iter().sum::<usize>())).max(1);
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        for chunk in rows.chunks(step) {
            for (b, &w) in bufs.iter_mut().zip(&widths) {
                b.clear();
                b.resize(chunk.len() * w, 0);
            }
            // Consecutive rows of one part are read together.
            let mut i = 0;
            while i < chunk.len() {
                let p = chunk[i].2;
                let n = chunk[i..].iter().take_while(|r| r.2 == p).count();
                ids.clear();
                ids.extend(chunk[i..i + n].iter().map(|r| r.1));
                handles.clear();
                if chunk[i..i + n].iter().all(|r| r.3 != u64::MAX) {
                    handles.extend(chunk[i..i + n].iter().map(|r| r.3));
                }
                let mut outs: Vec<&mut [u8]> = bufs
                    .iter_mut()
                    .zip(&widths)
                    .map(|(b, &w)| &mut b[i * w..(i + n) * w])
                    .collect();
                // SAFETY: the handles are the ones this snapshot's scan gave with these
                // ids (or none at all).
                unsafe {
                    snaps[p as usize].read_rows_by_handle(&ids, &handles, &mut outs)?;
                }
                i += n;
            }
            let all: Vec<u64> = chunk.iter().map(|r| r.1).collect();
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            visit(&all, &views)?;
        }
        Ok(())
    };
    match version {
        DigestVersion::V2 => hash_table(h, version, name, key, &slots, count, Box::new(read))?,
        DigestVersion::V1 => {
            let mut gathered = TableColumns {
                name: name.to_string(),
                key_dtype: key,
                slots: slots.clone(),
                ids: Vec::with_capacity(rows.len()),
                data: widths
                    .iter()
                    .map(|w| Vec::with_capacity(w * rows.len()))
                    .collect(),
            };
            read(&mut |ids: &[u64], cols: &[&[u8]]| {
                gathered.ids.extend_from_slice(ids);
                for (d, c) in gathered.data.iter_mut().zip(cols) {
                    d.extend_from_slice(c);
                }
                Ok(())
            })?;
            hash_columns(h, version, &gathered)?;
        }
    }
    for snap in snaps {
        snap.finish()?;
    }
    Ok(())
}

fn hash_dense(mut h: Sha256, dense: &[LoadedDense]) -> String {
    let mut dense: Vec<&LoadedDense> = dense.iter().collect();
    dense.sort_by(|a, b| a.name.cmp(&b.name));
    for d in dense {
        h.update(b"dense\0");
        put_str(&mut h, &d.name);
        put_str(&mut h, d.dtype.name());
        put_shape(&mut h, &d.shape);
        h.update((d.data.len() as u64).to_le_bytes());
        h.update(&d.data);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Each restored table's parts (one per target shard), by name.
fn restored_parts(r: &Restored) -> BTreeMap<String, Vec<&saver_core::EmbeddingTable>> {
    let mut tables: BTreeMap<String, Vec<&saver_core::EmbeddingTable>> = BTreeMap::new();
    for s in &r.shards {
        for t in &s.tables {
            tables
                .entry(SparseTable::name(t).to_string())
                .or_default()
                .push(t);
        }
    }
    tables
}

/// Hashes a table's header, as both versions do: name, key dtype, slots by name, row count.
fn hash_table_header(h: &mut Sha256, name: &str, key: KeyDtype, slots: &[SlotSpec], rows: u64) {
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by(|&a, &b| slots[a].name.cmp(&slots[b].name));
    h.update(b"table\0");
    put_str(h, name);
    put_str(h, key.dtype().name());
    h.update((slots.len() as u32).to_le_bytes());
    for &s in &order {
        put_str(h, &slots[s].name);
        put_str(h, slots[s].dtype.name());
        put_shape(h, &slots[s].shape);
    }
    h.update(rows.to_le_bytes());
}

/// Something that hands over one table's rows in the digest version's order, in batches: ids,
/// and each slot's rows (in the table's slot order).
type RowsInOrder<'a> = dyn FnOnce(&mut VisitRows<'_>) -> Result<()> + 'a;

/// Hashes one table: its header, then the rows `produce` hands over, which must be `rows` rows
/// in strictly increasing order of the version's row key (checked: a duplicate or misordered id
/// fails). The rows are laid out for hashing on this thread and hashed on another.
fn hash_table(
    h: &mut Sha256,
    version: DigestVersion,
    name: &str,
    key: KeyDtype,
    slots: &[SlotSpec],
    rows: u64,
    produce: Box<RowsInOrder<'_>>,
) -> Result<()> {
    hash_table_header(h, name, key, slots, rows);
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by(|&a, &b| slots[a].name.cmp(&slots[b].name));
    let widths: Vec<usize> = slots
        .iter()
        .map(|s| s.row_bytes().unwrap_or(0) as usize)
        .collect();
    let (full_tx, full_rx) = sync_channel::<Vec<u8>>(2);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(3);
    for _ in 0..3 {
        let _ = empty_tx.send(Vec::with_capacity(BATCH));
    }
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for batch in full_rx {
                h.update(&batch);
                let _ = empty_tx.send(batch);
            }
        });
        let mut seen = 0u64;
        let mut prev: Option<(u64, u64)> = None;
        let mut batch = empty_rx.recv().unwrap_or_default();
        let result = produce(&mut |ids: &[u64], cols: &[&[u8]]| {
            for (r, &id) in ids.iter().enumerate() {
                let at = version.row_key(key, id);
                if prev.is_some_and(|p| p >= at) {
                    return Err(Error::Mismatch(format!(
                        "table {name:?}: id {} is {} (rows must come in the digest's order, each once)",
                        key.format_id(id),
                        if prev == Some(at) { "there twice" } else { "out of order" }
                    ))
                    .into());
                }
                prev = Some(at);
                batch.extend_from_slice(&id.to_le_bytes());
                for &s in &order {
                    let w = widths[s];
                    batch.extend_from_slice(&cols[s][r * w..(r + 1) * w]);
                }
                if batch.len() >= BATCH {
                    let next = empty_rx.recv().unwrap_or_default();
                    let _ = full_tx.send(std::mem::replace(&mut batch, next));
                    batch.clear();
                }
            }
            seen += ids.len() as u64;
            Ok(())
        });
        let _ = full_tx.send(batch);
        drop(full_tx);
        result?;
        if seen != rows {
            return Err(Error::Mismatch(format!(
                "table {name:?}: {seen} rows were hashed, {rows} expected"
            )));
        }
        Ok(())
    })
}

impl std::fmt::Debug for Content<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self {
            Content::Tables { .. } => "Tables",
            Content::Files { .. } => "Files",
            Content::Source { .. } => "Source",
            Content::At { path, .. } => {
                return f
                    .debug_struct("At")
                    .field("path", path)
                    .finish_non_exhaustive()
            }
            Content::Restored(_) => "Restored",
            Content::Columns(_) => "Columns",
            Content::WithRowTables { .. } => "WithRowTables",
        };
        f.write_str(what)
    }
}

//! A content digest that depends only on what a checkpoint holds (table names, ids, slot rows,
//! dense tensors), not on shard count, file layout or row order: equal before and after a
//! reshard, and computable by other tools. The definitions are in `docs/FORMAT.md`; in short,
//! SHA-256 over tables by name (slots by name, rows in a fixed order) then dense tensors by name.
//!
//! Two versions ([`DigestVersion`]). Version 2, the default, orders each table's rows by
//! (bucket, id): the order a checkpoint stores them in, so a checkpoint's digest is one
//! sequential read of its files, in bounded memory ([`source_digest`]). Version 1 orders rows
//! by id alone, which takes a table's ids in memory; it stays computable for digests recorded
//! before version 2.

use std::collections::BTreeMap;
use std::sync::mpsc::sync_channel;

use rayon::slice::ParallelSliceMut;
use sha2::{Digest, Sha256};

use saver_core::{EmbeddingTable, KeyDtype, PartitionRule, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::arrays::{Columns, TableColumns};
use crate::load::rows::VisitRows;
use crate::source::SourceTables;

use crate::load::restore::LoadedDense;

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

/// Rows ahead of the one being copied whose memory is prefetched.
const PREFETCH_AHEAD: usize = 16;

/// Rows of one table, wherever they live.
trait Rows: Sync {
    /// Every id, unordered, each with a handle to find its row again.
    fn ids(&self) -> Vec<(u64, usize)>;
    /// Appends the row's slot bytes, slots in the order `order`, to `out`; `scratch` is the
    /// caller's buffer, kept between calls, for tables that must copy a row before reordering.
    fn append(
        &self,
        handle: usize,
        id: u64,
        order: &[usize],
        scratch: &mut Vec<u8>,
        out: &mut Vec<u8>,
    );
    /// Asks the CPU to start loading the row of `handle`, needed soon.
    fn prefetch(&self, handle: usize) {
        let _ = handle;
    }
}

struct TableParts<'a> {
    parts: &'a [&'a EmbeddingTable],
    /// Each slot's offset and length within a row as `append_row` gives it.
    slots: Vec<(usize, usize)>,
}

impl Rows for TableParts<'_> {
    fn ids(&self) -> Vec<(u64, usize)> {
        self.parts
            .iter()
            .enumerate()
            .flat_map(|(p, t)| t.ids().into_iter().map(move |id| (id, p)))
            .collect()
    }
    fn append(
        &self,
        handle: usize,
        id: u64,
        order: &[usize],
        scratch: &mut Vec<u8>,
        out: &mut Vec<u8>,
    ) {
        scratch.clear();
        self.parts[handle].append_row(id, scratch);
        for &s in order {
            let (off, len) = self.slots[s];
            out.extend_from_slice(&scratch[off..off + len]);
        }
    }
}

impl Rows for TableColumns {
    fn ids(&self) -> Vec<(u64, usize)> {
        self.ids
            .iter()
            .enumerate()
            .map(|(r, &id)| (id, r))
            .collect()
    }
    fn append(
        &self,
        handle: usize,
        _id: u64,
        order: &[usize],
        _scratch: &mut Vec<u8>,
        out: &mut Vec<u8>,
    ) {
        for &s in order {
            let b = self.slots[s].row_bytes().unwrap_or(0) as usize;
            out.extend_from_slice(&self.data[s][handle * b..(handle + 1) * b]);
        }
    }
    fn prefetch(&self, handle: usize) {
        #[cfg(target_arch = "x86_64")]
        for (d, s) in self.data.iter().zip(&self.slots) {
            let b = s.row_bytes().unwrap_or(0) as usize;
            if let Some(row) = d.get(handle * b..(handle + 1) * b) {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                // SAFETY: SSE is part of x86_64, and a prefetch never faults; the address is
                // inside `d` anyway. Only a row's first and last line: rows are narrow.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().cast());
                    _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().add(b.saturating_sub(1)).cast());
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = handle;
    }
}

fn hash_table(h: &mut Sha256, name: &str, key: KeyDtype, slots: &[SlotSpec], rows: &dyn Rows) {
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by(|&a, &b| slots[a].name.cmp(&slots[b].name));
    let mut ids = rows.ids();
    ids.par_sort_unstable_by_key(|&(id, _)| key.order_key(id));
    hash_table_header(h, name, key, slots, ids.len() as u64);
    // Rows in id order are a random walk over memory. One thread walks them, prefetching ahead,
    // into batches that this thread hashes meanwhile: the walk waits on memory and the hash on
    // the CPU, and done by one thread in turn they took the sum of both.
    let (full_tx, full_rx) = sync_channel::<Vec<u8>>(2);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(3);
    for _ in 0..3 {
        let _ = empty_tx.send(Vec::with_capacity(BATCH));
    }
    let (ids, order) = (&ids, &order);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let Ok(mut batch) = empty_rx.recv() else {
                return;
            };
            let mut scratch = Vec::new();
            for (k, &(id, handle)) in ids.iter().enumerate() {
                if let Some(&(_, ahead)) = ids.get(k + PREFETCH_AHEAD) {
                    rows.prefetch(ahead);
                }
                batch.extend_from_slice(&id.to_le_bytes());
                rows.append(handle, id, order, &mut scratch, &mut batch);
                if batch.len() >= BATCH {
                    if full_tx.send(batch).is_err() {
                        return;
                    }
                    let Ok(next) = empty_rx.recv() else {
                        return;
                    };
                    batch = next;
                    batch.clear();
                }
            }
            let _ = full_tx.send(batch);
        });
        for batch in full_rx {
            h.update(&batch);
            let _ = empty_tx.send(batch);
        }
    });
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

/// Each slot's (offset, length) within a row of `EmbeddingTable::append_row`: slot by slot.
fn row_layout(slots: &[SlotSpec]) -> Vec<(usize, usize)> {
    let mut off = 0;
    slots
        .iter()
        .map(|s| {
            let len = s.row_bytes().unwrap_or(0) as usize;
            off += len;
            (off - len, len)
        })
        .collect()
}

/// The version-1 digest of tables (each possibly split into parts, e.g. one per restored shard)
/// and dense tensors, as lowercase hex.
pub fn content_digest(
    tables: &BTreeMap<String, Vec<&EmbeddingTable>>,
    dense: &[LoadedDense],
) -> String {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG);
    for (name, parts) in tables {
        let Some(first) = parts.first() else { continue };
        hash_table(
            &mut h,
            name,
            first.key_dtype(),
            SparseTable::slots(*first),
            &TableParts {
                parts,
                slots: row_layout(SparseTable::slots(*first)),
            },
        );
    }
    hash_dense(h, dense)
}

/// The version-1 digest of a columnar load (tables must have distinct names).
pub fn columns_digest_v1(c: &Columns) -> String {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG);
    let mut tables: Vec<&TableColumns> = c.tables.iter().collect();
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    for t in tables {
        hash_table(&mut h, &t.name, t.key_dtype, &t.slots, t);
    }
    hash_dense(h, &c.dense)
}

/// The (version-2) digest of a columnar load (tables must have distinct names).
pub fn columns_digest(c: &Columns) -> Result<String> {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG_V2);
    let mut tables: Vec<&TableColumns> = c.tables.iter().collect();
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    for t in tables {
        let mut order: Vec<(u32, u64, usize)> = t
            .ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (PartitionRule::bucket_of(id), id, i))
            .collect();
        order.par_sort_unstable();
        let widths: Vec<usize> = t
            .slots
            .iter()
            .map(|s| s.row_bytes().unwrap_or(0) as usize)
            .collect();
        let order = &order;
        hash_table_v2(
            &mut h,
            &t.name,
            t.key_dtype,
            &t.slots,
            t.ids.len() as u64,
            Box::new(move |visit| {
                let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
                for chunk in order.chunks(1 << 14) {
                    for ((b, d), &w) in bufs.iter_mut().zip(&t.data).zip(&widths) {
                        b.clear();
                        for &(_, _, i) in chunk {
                            b.extend_from_slice(&d[i * w..(i + 1) * w]);
                        }
                    }
                    let ids: Vec<u64> = chunk.iter().map(|r| r.1).collect();
                    let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                    visit(&ids, &views)?;
                }
                Ok(())
            }),
        )?;
    }
    Ok(hash_dense(h, &c.dense))
}

/// Each restored table's parts (one per target shard), by name.
fn restored_parts(r: &crate::load::restore::Restored) -> BTreeMap<String, Vec<&EmbeddingTable>> {
    let mut tables: BTreeMap<String, Vec<&EmbeddingTable>> = BTreeMap::new();
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

/// The (version-2) digest of a restore's content (all its shards together).
pub fn restored_digest(r: &crate::load::restore::Restored) -> Result<String> {
    let tables = restored_parts(r)
        .into_iter()
        .map(|(k, v)| (k, v.into_iter().map(|t| t as &dyn SparseTable).collect()))
        .collect();
    tables_digest(&tables, &r.dense)
}

/// The version-1 digest of a restore's content.
pub fn restored_digest_v1(r: &crate::load::restore::Restored) -> String {
    content_digest(&restored_parts(r), &r.dense)
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

/// Something that hands over one table's rows in (bucket, id) order, in batches: ids, and
/// each slot's rows (in the table's slot order).
type RowsInBucketOrder<'a> = dyn FnOnce(&mut VisitRows<'_>) -> Result<()> + 'a;

/// Hashes one table for version 2: its header, then the rows `produce` hands over, which must
/// be `rows` rows in strictly increasing (bucket, id) order (checked: a duplicate or
/// misordered id fails). The rows are laid out for hashing on this thread and hashed on another.
fn hash_table_v2(
    h: &mut Sha256,
    name: &str,
    key: KeyDtype,
    slots: &[SlotSpec],
    rows: u64,
    produce: Box<RowsInBucketOrder<'_>>,
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
        let mut prev: Option<(u32, u64)> = None;
        let mut batch = empty_rx.recv().unwrap_or_default();
        let result = produce(&mut |ids: &[u64], cols: &[&[u8]]| {
            for (r, &id) in ids.iter().enumerate() {
                let at = (PartitionRule::bucket_of(id), id);
                if prev.is_some_and(|p| p >= at) {
                    return Err(Error::Mismatch(format!(
                        "table {name:?}: id {} is {} (rows must come in (bucket, id) order, each once)",
                        key.format_id(id),
                        if prev.is_some_and(|p| p.1 == id) { "there twice" } else { "out of order" }
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

/// Rows read at a time from a checkpoint or a plain input for the digest.
const READ_ROWS_BYTES: u64 = 4 << 20;

/// The version-2 digest of tables held in memory (any [`SparseTable`]s; a table may be split in
/// parts, e.g. one per restored shard, which must not share ids) and dense tensors. Holds 24
/// bytes per row beside the tables.
pub fn tables_digest(
    tables: &BTreeMap<String, Vec<&dyn SparseTable>>,
    dense: &[LoadedDense],
) -> Result<String> {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG_V2);
    for (name, parts) in tables {
        let Some(first) = parts.first() else { continue };
        let snaps = parts
            .iter()
            .map(|t| t.snapshot())
            .collect::<saver_core::Result<Vec<_>>>()?;
        // (bucket, id, part, handle)
        let mut rows: Vec<(u32, u64, u32, u64)> = Vec::new();
        for (p, snap) in snaps.iter().enumerate() {
            snap.scan(1 << 16, false, &mut |c| {
                rows.extend(c.ids.iter().enumerate().map(|(i, &id)| {
                    (
                        PartitionRule::bucket_of(id),
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
        hash_table_v2(
            &mut h,
            name,
            first.key_dtype(),
            &slots,
            count,
            Box::new(move |visit| {
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
            }),
        )?;
        for snap in snaps {
            snap.finish()?;
        }
    }
    Ok(hash_dense(h, dense))
}

/// The version-2 digest of the tables and dense tensors of a checkpoint or plain input, read
/// in bounded memory: a checkpoint's rows lie in digest order already and are read once, front
/// to back, each tensor checked against its CRC32; a plain input's group by group (see
/// `crate::source::plain`).
pub fn source_digest(tables: &SourceTables<'_>, dense: &[LoadedDense]) -> Result<String> {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG_V2);
    let mut tables = tables.as_bucket_rows();
    tables.sort_by(|a, b| a.name().cmp(b.name()));
    for t in tables {
        let step = (READ_ROWS_BYTES / (8 + t.row_bytes().iter().sum::<u64>())).max(1) as usize;
        hash_table_v2(
            &mut h,
            t.name(),
            t.key_dtype(),
            t.slots(),
            t.rows(),
            Box::new(move |visit| Ok(t.visit_in_bucket_order(step, visit)?)),
        )?;
        // No digest of bytes that fail their checksums.
        t.finish_checks()?;
    }
    Ok(hash_dense(h, dense))
}

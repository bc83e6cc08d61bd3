//! A content digest that depends only on what a checkpoint holds (table names, ids, slot rows,
//! dense tensors), not on shard count, file layout or row order: equal before and after a
//! reshard, and computable by other tools. The definition is in `docs/FORMAT.md`; in short,
//! SHA-256 over tables by name (slots by name, rows by ascending id) then dense tensors by name.

use std::collections::BTreeMap;
use std::sync::mpsc::sync_channel;

use rayon::slice::ParallelSliceMut;
use sha2::{Digest, Sha256};

use saver_core::{EmbeddingTable, KeyDtype, SlotSpec, SparseTable};

use crate::columns::{Columns, TableColumns};

use crate::restore::LoadedDense;

/// Version tag hashed first, so a changed definition never collides with the old one.
pub const DIGEST_TAG: &[u8] = b"saver-digest-v1\n";

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
    h.update(b"table\0");
    put_str(h, name);
    put_str(h, key.dtype().name());
    h.update((slots.len() as u32).to_le_bytes());
    for &s in &order {
        put_str(h, &slots[s].name);
        put_str(h, slots[s].dtype.name());
        put_shape(h, &slots[s].shape);
    }
    let mut ids = rows.ids();
    ids.par_sort_unstable_by_key(|&(id, _)| key.order_key(id));
    h.update((ids.len() as u64).to_le_bytes());
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

/// The digest of tables (each possibly split into parts, e.g. one per restored shard) and dense
/// tensors, as lowercase hex.
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

/// The digest of a columnar load (tables must have distinct names).
pub fn columns_digest(c: &Columns) -> String {
    let mut h = Sha256::new();
    h.update(DIGEST_TAG);
    let mut tables: Vec<&TableColumns> = c.tables.iter().collect();
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    for t in tables {
        hash_table(&mut h, &t.name, t.key_dtype, &t.slots, t);
    }
    hash_dense(h, &c.dense)
}

/// The digest of a restore's content (all its shards together).
pub fn restored_digest(r: &crate::restore::Restored) -> String {
    let mut tables: BTreeMap<String, Vec<&EmbeddingTable>> = BTreeMap::new();
    for s in &r.shards {
        for t in &s.tables {
            tables
                .entry(SparseTable::name(t).to_string())
                .or_default()
                .push(t);
        }
    }
    content_digest(&tables, &r.dense)
}

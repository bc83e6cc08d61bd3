//! A content digest that depends only on what a checkpoint holds (table names, ids, slot rows,
//! dense tensors), not on shard count, file layout or row order: equal before and after a
//! reshard, and computable by other tools. The definition is in `docs/FORMAT.md`; in short,
//! SHA-256 over tables by name (slots by name, rows by ascending id) then dense tensors by name.

use std::collections::BTreeMap;

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

/// Rows of one table, wherever they live.
trait Rows {
    /// Every id, unordered, each with a handle to find its row again.
    fn ids(&self) -> Vec<(u64, usize)>;
    /// Appends the row's slot bytes, in slot order, to `out`.
    fn append(&self, handle: usize, id: u64, out: &mut Vec<u8>);
}

struct TableParts<'a>(&'a [&'a EmbeddingTable]);

impl Rows for TableParts<'_> {
    fn ids(&self) -> Vec<(u64, usize)> {
        self.0
            .iter()
            .enumerate()
            .flat_map(|(p, t)| t.ids().into_iter().map(move |id| (id, p)))
            .collect()
    }
    fn append(&self, handle: usize, id: u64, out: &mut Vec<u8>) {
        self.0[handle].append_row(id, out);
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
    fn append(&self, handle: usize, _id: u64, out: &mut Vec<u8>) {
        for (d, s) in self.data.iter().zip(&self.slots) {
            let b = s.row_bytes().unwrap_or(0) as usize;
            out.extend_from_slice(&d[handle * b..(handle + 1) * b]);
        }
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
    ids.sort_unstable_by_key(|&(id, _)| key.order_key(id));
    h.update((ids.len() as u64).to_le_bytes());
    let sizes: Vec<usize> = slots
        .iter()
        .map(|s| s.row_bytes().unwrap_or(0) as usize)
        .collect();
    let mut offsets = vec![0usize; sizes.len()];
    for s in 1..sizes.len() {
        offsets[s] = offsets[s - 1] + sizes[s - 1];
    }
    let mut row = Vec::new();
    for (id, handle) in ids {
        row.clear();
        rows.append(handle, id, &mut row);
        h.update(id.to_le_bytes());
        for &s in &order {
            h.update(&row[offsets[s]..offsets[s] + sizes[s]]);
        }
    }
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
            &TableParts(parts),
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

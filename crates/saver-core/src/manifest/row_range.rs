//! The manifest entries of row-range tables ([`crate::row_range`]): per table its rows, per slot
//! its dtype, whole shape and chunks, each chunk a tensor of a data file at its offset; in a
//! delta, also patches: rectangles of which only the rows changed since the parent are held.

use serde::{Deserialize, Serialize};

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::manifest::TensorRef;
use crate::naming::{check_slot_name, check_table_name};
use crate::row_range::{chunk_tensor_name, patch_tensor_names, tiling_problem};

/// One row-range table: ids `0..rows`, no ids tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowTableManifest {
    /// Table name.
    pub name: String,
    /// Rows of the table (and of each of its slots).
    pub rows: u64,
    /// Its slots, by name.
    pub slots: Vec<RowSlotManifest>,
}

/// One slot of a row-range table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowSlotManifest {
    /// Slot name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The whole slot's shape: `[rows]` (one value per row) or `[rows, cols]`.
    pub shape: Vec<u64>,
    /// The chunks that hold it, by offset: in a shard manifest those the shard wrote, in a
    /// checkpoint's manifest all of them, which with its patches tile the slot exactly.
    pub chunks: Vec<RowChunkManifest>,
    /// In a delta, the rectangles of which it holds only the rows that changed since its parent
    /// (by offset); the rest of each is the parent's. None in a full checkpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patches: Vec<RowPatchManifest>,
}

/// One rectangle of a slot in a delta of which only the rows changed since the parent are held.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowPatchManifest {
    /// The shard that wrote it.
    pub shard: u32,
    /// Its first row, and first column for a slot of two dimensions.
    pub offset: Vec<u64>,
    /// Its shape: rows, and columns for a slot of two dimensions.
    pub shape: Vec<u64>,
    /// Its changed rows; none when no row of it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<ChangedRowsManifest>,
}

/// The rows of a patch that changed: their row numbers and their values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedRowsManifest {
    /// `U64` of shape `[k]`: table row numbers, increasing, within the patch's rows.
    pub rows: TensorRef,
    /// The slot's dtype, of shape `[k]` or `[k, columns of the patch]`: row `i` of it is the
    /// patch's columns of table row `rows[i]`.
    pub values: TensorRef,
}

/// One chunk of a slot: the rectangle of the slot at `offset` of its tensor's shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowChunkManifest {
    /// The shard that wrote it.
    pub shard: u32,
    /// Its first row, and first column for a slot of two dimensions.
    pub offset: Vec<u64>,
    /// Where its values are (shape: the chunk's).
    pub tensor: TensorRef,
}

impl RowTableManifest {
    /// Structural checks, so that readers can size buffers from the entry: names, one row count
    /// for every slot, chunks and patches of the slot's dtype inside its shape, none
    /// overlapping; and, when `complete` (a checkpoint's manifest), every element of every slot
    /// in some chunk or patch.
    pub(crate) fn check_consistency(&self, complete: bool) -> Result<()> {
        let bad = |what: String| Error::Encoding {
            what: format!("row-range table {:?}", self.name),
            message: what,
        };
        check_table_name(&self.name).map_err(|e| bad(e.to_string()))?;
        for (i, s) in self.slots.iter().enumerate() {
            check_slot_name(&s.name).map_err(|e| bad(e.to_string()))?;
            if self.slots[..i].iter().any(|o| o.name == s.name) {
                return Err(bad(format!("slot {:?} is listed twice", s.name)));
            }
            if !(1..=2).contains(&s.shape.len()) || s.shape[0] != self.rows {
                return Err(bad(format!(
                    "slot {:?} has shape {:?} in a table of {} rows",
                    s.name, s.shape, self.rows
                )));
            }
            for c in &s.chunks {
                let t = &c.tensor;
                let len = crate::tensor::byte_len(&t.name, t.dtype, &t.shape).ok();
                if t.dtype != s.dtype || len != Some(t.len) {
                    return Err(bad(format!(
                        "slot {:?}: tensor {:?} is not {} values of shape {:?}",
                        s.name, t.name, s.dtype, t.shape
                    )));
                }
                if let Some(b) = &t.blocks {
                    b.check(t.len)
                        .map_err(|why| bad(format!("tensor {:?} {why}", t.name)))?;
                }
            }
            for p in &s.patches {
                let Some(c) = &p.changed else { continue };
                let k = c.rows.shape.first().copied().unwrap_or(0);
                let mut values_shape = p.shape.clone();
                if let Some(r) = values_shape.first_mut() {
                    *r = k;
                }
                let rows_len =
                    crate::tensor::byte_len(&c.rows.name, Dtype::U64, &c.rows.shape).ok();
                let values_len =
                    crate::tensor::byte_len(&c.values.name, s.dtype, &values_shape).ok();
                if c.rows.dtype != Dtype::U64
                    || c.rows.shape.len() != 1
                    || rows_len != Some(c.rows.len)
                    || c.values.dtype != s.dtype
                    || c.values.shape != values_shape
                    || values_len != Some(c.values.len)
                    || k == 0
                    || k > p.shape.first().copied().unwrap_or(0)
                {
                    return Err(bad(format!(
                        "slot {:?}: the changed rows at {:?} are not k row numbers and k rows of \
                         {} of the patch's columns",
                        s.name, p.offset, s.dtype
                    )));
                }
                for t in [&c.rows, &c.values] {
                    if let Some(b) = &t.blocks {
                        b.check(t.len)
                            .map_err(|why| bad(format!("tensor {:?} {why}", t.name)))?;
                    }
                }
            }
            let pieces: Vec<(&[u64], &[u64])> = s
                .chunks
                .iter()
                .map(|c| (c.offset.as_slice(), c.tensor.shape.as_slice()))
                .chain(
                    s.patches
                        .iter()
                        .map(|p| (p.offset.as_slice(), p.shape.as_slice())),
                )
                .collect();
            if let Some(why) = tiling_problem(&s.shape, &pieces, complete) {
                return Err(bad(format!("slot {:?}: {why}", s.name)));
            }
            // A tensor's name says its place too: two chunks that trade offsets in a resealed
            // manifest would otherwise read as rows moved.
            for c in &s.chunks {
                let named = chunk_tensor_name(&self.name, &s.name, &c.offset);
                // Before 2026-12, a chunk of one dimension saved where it was made (never placed)
                // was named as if it had a column: `r<row>.c0` says the same place.
                let legacy = (c.offset.len() == 1)
                    .then(|| chunk_tensor_name(&self.name, &s.name, &[c.offset[0], 0]));
                if c.tensor.name != named && Some(&c.tensor.name) != legacy.as_ref() {
                    return Err(bad(format!(
                        "slot {:?}: the chunk at {:?} is tensor {:?}, whose name says another \
                         place (the chunk there is {named:?})",
                        s.name, c.offset, c.tensor.name
                    )));
                }
            }
            for p in &s.patches {
                let Some(c) = &p.changed else { continue };
                let (rows, values) = patch_tensor_names(&self.name, &s.name, &p.offset);
                if c.rows.name != rows || c.values.name != values {
                    return Err(bad(format!(
                        "slot {:?}: the changed rows at {:?} are tensors {:?} and {:?}, whose \
                         names say another place",
                        s.name, p.offset, c.rows.name, c.values.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every tensor of its chunks and patches.
    pub fn tensor_refs(&self) -> impl Iterator<Item = &TensorRef> {
        self.slots.iter().flat_map(|s| {
            s.chunks.iter().map(|c| &c.tensor).chain(
                s.patches
                    .iter()
                    .filter_map(|p| p.changed.as_ref())
                    .flat_map(|c| [&c.rows, &c.values]),
            )
        })
    }

    /// Whether some slot holds patches: rows of a delta's parent are read with it.
    pub(crate) fn has_patches(&self) -> bool {
        self.slots.iter().any(|s| !s.patches.is_empty())
    }
}

/// The row-range tables of a checkpoint from those of its shards: one entry per table, its
/// slots' chunks from every shard, which must agree on rows, dtypes and shapes and tile each
/// slot exactly. The error says what does not hold: the save is then refused.
pub(crate) fn merge_row_tables<'a>(
    shards: impl Iterator<Item = (u32, &'a [RowTableManifest])>,
) -> std::result::Result<Vec<RowTableManifest>, String> {
    let mut tables: Vec<RowTableManifest> = Vec::new();
    for (shard, given) in shards {
        for t in given {
            let m = match tables.iter_mut().find(|m| m.name == t.name) {
                Some(m) => m,
                None => {
                    tables.push(RowTableManifest {
                        name: t.name.clone(),
                        rows: t.rows,
                        slots: Vec::new(),
                    });
                    tables.last_mut().expect("just pushed")
                }
            };
            if m.rows != t.rows {
                return Err(format!(
                    "row-range table {:?} has {} rows in shard {shard} but {} before",
                    t.name, t.rows, m.rows
                ));
            }
            for s in &t.slots {
                match m.slots.iter_mut().find(|x| x.name == s.name) {
                    Some(x) if x.dtype != s.dtype || x.shape != s.shape => {
                        return Err(format!(
                            "row-range table {:?} slot {:?} is {} of shape {:?} in shard \
                             {shard} but {} of shape {:?} before",
                            t.name, s.name, s.dtype, s.shape, x.dtype, x.shape
                        ))
                    }
                    Some(x) => {
                        x.chunks.extend(s.chunks.iter().cloned());
                        x.patches.extend(s.patches.iter().cloned());
                    }
                    None => m.slots.push(s.clone()),
                }
            }
        }
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    for t in &mut tables {
        t.slots.sort_by(|a, b| a.name.cmp(&b.name));
        for s in &mut t.slots {
            s.chunks.sort_by(|a, b| a.offset.cmp(&b.offset));
            s.patches.sort_by(|a, b| a.offset.cmp(&b.offset));
        }
        t.check_consistency(true).map_err(|e| match e {
            Error::Encoding { what, message } => format!("{what}: {message}"),
            e => e.to_string(),
        })?;
    }
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(chunk_names: &[(&str, u64)]) -> RowTableManifest {
        let chunks = chunk_names
            .iter()
            .map(|&(name, row)| RowChunkManifest {
                shard: 0,
                offset: vec![row],
                tensor: TensorRef {
                    file: "f.safetensors".into(),
                    name: name.into(),
                    dtype: Dtype::F32,
                    shape: vec![2],
                    offset: 0,
                    len: 8,
                    crc32: 0,
                    blocks: None,
                    codec: None,
                },
            })
            .collect();
        RowTableManifest {
            name: "t".into(),
            rows: 4,
            slots: vec![RowSlotManifest {
                name: "s".into(),
                dtype: Dtype::F32,
                shape: vec![4],
                chunks,
                patches: Vec::new(),
            }],
        }
    }

    /// A chunk's tensor names its place; the name earlier saves gave a chunk of one dimension
    /// never placed (`r0.c0`) still reads, and no name says another place.
    #[test]
    fn chunk_names_must_say_their_place() {
        table(&[("t/s:r0", 0), ("t/s:r2", 2)])
            .check_consistency(true)
            .unwrap();
        table(&[("t/s:r0.c0", 0), ("t/s:r2", 2)])
            .check_consistency(true)
            .unwrap();
        for traded in [
            [("t/s:r2", 0), ("t/s:r0", 2)],
            [("t/s:r0", 0), ("t/s:r2.c1", 2)],
        ] {
            let e = table(&traded)
                .check_consistency(true)
                .unwrap_err()
                .to_string();
            assert!(e.contains("whose name says another place"), "{e}");
        }
    }
}

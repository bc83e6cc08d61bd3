//! Manifest types: what a checkpoint holds and where every byte of it lives.
//!
//! Each shard writes a [`ShardManifest`] once its data files are durable; the process that completes
//! the set merges them into the global [`Manifest`] ([`Manifest::merge`]). Both are JSON. The
//! layout is specified in `docs/FORMAT.md`.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::dtype::{Dtype, KeyDtype};
use crate::error::{Error, Result};
use crate::partition::PartitionRule;
use crate::table::SlotSpec;

/// Value of the `format` field of every manifest.
pub const FORMAT_NAME: &str = "saver";
/// The on-disk format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Where one tensor lives and what it must contain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRef {
    /// Data file, relative to the checkpoint directory.
    pub file: String,
    /// Tensor name inside the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's first byte in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// CRC32 (IEEE) of the tensor's bytes.
    pub crc32: u32,
}

/// One run of rows of a table partition, covering a contiguous bucket range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentManifest {
    /// Segment number within the partition.
    pub index: u32,
    /// Buckets covered, `[start, end)`.
    pub buckets: [u32; 2],
    /// Number of rows.
    pub rows: u64,
    /// The ids, sorted by (bucket, id bits).
    pub ids: TensorRef,
    /// U64 entries `(bucket << 48) | first_row` for each non-empty bucket, ascending.
    pub bucket_index: TensorRef,
    /// One tensor per kept slot, in the order of [`PartitionManifest::slots`].
    pub slots: Vec<TensorRef>,
}

/// The rows of one table that one shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionManifest {
    /// The shard.
    pub shard: u32,
    /// Buckets this partition covers (the shard's range under the partition rule).
    pub buckets: [u32; 2],
    /// Number of rows.
    pub rows: u64,
    /// Names of the slots written for this partition (filters may have dropped some).
    pub slots: Vec<String>,
    /// Segments, in bucket order.
    pub segments: Vec<SegmentManifest>,
}

/// One sparse table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableManifest {
    /// Table name.
    pub name: String,
    /// Id dtype.
    pub key_dtype: KeyDtype,
    /// Every slot of the table as saved (a slot dropped in every partition is not listed).
    pub slots: Vec<SlotSpec>,
    /// Total rows over all partitions.
    pub rows: u64,
    /// One entry per shard that holds rows or was planned for this table.
    pub partitions: Vec<PartitionManifest>,
}

/// One dense tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseManifest {
    /// The shard that wrote it.
    pub shard: u32,
    /// Where it is.
    pub tensor: TensorRef,
}

/// One data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileManifest {
    /// File name, relative to the checkpoint directory.
    pub name: String,
    /// The shard that wrote it.
    pub shard: u32,
    /// Total file size in bytes.
    pub bytes: u64,
    /// Offset of the data section (8 + header length).
    pub data_start: u64,
    /// Number of tensors.
    pub tensors: u32,
    /// CRC32 of the whole header (length prefix, JSON and padding).
    pub header_crc32: u32,
}

/// What one shard wrote; produced when its data are durable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The save this shard belongs to.
    pub save_id: String,
    /// The partition rule.
    pub partition: PartitionRule,
    /// Number of shards of the save.
    pub shard_num: u32,
    /// This shard.
    pub shard: u32,
    /// Tables with this shard's partition only.
    pub tables: Vec<TableManifest>,
    /// Dense tensors this shard wrote.
    pub dense: Vec<DenseManifest>,
    /// Data files this shard wrote.
    pub files: Vec<FileManifest>,
    /// Free-form metadata given by the trainer.
    pub user_metadata: BTreeMap<String, String>,
    /// This shard's trainer state, bincode-encoded then base64.
    pub trainer_state: Option<String>,
}

/// Per-shard facts kept in the global manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// The shard.
    pub shard: u32,
    /// Its trainer state, bincode-encoded then base64.
    pub trainer_state: Option<String>,
}

/// The global manifest of a committed checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Identifies the save; part of every file name.
    pub save_id: String,
    /// The partition rule.
    pub partition: PartitionRule,
    /// Number of shards the checkpoint was saved with.
    pub shard_num: u32,
    /// Sparse tables.
    pub tables: Vec<TableManifest>,
    /// Dense tensors.
    pub dense: Vec<DenseManifest>,
    /// Data files.
    pub files: Vec<FileManifest>,
    /// Per-shard trainer state.
    pub shards: Vec<ShardInfo>,
    /// Free-form metadata (shard 0's).
    pub user_metadata: BTreeMap<String, String>,
    /// The checkpoint this one is a delta of; always `None` until incremental saves exist.
    pub parent: Option<String>,
}

/// Structural checks of a table entry, so readers can size buffers from it safely.
pub trait TableManifestExt {
    /// Checks that every segment's tensors agree with the table's dtypes, shapes and row counts,
    /// and that bucket ranges nest.
    fn check_consistency(&self) -> Result<()>;
}

impl TableManifestExt for TableManifest {
    fn check_consistency(&self) -> Result<()> {
        let bad = |what: String| Error::Encoding {
            what: format!("table {:?}", self.name),
            message: what,
        };
        let mut total = 0u64;
        for p in &self.partitions {
            if p.buckets[0] > p.buckets[1] || p.buckets[1] > crate::partition::BUCKETS {
                return Err(bad(format!(
                    "shard {} has bucket range {:?}",
                    p.shard, p.buckets
                )));
            }
            let mut specs = Vec::new();
            for name in &p.slots {
                specs.push(self.slots.iter().find(|s| &s.name == name).ok_or_else(|| {
                    bad(format!("shard {} lists unknown slot {name:?}", p.shard))
                })?);
            }
            let mut rows = 0u64;
            let mut next = p.buckets[0];
            for seg in &p.segments {
                if seg.buckets[0] != next
                    || seg.buckets[1] < seg.buckets[0]
                    || seg.buckets[1] > p.buckets[1]
                {
                    return Err(bad(format!(
                        "shard {} segment {} has bucket range {:?}",
                        p.shard, seg.index, seg.buckets
                    )));
                }
                next = seg.buckets[1];
                rows += seg.rows;
                if seg.ids.dtype != self.key_dtype.dtype() || seg.ids.shape != [seg.rows] {
                    return Err(bad(format!(
                        "tensor {:?} does not hold {} ids",
                        seg.ids.name, seg.rows
                    )));
                }
                if seg.bucket_index.dtype != Dtype::U64 || seg.bucket_index.shape.len() != 1 {
                    return Err(bad(format!(
                        "tensor {:?} is not a U64 vector",
                        seg.bucket_index.name
                    )));
                }
                if seg.slots.len() != specs.len() {
                    return Err(bad(format!(
                        "shard {} segment {} has {} slot tensors for {} slots",
                        p.shard,
                        seg.index,
                        seg.slots.len(),
                        specs.len()
                    )));
                }
                for (t, spec) in seg.slots.iter().zip(&specs) {
                    let mut shape = vec![seg.rows];
                    shape.extend_from_slice(&spec.shape);
                    if t.dtype != spec.dtype || t.shape != shape {
                        return Err(bad(format!(
                            "tensor {:?} is {} {:?}, expected {} {:?}",
                            t.name, t.dtype, t.shape, spec.dtype, shape
                        )));
                    }
                }
            }
            if rows != p.rows {
                return Err(bad(format!(
                    "shard {} has {} rows in segments but says {}",
                    p.shard, rows, p.rows
                )));
            }
            total += rows;
        }
        if total != self.rows {
            return Err(bad(format!(
                "{} rows in partitions but says {}",
                total, self.rows
            )));
        }
        Ok(())
    }
}

fn mismatch(what: String) -> Error {
    Error::Encoding {
        what: "merging shard manifests".into(),
        message: what,
    }
}

impl Manifest {
    /// Merges the manifests of every shard of one save into the global manifest, checking that
    /// they belong together: same save, rule and shard count, each shard exactly once, identical
    /// table definitions.
    pub fn merge(mut shards: Vec<ShardManifest>) -> Result<Manifest> {
        shards.sort_by_key(|s| s.shard);
        let first = shards
            .first()
            .ok_or_else(|| mismatch("no shard manifests".into()))?;
        let (save_id, rule, shard_num) = (
            first.save_id.clone(),
            first.partition.clone(),
            first.shard_num,
        );
        if shards.len() as u64 != u64::from(shard_num) {
            return Err(mismatch(format!(
                "{} shard manifests for {shard_num} shards",
                shards.len()
            )));
        }
        let mut tables: Vec<TableManifest> = Vec::new();
        let mut dense = Vec::new();
        let mut files = Vec::new();
        let mut infos = Vec::new();
        for (i, s) in shards.iter().enumerate() {
            if s.shard as usize != i {
                return Err(mismatch(format!("shard {i} is missing or repeated")));
            }
            if s.save_id != save_id || s.partition != rule || s.shard_num != shard_num {
                return Err(mismatch(format!(
                    "shard {} belongs to save {:?} ({} shards), shard 0 to {:?} ({} shards)",
                    s.shard, s.save_id, s.shard_num, save_id, shard_num
                )));
            }
            if s.format != FORMAT_NAME || s.format_version != FORMAT_VERSION {
                return Err(mismatch(format!(
                    "shard {} has format {} version {}",
                    s.shard, s.format, s.format_version
                )));
            }
            for t in &s.tables {
                match tables.iter_mut().find(|m| m.name == t.name) {
                    Some(m) => {
                        if m.key_dtype != t.key_dtype {
                            return Err(mismatch(format!(
                                "table {:?} has key dtype {} in shard {} but {} before",
                                t.name, t.key_dtype, s.shard, m.key_dtype
                            )));
                        }
                        for slot in &t.slots {
                            match m.slots.iter().find(|x| x.name == slot.name) {
                                Some(x) if x != slot => {
                                    return Err(mismatch(format!(
                                        "table {:?} slot {:?} differs between shards",
                                        t.name, slot.name
                                    )))
                                }
                                Some(_) => {}
                                None => m.slots.push(slot.clone()),
                            }
                        }
                        m.rows += t.rows;
                        m.partitions.extend(t.partitions.iter().cloned());
                    }
                    None => tables.push(t.clone()),
                }
            }
            dense.extend(s.dense.iter().cloned());
            files.extend(s.files.iter().cloned());
            infos.push(ShardInfo {
                shard: s.shard,
                trainer_state: s.trainer_state.clone(),
            });
        }
        tables.sort_by(|a, b| a.name.cmp(&b.name));
        dense.sort_by(|a: &DenseManifest, b| a.tensor.name.cmp(&b.tensor.name));
        Ok(Manifest {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            save_id,
            partition: rule,
            shard_num,
            tables,
            dense,
            files,
            shards: infos,
            user_metadata: shards[0].user_metadata.clone(),
            parent: None,
        })
    }

    /// Every tensor the manifest references, with what it is.
    pub fn tensor_refs(&self) -> impl Iterator<Item = &TensorRef> {
        let sparse = self.tables.iter().flat_map(|t| {
            t.partitions.iter().flat_map(|p| {
                p.segments.iter().flat_map(|s| {
                    std::iter::once(&s.ids)
                        .chain(std::iter::once(&s.bucket_index))
                        .chain(s.slots.iter())
                })
            })
        });
        sparse.chain(self.dense.iter().map(|d| &d.tensor))
    }

    /// Total bytes of tensor data.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensor_refs().map(|t| t.len).sum()
    }

    /// A table by name.
    pub fn table(&self, name: &str) -> Option<&TableManifest> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// Decodes shard `shard`'s trainer state into `T`; `Ok(None)` if that shard saved none.
    pub fn trainer_state<T: DeserializeOwned>(&self, shard: u32) -> Result<Option<T>> {
        match self
            .shards
            .iter()
            .find(|s| s.shard == shard)
            .and_then(|s| s.trainer_state.as_deref())
        {
            Some(b64) => decode_trainer_state(b64).map(Some),
            None => Ok(None),
        }
    }
}

/// Encodes a trainer state for a manifest: bincode (standard configuration), then base64.
pub fn encode_trainer_state<T: Serialize>(state: &T) -> Result<String> {
    let bytes = bincode::serde::encode_to_vec(state, bincode::config::standard()).map_err(|e| {
        Error::Encoding {
            what: "trainer state".into(),
            message: e.to_string(),
        }
    })?;
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// Decodes a trainer state written by [`encode_trainer_state`].
pub fn decode_trainer_state<T: DeserializeOwned>(b64: &str) -> Result<T> {
    let err = |message: String| Error::Encoding {
        what: "trainer state".into(),
        message,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| err(e.to_string()))?;
    let (value, used) = bincode::serde::decode_from_slice(&bytes, bincode::config::standard())
        .map_err(|e| err(e.to_string()))?;
    if used != bytes.len() {
        return Err(err(format!("{} trailing bytes", bytes.len() - used)));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct State {
        step: u64,
        rng: [u64; 4],
        position: Vec<u32>,
    }

    #[test]
    fn trainer_state_round_trips_typed() {
        let s = State {
            step: 1234,
            rng: [1, 2, 3, u64::MAX],
            position: vec![7, 8],
        };
        let enc = encode_trainer_state(&s).unwrap();
        assert_eq!(decode_trainer_state::<State>(&enc).unwrap(), s);
        assert!(decode_trainer_state::<State>("!!").is_err());
        assert!(decode_trainer_state::<State>("AAAA").is_err());
    }
}

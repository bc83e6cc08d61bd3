//! What a checkpoint holds, summed up from its manifest: what `saver inspect` prints, as a type a
//! library user or a test can read (and serialize as JSON).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use saver_core::{Dtype, KeyDtype, ParentRef, PartitionRule};

use crate::error::Result;
use crate::load::checkpoint::Checkpoint;
use crate::load::link::Link;

/// One slot of a table.
#[derive(Clone, Debug, Serialize)]
pub struct SlotSummary {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// The shape of one row of it.
    pub shape: Vec<u64>,
}

/// One table.
#[derive(Clone, Debug, Serialize)]
pub struct TableSummary {
    /// Its name.
    pub name: String,
    /// The type of its ids.
    pub key_dtype: KeyDtype,
    /// Its rows, in all shards.
    pub rows: u64,
    /// Its rows in each shard, in shard order.
    pub rows_per_shard: Vec<u64>,
    /// Its slots.
    pub slots: Vec<SlotSummary>,
    /// Bytes of its ids and slots.
    pub bytes: u64,
    /// Bytes its ids, bucket indexes and slots take in the files: fewer than `bytes` where they
    /// are compressed (format versions 3 and 4).
    pub stored_bytes: u64,
}

/// One row-range table.
#[derive(Clone, Debug, Serialize)]
pub struct RowTableSummary {
    /// Table name.
    pub name: String,
    /// Its rows (its ids are `0..rows`).
    pub rows: u64,
    /// Its slots, each with its number of chunks.
    pub slots: Vec<RowSlotSummary>,
    /// Bytes of its values.
    pub bytes: u64,
    /// Bytes its chunks take in the files (less when compressed).
    pub stored_bytes: u64,
}

/// One slot of a row-range table in a [`Summary`].
#[derive(Clone, Debug, Serialize)]
pub struct RowSlotSummary {
    /// Slot name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The whole slot's shape: `[rows]` or `[rows, cols]`.
    pub shape: Vec<u64>,
    /// How many chunks hold it (in a delta, those held whole).
    pub chunks: usize,
    /// In a delta, how many patches (rectangles of which only changed rows are held) hold the
    /// rest, and the rows they hold.
    pub patches: usize,
    /// Rows the patches hold.
    pub changed_rows: u64,
}

/// One dense tensor.
#[derive(Clone, Debug, Serialize)]
pub struct DenseSummary {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its bytes.
    pub bytes: u64,
    /// Bytes it takes in its file: fewer than `bytes` where it is compressed.
    pub stored_bytes: u64,
    /// The shard that wrote it.
    pub shard: u32,
}

/// One data file.
#[derive(Clone, Debug, Serialize)]
pub struct FileSummary {
    /// Its name in the checkpoint's directory.
    pub name: String,
    /// The shard that wrote it.
    pub shard: u32,
    /// Its bytes.
    pub bytes: u64,
    /// The tensors it holds.
    pub tensors: u32,
}

/// One link of a delta's chain.
#[derive(Clone, Debug, Serialize)]
pub struct LinkSummary {
    /// Its directory.
    pub dir: String,
    /// Its save id.
    pub save_id: String,
    /// Whether it is a delta (the last link is a full checkpoint).
    pub delta: bool,
    /// Bytes of its data files.
    pub bytes: u64,
}

/// What a checkpoint holds: [`inspect`].
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The directory or URL inspected.
    pub dir: String,
    /// The format version its manifest carries.
    pub format_version: u32,
    /// Its save id.
    pub save_id: String,
    /// The trainer step it was saved at, if the save gave one (a managed root's steps do).
    pub step: Option<u64>,
    /// The partition rule its shards follow.
    pub partition_rule: PartitionRule,
    /// Its number of shards.
    pub shards: u32,
    /// Its tables.
    pub tables: Vec<TableSummary>,
    /// Its dense tensors.
    pub dense: Vec<DenseSummary>,
    /// Its row-range tables (format version 5).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub row_tables: Vec<RowTableSummary>,
    /// Its data files.
    pub files: Vec<FileSummary>,
    /// Bytes of its data files.
    pub total_bytes: u64,
    /// The user metadata of the save.
    pub user_metadata: BTreeMap<String, String>,
    /// The shards that saved a trainer state.
    pub trainer_state_shards: Vec<u32>,
    /// The process that wrote each shard (`host:pid`), in shard order, where the manifest names it.
    pub writers: Vec<String>,
    /// For a delta: the parent as the manifest names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// For a delta: every link of the chain, newest first, or why it cannot be followed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<std::result::Result<Vec<LinkSummary>, String>>,
}

/// The links of the chain of the delta in `dir`, or why they cannot be followed.
fn chain_of(dir: &Path) -> std::result::Result<Vec<LinkSummary>, String> {
    let chain = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    Ok(chain
        .links()
        .iter()
        .zip(chain.dirs())
        .map(|(c, d)| LinkSummary {
            dir: d.display().to_string(),
            save_id: c.manifest().save_id.clone(),
            delta: c.manifest().parent.is_some(),
            bytes: c.manifest().files.iter().map(|f| f.bytes).sum(),
        })
        .collect())
}

/// Sums up the checkpoint in `dir` from its manifest (no tensor byte is read); for a delta, also
/// the links of its chain.
pub fn inspect(dir: &Path) -> Result<Summary> {
    let ck = Link::open(dir)?;
    let m = ck.manifest();
    Ok(Summary {
        dir: dir.display().to_string(),
        format_version: m.format_version,
        save_id: m.save_id.clone(),
        step: m.step,
        partition_rule: m.partition.clone(),
        shards: m.shard_num,
        tables: m
            .tables
            .iter()
            .map(|t| {
                let mut per = vec![0; m.shard_num as usize];
                let (mut bytes, mut stored_bytes) = (0, 0);
                for p in &t.partitions {
                    per[p.shard as usize] += p.rows;
                    for s in &p.segments {
                        bytes += s.ids.len + s.slots.iter().map(|x| x.len).sum::<u64>();
                        stored_bytes += std::iter::once(&s.ids)
                            .chain(std::iter::once(&s.bucket_index))
                            .chain(&s.slots)
                            .map(|x| x.stored_len())
                            .sum::<u64>();
                    }
                }
                TableSummary {
                    name: t.name.clone(),
                    key_dtype: t.key_dtype,
                    rows: t.rows,
                    rows_per_shard: per,
                    slots: t
                        .slots
                        .iter()
                        .map(|s| SlotSummary {
                            name: s.name.clone(),
                            dtype: s.dtype,
                            shape: s.shape.clone(),
                        })
                        .collect(),
                    bytes,
                    stored_bytes,
                }
            })
            .collect(),
        row_tables: m
            .row_tables
            .iter()
            .map(|t| RowTableSummary {
                name: t.name.clone(),
                rows: t.rows,
                slots: t
                    .slots
                    .iter()
                    .map(|s| RowSlotSummary {
                        name: s.name.clone(),
                        dtype: s.dtype,
                        shape: s.shape.clone(),
                        chunks: s.chunks.len(),
                        patches: s.patches.len(),
                        changed_rows: s
                            .patches
                            .iter()
                            .filter_map(|p| p.changed.as_ref())
                            .map(|c| c.rows.shape.first().copied().unwrap_or(0))
                            .sum(),
                    })
                    .collect(),
                bytes: t.tensor_refs().map(|x| x.len).sum(),
                stored_bytes: t.tensor_refs().map(|x| x.stored_len()).sum(),
            })
            .collect(),
        dense: m
            .dense
            .iter()
            .map(|d| DenseSummary {
                name: d.tensor.name.clone(),
                dtype: d.tensor.dtype,
                shape: d.tensor.shape.clone(),
                bytes: d.tensor.len,
                stored_bytes: d.tensor.stored_len(),
                shard: d.shard,
            })
            .collect(),
        files: m
            .files
            .iter()
            .map(|f| FileSummary {
                name: f.name.clone(),
                shard: f.shard,
                bytes: f.bytes,
                tensors: f.tensors,
            })
            .collect(),
        total_bytes: m.files.iter().map(|f| f.bytes).sum(),
        user_metadata: m.user_metadata.clone(),
        trainer_state_shards: m
            .shards
            .iter()
            .filter(|s| s.trainer_state.is_some())
            .map(|s| s.shard)
            .collect(),
        writers: m
            .shards
            .iter()
            .filter_map(|s| s.writer.as_ref())
            .map(|w| format!("{}:{}", w.host, w.pid))
            .collect(),
        parent: m.parent.clone(),
        chain: m.parent.as_ref().map(|_| chain_of(dir)),
    })
}

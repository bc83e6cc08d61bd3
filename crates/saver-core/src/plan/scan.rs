//! Phase one of planning: snapshot each table, apply row filters, and sort the kept ids by bucket.

use std::ops::Range;

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::filter::{BlockInfo, BlockKind, Filters};
use crate::partition::{PartitionRule, BUCKETS};
use crate::table::{validate_slots, RowView, SlotSpec, SparseTable, TableSnapshot};

use super::ForeignRows;

/// Rows per scan chunk: bounds the memory a scan with slot values uses.
const SCAN_ROWS: usize = 4096;

/// A table after scanning: its snapshot and the ids to save, grouped by bucket.
pub(crate) struct ScannedTable<'a> {
    pub name: String,
    pub key_dtype: KeyDtype,
    pub slots: Vec<SlotSpec>,
    pub slot_bytes: Vec<usize>,
    pub snapshot: Box<dyn TableSnapshot + 'a>,
    /// Kept ids sorted by (bucket, id bits).
    pub ids: Vec<u64>,
    /// `bucket_start[b]..bucket_start[b + 1]` are the rows of bucket `b` in `ids`.
    pub bucket_start: Vec<u64>,
    /// For each planned shard (in plan order): whether its ids block is kept, and which slots.
    pub kept: Vec<Option<Vec<usize>>>,
}

impl ScannedTable<'_> {
    /// Rows of `ids` in buckets `range`.
    pub fn rows_in(&self, range: Range<u32>) -> Range<usize> {
        self.bucket_start[range.start as usize] as usize
            ..self.bucket_start[range.end as usize] as usize
    }
}

/// Which slots of `table` each planned shard keeps, per the block filters (`None`: ids dropped).
fn kept_blocks(
    table: &dyn SparseTable,
    shards: &[u32],
    filters: &Filters,
) -> Vec<Option<Vec<usize>>> {
    shards
        .iter()
        .map(|&shard| {
            let ids = BlockInfo {
                kind: BlockKind::Ids,
                table: Some(table.name()),
                slot: None,
                dense: None,
                shard,
            };
            filters.keep_block(&ids).then(|| {
                (0..table.slots().len())
                    .filter(|&s| {
                        filters.keep_block(&BlockInfo {
                            kind: BlockKind::Slot,
                            slot: Some(&table.slots()[s].name),
                            ..ids
                        })
                    })
                    .collect()
            })
        })
        .collect()
}

pub(crate) fn scan_table<'a>(
    table: &'a dyn SparseTable,
    shard_num: u32,
    shards: &[u32],
    filters: &Filters,
    foreign: ForeignRows,
) -> Result<ScannedTable<'a>> {
    let name = table.name().to_string();
    let slots = table.slots().to_vec();
    let slot_bytes = validate_slots(&name, &slots)?;
    let key_dtype = table.key_dtype();
    let kept = kept_blocks(table, shards, filters);
    let snapshot = table.snapshot()?;

    // shard -> position in `shards`, only needed when not every shard is planned.
    let all_planned = shards.len() as u64 == u64::from(shard_num);
    let keeps_shard = |shard: u32| -> Option<usize> {
        if all_planned {
            Some(shard as usize)
        } else {
            shards.iter().position(|&s| s == shard)
        }
    };
    let any_kept = kept.iter().any(Option::is_some);
    let with_values = filters.has_row_filters() && any_kept;

    let mut ids: Vec<u64> = Vec::with_capacity(if any_kept { table.len() } else { 0 });
    let mut foreign_count = 0u64;
    let mut foreign_first = None;
    if any_kept {
        snapshot.scan(SCAN_ROWS, with_values, &mut |chunk| {
            let mut row_vals: Vec<&[u8]> = vec![&[]; slots.len()];
            for (r, &id) in chunk.ids.iter().enumerate() {
                let shard = PartitionRule::shard_of(id, shard_num);
                let Some(pos) = keeps_shard(shard) else {
                    foreign_count += 1;
                    foreign_first.get_or_insert(id);
                    continue;
                };
                if kept[pos].is_none() {
                    continue;
                }
                if with_values {
                    for (s, v) in row_vals.iter_mut().enumerate() {
                        let b = slot_bytes[s];
                        *v = chunk
                            .slots
                            .get(s)
                            .and_then(|c| c.get(r * b..(r + 1) * b))
                            .ok_or_else(|| Error::Table {
                                table: name.clone(),
                                message: format!(
                                    "scan returned no values for slot {:?}",
                                    slots[s].name
                                ),
                            })?;
                    }
                    if !filters.keep_row(&RowView::new(&name, key_dtype, id, &slots, &row_vals)) {
                        continue;
                    }
                }
                ids.push(id);
            }
            Ok(())
        })?;
    }
    if foreign_count > 0 && foreign == ForeignRows::Error {
        return Err(Error::ForeignRows {
            table: name,
            shard: shards[0],
            count: foreign_count,
            first_id: key_dtype.format_id(foreign_first.unwrap_or_default()),
        });
    }

    let (ids, bucket_start) = sort_by_bucket(ids);
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::DuplicateId {
            table: name,
            id: key_dtype.format_id(w[0]),
        });
    }
    Ok(ScannedTable {
        name,
        key_dtype,
        slots,
        slot_bytes,
        snapshot,
        ids,
        bucket_start,
        kept,
    })
}

/// Counting sort by bucket, then by id bits within each bucket: O(n) plus tiny per-bucket sorts,
/// and deterministic whatever order the table produced its ids in.
pub(crate) fn sort_by_bucket(ids: Vec<u64>) -> (Vec<u64>, Vec<u64>) {
    let mut start = vec![0u64; BUCKETS as usize + 1];
    for &id in &ids {
        start[PartitionRule::bucket_of(id) as usize + 1] += 1;
    }
    for b in 0..BUCKETS as usize {
        start[b + 1] += start[b];
    }
    let mut next = start.clone();
    let mut sorted = vec![0u64; ids.len()];
    for id in ids {
        let b = PartitionRule::bucket_of(id) as usize;
        sorted[next[b] as usize] = id;
        next[b] += 1;
    }
    for b in 0..BUCKETS as usize {
        sorted[start[b] as usize..start[b + 1] as usize].sort_unstable();
    }
    (sorted, start)
}

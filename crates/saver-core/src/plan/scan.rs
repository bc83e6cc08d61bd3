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
    /// The snapshot's handle of each id in `ids`, or empty when it gave none.
    pub handles: Vec<u64>,
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
    let mut handles: Vec<u64> = Vec::with_capacity(ids.capacity());
    // Handles are used only if every chunk had them for every row.
    let mut all_handles = true;
    let mut foreign_count = 0u64;
    let mut foreign_first = None;
    if any_kept {
        snapshot.scan(SCAN_ROWS, with_values, &mut |chunk| {
            all_handles &= chunk.handles.len() == chunk.ids.len();
            if !all_handles {
                handles = Vec::new();
            }
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
                if all_handles {
                    handles.push(chunk.handles[r]);
                }
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

    let bucket_start = sort_by_bucket(&mut ids, &mut handles);
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
        handles,
        bucket_start,
        kept,
    })
}

/// Sorts `ids` by bucket, then by id bits within each bucket, moving `handles` (empty, or one per
/// id) along; returns where each bucket starts (`BUCKETS + 1` offsets).
///
/// In place, since for billions of rows a sorted copy would double the largest allocation of a
/// save: two American-flag passes (each misplaced id swapped straight into its region) on the
/// bucket's high then low byte, so each pass writes to only 256 region heads, which stay in cache
/// (one pass over 2^16 regions would miss the cache on nearly every swap). Then tiny per-bucket
/// sorts by id: deterministic whatever order the table produced its ids in.
pub(crate) fn sort_by_bucket(ids: &mut [u64], handles: &mut [u64]) -> Vec<u64> {
    let handles: &mut [u64] = if handles.len() == ids.len() {
        handles
    } else {
        &mut []
    };
    let mut start = Vec::with_capacity(BUCKETS as usize + 1);
    let high = flag_pass(ids, handles, |id| {
        (PartitionRule::bucket_of(id) >> 8) as usize
    });
    for h in 0..256 {
        let region = high[h]..high[h + 1];
        let sub_handles = if handles.is_empty() {
            &mut [][..]
        } else {
            &mut handles[region.clone()]
        };
        let low = flag_pass(&mut ids[region.clone()], sub_handles, |id| {
            (PartitionRule::bucket_of(id) & 0xff) as usize
        });
        start.extend(low[..256].iter().map(|&l| (region.start + l) as u64));
    }
    start.push(ids.len() as u64);

    let mut pairs = Vec::new();
    for b in 0..BUCKETS as usize {
        let range = start[b] as usize..start[b + 1] as usize;
        if handles.is_empty() {
            ids[range].sort_unstable();
        } else {
            pairs.clear();
            pairs.extend(
                ids[range.clone()]
                    .iter()
                    .zip(&handles[range.clone()])
                    .map(|(&i, &h)| (i, h)),
            );
            pairs.sort_unstable_by_key(|p| p.0);
            for (k, (id, h)) in pairs.iter().enumerate() {
                ids[range.start + k] = *id;
                handles[range.start + k] = *h;
            }
        }
    }
    start
}

/// One in-place American-flag pass over 256 regions by `key(id) < 256`, moving `handles` (empty,
/// or one per id) along. Returns the 257 region starts.
fn flag_pass(ids: &mut [u64], handles: &mut [u64], key: impl Fn(u64) -> usize) -> Vec<usize> {
    let mut start = vec![0usize; 257];
    for &id in ids.iter() {
        start[key(id) + 1] += 1;
    }
    for r in 0..256 {
        start[r + 1] += start[r];
    }
    let mut next = start.clone();
    for r in 0..256 {
        while next[r] < start[r + 1] {
            let i = next[r];
            let target = key(ids[i]);
            if target == r {
                next[r] += 1;
            } else {
                // Everything before next[target] is already in place, so that slot is free.
                let j = next[target];
                ids.swap(i, j);
                if !handles.is_empty() {
                    handles.swap(i, j);
                }
                next[target] += 1;
            }
        }
    }
    start
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn sort_orders_by_bucket_then_id_and_carries_handles(
            ids in vec(prop_oneof![any::<u64>(), 0u64..64], 0..3000),
            with_handles: bool,
        ) {
            let mut sorted = ids.clone();
            // A handle any id maps to, so that a handle left behind by a swap shows.
            let mut handles: Vec<u64> =
                if with_handles { ids.iter().map(|&i| !i).collect() } else { Vec::new() };
            let start = sort_by_bucket(&mut sorted, &mut handles);

            let mut expected = ids.clone();
            expected.sort_unstable_by_key(|&i| (PartitionRule::bucket_of(i), i));
            prop_assert_eq!(&sorted, &expected);
            if with_handles {
                prop_assert!(handles.iter().zip(&sorted).all(|(&h, &i)| h == !i));
            }
            prop_assert_eq!(start.len(), BUCKETS as usize + 1);
            for b in [0usize, 1, 255, 256, 4097, BUCKETS as usize] {
                let below = ids.iter().filter(|&&i| (PartitionRule::bucket_of(i) as usize) < b).count();
                prop_assert_eq!(start[b], below as u64);
            }
            for b in 0..BUCKETS as usize {
                for &i in &sorted[start[b] as usize..start[b + 1] as usize] {
                    prop_assert_eq!(PartitionRule::bucket_of(i) as usize, b);
                }
            }
        }
    }
}

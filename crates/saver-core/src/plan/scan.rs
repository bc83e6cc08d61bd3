//! Phase one of planning: snapshot each table, apply row filters, and sort the kept ids by bucket.

use std::ops::Range;

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::filter::{BlockInfo, BlockKind, Filters};
use crate::partition::{PartitionRule, BUCKETS};
use rayon::prelude::*;

use crate::table::{validate_slots, RowChunk, RowView, SlotSpec, SparseTable, TableSnapshot};

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

/// What the scan of one part (or, merged, of a whole table) found.
#[derive(Default)]
struct Found {
    ids: Vec<u64>,
    /// One per id, unless some chunk came without handles: then empty for good.
    handles: Vec<u64>,
    without_handles: bool,
    foreign_count: u64,
    foreign_first: Option<u64>,
}

/// A row filter and what it needs to see rows: the filters, the key dtype, the slots.
type RowFilter<'f> = (&'f Filters, KeyDtype, &'f [SlotSpec]);

impl Found {
    fn with_capacity(rows: usize) -> Self {
        Self {
            ids: Vec::with_capacity(rows),
            handles: Vec::with_capacity(rows),
            ..Self::default()
        }
    }

    /// Takes the rows of `chunk` this process saves and that `row_filter` (if any) keeps.
    fn add(
        &mut self,
        chunk: &RowChunk<'_>,
        table: &str,
        slot_bytes: &[usize],
        row_filter: Option<RowFilter<'_>>,
        keep: &impl Fn(u64) -> Option<bool>,
    ) -> Result<()> {
        if chunk.handles.len() != chunk.ids.len() && !self.without_handles {
            self.without_handles = true;
            self.handles = Vec::new();
        }
        let mut row_vals: Vec<&[u8]> = vec![&[]; slot_bytes.len()];
        for (r, &id) in chunk.ids.iter().enumerate() {
            match keep(id) {
                None => {
                    self.foreign_count += 1;
                    self.foreign_first.get_or_insert(id);
                    continue;
                }
                Some(false) => continue,
                Some(true) => {}
            }
            if let Some((filters, key_dtype, slots)) = row_filter {
                for (s, v) in row_vals.iter_mut().enumerate() {
                    let b = slot_bytes[s];
                    *v = chunk
                        .slots
                        .get(s)
                        .and_then(|c| c.get(r * b..(r + 1) * b))
                        .ok_or_else(|| Error::Table {
                            table: table.to_string(),
                            message: format!(
                                "scan returned no values for slot {:?}",
                                slots[s].name
                            ),
                        })?;
                }
                if !filters.keep_row(&RowView::new(table, key_dtype, id, slots, &row_vals)) {
                    continue;
                }
            }
            self.ids.push(id);
            if !self.without_handles {
                self.handles.push(chunk.handles[r]);
            }
        }
        Ok(())
    }

    /// Orders this part's rows by the bucket's high byte (the sort's first pass, done per part so
    /// that parts do it concurrently); returns the 257 region starts.
    fn by_high_byte(&mut self) -> Vec<usize> {
        let handles: &mut [u64] = if self.without_handles {
            &mut []
        } else {
            &mut self.handles
        };
        flag_pass(&mut self.ids, handles, high_byte)
    }

    /// One list of the parts' rows, ordered by the bucket's high byte, from parts so ordered
    /// (`highs[p]`: part `p`'s region starts); returns it with its 257 region starts. Each part
    /// is freed as soon as it is copied, so the peak stays near one copy of the rows.
    fn merge(parts: Vec<Found>, highs: &[Vec<usize>]) -> (Found, Vec<usize>) {
        let region_len = |p: usize, h: usize| highs[p][h + 1] - highs[p][h];
        let mut starts = vec![0usize; 257];
        for h in 0..256 {
            starts[h + 1] = starts[h] + (0..parts.len()).map(|p| region_len(p, h)).sum::<usize>();
        }
        if parts.len() == 1 {
            return (parts.into_iter().next().unwrap_or_default(), starts);
        }
        let rows = starts[256];
        let without_handles = parts.iter().any(|p| p.without_handles);
        let mut all = Found {
            ids: vec![0; rows],
            handles: if without_handles {
                Vec::new()
            } else {
                vec![0; rows]
            },
            without_handles,
            ..Found::default()
        };
        // Where part p's rows of region h go: after the region's rows from parts before p.
        let mut next = starts.clone();
        for (p, part) in parts.into_iter().enumerate() {
            for h in 0..256 {
                let from = highs[p][h]..highs[p][h + 1];
                let to = next[h]..next[h] + from.len();
                all.ids[to.clone()].copy_from_slice(&part.ids[from.clone()]);
                if !without_handles {
                    all.handles[to].copy_from_slice(&part.handles[from]);
                }
                next[h] += region_len(p, h);
            }
            all.foreign_count += part.foreign_count;
            all.foreign_first = all.foreign_first.or(part.foreign_first);
        }
        (all, starts)
    }
}

fn high_byte(id: u64) -> usize {
    (PartitionRule::bucket_of(id) >> 8) as usize
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
    // Whether a row is saved here: `Some(true)` yes, `Some(false)` its blocks are all dropped,
    // `None` its shard is not planned by this process (a foreign row).
    let keep = |id: u64| -> Option<bool> {
        let shard = PartitionRule::shard_of(id, shard_num);
        let pos = if all_planned {
            Some(shard as usize)
        } else {
            shards.iter().position(|&s| s == shard)
        };
        pos.map(|p| kept[p].is_some())
    };
    let any_kept = kept.iter().any(Option::is_some);
    let with_values = filters.has_row_filters() && any_kept;

    let mut found = Found::default();
    let mut high = vec![0usize; 257];
    if any_kept {
        // Parts are scanned concurrently, each into its own lists; merged below.
        let parts = snapshot.scan_parts().max(1);
        let per_part = table.len() / parts + 1;
        let scanned = (0..parts)
            .into_par_iter()
            .map(|part| {
                let mut f = Found::with_capacity(per_part);
                snapshot.scan_part(part, SCAN_ROWS, with_values, &mut |chunk| {
                    let row_filter = with_values.then_some((filters, key_dtype, &slots[..]));
                    f.add(&chunk, &name, &slot_bytes, row_filter, &keep)
                })?;
                let high = f.by_high_byte();
                Ok((f, high))
            })
            .collect::<Result<Vec<(Found, Vec<usize>)>>>()?;
        let (parts, highs): (Vec<Found>, Vec<Vec<usize>>) = scanned.into_iter().unzip();
        (found, high) = Found::merge(parts, &highs);
    }
    let Found {
        mut ids,
        mut handles,
        foreign_count,
        foreign_first,
        ..
    } = found;
    if foreign_count > 0 && foreign == ForeignRows::Error {
        return Err(Error::ForeignRows {
            table: name,
            shard: shards[0],
            count: foreign_count,
            first_id: key_dtype.format_id(foreign_first.unwrap_or_default()),
        });
    }

    let bucket_start = finish_sort(&mut ids, &mut handles, &high);
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

/// Finishes sorting `ids` by bucket, then by id bits within each bucket, moving `handles` (empty,
/// or one per id) along; returns where each bucket starts (`BUCKETS + 1` offsets). On entry the
/// rows are already ordered by the bucket's high byte, region `h` at `high[h]..high[h + 1]`
/// ([`Found::by_high_byte`] on each scanned part, then [`Found::merge`]).
///
/// In place, since for billions of rows a sorted copy would double the largest allocation of a
/// save: two American-flag passes (each misplaced id swapped straight into its region) on the
/// bucket's high then low byte, so each pass writes to only 256 region heads, which stay in cache
/// (one pass over 2^16 regions would miss the cache on nearly every swap). Then tiny per-bucket
/// sorts by id: deterministic whatever order the table produced its ids in. The high-byte pass
/// runs per scanned part and the rest per high-byte region, all on the rayon pool.
fn finish_sort(ids: &mut [u64], handles: &mut [u64], high: &[usize]) -> Vec<u64> {
    let handles: &mut [u64] = if handles.len() == ids.len() {
        handles
    } else {
        &mut []
    };
    // The 256 high-byte regions are disjoint from here on: each is finished on its own thread.
    let mut regions = Vec::with_capacity(256);
    let (mut rest_ids, mut rest_handles) = (ids, handles);
    for h in 0..256 {
        let len = high[h + 1] - high[h];
        let (region_ids, tail_ids) = rest_ids.split_at_mut(len);
        let (region_handles, tail_handles) = if rest_handles.is_empty() {
            (&mut [][..], rest_handles)
        } else {
            rest_handles.split_at_mut(len)
        };
        regions.push((high[h], region_ids, region_handles));
        (rest_ids, rest_handles) = (tail_ids, tail_handles);
    }
    let low_starts: Vec<Vec<usize>> = regions
        .into_par_iter()
        .map(|(_, ids, handles)| sort_region(ids, handles))
        .collect();
    let mut start = Vec::with_capacity(BUCKETS as usize + 1);
    for (h, low) in low_starts.iter().enumerate() {
        start.extend(low[..256].iter().map(|&l| (high[h] + l) as u64));
    }
    start.push(high[256] as u64);
    start
}

/// Sorts one high-byte region by the bucket's low byte, then each bucket by id; returns the 257
/// bucket starts within the region.
fn sort_region(ids: &mut [u64], handles: &mut [u64]) -> Vec<usize> {
    let low = flag_pass(ids, handles, |id| {
        (PartitionRule::bucket_of(id) & 0xff) as usize
    });
    let mut pairs = Vec::new();
    for b in 0..256 {
        let range = low[b]..low[b + 1];
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
    low
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

    /// The planner's whole sort: parts (some may come without handles) each ordered by high
    /// byte, merged, then finished.
    fn sort_in_parts(
        ids: &[u64],
        cuts: &[usize],
        handles_of: impl Fn(usize) -> bool,
    ) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(ids.len())).collect();
        bounds.push(0);
        bounds.push(ids.len());
        bounds.sort_unstable();
        let mut parts = Vec::new();
        let mut highs = Vec::new();
        for (p, w) in bounds.windows(2).enumerate() {
            let mut f = Found::with_capacity(w[1] - w[0]);
            f.ids.extend_from_slice(&ids[w[0]..w[1]]);
            if handles_of(p) {
                f.handles.extend(ids[w[0]..w[1]].iter().map(|&i| !i));
            } else {
                f.without_handles = true;
                f.handles.clear();
            }
            highs.push(f.by_high_byte());
            parts.push(f);
        }
        let (mut all, high) = Found::merge(parts, &highs);
        let start = finish_sort(&mut all.ids, &mut all.handles, &high);
        (all.ids, all.handles, start)
    }

    proptest! {
        #[test]
        fn sort_orders_by_bucket_then_id_and_carries_handles(
            ids in vec(prop_oneof![any::<u64>(), 0u64..64], 0..3000),
            cuts in vec(0usize..3000, 0..5),
            with_handles: bool,
            part_without: Option<usize>,
        ) {
            // A handle any id maps to, so that a handle left behind by a swap or a copy shows.
            let has = |p: usize| with_handles && Some(p) != part_without;
            let (sorted, handles, start) = sort_in_parts(&ids, &cuts, has);
            let with_handles = (0..=cuts.len()).all(has);
            prop_assert_eq!(handles.len(), if with_handles { ids.len() } else { 0 });

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

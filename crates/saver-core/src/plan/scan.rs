//! Phase one of planning: snapshot each table, apply row filters, group the kept rows by the
//! bucket's high byte and count every bucket (the rows are sorted later, see [`super::rows`]).

use std::ops::Range;
use std::sync::Arc;

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::filter::{BlockInfo, BlockKind, Filters};
use crate::partition::{PartitionRule, BUCKETS};
use rayon::prelude::*;

use crate::table::{validate_slots, RowChunk, RowView, SlotSpec, SparseTable, TableSnapshot};

use super::bucket_starts::BucketStarts;
use super::rows::{
    flag_pass, high_byte, KeptBuckets, MemoryPart, RunBufferPool, Spill, Spilled, Store, TableRows,
};
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
    /// The kept rows, in the order they are written: by (bucket, id bits).
    pub rows: TableRows,
    /// `at(b)..at(b + 1)` are the rows of bucket `b` in `rows`. Needed by the layout only, and
    /// freed once it is made, so that a model of many tables does not hold them through the
    /// whole write.
    pub bucket_start: BucketStarts,
    /// Rows in `rows`.
    pub row_count: u64,
    /// For each planned shard (in plan order): whether its ids block is kept, and which slots.
    pub kept: Vec<Option<Vec<usize>>>,
    /// Rows of shards this process does not plan, left out ([`ForeignRows::Skip`]).
    pub skipped: u64,
}

impl ScannedTable<'_> {
    /// Bytes a row takes when saved with the slots `slots`: its id and those slots.
    pub(super) fn saved_row_bytes(&self, slots: &[usize]) -> u64 {
        8 + slots
            .iter()
            .map(|&s| self.slot_bytes[s] as u64)
            .sum::<u64>()
    }

    /// Rows (positions in `rows`) in buckets `range`.
    pub(super) fn rows_in(&self, range: Range<u32>) -> Range<usize> {
        self.bucket_start.at(range.start) as usize..self.bucket_start.at(range.end) as usize
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
    /// The bucket of each row the last [`Self::add`] kept: hashed once, for the shard, the
    /// count and the region alike.
    buckets: Vec<u32>,
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
        keep: &impl Fn(u32) -> Option<bool>,
    ) -> Result<()> {
        if chunk.handles.len() != chunk.ids.len() && !self.without_handles {
            self.without_handles = true;
            self.handles = Vec::new();
        }
        self.buckets.clear();
        let mut row_vals: Vec<&[u8]> = vec![&[]; slot_bytes.len()];
        for (r, &id) in chunk.ids.iter().enumerate() {
            let bucket = PartitionRule::bucket_of(id);
            match keep(bucket) {
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
            self.buckets.push(bucket);
            if !self.without_handles {
                self.handles.push(chunk.handles[r]);
            }
        }
        Ok(())
    }

    /// Orders this part's rows by region, the bucket's high byte (done per part so that parts
    /// do it concurrently).
    fn into_memory_part(mut self) -> MemoryPart {
        let handles: &mut [u64] = if self.without_handles {
            &mut []
        } else {
            &mut self.handles
        };
        let high = flag_pass(&mut self.ids, handles, high_byte);
        MemoryPart {
            ids: self.ids,
            handles: self.handles,
            high,
        }
    }
}

/// Rows a [`Collected`] counts as a list of buckets before it takes an array of every bucket's
/// count: a delta's tables (a few rows each, scanned in 64 parts) would otherwise allocate,
/// clear and add up a `BUCKETS`-long array for every part.
const FEW_ROWS: usize = BUCKETS as usize / 8;

/// What scanning threads collected: counts per bucket and, unless spilled, the rows.
#[derive(Default)]
struct Collected {
    /// Rows per bucket (empty until more than [`FEW_ROWS`] rows are counted).
    counts: Vec<u64>,
    /// The bucket of each row counted, while `counts` is empty.
    few: Vec<u32>,
    parts: Vec<MemoryPart>,
    without_handles: bool,
    foreign_count: u64,
    foreign_first: Option<u64>,
}

impl Collected {
    /// Counts rows by their buckets.
    fn count(&mut self, buckets: &[u32]) {
        if self.counts.is_empty() && self.few.len() + buckets.len() <= FEW_ROWS {
            self.few.extend_from_slice(buckets);
            return;
        }
        self.make_dense();
        for &b in buckets {
            self.counts[b as usize] += 1;
        }
    }

    /// Moves the counted buckets into the array of counts.
    fn make_dense(&mut self) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS as usize];
        }
        for b in self.few.drain(..) {
            self.counts[b as usize] += 1;
        }
    }

    fn add_found(&mut self, f: &Found) {
        self.without_handles |= f.without_handles;
        self.foreign_count += f.foreign_count;
        self.foreign_first = self.foreign_first.or(f.foreign_first);
    }

    fn merge(mut self, mut other: Self) -> Self {
        if self.counts.is_empty() && !other.counts.is_empty() {
            std::mem::swap(&mut self.counts, &mut other.counts);
            std::mem::swap(&mut self.few, &mut other.few);
        }
        if self.counts.is_empty() {
            self.count(&other.few);
        } else {
            for (a, b) in self.counts.iter_mut().zip(&other.counts) {
                *a += b;
            }
            for &b in &other.few {
                self.counts[b as usize] += 1;
            }
        }
        self.parts.extend(other.parts);
        self.without_handles |= other.without_handles;
        self.foreign_count += other.foreign_count;
        self.foreign_first = self.foreign_first.or(other.foreign_first);
        self
    }

    /// Where each bucket's rows start (`BUCKETS + 1` offsets).
    fn bucket_starts(&self) -> Vec<u64> {
        if self.counts.is_empty() {
            let mut few = self.few.clone();
            few.sort_unstable();
            let mut bucket_start = Vec::with_capacity(BUCKETS as usize + 1);
            let mut at = 0;
            for b in 0..=BUCKETS {
                bucket_start.push(at as u64);
                while few.get(at) == Some(&b) {
                    at += 1;
                }
            }
            return bucket_start;
        }
        bucket_starts(&self.counts)
    }
}

/// Where each bucket's rows start (`BUCKETS + 1` offsets), from the rows per bucket (`counts`,
/// empty when no row was counted).
fn bucket_starts(counts: &[u64]) -> Vec<u64> {
    let mut bucket_start = Vec::with_capacity(BUCKETS as usize + 1);
    bucket_start.push(0);
    for b in 0..BUCKETS as usize {
        bucket_start.push(bucket_start[b] + counts.get(b).copied().unwrap_or(0));
    }
    bucket_start
}

/// Where a table's scan puts the rows it keeps.
pub(crate) struct RowsTo<'p> {
    /// The spill store, for a table past the plan memory; `None`: the rows stay in memory.
    pub spill: Option<Arc<dyn Spill>>,
    /// Rows of a spilled unit, at most (see [`super::rows::unit_rows`]).
    pub unit_rows: usize,
    /// Scan buffers, shared by every table's scan.
    pub buffers: &'p RunBufferPool,
}

/// Scans `table`: the rows planned shards keep, counted per bucket, held in memory or, when
/// `to.spill` is given, moved to it as they are scanned (and read back in units of at most
/// `to.unit_rows`).
pub(crate) fn scan_table<'a>(
    table: &'a dyn SparseTable,
    snapshot: Box<dyn TableSnapshot + 'a>,
    shard_num: u32,
    shards: &[u32],
    filters: &Filters,
    foreign: ForeignRows,
    to: RowsTo<'_>,
) -> Result<ScannedTable<'a>> {
    let RowsTo {
        spill,
        unit_rows,
        buffers,
    } = to;
    let name = table.name().to_string();
    let slots = table.slots().to_vec();
    let slot_bytes = validate_slots(&name, &slots)?;
    let key_dtype = table.key_dtype();
    let kept = kept_blocks(table, shards, filters);

    // shard -> position in `shards`, only needed when not every shard is planned.
    let all_planned = shards.len() as u64 == u64::from(shard_num);
    // Whether a row is saved here: `Some(true)` yes, `Some(false)` its blocks are all dropped,
    // `None` its shard is not planned by this process (a foreign row). Given the row's bucket.
    let keep = |bucket: u32| -> Option<bool> {
        let shard = PartitionRule::shard_of_bucket(bucket, shard_num);
        let pos = if all_planned {
            Some(shard as usize)
        } else {
            shards.iter().position(|&s| s == shard)
        };
        pos.map(|p| kept[p].is_some())
    };
    let any_kept = kept.iter().any(Option::is_some);
    let with_values = filters.has_row_filters() && any_kept;
    // A table past the plan memory whose snapshot lists rows by bucket keeps none of them: the
    // writer has them listed again, unit by unit. Not with row filters, which see slot values.
    let relisted = spill.is_some()
        && !with_values
        && snapshot.rows_in_buckets(0..0, &mut Vec::new(), &mut Vec::new())?;
    let spilled = spill.filter(|_| !relisted).map(|s| Spilled::new(&name, s));

    let mut collected = Collected::default();
    if any_kept {
        // Parts are scanned concurrently; each thread counts buckets into its own array.
        let parts = snapshot.scan_parts().max(1);
        let per_part = if spilled.is_some() || relisted {
            SCAN_ROWS
        } else {
            table.len() / parts + 1
        };
        collected = (0..parts)
            .into_par_iter()
            .try_fold(Collected::default, |mut acc, part| {
                let mut f = Found::with_capacity(per_part);
                let mut buffer = spilled.as_ref().map(|s| s.buffer(buffers));
                snapshot.scan_part(part, SCAN_ROWS, with_values, &mut |chunk| {
                    let row_filter = with_values.then_some((filters, key_dtype, &slots[..]));
                    f.add(&chunk, &name, &slot_bytes, row_filter, &keep)?;
                    acc.count(&f.buckets);
                    if let Some(b) = buffer.as_mut() {
                        b.take(&mut f.ids, &mut f.handles, &f.buckets)?;
                    } else if relisted {
                        f.ids.clear();
                        f.handles.clear();
                    }
                    Ok(())
                })?;
                acc.add_found(&f);
                match buffer {
                    Some(b) => b.finish()?,
                    None if relisted => {}
                    None => acc.parts.push(f.into_memory_part()),
                }
                Ok(acc)
            })
            .try_reduce(Collected::default, |a, b| Ok(a.merge(b)))?;
    }
    let bucket_start = collected.bucket_starts();
    let Collected {
        parts,
        without_handles,
        foreign_count,
        foreign_first,
        ..
    } = collected;
    if foreign_count > 0 && foreign == ForeignRows::Error {
        return Err(Error::ForeignRows {
            table: name,
            shard: shards[0],
            count: foreign_count,
            first_id: key_dtype.format_id(foreign_first.unwrap_or_default()),
        });
    }

    let store = match spilled {
        Some(s) => Store::Spilled(s),
        None if relisted => Store::Relisted(KeptBuckets::new(|b| keep(b) == Some(true))),
        None => Store::Memory(parts),
    };
    let rows = TableRows::new(
        &name,
        key_dtype,
        store,
        !without_handles,
        &bucket_start,
        unit_rows,
    );
    Ok(ScannedTable {
        name,
        key_dtype,
        slots,
        slot_bytes,
        snapshot,
        rows,
        row_count: bucket_start[bucket_start.len() - 1],
        bucket_start: BucketStarts::new(bucket_start),
        kept,
        skipped: foreign_count,
    })
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::super::rows::tests::{FailingSpill, MemorySpill};
    use super::super::rows::unit_rows;
    use super::*;

    /// Units at the default chunk size: 64 Ki rows.
    const DEFAULT_UNIT_ROWS: usize = 1 << 16;

    #[test]
    fn units_are_an_eighth_of_a_chunk_and_never_empty() {
        let default = crate::plan::PlanOptions::default().chunk_bytes;
        assert_eq!(unit_rows(default), DEFAULT_UNIT_ROWS);
        assert_eq!(unit_rows(4096), 32);
        assert_eq!(unit_rows(0), 1);
    }

    /// Where [`group`] puts the rows.
    #[derive(Clone, Debug)]
    enum To {
        Memory,
        Spill(Arc<dyn Spill>),
        /// Nowhere: they are listed again, those of the kept buckets taken.
        Relisted(fn(u32) -> bool),
    }

    impl std::fmt::Debug for dyn Spill {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Spill")
        }
    }

    /// A snapshot that lists its rows (`ids`, a handle `!id` each) by bucket and nothing else.
    struct Listing(Vec<u64>);

    impl TableSnapshot for Listing {
        fn scan(
            &self,
            _: usize,
            _: bool,
            _: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
        ) -> Result<()> {
            unreachable!("the rows are only listed by bucket")
        }
        fn read_rows(&self, _: &[u64], _: &mut [&mut [u8]]) -> Result<()> {
            unreachable!("no row is read")
        }
        fn rows_in_buckets(
            &self,
            buckets: Range<u32>,
            ids: &mut Vec<u64>,
            handles: &mut Vec<u64>,
        ) -> Result<bool> {
            for &i in &self.0 {
                if buckets.contains(&PartitionRule::bucket_of(i)) {
                    ids.push(i);
                    handles.push(!i);
                }
            }
            Ok(true)
        }
    }

    /// The scan's grouping of `ids`, cut into parts at `cuts` (part `p` with handles iff
    /// `handles_of(p)`; a handle is `!id`), into memory, a spill or nowhere (sorted in units of
    /// at most `unit_rows` out of memory); returns the rows and bucket starts, as `scan_table`
    /// does. Relisted, only the rows of kept buckets count.
    fn group(
        ids: &[u64],
        cuts: &[usize],
        handles_of: impl Fn(usize) -> bool,
        to: To,
        unit_rows: usize,
    ) -> Result<(TableRows, Vec<u64>)> {
        let (spill, relisted) = match &to {
            To::Memory => (None, None),
            To::Spill(s) => (Some(Arc::clone(s)), None),
            To::Relisted(keep) => (None, Some(*keep)),
        };
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(ids.len())).collect();
        bounds.push(0);
        bounds.push(ids.len());
        bounds.sort_unstable();
        let spilled = spill.map(|s| Spilled::new("t", s));
        let pool = RunBufferPool::default();
        let mut acc = Collected::default();
        for (p, w) in bounds.windows(2).enumerate() {
            let mut f = Found::with_capacity(w[1] - w[0]);
            f.ids.extend_from_slice(&ids[w[0]..w[1]]);
            if handles_of(p) {
                f.handles.extend(ids[w[0]..w[1]].iter().map(|&i| !i));
            } else {
                f.without_handles = true;
            }
            let mut buckets: Vec<u32> =
                f.ids.iter().map(|&i| PartitionRule::bucket_of(i)).collect();
            if let Some(keep) = relisted {
                buckets.retain(|&b| keep(b));
            }
            acc.count(&buckets);
            acc.add_found(&f);
            match &spilled {
                Some(s) => {
                    let mut b = s.buffer(&pool);
                    b.take(&mut f.ids, &mut f.handles, &buckets)?;
                    b.finish()?;
                }
                None if relisted.is_some() => {}
                None => acc.parts.push(f.into_memory_part()),
            }
        }
        let start = acc.bucket_starts();
        let store = match (spilled, relisted) {
            (Some(s), _) => Store::Spilled(s),
            (None, Some(keep)) => Store::Relisted(KeptBuckets::new(keep)),
            (None, None) => Store::Memory(acc.parts),
        };
        let rows = TableRows::new(
            "t",
            KeyDtype::U64,
            store,
            !acc.without_handles,
            &start,
            unit_rows,
        );
        Ok((rows, start))
    }

    /// Takes every row in pieces of `step`, as writer chunks do, from a table whose snapshot
    /// lists `listed`.
    fn take_all(
        rows: &TableRows,
        listed: &Listing,
        n: usize,
        step: usize,
    ) -> Result<(Vec<u64>, Vec<u64>)> {
        let (mut ids, mut handles) = (Vec::new(), Vec::new());
        let (mut i, mut h) = (Vec::new(), Vec::new());
        let mut at = 0;
        while at < n {
            let end = (at + step).min(n);
            rows.copy(listed, at..end, true, &mut i, &mut h)?;
            ids.extend_from_slice(&i);
            handles.extend_from_slice(&h);
            at = end;
        }
        Ok((ids, handles))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Counting buckets gives the same starts whether the counts stay a list of buckets or
        /// become an array, and however the parts' counts are merged.
        #[test]
        fn bucket_counts_are_the_same_as_lists_and_as_arrays(
            chunks in vec(
                (vec(0u32..BUCKETS, 0..64), 0usize..FEW_ROWS + 100),
                1..12,
            ),
            split in 0usize..12,
        ) {
            let chunks: Vec<Vec<u32>> = chunks
                .into_iter()
                .map(|(mut c, extra)| {
                    // Long chunks of one bucket push the counts past `FEW_ROWS` quickly.
                    let fill = c.first().copied().unwrap_or(7);
                    c.extend(std::iter::repeat_n(fill, extra));
                    c
                })
                .collect();
            let mut direct = vec![0u64; BUCKETS as usize];
            for &b in chunks.iter().flatten() {
                direct[b as usize] += 1;
            }
            let split = split.min(chunks.len());
            let (mut a, mut b) = (Collected::default(), Collected::default());
            for c in &chunks[..split] {
                a.count(c);
            }
            for c in &chunks[split..] {
                b.count(c);
            }
            let merged = a.merge(b);
            prop_assert_eq!(merged.bucket_starts(), bucket_starts(&direct));
        }
    }

    proptest! {
        #[test]
        fn rows_come_out_by_bucket_then_id_with_their_handles(
            ids in vec(prop_oneof![any::<u64>(), 0u64..64], 0..3000).prop_map(|mut v| {
                v.sort_unstable();
                v.dedup();
                v
            }).prop_shuffle(),
            cuts in vec(0usize..3000, 0..5),
            with_handles: bool,
            part_without: Option<usize>,
            to in 0u8..4,
            unit_rows in prop_oneof![Just(DEFAULT_UNIT_ROWS), 1usize..16],
            step in 1usize..700,
        ) {
            // A handle any id maps to, so that a handle left behind by a swap or a copy shows.
            let has = |p: usize| with_handles && Some(p) != part_without;
            let to = match to {
                0 => To::Memory,
                1 => To::Spill(Arc::new(MemorySpill::default())),
                2 => To::Relisted(|_| true),
                // A plan that keeps some buckets only: the listing has the others too.
                _ => To::Relisted(|b| b % 3 != 0),
            };
            let spill = !matches!(to, To::Memory);
            let listed = Listing(ids.clone());
            let ids: Vec<u64> = match &to {
                To::Relisted(keep) => {
                    ids.iter().copied().filter(|&i| keep(PartitionRule::bucket_of(i))).collect()
                }
                _ => ids,
            };
            let (rows, start) = match &to {
                // Relisted, the rows listed are those counted, whatever the parts scanned.
                To::Relisted(_) => group(&listed.0, &cuts, has, to.clone(), unit_rows).unwrap(),
                _ => group(&ids, &cuts, has, to.clone(), unit_rows).unwrap(),
            };
            prop_assert_eq!(rows.spilled(), matches!(to, To::Spill(_)));
            let (sorted, handles) = take_all(&rows, &listed, ids.len(), step).unwrap();
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
            // A spilled unit holds at most `unit_rows` rows, unless it is a single bucket.
            if spill {
                let mut at = 0;
                for len in rows.unit_rows() {
                    let unit = &sorted[at..at + len];
                    prop_assert!(
                        len <= unit_rows
                            || unit.iter().all(|&i| PartitionRule::bucket_of(i) == PartitionRule::bucket_of(unit[0])),
                        "a unit of {} rows over {} buckets", len, unit.len()
                    );
                    at += len;
                }
                prop_assert_eq!(at, ids.len());
            }
            // Every unit was freed once taken; reading again sorts it again from the store.
            let (mut again, mut again_handles) = (Vec::new(), Vec::new());
            rows.copy(&listed, 0..ids.len(), false, &mut again, &mut again_handles).unwrap();
            prop_assert_eq!(&again, &sorted);
            prop_assert_eq!(&again_handles, &handles);
        }

        #[test]
        fn a_repeated_id_is_named_when_its_region_is_sorted(
            ids in vec(any::<u64>(), 1..500),
            twin in any::<prop::sample::Index>(),
            to in 0u8..3,
            unit_rows in prop_oneof![Just(DEFAULT_UNIT_ROWS), 1usize..8],
        ) {
            let mut ids = ids;
            let id = ids[twin.index(ids.len())];
            ids.push(id);
            let to = match to {
                0 => To::Memory,
                1 => To::Spill(Arc::new(MemorySpill::default())),
                _ => To::Relisted(|_| true),
            };
            let (rows, _) = group(&ids, &[ids.len() / 2], |_| true, to, unit_rows).unwrap();
            let err = take_all(&rows, &Listing(ids.clone()), ids.len(), 64).unwrap_err();
            prop_assert!(
                matches!(&err, Error::DuplicateId { table, id: shown } if table == "t" && *shown == id.to_string()),
                "{}", err
            );
        }
    }

    #[test]
    fn a_failing_spill_is_an_error_naming_the_table() {
        let ids: Vec<u64> = (0..5000).collect();
        let err = match group(
            &ids,
            &[],
            |_| true,
            To::Spill(Arc::new(FailingSpill)),
            DEFAULT_UNIT_ROWS,
        ) {
            Err(e) => e,
            Ok((rows, _)) => take_all(&rows, &Listing(Vec::new()), ids.len(), 100).unwrap_err(),
        };
        let msg = err.to_string();
        assert!(matches!(err, Error::Spill { .. }), "{msg}");
        assert!(msg.contains("\"t\"") && msg.contains("disk full"), "{msg}");
    }
}

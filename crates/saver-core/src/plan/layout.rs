//! Phase two of planning: cut partitions into segments, place dense tensors on shards, pack the
//! segments and dense tensors of each shard into files balanced by bytes, and fix every header
//! and offset.

use std::ops::Range;

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::filter::{BlockInfo, BlockKind, Filters};
use crate::naming::{data_file_name, sparse_tensor_name, BUCKET_INDEX, IDS};
use crate::partition::PartitionRule;
use crate::row_range::RowRangeChunk;
use crate::tensor::DenseTensor;

use super::header::{
    planned_compressed_header_len, render_header, FileFacts, HeaderTensor, MAX_HEADER_BYTES,
};
use super::scan::ScannedTable;
use super::{
    DensePlan, FilePlan, Loc, PartitionPlan, PlanOptions, SegmentPlan, ShardPlan, SPLIT_FILE_BYTES,
};

/// Blocks are never cut smaller than this for balancing: tiny tensors only cost header space.
const MIN_BALANCE_BLOCK: u64 = 1 << 20;

/// The fewest files `bytes` of a shard's data go into: enough for `max_file_size`, and one per
/// [`SPLIT_FILE_BYTES`] up to `split_files`.
fn min_files(bytes: u64, opts: &PlanOptions) -> usize {
    let for_size = bytes.div_ceil(opts.max_file_size);
    let for_threads = (bytes / SPLIT_FILE_BYTES).min(opts.split_files as u64);
    for_size.max(for_threads).max(1) as usize
}

/// Assigns dense tensors to shards, largest first onto the least-loaded shard (ties: lowest shard,
/// then name order). Every process of a multi-process save computes the same assignment from the
/// same tensors.
pub(crate) fn assign_dense(dense: &[DenseTensor<'_>], shard_num: u32) -> Vec<u32> {
    // `pack` breaks size ties by position: order by name first so ties go by name.
    let mut by_name: Vec<usize> = (0..dense.len()).collect();
    by_name.sort_by(|&a, &b| dense[a].name().cmp(dense[b].name()));
    let sizes: Vec<u64> = by_name.iter().map(|&i| dense[i].byte_len()).collect();
    // Only as many bins as tensors are ever needed, so a huge shard count costs nothing.
    let bins = (shard_num as usize).min(dense.len().max(1));
    let mut out = vec![0u32; dense.len()];
    for (k, bin) in pack(&sizes, bins).into_iter().enumerate() {
        out[by_name[k]] = bin as u32;
    }
    out
}

/// Assigns the row-range chunks of a save that writes every shard to shards, as dense tensors
/// are: largest first onto the least-loaded shard, ties by table, slot and offset.
pub(crate) fn assign_chunks(chunks: &[&RowRangeChunk<'_>], shard_num: u32) -> Vec<u32> {
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |c: &RowRangeChunk<'_>| {
            (
                c.table().to_string(),
                c.slot().to_string(),
                c.offset().to_vec(),
            )
        };
        key(chunks[a]).cmp(&key(chunks[b]))
    });
    let sizes: Vec<u64> = order
        .iter()
        .map(|&i| chunks[i].values().byte_len())
        .collect();
    let bins = (shard_num as usize).min(chunks.len().max(1));
    let mut out = vec![0u32; chunks.len()];
    for (k, bin) in pack(&sizes, bins).into_iter().enumerate() {
        out[order[k]] = bin as u32;
    }
    out
}

/// Longest-processing-time packing of `sizes` into `bins` bins; returns each item's bin.
pub(crate) fn pack(sizes: &[u64], bins: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; bins];
    let mut out = vec![0usize; sizes.len()];
    for i in order {
        let (bin, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(j, &l)| (l, j))
            .expect("at least one bin");
        load[bin] += sizes[i];
        out[i] = bin;
    }
    out
}

/// Packs items of `sizes` into files: as few as `max_file_size` and `split_files` allow, more
/// while a file of several items overflows and could still be split. Each item's file, and the
/// file count.
fn pack_files(sizes: &[u64], opts: &PlanOptions) -> (Vec<usize>, usize) {
    let total: u64 = sizes.iter().sum();
    let mut nfiles = min_files(total, opts).min(sizes.len().max(1));
    loop {
        let a = pack(sizes, nfiles);
        if !overflows(sizes, &a, nfiles, opts) || nfiles >= sizes.len() {
            return (a, nfiles);
        }
        nfiles += 1;
    }
}

/// Each file's bytes and item count, for items of `sizes` placed in `files`.
fn file_loads(sizes: &[u64], files: &[usize], nfiles: usize) -> Vec<(u64, usize)> {
    let mut load = vec![(0u64, 0usize); nfiles];
    for (i, &f) in files.iter().enumerate() {
        load[f].0 += sizes[i];
        load[f].1 += 1;
    }
    load
}

/// Whether a file holding several of `sizes` goes past `max_file_size`.
fn overflows(sizes: &[u64], files: &[usize], nfiles: usize, opts: &PlanOptions) -> bool {
    any_overflow(&file_loads(sizes, files, nfiles), opts)
}

/// Whether a file of several items, by its `file_loads`, goes past `max_file_size`.
fn any_overflow(loads: &[(u64, usize)], opts: &PlanOptions) -> bool {
    loads
        .iter()
        .any(|&(bytes, count)| bytes > opts.max_file_size && count > 1)
}

/// Whether tensors of `sizes` placed in `files` stay within `max_file_size` (unless alone) and
/// within a quarter, or one tensor, of the mean file.
fn fits(sizes: &[u64], files: &[usize], nfiles: usize, opts: &PlanOptions) -> bool {
    let load = file_loads(sizes, files, nfiles);
    if any_overflow(&load, opts) {
        return false;
    }
    let used: Vec<u64> = load.into_iter().map(|l| l.0).filter(|&l| l > 0).collect();
    let mean = used.iter().sum::<u64>() as f64 / used.len().max(1) as f64;
    let max = used.iter().copied().max().unwrap_or(0) as f64;
    let largest = sizes.iter().copied().max().unwrap_or(0) as f64;
    max <= mean * 1.25 || max <= mean + largest
}

/// Splits a bucket range into consecutive segments of at most `max_rows` rows (a single bucket
/// larger than that forms a segment of its own). An empty range of rows yields no segment.
pub(crate) fn cut_segments(
    table: &ScannedTable<'_>,
    buckets: Range<u32>,
    max_rows: u64,
) -> Vec<Range<u32>> {
    let rows = table.rows_in(buckets.clone());
    if rows.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut seg_start = buckets.start;
    let mut acc = 0u64;
    for (b, n) in buckets
        .clone()
        .zip(table.bucket_start.counts(buckets.clone()))
    {
        if acc > 0 && acc + n > max_rows {
            out.push(seg_start..b);
            seg_start = b;
            acc = 0;
        }
        acc += n;
    }
    out.push(seg_start..buckets.end);
    out
}

/// The bucket index of a segment: `(bucket << 48) | first_row` for non-empty buckets. Where a
/// segment has more non-empty buckets than `rows / 16` (narrow tables with about one row per
/// bucket), only every k-th non-empty bucket gets an entry, so the index never costs more than
/// about half a byte per row; readers scan the ids of one group to find an exact boundary.
fn bucket_index(table: &ScannedTable<'_>, buckets: Range<u32>) -> Vec<u64> {
    let base = table.bucket_start.at(buckets.start);
    let rows = table.bucket_start.at(buckets.end) - base;
    let nonempty: Vec<u32> = buckets
        .clone()
        .zip(table.bucket_start.counts(buckets))
        .filter(|&(_, n)| n > 0)
        .map(|(b, _)| b)
        .collect();
    let max_entries = (rows / 16).max(1) as usize;
    let step = nonempty.len().div_ceil(max_entries).max(1);
    nonempty
        .iter()
        .step_by(step)
        .map(|&b| (u64::from(b) << 48) | (table.bucket_start.at(b) - base))
        .collect()
}

/// What a block is, so its location can be recorded once files are packed.
enum BlockRef {
    Ids {
        partition: usize,
        segment: usize,
    },
    Index {
        partition: usize,
        segment: usize,
    },
    Slot {
        partition: usize,
        segment: usize,
        slot: usize,
    },
    Dense {
        dense: usize,
    },
}

struct Block {
    tensor: HeaderTensor,
    len: u64,
    what: BlockRef,
}

/// The tensors a save writes whole: its dense tensors, then the values of its row-range chunks.
pub(crate) struct Dense<'p, 'a> {
    /// Every one of them.
    pub tensors: &'p [DenseTensor<'a>],
    /// The shard of each.
    pub shard_of: &'p [u32],
    /// Where each chunk (`tensors[given + k]`) goes in its table.
    pub chunks: &'p [super::ChunkPlace],
    /// How many of `tensors` are dense tensors.
    pub given: usize,
}

pub(crate) fn layout_shard(
    shard: u32,
    pos: usize,
    tables: &[ScannedTable<'_>],
    all_dense: Dense<'_, '_>,
    filters: &Filters,
    opts: &PlanOptions,
) -> Result<ShardPlan> {
    let range = PartitionRule::bucket_range(shard, opts.shard_num);
    // Partitions and the shard's byte estimate, to size segments for balance.
    let (mut partitions, mut estimate) = partitions_of(tables, pos, range);
    let dense_here = dense_of(shard, &all_dense, filters);
    let dense = all_dense.tensors;
    estimate += dense_here.iter().map(|&d| dense[d].byte_len()).sum::<u64>();
    let (files_estimate, target_block) = block_target(estimate, opts);

    // Files are packed from units: each segment's tensors (ids, bucket index, slots) together,
    // and each dense tensor. A writer thread writes one file front to back, and a row chunk
    // writes every tensor of its segment; were those tensors in different files, each file would
    // be written from several threads' chunks out of order, holding a partly filled direct-I/O
    // window wherever one had stopped (106 windows, 53 MiB, for a model of 200 small tables).
    let mut units: Vec<Vec<Block>> = Vec::new();
    for (p, part) in partitions.iter_mut().enumerate() {
        let table = &tables[part.table];
        units.extend(segment_units(
            shard,
            p,
            part,
            table,
            files_estimate,
            target_block,
        ));
    }
    let mut dense_plans = Vec::new();
    for &d in &dense_here {
        units.push(vec![dense_block(&dense[d], dense_plans.len())]);
        dense_plans.push(DensePlan {
            dense: d,
            loc: Loc::default(),
        });
    }
    let (blocks, assignment, nfiles) = assign_files(units, opts);
    let files = place_files(
        shard,
        &blocks,
        &assignment,
        nfiles,
        &mut partitions,
        &mut dense_plans,
        opts,
    )?;
    Ok(ShardPlan {
        shard,
        files,
        partitions,
        dense: dense_plans,
    })
}

/// The partitions of shard position `pos` (one per table that keeps slots there, over `range`),
/// and their bytes.
fn partitions_of(
    tables: &[ScannedTable<'_>],
    pos: usize,
    range: Range<u32>,
) -> (Vec<PartitionPlan>, u64) {
    let mut partitions = Vec::new();
    let mut estimate = 0u64;
    for (t, table) in tables.iter().enumerate() {
        let Some(slots) = table.kept[pos].clone() else {
            continue;
        };
        let rows = table.rows_in(range.clone());
        let row_bytes = table.saved_row_bytes(&slots);
        estimate += rows.len() as u64 * row_bytes;
        partitions.push(PartitionPlan {
            table: t,
            buckets: range.clone(),
            rows,
            slots,
            segments: Vec::new(),
        });
    }
    (partitions, estimate)
}

/// The dense tensors and chunks shard `shard` writes: those assigned to it that the block
/// filters keep (a chunk as a slot of its table).
fn dense_of(shard: u32, dense: &Dense<'_, '_>, filters: &Filters) -> Vec<usize> {
    (0..dense.tensors.len())
        .filter(|&d| dense.shard_of[d] == shard)
        .filter(|&d| {
            let block = match d.checked_sub(dense.given).map(|k| &dense.chunks[k]) {
                Some(c) => BlockInfo {
                    kind: BlockKind::Slot,
                    table: Some(&c.table),
                    slot: Some(&c.slot),
                    dense: None,
                    shard,
                },
                None => BlockInfo {
                    kind: BlockKind::Dense,
                    table: None,
                    slot: None,
                    dense: Some(dense.tensors[d].name()),
                    shard,
                },
            };
            filters.keep_block(&block)
        })
        .collect()
}

/// How many files a shard of `estimate` bytes needs at least, and the bytes that bound each
/// segment's tensor (one file) or each unit (several files, so that units balance the files).
fn block_target(estimate: u64, opts: &PlanOptions) -> (u64, u64) {
    let files_estimate = min_files(estimate, opts) as u64;
    let target_block = if files_estimate == 1 {
        opts.max_block_bytes
    } else {
        (estimate / files_estimate / 4)
            .max(MIN_BALANCE_BLOCK.min(opts.max_block_bytes))
            .min(opts.max_block_bytes)
    };
    (files_estimate, target_block)
}

/// The units of partition `p` (`part`, of `table`): one a segment, its ids, bucket index and slot
/// tensors; the partition's segments are added to `part`.
fn segment_units(
    shard: u32,
    p: usize,
    part: &mut PartitionPlan,
    table: &ScannedTable<'_>,
    files_estimate: u64,
    target_block: u64,
) -> Vec<Vec<Block>> {
    let mut units = Vec::new();
    let widest = part
        .slots
        .iter()
        .map(|&s| table.slot_bytes[s] as u64)
        .max()
        .unwrap_or(0)
        .max(8);
    // In a shard of one file, `target_block` bounds each tensor. Across files it bounds
    // each unit, so that units stay small enough to balance the files.
    let unit_row_bytes = if files_estimate == 1 {
        widest
    } else {
        table.saved_row_bytes(&part.slots)
    };
    let max_rows = (target_block / unit_row_bytes).clamp(1, u64::from(u32::MAX));
    for (si, seg_buckets) in cut_segments(table, part.buckets.clone(), max_rows)
        .into_iter()
        .enumerate()
    {
        let rows = table.rows_in(seg_buckets.clone());
        let nrows = rows.len() as u64;
        let index = bucket_index(table, seg_buckets.clone());
        let seg = si as u32;
        let mut blocks = Vec::with_capacity(2 + part.slots.len());
        blocks.push(Block {
            len: nrows * 8,
            tensor: HeaderTensor {
                name: sparse_tensor_name(&table.name, IDS, shard, seg),
                dtype: table.key_dtype.dtype(),
                shape: vec![nrows],
                start: 0,
                end: 0,
            },
            what: BlockRef::Ids {
                partition: p,
                segment: si,
            },
        });
        blocks.push(Block {
            len: index.len() as u64 * 8,
            tensor: HeaderTensor {
                name: sparse_tensor_name(&table.name, BUCKET_INDEX, shard, seg),
                dtype: Dtype::U64,
                shape: vec![index.len() as u64],
                start: 0,
                end: 0,
            },
            what: BlockRef::Index {
                partition: p,
                segment: si,
            },
        });
        for (k, &s) in part.slots.iter().enumerate() {
            let spec = &table.slots[s];
            let mut shape = vec![nrows];
            shape.extend_from_slice(&spec.shape);
            blocks.push(Block {
                len: nrows * table.slot_bytes[s] as u64,
                tensor: HeaderTensor {
                    name: sparse_tensor_name(&table.name, &spec.name, shard, seg),
                    dtype: spec.dtype,
                    shape,
                    start: 0,
                    end: 0,
                },
                what: BlockRef::Slot {
                    partition: p,
                    segment: si,
                    slot: k,
                },
            });
        }
        units.push(blocks);
        part.segments.push(SegmentPlan {
            index: seg,
            buckets: seg_buckets,
            rows,
            bucket_index: index,
            ids: Loc::default(),
            index_loc: Loc::default(),
            slots: vec![Loc::default(); part.slots.len()],
        });
    }
    units
}

/// The unit of dense tensor `t`, the `n`th dense tensor of the shard.
fn dense_block(t: &DenseTensor<'_>, n: usize) -> Block {
    Block {
        len: t.byte_len(),
        tensor: HeaderTensor {
            name: t.name().to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            start: 0,
            end: 0,
        },
        what: BlockRef::Dense { dense: n },
    }
}

/// Every block of `units`, and the file of each: whole units packed into files where that
/// balances them as well as packing single tensors is known to (a quarter over the mean, or one
/// tensor over it) and keeps every file of several tensors within `max_file_size`; else, with
/// units too coarse for the files (tiny files, or a shard just past one file once its bucket
/// indexes are counted), single tensors. Returns the blocks, their files and the file count.
fn assign_files(units: Vec<Vec<Block>>, opts: &PlanOptions) -> (Vec<Block>, Vec<usize>, usize) {
    let unit_lens: Vec<usize> = units.iter().map(Vec::len).collect();
    let by_unit = pack_files(
        &units
            .iter()
            .map(|u| u.iter().map(|b| b.len).sum())
            .collect::<Vec<u64>>(),
        opts,
    );
    let blocks: Vec<Block> = units.into_iter().flatten().collect();
    let sizes: Vec<u64> = blocks.iter().map(|b| b.len).collect();
    let mut unit_of_block = Vec::with_capacity(blocks.len());
    // Units hold consecutive blocks, so each block's file is its unit's.
    let (mut unit, mut left) = (0usize, 0usize);
    for _ in &blocks {
        while left == 0 {
            left = unit_lens[unit];
            unit += 1;
        }
        unit_of_block.push(by_unit.0[unit - 1]);
        left -= 1;
    }
    let (assignment, nfiles) = if fits(&sizes, &unit_of_block, by_unit.1, opts) {
        (unit_of_block, by_unit.1)
    } else {
        pack_files(&sizes, opts)
    };

    (blocks, assignment, nfiles)
}

/// The files of shard `shard`: each file's blocks in order, their offsets and header; every
/// block's place recorded in its partition's segment or its dense plan.
fn place_files(
    shard: u32,
    blocks: &[Block],
    assignment: &[usize],
    nfiles: usize,
    partitions: &mut [PartitionPlan],
    dense_plans: &mut [DensePlan],
    opts: &PlanOptions,
) -> Result<Vec<FilePlan>> {
    let mut per_file: Vec<Vec<usize>> = vec![Vec::new(); nfiles];
    for (i, &f) in assignment.iter().enumerate() {
        per_file[f].push(i);
    }
    per_file.retain(|v| !v.is_empty());

    let mut files = Vec::with_capacity(per_file.len());
    for (fi, members) in per_file.iter().enumerate() {
        let mut off = 0u64;
        let mut tensors = Vec::with_capacity(members.len());
        for (ti, &b) in members.iter().enumerate() {
            let block = &blocks[b];
            let mut t = block.tensor.clone();
            t.start = off;
            t.end = off + block.len;
            off = t.end;
            tensors.push(t);
            let loc = Loc {
                file: fi,
                tensor: ti,
            };
            match block.what {
                BlockRef::Ids { partition, segment } => {
                    partitions[partition].segments[segment].ids = loc
                }
                BlockRef::Index { partition, segment } => {
                    partitions[partition].segments[segment].index_loc = loc
                }
                BlockRef::Slot {
                    partition,
                    segment,
                    slot,
                } => partitions[partition].segments[segment].slots[slot] = loc,
                BlockRef::Dense { dense } => dense_plans[dense].loc = loc,
            }
        }
        let facts = FileFacts {
            save_id: &opts.save_id,
            shard,
            shard_num: opts.shard_num,
            file: fi as u32,
        };
        // A compressed file's header is written for what each tensor turned out to be stored
        // as: its length is planned for the longest that can be.
        let header_len = match opts.compression {
            None => render_header(&facts, &tensors, &vec![0; tensors.len()], opts.alignment).len()
                as u64,
            Some(_) => planned_compressed_header_len(&facts, &tensors, opts.alignment),
        };
        let name = data_file_name(&opts.save_id, shard, fi as u32);
        if header_len - 8 > MAX_HEADER_BYTES {
            return Err(Error::HeaderTooLarge {
                file: name,
                tensors: tensors.len(),
                bytes: header_len - 8,
                limit: MAX_HEADER_BYTES,
            });
        }
        files.push(FilePlan {
            name,
            index: fi as u32,
            data_start: header_len,
            data_len: off,
            tensors,
        });
    }

    Ok(files)
}

//! Owning loads into contiguous arrays: each selected table's ids and slot rows land in one buffer
//! per column, read straight from the files into their final place (one copy, from `parallel`
//! threads). For serving systems and tools that want arrays rather than a hashtable, and the
//! fastest way to take a checkpoint into memory.

use rayon::prelude::*;

use saver_core::manifest::TableManifest;
use saver_core::{KeyDtype, SlotSpec};

use crate::error::{Error, Result};
use crate::load::link::Link;
use crate::load::pages::{prefault, zeroed_bytes, zeroed_u64s};
use crate::load::restore::{reader_pool, LoadOptions, LoadReport, LoadedDense, PieceCrc};

/// One table as arrays. Rows are in checkpoint order (by source shard, bucket, id), not sorted.
#[derive(Clone, Debug, PartialEq)]
pub struct TableColumns {
    /// Name in the checkpoint (renamed if `rename` says so).
    pub name: String,
    /// Id dtype; `ids` hold the raw 64 bits.
    pub key_dtype: KeyDtype,
    /// The loaded slots.
    pub slots: Vec<SlotSpec>,
    /// One id per row.
    pub ids: Vec<u64>,
    /// Per slot, the rows back to back (little-endian, row-major).
    pub data: Vec<Vec<u8>>,
}

/// The result of [`crate::Checkpoint::load_columns`].
#[derive(Debug)]
pub struct Columns {
    /// Tables.
    pub tables: Vec<TableColumns>,
    /// Dense tensors.
    pub dense: Vec<LoadedDense>,
    /// Figures.
    pub report: LoadReport,
}

/// The smallest chunk a load into arrays reads from a remote store. Its rows land in the arrays
/// themselves, so a chunk costs no memory of its own, and larger chunks cut each column into
/// fewer, larger requests: where a store reads whole blocks (Garage: 1 MiB), every cut between
/// two requests costs a block read twice.
const REMOTE_CHUNK_BYTES: u64 = 64 << 20;

/// One chunk of work with its destination slices.
struct Job<'a, 'm> {
    read: &'a crate::load::restore::SegmentRead<'m>,
    rows: std::ops::Range<u64>,
    ids: &'a mut [u64],
    slots: Vec<&'a mut [u8]>,
}

impl Link {
    /// The arrays of the `wanted` tables (with the slots wanted of each) of this (full)
    /// checkpoint within `target`, read
    /// straight from the segments into their final place (for [`crate::Checkpoint::load_columns`],
    /// which checked the selection).
    pub(crate) fn load_table_columns(
        &self,
        wanted: Vec<(&TableManifest, Vec<SlotSpec>)>,
        target: &std::ops::Range<u32>,
        opts: &LoadOptions,
    ) -> Result<(Vec<TableColumns>, LoadReport)> {
        let mut report = LoadReport::default();
        let requests: Vec<_> = wanted
            .iter()
            .map(|(t, slots)| (*t, slots.as_slice(), target.clone()))
            .collect();
        let reads = self.segment_reads(&requests, &mut report)?;
        let plans: Vec<_> = wanted
            .into_iter()
            .zip(reads)
            .map(|((t, slots), reads)| (t, slots, reads))
            .collect();
        let mut tables: Vec<TableColumns> = plans
            .iter()
            .map(|(t, slots, reads)| {
                let rows: u64 = reads.iter().map(|r| r.rows.end - r.rows.start).sum();
                let data = slots
                    .iter()
                    .map(|s| {
                        let b = s.row_bytes().map_err(Error::from)?;
                        Ok(zeroed_bytes((rows * b) as usize, opts.huge_pages))
                    })
                    .collect::<Result<_>>()?;
                Ok(TableColumns {
                    name: t.name.clone(),
                    key_dtype: t.key_dtype,
                    slots: slots.clone(),
                    ids: zeroed_u64s(rows as usize, opts.huge_pages),
                    data,
                })
            })
            .collect::<Result<_>>()?;

        // Cut every destination into the disjoint pieces the chunks fill. From a remote store,
        // larger chunks make larger requests and fewer cuts, which it serves faster.
        let chunk_bytes = if self.is_remote() {
            opts.chunk_bytes.max(REMOTE_CHUNK_BYTES)
        } else {
            opts.chunk_bytes
        };
        let mut jobs: Vec<Job<'_, '_>> = Vec::new();
        for ((_, slots, reads), table) in plans.iter().zip(tables.iter_mut()) {
            let row_bytes: Vec<usize> = slots
                .iter()
                .map(|s| s.row_bytes().unwrap_or(0) as usize)
                .collect();
            let mut ids_rest: &mut [u64] = &mut table.ids;
            let mut data_rest: Vec<&mut [u8]> =
                table.data.iter_mut().map(Vec::as_mut_slice).collect();
            for read in reads {
                for rows in read.chunks(chunk_bytes) {
                    let n = (rows.end - rows.start) as usize;
                    let (ids, rest) = std::mem::take(&mut ids_rest).split_at_mut(n);
                    ids_rest = rest;
                    let mut slots_out = Vec::with_capacity(data_rest.len());
                    for (k, d) in data_rest.iter_mut().enumerate() {
                        let (head, rest) = std::mem::take(d).split_at_mut(n * row_bytes[k]);
                        *d = rest;
                        slots_out.push(head);
                    }
                    jobs.push(Job {
                        read,
                        rows,
                        ids,
                        slots: slots_out,
                    });
                }
            }
        }
        let remote = self.is_remote();
        if remote {
            jobs = large_and_small_alternating(jobs);
        }
        let gaps = Self::edge_gaps(plans.iter().flat_map(|(_, _, reads)| reads));
        let pool = reader_pool(crate::load::restore::reader_threads(self, opts.parallel))?;
        let read_tables = |jobs: &mut Vec<Job<'_, '_>>| -> Result<Vec<(u64, u64, Vec<PieceCrc>)>> {
            pool.install(|| {
                jobs.par_iter_mut()
                    .map(|job| {
                        let mut pieces = Vec::new();
                        prefault(bytemuck::cast_slice_mut(job.ids));
                        for s in job.slots.iter_mut() {
                            prefault(s);
                        }
                        let bytes = self.read_rows_into(
                            job.read,
                            job.rows.clone(),
                            bytemuck::cast_slice_mut(job.ids),
                            &mut job.slots,
                            &mut pieces,
                            &gaps,
                        )?;
                        // Ids were read as little-endian bytes; a no-op on little-endian machines.
                        job.ids.iter_mut().for_each(|x| *x = u64::from_le(*x));
                        Ok((job.ids.len() as u64, bytes, pieces))
                    })
                    .collect()
            })
        };
        let results = read_tables(&mut jobs);
        drop(jobs);
        let mut pieces = Vec::new();
        for (rows, bytes, p) in results? {
            report.rows += rows;
            report.bytes_kept += bytes;
            pieces.extend(p);
        }
        pool.install(|| self.check_pieces(pieces, &mut report))?;
        Ok((tables, report))
    }
}

/// `jobs` reordered largest, smallest, second largest, second smallest, …: on a remote store a
/// small job is mostly a round trip, and among large ones it waits while they keep the store busy
/// instead of all waiting together at the end.
fn large_and_small_alternating<'a, 'm>(mut jobs: Vec<Job<'a, 'm>>) -> Vec<Job<'a, 'm>> {
    let size = |j: &Job<'_, '_>| (j.rows.end - j.rows.start) * j.read.row_bytes();
    jobs.sort_by_key(|j| std::cmp::Reverse(size(j)));
    let mut sorted: std::collections::VecDeque<Job<'a, 'm>> = jobs.into();
    let mut out = Vec::with_capacity(sorted.len());
    while let Some(large) = sorted.pop_front() {
        out.push(large);
        if let Some(small) = sorted.pop_back() {
            out.push(small);
        }
    }
    out
}

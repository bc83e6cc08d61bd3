//! The loads of a [`Checkpoint`]'s hashed tables, as a [`LoadRequest`] asks for them: into new
//! tables ([`Checkpoint::restore`]), into the caller's sinks, into arrays
//! ([`Checkpoint::load_columns`]). One
//! implementation each, for a full checkpoint and a chain alike (a full checkpoint is a chain of
//! one link): the options are read here once (which tables and slots, which target shards, the
//! checks of a caller's table, renames, change tracking, dense tensors, read-ahead, the report).
//! Only moving the rows depends on the kind of checkpoint, through an [`Engine`]: a full
//! checkpoint's rows are read straight from its segments, where they lie in the order a load
//! wants; a chain's are resolved over its links first ([`ChainTable`]).

use std::ops::Range;
use std::time::Instant;

use rayon::prelude::*;

use saver_core::manifest::TableManifest;
use saver_core::partition::BUCKETS;
use saver_core::{EmbeddingTable, PartitionRule, Shard, SlotSpec, SparseTable};

use super::table::{Run, RunReader};
use super::{read_ahead, Ahead, ChainTable, Checkpoint, LoadRequest};
use crate::error::Result;
use crate::load::arrays::{Columns, TableColumns};
use crate::load::link::Link;
use crate::load::pages::{prefault, zeroed_bytes, zeroed_u64s};
use crate::load::restore::{
    expected_rows, finish_report, globs, reader_pool, reader_threads, select_tables, set_baselines,
    target_shards, tracked_if, LoadOptions, LoadReport, LoadedDense, Restored, RestoredShard,
    TableSink,
};
use crate::load::rows::BucketRows;

/// A table a load reads: its entry in the newest link's manifest, and the slots the load takes.
pub(crate) struct Selected<'c> {
    pub(crate) manifest: &'c TableManifest,
    pub(crate) slots: Vec<SlotSpec>,
}

/// Where a loaded row goes: target shard `shard`'s table for selected table `table`.
struct Sink<'s> {
    shard: u32,
    table: usize,
    sink: &'s dyn TableSink,
}

/// How the rows of the selected tables move: the only part of a load that depends on the kind
/// of checkpoint.
enum Engine<'c> {
    /// A full checkpoint: segments read straight into the target.
    Full(&'c Link),
    /// A chain of deltas down to a full checkpoint: one [`ChainTable`] per selected table.
    Chain(Vec<ChainTable<'c>>),
}

impl Checkpoint {
    /// The tables a load with `opts` reads, in manifest order: those `opts.tables` and
    /// `opts.table_filter` select, with the slots `opts.exclude_slots` leaves, after checking
    /// that every `opts.required_tables` is there.
    pub(crate) fn select(&self, opts: &LoadOptions) -> Result<Vec<Selected<'_>>> {
        let exclude = globs("exclude_slots", &opts.exclude_slots)?;
        Ok(select_tables(self.newest(), opts)?
            .into_iter()
            .map(|t| Selected {
                manifest: t,
                slots: Link::kept_slots(t, &exclude),
            })
            .collect())
    }

    /// The engine that moves `selected`'s rows.
    fn engine(&self, selected: &[Selected<'_>]) -> Result<Engine<'_>> {
        if !self.is_delta() {
            return Ok(Engine::Full(self.newest()));
        }
        Ok(Engine::Chain(self.chain_tables(selected)?))
    }

    /// `selected`, each resolved over the chain.
    pub(crate) fn chain_tables(&self, selected: &[Selected<'_>]) -> Result<Vec<ChainTable<'_>>> {
        selected
            .iter()
            .map(|s| ChainTable::new(self, &s.manifest.name, s.slots.clone()))
            .collect()
    }

    /// Restores into fresh [`EmbeddingTable`]s: every target shard of `opts.shard_num`, or only
    /// `opts.shard_index`, reading only the target's buckets (of every link, for a delta).
    /// Either everything loads, or an error is returned and nothing is kept.
    ///
    /// A checkpoint replaced while it is read (a save overwrote it, and removed its files after
    /// its commit) is read again as it is now, as every load of a `Checkpoint` is: see
    /// [`Self::on_latest`].
    ///
    /// The shorthand of [`Self::load`] with [`LoadRequest::tables`].
    pub fn restore(&self, opts: &LoadOptions) -> Result<Restored> {
        let l = self.load(LoadRequest::tables(opts))?;
        Ok(Restored {
            shards: l.shards,
            dense: l.dense,
            report: l.report,
        })
    }

    pub(super) fn restore_once(&self, opts: &LoadOptions) -> Result<Restored> {
        let (start, fetched) = (Instant::now(), self.bytes_fetched());
        let selected = self.select(opts)?;
        let targets = target_shards(opts)?;
        let engine = self.engine(&selected)?;
        let mut shards = Vec::with_capacity(targets.len());
        for &j in &targets {
            let mut tables = Vec::with_capacity(selected.len());
            for (i, s) in selected.iter().enumerate() {
                let shard = Shard {
                    index: j,
                    count: opts.shard_num,
                };
                let rows =
                    engine.rows_at_most(i, s, PartitionRule::bucket_range(j, opts.shard_num));
                let t = EmbeddingTable::for_shard(
                    out_name(opts, s.manifest),
                    s.manifest.key_dtype,
                    s.slots.clone(),
                    shard,
                    rows,
                )?;
                tables.push(tracked_if(t, opts)?);
            }
            shards.push(RestoredShard { shard: j, tables });
        }
        let sinks: Vec<Sink<'_>> = shards
            .iter()
            .flat_map(|s| {
                s.tables.iter().enumerate().map(move |(table, t)| Sink {
                    shard: s.shard,
                    table,
                    sink: t as &dyn TableSink,
                })
            })
            .collect();
        let ((), report, dense) = self.with_dense(opts, || {
            Ok(((), engine.fill(self, &selected, &sinks, opts)?))
        })?;
        set_baselines(&shards, opts, &self.newest().manifest().save_id)?;
        Ok(Restored {
            shards,
            dense,
            report: self.finished(report, start, fetched),
        })
    }

    /// Target shard `shard` of `opts.shard_num` into the sinks `sink_for` gives:
    /// [`LoadRequest::sinks`]. The report's duration and bytes read are the request's to fill in
    /// (its load also reads the dense tensors beside).
    pub(super) fn load_into_once<'s>(
        &self,
        shard: u32,
        opts: &LoadOptions,
        sink_for: &dyn Fn(&TableManifest) -> Option<&'s dyn TableSink>,
    ) -> Result<LoadReport> {
        PartitionRule::check_shard(shard, opts.shard_num)?;
        let mut selected = Vec::new();
        let mut sinks = Vec::new();
        for s in self.select(opts)? {
            let Some(sink) = sink_for(s.manifest) else {
                continue;
            };
            sinks.push(Sink {
                shard,
                table: selected.len(),
                sink,
            });
            selected.push(Selected {
                manifest: s.manifest,
                slots: sink.wanted_slots().to_vec(),
            });
        }
        let engine = self.engine(&selected)?;
        engine.fill(self, &selected, &sinks, opts)
    }

    /// Loads the selected tables (and dense tensors) into arrays: all rows, or with
    /// `opts.shard_index = Some(j)`, the rows of shard `j` of `opts.shard_num`, in (bucket, id
    /// bits) order within each saved partition. A delta's rows are resolved over its chain,
    /// reading only the target's buckets of every link.
    ///
    /// A checkpoint replaced while it is read is read again as it is now (see
    /// [`Self::on_latest`]).
    ///
    /// The shorthand of [`Self::load`] with [`LoadRequest::columns`].
    pub fn load_columns(&self, opts: &LoadOptions) -> Result<Columns> {
        let l = self.load(LoadRequest::columns(opts))?;
        Ok(Columns {
            tables: l.columns,
            dense: l.dense,
            report: l.report,
        })
    }

    pub(super) fn load_columns_once(&self, opts: &LoadOptions) -> Result<Columns> {
        let (start, fetched) = (Instant::now(), self.bytes_fetched());
        let selected = self.select(opts)?;
        target_shards(opts)?;
        let target = match opts.shard_index {
            Some(j) => PartitionRule::bucket_range(j, opts.shard_num),
            None => 0..BUCKETS,
        };
        let engine = self.engine(&selected)?;
        let (tables, report, dense) = self.with_dense(opts, || {
            let (mut tables, report) = match &engine {
                Engine::Full(link) => link.load_table_columns(
                    selected
                        .iter()
                        .map(|s| (s.manifest, s.slots.clone()))
                        .collect(),
                    &target,
                    opts,
                )?,
                Engine::Chain(chain) => chain_columns(self, chain, &target, opts)?,
            };
            for (t, s) in tables.iter_mut().zip(&selected) {
                t.name = out_name(opts, s.manifest);
            }
            Ok((tables, report))
        })?;
        Ok(Columns {
            tables,
            dense,
            report: self.finished(report, start, fetched),
        })
    }

    /// Runs `read` on this checkpoint; if it fails and the checkpoint was replaced meanwhile, runs
    /// it on the checkpoint there now, opened again from the same location, and so on (see
    /// [`read_latest`](crate::load::link::read_latest), up to 32 times). A save that replaces a
    /// checkpoint removes the old one's files after its commit, and an object store, unlike a
    /// local directory, keeps no removed object readable for whoever opened it: so a reader
    /// racing an overwrite returns the old or the new checkpoint's rows, never a missing-file
    /// error about a checkpoint that was never broken. A failure on a checkpoint that was not
    /// replaced stands, and so does any failure of a [`Self::pinned`] checkpoint.
    pub fn on_latest<T>(&self, read: impl Fn(&Checkpoint) -> Result<T>) -> Result<T> {
        let first = read(self);
        if first.is_ok() || !self.follows_replacement || !self.was_replaced() {
            return first;
        }
        let dir = &self.dirs()[0];
        crate::load::link::read_latest(dir, || read(&Checkpoint::open(dir)?))
    }

    /// Whether the location this checkpoint was opened from now holds another save (its index
    /// names another manifest): the checkpoint was replaced since it was opened. A reader that
    /// reads one request through this opening in several calls, and fails, asks this to tell
    /// a replaced checkpoint (open it again, and start the request over) from a broken one.
    pub fn was_replaced(&self) -> bool {
        self.newest().was_replaced()
    }

    /// Runs `load`, a load of tables, and reads the dense tensors `opts` selects: on a remote
    /// store beside it (both mostly wait on round trips, and the dense tensors' would otherwise
    /// add to the end of the load), after it otherwise. Returns `load`'s value, its report with
    /// the dense tensors' figures added, and the dense tensors.
    pub(super) fn with_dense<T>(
        &self,
        opts: &LoadOptions,
        load: impl FnOnce() -> Result<(T, LoadReport)>,
    ) -> Result<(T, LoadReport, Vec<LoadedDense>)> {
        if !opts.load_dense {
            let (t, report) = load()?;
            return Ok((t, report, Vec::new()));
        }
        let dense_of = || {
            let mut r = LoadReport::default();
            self.dense_tensors(Some(opts), &mut r).map(|d| (d, r))
        };
        let (loaded, dense) = if self.newest().is_remote() {
            std::thread::scope(|s| {
                let aside = s.spawn(dense_of);
                let loaded = load();
                let dense = aside
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p));
                (loaded, dense)
            })
        } else {
            let loaded = load();
            (loaded, dense_of())
        };
        let (t, mut report) = loaded?;
        let (dense, of_dense) = dense?;
        report.bytes_kept += of_dense.bytes_kept;
        report.tensors_checked += of_dense.tensors_checked;
        Ok((t, report, dense))
    }

    /// `report` with the load's duration, the bytes it read and its read amplification.
    pub(super) fn finished(
        &self,
        mut report: LoadReport,
        start: Instant,
        fetched: u64,
    ) -> LoadReport {
        report.load_seconds = start.elapsed().as_secs_f64();
        report.bytes_read = self.bytes_fetched() - fetched;
        finish_report(&mut report);
        report
    }
}

/// The name a loaded table goes by: its own, or what `opts.rename` gives it.
fn out_name(opts: &LoadOptions, t: &TableManifest) -> String {
    opts.rename
        .get(&t.name)
        .cloned()
        .unwrap_or_else(|| t.name.clone())
}

impl Engine<'_> {
    /// At most how many rows of selected table `i` a target of `buckets` receives: what a
    /// table sized for them before the load holds without growing.
    fn rows_at_most(&self, i: usize, s: &Selected<'_>, buckets: Range<u32>) -> usize {
        match self {
            Engine::Full(_) => expected_rows(s.manifest, buckets),
            Engine::Chain(tables) => tables[i].rows_at_most(buckets),
        }
    }

    /// Moves the rows of each sink's table and target shard into it, checking every byte read
    /// against its CRC32 before returning.
    fn fill(
        &self,
        ckpt: &Checkpoint,
        selected: &[Selected<'_>],
        sinks: &[Sink<'_>],
        opts: &LoadOptions,
    ) -> Result<LoadReport> {
        for s in sinks {
            let t = selected[s.table].manifest;
            ckpt.newest()
                .check_target(t, s.sink.wanted_key_dtype(), s.sink.wanted_slots())?;
        }
        match self {
            Engine::Full(link) => {
                let sinks: Vec<(u32, &TableManifest, &dyn TableSink)> = sinks
                    .iter()
                    .map(|s| (s.shard, selected[s.table].manifest, s.sink))
                    .collect();
                link.load_sinks(&sinks, opts)
            }
            Engine::Chain(tables) => fill_from_chain(ckpt, tables, sinks, opts),
        }
    }
}

/// [`Engine::fill`] for a chain: one task per (sink, part of its table within the sink's
/// target), each resolving its buckets over the links and inserting the rows in batches.
fn fill_from_chain(
    ckpt: &Checkpoint,
    tables: &[ChainTable<'_>],
    sinks: &[Sink<'_>],
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let mut work = Vec::new();
    let mut targets: Vec<Range<u32>> = Vec::new();
    for (k, s) in sinks.iter().enumerate() {
        let target = PartitionRule::bucket_range(s.shard, opts.shard_num);
        for part in &tables[s.table].parts {
            let r = part.start.max(target.start)..part.end.min(target.end);
            if !r.is_empty() {
                work.push((k, r));
            }
        }
        targets.push(target);
    }
    let pool = reader_pool(reader_threads(ckpt.newest(), opts.parallel))?;
    // What every sink's target reads whole, read ahead at once (on a remote store).
    let lowest = targets.iter().map(|t| t.start).min().unwrap_or(0);
    let highest = targets.iter().map(|t| t.end).max().unwrap_or(0);
    let _ahead: Ahead<'_> = read_ahead(&pool, tables, &(lowest..highest))?;
    let done: Vec<(u64, u64)> = pool.install(|| {
        work.par_iter()
            .map(|(k, r)| {
                let s = &sinks[*k];
                let t = &tables[s.table];
                let mut rows = 0u64;
                let batch = (opts.chunk_bytes / t.full_row_bytes()).max(1) as usize;
                t.visit_buckets(r.clone(), batch, &mut |ids, slots| {
                    rows += ids.len() as u64;
                    s.sink.insert_chunk(ids, slots)?;
                    Ok(())
                })?;
                Ok((rows, rows * t.full_row_bytes()))
            })
            .collect::<Result<_>>()
    })?;
    // Every byte loaded covered by a checksum that was checked, before anything is returned.
    super::finish_all_checks(&pool, tables)?;
    Ok(LoadReport {
        rows: done.iter().map(|d| d.0).sum(),
        bytes_kept: done.iter().map(|d| d.1).sum(),
        tensors_checked: tables.iter().map(ChainTable::tensors_checked).sum(),
        ..LoadReport::default()
    })
}

/// One part of a table as [`chain_columns`] reads it: its resolved ids and runs, and the region
/// of the final arrays they go to.
struct Region<'a> {
    ids: &'a mut [u64],
    slots: Vec<&'a mut [u8]>,
    part_ids: Vec<u64>,
    runs: Vec<Run>,
}

/// The arrays of a chain's tables within `target`: each part resolved first (a merge of the
/// links' ids: its live ids and the runs of link rows that hold their slots), so that each is
/// then read straight into its own region of the final arrays.
fn chain_columns(
    ckpt: &Checkpoint,
    tables: &[ChainTable<'_>],
    target: &Range<u32>,
    opts: &LoadOptions,
) -> Result<(Vec<TableColumns>, LoadReport)> {
    let pool = reader_pool(reader_threads(ckpt.newest(), opts.parallel))?;
    let _ahead = read_ahead(&pool, tables, target)?;
    let mut out = Vec::new();
    let mut report = LoadReport::default();
    for t in tables {
        let parts: Vec<Range<u32>> = t
            .parts
            .iter()
            .map(|p| p.start.max(target.start)..p.end.min(target.end))
            .filter(|r| !r.is_empty())
            .collect();
        let resolved: Vec<(Vec<u64>, Vec<Run>)> = pool.install(|| {
            parts
                .par_iter()
                .map(|r| t.resolve(r.clone()))
                .collect::<Result<_>>()
        })?;
        let total: usize = resolved.iter().map(|r| r.0.len()).sum();
        let widths: Vec<usize> = BucketRows::row_bytes(t)
            .iter()
            .map(|&w| w as usize)
            .collect();
        let mut ids = zeroed_u64s(total, opts.huge_pages);
        let mut data: Vec<Vec<u8>> = widths
            .iter()
            .map(|&w| zeroed_bytes(total * w, opts.huge_pages))
            .collect();
        let mut regions: Vec<Region<'_>> = Vec::new();
        {
            let mut ids_rest = &mut ids[..];
            let mut data_rest: Vec<&mut [u8]> = data.iter_mut().map(Vec::as_mut_slice).collect();
            for (part_ids, runs) in resolved {
                let n = part_ids.len();
                let (here, rest) = std::mem::take(&mut ids_rest).split_at_mut(n);
                ids_rest = rest;
                let slots = data_rest
                    .iter_mut()
                    .zip(&widths)
                    .map(|(d, &w)| {
                        let (here, rest) = std::mem::take(d).split_at_mut(n * w);
                        *d = rest;
                        here
                    })
                    .collect();
                regions.push(Region {
                    ids: here,
                    slots,
                    part_ids,
                    runs,
                });
            }
        }
        pool.install(|| {
            regions
                .into_par_iter()
                .map(|mut r| {
                    // The pages faulted in by one call each, as a full checkpoint's load does,
                    // rather than one trap a page in the copies below.
                    prefault(bytemuck::cast_slice_mut(r.ids));
                    for s in r.slots.iter_mut() {
                        prefault(s);
                    }
                    r.ids.copy_from_slice(&r.part_ids);
                    drop(r.part_ids);
                    RunReader::into_final_arrays().fill(t, &mut r.runs, &mut r.slots)
                })
                .collect::<Result<Vec<()>>>()
        })?;
        report.rows += ids.len() as u64;
        report.bytes_kept += ids.len() as u64 * t.full_row_bytes();
        out.push(TableColumns {
            name: t.name().to_string(),
            key_dtype: t.key_dtype(),
            slots: t.slots().to_vec(),
            ids,
            data,
        });
    }
    // Every byte loaded covered by a checksum that was checked, before it is returned.
    super::finish_all_checks(&pool, tables)?;
    report.tensors_checked = tables.iter().map(ChainTable::tensors_checked).sum();
    Ok((out, report))
}

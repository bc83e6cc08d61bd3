//! The one reader: [`Checkpoint`], a committed checkpoint opened with every link of its chain.
//!
//! A full checkpoint is a chain of one link, read straight from its segments ([`Link`]). A
//! delta checkpoint names its parent ([`ParentRef`]: a path relative to the delta, the parent's
//! save id and the CRC32 of its manifest) and holds, per table, the rows inserted or changed since
//! the parent and, in the companion table [`removed_table_name`](saver_core::naming::removed_table_name), the ids removed since it. The
//! parent may itself be a delta. [`Checkpoint::open`] follows the links to a full checkpoint, checking
//! each one; [`ChainTable`] presents one table of the chain as it would be in a full save of the
//! newest state.
//!
//! Every link stores its rows sorted by (bucket, id bits), so resolving is a k-way merge, bucket
//! range by bucket range: for each id, the newest link that holds it as a row or as a removal
//! decides. Nothing is held beyond a few read buffers per link, and a reader of some buckets (a
//! load for shard `j` of `M`) reads only those buckets of every link.

mod ahead;
mod table;

pub use crate::load::link::read_latest;
use ahead::Ahead;
pub use table::ChainTable;
use table::{Run, RunReader};

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use rayon::prelude::*;

use saver_core::manifest::{DenseManifest, ParentRef, TableManifest};
use saver_core::naming::removed_table_of;
use saver_core::partition::BUCKETS;
use saver_core::{EmbeddingTable, PartitionRule, Shard, SparseTable};

use crate::error::{io_err, Error, Result};
use crate::load::arrays::{Columns, TableColumns};
use crate::load::link::Link;
use crate::load::pages::{zeroed_bytes, zeroed_u64s};
use crate::load::restore::{
    finish_report, globs, read_dense_refs, set_baselines, target_shards, tracked_if, LoadOptions,
    LoadedDense, Restored, RestoredShard, TableSink,
};
use crate::load::rows::BucketRows;

/// Most links a chain may have, the full checkpoint at its root included. Each link is read by
/// every load, so a longer chain is a sign that it should be compacted (`saver compact`).
pub const MAX_CHAIN_LINKS: usize = 64;

/// `to` relative to `from`, both directories that exist (symbolic links resolved), or both
/// prefixes of one bucket.
pub(crate) fn relative_path(from: &Path, to: &Path) -> Result<String> {
    if let Some(rel) = crate::storage::relative_url(from, to)? {
        return Ok(rel);
    }
    let from = from
        .canonicalize()
        .map_err(io_err("resolve the directory", from))?;
    let to_c = to
        .canonicalize()
        .map_err(io_err("resolve the directory", to))?;
    let a: Vec<Component<'_>> = from.components().collect();
    let b: Vec<Component<'_>> = to_c.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut rel = PathBuf::new();
    for _ in common..a.len() {
        rel.push("..");
    }
    for c in &b[common..] {
        rel.push(c.as_os_str());
    }
    let rel = if rel.as_os_str().is_empty() {
        ".".to_string()
    } else {
        rel.to_str()
            .ok_or_else(|| Error::InvalidOption {
                option: "parent",
                why: format!("{} is not a UTF-8 path", to.display()),
            })?
            .to_string()
    };
    Ok(rel)
}

/// A checkpoint and, if it is a delta, every link down to the full checkpoint it starts from.
///
/// ```
/// use saver_core::{Dtype, EmbeddingTable, KeyDtype, SaveInput, Shard, SlotSpec};
/// use saver_io::{save, Checkpoint, LoadOptions, SaveOptions};
///
/// # let dir = tempfile::tempdir()?;
/// let table = EmbeddingTable::new("item", KeyDtype::I64, vec![SlotSpec::new("w", Dtype::F32, vec![4])])?;
/// for id in 0..1000 {
///     table.upsert(id, |row| row.slot_mut::<f32>(0).fill(id as f32));
/// }
/// save(dir.path(), SaveInput::new().table(&table), &SaveOptions::default())?;
///
/// // Saved as one shard, loaded as three: each worker reads only the bytes of its rows.
/// let ckpt = Checkpoint::open(dir.path())?;
/// let mut rows = 0;
/// for index in 0..3 {
///     let restored = ckpt.restore(&LoadOptions::for_shard(Shard { index, count: 3 }))?;
///     rows += restored.shards[0].tables[0].len();
/// }
/// assert_eq!(rows, 1000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    /// Newest first.
    links: Vec<Link>,
    dirs: Vec<PathBuf>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` and follows its parents. Each parent must exist, be
    /// committed, and be the save its child names (save id and manifest checksum); the chain
    /// must end in a full checkpoint within [`MAX_CHAIN_LINKS`] links and never come back to a
    /// link. Each failure is one error naming the link.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let first = Opened::open(crate::storage::open_location(&dir)?, &dir, Vec::new())?;
        Self::follow(first, dir)
    }

    /// Opens the checkpoint in `storage`, as [`Self::open`] does; a delta's parents are found
    /// by their paths relative to `storage`'s location.
    pub fn open_storage(storage: std::sync::Arc<dyn crate::storage::Storage>) -> Result<Self> {
        let dir = PathBuf::from(storage.location());
        Self::follow(Opened::open(storage, &dir, Vec::new())?, dir)
    }

    /// The chain that starts at `first`, opened from `dir`.
    fn follow(first: Opened, dir: PathBuf) -> Result<Self> {
        let Opened {
            link: first,
            mut parent,
        } = first;
        let key = |c: &Link| {
            (
                c.manifest().save_id.clone(),
                c.index().metadata.saver_manifest_crc32,
            )
        };
        let mut seen = HashSet::from([key(&first)]);
        let mut links = vec![first];
        let mut dirs = vec![dir];
        loop {
            let child = links.last().expect("one link");
            let child_dir = dirs.last().expect("one link").clone();
            let Some(p) = child.manifest().parent.clone() else {
                break;
            };
            let err = |message: String| Error::Chain {
                link: child_dir.display().to_string(),
                message,
            };
            if links.len() >= MAX_CHAIN_LINKS {
                return Err(err(format!(
                    "its chain has more than {MAX_CHAIN_LINKS} links; compact it into a full \
                     checkpoint (saver compact)"
                )));
            }
            saver_core::manifest::check_parent_path(&p.path)
                .map_err(|why| err(format!("parent {why}")))?;
            if seen.contains(&(p.save_id.clone(), p.manifest_crc32)) {
                return Err(err(format!(
                    "parent {p} is already a link of this chain: the chain is a cycle"
                )));
            }
            let parent_dir = child_dir.join(&p.path);
            // Opened beside its child's data files where the child's open did so.
            let opened = match parent.take() {
                Some(opened) => *opened,
                None => crate::storage::open_location(&parent_dir)
                    .and_then(|s| Opened::open(s, &parent_dir, Vec::new())),
            };
            let parent_link = opened.map(|o| {
                parent = o.parent;
                o.link
            });
            let parent = parent_link.map_err(|e| {
                // A resource or permission error (too many open files, EACCES) says nothing
                // about the chain: it stays what it is, never a broken link.
                if matches!(e, Error::Io { .. }) && !e.is_about_the_checkpoint() {
                    return e;
                }
                err(format!(
                    "parent {} cannot be opened: {e}",
                    parent_dir.display()
                ))
            })?;
            let (save_id, crc) = key(&parent);
            if save_id != p.save_id || crc != p.manifest_crc32 {
                return Err(err(format!(
                    "parent {} holds save {save_id} (manifest crc32 {crc:08x}), not save {} \
                     (crc32 {:08x}) that this delta was made from: it was replaced",
                    parent_dir.display(),
                    p.save_id,
                    p.manifest_crc32
                )));
            }
            if parent.manifest().partition != child.manifest().partition {
                return Err(err(format!(
                    "parent {} has another partition rule",
                    parent_dir.display()
                )));
            }
            seen.insert((save_id, crc));
            links.push(parent);
            dirs.push(parent_dir);
        }
        Ok(Self { links, dirs })
    }

    /// The newest link: the save that was opened.
    pub fn newest(&self) -> &Link {
        &self.links[0]
    }

    /// The manifest of the newest link.
    pub fn manifest(&self) -> &saver_core::Manifest {
        self.newest().manifest()
    }

    /// The global index of the newest link.
    pub fn index(&self) -> &saver_core::Index {
        self.newest().index()
    }

    /// Where the checkpoint (its newest link) is.
    pub fn location(&self) -> String {
        self.newest().location()
    }

    /// Shard `shard`'s trainer state, decoded as `T`.
    pub fn trainer_state<T: serde::de::DeserializeOwned>(&self, shard: u32) -> Result<Option<T>> {
        self.newest().trainer_state(shard)
    }

    /// Every link, newest first; the last is a full checkpoint.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// The directory of each link, as reached from the opened one.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Whether the newest link is a delta.
    pub fn is_delta(&self) -> bool {
        self.links.len() > 1
    }

    /// How a delta saved into `child_dir` (which exists) names this chain's newest link.
    pub fn parent_ref_for(&self, child_dir: &Path) -> Result<ParentRef> {
        let newest = self.newest();
        Ok(ParentRef {
            path: relative_path(child_dir, &self.dirs[0])?,
            save_id: newest.manifest().save_id.clone(),
            manifest_crc32: newest.index().metadata.saver_manifest_crc32,
        })
    }

    /// The dense tensors of the newest state, each with the link that holds it, by name: the
    /// newest link's, and those it keeps from its parent ([`Manifest::dense_in_parent`]), found
    /// in the nearest link that writes them.
    ///
    /// [`Manifest::dense_in_parent`]: saver_core::Manifest::dense_in_parent
    pub fn dense_refs(&self) -> Result<Vec<(&Link, &DenseManifest)>> {
        let newest = self.newest().manifest();
        let mut out: Vec<(&Link, &DenseManifest)> =
            newest.dense.iter().map(|d| (self.newest(), d)).collect();
        for name in &newest.dense_in_parent {
            let mut found = None;
            for (i, link) in self.links.iter().enumerate().skip(1) {
                let m = link.manifest();
                if let Some(d) = m.dense.iter().find(|d| &d.tensor.name == name) {
                    found = Some((link, d));
                    break;
                }
                // A link that neither writes nor keeps it ends the search: not in the chain.
                if !m.dense_in_parent.contains(name) {
                    return Err(Error::Chain {
                        link: self.dirs[i].display().to_string(),
                        message: format!(
                            "dense tensor {name:?} is kept from this parent, which does not hold it"
                        ),
                    });
                }
            }
            out.push(found.ok_or_else(|| Error::Chain {
                link: self.dirs[0].display().to_string(),
                message: format!("dense tensor {name:?} is in no link of the chain"),
            })?);
        }
        out.sort_by(|a, b| a.1.tensor.name.cmp(&b.1.tensor.name));
        Ok(out)
    }

    /// The dense tensors of the newest state that `opts.dense` selects (all when `None`), read
    /// whole from the links that hold them and checked against their CRC32.
    pub(crate) fn dense_tensors(
        &self,
        opts: Option<&LoadOptions>,
        report: &mut crate::LoadReport,
    ) -> Result<Vec<LoadedDense>> {
        let set = match opts {
            Some(o) => globs("dense", &o.dense)?,
            None => None,
        };
        read_dense_refs(self.dense_refs()?, &set, report)
    }

    /// Reads dense tensor `name` of the newest state whole (from the link that holds it),
    /// checking its CRC32.
    pub fn read_dense(&self, name: &str) -> Result<Vec<u8>> {
        let refs = self.dense_refs()?;
        let (link, _) = refs
            .iter()
            .find(|(_, d)| d.tensor.name == name)
            .ok_or_else(|| {
                Error::Mismatch(format!("no dense tensor {name:?} in {}", self.location()))
            })?;
        link.read_dense(name)
    }

    /// The tables of the newest state (the companion tables of removed ids are not tables),
    /// in manifest order.
    pub fn table_manifests(&self) -> impl Iterator<Item = &TableManifest> {
        self.newest()
            .manifest()
            .tables
            .iter()
            .filter(|t| removed_table_of(&t.name).is_none())
    }

    /// Every selected table (globs `tables`, all if empty) without the slots matching
    /// `exclude_slots`, resolved over the chain, in manifest order.
    pub fn tables(
        &self,
        tables: &[String],
        exclude_slots: &[String],
    ) -> Result<Vec<ChainTable<'_>>> {
        let set = globs("tables", tables)?;
        let exclude = globs("exclude_slots", exclude_slots)?;
        self.table_manifests()
            .filter(|t| set.as_ref().is_none_or(|s| s.is_match(&t.name)))
            .map(|t| ChainTable::new(self, &t.name, Link::kept_slots(t, &exclude)))
            .collect()
    }

    /// The dense tensors a load with `opts` wants, and its report, finished.
    fn finish_load(
        &self,
        opts: &LoadOptions,
        mut report: crate::LoadReport,
        start: std::time::Instant,
        fetched: u64,
    ) -> Result<(Vec<LoadedDense>, crate::LoadReport)> {
        let dense = if opts.load_dense {
            self.dense_tensors(Some(opts), &mut report)?
        } else {
            Vec::new()
        };
        report.load_seconds = start.elapsed().as_secs_f64();
        report.bytes_read = self.bytes_fetched() - fetched;
        finish_report(&mut report);
        Ok((dense, report))
    }

    /// Bytes the links' files have delivered to reads so far: see [`Link::bytes_fetched`].
    pub fn bytes_fetched(&self) -> u64 {
        self.links().iter().map(Link::bytes_fetched).sum()
    }

    /// The tables a load with `opts` reads.
    fn selected(&self, opts: &LoadOptions) -> Result<Vec<ChainTable<'_>>> {
        for r in &opts.required_tables {
            if self.table_manifests().all(|t| &t.name != r) {
                return Err(Error::Mismatch(format!(
                    "required table {r:?} is not in the checkpoint {}",
                    self.newest().location()
                )));
            }
        }
        Ok(self
            .tables(&opts.tables, &opts.exclude_slots)?
            .into_iter()
            .filter(|t| opts.table_filter.as_ref().is_none_or(|f| f(t.name())))
            .collect())
    }

    /// Loads the selected tables (and dense tensors) into arrays: all rows, or with
    /// `opts.shard_index = Some(j)`, the rows of shard `j` of `opts.shard_num`, in (bucket, id
    /// bits) order. A delta's rows are resolved over its chain, reading only the target's
    /// buckets of every link.
    pub fn load_columns(&self, opts: &LoadOptions) -> Result<Columns> {
        if !self.is_delta() {
            // One full checkpoint: its segments are read straight into the arrays.
            return self.newest().load_columns(opts);
        }
        let start = std::time::Instant::now();
        let fetched = self.bytes_fetched();
        target_shards(opts)?;
        let target = match opts.shard_index {
            Some(j) => PartitionRule::bucket_range(j, opts.shard_num),
            None => 0..BUCKETS,
        };
        let tables = self.selected(opts)?;
        let pool = crate::load::restore::reader_pool(crate::load::restore::reader_threads(
            self.newest(),
            opts.parallel,
        ))?;
        let _ahead = read_ahead(&pool, &tables, &target)?;
        let mut out = Vec::new();
        let mut report = crate::LoadReport::default();
        for t in &tables {
            let parts: Vec<Range<u32>> = t
                .parts
                .iter()
                .map(|p| p.start.max(target.start)..p.end.min(target.end))
                .filter(|r| !r.is_empty())
                .collect();
            // Each part resolved first (a merge of the links' ids: its live ids and the runs of
            // link rows that hold their slots), so that each is then read straight into its own
            // region of the final arrays.
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
                let mut data_rest: Vec<&mut [u8]> =
                    data.iter_mut().map(Vec::as_mut_slice).collect();
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
                        // The pages faulted in by one call each, as a compacted checkpoint's
                        // load does, rather than one trap a page in the copies below.
                        crate::load::pages::prefault(bytemuck::cast_slice_mut(r.ids));
                        for s in r.slots.iter_mut() {
                            crate::load::pages::prefault(s);
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
                name: opts
                    .rename
                    .get(t.name())
                    .cloned()
                    .unwrap_or_else(|| t.name().to_string()),
                key_dtype: t.key_dtype(),
                slots: t.slots().to_vec(),
                ids,
                data,
            });
        }
        // Every byte loaded covered by a checksum that was checked, before it is returned.
        finish_all_checks(&pool, &tables)?;
        report.tensors_checked = tables.iter().map(ChainTable::tensors_checked).sum();
        let (dense, report) = pool.install(|| self.finish_load(opts, report, start, fetched))?;
        Ok(Columns {
            tables: out,
            dense,
            report,
        })
    }

    /// Restores into fresh [`EmbeddingTable`]s: every target shard of `opts.shard_num`, or only
    /// `opts.shard_index`, reading only the target's buckets (of every link, for a delta).
    /// Either everything loads, or an error is returned and nothing is kept.
    pub fn restore(&self, opts: &LoadOptions) -> Result<Restored> {
        if !self.is_delta() {
            return self.newest().restore(opts);
        }
        let start = std::time::Instant::now();
        let fetched = self.bytes_fetched();
        let tables = self.selected(opts)?;
        let targets = target_shards(opts)?;
        let mut shards = Vec::new();
        for &j in &targets {
            let mut ts = Vec::new();
            for t in &tables {
                let name = opts
                    .rename
                    .get(t.name())
                    .cloned()
                    .unwrap_or_else(|| t.name().to_string());
                ts.push(tracked_if(
                    EmbeddingTable::for_shard(
                        name,
                        t.key_dtype(),
                        t.slots().to_vec(),
                        Shard {
                            index: j,
                            count: opts.shard_num,
                        },
                        t.rows_at_most(PartitionRule::bucket_range(j, opts.shard_num)),
                    )?,
                    opts,
                )?);
            }
            shards.push(RestoredShard {
                shard: j,
                tables: ts,
            });
        }
        // One task per (target shard, table, part of the table that overlaps the target).
        let mut work = Vec::new();
        for (si, s) in shards.iter().enumerate() {
            let target = PartitionRule::bucket_range(s.shard, opts.shard_num);
            for (ti, t) in tables.iter().enumerate() {
                for part in &t.parts {
                    let r = part.start.max(target.start)..part.end.min(target.end);
                    if !r.is_empty() {
                        work.push((si, ti, r));
                    }
                }
            }
        }
        let pool = crate::load::restore::reader_pool(crate::load::restore::reader_threads(
            self.newest(),
            opts.parallel,
        ))?;
        let _ahead = match opts.shard_index {
            Some(j) => read_ahead(
                &pool,
                &tables,
                &PartitionRule::bucket_range(j, opts.shard_num),
            )?,
            None => read_ahead(&pool, &tables, &(0..BUCKETS))?,
        };
        let done: Result<Vec<(u64, u64)>> = pool.install(|| {
            work.par_iter()
                .map(|(si, ti, r)| {
                    let t = &tables[*ti];
                    let sink = &shards[*si].tables[*ti];
                    let mut rows = 0u64;
                    let batch = (opts.chunk_bytes / t.full_row_bytes()).max(1) as usize;
                    t.visit_buckets(r.clone(), batch, &mut |ids, slots| {
                        rows += ids.len() as u64;
                        sink.insert_chunk(ids, slots)?;
                        Ok(())
                    })?;
                    Ok((rows, rows * t.full_row_bytes()))
                })
                .collect()
        });
        let done = done?;
        // Every byte loaded covered by a checksum that was checked, before anything is returned.
        finish_all_checks(&pool, &tables)?;
        set_baselines(&shards, opts, &self.newest().manifest().save_id)?;
        let report = crate::LoadReport {
            rows: done.iter().map(|d| d.0).sum(),
            bytes_kept: done.iter().map(|d| d.1).sum(),
            tensors_checked: tables.iter().map(ChainTable::tensors_checked).sum(),
            ..Default::default()
        };
        let (dense, report) = pool.install(|| self.finish_load(opts, report, start, fetched))?;
        Ok(Restored {
            shards,
            dense,
            report,
        })
    }
}

impl Checkpoint {
    /// Loads target shard `shard` of `opts.shard_num` into user sinks: `sink_for` returns the
    /// sink for a checkpoint table (by its manifest entry), or `None` to skip it. Dense tensors
    /// are not loaded (see [`Self::load_dense_tensors`]). A sink may hold part of the rows if
    /// this fails: load into a fresh table and swap it in on success, as [`Self::restore`] does.
    pub fn load_into<'s>(
        &self,
        shard: u32,
        opts: &LoadOptions,
        sink_for: &dyn Fn(&TableManifest) -> Option<&'s dyn TableSink>,
    ) -> Result<crate::LoadReport> {
        if !self.is_delta() {
            return self.newest().load_into(shard, opts, sink_for);
        }
        if shard >= opts.shard_num {
            return Err(saver_core::Error::ShardOutOfRange {
                index: shard,
                num: opts.shard_num,
            }
            .into());
        }
        let start = std::time::Instant::now();
        let fetched = self.bytes_fetched();
        let tables = self.selected(opts)?;
        let target = PartitionRule::bucket_range(shard, opts.shard_num);
        let mut work = Vec::new();
        for t in &tables {
            let Some(m) = self.table_manifests().find(|m| m.name == t.name()) else {
                continue;
            };
            let Some(sink) = sink_for(m) else {
                continue;
            };
            for part in &t.parts {
                let r = part.start.max(target.start)..part.end.min(target.end);
                if !r.is_empty() {
                    work.push((t, sink, r));
                }
            }
        }
        let pool = crate::load::restore::reader_pool(crate::load::restore::reader_threads(
            self.newest(),
            opts.parallel,
        ))?;
        let _ahead = read_ahead(&pool, &tables, &target)?;
        let done: Vec<u64> = pool.install(|| {
            work.par_iter()
                .map(|(t, sink, r)| {
                    let mut rows = 0u64;
                    let batch = (opts.chunk_bytes / t.full_row_bytes()).max(1) as usize;
                    t.visit_buckets(r.clone(), batch, &mut |ids, slots| {
                        rows += ids.len() as u64;
                        sink.insert_chunk(ids, slots)?;
                        Ok(())
                    })?;
                    Ok(rows)
                })
                .collect::<Result<_>>()
        })?;
        finish_all_checks(&pool, &tables)?;
        let mut report = crate::LoadReport {
            rows: done.iter().sum(),
            tensors_checked: tables.iter().map(ChainTable::tensors_checked).sum(),
            ..Default::default()
        };
        report.bytes_kept = work
            .iter()
            .zip(&done)
            .map(|((t, _, _), rows)| rows * t.full_row_bytes())
            .sum();
        report.load_seconds = start.elapsed().as_secs_f64();
        report.bytes_read = self.bytes_fetched() - fetched;
        finish_report(&mut report);
        Ok(report)
    }

    /// The dense tensors `opts.dense` selects (all when empty), CRC-checked: the newest state's,
    /// each read from the link that holds it.
    pub fn load_dense_tensors(&self, opts: &LoadOptions) -> Result<Vec<LoadedDense>> {
        self.dense_tensors(Some(opts), &mut crate::LoadReport::default())
    }
}

/// A link opened, with its parent if it was opened beside it (see [`Link::open_storage_beside`]).
struct Opened {
    link: Link,
    parent: Option<Box<Result<Opened>>>,
}

impl Opened {
    /// Opens the link in `storage` (at `dir`), and on a remote store its parent beside its data
    /// files, and so on down the chain: a chain of `n` links then waits on `n` manifests' round
    /// trips and one link's data files, not on `n` of each. `seen`: the saves of the links above,
    /// where a cycle stops the opening ahead (`Checkpoint::follow` reports it).
    fn open(
        storage: std::sync::Arc<dyn crate::storage::Storage>,
        dir: &Path,
        seen: Vec<(String, u32)>,
    ) -> Result<Self> {
        let remote = storage.is_remote();
        let (link, parent) = Link::open_storage_beside(storage, |m| {
            let p = m.parent.as_ref().filter(|_| remote)?;
            let key = (p.save_id.clone(), p.manifest_crc32);
            if seen.len() + 1 >= MAX_CHAIN_LINKS
                || seen.contains(&key)
                || saver_core::manifest::check_parent_path(&p.path).is_err()
            {
                return None;
            }
            let mut seen = seen.clone();
            seen.push(key);
            let parent_dir = dir.join(&p.path);
            Some(Box::new(
                crate::storage::open_location(&parent_dir)
                    .and_then(|s| Opened::open(s, &parent_dir, seen)),
            ))
        })?;
        Ok(Self { link, parent })
    }
}

/// Reads ahead what a load of `buckets` of `tables` reads whole from a remote store (see
/// [`crate::load::ahead`]), on the load's `pool`.
fn read_ahead<'c>(
    pool: &rayon::ThreadPool,
    tables: &[ChainTable<'c>],
    buckets: &Range<u32>,
) -> Result<Ahead<'c>> {
    let wanted = tables
        .iter()
        .flat_map(|t| t.tensors_within(buckets))
        .collect();
    pool.install(|| Ahead::plan(wanted))
}

/// Checks what every table of a load read only in part, all tables at once on the load's `pool`:
/// on a remote store each check waits on a round trip, and a thread a check would wait on them
/// one or two at a time.
fn finish_all_checks(pool: &rayon::ThreadPool, tables: &[ChainTable<'_>]) -> Result<()> {
    pool.install(|| tables.par_iter().try_for_each(ChainTable::finish_checks))
}

/// One part of a table as [`Checkpoint::load_columns`] reads it: its resolved ids and runs, and the
/// region of the final arrays they go to.
struct Region<'a> {
    ids: &'a mut [u64],
    slots: Vec<&'a mut [u8]>,
    part_ids: Vec<u64>,
    runs: Vec<Run>,
}

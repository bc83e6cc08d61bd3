//! Chains of delta checkpoints, resolved while they are read.
//!
//! A delta checkpoint names its parent ([`ParentRef`]: a path relative to the delta, the parent's
//! save id and the CRC32 of its manifest) and holds, per table, the rows inserted or changed since
//! the parent and, in the companion table [`removed_table_name`], the ids removed since it. The
//! parent may itself be a delta. [`Chain::open`] follows the links to a full checkpoint, checking
//! each one; [`ChainTable`] presents one table of the chain as it would be in a full save of the
//! newest state.
//!
//! Every link stores its rows sorted by (bucket, id bits), so resolving is a k-way merge, bucket
//! range by bucket range: for each id, the newest link that holds it as a row or as a removal
//! decides. Nothing is held beyond a few read buffers per link, and a reader of some buckets (a
//! load for shard `j` of `M`) reads only those buckets of every link.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use saver_core::manifest::{DenseManifest, ParentRef, TableManifest};
use saver_core::naming::{removed_table_name, removed_table_of};
use saver_core::partition::BUCKETS;
use saver_core::table::{RowChunk, TableSnapshot};
use saver_core::{EmbeddingTable, KeyDtype, PartitionRule, SlotSpec, SparseTable};

use crate::columns::{Columns, TableColumns};
use crate::error::{io_err, Error, Result};
use crate::reader::Checkpoint;
use crate::restore::{
    finish_report, globs, read_dense_refs, set_baselines, target_shards, tracked_if, LoadOptions,
    LoadedDense, Restored, RestoredShard,
};
use crate::source::stored::ROW_BITS;
use crate::source::{core_error as core, BucketRows, StoredTable, VisitRows};

/// Most links a chain may have, the full checkpoint at its root included. Each link is read by
/// every load, so a longer chain is a sign that it should be compacted (`saver compact`).
pub const MAX_CHAIN_LINKS: usize = 64;

/// Bits of a chain row handle below the link number: a [`StoredTable`] handle.
const LINK_SHIFT: u32 = 58;

/// Rows of one link's segment whose gap is at most this many bytes of a slot are read in one
/// piece, with the rows between: a gap smaller than a page saves the device nothing.
const COALESCE_BYTES: u64 = 4096;

/// Ids read at a time by each link's cursor.
const CURSOR_IDS: u64 = 8192;

/// Checks a parent path as a manifest gives it: relative, non-empty, no control characters.
pub fn check_parent_path(path: &str) -> std::result::Result<(), String> {
    if path.is_empty() {
        return Err("path is empty".into());
    }
    if path.chars().any(char::is_control) {
        return Err(format!("path {path:?} contains a control character"));
    }
    if Path::new(path).is_absolute() || path.starts_with('\\') {
        return Err(format!(
            "path {path:?} is absolute: a parent is named relative to its child"
        ));
    }
    Ok(())
}

/// `to` relative to `from`, both directories that exist (symbolic links resolved).
pub(crate) fn relative_path(from: &Path, to: &Path) -> Result<String> {
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
#[derive(Debug)]
pub struct Chain {
    /// Newest first.
    links: Vec<Checkpoint>,
    dirs: Vec<PathBuf>,
}

impl Chain {
    /// Opens the checkpoint in `dir` and follows its parents. Each parent must exist, be
    /// committed, and be the save its child names (save id and manifest checksum); the chain
    /// must end in a full checkpoint within [`MAX_CHAIN_LINKS`] links and never come back to a
    /// link. Each failure is one error naming the link.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let first = Checkpoint::open(&dir)?;
        let key = |c: &Checkpoint| {
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
            check_parent_path(&p.path).map_err(|why| err(format!("parent {why}")))?;
            if seen.contains(&(p.save_id.clone(), p.manifest_crc32)) {
                return Err(err(format!(
                    "parent {p} is already a link of this chain: the chain is a cycle"
                )));
            }
            let parent_dir = child_dir.join(&p.path);
            let parent = Checkpoint::open(&parent_dir).map_err(|e| {
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

    /// A chain of one full checkpoint.
    pub fn of_checkpoint(ckpt: Checkpoint, dir: PathBuf) -> Self {
        Self {
            links: vec![ckpt],
            dirs: vec![dir],
        }
    }

    /// The newest link: the checkpoint that was opened.
    pub fn newest(&self) -> &Checkpoint {
        &self.links[0]
    }

    /// Every link, newest first; the last is a full checkpoint.
    pub fn links(&self) -> &[Checkpoint] {
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
    pub fn dense_refs(&self) -> Result<Vec<(&Checkpoint, &DenseManifest)>> {
        let newest = self.newest().manifest();
        let mut out: Vec<(&Checkpoint, &DenseManifest)> =
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
    pub fn read_dense(
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
            .map(|t| ChainTable::new(self, &t.name, Checkpoint::kept_slots(t, &exclude)))
            .collect()
    }

    /// The dense tensors a load with `opts` wants, and its report, finished.
    fn finish_load(
        &self,
        opts: &LoadOptions,
        mut report: crate::LoadReport,
        start: std::time::Instant,
    ) -> Result<(Vec<LoadedDense>, crate::LoadReport)> {
        let dense = if opts.load_dense {
            self.read_dense(Some(opts), &mut report)?
        } else {
            Vec::new()
        };
        report.load_seconds = start.elapsed().as_secs_f64();
        finish_report(&mut report);
        Ok((dense, report))
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

    /// Loads into arrays, as [`Checkpoint::load_columns`] does for one checkpoint: the rows of
    /// target shard `opts.shard_index` (all rows when `None`), in (bucket, id bits) order.
    pub fn load_columns(&self, opts: &LoadOptions) -> Result<Columns> {
        let start = std::time::Instant::now();
        target_shards(opts)?;
        let target = match opts.shard_index {
            Some(j) => PartitionRule::bucket_range(j, opts.shard_num),
            None => 0..BUCKETS,
        };
        let tables = self.selected(opts)?;
        let pool = crate::restore::reader_pool(opts.parallel)?;
        let mut out = Vec::new();
        let mut report = crate::LoadReport::default();
        for t in &tables {
            let parts: Vec<Range<u32>> = t
                .parts
                .iter()
                .map(|p| p.start.max(target.start)..p.end.min(target.end))
                .filter(|r| !r.is_empty())
                .collect();
            let batch = (opts.chunk_bytes / t.full_row_bytes()).max(1) as usize;
            let pieces: Result<Vec<ColumnPiece>> = pool.install(|| {
                parts
                    .par_iter()
                    .map(|r| {
                        let mut ids = Vec::new();
                        let mut data = vec![Vec::new(); t.slots.len()];
                        t.visit_buckets(r.clone(), batch, &mut |i, s| {
                            ids.extend_from_slice(i);
                            for (d, s) in data.iter_mut().zip(s) {
                                d.extend_from_slice(s);
                            }
                            Ok(())
                        })?;
                        Ok((ids, data))
                    })
                    .collect()
            });
            let mut ids = Vec::new();
            let mut data = vec![Vec::new(); t.slots.len()];
            for (i, d) in pieces? {
                ids.extend_from_slice(&i);
                for (all, d) in data.iter_mut().zip(d) {
                    all.extend_from_slice(&d);
                }
            }
            report.rows += ids.len() as u64;
            report.bytes_kept += ids.len() as u64 * t.full_row_bytes();
            report.bytes_read += t.bytes_read();
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
        let (dense, report) = self.finish_load(opts, report, start)?;
        Ok(Columns {
            tables: out,
            dense,
            report,
        })
    }

    /// Restores into fresh [`EmbeddingTable`]s, as [`Checkpoint::restore`] does for one
    /// checkpoint: every target shard of `opts.shard_num`, or only `opts.shard_index`, reading
    /// only the target's buckets of every link.
    pub fn restore(&self, opts: &LoadOptions) -> Result<Restored> {
        let start = std::time::Instant::now();
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
                        0,
                        j,
                        opts.shard_num,
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
        let pool = crate::restore::reader_pool(opts.parallel)?;
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
        set_baselines(&shards, opts, &self.newest().manifest().save_id)?;
        let report = crate::LoadReport {
            rows: done.iter().map(|d| d.0).sum(),
            bytes_kept: done.iter().map(|d| d.1).sum(),
            bytes_read: tables.iter().map(ChainTable::bytes_read).sum(),
            ..Default::default()
        };
        let (dense, report) = self.finish_load(opts, report, start)?;
        Ok(Restored {
            shards,
            dense,
            report,
        })
    }
}

/// The ids and slot columns of one part of a table, as [`Chain::load_columns`] reads them.
type ColumnPiece = (Vec<u64>, Vec<Vec<u8>>);

/// One link's part of a [`ChainTable`]: its rows, and for a delta, its removed ids.
struct Link<'c> {
    rows: StoredTable<'c>,
    removed: Option<StoredTable<'c>>,
}

/// A table of a [`Chain`], resolved: the rows a full save of the newest state would hold.
pub struct ChainTable<'c> {
    name: String,
    key_dtype: KeyDtype,
    slots: Vec<SlotSpec>,
    row_bytes: Vec<u64>,
    /// Newest first: the consecutive links that hold the table.
    links: Vec<Link<'c>>,
    /// Bucket ranges, each within one segment of every link: the scan parts.
    parts: Vec<Range<u32>>,
    /// The number of live rows, counted (a merge of the ids of every link) when first asked:
    /// loads never ask, so they read only their buckets.
    rows: std::sync::OnceLock<u64>,
    /// Bytes of ids and rows read from the links' files so far.
    bytes_read: AtomicU64,
}

impl<'c> ChainTable<'c> {
    /// Table `name` of `chain` with slots `slots` (of the newest link's table).
    pub fn new(chain: &'c Chain, name: &str, slots: Vec<SlotSpec>) -> Result<Self> {
        let newest = chain.newest().manifest();
        let Some(t) = newest.table(name) else {
            return Err(Error::Mismatch(format!(
                "table {name:?} is not in the checkpoint {}",
                chain.newest().location()
            )));
        };
        let mut links = Vec::new();
        for (i, ckpt) in chain.links.iter().enumerate() {
            let Some(tm) = ckpt.manifest().table(name) else {
                break;
            };
            let at_link = |e: Error| Error::Chain {
                link: chain.dirs[i].display().to_string(),
                message: format!("table {name:?}: {e}"),
            };
            if tm.key_dtype != t.key_dtype {
                return Err(at_link(Error::Mismatch(format!(
                    "ids are {}, the newest link's {}",
                    tm.key_dtype, t.key_dtype
                ))));
            }
            let rows = StoredTable::new(ckpt, tm, slots.clone()).map_err(at_link)?;
            let removed = match ckpt.manifest().parent {
                None => None,
                Some(_) => {
                    let rname = removed_table_name(name);
                    let rm = ckpt
                        .manifest()
                        .table(&rname)
                        .ok_or_else(|| Error::Corrupt {
                            file: ckpt.location(),
                            what: format!("delta without the table {rname:?} of removed ids"),
                        })?;
                    Some(StoredTable::new(ckpt, rm, Vec::new()).map_err(at_link)?)
                }
            };
            for table in std::iter::once(&rows).chain(&removed) {
                if table.segment_count() >= 1 << (LINK_SHIFT - ROW_BITS) {
                    return Err(at_link(Error::Mismatch(format!(
                        "{} segments, more than a chain can address",
                        table.segment_count()
                    ))));
                }
            }
            links.push(Link { rows, removed });
        }
        let mut bounds: Vec<u32> = vec![0, BUCKETS];
        for l in &links {
            bounds.extend(l.rows.boundaries());
            if let Some(r) = &l.removed {
                bounds.extend(r.boundaries());
            }
        }
        bounds.sort_unstable();
        bounds.dedup();
        let parts: Vec<Range<u32>> = bounds
            .windows(2)
            .map(|w| w[0]..w[1])
            .filter(|r| !r.is_empty())
            .collect();
        let row_bytes = slots
            .iter()
            .map(|s| s.row_bytes())
            .collect::<saver_core::Result<_>>()?;
        Ok(Self {
            name: name.to_string(),
            key_dtype: t.key_dtype,
            slots,
            row_bytes,
            links,
            parts,
            rows: std::sync::OnceLock::new(),
            bytes_read: AtomicU64::new(0),
        })
    }

    /// Counts the live rows: a merge of every link's ids.
    fn count_rows(&self) -> Result<u64> {
        if self.links.len() == 1 && self.links[0].removed.is_none() {
            return Ok(self.links[0].rows.rows());
        }
        let mut n = 0u64;
        for p in &self.parts {
            self.merge(p.clone(), &mut |_, _| {
                n += 1;
                Ok(())
            })?;
        }
        Ok(n)
    }

    /// The number of live rows. A chain whose ids cannot be read counts 0 here; reading its rows
    /// then fails with the reason.
    fn live_rows(&self) -> u64 {
        *self.rows.get_or_init(|| self.count_rows().unwrap_or(0))
    }

    /// Bytes of ids and rows read from the links' files so far (binary searches aside).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// The number of links the table is resolved over.
    pub fn link_count(&self) -> usize {
        self.links.len()
    }

    /// Bytes of one whole row: id and every slot.
    fn full_row_bytes(&self) -> u64 {
        8 + self.row_bytes.iter().sum::<u64>()
    }

    /// Calls `emit(id, handle)` for every live row of `buckets` (within one part), in (bucket,
    /// id bits) order.
    fn merge(
        &self,
        buckets: Range<u32>,
        emit: &mut dyn FnMut(u64, u64) -> Result<()>,
    ) -> Result<()> {
        let mut cursors = Vec::new();
        for (i, l) in self.links.iter().enumerate() {
            for (table, removal) in
                std::iter::once((&l.rows, false)).chain(l.removed.as_ref().map(|r| (r, true)))
            {
                if let Some((seg, rows)) = table.rows_of_buckets(buckets.clone())? {
                    if !rows.is_empty() {
                        cursors.push(Cursor::new(table, &self.bytes_read, i, removal, seg, rows));
                    }
                }
            }
        }
        // The cursor with the most rows (the full checkpoint's, as a rule) runs in a tight loop
        // up to the next key of any other; only the others go through the heap.
        let Some(b) = (0..cursors.len()).max_by_key(|&c| cursors[c].end - cursors[c].first) else {
            return Ok(());
        };
        let mut bulk = cursors.swap_remove(b);
        let mut heap = BinaryHeap::new();
        for (c, cur) in cursors.iter_mut().enumerate() {
            if let Some(id) = cur.peek()? {
                heap.push(Reverse((
                    PartitionRule::bucket_of(id),
                    id,
                    cur.link,
                    cur.removal,
                    c,
                )));
            }
        }
        let handle = |cur: &Cursor<'_, '_>| {
            ((cur.link as u64) << LINK_SHIFT) | ((cur.seg as u64) << ROW_BITS) | cur.row()
        };
        loop {
            let next = heap.peek().map(|Reverse(t)| (t.0, t.1));
            let mut bulk_key = None;
            while let Some(id) = bulk.peek()? {
                let key = (PartitionRule::bucket_of(id), id);
                if next.is_some_and(|n| key >= n) {
                    bulk_key = Some(key);
                    break;
                }
                if !bulk.removal {
                    emit(id, handle(&bulk))?;
                }
                bulk.pos += 1;
            }
            let Some(key) = next else {
                return Ok(());
            };
            // Every entry of `key`: the newest link decides, a row before a removal of it.
            let mut best: Option<((usize, bool), u64)> = None;
            let mut take = |rank: (usize, bool), h: u64| {
                if best.is_none_or(|b| rank < b.0) {
                    best = Some((rank, h));
                }
            };
            if bulk_key == Some(key) {
                take((bulk.link, bulk.removal), handle(&bulk));
                bulk.pos += 1;
            }
            while let Some(Reverse(top)) = heap.peek() {
                if (top.0, top.1) != key {
                    break;
                }
                let c = top.4;
                heap.pop();
                let cur = &mut cursors[c];
                take((cur.link, cur.removal), handle(cur));
                cur.pos += 1;
                if let Some(id) = cur.peek()? {
                    heap.push(Reverse((
                        PartitionRule::bucket_of(id),
                        id,
                        cur.link,
                        cur.removal,
                        c,
                    )));
                }
            }
            if let Some(((_, false), h)) = best {
                emit(key.1, h)?;
            }
        }
    }

    /// Visits the live rows of `buckets` in (bucket, id bits) order, at most `batch` at a time.
    pub fn visit_buckets(
        &self,
        buckets: Range<u32>,
        batch: usize,
        visit: &mut VisitRows<'_>,
    ) -> Result<()> {
        let snap = ChainSnapshot::new(self)?;
        let batch = batch.max(1);
        let mut ids = Vec::with_capacity(batch);
        let mut handles = Vec::with_capacity(batch);
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); self.slots.len()];
        let mut flush = |ids: &mut Vec<u64>, handles: &mut Vec<u64>| -> Result<()> {
            if ids.is_empty() {
                return Ok(());
            }
            for (b, &w) in bufs.iter_mut().zip(&self.row_bytes) {
                b.resize(ids.len() * w as usize, 0);
            }
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            snap.read_handles(ids, handles, &mut outs)?;
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            visit(ids, &views)?;
            ids.clear();
            handles.clear();
            Ok(())
        };
        for part in &self.parts {
            let r = part.start.max(buckets.start)..part.end.min(buckets.end);
            if r.is_empty() {
                continue;
            }
            self.merge(r, &mut |id, h| {
                ids.push(id);
                handles.push(h);
                if ids.len() >= batch {
                    flush(&mut ids, &mut handles)?;
                }
                Ok(())
            })?;
        }
        flush(&mut ids, &mut handles)
    }

    /// Finds the live row of `id`: its handle, or `None` when the chain does not hold it.
    fn locate(&self, id: u64) -> Result<Option<u64>> {
        for (i, l) in self.links.iter().enumerate() {
            if let Some((s, r)) = l.rows.locate(id)? {
                return Ok(Some(
                    ((i as u64) << LINK_SHIFT) | ((s as u64) << ROW_BITS) | r,
                ));
            }
            if let Some(removed) = &l.removed {
                if removed.locate(id)?.is_some() {
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }
}

/// Reads the ids of one link's rows (or removed ids) over a row range of one segment.
struct Cursor<'t, 'c> {
    table: &'t StoredTable<'c>,
    read: &'t AtomicU64,
    link: usize,
    removal: bool,
    seg: usize,
    /// Row of `ids[0]`.
    first: u64,
    end: u64,
    ids: Vec<u64>,
    pos: usize,
    raw: Vec<u8>,
}

impl<'t, 'c> Cursor<'t, 'c> {
    fn new(
        table: &'t StoredTable<'c>,
        read: &'t AtomicU64,
        link: usize,
        removal: bool,
        seg: usize,
        rows: Range<u64>,
    ) -> Self {
        Self {
            table,
            read,
            link,
            removal,
            seg,
            first: rows.start,
            end: rows.end,
            ids: Vec::new(),
            pos: 0,
            raw: Vec::new(),
        }
    }

    /// The row number of the current id.
    fn row(&self) -> u64 {
        self.first + self.pos as u64
    }

    /// The current id, reading the next ones when needed; `None` at the end.
    fn peek(&mut self) -> Result<Option<u64>> {
        if self.pos == self.ids.len() {
            let start = self.first + self.ids.len() as u64;
            if start >= self.end {
                return Ok(None);
            }
            let n = (self.end - start).min(CURSOR_IDS);
            self.raw.resize(n as usize * 8, 0);
            self.table
                .read_segment(self.seg, start..start + n, &mut self.raw, &mut [])?;
            self.read.fetch_add(n * 8, Ordering::Relaxed);
            let last = self.ids.last().copied();
            self.ids.clear();
            self.ids.extend(
                self.raw
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
            );
            if let (Some(last), Some(&next)) = (last, self.ids.first()) {
                if (PartitionRule::bucket_of(next), next) <= (PartitionRule::bucket_of(last), last)
                {
                    return Err(Error::Corrupt {
                        file: self.table.checkpoint().location(),
                        what: format!(
                            "table {:?} holds id {} out of bucket order",
                            self.table.manifest().name,
                            self.table.key_dtype().format_id(next)
                        ),
                    });
                }
            }
            self.first = start;
            self.pos = 0;
        }
        Ok(self.ids.get(self.pos).copied())
    }
}

impl SparseTable for ChainTable<'_> {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_dtype(&self) -> KeyDtype {
        self.key_dtype
    }
    fn slots(&self) -> &[SlotSpec] {
        &self.slots
    }
    /// A hint, as the trait allows: the rows of every link, at least the live rows (counting
    /// them exactly takes a pass over every link's ids; [`BucketRows::rows`] does).
    fn len(&self) -> usize {
        let all: u64 = self.links.iter().map(|l| l.rows.rows()).sum();
        usize::try_from(all).unwrap_or(usize::MAX)
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        Ok(Box::new(
            ChainSnapshot::new(self).map_err(|e| core(&self.name, e))?,
        ))
    }
    /// Committed checkpoints do not change: the rows are the chain's, whole.
    fn point_in_time(&self) -> bool {
        true
    }
}

impl BucketRows for ChainTable<'_> {
    fn row_bytes(&self) -> &[u64] {
        &self.row_bytes
    }
    fn rows(&self) -> u64 {
        self.live_rows()
    }
    fn visit_in_bucket_order(&self, batch: usize, visit: &mut VisitRows<'_>) -> Result<()> {
        self.visit_buckets(0..BUCKETS, batch, visit)
    }
}

struct ChainSnapshot<'t, 'c> {
    table: &'t ChainTable<'c>,
}

impl<'t, 'c> ChainSnapshot<'t, 'c> {
    fn new(table: &'t ChainTable<'c>) -> Result<Self> {
        Ok(Self { table })
    }

    /// Reads the rows of `handles` into `out`, link by link: rows of one segment separated by
    /// less than [`COALESCE_BYTES`] of any slot are read in one piece (the rows between them,
    /// which a newer link replaced or removed, are read and skipped), so that a base shadowed
    /// here and there by deltas is read in long runs rather than row by row.
    fn read_handles(&self, ids: &[u64], handles: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        debug_assert_eq!(ids.len(), handles.len());
        let t = self.table;
        let mask = (1u64 << LINK_SHIFT) - 1;
        let split = |h: u64| (((h & mask) >> ROW_BITS) as usize, h & ((1 << ROW_BITS) - 1));
        let mut by_link: Vec<Vec<usize>> = vec![Vec::new(); t.links.len()];
        for (i, &h) in handles.iter().enumerate() {
            let link = (h >> LINK_SHIFT) as usize;
            by_link
                .get_mut(link)
                .ok_or_else(|| {
                    Error::Mismatch(format!("row handle {h:#x} is not table {:?}'s", t.name))
                })?
                .push(i);
        }
        let widths: Vec<usize> = t.row_bytes.iter().map(|&b| b as usize).collect();
        let gap = (COALESCE_BYTES / t.row_bytes.iter().copied().max().unwrap_or(1).max(1)).max(1);
        let mut scratch: Vec<Vec<u8>> = vec![Vec::new(); widths.len()];
        for (link, pos) in by_link.iter().enumerate() {
            let rows = &t.links[link].rows;
            let mut a = 0;
            while a < pos.len() {
                let (seg, first) = split(handles[pos[a]]);
                let mut last = first;
                let mut b = a + 1;
                while b < pos.len() {
                    let (s2, r) = split(handles[pos[b]]);
                    if s2 != seg || r <= last || r - last > gap {
                        break;
                    }
                    last = r;
                    b += 1;
                }
                if seg >= rows.segment_count() || last >= rows.segment_rows(seg) {
                    return Err(Error::Mismatch(format!(
                        "row handle {:#x} is not table {:?}'s",
                        handles[pos[a]], t.name
                    )));
                }
                let n = (last - first + 1) as usize;
                let mut bufs: Vec<&mut [u8]> = scratch
                    .iter_mut()
                    .zip(&widths)
                    .zip(out.iter())
                    .map(|((s, &w), o)| {
                        if o.is_empty() {
                            &mut [][..]
                        } else {
                            s.resize(n * w, 0);
                            &mut s[..]
                        }
                    })
                    .collect();
                rows.read_segment(seg, first..last + 1, &mut [], &mut bufs)?;
                let read: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                t.bytes_read.fetch_add(read, Ordering::Relaxed);
                for &i in &pos[a..b] {
                    let r = (split(handles[i]).1 - first) as usize;
                    for ((o, src), &w) in out.iter_mut().zip(&bufs).zip(&widths) {
                        if !o.is_empty() {
                            o[i * w..(i + 1) * w].copy_from_slice(&src[r * w..(r + 1) * w]);
                        }
                    }
                }
                a = b;
            }
        }
        Ok(())
    }
}

impl TableSnapshot for ChainSnapshot<'_, '_> {
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        saver_core::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.table.parts.len()
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> saver_core::Result<()>,
    ) -> saver_core::Result<()> {
        let t = self.table;
        let Some(range) = t.parts.get(part) else {
            return Ok(());
        };
        let max_rows = max_rows.max(1);
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); t.slots.len()];
        let mut flush = |ids: &mut Vec<u64>, handles: &mut Vec<u64>| -> Result<()> {
            if ids.is_empty() {
                return Ok(());
            }
            let slices: Vec<&[u8]> = if with_values {
                for (b, &w) in bufs.iter_mut().zip(&t.row_bytes) {
                    b.resize(ids.len() * w as usize, 0);
                }
                let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                self.read_handles(ids, handles, &mut outs)?;
                bufs.iter().map(Vec::as_slice).collect()
            } else {
                Vec::new()
            };
            visit(RowChunk {
                ids,
                handles,
                slots: &slices,
            })?;
            ids.clear();
            handles.clear();
            Ok(())
        };
        t.merge(range.clone(), &mut |id, h| {
            ids.push(id);
            handles.push(h);
            if ids.len() >= max_rows {
                flush(&mut ids, &mut handles)?;
            }
            Ok(())
        })
        .and_then(|()| flush(&mut ids, &mut handles))
        .map_err(|e| core(&t.name, e))
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver_core::Result<()> {
        let t = self.table;
        let handles = ids
            .iter()
            .map(|&id| {
                t.locate(id)?.ok_or_else(|| {
                    saver_core::Error::Table {
                        table: t.name.clone(),
                        message: format!(
                            "id {} is not in the checkpoint",
                            t.key_dtype.format_id(id)
                        ),
                    }
                    .into()
                })
            })
            .collect::<Result<Vec<u64>>>()
            .map_err(|e| core(&t.name, e))?;
        self.read_handles(ids, &handles, out)
            .map_err(|e| core(&t.name, e))
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver_core::Result<()> {
        if handles.len() != ids.len() {
            return self.read_rows(ids, out);
        }
        self.read_handles(ids, handles, out)
            .map_err(|e| core(&self.table.name, e))
    }
}

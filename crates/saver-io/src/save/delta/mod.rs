//! Delta saves: only what changed since a parent checkpoint.
//!
//! A table that tracks its changes ([`ChangeTracking`], e.g. an `EmbeddingTable` made with
//! `with_change_tracking`) and whose last committed save is the parent gives the rows written
//! since and the ids removed since, without any comparison. For every other table the delta is
//! found by content: each table's rows are walked in (bucket, id bits) order beside
//! the parent chain's rows of the same table ([`crate::load::checkpoint::ChainTable`]), which lie in that
//! order on disk. A row the parent lacks or holds with other bytes (in any slot the save keeps)
//! is written whole; a parent row whose id the table no longer holds, or whose row a row filter
//! now drops, is recorded as removed. Both go to nameless temporary files beside the checkpoint
//! ([`spool`]) and are then saved like any table, with the removed ids in the companion table
//! `removed_table_name`, through the ordinary plan, write and commit: a delta is committed,
//! verified and cleaned up exactly as a full checkpoint is.
//!
//! Memory: the comparison holds two batches of rows per side. Tables read from files (a
//! checkpoint, a chain or a plain input, [`SparseTable::in_bucket_order`]: `saver save --from …
//! --parent …`) are read in order as they are; any other [`SparseTable`] is put in order first
//! by sorting its ids and row handles in memory (16 bytes a row, [`InMemoryOrder`]).

mod order;
mod row_range;
pub(crate) mod spool;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::mpsc::sync_channel;
use std::sync::{Mutex, PoisonError};

use saver_core::filter::{BlockInfo, BlockKind, Filters};
use saver_core::naming::{removed_table_name, removed_table_of};
use saver_core::partition::BUCKETS;
use saver_core::plan::{ForeignRows, TableRef};
use saver_core::table::{RowView, TableSnapshot};
use saver_core::TableSchema;
use saver_core::{ChangeTracking, DenseTensor, PartitionRule, SaveInput, SlotSpec, SparseTable};

use crate::error::{Error, Result};
use crate::load::checkpoint::{ChainTable, Checkpoint};
use crate::load::rows::BucketRows;
use crate::save::decide::Parent;
use crate::save::options::SaveOptions;
use crate::save::report::DeltaMethod;
pub(crate) use order::InMemoryOrder;
use spool::{Spool, SpoolTable};

/// Rows compared at a time on each side.
const BATCH_ROWS: usize = 1 << 14;

/// Saves a delta of a model given as any tables. A table that tracks its changes
/// ([`ChangeTracking`]) and whose last committed save is the parent gives its changed rows and
/// removed ids directly (when the save has no row filter, which could drop rows the parent
/// holds); a table read from files ([`SparseTable::in_bucket_order`]: a checkpoint's, a chain's,
/// a plain input's) is compared as it is read, in bounded memory; any other is put in bucket
/// order in memory ([`InMemoryOrder`]) and compared. What [`crate::save_to`] does, after it
/// decided, when `opts.parent` is set; the changes are then saved as any input is.
pub(crate) fn find<'t>(
    input: &'t SaveInput<'_>,
    dense: Vec<DenseTensor<'t>>,
    opts: &SaveOptions,
    parent: &Parent,
) -> Result<Changes<'t>> {
    // The moment is the tables' snapshots below, not the plan of the changed rows found after
    // them: the hook is told then, so that a background save returns before the comparisons.
    let mut opts = opts.clone();
    let on_moment = opts.plan.on_moment.take();
    let opts = &opts;
    let parent_id = parent.chain.newest().manifest().save_id.clone();
    let mut ordered = Vec::new();
    let mut tracked = Vec::new();
    let mut methods = BTreeMap::new();
    // (tracking, token of the snapshot this save reads) of every table that tracks.
    let mut tokens: Vec<(&dyn ChangeTracking, u64)> = Vec::new();
    // Every table's snapshot at one moment (cheap: no row is copied), so that the delta holds
    // one moment for all; the comparisons' scans and sorts come after.
    let tables: Vec<&dyn SparseTable> = input.all_tables().collect();
    let taken = saver_core::table::moment::at_one_moment(|| {
        tables
            .iter()
            .map(|&t| {
                if t.in_bucket_order().is_some() {
                    // Read from files, which do not change: no moment to fix.
                    return Ok(Taken::InOrder);
                }
                let tracking = t.change_tracking();
                let since = tracked_since(
                    t,
                    tracking,
                    &parent_id,
                    parent.chain.table_manifests(),
                    opts,
                );
                Ok(match (tracking, since) {
                    (Some(c), Ok(since)) => {
                        // The shards of one save, taken by several threads, share one moment.
                        let (snapshot, token) = match &opts.save_id {
                            Some(id) => {
                                saver_core::table::moment::for_save(id, || c.changed_since(since))
                            }
                            None => c.changed_since(since),
                        }?;
                        Taken::Tracked {
                            c,
                            since,
                            snapshot,
                            token,
                        }
                    }
                    (tracking, why) => {
                        let snapshot = match &opts.save_id {
                            Some(id) => saver_core::table::moment::for_save(id, || t.snapshot()),
                            None => t.snapshot(),
                        }?;
                        Taken::Compared {
                            snapshot,
                            token: tracking.map(|c| (c, c.last_snapshot())),
                            why: why.err().unwrap_or_default(),
                        }
                    }
                })
            })
            .collect::<Result<Vec<_>>>()
    })?;
    if let Some(hook) = on_moment {
        (hook.0)();
    }
    // Per table in input order: compared as it is read (`Some`), or from `ordered`.
    let mut compared: Vec<Option<&dyn BucketRows>> = Vec::new();
    for (t, taken) in tables.into_iter().zip(taken) {
        match taken {
            Taken::InOrder => {
                let why = "the table is read from files (a checkpoint, a chain or a plain \
                           input), which keep no record of their changes"
                    .to_string();
                methods.insert(t.name().to_string(), DeltaMethod::Compared { why });
                compared.push(t.in_bucket_order());
            }
            Taken::Tracked {
                c,
                since,
                snapshot,
                token,
            } => {
                let removed = c.removed_between(since, token);
                tokens.push((c, token));
                tracked.push(TrackedChanges {
                    table: t,
                    snapshot: Mutex::new(Some(snapshot)),
                    removed,
                    rows_hint: c.changed_hint(),
                });
                methods.insert(t.name().to_string(), DeltaMethod::Tracked);
            }
            Taken::Compared {
                snapshot,
                token,
                why,
            } => {
                ordered.push(InMemoryOrder::of_snapshot(t, snapshot)?);
                compared.push(None);
                tokens.extend(token);
                methods.insert(t.name().to_string(), DeltaMethod::Compared { why });
            }
        }
    }
    let mut sorted = ordered.iter();
    let refs: Vec<&dyn BucketRows> = compared
        .into_iter()
        .map(|c| c.unwrap_or_else(|| sorted.next().expect("one sorted table each")))
        .collect();
    let row_chunks = row_range::changed_chunks(&input.row_chunks, &parent.chain, &mut methods)?;
    let found = Found { methods, tokens };
    let mut changes = changes(parent, &refs, tracked, dense, opts, found)?;
    changes.row_chunks = row_chunks;
    Ok(changes)
}

/// A table's snapshot for a delta, taken with the others' at one moment.
enum Taken<'t> {
    /// None: the table is read from files, in bucket order ([`SparseTable::in_bucket_order`]).
    InOrder,
    /// Its changes since the parent, from its own record of them.
    Tracked {
        c: &'t dyn ChangeTracking,
        since: u64,
        snapshot: Box<dyn TableSnapshot + 't>,
        token: u64,
    },
    /// The whole table, to compare with the parent; why; and, for a table that tracks, the
    /// token of this snapshot.
    Compared {
        snapshot: Box<dyn TableSnapshot + 't>,
        token: Option<(&'t dyn ChangeTracking, u64)>,
        why: String,
    },
}

/// Where `t`'s changes since the parent `parent_id` start in its own record of them, or why the
/// delta must compare it with the parent instead.
fn tracked_since<'m>(
    t: &dyn SparseTable,
    tracking: Option<&dyn ChangeTracking>,
    parent_id: &str,
    mut parent_tables: impl Iterator<Item = &'m saver_core::manifest::TableManifest>,
    opts: &SaveOptions,
) -> std::result::Result<u64, String> {
    match tracking {
        None => Err("the table keeps no record of its changes: make it with \
                     with_change_tracking, or restore it with LoadOptions::change_tracking"
            .to_string()),
        // A row filter could drop rows the parent holds: only a comparison finds those.
        Some(_) if opts.plan.filters.has_row_filters() => {
            Err("the save has a row filter, which may drop rows the parent holds".into())
        }
        Some(_) if !parent_tables.any(|m| m.name == t.name()) => {
            Err("the parent holds no table of this name".into())
        }
        Some(c) => c.baseline_of(parent_id).ok_or_else(|| match c.baseline() {
            Some((id, _)) => {
                format!("the table's last committed save is {id}, not the parent {parent_id}")
            }
            None => format!(
                "the table knows of no committed save of it, and was not written by the \
                 parent {parent_id} (after a restart, restore it with \
                 LoadOptions::change_tracking or call set_baseline)"
            ),
        }),
    }
}

/// How a delta found each table's changes, and the tables to tell of its commit.
struct Found<'t> {
    methods: BTreeMap<String, DeltaMethod>,
    tokens: Vec<(&'t dyn ChangeTracking, u64)>,
}

/// Compares `ordered` with the chain and adds the `tracked` changes: the delta's rows.
fn changes<'t>(
    parent: &Parent,
    ordered: &[&dyn BucketRows],
    tracked: Vec<TrackedChanges<'t>>,
    dense: Vec<DenseTensor<'t>>,
    opts: &SaveOptions,
    found: Found<'t>,
) -> Result<Changes<'t>> {
    let plan = &opts.plan;
    let shard = plan.shard_index.unwrap_or(0);
    let range = match plan.shard_index {
        Some(i) => PartitionRule::bucket_range(i, plan.shard_num),
        None => 0..BUCKETS,
    };
    // The slots the save keeps of a table, or `None` if it drops the table.
    let compared = |t: &dyn SparseTable| -> Option<Vec<usize>> {
        let kept = |kind, slot: Option<&str>| {
            plan.filters.keep_block(&BlockInfo {
                kind,
                table: Some(t.name()),
                slot,
                dense: None,
                shard,
            })
        };
        kept(BlockKind::Ids, None).then(|| {
            (0..t.slots().len())
                .filter(|&s| kept(BlockKind::Slot, Some(&t.slots()[s].name)))
                .collect()
        })
    };
    let mut spools: Vec<SpoolTable> = Vec::new();
    for t in ordered {
        let Some(compared) = compared(*t) else {
            continue;
        };
        let parent_table = parent_slots(&parent.chain, *t, &compared)?
            .map(|slots| ChainTable::new(&parent.chain, t.name(), slots))
            .transpose()?;
        let scratch = &crate::storage::scratch_dir(&parent.child_dir);
        let mut changed = Spool::new(scratch, t.slots())?;
        let mut removed = Spool::new(scratch, &[])?;
        diff_table(
            *t,
            parent_table.as_ref(),
            &compared,
            &plan.filters,
            (range.clone(), plan.foreign_rows, shard),
            &mut changed,
            &mut removed,
        )?;
        // A delta found against bytes that fail their checksums would be wrong: refused.
        if let Some(p) = &parent_table {
            p.finish_checks()?;
        }
        t.finish_checks()?;
        let name = t.name();
        spools.push(changed.finish(name, t.key_dtype(), t.slots(), t.point_in_time())?);
        spools.push(removed.finish(&removed_table_name(name), t.key_dtype(), &[], true)?);
    }
    let mut kept_tracked = Vec::new();
    for t in tracked {
        let Some(compared) = compared(t.table) else {
            continue;
        };
        parent_slots(&parent.chain, t.table, &compared)?;
        // A process of a multi-process save writes its own shard's removals.
        let mut ids: Vec<(u32, u64)> = t
            .removed
            .iter()
            .map(|&id| (PartitionRule::bucket_of(id), id))
            .filter(|(b, _)| range.contains(b))
            .collect();
        ids.sort_unstable();
        let mut removed = Spool::new(&crate::storage::scratch_dir(&parent.child_dir), &[])?;
        for (_, id) in ids {
            removed.push(id, &[])?;
        }
        let name = removed_table_name(t.table.name());
        spools.push(removed.finish(&name, t.table.key_dtype(), &[], true)?);
        kept_tracked.push(t);
    }
    let mut written = Vec::new();
    // Dense tensors the chain holds unchanged (same dtype, shape and CRC32) are named, not
    // written.
    let in_parent: std::collections::HashMap<&str, &saver_core::manifest::TensorRef> = parent
        .chain
        .dense_refs()?
        .into_iter()
        .map(|(_, d)| (d.tensor.name.as_str(), &d.tensor))
        .collect();
    let mut dense_in_parent = Vec::new();
    for d in dense {
        let kept = plan.filters.keep_block(&BlockInfo {
            kind: BlockKind::Dense,
            table: None,
            slot: None,
            dense: Some(d.name()),
            shard,
        });
        let same = match in_parent.get(d.name()) {
            Some(t) if t.dtype == d.dtype() && t.shape == d.shape() => t.crc32 == d.crc32()?,
            _ => false,
        };
        if kept && same {
            dense_in_parent.push(d.name().to_string());
        } else {
            written.push(d);
        }
    }
    dense_in_parent.sort();
    let mut opts = opts.clone();
    opts.plan.filters = delta_filters(&plan.filters);
    Ok(Changes {
        rows: ChangedRows {
            spools,
            tracked: kept_tracked,
        },
        dense: written,
        row_chunks: Vec::new(),
        delta: DeltaOf {
            parent: parent.parent_ref.clone(),
            dense_in_parent,
            methods: found.methods,
            tracking: found.tokens,
        },
        opts,
    })
}

/// What makes a save a delta: its parent, the dense tensors of the new state it does not write
/// because the parent's chain holds them unchanged, and how each table's changes were found.
pub(crate) struct DeltaOf<'t> {
    pub parent: saver_core::ParentRef,
    pub dense_in_parent: Vec<String>,
    pub methods: BTreeMap<String, DeltaMethod>,
    /// The tables whose changes the delta holds, with the token of the snapshot it read: told
    /// when the delta is durable and when it commits, like the tables of a full save.
    pub tracking: Vec<(&'t dyn ChangeTracking, u64)>,
}

/// A delta found against its parent, ready to be claimed, planned, written and committed like
/// any save.
pub(crate) struct Changes<'t> {
    /// Its tables: changed rows and removed ids.
    pub rows: ChangedRows<'t>,
    /// The dense tensors the parent's chain does not hold unchanged.
    pub dense: Vec<DenseTensor<'t>>,
    /// What it holds of the row-range chunks given: their changed rows, or whole chunks.
    pub row_chunks: Vec<saver_core::RowRangeChunk<'t>>,
    /// What its manifests record of the parent.
    pub delta: DeltaOf<'t>,
    /// The save's options, with the filters of a delta's plan ([`delta_filters`]).
    pub opts: SaveOptions,
}

/// A delta's tables: changed rows and removed ids spooled to temporary files, and the changes
/// of tables that track them.
pub(crate) struct ChangedRows<'t> {
    spools: Vec<SpoolTable>,
    tracked: Vec<TrackedChanges<'t>>,
}

impl ChangedRows<'_> {
    /// The delta's tables as a save's input (without its dense tensors).
    pub(crate) fn input(&self) -> SaveInput<'_> {
        let mut input = SaveInput::new();
        for s in &self.spools {
            input.tables.push(TableRef::Borrowed(s));
        }
        for t in &self.tracked {
            input.tables.push(TableRef::Borrowed(t));
        }
        input
    }
}

/// A tracking table's rows written since its baseline (a snapshot taken once, handed to the
/// save's plan) and its ids removed since then.
struct TrackedChanges<'t> {
    table: &'t dyn SparseTable,
    snapshot: Mutex<Option<Box<dyn TableSnapshot + 't>>>,
    removed: Vec<u64>,
    /// About how many rows the snapshot gives: the planner sizes its buffers from it.
    rows_hint: usize,
}

impl SparseTable for TrackedChanges<'_> {
    fn schema(&self) -> &TableSchema {
        self.table.schema()
    }
    fn len(&self) -> usize {
        self.rows_hint
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        self.snapshot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .map(|s| s as Box<dyn TableSnapshot + '_>)
            .ok_or_else(|| saver_core::Error::Table {
                table: self.table.name().to_string(),
                message: "the changed rows of a delta are read once".into(),
            })
    }
    fn point_in_time(&self) -> bool {
        self.table.point_in_time()
    }
}

/// The filters of a delta's plan: a table's removed ids follow the table's ids block, and no
/// row filter applies to them (rows were filtered when the delta was found). Without row filters
/// in `filters`, the plan has none either: a row filter makes the plan copy every row's values
/// to show them to it.
fn delta_filters(filters: &Filters) -> Filters {
    let blocks = filters.clone();
    let kept = Filters::new().keep_blocks(move |b| match b.table.and_then(removed_table_of) {
        Some(base) => blocks.keep_block(&BlockInfo {
            kind: BlockKind::Ids,
            table: Some(base),
            slot: None,
            dense: None,
            shard: b.shard,
        }),
        None => blocks.keep_block(b),
    });
    if !filters.has_row_filters() {
        return kept;
    }
    let rows = filters.clone();
    kept.keep_rows(move |r| removed_table_of(r.table()).is_some() || rows.keep_row(r))
}

/// The parent chain's slots of table `t` matching the slots `compared` of `t` (checked: same
/// key dtype, each slot with the same dtype and shape); `None` when the parent has no such table
/// (every row is new).
fn parent_slots(
    chain: &Checkpoint,
    t: &dyn SparseTable,
    compared: &[usize],
) -> Result<Option<Vec<SlotSpec>>> {
    let Some(pt) = chain.table_manifests().find(|m| m.name == t.name()) else {
        return Ok(None);
    };
    let unfit = |why: String| Error::Chain {
        link: chain.dirs()[0].display().to_string(),
        message: format!(
            "table {:?} {why}: a delta holds whole rows of what changed, so its parent must hold \
             the same slots; save a full checkpoint instead",
            t.name()
        ),
    };
    if pt.key_dtype != t.key_dtype() {
        return Err(unfit(format!(
            "has {} ids in the parent, {} now",
            pt.key_dtype,
            t.key_dtype()
        )));
    }
    let mut slots: Vec<SlotSpec> = Vec::new();
    for &s in compared {
        let spec = &t.slots()[s];
        match pt.slots.iter().find(|p| p.name == spec.name) {
            Some(p) if p == spec => slots.push(p.clone()),
            Some(p) => {
                return Err(unfit(format!(
                    "slot {:?} is {} {:?} in the parent, {} {:?} now",
                    spec.name, p.dtype, p.shape, spec.dtype, spec.shape
                )))
            }
            None => return Err(unfit(format!("slot {:?} is not in the parent", spec.name))),
        }
    }
    Ok(Some(slots))
}

/// A batch of the parent's rows.
struct Batch {
    ids: Vec<u64>,
    slots: Vec<Vec<u8>>,
}

/// Compares `t` (rows of `range` only, the others by `foreign`) with `parent` and appends the
/// rows to write to `changed` and the removed ids to `removed`, both in bucket order.
fn diff_table(
    t: &dyn BucketRows,
    parent: Option<&ChainTable<'_>>,
    compared: &[usize],
    filters: &Filters,
    (range, foreign, shard): (Range<u32>, ForeignRows, u32),
    changed: &mut Spool,
    removed: &mut Spool,
) -> Result<()> {
    let name = t.name();
    let key_dtype = t.key_dtype();
    let specs = t.slots();
    let widths: Vec<usize> = t.row_bytes().iter().map(|&b| b as usize).collect();
    let pwidths: Vec<usize> = compared.iter().map(|&s| widths[s]).collect();
    let filter_rows = filters.has_row_filters();
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) = sync_channel::<Result<Batch>>(2);
        if let Some(p) = parent {
            let range = range.clone();
            scope.spawn(move || {
                let r = p.visit_buckets(range, BATCH_ROWS, &mut |ids, slots| {
                    let b = Batch {
                        ids: ids.to_vec(),
                        slots: slots.iter().map(|s| s.to_vec()).collect(),
                    };
                    tx.send(Ok(b))
                        .map_err(|_| Error::Mismatch("the comparison stopped".into()).into())
                });
                if let Err(e) = r {
                    let _ = tx.send(Err(e));
                }
            });
        } else {
            drop(tx);
        }
        let mut cur: Option<Batch> = None;
        let mut at = 0usize;
        // The parent's next row, fetching batches as needed.
        let next_parent = |cur: &mut Option<Batch>, at: &mut usize| -> Result<bool> {
            loop {
                if let Some(b) = cur {
                    if *at < b.ids.len() {
                        return Ok(true);
                    }
                }
                match rx.recv() {
                    Ok(b) => {
                        *cur = Some(b?);
                        *at = 0;
                    }
                    Err(_) => {
                        *cur = None;
                        return Ok(false);
                    }
                }
            }
        };
        let mut last: Option<(u32, u64)> = None;
        t.visit_in_bucket_order(BATCH_ROWS, &mut |ids, slots| {
            let mut row: Vec<&[u8]> = Vec::with_capacity(widths.len());
            for (i, &id) in ids.iter().enumerate() {
                let bucket = PartitionRule::bucket_of(id);
                if !range.contains(&bucket) {
                    match foreign {
                        ForeignRows::Skip => continue,
                        ForeignRows::Error => {
                            return Err(saver_core::Error::ForeignRows {
                                table: name.to_string(),
                                shard,
                                count: 1,
                                first_id: key_dtype.format_id(id),
                            })
                        }
                    }
                }
                let key = (bucket, id);
                if last.is_some_and(|l| l >= key) {
                    return Err(saver_core::Error::DuplicateId {
                        table: name.to_string(),
                        id: key_dtype.format_id(id),
                    });
                }
                last = Some(key);
                row.clear();
                row.extend(
                    slots
                        .iter()
                        .zip(&widths)
                        .map(|(s, &w)| &s[i * w..(i + 1) * w]),
                );
                if filter_rows && !filters.keep_row(&RowView::new(name, key_dtype, id, specs, &row))
                {
                    continue;
                }
                let mut same = false;
                while next_parent(&mut cur, &mut at)? {
                    let b = cur.as_ref().expect("a batch");
                    let pid = b.ids[at];
                    let pkey = (PartitionRule::bucket_of(pid), pid);
                    if pkey < key {
                        removed.push(pid, &[])?;
                        at += 1;
                        continue;
                    }
                    if pkey == key {
                        same = compared
                            .iter()
                            .zip(&pwidths)
                            .enumerate()
                            .all(|(k, (&s, &w))| b.slots[k][at * w..(at + 1) * w] == *row[s]);
                        at += 1;
                    }
                    break;
                }
                if !same {
                    changed.push(id, &row)?;
                }
            }
            Ok(())
        })?;
        while next_parent(&mut cur, &mut at)? {
            let b = cur.as_ref().expect("a batch");
            removed.push(b.ids[at], &[])?;
            at += 1;
        }
        Ok(())
    })
}

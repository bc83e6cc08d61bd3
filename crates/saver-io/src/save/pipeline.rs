//! The save pipeline: plan, write every planned shard in parallel, make it durable, write the
//! shard manifests, commit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use rayon::prelude::*;

use saver_core::manifest::{format_version_of, TableGiven, WriterInfo};
use saver_core::naming::shard_manifest_name;
use saver_core::plan::{plan_with_spill, tables_past_budget, ChunkBuffer, TensorCrc};
use saver_core::table::TableSemantics;
use saver_core::ChangeTracking;
use saver_core::{PlanOptions, SaveInput, SavePlan};

use crate::error::{Error, Result};
use crate::save::checksum::{combine_crcs, CrcRun};
use crate::save::commit::{
    commit_under, files_left_alone, wait_for_commit, CommitRule, CommitState,
};
use crate::save::compressing::CompressedFile;
use crate::save::decide::{plan_options, Decided};
use crate::save::delta::DeltaOf;
use crate::save::owned::{claim_shards, reclaim_ended_saves, remove_own, Leftovers};
use crate::save::schedule::{Claimer, FileQueues};
use crate::save::sink::{FileSink, Files};
use crate::storage::at_once::{all_at_once, calls_at_once, each_at_once, STORE_CALLS_AT_ONCE};
use crate::storage::{Storage, WriteHandle};

use crate::save::options::{ProgressFn, SaveOptions};
use crate::save::report::SaveReport;

/// The tables every process of a save must be given alike, as this process was given them.
fn tables_given(input: &SaveInput<'_>) -> Vec<TableGiven> {
    input
        .tables
        .iter()
        .map(|t| TableGiven {
            name: t.name().to_string(),
            key_dtype: t.key_dtype(),
            slots: t.slots().to_vec(),
        })
        .collect()
}

/// [`save_to`] of a model ready to be written: a full checkpoint, or a delta's changed rows and
/// removed ids with the parent they are a delta of.
pub(crate) fn save_prepared(
    storage: &dyn Storage,
    input: SaveInput<'_>,
    opts: &SaveOptions,
    decided: &Decided,
    delta: Option<DeltaOf<'_>>,
) -> Result<SaveReport> {
    let t0 = Instant::now();
    let save_id = decided.save_id.clone();
    let plan_opts = plan_options(opts, &save_id);
    // Best effort: a store that fails here fails the save's own requests just after, with the
    // error that matters.
    let mut cleaned_up = storage.clean_ended_writers().unwrap_or_default();
    let shards: Vec<u32> = match plan_opts.shard_index {
        Some(i) => vec![i],
        None => (0..plan_opts.shard_num).collect(),
    };
    let single = plan_opts.shard_index.is_none();
    let writer = crate::storage::identity::current_writer();
    claim_shards(storage, &save_id, &shards, &writer)?;
    // What saves that were killed or crashed left here, once their writers have provably
    // ended: removed now, not left to pile up under the checkpoint that will commit here. Best
    // effort, as above.
    cleaned_up.extend(reclaim_ended_saves(storage, &save_id).unwrap_or_default());
    let mut shard_manifests_written = false;
    // A panic (in a filter, a table, the progress callback) fails the save as an error does:
    // its files go before the panic goes on.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        write_and_commit(
            storage,
            input,
            opts,
            &plan_opts,
            Shared {
                writer,
                decided,
                delta,
                t0,
            },
            &mut shard_manifests_written,
        )
    }));
    let rejected = match &outcome {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(matches!(e, Error::Rejected { .. })),
        Err(_) => Some(false),
    };
    if let Some(rejected) = rejected {
        let what = if single {
            Some(Leftovers::Everything)
        } else if !shard_manifests_written {
            Some(Leftovers::ShardsAndClaims)
        } else if rejected {
            Some(Leftovers::Shards)
        } else {
            // Written and durable: another process of the save may still commit it.
            None
        };
        if let Some(what) = what {
            remove_own(storage, &save_id, &shards, what);
        }
    }
    let result = outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    result.map(|report| SaveReport {
        cleaned_up,
        ..report
    })
}

/// What a save call knows before it plans.
struct Shared<'t> {
    writer: WriterInfo,
    decided: &'t Decided,
    delta: Option<DeltaOf<'t>>,
    t0: Instant,
}

fn write_and_commit(
    storage: &dyn Storage,
    input: SaveInput<'_>,
    opts: &SaveOptions,
    plan_opts: &PlanOptions,
    shared: Shared<'_>,
    shard_manifests_written: &mut bool,
) -> Result<SaveReport> {
    let save_id = plan_opts.save_id.clone();
    let tables_given = tables_given(&input);
    let table_semantics = input
        .all_tables()
        .map(|t| {
            let semantics = if t.point_in_time() {
                TableSemantics::PointInTime
            } else {
                TableSemantics::AsRead
            };
            (t.name().to_string(), semantics)
        })
        .collect();
    // Only a plan past its memory budget touches the spill.
    let spill = tables_past_budget(input.all_tables(), plan_opts.plan_memory)
        .contains(&true)
        .then(|| storage.spill())
        .transpose()?;
    let tracking: Vec<&dyn ChangeTracking> = input
        .all_tables()
        .filter_map(|t| t.change_tracking())
        .collect();
    let plan = plan_with_spill(&input, plan_opts, spill)?;
    // The moment each tracking table's snapshot was taken: what it is saved as of, once
    // committed.
    let mut tokens: Vec<(&dyn ChangeTracking, u64)> =
        tracking.iter().map(|&c| (c, c.last_snapshot())).collect();
    if let Some(d) = &shared.delta {
        tokens.extend(d.tracking.iter().copied());
    }
    let plan_seconds = shared.t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let written = write_plan(
        storage,
        &plan,
        plan_opts.parallel,
        opts.durable,
        opts.progress.as_deref(),
    )?;
    // Before any shard manifest: a source whose bytes fail their checksums is never committed,
    // nor a delta whose parent is gone.
    plan.finish_reads()?;
    if let Some(parent) = &shared.decided.parent {
        parent.check_held()?;
    }
    // After the writes, not before: a tensor read on demand (a device tensor staged through
    // the ring) then gives the CRC32s of the pieces its writers read, combined, rather than
    // being read a second time for them; one this process does not write is read for it here.
    let dense_given = plan.dense_given()?;
    // What the files hold as written, as their manifests record it: stored bytes where
    // compressed.
    let mut bytes_written = 0;
    let mut manifests = Vec::with_capacity(written.crcs.len());
    for (pos, shard_crcs) in written.crcs.iter().enumerate() {
        let mut m = plan.shard_manifest(
            pos,
            shard_crcs,
            &opts.user_metadata,
            opts.trainer_state.clone(),
        )?;
        m.writer = Some(shared.writer.clone());
        m.replaces = shared.decided.replaces.clone();
        m.step = opts.step;
        m.tables_given = tables_given.clone();
        m.dense_given = dense_given.clone();
        if let Some(d) = &shared.delta {
            m.parent = Some(d.parent.clone());
            m.dense_in_parent = d.dense_in_parent.clone();
        }
        m.format_version = format_version_of(
            m.parent.as_ref(),
            m.is_compressed(),
            !m.row_tables.is_empty(),
        );
        bytes_written += m.files.iter().map(|f| f.bytes).sum::<u64>();
        let json = serde_json::to_vec_pretty(&m).expect("manifests serialize");
        manifests.push((
            shard_manifest_name(&save_id, plan.shards()[pos].shard),
            json,
        ));
    }
    // Set before the writes, not after: once a shard manifest may exist, another process may
    // commit the set at any moment, so a failure from here on must not remove the shard.
    *shard_manifests_written = true;
    // Several at once on an object store: a round trip each.
    all_at_once(manifests, calls_at_once(storage), |(name, json)| {
        storage.put(&name, &json, opts.durable)
    })
    .into_iter()
    .collect::<Result<()>>()?;
    let write_seconds = t1.elapsed().as_secs_f64();
    let copy_on_write_peak_bytes = plan.copy_on_write_peak();
    // Durable: whichever call commits the save, these tables' next delta of it is tracked.
    let whole = !plan_opts.filters.has_row_filters();
    if whole {
        for &(c, token) in &tokens {
            c.written(&save_id, token);
        }
    }

    let t2 = Instant::now();
    let n = plan_opts.shard_num;
    // A managed save's rule checks its parent step under the root's lock; a plain delta's
    // parent is checked under its own directory's.
    let rule = opts.commit_rule.as_deref().or(shared
        .decided
        .parent
        .as_ref()
        .map(|p| p as &dyn CommitRule));
    let state = match (plan_opts.shard_index, opts.wait) {
        (Some(_), Some(timeout)) => {
            wait_for_commit(storage, &save_id, n, opts.durable, timeout, rule)?
        }
        _ => commit_under(storage, &save_id, n, opts.durable, rule)?,
    };
    if plan_opts.shard_index.is_none() && state != CommitState::CommittedHere {
        return Err(Error::Incomplete {
            dir: storage.location().into(),
            what: format!("single-process save {save_id} could not commit: {state:?}"),
        });
    }
    let left_alone = if state == CommitState::CommittedHere {
        files_left_alone(storage, &save_id)?
    } else {
        Vec::new()
    };
    let rows = plan
        .shards()
        .iter()
        .flat_map(|s| &s.partitions)
        .map(|p| p.rows.len() as u64)
        .sum::<u64>()
        + row_range_rows(&input.row_chunks);
    if matches!(state, CommitState::Committed | CommitState::CommittedHere) {
        for (c, token) in tokens {
            c.committed(whole.then_some(save_id.as_str()), token);
        }
    }
    Ok(SaveReport {
        save_id,
        shards: plan.shards().iter().map(|s| s.shard).collect(),
        files: plan.shards().iter().map(|s| s.files.len()).sum(),
        direct_io_files: written.direct_io_files,
        rows,
        bytes_written,
        spilled_rows: plan.spilled_rows(),
        skipped_rows: plan.skipped_rows(),
        plan_seconds,
        write_seconds,
        commit_seconds: t2.elapsed().as_secs_f64(),
        committed: matches!(state, CommitState::Committed | CommitState::CommittedHere),
        committed_here: state == CommitState::CommittedHere,
        replaced: shared
            .decided
            .replaces
            .as_ref()
            .filter(|_| state == CommitState::CommittedHere)
            .map(|c| c.save_id.clone()),
        left_alone,
        cleaned_up: Vec::new(),
        table_semantics,
        delta_tables: shared.delta.map(|d| d.methods).unwrap_or_default(),
        copy_on_write_peak_bytes,
    })
}

/// The rows of row-range tables given: per table, those of the chunks of its first slot.
fn row_range_rows(chunks: &[saver_core::RowRangeChunk<'_>]) -> u64 {
    let mut first: BTreeMap<&str, &str> = BTreeMap::new();
    for c in chunks {
        let slot = first.entry(c.table()).or_insert(c.slot());
        *slot = (*slot).min(c.slot());
    }
    chunks
        .iter()
        .filter(|c| first.get(c.table()) == Some(&c.slot()))
        .map(|c| c.rows().end - c.rows().start)
        .sum()
}

/// What [`write_plan`] wrote.
#[derive(Debug)]
pub(crate) struct PlanWritten {
    /// Checksums of every tensor, as `crcs[shard][file][tensor]`.
    pub crcs: Vec<Vec<Vec<TensorCrc>>>,
    /// Data files written with direct I/O (see [`WriteHandle::is_direct`]).
    pub direct_io_files: usize,
}

/// Writes every file of the plan. On error, every file this call created is removed.
pub(crate) fn write_plan(
    storage: &dyn Storage,
    plan: &SavePlan<'_>,
    parallel: usize,
    durable: bool,
    progress: Option<&ProgressFn>,
) -> Result<PlanWritten> {
    let abort_all = |handles: Vec<Vec<Box<dyn WriteHandle>>>| {
        handles.into_iter().flatten().for_each(|h| h.abort())
    };
    // On an object store each creation is two round trips (the upload and its marker): the
    // files are created several at once.
    let at_once = calls_at_once(storage);
    let wanted: Vec<(usize, &saver_core::plan::FilePlan)> = plan
        .shards()
        .iter()
        .enumerate()
        .flat_map(|(pos, shard)| shard.files.iter().map(move |f| (pos, f)))
        .collect();
    // The first failure stops further creations (the batch it is in still completes).
    let created = each_at_once(
        wanted,
        at_once,
        |(pos, f)| (pos, storage.create(&f.name, f.file_len())),
        |(_, h)| h.is_ok(),
    );
    let mut handles: Vec<Vec<Box<dyn WriteHandle>>> =
        plan.shards().iter().map(|_| Vec::new()).collect();
    let mut failed_create = None;
    for (pos, h) in created {
        match h {
            Ok(h) => handles[pos].push(h),
            Err(e) => {
                failed_create.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failed_create {
        abort_all(handles);
        return Err(e);
    }
    let direct_io_files = handles.iter().flatten().filter(|h| h.is_direct()).count();
    // A compressed save stores each file front to back as its frames are compressed.
    let compressed: Option<Vec<Vec<CompressedFile<'_>>>> = plan.options().compression.map(|c| {
        plan.shards()
            .iter()
            .zip(&handles)
            .map(|(shard, hs)| {
                hs.iter()
                    .enumerate()
                    .map(|(f, h)| CompressedFile::new(shard, f, &**h, c.level, durable))
                    .collect()
            })
            .collect()
    });
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(parallel)
        .thread_name(|i| format!("saver-write-{i}"))
        .build()
        .map_err(|e| Error::InvalidOption {
            option: "parallel",
            why: e.to_string(),
        })?;
    // Each thread writes one file front to back: see `schedule.rs`.
    let queues = FileQueues::new(plan.chunks().into_iter().map(|c| (plan.chunk_file(&c), c)));
    let failed = AtomicBool::new(false);
    let files = Files {
        plan,
        handles: &handles,
        compressed: compressed.as_deref(),
        durable,
        progress,
        done: &AtomicU64::new(0),
        total: plan.data_bytes(),
    };
    let written: Vec<Result<Vec<CrcRun>>> = pool.broadcast(|_| {
        let mut buf = ChunkBuffer::default();
        let mut sink = FileSink::new(&files);
        let mut place = Claimer::default();
        while !failed.load(Ordering::Relaxed) {
            let Some(chunk) = queues.claim(&mut place) else {
                break;
            };
            if let Err(e) = plan.produce(chunk, &mut buf, &mut sink) {
                failed.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
        Ok(sink.crcs.finish())
    });
    let written: Result<Vec<Vec<CrcRun>>> = written.into_iter().collect();
    let finished = written.and_then(|runs| {
        let mut crcs = combine_crcs(plan, runs.into_iter().flatten().collect())?;
        if let Some(files) = compressed {
            for ((shard_files, shard_crcs), (shard, hs)) in files
                .into_iter()
                .zip(crcs.iter_mut())
                .zip(plan.shards().iter().zip(&handles))
            {
                for (((file, file_crcs), fp), h) in shard_files
                    .into_iter()
                    .zip(shard_crcs.iter_mut())
                    .zip(&shard.files)
                    .zip(hs)
                {
                    let (stored, data_len) = file.finish()?;
                    for (c, s) in file_crcs.iter_mut().zip(stored) {
                        c.stored = Some(s);
                    }
                    h.truncate(fp.data_start + data_len)?;
                }
            }
        }
        for (pos, shard) in plan.shards().iter().enumerate() {
            for (f, _) in shard.files.iter().enumerate() {
                handles[pos][f].write_at(0, &plan.header(pos, f, &crcs[pos][f])?)?;
            }
        }
        Ok(crcs)
    });
    let crcs = match finished {
        Ok(c) => c,
        Err(e) => {
            abort_all(handles);
            return Err(e);
        }
    };
    // fsync and rename every file, several at once: fsync is where durable saves spend their
    // time. On an object store, a commit waits for the file's last parts and then completes the
    // upload, round trips that go together whatever the writer threads.
    let commits: Vec<Result<()>> = if storage.is_remote() {
        let files: Vec<Box<dyn WriteHandle>> = handles.into_iter().flatten().collect();
        all_at_once(files, STORE_CALLS_AT_ONCE, |h| h.commit(durable))
    } else {
        pool.install(|| {
            handles
                .into_par_iter()
                .flatten()
                .map(|h| h.commit(durable))
                .collect()
        })
    };
    if let Some(e) = commits.into_iter().find_map(Result::err) {
        // Files already renamed carry this save's id and no manifest names them: they are never
        // part of a checkpoint, and the next save of this shard or the next commit removes them.
        return Err(e);
    }
    if durable {
        storage.sync_dir()?;
    }
    Ok(PlanWritten {
        crcs,
        direct_io_files,
    })
}

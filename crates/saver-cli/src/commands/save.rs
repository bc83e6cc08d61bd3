//! `saver save`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use serde::Serialize;

use saver_core::synthetic::{SyntheticModel, SyntheticSpec};
use saver_core::SaveInput;
use saver_core::ScalarCondition;
use saver_io::source::Source;
use saver_io::tools::reshard::with_source_input;
use saver_io::{save, CheckpointManager, SaveOptions, SaveReport, SaveSettings};

use super::CmdResult;
use crate::cli::{DirectIoWhen, SaveArgs};
use crate::output;

/// A save's outcome: its report, what retention did (with --root), why it was full (with
/// --root), the seconds the model's input took before the save began.
type Saved = (
    SaveReport,
    Option<saver_io::manage::PruneReport>,
    Option<String>,
    f64,
);

#[derive(Serialize)]
struct Report<'a> {
    out: String,
    /// With --root: what retention did after the commit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pruned: Option<&'a saver_io::manage::PruneReport>,
    /// With --root: why the step was saved full rather than as a delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    full_because: Option<&'a str>,
    #[serde(flatten)]
    save: &'a SaveReport,
    input_seconds: f64,
    throughput_bytes_per_second: f64,
}

/// The save's options from its flags, through the library's one mapping of save settings: a
/// refusal names the flag (`--keep-rows`, from the setting `keep_rows`).
fn options(args: &SaveArgs) -> Result<SaveOptions, Box<dyn std::error::Error>> {
    let wait_seconds = match args.wait_seconds.as_deref() {
        None => None,
        Some(w) => Some(
            w.trim()
                .parse::<f64>()
                .map_err(|_| format!("--wait-seconds {w:?}: give a number of seconds"))?,
        ),
    };
    let settings = {
        let mut s = SaveSettings {
            shards: args.shards,
            shard_index: args.shard_index,
            save_id: args.save_id.clone(),
            parallel: Some(args.parallel),
            step: args.step,
            overwrite: args.overwrite,
            durable: !args.no_fsync,
            ..Default::default()
        };
        // Every process builds or reads the whole model and saves its own shard of it.
        s.skip_foreign_rows = true;
        s.parent = args.parent.clone();
        s.exclude_slots = args.exclude_slots.clone();
        s.tables = args.tables.clone();
        s.keep_rows = args.keep_rows.clone();
        if let Some(c) = args.compress.compression() {
            s.compress = Some("zstd".into());
            s.compress_level = Some(c.level);
        }
        s.direct_io = match args.direct_io {
            DirectIoWhen::Auto => "auto",
            DirectIoWhen::On => "on",
            DirectIoWhen::Off => "off",
        }
        .into();
        s.wait_seconds = wait_seconds;
        s.max_file_size = Some(args.max_file_size);
        s.plan_memory = Some(args.plan_memory);
        s
    };
    settings.options().map_err(|e| match e {
        saver_io::Error::InvalidOption { option, why } => {
            format!("--{}: {why}", option.replace('_', "-")).into()
        }
        e => e.into(),
    })
}

pub(super) fn run(args: SaveArgs) -> CmdResult {
    if args.shard_index.is_some() && args.save_id.is_none() {
        return Err(
            "--shard-index needs --save-id: the same id in every process of this save, \
                    and a new one for every save and every retry (e.g. run7-step1200-a1)"
                .into(),
        );
    }
    let mut opts = options(&args)?;

    // A managed root: the step's directory under it, and the manager that decides full or delta
    // and applies retention after the commit.
    let manager = match &args.root {
        Some(root) => {
            // The policy the root keeps, with the flags given (kept in the root from now on).
            let kept = CheckpointManager::open_kept(root)?;
            let policy = super::manage::policy_with(kept.policy(), &args.policy)?;
            let m = CheckpointManager::open(root, policy)?;
            // A step out of order is refused before the model is read or its directory made.
            m.check_step(args.step.expect("--root requires --step"), args.overwrite)?;
            if args.full {
                m.force_full();
            }
            Some(m)
        }
        None => None,
    };
    let out: PathBuf = match (&manager, &args.out) {
        (Some(m), _) => m
            .root()
            .step_path(args.step.expect("--root requires --step")),
        (None, Some(out)) => out.clone(),
        (None, None) => return Err("one of --out or --root is required".into()),
    };
    let t0 = Instant::now();
    let progress = output::byte_progress(args.out_fmt.json, "writing");
    opts.progress = progress.as_ref().map(|(_, f)| f.clone());
    let step = args.step;
    // Full or delta (with --parent) is the library's choice, from the options; a table read
    // from files is compared with the parent as it is read, in bounded memory.
    let save_it =
        |input: SaveInput<'_>, opts: &SaveOptions| -> Result<Saved, Box<dyn std::error::Error>> {
            let input_seconds = t0.elapsed().as_secs_f64();
            // A condition on a slot no table has would silently keep every row.
            for c in &args.keep_rows {
                let cond: ScalarCondition = c.parse()?;
                if !input
                    .tables
                    .iter()
                    .any(|t| t.slots().iter().any(|s| s.name == cond.slot))
                {
                    return Err(
                        format!("--keep-rows {c:?}: no table has a slot {:?}", cond.slot).into(),
                    );
                }
            }
            let (report, pruned, full_because) = match &manager {
                Some(m) => {
                    let mut opts = opts.clone();
                    opts.step = None;
                    let done = m.save(step.expect("--root requires --step"), input, &opts)?;
                    (done.save, done.pruned, done.full_because)
                }
                None => (save(&out, input, opts)?, None, None),
            };
            Ok((report, pruned, full_because, input_seconds))
        };
    let (report, pruned, full_because, input_seconds) = match (&args.synthetic, &args.from) {
        (Some(spec), _) => {
            if args.import_rounds.is_some() {
                return Err(
                    "--import-rounds applies to a plain input (--from), not --synthetic".into(),
                );
            }
            let spec: SyntheticSpec = spec.parse()?;
            let synthetic = SyntheticModel::generate(&spec)?;
            // Row-range tables (kind=rows): each process holds the rows of its shard.
            let mut input = synthetic.input();
            input.row_chunks = synthetic.row_chunks(opts.plan.shard_num, opts.plan.shard_index)?;
            save_it(input, &opts)?
        }
        (None, Some(path)) => {
            let source = Source::open(path)?;
            for w in source.warnings() {
                eprintln!("warning: {w}");
            }
            // A managed save's scratch is beside its root, which exists: the step's directory is
            // made by the save, and removed by it if the save fails before writing anything.
            let beside = manager
                .as_ref()
                .map_or(out.as_path(), |m| m.root().location());
            let rounds = args.import_rounds.map(|r| r as usize);
            with_source_input(&source, &mut opts, beside, rounds, save_it)?
        }
        (None, None) => return Err("one of --synthetic or --from is required".into()),
    };
    if let Some((bar, _)) = progress {
        bar.finish_and_clear();
    }
    note_left_alone(&out, &report);
    let throughput = report.bytes_written as f64 / report.write_seconds.max(1e-9);
    if args.out_fmt.json {
        output::json(&Report {
            out: out.display().to_string(),
            save: &report,
            full_because: full_because.as_deref(),
            pruned: pruned.as_ref(),
            input_seconds,
            throughput_bytes_per_second: throughput,
        });
    } else {
        println!(
            "saved {} rows in {} files ({}) to {} in {:.2}s ({}); save id {}",
            report.rows,
            report.files,
            output::size(report.bytes_written),
            out.display(),
            report.write_seconds,
            output::rate(report.bytes_written, report.write_seconds),
            report.save_id
        );
        println!(
            "  model input {:.2}s, plan {:.2}s{}, {}, commit {:.2}s; {}",
            input_seconds,
            report.plan_seconds,
            if report.spilled_rows > 0 {
                format!(" ({} rows spilled past --plan-memory)", report.spilled_rows)
            } else {
                String::new()
            },
            write_path(&out, report.direct_io_files, report.files),
            report.commit_seconds,
            match (report.committed, report.committed_here) {
                (true, true) => "committed".to_string(),
                (true, false) => "committed by another process".to_string(),
                _ => format!(
                    "shard(s) {:?} durable, waiting for the other shards to commit",
                    report.shards
                ),
            }
        );
    }
    if let (Some(why), false) = (&full_because, args.out_fmt.json) {
        if manager.is_some() {
            println!("  a full save: {why}");
        }
    }
    if let (Some(p), false) = (&pruned, args.out_fmt.json) {
        if !p.removed.is_empty() {
            println!(
                "  retention removed step(s) {:?} ({}); kept {:?}",
                p.removed,
                output::size(p.bytes_removed),
                p.kept
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn note_left_alone(out: &std::path::Path, report: &SaveReport) {
    let saver_like: Vec<&String> = report
        .left_alone
        .iter()
        .filter(|n| saver_core::naming::SaverFile::parse(n).is_some())
        .collect();
    if !report.cleaned_up.is_empty() {
        eprintln!(
            "note: cleaned up {} thing(s) that ended processes of this host left unfinished in \
             {} (uploads, a killed save's files)",
            report.cleaned_up.len(),
            out.display()
        );
    }
    if saver_like.is_empty() {
        return;
    }
    let mut saves: Vec<&str> = saver_like
        .iter()
        .filter_map(|n| saver_core::naming::SaverFile::parse(n).map(|f| f.save_id()))
        .collect();
    saves.sort_unstable();
    saves.dedup();
    eprintln!(
        "note: left {} file(s) of other saves ({}) in {}: in progress, or left by a save that \
         failed or crashed; remove them once no such save runs",
        saver_like.len(),
        saves.join(", "),
        out.display()
    );
}

/// How the data files were written, for the text report: a slow save through the page cache on a
/// disk that suits direct I/O is worth a look at `--direct-io`.
fn write_path(out: &std::path::Path, direct: usize, files: usize) -> String {
    match direct {
        _ if saver_io::storage::location_url(out).is_some() => "uploaded".to_string(),
        0 => "written through the page cache".to_string(),
        d if d == files => "written with direct I/O".to_string(),
        d => format!("{d} of {files} files written with direct I/O"),
    }
}

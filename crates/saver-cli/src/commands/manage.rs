//! `saver list`, `saver latest`, `saver prune` and `saver clean`: a managed root's steps.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use saver_io::manage::{CheckpointManager, Policy, Retention, Root};

use super::CmdResult;
use crate::cli::{CleanArgs, LatestArgs, ListArgs, PolicyArgs, PruneArgs, RetentionArgs};
use crate::output;

/// `kept` (a root's policy) with the flags given applied.
pub(super) fn policy_with(kept: &Policy, flags: &PolicyArgs) -> Result<Policy, saver_io::Error> {
    let mut p = kept.clone();
    if let Some(n) = flags.full_every {
        p.full_every = n;
    }
    if let Some(n) = flags.max_chain_links {
        p.max_chain_links = n;
    }
    p.retention = retention_with(&p.retention, &flags.retention)?;
    p.check()?;
    Ok(p)
}

/// `kept` (a root's retention) with the flags given applied.
fn retention_with(kept: &Retention, flags: &RetentionArgs) -> Result<Retention, saver_io::Error> {
    let mut r = kept.clone();
    if let Some(k) = flags.keep_latest {
        r.keep_latest = k;
    }
    if let Some(n) = flags.keep_every {
        r.keep_every = Some(n);
    }
    if let Some(n) = flags.keep_one_per_seconds {
        r.keep_one_per_seconds = Some(n);
    }
    r.keep_steps.extend(flags.keep_step.iter().copied());
    r.check()?;
    Ok(r)
}

/// The path of step `step` (`latest` or a number) of `root`: an error when the root holds no
/// such committed step.
/// Reads no policy: a restart must not depend on retention's settings.
pub(super) fn step_path(root: &Path, step: &str) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let root = Root::open_existing(root)?;
    if step == "latest" {
        return match root.latest()? {
            Some(s) => Ok(s.path),
            None => Err(format!("{} holds no committed step", root.location().display()).into()),
        };
    }
    let n: u64 = step
        .parse()
        .map_err(|_| format!("--step {step:?}: expected a step number or `latest`"))?;
    root.open_step(n)?;
    Ok(root.step_path(n))
}

/// The newest step of `root` that verifies (`--fallback`, with `--step latest` only), saying on
/// stderr which newer steps it passed over and why.
pub(super) fn verified_step_path(
    root: &Path,
    step: &str,
    parallel: usize,
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    if step != "latest" {
        return Err(format!("--fallback goes with --step latest, not --step {step}").into());
    }
    let found = Root::open_existing(root)?.latest_verified(parallel)?;
    for (s, why) in &found.passed_over {
        eprintln!("saver: step {s} does not verify ({why}); falling back");
    }
    match found.step {
        Some(s) => {
            if !found.passed_over.is_empty() {
                eprintln!("saver: loading step {}, the newest that verifies", s.step);
            }
            Ok(s.path)
        }
        None => Err(format!("{} holds no committed step that verifies", root.display()).into()),
    }
}

/// When a save started, in UTC to the second (`-` when unknown).
fn started(unix_ms: u64) -> String {
    if unix_ms == 0 {
        return "-".into();
    }
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// The processes that wrote a step, each once (in-process shards share their process).
fn writer_processes(writers: &[String]) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for w in writers {
        if !seen.contains(&w.as_str()) {
            seen.push(w);
        }
    }
    seen.join(",")
}

pub(super) fn list(args: ListArgs) -> CmdResult {
    let listing = Root::open_existing(&args.root)?.list()?;
    if args.out.json {
        output::json(&listing);
        return Ok(ExitCode::SUCCESS);
    }
    println!("step\tkind\tlinks\tsize\tstarted\twriters");
    for s in &listing.steps {
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            s.step,
            if s.is_delta() { "delta" } else { "full" },
            s.links,
            output::size(s.bytes),
            started(s.started_unix_ms),
            writer_processes(&s.writers)
        );
    }
    for s in &listing.uncommitted {
        println!("{s}\tnot committed (a save under way, or a crashed one's: see saver clean)");
    }
    for (s, why) in &listing.broken {
        println!("{s}\tunreadable: {why}");
    }
    for (s, n) in &listing.others_beside {
        println!(
            "{s}\t{n} file(s) of other saves beside the committed one (a save under way, or a \
             killed one's: see saver clean)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) fn latest(args: LatestArgs) -> CmdResult {
    // A root that does not exist is an error, not "no step yet" (exit 3): a restart script
    // must not start from scratch on a mistyped path.
    let latest = Root::open_existing(&args.root)?.latest()?;
    if args.out.json {
        output::json(&latest);
    }
    match latest {
        Some(s) => {
            if !args.out.json {
                println!("{}\t{}", s.step, s.path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        None => {
            if !args.out.json {
                eprintln!("{} holds no committed step", args.root.display());
            }
            Ok(ExitCode::from(3))
        }
    }
}

pub(super) fn prune(args: PruneArgs) -> CmdResult {
    Root::open_existing(&args.root)?;
    let m = CheckpointManager::open_kept(&args.root)?;
    let retention = retention_with(&m.policy().retention, &args.retention)?;
    let r = m.prune(Some(&retention), args.dry_run)?;
    if args.out.json {
        output::json(&r);
    } else {
        println!(
            "{} {} step(s) ({}): {:?}; kept {:?}",
            if args.dry_run {
                "would remove"
            } else {
                "removed"
            },
            r.removed.len(),
            output::size(r.bytes_removed),
            r.removed,
            r.kept
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) fn clean(args: CleanArgs) -> CmdResult {
    // Reclaiming leftovers needs no policy.
    let root = Root::open_existing(&args.root)?;
    let r = saver_io::manage::clean::clean(&root, args.dry_run)?;
    if args.out.json {
        output::json(&r);
    } else {
        println!(
            "{} the leftovers of {} step(s): {:?}",
            if args.dry_run {
                "would reclaim"
            } else {
                "reclaimed"
            },
            r.reclaimed.len(),
            r.reclaimed
        );
        for (step, why) in &r.left_alone {
            println!("left step {step} alone: {why}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

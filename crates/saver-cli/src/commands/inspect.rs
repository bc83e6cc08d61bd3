//! `saver inspect`: prints [`saver_io::tools::inspect::inspect`]'s summary.

use std::process::ExitCode;

use saver_io::tools::inspect::inspect;

use super::CmdResult;
use crate::cli::InspectArgs;
use crate::output;

pub(super) fn run(args: InspectArgs) -> CmdResult {
    let InspectArgs { dir, out } = args;
    let dir = dir.as_path();
    let report = inspect(dir)?;
    if out.json {
        output::json(&report);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "checkpoint {} (format v{}, save id {}{})",
        report.dir,
        report.format_version,
        report.save_id,
        report.step.map_or(String::new(), |s| format!(", step {s}"))
    );
    println!(
        "  {} shards, {} files, {}; partition rule {} over {} buckets",
        report.shards,
        report.files.len(),
        output::size(report.total_bytes),
        report.partition_rule.kind,
        report.partition_rule.buckets
    );
    if !report.tables.is_empty() || report.row_tables.is_empty() {
        println!("tables:");
    }
    for t in &report.tables {
        let slots: Vec<String> = t
            .slots
            .iter()
            .map(|s| format!("{} {}{:?}", s.name, s.dtype, s.shape))
            .collect();
        // A compressed table also says what it takes in the files.
        let stored = if report.format_version >= saver_core::COMPRESSED_FORMAT_VERSION {
            format!(" ({} stored)", output::size(t.stored_bytes))
        } else {
            String::new()
        };
        println!(
            "  {:<24} {:>12} rows  {:>10}{stored}  ids {}  slots: {}",
            t.name,
            t.rows,
            output::size(t.bytes),
            t.key_dtype,
            slots.join(", ")
        );
    }
    if !report.row_tables.is_empty() {
        println!("row-range tables (ids are row numbers):");
        for t in &report.row_tables {
            let slots: Vec<String> = t
                .slots
                .iter()
                .map(|s| {
                    let mut line =
                        format!("{} {}{:?} in {} chunks", s.name, s.dtype, s.shape, s.chunks);
                    if s.patches > 0 {
                        line += &format!(
                            " and {} patches of {} changed rows",
                            s.patches, s.changed_rows
                        );
                    }
                    line
                })
                .collect();
            println!(
                "  {:<24} {:>12} rows  {:>10}  slots: {}",
                t.name,
                t.rows,
                output::size(t.bytes),
                slots.join(", ")
            );
        }
    }
    if !report.dense.is_empty() {
        println!("dense:");
        for d in &report.dense {
            println!(
                "  {:<40} {} {:?}  {}  shard {}",
                d.name,
                d.dtype,
                d.shape,
                output::size(d.bytes),
                d.shard
            );
        }
    }
    println!("files:");
    for f in &report.files {
        println!(
            "  {:<48} shard {:>4}  {:>10}  {} tensors",
            f.name,
            f.shard,
            output::size(f.bytes),
            f.tensors
        );
    }
    if !report.writers.is_empty() {
        println!("written by {}", report.writers.join(", "));
    }
    for (k, v) in &report.user_metadata {
        println!("metadata {k} = {v}");
    }
    match &report.chain {
        None => {}
        Some(Ok(links)) => {
            println!(
                "delta: tables hold the rows changed since the parent, <table>:removed the ids \
                 removed; chain of {} links, newest first:",
                links.len()
            );
            for l in links {
                println!(
                    "  {}  save {}  {}  {}",
                    l.dir,
                    l.save_id,
                    if l.delta { "delta" } else { "full" },
                    output::size(l.bytes)
                );
            }
        }
        Some(Err(e)) => println!("delta: its chain cannot be followed: {e}"),
    }
    if !report.trainer_state_shards.is_empty() {
        println!(
            "trainer state saved by shards {:?}",
            report.trainer_state_shards
        );
    }
    Ok(ExitCode::SUCCESS)
}

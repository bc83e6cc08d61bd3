//! `saver inspect`.

use std::path::Path;
use std::process::ExitCode;

use serde::Serialize;

use saver_core::{Dtype, KeyDtype, PartitionRule};
use saver_io::{Chain, Checkpoint};

use super::CmdResult;
use crate::cli::Output;
use crate::output;

#[derive(Serialize)]
struct Slot {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
}

#[derive(Serialize)]
struct Table {
    name: String,
    key_dtype: KeyDtype,
    rows: u64,
    rows_per_shard: Vec<u64>,
    slots: Vec<Slot>,
    bytes: u64,
}

#[derive(Serialize)]
struct Dense {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    bytes: u64,
    shard: u32,
}

#[derive(Serialize)]
struct File {
    name: String,
    shard: u32,
    bytes: u64,
    tensors: u32,
}

#[derive(Serialize)]
struct Report {
    dir: String,
    format_version: u32,
    save_id: String,
    partition_rule: PartitionRule,
    shards: u32,
    tables: Vec<Table>,
    dense: Vec<Dense>,
    files: Vec<File>,
    total_bytes: u64,
    user_metadata: std::collections::BTreeMap<String, String>,
    trainer_state_shards: Vec<u32>,
    /// The process that wrote each shard (`host:pid`), in shard order, where the manifest names it.
    writers: Vec<String>,
    /// For a delta: the parent as the manifest names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<saver_core::ParentRef>,
    /// For a delta: every link of the chain, newest first, or why it cannot be followed.
    #[serde(skip_serializing_if = "Option::is_none")]
    chain: Option<Result<Vec<Link>, String>>,
}

#[derive(Serialize)]
struct Link {
    dir: String,
    save_id: String,
    delta: bool,
    bytes: u64,
}

/// The links of the chain of the delta in `dir`, or why they cannot be followed.
fn chain_of(dir: &Path) -> Result<Vec<Link>, String> {
    let chain = Chain::open(dir).map_err(|e| e.to_string())?;
    Ok(chain
        .links()
        .iter()
        .zip(chain.dirs())
        .map(|(c, d)| Link {
            dir: d.display().to_string(),
            save_id: c.manifest().save_id.clone(),
            delta: c.manifest().parent.is_some(),
            bytes: c.manifest().files.iter().map(|f| f.bytes).sum(),
        })
        .collect())
}

pub fn run(dir: &Path, out: Output) -> CmdResult {
    let ck = Checkpoint::open(dir)?;
    let m = ck.manifest();
    let report = Report {
        dir: dir.display().to_string(),
        format_version: m.format_version,
        save_id: m.save_id.clone(),
        partition_rule: m.partition.clone(),
        shards: m.shard_num,
        tables: m
            .tables
            .iter()
            .map(|t| {
                let mut per = vec![0; m.shard_num as usize];
                let mut bytes = 0;
                for p in &t.partitions {
                    per[p.shard as usize] += p.rows;
                    for s in &p.segments {
                        bytes += s.ids.len + s.slots.iter().map(|x| x.len).sum::<u64>();
                    }
                }
                Table {
                    name: t.name.clone(),
                    key_dtype: t.key_dtype,
                    rows: t.rows,
                    rows_per_shard: per,
                    slots: t
                        .slots
                        .iter()
                        .map(|s| Slot {
                            name: s.name.clone(),
                            dtype: s.dtype,
                            shape: s.shape.clone(),
                        })
                        .collect(),
                    bytes,
                }
            })
            .collect(),
        dense: m
            .dense
            .iter()
            .map(|d| Dense {
                name: d.tensor.name.clone(),
                dtype: d.tensor.dtype,
                shape: d.tensor.shape.clone(),
                bytes: d.tensor.len,
                shard: d.shard,
            })
            .collect(),
        files: m
            .files
            .iter()
            .map(|f| File {
                name: f.name.clone(),
                shard: f.shard,
                bytes: f.bytes,
                tensors: f.tensors,
            })
            .collect(),
        total_bytes: m.files.iter().map(|f| f.bytes).sum(),
        user_metadata: m.user_metadata.clone(),
        trainer_state_shards: m
            .shards
            .iter()
            .filter(|s| s.trainer_state.is_some())
            .map(|s| s.shard)
            .collect(),
        writers: m
            .shards
            .iter()
            .filter_map(|s| s.writer.as_ref())
            .map(|w| format!("{}:{}", w.host, w.pid))
            .collect(),
        parent: m.parent.clone(),
        chain: m.parent.as_ref().map(|_| chain_of(dir)),
    };
    if out.json {
        output::json(&report);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "checkpoint {} (format v{}, save id {})",
        report.dir, report.format_version, report.save_id
    );
    println!(
        "  {} shards, {} files, {}; partition rule {} over {} buckets",
        report.shards,
        report.files.len(),
        output::size(report.total_bytes),
        report.partition_rule.kind,
        report.partition_rule.buckets
    );
    println!("tables:");
    for t in &report.tables {
        let slots: Vec<String> = t
            .slots
            .iter()
            .map(|s| format!("{} {}{:?}", s.name, s.dtype, s.shape))
            .collect();
        println!(
            "  {:<24} {:>12} rows  {:>10}  ids {}  slots: {}",
            t.name,
            t.rows,
            output::size(t.bytes),
            t.key_dtype,
            slots.join(", ")
        );
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

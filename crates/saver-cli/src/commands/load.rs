//! `saver load`.

use std::path::Path;
use std::process::ExitCode;

use serde::Serialize;

use saver_io::digest::restored_digest;
use saver_io::{Checkpoint, LoadOptions, LoadReport};

use super::CmdResult;
use crate::cli::Output;
use crate::output;

#[derive(Serialize)]
struct Report<'a> {
    dir: String,
    shards: u32,
    shard_index: Option<u32>,
    tables: usize,
    dense: usize,
    #[serde(flatten)]
    load: &'a LoadReport,
    digest: String,
}

pub fn run(
    dir: &Path,
    shards: u32,
    shard_index: Option<u32>,
    parallel: usize,
    out: Output,
) -> CmdResult {
    let ck = Checkpoint::open(dir)?;
    let r = ck.restore(&LoadOptions {
        shard_num: shards,
        shard_index,
        parallel,
        ..LoadOptions::default()
    })?;
    let report = Report {
        dir: dir.display().to_string(),
        shards,
        shard_index,
        tables: ck.manifest().tables.len(),
        dense: r.dense.len(),
        load: &r.report,
        digest: restored_digest(&r),
    };
    if out.json {
        output::json(&report);
    } else {
        let which = match shard_index {
            Some(j) => format!("shard {j} of {shards}"),
            None => format!("all {shards} shard(s)"),
        };
        println!(
            "loaded {which}: {} rows, {} dense tensors, {} kept of {} read (read amplification {:.3}) in {:.2}s ({})",
            r.report.rows,
            r.dense.len(),
            output::size(r.report.bytes_kept),
            output::size(r.report.bytes_read),
            r.report.read_amplification,
            r.report.load_seconds,
            output::rate(r.report.bytes_read, r.report.load_seconds)
        );
        println!("digest {}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}

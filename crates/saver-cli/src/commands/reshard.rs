//! `saver reshard`.

use std::path::Path;
use std::process::ExitCode;

use saver_io::reshard::reshard;
use saver_io::{Checkpoint, SaveOptions};

use super::CmdResult;
use crate::cli::Output;
use crate::output;

pub fn run(
    src: &Path,
    out: &Path,
    shards: u32,
    parallel: usize,
    overwrite: bool,
    durable: bool,
    fmt: Output,
) -> CmdResult {
    let ck = Checkpoint::open(src)?;
    let mut opts = SaveOptions {
        durable,
        overwrite,
        ..SaveOptions::default()
    };
    opts.plan.shard_num = shards;
    opts.plan.parallel = parallel;
    let r = reshard(&ck, out, &opts)?;
    if fmt.json {
        output::json(&r);
    } else {
        println!(
            "resharded {} ({} shards) into {} ({} shards): {} rows, {} files, {} in {:.2}s",
            src.display(),
            ck.manifest().shard_num,
            out.display(),
            shards,
            r.rows,
            r.files,
            output::size(r.bytes_written),
            r.write_seconds
        );
    }
    Ok(ExitCode::SUCCESS)
}

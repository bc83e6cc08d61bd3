//! `saver reshard` and `saver compact`: both rewrite a checkpoint, resolved over its chain if it
//! is a delta, as one full checkpoint.

use std::path::Path;
use std::process::ExitCode;

use saver_io::load::checkpoint::read_latest;
use saver_io::tools::reshard::reshard as rewrite;
use saver_io::{Checkpoint, SaveOptions};

use super::CmdResult;
use crate::cli::{CompactArgs, ReshardArgs, RewriteFlags};
use crate::output;

/// `saver reshard`: a new shard count.
pub(super) fn reshard(args: ReshardArgs) -> CmdResult {
    run(&args.src, &args.out, Some(args.shards), &args.write)
}

/// `saver compact`: the chain's shard count unless told otherwise.
pub(super) fn compact(args: CompactArgs) -> CmdResult {
    run(&args.src, &args.out, args.shards, &args.write)
}

/// Rewrites `src` into `out` with `shards` shards (`None`: the source's).
fn run(src: &Path, out: &Path, shards: Option<u32>, write: &RewriteFlags) -> CmdResult {
    let RewriteFlags {
        parallel,
        overwrite,
        no_fsync,
        compress,
        out_fmt: fmt,
    } = *write;
    let durable = !no_fsync;
    let progress = output::byte_progress(fmt.json, "writing");
    // Read again if the source is replaced meanwhile (see `read_latest`).
    let (chain, shards, r) = read_latest(src, || {
        let chain = Checkpoint::open(src)?;
        let shards = shards.unwrap_or(chain.newest().manifest().shard_num);
        let mut opts = {
            let o = SaveOptions {
                durable,
                overwrite,
                progress: progress.as_ref().map(|(_, f)| f.clone()),
                ..Default::default()
            };
            o
        };
        opts.plan.shard_num = shards;
        opts.plan.parallel = parallel;
        opts.plan.compression = compress.compression();
        let r = rewrite(&chain, out, &opts)?;
        Ok((chain, shards, r))
    })?;
    if let Some((bar, _)) = progress {
        bar.finish_and_clear();
    }
    let from_shards = chain.newest().manifest().shard_num;
    if fmt.json {
        output::json(&r);
    } else {
        println!(
            "rewrote {}{} ({} shards) into {} ({} shards): {} rows, {} files, {} in {:.2}s",
            src.display(),
            if chain.is_delta() {
                format!(" and its {} parent(s)", chain.links().len() - 1)
            } else {
                String::new()
            },
            from_shards,
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

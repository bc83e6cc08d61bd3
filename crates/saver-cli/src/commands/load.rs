//! `saver load`.

use std::process::ExitCode;

use serde::Serialize;

use saver_core::Shard;
use saver_io::load::arrays::Columns;
use saver_io::tools::digest::{digest, Content, DigestVersion};
use saver_io::{Checkpoint, LoadOptions, LoadReport, LoadRequest, Restored};

use super::CmdResult;
use crate::cli::{LoadArgs, LoadTarget};
use crate::output;

#[derive(Serialize)]
struct Report<'a> {
    dir: String,
    shards: u32,
    shard_index: Option<u32>,
    tables: usize,
    dense: usize,
    /// Row-range tables read (the shard's rows of each), their rows and what was read.
    row_tables: usize,
    row_table_rows: u64,
    row_table_bytes_read: u64,
    #[serde(flatten)]
    load: &'a LoadReport,
    /// `None` with `--no-digest`.
    digest: Option<String>,
}

pub(super) fn run(args: LoadArgs) -> CmdResult {
    let LoadArgs {
        dir,
        step,
        fallback,
        shards,
        shard_index,
        parallel,
        into,
        huge_pages,
        no_digest,
        out,
    } = args;
    // A managed root's step: the newest committed one, or the one named.
    let dir = match &step {
        Some(step) if fallback => super::manage::verified_step_path(&dir, step, parallel)?,
        Some(step) => super::manage::step_path(&dir, step)?,
        None => dir,
    };
    let opts = {
        LoadOptions {
            shard_num: shards,
            shard_index,
            parallel,
            huge_pages,
            ..Default::default()
        }
    };
    // One request for both kinds of table, read from one save: a checkpoint replaced while it
    // is read is read again whole (`Checkpoint::load`).
    let ck = Checkpoint::open(&dir)?;
    let tables = ck.table_manifests().count();
    // The shard's rows of each row-range table, by the partition rule's row cut.
    let shard = shard_index.map_or(Shard::WHOLE, |index| Shard {
        index,
        count: shards,
    });
    let request = match into {
        LoadTarget::Tables => LoadRequest::tables(&opts),
        LoadTarget::Arrays => LoadRequest::columns(&opts),
    };
    let l = ck.load(request.row_tables(shard))?;
    let row_rows: u64 = l.row_tables.iter().map(|t| t.rows.end - t.rows.start).sum();
    let rows = (l.row_tables.len(), row_rows, l.rows.bytes_read);
    let dense = l.dense.len();
    let load = l.report.clone();
    let digest = if no_digest {
        None
    } else {
        let with_rows = |content: Content<'_>| {
            digest(
                Content::WithRowTables {
                    content: Box::new(content),
                    row_tables: &l.row_tables,
                },
                DigestVersion::V2,
            )
        };
        Some(match into {
            LoadTarget::Tables => with_rows(
                (&Restored {
                    shards: l.shards,
                    dense: l.dense,
                    report: l.report,
                })
                    .into(),
            )?,
            LoadTarget::Arrays => with_rows(
                (&Columns {
                    tables: l.columns,
                    dense: l.dense,
                    report: l.report,
                })
                    .into(),
            )?,
        })
    };
    let report = Report {
        dir: dir.display().to_string(),
        shards,
        shard_index,
        tables,
        dense,
        row_tables: rows.0,
        row_table_rows: rows.1,
        row_table_bytes_read: rows.2,
        load: &load,
        digest,
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
            load.rows,
            dense,
            output::size(load.bytes_kept),
            output::size(load.bytes_read),
            load.read_amplification,
            load.load_seconds,
            output::rate(load.bytes_read, load.load_seconds)
        );
        if rows.0 > 0 {
            println!(
                "row-range tables: {} rows of {} tables, {} read",
                rows.1,
                rows.0,
                output::size(rows.2)
            );
        }
        if let Some(d) = &report.digest {
            println!("digest {d}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

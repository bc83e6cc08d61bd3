//! `saver load`.

use std::process::ExitCode;

use serde::Serialize;

use saver_core::Shard;
use saver_io::load::checkpoint::read_latest;
use saver_io::tools::digest::{digest, Content, DigestVersion};
use saver_io::{Checkpoint, LoadOptions, LoadReport};

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
        let mut o = LoadOptions::default();
        o.shard_num = shards;
        o.shard_index = shard_index;
        o.parallel = parallel;
        o.huge_pages = huge_pages;
        o
    };
    // Opened again if it is replaced while it is read (see `read_latest`).
    let (tables, load, dense, rows, digest) = read_latest(&dir, || {
        let ck = Checkpoint::open(&dir)?;
        let tables = ck.table_manifests().count();
        // The shard's rows of each row-range table, by the cut the Python package uses.
        let shard = shard_index.map(|index| Shard {
            index,
            count: shards,
        });
        let (row_tables, rows) = ck.load_row_tables(shard)?;
        let with_rows = |content: Content<'_>| -> saver_io::Result<String> {
            digest(
                Content::WithRowTables {
                    content: Box::new(content),
                    row_tables: &row_tables,
                },
                DigestVersion::V2,
            )
        };
        let row_rows: u64 = row_tables.iter().map(|t| t.rows.end - t.rows.start).sum();
        let rows = (row_tables.len(), row_rows, rows.bytes_read);
        Ok(match into {
            LoadTarget::Tables => {
                let r = ck.restore(&opts)?;
                let digest = (!no_digest).then(|| with_rows((&r).into())).transpose()?;
                (tables, r.report, r.dense.len(), rows, digest)
            }
            LoadTarget::Arrays => {
                let c = ck.load_columns(&opts)?;
                let digest = (!no_digest).then(|| with_rows((&c).into())).transpose()?;
                (tables, c.report, c.dense.len(), rows, digest)
            }
        })
    })?;
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

//! `saver digest`.

use std::collections::BTreeMap;
use std::process::ExitCode;

use saver_core::SparseTable;
use saver_io::load::checkpoint::read_latest;
use saver_io::source::import::read_model;
use saver_io::source::Source;
use saver_io::tools::digest::{digest, Content, DigestVersion};

use super::CmdResult;
use crate::cli::DigestArgs;
use crate::output;

pub(super) fn run(args: DigestArgs) -> CmdResult {
    let DigestArgs {
        path,
        parallel,
        digest_version: version,
        out,
    } = args;
    let path = path.as_path();
    let digest = output::while_working(
        out.json,
        "reading",
        || -> Result<String, Box<dyn std::error::Error>> {
            Ok(if version == 1 {
                // Version 1 holds the model in memory, where row-range tables are not read.
                if let Ok(ck) = saver_io::Checkpoint::open(path) {
                    ck.refuse_row_tables("digest version 1")?;
                }
                let model = read_model(path, parallel)?;
                for w in &model.warnings {
                    eprintln!("warning: {w}");
                }
                let tables: BTreeMap<String, Vec<&dyn SparseTable>> = model
                    .tables
                    .iter()
                    .map(|t| {
                        (
                            SparseTable::name(t).to_string(),
                            vec![t as &dyn SparseTable],
                        )
                    })
                    .collect();
                digest(
                    Content::Tables {
                        tables: &tables,
                        dense: &model.dense,
                    },
                    DigestVersion::V1,
                )?
            } else {
                // Opened again if it is replaced while it is read (see `read_latest`).
                read_latest(path, || {
                    let source = Source::open(path)?;
                    for w in source.warnings() {
                        eprintln!("warning: {w}");
                    }
                    digest(
                        Content::Source {
                            source: &source,
                            parallel,
                        },
                        DigestVersion::V2,
                    )
                })?
            })
        },
    )?;
    if out.json {
        output::json(&serde_json::json!({
            "path": path.display().to_string(),
            "digest": digest,
            "digest_version": version,
        }));
    } else {
        println!("{digest}");
    }
    Ok(ExitCode::SUCCESS)
}

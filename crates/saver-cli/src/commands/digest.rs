//! `saver digest`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use saver_core::SparseTable;
use saver_io::digest::content_digest;
use saver_io::import::read_model;

use super::CmdResult;
use crate::cli::Output;
use crate::output;

pub fn run(path: &Path, parallel: usize, out: Output) -> CmdResult {
    let model = read_model(path, parallel)?;
    for w in &model.warnings {
        eprintln!("warning: {w}");
    }
    let tables: BTreeMap<String, Vec<&saver_core::EmbeddingTable>> = model
        .tables
        .iter()
        .map(|t| (SparseTable::name(t).to_string(), vec![t]))
        .collect();
    let digest = content_digest(&tables, &model.dense);
    if out.json {
        output::json(&serde_json::json!({ "path": path.display().to_string(), "digest": digest }));
    } else {
        println!("{digest}");
    }
    Ok(ExitCode::SUCCESS)
}

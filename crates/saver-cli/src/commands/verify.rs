//! `saver verify`.

use std::process::ExitCode;

use saver_io::{verify, Status};

use super::CmdResult;
use crate::cli::VerifyArgs;
use crate::output;

pub(super) fn run(args: VerifyArgs) -> CmdResult {
    let VerifyArgs { dir, parallel, out } = args;
    let dir = dir.as_path();
    let r = output::while_working(out.json, "verifying", || verify(dir, parallel))?;
    if out.json {
        output::json(&r);
    } else {
        match r.status {
            Status::Ok => println!(
                "ok: {} is complete and intact{} ({} files, {} tensors, {} checked)",
                dir.display(),
                match r.parents.len() {
                    0 => String::new(),
                    n => format!(", and so is every link of its chain ({n} parents)"),
                },
                r.files,
                r.tensors,
                output::size(r.bytes)
            ),
            Status::Incomplete => eprintln!(
                "incomplete: {} is not a committed checkpoint",
                dir.display()
            ),
            Status::Corrupt => eprintln!(
                "corrupt: {} has {} problem(s)",
                dir.display(),
                r.problems.len()
            ),
        }
        for p in &r.problems {
            match &p.tensor {
                Some(t) => eprintln!("  {}: tensor {t:?}: {}", p.file, p.detail),
                None => eprintln!("  {}: {}", p.file, p.detail),
            }
        }
    }
    Ok(match r.status {
        Status::Ok => ExitCode::SUCCESS,
        Status::Incomplete => ExitCode::from(3),
        Status::Corrupt => ExitCode::from(4),
    })
}

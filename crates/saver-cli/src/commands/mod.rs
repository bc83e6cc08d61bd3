//! One module per command; each turns flags into library calls and prints a report.

mod digest;
mod export;
mod inspect;
mod load;
mod reshard;
mod save;
mod verify;

use std::process::ExitCode;

use crate::cli::Command;

/// Any error a command reports: one line, no backtrace.
pub type CmdResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// Runs a command.
pub fn run(cmd: Command) -> CmdResult {
    match cmd {
        Command::Save(args) => save::run(args),
        Command::Inspect { dir, out } => inspect::run(&dir, out),
        Command::Verify { dir, parallel, out } => verify::run(&dir, parallel, out),
        Command::Load(args) => load::run(args),
        Command::Reshard {
            src,
            out,
            shards,
            parallel,
            overwrite,
            no_fsync,
            out_fmt,
        } => reshard::run(
            &src,
            &out,
            Some(shards),
            parallel,
            overwrite,
            !no_fsync,
            out_fmt,
        ),
        Command::Compact {
            src,
            out,
            shards,
            parallel,
            overwrite,
            no_fsync,
            out_fmt,
        } => reshard::run(&src, &out, shards, parallel, overwrite, !no_fsync, out_fmt),
        Command::Export {
            src,
            out,
            max_file_size,
            exclude_slots,
            tables,
            dtype,
            overwrite,
            out_fmt,
        } => export::run(
            &src,
            &out,
            max_file_size,
            exclude_slots,
            tables,
            dtype,
            overwrite,
            out_fmt,
        ),
        Command::Digest {
            path,
            parallel,
            digest_version,
            out,
        } => digest::run(&path, parallel, digest_version, out),
    }
}

//! One module per command; each turns flags into library calls and prints a report.

mod digest;
mod export;
mod inspect;
mod load;
mod manage;
mod reshard;
mod save;
mod verify;

use std::process::ExitCode;

use crate::cli::Command;

/// Any error a command reports: one line, no backtrace.
pub(crate) type CmdResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// Runs a command.
pub(crate) fn run(cmd: Command) -> CmdResult {
    match cmd {
        Command::Save(args) => save::run(*args),
        Command::Inspect(args) => inspect::run(args),
        Command::Verify(args) => verify::run(args),
        Command::Load(args) => load::run(args),
        Command::Reshard(args) => reshard::reshard(args),
        Command::Compact(args) => reshard::compact(args),
        Command::Export(args) => export::run(args),
        Command::Digest(args) => digest::run(args),
        Command::List(args) => manage::list(args),
        Command::Latest(args) => manage::latest(args),
        Command::Prune(args) => manage::prune(args),
        Command::Clean(args) => manage::clean(args),
    }
}

//! The `saver` binary: a thin layer over `saver-core` and `saver-io`.

mod cli;
mod commands;
mod output;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of our output goes away (`| head`),
    // instead of panicking on a write to a closed pipe.
    // SAFETY: called first, before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = cli::Cli::parse();
    // A store that does not answer would otherwise leave the command silent for its retries.
    saver_io::storage::on_slow_request(|what| eprintln!("saver: {what}"));
    match commands::run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

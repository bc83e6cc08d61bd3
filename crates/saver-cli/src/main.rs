//! The `saver` binary: a thin layer over `saver-core` and `saver-io`.
#![warn(unreachable_pub)]

mod cli;
mod commands;
mod output;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of our output goes away (`| head`),
    // instead of panicking on a write to a closed pipe.
    // SAFETY: called first, before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let matches = cli::Cli::command().get_matches();
    // Under --json, an error is JSON too, on stdout where the report would have been.
    let json = matches.subcommand().is_some_and(|(_, m)| {
        m.try_get_one::<bool>("json")
            .ok()
            .flatten()
            .copied()
            .unwrap_or(false)
    });
    let cli = cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // A store that does not answer would otherwise leave a person at a terminal looking at a
    // silent command for its retries; a log or a script gets the one error line at the end.
    if !json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        saver_io::storage::on_slow_request(|what| eprintln!("saver: {what}"));
    }
    match commands::run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({ "error": e.to_string() }));
            } else {
                eprintln!("error: {e}");
            }
            ExitCode::from(1)
        }
    }
}

//! Printing: human-readable text or one JSON object, and progress bars on terminals only.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use saver_io::save::ProgressFn;
use serde::Serialize;

/// Bytes as `1.5 GiB`.
pub(crate) fn size(n: u64) -> String {
    bytesize::ByteSize::b(n).display().iec().to_string()
}

/// Bytes per second as `1.2 GiB/s`.
pub(crate) fn rate(bytes: u64, seconds: f64) -> String {
    if seconds <= 0.0 {
        return "-".into();
    }
    format!("{}/s", size((bytes as f64 / seconds) as u64))
}

/// Prints `value` as one line of JSON on stdout.
pub(crate) fn json<T: Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string(value).expect("reports serialize")
    );
}

/// A spinner with the time so far on stderr while `work` runs, for a command that reads or writes
/// a checkpoint and has no count of bytes to show; nothing when stderr is not a terminal or JSON
/// is asked.
pub(crate) fn while_working<T>(json: bool, what: &'static str, work: impl FnOnce() -> T) -> T {
    if json || !std::io::stderr().is_terminal() {
        return work();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    bar.set_message(what);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let out = work();
    bar.finish_and_clear();
    out
}

/// A byte-progress bar on stderr (a percentage once the save knows its total), or nothing when
/// stderr is not a terminal or JSON is asked.
pub(crate) fn byte_progress(
    json: bool,
    what: &'static str,
) -> Option<(ProgressBar, Arc<ProgressFn>)> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg} {bytes}/{total_bytes} ({percent}%, {bytes_per_sec}) {elapsed}",
        )
        .expect("valid template"),
    );
    bar.set_message(what);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let b = bar.clone();
    Some((
        bar,
        Arc::new(move |p: saver_io::Progress| {
            b.set_length(p.total);
            b.set_position(p.written.max(b.position()));
        }),
    ))
}

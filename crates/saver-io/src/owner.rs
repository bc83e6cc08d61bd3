//! Who is saving: the identity a writer records in its claims and manifests, so that two writers
//! are told apart and named in errors, and random tokens that make names no other writer can
//! produce.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use saver_core::manifest::WriterInfo;
use saver_core::partition::fmix64;

/// 64 random bits from the operating system, or, where it has none to give, from the clock, the
/// process id and a counter mixed together.
pub(crate) fn random_u64() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: writes at most 8 bytes into an 8-byte buffer.
    let got = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if got == 8 {
        return u64::from_le_bytes(buf);
    }
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    fmix64(now_nanos() ^ (u64::from(std::process::id()) << 40) ^ fmix64(n))
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// A token drawn once per process: part of every temporary file name, so that two processes with
/// the same pid on two hosts sharing a directory never produce the same name.
pub(crate) fn process_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| format!("{:08x}", random_u64() as u32))
}

/// This host's name, or "unknown-host".
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: a writable buffer of the given length; the result is NUL-terminated on success
    // (truncated names may not be, so the last byte is kept 0).
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
    match (r, std::str::from_utf8(&buf[..len])) {
        (0, Ok(name)) if !name.is_empty() => name.to_string(),
        _ => "unknown-host".to_string(),
    }
}

/// When process `pid` started, in clock ticks since boot (field 22 of `/proc/<pid>/stat`): with
/// the pid, it names one process for good, as pids are reused.
pub(crate) fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process `pid` that started at `start` (see [`process_start`]) on host `host` is
/// known to have ended: only a process of this host can be known to, and only when it is gone or
/// its pid now names a process that started at another time.
pub(crate) fn has_ended(host: &str, pid: u32, start: u64) -> bool {
    if host != host_name() || pid == 0 {
        return false;
    }
    match process_start(pid) {
        Some(now) => start != 0 && now != start,
        // No such process, unless /proc cannot be read at all here.
        None => process_start(std::process::id()).is_some(),
    }
}

/// The identity of one save call in this process.
pub(crate) fn current_writer() -> WriterInfo {
    WriterInfo {
        host: host_name(),
        pid: std::process::id(),
        attempt: format!("{:016x}", random_u64()),
        started_unix_ms: now_nanos() / 1_000_000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_save_calls_are_two_writers() {
        let (a, b) = (current_writer(), current_writer());
        assert_eq!((a.pid, &a.host), (b.pid, &b.host));
        assert_ne!(a.attempt, b.attempt);
        assert!(!a.host.is_empty());
        assert_eq!(process_token(), process_token());
    }

    #[test]
    fn only_ended_processes_of_this_host_have_ended() {
        let me = std::process::id();
        let start = process_start(me).expect("/proc on Linux");
        assert!(!has_ended(&host_name(), me, start));
        assert!(has_ended(&host_name(), me, start + 1), "pid reused");
        assert!(!has_ended("some-other-host", me, start + 1));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let child_start = process_start(pid);
        child.wait().unwrap();
        if let Some(s) = child_start {
            assert!(has_ended(&host_name(), pid, s), "reaped child");
        }
    }
}

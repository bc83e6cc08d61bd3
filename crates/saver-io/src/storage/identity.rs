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

/// The pid namespace this process runs in, named so that no other machine, boot or container
/// shares the name: the kernel's boot id and the namespace's inode. A pid means something only
/// within its namespace, so only there can a process be known to have ended. `None` where
/// `/proc` does not tell.
pub(crate) fn pid_namespace() -> Option<&'static str> {
    static NS: OnceLock<Option<String>> = OnceLock::new();
    NS.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        Some(format!("{}/{}", boot.trim(), ns.display()))
    })
    .as_deref()
}

/// Whether the process `pid` of pid namespace `namespace` (see [`pid_namespace`]) that started
/// at `start` (see [`process_start`]) is known to have ended: only a process of this namespace
/// can be, and only when it is gone or its pid now names a process that started at another
/// time. Host names are no test: two containers may share one.
pub(crate) fn has_ended(namespace: &str, pid: u32, start: u64) -> bool {
    if pid == 0 || start == 0 || pid_namespace() != Some(namespace) {
        return false;
    }
    process_start(pid).is_none_or(|now| now != start)
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
    fn only_ended_processes_of_this_namespace_have_ended() {
        let ns = pid_namespace().expect("/proc on Linux");
        let me = std::process::id();
        let start = process_start(me).expect("/proc on Linux");
        assert!(!has_ended(ns, me, start));
        assert!(has_ended(ns, me, start + 1), "pid reused");
        assert!(!has_ended("another-machine/pid:[1]", me, start + 1));
        assert!(!has_ended(ns, me, 0), "start unknown");
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = child.id();
        let child_start = process_start(pid).expect("a running child");
        assert!(!has_ended(ns, pid, child_start));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(has_ended(ns, pid, child_start), "killed and reaped");
    }
}

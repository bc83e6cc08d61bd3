//! The `saver` binary raced against itself: several `saver save` processes into one directory,
//! `saver verify` while `saver save --overwrite` replaces the checkpoint, and inputs that must be
//! refused at once (FIFOs, never-committed directories) rather than hang or be misread.
//!
//! `SAVER_RACE_ROUNDS=N` raises the number of rounds (default 12).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn rounds() -> usize {
    std::env::var("SAVER_RACE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12)
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_saver"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("saver runs")
}

/// Waits for `child`, killing it and failing the test if it runs longer than `limit`.
fn finish(mut child: Child, limit: Duration, what: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} hung for {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[&str]) -> Output {
    finish(
        spawn(args),
        Duration::from_secs(60),
        &format!("saver {args:?}"),
    )
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn digest(path: &Path) -> String {
    let o = run(&["digest", path.to_str().unwrap()]);
    assert!(o.status.success(), "digest: {}", stderr(&o));
    stdout(&o).trim().to_string()
}

fn spec(seed: usize) -> String {
    format!("tables=2,rows=2000,dim=8,slots=embedding+adagrad,dense=64KiB,seed={seed}")
}

#[test]
fn racing_save_processes_leave_one_verified_checkpoint_and_losers_name_the_winner() {
    let root = tempfile::tempdir().unwrap();
    // The digest of each content, saved alone.
    let digests: Vec<String> = (0..4)
        .map(|seed| {
            let d = root.path().join(format!("ref{seed}"));
            let o = run(&[
                "save",
                "--out",
                d.to_str().unwrap(),
                "--synthetic",
                &spec(seed),
                "--no-fsync",
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            digest(&d)
        })
        .collect();
    let mut losers = 0;
    for round in 0..rounds() {
        let dir = root.path().join(format!("r{round}"));
        let out = dir.to_str().unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model-final.safetensors"), b"user data").unwrap();
        let overwrite = round % 2 == 1;
        if overwrite {
            let o = run(&[
                "save",
                "--out",
                out,
                "--synthetic",
                &spec(3),
                "--no-fsync",
                "--save-id",
                "old",
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
        }
        let k = 2 + round % 3 / 2; // two or three racers
        let ids: Vec<String> = (0..k).map(|i| format!("r{round}p{i}")).collect();
        let children: Vec<Child> = (0..k)
            .map(|i| {
                let mut args = vec![
                    "save",
                    "--out",
                    out,
                    "--no-fsync",
                    "--shards",
                    "2",
                    "--save-id",
                    &ids[i],
                ];
                let s = spec(i);
                args.extend(["--synthetic", &s]);
                if overwrite {
                    args.push("--overwrite");
                }
                spawn(&args)
            })
            .collect();
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| finish(c, Duration::from_secs(60), "a racing save"))
            .collect();
        let v = run(&["verify", out, "--json"]);
        assert!(
            v.status.success(),
            "round {round}: {}{}",
            stdout(&v),
            stderr(&v)
        );
        let d = digest(&dir);
        let won: Vec<usize> = (0..k).filter(|&i| outs[i].status.success()).collect();
        assert!(!won.is_empty(), "round {round}: nobody committed");
        if !overwrite {
            assert_eq!(
                won.len(),
                1,
                "round {round}: two saves committed without --overwrite"
            );
        }
        assert!(
            won.iter().any(|&i| digests[i] == d),
            "round {round}: content of no winner"
        );
        for (i, o) in outs.iter().enumerate() {
            if o.status.success() {
                assert!(
                    stdout(o).contains("committed"),
                    "round {round}: {}",
                    stdout(o)
                );
                continue;
            }
            losers += 1;
            let err = stderr(o);
            assert_eq!(o.status.code(), Some(1), "round {round}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "round {round}: {err}");
            assert!(!err.contains("panicked"), "{err}");
            assert!(
                (0..k).any(|j| j != i && err.contains(&ids[j])),
                "round {round}: the loser does not name the winner: {err}"
            );
        }
        assert_eq!(
            std::fs::read(dir.join("model-final.safetensors")).unwrap(),
            b"user data"
        );
    }
    assert!(losers > 0, "the races never overlapped");
}

#[test]
fn verify_during_overwrites_never_reports_a_false_corruption() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ck");
    let out = dir.to_str().unwrap();
    let o = run(&["save", "--out", out, "--synthetic", &spec(0), "--no-fsync"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let done = std::sync::atomic::AtomicBool::new(false);
    let verifies = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut n = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let v = run(&["verify", out]);
                assert!(
                    v.status.success(),
                    "verify said {:?}: {}",
                    v.status.code(),
                    stderr(&v)
                );
                n += 1;
            }
            n
        });
        for i in 0..rounds() * 2 {
            let o = run(&[
                "save",
                "--out",
                out,
                "--synthetic",
                &spec(i % 2),
                "--no-fsync",
                "--overwrite",
                "--shards",
                "3",
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap()
    });
    assert!(verifies > 0);
}

#[test]
fn fifos_and_never_committed_directories_are_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    // A FIFO where the index of a plain model is expected, and a FIFO given as the input itself.
    let plain = root.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let fifo = plain.join("model.safetensors.index.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = root.path().join("out");
    for args in [
        vec!["digest", plain.to_str().unwrap()],
        vec![
            "save",
            "--out",
            out.to_str().unwrap(),
            "--from",
            plain.to_str().unwrap(),
        ],
        vec!["digest", fifo.to_str().unwrap()],
        vec![
            "save",
            "--out",
            out.to_str().unwrap(),
            "--from",
            fifo.to_str().unwrap(),
        ],
    ] {
        let o = finish(
            spawn(&args),
            Duration::from_secs(20),
            &format!("saver {args:?}"),
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("not a regular file") || err.contains("neither a regular file"),
            "{args:?}: {err}"
        );
    }
    // A shard written by one process of a save that never completed.
    let partial = root.path().join("partial");
    let o = run(&[
        "save",
        "--out",
        partial.to_str().unwrap(),
        "--synthetic",
        &spec(0),
        "--shards",
        "2",
        "--shard-index",
        "0",
        "--save-id",
        "never",
        "--no-fsync",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for args in [
        vec!["digest", partial.to_str().unwrap()],
        vec![
            "save",
            "--out",
            out.to_str().unwrap(),
            "--from",
            partial.to_str().unwrap(),
        ],
    ] {
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("not a complete checkpoint") && err.contains("missing shards [1]"),
            "{args:?}: {err}"
        );
    }
    let v = run(&["verify", partial.to_str().unwrap()]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
}

#[test]
fn verify_says_permission_denied_is_an_error_not_a_corrupt_checkpoint() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = root.path().join("ck");
    let out = dir.to_str().unwrap();
    let o = run(&["save", "--out", out, "--synthetic", &spec(0), "--no-fsync"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let data = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o000)).unwrap();
    // Root reads any file, so run as nobody where we are root.
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    let mut cmd = if as_root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
        c.arg(env!("CARGO_BIN_EXE_saver"));
        c
    } else {
        Command::new(env!("CARGO_BIN_EXE_saver"))
    };
    let o = match cmd.args(["verify", out]).output() {
        Ok(o) => o,
        Err(e) => {
            // CI runs as root with setpriv (util-linux) and requires this test.
            assert!(
                std::env::var_os("SAVER_REQUIRE_ROOT").is_none(),
                "cannot run setpriv ({e}), and SAVER_REQUIRE_ROOT is set"
            );
            println!("skipped: cannot run setpriv ({e})");
            return;
        }
    };
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Permission denied") && !err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn export_replaces_only_the_files_of_the_export_it_replaces() {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    let o = run(&[
        "save",
        "--out",
        ck.to_str().unwrap(),
        "--synthetic",
        &spec(0),
        "--no-fsync",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ex = root.path().join("ex");
    std::fs::create_dir(&ex).unwrap();
    // A user's file named like an export's, which no export index lists.
    std::fs::write(ex.join("model-00007-of-00009.safetensors"), b"mine").unwrap();
    let export = |size: &str| {
        let o = run(&[
            "export",
            ck.to_str().unwrap(),
            "--out",
            ex.to_str().unwrap(),
            "--max-file-size",
            size,
            "--overwrite",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    export("64KiB");
    let many: Vec<String> = std::fs::read_dir(&ex)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    export("1GiB");
    let now: Vec<String> = std::fs::read_dir(&ex)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(many.len() > now.len(), "{many:?} -> {now:?}");
    assert_eq!(
        std::fs::read(ex.join("model-00007-of-00009.safetensors")).unwrap(),
        b"mine"
    );
    assert_eq!(digest(&ex), digest(&ck));
    // Every file left is the new export's (listed by its index), the index, or the user's.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ex.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let listed: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    for n in &now {
        assert!(
            listed.contains(&n.as_str())
                || n == "model.safetensors.index.json"
                || n == "model-00007-of-00009.safetensors",
            "{n} left behind: {now:?}"
        );
    }
}

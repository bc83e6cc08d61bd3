//! A committer paused (SIGSTOP, as a frozen machine is) past its commit lock's lease at every
//! step of its commit, on a real S3-compatible server that ignores conditional writes (Garage),
//! while another save takes the lock and commits: whatever exits 0 is committed and reads, what
//! came too late fails with a clear error and leaves the other's commit as it was, and every
//! checkpoint left verifies. Four shapes: two `--overwrite`s of one prefix, a managed root whose
//! newest step is replaced while a delta of it is saved as the next step, a new step saved
//! while a newer one commits, and a plain delta (`--parent`, no root) whose parent is replaced
//! before or during its commit (also on the local disk).

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::garage::Garage;

/// The lease of every process here: short, so that a round waits little for it to run out.
const LEASE_SECONDS: f64 = 1.5;

/// The steps of a commit a committer is paused at (`SAVER_STOP_AT`): after taking its locks,
/// after its checks, after its last check of the locks, after writing its index.
const STEPS: [&str; 4] = ["locked", "checked", "fenced", "indexed"];

/// The object store's settings, or none for runs on the local disk.
type Env = Vec<(String, String)>;

fn saver(g: &Garage, args: &[&str]) -> Command {
    saver_in(&env_of(g), args)
}

fn env_of(g: &Garage) -> Env {
    g.env()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn saver_in(env: &Env, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_saver"));
    c.args(args)
        .envs(env.iter().cloned())
        .env("SAVER_S3_LEASE_SECONDS", LEASE_SECONDS.to_string());
    c
}

fn ok(g: &Garage, args: &[&str]) -> String {
    ok_in(&env_of(g), args)
}

fn ok_in(env: &Env, args: &[&str]) -> String {
    let out = saver_in(env, args).output().unwrap();
    assert!(
        out.status.success(),
        "saver {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The content digest of the synthetic model `spec`, saved here on the local disk.
fn digest_of_model(g: &Garage, spec: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ck");
    let out = out.to_str().unwrap();
    ok(
        g,
        &["save", "--synthetic", spec, "--no-fsync", "--out", out],
    );
    ok(g, &["digest", out])
}

/// Whether process `pid` is stopped.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// Starts `saver args` stopped at commit step `step`; returns once it has stopped there.
fn paused_at(g: &Garage, args: &[&str], step: &str) -> Child {
    paused_in(&env_of(g), args, step)
}

fn paused_in(env: &Env, args: &[&str], step: &str) -> Child {
    let mut child = saver_in(env, args)
        .env("SAVER_STOP_AT", format!("commit:{step}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !is_stopped(child.id()) {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "saver {args:?} ended ({status}) before reaching commit:{step}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never reached {step}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child
}

/// Continues a paused process and waits for it.
fn resume(child: Child) -> Output {
    let pid = child.id() as libc::pid_t;
    // SAFETY: a signal to our own child, still unreaped, so the pid is its.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    child.wait_with_output().unwrap()
}

/// A late committer's failure: an error that says why (its lock was lost, or what won, as
/// `winner` words it), never a panic.
fn assert_refused_clearly(out: &Output, what: &str, winner: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{what} should have failed");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(
        err.contains("is no longer this process's") || err.contains(winner),
        "{what}: {err}"
    );
}

/// The pause that makes the lease run out: a lease and some, varied by round.
fn past_the_lease(round: u64) -> Duration {
    Duration::from_secs_f64(LEASE_SECONDS) + Duration::from_millis(100 + round * 170)
}

fn overwrites_of_one_prefix(g: &Garage, step: &str, round: u64, digests: &[String; 3]) {
    let url = g.url(&format!("lease/plain-{step}-{round}"));
    ok(g, &["save", "--synthetic", "tiny,seed=1", "--out", &url]);
    let late = paused_at(
        g,
        &[
            "save",
            "--synthetic",
            "tiny,seed=2",
            "--overwrite",
            "--out",
            &url,
        ],
        step,
    );
    std::thread::sleep(past_the_lease(round));
    // Waits for the paused holder's lease, then commits (or finds the paused one's commit).
    let other = saver(
        g,
        &[
            "save",
            "--synthetic",
            "tiny,seed=3",
            "--overwrite",
            "--out",
            &url,
        ],
    )
    .output()
    .unwrap();
    let late = resume(late);
    let what = format!("overwrites paused at {step}, round {round}");
    println!("{what}: {}", String::from_utf8_lossy(&late.stderr).trim());
    let now = ok(g, &["digest", &url]);
    ok(g, &["verify", &url]);
    assert!(
        other.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&other.stderr)
    );
    assert_eq!(now, digests[2], "{what}: the later commit was replaced");
    if step == "indexed" {
        // Its index was written within its lease: it stood, and the other save, which started
        // after it, replaced it.
        assert!(
            late.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&late.stderr)
        );
    } else {
        assert_refused_clearly(&late, &what, "another save committed first");
    }
}

fn a_delta_beside_a_replaced_step(g: &Garage, step: &str, round: u64, digests: &[String; 3]) {
    let root = g.url(&format!("lease/root-{step}-{round}"));
    let step_dir = |s: u64| format!("{root}/step-{s:020}");
    let managed = |step: &str, spec: &str, overwrite: bool| {
        let mut args = vec![
            "save",
            "--root",
            &root,
            "--step",
            step,
            "--synthetic",
            spec,
            "--full-every",
            "2",
        ];
        if overwrite {
            args.push("--overwrite");
        }
        args.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let args = managed("30", "tiny,seed=1", false);
    ok(g, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let args = managed("30", "tiny,seed=2", true);
    let late = paused_at(
        g,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        step,
    );
    std::thread::sleep(past_the_lease(round));
    // A delta of step 30 as it is (or as the paused save left it) saved as step 40.
    let args = managed("40", "tiny,seed=3", false);
    let delta = saver(g, &args.iter().map(String::as_str).collect::<Vec<_>>())
        .output()
        .unwrap();
    let late = resume(late);
    let what = format!("a managed root paused at {step}, round {round}");
    println!("{what}: {}", String::from_utf8_lossy(&late.stderr).trim());
    // Whatever committed reads, its parent with it.
    ok(g, &["verify", &step_dir(30)]);
    let thirty = ok(g, &["digest", &step_dir(30)]);
    assert!(
        delta.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&delta.stderr)
    );
    ok(g, &["verify", &step_dir(40)]);
    assert_eq!(ok(g, &["digest", &step_dir(40)]), digests[2], "{what}");
    if step == "indexed" {
        // Step 30 was replaced within the lease: the delta, started after, is a delta of it.
        assert!(
            late.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&late.stderr)
        );
        assert_eq!(thirty, digests[1], "{what}");
    } else {
        assert_refused_clearly(&late, &what, "step 40 (save ");
        assert_eq!(
            thirty, digests[0],
            "{what}: step 30 was replaced under its delta"
        );
    }
}

/// A new step 50 paused at `step` of its commit while step 60 commits: a root's steps only grow,
/// so step 50 never stands beside step 60 unless it was committed first, within its lease.
fn a_new_step_beside_a_newer_one(g: &Garage, step: &str, round: u64, digests: &[String; 3]) {
    let root = g.url(&format!("lease/new-{step}-{round}"));
    let save = |s: &str, spec: &str| {
        let args = ["save", "--root", &root, "--step", s, "--synthetic", spec];
        args.map(str::to_string)
    };
    let late = paused_at(
        g,
        &save("50", "tiny,seed=1").each_ref().map(String::as_str),
        step,
    );
    std::thread::sleep(past_the_lease(round));
    let newer = saver(g, &save("60", "tiny,seed=3").each_ref().map(String::as_str))
        .output()
        .unwrap();
    let late = resume(late);
    let what = format!("a new step paused at {step}, round {round}");
    println!("{what}: {}", String::from_utf8_lossy(&late.stderr).trim());
    assert!(
        newer.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&newer.stderr)
    );
    ok(g, &["verify", &format!("{root}/step-{:020}", 60)]);
    assert_eq!(
        ok(g, &["digest", &format!("{root}/step-{:020}", 60)]),
        digests[2],
        "{what}"
    );
    let listed = ok(g, &["list", &root, "--json"]);
    let steps: Vec<u64> = serde_json::from_str::<serde_json::Value>(&listed).unwrap()["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    if step == "indexed" {
        assert!(
            late.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&late.stderr)
        );
        assert_eq!(steps, [50, 60], "{what}");
    } else {
        assert_refused_clearly(&late, &what, "step 60 (save ");
        assert_eq!(
            steps,
            [60],
            "{what}: step 50 stands beside the newer step 60"
        );
    }
}

#[test]
fn a_committer_paused_past_its_lease_never_replaces_what_another_committed() {
    let Some(g) = Garage::start() else { return };
    let digests = ["tiny,seed=1", "tiny,seed=2", "tiny,seed=3"].map(|s| digest_of_model(&g, s));
    let rounds = 2;
    std::thread::scope(|s| {
        let (g, digests) = (&g, &digests);
        s.spawn(move || {
            for round in 0..rounds {
                for step in STEPS {
                    overwrites_of_one_prefix(g, step, round, digests);
                }
            }
        });
        s.spawn(move || {
            for round in 0..rounds {
                for step in STEPS {
                    a_delta_beside_a_replaced_step(g, step, round, digests);
                }
            }
        });
        s.spawn(move || {
            for round in 0..rounds {
                for step in STEPS {
                    a_new_step_beside_a_newer_one(g, step, round, digests);
                }
            }
        });
    });
}

/// A plain delta (`save --parent`, no managed root) paused at `step` of its commit while its
/// parent is overwritten: it never commits a delta of a parent that is gone. Paused before its
/// locks (`ready`), it fails naming the parent and the save that replaced it; paused holding
/// the parent directory's lock past its lease (an object store's), the overwrite takes the lock
/// and the delta fails naming the taker or the replacement. The parent holds the overwrite's
/// save, and the delta's directory no committed checkpoint.
///
/// `dir` is where both go: a prefix of the store `env` names, or a local directory.
fn a_plain_delta_beside_a_replaced_parent(env: &Env, dir: &str, step: &str, round: u64) {
    let at = if env.is_empty() {
        "the local disk"
    } else {
        "Garage"
    };
    let (parent, delta) = (format!("{dir}/parent"), format!("{dir}/delta"));
    let save = |spec: &str, extra: &[&str]| {
        let mut a = vec!["save", "--synthetic", spec, "--no-fsync"];
        a.extend_from_slice(extra);
        a.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    ok_in(
        env,
        &save("tiny,seed=1", &["--out", &parent])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let args = save("tiny,seed=2", &["--parent", &parent, "--out", &delta]);
    let late = paused_in(
        env,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        step,
    );
    if step != "ready" {
        std::thread::sleep(past_the_lease(round));
    } else {
        std::thread::sleep(Duration::from_millis(round * 37));
    }
    let over = save("tiny,seed=3", &["--overwrite", "--out", &parent]);
    let over = saver_in(env, &over.iter().map(String::as_str).collect::<Vec<_>>())
        .output()
        .unwrap();
    let late = resume(late);
    let what = format!("a plain delta paused at {step} on {at}, round {round}");
    println!("{what}: {}", String::from_utf8_lossy(&late.stderr).trim());
    assert!(
        over.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&over.stderr)
    );
    ok_in(env, &["verify", &parent]);
    assert_refused_clearly(&late, &what, "was replaced by save");
    if step == "ready" {
        // It took the locks after the overwrite: the parent's replacement is the reason.
        let err = String::from_utf8_lossy(&late.stderr);
        assert!(
            err.contains("the parent") && err.contains("was replaced by save"),
            "{what}: {err}"
        );
    }
    let verify = saver_in(env, &["verify", &delta]).output().unwrap();
    assert!(
        !verify.status.success(),
        "{what}: the delta's directory commits a save"
    );
}

#[test]
fn a_plain_delta_never_commits_over_a_parent_replaced_before_its_commit_on_the_local_disk() {
    for round in 0..4 {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().to_str().unwrap();
        a_plain_delta_beside_a_replaced_parent(&Env::new(), dir, "ready", round);
    }
}

#[test]
fn a_plain_delta_never_commits_over_a_parent_replaced_during_its_commit_on_an_object_store() {
    let Some(g) = Garage::start() else { return };
    for round in 0..2 {
        for step in ["ready", "locked", "checked", "fenced"] {
            let dir = g.url(&format!("lease/plain-delta-{step}-{round}"));
            a_plain_delta_beside_a_replaced_parent(&env_of(&g), &dir, step, round);
        }
    }
}

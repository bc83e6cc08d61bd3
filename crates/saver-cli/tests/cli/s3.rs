//! The `saver` binary against a real S3-compatible server (Garage on loopback): every command
//! takes `s3://bucket/prefix`, a kill -9 mid-upload never leaves a checkpoint that loads, a
//! server that stops is an error naming the store (never a hang), and bad credentials or buckets
//! are one-line errors. Each test runs its own server and gives its environment to the processes
//! it starts.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::garage;

use garage::Garage;
use saver_io::storage::{ObjectStorage, Storage};

fn saver_cmd(g: &Garage, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_saver"));
    c.args(args).envs(g.env());
    c
}

fn run(g: &Garage, args: &[&str]) -> Output {
    saver_cmd(g, args).output().expect("saver runs")
}

fn ok(g: &Garage, args: &[&str]) -> String {
    let out = run(g, args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "saver {args:?} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A failing command's stderr, checked to be a clear message (no panic).
fn fails(g: &Garage, args: &[&str]) -> String {
    let out = run(g, args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "saver {args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn digest(g: &Garage, dir: &str) -> String {
    ok(g, &["digest", dir]).trim().to_string()
}

/// The server's `prefix` as a storage.
fn prefix_of(g: &Garage, prefix: &str) -> ObjectStorage {
    ObjectStorage::with_store(g.s3_client(), &format!("s3://{}", g.bucket), prefix)
}

/// The uploads that upload markers under `prefix` record: (data object key, upload id).
fn recorded_uploads(g: &Garage, prefix: &str) -> Vec<(String, String)> {
    let storage = prefix_of(g, prefix);
    let mut uploads = Vec::new();
    for name in storage.list().unwrap() {
        let Some((data, _)) = name
            .split_once(".tmp-")
            .filter(|_| name.ends_with(".upload"))
        else {
            continue;
        };
        let record: serde_json::Value =
            serde_json::from_slice(&storage.get(&name, 4096).unwrap()).unwrap();
        let id = record["upload_id"].as_str().unwrap().to_string();
        uploads.push((format!("{prefix}/{data}"), id));
    }
    uploads
}

/// Whether the server still takes parts for upload `id` of `key`: an aborted or completed upload
/// takes none.
fn upload_is_open(g: &Garage, key: &str, id: &str) -> bool {
    use object_store::multipart::MultipartStore;
    let s3 = g.s3_client();
    let (key, id) = (object_store::path::Path::from(key), id.to_string());
    let rt = tokio_rt();
    rt.block_on(s3.put_part(&key, &id, 0, vec![0u8; 16].into()))
        .is_ok()
}

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn every_command_takes_an_s3_url() {
    let Some(g) = Garage::start() else { return };
    let local = tempfile::tempdir().unwrap();
    let lck = local.path().join("ck");
    ok(
        &g,
        &[
            "save",
            "--synthetic",
            "tiny",
            "--shards",
            "2",
            "--out",
            p(&lck),
        ],
    );
    let want = digest(&g, p(&lck));

    // Two processes, one shard each, into one prefix.
    let url = g.url("cli/ck");
    let children: Vec<_> = (0..2)
        .map(|j| {
            saver_cmd(
                &g,
                &[
                    "save",
                    "--synthetic",
                    "tiny",
                    "--shards",
                    "2",
                    "--shard-index",
                    &j.to_string(),
                    "--save-id",
                    "cli-1",
                    "--wait-seconds",
                    "60",
                    "--out",
                    &url,
                ],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(ok(&g, &["verify", &url]).starts_with("ok:"));
    assert!(ok(&g, &["inspect", &url]).contains(&format!("checkpoint {url}")));
    assert_eq!(digest(&g, &url), want);
    let loaded = ok(&g, &["load", &url, "--shards", "3", "--shard-index", "2"]);
    assert!(loaded.contains("loaded shard 2 of 3"), "{loaded}");

    // Rewrites from the store to the store, and the store as an input.
    let resharded = g.url("cli/resharded");
    ok(&g, &["reshard", &url, "--out", &resharded, "--shards", "3"]);
    assert_eq!(digest(&g, &resharded), want);
    let exported = g.url("cli/export");
    ok(&g, &["export", &url, "--out", &exported]);
    let copy = local.path().join("copy");
    ok(&g, &["save", "--from", &resharded, "--out", p(&copy)]);
    assert_eq!(digest(&g, p(&copy)), want);
    let from_export = local.path().join("from-export");
    ok(&g, &["save", "--from", &exported, "--out", p(&from_export)]);

    // A delta in the store against a parent in the store.
    let delta = g.url("cli/delta");
    ok(
        &g,
        &["save", "--from", p(&lck), "--parent", &url, "--out", &delta],
    );
    assert_eq!(digest(&g, &delta), want);
    assert!(ok(&g, &["verify", &delta]).starts_with("ok:"));

    // A URL never becomes a local path.
    let err = fails(&g, &["verify", "gs://bucket/x"]);
    assert!(err.contains("unsupported URL scheme"), "{err}");
    assert!(!Path::new("s3:").exists() && !Path::new("gs:").exists());
}

#[test]
fn bad_credentials_or_buckets_are_one_line_errors() {
    let Some(g) = Garage::start() else { return };
    let url = g.url("creds/ck");
    let start = Instant::now();
    let out = saver_cmd(&g, &["save", "--synthetic", "tiny", "--out", &url])
        .env("AWS_SECRET_ACCESS_KEY", "0".repeat(64))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    eprintln!("{err}");
    assert!(err.contains(&url), "{err}");
    assert!(err.contains("refused the credentials"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "not retried for long"
    );
    let err = fails(&g, &["verify", "s3://no-such-bucket/x"]);
    eprintln!("{err}");
    assert!(err.contains("s3://no-such-bucket"), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // No keys for a store of one's own: said at once, no request to a metadata address.
    let out = saver_cmd(&g, &["verify", &url])
        .env_remove("AWS_ACCESS_KEY_ID")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no credentials found"), "{err}");
    assert!(!err.contains("169.254"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// A closed port: the error says the connection was refused, on one line.
#[test]
fn a_closed_port_is_named_as_refused() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_saver"))
        .args(["verify", "s3://b/ck"])
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ACCESS_KEY_ID", "k")
        .env("AWS_SECRET_ACCESS_KEY", "s")
        .env("AWS_REGION", "garage")
        .env("SAVER_S3_RETRY_SECONDS", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("refused the connection"), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{err}"
    );
}

/// Whether `url` holds a checkpoint that verifies; `false` where it holds none. Anything else
/// (a committed checkpoint that does not verify) fails the test.
fn committed_and_intact(g: &Garage, url: &str) -> bool {
    let out = run(g, &["verify", url]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        assert!(text.starts_with("ok:"), "{text}");
        return true;
    }
    assert!(
        text.contains("not a complete checkpoint") || text.contains("incomplete"),
        "a killed save left something other than no checkpoint: {text}"
    );
    false
}

/// How far a save has come, by what it has stored.
#[derive(Clone, Copy, Debug)]
enum Reached {
    /// It has claimed a shard (a `.writer.json`).
    Claims,
    /// It has opened an upload (a `.upload` marker, put once the upload is created).
    Uploads,
}

/// Waits until the save `child` into `prefix` has reached `point` (or has ended).
fn wait_for(g: &Garage, prefix: &str, child: &mut std::process::Child, point: Reached) {
    let suffix = match point {
        Reached::Claims => ".writer.json",
        Reached::Uploads => ".upload",
    };
    let listing = prefix_of(g, prefix);
    let start = Instant::now();
    while !listing.list().unwrap().iter().any(|n| n.ends_with(suffix)) {
        if child.try_wait().unwrap().is_some() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the save never reached {point:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A new save into `url` commits and verifies, whatever an earlier save left there.
fn a_retry_commits(g: &Garage, url: &str) {
    ok(
        g,
        &["save", "--synthetic", "tiny", "--overwrite", "--out", url],
    );
    assert!(committed_and_intact(g, url));
}

#[test]
fn a_save_killed_mid_upload_never_leaves_a_checkpoint_that_loads() {
    let Some(g) = Garage::start() else { return };
    let (mut killed, mut open_left) = (0, 0);
    // Killed at varied points after the save claimed its shards, and after it opened its first
    // upload: on a loaded machine a save may not open one within 350 ms of its claims, and a
    // run of fixed delays from the claims then never killed one mid-upload.
    let points = [
        (Reached::Claims, 0u64),
        (Reached::Claims, 100),
        (Reached::Uploads, 0),
        (Reached::Uploads, 40),
        (Reached::Uploads, 200),
    ];
    for (round, (point, delay_ms)) in points.into_iter().enumerate() {
        let url = g.url(&format!("kill/ck{round}"));
        let mut child = saver_cmd(
            &g,
            &[
                "save",
                "--synthetic",
                "small",
                "--shards",
                "2",
                "--out",
                &url,
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        wait_for(&g, &format!("kill/ck{round}"), &mut child, point);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let finished = child.try_wait().unwrap().is_some();
        let _ = child.kill();
        child.wait().unwrap();
        if !finished && !committed_and_intact(&g, &url) {
            killed += 1;
        }
        eprintln!(
            "killed {delay_ms} ms after {point:?}: finished {finished}, killed before commit {killed}"
        );
        let prefix = format!("kill/ck{round}");
        let left = recorded_uploads(&g, &prefix);
        eprintln!("{} upload marker(s) left", left.len());
        open_left += left
            .iter()
            .filter(|(key, id)| upload_is_open(&g, key, id))
            .count();
        // A retry commits, whatever the earlier save left, and aborts the uploads the killed
        // save left open.
        a_retry_commits(&g, &url);
        assert_eq!(
            recorded_uploads(&g, &prefix),
            vec![],
            "markers left after a retry"
        );
        for (key, id) in &left {
            assert!(
                !upload_is_open(&g, key, id),
                "upload {id} of {key} still open"
            );
        }
    }
    assert!(killed > 0, "no save was killed before its commit");
    assert!(open_left > 0, "no save was killed with an upload open");
}

/// The cleanup a save runs at its start never touches the uploads of a save that is running in
/// another process: raced here against live saves, many times, while their uploads are open.
#[test]
fn cleanups_leave_the_uploads_of_running_saves_alone() {
    let Some(g) = Garage::start() else { return };
    let mut saw_open = 0;
    for round in 0..3 {
        let prefix = format!("live/ck{round}");
        let url = g.url(&prefix);
        let mut child = saver_cmd(&g, &["save", "--synthetic", "small", "--out", &url])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let storage = prefix_of(&g, &prefix);
        while child.try_wait().unwrap().is_none() {
            // Names only: the save completes its uploads and removes their markers meanwhile.
            let listed = storage.list().unwrap();
            saw_open += usize::from(listed.iter().any(|n| n.ends_with(".upload")));
            assert_eq!(
                storage.clean_ended_writers().unwrap(),
                Vec::<String>::new(),
                "a cleanup took a running save's upload"
            );
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(committed_and_intact(&g, &url));
    }
    assert!(saw_open > 0, "no cleanup ran while an upload was open");
}

#[test]
fn a_server_that_stops_mid_save_is_an_error_naming_the_store_and_a_retry_commits() {
    let Some(mut g) = Garage::start() else { return };
    let url = g.url("outage/ck");
    let child = saver_cmd(
        &g,
        &[
            "save",
            "--synthetic",
            "small",
            "--shards",
            "2",
            "--out",
            &url,
        ],
    )
    .env("SAVER_S3_TIMEOUT_SECONDS", "2")
    .env("SAVER_S3_RETRY_SECONDS", "3")
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Stop the server once the save has claimed its shards, so uploads are under way.
    let mut child = child;
    wait_for(&g, "outage/ck", &mut child, Reached::Claims);
    std::thread::sleep(Duration::from_millis(50));
    g.stop();
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    let waited = start.elapsed();
    g.restart();
    if out.status.success() {
        // It finished before the server stopped: then it must be whole.
        assert!(committed_and_intact(&g, &url));
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("after {waited:?}: {err}");
        assert!(err.contains("s3://saver-test/outage/ck"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(waited < Duration::from_secs(60), "gave up after {waited:?}");
        assert!(!committed_and_intact(&g, &url));
    }
    // A retry commits, whatever the earlier save left.
    a_retry_commits(&g, &url);
}

/// Readers (`load`, `verify`, `digest`) in a loop while a checkpoint on the store is overwritten
/// again and again: each reads the old or the new checkpoint, whole, starting over on the new one
/// when the old one's objects go; never a missing object, never "corrupt". A reader overtaken by
/// overwrites every time it starts over says so (exit 1), and reads once they pause.
#[test]
fn readers_racing_overwrites_see_the_old_or_the_new_checkpoint() {
    let Some(g) = Garage::start() else { return };
    let url = g.url("ow/ck");
    let seeds = 24;
    ok(
        &g,
        &[
            "save",
            "--synthetic",
            "tiny,seed=0",
            "--shards",
            "2",
            "--out",
            &url,
        ],
    );
    let done = std::sync::atomic::AtomicBool::new(false);
    let failures = std::sync::Mutex::new(Vec::new());
    let reads = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for reader in 0..3 {
            let (g, url, done, failures, reads) = (&g, &url, &done, &failures, &reads);
            s.spawn(move || {
                let verbs: [&[&str]; 3] = [
                    &["load", "--no-digest", "--shards", "3", "--shard-index", "1"],
                    &["verify"],
                    &["digest"],
                ];
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut args = verbs[reader].to_vec();
                    args.push(url);
                    let out = run(g, &args);
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if !out.status.success() {
                        failures.lock().unwrap().push(format!(
                            "{args:?}: exit {:?}: {}",
                            out.status.code(),
                            String::from_utf8_lossy(&out.stderr)
                        ));
                    }
                }
            });
        }
        for k in 1..=seeds {
            // Pauses of varied length: readers finish some reads between overwrites, and are
            // overtaken in others.
            std::thread::sleep(Duration::from_millis((k * 97 % 5) * 150));
            let spec = format!("tiny,seed={k}");
            ok(
                &g,
                &[
                    "save",
                    "--synthetic",
                    &spec,
                    "--shards",
                    "2",
                    "--overwrite",
                    "--out",
                    &url,
                ],
            );
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let failures = failures.into_inner().unwrap();
    let reads = reads.into_inner();
    assert!(reads >= 12, "{reads} reads");
    for f in &failures {
        assert!(
            f.contains("exit Some(1)") && f.contains("was replaced"),
            "{f}"
        );
    }
    println!(
        "{} of {reads} reads overtaken by overwrites",
        failures.len()
    );
    // Once saves pause, every reader reads.
    ok(
        &g,
        &[
            "load",
            "--no-digest",
            "--shards",
            "3",
            "--shard-index",
            "1",
            &url,
        ],
    );
    ok(&g, &["verify", &url]);
    ok(&g, &["digest", &url]);
}

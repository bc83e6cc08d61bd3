//! The `saver` binary, command by command, including its errors.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::Dtype as St;

fn saver(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_saver"))
        .args(args)
        .output()
        .expect("saver runs")
}

fn ok(args: &[&str]) -> String {
    let out = saver(args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "saver {args:?} failed: {}{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn json(args: &[&str]) -> serde_json::Value {
    let mut a = args.to_vec();
    a.push("--json");
    serde_json::from_str(ok(&a).trim()).expect("one JSON object")
}

/// Runs a failing command: returns (exit code, stderr), checking the message is one clear line.
fn fails(args: &[&str]) -> (i32, String) {
    let out = saver(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "saver {args:?} should fail");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
    (out.status.code().unwrap_or(-1), err)
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn the_main_job_save_8_shards_then_verify() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("ckpt");
    let r = json(&[
        "save",
        "--out",
        p(&out),
        "--synthetic",
        "tiny",
        "--shards",
        "8",
        "--parallel",
        "16",
    ]);
    assert!(r["bytes_written"].as_u64().unwrap() > 0);
    assert!(r["write_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(r["rows"].as_u64().unwrap(), 3000);
    assert_eq!(r["committed"], true);
    assert_eq!(r["spilled_rows"], 0);
    // A plan over its memory budget spills its rows and writes the same checkpoint.
    let spilled_out = d.path().join("spilled");
    let s = json(&[
        "save",
        "--out",
        p(&spilled_out),
        "--synthetic",
        "tiny",
        "--shards",
        "8",
        "--plan-memory",
        "0",
    ]);
    assert_eq!(s["spilled_rows"].as_u64().unwrap(), 3000);
    assert!(ok(&[
        "save",
        "--out",
        p(&d.path().join("s2")),
        "--synthetic",
        "tiny",
        "--plan-memory",
        "0"
    ])
    .contains("spilled"));
    assert_eq!(
        json(&["digest", p(&spilled_out)])["digest"],
        json(&["digest", p(&out)])["digest"]
    );
    let v = json(&["verify", p(&out)]);
    assert_eq!(v["status"], "ok");
    assert_eq!(v["files"].as_u64().unwrap(), 8);
    assert!(ok(&["verify", p(&out)]).contains("complete and intact"));

    let i = json(&["inspect", p(&out)]);
    assert_eq!(i["shards"], 8);
    assert_eq!(i["tables"].as_array().unwrap().len(), 3);
    assert_eq!(i["tables"][0]["slots"][1]["name"], "adagrad");
    assert_eq!(i["partition_rule"]["buckets"], 65536);
    assert!(ok(&["inspect", p(&out)]).contains("tables:"));

    let l = json(&["load", p(&out), "--shards", "3"]);
    assert_eq!(l["rows"], 3000);
    for k in [
        "bytes_read",
        "bytes_kept",
        "load_seconds",
        "read_amplification",
    ] {
        assert!(l[k].is_number(), "{k}");
    }
    let one = json(&["load", p(&out), "--shards", "3", "--shard-index", "1"]);
    assert!(one["rows"].as_u64().unwrap() < 3000);
    assert!(one["read_amplification"].as_f64().unwrap() <= 1.2);
    assert_eq!(l["digest"].as_str().unwrap().len(), 64);
    // Arrays and hashtables hold the same content.
    let arrays = json(&["load", p(&out), "--into", "arrays", "--huge-pages"]);
    assert_eq!(arrays["digest"], l["digest"]);
    assert_eq!(arrays["rows"], 3000);
    let part = json(&[
        "load",
        p(&out),
        "--into",
        "arrays",
        "--shards",
        "3",
        "--shard-index",
        "1",
    ]);
    assert_eq!(part["digest"], one["digest"]);
}

#[test]
fn every_direct_io_setting_writes_the_same_checkpoint() {
    // Beside the build, not in /tmp: a tmpfs there would make every setting the page cache.
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let suits = saver_io::storage::LocalFs::open_dir(d.path())
        .unwrap()
        .suits_direct_io();
    // CI builds on ext4 and requires the direct-I/O path (`SAVER_REQUIRE_DIRECT_IO=1`).
    assert!(
        suits || std::env::var_os("SAVER_REQUIRE_DIRECT_IO").is_none(),
        "the build directory takes no direct I/O, and SAVER_REQUIRE_DIRECT_IO is set"
    );
    let mut digests = Vec::new();
    // Compressed saves too: their files are cut to their stored length before the commit,
    // the last direct-I/O window written as the cut completes it.
    let settings: [&[&str]; 7] = [
        &["--direct-io"],
        &["--direct-io=on"],
        &["--direct-io=off"],
        &["--direct-io=auto"],
        &["--direct-io", "--no-fsync"],
        &["--direct-io=on", "--compress", "zstd"],
        &["--direct-io=off", "--compress", "zstd"],
    ];
    for (i, setting) in settings.into_iter().enumerate() {
        let out = d.path().join(i.to_string());
        // Files of many pages: pieces in lent memory, pages shared between pieces.
        let mut args = vec![
            "save",
            "--out",
            p(&out),
            "--synthetic",
            "tiny,rows=20000",
            "--shards",
            "2",
            "--parallel",
            "3",
        ];
        args.extend_from_slice(setting);
        let text = ok(&args);
        // The report names the write path: every setting but `off` takes direct I/O where it
        // suits the filesystem (the durable `auto` included).
        let path = if !setting.contains(&"--direct-io=off") && suits {
            "written with direct I/O"
        } else {
            "written through the page cache"
        };
        assert!(
            text.contains(path),
            "{setting:?} should say {path:?}: {text}"
        );
        assert_eq!(json(&["verify", p(&out)])["status"], "ok");
        digests.push(json(&["digest", p(&out)])["digest"].clone());
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");

    let (_, err) = fails(&[
        "save",
        "--out",
        p(&d.path().join("y")),
        "--synthetic",
        "tiny",
        "--direct-io=sometimes",
    ]);
    assert!(err.contains("auto, on, off"), "{err}");
}

#[test]
fn reshard_export_and_digest_agree() {
    let d = tempfile::tempdir().unwrap();
    let a = d.path().join("a");
    let b = d.path().join("b");
    let e = d.path().join("e");
    let c = d.path().join("c");
    ok(&[
        "save",
        "--out",
        p(&a),
        "--synthetic",
        "tiny,rows=700",
        "--shards",
        "5",
    ]);
    ok(&["reshard", p(&a), "--out", p(&b), "--shards", "2"]);
    assert_eq!(json(&["inspect", p(&b)])["shards"], 2);
    ok(&["export", p(&b), "--out", p(&e), "--max-file-size", "16KiB"]);
    ok(&["save", "--out", p(&c), "--from", p(&e), "--shards", "3"]);
    let digests: Vec<String> = [&a, &b, &e, &c]
        .iter()
        .map(|x| ok(&["digest", p(x)]).trim().to_string())
        .collect();
    assert!(digests.iter().all(|x| x == &digests[0]), "{digests:?}");
    assert_eq!(
        json(&["load", p(&c)])["digest"].as_str().unwrap(),
        digests[0]
    );
    // --no-digest loads (and checks) the same rows and leaves the digest out.
    let quick = json(&["load", p(&c), "--no-digest", "--into", "arrays"]);
    assert!(quick["digest"].is_null(), "{quick}");
    assert_eq!(quick["rows"], json(&["load", p(&c)])["rows"]);
    assert!(!ok(&["load", p(&c), "--no-digest"]).contains("digest"));
    // The export is split into files with an index, ids ascending.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(e.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let files: std::collections::BTreeSet<&str> = idx["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() > 1);
    let f = idx["weight_map"]["t0/ids"].as_str().unwrap();
    let bytes = std::fs::read(e.join(f)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<i64> = st
        .tensor("t0/ids")
        .unwrap()
        .data()
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    // A cast export differs in content, and its dtype is f16.
    let h = d.path().join("h");
    ok(&[
        "export",
        p(&a),
        "--out",
        p(&h),
        "--dtype",
        "f16",
        "--exclude-slots",
        "adagrad",
        "--tables",
        "t1",
    ]);
    let bytes = std::fs::read(h.join("model-00001-of-00001.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("t1/embedding").unwrap().dtype(), St::F16);
    assert!(st.tensor("t1/adagrad").is_err() && st.tensor("t0/ids").is_err());
    assert_ne!(ok(&["digest", p(&h)]).trim(), digests[0]);
}

/// Writes a plain safetensors input with the reference crate.
fn write_plain(path: &Path, tensors: Vec<(&str, St, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn le<T: Copy, const N: usize>(v: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[test]
fn plain_round_trip_through_save_reshard_export() {
    let d = tempfile::tempdir().unwrap();
    let plain = d.path().join("plain.safetensors");
    let ids: Vec<i64> = vec![i64::MIN, -5, 0, 7, 42, 1 << 40, i64::MAX];
    let emb: Vec<f32> = (0..ids.len() * 3).map(|x| x as f32 * 0.5 - 3.0).collect();
    let cnt: Vec<i32> = (0..ids.len() as i32).collect();
    let uids: Vec<u64> = vec![1, 99, u64::MAX];
    let w: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
    write_plain(
        &plain,
        vec![
            (
                "user/ids",
                St::I64,
                vec![ids.len()],
                le(&ids, i64::to_le_bytes),
            ),
            (
                "user/emb",
                St::F32,
                vec![ids.len(), 3],
                le(&emb, f32::to_le_bytes),
            ),
            (
                "user/count",
                St::I32,
                vec![ids.len()],
                le(&cnt, i32::to_le_bytes),
            ),
            ("geo/ids", St::U64, vec![3], le(&uids, u64::to_le_bytes)),
            ("tower.w", St::F32, vec![2, 2], le(&w, f32::to_le_bytes)),
        ],
    );
    let (s8, s3, ex) = (
        d.path().join("s8"),
        d.path().join("s3"),
        d.path().join("ex"),
    );
    ok(&[
        "save",
        "--out",
        p(&s8),
        "--from",
        p(&plain),
        "--shards",
        "8",
    ]);
    ok(&["reshard", p(&s8), "--out", p(&s3), "--shards", "3"]);
    ok(&["export", p(&s3), "--out", p(&ex)]);
    let orig = std::fs::read(&plain).unwrap();
    let orig = safetensors::SafeTensors::deserialize(&orig).unwrap();
    let back = std::fs::read(ex.join("model-00001-of-00001.safetensors")).unwrap();
    let back = safetensors::SafeTensors::deserialize(&back).unwrap();
    let mut names: Vec<String> = orig.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut back_names: Vec<String> = back.names().into_iter().map(str::to_string).collect();
    back_names.sort();
    assert_eq!(names, back_names);
    // The input's ids were ascending already, so every tensor must match byte for byte.
    for n in &names {
        let (a, b) = (orig.tensor(n).unwrap(), back.tensor(n).unwrap());
        assert_eq!(
            (a.dtype(), a.shape(), a.data()),
            (b.dtype(), b.shape(), b.data()),
            "{n}"
        );
    }
    let d0 = ok(&["digest", p(&plain)]);
    assert_eq!(d0, ok(&["digest", p(&s8)]));
    assert_eq!(d0, ok(&["digest", p(&s3)]));
    assert_eq!(d0, ok(&["digest", p(&ex)]));
}

#[test]
fn bad_input_is_refused_with_one_clear_line_and_nothing_committed() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out");
    let o = p(&out);
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["save", "--out", o, "--synthetic", "enormous"],
            "unknown preset \"enormous\"",
        ),
        (
            vec!["save", "--out", o, "--synthetic", "tables=x"],
            "tables=x",
        ),
        (
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--keep-rows",
                "freq=>3",
            ],
            "--keep-rows",
        ),
        (
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--keep-rows",
                "clicks>=3",
            ],
            "no table has a slot \"clicks\"",
        ),
        (
            vec!["save", "--out", o, "--synthetic", "tiny", "--shards", "0"],
            "at least 1",
        ),
        (
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--shards",
                "2",
                "--shard-index",
                "2",
                "--save-id",
                "x",
            ],
            "shard index 2",
        ),
        (
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--shards",
                "2",
                "--shard-index",
                "1",
            ],
            "--shard-index needs --save-id",
        ),
        (
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--exclude-slots",
                "[x",
            ],
            "\"[x\"",
        ),
        (
            vec!["save", "--out", o, "--from", "/no/such/input"],
            "/no/such/input",
        ),
    ];
    for bad in ["NaN", "inf", "-1", "1e300", "soon"] {
        cases.push((
            vec![
                "save",
                "--out",
                o,
                "--synthetic",
                "tiny",
                "--shards",
                "2",
                "--shard-index",
                "1",
                "--save-id",
                "w",
                "--wait-seconds",
                bad,
            ],
            "--wait-seconds",
        ));
    }
    for (args, needle) in cases {
        let (code, err) = fails(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let (code, err) = fails(&[
        "save",
        "--out",
        o,
        "--synthetic",
        "tiny",
        "--max-file-size",
        "lots",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--max-file-size"), "{err}");
    let (code, _) = fails(&["save", "--out", o]);
    assert_eq!(code, 2);
    let (code, _) = fails(&["frobnicate"]);
    assert_eq!(code, 2);

    // Ids and slots of different lengths, duplicate ids, bad id dtype: named, nothing written.
    let plain = d.path().join("bad.safetensors");
    let ids: Vec<i64> = vec![1, 2, 3];
    write_plain(
        &plain,
        vec![
            ("t/ids", St::I64, vec![3], le(&ids, i64::to_le_bytes)),
            ("t/emb", St::F32, vec![2, 4], vec![0u8; 32]),
        ],
    );
    let (_, err) = fails(&["save", "--out", o, "--from", p(&plain)]);
    assert!(err.contains("\"t/emb\"") && err.contains("3 ids"), "{err}");
    let dup: Vec<i64> = vec![5, -1, 5];
    write_plain(
        &plain,
        vec![("t/ids", St::I64, vec![3], le(&dup, i64::to_le_bytes))],
    );
    let (_, err) = fails(&["save", "--out", o, "--from", p(&plain)]);
    assert!(err.contains("id 5 appears more than once"), "{err}");
    write_plain(&plain, vec![("t/ids", St::F32, vec![3], vec![0u8; 12])]);
    let (_, err) = fails(&["save", "--out", o, "--from", p(&plain)]);
    assert!(
        err.contains("\"t/ids\"") && err.contains("I64 or U64"),
        "{err}"
    );
    assert!(!out.join("model.safetensors.index.json").exists());

    // A directory of DCP's own files (.metadata, *.distcp) is named as one, with the way in.
    let distcp = d.path().join("dcp");
    std::fs::create_dir_all(&distcp).unwrap();
    std::fs::write(distcp.join(".metadata"), b"\x80\x04").unwrap();
    std::fs::write(distcp.join("__0_0.distcp"), b"PK").unwrap();
    let (code, err) = fails(&["save", "--out", o, "--from", p(&distcp)]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("PyTorch DCP") && err.contains("python -m saver.dcp import"),
        "{err}"
    );
    assert!(!out.join("model.safetensors.index.json").exists());

    // Loading, verifying and inspecting what is not a checkpoint.
    std::fs::create_dir_all(&out).unwrap();
    let (code, err) = fails(&["load", o]);
    assert_eq!(code, 1);
    assert!(err.contains("not a complete checkpoint"), "{err}");
    let (code, _) = fails(&["verify", o]);
    assert_eq!(code, 3, "incomplete");
    let (_, err) = fails(&["inspect", p(&d.path().join("missing"))]);
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn overwrite_corruption_and_exit_codes() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("c");
    let o = p(&out);
    ok(&[
        "save",
        "--out",
        o,
        "--synthetic",
        "tiny",
        "--shards",
        "2",
        "--no-fsync",
    ]);
    let (code, err) = fails(&["save", "--out", o, "--synthetic", "tiny"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--overwrite") || err.contains("overwrite"),
        "{err}"
    );
    ok(&[
        "save",
        "--out",
        o,
        "--synthetic",
        "tiny,seed=9",
        "--overwrite",
    ]);
    let man = json(&["inspect", o]);
    let file = man["files"][0]["name"].as_str().unwrap().to_string();
    let path = out.join(&file);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let (code, err) = fails(&["verify", o]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains(&file) && err.contains("CRC32"), "{err}");
    let (code, err) = fails(&["load", o]);
    assert_eq!(code, 1);
    assert!(err.contains(&file), "{err}");
}

#[test]
fn n_cli_processes_save_one_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("mp");
    let o = p(&out).to_string();
    let children: Vec<_> = (0..3)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_saver"))
                .args([
                    "save",
                    "--out",
                    &o,
                    "--synthetic",
                    "tiny",
                    "--shards",
                    "3",
                    "--shard-index",
                    &i.to_string(),
                    "--save-id",
                    "mp1",
                    "--wait-seconds",
                    "60",
                    "--json",
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut committers = 0;
    for c in children {
        let c = c.wait_with_output().unwrap();
        assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
        let v: serde_json::Value = serde_json::from_slice(&c.stdout).unwrap();
        assert_eq!(v["committed"], true);
        committers += usize::from(v["committed_here"] == true);
    }
    assert_eq!(committers, 1);
    assert_eq!(json(&["verify", &o])["status"], "ok");
    let single = d.path().join("single");
    ok(&[
        "save",
        "--out",
        p(&single),
        "--synthetic",
        "tiny",
        "--shards",
        "1",
    ]);
    assert_eq!(ok(&["digest", &o]), ok(&["digest", p(&single)]));
    // A shard process that runs alone and is told to wait names what is missing.
    let lone = d.path().join("lone");
    let (_, err) = fails(&[
        "save",
        "--out",
        p(&lone),
        "--synthetic",
        "tiny",
        "--shards",
        "2",
        "--shard-index",
        "0",
        "--save-id",
        "lone1",
        "--wait-seconds",
        "0.2",
    ]);
    assert!(err.contains("missing shards: [1]"), "{err}");
}

#[test]
fn every_command_has_help_of_its_own_with_an_example() {
    // Each command's summary (the first line of its help) and what the top-level list says of it.
    let own = [
        ("save", "Save a checkpoint"),
        ("inspect", "Show what a checkpoint holds"),
        ("verify", "Check a checkpoint completely"),
        ("load", "Restore a checkpoint into memory"),
        (
            "reshard",
            "Rewrite a checkpoint for another number of shards",
        ),
        ("compact", "Rewrite a delta checkpoint and its chain"),
        ("export", "Write a consolidated plain safetensors copy"),
        ("digest", "Print a digest of a model's content"),
    ];
    let top = ok(&["--help"]);
    let mut summaries = HashMap::new();
    for (cmd, summary) in own {
        let h = ok(&[cmd, "--help"]);
        assert!(h.contains("Example"), "{cmd}: {h}");
        let first = h.lines().next().unwrap_or_default();
        assert!(first.starts_with(summary), "{cmd}'s help begins {first:?}");
        assert!(
            !h.contains("Output options shared"),
            "{cmd}: a flattened struct's doc leaked: {h}"
        );
        let listed = top
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{cmd} ")))
            .unwrap_or_else(|| panic!("{cmd} is not listed: {top}"));
        assert!(listed.contains(summary), "{cmd} is listed as {listed:?}");
        // No two commands share a summary.
        assert!(
            summaries.insert(first.to_string(), cmd).is_none(),
            "{cmd}: {first}"
        );
    }
    assert!(ok(&["save", "--help"]).contains("--keep-rows"));
}

#[test]
fn import_keeps_file_metadata_and_warns_of_a_misspelled_table() {
    let d = tempfile::tempdir().unwrap();
    let plain = d.path().join("plain.safetensors");
    let ids: Vec<i64> = vec![3, 1, 2];
    let emb: Vec<f32> = vec![0.5; 6];
    let tensors = [
        ("users/ID", St::I64, vec![3], le(&ids, i64::to_le_bytes)),
        ("users/emb", St::F32, vec![3, 2], le(&emb, f32::to_le_bytes)),
        ("item/ids", St::I64, vec![3], le(&ids, i64::to_le_bytes)),
        ("item/emb", St::F32, vec![3, 2], le(&emb, f32::to_le_bytes)),
    ];
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t, s, b)| (n.to_string(), TensorView::new(*t, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("trained_by".to_string(), "team-ads".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &plain).unwrap();
    let out = d.path().join("ck");
    let o = saver(&["save", "--out", p(&out), "--from", p(&plain)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("warning:") && err.contains("\"users/ID\"") && err.contains("users/ids"),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.contains("warning")).count(),
        1,
        "{err}"
    );
    // The input file's metadata is kept, and inspect shows it.
    let shown = ok(&["inspect", p(&out)]);
    assert!(
        shown.contains("plain.safetensors:trained_by = team-ads"),
        "{shown}"
    );
    let v = json(&["inspect", p(&out)]);
    assert_eq!(
        v["user_metadata"]["plain.safetensors:trained_by"],
        "team-ads"
    );
    // A NaN threshold would keep nothing: refused.
    let (code, err) = fails(&[
        "save",
        "--out",
        p(&d.path().join("nan")),
        "--from",
        p(&plain),
        "--keep-rows",
        "freq>=nan",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("NaN"), "{err}");
    // The existing checkpoint's message names the flag.
    let (_, err) = fails(&["save", "--out", p(&out), "--from", p(&plain)]);
    assert!(err.contains("--overwrite"), "{err}");
}

/// Tensors whose names are paths (`/ids`, `a/b/ids`, `a/b/w`) are dense tensors of a plain input,
/// imported as such without a word, as before the table-name checks.
#[test]
fn paths_that_end_in_ids_import_as_dense_tensors() {
    let d = tempfile::tempdir().unwrap();
    let plain = d.path().join("plain.safetensors");
    let ids: Vec<i64> = vec![3, 1, 2, 7];
    let w: Vec<f32> = vec![0.25; 8];
    let tensors = [
        ("/ids", St::I64, vec![4], le(&ids, i64::to_le_bytes)),
        ("a/b/ids", St::I64, vec![4], le(&ids, i64::to_le_bytes)),
        ("a/b/w", St::F32, vec![4, 2], le(&w, f32::to_le_bytes)),
    ];
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t, s, b)| (n.to_string(), TensorView::new(*t, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &plain).unwrap();
    let out = d.path().join("ck");
    let o = saver(&["save", "--out", p(&out), "--from", p(&plain)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("warning"), "{err}");
    let v = json(&["inspect", p(&out)]);
    let dense: Vec<&str> = v["dense"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(dense, ["/ids", "a/b/ids", "a/b/w"], "{v}");
    assert!(v["tables"].as_array().unwrap().is_empty(), "{v}");
}

/// A plain input whose `X/ids` names a table no checkpoint can hold (too long, a control
/// character) gets one error naming it, no contradictory warning that there is no `X/ids`.
#[test]
fn a_plain_table_with_an_impossible_name_is_one_error() {
    let d = tempfile::tempdir().unwrap();
    let ids: Vec<i64> = vec![3, 1, 2];
    let emb: Vec<f32> = vec![0.5; 6];
    for (i, table) in ["bad\u{1}name".to_string(), "t".repeat(600)]
        .iter()
        .enumerate()
    {
        let plain = d.path().join(format!("plain{i}.safetensors"));
        let names = [format!("{table}/ids"), format!("{table}/emb")];
        let tensors = [
            (&names[0], St::I64, vec![3], le(&ids, i64::to_le_bytes)),
            (&names[1], St::F32, vec![3, 2], le(&emb, f32::to_le_bytes)),
        ];
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, t, s, b)| (n.to_string(), TensorView::new(*t, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &plain).unwrap();
        let out = d.path().join(format!("ck{i}"));
        let (code, err) = fails(&["save", "--out", p(&out), "--from", p(&plain)]);
        assert_eq!(code, 1, "{err}");
        assert!(!err.contains("warning"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("cannot be a table's name"), "{err}");
    }
}

/// A plain model with `n` rows of table `user` (ids `ids`, a 4-wide embedding from `seed`).
fn plain_model(path: &Path, ids: &[i64], seed: f32, dense: f32) {
    let emb: Vec<f32> = ids
        .iter()
        .flat_map(|&i| {
            (0..4).map(move |k| i as f32 * 0.25 + k as f32 + seed * f32::from(i % 7 == 0))
        })
        .collect();
    write_plain(
        path,
        vec![
            (
                "user/ids",
                St::I64,
                vec![ids.len()],
                le(ids, i64::to_le_bytes),
            ),
            (
                "user/emb",
                St::F32,
                vec![ids.len(), 4],
                le(&emb, f32::to_le_bytes),
            ),
            ("w", St::F32, vec![2], le(&[dense, 1.0], f32::to_le_bytes)),
        ],
    );
}

#[test]
fn deltas_of_plain_inputs_through_every_command() {
    let d = tempfile::tempdir().unwrap();
    let path = |n: &str| d.path().join(n);
    // Step 0: ids 0..5000; step 1: every 7th row changed, 100 removed, 50 added; step 2: more.
    let ids0: Vec<i64> = (0..5000).collect();
    let ids1: Vec<i64> = (100..5050).collect();
    let ids2: Vec<i64> = (100..5050).filter(|i| i % 3 != 0).chain(-40..0).collect();
    plain_model(&path("m0.safetensors"), &ids0, 0.0, 0.0);
    plain_model(&path("m1.safetensors"), &ids1, 1.0, 1.0);
    plain_model(&path("m2.safetensors"), &ids2, 2.0, 2.0);
    let (m0, m1, m2) = (
        path("m0.safetensors"),
        path("m1.safetensors"),
        path("m2.safetensors"),
    );
    ok(&[
        "save",
        "--out",
        p(&path("c0")),
        "--from",
        p(&m0),
        "--shards",
        "3",
    ]);
    let r1 = json(&[
        "save",
        "--out",
        p(&path("c1")),
        "--from",
        p(&m1),
        "--parent",
        p(&path("c0")),
        "--shards",
        "2",
    ]);
    // About 700 rows changed (every 7th), 50 new and 100 removed ids, of 5000.
    assert!(r1["rows"].as_u64().unwrap() < 1000, "{r1}");
    ok(&[
        "save",
        "--out",
        p(&path("c2")),
        "--from",
        p(&m2),
        "--parent",
        p(&path("c1")),
        "--shards",
        "4",
    ]);
    let digest2 = ok(&["digest", p(&m2)]);
    assert_eq!(ok(&["digest", p(&path("c2"))]), digest2);
    assert_eq!(ok(&["digest", p(&path("c1"))]), ok(&["digest", p(&m1)]));
    // verify checks every link; inspect shows the chain.
    let v = json(&["verify", p(&path("c2"))]);
    assert_eq!(v["status"], "ok");
    assert_eq!(v["parents"].as_array().unwrap().len(), 2, "{v}");
    let i = ok(&["inspect", p(&path("c2"))]);
    assert!(i.contains("chain of 3 links") && i.contains("full"), "{i}");
    // load for shard j of M; compact; reshard; export; a delta of a delta's compaction.
    for j in 0..3 {
        let a = json(&[
            "load",
            p(&path("c2")),
            "--shards",
            "3",
            "--shard-index",
            &j.to_string(),
        ]);
        let b = json(&[
            "load",
            p(&path("c2")),
            "--shards",
            "3",
            "--shard-index",
            &j.to_string(),
            "--into",
            "arrays",
        ]);
        assert_eq!(a["rows"], b["rows"]);
    }
    ok(&["compact", p(&path("c2")), "--out", p(&path("full"))]);
    assert_eq!(ok(&["digest", p(&path("full"))]), digest2);
    let full = json(&["inspect", p(&path("full"))]);
    assert!(
        full.get("parent").is_none() && full["shards"] == 4,
        "{full}"
    );
    ok(&[
        "reshard",
        p(&path("c2")),
        "--out",
        p(&path("r5")),
        "--shards",
        "5",
    ]);
    assert_eq!(ok(&["digest", p(&path("r5"))]), digest2);
    ok(&["export", p(&path("c2")), "--out", p(&path("ex"))]);
    assert_eq!(ok(&["digest", p(&path("ex"))]), digest2);
    // The chain as --from: a full checkpoint of the same content.
    ok(&["save", "--out", p(&path("again")), "--from", p(&path("c2"))]);
    assert_eq!(ok(&["digest", p(&path("again"))]), digest2);

    // A parent that is gone: every command names it, in one line.
    std::fs::rename(path("c0"), path("c0-moved")).unwrap();
    for cmd in [
        vec!["digest", p(&path("c2"))],
        vec!["load", p(&path("c2"))],
        vec!["export", p(&path("c2")), "--out", p(&path("ex2"))],
    ] {
        let (_, err) = fails(&cmd);
        assert!(
            err.contains("c0") && err.trim().lines().count() == 1,
            "{cmd:?}: {err}"
        );
    }
    let (code, err) = fails(&["verify", p(&path("c2"))]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("c0"), "{err}");
}

#[test]
fn n_cli_processes_save_one_delta_with_another_shard_count() {
    let d = tempfile::tempdir().unwrap();
    let path = |n: &str| d.path().join(n);
    let ids0: Vec<i64> = (0..3000).collect();
    let ids1: Vec<i64> = (50..3100).filter(|i| i % 11 != 0).collect();
    plain_model(&path("m0.safetensors"), &ids0, 0.0, 0.0);
    plain_model(&path("m1.safetensors"), &ids1, 1.0, 1.0);
    ok(&[
        "save",
        "--out",
        p(&path("base")),
        "--from",
        p(&path("m0.safetensors")),
        "--shards",
        "2",
    ]);
    // The parent reached by two paths (a bind mount, which resolving links does not see
    // through): one checkpoint, whichever path a process was given.
    std::fs::create_dir(path("base-link")).unwrap();
    let bound = Command::new("mount")
        .args(["--bind", p(&path("base")), p(&path("base-link"))])
        .status()
        .is_ok_and(|s| s.success());
    /// Unmounts even when an assertion fails.
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = bound.then(|| Unmount(path("base-link")));
    if !bound {
        assert!(
            std::env::var_os("SAVER_REQUIRE_ROOT").is_none(),
            "mount --bind failed, and SAVER_REQUIRE_ROOT is set"
        );
        eprintln!("the bind-mounted parent path is skipped: mount --bind needs root");
        std::fs::remove_dir(path("base-link")).unwrap();
        std::os::unix::fs::symlink(path("base"), path("base-link")).unwrap();
    }
    // Rounds with varied start order and timing: every one commits exactly once, equal to m1.
    for round in 0..4 {
        let out = path(&format!("delta{round}"));
        let o = p(&out).to_string();
        let shards = 3 + round % 2;
        let mut children: Vec<_> = (0..shards)
            .rev()
            .map(|i| {
                std::thread::sleep(std::time::Duration::from_millis(
                    ((i + round) % 3) as u64 * 15,
                ));
                Command::new(env!("CARGO_BIN_EXE_saver"))
                    .args([
                        "save",
                        "--out",
                        &o,
                        "--from",
                        p(&path("m1.safetensors")),
                        "--parent",
                        p(&path(if i % 2 == 1 { "base-link" } else { "base" })),
                        "--shards",
                        &shards.to_string(),
                        "--shard-index",
                        &i.to_string(),
                        "--save-id",
                        &format!("d{round}"),
                        "--wait-seconds",
                        "60",
                        "--json",
                    ])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut committers = 0;
        for c in children.drain(..) {
            let c = c.wait_with_output().unwrap();
            assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
            let v: serde_json::Value = serde_json::from_slice(&c.stdout).unwrap();
            committers += usize::from(v["committed_here"] == true);
        }
        assert_eq!(committers, 1);
        assert_eq!(json(&["verify", &o])["status"], "ok");
        assert_eq!(
            ok(&["digest", &o]),
            ok(&["digest", p(&path("m1.safetensors"))])
        );
    }
}

/// `save --from` a plain table of several groups in rounds (`--import-rounds`) writes what one
/// pass writes (same digest, a complete checkpoint); the flag is refused without `--from` and
/// below 1.
#[test]
fn import_in_rounds_writes_what_one_pass_writes() {
    let d = tempfile::tempdir().unwrap();
    let plain = d.path().join("plain.safetensors");
    // 300 000 rows of 8 + 2 x 64 bytes: 41 MB, four groups of the distribution.
    let rows = 300_000usize;
    let ids: Vec<i64> = (0..rows as i64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64))
        .collect();
    let emb: Vec<f32> = (0..rows * 16).map(|x| x as f32).collect();
    let acc: Vec<f32> = (0..rows * 16).map(|x| (x % 977) as f32 * 0.25).collect();
    write_plain(
        &plain,
        vec![
            ("big/ids", St::I64, vec![rows], le(&ids, i64::to_le_bytes)),
            (
                "big/emb",
                St::F32,
                vec![rows, 16],
                le(&emb, f32::to_le_bytes),
            ),
            (
                "big/acc",
                St::F32,
                vec![rows, 16],
                le(&acc, f32::to_le_bytes),
            ),
            (
                "tower.w",
                St::F32,
                vec![2],
                le(&[1.0f32, 2.0], f32::to_le_bytes),
            ),
        ],
    );
    let mut digests = Vec::new();
    for rounds in ["1", "2", "4"] {
        let out = d.path().join(format!("r{rounds}"));
        ok(&[
            "save",
            "--from",
            p(&plain),
            "--out",
            p(&out),
            "--shards",
            "3",
            "--parallel",
            "2",
            "--import-rounds",
            rounds,
            "--no-fsync",
        ]);
        ok(&["verify", p(&out)]);
        digests.push(ok(&["digest", p(&out)]).trim().to_string());
    }
    assert_eq!(digests[0], digests[1], "2 rounds against one pass");
    assert_eq!(digests[0], digests[2], "4 rounds against one pass");
    assert_eq!(ok(&["digest", p(&plain)]).trim(), digests[0]);

    let (_, err) = fails(&[
        "save",
        "--synthetic",
        "tiny",
        "--out",
        p(&d.path().join("x")),
        "--import-rounds",
        "2",
    ]);
    assert!(err.contains("--from"), "{err}");
    let (_, err) = fails(&[
        "save",
        "--from",
        p(&plain),
        "--out",
        p(&d.path().join("y")),
        "--import-rounds",
        "0",
    ]);
    assert!(err.contains("--import-rounds"), "{err}");
}

#[test]
fn a_mistyped_object_store_url_is_an_error_never_a_local_directory() {
    let d = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_saver"))
            .current_dir(d.path())
            .args(args)
            .output()
            .expect("saver runs")
    };
    for url in ["s3:/ckpt/x", "s3:ckpt/x", "S3:/ckpt/x", "gs:/b/x"] {
        let out = run(&["save", "--synthetic", "tiny", "--out", url]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{url}: {err}");
        assert!(
            err.contains(url) && err.contains("s3://bucket/prefix"),
            "{url}: {err}"
        );
        for verb in ["verify", "inspect", "digest"] {
            let out = run(&[verb, url]);
            assert!(!out.status.success(), "{verb} {url}");
        }
    }
    // Nothing was made in the working directory.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    // A local directory whose name has a colon is still one, written as a path.
    ok(&[
        "save",
        "--synthetic",
        "tiny",
        "--out",
        p(&d.path().join("run:7")),
    ]);
    let out = run(&["save", "--synthetic", "tiny", "--out", "./s3:x"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The documented maximum, a chain of 64 links of 16 shards (1,024 data files), read under the
/// usual limit of 1,024 descriptors: `load` (into tables, into arrays, for another shard count),
/// `digest` and `verify` all succeed, with the digest the chain has without a limit (before, they
/// failed with "Too many open files" and `verify` called the chain corrupt). Under a limit too low
/// for anything, the resource error is named (exit 1), never taken for corruption (exit 4).
#[test]
fn a_chain_of_64_links_of_16_shards_reads_under_a_limit_of_1024_open_files() {
    let d = tempfile::tempdir().unwrap();
    let link = |k: usize| d.path().join(format!("l{k}"));
    ok(&[
        "save",
        "--synthetic",
        "tiny",
        "--shards",
        "16",
        "--no-fsync",
        "--out",
        p(&link(0)),
    ]);
    for k in 1..64 {
        let spec = format!("tiny,seed={k}");
        ok(&[
            "save",
            "--synthetic",
            &spec,
            "--shards",
            "16",
            "--no-fsync",
            "--parent",
            p(&link(k - 1)),
            "--out",
            p(&link(k)),
        ]);
    }
    let tip = link(63);
    let unlimited = ok(&["digest", p(&tip)]);
    let limited = |limit: u32, args: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ulimit -n {limit} && exec {} {args}",
                env!("CARGO_BIN_EXE_saver"),
            ))
            .output()
            .unwrap()
    };
    let tip = p(&tip);
    for args in [
        format!("digest {tip}"),
        format!("load {tip}"),
        format!("load {tip} --into arrays"),
        format!("load {tip} --shards 3 --shard-index 1"),
        format!("verify {tip}"),
    ] {
        let out = limited(1024, &args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if args.starts_with("digest") {
            assert_eq!(text, unlimited);
        }
        if args == format!("load {tip}") {
            assert!(text.contains(unlimited.trim()), "{text}");
        }
    }
    // So few descriptors that nothing can be read: an error naming the cause.
    for args in [format!("verify {tip}"), format!("digest {tip}")] {
        let out = limited(6, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args}: {err}");
        assert!(err.to_lowercase().contains("too many open files"), "{err}");
    }
}

/// An endpoint that accepts connections and never answers: `verify` fails after one retry window
/// (not one window per request it would make: three before), with one line naming the store and
/// what it waited for (the lines said while it waits are for a terminal, not a log).
#[test]
fn a_silent_store_fails_a_command_within_one_retry_window_saying_what_it_waits_for() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_saver"))
        .args(["verify", "s3://silent/ckpt"])
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ACCESS_KEY_ID", "k")
        .env("AWS_SECRET_ACCESS_KEY", "s")
        .env("AWS_REGION", "garage")
        .env("SAVER_S3_TIMEOUT_SECONDS", "2")
        .env("SAVER_S3_RETRY_SECONDS", "3")
        .output()
        .unwrap();
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("s3://silent/ckpt/model.safetensors.index.json"),
        "{err}"
    );
    assert!(err.contains("SAVER_S3_RETRY_SECONDS"), "{err}");
    assert!(!err.contains("waiting for"), "{err}");
    assert!(err.contains("did not answer in time"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // One window: a first attempt of 2 s and its retry, about 4 s; three windows took 12 s.
    assert!(took < std::time::Duration::from_secs(9), "{took:?}: {err}");
}

/// Every tensor of a plain export directory (all its files), as (dtype, shape, bytes), and the
/// `__metadata__` of each file.
type Exported = (
    HashMap<String, (St, Vec<usize>, Vec<u8>)>,
    Vec<HashMap<String, String>>,
);

fn read_export(dir: &Path) -> Exported {
    let (mut tensors, mut metas) = (HashMap::new(), Vec::new());
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        metas.push(meta.metadata().clone().unwrap_or_default());
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            tensors.insert(name, (t.dtype(), t.shape().to_vec(), t.data().to_vec()));
        }
    }
    (tensors, metas)
}

#[test]
fn quantized_exports_dequantize_to_within_half_a_step_from_any_shard_count_into_any_file_size() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    // dim 13: odd, so 4- and 2-bit rows end in a part-filled byte.
    let spec = "tables=2,rows=3000,dim=13,slots=embedding+adagrad,dense=4KiB,seed=3";
    ok(&[
        "save",
        "--out",
        p(&ck),
        "--synthetic",
        spec,
        "--shards",
        "5",
    ]);
    let plain = d.path().join("plain");
    ok(&["export", p(&ck), "--out", p(&plain)]);
    let (plain, _) = read_export(&plain);
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let f16s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect()
    };
    for (bits, layout) in [
        (8u32, "fused"),
        (8, "fused-half"),
        (8, "split"),
        (4, "fused"),
        (4, "split"),
        (2, "fused"),
        (2, "fused-half"),
    ] {
        let out = d.path().join(format!("q{bits}{layout}"));
        let r = json(&[
            "export",
            p(&ck),
            "--out",
            p(&out),
            "--quantize",
            &format!("int{bits}"),
            "--quantize-layout",
            layout,
            "--max-file-size",
            "32KiB",
        ]);
        assert!(r["files"].as_u64().unwrap() > 3, "small files: {r}");
        let (back, metas) = read_export(&out);
        let sbfloat = bits == 8 && layout == "fused";
        for table in ["t0", "t1"] {
            let name = format!("{table}/embedding");
            assert_eq!(
                back[&format!("{table}/ids")],
                plain[&format!("{table}/ids")]
            );
            assert_eq!(
                back[&format!("{table}/adagrad")],
                plain[&format!("{table}/adagrad")],
                "slots not quantized are exported as they are"
            );
            let rows = f32s(&plain[&name].2);
            let per = (8 / bits) as usize;
            let packed = 13usize.div_ceil(per);
            let (dtype, shape, bytes) = &back[&name];
            assert_eq!(*dtype, St::U8);
            let (values, scales, biases): (Vec<&[u8]>, Vec<f32>, Vec<f32>) = if layout == "split" {
                assert_eq!(shape, &vec![3000, packed]);
                let (s, b) = (
                    &back[&format!("{name}_qscale")],
                    &back[&format!("{name}_qbias")],
                );
                assert_eq!((s.0, &s.1), (St::F16, &vec![3000, 1]));
                (bytes.chunks(packed).collect(), f16s(&s.2), f16s(&b.2))
            } else {
                let width = packed + if sbfloat { 8 } else { 4 };
                assert_eq!(shape, &vec![3000, width]);
                let rows: Vec<&[u8]> = bytes.chunks(width).collect();
                let tail = |r: &[u8], k: usize| -> f32 {
                    if sbfloat {
                        f32s(&r[packed + 4 * k..packed + 4 * k + 4])[0]
                    } else {
                        f16s(&r[packed + 2 * k..packed + 2 * k + 2])[0]
                    }
                };
                let s = rows.iter().map(|r| tail(r, 0)).collect();
                let b = rows.iter().map(|r| tail(r, 1)).collect();
                (rows.iter().map(|r| &r[..packed]).collect(), s, b)
            };
            let levels = ((1u32 << bits) - 1) as f32;
            for (k, row) in rows.chunks(13).enumerate() {
                let (scale, bias) = (scales[k], biases[k]);
                let (lo, hi) = row
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                // What rounding bias and scale to f16 moves a value by, and the share of a
                // tiny range that the f32 form's 1e-8 in its divisor takes off.
                let slack = (bias - lo).abs()
                    + levels * (scale - (hi - bias) / levels).abs()
                    + (hi - lo) * 1e-8 / (hi - lo + 1e-8);
                for (c, &x) in row.iter().enumerate() {
                    let q = (values[k][c / per] >> ((c % per) as u32 * bits)) & levels as u8;
                    let y = scale * q as f32 + bias;
                    assert!(
                        (x - y).abs() <= scale * 0.5001 + slack + 1e-6,
                        "int{bits} {layout} {name} row {k}: {x} came back as {y}"
                    );
                }
            }
        }
        let quantized: Vec<&HashMap<String, String>> = metas
            .iter()
            .filter(|m| m.contains_key("quantized_tensors"))
            .collect();
        assert!(!quantized.is_empty());
        for m in quantized {
            assert_eq!(m["quantization_bits"], bits.to_string());
            let form = if sbfloat {
                "Fused8BitRowwiseQuantizedSBFloat"
            } else {
                "FusedNBitRowwiseQuantizedSBHalf"
            };
            assert_eq!(m["quantization"], form);
        }
    }

    // Refused, naming what is wrong: no slot to quantize, a slot that is not floating rows.
    let (_, err) = fails(&[
        "export",
        p(&ck),
        "--out",
        p(&d.path().join("none")),
        "--quantize",
        "int4",
        "--quantize-slots",
        "nothing*",
    ]);
    assert!(
        err.contains("quantize_slots") && err.contains("nothing*"),
        "{err}"
    );
    let (_, err) = fails(&[
        "export",
        p(&ck),
        "--out",
        p(&d.path().join("x")),
        "--quantize-layout",
        "split",
    ]);
    assert!(err.contains("--quantize"), "{err}");
    // A plain model of one table `t`, ids [3, 9] and these tensors, saved as checkpoint `name`.
    let checkpoint_of = |name: &str, tensors: Vec<(&str, St, Vec<usize>, Vec<u8>)>| {
        let plain = d.path().join(format!("{name}.safetensors"));
        let mut all = vec![("t/ids", St::I64, vec![2], le(&[3i64, 9], i64::to_le_bytes))];
        all.extend(tensors);
        write_plain(&plain, all);
        let ck = d.path().join(name);
        ok(&["save", "--out", p(&ck), "--from", p(&plain)]);
        ck
    };
    let embedding = |v: [f32; 4]| ("t/embedding", St::F32, vec![2, 2], le(&v, f32::to_le_bytes));
    // A row with a value that is not finite cannot be quantized: the export fails, naming the
    // tensor, and commits nothing.
    let nck = checkpoint_of("nan", vec![embedding([0.5, f32::NAN, 1.0, 2.0])]);
    let nex = d.path().join("nex");
    let (_, err) = fails(&["export", p(&nck), "--out", p(&nex), "--quantize", "int8"]);
    assert!(
        err.contains("t/embedding") && err.contains("not finite"),
        "{err}"
    );
    assert!(!nex.join("model.safetensors.index.json").exists());
    // A split layout whose scales would take the name of a slot the model has is refused.
    let scales = le(&[1.0f32, 2.0], f32::to_le_bytes);
    let cck = checkpoint_of(
        "clash",
        vec![
            embedding([0.5, 1.0, 1.5, 2.0]),
            ("t/embedding_qscale", St::F32, vec![2], scales),
        ],
    );
    let (_, err) = fails(&[
        "export",
        p(&cck),
        "--out",
        p(&d.path().join("cex")),
        "--quantize",
        "int4",
        "--quantize-layout",
        "split",
    ]);
    assert!(
        err.contains("t/embedding_qscale") && err.contains("split"),
        "{err}"
    );
}

/// `--compress zstd` through every command that writes a checkpoint (save, a delta, reshard,
/// compact) and every one that reads one (inspect, verify, load, digest, export): the same
/// content as the raw checkpoints, fewer bytes where the columns compress.
#[test]
fn compressed_checkpoints_through_every_command() {
    let d = tempfile::tempdir().unwrap();
    let path = |n: &str| d.path().join(n);
    let ids0: Vec<i64> = (0..40_000).collect();
    let ids1: Vec<i64> = (100..40_050).collect();
    plain_model(&path("m0.safetensors"), &ids0, 0.0, 0.0);
    plain_model(&path("m1.safetensors"), &ids1, 1.0, 1.0);
    let (m0, m1) = (path("m0.safetensors"), path("m1.safetensors"));
    let z = ["--compress", "zstd"];
    let save = |out: &str, from: &Path, shards: &str, extra: &[&str]| {
        let out = path(out);
        let mut a = vec!["save", "--out", p(&out), "--from", p(from)];
        a.extend(["--shards", shards]);
        a.extend(extra);
        json(&a)
    };
    let raw = save("raw0", &m0, "3", &[]);
    let packed = save("z0", &m0, "3", &z);
    assert!(
        packed["bytes_written"].as_u64().unwrap() * 2 < raw["bytes_written"].as_u64().unwrap(),
        "{packed} against {raw}"
    );
    let summary = json(&["inspect", p(&path("z0"))]);
    assert_eq!(summary["format_version"], 3);
    let table = &summary["tables"][0];
    assert!(
        table["stored_bytes"].as_u64().unwrap() * 2 < table["bytes"].as_u64().unwrap(),
        "{table}"
    );
    assert!(ok(&["inspect", p(&path("z0"))]).contains("stored)"));
    ok(&["verify", p(&path("z0"))]);
    let digest = |x: &str| ok(&["digest", p(&path(x))]).trim().to_string();
    assert_eq!(digest("z0"), digest("raw0"));
    assert_eq!(
        json(&[
            "load",
            p(&path("z0")),
            "--shards",
            "2",
            "--shard-index",
            "1"
        ])["digest"],
        json(&[
            "load",
            p(&path("raw0")),
            "--shards",
            "2",
            "--shard-index",
            "1"
        ])["digest"]
    );
    // A compressed delta of it; compacted, resharded, exported: the same as from the raw chain.
    let z0 = path("z0");
    let mut parent = vec!["--parent", p(&z0)];
    parent.extend(z);
    save("z1", &m1, "2", &parent);
    save("raw1", &m1, "2", &["--parent", p(&path("raw0"))]);
    assert_eq!(json(&["inspect", p(&path("z1"))])["format_version"], 4);
    assert_eq!(digest("z1"), digest("raw1"));
    ok(&[
        "compact",
        p(&path("z1")),
        "--out",
        p(&path("zc")),
        "--compress",
        "zstd",
    ]);
    ok(&[
        "reshard",
        p(&path("z1")),
        "--out",
        p(&path("zr")),
        "--shards",
        "5",
    ]);
    assert_eq!(json(&["inspect", p(&path("zr"))])["format_version"], 1);
    for x in ["zc", "zr"] {
        assert_eq!(digest(x), digest("raw1"), "{x}");
    }
    ok(&["export", p(&path("zc")), "--out", p(&path("ez"))]);
    ok(&["export", p(&path("raw1")), "--out", p(&path("er"))]);
    let file = "model-00001-of-00001.safetensors";
    assert!(
        std::fs::read(path("ez").join(file)).unwrap()
            == std::fs::read(path("er").join(file)).unwrap(),
        "the exports are the same bytes"
    );
    // A corrupt stored frame fails verify (exit 4), naming the file.
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            std::fs::read_dir(path("zc"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|f| f.to_string_lossy().ends_with(".manifest.json"))
                .unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    let t = &m["tables"][0]["partitions"][0]["segments"][0]["ids"];
    assert!(t["codec"].is_object(), "dense ids compress: {t}");
    let f = path("zc").join(t["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[t["offset"].as_u64().unwrap() as usize + 3] ^= 0xff;
    std::fs::write(&f, bytes).unwrap();
    let (code, err) = fails(&["verify", p(&path("zc"))]);
    assert_eq!(code, 4, "{err}");
    // Bad flags are refused before anything is written.
    let (_, err) = fails(&[
        "save",
        "--out",
        p(&path("bad")),
        "--from",
        p(&m0),
        "--compress",
        "zstd",
        "--compress-level",
        "25",
    ]);
    assert!(err.contains("compress-level"), "{err}");
    assert!(!path("bad").join("model.safetensors.index.json").exists());
}

/// Row-range tables through the binary: N processes each write the rows of their shard, one
/// commit; `inspect` lists the tables with their chunks, `verify` checks them, `digest` is the
/// same for every split; the commands that do not carry them yet refuse, naming them, and
/// write nothing.
#[test]
fn row_range_tables_through_every_command() {
    let d = tempfile::tempdir().unwrap();
    let spec = "tiny,kind=rows,rows=20000,dim=16";
    let out = d.path().join("mp");
    let o = p(&out).to_string();
    let children: Vec<_> = (0..3)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_saver"))
                .args([
                    "save",
                    "--out",
                    &o,
                    "--synthetic",
                    spec,
                    "--shards",
                    "3",
                    "--shard-index",
                    &i.to_string(),
                    "--save-id",
                    "rows1",
                    "--wait-seconds",
                    "60",
                    "--json",
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let c = c.wait_with_output().unwrap();
        assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    }
    let inspected = json(&["inspect", &o]);
    assert_eq!(inspected["format_version"], 5);
    let t0 = &inspected["row_tables"][0];
    assert_eq!(
        (t0["name"].as_str(), t0["rows"].as_u64()),
        (Some("t0"), Some(20000))
    );
    assert!(
        t0["slots"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["chunks"] == 3),
        "{t0}"
    );
    assert_eq!(json(&["verify", &o])["status"], "ok");
    let single = d.path().join("single");
    ok(&[
        "save",
        "--out",
        p(&single),
        "--synthetic",
        spec,
        "--shards",
        "1",
        "--compress",
        "zstd",
    ]);
    assert_eq!(ok(&["digest", &o]), ok(&["digest", p(&single)]));
    // Every rewrite carries them: the same content, whatever the shards.
    let digest = ok(&["digest", &o]);
    let (r, c, s, delta) = (
        d.path().join("r"),
        d.path().join("c"),
        d.path().join("s"),
        d.path().join("delta"),
    );
    ok(&["reshard", &o, "--out", p(&r), "--shards", "2"]);
    ok(&["compact", &o, "--out", p(&c)]);
    ok(&["save", "--from", &o, "--out", p(&s), "--shards", "2"]);
    // A delta of the same values holds patches of no changed rows.
    ok(&[
        "save",
        "--out",
        p(&delta),
        "--synthetic",
        spec,
        "--shards",
        "1",
        "--parent",
        &o,
    ]);
    let inspected = json(&["inspect", p(&delta)]);
    assert_eq!(inspected["format_version"], 6);
    let slot = &inspected["row_tables"][0]["slots"][0];
    assert!(
        slot["patches"].as_u64().unwrap() > 0 && slot["changed_rows"] == 0,
        "{slot}"
    );
    for dir in [&r, &c, &s, &delta] {
        assert_eq!(ok(&["digest", p(dir)]), digest, "{}", dir.display());
    }
    // `saver load` reads them: all of them give the checkpoint's digest; shard 1 of 2 its rows.
    let loaded = json(&["load", p(&delta)]);
    assert_eq!(loaded["digest"].as_str(), Some(digest.trim()), "{loaded}");
    assert_eq!(loaded["row_tables"], 3);
    let half = json(&["load", &o, "--shards", "2", "--shard-index", "1"]);
    let all_rows = loaded["row_table_rows"].as_u64().unwrap();
    assert_eq!(
        half["row_table_rows"].as_u64().unwrap() * 2,
        all_rows,
        "{half}"
    );
    let (_, err) = fails(&["digest", "--digest-version", "1", &o]);
    assert!(
        err.contains("row-range tables [\"t0\", \"t1\", \"t2\"]"),
        "{err}"
    );
    // An export writes each slot whole; quantized, the embedding's rows as FBGEMM's.
    let x = d.path().join("x");
    ok(&["export", &o, "--out", p(&x), "--quantize", "int8"]);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(x.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    for t in ["t0/embedding", "t0/adagrad", "t0/freq", "t2/embedding"] {
        assert!(index["weight_map"].get(t).is_some(), "{t}: {index}");
    }
    // A plain export (no cast) has the checkpoint's digest, and a save from it holds the same
    // row-range tables (before: its digest differed, and the tables came back as dense tensors).
    let (plain, back) = (d.path().join("plain"), d.path().join("back"));
    ok(&["export", &o, "--out", p(&plain)]);
    assert_eq!(ok(&["digest", p(&plain)]), digest);
    ok(&[
        "save",
        "--from",
        p(&plain),
        "--out",
        p(&back),
        "--shards",
        "3",
    ]);
    assert_eq!(ok(&["digest", p(&back)]), digest);
    let inspected = json(&["inspect", p(&back)]);
    assert_eq!(
        inspected["row_tables"].as_array().unwrap().len(),
        3,
        "{inspected}"
    );
    let names = |v: &serde_json::Value| -> Vec<String> {
        v["dense"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].to_string())
            .collect()
    };
    assert_eq!(names(&inspected), names(&json(&["inspect", &o])));
}

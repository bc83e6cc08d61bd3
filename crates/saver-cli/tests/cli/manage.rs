//! A managed root through the binary: `save --root --step`, `list`, `latest`, `load --step`,
//! `prune` and `clean`, locally and on the S3 test server.

use std::process::{Command, Output};

use crate::garage::Garage;

fn saver(env: &[(&'static str, String)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_saver"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(args)
        .output()
        .unwrap()
}

fn ok(env: &[(&'static str, String)], args: &[&str]) -> String {
    let out = saver(env, args);
    assert!(
        out.status.success(),
        "saver {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(env: &[(&'static str, String)], args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(env, args)).unwrap()
}

/// The digest a load prints.
fn digest(env: &[(&'static str, String)], args: &[&str]) -> String {
    json(env, args)["digest"].as_str().unwrap().to_string()
}

/// A job of six saves into `root` (a directory or a URL): deltas between full saves, the
/// newest two kept; then what every command says of it.
fn a_job_through_the_binary(root: &str, env: &[(&'static str, String)]) {
    if saver_io::storage::location_url(std::path::Path::new(root)).is_none() {
        // A root that does not exist is an error, never "no step yet".
        let out = saver(env, &["latest", root]);
        assert_eq!(out.status.code(), Some(1), "a missing root is an error");
        assert!(String::from_utf8_lossy(&out.stderr).contains(root));
        std::fs::create_dir_all(root).unwrap();
    }
    let out = saver(env, &["latest", root]);
    assert_eq!(out.status.code(), Some(3), "an empty root has no latest");
    let model = |s: u64| format!("tiny,seed={}", s % 2);
    for step in [100u64, 200, 300, 400, 500, 600] {
        let spec = model(step);
        let r = json(
            env,
            &[
                "save",
                "--root",
                root,
                "--step",
                &step.to_string(),
                "--synthetic",
                &spec,
                "--full-every",
                "3",
                "--keep-latest",
                "2",
                "--no-fsync",
                "--json",
            ],
        );
        let delta = r["delta_tables"].as_object().is_some_and(|d| !d.is_empty());
        assert_eq!(delta, step % 300 != 100, "step {step}: {r}");
    }
    let listed = json(env, &["list", root, "--json"]);
    let steps: Vec<u64> = listed["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    // The newest two (500, a delta of 400, and 600) and 400, the base 500 needs.
    assert_eq!(steps, vec![400, 500, 600], "{listed}");
    let latest = ok(env, &["latest", root]);
    assert!(latest.starts_with("600\t"), "{latest}");
    let path = latest.trim().split('\t').nth(1).unwrap().to_string();
    // load --step latest is the newest step's checkpoint, with any shard count.
    let by_step = digest(
        env,
        &["load", root, "--step", "latest", "--shards", "3", "--json"],
    );
    assert_eq!(by_step, digest(env, &["load", &path, "--json"]));
    assert_eq!(
        digest(env, &["load", root, "--step", "500", "--json"]),
        digest(
            env,
            &[
                "load",
                &format!("{root}/step-00000000000000000500"),
                "--json"
            ]
        )
    );
    // A step the root does not hold is an error naming it.
    let out = saver(env, &["load", root, "--step", "200"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("step 200") && err.contains("600"), "{err}");
    // prune keep 1: 600 is a delta of 500 of 400, so its chain keeps all three.
    let dry = json(
        env,
        &["prune", root, "--keep-latest", "1", "--dry-run", "--json"],
    );
    assert_eq!(dry["removed"], serde_json::json!([]), "{dry}");
    assert_eq!(dry["kept"], serde_json::json!([400, 500, 600]), "{dry}");
    // The next save is full (the chain is at its 3 links): its commit frees the chain.
    let r = json(
        env,
        &[
            "save",
            "--root",
            root,
            "--step",
            "700",
            "--synthetic",
            &model(700),
            "--keep-latest",
            "1",
            "--no-fsync",
            "--json",
        ],
    );
    assert!(
        r["delta_tables"].as_object().is_none_or(|d| d.is_empty()),
        "{r}"
    );
    assert_eq!(
        r["pruned"]["removed"],
        serde_json::json!([600, 500, 400]),
        "{r}"
    );
    let listed = json(env, &["list", root, "--json"]);
    assert_eq!(listed["steps"].as_array().unwrap().len(), 1);
    assert!(listed["uncommitted"].as_array().unwrap().is_empty());
    let clean = json(env, &["clean", root, "--json"]);
    assert!(clean["reclaimed"].as_array().unwrap().is_empty(), "{clean}");
    let latest = ok(env, &["latest", root]);
    assert!(latest.starts_with("700\t"), "{latest}");
    // A prune dry run of the policy the root keeps (keep 1, as the last save's flags said).
    let dry = json(env, &["prune", root, "--dry-run", "--json"]);
    assert_eq!(dry["kept"], serde_json::json!([700]));
    // 700 saved the model 600 held (seed 0), as one full checkpoint: the same content.
    assert_eq!(
        digest(env, &["load", root, "--step", "latest", "--json"]),
        by_step
    );
}

#[test]
fn a_managed_root_through_the_binary() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run7");
    a_job_through_the_binary(root.to_str().unwrap(), &[]);
    // The policy the flags gave is kept in the root.
    let policy: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("saver-policy.json")).unwrap()).unwrap();
    assert_eq!(policy["full_every"], 3);
    // Only step directories, the policy and the root's commit lock: nothing left behind by the
    // removals.
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ".saver-commit.lock",
            "saver-policy.json",
            "step-00000000000000000700"
        ]
    );
    // --root and --out together are refused.
    let out = saver(
        &[],
        &[
            "save",
            "--root",
            root.to_str().unwrap(),
            "--out",
            "/tmp/x",
            "--step",
            "1",
            "--synthetic",
            "tiny",
        ],
    );
    assert!(!out.status.success());
    // A step that is not after the newest is refused, naming both.
    let out = saver(
        &[],
        &[
            "save",
            "--root",
            root.to_str().unwrap(),
            "--step",
            "50",
            "--synthetic",
            "tiny",
            "--no-fsync",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("step 50") && err.contains("700"),
        "{err}"
    );
}

#[test]
fn a_managed_root_on_the_object_store() {
    let Some(g) = Garage::start() else {
        return;
    };
    let root = g.url("managed/run7");
    a_job_through_the_binary(&root, &g.env());
}

/// Saves steps 1 to 3 (each full) into `root`, keeping every one.
fn three_steps(root: &str) {
    for step in ["1", "2", "3"] {
        ok(
            &[],
            &[
                "save",
                "--root",
                root,
                "--step",
                step,
                "--synthetic",
                "tiny",
                "--full-every",
                "1",
                "--keep-latest",
                "5",
                "--no-fsync",
            ],
        );
    }
}

/// A policy file the manager cannot use stops whatever would act on it (retention, a save),
/// naming the file and the field, and removes nothing; reads and restarts do not need it.
#[test]
fn a_bad_policy_file_stops_retention_and_saves_but_never_reads() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run");
    let r = root.to_str().unwrap();
    three_steps(r);
    let file = root.join("saver-policy.json");
    for (policy, field) in [
        (r#"{"retention": {"keep_lastest": 5}}"#, "keep_lastest"),
        (r#"{"retention": {"keep_latest": 0}}"#, "keep_latest"),
        (r#"{"max_chain_links": 999}"#, "max_chain_links"),
        (r#"{"full_every": 0}"#, "full_every"),
        (r#"{"max_delta_fraction": -1.0}"#, "max_delta_fraction"),
    ] {
        std::fs::write(&file, policy).unwrap();
        for args in [
            vec!["prune", r],
            vec!["prune", r, "--dry-run"],
            vec![
                "save",
                "--root",
                r,
                "--step",
                "9",
                "--synthetic",
                "tiny",
                "--no-fsync",
            ],
        ] {
            let out = saver(&[], &args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?} with {policy}: {err}");
            assert!(
                err.contains(file.to_str().unwrap()) && err.contains(field),
                "{args:?} with {policy}: {err}"
            );
        }
        // Nothing removed, nothing saved.
        let steps = json(&[], &["list", r, "--json"])["steps"].clone();
        assert_eq!(steps.as_array().unwrap().len(), 3, "{policy}: {steps}");
        assert!(!root.join("step-00000000000000000009").exists(), "{policy}");
        // Reads and restarts.
        assert!(ok(&[], &["latest", r]).starts_with("3\t"));
        json(
            &[],
            &["load", r, "--step", "latest", "--json", "--no-digest"],
        );
        json(&[], &["load", r, "--step", "2", "--json", "--no-digest"]);
        ok(&[], &["clean", r, "--dry-run"]);
    }
}

/// A step whose index is cut is that step's problem: `clean` names it and goes on with the rest.
#[test]
fn clean_names_a_step_with_a_cut_index_and_cleans_the_rest() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run");
    let r = root.to_str().unwrap();
    three_steps(r);
    let index = root.join("step-00000000000000000002/model.safetensors.index.json");
    let bytes = std::fs::read(&index).unwrap();
    std::fs::write(&index, &bytes[..bytes.len() / 2]).unwrap();
    // A removal cut short in step 1: its marker, no index.
    let step1 = root.join("step-00000000000000000001");
    let save1 = json(&[], &["inspect", step1.to_str().unwrap(), "--json"])["save_id"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(
        step1.join("saver-pruning.json"),
        format!(r#"{{"step": 1, "save_ids": ["{save1}"]}}"#),
    )
    .unwrap();
    std::fs::remove_file(step1.join("model.safetensors.index.json")).unwrap();
    for dry in [true, false] {
        let mut args = vec!["clean", r, "--json"];
        if dry {
            args.push("--dry-run");
        }
        let report = json(&[], &args);
        assert_eq!(report["reclaimed"], serde_json::json!([1]), "{report}");
        let left = report["left_alone"].as_array().unwrap();
        assert_eq!(left.len(), 1, "{report}");
        assert_eq!(left[0][0], 2, "{report}");
        assert!(left[0][1].as_str().unwrap().contains("index"), "{report}");
    }
    assert!(!step1.exists());
    let text = ok(&[], &["clean", r]);
    assert!(text.contains("left step 2 alone"), "{text}");
}

/// `save --root` refuses a step out of order before it reads the model or makes a directory; a
/// model whose schema changed is saved full, saying why; `--full` forces one full save.
#[test]
fn save_root_refuses_early_saves_full_on_a_schema_change_and_on_request() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run");
    let r = root.to_str().unwrap();
    let save = |step: &str, spec: &str, extra: &[&str]| {
        let mut args = vec![
            "save",
            "--root",
            r,
            "--step",
            step,
            "--synthetic",
            spec,
            "--no-fsync",
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&[], &args)
    };
    assert!(save("10", "tiny", &[])["full_because"]
        .as_str()
        .unwrap()
        .contains("no earlier step"));
    assert!(save("20", "tiny", &[]).get("full_because").is_none());
    // Out of order: refused before the input is read (a missing one would say so) or the step's
    // directory is made.
    let missing = d.path().join("no-such-model");
    let out = saver(
        &[],
        &[
            "save",
            "--root",
            r,
            "--step",
            "15",
            "--from",
            missing.to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("step 15") && err.contains("20"),
        "{err}"
    );
    assert!(!root.join("step-00000000000000000015").exists());
    // Another dimension: a full save, with the reason.
    let why = save("30", "tiny,dim=4", &[])["full_because"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        why.contains("tables changed") && why.contains("[4]"),
        "{why}"
    );
    assert!(save("40", "tiny,dim=4", &[]).get("full_because").is_none());
    let why = save("50", "tiny,dim=4", &["--full"])["full_because"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(why.contains("asked for"), "{why}");
    let text = ok(
        &[],
        &[
            "save",
            "--root",
            r,
            "--step",
            "60",
            "--synthetic",
            "tiny",
            "--no-fsync",
        ],
    );
    assert!(text.contains("a full save: the tables changed"), "{text}");
}

/// A checkpoint directory is not a managed root: every root command refuses it, naming it,
/// and nothing is written into it.
#[test]
fn a_checkpoint_is_not_taken_for_a_managed_root() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let c = ck.to_str().unwrap();
    ok(
        &[],
        &["save", "--out", c, "--synthetic", "tiny", "--no-fsync"],
    );
    let before: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    for args in [
        vec!["list", c],
        vec!["latest", c],
        vec!["prune", c],
        vec!["clean", c],
        vec!["load", c, "--step", "latest"],
        vec![
            "save",
            "--root",
            c,
            "--step",
            "1",
            "--synthetic",
            "tiny",
            "--no-fsync",
        ],
    ] {
        let out = saver(&[], &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(c) && err.contains("not the step directories"),
            "{args:?}: {err}"
        );
    }
    let after: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before.len(), after.len(), "{after:?}");
}

/// `load --step latest --fallback` loads the newest step that verifies, saying which newer one
/// it passed over and why; without --fallback the damaged step fails the load.
#[test]
fn load_falls_back_to_the_newest_step_that_verifies_only_when_asked() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run");
    let r = root.to_str().unwrap();
    three_steps(r);
    let step3 = root.join("step-00000000000000000003");
    let data = std::fs::read_dir(&step3)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let mut bytes = std::fs::read(&data).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();
    let out = saver(&[], &["load", r, "--step", "latest", "--json"]);
    assert!(
        !out.status.success(),
        "a damaged newest step fails the load"
    );
    let out = saver(
        &[],
        &["load", r, "--step", "latest", "--fallback", "--json"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("step 3 does not verify") && err.contains("loading step 2"),
        "{err}"
    );
    let want = json(
        &[],
        &[
            "load",
            root.join("step-00000000000000000002").to_str().unwrap(),
            "--json",
        ],
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["digest"], want["digest"]);
}

/// What the commands show a person: `list` gives start times as dates and one writer per
/// process, `inspect` the step, errors under `--json` are JSON, and `prune --help` offers only
/// retention's flags.
#[test]
fn the_commands_speak_plainly() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("run");
    let r = root.to_str().unwrap();
    ok(
        &[],
        &[
            "save",
            "--root",
            r,
            "--step",
            "7",
            "--synthetic",
            "tiny",
            "--shards",
            "3",
            "--no-fsync",
        ],
    );
    let listed = ok(&[], &["list", r]);
    let row = listed.lines().nth(1).unwrap();
    let cols: Vec<&str> = row.split('\t').collect();
    assert!(cols[4].starts_with("20") && cols[4].ends_with('Z'), "{row}");
    assert!(
        !cols[5].contains(','),
        "one process wrote the three shards: {row}"
    );
    let step = root.join("step-00000000000000000007");
    let shown = ok(&[], &["inspect", step.to_str().unwrap()]);
    assert!(
        shown.lines().next().unwrap().contains(", step 7)"),
        "{shown}"
    );
    assert_eq!(
        json(&[], &["inspect", step.to_str().unwrap(), "--json"])["step"],
        7
    );
    let out = saver(&[], &["inspect", "/no/such/checkpoint", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        e["error"].as_str().unwrap().contains("/no/such/checkpoint"),
        "{e}"
    );
    let help = ok(&[], &["prune", "--help"]);
    assert!(help.contains("--keep-latest"), "{help}");
    assert!(
        !help.contains("--full-every") && !help.contains("--max-chain-links"),
        "{help}"
    );
    // Every shard written, the index gone: the message says the commit is what is missing.
    std::fs::remove_file(step.join("model.safetensors.index.json")).unwrap();
    let out = saver(&[], &["inspect", step.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("all 3 shards written, but the commit is missing"),
        "{err}"
    );
    assert!(!err.contains("missing shards []"), "{err}");
}

/// At a terminal every command that reads or writes a checkpoint shows its progress; off one
/// (a pipe, a log) none does. The terminal is `script`'s pseudo-terminal (util-linux, on every
/// Debian machine): a machine without it fails this test rather than skip it.
#[test]
fn progress_shows_at_a_terminal_and_nowhere_else() {
    let d = tempfile::tempdir().unwrap();
    let p = |name: &str| d.path().join(name).to_str().unwrap().to_string();
    let ck = p("ck");
    ok(
        &[],
        &["save", "--out", &ck, "--synthetic", "tiny", "--no-fsync"],
    );
    let bin = env!("CARGO_BIN_EXE_saver");
    for (args, shown) in [
        (vec!["verify", &ck], "verifying"),
        (vec!["export", &ck, "--out", &p("ex")], "exporting"),
        (vec!["digest", &ck], "reading"),
        (
            vec![
                "reshard",
                &ck,
                "--out",
                &p("rs"),
                "--shards",
                "2",
                "--no-fsync",
            ],
            "writing",
        ),
        (
            vec!["compact", &ck, "--out", &p("cp"), "--no-fsync"],
            "writing",
        ),
    ] {
        let line = std::iter::once(bin)
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        let out = Command::new("script")
            .args(["-qec", &line, "/dev/null"])
            .output()
            .expect("script (util-linux) runs the command at a pseudo-terminal");
        let seen = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{line}: {seen}");
        assert!(seen.contains(shown), "{line} at a terminal: {seen:?}");
    }
    // Off a terminal: nothing but the result.
    let out = saver(&[], &["verify", &ck]);
    assert!(String::from_utf8_lossy(&out.stderr).is_empty());
}

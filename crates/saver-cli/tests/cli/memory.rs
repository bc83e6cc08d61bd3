//! Every command that reads or rewrites a model (or a chain of deltas) runs in bounded memory: on a model several times
//! larger than the bound, each `saver` process's peak RSS (as the kernel counts it, mapped file
//! pages included) stays under it, and the results agree (one digest throughout). Saves to and
//! reads from an S3-compatible store (Garage on loopback) are held to the same bound.
//!
//! Row-range tables (what `saver.torch` saves) are held to the same bound by every command that
//! copies them: `save --from`, `reshard`, a delta's comparison, `compact`, `export`, `digest`.
//!
//! Needs an optimised build to run in reasonable time, so a debug `cargo test` skips it;
//! `tests/run.sh` runs it with `cargo test --release -p saver-cli --test memory`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::process::Command;

/// Peak RSS allowed for any one command, in bytes. The model is about five times larger.
const LIMIT: u64 = 160 << 20;

/// Rows of the model: 8-byte ids and two 32-wide f32 slots, 264 bytes a row (about 800 MB).
const ROWS: u64 = 3_000_000;

/// Creates a safetensors file at `path` and writes its header: `tensors` (name, dtype, shape,
/// bytes) laid out in order, `header` holding anything else (`__metadata__`). The caller writes
/// the tensors' bytes in that order.
fn create_safetensors(
    path: &Path,
    tensors: &[(&str, &str, Vec<u64>, u64)],
    mut header: serde_json::Map<String, serde_json::Value>,
) -> BufWriter<File> {
    let mut off = 0;
    for (name, dtype, shape, len) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [off, off + len] }),
        );
        off += len;
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut f = BufWriter::with_capacity(1 << 20, File::create(path).unwrap());
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    f
}

/// Writes a plain safetensors model: table `emb` (ids scrambled, unique) and a dense tensor.
fn write_model(path: &Path) {
    let dim = 32u64;
    let dense = 1u64 << 20;
    let tensors = [
        ("emb/ids", "I64", vec![ROWS], ROWS * 8),
        ("emb/embedding", "F32", vec![ROWS, dim], ROWS * dim * 4),
        ("emb/adagrad", "F32", vec![ROWS, dim], ROWS * dim * 4),
        ("mlp/w", "F32", vec![dense / 4], dense),
    ];
    let mut f = create_safetensors(path, &tensors, serde_json::Map::new());
    for r in 0..ROWS {
        // An odd multiplier is a bijection on u64: unique ids in no useful order.
        f.write_all(&r.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes())
            .unwrap();
    }
    let mut x = 1u32;
    for _ in 0..2 {
        let mut row = Vec::with_capacity(dim as usize * 4);
        for _ in 0..ROWS {
            row.clear();
            for _ in 0..dim {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                row.extend_from_slice(&((x >> 8) as f32 / 1e6).to_le_bytes());
            }
            f.write_all(&row).unwrap();
        }
    }
    f.write_all(&vec![7u8; dense as usize]).unwrap();
    f.flush().unwrap();
}

/// Runs `saver args` to completion with `env` set; returns its stdout and its peak RSS in bytes.
fn run(args: &[&str], tmp: &Path, env: &[(&str, String)]) -> (String, u64) {
    let child = Command::new(env!("CARGO_BIN_EXE_saver"))
        .args(args)
        .env("TMPDIR", tmp)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("saver runs");
    let pid = child.id() as libc::pid_t;
    let output = {
        // Read the pipes on threads while this one waits for the process with wait4, which
        // gives that one child's resource usage.
        let mut child = child;
        let mut out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let o = std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut out, &mut s).unwrap();
            s
        });
        let e = std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut err, &mut s).unwrap();
            s
        });
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our child, not yet waited for; the pointers are valid.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
        std::mem::forget(child);
        let (stdout, stderr) = (o.join().unwrap(), e.join().unwrap());
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "saver {args:?} failed: {stdout}{stderr}"
        );
        (stdout, usage.ru_maxrss as u64 * 1024)
    };
    output
}

/// Writes a model named `name` in `dir` with `write`, checks that it dwarfs [`LIMIT`], and makes
/// the commands' `$TMPDIR`: the model's path, its size in bytes, and that directory.
fn model_past_the_bound(
    dir: &Path,
    name: &str,
    write: fn(&Path),
) -> (String, u64, std::path::PathBuf) {
    let model = dir.join(name);
    write(&model);
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(
        size > 4 * LIMIT,
        "the model ({size} bytes) must dwarf the bound"
    );
    let tmp = dir.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    (model.to_str().unwrap().to_string(), size, tmp)
}

/// Runs each `(what, args)` in turn (`--parallel 2` added to all but `export`), asserting its
/// peak RSS under [`LIMIT`] (the model is `size` bytes); returns what the digests printed.
fn run_within_bound(
    commands: &[(&str, Vec<String>)],
    tmp: &Path,
    env: &[(&str, String)],
    size: u64,
) -> Vec<String> {
    let mut digests = Vec::new();
    for (what, args) in commands {
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        if args[0] != "export" {
            args.extend(["--parallel", "2"]);
        }
        let (out, rss) = run(&args, tmp, env);
        eprintln!("{what}: peak RSS {} MiB", rss >> 20);
        assert!(
            rss < LIMIT,
            "{what} peaked at {} MiB, over the {} MiB bound (model {} MiB)",
            rss >> 20,
            LIMIT >> 20,
            size >> 20
        );
        if args[0] == "digest" {
            digests.push(out.trim().to_string());
        }
    }
    digests
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "needs an optimised build: tests/run.sh runs it"
)]
fn every_command_runs_in_bounded_memory_on_a_model_larger_than_the_bound() {
    let d = tempfile::tempdir().unwrap();
    let p = |x: &str| d.path().join(x).to_str().unwrap().to_string();
    let (model, size, tmp) = model_past_the_bound(d.path(), "model.safetensors", write_model);
    // Saves to and reads from an S3-compatible store: its parts in flight and being filled are
    // held within the same bound.
    let g = crate::garage::Garage::start();
    let s3 = |x: &str| g.as_ref().map(|g| g.url(&format!("memory/{x}")));
    let mut commands: Vec<(&str, Vec<String>)> = vec![
        (
            "save --from",
            vec![
                "save".into(),
                "--from".into(),
                model.clone(),
                "--out".into(),
                p("ck"),
                "--shards".into(),
                "3".into(),
                "--no-fsync".into(),
            ],
        ),
        (
            "reshard",
            vec![
                "reshard".into(),
                p("ck"),
                "--out".into(),
                p("ck2"),
                "--shards".into(),
                "2".into(),
                "--no-fsync".into(),
            ],
        ),
        (
            "export",
            vec!["export".into(), p("ck2"), "--out".into(), p("ex")],
        ),
        (
            "export --quantize int4",
            vec![
                "export".into(),
                p("ck2"),
                "--out".into(),
                p("exq"),
                "--quantize".into(),
                "int4".into(),
                "--max-file-size".into(),
                "64MiB".into(),
            ],
        ),
        ("digest of the input", vec!["digest".into(), model.clone()]),
        ("digest of the checkpoint", vec!["digest".into(), p("ck")]),
        ("digest of the reshard", vec!["digest".into(), p("ck2")]),
        ("digest of the export", vec!["digest".into(), p("ex")]),
        (
            "save --from the export",
            vec![
                "save".into(),
                "--from".into(),
                p("ex"),
                "--out".into(),
                p("ck3"),
                "--no-fsync".into(),
            ],
        ),
        ("digest of that", vec!["digest".into(), p("ck3")]),
        // A chain whose merge handles every row three times: the base, a delta removing every
        // row (no row has a scalar "adagrad"), and a delta adding them all back.
        (
            "delta removing every row",
            vec![
                "save".into(),
                "--from".into(),
                p("ck3"),
                "--parent".into(),
                p("ck2"),
                "--keep-rows".into(),
                "adagrad>=0".into(),
                "--out".into(),
                p("d1"),
                "--no-fsync".into(),
            ],
        ),
        (
            "delta adding them back",
            vec![
                "save".into(),
                "--from".into(),
                model.clone(),
                "--parent".into(),
                p("d1"),
                "--out".into(),
                p("d2"),
                "--shards".into(),
                "2".into(),
                "--no-fsync".into(),
            ],
        ),
        ("digest of the chain", vec!["digest".into(), p("d2")]),
        (
            "compact",
            vec![
                "compact".into(),
                p("d2"),
                "--out".into(),
                p("ck4"),
                "--no-fsync".into(),
            ],
        ),
        ("digest of the compaction", vec!["digest".into(), p("ck4")]),
    ];
    if let (Some(ck), Some(ck2)) = (s3("ck"), s3("ck2")) {
        commands.extend([
            (
                "save --from to the store",
                vec![
                    "save".into(),
                    "--from".into(),
                    model.clone(),
                    "--out".into(),
                    ck.clone(),
                    "--shards".into(),
                    "3".into(),
                ],
            ),
            (
                "digest of the store's checkpoint",
                vec!["digest".into(), ck.clone()],
            ),
            (
                "reshard from the store to the store",
                vec![
                    "reshard".into(),
                    ck,
                    "--out".into(),
                    ck2.clone(),
                    "--shards".into(),
                    "2".into(),
                ],
            ),
            ("digest of that", vec!["digest".into(), ck2]),
        ]);
    }
    let env = g.as_ref().map(|g| g.env()).unwrap_or_default();
    let digests = run_within_bound(&commands, &tmp, &env, size);
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "temporary files are nameless"
    );
}

/// Rows of the row-range model: a 64-wide f32 slot and a scalar one, 260 bytes a row (about
/// 680 MB).
const TABLE_ROWS: u64 = 2_600_000;

/// Writes a plain safetensors model holding row-range table `item` (named so by the file's
/// `saver_row_tables` metadata, as an export writes it) and a dense tensor.
fn write_row_model(path: &Path) {
    let dim = 64u64;
    let tensors = [
        (
            "item/weight",
            "F32",
            vec![TABLE_ROWS, dim],
            TABLE_ROWS * dim * 4,
        ),
        ("item/adagrad", "F32", vec![TABLE_ROWS], TABLE_ROWS * 4),
        ("mlp/w", "F32", vec![1 << 18], 1 << 20),
    ];
    let mut metadata = serde_json::Map::new();
    metadata.insert(
        "__metadata__".into(),
        serde_json::json!({ "saver_row_tables": "[\"item\"]" }),
    );
    let mut f = create_safetensors(path, &tensors, metadata);
    let mut x = 7u32;
    let mut block = Vec::with_capacity(1 << 20);
    let mut left = TABLE_ROWS * (dim + 1);
    while left > 0 {
        block.clear();
        for _ in 0..left.min(1 << 18) {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            block.extend_from_slice(&((x >> 8) as f32 / 1e6).to_le_bytes());
        }
        left -= (block.len() / 4) as u64;
        f.write_all(&block).unwrap();
    }
    f.write_all(&vec![3u8; 1 << 20]).unwrap();
    f.flush().unwrap();
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "needs an optimised build: tests/run.sh runs it"
)]
fn every_command_copies_a_row_range_table_larger_than_the_bound_in_bounded_memory() {
    let d = tempfile::tempdir().unwrap();
    let p = |x: &str| d.path().join(x).to_str().unwrap().to_string();
    let (model, size, tmp) = model_past_the_bound(d.path(), "rows.safetensors", write_row_model);
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let commands: Vec<(&str, Vec<String>)> = vec![
        (
            "save --from",
            args(&[
                "save",
                "--from",
                &model,
                "--out",
                &p("ck"),
                "--shards",
                "3",
                "--no-fsync",
            ]),
        ),
        ("digest of the input", args(&["digest", &model])),
        ("digest of the checkpoint", args(&["digest", &p("ck")])),
        (
            "reshard",
            args(&[
                "reshard",
                &p("ck"),
                "--out",
                &p("ck2"),
                "--shards",
                "2",
                "--no-fsync",
            ]),
        ),
        ("digest of the reshard", args(&["digest", &p("ck2")])),
        // Every row compared with the parent's, none changed: the delta holds no rows.
        (
            "delta of the same rows",
            args(&[
                "save",
                "--from",
                &p("ck"),
                "--parent",
                &p("ck2"),
                "--out",
                &p("d1"),
                "--no-fsync",
            ]),
        ),
        ("digest of the chain", args(&["digest", &p("d1")])),
        (
            "compact",
            args(&[
                "compact",
                &p("d1"),
                "--out",
                &p("ck3"),
                "--shards",
                "1",
                "--no-fsync",
            ]),
        ),
        ("digest of the compaction", args(&["digest", &p("ck3")])),
        ("export", args(&["export", &p("ck3"), "--out", &p("ex")])),
        ("digest of the export", args(&["digest", &p("ex")])),
        (
            "save --from the export",
            args(&["save", "--from", &p("ex"), "--out", &p("ck4"), "--no-fsync"]),
        ),
        ("digest of that", args(&["digest", &p("ck4")])),
    ];
    let digests = run_within_bound(&commands, &tmp, &[], size);
    assert_eq!(digests.len(), 7);
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");
    let delta_bytes: u64 = std::fs::read_dir(p("d1"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        delta_bytes < 1 << 20,
        "the delta of unchanged rows holds none, yet takes {delta_bytes} bytes"
    );
}

//! The checkpoint manager's costs, each against a baseline in the same run
//! (docs/benchmarks/HISTORY.md, "Checkpoint manager"):
//!
//! * `restore_latest` of a root kept by the default policy, at the longest chain the policy
//!   leaves (a full checkpoint and three deltas of 1 % changed rows each), against restoring a
//!   full checkpoint of the same state; runs alternated, page cache warm for both;
//! * listing a root of `--checkpoints` steps (`steps()`, every manifest read; `latest()`, the
//!   newest chain only) and pruning it to its newest 10, on the local disk: time per step;
//! * a trainer's steps/s while the manager saves in the background every second (durable, deltas
//!   between full saves, retention after each commit) against the same trainer with no saves,
//!   `--train-seconds` each, alternated.
//!
//! `cargo bench --bench manager -- [--spec criteo-kaggle,scale=0.25] [--runs 3]
//! [--checkpoints 1000] [--train-seconds 10] [--train-rows 1048576] [--dir PATH]`

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use saver::core::partition::fmix64;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::manage::Retention;
use saver::{
    save, Checkpoint, CheckpointManager, EmbeddingTable, KeyDtype, LoadOptions, Policy, SaveInput,
    SaveOptions, SlotSpec,
};

/// 1 % of each table's rows changed.
fn train(tables: &[EmbeddingTable], round: u64) {
    for table in tables {
        let ids = table.ids();
        let n = ids.len() as u64;
        for k in 0..n / 100 {
            let id = ids[(fmix64(k ^ (round << 48)) % n) as usize];
            table.update(id, |row| row.slot_mut::<f32>(0)[0] += 1.0);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn opts() -> SaveOptions {
    let mut o = SaveOptions::default();
    o.plan.shard_num = 4;
    o
}

mod common;
use common::{input_of, tracked_copy};
#[path = "../tests/integration/common/garage.rs"]
mod garage;

/// A root of `n` tiny checkpoints at `root`, saved with `opts`; then the times of `steps()`,
/// `latest()` and a prune to the newest 10, printed as a table row each.
fn list_and_prune(label: &str, root: &std::path::Path, n: u64, opts: &SaveOptions) {
    let keep_all = {
        let mut o = Policy {
            full_every: 1,
            ..Default::default()
        };
        o.retention = {
            Retention {
                keep_latest: usize::MAX,
                ..Default::default()
            }
        };
        o
    };
    let mm = CheckpointManager::open(root, keep_all).unwrap();
    let t = EmbeddingTable::new(
        "t",
        KeyDtype::U64,
        vec![SlotSpec::new("e", saver::Dtype::F32, vec![4])],
    )
    .unwrap();
    t.insert(1, &[&[0u8; 16]]).unwrap();
    for step in 1..=n {
        mm.save(step, SaveInput::new().table(&t), opts).unwrap();
    }
    let t0 = Instant::now();
    assert_eq!(mm.steps().unwrap().len() as u64, n);
    let list_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    assert_eq!(mm.latest().unwrap().unwrap().step, n);
    let latest_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let keep = {
        Retention {
            keep_latest: 10,
            ..Default::default()
        }
    };
    let pruned = mm.prune(Some(&keep), false).unwrap();
    let prune_s = t0.elapsed().as_secs_f64();
    assert_eq!(pruned.removed.len() as u64, n.saturating_sub(10));
    let per = |s: f64, k: u64| format!("{:.2} ms", s * 1e3 / k.max(1) as f64);
    println!(
        "| {label}, {n} checkpoints | {} | {:.1} ms | {} |",
        per(list_s, n),
        latest_s * 1e3,
        per(prune_s, pruned.removed.len() as u64)
    );
}

/// Steps of 10,000 upserts a trainer makes on `t` while `during` runs (or for `secs` seconds when
/// it returns at once), per second.
fn steps_per_second(t: &EmbeddingTable, secs: f64, during: impl FnOnce(&AtomicBool)) -> f64 {
    let stop = AtomicBool::new(false);
    let hot = t.len() as u64 / 10;
    let start = Instant::now();
    let steps = std::thread::scope(|s| {
        let trainer = s.spawn(|| {
            let (mut n, mut r) = (0u64, 1u64);
            while !stop.load(Ordering::Relaxed) {
                common::train_step(t, hot, 10_000, &mut r);
                n += 1;
            }
            n
        });
        during(&stop);
        while start.elapsed().as_secs_f64() < secs {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        trainer.join().unwrap()
    });
    steps as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let spec = arg("--spec").unwrap_or_else(|| "criteo-kaggle,scale=0.25".into());
    let runs: usize = arg("--runs").map_or(3, |r| r.parse().unwrap());
    let checkpoints: u64 = arg("--checkpoints").map_or(1000, |r| r.parse().unwrap());
    let dir = PathBuf::from(arg("--dir").unwrap_or_else(|| "target/bench-manager".into()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // A job under the default policy, up to the longest chain it leaves.
    let m = SyntheticModel::generate(&spec.parse::<SyntheticSpec>().unwrap()).unwrap();
    let tables = tracked_copy(&m);
    let policy = Policy::default();
    let root = dir.join("root");
    let manager = CheckpointManager::open(&root, policy.clone()).unwrap();
    for step in 1..=policy.full_every as u64 {
        train(&tables, step);
        manager.save(step, input_of(&tables, &m), &opts()).unwrap();
    }
    let latest = manager.latest().unwrap().unwrap();
    let full = dir.join("full");
    save(&full, input_of(&tables, &m), &opts()).unwrap();
    let (mut chain_t, mut full_t) = (Vec::new(), Vec::new());
    let lopts = LoadOptions::default();
    for round in 0..=runs {
        let t = Instant::now();
        let (step, r) = manager.restore_latest(&lopts).unwrap().unwrap();
        let chain_s = t.elapsed().as_secs_f64();
        assert_eq!(step, latest.step);
        let rows_chain = r.report.rows;
        drop(r);
        let t = Instant::now();
        let r = Checkpoint::open(&full).unwrap().restore(&lopts).unwrap();
        let full_s = t.elapsed().as_secs_f64();
        assert_eq!(r.report.rows, rows_chain, "the same state");
        drop(r);
        if round > 0 {
            chain_t.push(chain_s);
            full_t.push(full_s);
        }
    }
    let (c, f) = (median(chain_t), median(full_t));
    println!("| what | full checkpoint | restore_latest | ratio |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| restore, {} links ({spec}, {} rows) | {f:.3} s | {c:.3} s | {:.2} |",
        latest.links,
        m.tables.iter().map(|t| t.len()).sum::<usize>(),
        c / f
    );
    drop(manager);

    // Roots of many small checkpoints: listing and pruning, on the local disk and on Garage.
    println!();
    println!("| root | steps(), a step | latest() | prune to the newest 10, a removed step |");
    println!("| --- | --- | --- | --- |");
    let quick = {
        SaveOptions {
            durable: false,
            ..Default::default()
        }
    };
    list_and_prune("local disk", &dir.join("many"), checkpoints, &quick);
    if let Some(g) = garage::shared() {
        // Each tiny save takes tens of requests of 5-30 ms here: a smaller root.
        let n = checkpoints.min(200);
        let url = g.url("bench-manager/many");
        list_and_prune("Garage on loopback", std::path::Path::new(&url), n, &quick);
    }

    // A trainer's pace with the manager saving in the background, against none.
    let secs: f64 = arg("--train-seconds").map_or(10.0, |r| r.parse().unwrap());
    let rows: u64 = arg("--train-rows").map_or(1 << 20, |r| r.parse().unwrap());
    let table = Arc::new(common::trainer_table_with(rows, true));
    let (mut idle, mut saving) = (Vec::new(), Vec::new());
    let mut saves = 0;
    for round in 0..runs.max(1) {
        idle.push(steps_per_second(&table, secs, |_| {}));
        let troot = dir.join(format!("train-{round}"));
        let tm = CheckpointManager::open(&troot, Policy::default()).unwrap();
        saving.push(steps_per_second(&table, secs, |stop| {
            let start = Instant::now();
            let mut step = 0;
            while start.elapsed().as_secs_f64() < secs && !stop.load(Ordering::Relaxed) {
                step += 1;
                tm.save_async(step, SaveInput::new().table(Arc::clone(&table)), &opts())
                    .unwrap();
                saves += 1;
                std::thread::sleep(Duration::from_secs(1));
            }
        }));
        tm.wait().unwrap();
    }
    let (i, w) = (median(idle), median(saving));
    println!();
    println!("| trainer, {rows} rows, steps of 10,000 upserts | no saves | manager saving every second | ratio |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| steps/s ({saves} background saves, {secs} s a run) | {i:.1} | {w:.1} | {:.2} |",
        w / i
    );
    let _ = std::fs::remove_dir_all(&dir);
}

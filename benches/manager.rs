//! The checkpoint manager's costs, each against a baseline in the same run
//! (docs/BENCHMARKS.md, "Checkpoint manager"):
//!
//! * `restore_latest` of a root kept by the default policy, at the longest chain the policy
//!   leaves (a full checkpoint and three deltas of 1 % changed rows each), against restoring a
//!   full checkpoint of the same state; runs alternated, page cache warm for both;
//! * listing a root of `--checkpoints` steps (`steps()`, every manifest read; `latest()`, the
//!   newest chain only) and pruning it to its newest 10, on the local disk: time per step.
//!
//! `cargo bench --bench manager -- [--spec criteo-kaggle,scale=0.25] [--runs 3]
//! [--checkpoints 1000] [--dir PATH]`

use std::path::PathBuf;
use std::time::Instant;

use saver::core::partition::fmix64;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::manage::Retention;
use saver::{
    save, Checkpoint, CheckpointManager, DenseTensor, EmbeddingTable, KeyDtype, LoadOptions,
    Policy, SaveInput, SaveOptions, SlotSpec, SparseTable,
};

/// Copies of `m`'s tables with change tracking on.
fn tracked_copy(m: &SyntheticModel) -> Vec<EmbeddingTable> {
    m.tables
        .iter()
        .map(|t| {
            let c = EmbeddingTable::new(t.name(), SparseTable::key_dtype(t), t.slots().to_vec())
                .unwrap()
                .with_change_tracking()
                .unwrap();
            let widths = t.slot_row_bytes().to_vec();
            let mut row = Vec::new();
            for id in t.ids() {
                row.clear();
                t.append_row(id, &mut row);
                let mut at = 0;
                let values: Vec<&[u8]> = widths
                    .iter()
                    .map(|&w| {
                        at += w;
                        &row[at - w..at]
                    })
                    .collect();
                c.insert(id, &values).unwrap();
            }
            c
        })
        .collect()
}

fn input_of<'a>(tables: &'a [EmbeddingTable], m: &'a SyntheticModel) -> SaveInput<'a> {
    let mut input = SaveInput::new();
    for t in tables {
        input = input.table(t);
    }
    for (name, shape, data) in &m.dense {
        input = input.dense(
            DenseTensor::new(name.clone(), saver::Dtype::F32, shape.clone(), &data[..]).unwrap(),
        );
    }
    input
}

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

    // A root of many small checkpoints: listing and pruning.
    let many = dir.join("many");
    let keep_all = Policy {
        full_every: 1,
        retention: Retention {
            keep_latest: usize::MAX,
            ..Retention::default()
        },
        ..Policy::default()
    };
    let mm = CheckpointManager::open(&many, keep_all).unwrap();
    let t = EmbeddingTable::new(
        "t",
        KeyDtype::U64,
        vec![SlotSpec::new("e", saver::Dtype::F32, vec![4])],
    )
    .unwrap();
    t.insert(1, &[&[0u8; 16]]).unwrap();
    let quick = SaveOptions {
        durable: false,
        ..SaveOptions::default()
    };
    for step in 1..=checkpoints {
        mm.save(step, SaveInput::new().table(&t), &quick).unwrap();
    }
    let t0 = Instant::now();
    let n = mm.steps().unwrap().len();
    let list_s = t0.elapsed().as_secs_f64();
    assert_eq!(n as u64, checkpoints);
    let t0 = Instant::now();
    assert_eq!(mm.latest().unwrap().unwrap().step, checkpoints);
    let latest_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let pruned = mm
        .prune(
            Some(&Retention {
                keep_latest: 10,
                ..Retention::default()
            }),
            false,
        )
        .unwrap();
    let prune_s = t0.elapsed().as_secs_f64();
    assert_eq!(pruned.removed.len() as u64, checkpoints.saturating_sub(10));
    println!();
    println!("| root of {checkpoints} checkpoints (local disk) | time | per checkpoint |");
    println!("| --- | --- | --- |");
    let per = |s: f64, k: u64| format!("{:.3} ms", s * 1e3 / k.max(1) as f64);
    println!(
        "| steps() (every manifest) | {list_s:.3} s | {} |",
        per(list_s, checkpoints)
    );
    println!("| latest() (newest chain only) | {:.4} s | - |", latest_s);
    println!(
        "| prune to the newest 10 ({} removed) | {prune_s:.3} s | {} |",
        pruned.removed.len(),
        per(prune_s, pruned.removed.len() as u64)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

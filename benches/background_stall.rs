//! How long a background save holds the trainer: the time `save_async` takes to return (the
//! save's moment is fixed, the rest runs on the save's threads), for every kind of save, against
//! the time the same save takes when the trainer waits for it whole (a blocking save's stall);
//! and the training lost while the background save runs: a trainer thread updates the table
//! (steps of 10,000 upserts) throughout, and the steps it did not take during the save, at its
//! pace in the half second before, are counted in seconds of training.
//!
//! `cargo bench --bench background_stall -- [--rows 1000000] [--runs 5]`
//!
//! A table of `--rows` rows (ids 0..rows, a 32-wide embedding and its Adagrad accumulator: 256
//! bytes a row), a full checkpoint of it, then 1 % of its rows changed before every save. Kinds:
//! a full save; a delta of a table that tracks its changes; a delta of one that does not (its rows
//! compared with the parent's); a delta of a tracking table with a row filter (compared too).
//! Every save is durable, into a directory of its own. Medians of `--runs` rounds after a
//! warm-up round, kinds interleaved.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{median, train_step, trainer_table_with};
use saver::core::Filters;
use saver::{save, save_async, EmbeddingTable, SaveInput, SaveOptions};

/// One kind of save: its name, whether its table tracks changes, whether it is a delta and
/// whether it has a row filter.
struct Kind {
    name: &'static str,
    tracking: bool,
    delta: bool,
    filter: bool,
}

const KINDS: [Kind; 4] = [
    Kind {
        name: "full save",
        tracking: true,
        delta: false,
        filter: false,
    },
    Kind {
        name: "delta, tracked changes",
        tracking: true,
        delta: true,
        filter: false,
    },
    Kind {
        name: "delta, compared with the parent",
        tracking: false,
        delta: true,
        filter: false,
    },
    Kind {
        name: "delta with a row filter",
        tracking: true,
        delta: true,
        filter: true,
    },
];

fn opts(kind: &Kind, parent: &Path) -> SaveOptions {
    let mut o = {
        SaveOptions {
            parent: kind.delta.then(|| parent.to_path_buf()),
            ..Default::default()
        }
    };
    o.plan.parallel = 2;
    if kind.filter {
        // Keeps every row (the filter's cost, not what it drops, is measured).
        o.plan.filters = Filters::new().keep_rows(|_| true);
    }
    o
}

/// 1 % of the rows of `t` changed, different ones each round.
fn train(t: &EmbeddingTable, rows: u64, round: u64) {
    for k in 0..rows / 100 {
        let id = saver::core::partition::fmix64(k ^ (round << 40)) % rows;
        t.upsert(id, |row| row.slot_mut::<f32>(0)[0] += 1.0);
    }
}

/// Runs `save` while a trainer thread updates `t`: what `save` returns, and the seconds of
/// training lost while it ran (steps not taken, at the trainer's pace in the half second before).
fn while_training(t: &EmbeddingTable, rows: u64, save: impl FnOnce() -> f64) -> (f64, f64) {
    const BATCH: u64 = 10_000;
    let steps = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut r = 7u64;
            while !stop.load(Ordering::Relaxed) {
                train_step(t, rows, BATCH, &mut r);
                steps.fetch_add(1, Ordering::Relaxed);
            }
        });
        let window = Duration::from_millis(500);
        let before = steps.load(Ordering::Relaxed);
        std::thread::sleep(window);
        let pace = (steps.load(Ordering::Relaxed) - before) as f64 / window.as_secs_f64();
        let (t0, at0) = (Instant::now(), steps.load(Ordering::Relaxed));
        let held = save();
        let (took, taken) = (
            t0.elapsed().as_secs_f64(),
            steps.load(Ordering::Relaxed) - at0,
        );
        stop.store(true, Ordering::Relaxed);
        (held, (took - taken as f64 / pace.max(1e-9)).max(0.0))
    })
}

fn main() {
    let rows: u64 = common::arg("--rows")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let runs: usize = common::arg("--runs")
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let scratch = common::scratch().join("background_stall");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let tables: Vec<Arc<EmbeddingTable>> = KINDS
        .iter()
        .map(|k| Arc::new(trainer_table_with(rows, k.tracking)))
        .collect();
    // Each kind's parent: a full checkpoint of its table.
    let parents: Vec<PathBuf> = (0..KINDS.len())
        .map(|i| {
            let p = scratch.join(format!("parent-{i}"));
            save(
                &p,
                SaveInput::new().table(&*tables[i]),
                &SaveOptions::default(),
            )
            .unwrap();
            p
        })
        .collect();
    println!("## Background saves: the time `save_async` holds the trainer\n");
    println!(
        "{rows} rows of 256 bytes, 1 % changed before each save, durable saves, parallel 2. \
         Medians of {runs} rounds after a warm-up round. Baseline: the same save, blocking.\n"
    );
    let mut returned = vec![Vec::new(); KINDS.len()];
    let mut lost = vec![Vec::new(); KINDS.len()];
    let mut blocking = vec![Vec::new(); KINDS.len()];
    let mut n = 0u64;
    for round in 0..=runs {
        for (i, kind) in KINDS.iter().enumerate() {
            for background in [true, false] {
                n += 1;
                train(&tables[i], rows, n);
                let dir = scratch.join(format!("save-{n}"));
                let o = opts(kind, &parents[i]);
                let secs = if background {
                    let (held, training_lost) = while_training(&tables[i], rows, || {
                        let t = Instant::now();
                        let h = save_async(&dir, SaveInput::new().table(Arc::clone(&tables[i])), o)
                            .unwrap();
                        let held = t.elapsed().as_secs_f64();
                        h.wait().unwrap();
                        held
                    });
                    if round > 0 {
                        lost[i].push(training_lost);
                    }
                    held
                } else {
                    let t = Instant::now();
                    save(&dir, SaveInput::new().table(&*tables[i]), &o).unwrap();
                    t.elapsed().as_secs_f64()
                };
                let _ = std::fs::remove_dir_all(&dir);
                if round > 0 {
                    if background {
                        returned[i].push(secs);
                    } else {
                        blocking[i].push(secs);
                    }
                }
            }
        }
    }
    println!(
        "| save | `save_async` returns after | training lost while it runs | blocking save (its \
         stall) | returned / stall | lost / stall |\n| --- | --- | --- | --- | --- | --- |"
    );
    for (i, kind) in KINDS.iter().enumerate() {
        let (r, l, b) = (
            median(returned[i].clone()),
            median(lost[i].clone()),
            median(blocking[i].clone()),
        );
        println!(
            "| {} | {:.1} ms | {:.0} ms | {:.0} ms | **{:.3}** | **{:.2}** |",
            kind.name,
            r * 1e3,
            l * 1e3,
            b * 1e3,
            r / b,
            l / b
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

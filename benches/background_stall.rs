//! How long a background save holds the trainer: the time `save_async` takes to return (the
//! save's moment is fixed, the rest runs on the save's threads), for every kind of save, against
//! the time the same save takes when the trainer waits for it whole (a blocking save's stall).
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

use common::{median, trainer_table_with};
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
    let mut o = SaveOptions {
        parent: kind.delta.then(|| parent.to_path_buf()),
        ..SaveOptions::default()
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
    let mut blocking = vec![Vec::new(); KINDS.len()];
    let mut n = 0u64;
    for round in 0..=runs {
        for (i, kind) in KINDS.iter().enumerate() {
            for background in [true, false] {
                n += 1;
                train(&tables[i], rows, n);
                let dir = scratch.join(format!("save-{n}"));
                let o = opts(kind, &parents[i]);
                let t = Instant::now();
                let secs = if background {
                    let h = save_async(&dir, SaveInput::new().table(Arc::clone(&tables[i])), o)
                        .unwrap();
                    let held = t.elapsed().as_secs_f64();
                    h.wait().unwrap();
                    held
                } else {
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
        "| save | `save_async` returns after | blocking save | ratio |\n| --- | --- | --- | --- |"
    );
    for (i, kind) in KINDS.iter().enumerate() {
        let (r, b) = (median(returned[i].clone()), median(blocking[i].clone()));
        println!(
            "| {} | {:.1} ms | {:.0} ms | **{:.3}** |",
            kind.name,
            r * 1e3,
            b * 1e3,
            r / b
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

//! Training while saving: what a background point-in-time save costs the trainer on this machine.
//!
//! A trainer thread applies steps of 10,000 upserts (dim-32 embedding + Adagrad) to rows of a 1 M
//! row table (256 MiB), to a hot set of 1 % or 10 % of them, as fast as it can. Reported, in one
//! run: the time the trainer is blocked in `save_async`; its steps/s and p99 step time outside a
//! save and during durable saves with 1 and 2 writer threads; the copy-on-write memory at its
//! peak; and the save's time with the trainer running against idle.
//!
//! `cargo bench --bench train_while_saving` (SAVER_BENCH_DIR for the output directory).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use saver::{save_async, EmbeddingTable, SaveInput, SaveOptions};

mod common;

const ROWS: u64 = 1 << 20;
const ROW_BYTES: u64 = 256;
const BATCH: u64 = 10_000;

/// Step end times and durations of a trainer that runs until `stop`.
fn trainer(
    t: &EmbeddingTable,
    hot: u64,
    stop: &AtomicBool,
    begin: Instant,
) -> Vec<(Duration, Duration)> {
    let mut steps = Vec::new();
    let mut r = 1u64;
    while !stop.load(Ordering::Relaxed) {
        let s = Instant::now();
        common::train_step(t, hot, BATCH, &mut r);
        steps.push((begin.elapsed(), s.elapsed()));
    }
    steps
}

/// Steps/s and p99 step time of the steps that ended within `[from, to)`.
fn rate(steps: &[(Duration, Duration)], from: Duration, to: Duration) -> (f64, Duration) {
    let mut within: Vec<Duration> = steps
        .iter()
        .filter(|(end, _)| *end >= from && *end < to)
        .map(|s| s.1)
        .collect();
    within.sort();
    let p99 = within
        .get(within.len() * 99 / 100)
        .copied()
        .unwrap_or_default();
    (within.len() as f64 / (to - from).as_secs_f64(), p99)
}

fn main() {
    let scratch = common::scratch().join("train-while-saving");
    let _ = std::fs::remove_dir_all(&scratch);
    println!(
        "table: {ROWS} rows, {} MiB; steps of {BATCH} upserts",
        (ROWS * ROW_BYTES) >> 20
    );
    for hot_percent in [1u64, 10] {
        let hot = ROWS * hot_percent / 100;
        let t = Arc::new(common::trainer_table(ROWS));
        let stop = AtomicBool::new(false);
        let begin = Instant::now();
        let saves = Mutex::new(Vec::new());
        let steps = std::thread::scope(|s| {
            let trainer = s.spawn(|| trainer(&t, hot, &stop, begin));
            std::thread::sleep(Duration::from_secs(2));
            for (k, parallel) in [1usize, 2, 1, 2].into_iter().enumerate() {
                let mut opts = SaveOptions {
                    save_id: Some(format!("h{hot_percent}k{k}")),
                    ..SaveOptions::default()
                };
                opts.plan.parallel = parallel;
                let dir = scratch.join(format!("h{hot_percent}k{k}"));
                let from = begin.elapsed();
                let h = save_async(&dir, SaveInput::new().table(t.clone()), opts).unwrap();
                let blocked = begin.elapsed() - from;
                h.wait().unwrap();
                let to = begin.elapsed();
                saves.lock().unwrap().push((
                    parallel,
                    from,
                    to,
                    blocked,
                    t.point_in_time_bytes().1,
                ));
                std::fs::remove_dir_all(&dir).unwrap();
                std::thread::sleep(Duration::from_secs(1));
            }
            stop.store(true, Ordering::Relaxed);
            trainer.join().unwrap()
        });
        let (outside, p99_outside) =
            rate(&steps, Duration::from_millis(500), Duration::from_secs(2));
        println!(
            "\nhot set {hot_percent} %: outside a save {outside:.1} steps/s, p99 {p99_outside:.1?}"
        );
        for (parallel, from, to, blocked, peak) in saves.into_inner().unwrap() {
            let (during, p99) = rate(&steps, from, to);
            println!(
                "  save, parallel {parallel}: {:.2} s, blocked {blocked:.2?}; during it {during:.1} steps/s ({:.2} x outside), p99 {p99:.1?}; copy-on-write peak so far {:.1} MiB ({:.1} % of the table)",
                (to - from).as_secs_f64(),
                during / outside,
                peak as f64 / (1 << 20) as f64,
                peak as f64 * 100.0 / (ROWS * ROW_BYTES) as f64,
            );
        }
        // The same save with the trainer idle.
        for parallel in [1usize, 2] {
            let mut opts = SaveOptions {
                save_id: Some(format!("idle{hot_percent}p{parallel}")),
                ..SaveOptions::default()
            };
            opts.plan.parallel = parallel;
            let dir = scratch.join(format!("idle{hot_percent}p{parallel}"));
            let start = Instant::now();
            save_async(&dir, SaveInput::new().table(t.clone()), opts)
                .unwrap()
                .wait()
                .unwrap();
            println!(
                "  save, parallel {parallel}, trainer idle: {:.2} s",
                start.elapsed().as_secs_f64()
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

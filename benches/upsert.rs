//! What a trainer's write costs: `EmbeddingTable::upsert` of existing rows (dim 32 embedding +
//! Adagrad, 1 M rows, random ids) with no save open, and while a point-in-time snapshot is open:
//! rows already kept (the steady state of a long save) and first writes after the moment (each
//! keeps the row's pre-image). `cargo bench --bench upsert`
//!
//! `no save open, change tracking`: the same on a table with change tracking on.
//!
//! The first figure is comparable with builds before copy-on-write (the file compiles against
//! them unchanged but for the snapshot groups): the cost of the check every write now makes.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use saver::{EmbeddingTable, SparseTable};

mod common;

const ROWS: u64 = 1 << 20;
const BATCH: u64 = 10_000;

/// One batch of upserts of random existing rows, as a training step applies gradients.
fn step(t: &EmbeddingTable, seed: u64) {
    let mut r = seed;
    common::train_step(t, ROWS, BATCH, &mut r);
}

fn upsert(c: &mut Criterion) {
    let t = common::trainer_table(ROWS);
    let mut g = c.benchmark_group("upsert");
    g.throughput(Throughput::Elements(BATCH));
    let mut seed = 1;
    g.bench_function("no save open", |b| {
        b.iter(|| {
            seed += 1;
            step(&t, seed)
        })
    });
    if std::env::var_os("SAVER_BENCH_BASELINE").is_none() {
        // The same writes to a table that tracks its changes (one more load and store a write).
        let tracked = common::trainer_table_with(ROWS, true);
        g.bench_function("no save open, change tracking", |b| {
            b.iter(|| {
                seed += 1;
                step(&tracked, seed)
            })
        });
        drop(tracked);
        // Every row kept once: later writes find their pre-image kept and only look it up.
        let snap = t.snapshot().unwrap();
        for id in 0..ROWS {
            t.upsert(id, |_| ());
        }
        g.bench_function("save open, rows already kept", |b| {
            b.iter(|| {
                seed += 1;
                step(&t, seed)
            })
        });
        drop(snap);
        // A fresh snapshot per batch: most writes are the row's first after the moment.
        g.bench_function("save open, first writes (pre-image kept)", |b| {
            b.iter_batched(
                || t.snapshot().unwrap(),
                |snap| {
                    seed += 1;
                    step(&t, seed);
                    snap
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, upsert);
criterion_main!(benches);

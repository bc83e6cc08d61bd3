//! Save and load throughput against the plain write / read of the same bytes, measured in the same
//! group so the ratio is meaningful on a noisy machine. `cargo bench --bench save_load`
//! (`SAVER_BENCH_BYTES` sets the model size; default 256 MiB).

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::{save, Checkpoint, LoadOptions, SaveOptions};

fn bytes() -> u64 {
    std::env::var("SAVER_BENCH_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256 << 20)
}

fn opts(parallel: usize, durable: bool) -> SaveOptions {
    let mut o = {
        SaveOptions {
            durable,
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.parallel = parallel;
    o
}

fn save_load(c: &mut Criterion) {
    let spec: SyntheticSpec = common::spec_of_size(bytes()).parse().unwrap();
    let model = SyntheticModel::generate(&spec).unwrap();
    let dir = common::scratch().join("criterion");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let probe = save(dir.join("probe"), model.input(), &opts(2, false)).unwrap();
    let total = probe.bytes_written;

    let mut g = c.benchmark_group("save");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(total));
    for durable in [false, true] {
        let tag = if durable { "fsync" } else { "no fsync" };
        g.bench_function(format!("plain sequential write ({tag})"), |b| {
            b.iter(|| common::plain_write(&dir.join("plain.bin"), total, durable))
        });
        for p in [1, 2, 4] {
            g.bench_function(format!("saver save, parallel {p} ({tag})"), |b| {
                b.iter(|| save(dir.join("ckpt"), model.input(), &opts(p, durable)).unwrap())
            });
        }
    }
    g.finish();

    let ckpt = dir.join("probe");
    let files = common::data_files(&ckpt);
    let ck = Checkpoint::open(&ckpt).unwrap();
    let mut g = c.benchmark_group("load (warm cache)");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(total));
    g.bench_function("plain read into reused buffers, 2 threads", |b| {
        b.iter(|| common::plain_read(&files, 2))
    });
    g.bench_function("saver restore (owning), parallel 2", |b| {
        b.iter(|| {
            ck.restore(&{
                LoadOptions {
                    parallel: 2,
                    ..Default::default()
                }
            })
            .unwrap()
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, save_load);
criterion_main!(benches);

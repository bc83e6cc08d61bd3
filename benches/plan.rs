//! Planning a Criteo-Kaggle-shaped model: 26 tables, 30 million rows (dim 16, Adagrad).
//! `cargo bench --bench plan`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::{PlanOptions, SaveInput};

fn plan(c: &mut Criterion) {
    // 33.76 M rows at scale 1; 0.8886 gives 30.0 M.
    let spec: SyntheticSpec = "criteo-kaggle,scale=0.8886".parse().unwrap();
    let rows: u64 = spec.table_rows().iter().sum();
    let model = SyntheticModel::generate(&spec).unwrap();
    let mut g = c.benchmark_group("plan");
    g.sample_size(10);
    g.throughput(Throughput::Elements(rows));
    for shards in [1u32, 8] {
        g.bench_function(
            format!("26 tables, {:.1}M rows, {shards} shards", rows as f64 / 1e6),
            |b| {
                b.iter(|| {
                    let input: SaveInput<'_> = model.input();
                    let p = saver::core::plan(
                        input,
                        &PlanOptions {
                            shard_num: shards,
                            ..PlanOptions::default()
                        },
                    )
                    .unwrap();
                    assert!(p.data_bytes() > 0);
                    p
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, plan);
criterion_main!(benches);

//! Planning a Criteo-Kaggle-shaped model: 26 tables, 30 million rows (dim 16, Adagrad).
//! `cargo bench --bench plan` (`SAVER_BENCH_SCALE` for another scale of the model)
//!
//! `plan` alone counts and groups the rows; their sort by (bucket, id) happens when the writer
//! takes them, so `plan + sorted ids` (every partition's ids, as the writer sees them) is the
//! figure to compare with plans made before that change. `spilled` is the same with every table's
//! rows in a spill file on the scratch disk (`--plan-memory 0`), read back as the writer would.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use saver::core::plan::Spill;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::storage::FileSpill;
use saver::{PlanOptions, SaveInput};

mod common;

fn plan(c: &mut Criterion) {
    // 33.76 M rows at scale 1; 0.8886 gives 30.0 M.
    let spec: SyntheticSpec = format!("criteo-kaggle,scale={}", common::scale_or(0.8886))
        .parse()
        .unwrap();
    let rows: u64 = spec.table_rows().iter().sum();
    let model = SyntheticModel::generate(&spec).unwrap();
    let mut g = c.benchmark_group("plan");
    g.sample_size(10);
    g.throughput(Throughput::Elements(rows));
    let scratch = common::scratch();
    for shards in [1u32, 8] {
        for (sorted, spilled) in [(false, false), (true, false), (true, true)] {
            let what = match (sorted, spilled) {
                (false, _) => "plan",
                (true, false) => "plan + sorted ids",
                (true, true) => "plan + sorted ids, spilled",
            };
            g.bench_function(
                format!(
                    "{what}, 26 tables, {:.1}M rows, {shards} shards",
                    rows as f64 / 1e6
                ),
                |b| {
                    let input: SaveInput<'_> = model.input();
                    b.iter(|| {
                        // A fresh spill file per save, as `save` makes.
                        let spill = spilled.then(|| {
                            Arc::new(FileSpill::in_dir(&scratch).unwrap()) as Arc<dyn Spill>
                        });
                        let p = saver::core::plan::plan_with_spill(
                            &input,
                            &{
                                PlanOptions {
                                    shard_num: shards,
                                    plan_memory: if spilled { 0 } else { 1 << 40 },
                                    ..Default::default()
                                }
                            },
                            spill,
                        )
                        .unwrap();
                        assert!(p.data_bytes() > 0);
                        if sorted {
                            // On every core, as writer threads sort.
                            let parts: Vec<_> =
                                p.shards().iter().flat_map(|s| &s.partitions).collect();
                            let ids: usize = parts
                                .par_iter()
                                .map(|part| p.partition_ids(part).unwrap().len())
                                .sum();
                            assert_eq!(ids as u64, rows);
                        }
                        p
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, plan);
criterion_main!(benches);

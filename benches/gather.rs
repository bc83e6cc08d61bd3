//! The save's row gather: reading every row of a Criteo-Kaggle-shaped model (criteo-kaggle ×0.5,
//! 16.9 M rows of 136 bytes) by handle, in the order a save reads them.
//! `cargo bench --bench gather` (`SAVER_BENCH_SCALE` for another scale of the model)
//!
//! The tables are filled by inserts in random id order, as training fills them, so bucket order
//! (the save's) is random with respect to insertion order. Both rows run on two threads in
//! chunks of 60 000 rows, as writer threads do:
//! - `bucket order`: every row read by handle, in the save's order (bucket, then id);
//! - `plain copy`: the same bytes copied from one contiguous array into the same chunk buffers:
//!   the baseline, what the gather would cost if every row sat where the save reads it next.
//!
//! Their ratio is what the table's memory layout costs a save (see `table/embedding/slab.rs`).
//!
//! `column tables, bucket order` reads the same rows from [`ColumnTable`]s, arrays with the rows
//! in ascending id order (a trainer's arrays as the Python package saves them in place): random
//! with respect to bucket order, so each row is a jump in the arrays, as in a hashtable.

use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use saver::core::partition::PartitionRule;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::core::table::{ColumnTable, TableSnapshot};
use saver::SparseTable;

mod common;

/// Rows a writer thread reads at once.
const CHUNK_ROWS: usize = 60_000;

/// One table's snapshot and its rows (ids and handles) in the order to read them.
struct Order<'a> {
    snapshot: Box<dyn TableSnapshot + 'a>,
    ids: Vec<u64>,
    handles: Vec<u64>,
    slot_bytes: Vec<usize>,
}

/// Every table's rows, sorted by `key(id, handle)`.
fn order<'a, T: SparseTable>(tables: &'a [T], key: impl Fn(u64, u64) -> u128) -> Vec<Order<'a>> {
    tables
        .iter()
        .map(|t| {
            let snapshot = t.snapshot().unwrap();
            let mut rows: Vec<(u128, u64, u64)> = Vec::with_capacity(t.len());
            snapshot
                .scan(1 << 16, false, &mut |c| {
                    rows.extend(
                        c.ids
                            .iter()
                            .zip(c.handles)
                            .map(|(&id, &h)| (key(id, h), id, h)),
                    );
                    Ok(())
                })
                .unwrap();
            rows.sort_unstable();
            Order {
                snapshot,
                ids: rows.iter().map(|r| r.1).collect(),
                handles: rows.iter().map(|r| r.2).collect(),
                slot_bytes: (t.slots().iter())
                    .map(|s| s.row_bytes().unwrap() as usize)
                    .collect(),
            }
        })
        .collect()
}

/// Runs `read(table, first row, end row, out)` over every chunk of every table, on two threads,
/// with `out` one reused buffer per slot, sized for the chunk.
fn on_two_threads(
    tables: &[Order<'_>],
    read: impl Fn(usize, usize, usize, &mut [&mut [u8]]) + Sync,
) {
    let chunks: Vec<(usize, usize)> = tables
        .iter()
        .enumerate()
        .flat_map(|(t, o)| (0..o.ids.len()).step_by(CHUNK_ROWS).map(move |a| (t, a)))
        .collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut bufs: Vec<Vec<u8>> = Vec::new();
                while let Some(&(t, a)) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let o = &tables[t];
                    let b = (a + CHUNK_ROWS).min(o.ids.len());
                    bufs.resize_with(o.slot_bytes.len(), Vec::new);
                    for (buf, &bytes) in bufs.iter_mut().zip(&o.slot_bytes) {
                        buf.resize((b - a) * bytes, 0);
                    }
                    let mut out: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                    read(t, a, b, &mut out);
                }
            });
        }
    });
}

/// Reads every row of `tables` by handle.
fn gather(tables: &[Order<'_>]) {
    on_two_threads(tables, |t, a, b, out| {
        let o = &tables[t];
        // SAFETY: every handle is the one the snapshot's scan gave for its id, and the snapshot
        // lives in `o`.
        unsafe {
            o.snapshot
                .read_rows_by_handle(&o.ids[a..b], &o.handles[a..b], out)
        }
        .unwrap();
    });
}

/// Copies as many bytes as [`gather`] reads, from `source` (each table's rows side by side,
/// slot after slot), in the same chunks.
fn plain_copy(tables: &[Order<'_>], source: &[u8], table_start: &[usize]) {
    on_two_threads(tables, |t, a, _, out| {
        let mut at = table_start[t] + a * tables[t].slot_bytes.iter().sum::<usize>();
        for buf in out.iter_mut() {
            buf.copy_from_slice(&source[at..at + buf.len()]);
            at += buf.len();
        }
    });
}

/// Each of `tables` as arrays: its rows in ascending id order, slot by slot.
fn as_columns(tables: &[impl SparseTable]) -> Vec<ColumnTable<'static>> {
    tables
        .iter()
        .map(|t| {
            // The rows as the scan gives them, then put in id order through a permutation.
            let snapshot = t.snapshot().unwrap();
            let (mut ids, mut scanned) = (
                Vec::with_capacity(t.len()),
                vec![Vec::new(); t.slots().len()],
            );
            snapshot
                .scan(1 << 16, true, &mut |c| {
                    ids.extend_from_slice(c.ids);
                    for (all, rows) in scanned.iter_mut().zip(c.slots) {
                        all.extend_from_slice(rows);
                    }
                    Ok(())
                })
                .unwrap();
            let mut order: Vec<usize> = (0..ids.len()).collect();
            order.sort_unstable_by_key(|&r| ids[r]);
            let data = scanned
                .iter()
                .map(|all| {
                    let b = all.len() / ids.len().max(1);
                    order
                        .iter()
                        .flat_map(|&r| &all[r * b..(r + 1) * b])
                        .copied()
                        .collect()
                })
                .collect();
            let ids = order.iter().map(|&r| ids[r]).collect();
            ColumnTable::new(t.name(), t.key_dtype(), t.slots().to_vec(), ids, data).unwrap()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let scale = common::scale_or(0.5);
    let spec: SyntheticSpec = format!("criteo-kaggle,scale={scale}").parse().unwrap();
    let rows: u64 = spec.table_rows().iter().sum();
    let model = SyntheticModel::generate(&spec).unwrap();
    let columns = as_columns(&model.tables);
    let mut g = c.benchmark_group("gather");
    g.sample_size(10);
    g.throughput(Throughput::Elements(rows));
    let bucket_order =
        |id: u64, _| (u128::from(PartitionRule::bucket_of(id)) << 64) | u128::from(id);
    // A snapshot reads each row once (a save asks for each row once; a second read is an
    // error), so every round takes snapshots of its own, scanned and sorted untimed.
    g.bench_function(format!("bucket order, criteo-kaggle x{scale}"), |b| {
        b.iter_batched(
            || order(&model.tables, bucket_order),
            |tables| {
                gather(&tables);
                tables
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function(
        format!("column tables, bucket order, criteo-kaggle x{scale}"),
        |b| {
            b.iter_batched(
                || order(&columns, bucket_order),
                |tables| {
                    gather(&tables);
                    tables
                },
                BatchSize::PerIteration,
            )
        },
    );
    let by_bucket = order(&model.tables, bucket_order);
    let row_bytes = |o: &Order<'_>| o.slot_bytes.iter().sum::<usize>();
    let table_start: Vec<usize> = by_bucket
        .iter()
        .scan(0, |at, o| {
            let start = *at;
            *at += o.ids.len() * row_bytes(o);
            Some(start)
        })
        .collect();
    let total: usize = by_bucket.iter().map(|o| o.ids.len() * row_bytes(o)).sum();
    let source = vec![0x5au8; total];
    g.bench_function(
        format!("plain copy of the same bytes (baseline), criteo-kaggle x{scale}"),
        |b| b.iter(|| plain_copy(&by_bucket, &source, &table_start)),
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! What a trainer writes with `use saver::prelude::*`: one import for tables, saves, loads and
//! their reports, no ambiguity between the table traits, typed dense tensors, a progress counter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use saver::prelude::*;

#[test]
fn a_trainer_needs_one_import() {
    let table = EmbeddingTable::new(
        "item",
        KeyDtype::I64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![4])],
    )
    .unwrap();
    for id in 0..100u64 {
        table.upsert(id, |row: &mut RowMut<'_>| {
            row.slot_mut::<f32>(0).fill(id as f32)
        });
    }
    // SparseTable and TableSink are both in scope: the inherent methods answer.
    assert_eq!(table.name(), "item");
    assert_eq!(table.slots().len(), 1);
    assert_eq!(table.key_dtype(), KeyDtype::I64);

    let written = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&written);
    let opts = {
        let mut o = SaveOptions::default();
        o.progress = Some(Arc::new(move |p: saver::Progress| {
            counter.fetch_add(p.bytes, Ordering::Relaxed);
        }));
        o
    };
    let weights = [0.5f32, -1.0, 2.0];
    let dir = tempfile::tempdir().unwrap();
    let report: SaveReport = save(
        dir.path(),
        SaveInput::new()
            .table(&table)
            .dense(DenseTensor::from_f32("w", vec![3], &weights).unwrap()),
        &opts,
    )
    .unwrap();
    assert!(report.committed && written.load(Ordering::Relaxed) > 0);
    assert_eq!(verify(dir.path(), 1).unwrap().status, Status::Ok);

    let restored: Restored = Checkpoint::open(dir.path())
        .unwrap()
        .restore(&LoadOptions::default())
        .unwrap();
    let w: &LoadedDense = &restored.dense[0];
    assert_eq!(w.as_f32().unwrap(), weights);
    let e = w.as_i64().unwrap_err().to_string();
    assert!(e.contains("\"w\"") && e.contains("F32"), "{e}");
    assert_eq!(restored.shards[0].tables[0].len(), 100);
}

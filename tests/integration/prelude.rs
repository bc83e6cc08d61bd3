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
        SaveOptions {
            progress: Some(Arc::new(move |p: saver::Progress| {
                counter.fetch_add(p.bytes, Ordering::Relaxed);
            })),
            ..Default::default()
        }
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

/// The prelude stays small enough to read: a name joins it as a reviewed decision (raise the
/// bound here), and everything else is reached by its crate's path (`saver::core::…`,
/// `saver::io::…`).
#[test]
fn the_prelude_holds_at_most_40_names() {
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs")).unwrap();
    let start = lib
        .find("pub mod prelude {")
        .expect("src/lib.rs has a prelude");
    let end = start + lib[start..].find("\n}\n").expect("the prelude ends");
    let mut names = Vec::new();
    for item in lib[start..end].split("pub use ").skip(1) {
        let item = &item[..item.find(';').unwrap()];
        let list = match (item.find('{'), item.rfind('}')) {
            (Some(a), Some(b)) => &item[a + 1..b],
            _ => item.rsplit("::").next().unwrap(),
        };
        names.extend(
            list.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_string),
        );
    }
    assert!(
        names.len() >= 20,
        "the count missed the prelude's names: {names:?}"
    );
    assert!(
        names.len() <= 40,
        "the prelude holds {} names: {names:?}",
        names.len()
    );
}

//! A row-range table saver holds for the trainer (`RowRangeTable`): a save's moment shares its
//! blocks instead of copying them, writes after the moment copy only the blocks they touch, and
//! a save racing the trainer's writes holds the table as it was between two of them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use saver::io::LoadRequest;
use saver::{
    save, save_async, Checkpoint, Dtype, RowRangeTable, RowsInto, SaveInput, SaveOptions, SlotSpec,
};

fn slots() -> Vec<SlotSpec> {
    vec![
        SlotSpec::new("weight", Dtype::F32, vec![8]),
        SlotSpec::new("steps", Dtype::I64, vec![]),
    ]
}

/// Sets every held row to `v`: its weights, and its step count.
fn set_all(t: &RowRangeTable, v: f32) {
    t.update(t.rows(), |mut r| {
        r.slot_mut::<f32>(0)?.fill(v);
        r.slot_mut::<i64>(1)?.fill(v as i64);
        Ok(())
    })
    .unwrap();
}

/// The weights and steps of rows `rows` of `dir`'s table "emb".
fn saved(dir: &std::path::Path, rows: std::ops::Range<u64>) -> (Vec<f32>, Vec<i64>) {
    let n = (rows.end - rows.start) as usize;
    let (mut w, mut s) = (vec![0f32; n * 8], vec![0i64; n]);
    Checkpoint::open(dir)
        .unwrap()
        .load_rows(
            "emb",
            rows,
            &mut [
                RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)),
                RowsInto::new("steps", bytemuck::cast_slice_mut(&mut s)),
            ],
        )
        .unwrap();
    (w, s)
}

/// A background save of a table copies nothing at its call; the trainer's writes after it copy
/// only the blocks they touch, and the checkpoint holds the rows as they were at the call.
#[test]
fn a_background_save_shares_the_table_and_copies_only_what_is_written_after() {
    let d = tempfile::tempdir().unwrap();
    let t = RowRangeTable::with_block_rows("emb", 10_000, 0..10_000, slots(), 1000).unwrap();
    set_all(&t, 1.0);
    let h = save_async(
        d.path(),
        SaveInput::new().row_table(&t).unwrap(),
        SaveOptions::default(),
    )
    .unwrap();
    assert_eq!(t.blocks_copied(), 0);
    // Rows 2500..2600 lie in one block: one copy of it per slot, at most, while the save holds it.
    t.update(2500..2600, |mut r| {
        r.slot_mut::<f32>(0)?.fill(2.0);
        Ok(())
    })
    .unwrap();
    assert!(t.blocks_copied() <= 2, "{}", t.blocks_copied());
    h.wait().unwrap();
    let (w, s) = saved(d.path(), 0..10_000);
    assert!(w.iter().all(|&v| v == 1.0) && s.iter().all(|&v| v == 1));
    // After the save, nothing holds the blocks: writes copy nothing.
    let before = t.blocks_copied();
    set_all(&t, 3.0);
    assert_eq!(t.blocks_copied(), before);
}

/// Saves racing a trainer that rewrites the whole table in one update each step: every
/// checkpoint holds one step's values in every row and slot, never a mix; many rounds with
/// varied timing, blocking and background saves alike.
#[test]
fn a_save_racing_the_trainers_writes_holds_one_moment() {
    let t = Arc::new(RowRangeTable::with_block_rows("emb", 4000, 0..4000, slots(), 256).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let trainer = {
        let (t, stop) = (Arc::clone(&t), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut step = 0f32;
            while !stop.load(Ordering::Relaxed) {
                step += 1.0;
                set_all(&t, step);
            }
        })
    };
    let d = tempfile::tempdir().unwrap();
    for round in 0..24u64 {
        std::thread::sleep(Duration::from_micros(round * 137 % 900));
        let dir = d.path().join(round.to_string());
        let input = SaveInput::new().row_table(&t).unwrap();
        if round % 2 == 0 {
            save(&dir, input, &SaveOptions::default()).unwrap();
        } else {
            save_async(&dir, input, SaveOptions::default())
                .unwrap()
                .wait()
                .unwrap();
        }
        let (w, s) = saved(&dir, 0..4000);
        let v = w[0];
        assert!(
            w.iter().all(|&x| x == v) && s.iter().all(|&x| x == v as i64),
            "round {round}: a mix of steps"
        );
    }
    stop.store(true, Ordering::Relaxed);
    trainer.join().unwrap();
}

/// A restart fills a table of another split from a checkpoint saved by two processes' tables,
/// and a delta of a table saves only the rows written since its parent.
#[test]
fn a_table_restores_from_any_split_and_saves_deltas() {
    let d = tempfile::tempdir().unwrap();
    let halves = [0..3000u64, 3000..5000];
    let tables: Vec<RowRangeTable> = halves
        .iter()
        .map(|r| RowRangeTable::with_block_rows("emb", 5000, r.clone(), slots(), 700).unwrap())
        .collect();
    for t in &tables {
        t.update(t.rows(), |mut r| {
            let first = r.first_row();
            for (i, v) in r.slot_mut::<f32>(0)?.iter_mut().enumerate() {
                *v = (first + i as u64 / 8) as f32;
            }
            r.slot_mut::<i64>(1)?.fill(first as i64);
            Ok(())
        })
        .unwrap();
    }
    let base = d.path().join("base");
    std::thread::scope(|s| {
        for (i, t) in tables.iter().enumerate() {
            let base = &base;
            s.spawn(move || {
                let opts = SaveOptions::for_shard(
                    saver::Shard {
                        index: i as u32,
                        count: 2,
                    },
                    "halves",
                );
                save(base, SaveInput::new().row_table(t).unwrap(), &opts).unwrap();
            });
        }
    });
    let middle = RowRangeTable::new("emb", 5000, 1000..4000, slots()).unwrap();
    let loaded = Checkpoint::open(&base)
        .unwrap()
        .load(LoadRequest::rows_only().into_table(&middle))
        .unwrap()
        .rows;
    assert_eq!(loaded.bytes_wanted, 3000 * (8 * 4 + 8));
    middle
        .read(2999..3001, |first, parts| {
            let w: &[f32] = bytemuck::cast_slice(parts[0]);
            for (i, row) in w.chunks(8).enumerate() {
                assert_eq!(row, [(first + i as u64) as f32; 8]);
            }
            Ok(())
        })
        .unwrap();
    // Ten rows written since: a delta of them holds their bytes (and row numbers), no more.
    middle
        .update(1500..1510, |mut r| {
            r.slot_mut::<f32>(0)?.fill(-1.0);
            Ok(())
        })
        .unwrap();
    let whole = RowRangeTable::new("emb", 5000, 0..5000, slots()).unwrap();
    Checkpoint::open(&base)
        .unwrap()
        .load(LoadRequest::rows_only().into_table(&whole))
        .unwrap();
    whole
        .update(1500..1510, |mut r| {
            r.slot_mut::<f32>(0)?.fill(-1.0);
            Ok(())
        })
        .unwrap();
    let delta = d.path().join("delta");
    save(
        &delta,
        SaveInput::new().row_table(&whole).unwrap(),
        &SaveOptions {
            parent: Some(base.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let ck = Checkpoint::open(&delta).unwrap();
    assert_eq!(ck.manifest().total_tensor_bytes(), 10 * (8 * 4 + 8));
    let (w, _) = saved(&delta, 1495..1515);
    assert_eq!(w[5 * 8..15 * 8], [-1.0; 80]);
    assert_eq!(w[0], 1495.0);
    // A table of other slots is refused, naming the slot.
    let other = RowRangeTable::new(
        "emb",
        5000,
        0..10,
        vec![SlotSpec::new("weight", Dtype::F32, vec![4])],
    )
    .unwrap();
    let e = ck
        .load(LoadRequest::rows_only().into_table(&other))
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"weight\""), "{e}");
}

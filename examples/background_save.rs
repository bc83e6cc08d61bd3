//! Saving while training: a trainer loop that starts a background save every K steps and goes on
//! training at once, then, after a simulated crash, restarts from the newest committed checkpoint.
//!
//! Each save shows the tables as they were at the step it was started at (point-in-time), although
//! the training threads keep writing to them while it is written. The trainer state (step, RNG) is
//! passed with the save call between two steps, so it belongs to that moment too; the check at the
//! end restores the newest checkpoint and compares it with a copy of the model taken at that step.
//!
//! Run: `cargo run --release --example background_save [DIR]`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use saver::core::partition::fmix64;
use saver::{
    save_async, Checkpoint, DenseTensor, Dtype, EmbeddingTable, KeyDtype, LoadOptions, SaveHandle,
    SaveInput, SaveOptions, SlotSpec,
};

const DIM: usize = 8;
const SAVE_EVERY: u64 = 5;
const STEPS: u64 = 23;

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
struct TrainerState {
    step: u64,
    rng: u64,
}

fn new_table() -> EmbeddingTable {
    EmbeddingTable::new(
        "item",
        KeyDtype::U64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![DIM as u64]),
            SlotSpec::new("freq", Dtype::I64, vec![]),
        ],
    )
    .expect("valid table")
}

/// One training step: 4 threads each update 2000 rows (and evict a few), plus the dense weights.
fn step(table: &EmbeddingTable, mlp: &mut [f32], state: &mut TrainerState) {
    state.step += 1;
    state.rng = fmix64(state.rng ^ state.step);
    let seed = state.rng;
    std::thread::scope(|s| {
        for w in 0..4u64 {
            s.spawn(move || {
                let mut r = seed ^ w;
                for _ in 0..2000 {
                    r = fmix64(r);
                    let id = r % 50_000;
                    if r.is_multiple_of(97) {
                        table.remove(id);
                        continue;
                    }
                    table.upsert(id, |row| {
                        row.slot_mut::<f32>(0).iter_mut().for_each(|x| *x += 0.01);
                        row.slot_mut::<i64>(1)[0] += 1;
                    });
                }
            });
        }
    });
    mlp.iter_mut().for_each(|x| *x *= 0.999);
}

/// Every row of a table, for comparing a restored model with the model at a step.
fn rows(table: &EmbeddingTable) -> BTreeMap<u64, (Vec<u8>, Vec<u8>)> {
    table
        .ids()
        .into_iter()
        .filter_map(|id| Some((id, (table.get_slot(id, 0)?, table.get_slot(id, 1)?))))
        .collect()
}

/// The newest committed checkpoint under `root` (directories named `step-<n>`).
fn newest(root: &Path) -> Option<(u64, PathBuf)> {
    std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let step = e
                .file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse()
                .ok()?;
            Some((step, e.path()))
        })
        .filter(|(_, p)| saver::verify(p, 2).is_ok_and(|v| v.status == saver::Status::Ok))
        .max_by_key(|(step, _)| *step)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("saver-bg-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root);

    let table = Arc::new(new_table());
    let mut mlp = vec![1.0f32; 256];
    let mut state = TrainerState { step: 0, rng: 7 };
    let mut in_flight: Option<SaveHandle> = None;
    let mut at_last_save = None;
    for _ in 0..STEPS {
        step(&table, &mut mlp, &mut state);
        if !state.step.is_multiple_of(SAVE_EVERY) {
            continue;
        }
        // One save at a time: the previous one has had SAVE_EVERY steps to finish.
        if let Some(h) = in_flight.take() {
            let r = h.wait()?;
            println!("  save {} committed ({} rows)", r.save_id, r.rows);
        }
        let opts = {
            let o = SaveOptions {
                save_id: Some(format!("step{}", state.step)),
                step: Some(state.step),
                ..Default::default()
            };
            o
        }
        .with_trainer_state(&state)?;
        let started = std::time::Instant::now();
        // The table is shared with the save (an Arc); the dense tensor is copied by the call.
        let input = SaveInput::new()
            .table(Arc::clone(&table))
            .dense(DenseTensor::from_f32("mlp.weight", vec![256], &mlp)?);
        let dir = root.join(format!("step-{}", state.step));
        in_flight = Some(save_async(dir, input, opts)?);
        println!(
            "step {}: background save started, training again after {:?}",
            state.step,
            started.elapsed()
        );
        // What the save must show, for the check below (a copy the example makes; saver does not).
        at_last_save = Some((state.clone(), rows(&table), mlp.clone()));
    }
    if let Some(h) = in_flight.take() {
        h.wait()?;
    }

    // The process dies; a new one restores from the newest committed checkpoint.
    drop(table);
    let (step, dir) = newest(&root).ok_or("no committed checkpoint")?;
    let ck = Checkpoint::open(&dir)?;
    let restored: TrainerState = ck.trainer_state(0)?.ok_or("no trainer state")?;
    let tables = ck.restore(&LoadOptions::default())?;
    let table = &tables.shards[0].tables[0];
    let mlp: Vec<f32> = ck
        .read_dense("mlp.weight")?
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (want_state, want_rows, want_mlp) = at_last_save.ok_or("no save was started")?;
    assert_eq!(restored, want_state, "trainer state of step {step}");
    assert_eq!(mlp, want_mlp, "dense weights of step {step}");
    assert!(rows(table) == want_rows, "rows of step {step}");
    println!(
        "restarted from {} (step {step}): {} rows, trainer state and dense weights as at that step",
        dir.display(),
        table.len()
    );
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

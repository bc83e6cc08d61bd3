//! A trainer loop: worker threads update a concurrent embedding table and dense weights; every K
//! steps the trainer saves, with a filter closure that drops rows seen fewer than 3 times and with
//! its trainer state; after a simulated crash it restores from the latest committed checkpoint and
//! goes on.
//!
//! Run: `cargo run --release --example trainer_loop [DIR]`

use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use serde::{Deserialize, Serialize};

use saver::{
    save, Checkpoint, DenseTensor, Dtype, EmbeddingTable, Filters, KeyDtype, LoadOptions,
    SaveOptions, SlotSpec,
};

const DIM: usize = 16;
const SAVE_EVERY: u64 = 10;

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
struct TrainerState {
    step: u64,
    rng: u64,
    samples_seen: u64,
}

struct Trainer {
    table: EmbeddingTable,
    mlp: RwLock<Vec<f32>>,
    state: Mutex<TrainerState>,
}

fn new_table() -> EmbeddingTable {
    EmbeddingTable::new(
        "item",
        KeyDtype::I64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![DIM as u64]),
            SlotSpec::new("adagrad", Dtype::F32, vec![DIM as u64]),
            SlotSpec::new("freq", Dtype::I64, vec![]),
        ],
    )
    .expect("valid table")
}

fn next(rng: &mut u64) -> u64 {
    *rng = saver::core::partition::fmix64(rng.wrapping_add(0x9e37_79b9_7f4a_7c15));
    *rng
}

impl Trainer {
    /// One step: 4 threads each apply 500 sparse updates (Zipf-like ids) and touch the MLP.
    fn step(&self) {
        let seed = {
            let mut s = self.state.lock().unwrap();
            s.step += 1;
            s.samples_seen += 2000;
            next(&mut s.rng)
        };
        std::thread::scope(|scope| {
            for w in 0..4u64 {
                scope.spawn(move || {
                    let mut rng = seed ^ w;
                    for _ in 0..500 {
                        let r = next(&mut rng);
                        let id = ((r % 20_000) * (r % 20_000) / 20_000) as i64 - 3000;
                        self.table.upsert(id as u64, |row| {
                            let g = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                            for x in row.slot_mut::<f32>(1).iter_mut() {
                                *x += g * g;
                            }
                            let acc = row.slot_mut::<f32>(1)[0];
                            for x in row.slot_mut::<f32>(0).iter_mut() {
                                *x -= 0.01 * g / acc.sqrt().max(1e-6);
                            }
                            row.slot_mut::<i64>(2)[0] += 1;
                        });
                    }
                    let mut mlp = self.mlp.write().unwrap();
                    mlp[(seed as usize + w as usize) % 256] += 0.001;
                });
            }
        });
    }

    fn save(&self, root: &Path) -> saver::io::Result<PathBuf> {
        let state = self.state.lock().unwrap().clone();
        let dir = root.join(format!("step-{:08}", state.step));
        let mlp = self.mlp.read().unwrap();
        let input = saver::SaveInput::new()
            .table(&self.table)
            .dense(DenseTensor::from_f32("mlp.weight", vec![16, 16], &mlp)?);
        let mut opts = SaveOptions::default().with_trainer_state(&state)?;
        opts.plan.shard_num = 2;
        // The custom filter: rows seen fewer than 3 times are not worth saving.
        opts.plan.filters =
            Filters::new().keep_rows(|row| row.scalar("freq").is_some_and(|f| f >= 3.0));
        opts.user_metadata
            .insert("model".into(), "example-two-tower".into());
        let r = save(&dir, input, &opts)?;
        println!(
            "step {:>3}: saved {} of {} rows (freq >= 3) to {}",
            state.step,
            r.rows,
            self.table.len(),
            dir.display()
        );
        Ok(dir)
    }

    /// The newest checkpoint under `root` that opens (committed and structurally valid).
    fn restore_latest(root: &Path) -> saver::io::Result<Option<Trainer>> {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        dirs.sort();
        for dir in dirs.iter().rev() {
            let Ok(ck) = Checkpoint::open(dir) else {
                println!("skipping {} (not a committed checkpoint)", dir.display());
                continue;
            };
            let restored = ck.restore(&LoadOptions::default())?;
            let table = restored
                .shards
                .into_iter()
                .next()
                .expect("one shard")
                .tables
                .into_iter()
                .next()
                .expect("item");
            let mlp: Vec<f32> = bytemuck_f32(&restored.dense[0].data);
            let state: TrainerState = ck.trainer_state(0)?.expect("saved with a trainer state");
            println!(
                "restored step {} from {} ({} rows)",
                state.step,
                dir.display(),
                table.len()
            );
            return Ok(Some(Trainer {
                table,
                mlp: RwLock::new(mlp),
                state: Mutex::new(state),
            }));
        }
        Ok(None)
    }
}

fn bytemuck_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("saver-trainer-example"));
    let _ = std::fs::remove_dir_all(&root);
    let trainer = Trainer {
        table: new_table(),
        mlp: RwLock::new(vec![0.0; 256]),
        state: Mutex::new(TrainerState {
            step: 0,
            rng: 42,
            samples_seen: 0,
        }),
    };
    let mut last = None;
    for _ in 0..25 {
        trainer.step();
        if trainer
            .state
            .lock()
            .unwrap()
            .step
            .is_multiple_of(SAVE_EVERY)
        {
            last = Some(trainer.save(&root)?);
        }
    }
    // A save that crashes half-way leaves a directory without a commit; restart must skip it.
    std::fs::create_dir_all(root.join("step-99999999"))?;
    let before = trainer.state.lock().unwrap().clone();
    drop(trainer);
    println!("-- crash at step {} --", before.step);

    let trainer = Trainer::restore_latest(&root)?.expect("a committed checkpoint exists");
    let state = trainer.state.lock().unwrap().clone();
    assert_eq!(
        state.step, 20,
        "the newest committed checkpoint is step 20 ({last:?})"
    );
    assert!(trainer.table.ids().iter().all(|&id| {
        let f = trainer.table.get_slot(id, 2).unwrap();
        i64::from_le_bytes(f.try_into().unwrap()) >= 3
    }));
    for _ in 0..10 {
        trainer.step();
    }
    trainer.save(&root)?;
    println!("went on to step {}", trainer.state.lock().unwrap().step);
    Ok(())
}

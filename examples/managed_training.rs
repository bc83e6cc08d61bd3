//! A training job's checkpoints with the manager: one worker trains and saves every 5 steps in
//! the background (a full checkpoint every third save, tracked deltas between), retention keeps
//! the newest two and every 20th step; then the job "crashes", and restarts from the newest
//! committed step with two workers, each restoring its shard, and goes on saving into the same
//! root.
//!
//! Run: `cargo run --release --example managed_training [ROOT]`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use saver::core::partition::fmix64;
use saver::io::manage::Retention;
use saver::{
    CheckpointManager, Dtype, EmbeddingTable, KeyDtype, LoadOptions, Policy, SaveInput,
    SaveOptions, Shard, SlotSpec,
};

const DIM: usize = 4;

fn slots() -> Vec<SlotSpec> {
    vec![SlotSpec::new("embedding", Dtype::F32, vec![DIM as u64])]
}

/// One training step: 200 rows of 5,000 ids touched.
fn train(tables: &[Arc<EmbeddingTable>], step: u64) {
    for k in 0..200u64 {
        let id = fmix64(step << 20 | k) % 5000;
        // Each worker trains the ids of its shard.
        let t = &tables[saver::PartitionRule::shard_of(id, tables.len() as u32) as usize];
        t.upsert(id, |row| row.slot_mut::<f32>(0)[0] += step as f32);
    }
}

/// The rows of `tables`, by id.
fn rows(tables: &[Arc<EmbeddingTable>]) -> BTreeMap<u64, Vec<u8>> {
    let mut out = BTreeMap::new();
    for t in tables {
        for id in t.ids() {
            out.insert(id, t.get_slot(id, 0).expect("listed"));
        }
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let root: PathBuf = std::env::args()
        .nth(1)
        .map_or_else(|| tmp.path().join("run"), PathBuf::from);
    let policy = {
        let mut o = Policy {
            every_steps: 5,
            full_every: 3,
            max_chain_links: 3,
            ..Default::default()
        };
        o.retention = {
            Retention {
                keep_latest: 2,
                keep_every: Some(20),
                ..Default::default()
            }
        };
        o
    };

    // Part 1: one worker, saving in the background every 5 steps.
    let mut at_step = BTreeMap::new();
    {
        let manager = CheckpointManager::open(&root, policy.clone())?;
        let table =
            Arc::new(EmbeddingTable::new("item", KeyDtype::U64, slots())?.with_change_tracking()?);
        let tables = vec![table.clone()];
        for step in 1..=37u64 {
            train(&tables, step);
            if manager.is_due(step) {
                let input = SaveInput::new().table(Arc::clone(&table));
                manager.save_async(step, input, &SaveOptions::default())?;
                at_step.insert(step, rows(&tables));
                println!("step {step}: saving in the background; training goes on");
            }
        }
        // The last save's outcome; a failure would also have been printed as it happened.
        manager.wait()?;
        for s in manager.steps()? {
            println!(
                "  kept step {:>3}: {}, {} link(s)",
                s.step,
                if s.is_delta() { "delta" } else { "full" },
                s.links
            );
        }
        // The job crashes here: nothing of it is kept but the root.
    }

    // Part 2: the job restarts with two workers, from the newest committed step.
    let manager = CheckpointManager::open_kept(&root)?;
    let latest = manager.latest()?.ok_or("no committed step")?;
    println!("restart from step {} with 2 workers", latest.step);
    let mut tables = Vec::new();
    for worker in 0..2 {
        let (step, r) = manager
            .restore_latest(&{
                let mut o = LoadOptions::for_shard(Shard {
                    index: worker,
                    count: 2,
                });
                // The restored tables track their changes: the next delta is tracked at once.
                o.change_tracking = true;
                o
            })?
            .ok_or("no committed step")?;
        assert_eq!(step, latest.step);
        let shard = r.shards.into_iter().next().ok_or("one shard")?;
        tables.push(shard.into_shared().remove("item").ok_or("table item")?);
    }
    assert_eq!(rows(&tables), at_step[&latest.step], "the restored rows");
    for step in latest.step + 1..=52 {
        train(&tables, step);
        if manager.is_due(step) {
            let mut input = SaveInput::new();
            for (w, t) in tables.iter().enumerate() {
                input = input.shard_table(w as u32, Arc::clone(t));
            }
            let mut opts = SaveOptions::default();
            opts.plan.shard_num = 2;
            manager.save_async(step, input, &opts)?;
            at_step.insert(step, rows(&tables));
        }
    }
    manager.wait()?;
    let latest = manager.latest()?.ok_or("no committed step")?;
    let (_, r) = manager
        .restore_latest(&LoadOptions::default())?
        .ok_or("no committed step")?;
    let restored = r.shards[0].table("item").ok_or("item")?;
    let mut got = BTreeMap::new();
    for id in restored.ids() {
        got.insert(id, restored.get_slot(id, 0).ok_or("row")?);
    }
    assert_eq!(got, at_step[&latest.step]);
    let steps: Vec<u64> = manager.steps()?.iter().map(|s| s.step).collect();
    println!(
        "step {} restores whole; the root keeps steps {steps:?}",
        latest.step
    );
    Ok(())
}

//! Incremental checkpoints in a trainer loop: a full checkpoint now and then, a small delta every
//! few steps in between (only the rows written since the last save, from the table's change
//! tracking), a compaction of the last chain, and a restart from the newest delta whose first
//! delta is tracked too.
//!
//! Run: `cargo run --release --example incremental [DIR]`

use std::path::{Path, PathBuf};

use saver::core::partition::fmix64;
use saver::io::tools::digest::{Content, DigestVersion};
use saver::io::tools::reshard::reshard;
use saver::{
    save, Checkpoint, Dtype, EmbeddingTable, KeyDtype, LoadOptions, SaveInput, SaveOptions,
    SlotSpec,
};

const ROWS: u64 = 200_000;
const STEPS: u64 = 12;
const SAVE_EVERY: u64 = 2;
const FULL_EVERY: usize = 4;

/// One training step: 1 % of the rows get a gradient, a few are evicted, a few are new.
fn train(t: &EmbeddingTable, step: u64) {
    for k in 0..ROWS / 100 {
        let id = fmix64(k ^ step << 32) % ROWS;
        t.upsert(id, |row| row.slot_mut::<f32>(0)[0] += 0.01);
    }
    for k in 0..ROWS / 1000 {
        t.remove(fmix64(k ^ step << 40 ^ 1) % ROWS);
        t.upsert(ROWS + step * 1000 + k, |row| {
            row.slot_mut::<f32>(0)[1] = 1.0
        });
    }
}

fn digest(dir: &Path) -> String {
    let at = Content::At {
        path: dir,
        parallel: 2,
    };
    saver::io::tools::digest::digest(at, DigestVersion::V2).unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("saver-incremental-example"));
    let _ = std::fs::remove_dir_all(&root);
    let table = EmbeddingTable::new(
        "item",
        KeyDtype::U64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![16])],
    )?
    .with_change_tracking()?;
    for id in 0..ROWS {
        table.upsert(id, |row| row.slot_mut::<f32>(0)[0] = id as f32);
    }

    let mut last = root.join("step-0");
    let full = save(
        &last,
        SaveInput::new().table(&table),
        &SaveOptions::default(),
    )?;
    println!("step 0: full checkpoint, {} rows", full.rows);
    let mut links = 1;
    for step in 1..=STEPS {
        train(&table, step);
        if step % SAVE_EVERY != 0 {
            continue;
        }
        let dir = root.join(format!("step-{step}"));
        if links == FULL_EVERY {
            // A full checkpoint now and then keeps chains short.
            save(
                &dir,
                SaveInput::new().table(&table),
                &SaveOptions::default(),
            )?;
            println!("step {step}: full checkpoint");
            links = 1;
        } else {
            let opts = {
                SaveOptions {
                    parent: Some(last.clone()),
                    ..Default::default()
                }
            };
            let r = save(&dir, SaveInput::new().table(&table), &opts)?;
            links += 1;
            println!(
                "step {step}: delta of {} rows and removed ids, {} KiB",
                r.rows,
                r.bytes_written >> 10
            );
        }
        last = dir;
    }
    // The last chain as one full checkpoint: for serving, or to delete its links.
    let compacted = root.join("compacted");
    reshard(
        &Checkpoint::open(&last)?,
        &compacted,
        &SaveOptions::default(),
    )?;
    assert_eq!(digest(&compacted), digest(&last));
    println!("compacted the last chain of {links} links: same digest");

    // A restart: the newest checkpoint (a delta) restored into tables that track their changes,
    // with it as their baseline, so the next delta is tracked at once.
    let restored = Checkpoint::open(&last)?.restore(&{
        LoadOptions {
            change_tracking: true,
            ..Default::default()
        }
    })?;
    let table = &restored.shards[0].tables[0];
    train(table, STEPS + 1);
    let dir = root.join("after-restart");
    let opts = {
        SaveOptions {
            parent: Some(last.clone()),
            ..Default::default()
        }
    };
    let r = save(&dir, SaveInput::new().table(table), &opts)?;
    let check = root.join("check-full");
    save(
        &check,
        SaveInput::new().table(table),
        &SaveOptions::default(),
    )?;
    assert_eq!(
        digest(&dir),
        digest(&check),
        "the chain holds the trained state"
    );
    println!(
        "after the restart: tracked delta of {} rows; the chain equals a full save",
        r.rows
    );
    Ok(())
}

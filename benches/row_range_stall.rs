//! How long a background save of row-range tables holds the trainer, by how the tables are
//! held: a `RowRangeTable` (saver's blocks, shared with the save's moment and copied only when
//! written while the save holds them) against chunks borrowed from the trainer's own tensors
//! (what PyTorch gives: copied at the call, on every core), and against a blocking save of the
//! same tables (its stall). Also the trainer's cost of writing during the save: the blocks
//! copied, for a step that writes 1 % of the rows at random.
//!
//! `cargo bench --bench row_range_stall -- [--scale 1.0] [--runs 5]`
//!
//! The model is the DLRM-like one of benches/row_range.py: 6 tables, 3.76 M rows of 32 floats
//! with an Adagrad state of the same shape, 0.9 GiB at scale 1. Saves are durable, each into a
//! directory of its own. Medians of `--runs` rounds after a warm-up round, kinds interleaved.

mod common;

use std::time::Instant;

use common::median;
use saver::{
    save, save_async, Dtype, RowRangeChunk, RowRangeTable, SaveInput, SaveOptions, SlotSpec,
};

const TABLE_ROWS: [u64; 6] = [1_500_000, 1_000_000, 600_000, 400_000, 200_000, 60_000];
const DIM: u64 = 32;

fn slots() -> Vec<SlotSpec> {
    vec![
        SlotSpec::new("weight", Dtype::F32, vec![DIM]),
        SlotSpec::new("sum", Dtype::F32, vec![DIM]),
    ]
}

/// Writes 1 % of `t`'s rows, at random: a training step.
fn step(t: &RowRangeTable, seed: u64) {
    let rows = t.table_rows();
    for k in 0..rows / 100 {
        let r = saver::core::partition::fmix64(k ^ (seed << 40)) % rows;
        t.update(r..r + 1, |mut w| {
            w.slot_mut::<f32>(0)?[0] += 1.0;
            w.slot_mut::<f32>(1)?[0] += 1.0;
            Ok(())
        })
        .unwrap();
    }
}

fn main() {
    let scale: f64 = common::arg("--scale")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let runs: usize = common::arg("--runs")
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let scratch = common::scratch().join("row_range_stall");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let rows: Vec<u64> = TABLE_ROWS
        .iter()
        .map(|&r| ((r as f64 * scale) as u64).max(1))
        .collect();
    let tables: Vec<RowRangeTable> = rows
        .iter()
        .enumerate()
        .map(|(i, &n)| RowRangeTable::new(&format!("t{i}"), n, 0..n, slots()).unwrap())
        .collect();
    // The same values as the trainer's own tensors: one vector per table and slot.
    let tensors: Vec<[Vec<f32>; 2]> = rows
        .iter()
        .map(|&n| {
            [
                vec![0.5f32; (n * DIM) as usize],
                vec![0.1f32; (n * DIM) as usize],
            ]
        })
        .collect();
    let bytes: u64 = rows.iter().map(|n| n * DIM * 4 * 2).sum();
    let borrowed = || {
        let mut input = SaveInput::new();
        for (i, (&n, t)) in rows.iter().zip(&tensors).enumerate() {
            for (slot, v) in ["weight", "sum"].iter().zip(t) {
                input = input.row_chunk(
                    RowRangeChunk::from_f32(&format!("t{i}"), slot, vec![n, DIM], v).unwrap(),
                );
            }
        }
        input
    };
    let shared = || {
        let mut input = SaveInput::new();
        for t in &tables {
            input = input.row_table(t).unwrap();
        }
        input
    };
    let (mut held_shared, mut held_copied, mut blocking, mut copied_blocks, mut total_blocks) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0u64);
    let mut n = 0;
    for round in 0..=runs {
        for kind in 0..3 {
            n += 1;
            let dir = scratch.join(format!("save-{n}"));
            let t0 = Instant::now();
            match kind {
                0 => {
                    let before: u64 = tables.iter().map(|t| t.blocks_copied()).sum();
                    let h = save_async(&dir, shared(), SaveOptions::default()).unwrap();
                    let held = t0.elapsed().as_secs_f64();
                    // A training step while the save runs: what copy-on-write costs.
                    for t in &tables {
                        step(t, n);
                    }
                    h.wait().unwrap();
                    let after: u64 = tables.iter().map(|t| t.blocks_copied()).sum();
                    if round > 0 {
                        held_shared.push(held);
                        copied_blocks.push((after - before) as f64);
                    }
                    total_blocks = tables
                        .iter()
                        .map(|t| {
                            t.table_rows()
                                .div_ceil(saver::core::row_range::DEFAULT_BLOCK_ROWS)
                                * 2
                        })
                        .sum();
                }
                1 => {
                    let h = save_async(&dir, borrowed(), SaveOptions::default()).unwrap();
                    let held = t0.elapsed().as_secs_f64();
                    h.wait().unwrap();
                    if round > 0 {
                        held_copied.push(held);
                    }
                }
                _ => {
                    save(&dir, shared(), &SaveOptions::default()).unwrap();
                    if round > 0 {
                        blocking.push(t0.elapsed().as_secs_f64());
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let (s, c, b) = (median(held_shared), median(held_copied), median(blocking));
    println!("## Background saves of row-range tables: the time `save_async` holds the trainer\n");
    println!(
        "{} of row-range tables (6 tables, weight and Adagrad sum of {DIM} floats), durable \
         saves. Medians of {runs} rounds after a warm-up round. Baseline: a blocking save of the \
         same tables.\n",
        common::human(bytes)
    );
    println!("| held as | `save_async` returns after | / blocking save |\n| --- | --- | --- |");
    println!(
        "| `RowRangeTable` (moment shared, copy-on-write) | {:.2} ms | **{:.4}** |",
        s * 1e3,
        s / b
    );
    println!(
        "| chunks of the trainer's tensors (copied at the call) | {:.0} ms | **{:.3}** |",
        c * 1e3,
        c / b
    );
    println!("| blocking save | {:.0} ms | 1 |", b * 1e3);
    println!(
        "\nA training step of 1 % of the rows during the `RowRangeTable` save copied a median of \
         {:.0} of its {total_blocks} blocks.",
        median(copied_blocks)
    );
}

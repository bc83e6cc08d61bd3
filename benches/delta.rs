//! Incremental checkpoints against full ones, in one run (docs/benchmarks/HISTORY.md, "Incremental
//! checkpoints"):
//!
//! * a delta with 1 % of rows changed, 0.2 % removed and 0.5 % added: bytes and time against a
//!   full save of the same state (changes found by content);
//! * a load of a base plus 10 such deltas against a load of the compacted checkpoint: time and
//!   read amplification;
//! * `compact` (a chain rewritten as a full checkpoint) against a full save.
//!
//! `cargo bench --bench delta -- [--spec criteo-kaggle,scale=0.5] [--runs 3] [--dir PATH] [--keep]
//! [--only-tracked]` (`--only-tracked`: the tracked delta alone, e.g. to profile it)

use std::path::{Path, PathBuf};
use std::time::Instant;

use saver::core::partition::fmix64;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::tools::reshard::reshard;
mod common;

use common::{input_of, tracked_copy};
use saver::{save, Checkpoint, EmbeddingTable, LoadOptions, SaveOptions};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn opts(parent: Option<&Path>) -> SaveOptions {
    let mut o = {
        SaveOptions {
            overwrite: true,
            parent: parent.map(Path::to_path_buf),
            ..Default::default()
        }
    };
    o.plan.shard_num = 4;
    o
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// One training interval: 1 % of rows changed, 0.2 % removed, 0.5 % added (in every table).
fn mutate(tables: &[EmbeddingTable], round: u64) {
    for (t, table) in tables.iter().enumerate() {
        let ids = table.ids();
        let n = ids.len() as u64;
        let pick = |k: u64, salt: u64| ids[(fmix64(k ^ (salt << 32) ^ round << 48) % n) as usize];
        for k in 0..n / 100 {
            table.update(pick(k, 1), |row| {
                let e = row.slot_mut::<f32>(0);
                e[0] += 1.0;
            });
        }
        for k in 0..n / 500 {
            table.remove(pick(k, 2));
        }
        let width: Vec<usize> = table.slot_row_bytes().to_vec();
        let rows: Vec<Vec<u8>> = width.iter().map(|&w| vec![3u8; w]).collect();
        let refs: Vec<&[u8]> = rows.iter().map(Vec::as_slice).collect();
        for k in 0..n / 200 {
            let id = fmix64(k ^ (round << 40) ^ ((t as u64) << 56) ^ 0xadd);
            table.insert(id, &refs).unwrap();
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let spec = arg("--spec").unwrap_or_else(|| "criteo-kaggle,scale=0.5".into());
    let runs: usize = arg("--runs").map_or(3, |r| r.parse().unwrap());
    let root = PathBuf::from(arg("--dir").unwrap_or_else(|| "target/bench-delta".into()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let m = SyntheticModel::generate(&spec.parse::<SyntheticSpec>().unwrap()).unwrap();

    let only_tracked = args.iter().any(|a| a == "--only-tracked");

    // Full and delta saves of the same state, interleaved.
    let base = root.join("base");
    if !only_tracked {
        save(&base, m.input(), &opts(None)).unwrap();
        mutate(&m.tables, 1);
    }
    let (mut full_t, mut delta_t) = (Vec::new(), Vec::new());
    let (full, delta) = (root.join("full"), root.join("delta"));
    for round in (0..=runs).filter(|_| !only_tracked) {
        for (dir, parent, times) in [
            (&full, None, &mut full_t),
            (&delta, Some(base.as_path()), &mut delta_t),
        ] {
            let _ = std::fs::remove_dir_all(dir);
            // SAFETY: sync(2) has no preconditions.
            unsafe { libc::sync() };
            let t = Instant::now();
            save(dir, m.input(), &opts(parent)).unwrap();
            if round > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    println!("| what | full save | delta | ratio |");
    println!("| --- | --- | --- | --- |");
    if !only_tracked {
        let (fb, db) = (dir_bytes(&full), dir_bytes(&delta));
        let (ft, dt) = (median(full_t), median(delta_t));
        println!(
            "| bytes | {:.1} MiB | {:.1} MiB | {:.4} |",
            fb as f64 / 1048576.0,
            db as f64 / 1048576.0,
            db as f64 / fb as f64
        );
        println!(
            "| time (durable), changes found by comparing | {ft:.2} s | {dt:.2} s | {:.3} |",
            dt / ft
        );
    }

    // Tracked: each round saves a baseline, changes the tables, then times a delta of them
    // against a full save of the same state.
    let tracked = tracked_copy(&m);
    let (mut tf_t, mut td_t) = (Vec::new(), Vec::new());
    let (tbase, tdelta, tfull) = (root.join("tbase"), root.join("tdelta"), root.join("tfull"));
    for round in 0..=runs {
        for d in [&tbase, &tdelta, &tfull] {
            let _ = std::fs::remove_dir_all(d);
        }
        save(&tbase, input_of(&tracked, &m), &opts(None)).unwrap();
        mutate(&tracked, 100 + round as u64);
        // SAFETY: sync(2) has no preconditions.
        unsafe { libc::sync() };
        let t = Instant::now();
        let r = save(&tdelta, input_of(&tracked, &m), &opts(Some(&tbase))).unwrap();
        let d = t.elapsed().as_secs_f64();
        eprintln!(
            "tracked delta: {d:.3} s (before the plan {:.3} s, plan {:.3} s, write {:.3} s, commit {:.3} s)",
            d - r.plan_seconds - r.write_seconds - r.commit_seconds,
            r.plan_seconds,
            r.write_seconds,
            r.commit_seconds
        );
        // SAFETY: as above.
        unsafe { libc::sync() };
        let t = Instant::now();
        save(&tfull, input_of(&tracked, &m), &opts(None)).unwrap();
        if round > 0 {
            td_t.push(d);
            tf_t.push(t.elapsed().as_secs_f64());
        }
    }
    let (tf, td) = (median(tf_t), median(td_t));
    let (tfb, tdb) = (dir_bytes(&tfull), dir_bytes(&tdelta));
    println!(
        "| bytes, tracked | {:.1} MiB | {:.1} MiB | {:.4} |",
        tfb as f64 / 1048576.0,
        tdb as f64 / 1048576.0,
        tdb as f64 / tfb as f64
    );
    println!(
        "| time (durable), tracked changes | {tf:.2} s | {td:.2} s | {:.3} |",
        td / tf
    );
    drop(tracked);
    if only_tracked {
        let _ = std::fs::remove_dir_all(&root);
        return;
    }

    // A chain of a base and 10 deltas, against its compaction.
    let mut last = base.clone();
    for k in 0..10 {
        if k > 0 {
            mutate(&m.tables, 10 + k);
        }
        let d = root.join(format!("chain{k}"));
        save(&d, m.input(), &opts(Some(&last))).unwrap();
        last = d;
    }
    let chain = Checkpoint::open(&last).unwrap();
    let compacted = root.join("compacted");
    let (mut compact_t, mut full2_t) = (Vec::new(), Vec::new());
    for round in 0..=runs {
        let _ = std::fs::remove_dir_all(&compacted);
        unsafe { libc::sync() };
        let t = Instant::now();
        reshard(&chain, &compacted, &opts(None)).unwrap();
        if round > 0 {
            compact_t.push(t.elapsed().as_secs_f64());
        }
        let _ = std::fs::remove_dir_all(&full);
        unsafe { libc::sync() };
        let t = Instant::now();
        save(&full, m.input(), &opts(None)).unwrap();
        if round > 0 {
            full2_t.push(t.elapsed().as_secs_f64());
        }
    }
    let (ct, f2) = (median(compact_t), median(full2_t));
    println!(
        "| compact of base + 10 deltas (durable) | {f2:.2} s | {ct:.2} s | {:.3} |",
        ct / f2
    );

    let compacted_ck = Checkpoint::open(&compacted).unwrap();
    let lopts = |j| LoadOptions {
        shard_num: 2,
        shard_index: Some(j),
        load_dense: false,
        ..Default::default()
    };
    for (what, into_arrays) in [("load into arrays", true), ("restore into tables", false)] {
        let (mut ct, mut cht) = (Vec::new(), Vec::new());
        let (mut ca, mut cha) = (0.0, 0.0);
        for round in 0..=runs {
            let t = Instant::now();
            let r = if into_arrays {
                compacted_ck.load_columns(&lopts(0)).unwrap().report
            } else {
                compacted_ck.restore(&lopts(0)).unwrap().report
            };
            if round > 0 {
                ct.push(t.elapsed().as_secs_f64());
            }
            ca = r.read_amplification;
            let t = Instant::now();
            let chain = Checkpoint::open(&last).unwrap();
            let r = if into_arrays {
                chain.load_columns(&lopts(0)).unwrap().report
            } else {
                chain.restore(&lopts(0)).unwrap().report
            };
            if round > 0 {
                cht.push(t.elapsed().as_secs_f64());
            }
            cha = r.read_amplification;
        }
        let (ct, cht) = (median(ct), median(cht));
        println!(
            "| {what}, shard 0 of 2, warm cache: time | {ct:.2} s (compacted) | {cht:.2} s (chain) | {:.3} |",
            cht / ct
        );
        println!(
            "| {what}: read amplification | {ca:.3} | {cha:.3} | {:.3} |",
            cha / ca
        );
    }
    // `--keep` leaves the checkpoints (the chain is `chain9`, its compaction `compacted`), to
    // profile their loads with the `saver` binary.
    if !args.iter().any(|a| a == "--keep") {
        let _ = std::fs::remove_dir_all(&root);
    }
}

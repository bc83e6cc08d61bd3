//! Multi-process: N processes each save their shard of one checkpoint into one directory (the
//! one that completes the set commits); then M processes each load their shard of it.
//!
//! Run: `cargo run --release --example multi_process [N] [M]`
//! (it starts its own child processes, as a launcher would).

use std::process::Command;
use std::time::Duration;

use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::{save, Checkpoint, ForeignRows, LoadOptions, PartitionRule, SaveOptions};

const SPEC: &str = "tables=3,rows=30000,dim=16,slots=embedding+adagrad,dense=256KiB,seed=11";

fn child_save(dir: &str, n: u32, i: u32) -> Result<(), Box<dyn std::error::Error>> {
    // Every process builds the same model (as replicated workers would) and saves its shard.
    let model = SyntheticModel::generate(&SPEC.parse::<SyntheticSpec>()?)?;
    let mut opts = {
        SaveOptions {
            save_id: Some("example-step-100".into()),
            wait: Some(Duration::from_secs(120)),
            ..Default::default()
        }
    };
    opts.plan.shard_num = n;
    opts.plan.shard_index = Some(i);
    opts.plan.foreign_rows = ForeignRows::Skip;
    let r = save(dir, model.input(), &opts)?;
    println!(
        "saver {i}/{n}: wrote {} rows, committed here: {}",
        r.rows, r.committed_here
    );
    Ok(())
}

fn child_load(dir: &str, m: u32, j: u32) -> Result<(), Box<dyn std::error::Error>> {
    let ck = Checkpoint::open(dir)?;
    let r = ck.restore(&{
        LoadOptions {
            shard_num: m,
            shard_index: Some(j),
            ..Default::default()
        }
    })?;
    for t in &r.shards[0].tables {
        assert!(t
            .ids()
            .iter()
            .all(|&id| PartitionRule::shard_of(id, m) == j));
    }
    println!(
        "loader {j}/{m}: {} rows, read amplification {:.3}",
        r.report.rows, r.report.read_amplification
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 5 && (args[1] == "save" || args[1] == "load") {
        let (n, i) = (args[3].parse()?, args[4].parse()?);
        return if args[1] == "save" {
            child_save(&args[2], n, i)
        } else {
            child_load(&args[2], n, i)
        };
    }
    let n: u32 = args.get(1).map_or(Ok(4), |s| s.parse())?;
    let m: u32 = args.get(2).map_or(Ok(3), |s| s.parse())?;
    let dir = std::env::temp_dir().join("saver-multi-process-example");
    let _ = std::fs::remove_dir_all(&dir);
    let dir = dir.to_str().expect("utf-8 temp dir").to_string();
    let exe = std::env::current_exe()?;
    let run_all = |verb: &str, count: u32| -> Result<(), Box<dyn std::error::Error>> {
        let children: Vec<_> = (0..count)
            .map(|k| {
                Command::new(&exe)
                    .args([verb, &dir, &count.to_string(), &k.to_string()])
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        for mut c in children {
            if !c.wait()?.success() {
                return Err(format!("a {verb} process failed").into());
            }
        }
        Ok(())
    };
    run_all("save", n)?;
    let ck = Checkpoint::open(&dir)?;
    println!(
        "committed: {} shards, {} files",
        ck.manifest().shard_num,
        ck.manifest().files.len()
    );
    run_all("load", m)?;
    let total: u64 = ck.manifest().tables.iter().map(|t| t.rows).sum();
    assert_eq!(total, 90_000);
    println!("ok: {n} savers, {m} loaders, {total} rows");
    Ok(())
}

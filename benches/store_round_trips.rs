//! What a save to an S3-compatible store (Garage on loopback, started here) and an open of the
//! checkpoint there spend outside their bytes, by number of shards. A save claims its shards,
//! writes their manifests and commits (reading every shard's manifest and claim, the index's
//! compare-and-swap, removing the checkpoint it replaced); an open reads the index and the
//! manifest and looks up every data file and checks its header. Each is one or a few round
//! trips a shard or a file, so for a checkpoint of many small shards they are most of the time.
//!
//! `cargo bench --bench store_round_trips -- [--runs 5] [--shards 1,8,32] [--json]`
//!
//! For each number of shards, into a prefix of its own: a first save (nothing to replace), then
//! `--runs` saves that each replace the one before, of a small model (8 tables of 20,000 rows,
//! 1 MB dense), each followed by a `Checkpoint::open` of what it saved. Prints the medians of the
//! whole save and of its plan (claims included), write (shard manifests included) and commit
//! phases, for the first save and for the replacing ones, and of the opens; and, as the baseline
//! of the same run, the median time of one round trip to the idle store (a PUT of 1 KiB, and a
//! GET of it), so that every time is also given in PUTs. `--json` prints one JSON object per
//! number of shards instead (phases as [whole, plan, write, commit]). Many of the requests of a
//! save or an open take far longer than these: Garage writes its metadata durably, and answers a
//! ranged GET (a data file's header) about 40 ms late on a connection kept from an earlier
//! request (docs/benchmarks/HISTORY.md, "Round trips of a save of many shards").
//!
//! Needs a `garage` binary on `PATH` or in `~/.cargo/bin` (`cargo install --locked garage`).

#[path = "../tests/integration/common/garage.rs"]
mod garage;

mod common;

use std::path::Path;
use std::time::Instant;

use common::{arg, median};
use object_store::ObjectStoreExt;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::{save, Checkpoint, SaveOptions, SaveReport};

/// A save's seconds: whole, plan, write, commit.
fn phases(whole: f64, r: &SaveReport) -> [f64; 4] {
    [whole, r.plan_seconds, r.write_seconds, r.commit_seconds]
}

fn main() {
    let runs: usize = arg("--runs").map_or(5, |v| v.parse().expect("--runs N"));
    let shard_counts: Vec<u32> = arg("--shards").map_or(vec![1, 8, 32], |v| {
        v.split(',')
            .map(|s| s.parse().expect("--shards 1,8,32"))
            .collect()
    });
    let json = std::env::args().any(|a| a == "--json");
    let Some(g) = garage::Garage::start() else {
        panic!("no garage binary: cargo install --locked garage");
    };
    g.set_env();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s3 = g.s3_client();
    let round_trip = median(
        (0..21)
            .map(|i| {
                let key = object_store::path::Path::from(format!("rtt/{i}"));
                let t = Instant::now();
                rt.block_on(s3.put(&key, vec![7u8; 1024].into())).unwrap();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let get = median(
        (0..21)
            .map(|i| {
                let key = object_store::path::Path::from(format!("rtt/{i}"));
                let t = Instant::now();
                rt.block_on(async { s3.get(&key).await.unwrap().bytes().await.unwrap() });
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let spec: SyntheticSpec = "tables=8,rows=20000,dim=16,slots=embedding,dense=1000000,seed=3"
        .parse()
        .unwrap();
    let model = SyntheticModel::generate(&spec).unwrap();
    if !json {
        println!(
            "One round trip to the idle store: a PUT of 1 KiB {:.1} ms, a GET of it {:.1} ms. \
             Seconds, and in brackets as many PUTs; the replacing saves' medians.\n",
            round_trip * 1e3,
            get * 1e3
        );
        println!("| shards | save | whole | plan | write | commit |\n| --- | --- | --- | --- | --- | --- |");
    }
    for shards in shard_counts {
        let url = g.url(&format!("shards{shards}"));
        let mut first = [0.0; 4];
        let mut replacing: Vec<[f64; 4]> = Vec::new();
        let mut opens = Vec::new();
        for k in 0..=runs {
            let mut o = {
                let o = SaveOptions {
                    overwrite: true,
                    save_id: Some(format!("s{k}")),
                    ..Default::default()
                };
                o
            };
            o.plan.shard_num = shards;
            o.plan.parallel = 2;
            let t = Instant::now();
            let r = save(Path::new(&url), model.input(), &o).unwrap();
            let p = phases(t.elapsed().as_secs_f64(), &r);
            assert_eq!(r.replaced.is_some(), k > 0, "save {k} of {shards} shards");
            let t = Instant::now();
            let ck = Checkpoint::open(Path::new(&url)).unwrap();
            opens.push(t.elapsed().as_secs_f64());
            assert_eq!(ck.manifest().save_id, format!("s{k}"));
            if k == 0 {
                first = p;
            } else {
                replacing.push(p);
            }
        }
        let med: [f64; 4] =
            std::array::from_fn(|i| median(replacing.iter().map(|p| p[i]).collect()));
        let open = median(opens);
        if json {
            println!(
                "{{\"shards\":{shards},\"put_s\":{round_trip:.5},\"get_s\":{get:.5},\"first\":{first:?},\"replacing\":{med:?},\"open_s\":{open:.5}}}"
            );
        } else {
            for (what, p) in [("first", first), ("replacing", med)] {
                let cells: Vec<String> = p
                    .iter()
                    .map(|s| format!("{s:.3} ({:.0})", s / round_trip))
                    .collect();
                println!("| {shards} | {what} | {} |", cells.join(" | "));
            }
            println!(
                "| {shards} | `Checkpoint::open` | {open:.3} ({:.0}) | | | |",
                open / round_trip
            );
        }
    }
}

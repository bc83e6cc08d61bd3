//! A delta chain read from an S3-compatible store (Garage on loopback, started here) against its
//! compacted copy in the same store: the same rows, read through the links or from one
//! checkpoint.
//!
//! `cargo bench --bench chain_object_store -- [--size 6MiB] [--links 3] [--shards 1] [--runs 3]`
//!
//! `--shards N` saves every link (and the compacted copy) in N shards. Besides the whole load,
//! one worker's load of shard 1 of 2 (a resharding load: half the rows, from every shard).
//!
//! The base holds the model; each later link rewrites 30 % of every table's rows (a different
//! 30 % each time). Every configuration runs once per round, interleaved, after a warm-up round;
//! medians are reported, with the chain's time as a ratio to the compacted copy's (the baseline:
//! the same rows, digest and load done the same way, from one checkpoint).

#[path = "../tests/integration/common/garage.rs"]
mod garage;

mod common;

use common::{human, median};

use std::path::Path;
use std::time::Instant;

use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::tools::digest::{Content, DigestVersion};
use saver::io::tools::reshard::reshard;
use saver::{save, Checkpoint, LoadOptions, SaveOptions};

/// One configuration: runs once, returns its timed seconds.
type Run<'a> = Box<dyn Fn() -> f64 + 'a>;

fn opts(parent: Option<&str>, shards: u32) -> SaveOptions {
    let mut o = {
        SaveOptions {
            overwrite: true,
            parent: parent.map(Into::into),
            ..Default::default()
        }
    };
    o.plan.parallel = 2;
    o.plan.shard_num = shards;
    o
}

/// The content digest of the checkpoint or chain at `url`, as `saver digest` computes it.
fn digest(url: &str) -> String {
    let at = Content::At {
        path: Path::new(url),
        parallel: 2,
    };
    saver::io::tools::digest::digest(at, DigestVersion::V2).unwrap()
}

/// Loads the checkpoint or chain at `url` into tables (all of it, or shard `part` of 2);
/// returns the rows loaded.
fn load(url: &str, part: Option<u32>) -> u64 {
    let chain = Checkpoint::open(Path::new(url)).unwrap();
    let mut o = LoadOptions::default();
    if let Some(j) = part {
        o.shard_num = 2;
        o.shard_index = Some(j);
    }
    let r = chain.restore(&o).unwrap();
    r.report.rows
}

fn main() {
    let size = common::arg("--size")
        .and_then(|s| saver::core::synthetic::parse_size(&s))
        .unwrap_or(6 << 20);
    let links: usize = common::arg("--links")
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let shards: u32 = common::arg("--shards")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let runs: usize = common::arg("--runs")
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let Some(g) = garage::Garage::start() else {
        eprintln!("no garage binary: cargo install --locked garage");
        return;
    };
    g.set_env();

    let spec: SyntheticSpec = common::spec_of_size(size).parse().unwrap();
    let model = SyntheticModel::generate(&spec).unwrap();
    let mut urls: Vec<String> = Vec::new();
    let mut bytes = 0;
    for k in 0..links {
        if k > 0 {
            for t in &model.tables {
                for id in t.ids() {
                    let drawn =
                        (id ^ (k as u64).wrapping_mul(0x9E37_79B9)).wrapping_mul(2654435761);
                    if (drawn >> 7) % 10 < 3 {
                        t.upsert(id, |r| r.slot_mut::<f32>(0)[0] += k as f32);
                    }
                }
            }
        }
        let url = g.url(&format!("chain/l{k}"));
        let r = save(
            Path::new(&url),
            model.input(),
            &opts(urls.last().map(String::as_str), shards),
        )
        .unwrap();
        bytes += r.bytes_written;
        urls.push(url);
    }
    let tip = urls.last().unwrap().clone();
    let compacted = g.url("chain/compacted");
    let chain = Checkpoint::open(Path::new(&tip)).unwrap();
    reshard(&chain, Path::new(&compacted), &opts(None, shards)).unwrap();
    drop(chain);
    assert_eq!(digest(&tip), digest(&compacted));

    println!(
        "## A chain of {links} links on an object store (Garage on loopback), {} model in {shards} shard(s), {} in all links\n",
        human(spec.model_bytes()),
        human(bytes)
    );
    println!(
        "Medians of {runs} rounds after a warm-up round, configurations interleaved. Baseline: \
         the chain's compacted copy in the same store. Ratio: the chain's time / the copy's.\n"
    );
    let configs: Vec<(&str, Run<'_>)> = vec![
        (
            "digest, compacted",
            Box::new(|| {
                let t = Instant::now();
                digest(&compacted);
                t.elapsed().as_secs_f64()
            }),
        ),
        (
            "digest, chain",
            Box::new(|| {
                let t = Instant::now();
                digest(&tip);
                t.elapsed().as_secs_f64()
            }),
        ),
        (
            "load into tables, compacted",
            Box::new(|| {
                let t = Instant::now();
                load(&compacted, None);
                t.elapsed().as_secs_f64()
            }),
        ),
        (
            "load into tables, chain",
            Box::new(|| {
                let t = Instant::now();
                load(&tip, None);
                t.elapsed().as_secs_f64()
            }),
        ),
        (
            "load of shard 1 of 2, compacted",
            Box::new(|| {
                let t = Instant::now();
                load(&compacted, Some(1));
                t.elapsed().as_secs_f64()
            }),
        ),
        (
            "load of shard 1 of 2, chain",
            Box::new(|| {
                let t = Instant::now();
                load(&tip, Some(1));
                t.elapsed().as_secs_f64()
            }),
        ),
    ];
    let mut times = vec![Vec::new(); configs.len()];
    for round in 0..=runs {
        for (i, (name, f)) in configs.iter().enumerate() {
            let secs = f();
            eprintln!("round {round}: {name}: {secs:.2} s");
            if round > 0 {
                times[i].push(secs);
            }
        }
    }
    let times: Vec<f64> = times.into_iter().map(median).collect();
    println!("| read | compacted copy | chain | chain / copy |\n| --- | --- | --- | --- |");
    for (i, what) in ["digest", "load into tables", "load of shard 1 of 2"]
        .iter()
        .enumerate()
    {
        let (copy, chain) = (times[2 * i], times[2 * i + 1]);
        println!(
            "| {what} | {copy:.2} s | {chain:.2} s | **{:.2}** |",
            chain / copy
        );
    }
}

//! Compressed checkpoints against raw ones of the same model, in one run: bytes stored, and the
//! time of a durable save and of a load from disk (its files evicted from the page cache first),
//! locally and to an S3-compatible store (Garage on loopback, started here).
//!
//! `cargo bench --bench compressed -- [--size 1GiB] [--runs 3] [--no-s3]`
//!
//! Three models of about `--size` each: the two of the peers harness (`small`: dim-64 embedding
//! and Adagrad rows; `criteo-kaggle`: its 26 tables' row counts, dim 16), whose ids are hashed
//! and whose values are random fp32, as trained embeddings nearly are; and a model whose ids
//! are dense (category indices `0..n`, as Criteo's are) and whose optimizer rows are zero for 9
//! rows in 10 (rows a sparse optimizer never updated). Every configuration runs once per round,
//! raw and compressed alternated, after a warm-up round; medians. Each figure is the compressed
//! checkpoint's over the raw one's of the same run: below 1, compression wins.

#[path = "../tests/integration/common/garage.rs"]
mod garage;

mod common;

use common::{human, median};

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::storage::{ObjectStorage, Storage};
use saver::{
    save, Checkpoint, Compression, Dtype, EmbeddingTable, KeyDtype, LoadOptions, SaveInput,
    SaveOptions, SlotSpec,
};

/// A model to save: its tables (and dense tensors, for the synthetic ones).
enum Model {
    Synthetic(SyntheticModel),
    Tables(Vec<EmbeddingTable>),
}

impl Model {
    fn input(&self) -> SaveInput<'_> {
        match self {
            Model::Synthetic(m) => m.input(),
            Model::Tables(ts) => ts.iter().fold(SaveInput::new(), |i, t| i.table(t)),
        }
    }
}

/// A model's name and how to make it (one at a time, so that only one is in memory).
type ModelMaker<'a> = (&'a str, Box<dyn Fn() -> Model + 'a>);

/// Tables of dense ids `0..rows`, a dim-16 fp32 embedding of random values and an Adagrad
/// accumulator that is zero in 9 rows of 10, about `bytes` in all.
fn mostly_zero_optimizer(bytes: u64) -> Vec<EmbeddingTable> {
    let slots = vec![
        SlotSpec::new("embedding", Dtype::F32, vec![16]),
        SlotSpec::new("adagrad", Dtype::F32, vec![16]),
    ];
    let rows = bytes / (8 + 2 * 16 * 4) / 4;
    (0..4u64)
        .map(|t| {
            let table = EmbeddingTable::new(format!("t{t}"), KeyDtype::I64, slots.clone()).unwrap();
            (0..rows).into_par_iter().for_each(|id| {
                table.upsert(id, |row| {
                    let h = saver::core::partition::fmix64(id ^ (t << 48));
                    for (i, v) in row.slot_mut::<f32>(0).iter_mut().enumerate() {
                        *v = (saver::core::partition::fmix64(h ^ i as u64) >> 40) as f32
                            / (1u64 << 24) as f32
                            - 0.5;
                    }
                    if id % 10 == 0 {
                        for (i, v) in row.slot_mut::<f32>(1).iter_mut().enumerate() {
                            *v = (saver::core::partition::fmix64(!h ^ i as u64) >> 44) as f32 / 1e4;
                        }
                    }
                });
            });
            table
        })
        .collect()
}

/// A synthetic spec scaled to about `bytes`.
fn scaled(preset: &str, bytes: u64) -> SyntheticSpec {
    let mut spec: SyntheticSpec = preset.parse().unwrap();
    spec.scale = bytes as f64 / spec.model_bytes() as f64;
    spec
}

fn opts(compressed: bool) -> SaveOptions {
    let mut o = {
        SaveOptions {
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.parallel = 2;
    o.plan.compression = compressed.then(Compression::default);
    o
}

/// Drops a directory's files from the page cache (they are clean after a durable save), so a
/// load reads them from the disk.
fn evict(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let f = std::fs::File::open(e.unwrap().path()).unwrap();
        // SAFETY: a valid descriptor; the call only drops clean cached pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

fn load(dir: &Path) -> f64 {
    let t = Instant::now();
    let r = Checkpoint::open(dir)
        .unwrap()
        .restore(&{
            LoadOptions {
                parallel: 2,
                ..Default::default()
            }
        })
        .unwrap();
    let secs = t.elapsed().as_secs_f64();
    drop(r);
    secs
}

fn stored_bytes(dir: &Path) -> u64 {
    Checkpoint::open(dir)
        .unwrap()
        .newest()
        .manifest()
        .files
        .iter()
        .map(|f| f.bytes)
        .sum()
}

/// Medians of `runs` rounds (after a warm-up) of each configuration, interleaved.
fn interleaved(runs: usize, configs: &mut [Box<dyn FnMut() -> f64 + '_>]) -> Vec<f64> {
    let mut times = vec![Vec::new(); configs.len()];
    for round in 0..=runs {
        for (k, run) in configs.iter_mut().enumerate() {
            let secs = run();
            if round > 0 {
                times[k].push(secs);
            }
        }
    }
    times.into_iter().map(median).collect()
}

fn main() {
    let (size, runs) = common::size_and_runs();
    let size = if common::arg("--size").is_none() {
        1 << 30
    } else {
        size
    };
    let s3 = !std::env::args().any(|a| a == "--no-s3");
    let g = if s3 {
        match garage::Garage::start() {
            Some(g) => {
                g.set_env();
                Some(g)
            }
            None => {
                eprintln!("no garage binary (cargo install --locked garage); local figures only");
                None
            }
        }
    } else {
        None
    };
    let scratch = common::scratch().join("compressed");
    println!(
        "## Compressed checkpoints (`--compress zstd`, level 1) against raw ones\n\n\
         Medians of {runs} rounds after a warm-up round, raw and compressed alternated. Saves \
         are durable (with direct I/O where the disk suits it); loads restore every table with 2 threads, the files evicted from the page cache \
         first. Ratios: compressed over raw (below 1: compression wins).\n"
    );
    println!(
        "| model | raw bytes | compressed | bytes ratio | save local | load local | save S3 | \
         load S3 |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let models: Vec<ModelMaker<'_>> = vec![
        (
            "small (dim 64, embedding + Adagrad, hashed ids)",
            Box::new(|| {
                Model::Synthetic(SyntheticModel::generate(&scaled("small", size)).unwrap())
            }),
        ),
        (
            "criteo-kaggle (26 tables, dim 16, hashed ids)",
            Box::new(|| {
                Model::Synthetic(SyntheticModel::generate(&scaled("criteo-kaggle", size)).unwrap())
            }),
        ),
        (
            "dense ids, Adagrad zero in 9 rows of 10 (4 tables, dim 16)",
            Box::new(|| Model::Tables(mostly_zero_optimizer(size))),
        ),
    ];
    for (name, make) in models {
        let model = make();
        let dirs: Vec<PathBuf> = ["raw", "zstd"].iter().map(|k| scratch.join(k)).collect();
        // Each S3 save writes a fresh prefix, which its load reads then removes.
        let n = [std::cell::Cell::new(0u32), std::cell::Cell::new(0u32)];
        let mut configs: Vec<Box<dyn FnMut() -> f64 + '_>> = Vec::new();
        for (k, dir) in dirs.iter().enumerate() {
            let model = &model;
            configs.push(Box::new(move || {
                let t = Instant::now();
                save(dir, model.input(), &opts(k == 1)).unwrap();
                t.elapsed().as_secs_f64()
            }));
        }
        for dir in &dirs {
            configs.push(Box::new(move || {
                evict(dir);
                load(dir)
            }));
        }
        if let Some(g) = &g {
            for k in 0..2 {
                let (model, n) = (&model, &n[k]);
                configs.push(Box::new(move || {
                    n.set(n.get() + 1);
                    let url = g.url(&format!("compressed/{}-{k}", n.get()));
                    let t = Instant::now();
                    save(Path::new(&url), model.input(), &opts(k == 1)).unwrap();
                    t.elapsed().as_secs_f64()
                }));
            }
            for k in 0..2 {
                let n = &n[k];
                configs.push(Box::new(move || {
                    let url = g.url(&format!("compressed/{}-{k}", n.get()));
                    let secs = load(Path::new(&url));
                    let s = ObjectStorage::from_url(&url).unwrap();
                    for name in s.list().unwrap() {
                        s.remove(&name).unwrap();
                    }
                    secs
                }));
            }
        }
        let t = interleaved(runs, &mut configs);
        let (raw, zstd) = (stored_bytes(&dirs[0]), stored_bytes(&dirs[1]));
        let ratio = |a: f64, b: f64| format!("{:.2} ({:.2} / {:.2} s)", b / a, b, a);
        let s3_cells = if t.len() > 4 {
            format!("{} | {}", ratio(t[4], t[5]), ratio(t[6], t[7]))
        } else {
            "— | —".into()
        };
        println!(
            "| {name} | {} | {} | {:.2} | {} | {} | {s3_cells} |",
            human(raw),
            human(zstd),
            zstd as f64 / raw as f64,
            ratio(t[0], t[1]),
            ratio(t[2], t[3]),
        );
        drop(configs);
        for d in &dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

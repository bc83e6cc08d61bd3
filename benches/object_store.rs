//! saver against an S3-compatible store (Garage on loopback, started here), against the plain
//! `object_store` requests that move the same bytes, in one run.
//!
//! `cargo bench --bench object_store -- [--size 2GiB] [--runs 3] [--loads-only | --saves-only]`
//! (`--loads-only`: skip the timed saves, for work on the loads; `--saves-only`: skip the timed
//! loads and the memory figures).
//!
//! Needs a `garage` binary on `PATH` or in `~/.cargo/bin` (`cargo install --locked garage`).
//! Baselines: an upload of the checkpoint's own files (as the same save writes them to a local
//! directory) in 8 MiB parts, 8 in flight (the limit of a save; the store does the same work on
//! the same bytes), beside a multipart upload of as many random bytes; and ranged GETs of 8 MiB,
//! 8 in flight, of the bytes a load reads, each copied into new memory as a load puts its bytes
//! into the new memory of the model it returns (the limit of a load), beside the same GETs
//! dropping their bytes. Every configuration runs once per round, interleaved, after a warm-up
//! round; what a run built is freed after its clock stops; medians are
//! reported with each figure as a ratio to its baseline of the same run, with the CPU time the
//! client (this process: saver, or the baseline's requests) and the server spent in the timed part.
//! Then peak memory of a save and a load, against the same operation on a local directory.

#[path = "../tests/integration/common/garage.rs"]
mod garage;

mod common;

use common::{cpu_seconds, gib_s, human, median, rss};

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3;
use object_store::multipart::MultipartStore;
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::storage::{ObjectStorage, Storage};
use saver::{save, Checkpoint, LoadOptions, SaveOptions};

/// One configuration: runs once, returns its timed seconds (setup and teardown untimed).
type Run<'a> = Box<dyn FnMut() -> f64 + 'a>;

const PIECE: u64 = 8 << 20;
const IN_FLIGHT: usize = 8;

/// The server whose CPU time [`clock`] counts.
static SERVER: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
/// CPU seconds of client and server in the last [`clock`]ed region.
static LAST_CPU: std::sync::Mutex<(f64, f64)> = std::sync::Mutex::new((0.0, 0.0));

/// Runs `f`, returns its wall time, and records the CPU time client and server spent in it.
fn clock(f: impl FnOnce()) -> f64 {
    let server = SERVER.get().copied().flatten();
    let (c0, s0) = cpu_seconds(server);
    let t = Instant::now();
    f();
    let secs = t.elapsed().as_secs_f64();
    let (c1, s1) = cpu_seconds(server);
    *LAST_CPU.lock().unwrap() = (c1 - c0, s1 - s0);
    secs
}

/// [`clock`] of a load that returns what it built, freed once the clock has stopped: freeing a
/// model is not part of loading it, and the plain GETs a load is compared with build nothing.
fn clock_load<T>(load: impl FnOnce() -> T) -> f64 {
    let mut built = None;
    let secs = clock(|| built = Some(load()));
    drop(built);
    secs
}

/// Medians per configuration: (wall seconds, client CPU seconds, server CPU seconds).
fn interleaved(runs: usize, configs: &mut [(String, Run<'_>)]) -> Vec<(f64, f64, f64)> {
    let mut times = vec![Vec::new(); configs.len()];
    for round in 0..=runs {
        for (i, (name, f)) in configs.iter_mut().enumerate() {
            let secs = f();
            let (client, server) = *LAST_CPU.lock().unwrap();
            eprintln!("round {round}: {name}: {secs:.2} s (CPU: client {client:.2} s, server {server:.2} s)");
            if round > 0 {
                times[i].push((secs, client, server));
            }
        }
    }
    times
        .into_iter()
        .map(|t| {
            let m = |k: fn(&(f64, f64, f64)) -> f64| median(t.iter().map(k).collect());
            (m(|x| x.0), m(|x| x.1), m(|x| x.2))
        })
        .collect()
}

/// Peak resident memory that `f` adds to this process (`None` where it cannot be measured).
fn peak_of<T>(f: impl FnOnce() -> T) -> (Option<u64>, T) {
    let (before, _) = rss();
    let ok = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let out = f();
    (ok.then(|| rss().1.saturating_sub(before)), out)
}

/// The baseline of a save: one multipart upload of `bytes` bytes, [`PIECE`] parts, [`IN_FLIGHT`]
/// at a time. Every part's bytes differ from every other's, down to each 64 KiB: a store that
/// stores equal blocks once (Garage does) would take one buffer sent again and again for less
/// work than a checkpoint's. Each part is one copy of a pseudo-random template with its number
/// and offset stamped every 64 KiB, made when the part is sent, as a save's rows are.
fn plain_upload(rt: &tokio::runtime::Runtime, s3: &Arc<AmazonS3>, key: &Key, bytes: u64) {
    let template: Vec<u8> = (0..PIECE / 8)
        .flat_map(|i| saver::core::partition::fmix64(i ^ 0x5A5A).to_le_bytes())
        .collect();
    let template = &template;
    rt.block_on(async {
        let id = s3.create_multipart(key).await.unwrap();
        let parts: Vec<_> = futures::stream::iter(0..bytes.div_ceil(PIECE))
            .map(|i| {
                let len = PIECE.min(bytes - i * PIECE) as usize;
                let mut part = template[..len].to_vec();
                for at in (0..len.saturating_sub(15)).step_by(64 << 10) {
                    part[at..at + 8].copy_from_slice(&i.to_le_bytes());
                    part[at + 8..at + 16].copy_from_slice(&(at as u64).to_le_bytes());
                }
                let (s3, key, id, payload) = (
                    s3.clone(),
                    key.clone(),
                    id.clone(),
                    PutPayload::from(Bytes::from(part)),
                );
                async move { s3.put_part(&key, &id, i as usize, payload).await.unwrap() }
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        s3.complete_multipart(key, &id, parts).await.unwrap();
    });
}

/// The files a save to a store would send, by name, read into memory: every file of `dir` (a
/// checkpoint saved to a local directory, which is flat) but the commit lock, which only a local
/// directory has.
fn checkpoint_files(dir: &Path) -> Vec<(String, Bytes)> {
    let mut out: Vec<(String, Bytes)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != saver::core::naming::COMMIT_LOCK)
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, Bytes::from(std::fs::read(e.path()).unwrap()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The baseline of a save that does the same work: `files` (a checkpoint's files, as the same
/// save wrote them to a local directory) uploaded under `prefix` as they are, from memory. A file
/// of more than one part goes up as a multipart upload of [`PIECE`] parts, [`IN_FLIGHT`] parts in
/// flight across all files; a smaller one in one PUT. The store receives exactly the bytes the
/// save sends it, so it does the same work on them: Garage compresses each block it stores
/// (zstd) and keeps equal blocks once, and a checkpoint's bytes are not random.
fn upload_files(
    rt: &tokio::runtime::Runtime,
    s3: &Arc<AmazonS3>,
    prefix: &str,
    files: &[(String, Bytes)],
) {
    let key = |name: &str| Key::from(format!("{prefix}/{name}"));
    rt.block_on(async {
        let (big, small): (Vec<_>, Vec<_>) = files.iter().partition(|f| f.1.len() as u64 > PIECE);
        let ids = futures::future::join_all(big.iter().map(|f| {
            let k = key(&f.0);
            async move { s3.create_multipart(&k).await.unwrap() }
        }))
        .await;
        let parts = big.iter().zip(&ids).enumerate().flat_map(|(k, (f, id))| {
            (0..(f.1.len() as u64).div_ceil(PIECE)).map(move |i| {
                let end = ((i + 1) * PIECE).min(f.1.len() as u64);
                (k, id, i, f.1.slice((i * PIECE) as usize..end as usize))
            })
        });
        let puts = futures::stream::iter(small.iter().map(|f| {
            let k = key(&f.0);
            let payload = PutPayload::from(f.1.clone());
            async move {
                s3.put(&k, payload).await.unwrap();
            }
        }))
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<()>>();
        let uploads = futures::stream::iter(parts)
            .map(|(k, id, i, bytes)| {
                let name = key(&big[k].0);
                async move {
                    let part = s3
                        .put_part(&name, id, i as usize, PutPayload::from(bytes))
                        .await
                        .unwrap();
                    (k, part)
                }
            })
            .buffered(IN_FLIGHT)
            .collect::<Vec<_>>();
        let (done, _) = futures::join!(uploads, puts);
        let mut by_file = vec![Vec::new(); big.len()];
        for (k, part) in done {
            by_file[k].push(part);
        }
        futures::future::join_all(big.iter().zip(&ids).zip(by_file).map(
            |((f, id), parts)| async move {
                s3.complete_multipart(&key(&f.0), id, parts).await.unwrap();
            },
        ))
        .await;
    });
}

/// The baseline of a load: ranged GETs of [`PIECE`] bytes, [`IN_FLIGHT`] at a time, of the first
/// `bytes` bytes of `objects` (key, size) in turn, each on the runtime's threads. With `keep`,
/// each piece is copied into new memory of its own, as a load puts what it reads into the new
/// memory of the model it returns: on this VM, faulting in 2 GiB of new pages takes about 0.6 s
/// of two threads, which GETs that drop their bytes into memory used again never pay. Fails
/// unless every byte asked for came; returns the pieces kept (to be freed untimed, as a load's
/// model is), none without `keep`.
fn plain_get(
    rt: &tokio::runtime::Runtime,
    s3: &Arc<AmazonS3>,
    objects: &[(Key, u64)],
    bytes: u64,
    keep: bool,
) -> Vec<memmap2::MmapMut> {
    let mut ranges = Vec::new();
    let mut left = bytes;
    for (key, size) in objects {
        let mut at = 0;
        while at < *size && left > 0 {
            let n = PIECE.min(size - at).min(left);
            ranges.push((key.clone(), at..at + n));
            at += n;
            left -= n;
        }
    }
    let pieces: Vec<(u64, Option<memmap2::MmapMut>)> = rt.block_on(async {
        futures::stream::iter(ranges)
            .map(|(key, r)| {
                let s3 = s3.clone();
                rt.spawn(async move {
                    let got = s3.get_range(&key, r).await.unwrap();
                    // A mapping of its own: new pages whatever the allocator holds free, as
                    // the arrays of a load (far past the allocator's threshold for mapping).
                    let kept = keep.then(|| {
                        let mut piece = memmap2::MmapMut::map_anon(got.len()).unwrap();
                        piece.copy_from_slice(&got);
                        piece
                    });
                    (got.len() as u64, kept)
                })
            })
            .buffer_unordered(IN_FLIGHT)
            .map(|joined| joined.unwrap())
            .collect()
            .await
    });
    let fetched: u64 = pieces.iter().map(|p| p.0).sum();
    assert_eq!(
        fetched, bytes,
        "the GETs fetched fewer bytes than asked for"
    );
    pieces.into_iter().filter_map(|p| p.1).collect()
}

/// Removes every object under `url` (untimed teardown).
fn remove_all(url: &str) {
    let s = ObjectStorage::from_url(url).unwrap();
    for name in s.list().unwrap() {
        s.remove(&name).unwrap();
    }
}

fn opts(parallel: usize, shards: u32) -> SaveOptions {
    let mut o = {
        SaveOptions {
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.parallel = parallel;
    o.plan.shard_num = shards;
    o
}

fn main() {
    let (size, runs) = common::size_and_runs();
    let Some(g) = garage::Garage::start() else {
        eprintln!("no garage binary: cargo install --locked garage");
        return;
    };
    g.set_env();
    SERVER.set(g.pid()).unwrap();
    let s3 = g.s3_client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let spec: SyntheticSpec = common::spec_of_size(size).parse().unwrap();
    let model = SyntheticModel::generate(&spec).unwrap();
    let local = common::scratch().join("object-store");
    let _ = std::fs::remove_dir_all(&local);

    // Peak memory of a save beyond the model, to the store and to a local directory.
    let (peak_local, probe) = peak_of(|| save(&local, model.input(), &opts(2, 1)).unwrap());
    let probe_url = g.url("probe");
    let (peak_s3, _) = peak_of(|| save(Path::new(&probe_url), model.input(), &opts(2, 1)).unwrap());
    // With twice the writers: the documented bound grows by 8 MiB a writer thread.
    let (peak_local4, _) = peak_of(|| save(&local, model.input(), &opts(4, 1)).unwrap());
    let probe_url4 = g.url("probe4");
    let (peak_s3_4, _) =
        peak_of(|| save(Path::new(&probe_url4), model.input(), &opts(4, 1)).unwrap());
    let bytes = probe.bytes_written;
    println!(
        "## Object store (Garage on loopback), {} model ({} rows, {} data files)\n",
        human(bytes),
        probe.rows,
        probe.files
    );
    println!(
        "Medians of {runs} rounds after a warm-up round, configurations interleaved. Baselines: \
         `object_store` multipart upload of the same number of bytes ({} parts, {IN_FLIGHT} in \
         flight), and ranged GETs ({} each, {IN_FLIGHT} in flight) of the bytes the load reads, \
         copied into new memory as a load's model is (beside them, the same GETs dropping their \
         bytes). Ratio: saver's throughput / the baseline's.\n",
        human(PIECE),
        human(PIECE)
    );

    // The checkpoint's own files, as the save of the first configuration below writes them.
    let same_dir = common::scratch().join("object-store-same-bytes");
    let _ = std::fs::remove_dir_all(&same_dir);
    save(&same_dir, model.input(), &opts(2, 1)).unwrap();
    let same = checkpoint_files(&same_dir);
    let _ = std::fs::remove_dir_all(&same_dir);
    // A fresh prefix for every save, so each writes into an empty one.
    let n = std::cell::Cell::new(0u32);
    let mut saves: Vec<(String, Run<'_>)> = vec![
        (
            "plain upload of the checkpoint's files (limit)".into(),
            Box::new(|| {
                let secs = clock(|| upload_files(&rt, &s3, "plain/files", &same));
                remove_all(&g.url("plain/files"));
                secs
            }),
        ),
        (
            "plain multipart upload of as many random bytes".into(),
            Box::new(|| {
                let key = Key::from("plain/upload");
                let secs = clock(|| plain_upload(&rt, &s3, &key, bytes));
                rt.block_on(s3.delete(&key)).unwrap();
                secs
            }),
        ),
    ];
    for (shards, parallel) in [(1u32, 2usize), (1, 4), (8, 4)] {
        let (model, g, n) = (&model, &g, &n);
        saves.push((
            format!("saver save, {shards} shard(s), parallel {parallel}"),
            Box::new(move || {
                n.set(n.get() + 1);
                let url = g.url(&format!("save/{}", n.get()));
                let secs = clock(|| {
                    save(Path::new(&url), model.input(), &opts(parallel, shards)).unwrap();
                });
                remove_all(&url);
                secs
            }),
        ));
    }
    if std::env::args().any(|a| a == "--loads-only") {
        saves.clear();
    }
    let times = interleaved(runs, &mut saves);
    if !times.is_empty() {
        println!("| save | time | throughput | ratio to limit | CPU: client / server |\n| --- | --- | --- | --- | --- |");
    }
    for (i, &(t, client, server)) in times.iter().enumerate() {
        let ratio = if i == 0 {
            "1.00".to_string()
        } else {
            format!("**{:.2}**", times[0].0 / t)
        };
        println!(
            "| {} | {t:.2} s | {} | {ratio} | {client:.2} s / {server:.2} s |",
            saves[i].0,
            gib_s(bytes, t)
        );
    }
    drop(saves);
    if std::env::args().any(|a| a == "--saves-only") {
        let _ = std::fs::remove_dir_all(&local);
        return;
    }

    // Loads: the probe checkpoint (1 shard) whole, and one saved with 8 shards read as shard 1
    // of 3.
    let url8 = g.url("probe8");
    save(Path::new(&url8), model.input(), &opts(4, 8)).unwrap();
    let ck = Checkpoint::open(Path::new(&probe_url)).unwrap();
    let ck8 = Checkpoint::open(Path::new(&url8)).unwrap();
    let objects = |ck: &Checkpoint, prefix: &str| -> Vec<(Key, u64)> {
        ck.manifest()
            .files
            .iter()
            .map(|f| (Key::from(format!("{prefix}/{}", f.name)), f.bytes))
            .collect()
    };
    let (whole, eighths) = (objects(&ck, "probe"), objects(&ck8, "probe8"));
    let reshard_opts = {
        LoadOptions {
            shard_num: 3,
            shard_index: Some(1),
            parallel: 2,
            ..Default::default()
        }
    };
    let reshard_read = ck8.load_columns(&reshard_opts).unwrap().report.bytes_read;
    let all = {
        LoadOptions {
            parallel: 2,
            ..Default::default()
        }
    };
    let mut loads: Vec<(String, Run<'_>)> = vec![
        (
            "plain ranged GETs of the checkpoint, bytes dropped".into(),
            Box::new(|| clock(|| drop(plain_get(&rt, &s3, &whole, bytes, false)))),
        ),
        (
            "plain ranged GETs of the checkpoint into new memory (limit)".into(),
            Box::new(|| clock_load(|| plain_get(&rt, &s3, &whole, bytes, true))),
        ),
        (
            "saver load into new arrays (load_columns), parallel 2".into(),
            Box::new(|| clock_load(|| ck.load_columns(&all).unwrap())),
        ),
        (
            "saver restore into new hashtables, parallel 2".into(),
            Box::new(|| clock_load(|| ck.restore(&all).unwrap())),
        ),
        (
            "plain ranged GETs of the bytes shard 1 of 3 reads, bytes dropped".into(),
            Box::new(|| clock(|| drop(plain_get(&rt, &s3, &eighths, reshard_read, false)))),
        ),
        (
            "plain ranged GETs of the bytes shard 1 of 3 reads into new memory (limit)".into(),
            Box::new(|| clock_load(|| plain_get(&rt, &s3, &eighths, reshard_read, true))),
        ),
        (
            "saver resharding load 8 → shard 1 of 3 into arrays, parallel 2".into(),
            Box::new(|| clock_load(|| ck8.load_columns(&reshard_opts).unwrap())),
        ),
    ];
    let times = interleaved(runs, &mut loads);
    println!("\n| load | time | throughput | ratio to limit | CPU: client / server |\n| --- | --- | --- | --- | --- |");
    let read = [
        bytes,
        bytes,
        bytes,
        bytes,
        reshard_read,
        reshard_read,
        reshard_read,
    ];
    // The limit of each half: its GETs into new memory.
    let limit = |i: usize| if i < 4 { 1 } else { 5 };
    for (i, &(t, client, server)) in times.iter().enumerate() {
        let ratio = if i == limit(i) {
            "1.00".to_string()
        } else if i == 0 || i == 4 {
            format!("{:.2}", times[limit(i)].0 / t)
        } else {
            format!("**{:.2}**", times[limit(i)].0 / t)
        };
        println!(
            "| {} | {t:.2} s | {} | {ratio} | {client:.2} s / {server:.2} s |",
            loads[i].0,
            gib_s(read[i], t)
        );
    }
    drop(loads);

    // Peak memory of a load beyond what it returns, from the store and from the local directory.
    let local_ck = Checkpoint::open(&local).unwrap();
    let (peak_load_local, a) = peak_of(|| local_ck.load_columns(&all).unwrap());
    let kept = a.report.bytes_kept;
    drop(a);
    let (peak_load_s3, b) = peak_of(|| ck.load_columns(&all).unwrap());
    drop(b);
    let r = ck8.load_columns(&reshard_opts).unwrap().report;
    println!(
        "\nResharding load 8 → shard 1 of 3: {} read for {} kept, read amplification {:.4}.\n",
        human(r.bytes_read),
        human(r.bytes_kept),
        r.read_amplification
    );
    let show = |p: Option<u64>| p.map_or("not measurable here".to_string(), human);
    println!(
        "| peak memory beyond the model | local directory | object store |\n| --- | --- | --- |"
    );
    println!(
        "| save, 1 shard, parallel 2 | {} | {} |",
        show(peak_local),
        show(peak_s3)
    );
    println!(
        "| save, 1 shard, parallel 4 | {} | {} |",
        show(peak_local4),
        show(peak_s3_4)
    );
    println!(
        "| load into arrays, parallel 2 (beyond the {} it returns) | {} | {} |",
        human(kept),
        show(peak_load_local.map(|p| p.saturating_sub(kept))),
        show(peak_load_s3.map(|p| p.saturating_sub(kept)))
    );
    let _ = std::fs::remove_dir_all(&local);
}

//! Shared pieces of the benchmarks: baselines measured in the same run as saver.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The buffer size of the plain baselines (saver's default chunk size).
pub const BUF: usize = 8 << 20;

/// A plain sequential write of `bytes` bytes from one reused buffer: the physical limit a
/// checkpoint writer is measured against. With `fsync`, the file is synced before returning.
pub fn plain_write(path: &Path, bytes: u64, fsync: bool) {
    let buf = vec![0x5au8; BUF];
    let mut f = File::create(path).unwrap();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(BUF as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    if fsync {
        f.sync_all().unwrap();
    }
}

/// The same write with `O_DIRECT` (around the page cache) from one page-aligned reused buffer,
/// then `fsync`: the other plain way to write durably, and on this machine's disk the faster. A
/// durable save's limit is the faster of this and [`plain_write`] with fsync.
pub fn plain_write_direct(path: &Path, bytes: u64) {
    use std::os::unix::fs::OpenOptionsExt;
    const ALIGN: usize = 4096;
    let mut raw = vec![0x5au8; BUF + ALIGN];
    let at = raw.as_ptr().align_offset(ALIGN);
    let buf = &mut raw[at..at + BUF];
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    let mut off = 0u64;
    while off < bytes {
        // Whole aligned blocks; the file is cut to `bytes` after.
        let n = ((bytes - off).min(BUF as u64) as usize).next_multiple_of(ALIGN);
        f.write_all_at(&buf[..n], off).unwrap();
        off += n as u64;
    }
    f.set_len(bytes).unwrap();
    f.sync_all().unwrap();
}

/// Reads every file whole into reused buffers, from `threads` threads (files split between them).
pub fn plain_read(files: &[PathBuf], threads: usize) -> u64 {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut buf = vec![0u8; BUF];
                    let mut total = 0u64;
                    for f in files.iter().skip(t).step_by(threads) {
                        let file = OpenOptions::new().read(true).open(f).unwrap();
                        let len = file.metadata().unwrap().len();
                        let mut off = 0;
                        while off < len {
                            let n = ((len - off) as usize).min(BUF);
                            file.read_exact_at(&mut buf[..n], off).unwrap();
                            off += n as u64;
                        }
                        total += len;
                    }
                    total
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

/// Reads every file whole into new memory of its own, from `threads` threads (files split
/// between them), and returns it: what a load does, which puts the bytes it reads into the new
/// memory of the model it returns and faults in every page of it.
pub fn plain_read_into_new(files: &[PathBuf], threads: usize) -> Vec<Vec<u8>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    files
                        .iter()
                        .skip(t)
                        .step_by(threads)
                        .map(|f| {
                            let file = OpenOptions::new().read(true).open(f).unwrap();
                            let mut buf = vec![0u8; file.metadata().unwrap().len() as usize];
                            for (k, piece) in buf.chunks_mut(BUF).enumerate() {
                                file.read_exact_at(piece, (k * BUF) as u64).unwrap();
                            }
                            buf
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// The data files of a checkpoint directory.
pub fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// A scratch directory for benchmark output: `SAVER_BENCH_DIR` or `target/bench-scratch` (on the
/// same disk as the build, not a tmpfs, so writes measure the disk).
pub fn scratch() -> PathBuf {
    let dir = std::env::var_os("SAVER_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-scratch"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The scale of a benchmark's Criteo-Kaggle-shaped model: `SAVER_BENCH_SCALE`, or `default`.
/// `benches/summary.sh --quick` sets it small, so that CI runs every benchmark once.
pub fn scale_or(default: f64) -> f64 {
    std::env::var("SAVER_BENCH_SCALE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|s: &f64| *s > 0.0)
        .unwrap_or(default)
}

/// Bytes of a row-major model spec of about `bytes` bytes: 8 tables of dim-64 embedding + Adagrad.
pub fn spec_of_size(bytes: u64) -> String {
    let dense = (bytes / 32).min(256 << 20);
    let rows = (bytes - dense) / 8 / (8 + 2 * 64 * 4);
    format!("tables=8,rows={rows},dim=64,slots=embedding+adagrad,dense={dense},seed=3")
}

/// A trainer's table for the write benchmarks: `rows` rows (ids 0..rows) of a dim-32 embedding
/// and its Adagrad accumulator, 256 bytes a row.
pub fn trainer_table(rows: u64) -> saver::EmbeddingTable {
    trainer_table_with(rows, false)
}

/// [`trainer_table`], with change tracking on if `tracking`.
pub fn trainer_table_with(rows: u64, tracking: bool) -> saver::EmbeddingTable {
    use saver::{Dtype, EmbeddingTable, KeyDtype, SlotSpec};
    let mut t = EmbeddingTable::new(
        "t",
        KeyDtype::U64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![32]),
            SlotSpec::new("adagrad", Dtype::F32, vec![32]),
        ],
    )
    .unwrap();
    if tracking {
        t = t.with_change_tracking().unwrap();
    }
    for id in 0..rows {
        t.upsert(id, |_| ());
    }
    t
}

/// One training step of `batch` Adagrad-like updates to random rows of `t` below `hot`, from
/// the random state `r` (advanced).
pub fn train_step(t: &saver::EmbeddingTable, hot: u64, batch: u64, r: &mut u64) {
    for _ in 0..batch {
        *r = saver::core::partition::fmix64(*r);
        let g = (*r >> 40) as f32 * 1e-7;
        t.upsert(*r % hot, |row| {
            row.slot_mut::<f32>(1)[0] += g * g;
            row.slot_mut::<f32>(0).iter_mut().for_each(|x| *x -= g);
        });
    }
}

/// The median of `v` (not empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Resident and peak-resident memory of this process, from /proc/self/status (bytes).
pub fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU seconds of this process (every thread) and of process `pid`, from `/proc`.
pub fn cpu_seconds(pid: Option<u32>) -> (f64, f64) {
    let of = |path: String| -> f64 {
        let stat = std::fs::read_to_string(&path).unwrap_or_default();
        if stat.is_empty() {
            return 0.0; // a server that has exited
        }
        // utime and stime are fields 14 and 15; the command name (field 2) may hold spaces, so
        // count from the closing parenthesis: the field after it is field 3, the state, a letter.
        // Every field counts, so that this letter does not shift the others.
        let rest = stat.rsplit_once(')').map_or("", |r| r.1);
        let field = |n: usize| -> f64 {
            rest.split_whitespace()
                .nth(n - 3)
                .and_then(|x| x.parse().ok())
                .unwrap_or_else(|| panic!("{path}: field {n} is not a number: {stat}"))
        };
        // SAFETY: sysconf has no memory effects.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        (field(14) + field(15)) / hz
    };
    let server = pid.map_or(0.0, |p| of(format!("/proc/{p}/stat")));
    (of("/proc/self/stat".into()), server)
}

/// `bytes` in GiB or MiB.
pub fn human(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// `bytes` moved in `secs`, in GiB/s.
pub fn gib_s(bytes: u64, secs: f64) -> String {
    format!("{:.2} GiB/s", bytes as f64 / secs / (1u64 << 30) as f64)
}

/// The value after `name` on the benchmark's command line (`--size 2GiB`), if given.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// `--size` (default 2 GiB) and `--runs` (default 3).
pub fn size_and_runs() -> (u64, usize) {
    let size = arg("--size")
        .and_then(|s| saver::core::synthetic::parse_size(&s))
        .unwrap_or(2 << 30);
    let runs = arg("--runs").and_then(|s| s.parse().ok()).unwrap_or(3);
    (size, runs)
}

/// Copies of `m`'s tables with change tracking on.
pub fn tracked_copy(m: &saver::core::synthetic::SyntheticModel) -> Vec<saver::EmbeddingTable> {
    m.tables
        .iter()
        .map(|t| {
            let c = saver::EmbeddingTable::new(
                t.name(),
                saver::SparseTable::key_dtype(t),
                t.slots().to_vec(),
            )
            .unwrap()
            .with_change_tracking()
            .unwrap();
            let widths = t.slot_row_bytes().to_vec();
            let mut row = Vec::new();
            for id in t.ids() {
                row.clear();
                t.append_row(id, &mut row);
                let mut at = 0;
                let values: Vec<&[u8]> = widths
                    .iter()
                    .map(|&w| {
                        at += w;
                        &row[at - w..at]
                    })
                    .collect();
                c.insert(id, &values).unwrap();
            }
            c
        })
        .collect()
}

/// `tables` and `m`'s dense tensors as a save's input.
pub fn input_of<'a>(
    tables: &'a [saver::EmbeddingTable],
    m: &'a saver::core::synthetic::SyntheticModel,
) -> saver::SaveInput<'a> {
    let mut input = saver::SaveInput::new();
    for t in tables {
        input = input.table(t);
    }
    for (name, shape, data) in &m.dense {
        input = input.dense(
            saver::DenseTensor::new(name.clone(), saver::Dtype::F32, shape.clone(), &data[..])
                .unwrap(),
        );
    }
    input
}

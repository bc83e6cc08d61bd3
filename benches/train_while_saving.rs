//! Training while saving: what a background point-in-time save costs the trainers on this machine.
//!
//! Trainer threads apply steps of 10,000 upserts (dim-32 embedding + Adagrad) to rows of a 1 M
//! row table (256 MiB), to a hot set of 1 % or 10 % of them or to all (uniform), as fast as they
//! can. For each case (1 and 2 trainer threads × hot set), in one run: steps/s and p50/p99 step
//! time outside a save and during durable `save_async`s with 1 and 2 writer threads; the time
//! the trainer was blocked in `save_async`; the training lost per save (steps not taken, in
//! seconds of training at the pace outside) against the stall of a blocking save of the same
//! table (the same save with the trainers stopped); the copy-on-write memory at its peak; the
//! save's time with the trainers running against idle; and the floor, the same figures while one
//! thread, or two threads each writing half, write the table's bytes from memory to files and
//! sync them ("floor×1" and "floor×2" writers, what the saves with 1 and 2 writers compare to);
//! and a save of another table of the same size that no trainer writes ("other×1"): what the
//! save's own work costs the trainers, without the locks and copy-on-write of sharing a table.
//!
//! "Outside" a save is the 0.9 s just before it (each save or plain write follows a pause of a
//! second or more): this machine's speed drifts by two or three times within a run, with nothing
//! else of ours running, so ratios to one early window measure the drift as much as the save
//! (`steps_ratio_first`, against the window before the first save, is printed beside them for
//! comparison). From the kernel's schedstat: the trainers' time waiting for a CPU during the save
//! (`trainers_wait_s`: the save's threads took their core) and the CPU time of every other thread
//! of the process (`save_cpu_s`, the save's own); and, for the slowest 1 % of the steps during
//! each run, where their time went on average (`tail_run_ms` on a CPU, `tail_wait_ms` waiting for
//! one, `tail_asleep_ms` neither: a lock, a page fault's wait), from each trainer thread's
//! schedstat read before and after every step.
//!
//! `cargo bench --bench train_while_saving -- [--rows N] [--trainers 1,2] [--hot 1,10,100]
//! [--json]` (SAVER_BENCH_DIR for the output directory). `--json` prints one JSON object per
//! save, for `benches/train_while_saving_ab.sh`, which runs this file built against two commits
//! alternately.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use saver::{save_async, EmbeddingTable, SaveInput, SaveOptions};

mod common;

const ROW_BYTES: u64 = 256;
const BATCH: u64 = 10_000;
/// How long before each save or plain write the pace outside it is measured.
const BEFORE: Duration = Duration::from_millis(900);

/// One training step: when it ended (since the run began), how long it took, and of that the
/// time its thread spent on a CPU and waiting for one (the rest it slept: a lock, a page fault's
/// I/O, ...).
#[derive(Clone, Copy)]
struct Step {
    end: Duration,
    took: Duration,
    run: Duration,
    wait: Duration,
}

/// The steps of a trainer that runs until `stop`.
fn trainer(
    t: &EmbeddingTable,
    hot: u64,
    seed: u64,
    stop: &AtomicBool,
    begin: Instant,
    tids: &Mutex<Vec<i64>>,
) -> Vec<Step> {
    // SAFETY: gettid has no memory effects.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    tids.lock().unwrap().push(tid);
    // Kept open and read again from its start each step: a few microseconds against steps of
    // half a millisecond or more.
    let stat = std::fs::File::open(format!("/proc/self/task/{tid}/schedstat")).unwrap();
    let mut steps = Vec::new();
    let mut r = seed;
    while !stop.load(Ordering::Relaxed) {
        let (run0, wait0) = schedstat(&stat);
        let s = Instant::now();
        common::train_step(t, hot, BATCH, &mut r);
        let took = s.elapsed();
        let (run1, wait1) = schedstat(&stat);
        steps.push(Step {
            end: begin.elapsed(),
            took,
            run: run1.saturating_sub(run0),
            wait: wait1.saturating_sub(wait0),
        });
    }
    steps
}

/// A thread's time on a CPU and waiting for one, from its open schedstat file.
fn schedstat(f: &std::fs::File) -> (Duration, Duration) {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 128];
    let n = f.read_at(&mut buf, 0).unwrap();
    let s = std::str::from_utf8(&buf[..n]).unwrap();
    let mut it = s.split_whitespace().map(|x| x.parse::<u64>().unwrap());
    let (run, wait) = (it.next().unwrap(), it.next().unwrap());
    (Duration::from_nanos(run), Duration::from_nanos(wait))
}

/// Time on a CPU and time waiting for one (runnable, not running), summed over threads `tids`
/// of this process, from the kernel's schedstat.
fn sched(tids: &[i64]) -> (Duration, Duration) {
    let mut run = 0u64;
    let mut wait = 0u64;
    for t in tids {
        let path = format!("/proc/self/task/{t}/schedstat");
        let s = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e} (a kernel without CONFIG_SCHED_INFO?)"));
        let mut f = s.split_whitespace().map(|x| x.parse::<u64>());
        let mut next = || {
            f.next()
                .and_then(Result::ok)
                .unwrap_or_else(|| panic!("{path}: not two numbers: {s:?}"))
        };
        run += next();
        wait += next();
    }
    (Duration::from_nanos(run), Duration::from_nanos(wait))
}

/// CPU time (user + system) of the whole process so far, threads that ended included.
fn process_cpu() -> Duration {
    // SAFETY: getrusage writes only the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Steps/s, p50 and p99 step time of the steps (of every trainer) that ended within
/// `[from, to)`.
fn rate(steps: &[Step], from: Duration, to: Duration) -> (f64, Duration, Duration) {
    let within = slowest_first(steps, from, to);
    if within.is_empty() {
        return (0.0, Duration::ZERO, Duration::ZERO);
    }
    // Slowest first: quantile q is counted from the end.
    let at = |q: usize| within[within.len() - 1 - within.len() * q / 100].took;
    (
        within.len() as f64 / (to - from).as_secs_f64(),
        at(50),
        at(99),
    )
}

/// The steps that ended within `[from, to)`, slowest first.
fn slowest_first(steps: &[Step], from: Duration, to: Duration) -> Vec<Step> {
    let mut within: Vec<Step> = steps
        .iter()
        .filter(|s| s.end >= from && s.end < to)
        .copied()
        .collect();
    within.sort_by_key(|s| std::cmp::Reverse(s.took));
    within
}

/// Where the slowest 1 % of the steps within `[from, to)` (at least one) spent their time, on
/// average: on a CPU, waiting for one, and the rest asleep.
fn tail(steps: &[Step], from: Duration, to: Duration) -> (Duration, Duration, Duration) {
    let within = slowest_first(steps, from, to);
    let n = within.len().div_ceil(100).max(1).min(within.len());
    if n == 0 {
        return Default::default();
    }
    let sum = |f: fn(&Step) -> Duration| within[..n].iter().map(f).sum::<Duration>() / n as u32;
    let (took, run, wait) = (sum(|s| s.took), sum(|s| s.run), sum(|s| s.wait));
    (run, wait, took.saturating_sub(run + wait))
}

struct Args {
    rows: u64,
    trainers: Vec<usize>,
    hot: Vec<u64>,
    json: bool,
}

fn args() -> Args {
    let mut a = Args {
        rows: 1 << 20,
        trainers: vec![1, 2],
        hot: vec![1, 10, 100],
        json: false,
    };
    let list = |v: &str| -> Vec<u64> { v.split(',').map(|x| x.parse().unwrap()).collect() };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--rows" => a.rows = it.next().unwrap().parse().unwrap(),
            "--trainers" => {
                a.trainers = list(&it.next().unwrap())
                    .into_iter()
                    .map(|x| x as usize)
                    .collect()
            }
            "--hot" => a.hot = list(&it.next().unwrap()),
            "--json" => a.json = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// One run of something beside the trainers: a save or a plain write.
struct Run {
    /// What ran.
    beside: Beside,
    /// The save's writer threads, or the plain write's threads.
    threads: usize,
    from: Duration,
    to: Duration,
    /// How long `save_async` held the trainer.
    blocked: Duration,
    /// The copy-on-write peak so far.
    peak: usize,
    /// Where the CPU time went during the run.
    spent: Spent,
}

/// CPU time: the trainers' on a CPU and waiting for one, and every other thread's of the process
/// (during a run, the save's or the plain write's). Read at the start of a run, then the
/// difference at its end ([`Spent::since`]).
#[derive(Clone, Copy)]
struct Spent {
    trainers_run: Duration,
    trainers_wait: Duration,
    others: Duration,
}

impl Spent {
    /// So far, for the trainer threads `tids`.
    fn now(tids: &Mutex<Vec<i64>>) -> Self {
        let (trainers_run, trainers_wait) = sched(&tids.lock().unwrap());
        let all = process_cpu();
        Self {
            trainers_run,
            trainers_wait,
            others: all.saturating_sub(trainers_run),
        }
    }

    /// Spent since `start` (an earlier [`Spent::now`]).
    fn since(tids: &Mutex<Vec<i64>>, start: Self) -> Self {
        let end = Self::now(tids);
        Self {
            trainers_run: end.trainers_run.saturating_sub(start.trainers_run),
            trainers_wait: end.trainers_wait.saturating_sub(start.trainers_wait),
            others: end.others.saturating_sub(start.others),
        }
    }
}

/// What ran beside the trainers: a plain write of the table's bytes (the floor), a save of
/// their table, or a save of another one.
#[derive(Clone, Copy, PartialEq)]
enum Beside {
    Floor,
    Save,
    OtherSave,
}

/// Writes `bytes` to a new file at `path` in 8 MiB writes and syncs it, at the background save's
/// priority (nice +10), then removes it.
fn plain_write(path: &std::path::Path, bytes: &[u8]) {
    use std::io::Write;
    // SAFETY: setpriority of the calling thread has no memory effects.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
    let mut f = std::fs::File::create(path).unwrap();
    for c in bytes.chunks(8 << 20) {
        f.write_all(c).unwrap();
    }
    f.sync_data().unwrap();
    drop(f);
    std::fs::remove_file(path).unwrap();
}

fn main() {
    let a = args();
    let scratch = common::scratch().join("train-while-saving");
    let _ = std::fs::remove_dir_all(&scratch);
    if !a.json {
        println!(
            "table: {} rows, {} MiB; steps of {BATCH} upserts",
            a.rows,
            (a.rows * ROW_BYTES) >> 20
        );
    }
    for &trainers in &a.trainers {
        for &hot_percent in &a.hot {
            case(&a, &scratch, trainers, hot_percent);
        }
    }
}

fn case(a: &Args, scratch: &std::path::Path, trainers: usize, hot_percent: u64) {
    let hot = (a.rows * hot_percent / 100).max(1);
    let t = Arc::new(common::trainer_table(a.rows));
    // A second table of the same size that nobody trains: saving it costs the trainers what a
    // save does to the machine (CPU, memory traffic, I/O), and nothing of sharing their table
    // (locks, copy-on-write), which the difference from a save of their own table measures.
    let other = Arc::new(common::trainer_table(a.rows));
    let tag = format!("t{trainers}h{hot_percent}");
    // The stall of a blocking save: stop, save, resume; the table as the trainers left it.
    let idle = |k: &str, parallel: usize| {
        let mut opts = {
            let o = SaveOptions {
                save_id: Some(format!("{tag}idle{k}")),
                ..Default::default()
            };
            o
        };
        opts.plan.parallel = parallel;
        let dir = scratch.join(format!("{tag}idle{k}"));
        let start = Instant::now();
        save_async(&dir, SaveInput::new().table(t.clone()), opts)
            .unwrap()
            .wait()
            .unwrap();
        let took = start.elapsed();
        std::fs::remove_dir_all(&dir).unwrap();
        took
    };
    let stop = AtomicBool::new(false);
    let begin = Instant::now();
    let tids = Mutex::new(Vec::new());
    let mut runs_done: Vec<Run> = Vec::new();
    // A buffer of the table's size for the plain writes, filled (so mapped) before the trainers
    // start.
    let source: Vec<u8> = (0..a.rows * ROW_BYTES).map(|i| i as u8).collect();
    let steps: Vec<Step> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..trainers)
            .map(|k| {
                let (t, stop, tids) = (&t, &stop, &tids);
                s.spawn(move || trainer(t, hot, 1 + k as u64, stop, begin, tids))
            })
            .collect();
        std::thread::sleep(Duration::from_secs(2));
        let runs = [
            (1usize, false),
            (2, false),
            (1, true),
            (1, false),
            (2, false),
            (1, true),
        ];
        for (k, (parallel, of_other)) in runs.into_iter().enumerate() {
            let mut opts = {
                let o = SaveOptions {
                    save_id: Some(format!("{tag}k{k}")),
                    ..Default::default()
                };
                o
            };
            opts.plan.parallel = parallel;
            let dir = scratch.join(format!("{tag}k{k}"));
            let saved = if of_other { &other } else { &t };
            let start = Spent::now(&tids);
            let from = begin.elapsed();
            let h = save_async(&dir, SaveInput::new().table(saved.clone()), opts).unwrap();
            let blocked = begin.elapsed() - from;
            h.wait().unwrap();
            let to = begin.elapsed();
            let spent = Spent::since(&tids, start);
            runs_done.push(Run {
                beside: if of_other {
                    Beside::OtherSave
                } else {
                    Beside::Save
                },
                threads: parallel,
                from,
                to,
                blocked,
                peak: saved.point_in_time_bytes().1,
                spent,
            });
            std::fs::remove_dir_all(&dir).unwrap();
            std::thread::sleep(Duration::from_secs(1));
        }
        // The floor: the same bytes written from memory to files and synced, by one or two
        // threads at the save's priority, with no table, lock or copy-on-write in the way.
        for threads in [1usize, 2, 1, 2] {
            let start = Spent::now(&tids);
            let from = begin.elapsed();
            let part = source.len().div_ceil(threads);
            std::thread::scope(|p| {
                for (k, bytes) in source.chunks(part).enumerate() {
                    let path = scratch.join(format!("{tag}plain{k}"));
                    p.spawn(move || plain_write(&path, bytes));
                }
            });
            let to = begin.elapsed();
            let spent = Spent::since(&tids, start);
            runs_done.push(Run {
                beside: Beside::Floor,
                threads,
                from,
                to,
                blocked: Duration::ZERO,
                peak: 0,
                spent,
            });
            std::thread::sleep(Duration::from_secs(1));
        }
        stop.store(true, Ordering::Relaxed);
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    let (first, p50_first, p99_first) =
        rate(&steps, Duration::from_millis(500), Duration::from_secs(2));
    let idle_secs = [idle("1", 1), idle("2", 2)];
    if !a.json {
        println!(
            "\n{trainers} trainer(s), hot set {hot_percent} %: before the first save {first:.1} steps/s, p50 {p50_first:.2?}, p99 {p99_first:.2?}; blocking save (trainers stopped) {:.2} s / {:.2} s with 1 / 2 writers",
            idle_secs[0].as_secs_f64(),
            idle_secs[1].as_secs_f64()
        );
    }
    for run in runs_done {
        let Run {
            beside,
            threads,
            from,
            to,
            blocked,
            peak,
            spent,
        } = run;
        let (during, p50, p99) = rate(&steps, from, to);
        // The pace outside is the pace just before this run (each follows a pause of a second or
        // more): this machine's speed drifts by several times within a run, so a pace measured
        // once would make every later ratio partly a measure of the drift.
        let (outside, p50_out, p99_out) = rate(&steps, from.saturating_sub(BEFORE), from);
        let (tail_run, tail_wait, tail_asleep) = tail(&steps, from, to);
        let took = (to - from).as_secs_f64();
        // Steps not taken during the save, in seconds of training at the pace outside.
        let lost = took * (1.0 - during / outside);
        let stall = match beside {
            Beside::Floor => 0.0,
            Beside::Save | Beside::OtherSave => idle_secs[threads - 1].as_secs_f64(),
        };
        let writers = match beside {
            Beside::Floor => format!("floor×{threads}"),
            Beside::Save => threads.to_string(),
            Beside::OtherSave => format!("other×{threads}"),
        };
        if a.json {
            println!(
                "{{\"trainers\":{trainers},\"hot\":{hot_percent},\"writers\":\"{}\",\"steps_ratio\":{:.4},\"steps_ratio_first\":{:.4},\"p50_out_ms\":{:.4},\"p99_out_ms\":{:.4},\"p50_during_ms\":{:.4},\"p99_during_ms\":{:.4},\"p99_ratio\":{:.4},\"blocked_ms\":{:.4},\"lost_s\":{lost:.4},\"stall_s\":{stall:.4},\"save_s\":{took:.4},\"save_idle_s\":{stall:.4},\"cow_peak_mib\":{:.2},\"trainers_run_s\":{:.4},\"trainers_wait_s\":{:.4},\"save_cpu_s\":{:.4},\"tail_run_ms\":{:.4},\"tail_wait_ms\":{:.4},\"tail_asleep_ms\":{:.4}}}",
                writers,
                during / outside,
                during / first,
                p50_out.as_secs_f64() * 1e3,
                p99_out.as_secs_f64() * 1e3,
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3,
                p99.as_secs_f64() / p99_out.as_secs_f64().max(1e-9),
                blocked.as_secs_f64() * 1e3,
                peak as f64 / (1 << 20) as f64,
                spent.trainers_run.as_secs_f64(),
                spent.trainers_wait.as_secs_f64(),
                spent.others.as_secs_f64(),
                tail_run.as_secs_f64() * 1e3,
                tail_wait.as_secs_f64() * 1e3,
                tail_asleep.as_secs_f64() * 1e3,
            );
        } else if beside == Beside::Floor {
            println!(
                "  floor, a plain write of the same bytes by {threads} thread(s): {took:.2} s; during it {during:.1} steps/s ({:.2} x outside), p50 {p50:.2?}, p99 {p99:.2?} ({:.1} x outside); the slowest 1 % of steps: {tail_run:.2?} on a CPU, {tail_wait:.2?} waiting for one, {tail_asleep:.2?} asleep",
                during / outside,
                p99.as_secs_f64() / p99_out.as_secs_f64().max(1e-9),
            );
        } else {
            let what = if beside == Beside::OtherSave {
                format!("save of another table, {threads} writer(s)")
            } else {
                format!("save, {threads} writer(s)")
            };
            println!(
                "  {what}: {took:.2} s ({:.2} x idle), blocked {blocked:.2?}; during it {during:.1} steps/s ({:.2} x outside), p50 {p50:.2?}, p99 {p99:.2?} ({:.1} x outside); training lost {lost:.3} s against a blocking save's {stall:.3} s; copy-on-write peak so far {:.1} MiB ({:.1} % of the table); the slowest 1 % of steps: {tail_run:.2?} on a CPU, {tail_wait:.2?} waiting for one, {tail_asleep:.2?} asleep",
                took / stall,
                during / outside,
                p99.as_secs_f64() / p99_out.as_secs_f64().max(1e-9),
                peak as f64 / (1 << 20) as f64,
                peak as f64 * 100.0 / (a.rows * ROW_BYTES) as f64,
            );
        }
    }
}

//! The engine's figures (docs/benchmarks/summary.md): saver against the physical limit, on one
//! model, in one run.
//!
//! `cargo bench --bench compare -- [--size 2GiB | --spec criteo-kaggle,scale=0.5] [--runs 3]
//! [--memory-only] [--plan-memory 64MiB] [--direct-io auto|on|off] [--durable-pairs N]
//! [--cache-pairs N]`
//!
//! For each configuration: a warm-up, then `--runs` timed runs; the median is reported, and each
//! figure as a ratio to the baseline measured in the same run. Prints a Markdown report. What a
//! run writes is removed before it, untimed: a write that replaces a file of 2 GiB pays for
//! freeing its blocks and pages, which the plain writes' times once included (and a save's
//! removal of its last output the save's), about a second for the write without fsync.
//!
//! `--durable-pairs N` measures only the durable save against its limit, more closely: a save
//! (1 shard, parallel 2) and the plain durable writes, N rounds after a warm-up, the order
//! rotated each round so that none always follows the same run, every output removed untimed;
//! and the save's phases from its report: the plan, before any file exists, and the write; and
//! the CPU time (user and system, every thread of the process) each run spent. `--cache-pairs N`
//! does the same for the save without fsync, against the plain buffered write without fsync.

mod common;

use common::{cpu_seconds, gib_s, human, median, rss};

use std::time::Instant;

use saver::core::synthetic::{parse_size, SyntheticModel, SyntheticSpec};
use saver::io::DirectIo;
use saver::{save, Checkpoint, LoadOptions, SaveOptions};

/// One benchmarked configuration: runs once, returns what it built (dropped untimed).
type Run<'a> = Box<dyn FnMut() -> Box<dyn std::any::Any> + 'a>;

/// A benchmarked configuration: its name, what it writes (removed before each run, untimed:
/// a plain write and a save both start with nothing to replace), and the run.
type Config<'a> = (String, Option<std::path::PathBuf>, Run<'a>);

/// Removes the file or directory at `path`, if any.
fn remove(path: &std::path::Path) {
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_dir_all(path);
}

/// Runs every configuration once per round, for a warm-up round and `runs` timed rounds, with a
/// `sync` before each timed run so every run starts without dirty pages. Interleaving spreads this
/// shared machine's noise evenly over saver and the baselines. Returns the median seconds of each.
fn interleaved(runs: usize, configs: &mut [Config<'_>]) -> Vec<f64> {
    let mut times = vec![Vec::new(); configs.len()];
    for round in 0..=runs {
        for (i, (_, output, f)) in configs.iter_mut().enumerate() {
            if let Some(output) = output {
                remove(output);
            }
            // SAFETY: sync(2) has no preconditions.
            unsafe { libc::sync() };
            let t = Instant::now();
            let result = f();
            let secs = t.elapsed().as_secs_f64();
            drop(result); // freeing what a run built (a restored model) is not part of its time
            if round > 0 {
                times[i].push(secs);
            }
        }
    }
    times.into_iter().map(median).collect()
}

/// Resets the peak-RSS counter (Linux: writing 5 to clear_refs), so VmHWM measures what follows.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The command-line settings every configuration shares.
#[derive(Clone, Copy)]
struct Flags {
    plan_memory: u64,
    direct_io: DirectIo,
}

fn opts(flags: &Flags, parallel: usize, durable: bool, shards: u32) -> SaveOptions {
    let mut o = {
        SaveOptions {
            durable,
            direct_io: flags.direct_io,
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.parallel = parallel;
    o.plan.shard_num = shards;
    o.plan.plan_memory = flags.plan_memory;
    o
}

/// One run of [`pairs`].
enum PairRun {
    /// The plain write with `O_DIRECT` (durable).
    Direct,
    /// The plain buffered write, with fsync where the save is durable.
    Buffered,
    /// saver's save.
    Save,
}

/// A save (1 shard, parallel 2) against the plain writes of as many bytes that do its work:
/// durable, the `O_DIRECT` write and the buffered write + fsync; without fsync, the buffered
/// write. `rounds` rounds after a warm-up, in an order rotated each round. Prints each one's
/// median and the median over rounds of the limit's time (the fastest plain write of that round)
/// over the save's.
fn pairs(
    model: &SyntheticModel,
    flags: &Flags,
    dir: &std::path::Path,
    bytes: u64,
    rounds: usize,
    durable: bool,
) {
    let plain = dir.join("plain.bin");
    let out = dir.join("save-pairs");
    // The limits first, the save last.
    let runs: &[(&str, PairRun)] = if durable {
        &[
            ("plain sequential write, O_DIRECT (fsync)", PairRun::Direct),
            ("plain sequential write (fsync)", PairRun::Buffered),
            ("saver save, 1 shard, parallel 2 (fsync)", PairRun::Save),
        ]
    } else {
        &[
            ("plain sequential write (no fsync)", PairRun::Buffered),
            ("saver save, 1 shard, parallel 2 (no fsync)", PairRun::Save),
        ]
    };
    let n = runs.len();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); n];
    // CPU seconds of this process (every thread) in each run: where the disk is faster than the
    // save's work on two cores, this and not the disk sets the save's pace.
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut ratios = Vec::new();
    // The save's phases, as its report gives them: the plan, before any file exists, and the
    // write, the fsyncs and the commit.
    let (mut plan, mut write) = (Vec::new(), Vec::new());
    let mut phases = (0.0, 0.0);
    for round in 0..=rounds {
        let mut this = vec![0.0; n];
        let mut this_cpu = vec![0.0; n];
        for k in 0..n {
            let which = (k + round) % n;
            remove(&plain);
            remove(&out);
            // SAFETY: sync(2) has no preconditions.
            unsafe { libc::sync() };
            let c = cpu_seconds(None).0;
            let t = Instant::now();
            match runs[which].1 {
                PairRun::Direct => common::plain_write_direct(&plain, bytes),
                PairRun::Buffered => common::plain_write(&plain, bytes, durable),
                PairRun::Save => {
                    let r = save(&out, model.input(), &opts(flags, 2, durable, 1)).unwrap();
                    phases = (r.plan_seconds, r.write_seconds + r.commit_seconds);
                }
            }
            this[which] = t.elapsed().as_secs_f64();
            this_cpu[which] = cpu_seconds(None).0 - c;
        }
        if round > 0 {
            plan.push(phases.0);
            write.push(phases.1);
            for (all, &t) in times.iter_mut().zip(&this) {
                all.push(t);
            }
            for (all, &c) in cpu.iter_mut().zip(&this_cpu) {
                all.push(c);
            }
            let limit = this[..n - 1].iter().copied().fold(f64::INFINITY, f64::min);
            ratios.push(limit / this[n - 1]);
        }
    }
    remove(&plain);
    remove(&out);
    let what = if durable {
        "Durable save"
    } else {
        "Save without fsync"
    };
    println!(
        "{what} against its limit: {rounds} rounds after a warm-up, the order rotated each \
         round, `sync` before every run, outputs removed untimed.\n"
    );
    println!(
        "| run | median time | throughput | CPU (user + system, every thread) |\n| --- | --- | --- | --- |"
    );
    for (((name, _), all), c) in runs.iter().zip(&times).zip(&cpu) {
        let t = median(all.clone());
        let c = median(c.clone());
        println!("| {name} | {t:.2} s | {} | {c:.2} s |", gib_s(bytes, t));
    }
    let (plan, write) = (median(plan), median(write));
    let (writes, first) = if durable {
        ("the write, fsync and commit", "`O_DIRECT` write")
    } else {
        ("the write and commit", "write")
    };
    println!(
        "\nThe save's phases (medians): the plan {plan:.2} s, during which no byte is written; \
         {writes} {write:.2} s, {} (the plain {first}: {}).",
        gib_s(bytes, write),
        gib_s(bytes, median(times[0].clone()))
    );
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "\nThe save against the faster plain write of its round: median **{:.2}** (rounds: {}).",
        median(ratios.clone()),
        each.join(", ")
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = common::arg;
    let (size, runs) = common::size_and_runs();
    let plan_memory = arg("--plan-memory")
        .and_then(|s| parse_size(&s))
        .unwrap_or(saver::PlanOptions::default().plan_memory);
    let direct_io = match arg("--direct-io").as_deref() {
        None | Some("auto") => DirectIo::Auto,
        Some("on") => DirectIo::On,
        Some("off") => DirectIo::Off,
        Some(other) => panic!("--direct-io {other:?}: expected auto, on or off"),
    };
    let flags = Flags {
        plan_memory,
        direct_io,
    };
    let dir = common::scratch().join("compare");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    let spec: SyntheticSpec = arg("--spec")
        .unwrap_or_else(|| common::spec_of_size(size))
        .parse()
        .unwrap();
    let t = Instant::now();
    let model = SyntheticModel::generate(&spec).unwrap();
    eprintln!("generated {spec:?} in {:.1}s", t.elapsed().as_secs_f64());

    // Memory first, while this process has never saved: peak RSS during a save minus RSS before.
    let (before, _) = rss();
    let measured = reset_peak();
    let ck_dir = dir.join("ckpt");
    let probe = save(&ck_dir, model.input(), &opts(&flags, 4, true, 1)).unwrap();
    let peak = measured.then(|| rss().1.saturating_sub(before));
    let bytes = probe.bytes_written;
    let chunk = saver::PlanOptions::default().chunk_bytes;
    println!(
        "## Save and load, {} model ({} rows, {} data files)\n",
        human(bytes),
        probe.rows,
        probe.files
    );
    match peak {
        Some(p) => println!(
            "Save peak memory beyond the model (parallel 4, fsync, first save of the process, plan memory \
             {}): **{}**; bound 64 MiB + 4 × {} chunk = {}; {} of the plan's 16 bytes a row spilled.\n",
            human(plan_memory), human(p), human(chunk), human((64 << 20) + 4 * chunk),
            human(probe.spilled_rows * 16)
        ),
        None => println!("(peak memory: /proc/self/clear_refs not writable here)\n"),
    }
    if args.iter().any(|a| a == "--memory-only") {
        return;
    }
    for (flag, durable) in [("--durable-pairs", true), ("--cache-pairs", false)] {
        if let Some(rounds) = arg(flag) {
            let rounds = rounds
                .parse()
                .unwrap_or_else(|_| panic!("{flag}: a number of rounds"));
            pairs(&model, &flags, &dir, bytes, rounds, durable);
            return;
        }
    }
    println!(
        "Medians of {runs} rounds after a warm-up round; configurations interleaved within each round, \
         `sync` before every run. Ratio: saver's throughput / the plain baseline's.\n"
    );

    let plain = dir.join("plain.bin");
    let mut configs: Vec<Config<'_>> = Vec::new();
    for durable in [true, false] {
        let tag = if durable { "fsync" } else { "no fsync" };
        let plain = plain.clone();
        if durable {
            let plain = plain.clone();
            configs.push((
                "plain sequential write, O_DIRECT (fsync)".to_string(),
                Some(plain.clone()),
                Box::new(move || {
                    common::plain_write_direct(&plain, bytes);
                    Box::new(())
                }),
            ));
        }
        configs.push((
            format!("plain sequential write ({tag})"),
            Some(plain.clone()),
            Box::new(move || {
                common::plain_write(&plain, bytes, durable);
                Box::new(())
            }),
        ));
        for (shards, p) in [(1u32, 1usize), (1, 2), (1, 4), (8, 4)] {
            let out = dir.join(format!("save-{shards}-{p}-{durable}"));
            let model = &model;
            configs.push((
                format!("saver save, {shards} shard(s), parallel {p} ({tag})"),
                Some(out.clone()),
                Box::new(move || {
                    Box::new(save(&out, model.input(), &opts(&flags, p, durable, shards)).unwrap())
                }),
            ));
        }
    }
    let times = interleaved(runs, &mut configs);
    // The limit of each half: its fastest plain write (for durable saves, the faster of a
    // buffered write + fsync and an O_DIRECT write).
    println!("| save | time | throughput | ratio to limit (the fastest plain write of its half) |\n| --- | --- | --- | --- |");
    for (start, end) in [(0, 6), (6, 11)] {
        let base = (start..end)
            .filter(|&i| configs[i].0.starts_with("plain"))
            .map(|i| times[i])
            .fold(f64::INFINITY, f64::min);
        for i in start..end {
            let (name, t) = (&configs[i].0, times[i]);
            println!(
                "| {name} | {t:.2} s | {} | {:.2}{} |",
                gib_s(bytes, t),
                base / t,
                if t == base { " (limit)" } else { "" }
            );
        }
    }
    for output in configs.iter().filter_map(|c| c.1.as_deref()) {
        remove(output);
    }
    drop(configs);

    // Loads from warm page cache.
    let files = common::data_files(&ck_dir);
    let ck = Checkpoint::open(&ck_dir).unwrap();
    // The limit: the files read into new memory, as a load puts them into the new memory of the
    // model it returns (faulting in 2 GiB of new pages takes about 0.6 s of two threads on this
    // VM). Beside it, the same reads into one reused buffer each, which pay none of that.
    let mut loads: Vec<Config<'_>> = vec![
        (
            "plain read into new memory, 2 threads (limit)".into(),
            None,
            Box::new(|| Box::new(common::plain_read_into_new(&files, 2))),
        ),
        (
            "plain read into reused buffers, 2 threads".into(),
            None,
            Box::new(|| Box::new(common::plain_read(&files, 2))),
        ),
    ];
    for p in [1usize, 2] {
        let ck = &ck;
        loads.push((
            format!("saver load into new arrays (load_columns), parallel {p}"),
            None,
            Box::new(move || {
                Box::new(
                    ck.load_columns(&{
                        LoadOptions {
                            parallel: p,
                            ..Default::default()
                        }
                    })
                    .unwrap(),
                )
            }),
        ));
    }
    for p in [1usize, 2] {
        let ck = &ck;
        loads.push((
            format!("saver restore into new hashtables (EmbeddingTable), parallel {p}"),
            None,
            Box::new(move || {
                Box::new(
                    ck.restore(&{
                        LoadOptions {
                            parallel: p,
                            ..Default::default()
                        }
                    })
                    .unwrap(),
                )
            }),
        ));
    }
    let times = interleaved(runs, &mut loads);
    println!("\n| load (warm page cache) | time | throughput | ratio to limit |\n| --- | --- | --- | --- |");
    for (i, t) in times.iter().enumerate() {
        let ratio = if i == 0 {
            "1.00".to_string()
        } else {
            format!("{:.2}", times[0] / t)
        };
        println!(
            "| {} | {t:.2} s | {} | {ratio} |",
            loads[i].0,
            gib_s(bytes, *t)
        );
    }
    drop(loads);

    // Resharding 8 -> 3.
    let ck8_dir = dir.join("ckpt8");
    save(&ck8_dir, model.input(), &opts(&flags, 4, false, 8)).unwrap();
    let ck8 = Checkpoint::open(&ck8_dir).unwrap();
    println!("\n| resharding load 8 → 3 | rows | bytes read | bytes kept | read amplification | time |\n| --- | --- | --- | --- | --- | --- |");
    for j in 0..3 {
        let r = ck8
            .restore(&{
                LoadOptions {
                    shard_num: 3,
                    shard_index: Some(j),
                    parallel: 2,
                    ..Default::default()
                }
            })
            .unwrap();
        let rep = &r.report;
        println!(
            "| target shard {j} of 3 | {} | {} | {} | {:.4} | {:.2} s |",
            rep.rows,
            human(rep.bytes_read),
            human(rep.bytes_kept),
            rep.read_amplification,
            rep.load_seconds
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

//! One process, many shards: in-process workers (threads of one trainer) that each hold their
//! shard of every table.
//!
//! - Saves of several shards from one process, in the background or from a rayon pool, with
//!   `wait`, never block each other: hundreds of rounds with varied timing, each bounded.
//! - Every table of a committed save learns of the commit, whichever call committed it: the next
//!   delta of every worker's table is tracked, as the report says.
//! - One call saves every worker's shard (foreground and background) and holds what a
//!   single-process save of the same rows holds.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::common::source_digest;
use saver::core::partition::fmix64;
use saver::io::source::Source;
use saver::{
    save, save_async, DeltaMethod, Dtype, EmbeddingTable, KeyDtype, LoadOptions, PartitionRule,
    SaveInput, SaveOptions, SaveReport, SlotSpec,
};

const NAMES: [&str; 2] = ["items", "users"];

fn slots() -> Vec<SlotSpec> {
    vec![
        SlotSpec::new("embedding", Dtype::F32, vec![4]),
        SlotSpec::new("freq", Dtype::I64, vec![]),
    ]
}

/// Worker `shard` of `n`'s tables, holding the rows of its shard among ids `0..ids`, each with
/// values derived from `seed`.
fn worker(shard: u32, n: u32, ids: u64, seed: u64, tracking: bool) -> Vec<Arc<EmbeddingTable>> {
    NAMES
        .iter()
        .map(|name| {
            let mut t = EmbeddingTable::for_shard(
                *name,
                KeyDtype::U64,
                slots(),
                saver::Shard {
                    index: shard,
                    count: n,
                },
                0,
            )
            .unwrap();
            if tracking {
                t = t.with_change_tracking().unwrap();
            }
            for id in (0..ids).filter(|&id| PartitionRule::shard_of(id, n) == shard) {
                write(&t, id, seed);
            }
            Arc::new(t)
        })
        .collect()
}

fn write(t: &EmbeddingTable, id: u64, seed: u64) {
    let v = fmix64(id ^ seed) as u32 as f32;
    t.upsert(id, |r| {
        r.slot_mut::<f32>(0).fill(v);
        r.slot_mut::<i64>(1)[0] = seed as i64;
    });
}

fn opts(save_id: &str, n: u32) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some(save_id.into()),
            durable: false,
            ..Default::default()
        }
    };
    o.plan.shard_num = n;
    o.plan.parallel = 2;
    o
}

fn digest(dir: &Path) -> String {
    let source = Source::open(dir).unwrap();
    let tables = source.tables(dir, 1).unwrap();
    source_digest(&tables, &source.dense().unwrap()).unwrap()
}

/// The input of worker `shard` saving its own shard, as one process of a multi-process save.
fn own_shard(tables: &[Arc<EmbeddingTable>]) -> SaveInput<'static> {
    tables
        .iter()
        .fold(SaveInput::new(), |i, t| i.table(Arc::clone(t)))
}

/// The whole worker set as one call's input.
fn worker_set(workers: &[Vec<Arc<EmbeddingTable>>]) -> SaveInput<'static> {
    let mut input = SaveInput::new();
    for (shard, tables) in workers.iter().enumerate() {
        for t in tables {
            input = input.shard_table(shard as u32, Arc::clone(t));
        }
    }
    input
}

#[test]
fn in_process_shards_saved_with_wait_never_block_each_other() {
    let root = tempfile::tempdir().unwrap();
    let rounds: usize = std::env::var("SAVER_WORKER_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let started = Instant::now();
    for round in 0..rounds {
        let n = 2 + (round % 3) as u32;
        let workers: Vec<_> = (0..n)
            .map(|s| worker(s, n, 300, round as u64, false))
            .collect();
        let dir = root.path().join(format!("r{round}"));
        let id = format!("round{round}");
        let mut o = opts(&id, n);
        o.plan.parallel = 1 + round % 3;
        // A hang shows as a wait that runs out: far longer than any round takes.
        o.wait = Some(Duration::from_secs(20));
        let reports: Vec<SaveReport> = if round % 2 == 0 {
            // Background saves, started at varied moments.
            let handles: Vec<_> = workers
                .iter()
                .enumerate()
                .map(|(s, tables)| {
                    if (round + s) % 4 == 1 {
                        std::thread::sleep(Duration::from_micros((round as u64 * 37) % 2000));
                    }
                    let mut o = o.clone();
                    o.plan.shard_index = Some(s as u32);
                    save_async(&dir, own_shard(tables), o).unwrap()
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.wait().unwrap_or_else(|e| panic!("round {round}: {e}")))
                .collect()
        } else {
            // Foreground saves, each a job of one rayon pool.
            workers
                .par_iter()
                .enumerate()
                .map(|(s, tables)| {
                    let mut o = o.clone();
                    o.plan.shard_index = Some(s as u32);
                    save(&dir, own_shard(tables), &o)
                        .unwrap_or_else(|e| panic!("round {round}: {e}"))
                })
                .collect()
        };
        assert!(reports.iter().all(|r| r.committed), "round {round}");
        assert_eq!(
            reports.iter().filter(|r| r.committed_here).count(),
            1,
            "round {round}"
        );
        assert_eq!(saver::verify(&dir, 2).unwrap().status, saver::Status::Ok);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!("{rounds} rounds in {:?}", started.elapsed());
}

/// Saves shard by shard as separate calls (some waiting, some not), then changes rows, then a
/// delta of each worker's tables: every table must find its changes tracked.
#[test]
fn every_worker_table_tracks_its_next_delta_whoever_committed() {
    let root = tempfile::tempdir().unwrap();
    for round in 0..12u32 {
        let n = 2 + round % 3;
        let workers: Vec<_> = (0..n).map(|s| worker(s, n, 2000, 1, true)).collect();
        let base = root.path().join(format!("base{round}"));
        let child = root.path().join(format!("child{round}"));
        // Some shards wait for the commit, some return as soon as they are durable, some are
        // saved in the background; the one that completes the set commits, whichever it is.
        // One after the other, only the last may wait (the others would wait for it).
        let save_shard = |dir: &Path, id: &str, parent: Option<&Path>, s: u32, last: bool| {
            let mut o = opts(id, n);
            o.plan.shard_index = Some(s);
            o.parent = parent.map(Path::to_path_buf);
            let input = own_shard(&workers[s as usize]);
            match (round + s) % 3 {
                1 if last => {
                    o.wait = Some(Duration::from_secs(30));
                    save(dir, input, &o).unwrap()
                }
                2 => save_async(dir, input, o).unwrap().wait().unwrap(),
                _ => save(dir, input, &o).unwrap(),
            }
        };
        let save_all = |dir: &Path, id: &str, parent: Option<&Path>, together: bool| {
            if !together {
                return (0..n)
                    .map(|s| save_shard(dir, id, parent, s, s + 1 == n))
                    .collect::<Vec<SaveReport>>();
            }
            std::thread::scope(|sc| {
                let hs: Vec<_> = (0..n)
                    .map(|s| {
                        let save_shard = &save_shard;
                        sc.spawn(move || save_shard(dir, id, parent, s, true))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let reports = save_all(&base, &format!("base{round}"), None, round % 2 == 1);
        // The calls that returned before the commit did not see it; a later one made it.
        let dir_committed = Path::new(&base)
            .join("model.safetensors.index.json")
            .exists();
        assert!(dir_committed, "round {round}: the base committed");
        assert_eq!(reports.iter().filter(|r| r.committed_here).count(), 1);

        for tables in &workers {
            for t in tables {
                for id in t.ids().into_iter().filter(|id| id % 7 == round as u64 % 7) {
                    write(t, id, 99);
                }
            }
        }
        let children = save_all(&child, &format!("child{round}"), Some(&base), round % 4 < 2);
        for (s, r) in children.iter().enumerate() {
            for name in NAMES {
                assert_eq!(
                    r.delta_tables[name],
                    DeltaMethod::Tracked,
                    "round {round}, shard {s}, table {name}"
                );
            }
        }
        // The tracked chain holds what a full save of the final state holds.
        let full = root.path().join(format!("full{round}"));
        save(
            &full,
            worker_set(&workers),
            &opts(&format!("full{round}"), n),
        )
        .unwrap();
        assert_eq!(digest(&child), digest(&full), "round {round}");
    }
}

#[test]
fn one_call_saves_the_worker_set_as_a_single_process_save_of_its_rows() {
    let root = tempfile::tempdir().unwrap();
    for (k, n) in [1u32, 2, 3, 5].into_iter().enumerate() {
        let workers: Vec<_> = (0..n).map(|s| worker(s, n, 5000, 3, true)).collect();
        // The same rows in one table per name.
        let whole: Vec<EmbeddingTable> = NAMES
            .iter()
            .map(|name| {
                let t = EmbeddingTable::new(*name, KeyDtype::U64, slots()).unwrap();
                for id in 0..5000 {
                    write(&t, id, 3);
                }
                t
            })
            .collect();
        let single = root.path().join(format!("single{k}"));
        let input = whole.iter().fold(SaveInput::new(), |i, t| i.table(t));
        save(&single, input, &opts(&format!("single{k}"), n)).unwrap();

        let fg = root.path().join(format!("fg{k}"));
        let r = save(&fg, worker_set(&workers), &opts(&format!("fg{k}"), n)).unwrap();
        assert!(r.committed_here);
        assert_eq!(r.shards, (0..n).collect::<Vec<_>>());
        assert_eq!(r.rows, 2 * 5000);
        let bg = root.path().join(format!("bg{k}"));
        let r = save_async(&bg, worker_set(&workers), opts(&format!("bg{k}"), n))
            .unwrap()
            .wait()
            .unwrap();
        assert!(r.committed_here);
        assert_eq!(digest(&fg), digest(&single));
        assert_eq!(digest(&bg), digest(&single));

        // The newest one-call save is every worker's baseline: its delta is tracked.
        for tables in &workers {
            write(&tables[0], tables[0].ids()[0], 77);
        }
        let delta = root.path().join(format!("delta{k}"));
        let mut o = opts(&format!("delta{k}"), n);
        o.parent = Some(bg.clone());
        let r = save(&delta, worker_set(&workers), &o).unwrap();
        assert_eq!(r.delta_tables["items"], DeltaMethod::Tracked);
        assert_eq!(r.delta_tables["users"], DeltaMethod::Tracked);
        assert_eq!(r.rows, u64::from(n), "one changed row per worker");
    }
}

#[test]
fn a_worker_set_that_is_not_whole_is_refused_naming_what_is_missing() {
    let root = tempfile::tempdir().unwrap();
    let workers: Vec<_> = (0..3).map(|s| worker(s, 3, 100, 1, false)).collect();
    // Shard 2's worker forgot its "users" table.
    let input = SaveInput::new()
        .shard_table(0, Arc::clone(&workers[0][0]))
        .shard_table(0, Arc::clone(&workers[0][1]))
        .shard_table(1, Arc::clone(&workers[1][0]))
        .shard_table(1, Arc::clone(&workers[1][1]))
        .shard_table(2, Arc::clone(&workers[2][0]));
    let err = save(root.path().join("a"), input, &opts("a", 3)).unwrap_err();
    assert!(
        err.to_string().contains("\"users\"") && err.to_string().contains("[2]"),
        "{err}"
    );
    // A worker's table holding another shard's rows: refused by default, naming the table.
    write(
        &workers[1][0],
        (0..)
            .find(|&id| PartitionRule::shard_of(id, 3) == 0)
            .unwrap(),
        5,
    );
    let err = save(root.path().join("b"), worker_set(&workers), &opts("b", 3)).unwrap_err();
    assert!(err.to_string().contains("items"), "{err}");
    assert!(!root.path().join("b/model.safetensors.index.json").exists());
    // A borrowed table cannot go to a background save.
    let t = EmbeddingTable::new("t", KeyDtype::U64, slots()).unwrap();
    let err = save_async(
        root.path().join("c"),
        SaveInput::new().table(&t),
        opts("c", 1),
    )
    .unwrap_err();
    assert!(err.to_string().contains("Arc"), "{err}");
}

#[test]
fn a_restart_without_change_tracking_says_why_its_first_delta_is_compared() {
    let root = tempfile::tempdir().unwrap();
    let workers = vec![worker(0, 1, 500, 1, true)];
    let base = root.path().join("base");
    save(&base, worker_set(&workers), &opts("base", 1)).unwrap();
    let ck = saver::Checkpoint::open(&base).unwrap();
    let restored = ck.restore(&LoadOptions::default()).unwrap();
    let tables = &restored.shards[0].tables;
    let mut o = opts("delta", 1);
    o.parent = Some(base.clone());
    let input = tables.iter().fold(SaveInput::new(), |i, t| i.table(t));
    let r = save(root.path().join("delta"), input, &o).unwrap();
    match &r.delta_tables["items"] {
        DeltaMethod::Compared { why } => {
            assert!(why.contains("LoadOptions::change_tracking"), "{why}")
        }
        m => panic!("{m:?}"),
    }
    // Restored with tracking, the first delta is tracked.
    let restored = ck
        .restore(&{
            LoadOptions {
                change_tracking: true,
                ..Default::default()
            }
        })
        .unwrap();
    let input = restored.shards[0]
        .tables
        .iter()
        .fold(SaveInput::new(), |i, t| i.table(t));
    let mut o = opts("delta2", 1);
    o.parent = Some(base);
    let r = save(root.path().join("delta2"), input, &o).unwrap();
    assert_eq!(r.delta_tables["items"], DeltaMethod::Tracked);
}

#[test]
fn the_report_gives_this_saves_copy_on_write_peak_and_progress_its_total() {
    use std::sync::Mutex;
    let root = tempfile::tempdir().unwrap();
    let tables = worker(0, 1, 20_000, 1, false);
    let seen: Arc<Mutex<Vec<saver::Progress>>> = Arc::default();
    let save_with = |dir: &str, writes: u64| {
        let mut o = opts(dir, 1);
        let t = Arc::clone(&tables[0]);
        // Between the moment and the first row read: each write keeps one pre-image.
        o.plan.on_moment = Some(saver::core::table::moment::MomentHook(Arc::new(
            move || {
                for id in 0..writes {
                    write(&t, id, 5);
                }
            },
        )));
        let log = Arc::clone(&seen);
        o.progress = Some(Arc::new(move |p| log.lock().unwrap().push(p)));
        let input = tables
            .iter()
            .fold(SaveInput::new(), |i, t| i.table(Arc::clone(t)));
        save_async(root.path().join(dir), input, o)
            .unwrap()
            .wait()
            .unwrap()
    };
    let r = save_with("a", 500);
    // 500 rows of 4 f32 and an i64: at least 24 bytes each were kept at once.
    assert!(
        r.copy_on_write_peak_bytes >= 500 * 24,
        "{}",
        r.copy_on_write_peak_bytes
    );
    let progress = std::mem::take(&mut *seen.lock().unwrap());
    let total = progress[0].total;
    assert!(total > 0 && total <= r.bytes_written);
    assert!(progress
        .iter()
        .all(|p| p.total == total && p.written <= total));
    assert_eq!(progress.iter().map(|p| p.bytes).sum::<u64>(), total);
    assert_eq!(progress.iter().map(|p| p.written).max(), Some(total));
    // The peak is this save's: one during which nothing is written kept nothing.
    let r = save_with("b", 0);
    assert_eq!(r.copy_on_write_peak_bytes, 0);
}

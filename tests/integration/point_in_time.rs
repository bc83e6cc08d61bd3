//! A save while training is one moment: trainer threads upsert, insert and remove rows of
//! `EmbeddingTable`s as fast as they can, every write carrying a global version and logged with
//! the times it started and ended; after each save, one moment T must explain every saved row of
//! every table (its version written before T and not overwritten before T), every row alive at T
//! must be saved, and no row may be torn.
//!
//! `SAVER_PIT_SAVES=N` raises the number of saves per scenario (default 4).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use saver::core::partition::fmix64;
use saver::core::table::moment;
use saver::core::table::TableSemantics;
use saver::{
    save, save_async, Checkpoint, Dtype, EmbeddingTable, ForeignRows, KeyDtype, LoadOptions,
    SaveInput, SaveOptions, SlotSpec, SparseTable,
};

const IDS: u64 = 6000;
const TRAINERS: u64 = 3;

fn saves() -> usize {
    std::env::var("SAVER_PIT_SAVES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

fn check_word(id: u64, version: u64) -> u64 {
    fmix64(id ^ version.rotate_left(17))
}

fn table(name: &str) -> EmbeddingTable {
    let t = EmbeddingTable::new(
        name,
        KeyDtype::U64,
        vec![
            SlotSpec::new("version", Dtype::U64, vec![]),
            SlotSpec::new("check", Dtype::U64, vec![]),
            SlotSpec::new("embedding", Dtype::F32, vec![8]),
        ],
    )
    .unwrap();
    for id in 0..IDS {
        t.upsert(id, |r| r.slot_mut::<u64>(1)[0] = check_word(id, 0));
    }
    t
}

/// One write of one row: the version it wrote (0: a removal), and when it started and ended, in
/// nanoseconds since the test began.
#[derive(Clone, Copy, Debug)]
struct Op {
    version: u64,
    start: u64,
    end: u64,
}

/// Every write of every row of every table, in order per row.
type Log = HashMap<(usize, u64), Vec<Op>>;

/// Trains: each thread owns the ids `id % TRAINERS == thread` of every table, so writes of one
/// row are in program order, and stamps every write with a global version.
fn train(tables: &[&EmbeddingTable], stop: &AtomicBool, begin: Instant) -> Log {
    let clock = AtomicU64::new(1);
    let now = || begin.elapsed().as_nanos() as u64;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..TRAINERS)
            .map(|thread| {
                let clock = &clock;
                s.spawn(move || {
                    let mut log: Log = HashMap::new();
                    let mut rng = fmix64(thread + 1);
                    while !stop.load(Ordering::Relaxed) {
                        rng = fmix64(rng);
                        let t = (rng % tables.len() as u64) as usize;
                        let id = (rng >> 8) % (IDS / TRAINERS) * TRAINERS + thread;
                        let table = tables[t];
                        let version = clock.fetch_add(1, Ordering::SeqCst);
                        let start = now();
                        let written = match (rng >> 40) % 20 {
                            0 | 1 => {
                                table.remove(id);
                                0
                            }
                            2 => {
                                let mut emb = [0u8; 32];
                                emb[..8].copy_from_slice(&version.to_le_bytes());
                                let row = [
                                    &version.to_le_bytes()[..],
                                    &check_word(id, version).to_le_bytes()[..],
                                    &emb[..],
                                ];
                                table.insert(id, &row).unwrap();
                                version
                            }
                            _ => table.upsert(id, |r| {
                                r.slot_mut::<u64>(0)[0] = version;
                                r.slot_mut::<u64>(1)[0] = check_word(id, version);
                                r.slot_mut::<f32>(2).fill(version as f32);
                                version
                            }),
                        };
                        let end = now();
                        log.entry((t, id)).or_default().push(Op {
                            version: written,
                            start,
                            end,
                        });
                    }
                    log
                })
            })
            .collect();
        let mut all = Log::new();
        for h in handles {
            all.extend(h.join().unwrap());
        }
        all
    })
}

/// Each table's saved rows: id -> version, checking no row is torn or another id's.
fn saved_rows(dir: &Path, names: &[&str]) -> Vec<HashMap<u64, u64>> {
    // A delta's rows are those of its whole chain.
    let restored = Checkpoint::open(dir)
        .unwrap()
        .restore(&LoadOptions::default())
        .unwrap();
    names
        .iter()
        .map(|name| {
            let mut rows = HashMap::new();
            for shard in &restored.shards {
                for t in shard
                    .tables
                    .iter()
                    .filter(|t| SparseTable::name(*t) == *name)
                {
                    for id in t.ids() {
                        let word =
                            |s| u64::from_le_bytes(t.get_slot(id, s).unwrap().try_into().unwrap());
                        let (version, check) = (word(0), word(1));
                        assert_eq!(check, check_word(id, version), "{name} id {id}: a torn row");
                        rows.insert(id, version);
                    }
                }
            }
            rows
        })
        .collect()
}

/// Finds the moment that explains `saved` given the write log, within `[from, to]` (when the
/// save was called and returned, in the log's nanoseconds): every saved version was written
/// (started) before T and the row's next write had not ended before T; every row not saved was
/// absent at T. Returns (earliest, latest) bound of T, or what contradicts a single moment.
fn find_moment(
    saved: &[HashMap<u64, u64>],
    log: &Log,
    from: u64,
    to: u64,
) -> Result<(u64, u64), String> {
    let (mut lo, mut hi) = (from, to);
    // The interval of T in which each row is in each of its states: state k is after write k
    // (k = 0: the initial row), from write k's start to write k + 1's end.
    let empty = Vec::new();
    let mut absent: Vec<Vec<(u64, u64)>> = Vec::new();
    for (t, rows) in saved.iter().enumerate() {
        for id in 0..IDS {
            let ops = log.get(&(t, id)).unwrap_or(&empty);
            let window = |k: usize| {
                let start = if k == 0 { 0 } else { ops[k - 1].start };
                let end = ops.get(k).map_or(u64::MAX, |o| o.end);
                (start, end)
            };
            let version_after = |k: usize| {
                if k == 0 {
                    Some(0)
                } else {
                    Some(ops[k - 1].version).filter(|&v| v != 0)
                }
            };
            match rows.get(&id) {
                Some(&v) => {
                    let k = (0..=ops.len())
                        .find(|&k| version_after(k) == Some(v))
                        .ok_or_else(|| {
                            format!("table {t} id {id}: saved version {v} was never written")
                        })?;
                    let (s, e) = window(k);
                    lo = lo.max(s);
                    hi = hi.min(e);
                    if lo >= hi {
                        return Err(format!(
                            "table {t} id {id}: saved version {v} (held from {s} to {e} ns) leaves no moment in [{lo}, {hi})"
                        ));
                    }
                }
                None => absent.push(
                    (0..=ops.len())
                        .filter(|&k| version_after(k).is_none())
                        .map(window)
                        .collect(),
                ),
            }
        }
    }
    for windows in absent {
        if !windows.iter().any(|&(s, e)| s.max(lo) < e.min(hi)) {
            return Err(format!("a row alive throughout [{lo}, {hi}) was not saved"));
        }
    }
    Ok((lo, hi))
}

fn opts(id: &str) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some(id.into()),
            durable: false,
            ..Default::default()
        }
    };
    o.plan.shard_num = 2;
    o.plan.parallel = 1;
    o.plan.chunk_bytes = 16 << 10;
    o
}

/// Runs trainers on `names` tables while `saving` saves `saves()` times; checks every save.
fn scenario(names: &[&str], saving: impl Fn(&[Arc<EmbeddingTable>], &Path, usize)) {
    let tables: Vec<Arc<EmbeddingTable>> = names.iter().map(|n| Arc::new(table(n))).collect();
    let refs: Vec<&EmbeddingTable> = tables.iter().map(|t| t.as_ref()).collect();
    let root = tempfile::tempdir().unwrap();
    let stop = AtomicBool::new(false);
    let begin = Instant::now();
    let (log, windows) = std::thread::scope(|s| {
        let trainers = s.spawn(|| train(&refs, &stop, begin));
        let mut windows = Vec::new();
        for k in 0..saves() {
            std::thread::sleep(Duration::from_millis(20));
            // T must fall while the save call runs.
            let from = begin.elapsed().as_nanos() as u64;
            saving(&tables, &root.path().join(format!("s{k}")), k);
            windows.push((from, begin.elapsed().as_nanos() as u64));
        }
        stop.store(true, Ordering::Relaxed);
        (trainers.join().unwrap(), windows)
    });
    let writes: usize = log.values().map(Vec::len).sum();
    for (k, &(from, to)) in windows.iter().enumerate() {
        // The trainers wrote while the save ran: otherwise a single moment proves nothing.
        let during = log
            .values()
            .flatten()
            .filter(|op| op.start < to && op.end > from)
            .count();
        assert!(during > 0, "save {k}: no write overlapped the save");
        let saved = saved_rows(&root.path().join(format!("s{k}")), names);
        let rows: usize = saved.iter().map(HashMap::len).sum();
        match find_moment(&saved, &log, from, to) {
            Ok((lo, hi)) => {
                println!("save {k}: {rows} rows explained by one moment in [{lo}, {hi}) ns")
            }
            Err(e) => panic!("save {k} is not one moment: {e}"),
        }
        for t in &tables {
            assert_eq!(t.point_in_time_bytes().0, 0, "pre-images outlived the save");
        }
    }
    println!("{writes} writes during {} saves", saves());
}

fn input(tables: &[Arc<EmbeddingTable>]) -> SaveInput<'_> {
    let mut input = SaveInput::new();
    for t in tables {
        input = input.table(t.as_ref());
    }
    input
}

#[test]
fn a_save_of_one_table_while_training_is_one_moment() {
    scenario(&["items"], |tables, dir, k| {
        let r = save(dir, input(tables), &opts(&format!("one{k}"))).unwrap();
        assert_eq!(r.table_semantics["items"], TableSemantics::PointInTime);
    });
}

#[test]
fn a_save_of_several_tables_while_training_is_one_moment_for_all() {
    scenario(&["users", "items", "cross"], |tables, dir, k| {
        let mut o = opts(&format!("many{k}"));
        // Every other save spills its plan, so rows are read long after the scan.
        if k % 2 == 1 {
            o.plan.plan_memory = 0;
        }
        save(dir, input(tables), &o).unwrap();
    });
}

/// Deltas of several tables saved while training, each over the previous save; the tables keep
/// no record of their changes, so each delta compares every table with its parent: the chain
/// each delta ends is one moment for all the tables.
#[test]
fn a_delta_of_several_tables_while_training_is_one_moment_for_all() {
    scenario(&["users", "items", "cross"], |tables, dir, k| {
        let mut o = opts(&format!("delta{k}"));
        if k > 0 {
            o.parent = Some(dir.with_file_name(format!("s{}", k - 1)));
        }
        save(dir, input(tables), &o).unwrap();
    });
}

#[test]
fn workers_saving_their_shards_of_shared_tables_share_one_moment() {
    scenario(&["users", "items"], |tables, dir, k| {
        // The step to save: one moment for both workers, fixed before either starts.
        let all = input(tables);
        let held = moment::hold(all.all_tables()).unwrap();
        std::thread::scope(|s| {
            for shard in 0..2 {
                s.spawn(move || {
                    let mut o = opts(&format!("workers{k}"));
                    o.plan.shard_index = Some(shard);
                    o.plan.foreign_rows = ForeignRows::Skip;
                    o.wait = Some(Duration::from_secs(30));
                    save(dir, input(tables), &o).unwrap();
                });
            }
        });
        drop(held);
    });
}

#[test]
fn one_call_saves_every_workers_shard_at_one_moment() {
    scenario(&["users", "items"], |tables, dir, k| {
        // Each worker gives its table for its shard (here both workers share the tables, so each
        // skips the other's rows); one call, foreground or background, saves both shards.
        let mut o = opts(&format!("set{k}"));
        o.plan.foreign_rows = ForeignRows::Skip;
        let mut workers = SaveInput::new();
        for shard in 0..2 {
            for t in tables {
                workers = workers.shard_table(shard, Arc::clone(t));
            }
        }
        let r = if k % 2 == 0 {
            save(dir, workers, &o).unwrap()
        } else {
            save_async(dir, workers, o).unwrap().wait().unwrap()
        };
        assert!(r.committed_here);
        assert_eq!(r.shards, vec![0, 1]);
        assert_eq!(r.table_semantics["users"], TableSemantics::PointInTime);
    });
}

#[test]
fn a_background_save_returns_at_its_moment_and_saves_that_moment() {
    let blocked = std::sync::Mutex::new(Vec::new());
    scenario(&["items", "users"], |tables, dir, k| {
        // Shared with the background save; the trainers keep writing to them.
        let weights: Vec<f32> = (0..64).map(|i| (i + k) as f32).collect();
        let mut input = SaveInput::new()
            .dense(saver::DenseTensor::from_f32("mlp.w", vec![64], &weights).unwrap());
        for t in tables {
            input = input.table(Arc::clone(t));
        }
        let started = Instant::now();
        let h = save_async(dir, input, opts(&format!("bg{k}"))).unwrap();
        blocked.lock().unwrap().push(started.elapsed());
        let r = h.wait().unwrap();
        assert!(r.committed_here);
        let ck = Checkpoint::open(dir).unwrap();
        assert_eq!(ck.read_dense("mlp.w").unwrap(), bytemuck_f32(&weights));
    });
    let blocked = blocked.into_inner().unwrap();
    println!("blocked in save_async: {blocked:?}");
    assert!(
        blocked.iter().all(|b| *b < Duration::from_secs(2)),
        "{blocked:?}"
    );
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A trainer's own table: a `RwLock<HashMap>` of rows. Its snapshot copies the rows under the read
/// lock into a `ColumnTable` that the snapshot owns: point-in-time, and rows removed during the
/// save cannot fail it.
struct MyTable {
    schema: saver::core::TableSchema,
    rows: std::sync::RwLock<HashMap<u64, [u64; 2]>>,
}

impl SparseTable for MyTable {
    fn schema(&self) -> &saver::core::TableSchema {
        &self.schema
    }
    fn len(&self) -> usize {
        self.rows.read().unwrap().len()
    }
    fn snapshot(&self) -> saver::core::Result<Box<dyn saver::core::TableSnapshot + '_>> {
        let rows = self.rows.read().unwrap();
        let mut ids = Vec::with_capacity(rows.len());
        let (mut version, mut check) = (Vec::new(), Vec::new());
        for (&id, row) in rows.iter() {
            ids.push(id);
            version.extend_from_slice(&row[0].to_le_bytes());
            check.extend_from_slice(&row[1].to_le_bytes());
        }
        drop(rows);
        let copy = saver::core::ColumnTable::new(
            "mine",
            KeyDtype::U64,
            self.schema.slots.clone(),
            ids,
            vec![version, check],
        )?;
        Ok(copy.into_snapshot())
    }
    fn point_in_time(&self) -> bool {
        true
    }
}

#[test]
fn a_custom_table_that_copies_its_rows_is_point_in_time_and_survives_removals() {
    let t = MyTable {
        schema: saver::core::TableSchema::new(
            "mine",
            KeyDtype::U64,
            vec![
                SlotSpec::new("version", Dtype::U64, vec![]),
                SlotSpec::new("check", Dtype::U64, vec![]),
            ],
        ),
        rows: std::sync::RwLock::new((0..IDS).map(|id| (id, [0, check_word(id, 0)])).collect()),
    };
    let root = tempfile::tempdir().unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut v = 1u64;
            while !stop.load(Ordering::Relaxed) {
                v += 1;
                let id = fmix64(v) % IDS;
                let mut rows = t.rows.write().unwrap();
                if v.is_multiple_of(3) {
                    rows.remove(&id);
                } else {
                    rows.insert(id, [v, check_word(id, v)]);
                }
            }
        });
        for k in 0..saves() {
            let dir = root.path().join(format!("mine{k}"));
            let r = save(&dir, SaveInput::new().table(&t), &opts(&format!("mine{k}"))).unwrap();
            assert_eq!(r.table_semantics["mine"], TableSemantics::PointInTime);
            let ck = Checkpoint::open(&dir).unwrap();
            let restored = ck.restore(&LoadOptions::default()).unwrap();
            let rows = &restored.shards[0].tables[0];
            assert!(!rows.is_empty());
            for id in rows.ids() {
                let word =
                    |s| u64::from_le_bytes(rows.get_slot(id, s).unwrap().try_into().unwrap());
                assert_eq!(word(1), check_word(id, word(0)), "id {id}: a torn row");
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// `save_async(step k)`, hot rows written, `save_async(step k + 1)` while the first still runs:
/// the second either fails, naming the table and why, or holds the rows as they were at its own
/// call. It never holds the first save's moment under its own step.
#[test]
fn an_overlapping_background_save_never_holds_an_earlier_moment_under_its_step() {
    const ROWS: u64 = 100_000;
    const HOT: u64 = 2_000;
    let t = Arc::new(table("items"));
    for id in 0..ROWS {
        t.upsert(id, |r| r.slot_mut::<u64>(0)[0] = 0);
    }
    let root = tempfile::tempdir().unwrap();
    // Both cores busy, as under training: the first save takes longer.
    let stop = AtomicBool::new(false);
    let (mut refused, mut overlapped) = (0, 0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(fmix64(std::hint::black_box(7)));
            }
        });
        let hot = |v: u64| {
            for id in 0..HOT {
                t.upsert(id * 37 % ROWS, |r| r.slot_mut::<u64>(0)[0] = v);
            }
        };
        let check = |dir: &Path, step: u64| {
            let ck = Checkpoint::open(dir).unwrap();
            assert_eq!(ck.manifest().step, Some(step), "{}", dir.display());
            let restored = ck.restore(&LoadOptions::default()).unwrap();
            let items = restored.table("items").unwrap();
            for id in 0..HOT {
                let got = u64::from_le_bytes(
                    items
                        .get_slot(id * 37 % ROWS, 0)
                        .unwrap()
                        .try_into()
                        .unwrap(),
                );
                assert_eq!(
                    got,
                    step,
                    "{}: hot row {id} of another moment",
                    dir.display()
                );
            }
        };
        for k in 0..8u64 {
            let step = |k: u64| 10 * k + 1;
            let opts = |step: u64| {
                let o = SaveOptions {
                    save_id: Some(format!("s{step}")),
                    step: Some(step),
                    durable: false,
                    ..Default::default()
                };
                o
            };
            hot(step(k));
            let a = root.path().join(format!("a{k}"));
            let first =
                save_async(&a, SaveInput::new().table(Arc::clone(&t)), opts(step(k))).unwrap();
            hot(step(k) + 1);
            let b = root.path().join(format!("b{k}"));
            let running = !first.is_finished();
            match save_async(
                &b,
                SaveInput::new().table(Arc::clone(&t)),
                opts(step(k) + 1),
            ) {
                Ok(second) => {
                    overlapped += usize::from(running);
                    second.wait().unwrap();
                    check(&b, step(k) + 1);
                }
                Err(e) => {
                    refused += 1;
                    let e = e.to_string();
                    assert!(
                        e.contains("\"items\"") && e.contains("moment has passed"),
                        "{e}"
                    );
                    assert!(!b.join("model.safetensors.index.json").exists());
                }
            }
            first.wait().unwrap();
            check(&a, step(k));
        }
        stop.store(true, Ordering::Relaxed);
    });
    println!("{refused} refused, {overlapped} ran alongside");
    assert!(
        refused + overlapped > 0,
        "no second save started while the first ran"
    );
}

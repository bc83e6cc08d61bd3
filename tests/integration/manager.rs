//! The checkpoint manager: a training job's checkpoints in one root. Each test is one of the
//! failures users of other checkpointing tools report most (retention that deletes the last good
//! checkpoint, a partial save taken as latest, retention surprises, silent background failures),
//! written so that it would have caught it; then restarts with another policy and worker count,
//! retention racing saves, and removals killed at every storage operation.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use saver::io::manage::{KeepBest, Retention, Started, WhenBusy};
use saver::{
    CheckpointManager, Dtype, EmbeddingTable, KeyDtype, LoadOptions, Policy, SaveInput,
    SaveOptions, SlotSpec, SparseTable,
};

/// The rows a job holds: id → one f32 value and a step stamp.
type State = BTreeMap<u64, (f32, u64)>;

fn slots() -> Vec<SlotSpec> {
    vec![
        SlotSpec::new("embedding", Dtype::F32, vec![1]),
        SlotSpec::new("stamp", Dtype::U64, vec![]),
    ]
}

/// A table of the job's rows that tracks its changes (its deltas are tracked).
fn tracked_table() -> EmbeddingTable {
    EmbeddingTable::new("emb", KeyDtype::U64, slots())
        .unwrap()
        .with_change_tracking()
        .unwrap()
}

fn write(table: &EmbeddingTable, id: u64, row: (f32, u64)) {
    table
        .insert(id, &[&row.0.to_le_bytes()[..], &row.1.to_le_bytes()[..]])
        .unwrap();
}

/// One training step: rows `step*7 .. step*7+40` (mod 300) written, one row removed.
fn train(table: &EmbeddingTable, state: &mut State, step: u64) {
    for k in 0..40 {
        let id = (step * 7 + k) % 300;
        let row = (step as f32 + k as f32 / 100.0, step);
        write(table, id, row);
        state.insert(id, row);
    }
    let gone = (step * 13) % 300;
    if table.remove(gone) {
        state.remove(&gone);
    }
}

fn opts() -> SaveOptions {
    {
        SaveOptions {
            durable: false,
            ..Default::default()
        }
    }
}

fn policy(full_every: u32, keep_latest: usize) -> Policy {
    let mut p = Policy {
        full_every,
        max_chain_links: full_every as usize,
        ..Default::default()
    };
    // The test's deltas are large beside their small bases; the cadence is what is tested.
    p.max_delta_fraction = 100.0;
    p.retention.keep_latest = keep_latest;
    p
}

/// The rows of `dir`'s checkpoint, restored with `shards` target shards.
fn restored_state(dir: &Path, shards: u32) -> State {
    let r = saver::Checkpoint::open(dir)
        .unwrap()
        .restore(&{
            LoadOptions {
                shard_num: shards,
                ..Default::default()
            }
        })
        .unwrap();
    let mut state = State::new();
    for s in &r.shards {
        let t = s.table("emb").unwrap();
        for id in t.ids() {
            let e = t.get_slot(id, 0).unwrap();
            let st = t.get_slot(id, 1).unwrap();
            state.insert(
                id,
                (
                    f32::from_le_bytes(e.try_into().unwrap()),
                    u64::from_le_bytes(st.try_into().unwrap()),
                ),
            );
        }
    }
    state
}

fn step_dirs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.file_type()
                .unwrap()
                .is_dir()
                .then(|| e.file_name().into_string().unwrap())
        })
        .collect();
    v.sort();
    v
}

/// Saves every step, deltas between full saves (tracked: the table keeps its changes), keeps the
/// newest two and every link they need; every listed step restores to the state it saved, and
/// a restart with another worker count restores the newest.
#[test]
fn a_job_saves_deltas_keeps_the_latest_and_restarts_from_the_newest() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(3, 2)).unwrap();
    let table = tracked_table();
    let mut state = State::new();
    let mut saved: BTreeMap<u64, State> = BTreeMap::new();
    for step in 1..=10u64 {
        train(&table, &mut state, step);
        let done = m
            .save(step * 100, SaveInput::new().table(&table), &opts())
            .unwrap();
        saved.insert(step * 100, state.clone());
        let full = (step - 1) % 3 == 0;
        assert_eq!(done.save.delta_tables.is_empty(), full, "step {step}");
        if !full {
            assert!(
                matches!(done.save.delta_tables["emb"], saver::DeltaMethod::Tracked),
                "{:?}",
                done.save.delta_tables
            );
        }
        let steps = m.steps().unwrap();
        assert_eq!(m.latest().unwrap().unwrap().step, step * 100);
        // The newest two, and every link of their chains: nothing else.
        let listed: Vec<u64> = steps.iter().map(|s| s.step).collect();
        let mut want: Vec<u64> = Vec::new();
        for s in steps.iter().rev().take(2) {
            let mut at = Some(s.step);
            while let Some(x) = at {
                want.push(x);
                at = steps.iter().find(|i| i.step == x).unwrap().parent;
            }
        }
        want.sort();
        want.dedup();
        assert_eq!(listed, want, "step {step}");
        assert!(steps.iter().all(|s| s.links <= 3));
        for s in &steps {
            assert_eq!(
                restored_state(&s.path, 1),
                saved[&s.step],
                "step {}",
                s.step
            );
        }
        // Removed steps leave no directory behind.
        assert_eq!(step_dirs(root.path()).len(), listed.len());
    }
    drop(m);
    // A restart: another policy, and three workers instead of one.
    let again = CheckpointManager::open(root.path(), policy(1, 1)).unwrap();
    let (step, r) = again
        .restore_latest(&{
            LoadOptions {
                shard_num: 3,
                ..Default::default()
            }
        })
        .unwrap()
        .unwrap();
    assert_eq!(step, 1000);
    assert_eq!(r.shards.len(), 3);
    assert_eq!(
        restored_state(&again.latest().unwrap().unwrap().path, 3),
        state
    );
    // The next save, under the new policy (full every save, keep 1), replaces the whole chain.
    train(&table, &mut state, 11);
    let done = again
        .save(1100, SaveInput::new().table(&table), &opts())
        .unwrap();
    assert!(done.save.delta_tables.is_empty());
    let steps = again.steps().unwrap();
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1100]);
    assert_eq!(restored_state(&steps[0].path, 2), state);
    // An explicit step that is not there is an error, never a fresh start.
    let err = again.open_step(700).unwrap_err().to_string();
    assert!(err.contains("step 700") && err.contains("1100"), "{err}");
}

/// A table whose snapshot is taken at the save's moment and whose scan, later, fails or waits
/// for a gate: a background save that fails, or that is still running, after its moment.
struct Troubled {
    inner: EmbeddingTable,
    fail: bool,
    gate: Mutex<Option<mpsc::Receiver<()>>>,
}

struct TroubledSnapshot<'a> {
    inner: Box<dyn saver::core::TableSnapshot + 'a>,
    table: &'a Troubled,
}

impl SparseTable for Troubled {
    fn schema(&self) -> &saver::core::TableSchema {
        self.inner.schema()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn snapshot(&self) -> saver::core::Result<Box<dyn saver::core::TableSnapshot + '_>> {
        Ok(Box::new(TroubledSnapshot {
            inner: self.inner.snapshot()?,
            table: self,
        }))
    }
}

impl saver::core::TableSnapshot for TroubledSnapshot<'_> {
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(saver::core::table::RowChunk<'_>) -> saver::core::Result<()>,
    ) -> saver::core::Result<()> {
        if let Some(gate) = self.table.gate.lock().unwrap().take() {
            let _ = gate.recv();
        }
        if self.table.fail {
            return Err(saver::core::Error::Table {
                table: "emb".into(),
                message: "the feature store went away".into(),
            });
        }
        self.inner.scan(max_rows, with_values, visit)
    }
    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> saver::core::Result<()> {
        self.inner.read_rows(ids, out)
    }
    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> saver::core::Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.read_rows_by_handle(ids, handles, out) }
    }
}

fn troubled(fail: bool, gate: Option<mpsc::Receiver<()>>) -> Arc<Troubled> {
    let inner = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    for id in 0..100 {
        write(&inner, id, (id as f32, 2));
    }
    Arc::new(Troubled {
        inner,
        fail,
        gate: Mutex::new(gate),
    })
}

/// Complaints 1, 2 and 4: with `keep 1`, a background save still running or one that failed
/// never costs the only whole checkpoint, is never the latest, and a failure is reported when it
/// happens, not at the next save.
#[test]
fn keep_one_never_loses_the_only_whole_checkpoint_to_a_save_in_flight_or_failed() {
    let root = tempfile::tempdir().unwrap();
    let (tx, rx) = mpsc::channel();
    let m = CheckpointManager::open(root.path(), policy(1, 1))
        .unwrap()
        .on_failure(move |step, e| tx.send((step, e.to_string())).unwrap());
    let good = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    write(&good, 1, (1.0, 1));
    m.save(1, SaveInput::new().table(&good), &opts()).unwrap();

    // In flight: its moment is fixed, it is not committed.
    let (open, gate) = mpsc::channel();
    let slow = troubled(false, Some(gate));
    let started = m
        .save_async(2, SaveInput::new().table(slow.clone()), &opts())
        .unwrap();
    assert!(matches!(started, Started::Saving { step: 2 }));
    assert_eq!(
        m.latest().unwrap().unwrap().step,
        1,
        "a save in flight is not the latest"
    );
    let pruned = m.prune(None, false).unwrap();
    assert!(pruned.removed.is_empty(), "{pruned:?}");
    assert_eq!(m.steps().unwrap().len(), 1);
    drop(open);
    let done = m.wait().unwrap().unwrap();
    assert_eq!(done.step, 2);
    // Its commit made step 1 unnecessary: removed after it, not before.
    assert_eq!(done.pruned.unwrap().removed, vec![1]);
    assert_eq!(m.latest().unwrap().unwrap().step, 2);

    // A save that fails after its moment: reported at once, and step 2 stays.
    let bad = troubled(true, None);
    m.save_async(3, SaveInput::new().table(bad), &opts())
        .unwrap();
    let (step, why) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!(step, 3);
    assert!(why.contains("feature store"), "{why}");
    let err = m.wait().unwrap_err().to_string();
    assert!(err.contains("feature store"), "{err}");
    assert_eq!(m.latest().unwrap().unwrap().step, 2);
    assert_eq!(
        restored_state(&m.latest().unwrap().unwrap().path, 1).len(),
        100
    );
    // The failed save left no committed step and nothing that lists.
    assert_eq!(m.steps().unwrap().len(), 1);
}

/// A background delta returns at its moment, whatever finds its changes: a table compared with
/// the parent (one that keeps no record of its changes, or a save with a row filter) is compared
/// on the save's threads, after the call returned. Here the table's rows cannot be read until the
/// test lets them (a gate), so a call that compared first would never return.
#[test]
fn a_compared_background_delta_returns_at_its_moment() {
    let root = tempfile::tempdir().unwrap();
    let m = Arc::new(CheckpointManager::open(root.path(), policy(8, 8)).unwrap());
    let base = troubled(false, None);
    m.save(1, SaveInput::new().table(base.clone()), &opts())
        .unwrap();
    for (step, filtered) in [(2u64, false), (3, true)] {
        let (open, gate) = mpsc::channel();
        let slow = troubled(false, Some(gate));
        write(&slow.inner, 500 + step, (step as f32, step));
        let mut o = opts();
        if filtered {
            o.plan.filters = saver::core::Filters::new().keep_rows(|_| true);
        }
        let (returned, rx) = mpsc::channel();
        let caller = {
            let (m, slow) = (Arc::clone(&m), slow.clone());
            std::thread::spawn(move || {
                let started = m.save_async(step, SaveInput::new().table(slow), &o);
                returned.send(started.map(|_| ())).unwrap();
            })
        };
        rx.recv_timeout(Duration::from_secs(60))
            .expect("save_async returns while the rows cannot be read yet")
            .unwrap();
        caller.join().unwrap();
        drop(open);
        let done = m.wait().unwrap().unwrap();
        assert_eq!(done.full_because, None, "step {step} is a delta");
        assert!(
            matches!(
                done.save.delta_tables.get("emb"),
                Some(saver::DeltaMethod::Compared { .. })
            ),
            "{:?}",
            done.save.delta_tables
        );
        let state = restored_state(&done.path, 1);
        assert_eq!(state.len(), 101, "step {step}");
        assert_eq!(state[&(500 + step)], (step as f32, step));
    }
}

/// With `WhenBusy::Skip`, a step that comes while a save runs is skipped, never queued behind it.
#[test]
fn a_busy_manager_skips_when_told_to() {
    let root = tempfile::tempdir().unwrap();
    let mut p = policy(1, 3);
    p.when_busy = WhenBusy::Skip;
    let m = CheckpointManager::open(root.path(), p).unwrap();
    let (open, gate) = mpsc::channel();
    let slow = troubled(false, Some(gate));
    m.save_async(1, SaveInput::new().table(slow.clone()), &opts())
        .unwrap();
    let skipped = m
        .save_async(2, SaveInput::new().table(troubled(false, None)), &opts())
        .unwrap();
    assert!(matches!(
        skipped,
        Started::Skipped {
            step: 2,
            running: 1
        }
    ));
    drop(open);
    m.wait().unwrap();
    assert_eq!(
        m.steps()
            .unwrap()
            .iter()
            .map(|s| s.step)
            .collect::<Vec<_>>(),
        vec![1]
    );
}

/// Complaint 2: a crashed save's directory (files, no index) is never the latest, and is
/// reclaimed only once its writer is provably gone; a live writer's files are left alone.
#[test]
fn a_crashed_save_is_never_the_latest_and_is_reclaimed_once_its_writer_is_gone() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(1, 5)).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    write(&t, 1, (1.0, 1));
    m.save(10, SaveInput::new().table(&t), &opts()).unwrap();
    // A save of step 20 that wrote its files and never committed: the index removed after the
    // fact stands for a process killed before its commit (its writer, this process, lives).
    m.save(20, SaveInput::new().table(&t), &opts()).unwrap();
    let s20 = root.path().join(saver::io::manage::root::step_dir_name(20));
    std::fs::remove_file(s20.join("model.safetensors.index.json")).unwrap();
    assert_eq!(m.latest().unwrap().unwrap().step, 10);
    let listing = m.root().list().unwrap();
    assert_eq!(listing.uncommitted, vec![20]);
    // Its writer (this process) is alive: left alone.
    let c = m.clean(false).unwrap();
    assert!(c.reclaimed.is_empty(), "{c:?}");
    assert_eq!(c.left_alone.len(), 1);
    assert!(s20.exists());

    // A save by a child process that is killed mid-save: reclaimed once the child is gone.
    let dir = root.path().join(saver::io::manage::root::step_dir_name(30));
    let mut child = hanging_save(&dir);
    let c = m.clean(true).unwrap();
    assert!(!c.reclaimed.contains(&30), "a live writer's files: {c:?}");
    child.kill();
    let c = m.clean(false).unwrap();
    assert!(c.reclaimed.contains(&30), "{c:?}");
    assert!(!dir.exists());
    assert_eq!(m.latest().unwrap().unwrap().step, 10);
}

/// Kill -9 during a save, restart, save the same step again: the new save removes what the killed
/// save left (its writer has provably ended) and never a file of a save still running beside it;
/// once that one's writer is gone too, `clean` reclaims its files from the committed step.
#[test]
fn a_killed_saves_leftovers_go_with_the_next_save_of_its_step_and_nothing_else_does() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(1, 5)).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    write(&t, 1, (1.0, 1));
    m.save(10, SaveInput::new().table(&t), &opts()).unwrap();
    let dir = root.path().join(saver::io::manage::root::step_dir_name(20));
    let names = |d: &Path| -> std::collections::BTreeSet<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with(".saver-commit.lock"))
            .collect()
    };
    let mut killed = hanging_save(&dir);
    let killed_files = names(&dir);
    assert!(!killed_files.is_empty());
    let mut live = hanging_save(&dir);
    let live_files: std::collections::BTreeSet<String> =
        names(&dir).difference(&killed_files).cloned().collect();
    assert!(!live_files.is_empty());
    killed.kill();
    // The restart saves step 20 again.
    let done = m.save(20, SaveInput::new().table(&t), &opts()).unwrap();
    let now = names(&dir);
    assert!(
        killed_files.is_disjoint(&now),
        "the killed save's files stay: {now:?}"
    );
    assert!(
        live_files.is_subset(&now),
        "a live save's files went: {now:?}"
    );
    for f in &killed_files {
        assert!(
            done.save.cleaned_up.contains(f),
            "{f}: {:?}",
            done.save.cleaned_up
        );
    }
    assert_eq!(m.latest().unwrap().unwrap().step, 20);
    // The listing says what is on disk beside the committed save.
    assert_eq!(
        m.root().list().unwrap().others_beside,
        vec![(20, live_files.len())]
    );
    // Nothing more to reclaim while the other save's writer lives.
    let c = m.clean(false).unwrap();
    assert!(c.reclaimed.is_empty(), "{c:?}");
    assert!(live_files.is_subset(&names(&dir)));
    live.kill();
    let dry = m.clean(true).unwrap();
    assert_eq!(dry.reclaimed, vec![20]);
    assert_eq!(dry.files_removed, live_files.len());
    assert!(
        live_files.is_subset(&names(&dir)),
        "a dry run removes nothing"
    );
    let c = m.clean(false).unwrap();
    assert_eq!(c.reclaimed, vec![20], "{c:?}");
    assert!(live_files.is_disjoint(&names(&dir)));
    assert!(m.root().list().unwrap().others_beside.is_empty());
    // The committed step is whole, and holds what was saved.
    assert_eq!(saver::verify(&dir, 2).unwrap().status, saver::Status::Ok);
    assert_eq!(restored_state(&dir, 1).len(), 1);
}

/// A child process that is killed when dropped: a test that fails never leaves it behind (it
/// would hold the test's output open for the hour it sleeps).
struct Hanging(std::process::Child);

impl Hanging {
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Hanging {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A child process saving into `dir` that hangs in its first write, once it claimed its shard.
fn hanging_save(dir: &Path) -> Hanging {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--ignored",
            "manager::a_save_that_hangs_after_claiming_its_shard",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SAVER_HANG_DIR", dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("claimed") {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "the child ended before it claimed its shard"
        );
    }
    Hanging(child)
}

/// A removal cut short in a step directory where another save has started meanwhile: `clean`
/// finishes the removal of the save its marker names and never touches the live save's files;
/// once that writer is gone, its files go too.
#[test]
fn finishing_a_removal_never_touches_another_saves_files() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(1, 5)).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    write(&t, 1, (1.0, 1));
    let old = m.save(10, SaveInput::new().table(&t), &opts()).unwrap();
    m.save(20, SaveInput::new().table(&t), &opts()).unwrap();
    // The removal of step 10 cut short after its marker and its index.
    let dir = root.path().join(saver::io::manage::root::step_dir_name(10));
    let marker = serde_json::json!({ "step": 10, "save_ids": [old.save.save_id] });
    std::fs::write(
        dir.join(saver::io::manage::root::PRUNE_MARKER),
        marker.to_string(),
    )
    .unwrap();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    // Another save starts in that directory (its writer lives).
    let mut child = hanging_save(&dir);
    let names = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    };
    let theirs: Vec<String> = names(&dir)
        .into_iter()
        .filter(|n| n.contains("saver-") || n.contains("model-"))
        .filter(|n| !n.contains(&old.save.save_id) && n != saver::io::manage::root::PRUNE_MARKER)
        .collect();
    assert!(!theirs.is_empty(), "the child wrote its claim");
    let c = m.clean(false).unwrap();
    assert_eq!(c.reclaimed, vec![10], "{c:?}");
    let left = names(&dir);
    for n in &theirs {
        assert!(
            left.contains(n),
            "the live save's {n} was removed: {left:?}"
        );
    }
    assert!(
        !left.iter().any(|n| n.contains(&old.save.save_id)),
        "{left:?}"
    );
    assert!(!left
        .iter()
        .any(|n| n == saver::io::manage::root::PRUNE_MARKER));
    child.kill();
    let c = m.clean(false).unwrap();
    assert_eq!(c.reclaimed, vec![10], "{c:?}");
    assert!(!dir.exists());
    assert_eq!(m.latest().unwrap().unwrap().step, 20);
}

/// Child mode: a save into SAVER_HANG_DIR that hangs in its first write, after its claim.
#[test]
#[ignore = "a child process of a test: that test runs it, with --ignored"]
fn a_save_that_hangs_after_claiming_its_shard() {
    let Ok(dir) = std::env::var("SAVER_HANG_DIR") else {
        panic!("a child process: run by its parent test, which sets its environment");
    };
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    for id in 0..1000 {
        write(&t, id, (id as f32, 30));
    }
    let mut o = opts();
    o.progress = Some(Arc::new(|_| {
        // Every writer thread says so; the parent stops reading after the first, so a failed
        // write is no error (println! would panic on the closed pipe).
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), "claimed");
        std::thread::sleep(Duration::from_secs(3600));
    }));
    let _ = saver::save(&dir, SaveInput::new().table(&t), &o);
}

/// Complaint 3: a best-by-metric rule keeps the best steps beyond the newest, never instead of
/// them; keep-every keeps milestones; pinned steps stay.
#[test]
fn retention_rules_add_to_the_newest_never_evict_them() {
    let root = tempfile::tempdir().unwrap();
    let mut p = policy(1, 2);
    p.retention.keep_every = Some(40);
    p.retention.keep_steps.insert(30);
    p.retention.keep_best = Some(KeepBest {
        metric: "loss".into(),
        count: 1,
        higher_is_better: false,
    });
    let m = CheckpointManager::open(root.path(), p).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    // The loss is best (lowest) at step 20 and worst at the newest steps.
    let loss = [
        (10u64, 5.0),
        (20, 1.0),
        (30, 4.0),
        (40, 6.0),
        (50, 7.0),
        (60, 9.0),
        (70, 8.0),
    ];
    for (step, l) in loss {
        write(&t, step, (l as f32, step));
        let mut o = opts();
        o.user_metadata.insert("loss".into(), l.to_string());
        m.save(step, SaveInput::new().table(&t), &o).unwrap();
    }
    let kept: Vec<u64> = m.steps().unwrap().iter().map(|s| s.step).collect();
    assert_eq!(kept, vec![20, 30, 40, 60, 70]);
}

/// A delta that holds more than the policy's fraction of its base makes the next save full.
#[test]
fn a_delta_as_large_as_its_base_makes_the_next_save_full() {
    let root = tempfile::tempdir().unwrap();
    let mut p = policy(8, 8);
    p.max_delta_fraction = 0.5;
    let m = CheckpointManager::open(root.path(), p).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    for id in 0..1000 {
        write(&t, id, (0.0, 1));
    }
    m.save(1, SaveInput::new().table(&t), &opts()).unwrap();
    write(&t, 5, (1.0, 2));
    let small = m.save(2, SaveInput::new().table(&t), &opts()).unwrap();
    assert!(
        !small.save.delta_tables.is_empty(),
        "a small change: a delta"
    );
    for id in 0..800 {
        write(&t, id, (3.0, 3));
    }
    let large = m.save(3, SaveInput::new().table(&t), &opts()).unwrap();
    assert!(
        !large.save.delta_tables.is_empty(),
        "a delta of step 2, which was small"
    );
    let next = m.save(4, SaveInput::new().table(&t), &opts()).unwrap();
    assert!(
        next.save.delta_tables.is_empty(),
        "step 3's delta held 80 % of its base"
    );
    assert_eq!(m.latest().unwrap().unwrap().links, 1);
}

/// The model's schema changed (a slot added, a dimension changed): the manager saves the step
/// full and says why, where a delta would be refused. `force_full` makes one save full.
#[test]
fn a_schema_change_or_a_request_makes_the_save_full_and_says_why() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(8, 8)).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    for id in 0..100 {
        write(&t, id, (1.0, 1));
    }
    let first = m.save(1, SaveInput::new().table(&t), &opts()).unwrap();
    assert!(first.full_because.unwrap().contains("no earlier step"));
    let delta = m.save(2, SaveInput::new().table(&t), &opts()).unwrap();
    assert_eq!(delta.full_because, None);
    assert!(!delta.save.delta_tables.is_empty());
    // A slot added.
    let mut wider = slots();
    wider.push(SlotSpec::new("adagrad", Dtype::F32, vec![1]));
    let t2 = EmbeddingTable::new("emb", KeyDtype::U64, wider).unwrap();
    for id in 0..100u64 {
        let v = 2.0f32.to_le_bytes();
        t2.insert(id, &[&v[..], &3u64.to_le_bytes()[..], &v[..]])
            .unwrap();
    }
    let added = m.save(3, SaveInput::new().table(&t2), &opts()).unwrap();
    let why = added.full_because.expect("saved full");
    assert!(why.contains("adagrad") && why.contains("step 2"), "{why}");
    assert!(added.save.delta_tables.is_empty());
    // A dimension changed.
    let t3 = EmbeddingTable::new(
        "emb",
        KeyDtype::U64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![2]),
            SlotSpec::new("stamp", Dtype::U64, vec![]),
            SlotSpec::new("adagrad", Dtype::F32, vec![1]),
        ],
    )
    .unwrap();
    let v = [0u8; 8];
    t3.insert(7, &[&v[..], &v[..], &v[..4]]).unwrap();
    let changed = m.save(4, SaveInput::new().table(&t3), &opts()).unwrap();
    let why = changed.full_because.expect("saved full");
    assert!(why.contains("embedding") && why.contains("[2]"), "{why}");
    // The same schema again: a delta; then one full save on request, then deltas again.
    assert_eq!(
        m.save(5, SaveInput::new().table(&t3), &opts())
            .unwrap()
            .full_because,
        None
    );
    m.force_full();
    let forced = m.save(6, SaveInput::new().table(&t3), &opts()).unwrap();
    assert!(forced.full_because.unwrap().contains("asked for"));
    assert_eq!(
        m.save(7, SaveInput::new().table(&t3), &opts())
            .unwrap()
            .full_because,
        None
    );
    assert_eq!(m.latest().unwrap().unwrap().links, 2);
}

/// A save the manager refuses leaves nothing: out of order, refused before any directory is
/// made (also by `check_step`, for callers that read the model first); a save that fails after
/// its directory was made removes the directory it made.
#[test]
fn a_refused_or_failed_managed_save_leaves_no_step_directory() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(4, 8)).unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap();
    write(&t, 1, (1.0, 1));
    m.save(10, SaveInput::new().table(&t), &opts()).unwrap();
    for (step, overwrite) in [(5, false), (10, false), (5, true)] {
        let e = m.check_step(step, overwrite).unwrap_err().to_string();
        assert!(e.contains("newest committed step 10"), "{e}");
        let o = {
            let mut o = opts();
            o.overwrite = overwrite;
            o
        };
        let e = m.save(step, SaveInput::new().table(&t), &o).unwrap_err();
        assert!(e.to_string().contains("step 10"), "{e}");
    }
    m.check_step(10, true).unwrap();
    m.check_step(11, false).unwrap();
    // A save that fails once its directory exists: a table of another shard's rows.
    let mut o = opts();
    o.plan.shard_num = 4;
    let foreign = EmbeddingTable::for_shard(
        "emb",
        KeyDtype::U64,
        slots(),
        saver::Shard { index: 1, count: 4 },
        0,
    )
    .unwrap();
    let e = m
        .save(
            20,
            SaveInput::new().shard_table(0, &foreign).shard_table(1, &t),
            &o,
        )
        .err();
    assert!(e.is_some(), "the save fails");
    assert_eq!(step_dirs(root.path()), vec!["step-00000000000000000010"]);
}

/// Retention racing saves: a second process prunes the root with `keep 1` as fast as it can
/// while the job saves deltas. Every step any listing shows restores whole, and the newest
/// committed step is never lost.
#[test]
fn pruning_racing_saves_never_loses_the_newest_or_breaks_a_chain() {
    let root = tempfile::tempdir().unwrap();
    let m = CheckpointManager::open(root.path(), policy(4, 1)).unwrap();
    let table = tracked_table();
    let mut state = State::new();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let saved: Mutex<BTreeMap<u64, State>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        let pruner = s.spawn(|| {
            let other = CheckpointManager::open_kept(root.path()).unwrap();
            let mut checks = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                other.prune(None, false).unwrap();
                if let Some(latest) = other.latest().unwrap() {
                    let want = saved.lock().unwrap().get(&latest.step).cloned();
                    // The newest step, read while the other prunes: whole, or replaced by a
                    // newer one between the listing and the read.
                    match saver::Checkpoint::open(&latest.path) {
                        Ok(ck) => {
                            if let Ok(r) = ck.restore(&LoadOptions::default()) {
                                if let Some(want) = want {
                                    assert_eq!(r.table("emb").unwrap().len(), want.len());
                                }
                                checks += 1;
                            }
                        }
                        Err(_) => assert!(
                            other.latest().unwrap().unwrap().step > latest.step,
                            "the newest step {} was lost",
                            latest.step
                        ),
                    }
                }
            }
            checks
        });
        // SAVER_MANAGER_RACE_STEPS for a longer race (CI runs the default).
        let steps: u64 = std::env::var("SAVER_MANAGER_RACE_STEPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100);
        for step in 1..=steps {
            train(&table, &mut state, step);
            saved.lock().unwrap().insert(step, state.clone());
            m.save(step, SaveInput::new().table(&table), &opts())
                .unwrap();
            assert_eq!(m.latest().unwrap().unwrap().step, step);
            std::thread::sleep(Duration::from_millis(step % 5));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(pruner.join().unwrap() > 0);
    });
    let latest = m.latest().unwrap().unwrap();
    let last = saved.lock().unwrap().keys().max().copied().unwrap();
    assert_eq!(latest.step, last);
    assert_eq!(restored_state(&latest.path, 2), state);
    for s in m.steps().unwrap() {
        saver::Checkpoint::open(&s.path)
            .unwrap()
            .restore(&LoadOptions::default())
            .unwrap();
    }
}

/// Child mode: prunes SAVER_PRUNE_ROOT to its newest two steps, killing itself (SIGKILL) at
/// storage operation SAVER_PRUNE_AT of the removal; prints how many operations it made.
#[test]
#[ignore = "a child process of a test: that test runs it, with --ignored"]
fn prune_child() {
    let (Ok(dir), Ok(at)) = (
        std::env::var("SAVER_PRUNE_ROOT"),
        std::env::var("SAVER_PRUNE_AT"),
    ) else {
        panic!("a child process: run by its parent test, which sets its environment");
    };
    let counter = Arc::new(crate::crash::KillCounter {
        at: at.parse().unwrap(),
        ops: std::sync::atomic::AtomicU64::new(0),
    });
    let c = counter.clone();
    let root = saver::io::manage::Root::open(Path::new(&dir))
        .unwrap()
        .with_step_opener(move |p| {
            Ok(Arc::new(crate::crash::KillAt {
                inner: saver::io::storage::LocalFs::create_dir(p)?,
                counter: c.clone(),
            }) as Arc<dyn saver::io::storage::Storage>)
        });
    let rules = {
        Retention {
            keep_latest: 2,
            ..Default::default()
        }
    };
    saver::io::manage::prune::prune(&root, &rules, false).unwrap();
    println!(
        "ops={}",
        counter.ops.load(std::sync::atomic::Ordering::SeqCst)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

fn prune_in_child(root: &Path, at: u64) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--ignored",
            "manager::prune_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SAVER_PRUNE_ROOT", root)
        .env("SAVER_PRUNE_AT", at.to_string())
        .output()
        .unwrap()
}

/// A prune killed at every storage operation of its removals: after each kill, every step a
/// listing shows restores to the state it saved, the newest step is never lost, and the next
/// prune and clean finish the job, leaving exactly the kept steps and nothing else.
#[test]
fn a_prune_killed_at_every_operation_leaves_every_listed_step_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("template");
    let m = CheckpointManager::open(&template, policy(3, 100)).unwrap();
    let table = tracked_table();
    let mut state = State::new();
    let mut saved: BTreeMap<u64, State> = BTreeMap::new();
    for step in 1..=7u64 {
        train(&table, &mut state, step);
        m.save(step, SaveInput::new().table(&table), &opts())
            .unwrap();
        saved.insert(step, state.clone());
    }
    drop(m);
    // The newest two are 6 (a delta of 4's chain) and 7: 4, 5, 6, 7 stay; 1, 2, 3 go.
    let probe = tmp.path().join("probe");
    copy_dir(&template, &probe);
    let out = prune_in_child(&probe, u64::MAX);
    let text = String::from_utf8_lossy(&out.stdout);
    let ops: u64 = text
        .split("ops=")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the probe did not report: {text}"));
    assert!(
        ops >= 9,
        "three removals of three operations at least: {ops}"
    );
    let kept = vec![4, 5, 6, 7];
    for at in 0..ops {
        let root = tmp.path().join(format!("kill-{at}"));
        copy_dir(&template, &root);
        let out = prune_in_child(&root, at);
        assert!(!out.status.success(), "kill {at}: the child was not killed");
        let again = CheckpointManager::open_kept(&root).unwrap();
        let steps = again.steps().unwrap();
        assert_eq!(again.latest().unwrap().unwrap().step, 7, "kill {at}");
        for s in &steps {
            assert_eq!(
                restored_state(&s.path, 1),
                saved[&s.step],
                "kill {at}: step {}",
                s.step
            );
        }
        for k in &kept {
            assert!(
                steps.iter().any(|s| s.step == *k),
                "kill {at}: step {k} lost"
            );
        }
        // The next prune and clean finish: the kept steps, nothing else.
        again
            .prune(
                Some(&{
                    Retention {
                        keep_latest: 2,
                        ..Default::default()
                    }
                }),
                false,
            )
            .unwrap();
        again.clean(false).unwrap();
        let listing = again.root().list().unwrap();
        assert_eq!(
            listing.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
            kept,
            "kill {at}"
        );
        assert!(
            listing.uncommitted.is_empty() && listing.broken.is_empty(),
            "kill {at}: {listing:?}"
        );
        assert_eq!(step_dirs(&root).len(), kept.len(), "kill {at}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// Several processes of one save (here threads, each with its own manager and its own copy of
/// the model) call the same `save(step, …)` with their shard index and one save id per step:
/// each waits for the commit, all decide full or delta alike, and only shard 0's runs retention.
#[test]
fn the_processes_of_one_save_decide_alike_and_one_prunes() {
    let root = tempfile::tempdir().unwrap();
    let copies: Vec<EmbeddingTable> = (0..2)
        .map(|_| EmbeddingTable::new("emb", KeyDtype::U64, slots()).unwrap())
        .collect();
    // Each process's copy of the model, trained alike.
    let mut states = vec![State::new(); 2];
    let barrier = std::sync::Barrier::new(2);
    for step in 1..=7u64 {
        for (t, s) in copies.iter().zip(states.iter_mut()) {
            train(t, s, step);
        }
        assert_eq!(states[0], states[1]);
        let state = states[0].clone();
        let results: Vec<saver::io::manage::ManagedSave> = std::thread::scope(|s| {
            let handles: Vec<_> = copies
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let root = root.path();
                    let barrier = &barrier;
                    s.spawn(move || {
                        let m = CheckpointManager::open(root, policy(3, 2)).unwrap();
                        barrier.wait();
                        let mut o = opts();
                        o.save_id = Some(format!("run1-step{step}"));
                        o.plan.shard_num = 2;
                        o.plan.shard_index = Some(i as u32);
                        o.plan.foreign_rows = saver::ForeignRows::Skip;
                        m.save(step, SaveInput::new().table(t), &o).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r.save.committed), "step {step}");
        assert_eq!(
            results[0].save.delta_tables.is_empty(),
            results[1].save.delta_tables.is_empty(),
            "step {step}: both processes decide alike"
        );
        assert_eq!(
            results[0].save.delta_tables.is_empty(),
            (step - 1) % 3 == 0,
            "step {step}"
        );
        assert!(results[0].pruned.is_some() && results[1].pruned.is_none());
        let m = CheckpointManager::open_kept(root.path()).unwrap();
        let latest = m.latest().unwrap().unwrap();
        assert_eq!(latest.step, step);
        assert_eq!(latest.shards, 2);
        assert_eq!(restored_state(&latest.path, 3), state, "step {step}");
    }
}

//! Crash safety: a save killed (SIGKILL) at any point never costs the previous checkpoint, never
//! leaves anything that loads as a checkpoint unless it was committed, and never blocks the next
//! save. Kill points are storage operations (every write, rename, claim, removal: so the commit
//! phase is hit exactly) plus random moments, in a child process.
//!
//! `SAVER_CRASH_POINTS=N` raises the number of kill points per scenario (default 50).

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::restored_digest;
use saver::core::partition::fmix64;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::storage::{CommitLock, LocalFs, ReadHandle, Storage, WriteHandle};
use saver::io::{save_to, Error, Result};
use saver::{save, Checkpoint, ForeignRows, LoadOptions, SaveOptions, Status};

const SPEC_A: &str = "tables=3,rows=3000,dim=8,slots=embedding+adagrad+freq,dense=64KiB,seed=1";
const SPEC_B: &str = "tables=3,rows=3000,dim=8,slots=embedding+adagrad+freq,dense=64KiB,seed=2";

fn model(spec: &str) -> SyntheticModel {
    SyntheticModel::generate(&spec.parse::<SyntheticSpec>().unwrap()).unwrap()
}

fn opts(id: &str) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some(id.into()),
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.shard_num = 2;
    o.plan.parallel = 2;
    o.plan.max_file_size = 32 << 10;
    o.plan.chunk_bytes = 16 << 10;
    o
}

/// Kills its own process with SIGKILL at the n-th mutating storage operation.
#[derive(Debug)]
pub(crate) struct KillAt {
    pub(crate) inner: LocalFs,
    pub(crate) counter: Arc<KillCounter>,
}

/// The operation counter, shared by the storage and every file it opens.
#[derive(Debug)]
pub(crate) struct KillCounter {
    pub(crate) at: u64,
    pub(crate) ops: AtomicU64,
}

impl KillCounter {
    fn tick(&self) {
        if self.ops.fetch_add(1, Ordering::SeqCst) == self.at {
            // SAFETY: sending a signal to ourselves; nothing after this runs.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

struct KillWrite {
    inner: Box<dyn WriteHandle>,
    counter: Arc<KillCounter>,
}

impl WriteHandle for KillWrite {
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.counter.tick();
        self.inner.write_at(offset, buf)
    }
    fn truncate(&self, len: u64) -> Result<()> {
        self.counter.tick();
        self.inner.truncate(len)
    }
    fn commit(self: Box<Self>, durable: bool) -> Result<()> {
        self.counter.tick();
        self.inner.commit(durable)?;
        self.counter.tick();
        Ok(())
    }
    fn abort(self: Box<Self>) {
        self.inner.abort()
    }
}

impl Storage for KillAt {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn create(&self, name: &str, len: u64) -> Result<Box<dyn WriteHandle>> {
        self.counter.tick();
        Ok(Box::new(KillWrite {
            inner: self.inner.create(name, len)?,
            counter: self.counter.clone(),
        }))
    }
    fn create_exclusive(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        self.counter.tick();
        let r = self.inner.create_exclusive(name, bytes)?;
        self.counter.tick();
        Ok(r)
    }
    fn open(&self, name: &str) -> Result<Box<dyn ReadHandle>> {
        self.inner.open(name)
    }
    fn exists(&self, name: &str) -> Result<bool> {
        self.inner.exists(name)
    }
    fn list(&self) -> Result<Vec<String>> {
        self.inner.list()
    }
    fn remove(&self, name: &str) -> Result<()> {
        self.counter.tick();
        self.inner.remove(name)
    }
    fn sync_dir(&self) -> Result<()> {
        self.counter.tick();
        self.inner.sync_dir()
    }
    fn lock_commit(&self, wait: Duration) -> Result<Box<dyn CommitLock>> {
        self.counter.tick();
        let lock = self.inner.lock_commit(wait)?;
        self.counter.tick();
        Ok(lock)
    }
}

/// Child mode: save model B into SAVER_CRASH_DIR, killing ourselves at operation SAVER_CRASH_AT.
#[test]
#[ignore = "a child process of a test: that test runs it, with --ignored"]
fn crash_child() {
    let (Ok(dir), Ok(at)) = (
        std::env::var("SAVER_CRASH_DIR"),
        std::env::var("SAVER_CRASH_AT"),
    ) else {
        panic!("a child process: run by its parent test, which sets its environment");
    };
    let m = model(SPEC_B);
    let id = std::env::var("SAVER_CRASH_ID").unwrap();
    let mut o = opts(&id);
    if let Ok(shard) = std::env::var("SAVER_CRASH_SHARD") {
        o.plan.shard_num = 3;
        o.plan.shard_index = Some(shard.parse().unwrap());
        o.plan.foreign_rows = ForeignRows::Skip;
        o.wait = Some(Duration::from_secs(3));
    }
    if let Ok(parent) = std::env::var("SAVER_CRASH_PARENT") {
        o.parent = Some(parent.into());
    }
    let direct = std::env::var("SAVER_CRASH_DIRECT").is_ok();
    let storage = KillAt {
        inner: LocalFs::create_dir(&dir).unwrap().with_direct_io(direct),
        counter: Arc::new(KillCounter {
            at: at.parse().unwrap(),
            ops: AtomicU64::new(0),
        }),
    };
    match save_to(&storage, m.input(), &o) {
        Ok(r) => println!(
            "ops={} committed={}",
            storage.counter.ops.load(Ordering::SeqCst),
            r.committed
        ),
        Err(e) => println!("error: {e}"),
    }
}

/// Spawns a child saving into `dir` (with direct I/O if `direct`), killed at storage operation
/// `at`.
fn spawn_child(
    dir: &Path,
    at: u64,
    id: &str,
    shard: Option<u32>,
    direct: bool,
) -> std::process::Child {
    spawn_delta_child(dir, at, id, shard, direct, None)
}

/// [`spawn_child`], saving a delta of `parent` when one is given.
fn spawn_delta_child(
    dir: &Path,
    at: u64,
    id: &str,
    shard: Option<u32>,
    direct: bool,
    parent: Option<&Path>,
) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    if let Some(p) = parent {
        c.env("SAVER_CRASH_PARENT", p);
    }
    if direct {
        c.env("SAVER_CRASH_DIRECT", "1");
    }
    c.args([
        "--exact",
        "--ignored",
        "crash::crash_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("SAVER_CRASH_DIR", dir)
    .env("SAVER_CRASH_AT", at.to_string())
    .env("SAVER_CRASH_ID", id)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if let Some(s) = shard {
        c.env("SAVER_CRASH_SHARD", s.to_string());
    }
    c.spawn().unwrap()
}

/// How many storage operations a save makes: a probe child, never killed, reports it.
fn storage_ops(probe: std::process::Child) -> u64 {
    let out = probe.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("ops=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the probe reports its op count: {text}"))
}

fn digest_of(dir: &Path) -> String {
    let ck = Checkpoint::open(dir).unwrap();
    restored_digest(&ck.restore(&LoadOptions::default()).unwrap()).unwrap()
}

fn points() -> u64 {
    std::env::var("SAVER_CRASH_POINTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50)
}

/// After a kill: the directory holds either the old checkpoint or the new one, complete; or, if
/// it had none, nothing that loads. Then a new save into it succeeds.
fn check_after_kill(
    dir: &Path,
    had_old: Option<&str>,
    old_digest: &str,
    new_digest: &str,
    b: &SyntheticModel,
    round: u64,
) {
    let v = saver::verify(dir, 2).unwrap();
    match v.status {
        Status::Ok => {
            let d = digest_of(dir);
            assert!(
                d == new_digest || (had_old.is_some() && d == old_digest),
                "round {round}: a committed checkpoint with foreign content"
            );
        }
        Status::Incomplete => {
            assert!(
                had_old.is_none(),
                "round {round}: the old checkpoint was lost: {:?}",
                v.problems
            );
            let err = Checkpoint::open(dir).unwrap_err();
            assert!(
                matches!(err, Error::Incomplete { .. }),
                "round {round}: {err}"
            );
        }
        Status::Corrupt => panic!(
            "round {round}: a crash produced a corrupt checkpoint: {:?}",
            v.problems
        ),
    }
    // The next save into the same directory succeeds and commits cleanly.
    let retry = save(dir, b.input(), &opts(&format!("retry{round}"))).unwrap();
    assert_eq!(saver::verify(dir, 2).unwrap().status, Status::Ok);
    assert_eq!(digest_of(dir), new_digest);
    // The killed save's files cannot be told from a save still running: the retry leaves them
    // alone and says so. Everything else in the directory is the retry's checkpoint.
    for name in common::dir_bytes(dir).into_keys() {
        let retry_file = name.contains(&format!("retry{round}"))
            || name == "model.safetensors.index.json"
            || name == ".saver-commit.lock";
        assert!(
            retry_file || retry.left_alone.contains(&name),
            "round {round}: {name} is neither the retry's nor reported as left alone"
        );
        // What the retry replaced is gone; a killed commit's unfinished removal of the
        // checkpoint before it stays, since nothing names those files any more.
        let replaced = retry.replaced.as_deref().unwrap_or("none");
        assert!(
            !name.contains(&format!("-{replaced}-")) && !name.contains(&format!("-{replaced}.")),
            "round {round}: {name} of the replaced checkpoint {replaced} was not removed"
        );
    }
}

#[test]
fn killed_saves_never_cost_the_previous_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let a = model(SPEC_A);
    let b = model(SPEC_B);
    let sibling = root.path().join("previous");
    save(&sibling, a.input(), &opts("prev")).unwrap();
    let digest_a = digest_of(&sibling);

    // How many storage operations a full save makes.
    let probe = root.path().join("probe");
    let total = storage_ops(spawn_child(&probe, u64::MAX, "crashprobe", None, false));
    let digest_b = digest_of(&probe);
    assert_ne!(digest_a, digest_b);

    let n = points();
    let started = Instant::now();
    let mut kills = 0;
    for (scenario, had_old) in [("fresh", None), ("overwrite", Some("old"))] {
        for k in 0..n {
            // Spread over every operation, with the last ones (the commit) always included.
            let at = if k < 5 {
                total.saturating_sub(1 + k)
            } else {
                (k * 7919) % total.max(1)
            };
            let dir = root.path().join(format!("{scenario}{k}"));
            if had_old.is_some() {
                save(&dir, a.input(), &opts("old")).unwrap();
            }
            // Every other kill point writes with direct I/O.
            let out = spawn_child(&dir, at, &format!("crash{k}"), None, k % 2 == 1)
                .wait_with_output()
                .unwrap();
            let killed = out.status.code().is_none();
            kills += usize::from(killed);
            assert!(
                killed || at >= total,
                "op {at} of {total} did not kill the child: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            check_after_kill(&dir, had_old, &digest_a, &digest_b, &b, k);
            assert_eq!(
                digest_of(&sibling),
                digest_a,
                "the sibling checkpoint changed"
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
    // Kills at random moments (SIGKILL from the parent), overwriting a committed checkpoint.
    let mut rng = 0x5eed_u64;
    for k in 0..n / 5 {
        rng = fmix64(rng + 1);
        let dir = root.path().join(format!("timed{k}"));
        save(&dir, a.input(), &opts("old")).unwrap();
        let mut child = spawn_child(&dir, u64::MAX, &format!("crash{k}"), None, k % 2 == 1);
        std::thread::sleep(Duration::from_micros(rng % 400_000));
        let _ = child.kill();
        let _ = child.wait();
        check_after_kill(&dir, Some("old"), &digest_a, &digest_b, &b, 1000 + k);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!(
        "{kills} op-indexed kills and {} timed kills over {total} storage ops in {:.1}s",
        n / 5,
        started.elapsed().as_secs_f64()
    );
    assert!(
        kills as u64 >= n,
        "at least {n} kill points must actually kill"
    );
}

#[test]
fn a_killed_shard_process_blocks_the_commit_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Shard 1 is killed at its 3rd storage operation; shards 0 and 2 wait 3 s, then time out.
    let children: Vec<_> = [(0, u64::MAX), (1, 3), (2, u64::MAX)]
        .iter()
        .map(|&(s, at)| spawn_child(dir.path(), at, "mp", Some(s), false))
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert!(outs[1].status.code().is_none(), "shard 1 was killed");
    for s in [0, 2] {
        let text = String::from_utf8_lossy(&outs[s].stdout);
        assert!(
            text.contains("error: timed out") && text.contains("missing shards: [1]"),
            "shard {s}: {text}"
        );
    }
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        Status::Incomplete
    );
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("missing shards [1]"), "{err}");
    assert!(!dir.path().join("model.safetensors.index.json").exists());
}

/// The digest of the chain whose newest link is in `dir`.
fn chain_digest(dir: &Path) -> String {
    let chain = saver::Checkpoint::open(dir).unwrap();
    restored_digest(&chain.restore(&LoadOptions::default()).unwrap()).unwrap()
}

#[test]
fn killed_delta_saves_never_leave_a_delta_that_loads_and_never_touch_the_parent() {
    let root = tempfile::tempdir().unwrap();
    let a = model(SPEC_A);
    let b = model(SPEC_B);
    let base = root.path().join("base");
    save(&base, a.input(), &opts("base")).unwrap();
    let digest_a = digest_of(&base);
    let base_files = common::dir_bytes(&base);

    let probe = root.path().join("probe");
    let total = storage_ops(spawn_delta_child(
        &probe,
        u64::MAX,
        "deltaprobe",
        None,
        false,
        Some(&base),
    ));
    let digest_b = chain_digest(&probe);
    assert_ne!(digest_a, digest_b);

    let n = points();
    let mut kills = 0;
    for k in 0..n {
        let at = if k < 5 {
            total.saturating_sub(1 + k)
        } else {
            (k * 7919) % total.max(1)
        };
        let dir = root.path().join(format!("delta{k}"));
        let out = spawn_delta_child(&dir, at, &format!("d{k}"), None, k % 2 == 1, Some(&base))
            .wait_with_output()
            .unwrap();
        kills += usize::from(out.status.code().is_none());
        match saver::verify(&dir, 2).unwrap().status {
            Status::Ok => assert_eq!(chain_digest(&dir), digest_b, "kill {k}"),
            Status::Incomplete => assert!(saver::Checkpoint::open(&dir).is_err(), "kill {k}"),
            Status::Corrupt => panic!("kill {k}: a crash left a corrupt delta"),
        }
        // A retry of the delta commits; the parent was never touched.
        let mut o = opts(&format!("retry{k}"));
        o.parent = Some(base.clone());
        save(&dir, b.input(), &o).unwrap();
        assert_eq!(chain_digest(&dir), digest_b, "kill {k}");
        assert_eq!(
            common::dir_bytes(&base),
            base_files,
            "kill {k}: the parent changed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert!(
        kills as u64 >= n,
        "at least {n} kill points must actually kill"
    );
    assert_eq!(digest_of(&base), digest_a);
}

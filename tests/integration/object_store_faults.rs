//! The object-store backend against the failures a live server rarely produces on demand: a part
//! upload, an upload's completion or its abort that fails, and a ranged GET that comes back short.
//! A store wrapper injects them into an in-memory store; every one must end as an error naming the
//! object (never a panic or a checkpoint that looks complete), and a retry must commit.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{
    CopyOptions, GetOptions, GetRange, GetResult, ListResult, MultipartId, MultipartUpload,
    ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use saver::core::synthetic::SyntheticModel;
use saver::io::storage::{ObjectStorage, Storage};
use saver::io::{save_to, verify_storage};
use saver::{Checkpoint, LoadOptions, SaveOptions, Status};

/// A request kind a fault can hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    PutPart,
    Complete,
    Abort,
    /// A ranged GET answers one byte short.
    ShortGet,
}

/// An in-memory store that fails the `n`-th request of a kind (counted from 1), `times` times.
#[derive(Debug, Default)]
struct Faulty {
    inner: InMemory,
    faults: Mutex<Vec<(Op, usize, usize)>>,
    seen: Mutex<Vec<Op>>,
    /// Accept `If-None-Match: *` and overwrite anyway, as Garage 2.5 does.
    ignores_conditions: bool,
    /// How long every part upload takes, so that uploads overlap.
    slow_parts: Option<std::time::Duration>,
    /// Part uploads running now, and the most that ever ran at once.
    parts_in_flight: Mutex<(usize, usize)>,
}

impl fmt::Display for Faulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

impl Faulty {
    fn inject(&self, op: Op, nth: usize, times: usize) {
        let mut faults = self.faults.lock().unwrap();
        faults.retain(|f| f.0 != op);
        faults.push((op, nth, times));
        self.seen.lock().unwrap().retain(|o| *o != op);
    }

    /// Whether this request of kind `op` is to fail.
    fn hit(&self, op: Op) -> bool {
        let mut seen = self.seen.lock().unwrap();
        seen.push(op);
        let count = seen.iter().filter(|o| **o == op).count();
        let mut faults = self.faults.lock().unwrap();
        match faults.iter_mut().find(|f| f.0 == op) {
            Some((_, nth, times)) if count >= *nth && *times > 0 => {
                *times -= 1;
                true
            }
            _ => false,
        }
    }

    fn injected(op: Op) -> object_store::Error {
        object_store::Error::Generic {
            store: "Faulty",
            source: format!("injected failure of {op:?}").into(),
        }
    }
}

#[async_trait]
impl ObjectStore for Faulty {
    async fn put_opts(
        &self,
        location: &Key,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if self.ignores_conditions {
            opts.mode = object_store::PutMode::Overwrite;
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Key,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Key,
        mut options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if let Some(GetRange::Bounded(r)) = &options.range {
            if r.end - r.start > 1 && self.hit(Op::ShortGet) {
                options.range = Some(GetRange::Bounded(r.start..r.end - 1));
            }
        }
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Key,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Key>>,
    ) -> BoxStream<'static, object_store::Result<Key>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Key>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Key,
        to: &Key,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[async_trait]
impl MultipartStore for Faulty {
    async fn create_multipart(&self, path: &Key) -> object_store::Result<MultipartId> {
        self.inner.create_multipart(path).await
    }

    async fn put_part(
        &self,
        path: &Key,
        id: &MultipartId,
        part_idx: usize,
        data: PutPayload,
    ) -> object_store::Result<PartId> {
        if self.hit(Op::PutPart) {
            return Err(Self::injected(Op::PutPart));
        }
        {
            let mut f = self.parts_in_flight.lock().unwrap();
            f.0 += 1;
            f.1 = f.1.max(f.0);
        }
        if let Some(d) = self.slow_parts {
            tokio::time::sleep(d).await;
        }
        let out = self.inner.put_part(path, id, part_idx, data).await;
        self.parts_in_flight.lock().unwrap().0 -= 1;
        out
    }

    async fn complete_multipart(
        &self,
        path: &Key,
        id: &MultipartId,
        parts: Vec<PartId>,
    ) -> object_store::Result<PutResult> {
        if self.hit(Op::Complete) {
            return Err(Self::injected(Op::Complete));
        }
        self.inner.complete_multipart(path, id, parts).await
    }

    async fn abort_multipart(&self, path: &Key, id: &MultipartId) -> object_store::Result<()> {
        if self.hit(Op::Abort) {
            return Err(Self::injected(Op::Abort));
        }
        self.inner.abort_multipart(path, id).await
    }
}

fn setup() -> (Arc<Faulty>, ObjectStorage, SyntheticModel) {
    let store = Arc::new(Faulty::default());
    let storage = ObjectStorage::with_store(store.clone(), "memory://faults", "ck");
    // Big enough for multipart data files (over 8 MiB each).
    let spec = "tables=2,rows=40000,dim=64,slots=embedding+adagrad,dense=1MiB,seed=5";
    let model = SyntheticModel::generate(&spec.parse().unwrap()).unwrap();
    (store, storage, model)
}

fn opts() -> SaveOptions {
    let mut o = {
        SaveOptions {
            overwrite: true,
            ..Default::default()
        }
    };
    o.plan.parallel = 2;
    o
}

/// No checkpoint and nothing of the failed save (no data, no marker, no open upload) is left.
fn nothing_left(storage: &ObjectStorage) {
    let names = storage.list().unwrap();
    assert!(
        names.is_empty(),
        "a failed single-process save left {names:?}"
    );
}

#[test]
fn failed_part_uploads_and_completions_fail_the_save_cleanly_and_a_retry_commits() {
    for (op, nth) in [
        (Op::PutPart, 1),
        (Op::PutPart, 3),
        (Op::Complete, 1),
        (Op::PutPart, 5),
    ] {
        let (store, storage, model) = setup();
        store.inject(op, nth, 1);
        let err = save_to(&storage, model.input(), &opts()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("memory://faults/ck/"), "{op:?} {nth}: {msg}");
        assert!(msg.contains("injected failure"), "{op:?} {nth}: {msg}");
        assert_eq!(msg.lines().count(), 1, "{msg}");
        nothing_left(&storage);
        let report = save_to(&storage, model.input(), &opts()).unwrap();
        assert!(report.committed);
        assert_eq!(verify_storage(&storage, 2).unwrap().status, Status::Ok);
    }
}

/// One writer thread keeps several parts on their way up (it does not wait for each), and never
/// more than the storage's bound.
#[test]
fn parts_go_up_in_the_background_within_the_bound() {
    let store = Arc::new(Faulty {
        slow_parts: Some(std::time::Duration::from_millis(150)),
        ..Faulty::default()
    });
    let storage = ObjectStorage::with_store(store.clone(), "memory://slow", "ck");
    // One data file of about 41 MiB: six parts of 8 MiB.
    let spec = "tables=2,rows=40000,dim=64,slots=embedding+adagrad,dense=1MiB,seed=5";
    let model = SyntheticModel::generate(&spec.parse().unwrap()).unwrap();
    let mut o = opts();
    o.plan.parallel = 1;
    let report = save_to(&storage, model.input(), &o).unwrap();
    assert!(report.committed);
    assert_eq!(verify_storage(&storage, 2).unwrap().status, Status::Ok);
    let (running, most) = *store.parts_in_flight.lock().unwrap();
    assert_eq!(running, 0, "the commit waited for every part");
    let bound = std::env::var("SAVER_S3_UPLOADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(saver::io::storage::UPLOADS_IN_FLIGHT);
    assert!(
        most >= 2.min(bound) && most <= bound,
        "{most} parts in flight at most, with one writer thread and a bound of {bound}"
    );

    // A part that fails while later ones are in flight fails the save, naming the object, and
    // leaves nothing behind.
    let store = Arc::new(Faulty {
        slow_parts: Some(std::time::Duration::from_millis(150)),
        ..Faulty::default()
    });
    let storage = ObjectStorage::with_store(store.clone(), "memory://slow", "ck");
    store.inject(Op::PutPart, 2, 1);
    let err = save_to(&storage, model.input(), &o)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("memory://slow/ck/") && err.contains("injected failure"),
        "{err}"
    );
    assert_eq!(
        store.parts_in_flight.lock().unwrap().0,
        0,
        "no part left running"
    );
    nothing_left(&storage);
}

#[test]
fn an_abort_that_fails_is_finished_through_the_upload_marker() {
    let (store, storage, model) = setup();
    // The part fails, and so does the abort that follows it: the save's cleanup removes the
    // file's marker, which aborts the upload again.
    store.inject(Op::PutPart, 2, 1);
    let err = save_to(&storage, model.input(), &opts()).unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    nothing_left(&storage);

    store.inject(Op::Abort, 1, 1);
    store.inject(Op::PutPart, 1, 1);
    let _ = save_to(&storage, model.input(), &opts()).unwrap_err();
    // The first abort failed: the cleanup's removal of the marker retried it, or left the marker
    // for the next save (never an upload with no marker).
    let left: Vec<String> = storage.list().unwrap();
    assert!(
        left.iter().all(|n| n.ends_with(".upload")),
        "only markers may be left: {left:?}"
    );
    let report = save_to(&storage, model.input(), &opts()).unwrap();
    assert!(report.committed);
}

#[test]
fn a_short_ranged_read_is_an_error_naming_the_object() {
    let (store, storage, model) = setup();
    save_to(&storage, model.input(), &opts()).unwrap();
    let ck = Checkpoint::open_storage(Arc::new(storage.clone())).unwrap();
    store.inject(Op::ShortGet, 1, usize::MAX);
    let err = ck
        .load_columns(&LoadOptions::default())
        .expect_err("a short read fails the load");
    let msg = err.to_string();
    assert!(msg.contains("memory://faults/ck/model-"), "{msg}");
    assert_eq!(msg.lines().count(), 1, "{msg}");
    let report = verify_storage(&storage, 2).unwrap();
    assert_ne!(report.status, Status::Ok, "a short read must not verify");
}

/// On a store that ignores conditional writes there is no commit lock, so the processes of one
/// save commit at the same moment: each must see the save committed (by itself or another of
/// them), never mistake its own save's index for a rival's.
#[test]
fn writers_of_one_save_commit_together_without_a_lock() {
    let store = Arc::new(Faulty {
        ignores_conditions: true,
        ..Faulty::default()
    });
    let storage = ObjectStorage::with_store(store, "memory://nolock", "ck");
    assert!(!storage.honours_conditional_create().unwrap());
    let spec = "tables=2,rows=3000,dim=8,slots=embedding,dense=64KiB,seed=9";
    let model = SyntheticModel::generate(&spec.parse().unwrap()).unwrap();
    for round in 0..100 {
        let reports: Vec<_> = std::thread::scope(|s| {
            let running: Vec<_> = (0..3u32)
                .map(|i| {
                    let (storage, model) = (&storage, &model);
                    s.spawn(move || {
                        let mut o = opts();
                        o.plan.shard_num = 3;
                        o.plan.shard_index = Some(i);
                        o.plan.foreign_rows = saver::core::plan::ForeignRows::Skip;
                        o.save_id = Some(format!("r{round}"));
                        o.wait = Some(std::time::Duration::from_secs(30));
                        save_to(storage, model.input(), &o)
                    })
                })
                .collect();
            running.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in reports {
            let r = r.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(r.committed, "round {round}");
        }
        assert_eq!(verify_storage(&storage, 2).unwrap().status, Status::Ok);
    }
}

/// The commit lock of a store that ignores conditional writes (the flag lock): takers racing
/// for it, many times over, never hold it together, and each gets it within the wait.
#[test]
fn the_flag_lock_excludes_racing_takers() {
    let store = Arc::new(Faulty {
        ignores_conditions: true,
        ..Faulty::default()
    });
    let storage = ObjectStorage::with_store(store, "memory://flags", "ck");
    assert!(!storage.honours_conditional_create().unwrap());
    flag_lock_race(&storage, 4, 50);
    // No flag is left once every holder released it.
    assert!(storage.list().unwrap().is_empty(), "{:?}", storage.list());
}

/// `takers` threads each take `storage`'s commit lock `times` times, holding it across a
/// read-modify-write of a counter object and a check that nobody else holds it.
pub(crate) fn flag_lock_race(storage: &ObjectStorage, takers: usize, times: usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let holders = AtomicUsize::new(0);
    storage.put("counter", b"0", true).unwrap();
    std::thread::scope(|s| {
        for t in 0..takers {
            let holders = &holders;
            s.spawn(move || {
                for i in 0..times {
                    let lock = storage
                        .lock_commit(std::time::Duration::from_secs(60))
                        .unwrap();
                    assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    let n: u64 = String::from_utf8(storage.get("counter", 64).unwrap())
                        .unwrap()
                        .parse()
                        .unwrap();
                    if (t + i) % 3 == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    storage
                        .put("counter", (n + 1).to_string().as_bytes(), true)
                        .unwrap();
                    holders.fetch_sub(1, Ordering::SeqCst);
                    drop(lock);
                }
            });
        }
    });
    let n = String::from_utf8(storage.get("counter", 64).unwrap()).unwrap();
    assert_eq!(n, (takers * times).to_string(), "an update was lost");
    storage.remove("counter").unwrap();
}

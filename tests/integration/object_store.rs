//! The storage conformance suite, run against every backend: the local filesystem and an
//! S3-compatible object store (a real Garage server on loopback, see `common/garage.rs`). Then
//! whole checkpoints through the public API on the object store: multi-process saves, resharding
//! loads for every j of M, deltas whose parent is in the bucket, and the errors a user meets.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::garage;

use crate::common::restored_digest;
use saver::core::plan::ForeignRows;
use saver::core::PartitionRule;
use saver::io::storage::{LocalFs, ObjectStorage, Storage, MIN_PART_SIZE};
use saver::{save, verify, Checkpoint, LoadOptions, SaveOptions, Status};

/// Deterministic bytes for a test file.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    common::row_bytes(seed, 0, len)
}

/// What every backend must do, whatever it is. `exclusive` says whether the backend guarantees
/// that of racing exclusive creators exactly one wins (the object store does where it honours
/// conditional creation).
fn conformance(storage: &dyn Storage, exclusive: bool) {
    // A file written by several threads at disjoint offsets, in any order, its first bytes last
    // (as a save writes its header), is invisible until committed, then reads back exactly.
    let len = (2 * MIN_PART_SIZE + 12_345) as usize;
    let want = bytes(1, len);
    let h = storage.create("big.safetensors", len as u64).unwrap();
    assert!(!storage.exists("big.safetensors").unwrap());
    let piece = 1 << 20;
    let mut offsets: Vec<usize> = (piece..len).step_by(piece).collect();
    offsets.reverse();
    std::thread::scope(|s| {
        for lane in 0..3 {
            let (h, offsets, want) = (&h, &offsets, &want);
            s.spawn(move || {
                for &o in offsets.iter().skip(lane).step_by(3) {
                    h.write_at(o as u64, &want[o..(o + piece).min(len)])
                        .unwrap();
                }
            });
        }
    });
    assert!(!storage.list().unwrap().contains(&"big.safetensors".into()));
    h.write_at(0, &want[..piece]).unwrap();
    h.commit(true).unwrap();
    storage.sync_dir().unwrap();
    let r = storage.open("big.safetensors").unwrap();
    assert_eq!(r.len(), len as u64);
    let mut got = vec![0u8; len];
    r.read_at(0, &mut got).unwrap();
    assert!(got == want, "a multipart file reads back as written");
    let mut mid = vec![0u8; 3 * piece];
    r.read_at(MIN_PART_SIZE - 7, &mut mid).unwrap();
    let at = MIN_PART_SIZE as usize - 7;
    assert!(mid == want[at..at + 3 * piece], "a range across parts");
    // A file cut short of its created length before its commit (a compressed save's), its
    // first bytes written last: into the second part, and within the first.
    for cut in [MIN_PART_SIZE as usize + 777, 3000] {
        let h = storage.create("cut.safetensors", len as u64).unwrap();
        let head = cut.min(1000);
        h.write_at(head as u64, &want[head..cut]).unwrap();
        h.truncate(cut as u64).unwrap();
        h.write_at(0, &want[..head]).unwrap();
        h.commit(true).unwrap();
        let r = storage.open("cut.safetensors").unwrap();
        assert_eq!(r.len(), cut as u64);
        let mut got = vec![0u8; cut];
        r.read_at(0, &mut got).unwrap();
        assert!(
            got == want[..cut],
            "a file cut to {cut} bytes reads back as written"
        );
        storage.remove("cut.safetensors").unwrap();
    }
    // A cut past the end is refused.
    let h = storage.create("cut.safetensors", len as u64).unwrap();
    h.write_at(5000, &want[5000..6000]).unwrap();
    assert!(h.truncate(len as u64 + 1).is_err());
    h.abort();

    // Many ranges at once: overlapping, touching, a small gap apart, far apart, empty.
    let ranges: [(usize, usize); 7] = [
        (5, 100),
        (50, 4000),
        (4000, 10),
        (4100, 3 << 20),
        (len - 9000, 9000),
        (MIN_PART_SIZE as usize + 3, 0),
        (MIN_PART_SIZE as usize - 2, 5 << 20),
    ];
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, n)| vec![0u8; n]).collect();
    let mut reads: Vec<(u64, &mut [u8])> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(o, _), b)| (o as u64, b.as_mut_slice()))
        .collect();
    r.read_many(&mut reads).unwrap();
    for (&(o, n), b) in ranges.iter().zip(&bufs) {
        assert!(b[..] == want[o..o + n], "read_many of {n} bytes at {o}");
    }
    let err = r
        .read_many(&mut [(0, &mut [0u8; 4][..]), (len as u64 - 1, &mut [0u8; 2][..])])
        .unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    let err = r.read_at(len as u64 - 10, &mut [0u8; 11]).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");

    // Small files: whole, and aborted files leave nothing.
    let h = storage.create("small.json", 5).unwrap();
    h.write_at(0, b"hello").unwrap();
    h.commit(false).unwrap();
    assert_eq!(storage.get("small.json", 100).unwrap(), b"hello");
    let err = storage.get("small.json", 4).unwrap_err();
    assert!(err.to_string().contains("more than the 4"), "{err}");
    for len in [10u64, 3 * MIN_PART_SIZE] {
        let h = storage.create("aborted.safetensors", len).unwrap();
        h.write_at(0, &bytes(2, 10)).unwrap();
        h.abort();
        assert!(!storage.exists("aborted.safetensors").unwrap());
    }
    // An empty file.
    storage.create("empty", 0).unwrap().commit(false).unwrap();
    assert_eq!(storage.open("empty").unwrap().len(), 0);

    // put replaces whole; exclusive creation keeps the first.
    storage.put("small.json", b"bye", true).unwrap();
    assert_eq!(storage.get("small.json", 100).unwrap(), b"bye");
    assert!(storage.create_exclusive("claim.json", b"first").unwrap());
    assert!(!storage.create_exclusive("claim.json", b"second").unwrap());
    assert_eq!(storage.get("claim.json", 100).unwrap(), b"first");
    if exclusive {
        for round in 0..8 {
            let name = format!("race-{round}.json");
            let wins: usize = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|i| {
                        let name = &name;
                        s.spawn(move || {
                            storage
                                .create_exclusive(name, format!("{i}").as_bytes())
                                .unwrap() as usize
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(wins, 1, "exactly one of racing creators wins");
        }
    }

    // Listing, removal, and names that would leave the directory.
    let mut names = storage.list().unwrap();
    names.retain(|n| !n.starts_with("race-"));
    names.sort();
    assert_eq!(
        names,
        ["big.safetensors", "claim.json", "empty", "small.json"]
    );
    storage.remove("claim.json").unwrap();
    storage.remove("claim.json").unwrap();
    assert!(!storage.exists("claim.json").unwrap());
    let err = storage.open("claim.json").err().expect("gone");
    assert!(err.is_about_the_checkpoint(), "a missing file: {err}");
    for bad in ["../x", "a/b", "", ".."] {
        assert!(storage.create(bad, 1).is_err(), "{bad:?}");
        assert!(storage.open(bad).is_err(), "{bad:?}");
    }

    // The commit lock: holders never overlap (where there is a lock to take).
    if exclusive {
        let inside = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..3 {
                        let _l = storage.lock_commit(Duration::from_secs(30)).unwrap();
                        assert_eq!(inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst), 0);
                        std::thread::sleep(Duration::from_millis(5));
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
        });
    }
}

#[test]
fn the_local_filesystem_conforms() {
    let dir = tempfile::tempdir().unwrap();
    conformance(&LocalFs::open_dir(dir.path()).unwrap(), true);
}

/// An object store that honours conditional creation and updates: the commit lock is a lease.
#[test]
fn an_object_store_with_conditional_writes_conforms() {
    let store = Arc::new(object_store::memory::InMemory::new());
    let storage = ObjectStorage::with_store(store, "memory://test", "ck");
    assert!(storage.honours_conditional_create().unwrap());
    conformance(&storage, true);

    // A lease left by a holder that died is taken over once it has run out, never before.
    let lock = saver::core::naming::COMMIT_LOCK;
    storage
        .put(lock, br#"{"holder":"dead:1","expires_unix_ms":1}"#, true)
        .unwrap();
    drop(storage.lock_commit(Duration::from_secs(5)).unwrap());
    assert!(!storage.exists(lock).unwrap(), "released on drop");
    storage
        .put(
            lock,
            br#"{"holder":"busy:1","expires_unix_ms":99999999999999}"#,
            true,
        )
        .unwrap();
    let err = storage
        .lock_commit(Duration::from_millis(300))
        .err()
        .expect("held");
    assert!(err.to_string().contains("memory://test/ck/"), "{err}");
}

#[test]
fn the_object_store_conforms() {
    let Some(g) = garage::shared() else { return };
    let storage = ObjectStorage::from_url(&g.url("conformance")).unwrap();
    let exclusive = storage.honours_conditional_create().unwrap();
    eprintln!("garage honours conditional creation: {exclusive}");
    conformance(&storage, exclusive);
    // Another prefix sees none of it; a prefix is a directory, not a name prefix.
    let other = ObjectStorage::from_url(&g.url("conformance2")).unwrap();
    assert!(other.list().unwrap().is_empty());
    let nested = ObjectStorage::from_url(&g.url("")).unwrap();
    assert!(!nested.list().unwrap().contains(&"big.safetensors".into()));
}

/// Garage ignores conditional writes: its commit lock is the flag lock, raced here on the real
/// server (the same race as against the in-memory store).
#[test]
fn the_commit_lock_on_garage_excludes_racing_takers() {
    let Some(g) = garage::shared() else { return };
    let storage = ObjectStorage::from_url(&g.url("flag-lock")).unwrap();
    crate::object_store_faults::flag_lock_race(&storage, 3, 15);
    assert!(storage.list().unwrap().is_empty(), "{:?}", storage.list());
}

fn options(shards: u32) -> SaveOptions {
    let mut o = SaveOptions::default();
    o.plan.shard_num = shards;
    o.plan.parallel = 2;
    o.plan.max_block_bytes = 64 << 10;
    o
}

fn digest_of(dir: &Path, shards: u32, index: u32) -> String {
    let ckpt = Checkpoint::open(dir).unwrap();
    let r = ckpt
        .restore(&{
            LoadOptions {
                shard_num: shards,
                shard_index: Some(index),
                parallel: 2,
                ..Default::default()
            }
        })
        .unwrap();
    restored_digest(&r).unwrap()
}

#[test]
fn checkpoints_round_trip_through_the_object_store() {
    let Some(g) = garage::shared() else { return };
    let model = common::Model::new(60_000);
    let local = tempfile::tempdir().unwrap();
    save(local.path(), model.input(), &options(3)).unwrap();
    let url = g.url("round-trip/ck");
    let remote = Path::new(&url);

    // Three processes' worth of shards, written at once, committed once.
    let id = "rt-1".to_string();
    let reports: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|j| {
                let (model, id) = (&model, id.clone());
                s.spawn(move || {
                    let mut o = options(3);
                    o.plan.shard_index = Some(j);
                    o.plan.foreign_rows = ForeignRows::Skip;
                    o.save_id = Some(id);
                    o.wait = Some(Duration::from_secs(60));
                    save(remote, model.input(), &o).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Where the store has a commit lock, one process commits; where it has none, several may
    // write the index, with the same bytes (a commit is idempotent), so all agree.
    let exclusive = ObjectStorage::from_url(&url)
        .unwrap()
        .honours_conditional_create()
        .unwrap();
    let here = reports.iter().filter(|r| r.committed_here).count();
    assert!(if exclusive { here == 1 } else { here >= 1 }, "{here}");
    assert!(reports.iter().all(|r| r.committed));
    let v = verify(remote, 2).unwrap();
    assert_eq!(v.status, Status::Ok, "{v:?}");

    // Every shard j of M reads the same rows as from the local copy, reading about what it keeps.
    for m in [1, 2, 5] {
        for j in 0..m {
            assert_eq!(
                digest_of(remote, m, j),
                digest_of(local.path(), m, j),
                "shard {j} of {m}"
            );
        }
    }
    let ckpt = Checkpoint::open(remote).unwrap();
    let r = ckpt
        .restore(&{
            LoadOptions {
                shard_num: 4,
                shard_index: Some(1),
                parallel: 2,
                ..Default::default()
            }
        })
        .unwrap();
    let amp = r.report.bytes_read as f64 / r.report.bytes_kept.max(1) as f64;
    assert!(amp < 1.1, "read amplification {amp}");

    // A second save replaces the first and removes exactly its files.
    let before: Vec<String> = ObjectStorage::from_url(&url).unwrap().list().unwrap();
    let err = save(remote, model.input(), &options(1)).unwrap_err();
    assert!(err.to_string().contains("--overwrite"), "{err}");
    let mut o = options(1);
    o.overwrite = true;
    let rep = save(remote, model.input(), &o).unwrap();
    assert_eq!(rep.replaced.as_deref(), Some("rt-1"));
    let after: Vec<String> = ObjectStorage::from_url(&url).unwrap().list().unwrap();
    assert!(after.iter().all(|n| !n.contains("rt-1")), "{after:?}");
    assert!(before.iter().any(|n| n.contains("rt-1")));
    assert_eq!(digest_of(remote, 1, 0), digest_of(local.path(), 1, 0));
}

/// The claims of writer `id`'s shards named in `names`.
fn claims_of<'a>(names: &'a [String], id: &str) -> Vec<&'a str> {
    let prefix = format!("saver-{id}-s");
    names
        .iter()
        .filter(|n| n.starts_with(&prefix) && n.ends_with(".writer.json"))
        .map(String::as_str)
        .collect()
}

/// A save of more shards than the store calls it sends at once (claims, shard manifests, the
/// commit's reads, the removal of what it replaced all go in batches): it commits whole,
/// replaces exactly the checkpoint before it, and one refused claim takes back every claim the
/// save made and no other writer's.
#[test]
fn a_save_of_many_shards_claims_and_commits_in_batches_on_the_store() {
    let Some(g) = garage::shared() else { return };
    let model = common::Model::new(20_000);
    let shards = 12;
    let local = tempfile::tempdir().unwrap();
    save(local.path(), model.input(), &options(shards)).unwrap();
    let url = g.url("many-shards/ck");
    let remote = Path::new(&url);
    let store = ObjectStorage::from_url(&url).unwrap();

    let mut o = options(shards);
    o.save_id = Some("many-1".into());
    save(remote, model.input(), &o).unwrap();
    assert_eq!(verify(remote, 2).unwrap().status, Status::Ok);
    let names = store.list().unwrap();
    assert_eq!(
        claims_of(&names, "many-1").len(),
        shards as usize,
        "{names:?}"
    );
    let mut o = options(shards);
    o.save_id = Some("many-2".into());
    o.overwrite = true;
    let rep = save(remote, model.input(), &o).unwrap();
    assert_eq!(rep.replaced.as_deref(), Some("many-1"));
    let names = store.list().unwrap();
    assert!(names.iter().all(|n| !n.contains("many-1")), "{names:?}");
    for (m, j) in [(1, 0), (5, 3)] {
        assert_eq!(
            digest_of(remote, m, j),
            digest_of(local.path(), m, j),
            "shard {j} of {m}"
        );
    }

    // Another process's writer of shard 3 of save "dup" (gone without committing), then a
    // single-process save under the same id: refused, naming both writers; of the claims, only
    // the other writer's is left.
    let mut o = options(shards);
    o.save_id = Some("dup".into());
    o.plan.shard_index = Some(3);
    o.plan.foreign_rows = ForeignRows::Skip;
    o.overwrite = true;
    save(remote, model.input(), &o).unwrap();
    let mut o = options(shards);
    o.save_id = Some("dup".into());
    o.overwrite = true;
    let e = save(remote, model.input(), &o).unwrap_err().to_string();
    assert!(e.contains("shard 3 has two writers"), "{e}");
    let names = store.list().unwrap();
    assert_eq!(
        claims_of(&names, "dup"),
        vec!["saver-dup-s00003.writer.json"],
        "{names:?}"
    );
    assert_eq!(
        Checkpoint::open(remote).unwrap().manifest().save_id,
        "many-2",
        "the checkpoint before stays"
    );
}

/// Saves of several shards racing to overwrite one prefix of the store, whose claims, commit
/// reads and removals of the replaced checkpoint go in batches: each round ends with one whole
/// checkpoint of a racer's model, the user's objects untouched and the replaced checkpoint's
/// objects gone. Where the store honours conditional writes (a commit lock), also: every commit
/// replaced a different checkpoint, and nothing is left but the committed save's objects. Where
/// it does not (Garage), racing saves are not excluded (docs/FORMAT.md, "Object storage"): a
/// save that committed and was then overwritten may leave its own objects, never anyone else's.
#[test]
fn saves_of_many_shards_racing_on_the_store_leave_one_checkpoint_and_the_users_objects() {
    let Some(g) = garage::shared() else { return };
    let shards = 4;
    let models: Vec<common::Model> = (0..4)
        .map(|i| common::Model::new(3_000 + 100 * i))
        .collect();
    let local = tempfile::tempdir().unwrap();
    let digests: Vec<String> = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let d = local.path().join(i.to_string());
            save(&d, m.input(), &options(1)).unwrap();
            digest_of(&d, 1, 0)
        })
        .collect();
    let user: Vec<(&str, Vec<u8>)> = ["notes.txt", "saver-notes.txt", "model-final.safetensors"]
        .into_iter()
        .map(|n| (n, format!("the user's own {n}").into_bytes()))
        .collect();
    let rounds = 6;
    let mut lost = 0;
    for round in 0..rounds {
        let url = g.url(&format!("many-shards-race/r{round}"));
        let remote = Path::new(&url);
        let store = ObjectStorage::from_url(&url).unwrap();
        for (name, bytes) in &user {
            store.put(name, bytes, true).unwrap();
        }
        let mut o = options(shards);
        o.save_id = Some(format!("old{round}"));
        save(remote, models[3].input(), &o).unwrap();
        let exclusive = store.honours_conditional_create().unwrap();
        let k = 2 + round % 2;
        let ids: Vec<String> = (0..k).map(|i| format!("r{round}x{i}")).collect();
        let barrier = std::sync::Barrier::new(k);
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = ids
                .iter()
                .zip(&models)
                .enumerate()
                .map(|(i, (id, m))| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        let mut o = options(shards);
                        o.save_id = Some(id.clone());
                        o.overwrite = true;
                        barrier.wait();
                        std::thread::sleep(Duration::from_millis((round * 7 + i * 13) as u64 % 20));
                        save(remote, m.input(), &o)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            verify(remote, 2).unwrap().status,
            Status::Ok,
            "round {round}"
        );
        let committed = Checkpoint::open(remote).unwrap().manifest().save_id.clone();
        let last = ids
            .iter()
            .position(|id| *id == committed)
            .unwrap_or_else(|| panic!("round {round}: {committed} is no racer's save"));
        assert!(results[last].is_ok(), "round {round}: {results:?}");
        assert_eq!(digest_of(remote, 1, 0), digests[last], "round {round}");
        let mut replaced: Vec<Option<String>> = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|r| r.replaced.clone())
            .collect();
        let winners = replaced.len();
        replaced.sort();
        replaced.dedup();
        if exclusive {
            assert_eq!(
                replaced.len(),
                winners,
                "round {round}: two saves replaced one checkpoint"
            );
        }
        lost += results.iter().filter(|r| r.is_err()).count();
        let names = store.list().unwrap();
        for (name, bytes) in &user {
            assert_eq!(
                &store.get(name, 1 << 10).unwrap(),
                bytes,
                "round {round}: {name}"
            );
        }
        for name in &names {
            let of =
                |id: &str| name.contains(&format!("-{id}-")) || name.contains(&format!("-{id}."));
            let expected = user.iter().any(|(n, _)| n == name)
                || name == "model.safetensors.index.json"
                || of(&committed)
                || (!exclusive && ids.iter().any(|id| of(id)));
            assert!(
                expected,
                "round {round}: {name} left behind (committed: {committed})"
            );
        }
    }
    println!("{rounds} rounds on the store: {lost} saves lost a race");
}

#[test]
fn compressed_checkpoints_and_deltas_round_trip_through_the_object_store() {
    let Some(g) = garage::shared() else { return };
    let model = common::Model::new(40_000);
    let compressed = |shards| {
        let mut o = options(shards);
        o.plan.compression = Some(saver::Compression::default());
        o
    };
    let url = g.url("compressed/base");
    let remote = Path::new(&url);
    let rep = save(remote, model.input(), &compressed(3)).unwrap();
    let local = tempfile::tempdir().unwrap();
    save(local.path(), model.input(), &options(3)).unwrap();
    let raw: u64 = Checkpoint::open(local.path())
        .unwrap()
        .newest()
        .manifest()
        .files
        .iter()
        .map(|f| f.bytes)
        .sum();
    assert!(
        rep.bytes_written < raw,
        "{} against {raw}",
        rep.bytes_written
    );
    assert_eq!(verify(remote, 2).unwrap().status, Status::Ok);
    for m in [1, 4] {
        for j in 0..m {
            assert_eq!(
                digest_of(remote, m, j),
                digest_of(local.path(), m, j),
                "shard {j} of {m}"
            );
        }
    }
    // A compressed delta of the compressed base, in the bucket.
    for id in 0..300u64 {
        model
            .user
            .insert(id, &[&[9u8; 32][..], &[0u8; 32][..], &[3u8; 8][..]])
            .unwrap();
    }
    let delta_url = g.url("compressed/step2");
    let mut o = compressed(2);
    o.parent = Some(url.clone().into());
    save(Path::new(&delta_url), model.input(), &o).unwrap();
    let chain = Checkpoint::open(Path::new(&delta_url)).unwrap();
    assert_eq!(
        chain.newest().manifest().format_version,
        saver::core::COMPRESSED_DELTA_FORMAT_VERSION
    );
    let fresh = tempfile::tempdir().unwrap();
    save(fresh.path(), model.input(), &options(1)).unwrap();
    let got = restored_digest(&chain.restore(&LoadOptions::default()).unwrap()).unwrap();
    assert_eq!(got, digest_of(fresh.path(), 1, 0));
}

#[test]
fn a_delta_names_its_parent_in_the_bucket() {
    let Some(g) = garage::shared() else { return };
    let model = common::Model::new(20_000);
    let base_url = g.url("chain/base");
    let delta_url = g.url("chain/step2");
    save(Path::new(&base_url), model.input(), &options(2)).unwrap();
    // Change some rows, then save a delta against the base.
    for id in 0..500u64 {
        model
            .user
            .insert(id, &[&[7u8; 32][..], &[1u8; 32][..], &[2u8; 8][..]])
            .unwrap();
    }
    let mut o = options(3);
    o.parent = Some(base_url.clone().into());
    save(Path::new(&delta_url), model.input(), &o).unwrap();
    let ckpt = Checkpoint::open(Path::new(&delta_url)).unwrap();
    let parent = ckpt.manifest().parent.as_ref().unwrap();
    assert_eq!(parent.path, "../base");
    let chain = Checkpoint::open(Path::new(&delta_url)).unwrap();
    assert_eq!(chain.links().len(), 2);
    assert_eq!(verify(Path::new(&delta_url), 2).unwrap().status, Status::Ok);
    let local = tempfile::tempdir().unwrap();
    save(local.path(), model.input(), &options(1)).unwrap();
    let want = digest_of(local.path(), 1, 0);
    let got = restored_digest(&chain.restore(&LoadOptions::default()).unwrap()).unwrap();
    assert_eq!(got, want);
    // A parent in another bucket cannot be named relative to the child.
    let mut o = options(1);
    o.parent = Some(base_url.into());
    let other = tempfile::tempdir().unwrap();
    let err = save(other.path(), model.input(), &o).unwrap_err();
    assert!(err.to_string().contains("not in one bucket"), "{err}");
}

/// A resharding load of a delta chain from the store reads every target's rows as from the same
/// chain on disk, and about the bytes the local load reads: its read-ahead takes the rows of the
/// segments that straddle the target's edges, not those segments whole.
#[test]
fn a_chain_on_the_store_loads_each_target_reading_what_its_rows_need() {
    let Some(g) = garage::shared() else { return };
    let model = common::Model::new(60_000);
    let local = tempfile::tempdir().unwrap();
    let (base, delta) = (local.path().join("base"), local.path().join("step2"));
    save(&base, model.input(), &options(2)).unwrap();
    for id in (0..60_000u64).step_by(7) {
        model
            .user
            .insert(id, &[&[5u8; 32][..], &[6u8; 32][..], &[7u8; 8][..]])
            .unwrap();
    }
    let mut o = options(3);
    o.parent = Some(base.clone());
    save(&delta, model.input(), &o).unwrap();
    for link in ["base", "step2"] {
        let store = ObjectStorage::from_url(&g.url(&format!("chain-reshard/{link}"))).unwrap();
        for f in std::fs::read_dir(local.path().join(link)).unwrap() {
            let f = f.unwrap().path();
            let name = f.file_name().unwrap().to_str().unwrap().to_string();
            store.put(&name, &std::fs::read(&f).unwrap(), true).unwrap();
        }
    }
    let remote_url = g.url("chain-reshard/step2");
    let remote = Checkpoint::open(Path::new(&remote_url)).unwrap();
    assert_eq!(remote.links().len(), 2);
    let on_disk = Checkpoint::open(&delta).unwrap();
    let n = 5u32;
    for j in 0..n {
        let o = LoadOptions {
            shard_num: n,
            shard_index: Some(j),
            parallel: 2,
            ..Default::default()
        };
        let (got, want) = (remote.restore(&o).unwrap(), on_disk.restore(&o).unwrap());
        assert_eq!(
            restored_digest(&got).unwrap(),
            restored_digest(&want).unwrap(),
            "target {j} of {n}"
        );
        let ratio = got.report.bytes_read as f64 / want.report.bytes_read.max(1) as f64;
        assert!(
            ratio < 1.3,
            "target {j} of {n}: {} bytes read from the store, {} from disk",
            got.report.bytes_read,
            want.report.bytes_read
        );
    }
}

/// A load from the store that cuts a checksummed block at its first or last row reads the rest
/// of the block beside its rows, to check it: a byte flipped there, outside the rows it returns,
/// fails that load, as it fails the load of the target whose rows hold the byte. Both loads, into
/// tables and into arrays.
#[test]
fn a_flipped_byte_beside_a_targets_rows_fails_its_load_from_the_store() {
    let Some(g) = garage::shared() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = common::Model::new(60_000);
    save(dir.path(), model.input(), &options(1)).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let n = 3u32;
    // The first bucket of target 2: its rows start inside a segment, inside a block.
    let edge = PartitionRule::bucket_range(2, n).start;
    let seg = ck.manifest().table("user").unwrap().partitions[0]
        .segments
        .iter()
        .find(|s| s.buckets[0] < edge && edge < s.buckets[1])
        .expect("a segment straddles the edge")
        .clone();
    let t = seg.slots[0].clone();
    let block = t.blocks.as_ref().expect("longer than a block").bytes;
    let ids = std::fs::read(dir.path().join(&seg.ids.file)).unwrap();
    let id_at = |r: u64| {
        let at = (seg.ids.offset + r * 8) as usize;
        u64::from_le_bytes(ids[at..at + 8].try_into().unwrap())
    };
    let first = (0..seg.rows)
        .find(|&r| PartitionRule::bucket_of(id_at(r)) >= edge)
        .unwrap();
    let at = first * (t.len / seg.rows);
    assert!(at % block != 0, "the edge falls on a block's start");
    // The last byte of target 1's rows, then the first of target 2's: each lies in the block
    // that the other target's load cuts.
    for (k, byte) in [at - 1, at].into_iter().enumerate() {
        let url = g.url(&format!("edge-flip/{k}"));
        let store = ObjectStorage::from_url(&url).unwrap();
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let f = f.unwrap().path();
            let name = f.file_name().unwrap().to_str().unwrap().to_string();
            let mut bytes = std::fs::read(&f).unwrap();
            if name == t.file {
                bytes[(t.offset + byte) as usize] ^= 0x10;
            }
            store.put(&name, &bytes, true).unwrap();
        }
        let remote = Checkpoint::open(Path::new(&url)).unwrap();
        for j in [1, 2] {
            let o = {
                LoadOptions {
                    shard_num: n,
                    shard_index: Some(j),
                    parallel: 2,
                    ..Default::default()
                }
            };
            let errs = [remote.restore(&o).err(), remote.load_columns(&o).err()];
            for e in errs {
                let e = e.unwrap_or_else(|| panic!("target {j} loaded, byte {byte} flipped"));
                assert!(e.to_string().contains(&t.name), "{e}");
                assert!(e.to_string().contains("CRC32"), "{e}");
            }
        }
        // Target 0 reads none of that block: it loads.
        let o = {
            LoadOptions {
                shard_num: n,
                shard_index: Some(0),
                ..Default::default()
            }
        };
        remote.load_columns(&o).unwrap();
    }
}

#[test]
fn bad_locations_are_one_line_errors() {
    let Some(g) = garage::shared() else { return };
    let cases: BTreeMap<&str, &str> = [
        ("gs://bucket/x", "unsupported URL scheme"),
        ("s3:///x", "no bucket name"),
        ("s3://b/../x", "leaves the bucket"),
    ]
    .into();
    for (url, needle) in cases {
        let err = Checkpoint::open(Path::new(url)).unwrap_err().to_string();
        assert!(err.contains(needle), "{url}: {err}");
        assert!(!err.contains('\n'), "{err}");
    }
    // A bucket that does not exist, and a prefix with no checkpoint.
    let err = Checkpoint::open(Path::new("s3://no-such-bucket-here/x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("s3://no-such-bucket-here"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    let err = Checkpoint::open(Path::new(&g.url("nothing/here")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not a complete checkpoint") || err.contains("not found"),
        "{err}"
    );
}

/// Readers in threads of one process, racing overwrites of one prefix on the store, hundreds of
/// reads: each read (a plain `Checkpoint::open` and `restore`, or through `read_latest`, as the
/// commands read) returns a checkpoint
/// that was saved there, whole — its digest is one of the saved models', never a mixture — or
/// says it was overtaken ("was replaced"). Never a missing object, never "corrupt". About 20
/// reads in CI; `SAVER_S3_RACE_SAVES=300` makes hundreds.
#[test]
fn library_readers_racing_overwrites_get_a_whole_saved_checkpoint() {
    let Some(g) = garage::shared() else { return };
    use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
    let url = g.url("race/ck");
    let dir = Path::new(&url);
    // `SAVER_S3_RACE_SAVES` raises the number of overwrites (and so of reads).
    let saves: u64 = std::env::var("SAVER_S3_RACE_SAVES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let models: Vec<SyntheticModel> = (0..saves)
        .map(|k| {
            let spec: SyntheticSpec = format!("tiny,seed={k}").parse().unwrap();
            SyntheticModel::generate(&spec).unwrap()
        })
        .collect();
    let mut o = options(2);
    o.overwrite = true;
    // Each model's digest, from a save of it read back whole.
    let mut digests = std::collections::BTreeSet::new();
    save(dir, models[0].input(), &o).unwrap();
    digests.insert(digest_of(dir, 1, 0));
    let digests = std::sync::Mutex::new(digests);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (reads, overtaken) = (
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
    );
    let seen = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for reader in 0..3u32 {
            let (done, reads, overtaken, seen) = (&done, &reads, &overtaken, &seen);
            s.spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let load = || -> saver::Result<(u32, String)> {
                        let chain = Checkpoint::open(dir)?;
                        let r = chain.restore(&{
                            LoadOptions {
                                shard_num: 1 + reader % 2,
                                shard_index: Some(0),
                                parallel: 2,
                                ..Default::default()
                            }
                        })?;
                        Ok((reader % 2, restored_digest(&r)?))
                    };
                    // Readers 0 and 2 open and restore as any library user would: the
                    // checkpoint starts over by itself. Reader 1 wraps it in read_latest, as
                    // the commands do.
                    let got = if reader == 1 {
                        saver::io::load::checkpoint::read_latest(dir, load)
                    } else {
                        load()
                    };
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match got {
                        Ok(d) => seen.lock().unwrap().push(d),
                        Err(e) => {
                            let e = e.to_string();
                            assert!(e.contains("was replaced"), "{e}");
                            overtaken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        for (k, m) in models.iter().enumerate().skip(1) {
            std::thread::sleep(Duration::from_millis((k as u64 * 37 % 7) * 40));
            save(dir, m.input(), &o).unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    // What each model reads as, whole (shard 0 of 1) and as shard 0 of 2, read with no race.
    let mut whole = std::collections::BTreeSet::new();
    let mut half = std::collections::BTreeSet::new();
    let local = tempfile::tempdir().unwrap();
    for (k, m) in models.iter().enumerate() {
        let d = local.path().join(format!("m{k}"));
        save(&d, m.input(), &options(2)).unwrap();
        whole.insert(digest_of(&d, 1, 0));
        half.insert(digest_of(&d, 2, 0));
    }
    assert!(whole.is_superset(&digests.into_inner().unwrap()));
    let seen = seen.into_inner().unwrap();
    for (kind, d) in &seen {
        let known = if *kind == 0 { &whole } else { &half };
        assert!(known.contains(d), "a read returned rows of no saved model");
    }
    let reads = reads.into_inner();
    assert!(reads >= 12, "{reads} reads");
    println!(
        "{reads} reads, {} overtaken, {} distinct checkpoints read",
        overtaken.into_inner(),
        seen.iter().collect::<std::collections::BTreeSet<_>>().len()
    );
}

/// A reader that reads one request in several loads opens the checkpoint pinned: once another
/// save replaced it (and removed its objects, which an object store keeps readable for no one),
/// a pinned load fails and says the checkpoint was replaced, where an unpinned one reads the
/// new checkpoint. Neither ever mixes the two.
#[test]
fn a_pinned_checkpoint_reads_its_own_save_or_fails_saying_it_was_replaced() {
    let Some(g) = garage::shared() else { return };
    let (old, new) = (common::Model::new(5_000), common::Model::new(7_000));
    let url = g.url("pinned/ck");
    let dir = Path::new(&url);
    let mut o = options(1);
    o.overwrite = true;
    save(dir, old.input(), &o).unwrap();
    let digest = |ck: &Checkpoint| {
        ck.restore(&LoadOptions::default())
            .and_then(|r| restored_digest(&r))
    };
    let want_old = digest(&Checkpoint::open(dir).unwrap()).unwrap();
    let pinned = Checkpoint::open(dir).unwrap().pinned();
    let following = Checkpoint::open(dir).unwrap();
    assert!(!pinned.was_replaced());
    assert_eq!(
        digest(&pinned).unwrap(),
        want_old,
        "a pinned read before any replacement"
    );
    save(dir, new.input(), &o).unwrap();
    let want_new = digest(&Checkpoint::open(dir).unwrap()).unwrap();
    assert_ne!(want_old, want_new);
    assert!(pinned.was_replaced() && following.was_replaced());
    let err = digest(&pinned).expect_err("the old save's objects are gone");
    assert!(err.to_string().contains("pinned/ck"), "{err}");
    assert_eq!(digest(&following).unwrap(), want_new);
}

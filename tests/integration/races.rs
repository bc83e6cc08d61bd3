//! One save, one owner: saves, workers and readers racing for one directory, for real, many times
//! with varied timing. Each round asserts what a user relies on: the directory ends holding a
//! checkpoint that verifies and whose content is one save's whole model, a save that reports
//! success was committed from the state it saw, losers fail naming the winner, and no file that
//! is not the save's own (a user's, another save's) is ever removed.
//!
//! `SAVER_RACE_ROUNDS=N` raises the number of rounds (default 100 for the save races).

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Barrier;
use std::time::Duration;

use crate::common::restored_digest;
use saver::core::partition::fmix64;
use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::io::save::{try_commit, CommitState};
use saver::io::storage::{Fault, FaultyStorage, LocalFs};
use saver::io::{save_to, Error, SaveReport};
use saver::{
    save, Checkpoint, DenseTensor, Dtype, ForeignRows, LoadOptions, SaveInput, SaveOptions, Status,
};

fn rounds(default: usize) -> usize {
    std::env::var("SAVER_RACE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn model(seed: u64) -> SyntheticModel {
    let spec: SyntheticSpec =
        format!("tables=2,rows=400,dim=4,slots=embedding+adagrad,dense=8KiB,seed={seed}")
            .parse()
            .unwrap();
    SyntheticModel::generate(&spec).unwrap()
}

fn opts(id: &str, shards: u32, overwrite: bool) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some(id.into()),
            overwrite,
            durable: false,
            ..Default::default()
        }
    };
    o.plan.shard_num = shards;
    o.plan.parallel = 2;
    o.plan.max_file_size = 16 << 10;
    o
}

fn digest_of(dir: &Path) -> String {
    let ck = Checkpoint::open(dir).unwrap();
    restored_digest(&ck.restore(&LoadOptions::default()).unwrap()).unwrap()
}

/// The content digest of each model, from a save into a directory of its own.
fn digests(models: &[SyntheticModel]) -> Vec<String> {
    let root = tempfile::tempdir().unwrap();
    models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let dir = root.path().join(i.to_string());
            save(&dir, m.input(), &opts("reference", 1, false)).unwrap();
            digest_of(&dir)
        })
        .collect()
}

/// Files a user keeps beside checkpoints, some named much like saver's.
const USER_FILES: [&str; 4] = [
    "model-00001-of-00004.safetensors",
    "model-final.safetensors",
    "saver-notes.txt",
    "notes.txt",
];

fn put_user_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::create_dir_all(dir).unwrap();
    USER_FILES
        .iter()
        .map(|name| {
            let bytes = format!("the user's own {name}").into_bytes();
            std::fs::write(dir.join(name), &bytes).unwrap();
            (name.to_string(), bytes)
        })
        .collect()
}

fn assert_user_files_kept(dir: &Path, user: &BTreeMap<String, Vec<u8>>, round: usize) {
    let now = common::dir_bytes(dir);
    for (name, bytes) in user {
        assert_eq!(
            now.get(name),
            Some(bytes),
            "round {round}: user file {name} lost or changed"
        );
    }
}

/// Every file in `dir` is the user's, the commit lock, the index, or the committed save's.
fn assert_only_the_committed_save(dir: &Path, user: &BTreeMap<String, Vec<u8>>, round: usize) {
    let committed = Checkpoint::open(dir).unwrap().manifest().save_id.clone();
    for name in common::dir_bytes(dir).into_keys() {
        let expected = user.contains_key(&name)
            || name == ".saver-commit.lock"
            || name == "model.safetensors.index.json"
            || name.contains(&format!("-{committed}-"))
            || name.contains(&format!("-{committed}."));
        assert!(
            expected,
            "round {round}: {name} left behind (committed: {committed})"
        );
    }
}

/// Races `k` single-process saves (each its own model) into `dir`, each after a small random delay.
fn race(
    dir: &Path,
    models: &[SyntheticModel],
    ids: &[String],
    overwrite: bool,
    rng: &mut u64,
) -> Vec<saver::io::Result<SaveReport>> {
    let barrier = Barrier::new(ids.len());
    let delays: Vec<u64> = ids
        .iter()
        .map(|_| {
            *rng = fmix64(*rng + 1);
            *rng % 3000
        })
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .iter()
            .zip(models)
            .zip(&delays)
            .map(|((id, m), &delay)| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    std::thread::sleep(Duration::from_micros(delay));
                    save(dir, m.input(), &opts(id, 2, overwrite))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn racing_saves_commit_one_at_a_time_and_never_lose_the_directory() {
    let models: Vec<SyntheticModel> = (1..=4).map(model).collect();
    let digest = digests(&models);
    let root = tempfile::tempdir().unwrap();
    let mut rng = 0x7ace_u64;
    let n = rounds(100);
    let (mut lost_races, mut both_committed) = (0, 0);
    for round in 0..n {
        let dir = root.path().join(format!("r{round}"));
        let user = put_user_files(&dir);
        let overwrite = round % 2 == 1;
        let k = 2 + round % 2 + usize::from(round % 4 == 0);
        if overwrite {
            save(
                &dir,
                models[3].input(),
                &opts(&format!("old{round}"), 2, false),
            )
            .unwrap();
        }
        let ids: Vec<String> = (0..k).map(|i| format!("r{round}x{i}")).collect();
        let results = race(&dir, &models[..k], &ids, overwrite, &mut rng);

        let committed = Checkpoint::open(&dir).unwrap().manifest().save_id.clone();
        assert_eq!(
            saver::verify(&dir, 2).unwrap().status,
            Status::Ok,
            "round {round}"
        );
        let winners: Vec<&SaveReport> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert!(
            !winners.is_empty(),
            "round {round}: nobody committed: {results:?}"
        );
        // Successes form one chain of commits, each from the state the save saw: no two replaced
        // the same checkpoint (that would be a lost update).
        let mut replaced: Vec<Option<&str>> =
            winners.iter().map(|w| w.replaced.as_deref()).collect();
        replaced.sort();
        let before = replaced.len();
        replaced.dedup();
        assert_eq!(
            replaced.len(),
            before,
            "round {round}: two saves replaced one checkpoint"
        );
        if !overwrite {
            assert_eq!(
                winners.len(),
                1,
                "round {round}: two saves committed without --overwrite"
            );
        }
        both_committed += usize::from(winners.len() > 1);
        // The directory holds the last winner, with exactly its model's content.
        let last = ids
            .iter()
            .position(|id| *id == committed)
            .expect("a racer's save");
        assert!(
            results[last].is_ok(),
            "round {round}: committed save {committed} reported failure"
        );
        assert_eq!(
            digest_of(&dir),
            digest[last],
            "round {round}: content is not {committed}'s"
        );
        // Losers fail naming the save that won (or that holds the directory).
        for (i, r) in results.iter().enumerate() {
            let Err(e) = r else { continue };
            lost_races += 1;
            let msg = e.to_string();
            let names_a_winner = ids
                .iter()
                .enumerate()
                .any(|(j, id)| j != i && msg.contains(id.as_str()));
            assert!(
                names_a_winner,
                "round {round}: {} failed without naming the winner: {msg}",
                ids[i]
            );
            assert!(
                matches!(e, Error::Rejected { .. } | Error::Exists { .. }),
                "round {round}: unexpected error {e}"
            );
        }
        assert_user_files_kept(&dir, &user, round);
        assert_only_the_committed_save(&dir, &user, round);
    }
    println!("{n} rounds: {lost_races} saves lost a race, {both_committed} rounds committed twice in sequence");
    assert!(lost_races > 0, "the races never overlapped");
}

#[test]
fn readers_racing_overwrites_see_one_whole_checkpoint() {
    let models: Vec<SyntheticModel> = (1..=2).map(model).collect();
    let digest = digests(&models);
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), models[0].input(), &opts("v0", 2, false)).unwrap();
    let overwrites = rounds(100) / 2 + 10;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (verified, loaded) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (dir, digest, done) = (dir.path(), &digest, &done);
                s.spawn(move || {
                    let mut count = 0;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        if r == 0 {
                            let v = saver::verify(dir, 1).unwrap();
                            assert_eq!(v.status, Status::Ok, "{:?}", v.problems);
                        } else {
                            let d = digest_of(dir);
                            assert!(digest.contains(&d), "a load saw a mixture");
                        }
                        count += 1;
                    }
                    count
                })
            })
            .collect();
        for i in 1..=overwrites {
            save(
                dir.path(),
                models[i % 2].input(),
                &opts(&format!("v{i}"), 2, true),
            )
            .unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let counts: Vec<usize> = readers.into_iter().map(|h| h.join().unwrap()).collect();
        (counts[0], counts[1])
    });
    println!(
        "{overwrites} overwrites, {verified} verifies and {loaded} loads, all of one checkpoint"
    );
    assert!(verified > 0 && loaded > 0);
}

/// Saves shard `shard` of a two-shard save `id` of `m` into `dir`, waiting up to 5 s for the commit.
fn save_shard(dir: &Path, m: SaveInput<'_>, id: &str, shard: u32) -> saver::io::Result<SaveReport> {
    let mut o = opts(id, 2, true);
    o.plan.shard_index = Some(shard);
    o.plan.foreign_rows = ForeignRows::Skip;
    o.wait = Some(Duration::from_secs(5));
    save(dir, m, &o)
}

#[test]
fn a_stale_duplicate_worker_never_gets_its_shard_committed() {
    let (real, stale) = (model(1), model(2));
    let digest = digests(&[model(1), model(2), model(3)]);
    let root = tempfile::tempdir().unwrap();
    let mut rng = 0x57a1e_u64;
    let n = rounds(100) / 4 + 5;
    let mut outcomes: HashMap<&str, usize> = HashMap::new();
    for round in 0..n {
        let dir = root.path().join(format!("r{round}"));
        save(&dir, model(3).input(), &opts("old", 2, false)).unwrap();
        let id = format!("run{round}");
        // The stale worker comes anywhere from together with the real ones to well after their
        // commit.
        let delays: Vec<u64> = [20_000, 20_000, 200_000]
            .into_iter()
            .map(|range| {
                rng = fmix64(rng + 1);
                rng % range
            })
            .collect();
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = [(&real, 0), (&real, 1), (&stale, 0)]
                .into_iter()
                .zip(&delays)
                .map(|((m, shard), &delay)| {
                    let (dir, id) = (&dir, &id);
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_micros(delay));
                        save_shard(dir, m.input(), id, shard)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            saver::verify(&dir, 1).unwrap().status,
            Status::Ok,
            "round {round}"
        );
        let d = digest_of(&dir);
        assert!(
            d == digest[0] || d == digest[2],
            "round {round}: the stale worker's shard was committed: {results:?}"
        );
        let outcome = if d == digest[0] {
            "real committed"
        } else {
            "nothing committed"
        };
        *outcomes.entry(outcome).or_default() += 1;
        // The stale writer never succeeds, and is told why.
        let e = results[2].as_ref().expect_err("the stale worker must fail");
        assert!(
            matches!(e, Error::Rejected { .. })
                || e.to_string().contains("already holds the committed save"),
            "round {round}: {e}"
        );
    }
    println!("{n} rounds: {outcomes:?}");
}

/// A model whose tables are `m`'s and whose dense tensors are `dense`.
fn with_dense<'a>(m: &'a SyntheticModel, dense: &'a [(String, Vec<u8>)]) -> SaveInput<'a> {
    let mut input = SaveInput::new();
    for t in &m.tables {
        input = input.table(t);
    }
    for (name, bytes) in dense {
        input = input.dense(
            DenseTensor::new(
                name.clone(),
                Dtype::U8,
                vec![bytes.len() as u64],
                bytes.as_slice(),
            )
            .unwrap(),
        );
    }
    input
}

#[test]
fn every_dense_tensor_any_process_was_given_is_written_once_or_the_save_fails_naming_it() {
    let m = model(1);
    let a = |name: &str, fill: u8| (name.to_string(), vec![fill; 3000]);
    let full = vec![a("mlp.w", 1), a("mlp.b", 2), a("step_scale", 3)];
    let other = vec![a("mlp.w", 1), a("mlp.b", 9), a("step_scale", 3)];
    let extra = vec![
        a("mlp.w", 1),
        a("mlp.b", 2),
        a("step_scale", 3),
        a("rank1_only", 4),
    ];
    let none: Vec<(String, Vec<u8>)> = Vec::new();
    // (what shard 0 is given, what shard 1 is given, Ok or the words the error must contain)
    type Given<'a> = &'a [(String, Vec<u8>)];
    let cases: Vec<(Given, Given, Option<&[&str]>)> = vec![
        (&full, &full, None),
        (&none, &none, None),
        (
            &full,
            &none,
            Some(&["was passed to shard 0 but not to shard 1", "every process"]),
        ),
        (
            &none,
            &full,
            Some(&["was passed to shard 1 but not to shard 0"]),
        ),
        (
            &full,
            &other,
            Some(&["\"mlp.b\"", "different content", "shard 1"]),
        ),
        (&full, &extra, Some(&["\"rank1_only\"", "not to shard 0"])),
    ];
    let root = tempfile::tempdir().unwrap();
    for (case, (given0, given1, expect)) in cases.into_iter().enumerate() {
        // Both orders of arrival: the committer is whichever process completes the set.
        for first in [0u32, 1] {
            let dir = root.path().join(format!("c{case}f{first}"));
            let id = format!("dense{case}");
            let given = [given0, given1];
            let results: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = [first, 1 - first]
                    .into_iter()
                    .map(|shard| {
                        let (dir, id, m) = (&dir, &id, &m);
                        let input = with_dense(m, given[shard as usize]);
                        let h = s.spawn(move || save_shard(dir, input, id, shard));
                        std::thread::sleep(Duration::from_millis(5));
                        h
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            match expect {
                None => {
                    assert!(
                        results.iter().all(|r| r.is_ok()),
                        "case {case}: {results:?}"
                    );
                    let ck = Checkpoint::open(&dir).unwrap();
                    let names: Vec<&str> = ck
                        .manifest()
                        .dense
                        .iter()
                        .map(|d| d.tensor.name.as_str())
                        .collect();
                    assert_eq!(names.len(), given0.len(), "case {case}: {names:?}");
                    for (name, bytes) in given0 {
                        assert_eq!(&ck.read_dense(name).unwrap(), bytes, "case {case}: {name}");
                    }
                }
                Some(words) => {
                    assert!(
                        Checkpoint::open(&dir).is_err(),
                        "case {case}: committed anyway"
                    );
                    let failed: Vec<String> = results
                        .iter()
                        .filter_map(|r| r.as_ref().err())
                        .map(|e| e.to_string())
                        .collect();
                    assert_eq!(
                        failed.len(),
                        2,
                        "case {case}: both processes fail: {results:?}"
                    );
                    for w in words {
                        assert!(
                            failed.iter().any(|e| e.contains(w)),
                            "case {case}: no error says {w:?}: {failed:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn shards_of_different_models_or_steps_are_refused_naming_the_shard() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (model(1), model(2));
    // Same shapes, another seed: the dense content differs.
    let dir = root.path().join("seed");
    save(&dir, model(3).input(), &opts("old", 2, false)).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let h0 = s.spawn(|| save_shard(&dir, a.input(), "mixed", 0));
        let h1 = s.spawn(|| save_shard(&dir, b.input(), "mixed", 1));
        vec![h0.join().unwrap(), h1.join().unwrap()]
    });
    for r in &results {
        let e = r
            .as_ref()
            .expect_err("mixed content must not commit")
            .to_string();
        assert!(
            e.contains("shard 1") && e.contains("different content"),
            "{e}"
        );
    }
    assert_eq!(Checkpoint::open(&dir).unwrap().manifest().save_id, "old");
    // Same model, another trainer step.
    let dir = root.path().join("step");
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = [(0, 100), (1, 101)]
            .into_iter()
            .map(|(shard, step)| {
                let (dir, a) = (&dir, &a);
                s.spawn(move || {
                    let mut o = opts("steps", 2, false);
                    o.plan.shard_index = Some(shard);
                    o.plan.foreign_rows = ForeignRows::Skip;
                    o.wait = Some(Duration::from_secs(5));
                    o.step = Some(step);
                    save(dir, a.input(), &o)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &results {
        let e = r
            .as_ref()
            .expect_err("two steps must not commit")
            .to_string();
        assert!(e.contains("step Some(101)"), "{e}");
    }
}

#[test]
fn a_committer_whose_disk_fills_leaves_a_set_that_a_retry_commits() {
    let m = model(1);
    let digest = digests(&[model(1)]);
    let dir = tempfile::tempdir().unwrap();
    save_shard_no_wait(dir.path(), &m, "full", 0, None).unwrap();
    // The process of shard 1 completes the set, and its disk fills while it writes the index.
    let e = save_shard_no_wait(dir.path(), &m, "full", 1, Some(Fault::CommitOfIndex)).unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        Status::Incomplete
    );
    // No claim, lock or half-written index stands in the way: a retry commits the set.
    let storage = LocalFs::open_dir(dir.path()).unwrap();
    assert_eq!(
        try_commit(&storage, "full", 2, false).unwrap(),
        CommitState::CommittedHere
    );
    assert_eq!(saver::verify(dir.path(), 1).unwrap().status, Status::Ok);
    assert_eq!(digest_of(dir.path()), digest[0]);
    let names: Vec<String> = common::dir_bytes(dir.path()).into_keys().collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
}

fn save_shard_no_wait(
    dir: &Path,
    m: &SyntheticModel,
    id: &str,
    shard: u32,
    fault: Option<Fault>,
) -> saver::io::Result<SaveReport> {
    let mut o = opts(id, 2, false);
    o.plan.shard_index = Some(shard);
    o.plan.foreign_rows = ForeignRows::Skip;
    let local = LocalFs::create_dir(dir).unwrap();
    match fault {
        Some(f) => save_to(&FaultyStorage::new(local, f), m.input(), &o),
        None => save_to(&local, m.input(), &o),
    }
}

#[test]
fn a_directory_of_user_files_is_saved_into_and_left_as_it_was() {
    let m = model(1);
    let dir = tempfile::tempdir().unwrap();
    let user = put_user_files(dir.path());
    let first = save(dir.path(), m.input(), &opts("u1", 2, false)).unwrap();
    let mut reported = first.left_alone.clone();
    reported.sort();
    let mut expected: Vec<String> = USER_FILES.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(
        reported, expected,
        "the save says which files it left alone"
    );
    for i in 2..4 {
        save(dir.path(), m.input(), &opts(&format!("u{i}"), 2, true)).unwrap();
        assert_user_files_kept(dir.path(), &user, i);
        assert_only_the_committed_save(dir.path(), &user, i);
    }
    // A Hugging Face index that is not saver's is not replaced.
    let hf = tempfile::tempdir().unwrap();
    let index =
        br#"{"metadata":{"total_size":4},"weight_map":{"w":"model-00001-of-00001.safetensors"}}"#;
    std::fs::write(hf.path().join("model.safetensors.index.json"), index).unwrap();
    let e = save(hf.path(), m.input(), &opts("u9", 1, true))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("another directory"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(hf.path().join("model.safetensors.index.json")).unwrap(),
        index
    );
    assert_eq!(
        std::fs::read_dir(hf.path()).unwrap().count(),
        1,
        "nothing was written"
    );
}

#[test]
fn a_save_id_names_one_save_a_second_writer_of_a_shard_is_refused() {
    let m = model(1);
    let dir = tempfile::tempdir().unwrap();
    // A retry under the id of a save that left a shard behind is refused: its shard 0 could
    // otherwise be committed with the retry's shard 1.
    save_shard_no_wait(dir.path(), &m, "once", 0, None).unwrap();
    let e = save_shard_no_wait(dir.path(), &m, "once", 0, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("two writers") && e.contains("pid"), "{e}");
    let e = save_shard_no_wait(dir.path(), &m, "once", 1, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("two writers"), "the save stays rejected: {e}");
    assert!(Checkpoint::open(dir.path()).is_err());
    // A new id saves.
    save(dir.path(), m.input(), &opts("twice", 2, false)).unwrap();
    // A multi-process save without an id is refused before anything is written.
    let mut o = opts("x", 2, false);
    o.save_id = None;
    o.plan.shard_index = Some(0);
    let e = save(tempfile::tempdir().unwrap().path(), m.input(), &o).unwrap_err();
    assert!(e.to_string().contains("explicit save id"), "{e}");
}

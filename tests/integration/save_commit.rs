//! Saving and committing, through the public API.

use crate::common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::{checkpoint_bytes, dir_bytes, Model};
use saver::io::storage::{Fault, FaultyStorage, LocalFs, Storage};
use saver::io::DirectIo;
use saver::io::{save_to, Error};
use saver::{save, Checkpoint, Filters, ForeignRows, LoadOptions, PlanOptions, SaveOptions};

fn opts(shards: u32, parallel: usize) -> SaveOptions {
    SaveOptions {
        plan: PlanOptions {
            shard_num: shards,
            parallel,
            max_file_size: 64 << 10,
            ..Default::default()
        },
        save_id: Some("t1".into()),
        ..Default::default()
    }
}

#[test]
fn every_file_is_valid_safetensors_with_the_saved_bytes() {
    let m = Model::new(3000);
    let dir = tempfile::tempdir().unwrap();
    let report = save(dir.path(), m.input(), &opts(3, 4)).unwrap();
    assert!(report.committed && report.committed_here);
    assert!(
        report.files > 3,
        "small max file size gives several files per shard"
    );
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let man = ckpt.manifest();
    let mut ids_seen = BTreeSet::new();
    for f in &man.files {
        let bytes = std::fs::read(dir.path().join(&f.name)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["saver.save_id"], "t1");
        for (name, view) in st.tensors() {
            let r = man.tensor_refs().find(|t| t.name == name).unwrap();
            assert_eq!(crc32fast::hash(view.data()), r.crc32, "{name}");
            assert_eq!(format!("{:?}", view.dtype()), r.dtype.name());
        }
        let data: u64 = man
            .tensor_refs()
            .filter(|t| t.file == f.name)
            .map(|t| t.len)
            .sum();
        assert_eq!(
            bytes.len() as u64,
            f.data_start + data,
            "{}: header + tensors, nothing else",
            f.name
        );
        assert_eq!(f.data_start % 4096, 0, "data section aligned");
    }
    // Rows in the files equal the table's rows, slot by slot.
    let user = common::rows_of(&m.user);
    let t = man.table("user").unwrap();
    for p in &t.partitions {
        for seg in &p.segments {
            let read = |r: &saver::core::manifest::TensorRef| {
                let bytes = std::fs::read(dir.path().join(&r.file)).unwrap();
                bytes[r.offset as usize..(r.offset + r.len) as usize].to_vec()
            };
            let ids: Vec<u64> = read(&seg.ids)
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            for (k, slot) in seg.slots.iter().enumerate() {
                let data = read(slot);
                let w = data.len() / ids.len();
                for (i, id) in ids.iter().enumerate() {
                    assert_eq!(&data[i * w..(i + 1) * w], user[id][k].as_slice());
                }
            }
            ids_seen.extend(ids);
        }
    }
    assert_eq!(ids_seen.len(), user.len());
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        man.total_tensor_bytes()
    );
    assert_eq!(
        index["weight_map"].as_object().unwrap().len(),
        man.tensor_refs().count()
    );
}

#[test]
fn identical_input_gives_identical_bytes_whatever_the_parallelism() {
    let m = Model::new(2000);
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    save(a.path(), m.input(), &opts(4, 1)).unwrap();
    save(b.path(), m.input(), &opts(4, 7)).unwrap();
    assert_eq!(checkpoint_bytes(a.path()), checkpoint_bytes(b.path()));
}

#[test]
fn a_plan_past_its_memory_budget_spills_and_writes_the_same_bytes() {
    let m = Model::new(3000);
    for filtered in [false, true] {
        let with = |plan_memory: u64| {
            let mut o = opts(3, 2);
            o.plan.plan_memory = plan_memory;
            if filtered {
                o.plan.filters = Filters::new().keep_rows(|r| r.id_bits() % 3 != 0);
            }
            o
        };
        let in_memory = tempfile::tempdir().unwrap();
        let spilled = tempfile::tempdir().unwrap();
        let all = save(in_memory.path(), m.input(), &with(u64::MAX)).unwrap();
        assert_eq!(all.spilled_rows, 0);
        let item_rows = (0..1500u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .filter(|id| !filtered || id % 3 != 0)
            .count() as u64;
        // 0: both tables spill; 50 000: the first (48 000 bytes of plan) fits, the second spills.
        for (budget, spilled_rows) in [(0, all.rows), (50_000, item_rows)] {
            let _ = std::fs::remove_dir_all(spilled.path());
            let report = save(spilled.path(), m.input(), &with(budget)).unwrap();
            assert!(report.committed);
            assert_eq!(report.spilled_rows, spilled_rows, "budget {budget}");
            assert_eq!(
                checkpoint_bytes(in_memory.path()),
                checkpoint_bytes(spilled.path()),
                "budget {budget}, filtered {filtered}"
            );
        }
    }
}

#[test]
fn spilled_regions_larger_than_a_unit_are_split_and_write_the_same_bytes() {
    // About 78 user rows and 39 item rows per region (1/256 of the buckets). With 4 KiB chunks a
    // writer thread holds units of 32 rows, so every region of both spilled tables is split into
    // units of whole buckets, which must come out as if never split.
    let m = Model::new(20_000);
    let with = |plan_memory: u64| {
        let mut o = opts(3, 2);
        o.plan.plan_memory = plan_memory;
        o.plan.chunk_bytes = 4096;
        o
    };
    let in_memory = tempfile::tempdir().unwrap();
    let split = tempfile::tempdir().unwrap();
    let all = save(in_memory.path(), m.input(), &with(u64::MAX)).unwrap();
    let report = save(split.path(), m.input(), &with(0)).unwrap();
    assert_eq!(report.spilled_rows, all.rows);
    assert_eq!(
        checkpoint_bytes(in_memory.path()),
        checkpoint_bytes(split.path())
    );
    assert_eq!(
        saver::verify(split.path(), 2).unwrap().status,
        saver::Status::Ok
    );
}

#[test]
fn direct_io_writes_the_same_bytes_and_falls_back_where_unsupported() {
    let m = Model::new(20_000);
    // Files of several MiB, whose pieces go to the disk from lent memory, and files of a few
    // pages.
    for max_file_size in [2 << 30, 64 << 10] {
        let with = |direct_io| {
            let mut o = opts(3, 2);
            o.plan.max_file_size = max_file_size;
            o.direct_io = direct_io;
            o
        };
        // In the build directory: /tmp may be a tmpfs, which has no O_DIRECT.
        let buffered = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let direct = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let b = save(buffered.path(), m.input(), &with(DirectIo::Off)).unwrap();
        let d = save(direct.path(), m.input(), &with(DirectIo::On)).unwrap();
        assert_eq!(
            checkpoint_bytes(buffered.path()),
            checkpoint_bytes(direct.path())
        );
        // The report says which path the bytes took.
        assert_eq!(b.direct_io_files, 0);
        if LocalFs::open_dir(direct.path()).unwrap().suits_direct_io() {
            assert_eq!(d.direct_io_files, d.files);
        } else {
            // CI builds on ext4 and requires the direct-I/O path (`SAVER_REQUIRE_DIRECT_IO=1`).
            assert!(
                std::env::var_os("SAVER_REQUIRE_DIRECT_IO").is_none(),
                "the build directory takes no direct I/O, and SAVER_REQUIRE_DIRECT_IO is set"
            );
        }
        assert_eq!(
            saver::verify(direct.path(), 2).unwrap().status,
            saver::Status::Ok
        );
    }
    // tmpfs refuses O_DIRECT before Linux 6.6: the save then goes through the page cache, and the
    // report says so.
    if std::path::Path::new("/dev/shm").is_dir() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        // The default does not even try there.
        assert!(!LocalFs::open_dir(shm.path()).unwrap().suits_direct_io());
        let mut o = opts(2, 2);
        o.direct_io = DirectIo::On;
        let r = save(shm.path(), m.input(), &o).unwrap();
        assert!(
            r.direct_io_files == 0 || r.direct_io_files == r.files,
            "one filesystem, one answer: {r:?}"
        );
        assert_eq!(
            saver::verify(shm.path(), 2).unwrap().status,
            saver::Status::Ok
        );
    }
}

#[test]
fn overwrite_is_refused_unless_asked_and_keeps_the_old_checkpoint_until_commit() {
    let m = Model::new(500);
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), m.input(), &opts(2, 2)).unwrap();
    let before = dir_bytes(dir.path());
    let mut o = opts(2, 2);
    o.save_id = Some("t2".into());
    let err = save(dir.path(), m.input(), &o).unwrap_err();
    assert!(matches!(err, Error::Exists { .. }), "{err}");
    assert!(err.to_string().contains("overwrite"), "{err}");
    assert_eq!(
        dir_bytes(dir.path()),
        before,
        "a refused save touches nothing"
    );

    // An overwrite that fails before its commit leaves the old checkpoint loadable.
    o.overwrite = true;
    let faulty = FaultyStorage::new(
        LocalFs::open_dir(dir.path()).unwrap(),
        Fault::WriteNumber(3),
    );
    assert!(save_to(&faulty, m.input(), &o).is_err());
    assert_eq!(
        Checkpoint::open(dir.path()).unwrap().manifest().save_id,
        "t1"
    );
    assert_eq!(
        saver::verify(dir.path(), 2).unwrap().status,
        saver::Status::Ok
    );

    // A successful overwrite replaces it and removes the old files.
    save(dir.path(), m.input(), &o).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.manifest().save_id, "t2");
    assert!(
        dir_bytes(dir.path()).keys().all(|n| !n.contains("-t1")),
        "old files collected"
    );
}

#[test]
fn nothing_to_write_is_a_valid_empty_checkpoint() {
    let m = Model::new(100);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(5, 16);
    o.plan.filters = Filters::new().keep_blocks(|_| false);
    let r = save(dir.path(), m.input(), &o).unwrap();
    assert!(r.committed);
    assert_eq!(r.files, 0);
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        saver::Status::Ok
    );
    let restored = Checkpoint::open(dir.path())
        .unwrap()
        .restore(&LoadOptions::default())
        .unwrap();
    assert!(restored.shards[0].tables.is_empty() && restored.dense.is_empty());
}

#[test]
fn parallel_far_above_the_number_of_blocks() {
    let m = Model::new(10);
    let dir = tempfile::tempdir().unwrap();
    let r = save(dir.path(), m.input(), &opts(1, 64)).unwrap();
    assert!(r.committed);
    let restored = Checkpoint::open(dir.path())
        .unwrap()
        .restore(&LoadOptions::default())
        .unwrap();
    assert_eq!(
        common::rows_of(&restored.shards[0].tables[1]),
        common::rows_of(&m.user)
    );
}

#[test]
fn a_shard_that_never_arrives_times_out_naming_it() {
    let m = Model::new(300);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(3, 2);
    o.plan.foreign_rows = ForeignRows::Skip;
    o.wait = Some(Duration::from_millis(300));
    for (shard, expect_missing) in [(0, vec![1, 2]), (2, vec![1])] {
        o.plan.shard_index = Some(shard);
        let started = std::time::Instant::now();
        let err = save(dir.path(), m.input(), &o).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10));
        match err {
            Error::Timeout { missing, .. } => assert_eq!(missing, expect_missing),
            e => panic!("expected a timeout, got {e}"),
        }
    }
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("missing shards [1]"), "{err}");
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        saver::Status::Incomplete
    );
}

#[test]
fn failed_writes_leave_no_temporary_files_and_no_checkpoint() {
    let m = Model::new(2000);
    for fault in [
        Fault::WriteNumber(0),
        Fault::WriteNumber(17),
        Fault::DiskFullAfter(50_000),
        Fault::CommitNumber(1),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let faulty = FaultyStorage::new(LocalFs::open_dir(dir.path()).unwrap(), fault);
        let err = save_to(&faulty, m.input(), &opts(2, 2)).unwrap_err();
        assert!(err.to_string().contains("injected"), "{fault:?}: {err}");
        let left: Vec<String> = dir_bytes(dir.path()).into_keys().collect();
        assert!(
            left.iter().all(|n| !n.contains(".tmp-")),
            "{fault:?}: {left:?}"
        );
        assert!(Checkpoint::open(dir.path()).is_err());
        // A new save into the same directory succeeds.
        save(dir.path(), m.input(), &opts(2, 2)).unwrap();
        assert_eq!(
            saver::verify(dir.path(), 1).unwrap().status,
            saver::Status::Ok
        );
    }
}

#[test]
fn a_process_that_skips_other_shards_rows_reports_how_many() {
    let m = Model::new(3000);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(3, 2);
    o.plan.foreign_rows = ForeignRows::Skip;
    let all: Vec<u64> = [&m.user, &m.item]
        .iter()
        .flat_map(|t| common::rows_of(t).into_keys())
        .collect();
    for shard in 0..3 {
        o.plan.shard_index = Some(shard);
        let r = save(dir.path(), m.input(), &o).unwrap();
        let mine = all
            .iter()
            .filter(|&&id| saver::PartitionRule::shard_of(id, 3) == shard)
            .count() as u64;
        assert_eq!((r.rows, r.skipped_rows), (mine, all.len() as u64 - mine));
    }
    // A process that is refused foreign rows skips none when it saves every shard.
    o.plan.shard_index = None;
    o.plan.foreign_rows = ForeignRows::Error;
    let whole = tempfile::tempdir().unwrap();
    let r = save(whole.path(), m.input(), &o).unwrap();
    assert_eq!((r.rows, r.skipped_rows), (all.len() as u64, 0));
}

/// Child mode of the multi-process test: save one shard and exit.
#[test]
#[ignore = "a child process of a test: that test runs it, with --ignored"]
fn multi_process_child() {
    let (Ok(dir), Ok(shard)) = (
        std::env::var("SAVER_TEST_DIR"),
        std::env::var("SAVER_TEST_SHARD"),
    ) else {
        panic!("a child process: run by its parent test, which sets its environment");
    };
    let m = Model::new(4000);
    let mut o = opts(4, 2);
    o.save_id = Some("mp4".into());
    o.plan.shard_index = Some(shard.parse().unwrap());
    o.plan.foreign_rows = ForeignRows::Skip;
    o.wait = Some(Duration::from_secs(60));
    let r = save(&dir, m.input(), &o).unwrap();
    assert!(r.committed);
    println!("committed_here={}", r.committed_here);
}

#[test]
fn n_processes_commit_exactly_once_and_match_the_single_process_save() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..4)
        .map(|s| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "--ignored",
                    "save_commit::multi_process_child",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("SAVER_TEST_DIR", dir.path())
                .env("SAVER_TEST_SHARD", s.to_string())
                .output_async()
        })
        .collect();
    let outputs: Vec<String> = children.into_iter().map(|c| c.wait()).collect();
    let committers = outputs
        .iter()
        .filter(|o| o.contains("committed_here=true"))
        .count();
    assert_eq!(committers, 1, "{outputs:?}");
    let man = Checkpoint::open(dir.path()).unwrap().manifest().clone();

    // The single-process save with the same save id is byte-identical.
    let m = Model::new(4000);
    let single = tempfile::tempdir().unwrap();
    let mut o = opts(4, 3);
    o.save_id = Some(man.save_id.clone());
    save(single.path(), m.input(), &o).unwrap();
    let a = checkpoint_bytes(dir.path());
    let b = checkpoint_bytes(single.path());
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    assert!(
        a == b,
        "multi-process and single-process checkpoints differ"
    );
}

trait OutputAsync {
    fn output_async(&mut self) -> Child;
}
struct Child(std::process::Child);
impl OutputAsync for Command {
    fn output_async(&mut self) -> Child {
        Child(
            self.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }
}
impl Child {
    fn wait(self) -> String {
        let out = self.0.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "child failed: {text}");
        text
    }
}

/// Child mode: hold the commit lock of SAVER_LOCK_DIR, say so, and sleep until killed.
#[test]
#[ignore = "a child process of a test: that test runs it, with --ignored"]
fn lock_holder_child() {
    let Ok(dir) = std::env::var("SAVER_LOCK_DIR") else {
        panic!("a child process: run by its parent test, which sets its environment");
    };
    let storage = LocalFs::open_dir(dir).unwrap();
    let _lock = storage.lock_commit(Duration::from_secs(5)).unwrap();
    println!("locked");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_committer_killed_while_holding_the_lock_never_blocks_the_commit() {
    use std::io::BufRead;
    let m = Model::new(200);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(2, 2);
    o.plan.foreign_rows = ForeignRows::Skip;
    o.plan.shard_index = Some(0);
    save(dir.path(), m.input(), &o).unwrap();
    // A process takes the commit lock and is killed while holding it.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--ignored",
            "save_commit::lock_holder_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SAVER_LOCK_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    while !line.contains("locked") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended");
    }
    // While it lives, the lock is held: a commit would wait.
    let storage = LocalFs::open_dir(dir.path()).unwrap();
    assert!(matches!(
        storage.lock_commit(Duration::from_millis(50)),
        Err(Error::LockTimeout { .. })
    ));
    child.kill().unwrap();
    child.wait().unwrap();
    // The last shard commits at once: the kernel released the dead holder's lock.
    o.plan.shard_index = Some(1);
    o.wait = Some(Duration::from_secs(5));
    let started = std::time::Instant::now();
    let r = save(dir.path(), m.input(), &o).unwrap();
    assert!(r.committed_here);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        saver::Status::Ok
    );
}

/// A panic in a row filter, a block filter or the progress callback of a background save: the
/// error reaches `wait`, nothing commits, and the save leaves none of its files (claims and
/// temporary data files included).
#[test]
fn a_panicking_background_save_removes_its_own_files() {
    use std::sync::Arc;
    let tables: Vec<Arc<saver::EmbeddingTable>> = (0..2)
        .map(|k| {
            let t = saver::EmbeddingTable::new(
                format!("t{k}"),
                saver::KeyDtype::U64,
                vec![saver::SlotSpec::new("e", saver::Dtype::F32, vec![64])],
            )
            .unwrap();
            for id in 0..40_000u64 {
                t.upsert(id, |r| r.slot_mut::<f32>(0).fill(id as f32));
            }
            Arc::new(t)
        })
        .collect();
    let root = tempfile::tempdir().unwrap();
    for (k, what) in ["row filter", "block filter", "progress"]
        .iter()
        .enumerate()
    {
        let dir = root.path().join(format!("p{k}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("users-file.txt"), b"mine").unwrap();
        let mut opts = {
            saver::SaveOptions {
                durable: false,
                ..Default::default()
            }
        };
        opts.plan.shard_num = 2;
        match *what {
            "row filter" => {
                opts.plan.filters =
                    saver::Filters::new().keep_rows(|r| r.id_bits() != 12_345 || panic!("boom"))
            }
            "block filter" => {
                opts.plan.filters = saver::Filters::new()
                    .keep_blocks(|b| b.table != Some("t1") || b.shard != 1 || panic!("boom"))
            }
            _ => {
                opts.progress = Some(Arc::new(|p: saver::Progress| {
                    assert!(p.written < p.total / 2, "boom")
                }))
            }
        }
        let input = tables
            .iter()
            .fold(saver::SaveInput::new(), |i, t| i.table(Arc::clone(t)));
        let err = match saver::save_async(&dir, input, opts) {
            Ok(h) => h.wait().unwrap_err(),
            Err(e) => e,
        };
        assert!(err.to_string().contains("boom"), "{what}: {err}");
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["users-file.txt".to_string()], "{what}");
    }
}

/// User metadata past its bounds is refused before anything is written, naming it: a checkpoint
/// that carried it would be refused by every reader.
#[test]
fn user_metadata_past_its_bounds_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(100);
    let mut o = opts(1, 1);
    o.user_metadata = (0..=saver::core::manifest::MAX_USER_METADATA_ENTRIES)
        .map(|i| (format!("k{i}"), "v".to_string()))
        .collect();
    let e = save(dir.path(), m.input(), &o).unwrap_err().to_string();
    assert!(e.contains("user metadata"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The plan's save id belongs to the save: one set there to anything but the save's own is
/// refused, naming the option, and nothing is written.
#[test]
fn a_plan_save_id_other_than_the_saves_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(100);
    let mut o = opts(1, 1);
    o.plan.save_id = "other".into();
    let e = save(dir.path(), m.input(), &o).unwrap_err().to_string();
    assert!(e.contains("plan.save_id") && e.contains("other"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // The same id as the save's is no conflict.
    o.plan.save_id = "t1".into();
    save(dir.path(), m.input(), &o).unwrap();
}

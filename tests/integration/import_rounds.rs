//! A plain table distributed in rounds (its slot rows made a round of groups at a time, on a
//! thread of their own, while saves read them): saves racing each other over one distributed
//! input, and an input that breaks while rounds are still to be made.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use crate::common::source_digest;
use saver::io::load::restore::LoadedDense;
use saver::io::source::{save_input, PlainInput, Source, SourceTables};
use saver::io::{save, Checkpoint, SaveOptions};

/// Writes a plain input of one table `t0` of `rows` rows in no useful order (ids, two slots of
/// eight f32 each) and a dense tensor.
fn write_plain(path: &Path, rows: usize, seed: u64) {
    use safetensors::tensor::TensorView;
    let ids: Vec<u8> = (0..rows as u64)
        .flat_map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).to_le_bytes())
        .collect();
    let slot = |k: u64| -> Vec<u8> {
        (0..rows as u64 * 32)
            .map(|b| (b.wrapping_mul(31) ^ seed ^ k) as u8)
            .collect()
    };
    let (a, b) = (slot(1), slot(2));
    let dense = vec![7u8; 16];
    let views = vec![
        (
            "t0/ids".to_string(),
            TensorView::new(safetensors::Dtype::I64, vec![rows], &ids).unwrap(),
        ),
        (
            "t0/emb".to_string(),
            TensorView::new(safetensors::Dtype::F32, vec![rows, 8], &a).unwrap(),
        ),
        (
            "t0/acc".to_string(),
            TensorView::new(safetensors::Dtype::F32, vec![rows, 8], &b).unwrap(),
        ),
        (
            "dense.w".to_string(),
            TensorView::new(safetensors::Dtype::F32, vec![4], &dense).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn opts(shards: u32, parallel: usize) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some("rounds".into()),
            durable: false,
            ..Default::default()
        }
    };
    o.plan.shard_num = shards;
    o.plan.parallel = parallel;
    o.plan.max_file_size = 64 << 10;
    o
}

fn data_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A plain input of 6000 rows written in `dir` and opened, a scratch directory beside it, and its
/// dense tensors: (input path, scratch, input, dense).
fn open_plain(dir: &Path, seed: u64) -> (PathBuf, PathBuf, PlainInput, Vec<LoadedDense>) {
    let input = dir.join("model.safetensors");
    write_plain(&input, 6000, seed);
    let scratch = dir.join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let Source::Plain(plain) = Source::open(&input).unwrap() else {
        panic!("plain")
    };
    let dense = plain.read_dense().unwrap();
    (input, scratch, plain, dense)
}

/// Runs `f` on a thread of its own and waits at most a minute for it: what is tested here must
/// end, with a result or an error, and never wait forever for a round.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("finished within a minute (no reader waits forever for a round)")
}

/// Several saves at once from one input distributed in rounds, started at varied moments, each
/// write the bytes of a save from the input distributed in one pass; then a digest, which reads
/// every round again after the saves let them go, gives the one-pass digest.
#[test]
fn saves_racing_over_rounds_write_what_one_pass_writes() {
    within_a_minute(|| {
        let d = tempfile::tempdir().unwrap();
        let (_, scratch, plain, dense) = open_plain(d.path(), 42);
        let one_pass =
            SourceTables::Plain(plain.tables_in_rounds(&scratch, 2, 4096, Some(1)).unwrap());
        save(
            d.path().join("ref"),
            save_input(&one_pass, &dense).unwrap(),
            &opts(3, 2),
        )
        .unwrap();
        let want = data_files(&d.path().join("ref"));
        let want_digest = source_digest(&one_pass, &dense).unwrap();
        drop(one_pass);

        for (iteration, (rounds, savers)) in [(2, 2), (3, 3), (8, 2), (64, 3), (5, 1)]
            .into_iter()
            .enumerate()
        {
            let tables = SourceTables::Plain(
                plain
                    .tables_in_rounds(&scratch, 1 + iteration % 2, 4096, Some(rounds))
                    .unwrap(),
            );
            std::thread::scope(|scope| {
                for s in 0..savers {
                    let (tables, dense, want) = (&tables, &dense, &want);
                    let dir = d.path().join(format!("s{s}"));
                    scope.spawn(move || {
                        std::thread::sleep(Duration::from_millis((s * 7 + iteration * 3) as u64));
                        save(
                            &dir,
                            save_input(tables, dense).unwrap(),
                            &opts(3, 1 + s % 2),
                        )
                        .unwrap();
                        assert!(
                            data_files(&dir) == *want,
                            "save {s} of {savers} over {rounds} rounds wrote other bytes"
                        );
                        std::fs::remove_dir_all(&dir).unwrap();
                    });
                }
            });
            assert_eq!(source_digest(&tables, &dense).unwrap(), want_digest);
        }
        assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    });
}

/// An input cut short after its ids were distributed: the rounds still to be made cannot be
/// read, and the save fails with an error naming the table, instead of waiting for them.
#[test]
fn an_input_cut_short_fails_the_save_instead_of_hanging() {
    let err = within_a_minute(|| {
        let d = tempfile::tempdir().unwrap();
        let (input, scratch, plain, dense) = open_plain(d.path(), 7);
        let tables =
            SourceTables::Plain(plain.tables_in_rounds(&scratch, 2, 4096, Some(16)).unwrap());
        let len = std::fs::metadata(&input).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&input)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let saved = save(
            d.path().join("ck"),
            save_input(&tables, &dense).unwrap(),
            &opts(2, 2),
        );
        let err = saved.expect_err("half the input is gone").to_string();
        // Nothing that looks like a checkpoint is left.
        assert!(Checkpoint::open(d.path().join("ck")).is_err());
        err
    });
    assert!(
        err.contains("t0"),
        "the error names the table or its tensor: {err}"
    );
}

/// Swaps the first two ids of `t0` in place in the input file: the file's size stays, its content
/// and change times do not.
fn swap_two_ids(input: &Path) {
    use std::os::unix::fs::FileExt;
    let bytes = std::fs::read(input).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = 8 + n + header["t0/ids"]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut two = bytes[at..at + 16].to_vec();
    two.rotate_left(8);
    let f = std::fs::OpenOptions::new().write(true).open(input).unwrap();
    f.write_all_at(&two, at as u64).unwrap();
}

/// The input rewritten in place (two ids swapped) after it was opened, before the save or while
/// it writes, distributed in 1, 2, 4 and 16 rounds: the save fails naming the table and the file,
/// and leaves no checkpoint; so does a digest of it.
#[test]
fn an_input_rewritten_in_place_fails_the_save_naming_the_table() {
    for rounds in [1usize, 2, 4, 16] {
        for during in [false, true] {
            let err = within_a_minute(move || {
                let d = tempfile::tempdir().unwrap();
                let (input, scratch, plain, dense) = open_plain(d.path(), 3);
                let tables = SourceTables::Plain(
                    plain
                        .tables_in_rounds(&scratch, 2, 4096, Some(rounds))
                        .unwrap(),
                );
                let mut o = opts(2, 2);
                if during {
                    let once = std::sync::Arc::new(std::sync::Once::new());
                    let input = input.clone();
                    o.progress = Some(std::sync::Arc::new(move |_| {
                        once.call_once(|| swap_two_ids(&input))
                    }));
                } else {
                    swap_two_ids(&input);
                }
                let saved = save(
                    d.path().join("ck"),
                    save_input(&tables, &dense).unwrap(),
                    &o,
                );
                let err = saved.expect_err("the input changed").to_string();
                assert!(Checkpoint::open(d.path().join("ck")).is_err());
                if !during {
                    let digest = source_digest(&tables, &dense).expect_err("changed");
                    assert!(digest.to_string().contains("changed"), "{digest}");
                }
                err
            });
            assert!(
                err.contains("t0") && err.contains("model.safetensors") && err.contains("changed"),
                "{rounds} rounds, during: {during}: {err}"
            );
        }
    }
}

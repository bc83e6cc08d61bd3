//! One load request for both kinds of table (`LoadRequest`, `Checkpoint::load`): every target of
//! a request, hashed tables, dense tensors, the caller's row buffers and whole row-range tables,
//! comes from one save while overwrites race it, locally and on the object store; and a target
//! that a check refuses leaves every other target of its request untouched.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use saver::io::LoadRequest;
use saver::{
    save, Checkpoint, DenseTensor, Dtype, EmbeddingTable, KeyDtype, LoadOptions, RowRangeChunk,
    RowsInto, SaveInput, SaveOptions, Shard, SlotSpec,
};

const ROWS: u64 = 4000;
const COLS: u64 = 8;

/// Version `v` of a model of both kinds, every value telling its version: a hashed table
/// `users`, a dense tensor `mlp`, row-range tables `emb` (two chunks) and `side`.
fn save_version(dir: &Path, v: u64, opts: &SaveOptions) {
    let users = EmbeddingTable::new(
        "users",
        KeyDtype::I64,
        vec![SlotSpec::new("e", Dtype::F32, vec![2])],
    )
    .unwrap();
    let row = [v as f32; 2];
    for id in 0..300u64 {
        users
            .insert(id * 7919, &[bytemuck::cast_slice(&row)])
            .unwrap();
    }
    let mlp = [v as f32; 6];
    let side = vec![v as f32; 1000];
    let mut input = SaveInput::new()
        .table(&users)
        .dense(DenseTensor::from_f32("mlp", vec![2, 3], &mlp).unwrap());
    for r in [0..1500, 1500..ROWS] {
        let vals: Vec<f32> = r
            .clone()
            .flat_map(|r| (0..COLS).map(move |c| (v * 100_000 + r * COLS + c) as f32))
            .collect();
        input = input.row_chunk(
            RowRangeChunk::new(
                "emb",
                "weight",
                Dtype::F32,
                vec![r.end - r.start, COLS],
                bytemuck::cast_slice::<f32, u8>(&vals).to_vec(),
            )
            .unwrap()
            .at(&[r.start, 0], &[ROWS, COLS])
            .unwrap(),
        );
    }
    input = input.row_chunk(RowRangeChunk::from_f32("side", "w", vec![1000], &side).unwrap());
    save(dir, input, opts).unwrap();
}

/// Reads one request of every kind of target; returns the one version all of it holds, or
/// panics naming the target that holds another.
fn load_one_version(ck: &Checkpoint, round: usize) -> u64 {
    let opts = LoadOptions::default();
    let (rows, cols) = (1000..3000u64, 2..6u64);
    let mut emb = vec![0f32; ((rows.end - rows.start) * (cols.end - cols.start)) as usize];
    let loaded = ck
        .load(
            LoadRequest::columns(&opts)
                .rows(
                    "emb",
                    rows.clone(),
                    [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut emb))
                        .columns(cols.clone())],
                )
                .row_tables(Shard { index: 1, count: 2 }),
        )
        .unwrap();
    let v = emb[0] as u64 / 100_000;
    for (i, &x) in emb.iter().enumerate() {
        let (r, c) = (rows.start + i as u64 / 4, cols.start + i as u64 % 4);
        assert_eq!(
            x,
            (v * 100_000 + r * COLS + c) as f32,
            "round {round}: emb row {r} col {c}"
        );
    }
    let users = &loaded.columns[0];
    assert_eq!(users.ids.len(), 300, "round {round}");
    let e: &[f32] = bytemuck::cast_slice(&users.data[0]);
    assert!(
        e.iter().all(|&x| x == v as f32),
        "round {round}: users holds {:?}, emb version {v}",
        e[0]
    );
    let mlp: &[f32] = bytemuck::cast_slice(&loaded.dense[0].data);
    assert_eq!(mlp, [v as f32; 6], "round {round}: mlp");
    let side = loaded.row_tables.iter().find(|t| t.name == "side").unwrap();
    assert_eq!(side.rows, 500..1000);
    let w: &[f32] = bytemuck::cast_slice(&side.slots[0].values);
    assert!(
        w.iter().all(|&x| x == v as f32),
        "round {round}: side holds {}, emb version {v}",
        w[0]
    );
    assert!(loaded.rows.bytes_wanted > 0 && loaded.report.rows == 300);
    v
}

/// Loads of one request race a writer overwriting `dir` with new versions, for `rounds` loads;
/// the writer pauses `pause` plus up to 40 ms between saves (on a remote store, longer than a
/// load takes, ~0.3 s here: a load that a commit cuts, whose files that commit removed, is read
/// again from the start and can finish before the next).
fn race(dir: &Path, rounds: usize, pause: u64) {
    let opts = SaveOptions {
        overwrite: true,
        durable: false,
        ..Default::default()
    };
    save_version(dir, 0, &opts);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut v = 1;
            while !stop.load(Ordering::Relaxed) && v < 2000 {
                save_version(dir, v, &opts);
                std::thread::sleep(std::time::Duration::from_millis(pause + v * 37 % 40));
                v += 1;
            }
            v
        });
        /// Stops the writer however this thread leaves the scope, a failed assertion too.
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stopping = Stop(&stop);
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..rounds {
            // Opened once, then read while the writer replaces it.
            let ck = Checkpoint::open(dir).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(round as u64 * 13 % 30));
            seen.insert(load_one_version(&ck, round));
        }
        drop(stopping);
        let saved = writer.join().unwrap();
        assert!(saved > 2, "the overwrites raced the loads ({saved} saves)");
        assert!(seen.len() > 1, "every load read one version: {seen:?}");
        eprintln!("{rounds} loads saw versions {seen:?} while {saved} saves replaced them");
    });
}

#[test]
fn one_request_reads_every_target_from_one_save_while_overwrites_race_it() {
    let d = tempfile::tempdir().unwrap();
    race(&d.path().join("ck"), 60, 0);
}

#[test]
fn one_request_reads_every_target_from_one_save_while_overwrites_race_it_on_the_store() {
    let Some(g) = crate::common::garage::shared() else {
        return;
    };
    let url = g.url("load-request/race");
    race(Path::new(&url), 16, 600);
}

#[test]
fn a_target_a_check_refuses_leaves_the_request_s_other_targets_untouched() {
    let d = tempfile::tempdir().unwrap();
    save_version(d.path(), 3, &SaveOptions::default());
    let ck = Checkpoint::open(d.path()).unwrap();
    let opts = LoadOptions::default();
    let sentinel = -7.0f32;
    /// A target over the buffer given that one check refuses.
    type Bad = fn(&mut [u8]) -> RowsInto<'_>;
    let cases: [(&str, Bad, &str); 3] = [
        (
            "no such slot",
            |b| RowsInto::new("nope", b),
            "no slot \"nope\"",
        ),
        (
            "columns past the slot's",
            |b| RowsInto::new("weight", b).columns(6..10),
            "columns 6..10",
        ),
        (
            "a buffer of the wrong size",
            |b| RowsInto::new("weight", &mut b[..12]),
            "the buffer has 12 bytes",
        ),
    ];
    for (what, bad, says) in cases {
        let mut good = vec![sentinel; 10 * COLS as usize];
        let mut other = vec![sentinel; 4 * COLS as usize];
        let users = EmbeddingTable::new(
            "users",
            KeyDtype::I64,
            vec![SlotSpec::new("e", Dtype::F32, vec![2])],
        )
        .unwrap();
        let sink_for = |t: &saver::core::manifest::TableManifest| {
            (t.name == "users").then_some(&users as &dyn saver::io::TableSink)
        };
        let err = ck
            .load(
                LoadRequest::sinks(&opts, 0, &sink_for)
                    .rows(
                        "emb",
                        0..10,
                        [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut good))],
                    )
                    .rows("emb", 20..24, [bad(bytemuck::cast_slice_mut(&mut other))]),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{what}: {err}");
        assert!(
            good.iter().all(|&x| x == sentinel),
            "{what}: a buffer was filled"
        );
        assert_eq!(
            saver::SparseTable::len(&users),
            0,
            "{what}: a sink was filled"
        );
    }
    // The same request, well formed, fills them all.
    let mut good = vec![sentinel; 10 * COLS as usize];
    let loaded = ck
        .load(LoadRequest::dense_only(&opts).rows(
            "emb",
            0..10,
            [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut good))],
        ))
        .unwrap();
    assert_eq!(good[9], (3 * 100_000 + 9) as f32);
    assert_eq!(loaded.dense.len(), 1);
    assert_eq!(loaded.step, None);
    assert!(loaded.columns.is_empty() && loaded.shards.is_empty());
}

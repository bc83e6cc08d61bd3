//! Row-range tables: chunks given by any number of processes, any mix of row and column splits,
//! committed only when they tile every slot, and read back for any range straight into the
//! caller's buffers, reading only about the bytes asked for.

use std::ops::Range;

use proptest::prelude::*;
use saver::core::row_range::chunk_tensor_name;
use saver::{
    save, verify, Checkpoint, Dtype, Error, RowRangeChunk, RowsInto, SaveInput, SaveOptions, Shard,
    Status,
};

/// The value of row `r`, column `c` of slot `s`: every element distinct.
fn value(s: u64, r: u64, c: u64) -> f32 {
    (s * 1_000_000 + r * 100 + c) as f32
}

/// Chunk `rows × cols` of slot `slot` (whole shape `whole`) with its values.
fn chunk(slot: &str, whole: &[u64], rows: Range<u64>, cols: Range<u64>) -> RowRangeChunk<'static> {
    let s = u64::from(slot == "state");
    let mut v = Vec::new();
    for r in rows.clone() {
        for c in cols.clone() {
            v.push(value(s, r, c));
        }
    }
    let bytes: Vec<u8> = bytemuck::cast_slice(&v).to_vec();
    let (shape, offset) = if whole.len() == 1 {
        (vec![rows.end - rows.start], vec![rows.start])
    } else {
        (
            vec![rows.end - rows.start, cols.end - cols.start],
            vec![rows.start, cols.start],
        )
    };
    RowRangeChunk::new("emb", slot, Dtype::F32, shape, bytes)
        .unwrap()
        .at(&offset, whole)
        .unwrap()
}

/// Cuts `0..n` at `cuts` (taken modulo n + 1).
fn ranges(n: u64, cuts: &[u64]) -> Vec<Range<u64>> {
    let mut e: Vec<u64> = cuts.iter().map(|c| c % (n + 1)).collect();
    e.extend([0, n]);
    e.sort_unstable();
    e.dedup();
    e.windows(2).map(|w| w[0]..w[1]).collect()
}

/// Saves a table `emb` of `rows` rows: slot `weight` of `cols` columns cut into a grid at
/// `row_cuts` × `col_cuts`, slot `state` (one value per row) cut at `row_cuts`; the chunks dealt
/// to `writers` processes, each saving its shard; returns when committed.
fn save_split(
    dir: &std::path::Path,
    rows: u64,
    cols: u64,
    row_cuts: &[u64],
    col_cuts: &[u64],
    writers: u32,
) {
    let mut chunks: Vec<RowRangeChunk<'static>> = Vec::new();
    for r in ranges(rows, row_cuts) {
        for c in ranges(cols, col_cuts) {
            chunks.push(chunk("weight", &[rows, cols], r.clone(), c));
        }
        chunks.push(chunk("state", &[rows], r, 0..1));
    }
    let mut per: Vec<Vec<RowRangeChunk<'static>>> = (0..writers).map(|_| Vec::new()).collect();
    for (i, c) in chunks.into_iter().enumerate() {
        per[i % writers as usize].push(c);
    }
    let id = format!("rr{writers}-{}", row_cuts.len() * 10 + col_cuts.len());
    std::thread::scope(|s| {
        for (w, mine) in per.into_iter().enumerate() {
            let id = id.clone();
            s.spawn(move || {
                let mut input = SaveInput::new();
                input.row_chunks = mine;
                let opts = SaveOptions::for_shard(
                    Shard {
                        index: w as u32,
                        count: writers,
                    },
                    id,
                );
                save(dir, input, &opts).unwrap();
            });
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any save split (1 to 3 writers, any mix of row and column chunks) reads back exactly for
    /// any load split (ranges of rows and columns), reading no more than the bytes asked for
    /// plus, per chunk read, what completes its checked blocks.
    #[test]
    fn any_save_split_reads_back_exactly_for_any_load_split(
        rows in 1u64..300, cols in 1u64..12,
        row_cuts in proptest::collection::vec(0u64..320, 0..4),
        col_cuts in proptest::collection::vec(0u64..14, 0..3),
        writers in 1u32..4,
        loads in proptest::collection::vec((0u64..320, 0u64..320, 0u64..14, 0u64..14), 1..5),
    ) {
        let d = tempfile::tempdir().unwrap();
        save_split(d.path(), rows, cols, &row_cuts, &col_cuts, writers);
        let ck = Checkpoint::open(d.path()).unwrap();
        let t = ck.row_table("emb").expect("committed with its table");
        prop_assert_eq!(t.rows, rows);
        for (a, b, x, y) in loads {
            let (a, b) = (a.min(b) % (rows + 1), a.max(b) % (rows + 1));
            let (a, b) = (a.min(b), a.max(b));
            let (x, y) = (x.min(y) % (cols + 1), x.max(y) % (cols + 1));
            let (x, y) = (x.min(y), x.max(y));
            let mut w = vec![0f32; ((b - a) * (y - x)) as usize];
            let mut st = vec![0f32; (b - a) as usize];
            let loaded = ck.load_rows("emb", a..b, &mut [
                RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)).columns(x..y),
                RowsInto::new("state", bytemuck::cast_slice_mut(&mut st)),
            ]).unwrap();
            for r in a..b {
                for c in x..y {
                    prop_assert_eq!(w[((r - a) * (y - x) + (c - x)) as usize], value(0, r, c));
                }
                prop_assert_eq!(st[(r - a) as usize], value(1, r, 0));
            }
            prop_assert_eq!(loaded.bytes_wanted, ((b - a) * (y - x) + (b - a)) * 4);
            prop_assert!(loaded.bytes_read >= loaded.bytes_wanted);
        }
        prop_assert_eq!(verify(d.path(), 2).unwrap().status, Status::Ok);
    }
}

/// Whole-row loads of a large table read what they ask for (the checked blocks' edges aside):
/// a resharding load from 2 row shards to 3 reads at most 1.05 times the bytes it keeps.
#[test]
fn a_resharding_load_reads_about_the_bytes_it_keeps() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (60_000u64, 64u64);
    save_split(d.path(), rows, cols, &[rows / 2], &[], 2);
    let ck = Checkpoint::open(d.path()).unwrap();
    let (mut wanted, mut read) = (0, 0);
    for j in 0..3u64 {
        let r = rows * j / 3..rows * (j + 1) / 3;
        let mut w = vec![0f32; ((r.end - r.start) * cols) as usize];
        let mut st = vec![0f32; (r.end - r.start) as usize];
        let l = ck
            .load_rows(
                "emb",
                r.clone(),
                &mut [
                    RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)),
                    RowsInto::new("state", bytemuck::cast_slice_mut(&mut st)),
                ],
            )
            .unwrap();
        assert_eq!(w[0], value(0, r.start, 0));
        assert_eq!(*w.last().unwrap(), value(0, r.end - 1, cols - 1));
        wanted += l.bytes_wanted;
        read += l.bytes_read;
    }
    assert!(
        read as f64 <= 1.05 * wanted as f64,
        "read {read} for {wanted}"
    );
}

/// Chunks that overlap, or leave rows that no process gave, never commit: the commit names the
/// slot and what is wrong. Overlap within one process is refused before anything is written.
#[test]
fn overlapping_or_gapped_chunks_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (100, 4);
    let two = |dir: &std::path::Path,
               id: &str,
               a: Range<u64>,
               b: Range<u64>|
     -> Vec<Result<saver::SaveReport, Error>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = [a, b]
                .into_iter()
                .enumerate()
                .map(|(w, r)| {
                    let id = id.to_string();
                    s.spawn(move || {
                        let input =
                            SaveInput::new().row_chunk(chunk("weight", &[rows, cols], r, 0..cols));
                        save(
                            dir,
                            input,
                            &SaveOptions::for_shard(
                                Shard {
                                    index: w as u32,
                                    count: 2,
                                },
                                id,
                            ),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let overlap = two(&d.path().join("o"), "ov", 0..60, 50..100);
    let e = overlap
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("refused")
        .to_string();
    assert!(e.contains("\"weight\"") && e.contains("overlap"), "{e}");
    assert!(!Checkpoint::open(d.path().join("o")).is_ok_and(|c| c.row_table("emb").is_some()));
    let gap = two(&d.path().join("g"), "gp", 0..40, 50..100);
    let e = gap
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("refused")
        .to_string();
    assert!(e.contains("\"weight\"") && e.contains("cover"), "{e}");

    let input = SaveInput::new()
        .row_chunk(chunk("weight", &[rows, cols], 0..60, 0..cols))
        .row_chunk(chunk("weight", &[rows, cols], 40..100, 0..cols));
    let e = save(d.path().join("one"), input, &SaveOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("overlap"), "{e}");
    assert!(!d.path().join("one").exists());
}

/// A chunk whose bytes changed on disk fails the load of any range that reads it, naming the
/// tensor, and fails verify; ranges that do not touch it still load.
/// Slot `weight` of table `emb`, as the checkpoint's manifest holds it.
fn weight_slot(ck: &Checkpoint) -> saver::core::manifest::RowSlotManifest {
    ck.row_table("emb")
        .unwrap()
        .slots
        .iter()
        .find(|s| s.name == "weight")
        .unwrap()
        .clone()
}

#[test]
fn a_corrupt_chunk_is_named_by_load_and_verify() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (2000u64, 16u64);
    save_split(d.path(), rows, cols, &[1000], &[], 1);
    let ck = Checkpoint::open(d.path()).unwrap();
    let slot = &weight_slot(&ck);
    let second = slot.chunks.iter().find(|c| c.offset == [1000, 0]).unwrap();
    assert_eq!(
        second.tensor.name,
        chunk_tensor_name("emb", "weight", &[1000, 0])
    );
    let file = d.path().join(&second.tensor.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[(second.tensor.offset + 4 * 16 * 700) as usize] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let mut w = vec![0f32; (10 * cols) as usize];
    let e = ck
        .load_rows(
            "emb",
            1695..1705,
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w))],
        )
        .unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains(&second.tensor.name), "{e}");
    ck.load_rows(
        "emb",
        10..20,
        &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w))],
    )
    .unwrap();
    let report = verify(d.path(), 2).unwrap();
    assert_ne!(report.status, Status::Ok);
}

/// A chunk of several read parts (a load of whole rows reads and checks 8 MiB of a tensor at a
/// time on each thread): ranges across the parts' edges come back exact, and a corrupt byte in
/// a middle part fails the loads that read it, not those that do not.
#[test]
fn a_large_chunk_reads_back_across_its_read_parts_and_its_corruption_is_found() {
    let d = tempfile::tempdir().unwrap();
    // 80 000 rows of 64 f32: 20 MB in one chunk, three parts.
    let (rows, cols) = (80_000u64, 64u64);
    save_split(d.path(), rows, cols, &[], &[], 1);
    let ck = Checkpoint::open(d.path()).unwrap();
    let row_bytes = cols * 4;
    let part_rows = (8 << 20) / row_bytes;
    let load = |ck: &Checkpoint, r: Range<u64>| {
        let mut w = vec![0f32; ((r.end - r.start) * cols) as usize];
        ck.load_rows(
            "emb",
            r.clone(),
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w))],
        )
        .map(|_| w)
    };
    for r in [
        0..rows,
        part_rows - 1..part_rows + 1,
        7..2 * part_rows + 3,
        part_rows..rows,
        rows - 1..rows,
    ] {
        let w = load(&ck, r.clone()).unwrap();
        let want: Vec<f32> = r
            .clone()
            .flat_map(|row| (0..cols).map(move |c| value(0, row, c)))
            .collect();
        assert!(w == want, "rows {r:?}");
    }
    let weight = weight_slot(&ck).chunks[0].tensor.clone();
    let file = d.path().join(&weight.file);
    let mut bytes = std::fs::read(&file).unwrap();
    let bad_row = part_rows + part_rows / 2;
    bytes[(weight.offset + bad_row * row_bytes + 5) as usize] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    for r in [0..rows, bad_row..bad_row + 1, part_rows..2 * part_rows] {
        let e = load(&ck, r.clone()).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "rows {r:?}: {e}");
        assert!(e.to_string().contains(&weight.name), "{e}");
    }
    for r in [0..part_rows, 2 * part_rows..rows] {
        load(&ck, r.clone()).unwrap_or_else(|e| panic!("rows {r:?}: {e}"));
    }
}

/// A checkpoint of both kinds: the hashed tables and dense tensors restore as ever, the
/// row-range table loads by range; a reshard and a delta carry both.
#[test]
fn a_checkpoint_of_both_kinds_loads_reshards_and_takes_deltas() {
    let d = tempfile::tempdir().unwrap();
    let hashed = crate::common::table(
        "users",
        saver::KeyDtype::I64,
        vec![saver::SlotSpec::new("e", Dtype::F32, vec![2])],
        &[1, 2, 3],
    );
    let mlp = [0.5f32; 6];
    let input = SaveInput::new()
        .table(&hashed)
        .dense(saver::DenseTensor::from_f32("mlp", vec![2, 3], &mlp).unwrap())
        .row_chunk(chunk("weight", &[50, 3], 0..50, 0..3));
    save(d.path(), input, &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    assert_eq!(
        ck.manifest().format_version,
        saver::core::manifest::ROW_RANGE_FORMAT_VERSION
    );
    let r = ck.restore(&saver::LoadOptions::default()).unwrap();
    assert_eq!(r.shards[0].tables.len(), 1);
    assert_eq!(r.dense.len(), 1);
    // The row-range table's last row, by range.
    let last_row_is_back = |ck: &Checkpoint| {
        let mut w = vec![0f32; 3];
        ck.load_rows(
            "emb",
            49..50,
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w))],
        )
        .unwrap();
        assert_eq!(w, [value(0, 49, 0), value(0, 49, 1), value(0, 49, 2)]);
    };
    last_row_is_back(&ck);
    let refused = |e: Error| assert!(e.to_string().contains("row-range tables [\"emb\"]"), "{e}");
    // An export writes each slot of a row-range table as one tensor of its whole shape.
    let x = d.path().join("x");
    saver::export(&ck, &x, &saver::ExportOptions::default()).unwrap();
    let exported = exported_tensors(&x);
    let (dtype, shape, bytes) = &exported["emb/weight"];
    assert_eq!(
        (*dtype, shape.as_slice()),
        (safetensors::Dtype::F32, &[50usize, 3][..])
    );
    let values: Vec<f32> = bytemuck::cast_slice(bytes).to_vec();
    assert_eq!(values[49 * 3 + 2], value(0, 49, 2));
    assert!(exported.contains_key("users/ids") && exported.contains_key("mlp"));
    // Resharded, and a delta of it: both kinds carried.
    let mut two = SaveOptions::default();
    two.plan.shard_num = 2;
    let r = d.path().join("r");
    saver::io::tools::reshard::reshard(&ck, &r, &two).unwrap();
    assert_eq!(digest_at(&r), digest_at(d.path()));
    let delta = d.path().join("delta");
    let more = crate::common::table(
        "users",
        saver::KeyDtype::I64,
        vec![saver::SlotSpec::new("e", Dtype::F32, vec![2])],
        &[1, 2, 3, 4],
    );
    let input = SaveInput::new()
        .table(&more)
        .dense(saver::DenseTensor::from_f32("mlp", vec![2, 3], &mlp).unwrap())
        .row_chunk(chunk("weight", &[50, 3], 0..50, 0..3));
    save(
        &delta,
        input,
        &SaveOptions {
            parent: Some(d.path().into()),
            ..Default::default()
        },
    )
    .unwrap();
    let ck = Checkpoint::open(&delta).unwrap();
    assert_eq!(ck.links().len(), 2);
    let r = ck.restore(&saver::LoadOptions::default()).unwrap();
    assert_eq!(r.shards[0].tables[0].len(), 4);
    last_row_is_back(&ck);
    refused(ck.refuse_row_tables("digest version 1").unwrap_err());
}

/// The digest covers row-range tables: equal for one content saved by any split and any number
/// of writers, different when one value differs.
#[test]
fn the_digest_of_a_row_range_table_depends_on_its_values_not_its_split() {
    let d = tempfile::tempdir().unwrap();
    save_split(&d.path().join("a"), 500, 8, &[100, 300], &[4], 3);
    save_split(&d.path().join("b"), 500, 8, &[250], &[], 1);
    assert_eq!(
        digest_at(&d.path().join("a")),
        digest_at(&d.path().join("b"))
    );
    let one = chunk("weight", &[500, 8], 0..500, 0..8);
    let mut v: Vec<f32> = bytemuck::cast_slice(one.values().data().unwrap()).to_vec();
    v[7] += 1.0;
    let changed = RowRangeChunk::new(
        "emb",
        "weight",
        Dtype::F32,
        vec![500, 8],
        bytemuck::cast_slice(&v).to_vec(),
    )
    .unwrap()
    .at(&[0, 0], &[500, 8])
    .unwrap();
    let input = SaveInput::new()
        .row_chunk(changed)
        .row_chunk(chunk("state", &[500], 0..500, 0..1));
    save(d.path().join("c"), input, &SaveOptions::default()).unwrap();
    assert_ne!(
        digest_at(&d.path().join("a")),
        digest_at(&d.path().join("c"))
    );
}

/// On the object store (a real Garage server) as on a disk: three writers' chunks, one commit,
/// any range read back exactly, verify and the digest as for the same split saved locally.
#[test]
fn row_range_tables_round_trip_through_the_object_store() {
    let Some(g) = crate::common::garage::shared() else {
        return;
    };
    let url = g.url("row-range/ck");
    let remote = std::path::Path::new(&url);
    save_split(remote, 5000, 8, &[1000, 3000], &[4], 3);
    let local = tempfile::tempdir().unwrap();
    save_split(local.path(), 5000, 8, &[2500], &[], 1);
    let ck = Checkpoint::open(remote).unwrap();
    let mut w = vec![0f32; 2000 * 3];
    let loaded = ck
        .load_rows(
            "emb",
            900..2900,
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)).columns(3..6)],
        )
        .unwrap();
    assert!(loaded.chunks >= 4, "{loaded:?}");
    for r in 900..2900u64 {
        for c in 3..6u64 {
            assert_eq!(w[((r - 900) * 3 + c - 3) as usize], value(0, r, c));
        }
    }
    assert_eq!(verify(remote, 2).unwrap().status, Status::Ok);
    assert_eq!(digest_at(remote), digest_at(local.path()));
}

/// A checkpoint manager saves a model with row-range tables as its policy says, deltas
/// included, and its newest step loads by range; a step without them holds none.
#[test]
fn a_manager_saves_row_range_tables_in_deltas_too() {
    let d = tempfile::tempdir().unwrap();
    let m = saver::CheckpointManager::open(d.path(), saver::Policy::default()).unwrap();
    for step in [100, 200] {
        let input = SaveInput::new()
            .row_chunk(chunk("weight", &[300, 4], 0..300, 0..4))
            .row_chunk(chunk("state", &[300], 0..300, 0..1));
        let saved = m.save(step, input, &SaveOptions::default()).unwrap();
        if step == 200 {
            assert_eq!(saved.full_because, None);
        }
    }
    let latest = m
        .steps()
        .unwrap()
        .into_iter()
        .find(|s| s.step == 200)
        .expect("step 200");
    assert_eq!((latest.step, latest.links), (200, 2));
    let mut st = vec![0f32; 10];
    Checkpoint::open(&latest.path)
        .unwrap()
        .load_rows(
            "emb",
            290..300,
            &mut [RowsInto::new("state", bytemuck::cast_slice_mut(&mut st))],
        )
        .unwrap();
    assert_eq!(st[9], value(1, 299, 0));
    let users = crate::common::table(
        "users",
        saver::KeyDtype::I64,
        vec![saver::SlotSpec::new("e", Dtype::F32, vec![2])],
        &[1, 2, 3],
    );
    m.save(300, SaveInput::new().table(&users), &SaveOptions::default())
        .unwrap();
    let step = m
        .steps()
        .unwrap()
        .into_iter()
        .find(|s| s.step == 300)
        .unwrap();
    assert!(Checkpoint::open(&step.path)
        .unwrap()
        .manifest()
        .row_tables
        .is_empty());
}

/// A reader trusts no manifest: re-sealed with chunks that trade places, overlap, leave a gap,
/// fall outside their slot or disagree with their tensor, or with a version that does not say "row-range
/// tables", the checkpoint is refused as corrupt, naming what is wrong, before a byte is read.
#[test]
fn a_resealed_manifest_whose_chunks_do_not_tile_is_refused() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit); 7] = [
        // Two chunks of one shape trade offsets: they still tile the slot.
        ("whose name says another place", |m| {
            let c = &mut m["row_tables"][0]["slots"][1]["chunks"];
            let first = c[0]["offset"].clone();
            c[0]["offset"] = c[1]["offset"].clone();
            c[1]["offset"] = first;
        }),
        ("overlap", |m| {
            m["row_tables"][0]["slots"][1]["chunks"][1]["offset"][0] = serde_json::json!(100);
        }),
        ("cover", |m| {
            let c = m["row_tables"][0]["slots"][1]["chunks"]
                .as_array_mut()
                .unwrap();
            c.pop();
        }),
        ("outside", |m| {
            m["row_tables"][0]["slots"][1]["chunks"][1]["offset"][1] = serde_json::json!(7);
        }),
        ("is not", |m| {
            m["row_tables"][0]["slots"][1]["chunks"][0]["tensor"]["dtype"] =
                serde_json::json!("F64");
        }),
        ("format version", |m| {
            m["format_version"] = serde_json::json!(1);
        }),
        // A chunk made a patch (of no changed rows): a full checkpoint has no parent.
        ("changed rows of a parent", |m| {
            let slot = &mut m["row_tables"][0]["slots"][1];
            let c = slot["chunks"].as_array_mut().unwrap().pop().unwrap();
            slot["patches"] = serde_json::json!([{
                "shard": c["shard"], "offset": c["offset"], "shape": c["tensor"]["shape"],
            }]);
        }),
    ];
    for (want, edit) in cases {
        let d = tempfile::tempdir().unwrap();
        // Chunks of "weight" at rows 0 and 250.
        save_split(d.path(), 500, 8, &[250], &[], 1);
        crate::common::reseal(d.path(), edit);
        let e = match Checkpoint::open(d.path()) {
            Ok(_) => panic!("{want}: opened"),
            Err(e) => e,
        };
        assert!(matches!(e, Error::Corrupt { .. }), "{want}: {e}");
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
}

/// A background save of row-range chunks is of the moment it returns: the caller's buffers may
/// change at once, and the checkpoint holds what they held.
#[test]
fn a_background_save_of_row_range_chunks_holds_the_moment_it_returned() {
    let d = tempfile::tempdir().unwrap();
    let mut values: Vec<f32> = (0..4000).map(|v| v as f32).collect();
    // Borrowed: the background save copies it before it returns.
    let chunk = RowRangeChunk::from_f32("emb", "weight", vec![1000, 4], &values).unwrap();
    let handle = saver::save_async(
        d.path(),
        SaveInput::new().row_chunk(chunk),
        SaveOptions::default(),
    )
    .unwrap();
    values.iter_mut().for_each(|v| *v = -1.0);
    handle.wait().unwrap();
    let mut back = vec![0f32; 4000];
    Checkpoint::open(d.path())
        .unwrap()
        .load_rows(
            "emb",
            0..1000,
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut back))],
        )
        .unwrap();
    assert!(back.iter().enumerate().all(|(i, &v)| v == i as f32));
}

/// What `saver digest PATH` prints for `path`.
fn digest_at(path: &std::path::Path) -> String {
    use saver::io::tools::digest::{digest, Content, DigestVersion};
    digest(Content::At { path, parallel: 1 }, DigestVersion::V2).unwrap()
}

/// Every tensor of the export in `dir`: name -> (dtype, shape, bytes).
fn exported_tensors(
    dir: &std::path::Path,
) -> std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.tensors() {
                out.insert(name, (t.dtype(), t.shape().to_vec(), t.data().to_vec()));
            }
        }
    }
    out
}

/// An export of a row-range table split in rows and columns by three writers gives the whole
/// slot, cast to f16 when asked, or quantized row-wise (int8, fused) like a table's slot: each
/// row's values within half a step of the saved ones.
#[test]
fn an_export_consolidates_a_row_range_table_cast_or_quantized() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (3000u64, 8u64);
    save_split(d.path(), rows, cols, &[700, 2100], &[3], 3);
    let ck = Checkpoint::open(d.path()).unwrap();
    let o = saver::ExportOptions {
        dtype: Some(Dtype::F16),
        ..Default::default()
    };
    saver::export(&ck, &d.path().join("f16"), &o).unwrap();
    let t = exported_tensors(&d.path().join("f16"));
    let (dtype, shape, bytes) = &t["emb/weight"];
    assert_eq!(
        (*dtype, shape.as_slice()),
        (safetensors::Dtype::F16, &[3000usize, 8][..])
    );
    let whole: Vec<f32> = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| value(0, r, c)))
        .collect();
    let want =
        saver::core::cast::cast(bytemuck::cast_slice(&whole), Dtype::F32, Dtype::F16).unwrap();
    assert!(
        bytes == &want,
        "the f16 export is the cast of every saved value"
    );
    assert_eq!(t["emb/state"].1, vec![3000]);
    let q = saver::ExportOptions {
        quantize: Some(saver::core::quantize::Quantization {
            bits: saver::core::quantize::QuantBits::Int8,
            layout: saver::core::quantize::QuantLayout::Fused,
        }),
        quantize_slots: vec!["weight".into()],
        ..Default::default()
    };
    saver::export(&ck, &d.path().join("q"), &q).unwrap();
    let t = exported_tensors(&d.path().join("q"));
    let (dtype, shape, fused) = &t["emb/weight"];
    assert_eq!(
        (*dtype, shape.as_slice()),
        (safetensors::Dtype::U8, &[3000usize, 16][..])
    );
    // FBGEMM's 8-bit rows: 8 values, then scale and bias (f32).
    for r in [0u64, 699, 700, 2999] {
        let row = &fused[(r * 16) as usize..(r * 16 + 16) as usize];
        let scale = f32::from_le_bytes(row[8..12].try_into().unwrap());
        let bias = f32::from_le_bytes(row[12..16].try_into().unwrap());
        for c in 0..cols {
            let got = f32::from(row[c as usize]) * scale + bias;
            // Half a step, and the rounding of f32 arithmetic at these magnitudes (~7e4).
            let v = value(0, r, c);
            assert!(
                (got - v).abs() <= scale / 2.0 + v.abs() * 1e-6,
                "row {r} col {c}: {got}"
            );
        }
    }
    // The unquantized slot stays as it was.
    let (_, _, state) = &t["emb/state"];
    let state: Vec<f32> = bytemuck::cast_slice(state).to_vec();
    assert!((0..rows).all(|r| state[r as usize] == value(1, r, 0)));
}

/// A row-range table of 0 rows or 0 columns is a table: kept in the checkpoint with its slot's
/// shape (before, dropped: a model with an `nn.Embedding(0, 4)` saved and then failed to load),
/// read as nothing, verified, and a delta of it is a checkpoint too.
#[test]
fn empty_row_range_tables_are_kept() {
    let d = tempfile::tempdir().unwrap();
    let chunks = [
        RowRangeChunk::from_f32("none", "weight", vec![0, 4], &[]).unwrap(),
        RowRangeChunk::from_f32("narrow", "weight", vec![5, 0], &[]).unwrap(),
        RowRangeChunk::from_f32("some", "weight", vec![2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap(),
    ];
    let mut input = SaveInput::new();
    input.row_chunks = chunks.to_vec();
    saver::save(d.path().join("full"), input, &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(d.path().join("full")).unwrap();
    for (table, shape) in [
        ("none", vec![0, 4]),
        ("narrow", vec![5, 0]),
        ("some", vec![2, 2]),
    ] {
        let t = ck
            .row_table(table)
            .unwrap_or_else(|| panic!("{table} was dropped"));
        assert_eq!(t.slots[0].shape, shape, "{table}");
    }
    let mut nothing: [u8; 0] = [];
    ck.load_rows("narrow", 0..5, &mut [RowsInto::new("weight", &mut nothing)])
        .unwrap();
    ck.load_rows("none", 0..0, &mut [RowsInto::new("weight", &mut nothing)])
        .unwrap();
    assert_eq!(
        saver::verify(d.path().join("full"), 1).unwrap().status,
        saver::Status::Ok
    );
    let mut input = SaveInput::new();
    input.row_chunks = chunks.to_vec();
    saver::save(
        d.path().join("delta"),
        input,
        &SaveOptions {
            parent: Some(d.path().join("full")),
            ..Default::default()
        },
    )
    .unwrap();
    let delta = Checkpoint::open(d.path().join("delta")).unwrap();
    assert!(delta.row_table("none").is_some() && delta.row_table("narrow").is_some());
    assert_eq!(
        saver::verify(d.path().join("delta"), 1).unwrap().status,
        saver::Status::Ok
    );
}

/// Bytes in memory, lent as a [`saver::core::ByteSource`] that records every read.
#[derive(Debug)]
struct Recorded {
    bytes: Vec<u8>,
    reads: std::sync::Mutex<Vec<Range<u64>>>,
    fail: bool,
}

impl saver::core::ByteSource for Recorded {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> saver::core::Result<()> {
        if self.fail {
            return Err(saver::core::Error::InvalidOption {
                option: "source",
                why: "the source went away".into(),
            });
        }
        let at = offset as usize;
        out.copy_from_slice(&self.bytes[at..at + out.len()]);
        self.reads
            .lock()
            .unwrap()
            .push(offset..offset + out.len() as u64);
        Ok(())
    }
}

/// The data files of the checkpoint in `dir`, by name, with their bytes.
fn data_files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// A chunk whose bytes are read on demand (what `reshard`, `compact` and `save --from` give)
    /// is saved as the same chunk in memory is, byte for byte, while the save reads each of its
    /// bytes once, a writer's chunk at a time, never the whole.
    #[test]
    fn chunks_read_on_demand_save_the_bytes_of_chunks_in_memory_a_writer_chunk_at_a_time(
        rows in 1u64..3000, cols in 1u64..24,
        row_cuts in proptest::collection::vec(0u64..3200, 0..3),
        shards in 1u32..4,
        chunk_bytes in 4096u64..12288,
    ) {
        let whole = [rows, cols];
        let in_memory: Vec<RowRangeChunk<'static>> = ranges(rows, &row_cuts)
            .into_iter()
            .map(|r| chunk("weight", &whole, r, 0..cols))
            .collect();
        let sources: Vec<std::sync::Arc<Recorded>> = in_memory
            .iter()
            .map(|c| std::sync::Arc::new(Recorded {
                bytes: c.values().data().unwrap().to_vec(),
                reads: Default::default(),
                fail: false,
            }))
            .collect();
        let deferred: Vec<RowRangeChunk<'_>> = in_memory
            .iter()
            .zip(&sources)
            .map(|(c, s)| {
                RowRangeChunk::of_rows_deferred(
                    "emb", "weight", Dtype::F32, &whole, c.rows(),
                    std::sync::Arc::clone(s) as std::sync::Arc<dyn saver::core::ByteSource>,
                ).unwrap()
            })
            .collect();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut opts = SaveOptions { save_id: Some("same".into()), ..Default::default() };
        opts.plan.shard_num = shards;
        opts.plan.chunk_bytes = chunk_bytes;
        let mut input = SaveInput::new();
        input.row_chunks = in_memory;
        save(a.path(), input, &opts).unwrap();
        let mut input = SaveInput::new();
        input.row_chunks = deferred;
        save(b.path(), input, &opts).unwrap();
        prop_assert_eq!(data_files(a.path()), data_files(b.path()));
        for s in &sources {
            let mut reads = s.reads.lock().unwrap().clone();
            reads.sort_by_key(|r| r.start);
            let mut at = 0;
            for r in &reads {
                prop_assert_eq!(r.start, at, "each byte read once, none skipped");
                prop_assert!(r.end - r.start <= chunk_bytes, "a read of {:?}", r);
                at = r.end;
            }
            prop_assert_eq!(at, s.bytes.len() as u64);
        }
    }
}

/// A chunk read on demand whose source fails fails its save with the source's error, and
/// leaves no checkpoint behind.
#[test]
fn a_chunk_read_on_demand_that_fails_fails_its_save_and_commits_nothing() {
    let d = tempfile::tempdir().unwrap();
    let source = std::sync::Arc::new(Recorded {
        bytes: vec![0u8; 100 * 8 * 4],
        reads: Default::default(),
        fail: true,
    });
    let mut input = SaveInput::new();
    input.row_chunks = vec![RowRangeChunk::of_rows_deferred(
        "emb",
        "weight",
        Dtype::F32,
        &[100, 8],
        0..100,
        source,
    )
    .unwrap()];
    let err = save(d.path(), input, &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("the source went away"), "{err}");
    assert!(Checkpoint::open(d.path()).is_err(), "nothing is committed");
    assert!(data_files(d.path()).is_empty(), "no data file is left");
}

/// A reshard reads a row-range table a writer's chunk at a time; chunks that start or end
/// within a row (rows of 12 bytes, chunks of 4 KiB) copy every row once and exactly, and the
/// copy of a chain (a delta's changed rows over its parent's) is its newest state.
#[test]
fn a_reshard_copies_rows_that_straddle_its_writer_chunks_exactly() {
    let d = tempfile::tempdir().unwrap();
    let (base, delta, out) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
    let rows = 5000u64;
    let mut input = SaveInput::new();
    input.row_chunks = vec![
        chunk("weight", &[rows, 3], 0..2600, 0..3),
        chunk("weight", &[rows, 3], 2600..rows, 0..3),
    ];
    save(&base, input, &SaveOptions::default()).unwrap();
    // A delta changing rows 10..20 of the second chunk.
    let mut changed = chunk("weight", &[rows, 3], 2600..rows, 0..3);
    let mut v: Vec<f32> = bytemuck::cast_slice(changed.values().data().unwrap()).to_vec();
    for x in &mut v[30..60] {
        *x = -*x;
    }
    changed = RowRangeChunk::new("emb", "weight", Dtype::F32, vec![rows - 2600, 3], {
        bytemuck::cast_slice::<f32, u8>(&v).to_vec()
    })
    .unwrap()
    .at(&[2600, 0], &[rows, 3])
    .unwrap();
    let mut input = SaveInput::new();
    input.row_chunks = vec![chunk("weight", &[rows, 3], 0..2600, 0..3), changed];
    let opts = SaveOptions {
        parent: Some(base.clone()),
        ..Default::default()
    };
    save(&delta, input, &opts).unwrap();
    let mut opts = SaveOptions::default();
    opts.plan.shard_num = 3;
    opts.plan.chunk_bytes = 4096;
    let chain = Checkpoint::open(&delta).unwrap();
    saver::io::tools::reshard::reshard(&chain, &out, &opts).unwrap();
    assert_eq!(digest_at(&out), digest_at(&delta));
    let mut back = vec![0f32; (rows * 3) as usize];
    Checkpoint::open(&out)
        .unwrap()
        .load_rows(
            "emb",
            0..rows,
            &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut back))],
        )
        .unwrap();
    for r in 0..rows {
        for c in 0..3 {
            let want = value(0, r, c) * if (2610..2620).contains(&r) { -1.0 } else { 1.0 };
            assert_eq!(back[(r * 3 + c) as usize], want, "row {r} column {c}");
        }
    }
}

/// A compaction of a checkpoint on an object store that other saves keep replacing copies one
/// save, whole: its row-range rows are read a writer's chunk at a time, all from the checkpoint
/// it opened; one replaced meanwhile (its objects removed) fails the copy, which runs again on
/// the new one, never a copy of rows of two saves. Raced for real, many rounds, varied timing.
#[test]
fn a_compaction_racing_overwrites_on_the_object_store_copies_one_save() {
    let Some(g) = crate::common::garage::shared() else {
        return;
    };
    let url = g.url("row-range/race");
    let remote = std::path::Path::new(&url);
    let (rows, cols) = (10_000u64, 8u64);
    // Version `v` of the table: every value tells its version, row and column.
    let version = |v: u64| -> SaveInput<'static> {
        let mut input = SaveInput::new();
        for r in [0..4000, 4000..rows] {
            let vals: Vec<f32> = r
                .clone()
                .flat_map(|r| (0..cols).map(move |c| (v * 100_000 + r * cols + c) as f32))
                .collect();
            let shape = vec![r.end - r.start, cols];
            input = input.row_chunk(
                RowRangeChunk::new("emb", "weight", Dtype::F32, shape, {
                    bytemuck::cast_slice::<f32, u8>(&vals).to_vec()
                })
                .unwrap()
                .at(&[r.start, 0], &[rows, cols])
                .unwrap(),
            );
        }
        input
    };
    let opts = SaveOptions {
        overwrite: true,
        durable: false,
        ..Default::default()
    };
    save(remote, version(0), &opts).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let out = tempfile::tempdir().unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            // Bounded, so that a copy that fails does not leave it running.
            let mut v = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && v < 400 {
                save(remote, version(v), &opts).unwrap();
                // Pauses about as long as a copy takes, so that some copies see no
                // replacement and others one or more.
                std::thread::sleep(std::time::Duration::from_millis(100 + v * 337 % 1200));
                v += 1;
            }
            v
        });
        let mut copy = SaveOptions::default();
        copy.plan.shard_num = 2;
        copy.plan.chunk_bytes = 65536;
        copy.durable = false;
        /// Stops the writer however this thread leaves the scope, a failed assertion too.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let stopping = Stop(&stop);
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..8 {
            let dir = out.path().join(format!("c{round}"));
            saver::io::tools::reshard::compact(remote, &dir, &copy).unwrap();
            let mut back = vec![0f32; (rows * cols) as usize];
            Checkpoint::open(&dir)
                .unwrap()
                .load_rows(
                    "emb",
                    0..rows,
                    &mut [RowsInto::new("weight", bytemuck::cast_slice_mut(&mut back))],
                )
                .unwrap();
            let v = back[0] as u64 / 100_000;
            for (i, &x) in back.iter().enumerate() {
                assert_eq!(
                    x,
                    (v * 100_000 + i as u64) as f32,
                    "round {round}: value {i}"
                );
            }
            seen.insert(v);
            std::thread::sleep(std::time::Duration::from_millis(round * 23 % 70));
        }
        drop(stopping);
        let saved = writer.join().unwrap();
        assert!(saved > 2, "the overwrites raced the copies ({saved} saves)");
        eprintln!("copies of versions {seen:?} while {saved} saves replaced the checkpoint");
    });
}

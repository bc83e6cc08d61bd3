//! Loading back: round trips with resharding, selection, and every load error.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::{rows_of, table, Model};
use proptest::prelude::*;
use saver::io::{Error, LoadRequest, TableSink};
use saver::{
    save, Checkpoint, Dtype, EmbeddingTable, KeyDtype, LoadOptions, PartitionRule, PlanOptions,
    SaveOptions, SlotSpec,
};

fn save_opts(shards: u32) -> SaveOptions {
    SaveOptions {
        plan: PlanOptions {
            shard_num: shards,
            parallel: 2,
            max_block_bytes: 16 << 10,
            ..Default::default()
        },
        durable: false,
        ..Default::default()
    }
}

fn dtype_strategy() -> impl Strategy<Value = Dtype> {
    prop_oneof![
        Just(Dtype::BOOL),
        Just(Dtype::F16),
        Just(Dtype::BF16),
        Just(Dtype::U64),
        Just(Dtype::F32),
        Just(Dtype::I8),
        Just(Dtype::F64),
        Just(Dtype::F8_E4M3),
        Just(Dtype::C64),
    ]
}

fn id_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        (-500i64..500).prop_map(|x| x as u64),
        Just(u64::MAX),
        Just(i64::MIN as u64),
        Just(i64::MAX as u64),
        Just(0u64),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn any_n_to_any_m_restores_exactly_the_saved_model(
        ids in proptest::collection::btree_set(id_strategy(), 0..600),
        dtypes in proptest::collection::vec(dtype_strategy(), 1..4),
        dim in 1u64..6,
        signed in any::<bool>(),
        n in 1u32..17,
        m in 1u32..17,
    ) {
        let ids: Vec<u64> = ids.into_iter().collect();
        let slots: Vec<SlotSpec> = dtypes.iter().enumerate()
            .map(|(i, &d)| SlotSpec::new(format!("s{i}"), d, if i == 0 { vec![] } else { vec![dim] }))
            .collect();
        let key = if signed { KeyDtype::I64 } else { KeyDtype::U64 };
        let t = table("t", key, slots, &ids);
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), saver::SaveInput::new().table(&t), &save_opts(n)).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let restored = ck.restore(&{
LoadOptions {
    shard_num: m,
    ..Default::default()
}
}).unwrap();
        let mut union = BTreeMap::new();
        for shard in &restored.shards {
            let part = rows_of(&shard.tables[0]);
            for id in part.keys() {
                prop_assert_eq!(PartitionRule::shard_of(*id, m), shard.shard, "id {} in the wrong shard", id);
            }
            let before = union.len();
            let added = part.len();
            union.extend(part);
            prop_assert_eq!(union.len(), before + added, "an id was restored twice");
        }
        prop_assert_eq!(&union, &rows_of(&t));
        prop_assert!(restored.report.read_amplification <= 1.1 || restored.report.bytes_kept < 100_000,
            "amplification {}", restored.report.read_amplification);

        // Loading one target shard alone gives the same rows as in the all-shards restore.
        let j = m / 2;
        let one = ck.restore(&{
LoadOptions {
    shard_num: m,
    shard_index: Some(j),
    ..Default::default()
}
}).unwrap();
        prop_assert_eq!(rows_of(&one.shards[0].tables[0]), rows_of(&restored.shards[j as usize].tables[0]));
    }
}

fn saved_model(dir: &Path, shards: u32) -> Model {
    let m = Model::new(3000);
    save(dir, m.input(), &save_opts(shards)).unwrap();
    m
}

#[test]
fn resharding_8_to_3_reads_little_more_than_it_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(40_000);
    save(dir.path(), m.input(), &save_opts(8)).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut total = 0;
    for j in 0..3 {
        let r = ck
            .restore(&{
                LoadOptions {
                    shard_num: 3,
                    shard_index: Some(j),
                    load_dense: false,
                    ..Default::default()
                }
            })
            .unwrap();
        assert!(
            r.report.read_amplification <= 1.1,
            "shard {j}: {}",
            r.report.read_amplification
        );
        total += r.shards[0]
            .tables
            .iter()
            .map(saver::SparseTable::len)
            .sum::<usize>();
    }
    assert_eq!(total, m.user.len() + m.item.len());
}

#[test]
fn selection_renaming_and_dense() {
    let dir = tempfile::tempdir().unwrap();
    let m = saved_model(dir.path(), 4);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut rename = BTreeMap::new();
    rename.insert("user".to_string(), "user_v2".to_string());
    let r = ck
        .restore(&{
            LoadOptions {
                tables: vec!["us*".into()],
                exclude_slots: vec!["adagrad".into(), "freq".into()],
                dense: vec!["*.bias".into()],
                rename,
                ..Default::default()
            }
        })
        .unwrap();
    let t = &r.shards[0].tables;
    assert_eq!(t.len(), 1);
    assert_eq!(saver::SparseTable::name(&t[0]), "user_v2");
    assert_eq!(saver::SparseTable::slots(&t[0]).len(), 1);
    let full = rows_of(&m.user);
    for (id, slots) in rows_of(&t[0]) {
        assert_eq!(slots[0], full[&id][0]);
    }
    assert_eq!(r.dense.len(), 1);
    assert_eq!(r.dense[0].name, "mlp.0.bias");
    assert_eq!(r.dense[0].data, m.w2);
    // A closure selects tables too.
    let r = ck
        .restore(&{
            LoadOptions {
                table_filter: Some(std::sync::Arc::new(|n: &str| n == "item")),
                ..Default::default()
            }
        })
        .unwrap();
    assert_eq!(rows_of(&r.shards[0].tables[0]), rows_of(&m.item));
}

#[test]
fn trainer_state_reads_back_typed() {
    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct State {
        step: u64,
        rng: [u64; 2],
    }
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(10);
    let mut o = save_opts(2)
        .with_trainer_state(&State {
            step: 77,
            rng: [1, 2],
        })
        .unwrap();
    o.user_metadata.insert("model".into(), "dlrm".into());
    save(dir.path(), m.input(), &o).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.trainer_state::<State>(1).unwrap(),
        Some(State {
            step: 77,
            rng: [1, 2]
        })
    );
    assert_eq!(ck.manifest().user_metadata["model"], "dlrm");
}

#[test]
fn reshard_keeps_every_row_dense_tensor_and_state() {
    let (src, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let m = Model::new(5_000);
    let mut o = save_opts(4).with_trainer_state(&123u64).unwrap();
    o.user_metadata.insert("model".into(), "dlrm".into());
    save(src.path(), m.input(), &o).unwrap();
    let ck = Checkpoint::open(src.path()).unwrap();
    let out_dir = out.path().join("three");
    let r = saver::io::tools::reshard::reshard(&ck, &out_dir, &save_opts(3)).unwrap();
    assert_eq!(r.rows, 5_000 + 2_500);

    assert_eq!(
        saver::verify(&out_dir, 2).unwrap().status,
        saver::Status::Ok
    );
    let new = Checkpoint::open(&out_dir).unwrap();
    assert_eq!(new.manifest().shard_num, 3);
    assert_eq!(new.trainer_state::<u64>(2).unwrap(), Some(123));
    assert_eq!(new.manifest().user_metadata["model"], "dlrm");
    let all = LoadOptions::default();
    let (a, b) = (ck.restore(&all).unwrap(), new.restore(&all).unwrap());
    assert_eq!(
        crate::common::restored_digest(&a).unwrap(),
        crate::common::restored_digest(&b).unwrap()
    );
    let tables = &b.shards[0].tables;
    let user = tables
        .iter()
        .find(|t| saver::SparseTable::name(*t) == "user")
        .unwrap();
    assert_eq!(rows_of(user), rows_of(&m.user));
    let dense: BTreeMap<_, _> = b.dense.iter().map(|d| (d.name.as_str(), &d.data)).collect();
    assert_eq!(dense["mlp.0.weight"], &m.w1);
}

/// The same checks, and the same rows, whether the checkpoint is full or a delta (one load loop
/// for both: a chain's load once skipped the checks of a caller's table).
#[test]
fn user_sinks_get_mismatches_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = saved_model(dir.path(), 2);
    user_sinks_get_mismatches_named_in(&Checkpoint::open(dir.path()).unwrap());
    let other = tempfile::tempdir().unwrap();
    let delta = other.path().join("delta");
    let mut o = save_opts(2);
    o.save_id = Some("d1".into());
    o.parent = Some(dir.path().to_path_buf());
    save(&delta, m.input(), &o).unwrap();
    let chain = Checkpoint::open(&delta).unwrap();
    assert!(chain.is_delta());
    user_sinks_get_mismatches_named_in(&chain);
}

fn user_sinks_get_mismatches_named_in(ck: &Checkpoint) {
    let wrong_dtype = EmbeddingTable::new(
        "user",
        KeyDtype::I64,
        vec![SlotSpec::new("embedding", Dtype::F16, vec![8])],
    )
    .unwrap();
    let err = ck
        .load(LoadRequest::sinks(&LoadOptions::default(), 0, &|t| {
            (t.name == "user").then_some(&wrong_dtype as &dyn TableSink)
        }))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"user\"") && err.contains("\"embedding\"") && err.contains("F16"),
        "{err}"
    );
    let wrong_shape = EmbeddingTable::new(
        "user",
        KeyDtype::I64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![9])],
    )
    .unwrap();
    let err = ck
        .load(LoadRequest::sinks(&LoadOptions::default(), 0, &|t| {
            (t.name == "user").then_some(&wrong_shape as &dyn TableSink)
        }))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[9]"), "{err}");
    let wrong_key = EmbeddingTable::new("user", KeyDtype::U64, vec![]).unwrap();
    let err = ck
        .load(LoadRequest::sinks(&LoadOptions::default(), 0, &|t| {
            (t.name == "user").then_some(&wrong_key as &dyn TableSink)
        }))
        .unwrap_err()
        .to_string();
    assert!(err.contains("I64 ids"), "{err}");
    let missing = EmbeddingTable::new(
        "user",
        KeyDtype::I64,
        vec![SlotSpec::new("adam_m", Dtype::F32, vec![8])],
    )
    .unwrap();
    let err = ck
        .load(LoadRequest::sinks(&LoadOptions::default(), 0, &|t| {
            (t.name == "user").then_some(&missing as &dyn TableSink)
        }))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no slot \"adam_m\""), "{err}");
    let err = ck
        .restore(&{
            LoadOptions {
                required_tables: vec!["clicks".into()],
                ..Default::default()
            }
        })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("required table \"clicks\""), "{err}");
    // A sink that only wants embeddings gets them, from shard 1 of 2.
    let emb = EmbeddingTable::new(
        "user",
        KeyDtype::I64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![8])],
    )
    .unwrap();
    let two = {
        LoadOptions {
            shard_num: 2,
            ..Default::default()
        }
    };
    let r = ck
        .load(LoadRequest::sinks(&two, 1, &|t| {
            (t.name == "user").then_some(&emb as &dyn TableSink)
        }))
        .unwrap()
        .report;
    assert_eq!(r.rows as usize, saver::SparseTable::len(&emb));
    assert!(saver::SparseTable::len(&emb) > 0);
}

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_flipped_data_byte_is_caught_by_verify_and_refused_by_load() {
    let dir = tempfile::tempdir().unwrap();
    saved_model(dir.path(), 2);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let t = ck.manifest().table("user").unwrap().partitions[1].segments[0].slots[0].clone();
    drop(ck);
    flip(&dir.path().join(&t.file), t.offset + 5);
    let v = saver::verify(dir.path(), 2).unwrap();
    assert_eq!(v.status, saver::Status::Corrupt);
    assert_eq!(v.problems.len(), 1);
    assert_eq!(v.problems[0].tensor.as_deref(), Some(t.name.as_str()));
    assert_eq!(v.problems[0].file, t.file);
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .restore(&LoadOptions::default())
        .err()
        .unwrap();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains(&t.name), "{err}");
}

/// A flipped byte in a segment's bucket index fails every load that reads the segment, whole or
/// in part, into tables and into arrays, naming the index: a load read whole checks the index
/// with the segment's first rows, a load cut by a target's edges before any rows.
#[test]
fn a_flipped_bucket_index_byte_fails_every_load_that_reads_its_segment() {
    let dir = tempfile::tempdir().unwrap();
    saved_model(dir.path(), 1);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let segs = ck.manifest().table("user").unwrap().partitions[0]
        .segments
        .clone();
    drop(ck);
    let seg = &segs[segs.len() / 2];
    let t = &seg.bucket_index;
    assert!(t.len > 8, "{} holds one entry", t.name);
    for at in [0, t.len - 1] {
        let copy = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
        }
        flip(&copy.path().join(&t.file), t.offset + at);
        let ck = Checkpoint::open(copy.path()).unwrap();
        for m in [1u32, 3, 7] {
            for j in 0..m {
                let range = PartitionRule::bucket_range(j, m);
                if range.end <= seg.buckets[0] || range.start >= seg.buckets[1] {
                    continue;
                }
                let o = {
                    LoadOptions {
                        shard_num: m,
                        shard_index: Some(j),
                        ..Default::default()
                    }
                };
                for err in [ck.restore(&o).err(), ck.load_columns(&o).err()] {
                    let err = err.unwrap_or_else(|| panic!("target {j} of {m} loaded"));
                    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
                    assert!(err.to_string().contains(&t.name), "{err}");
                }
            }
        }
    }
}

#[test]
fn truncated_and_missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    saved_model(dir.path(), 2);
    let man = Checkpoint::open(dir.path()).unwrap().manifest().clone();
    let f = &man.files[0];
    let path = dir.path().join(&f.name);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&f.name) && err.contains("truncated"), "{err}");
    let v = saver::verify(dir.path(), 1).unwrap();
    assert_eq!(v.status, saver::Status::Corrupt);
    assert!(
        v.problems
            .iter()
            .any(|p| p.file == f.name && p.detail.contains("truncated")),
        "{:?}",
        v.problems
    );

    std::fs::remove_file(&path).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&f.name), "{err}");
    let v = saver::verify(dir.path(), 1).unwrap();
    assert_eq!(v.status, saver::Status::Corrupt);
    assert!(
        v.problems.iter().any(|p| p.file.contains(&f.name)),
        "{:?}",
        v.problems
    );
}

#[test]
fn a_hand_edited_index_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    saved_model(dir.path(), 2);
    let path = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["weight_map"]["ghost/tensor"] = serde_json::json!("model-nowhere.safetensors");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors.index.json"), "{err}");

    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["metadata"]["saver_manifest"] = serde_json::json!("../outside.json");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("../outside.json") && err.contains("path separator"),
        "{err}"
    );

    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["metadata"]["saver_format_version"] = serde_json::json!(99);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("format version 99"), "{err}");
}

#[test]
fn a_directory_without_a_commit_is_refused_with_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("never committed") && err.contains("empty"),
        "{err}"
    );
    assert_eq!(
        saver::verify(dir.path(), 1).unwrap().status,
        saver::Status::Incomplete
    );
    let err = Checkpoint::open(dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope"), "{err}");
}

#[test]
fn partial_reads_check_ids_structurally() {
    // A flipped id byte in a tensor read only in part (resharding) is still caught.
    let dir = tempfile::tempdir().unwrap();
    saved_model(dir.path(), 1);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let seg = ck.manifest().table("user").unwrap().partitions[0].segments[0].clone();
    drop(ck);
    // Corrupt every id of the segment so any target shard that reads part of it sees one.
    let mut b = std::fs::read(dir.path().join(&seg.ids.file)).unwrap();
    for i in 0..seg.rows {
        b[(seg.ids.offset + i * 8 + 7) as usize] ^= 0x10;
    }
    std::fs::write(dir.path().join(&seg.ids.file), b).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let errs: BTreeSet<String> = (0..4)
        .filter_map(|j| {
            ck.restore(&{
                LoadOptions {
                    shard_num: 4,
                    shard_index: Some(j),
                    ..Default::default()
                }
            })
            .err()
            .map(|e| e.to_string())
        })
        .collect();
    assert!(!errs.is_empty());
    assert!(
        errs.iter()
            .all(|e| e.contains("out of bucket order") || e.contains("CRC32")),
        "{errs:?}"
    );
}

/// The rows a load returned, per table, as id -> row bytes of every slot.
fn loaded_rows(r: &saver::Restored) -> BTreeMap<(String, u64), Vec<Vec<u8>>> {
    let mut out = BTreeMap::new();
    for shard in &r.shards {
        for t in &shard.tables {
            for (id, row) in rows_of(t) {
                out.insert((t.name().to_string(), id), row);
            }
        }
    }
    out
}

/// A byte flipped in a slot tensor of a segment that a resharding load reads only in part (the
/// segment straddles the edge of the target's buckets), on either side of the edge: the target
/// that reads the flipped row refuses it, into tables and into arrays, naming the tensor; a
/// target that reads other rows of the tensor either refuses it too or returns exactly the rows
/// of the intact checkpoint. Before, the target that read the flipped row returned it.
#[test]
fn a_flipped_byte_in_a_segment_read_in_part_is_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(60_000);
    let mut o = save_opts(1);
    o.plan.max_block_bytes = 4 << 20;
    save(dir.path(), m.input(), &o).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let segs = ck.manifest().table("user").unwrap().partitions[0]
        .segments
        .clone();
    let mut tried = 0;
    for m in [3u32, 4, 5] {
        let edges: Vec<u32> = (1..m)
            .map(|j| PartitionRule::bucket_range(j, m).start)
            .collect();
        let Some(seg) = segs
            .iter()
            .find(|s| edges.iter().any(|&e| s.buckets[0] < e && e < s.buckets[1]))
        else {
            continue;
        };
        let t = &seg.slots[0];
        assert!(t.blocks.is_some(), "{} is not longer than a block", t.name);
        let target_opts = |j| LoadOptions {
            shard_num: m,
            shard_index: Some(j),
            ..Default::default()
        };
        let intact: Vec<_> = (0..m)
            .map(|j| loaded_rows(&ck.restore(&target_opts(j)).unwrap()))
            .collect();
        for at in [1, 2, 3, 5, 6] {
            let copy = tempfile::tempdir().unwrap();
            for f in std::fs::read_dir(dir.path()).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
            }
            let byte = t.len * at / 7;
            flip(&copy.path().join(&t.file), t.offset + byte);
            // The target holding the flipped row: its id's bucket.
            let row = byte / (t.len / seg.rows);
            let ids = std::fs::read(dir.path().join(&seg.ids.file)).unwrap();
            let at_id = (seg.ids.offset + row * 8) as usize;
            let id = u64::from_le_bytes(ids[at_id..at_id + 8].try_into().unwrap());
            let holder = (0..m)
                .find(|&j| {
                    PartitionRule::bucket_range(j, m).contains(&PartitionRule::bucket_of(id))
                })
                .unwrap();
            let flipped = Checkpoint::open(copy.path()).unwrap();
            for j in 0..m {
                let tables = flipped.restore(&target_opts(j));
                let arrays = flipped.load_columns(&target_opts(j));
                for (what, err) in [
                    ("tables", tables.as_ref().err()),
                    ("arrays", arrays.as_ref().err()),
                ] {
                    match err {
                        Some(e) => {
                            assert!(matches!(e, Error::Corrupt { .. }), "{e}");
                            assert!(e.to_string().contains(&t.name), "{e}");
                        }
                        None => assert_ne!(j, holder, "{what}, target {j} of {m}, flip at {at}/7"),
                    }
                }
                if let Ok(r) = &tables {
                    assert_eq!(loaded_rows(r), intact[j as usize], "target {j} of {m}");
                }
            }
            tried += 1;
        }
    }
    assert!(tried > 0, "no segment straddles a target edge");
}

/// Every tensor longer than one checksummed block carries the CRC32 of each block, and they match
/// its bytes (`verify`, which checks them too, says Ok).
#[test]
fn block_checksums_match_the_bytes_of_every_long_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::new(60_000);
    let mut o = save_opts(2);
    o.plan.max_block_bytes = 4 << 20;
    save(dir.path(), m.input(), &o).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut with_blocks = 0;
    for t in ck.manifest().tensor_refs() {
        let bytes = std::fs::read(dir.path().join(&t.file)).unwrap();
        let data = &bytes[t.offset as usize..(t.offset + t.len) as usize];
        match &t.blocks {
            None => assert!(
                t.len <= saver::core::plan::MIN_CRC_BLOCK_BYTES,
                "{}",
                t.name
            ),
            Some(b) => {
                with_blocks += 1;
                let want: Vec<u32> = data.chunks(b.bytes as usize).map(crc32fast::hash).collect();
                assert_eq!(b.crc32, want, "{}", t.name);
            }
        }
    }
    assert!(with_blocks > 0);
    drop(ck);
    assert_eq!(
        saver::verify(dir.path(), 2).unwrap().status,
        saver::Status::Ok
    );
}
/// Rows of a columnar table as id -> slot rows.
fn rows_of_columns(t: &saver::io::load::arrays::TableColumns) -> BTreeMap<u64, Vec<Vec<u8>>> {
    let sizes: Vec<usize> = t
        .slots
        .iter()
        .map(|s| s.row_bytes().unwrap() as usize)
        .collect();
    t.ids
        .iter()
        .enumerate()
        .map(|(r, &id)| {
            (
                id,
                t.data
                    .iter()
                    .zip(&sizes)
                    .map(|(d, &b)| d[r * b..(r + 1) * b].to_vec())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn columnar_loads_equal_the_tables_whole_and_per_target() {
    let dir = tempfile::tempdir().unwrap();
    let m = saved_model(dir.path(), 5);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let all = ck.load_columns(&LoadOptions::default()).unwrap();
    let user = all.tables.iter().find(|t| t.name == "user").unwrap();
    assert_eq!(user.ids.len(), m.user.len());
    assert_eq!(rows_of_columns(user), rows_of(&m.user));
    assert_eq!(all.dense.len(), 2);
    assert!(
        all.report.read_amplification < 1.05,
        "{}",
        all.report.read_amplification
    );
    let mut union = BTreeMap::new();
    for j in 0..3 {
        let part = ck
            .load_columns(&{
                LoadOptions {
                    shard_num: 3,
                    shard_index: Some(j),
                    exclude_slots: vec!["adagrad".into()],
                    ..Default::default()
                }
            })
            .unwrap();
        let item = part.tables.iter().find(|t| t.name == "item").unwrap();
        assert!(item
            .ids
            .iter()
            .all(|&id| PartitionRule::shard_of(id, 3) == j));
        union.extend(rows_of_columns(item));
        let u = part.tables.iter().find(|t| t.name == "user").unwrap();
        assert_eq!(u.slots.len(), 2, "adagrad excluded");
    }
    assert_eq!(union, rows_of(&m.item));
}

#[test]
fn huge_page_arrays_hold_the_same_rows() {
    // 5 MiB per slot: large enough for the huge-page advice to apply to whole 2 MiB pages.
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u64> = (0..40_000u64).map(|i| i * 7 + 3).collect();
    let t = table(
        "big",
        KeyDtype::U64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![32]),
            SlotSpec::new("adagrad", Dtype::F32, vec![32]),
        ],
        &ids,
    );
    let mut opts = save_opts(1);
    opts.plan.max_block_bytes = 256 << 20;
    save(dir.path(), saver::SaveInput::new().table(&t), &opts).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    for huge_pages in [false, true] {
        let c = ck
            .load_columns(&{
                LoadOptions {
                    huge_pages,
                    chunk_bytes: 1 << 20,
                    ..Default::default()
                }
            })
            .unwrap();
        assert_eq!(
            rows_of_columns(&c.tables[0]),
            rows_of(&t),
            "huge_pages {huge_pages}"
        );
    }
}

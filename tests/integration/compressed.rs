//! Compressed checkpoints (format versions 3 and 4): what a load, a resharding load, a verify and
//! a digest give for them is what they give for the same model saved raw; they are smaller where
//! the columns compress; corruption of a stored frame is caught and named.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::restored_digest;
use common::{rows_of, table, Model};
use proptest::prelude::*;
use saver::{
    save, Checkpoint, Compression, DenseTensor, Dtype, EmbeddingTable, KeyDtype, LoadOptions,
    PlanOptions, SaveOptions, SlotSpec, Status,
};

fn opts(shards: u32, compressed: bool) -> SaveOptions {
    SaveOptions {
        plan: PlanOptions {
            shard_num: shards,
            parallel: 2,
            compression: compressed.then(Compression::default),
            ..Default::default()
        },
        durable: false,
        ..Default::default()
    }
}

/// A table whose columns compress: ids `0..rows` (dense, as category indices are), embedding
/// rows nine in ten zero, a counter that is small.
fn compressible(rows: u64) -> EmbeddingTable {
    let t = EmbeddingTable::new(
        "cat",
        KeyDtype::I64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![16]),
            SlotSpec::new("count", Dtype::I64, vec![]),
        ],
    )
    .unwrap();
    for id in 0..rows {
        let emb: Vec<u8> = (0..16u64)
            .flat_map(|k| {
                let v = if id % 10 == 0 {
                    saver::core::partition::fmix64(id * 16 + k) as u32 as f32 / 1e9
                } else {
                    0.0
                };
                v.to_le_bytes()
            })
            .collect();
        let count = (id % 7).to_le_bytes();
        t.insert(id, &[&emb, &count]).unwrap();
    }
    t
}

fn bytes_of(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn restore_all(dir: &Path, shards: u32) -> saver::Restored {
    Checkpoint::open(dir)
        .unwrap()
        .restore(&{
            LoadOptions {
                shard_num: shards,
                ..Default::default()
            }
        })
        .unwrap()
}

#[test]
fn a_compressed_checkpoint_is_smaller_and_loads_as_the_raw_one() {
    let t = compressible(200_000);
    let w: Vec<u8> = (0..300_000u32)
        .flat_map(|i| ((i % 100) as f32).to_le_bytes())
        .collect();
    let input = || {
        saver::SaveInput::new()
            .table(&t)
            .dense(DenseTensor::new("w", Dtype::F32, vec![300_000], w.as_slice()).unwrap())
    };
    let raw = tempfile::tempdir().unwrap();
    let packed = tempfile::tempdir().unwrap();
    save(raw.path(), input(), &opts(3, false)).unwrap();
    let report = save(packed.path(), input(), &opts(3, true)).unwrap();
    let (raw_bytes, packed_bytes) = (bytes_of(raw.path()), bytes_of(packed.path()));
    assert!(
        packed_bytes * 3 < raw_bytes,
        "compressed {packed_bytes} bytes, raw {raw_bytes}"
    );
    assert!(
        report.bytes_written < raw_bytes / 3,
        "the report counts the bytes stored: {}",
        report.bytes_written
    );
    let ck = Checkpoint::open(packed.path()).unwrap();
    assert_eq!(
        ck.manifest().format_version,
        saver::core::COMPRESSED_FORMAT_VERSION
    );
    assert!(ck.manifest().tensor_refs().any(|t| t.codec.is_some()));
    // Every shard count reads the same rows and dense tensors as from the raw checkpoint.
    for m in [1, 2, 3, 5] {
        let a = restore_all(raw.path(), m);
        let b = restore_all(packed.path(), m);
        assert_eq!(
            restored_digest(&a).unwrap(),
            restored_digest(&b).unwrap(),
            "{m} shards"
        );
        for (sa, sb) in a.shards.iter().zip(&b.shards) {
            assert_eq!(rows_of(&sa.tables[0]), rows_of(&sb.tables[0]));
        }
    }
    let v = saver::verify(packed.path(), 2).unwrap();
    assert_eq!(v.status, Status::Ok, "{:?}", v.problems);
}

#[test]
fn columns_that_do_not_compress_are_stored_raw() {
    // Hashed ids and random values: nothing to find.
    let ids: Vec<u64> = (0..50_000u64).map(saver::core::partition::fmix64).collect();
    let t = table(
        "h",
        KeyDtype::U64,
        vec![SlotSpec::new("e", Dtype::F32, vec![8])],
        &ids,
    );
    let dir = tempfile::tempdir().unwrap();
    save(
        dir.path(),
        saver::SaveInput::new().table(&t),
        &opts(1, true),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let seg = &ck.manifest().tables[0].partitions[0].segments[0];
    assert!(seg.ids.codec.is_none(), "hashed ids stay raw");
    assert!(seg.slots[0].codec.is_none(), "random values stay raw");
    assert_eq!(
        rows_of(&restore_all(dir.path(), 1).shards[0].tables[0]),
        rows_of(&t)
    );
}

#[test]
fn a_corrupt_frame_is_named_by_load_and_verify() {
    let t = compressible(50_000);
    let dir = tempfile::tempdir().unwrap();
    save(
        dir.path(),
        saver::SaveInput::new().table(&t),
        &opts(1, true),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let victim = ck
        .manifest()
        .tensor_refs()
        .find(|t| t.codec.is_some() && t.name.contains("/embedding:"))
        .expect("a compressed embedding tensor")
        .clone();
    drop(ck);
    let path = dir.path().join(&victim.file);
    let mut bytes = std::fs::read(&path).unwrap();
    // The middle of the first frame.
    let first = victim.codec.as_ref().unwrap().frames[0] as u64;
    bytes[(victim.offset + first / 2) as usize] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    let err = match Checkpoint::open(dir.path())
        .unwrap()
        .restore(&LoadOptions::default())
    {
        Ok(_) => panic!("a corrupt frame loaded"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(&victim.file), "{err}");
    let v = saver::verify(dir.path(), 2).unwrap();
    assert_eq!(v.status, Status::Corrupt);
    assert!(
        v.problems
            .iter()
            .any(|p| p.tensor.as_deref() == Some(victim.name.as_str())),
        "{:?}",
        v.problems
    );
}

#[test]
fn the_standard_model_round_trips_compressed_through_any_shard_count() {
    let m = Model::new(3_000);
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), m.input(), &opts(4, true)).unwrap();
    let raw = tempfile::tempdir().unwrap();
    save(raw.path(), m.input(), &opts(4, false)).unwrap();
    for k in [1, 3, 4] {
        let a = restore_all(raw.path(), k);
        let b = restore_all(dir.path(), k);
        assert_eq!(restored_digest(&a).unwrap(), restored_digest(&b).unwrap());
        let mut user = BTreeMap::new();
        for s in &b.shards {
            user.extend(rows_of(&s.tables[1]));
        }
        assert_eq!(user, rows_of(&m.user));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any model, saved compressed into N shards, loads into M shards exactly as saved, whatever
    /// its tables' sizes (frames from one to many, segments cut small).
    #[test]
    fn any_n_to_any_m_restores_a_compressed_checkpoint_exactly(
        rows in 0u64..6_000,
        dim in 1u64..24,
        sparse_values in any::<bool>(),
        n in 1u32..6,
        m in 1u32..6,
    ) {
        let t = EmbeddingTable::new(
            "t",
            KeyDtype::I64,
            vec![SlotSpec::new("e", Dtype::F32, vec![dim])],
        )
        .unwrap();
        for id in 0..rows {
            let row: Vec<u8> = (0..dim)
                .flat_map(|k| {
                    let v = if sparse_values && id % 3 != 0 { 0.0 } else { (id * dim + k) as f32 };
                    v.to_le_bytes()
                })
                .collect();
            t.insert(id * 3, &[&row]).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let mut o = opts(n, true);
        o.plan.max_block_bytes = 4096 + (rows % 5) * 8192;
        save(dir.path(), saver::SaveInput::new().table(&t), &o).unwrap();
        let r = restore_all(dir.path(), m);
        let mut all = BTreeMap::new();
        for s in &r.shards {
            all.extend(rows_of(&s.tables[0]));
        }
        prop_assert_eq!(all, rows_of(&t));
    }
}

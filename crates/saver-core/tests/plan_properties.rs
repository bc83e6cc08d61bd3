//! Properties of the save plan: placement, completeness, tiling, balance, determinism, filters.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use saver_core::plan::ShardPlan;
use saver_core::{
    plan, DenseTensor, Dtype, EmbeddingTable, Filters, ForeignRows, KeyDtype, PartitionRule,
    PlanOptions, SaveInput, SavePlan, SlotSpec,
};

fn make_table(name: &str, ids: &[u64], dim: u64) -> EmbeddingTable {
    let t = EmbeddingTable::new(
        name,
        KeyDtype::I64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![dim]),
            SlotSpec::new("freq", Dtype::I64, vec![]),
        ],
    )
    .unwrap();
    for &id in ids {
        t.upsert(id, |r| {
            r.slot_mut::<f32>(0).fill(id as f32);
            r.slot_mut::<i64>(1)[0] = (id % 10) as i64;
        });
    }
    t
}

/// (table name, id) of every row the plan writes, with the shard it goes to.
fn planned_rows(p: &SavePlan<'_>) -> Vec<(String, u64, u32)> {
    let mut out = Vec::new();
    for s in p.shards() {
        for part in &s.partitions {
            for id in p.partition_ids(part).unwrap() {
                out.push((p.table_name(part.table).to_string(), id, s.shard));
            }
        }
    }
    out
}

fn check_tiling(s: &ShardPlan) -> Result<(), TestCaseError> {
    for f in &s.files {
        let mut ranges: Vec<(u64, u64)> = f.tensors.iter().map(|t| (t.start, t.end)).collect();
        ranges.sort();
        let mut next = 0;
        for (a, b) in ranges {
            prop_assert_eq!(a, next, "gap or overlap in {}", f.name);
            next = b;
        }
        prop_assert_eq!(next, f.data_len);
        prop_assert_eq!(f.data_start % 4096, 0);
    }
    Ok(())
}

fn ids_strategy() -> impl Strategy<Value = BTreeSet<u64>> {
    let id = prop_oneof![
        any::<u64>(),
        (-1000i64..1000).prop_map(|x| x as u64),
        Just(0u64),
        Just(u64::MAX),
        Just(i64::MIN as u64),
        Just(i64::MAX as u64),
    ];
    proptest::collection::btree_set(id, 0..400)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn rows_land_once_where_the_rule_says_and_nothing_is_lost(
        ids_a in ids_strategy(),
        ids_b in ids_strategy(),
        shard_num in 1u32..20,
    ) {
        let ids_a: Vec<u64> = ids_a.into_iter().collect();
        let ids_b: Vec<u64> = ids_b.into_iter().collect();
        let a = make_table("a", &ids_a, 4);
        let b = make_table("b", &ids_b, 1);
        let opts = {
PlanOptions {
    shard_num,
    ..Default::default()
}
};
        let p_input = SaveInput::new().table(&a).table(&b);
        let p = plan(&p_input, &opts).unwrap();
        let rows = planned_rows(&p);
        let mut seen = BTreeSet::new();
        for (t, id, shard) in &rows {
            prop_assert_eq!(*shard, PartitionRule::shard_of(*id, shard_num));
            prop_assert!(seen.insert((t.clone(), *id)), "row written twice");
        }
        let expected: BTreeSet<(String, u64)> = ids_a.iter().map(|&i| ("a".to_string(), i))
            .chain(ids_b.iter().map(|&i| ("b".to_string(), i))).collect();
        prop_assert_eq!(seen, expected);
        for s in p.shards() {
            check_tiling(s)?;
        }
    }

    #[test]
    fn per_shard_plans_equal_the_single_process_plan(
        ids in ids_strategy(),
        shard_num in 1u32..9,
    ) {
        let ids: Vec<u64> = ids.into_iter().collect();
        let t = make_table("t", &ids, 3);
        let w: Vec<f32> = (0..100).map(|x| x as f32).collect();
        let input = || SaveInput::new().table(&t)
            .dense(DenseTensor::from_f32("w1", vec![100], &w).unwrap())
            .dense(DenseTensor::from_f32("w2", vec![10, 5], &w[..50]).unwrap());
        let all_input = input();
        let all = plan(&all_input, &{
PlanOptions {
    shard_num,
    ..Default::default()
}
}).unwrap();
        for j in 0..shard_num {
            let one_input = input();
            let one = plan(&one_input, &{
PlanOptions {
    shard_num,
    shard_index: Some(j),
    foreign_rows: ForeignRows::Skip,
    parallel: 1,
    ..Default::default()
}
}).unwrap();
            let a = &all.shards()[j as usize];
            let b = &one.shards()[0];
            prop_assert_eq!(a.files.len(), b.files.len());
            for (fa, fb) in a.files.iter().zip(&b.files) {
                prop_assert_eq!(&fa.tensors, &fb.tensors);
                prop_assert_eq!(fa.data_start, fb.data_start);
            }
            for f in 0..a.files.len() {
                let crcs = vec![
                    saver_core::TensorCrc { crc32: 7, blocks: None, stored: None };
                    a.files[f].tensors.len()
                ];
                prop_assert_eq!(
                    all.header(j as usize, f, &crcs).unwrap(),
                    one.header(0, f, &crcs).unwrap()
                );
            }
        }
        // Dense tensors are written exactly once across shards.
        let dense: Vec<usize> = all.shards().iter().flat_map(|s| s.dense.iter().map(|d| d.dense)).collect();
        prop_assert_eq!(dense.len(), 2);
        prop_assert_ne!(dense[0], dense[1]);
    }

    #[test]
    fn files_are_balanced_by_bytes(
        sizes in proptest::collection::vec(1u64..20_000, 1..12),
        nrows in 2_000u64..30_000,
        max_file_kib in 64u64..512,
    ) {
        // One table plus dense tensors of random sizes, small max file size: several files per shard.
        let ids: Vec<u64> = (0..nrows).collect();
        let t = make_table("t", &ids, 8);
        let bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![1u8; n as usize]).collect();
        let mut input = SaveInput::new().table(&t);
        for (i, b) in bufs.iter().enumerate() {
            input = input.dense(DenseTensor::new(format!("d{i}"), Dtype::U8, vec![b.len() as u64], b.as_slice()).unwrap());
        }
        let opts = {
PlanOptions {
    shard_num: 1,
    max_file_size: max_file_kib << 10,
    max_block_bytes: 64 << 10,
    ..Default::default()
}
};
        let p = plan(&input, &opts).unwrap();
        let s = &p.shards()[0];
        check_tiling(s)?;
        let loads: Vec<u64> = s.files.iter().map(|f| f.data_len).collect();
        let total: u64 = loads.iter().sum();
        let ideal = total as f64 / loads.len() as f64;
        let largest = s.files.iter().flat_map(|f| &f.tensors).map(|t| t.end - t.start).max().unwrap();
        let max = *loads.iter().max().unwrap() as f64;
        prop_assert!(
            max <= ideal * 1.25 || max <= ideal + largest as f64,
            "loads {:?}, ideal {}, largest block {}", loads, ideal, largest
        );
        for f in &s.files {
            prop_assert!(f.data_len <= opts.max_file_size || f.tensors.len() == 1, "{} over max size", f.name);
        }
    }

    #[test]
    fn same_input_same_plan(ids in ids_strategy(), shard_num in 1u32..6) {
        let ids: Vec<u64> = ids.into_iter().collect();
        // Insert in two different orders: the table's iteration order must not matter.
        let t1 = make_table("t", &ids, 2);
        let rev: Vec<u64> = ids.iter().rev().copied().collect();
        let t2 = make_table("t", &rev, 2);
        let o = {
PlanOptions {
    shard_num,
    ..Default::default()
}
};
        let p1_input = SaveInput::new().table(&t1);
        let p1 = plan(&p1_input, &o).unwrap();
        let p2_input = SaveInput::new().table(&t2);
        let p2 = plan(&p2_input, &{
let mut o = o.clone();
o.parallel = 7;
o
}).unwrap();
        prop_assert_eq!(planned_rows(&p1), planned_rows(&p2));
        for (a, b) in p1.shards().iter().zip(p2.shards()) {
            for (fa, fb) in a.files.iter().zip(&b.files) {
                prop_assert_eq!(&fa.tensors, &fb.tensors);
            }
        }
        let m1 = p1.shard_manifest(0, &p1.shards()[0].files.iter().map(|f| vec![saver_core::TensorCrc { crc32: 0, blocks: None, stored: None }; f.tensors.len()]).collect::<Vec<_>>(), &BTreeMap::new(), None).unwrap();
        let m2 = p2.shard_manifest(0, &p2.shards()[0].files.iter().map(|f| vec![saver_core::TensorCrc { crc32: 0, blocks: None, stored: None }; f.tensors.len()]).collect::<Vec<_>>(), &BTreeMap::new(), None).unwrap();
        prop_assert_eq!(m1, m2);
    }
}

#[test]
fn filter_that_drops_everything_gives_an_empty_valid_plan() {
    let t = make_table("t", &(0..1000).collect::<Vec<_>>(), 4);
    let w = [1f32; 8];
    let input = SaveInput::new()
        .table(&t)
        .dense(DenseTensor::from_f32("w", vec![8], &w).unwrap());
    let opts = {
        PlanOptions {
            shard_num: 3,
            filters: Filters::new().keep_blocks(|_| false),
            ..Default::default()
        }
    };
    let p = plan(&input, &opts).unwrap();
    assert_eq!(p.shards().len(), 3);
    assert!(p
        .shards()
        .iter()
        .all(|s| s.files.is_empty() && s.partitions.is_empty() && s.dense.is_empty()));
    assert_eq!(p.data_bytes(), 0);
    assert!(p.chunks().is_empty());

    // A row filter dropping every row keeps the table, empty, with no tensors.
    let opts = {
        PlanOptions {
            shard_num: 2,
            filters: Filters::new().keep_rows(|_| false),
            ..Default::default()
        }
    };
    let p_input = SaveInput::new().table(&t);
    let p = plan(&p_input, &opts).unwrap();
    for s in p.shards() {
        assert_eq!(s.partitions.len(), 1);
        assert!(s.partitions[0].rows.is_empty() && s.partitions[0].segments.is_empty());
        assert!(s.files.is_empty());
    }
}

#[test]
fn dropping_a_tables_ids_drops_its_slots_too() {
    let a = make_table("a", &(0..100).collect::<Vec<_>>(), 4);
    let b = make_table("b", &(0..100).collect::<Vec<_>>(), 4);
    let opts = {
        PlanOptions {
            shard_num: 2,
            filters: Filters::new().keep_blocks(|blk| {
                !(blk.table == Some("a") && blk.kind == saver_core::BlockKind::Ids)
            }),
            ..Default::default()
        }
    };
    let p_input = SaveInput::new().table(&a).table(&b);
    let p = plan(&p_input, &opts).unwrap();
    for s in p.shards() {
        for f in &s.files {
            assert!(
                f.tensors.iter().all(|t| !t.name.starts_with("a/")),
                "{:?}",
                f.tensors
            );
        }
        assert!(s
            .partitions
            .iter()
            .all(|part| p.table_name(part.table) == "b"));
    }
}

#[test]
fn excluded_slots_and_row_thresholds() {
    let t = make_table("t", &(0..1000).collect::<Vec<_>>(), 4);
    let opts = {
        PlanOptions {
            filters: Filters::new()
                .exclude_slots("fr*")
                .unwrap()
                .keep_rows_where("freq>=5".parse().unwrap()),
            ..Default::default()
        }
    };
    let p_input = SaveInput::new().table(&t);
    let p = plan(&p_input, &opts).unwrap();
    let names: Vec<&str> = p.shards()[0].files[0]
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("t/embedding:")));
    assert!(!names.iter().any(|n| n.starts_with("t/freq:")));
    assert_eq!(planned_rows(&p).len(), 500);
}

#[test]
fn negative_and_extreme_ids_are_planned() {
    let ids = [
        0u64,
        u64::MAX,
        i64::MIN as u64,
        i64::MAX as u64,
        (-1i64) as u64,
        1,
    ];
    let t = make_table("t", &ids, 1);
    for n in [1, 2, 3, 5, 16] {
        let input = SaveInput::new().table(&t);
        let p = plan(&input, &{
            PlanOptions {
                shard_num: n,
                ..Default::default()
            }
        })
        .unwrap();
        let rows: BTreeSet<u64> = planned_rows(&p).into_iter().map(|(_, id, _)| id).collect();
        assert_eq!(rows, ids.iter().copied().collect());
    }
}

#[test]
fn bad_input_gets_named_errors() {
    let t = make_table("t", &[1, 2], 1);
    let t2 = make_table("t", &[1, 2], 1);
    let err =
        |input: SaveInput<'_>, o: &PlanOptions| plan(&input, o).expect_err("must fail").to_string();
    let o = PlanOptions::default();
    assert!(err(SaveInput::new().table(&t).table(&t2), &o).contains("duplicate table name \"t\""));
    assert!(err(SaveInput::new(), &{
        let mut o = o.clone();
        o.shard_num = 0;
        o
    })
    .contains("at least 1"));
    assert!(err(SaveInput::new(), &{
        let mut o = o.clone();
        o.shard_num = 2;
        o.shard_index = Some(2);
        o
    })
    .contains("shard index 2"));
    let w = [0f32; 2];
    let e = err(
        SaveInput::new()
            .table(&t)
            .dense(DenseTensor::from_f32("t/embedding:s0.0", vec![2], &w).unwrap()),
        &o,
    );
    assert!(e.contains("t/embedding:s0.0"), "{e}");
    let e = err(
        SaveInput::new()
            .dense(DenseTensor::from_f32("w", vec![2], &w).unwrap())
            .dense(DenseTensor::from_f32("w", vec![2], &w).unwrap()),
        &o,
    );
    assert!(e.contains("duplicate dense tensor name \"w\""), "{e}");
    // Rows owned by another shard, in multi-process mode, are refused by default.
    let many = make_table("m", &(0..100).collect::<Vec<_>>(), 1);
    let e = err(SaveInput::new().table(&many), &{
        let mut o = o.clone();
        o.shard_num = 4;
        o.shard_index = Some(1);
        o
    });
    assert!(
        e.contains("table \"m\"") && e.contains("belong to other shards"),
        "{e}"
    );
    assert!(err(SaveInput::new(), &{
        let mut o = o.clone();
        o.save_id = "a/b".into();
        o
    })
    .contains("save_id"));
}

#[test]
fn large_partitions_are_cut_into_bounded_segments() {
    let ids: Vec<u64> = (0..50_000).collect();
    let t = make_table("t", &ids, 16);
    let opts = {
        PlanOptions {
            max_block_bytes: 64 << 10,
            ..Default::default()
        }
    };
    let p_input = SaveInput::new().table(&t);
    let p = plan(&p_input, &opts).unwrap();
    let part = &p.shards()[0].partitions[0];
    assert!(part.segments.len() > 10);
    let mut next = part.buckets.start;
    for seg in &part.segments {
        assert_eq!(seg.buckets.start, next);
        next = seg.buckets.end;
    }
    assert_eq!(next, part.buckets.end);
    for f in &p.shards()[0].files {
        for t in &f.tensors {
            // A single bucket may exceed the block bound; here buckets hold about one row.
            assert!(
                t.end - t.start <= 64 << 10,
                "{} is {} bytes",
                t.name,
                t.end - t.start
            );
        }
    }
}

#[test]
fn large_shards_are_split_into_files_for_the_writer_threads() {
    // 8 dense tensors of 80 MiB (never touched: planning reads no data): 640 MiB in one shard.
    let data = vec![0u8; 80 << 20];
    let input = || {
        (0..8).fold(SaveInput::new(), |input, i| {
            input.dense(
                DenseTensor::new(format!("w{i}"), Dtype::U8, vec![80 << 20], &data[..]).unwrap(),
            )
        })
    };
    let files = |split_files| {
        let opts = {
            PlanOptions {
                split_files,
                ..Default::default()
            }
        };
        let p_input = input();
        let p = plan(&p_input, &opts).unwrap();
        let sizes: Vec<u64> = p.shards()[0]
            .files
            .iter()
            .map(|f| f.tensors.iter().map(|t| t.end - t.start).sum())
            .collect();
        sizes
    };
    // One file per 256 MiB: 2 files of 320 MiB, whatever the writer threads.
    assert_eq!(files(4), vec![320 << 20, 320 << 20]);
    assert_eq!(files(1), vec![640 << 20]);
    let input = input();
    let err = plan(&input, &{
        PlanOptions {
            split_files: 0,
            ..Default::default()
        }
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("split_files"), "{err}");
}

/// A segment's tensors lie side by side in one file wherever whole segments balance the files,
/// so that the writer thread writing a file front to back writes all of them.
#[test]
fn segments_stay_whole_in_one_file() {
    let ids: Vec<u64> = (0..60_000).collect();
    let tables: Vec<_> = (0..4)
        .map(|i| make_table(&format!("t{i}"), &ids, 8))
        .collect();
    let input = tables
        .iter()
        .fold(SaveInput::new(), |input, t| input.table(t));
    let opts = {
        PlanOptions {
            shard_num: 2,
            max_file_size: 2 << 20,
            max_block_bytes: 64 << 10,
            ..Default::default()
        }
    };
    let p = plan(&input, &opts).unwrap();
    for s in p.shards() {
        assert!(s.files.len() > 1, "several files per shard");
        for seg in s.partitions.iter().flat_map(|p| &p.segments) {
            let locs: Vec<_> = [seg.ids, seg.index_loc]
                .into_iter()
                .chain(seg.slots.iter().copied())
                .collect();
            for (k, loc) in locs.iter().enumerate() {
                assert_eq!(
                    loc.file, seg.ids.file,
                    "segment {} spread over files",
                    seg.index
                );
                assert_eq!(
                    loc.tensor,
                    seg.ids.tensor + k,
                    "segment {} not contiguous",
                    seg.index
                );
            }
        }
    }
}

#[test]
fn a_file_whose_header_would_pass_the_safetensors_limit_is_refused_before_writing() {
    // 200 000 empty dense tensors with 500-byte names: a header of about 110 MB in one file.
    let names: Vec<String> = (0..200_000).map(|i| format!("{i:0>500}")).collect();
    let mut input = SaveInput::new();
    for n in &names {
        input = input.dense(DenseTensor::new(n.clone(), Dtype::U8, vec![0], Vec::new()).unwrap());
    }
    let Err(err) = plan(&input, &PlanOptions::default()) else {
        panic!("a plan with a 110 MB header was accepted");
    };
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            saver_core::Error::HeaderTooLarge {
                tensors: 200_000,
                ..
            }
        ) && msg.contains("model-")
            && msg.contains("100000000"),
        "{msg}"
    );
}

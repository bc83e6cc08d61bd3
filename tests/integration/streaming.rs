//! The streaming paths (plain inputs distributed by bucket, checkpoint tables read on demand,
//! the external merge sort of export, the digest that streams) give exactly what the in-memory
//! paths give: the same checkpoint bytes, the same digest, the same export.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{restored_digest, source_digest};
use proptest::prelude::*;
use saver::core::{Dtype, SaveInput, SparseTable};
use saver::io::source::import::read_plain;
use saver::io::source::{save_input, Source, SourceTables};
use saver::io::tools::digest::{digest, Content, DigestVersion};
use saver::io::tools::export::{export, ExportOptions};
use saver::io::{save, Checkpoint, LoadOptions, SaveOptions};

/// One slot of a plain table: name, dtype, row width in elements, rows back to back.
type PlainSlot = (String, Dtype, u64, Vec<u8>);

/// A plain input: per table, its ids (in input order) and slots; plus one dense tensor.
#[derive(Clone, Debug)]
struct Plain {
    tables: Vec<(Vec<i64>, Vec<PlainSlot>)>,
}

fn plain_strategy() -> impl Strategy<Value = Plain> {
    let slot = (
        prop_oneof![
            Just(Dtype::F32),
            Just(Dtype::F16),
            Just(Dtype::I64),
            Just(Dtype::U8)
        ],
        1u64..5,
    );
    let table = (
        proptest::collection::btree_set(any::<i64>(), 0..600),
        proptest::collection::vec(slot, 1..3),
        any::<u64>(),
    )
        .prop_map(|(ids, slots, seed)| {
            let mut ids: Vec<i64> = ids.into_iter().collect();
            // Input order is not id order.
            let n = ids.len();
            for i in 0..n {
                ids.swap(i, (seed as usize).wrapping_add(i * 7919) % n.max(1));
            }
            let slots = slots
                .into_iter()
                .enumerate()
                .map(|(k, (dtype, width))| {
                    let bytes = n as u64 * width * (dtype.bits() / 8);
                    let data = (0..bytes)
                        .map(|b| (b.wrapping_mul(31) ^ seed ^ k as u64) as u8)
                        // f16 NaNs compare unequal nowhere here: bytes are compared, not values.
                        .collect();
                    (format!("s{k}"), dtype, width, data)
                })
                .collect();
            (ids, slots)
        });
    proptest::collection::vec(table, 1..3).prop_map(|tables| Plain { tables })
}

fn write_plain(p: &Plain, path: &Path) {
    use safetensors::tensor::TensorView;
    let st = |d: Dtype| match d {
        Dtype::F32 => safetensors::Dtype::F32,
        Dtype::F16 => safetensors::Dtype::F16,
        Dtype::I64 => safetensors::Dtype::I64,
        Dtype::U8 => safetensors::Dtype::U8,
        _ => unreachable!(),
    };
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (t, (ids, slots)) in p.tables.iter().enumerate() {
        owned.push((
            format!("t{t}/ids"),
            safetensors::Dtype::I64,
            vec![ids.len()],
            ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
        ));
        for (name, dtype, width, data) in slots {
            owned.push((
                format!("t{t}/{name}"),
                st(*dtype),
                vec![ids.len(), *width as usize],
                data.clone(),
            ));
        }
    }
    owned.push((
        "dense.w".into(),
        safetensors::Dtype::F32,
        vec![3],
        vec![1u8; 12],
    ));
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn opts(shards: u32) -> SaveOptions {
    let mut o = {
        SaveOptions {
            save_id: Some("streaming".into()),
            durable: false,
            ..Default::default()
        }
    };
    o.plan.shard_num = shards;
    o.plan.parallel = 2;
    // Small files and segments, so that tables span several of each.
    o.plan.max_block_bytes = 4096;
    o.plan.max_file_size = 16 << 10;
    o.plan.plan_memory = 4096;
    o
}

/// Every data file of a checkpoint, by name.
fn data_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.ends_with(".safetensors")
        })
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn streaming_and_in_memory_paths_agree(
        p in plain_strategy(),
        shards in 1u32..5,
        reshards in 1u32..4,
        group_bytes in prop_oneof![Just(4096u64), Just(1 << 20)],
        sort_memory in prop_oneof![Just(1usize), Just(3000), Just(32 << 20)],
        rounds in prop_oneof![Just(None), Just(Some(2usize)), Just(Some(3)), Just(Some(64))],
    ) {
        let d = tempfile::tempdir().unwrap();
        let input = d.path().join("model.safetensors");
        write_plain(&p, &input);

        // In memory: the input in EmbeddingTables, saved.
        let model = read_plain(&input).unwrap();
        save(d.path().join("mem"), model.input().unwrap(), &opts(shards)).unwrap();
        let mem_tables: BTreeMap<String, Vec<&dyn SparseTable>> = model
            .tables
            .iter()
            .map(|t| (SparseTable::name(t).to_string(), vec![t as &dyn SparseTable]))
            .collect();
        let mem_digest = digest(
            Content::Tables {
                tables: &mem_tables,
                dense: &model.dense,
            },
            DigestVersion::V2,
        ).unwrap();

        // Streaming: the input distributed by bucket (small groups: many of them; in one pass
        // or in rounds), saved.
        let Source::Plain(plain) = Source::open(&input).unwrap() else { panic!("plain") };
        let scratch = d.path().join("scratch");
        std::fs::create_dir(&scratch).unwrap();
        let tables = SourceTables::Plain(
            plain.tables_in_rounds(&scratch, 2, group_bytes, rounds).unwrap(),
        );
        let dense = plain.read_dense().unwrap();
        prop_assert_eq!(source_digest(&tables, &dense).unwrap(), mem_digest.clone());
        let report = save(d.path().join("stream"), save_input(&tables, &dense).unwrap(), &opts(shards)).unwrap();
        // Past the plan's memory, a plain table's rows are listed again by bucket, not spilled.
        prop_assert_eq!(report.spilled_rows, 0);
        prop_assert!(data_files(&d.path().join("mem")) == data_files(&d.path().join("stream")),
            "a save from the streamed input writes the in-memory save's bytes");
        prop_assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);

        // A checkpoint's digest, read on demand, and the digest of its restore.
        let ck = Checkpoint::open(d.path().join("stream")).unwrap();
        let stored = SourceTables::of_checkpoint(&ck).unwrap();
        let ck_dense = ck.load_dense_tensors(&LoadOptions::default()).unwrap();
        prop_assert_eq!(source_digest(&stored, &ck_dense).unwrap(), mem_digest.clone());
        let restored = ck.restore(&LoadOptions::default()).unwrap();
        prop_assert_eq!(restored_digest(&restored).unwrap(), mem_digest.clone());

        // Reshard, streaming, against a save of the restored tables (in memory).
        saver::io::tools::reshard::reshard(&ck, &d.path().join("resharded"), &opts(reshards)).unwrap();
        let mut input = SaveInput::new();
        for s in &restored.shards {
            for t in &s.tables {
                input = input.table(t);
            }
        }
        for x in &restored.dense {
            input = input.dense(saver::core::DenseTensor::new(x.name.clone(), x.dtype, x.shape.clone(), &x.data).unwrap());
        }
        save(d.path().join("mem-resharded"), input, &opts(reshards)).unwrap();
        prop_assert!(data_files(&d.path().join("resharded")) == data_files(&d.path().join("mem-resharded")));

        // Export: ids ascending, rows with them, bit-exact, whatever the sort's run size.
        let e = d.path().join("export");
        export(&ck, &e, &{
ExportOptions {
    sort_memory,
    durable: false,
    parallel: 2,
    ..Default::default()
}
}).unwrap();
        let back = read_plain(&e).unwrap();
        for (t, (ids, slots)) in p.tables.iter().enumerate() {
            let mut order: Vec<usize> = (0..ids.len()).collect();
            order.sort_by_key(|&i| ids[i]);
            let files: Vec<Vec<u8>> = std::fs::read_dir(&e).unwrap()
                .map(|x| x.unwrap().path())
                .filter(|x| x.extension().is_some_and(|x| x == "safetensors"))
                .map(|x| std::fs::read(x).unwrap())
                .collect();
            let find = |name: &str| -> Vec<u8> {
                for f in &files {
                    let st = safetensors::SafeTensors::deserialize(f).unwrap();
                    if let Ok(v) = st.tensor(name) {
                        return v.data().to_vec();
                    }
                }
                panic!("{name} is not in the export");
            };
            let want_ids: Vec<u8> = order.iter().flat_map(|&i| ids[i].to_le_bytes()).collect();
            prop_assert_eq!(find(&format!("t{t}/ids")), want_ids);
            for (name, dtype, width, data) in slots {
                let b = (*width * (dtype.bits() / 8)) as usize;
                let want: Vec<u8> = order.iter().flat_map(|&i| data[i * b..(i + 1) * b].to_vec()).collect();
                prop_assert_eq!(find(&format!("t{t}/{name}")), want);
            }
        }
        let back_tables: BTreeMap<String, Vec<&dyn SparseTable>> = back
            .tables
            .iter()
            .map(|t| (SparseTable::name(t).to_string(), vec![t as &dyn SparseTable]))
            .collect();
        prop_assert_eq!(digest(
            Content::Tables {
                tables: &back_tables,
                dense: &back.dense,
            },
            DigestVersion::V2,
        ).unwrap(), mem_digest);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// One digest of one content whatever holds it: the tables in memory, restored as any
    /// number of shards, loaded as columns, read from the files (version 2); in both versions,
    /// which differ from each other; and version 1 is refused where rows come from files.
    #[test]
    fn a_digest_is_the_same_whatever_holds_the_content(
        ids in proptest::collection::btree_set(any::<u64>(), 0..400),
        shards in 1u32..4,
        key in prop_oneof![Just(saver::KeyDtype::I64), Just(saver::KeyDtype::U64)],
    ) {
        let d = tempfile::tempdir().unwrap();
        let ids: Vec<u64> = ids.into_iter().collect();
        let slots = vec![
            saver::SlotSpec::new("w", Dtype::F32, vec![3]),
            saver::SlotSpec::new("a", Dtype::U8, vec![2]),
        ];
        let t = crate::common::table("t", key, slots, &ids);
        save(d.path(), SaveInput::new().table(&t), &SaveOptions::default()).unwrap();
        let ck = Checkpoint::open(d.path()).unwrap();
        let all_shards = LoadOptions {
            shard_num: shards,
            ..Default::default()
        };
        let restored = ck.restore(&all_shards).unwrap();
        let columns = ck.load_columns(&LoadOptions::default()).unwrap();
        let tables: BTreeMap<String, Vec<&dyn SparseTable>> =
            [("t".to_string(), vec![&t as &dyn SparseTable])].into_iter().collect();
        let mut by_version = Vec::new();
        for version in [DigestVersion::V1, DigestVersion::V2] {
            let of_tables = digest(Content::Tables { tables: &tables, dense: &[] }, version).unwrap();
            prop_assert_eq!(&digest((&restored).into(), version).unwrap(), &of_tables);
            prop_assert_eq!(&digest((&columns).into(), version).unwrap(), &of_tables);
            let at = digest(Content::At { path: d.path(), parallel: 2 }, version);
            if version == DigestVersion::V2 {
                prop_assert_eq!(&at.unwrap(), &of_tables);
            } else {
                let e = at.unwrap_err().to_string();
                prop_assert!(e.contains("digest version"), "{}", e);
            }
            by_version.push(of_tables);
        }
        prop_assert_ne!(&by_version[0], &by_version[1]);
    }
}

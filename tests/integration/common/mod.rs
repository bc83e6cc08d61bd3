//! Models shared by the integration tests.
#![allow(dead_code)]

pub mod garage;

use std::collections::BTreeMap;
use std::path::Path;

use saver::{DenseTensor, Dtype, EmbeddingTable, KeyDtype, SlotSpec, SparseTable};

/// Deterministic bytes of one slot row of an id: every byte derived from (id, slot, position).
pub fn row_bytes(id: u64, slot: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (saver::core::partition::fmix64(id ^ ((slot as u64) << 56) ^ (i as u64) << 40) >> 56)
                as u8
        })
        .collect()
}

/// A table with the given slots, one row per id, values from [`row_bytes`].
pub fn table(name: &str, key: KeyDtype, slots: Vec<SlotSpec>, ids: &[u64]) -> EmbeddingTable {
    let t = EmbeddingTable::new(name, key, slots).unwrap();
    let sizes = t.slot_row_bytes().to_vec();
    for &id in ids {
        let rows: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(s, &n)| row_bytes(id, s, n))
            .collect();
        let refs: Vec<&[u8]> = rows.iter().map(Vec::as_slice).collect();
        t.insert(id, &refs).unwrap();
    }
    t
}

/// The standard test model: two tables and two dense tensors.
pub struct Model {
    pub user: EmbeddingTable,
    pub item: EmbeddingTable,
    pub w1: Vec<u8>,
    pub w2: Vec<u8>,
}

impl Model {
    pub fn new(rows: u64) -> Self {
        let user_ids: Vec<u64> = (0..rows)
            .map(|i| (i as i64 - rows as i64 / 2) as u64)
            .collect();
        let item_ids: Vec<u64> = (0..rows / 2)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        Model {
            user: table(
                "user",
                KeyDtype::I64,
                vec![
                    SlotSpec::new("embedding", Dtype::F32, vec![8]),
                    SlotSpec::new("adagrad", Dtype::F32, vec![8]),
                    SlotSpec::new("freq", Dtype::I64, vec![]),
                ],
                &user_ids,
            ),
            item: table(
                "item",
                KeyDtype::U64,
                vec![SlotSpec::new("embedding", Dtype::BF16, vec![4])],
                &item_ids,
            ),
            w1: row_bytes(1, 0, 4 * 64 * 32),
            w2: row_bytes(2, 0, 4 * 32),
        }
    }

    pub fn input(&self) -> saver::SaveInput<'_> {
        saver::SaveInput::new()
            .table(&self.user)
            .table(&self.item)
            .dense(
                DenseTensor::new("mlp.0.weight", Dtype::F32, vec![64, 32], self.w1.as_slice())
                    .unwrap(),
            )
            .dense(
                DenseTensor::new("mlp.0.bias", Dtype::F32, vec![32], self.w2.as_slice()).unwrap(),
            )
    }
}

/// Every row of a table: id -> concatenated slot bytes.
pub fn rows_of(t: &EmbeddingTable) -> BTreeMap<u64, Vec<Vec<u8>>> {
    let n = SparseTable::slots(t).len();
    t.ids()
        .into_iter()
        .map(|id| (id, (0..n).map(|s| t.get_slot(id, s).unwrap()).collect()))
        .collect()
}

/// Every file of a directory with its bytes.
pub fn dir_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// What a save must write identically for identical input, file by file: every data file's bytes,
/// and the manifests and index with what says who wrote them and when taken out (the writer of
/// each shard, and so the manifest's checksum in the index). Writer claims and the commit lock
/// are left out for the same reason.
pub fn checkpoint_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.remove("writer");
                m.remove("saver_manifest_crc32");
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    dir_bytes(dir)
        .into_iter()
        .filter(|(n, _)| !n.ends_with(".writer.json") && !n.starts_with(".saver"))
        .map(|(n, b)| {
            if n.ends_with(".json") {
                let mut v: serde_json::Value = serde_json::from_slice(&b).unwrap();
                strip(&mut v);
                (n, serde_json::to_vec(&v).unwrap())
            } else {
                (n, b)
            }
        })
        .collect()
}

/// Rewrites the manifest with `edit` and re-seals it in the index, as an attacker would.
pub fn reseal(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let idx_path = dir.join(saver::core::naming::INDEX_FILE);
    let mut idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&idx_path).unwrap()).unwrap();
    let man_name = idx["metadata"]["saver_manifest"]
        .as_str()
        .unwrap()
        .to_string();
    let mut man: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(&man_name)).unwrap()).unwrap();
    edit(&mut man);
    let bytes = serde_json::to_vec(&man).unwrap();
    std::fs::write(dir.join(&man_name), &bytes).unwrap();
    idx["metadata"]["saver_manifest_crc32"] = serde_json::json!(crc32fast::hash(&bytes));
    std::fs::write(&idx_path, serde_json::to_vec(&idx).unwrap()).unwrap();
}

/// The (version-2) digest of what a restore returned.
pub fn restored_digest(r: &saver::Restored) -> saver::Result<String> {
    use saver::io::tools::digest::{digest, Content, DigestVersion};
    digest(Content::Restored(r), DigestVersion::V2)
}

/// The (version-2) digest of tables and dense tensors read from files.
pub fn source_digest(
    tables: &saver::io::source::SourceTables<'_>,
    dense: &[saver::io::LoadedDense],
) -> saver::Result<String> {
    use saver::io::tools::digest::{digest, Content, DigestVersion};
    digest(Content::Files { tables, dense }, DigestVersion::V2)
}

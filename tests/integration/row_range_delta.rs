//! Deltas of row-range tables: each chunk compared with its parent, only the changed rows
//! written (a patch), read back over the parent's rows for any range, through chains of any
//! length and any save split; compacted and resharded into full checkpoints of the same
//! content.

use std::ops::Range;
use std::path::Path;

use proptest::prelude::*;
use saver::io::tools::digest::{digest, Content, DigestVersion};
use saver::{
    save, verify, Checkpoint, Dtype, RowRangeChunk, RowsInto, SaveInput, SaveOptions, Shard, Status,
};

/// A row-range table `emb` held in memory: slot `weight` of `cols` columns, slot `state` of one
/// value per row.
#[derive(Clone, Debug)]
struct Model {
    rows: u64,
    cols: u64,
    weight: Vec<f32>,
    state: Vec<f32>,
}

impl Model {
    fn new(rows: u64, cols: u64) -> Self {
        Self {
            rows,
            cols,
            weight: (0..rows * cols).map(|v| v as f32).collect(),
            state: (0..rows).map(|v| -(v as f32)).collect(),
        }
    }

    /// Changes rows `rows` (modulo the table's): their weights, and every other one's state.
    fn change(&mut self, rows: &[u64], by: f32) {
        for (i, &r) in rows.iter().enumerate() {
            let r = r % self.rows;
            for c in 0..self.cols {
                self.weight[(r * self.cols + c) as usize] += by;
            }
            if i % 2 == 0 {
                self.state[r as usize] += by;
            }
        }
    }

    /// The chunk `rows × cols` of `slot`.
    fn chunk(&self, slot: &str, rows: Range<u64>, cols: Range<u64>) -> RowRangeChunk<'static> {
        let (values, shape, offset, whole): (Vec<f32>, _, _, _) = if slot == "state" {
            (
                self.state[rows.start as usize..rows.end as usize].to_vec(),
                vec![rows.end - rows.start],
                vec![rows.start],
                vec![self.rows],
            )
        } else {
            let mut v = Vec::new();
            for r in rows.clone() {
                for c in cols.clone() {
                    v.push(self.weight[(r * self.cols + c) as usize]);
                }
            }
            (
                v,
                vec![rows.end - rows.start, cols.end - cols.start],
                vec![rows.start, cols.start],
                vec![self.rows, self.cols],
            )
        };
        RowRangeChunk::new(
            "emb",
            slot,
            Dtype::F32,
            shape,
            bytemuck::cast_slice(&values).to_vec(),
        )
        .unwrap()
        .at(&offset, &whole)
        .unwrap()
    }

    /// Saves the model to `dir` cut at `row_cuts` × `col_cuts`, the chunks dealt to `writers`
    /// processes; a delta of `parent` when given.
    fn save(
        &self,
        dir: &Path,
        row_cuts: &[u64],
        col_cuts: &[u64],
        writers: u32,
        parent: Option<&Path>,
    ) {
        let mut chunks = Vec::new();
        for r in ranges(self.rows, row_cuts) {
            for c in ranges(self.cols, col_cuts) {
                chunks.push(self.chunk("weight", r.clone(), c));
            }
            chunks.push(self.chunk("state", r, 0..1));
        }
        let mut per: Vec<Vec<RowRangeChunk<'static>>> = (0..writers).map(|_| Vec::new()).collect();
        for (i, c) in chunks.into_iter().enumerate() {
            per[i % writers as usize].push(c);
        }
        let id = format!("s{}", rand_id());
        std::thread::scope(|s| {
            for (w, mine) in per.into_iter().enumerate() {
                let id = id.clone();
                s.spawn(move || {
                    let mut input = SaveInput::new();
                    input.row_chunks = mine;
                    let mut opts = SaveOptions::for_shard(
                        Shard {
                            index: w as u32,
                            count: writers,
                        },
                        id,
                    );
                    if let Some(p) = parent {
                        opts.parent = Some(p.into());
                    }
                    save(dir, input, &opts).unwrap();
                });
            }
        });
    }

    /// Checks rows `a..b`, columns `x..y` of `ck` against the model.
    fn check(&self, ck: &Checkpoint, rows: Range<u64>, cols: Range<u64>) {
        let n = rows.end - rows.start;
        let mut w = vec![0f32; (n * (cols.end - cols.start)) as usize];
        let mut st = vec![0f32; n as usize];
        ck.load_rows(
            "emb",
            rows.clone(),
            &mut [
                RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)).columns(cols.clone()),
                RowsInto::new("state", bytemuck::cast_slice_mut(&mut st)),
            ],
        )
        .unwrap();
        for r in rows.clone() {
            for c in cols.clone() {
                let got = w[((r - rows.start) * (cols.end - cols.start) + c - cols.start) as usize];
                assert_eq!(
                    got,
                    self.weight[(r * self.cols + c) as usize],
                    "row {r} col {c}"
                );
            }
            assert_eq!(
                st[(r - rows.start) as usize],
                self.state[r as usize],
                "state {r}"
            );
        }
    }
}

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Cuts `0..n` at `cuts` (taken modulo n + 1).
fn ranges(n: u64, cuts: &[u64]) -> Vec<Range<u64>> {
    let mut e: Vec<u64> = cuts.iter().map(|c| c % (n + 1)).collect();
    e.extend([0, n]);
    e.sort_unstable();
    e.dedup();
    e.windows(2).map(|w| w[0]..w[1]).collect()
}

fn digest_at(path: &Path) -> String {
    digest(Content::At { path, parallel: 1 }, DigestVersion::V2).unwrap()
}

/// Bytes of the data files of the checkpoint in `dir` (not of its parents).
fn data_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// A chain of deltas, each of some changed rows and each saved with its own split and number
    /// of writers, reads back the newest values for any range; verifies; has the digest of a
    /// full save of the same values; and compacts into a full checkpoint of that digest.
    #[test]
    fn a_chain_of_row_range_deltas_reads_back_the_newest_values_for_any_range(
        rows in 2u64..200, cols in 1u64..8,
        base_cuts in proptest::collection::vec(0u64..220, 0..3),
        links in proptest::collection::vec((
            proptest::collection::vec(0u64..220, 0..3),
            proptest::collection::vec(0u64..10, 0..2),
            1u32..4,
            proptest::collection::vec(0u64..1000, 0..12),
        ), 1..4),
        loads in proptest::collection::vec((0u64..220, 0u64..220, 0u64..10, 0u64..10), 1..4),
    ) {
        let d = tempfile::tempdir().unwrap();
        let mut model = Model::new(rows, cols);
        let base = d.path().join("0");
        model.save(&base, &base_cuts, &[], 1, None);
        let mut parent = base;
        for (i, (row_cuts, col_cuts, writers, changed)) in links.iter().enumerate() {
            model.change(changed, (i + 1) as f32 * 0.5);
            let dir = d.path().join(format!("{}", i + 1));
            model.save(&dir, row_cuts, col_cuts, *writers, Some(&parent));
            let ck = Checkpoint::open(&dir).unwrap();
            prop_assert_eq!(ck.links().len(), i + 2);
            prop_assert_eq!(
                ck.manifest().format_version,
                saver::core::manifest::ROW_RANGE_DELTA_FORMAT_VERSION
            );
            for &(a, b, x, y) in &loads {
                let (a, b) = (a.min(b) % (rows + 1), a.max(b) % (rows + 1));
                let (x, y) = (x.min(y) % (cols + 1), x.max(y) % (cols + 1));
                model.check(&ck, a.min(b)..a.max(b), x.min(y)..x.max(y));
            }
            model.check(&ck, 0..rows, 0..cols);
            prop_assert_eq!(verify(&dir, 2).unwrap().status, Status::Ok);
            parent = dir;
        }
        let full = d.path().join("full");
        model.save(&full, &[], &[], 1, None);
        prop_assert_eq!(digest_at(&parent), digest_at(&full));
        let compacted = d.path().join("compacted");
        saver::io::tools::reshard::compact(&parent, &compacted, &SaveOptions::default()).unwrap();
        let ck = Checkpoint::open(&compacted).unwrap();
        prop_assert_eq!(ck.links().len(), 1);
        model.check(&ck, 0..rows, 0..cols);
        prop_assert_eq!(digest_at(&compacted), digest_at(&full));
    }
}

/// A delta of a few changed rows writes about those rows, not the table; one of none writes no
/// row-range values at all; one of most rows changed holds whole chunks. Resharded, the chain
/// becomes a full checkpoint of the same content.
#[test]
fn a_delta_writes_the_rows_that_changed() {
    let d = tempfile::tempdir().unwrap();
    let mut model = Model::new(100_000, 16);
    let base = d.path().join("base");
    model.save(&base, &[50_000], &[], 2, None);
    let full_bytes = data_bytes(&base);
    // Nothing changed: every chunk is a patch of no rows.
    let same = d.path().join("same");
    model.save(&same, &[30_000], &[8], 3, Some(&base));
    let ck = Checkpoint::open(&same).unwrap();
    let t = ck.row_table("emb").unwrap();
    assert!(t
        .slots
        .iter()
        .all(|s| s.chunks.is_empty() && s.patches.iter().all(|p| p.changed.is_none())));
    assert_eq!(ck.manifest().total_tensor_bytes(), 0);
    // 100 rows changed: about their bytes (ids and values), a thousandth of the table.
    let changed: Vec<u64> = (0..100).map(|i| i * 997).collect();
    model.change(&changed, 1.0);
    let few = d.path().join("few");
    model.save(&few, &[], &[], 1, Some(&same));
    let ck = Checkpoint::open(&few).unwrap();
    let tensor_bytes = ck.manifest().total_tensor_bytes();
    assert_eq!(
        tensor_bytes,
        100 * (8 + 16 * 4) + 50 * (8 + 4),
        "{tensor_bytes}"
    );
    assert!(
        data_bytes(&few) < full_bytes / 100,
        "{} of {full_bytes}",
        data_bytes(&few)
    );
    model.check(&ck, 0..100_000, 0..16);
    // Every row changed: whole chunks, which need no parent to read.
    let all: Vec<u64> = (0..100_000).collect();
    model.change(&all, 2.0);
    let most = d.path().join("most");
    model.save(&most, &[], &[], 1, Some(&few));
    let ck = Checkpoint::open(&most).unwrap();
    let t = ck.row_table("emb").unwrap();
    let weight = t.slots.iter().find(|s| s.name == "weight").unwrap();
    assert!(weight.patches.is_empty() && !weight.chunks.is_empty());
    model.check(&ck, 0..100_000, 0..16);
    // Resharded for 3 shards: a full checkpoint of the same content, its rows cut in three.
    let re = d.path().join("re");
    let mut three = SaveOptions::default();
    three.plan.shard_num = 3;
    saver::io::tools::reshard::reshard(&ck, &re, &three).unwrap();
    let r = Checkpoint::open(&re).unwrap();
    assert_eq!((r.links().len(), r.manifest().shard_num), (1, 3));
    let t = r.row_table("emb").unwrap();
    let shards: std::collections::BTreeSet<u32> =
        t.slots[0].chunks.iter().map(|c| c.shard).collect();
    assert_eq!(shards.len(), 3);
    model.check(&r, 0..100_000, 0..16);
    assert_eq!(digest_at(&re), digest_at(&most));
}

/// A delta holds what its input holds: a slot whose shape changed, or a table new since the
/// parent, is held whole; a table the input no longer gives is gone.
#[test]
fn a_delta_holds_tables_new_or_reshaped_whole() {
    let d = tempfile::tempdir().unwrap();
    let model = Model::new(500, 4);
    let base = d.path().join("base");
    model.save(&base, &[], &[], 1, None);
    let grown = Model::new(600, 4);
    let other = RowRangeChunk::from_f32("other", "w", vec![3], &[1.0, 2.0, 3.0]).unwrap();
    let input = SaveInput::new()
        .row_chunk(grown.chunk("weight", 0..600, 0..4))
        .row_chunk(grown.chunk("state", 0..600, 0..1))
        .row_chunk(other);
    let delta = d.path().join("delta");
    let report = save(
        &delta,
        input,
        &SaveOptions {
            parent: Some(base.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        report.delta_tables.contains_key("other"),
        "{:?}",
        report.delta_tables
    );
    let ck = Checkpoint::open(&delta).unwrap();
    assert!(ck
        .row_table("emb")
        .unwrap()
        .slots
        .iter()
        .all(|s| s.patches.is_empty()));
    grown.check(&ck, 0..600, 0..4);
    // Without "other" and "emb", a delta holds neither.
    let users = crate::common::table(
        "users",
        saver::KeyDtype::I64,
        vec![saver::SlotSpec::new("e", Dtype::F32, vec![2])],
        &[1, 2, 3],
    );
    let next = d.path().join("next");
    save(
        &next,
        SaveInput::new().table(&users),
        &SaveOptions {
            parent: Some(delta.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let ck = Checkpoint::open(&next).unwrap();
    assert!(ck.manifest().row_tables.is_empty());
    assert!(ck.load_rows("emb", 0..1, &mut []).is_err());
}

/// A full save refuses a chunk reduced to its changed rows, which stands for a parent's rows.
#[test]
fn a_full_save_refuses_changed_rows_only() {
    let d = tempfile::tempdir().unwrap();
    let model = Model::new(10, 2);
    let patch = model
        .chunk("weight", 0..10, 0..2)
        .only_rows(vec![3], vec![0u8; 8])
        .unwrap();
    let e = save(
        d.path(),
        SaveInput::new().row_chunk(patch),
        &SaveOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("only_rows") && e.contains("\"weight\""), "{e}");
}

/// The manifest of the checkpoint in `dir`, as JSON.
fn manifest_json(dir: &Path) -> serde_json::Value {
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(saver::core::naming::INDEX_FILE)).unwrap())
            .unwrap();
    let name = idx["metadata"]["saver_manifest"].as_str().unwrap();
    serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
}

/// Reads every row of `emb` from `dir`: the error of the first read that refuses.
fn read_all(dir: &Path, rows: u64, cols: u64) -> saver::Result<()> {
    let mut w = vec![0f32; (rows * cols) as usize];
    let mut st = vec![0f32; rows as usize];
    Checkpoint::open(dir)?.load_rows(
        "emb",
        0..rows,
        &mut [
            RowsInto::new("weight", bytemuck::cast_slice_mut(&mut w)),
            RowsInto::new("state", bytemuck::cast_slice_mut(&mut st)),
        ],
    )?;
    Ok(())
}

/// Asserts that every read of `dir` and its verify refuse it, both naming `want`.
fn refused_by_reads_and_verify(dir: &Path, want: &str) {
    let read = read_all(dir, 100, 4).expect_err("read");
    assert!(read.to_string().contains(want), "{want}: {read}");
    let report = verify(dir, 1).unwrap();
    assert_eq!(report.status, Status::Corrupt, "{want}: {report:?}");
    assert!(
        report.problems.iter().any(|p| p.detail.contains(want)),
        "{want}: {report:?}"
    );
}

/// What a read of a row-range delta refuses, verify refuses too, so that a manager's fallback
/// passes such a step over rather than fail on it: changed-row numbers out of order, repeated or
/// past their patch (their bytes rewritten and their CRC resealed), and a parent resealed into
/// the chain whose slot has another shape. Before, verify said intact to each.
#[test]
fn what_a_read_of_a_row_range_delta_refuses_verify_refuses_too() {
    for rows in [[10u64, 3, 40], [3, 3, 40], [3, 10, 140]] {
        let d = tempfile::tempdir().unwrap();
        let (base, delta) = (d.path().join("base"), d.path().join("delta"));
        let mut m = Model::new(100, 4);
        m.save(&base, &[], &[], 1, None);
        m.change(&[3, 10, 40], 1.0);
        m.save(&delta, &[], &[], 1, Some(&base));
        assert_eq!(verify(&delta, 1).unwrap().status, Status::Ok);
        let man = manifest_json(&delta);
        let slot = man["row_tables"][0]["slots"]
            .as_array()
            .unwrap()
            .iter()
            .position(|s| s["name"] == "weight")
            .unwrap();
        let t = man["row_tables"][0]["slots"][slot]["patches"][0]["changed"]["rows"].clone();
        assert_eq!(t["len"], 24, "three changed rows");
        let bytes: Vec<u8> = rows.iter().flat_map(|r| r.to_le_bytes()).collect();
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(delta.join(t["file"].as_str().unwrap()))
                .unwrap();
            f.seek(SeekFrom::Start(t["offset"].as_u64().unwrap()))
                .unwrap();
            f.write_all(&bytes).unwrap();
        }
        let crc = crc32fast::hash(&bytes);
        crate::common::reseal(&delta, |m| {
            m["row_tables"][0]["slots"][slot]["patches"][0]["changed"]["rows"]["crc32"] =
                serde_json::json!(crc);
        });
        refused_by_reads_and_verify(&delta, "is not increasing row numbers within 0..100");
    }

    // The parent replaced by a checkpoint whose slot has five columns, and the delta's
    // reference to it resealed.
    let d = tempfile::tempdir().unwrap();
    let (base, delta, other) = (
        d.path().join("base"),
        d.path().join("delta"),
        d.path().join("other"),
    );
    let mut m = Model::new(100, 4);
    m.save(&base, &[], &[], 1, None);
    m.change(&[3, 10, 40], 1.0);
    m.save(&delta, &[], &[], 1, Some(&base));
    Model::new(100, 5).save(&other, &[], &[], 1, None);
    let ck = Checkpoint::open(&other).unwrap();
    let (id, crc) = (ck.manifest().save_id.clone(), {
        let idx: serde_json::Value = serde_json::from_slice(
            &std::fs::read(other.join(saver::core::naming::INDEX_FILE)).unwrap(),
        )
        .unwrap();
        idx["metadata"]["saver_manifest_crc32"].as_u64().unwrap()
    });
    crate::common::reseal(&delta, |m| {
        m["parent"] = serde_json::json!({"path": "../other", "save_id": id, "manifest_crc32": crc});
    });
    refused_by_reads_and_verify(&delta, "which it does not hold so");
}

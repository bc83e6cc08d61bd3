//! Delta checkpoints: whatever sequence of upserts, removals and saves (full or delta, any shard
//! counts, with or without row filters), the chain holds exactly what a full save of the final
//! state with the same filters holds: same digest, same rows for every shard j of M, same
//! export, and `compact` gives a full checkpoint of that content. Plus every way a chain can be
//! broken, each refused with one error naming the link.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;

use crate::common::{restored_digest, source_digest};
use proptest::prelude::*;
use saver::core::ScalarCondition;
use saver::io::source::Source;
use saver::io::tools::export::export;
use saver::io::tools::reshard::reshard;
use saver::{
    save, Checkpoint, DenseTensor, Dtype, EmbeddingTable, Error, ExportOptions, Filters, KeyDtype,
    LoadOptions, SaveInput, SaveOptions, SlotSpec, Status,
};

/// Table → id → (embedding bytes, freq).
type State = BTreeMap<usize, BTreeMap<u64, ([u8; 8], f32)>>;

const KEYS: [KeyDtype; 2] = [KeyDtype::I64, KeyDtype::U64];

fn slots() -> Vec<SlotSpec> {
    vec![
        SlotSpec::new("embedding", Dtype::F32, vec![2]),
        SlotSpec::new("freq", Dtype::F32, vec![]),
    ]
}

fn tables_of(state: &State) -> Vec<EmbeddingTable> {
    (0..2)
        .map(|t| {
            let table = EmbeddingTable::new(format!("t{t}"), KEYS[t], slots()).unwrap();
            for (&id, (emb, freq)) in state.get(&t).into_iter().flatten() {
                table
                    .insert(id, &[&emb[..], &freq.to_le_bytes()[..]])
                    .unwrap();
            }
            table
        })
        .collect()
}

fn options(shards: u32, threshold: Option<u8>, parent: Option<&Path>) -> SaveOptions {
    let mut o = {
        SaveOptions {
            durable: false,
            parent: parent.map(Path::to_path_buf),
            ..Default::default()
        }
    };
    o.plan.shard_num = shards;
    o.plan.parallel = 2;
    o.plan.max_block_bytes = 4096;
    if let Some(t) = threshold {
        let cond: ScalarCondition = format!("freq>={t}").parse().unwrap();
        o.plan.filters = Filters::new().keep_rows_where(cond);
    }
    o
}

fn save_state(
    dir: &Path,
    state: &State,
    dense: &[u8],
    opts: &SaveOptions,
) -> saver::io::Result<()> {
    let tables = tables_of(state);
    let mut input = SaveInput::new();
    for t in &tables {
        input = input.table(t);
    }
    input = input.dense(DenseTensor::new("w", Dtype::U8, vec![dense.len() as u64], dense).unwrap());
    save(dir, input, opts).map(|_| ())
}

fn digest(dir: &Path) -> String {
    let source = Source::open(dir).unwrap();
    let tables = source.tables(dir, 1).unwrap();
    source_digest(&tables, &source.dense().unwrap()).unwrap()
}

/// One step: rows upserted (table, id, embedding seed, freq), rows removed (table, id), then a
/// save: delta or full, shard count, row filter.
#[derive(Clone, Debug)]
struct Step {
    upserts: Vec<(usize, u16, u8, u8)>,
    removes: Vec<(usize, u16)>,
    delta: bool,
    shards: u32,
    threshold: Option<u8>,
}

fn step() -> impl Strategy<Value = Step> {
    (
        proptest::collection::vec((0..2usize, 0..400u16, any::<u8>(), 0..10u8), 0..300),
        proptest::collection::vec((0..2usize, 0..400u16), 0..60),
        proptest::bool::weighted(0.8),
        1..4u32,
        proptest::option::weighted(0.3, 0..10u8),
    )
        .prop_map(|(upserts, removes, delta, shards, threshold)| Step {
            upserts,
            removes,
            delta,
            shards,
            threshold,
        })
}

/// The id of `n` in table `t`: negative ones too in the I64 table.
fn id_of(t: usize, n: u16) -> u64 {
    match KEYS[t] {
        KeyDtype::I64 => (i64::from(n) - 200) as u64,
        KeyDtype::U64 => u64::from(n) * 0x9e37_79b9,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn a_chain_holds_what_a_full_save_of_the_final_state_holds(
        steps in proptest::collection::vec(step(), 1..6),
        load_shards in 1..4u32,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let mut state = State::new();
        let mut last: Option<PathBuf> = None;
        let mut dense = vec![7u8; 8];
        for (k, s) in steps.iter().enumerate() {
            for &(t, n, seed, freq) in &s.upserts {
                let emb = [seed, seed ^ 0x5a, k as u8, n as u8, 1, 2, 3, seed];
                state.entry(t).or_default().insert(id_of(t, n), (emb, f32::from(freq)));
            }
            for &(t, n) in &s.removes {
                state.entry(t).or_default().remove(&id_of(t, n));
            }
            // The dense tensor changes in some steps only: a delta writes it only then.
            if s.upserts.len() % 2 == 0 {
                dense = vec![k as u8; 16 + k];
            }
            let dir = tmp.path().join(format!("s{k}"));
            let parent = last.as_deref().filter(|_| s.delta);
            save_state(&dir, &state, &dense, &options(s.shards, s.threshold, parent)).unwrap();
            last = Some(dir);
        }
        let last = last.unwrap();
        let s = steps.last().unwrap();
        let full = tmp.path().join("full");
        save_state(&full, &state, &dense, &options(2, s.threshold, None)).unwrap();

        // Same digest, through the chain.
        prop_assert_eq!(digest(&last), digest(&full));
        prop_assert_eq!(saver::verify(&last, 2).unwrap().status, Status::Ok);

        // Same rows for every shard j of M, reading only j's buckets of every link.
        let chain = Checkpoint::open(&last).unwrap();
        let reference = Checkpoint::open(&full).unwrap();
        for j in 0..load_shards {
            let opts = {
LoadOptions {
    shard_num: load_shards,
    shard_index: Some(j),
    ..Default::default()
}
};
            let a = chain.restore(&opts).unwrap();
            let b = reference.restore(&opts).unwrap();
            prop_assert_eq!(restored_digest(&a).unwrap(), restored_digest(&b).unwrap());
            let ca = chain.load_columns(&opts).unwrap();
            let cb = reference.load_columns(&opts).unwrap();
            prop_assert_eq!(&ca.tables, &cb.tables);
        }

        // Compact: a full checkpoint of the same content.
        let compacted = tmp.path().join("compacted");
        let mut o = options(3, None, None);
        o.plan.max_block_bytes = 256 << 20;
        reshard(&chain, &compacted, &o).unwrap();
        prop_assert!(Checkpoint::open(&compacted).unwrap().manifest().parent.is_none());
        prop_assert_eq!(digest(&compacted), digest(&full));

        // Same export, byte for byte.
        let (ea, eb) = (tmp.path().join("ea"), tmp.path().join("eb"));
        export(&chain, &ea, &ExportOptions::default()).unwrap();
        export(&Checkpoint::open(&full).unwrap(), &eb, &ExportOptions::default()).unwrap();
        for name in ["model-00001-of-00001.safetensors", "model.safetensors.index.json"] {
            prop_assert!(std::fs::read(ea.join(name)).unwrap() == std::fs::read(eb.join(name)).unwrap());
        }
    }
}

/// Deltas much larger than what the merge reads of a link at a time (8192 ids), over a base
/// that shares their buckets: the merge goes through many batches, each ending at a different
/// link's last id, and ids that several links hold meet in one batch. The chain still holds
/// what a full save of the final state holds, through every way of reading it.
#[test]
fn large_deltas_merge_in_many_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let mut state = State::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let row = |id: u64, k: u64| ((id ^ k).to_le_bytes(), (k as f32) + 1.0);
    for id in 0..60_000u64 {
        state.entry(0).or_default().insert(id, row(id, 0));
    }
    let mut last: Option<PathBuf> = None;
    for k in 0..4u64 {
        if k > 0 {
            // Ids below 80 000: a third new, the rest over the base or an older delta.
            for _ in 0..30_000 {
                let id = next() % 80_000;
                state.entry(0).or_default().insert(id, row(id, k));
            }
            for _ in 0..4_000 {
                let id = next() % 80_000;
                state.entry(0).or_default().remove(&id);
            }
        }
        let dir = tmp.path().join(format!("l{k}"));
        // One segment a shard, so that a part holds all of a link's rows in its buckets.
        let mut o = options(2, None, last.as_deref());
        o.plan.max_block_bytes = 256 << 20;
        save_state(&dir, &state, &[k as u8], &o).unwrap();
        last = Some(dir);
    }
    let last = last.unwrap();
    let full = tmp.path().join("full");
    save_state(&full, &state, &[3], &options(3, None, None)).unwrap();
    assert_eq!(digest(&last), digest(&full));
    let chain = Checkpoint::open(&last).unwrap();
    assert_eq!(chain.links().len(), 4);
    let reference = Checkpoint::open(&full).unwrap();
    for (shards, j) in [(1, 0), (3, 1)] {
        let opts = {
            LoadOptions {
                shard_num: shards,
                shard_index: Some(j),
                ..Default::default()
            }
        };
        let (a, b) = (
            chain.load_columns(&opts).unwrap(),
            reference.load_columns(&opts).unwrap(),
        );
        assert_eq!(a.tables, b.tables);
        let (a, b) = (
            chain.restore(&opts).unwrap(),
            reference.restore(&opts).unwrap(),
        );
        assert_eq!(restored_digest(&a).unwrap(), restored_digest(&b).unwrap());
    }
}

/// A base and a delta of it (a few rows changed, one removed), in `root`.
fn base_and_delta(root: &Path) -> (PathBuf, PathBuf, State) {
    let mut state = State::new();
    for n in 0..200u16 {
        state
            .entry(0)
            .or_default()
            .insert(id_of(0, n), ([n as u8; 8], 1.0));
    }
    let base = root.join("base");
    save_state(&base, &state, b"w0", &options(2, None, None)).unwrap();
    let t0 = state.get_mut(&0).unwrap();
    t0.insert(id_of(0, 3), ([9; 8], 2.0));
    t0.remove(&id_of(0, 4));
    t0.insert(id_of(0, 500), ([7; 8], 3.0));
    let delta = root.join("delta");
    save_state(&delta, &state, b"w1", &options(2, None, Some(&base))).unwrap();
    (base, delta, state)
}

#[test]
fn a_delta_holds_only_what_changed_reads_whole_and_old_readers_refuse_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, delta, _) = base_and_delta(tmp.path());
    let ck = Checkpoint::open(&delta).unwrap();
    let m = ck.manifest();
    assert_eq!(m.format_version, saver::core::DELTA_FORMAT_VERSION);
    assert_eq!(m.table("t0").unwrap().rows, 2, "one changed row, one new");
    assert_eq!(m.table("t0:removed").unwrap().rows, 1);
    assert_eq!(m.table("t1").unwrap().rows, 0);
    // The dense tensor changed ("w0" to "w1"): written.
    assert_eq!(m.dense.len(), 1);
    assert!(m.dense_in_parent.is_empty());
    let p = m.parent.as_ref().unwrap();
    assert_eq!(p.path, "../base");
    // A build that knows only version 1 checks the version first: the index says 2.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(delta.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["saver_format_version"], 2);
    // Opened, a delta is read through its chain: the whole newest state, never the changes
    // alone (which would be a wrong model).
    let (_, _, state) = base_and_delta(&tmp.path().join("again"));
    assert!(ck.is_delta());
    assert_eq!(ck.links().len(), 2);
    let r = ck.restore(&LoadOptions::default()).unwrap();
    assert_eq!(r.table("t0").unwrap().len(), state[&0].len());
    let c = ck.load_columns(&LoadOptions::default()).unwrap();
    assert_eq!(
        c.tables.iter().find(|t| t.name == "t0").unwrap().ids.len(),
        state[&0].len()
    );
}

/// `save` decides full or delta from its options for every input kind: tables read from files
/// (here a checkpoint opened as a source, as `saver save --from … --parent …` reads it) are
/// compared with the parent as they are read, and the delta holds what the in-memory delta
/// holds.
#[test]
fn save_of_a_source_with_a_parent_is_a_delta_compared_as_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, state) = base_and_delta(tmp.path());
    let full = tmp.path().join("full");
    save_state(&full, &state, b"w1", &options(2, None, None)).unwrap();
    let source = Source::open(&full).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let tables = source.tables(scratch.path(), 2).unwrap();
    let dense = source.dense().unwrap();
    let out = tmp.path().join("from-source");
    let input = saver::io::source::save_input(&tables, &dense).unwrap();
    let report = save(&out, input, &options(2, None, Some(&base))).unwrap();
    for t in ["t0", "t1"] {
        match &report.delta_tables[t] {
            saver::DeltaMethod::Compared { why } => {
                assert!(why.contains("read from files"), "{why}")
            }
            m => panic!("{t}: {m:?}"),
        }
    }
    let ours = Checkpoint::open(&out).unwrap();
    let theirs = Checkpoint::open(&delta).unwrap();
    assert!(ours.is_delta());
    for t in ["t0", "t0:removed", "t1"] {
        assert_eq!(
            ours.manifest().table(t).unwrap().rows,
            theirs.manifest().table(t).unwrap().rows,
            "{t}"
        );
    }
    let digest =
        |c: &Checkpoint| restored_digest(&c.restore(&LoadOptions::default()).unwrap()).unwrap();
    assert_eq!(digest(&ours), digest(&Checkpoint::open(&full).unwrap()));
}

fn expect_chain_error(dir: &Path, needles: &[&str]) {
    let err = Checkpoint::open(dir).unwrap_err();
    assert!(matches!(err, Error::Chain { .. }), "{err}");
    let text = err.to_string();
    for n in needles {
        assert!(text.contains(n), "{text:?} does not say {n:?}");
    }
    assert!(!text.contains('\n'), "one line: {text}");
    // verify names the broken link too, and load refuses.
    let v = saver::verify(dir, 1).unwrap();
    assert_eq!(v.status, Status::Corrupt);
    assert!(v
        .problems
        .iter()
        .any(|p| needles.iter().all(|n| p.detail.contains(n))));
}

#[test]
fn a_missing_replaced_or_incomplete_parent_is_named() {
    // Missing.
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, _) = base_and_delta(tmp.path());
    std::fs::rename(&base, tmp.path().join("moved")).unwrap();
    expect_chain_error(&delta, &["delta", "base", "cannot be opened"]);

    // Replaced by another save at the same path.
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, state) = base_and_delta(tmp.path());
    let mut o = options(2, None, None);
    o.overwrite = true;
    save_state(&base, &state, b"other", &o).unwrap();
    expect_chain_error(&delta, &["replaced", "base"]);

    // Incomplete: its index gone.
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, _) = base_and_delta(tmp.path());
    std::fs::remove_file(base.join("model.safetensors.index.json")).unwrap();
    expect_chain_error(&delta, &["base", "not a complete checkpoint"]);

    // Deleting the parent is the user's choice: the delta itself still verifies as files, and
    // every read names the parent.
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, _) = base_and_delta(tmp.path());
    std::fs::remove_dir_all(&base).unwrap();
    let err = Source::open(&delta).unwrap_err().to_string();
    assert!(err.contains("base"), "{err}");
}

#[test]
fn hostile_parent_references_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, delta, _) = base_and_delta(tmp.path());
    for (evil, says) in [
        ("/etc", "absolute"),
        ("", "empty"),
        ("a\nb", "control"),
        (".", "replaced"),
    ] {
        let dir = tmp.path().join("hostile");
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&delta, &dir);
        common::reseal(&dir, |m| m["parent"]["path"] = serde_json::json!(evil));
        let err = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(err.contains(says), "{evil:?}: {err}");
    }
    // A parent reached through a symbolic link is followed, and still must be the save named.
    let dir = tmp.path().join("linked");
    copy_dir(&delta, &dir);
    std::os::unix::fs::symlink(tmp.path().join("base"), tmp.path().join("via")).unwrap();
    common::reseal(&dir, |m| m["parent"]["path"] = serde_json::json!("../via"));
    assert_eq!(digest(&dir), digest(&delta));
    // A full checkpoint's manifest claiming a removed-ids table is refused.
    let base = tmp.path().join("base2");
    copy_dir(&tmp.path().join("base"), &base);
    common::reseal(&base, |m| {
        let mut t = m["tables"][0].clone();
        t["name"] = serde_json::json!("t0:removed");
        m["tables"].as_array_mut().unwrap().push(t);
    });
    assert!(Checkpoint::open(&base).is_err());
}

#[test]
fn chains_deeper_than_the_limit_are_refused_and_compact_fixes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let mut state = State::new();
    let mut last: Option<PathBuf> = None;
    for k in 0..saver::io::load::checkpoint::MAX_CHAIN_LINKS + 1 {
        state
            .entry(1)
            .or_default()
            .insert(id_of(1, k as u16), ([k as u8; 8], 1.0));
        let dir = tmp.path().join(format!("l{k}"));
        let saved = save_state(&dir, &state, b"w", &options(1, None, last.as_deref()));
        if k < saver::io::load::checkpoint::MAX_CHAIN_LINKS {
            saved.unwrap_or_else(|e| panic!("link {k}: {e}"));
            last = Some(dir);
            continue;
        }
        // The 65th link is refused before anything is written, never committed unreadable.
        let err = saved.unwrap_err().to_string();
        assert!(err.contains("64 links") && err.contains("compact"), "{err}");
        assert!(!dir.join("model.safetensors.index.json").exists());
    }
    // One link below the limit resolves, and compacts into a full checkpoint.
    let prev = tmp.path().join(format!(
        "l{}",
        saver::io::load::checkpoint::MAX_CHAIN_LINKS - 1
    ));
    let chain = Checkpoint::open(&prev).unwrap();
    assert_eq!(
        chain.links().len(),
        saver::io::load::checkpoint::MAX_CHAIN_LINKS
    );
    let out = tmp.path().join("compacted");
    reshard(&chain, &out, &options(1, None, None)).unwrap();
    assert_eq!(digest(&out), digest(&prev));
}

#[test]
fn a_delta_never_replaces_a_link_of_its_own_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, state) = base_and_delta(tmp.path());
    for target in [&base, &delta] {
        let mut o = options(2, None, Some(&delta));
        o.overwrite = true;
        let err = save_state(target, &state, b"x", &o)
            .unwrap_err()
            .to_string();
        assert!(err.contains("link of the parent's chain"), "{err}");
    }
    // The base under other paths: a symbolic link, and a bind mount (which no path comparison
    // sees through: the save id of the checkpoint it holds does).
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&base, &link).unwrap();
    let mut aliases = vec![link];
    let mounted = tmp.path().join("mounted");
    std::fs::create_dir(&mounted).unwrap();
    let bound = Command::new("mount")
        .args(["--bind", base.to_str().unwrap(), mounted.to_str().unwrap()])
        .status()
        .is_ok_and(|s| s.success());
    /// Unmounts even when an assertion fails.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = bound.then(|| Unmount(mounted.clone()));
    if bound {
        aliases.push(mounted.clone());
    } else if std::env::var_os("SAVER_REQUIRE_ROOT").is_some() {
        panic!("mount --bind failed, and SAVER_REQUIRE_ROOT is set");
    } else {
        eprintln!("skipped the bind-mount alias: mount --bind needs root");
    }
    for alias in &aliases {
        let mut o = options(2, None, Some(&delta));
        o.overwrite = true;
        let err = save_state(alias, &state, b"x", &o).unwrap_err().to_string();
        assert!(
            err.contains("link of the parent's chain"),
            "{}: {err}",
            alias.display()
        );
    }
    assert_eq!(saver::verify(&delta, 1).unwrap().status, Status::Ok);
}

#[test]
fn a_parent_without_the_slots_a_delta_keeps_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, _, state) = base_and_delta(tmp.path());
    let tables = tables_of(&state);
    let wide = EmbeddingTable::new(
        "t0",
        KeyDtype::I64,
        vec![
            SlotSpec::new("embedding", Dtype::F32, vec![2]),
            SlotSpec::new("freq", Dtype::F32, vec![]),
            SlotSpec::new("adam_m", Dtype::F32, vec![2]),
        ],
    )
    .unwrap();
    let input = SaveInput::new().table(&wide).table(&tables[1]);
    let err = save(tmp.path().join("d"), input, &options(1, None, Some(&base)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adam_m") && err.contains("full checkpoint"),
        "{err}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn tracked_tables() -> Vec<EmbeddingTable> {
    (0..2)
        .map(|t| {
            EmbeddingTable::new(format!("t{t}"), KEYS[t], slots())
                .unwrap()
                .with_change_tracking()
                .unwrap()
        })
        .collect()
}

fn save_tables(
    dir: &Path,
    tables: &[EmbeddingTable],
    dense: &[u8],
    opts: &SaveOptions,
) -> saver::SaveReport {
    let mut input = SaveInput::new();
    for t in tables {
        input = input.table(t);
    }
    input = input.dense(DenseTensor::new("w", Dtype::U8, vec![dense.len() as u64], dense).unwrap());
    save(dir, input, opts).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Tables that track their changes give the same chains: the rows written since the parent
    /// and the ids removed since it, without a comparison (but with one when a row filter is
    /// given, which may drop rows the parent holds, or when the table's last save is not the
    /// parent).
    #[test]
    fn tracked_tables_give_what_a_full_save_of_the_final_state_holds(
        steps in proptest::collection::vec(step(), 1..6),
        skip_parent in proptest::bool::weighted(0.2),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let tables = tracked_tables();
        let mut state = State::new();
        let mut saves: Vec<PathBuf> = Vec::new();
        let mut dense = vec![7u8; 8];
        for (k, s) in steps.iter().enumerate() {
            let mut touched = 0u64;
            for &(t, n, seed, freq) in &s.upserts {
                let emb = [seed, seed ^ 0x5a, k as u8, n as u8, 1, 2, 3, seed];
                let id = id_of(t, n);
                state.entry(t).or_default().insert(id, (emb, f32::from(freq)));
                tables[t].insert(id, &[&emb[..], &f32::from(freq).to_le_bytes()[..]]).unwrap();
                touched += 1;
            }
            for &(t, n) in &s.removes {
                let id = id_of(t, n);
                state.entry(t).or_default().remove(&id);
                tables[t].remove(id);
                touched += 1;
            }
            // The dense tensor changes in some steps only: a delta writes it only then.
            if s.upserts.len() % 2 == 0 {
                dense = vec![k as u8; 16 + k];
            }
            let dir = tmp.path().join(format!("s{k}"));
            // Now and then the parent is not the tables' last save: a comparison then.
            let parent = if skip_parent && saves.len() >= 2 {
                saves.get(saves.len() - 2)
            } else {
                saves.last()
            };
            let parent = parent.map(PathBuf::as_path).filter(|_| s.delta);
            let r = save_tables(&dir, &tables, &dense, &options(s.shards, s.threshold, parent));
            let unfiltered = s.threshold.is_none() && (k == 0 || steps[k - 1].threshold.is_none());
            if parent.is_some() && unfiltered && saves.last().map(PathBuf::as_path) == parent {
                // Tracked or compared, a delta holds at most the rows and ids touched (after a
                // save whose row filter dropped rows, those come back as new ones).
                prop_assert!(r.rows <= touched, "{} rows for {} touched", r.rows, touched);
            }
            saves.push(dir);
        }
        let last = saves.last().unwrap();
        let s = steps.last().unwrap();
        let full = tmp.path().join("full");
        save_state(&full, &state, &dense, &options(2, s.threshold, None)).unwrap();
        prop_assert_eq!(digest(last), digest(&full));
    }
}

#[test]
fn a_tracked_delta_holds_the_rows_written_and_only_them() {
    let tmp = tempfile::tempdir().unwrap();
    let tables = tracked_tables();
    let row = |n: u8| ([n; 8], 1.0f32);
    for n in 0..100u16 {
        let (e, f) = row(n as u8);
        tables[0]
            .insert(id_of(0, n), &[&e[..], &f.to_le_bytes()[..]])
            .unwrap();
    }
    let base = tmp.path().join("base");
    save_tables(&base, &tables, b"w", &options(2, None, None));
    // Ten rows written with the values they had: a comparison would find nothing, the tracking
    // knows they were written. Two removed, one added.
    for n in 0..10u16 {
        let (e, f) = row(n as u8);
        tables[0]
            .insert(id_of(0, n), &[&e[..], &f.to_le_bytes()[..]])
            .unwrap();
    }
    tables[0].remove(id_of(0, 50));
    tables[0].remove(id_of(0, 51));
    let (e, f) = row(7);
    tables[0]
        .insert(id_of(0, 300), &[&e[..], &f.to_le_bytes()[..]])
        .unwrap();
    let delta = tmp.path().join("delta");
    let r = save_tables(&delta, &tables, b"w", &options(3, None, Some(&base)));
    let m = Checkpoint::open(&delta).unwrap().manifest().clone();
    assert_eq!(m.table("t0").unwrap().rows, 11);
    assert_eq!(m.table("t0:removed").unwrap().rows, 2);
    assert_eq!(m.table("t1").unwrap().rows, 0);
    assert_eq!(r.rows, 13);
    // The same save again: nothing written since, and the dense tensor is the parent's.
    let again = tmp.path().join("again");
    let r = save_tables(&again, &tables, b"w", &options(1, None, Some(&delta)));
    assert_eq!(r.rows, 0);
    let m = Checkpoint::open(&again).unwrap().manifest().clone();
    assert!(m.dense.is_empty());
    assert_eq!(m.dense_in_parent, ["w"]);
    let full = tmp.path().join("full");
    save_tables(&full, &tables, b"w", &options(1, None, None));
    assert_eq!(digest(&again), digest(&full));
}

/// Trainers write while tracked deltas are saved: every chain is one moment. Each trainer
/// writes its rows in order, round after round, so at any moment its rows read as a staircase:
/// round c on a prefix, c - 1 after it. A row missed by the tracking (written after the parent's
/// moment but not saved) would break the staircase in a later chain.
#[test]
fn tracked_deltas_saved_while_training_are_each_one_moment() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const ROWS: u64 = 400;
    let tmp = tempfile::tempdir().unwrap();
    let table = EmbeddingTable::new(
        "t",
        KeyDtype::U64,
        vec![SlotSpec::new("round", Dtype::F32, vec![])],
    )
    .unwrap()
    .with_change_tracking()
    .unwrap();
    for trainer in 0..2u64 {
        for i in 0..ROWS {
            table
                .insert(trainer << 32 | i, &[&0f32.to_le_bytes()])
                .unwrap();
        }
    }
    let tables = [&table];
    let save_one = |dir: &Path, parent: Option<&Path>| {
        let mut o = options(2, None, parent);
        o.plan.parallel = 1;
        save(dir, SaveInput::new().table(tables[0]), &o).unwrap();
    };
    let stop = AtomicBool::new(false);
    // Rounds completed by the trainers: every interval between two saves sees writes.
    let rounds = std::sync::atomic::AtomicU64::new(0);
    let wait_rounds = |n: u64| {
        let start = rounds.load(Ordering::SeqCst);
        let t = std::time::Instant::now();
        while rounds.load(Ordering::SeqCst) < start + n && t.elapsed().as_secs() < 10 {
            std::thread::yield_now();
        }
    };
    /// Stops the trainers however the saves end, so that a failed save fails the test
    /// instead of waiting forever for them.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let mut dirs = vec![tmp.path().join("d0")];
    std::thread::scope(|s| {
        for trainer in 0..2u64 {
            let (table, stop, rounds) = (&table, &stop, &rounds);
            s.spawn(move || {
                let mut round = 1f32;
                while !stop.load(Ordering::Relaxed) {
                    for i in 0..ROWS {
                        table.upsert(trainer << 32 | i, |r| r.slot_mut::<f32>(0)[0] = round);
                    }
                    round += 1.0;
                    rounds.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        let _stop = Stop(&stop);
        wait_rounds(2);
        save_one(&dirs[0], None);
        for k in 1..16 {
            wait_rounds(1 + k % 3);
            let dir = tmp.path().join(format!("d{k}"));
            save_one(&dir, Some(dirs.last().unwrap()));
            dirs.push(dir);
        }
    });
    for dir in &dirs {
        let chain = Checkpoint::open(dir).unwrap();
        let c = chain.load_columns(&LoadOptions::default()).unwrap();
        let t = &c.tables[0];
        let mut by_id: Vec<(u64, f32)> = t
            .ids
            .iter()
            .zip(t.data[0].chunks_exact(4))
            .map(|(&id, v)| (id, f32::from_le_bytes(v.try_into().unwrap())))
            .collect();
        by_id.sort_by_key(|r| r.0);
        assert_eq!(by_id.len() as u64, 2 * ROWS, "{}", dir.display());
        for trainer in by_id.chunks(ROWS as usize) {
            let first = trainer[0].1;
            assert!(
                trainer.windows(2).all(|w| w[1].1 <= w[0].1)
                    && first - trainer.last().unwrap().1 <= 1.0,
                "{}: not one moment: {:?}",
                dir.display(),
                trainer.iter().map(|r| r.1).collect::<Vec<_>>()
            );
        }
    }
    // Training stopped: one more delta equals a full save (rows written between a save's moment
    // and its commit, and after, are all in some delta).
    let last = tmp.path().join("last");
    save_one(&last, Some(dirs.last().unwrap()));
    let full = tmp.path().join("full");
    save_one(&full, None);
    assert_eq!(digest(&last), digest(&full));
}

/// A table that claims a name of the companion tables of deltas.
struct Named<'a>(&'a EmbeddingTable, saver::core::TableSchema);

impl saver::SparseTable for Named<'_> {
    fn schema(&self) -> &saver::core::TableSchema {
        &self.1
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn snapshot(&self) -> saver::core::Result<Box<dyn saver::core::TableSnapshot + '_>> {
        saver::SparseTable::snapshot(self.0)
    }
}

#[test]
fn a_full_save_refuses_a_table_named_like_removed_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let t = EmbeddingTable::new("t0", KeyDtype::I64, slots()).unwrap();
    let fake = Named(
        &t,
        saver::core::TableSchema::new("t0:removed", saver::SparseTable::key_dtype(&t), slots()),
    );
    let err = save(
        tmp.path().join("x"),
        SaveInput::new().table(&t).table(&fake),
        &options(1, None, None),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("t0:removed"), "{err}");
    assert!(!tmp.path().join("x/model.safetensors.index.json").exists());
}

/// After a restart: tables restored with change tracking have the loaded checkpoint (the newest
/// link of a chain) as their baseline, so the first delta after the restart is tracked.
#[test]
fn tables_restored_with_tracking_give_a_tracked_delta_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, delta, _) = base_and_delta(tmp.path());
    for loaded in [tmp.path().join("base"), delta] {
        let chain = Checkpoint::open(&loaded).unwrap();
        let opts = {
            LoadOptions {
                change_tracking: true,
                ..Default::default()
            }
        };
        let restored = chain.restore(&opts).unwrap();
        let tables = &restored.shards[0].tables;
        let t0 = tables.iter().find(|t| t.name() == "t0").unwrap();
        // Three rows written with the values they have (a comparison finds nothing), one removed.
        for n in [10u16, 11, 12] {
            let id = id_of(0, n);
            t0.update(id, |_| ());
        }
        t0.remove(id_of(0, 20));
        let next = loaded.with_file_name(format!(
            "{}-next",
            loaded.file_name().unwrap().to_str().unwrap()
        ));
        let mut input = SaveInput::new();
        for t in tables {
            input = input.table(t);
        }
        let w = &restored.dense[0];
        input =
            input.dense(DenseTensor::new(&w.name, w.dtype, w.shape.clone(), &w.data[..]).unwrap());
        let r = save(&next, input, &options(2, None, Some(&loaded))).unwrap();
        let m = Checkpoint::open(&next).unwrap().manifest().clone();
        assert_eq!(m.table("t0").unwrap().rows, 3, "{}", loaded.display());
        assert_eq!(m.table("t0:removed").unwrap().rows, 1);
        assert_eq!(r.rows, 4);
        assert_eq!(m.dense_in_parent, ["w"]);
        let full = tmp.path().join("full-of-next");
        let _ = std::fs::remove_dir_all(&full);
        let mut input = SaveInput::new();
        for t in tables {
            input = input.table(t);
        }
        input =
            input.dense(DenseTensor::new(&w.name, w.dtype, w.shape.clone(), &w.data[..]).unwrap());
        save(&full, input, &options(1, None, None)).unwrap();
        assert_eq!(digest(&next), digest(&full));
    }
    // Tracking is off by default, and a baseline needs it.
    let t = EmbeddingTable::new("t", KeyDtype::U64, slots()).unwrap();
    assert!(t
        .set_baseline("x")
        .unwrap_err()
        .to_string()
        .contains("change tracking"));
}

/// A whole load of a chain reads every link's row tensors whole, so it checks each one's CRC32,
/// and its report counts them (it once counted only the dense tensors).
#[test]
fn a_chain_load_counts_every_tensor_it_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, _) = base_and_delta(tmp.path());
    let chain = Checkpoint::open(&delta).unwrap();
    let whole = LoadOptions::default();
    let base_alone = Checkpoint::open(&base).unwrap().restore(&whole).unwrap();
    let restored = chain.restore(&whole).unwrap();
    let columns = chain.load_columns(&whole).unwrap();
    // The base's tensors, plus at least the delta's ids and slots.
    assert!(
        restored.report.tensors_checked >= base_alone.report.tensors_checked + 3,
        "{} checked, the base alone {}",
        restored.report.tensors_checked,
        base_alone.report.tensors_checked
    );
    assert_eq!(
        columns.report.tensors_checked,
        restored.report.tensors_checked
    );
}

/// What checks one read's outcome against the intact chain's.
type Check<'a> = dyn FnMut(&str, Result<String, Error>, &str) + 'a;

/// Chains of 1, 2, 4 and 10 links whose every delta rewrites 70 % of the rows, so that each older
/// link is read only in part; one byte flipped 2/7 of the way into one link's embedding tensor of
/// shard 1. Every read
/// of the chain that touches that tensor fails naming it; nothing is returned, and no rewrite
/// (compact, reshard, export, save --from, a delta over it) commits.
#[test]
fn a_corrupt_byte_in_any_link_is_refused_by_every_read_and_never_laundered() {
    const ROWS: u64 = 60_000;
    let table = || {
        EmbeddingTable::new(
            "q0",
            KeyDtype::U64,
            vec![SlotSpec::new("embedding", Dtype::F32, vec![16])],
        )
        .unwrap()
    };
    for (links, bads) in [
        (1usize, vec![0usize]),
        (2, vec![0, 1]),
        (4, vec![0, 1, 2, 3]),
        (10, vec![0, 4, 9]),
    ] {
        for bad in bads {
            let tmp = tempfile::tempdir().unwrap();
            let t = table();
            let mut dirs: Vec<PathBuf> = Vec::new();
            for k in 0..links {
                for id in 0..ROWS {
                    // Link 0 writes every row; each later link rewrites 70 % of them, a
                    // different 70 % each time, so that every link keeps rows the tip reads.
                    let drawn =
                        (id ^ (k as u64).wrapping_mul(0x9E37_79B9)).wrapping_mul(2654435761);
                    if k == 0 || (drawn >> 7) % 10 < 7 {
                        t.upsert(id, |r| {
                            r.slot_mut::<f32>(0).fill((id * 10 + k as u64) as f32)
                        });
                    }
                }
                let dir = tmp.path().join(format!("l{k}"));
                let mut o = options(2, None, dirs.last().map(PathBuf::as_path));
                // Segments of thousands of rows: each link's keeps rows the tip reads.
                o.plan.max_block_bytes = 1 << 20;
                save(&dir, SaveInput::new().table(&t), &o).unwrap();
                dirs.push(dir);
            }
            let tip = dirs.last().unwrap().clone();
            let shard = |j| LoadOptions {
                shard_num: 2,
                shard_index: Some(j),
                ..Default::default()
            };
            let chain_digest = |dir: &Path| -> Result<String, Error> {
                let source = Source::open(dir)?;
                let tables = source.tables(dir, 1)?;
                let dense = source.dense()?;
                source_digest(&tables, &dense)
            };
            // What every read gives of the intact chain.
            let intact = {
                let chain = Checkpoint::open(&tip).unwrap();
                [
                    restored_digest(&chain.restore(&LoadOptions::default()).unwrap()).unwrap(),
                    restored_digest(&chain.restore(&shard(1)).unwrap()).unwrap(),
                    restored_digest(&chain.restore(&shard(0)).unwrap()).unwrap(),
                    chain_digest(&tip).unwrap(),
                ]
            };
            // The flip, in link `bad`'s embedding of shard 1.
            let tensor = {
                let ck = Checkpoint::open(&dirs[bad]).unwrap();
                let p = &ck.manifest().table("q0").unwrap().partitions;
                p.iter().find(|p| p.shard == 1).unwrap().segments[0].slots[0].clone()
            };
            let file = dirs[bad].join(&tensor.file);
            let mut bytes = std::fs::read(&file).unwrap();
            bytes[(tensor.offset + tensor.len * 2 / 7) as usize] ^= 0x40;
            std::fs::write(&file, bytes).unwrap();
            // A read refuses, naming the tensor, or (when the rows it needs lie in other blocks
            // of the tensor: an old link whose rows later links replaced) gives what the intact
            // chain gives. The newest link's rows are all live: every read of them refuses.
            let mut refused = 0;
            let mut check = |what: &str, got: Result<String, Error>, want: &str| match got {
                Err(e) => {
                    let e = e.to_string();
                    assert!(
                        e.contains(&tensor.name),
                        "{links} links, bad {bad}, {what}: {e}"
                    );
                    refused += 1;
                }
                Ok(d) => assert_eq!(d, want, "{links} links, bad {bad}, {what}: wrong rows"),
            };
            let chain = Checkpoint::open(&tip).unwrap();
            let restored = |o: &LoadOptions| chain.restore(o).and_then(|r| restored_digest(&r));
            check("restore", restored(&LoadOptions::default()), &intact[0]);
            check("restore shard 1 of 2", restored(&shard(1)), &intact[1]);
            // Shard 0 of 2 does not read the bad tensor, and gets the right rows.
            assert_eq!(restored(&shard(0)).unwrap(), intact[2]);
            let arrays = chain.load_columns(&LoadOptions::default()).and_then(|c| {
                saver::io::tools::digest::digest(
                    (&c).into(),
                    saver::io::tools::digest::DigestVersion::V2,
                )
            });
            check("arrays", arrays, &intact[3]);
            check("digest", chain_digest(&tip), &intact[3]);
            // What a rewrite commits must be the intact chain's rows, or nothing.
            let rewritten =
                |what: &str, out: &Path, r: Result<(), Error>, check: &mut Check<'_>| {
                    let committed = out.join("model.safetensors.index.json").exists();
                    assert_eq!(committed, r.is_ok(), "{what}");
                    check(what, r.and_then(|()| chain_digest(out)), &intact[3]);
                };
            let source = Source::open(&tip).unwrap();
            let from = tmp.path().join("from");
            let saved = source.tables(&tip, 1).and_then(|tables| {
                let dense = source.dense()?;
                let input = saver::io::source::save_input(&tables, &dense)?;
                save(&from, input, &options(3, None, None)).map(|_| ())
            });
            rewritten("save --from", &from, saved, &mut check);
            let compacted = tmp.path().join("compacted");
            let r = reshard(&chain, &compacted, &options(2, None, None)).map(|_| ());
            rewritten("compact", &compacted, r, &mut check);
            let exported = tmp.path().join("exported");
            let r = export(&chain, &exported, &ExportOptions::default()).map(|_| ());
            match r {
                Err(e) => check("export", Err(e), ""),
                Ok(()) => assert!(bad + 1 < links, "export read the newest link's rows"),
            }
            // A delta over it compares against the rows of the chain: refused, or right.
            let over = tmp.path().join("over");
            let o = options(2, None, Some(&tip));
            let r = save(&over, SaveInput::new().table(&table()), &o).map(|_| ());
            let committed = over.join("model.safetensors.index.json").exists();
            assert_eq!(committed, r.is_ok(), "delta over it");
            if let Err(e) = r {
                check("delta over it", Err(e), "");
            }
            if bad + 1 == links {
                assert_eq!(
                    refused, 8,
                    "{links} links: every read of the newest link refuses"
                );
            }
        }
    }
}

/// The parent overwritten by another save while a delta of it is being written: the delta fails
/// naming the parent, and leaves no checkpoint (before, it committed and could not be read).
#[test]
fn a_delta_whose_parent_is_replaced_while_it_is_saved_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, _, state) = base_and_delta(tmp.path());
    let mut o = options(2, None, Some(&base));
    let once = std::sync::Arc::new(std::sync::Once::new());
    let (parent, other) = (base.clone(), state.clone());
    o.progress = Some(std::sync::Arc::new(move |_| {
        once.call_once(|| {
            let mut o = options(2, None, None);
            o.overwrite = true;
            save_state(&parent, &other, b"other", &o).unwrap();
        })
    }));
    let out = tmp.path().join("late");
    let err = save_state(&out, &state, b"w2", &o).unwrap_err().to_string();
    assert!(err.contains("replaced") && err.contains("base"), "{err}");
    assert!(!out.join("model.safetensors.index.json").exists());
}

/// `compact` of a delta writes one full checkpoint of the chain's newest state, which reads alone.
#[test]
fn compact_writes_the_newest_state_as_one_full_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, delta, _) = base_and_delta(tmp.path());
    let out = tmp.path().join("compacted");
    saver::io::tools::reshard::compact(&delta, &out, &options(3, None, None)).unwrap();
    let compacted = Checkpoint::open(&out).unwrap();
    assert!(!compacted.is_delta());
    assert_eq!(compacted.newest().manifest().shard_num, 3);
    let digest =
        |c: &Checkpoint| restored_digest(&c.restore(&LoadOptions::default()).unwrap()).unwrap();
    assert_eq!(
        digest(&compacted),
        digest(&Checkpoint::open(&delta).unwrap())
    );
}

/// The summary `saver inspect` prints is a library type: a delta's names its parent and every
/// link of its chain, newest first.
#[test]
fn inspect_sums_up_a_delta_and_its_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, delta, _) = base_and_delta(tmp.path());
    let s = saver::io::tools::inspect::inspect(&delta).unwrap();
    assert!(s.parent.is_some());
    let links = s.chain.unwrap().unwrap();
    assert_eq!(links.len(), 2);
    assert!(links[0].delta && !links[1].delta);
    let base_id = Checkpoint::open(&base).unwrap().manifest().save_id.clone();
    assert_eq!(links[1].save_id, base_id);
    assert_eq!(s.tables.iter().map(|t| t.rows).sum::<u64>(), {
        let ck = Checkpoint::open(&delta).unwrap();
        ck.manifest().tables.iter().map(|t| t.rows).sum::<u64>()
    });
    let full = saver::io::tools::inspect::inspect(&base).unwrap();
    assert!(full.parent.is_none() && full.chain.is_none());
    assert_eq!(
        full.total_bytes,
        full.files.iter().map(|f| f.bytes).sum::<u64>()
    );
}

/// A delta decides first, as a full save does: options that cannot hold are named before its
/// parent is opened or a row compared (here the parent does not even exist).
#[test]
fn a_delta_with_bad_options_is_refused_before_its_parent_is_read() {
    let root = tempfile::tempdir().unwrap();
    let t = EmbeddingTable::new("emb", KeyDtype::I64, slots()).unwrap();
    // A multi-process save without a save id.
    let mut o = SaveOptions {
        parent: Some(root.path().join("no-such-parent")),
        ..Default::default()
    };
    o.plan.shard_num = 2;
    o.plan.shard_index = Some(0);
    let e = saver::save(root.path().join("d"), SaveInput::new().table(&t), &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("save id") && !e.contains("no-such-parent"),
        "{e}"
    );
    // A directory that holds a checkpoint, without --overwrite.
    let full = root.path().join("full");
    saver::save(&full, SaveInput::new().table(&t), &SaveOptions::default()).unwrap();
    let o = SaveOptions {
        parent: Some(root.path().join("no-such-parent")),
        ..Default::default()
    };
    let e = saver::save(&full, SaveInput::new().table(&t), &o)
        .unwrap_err()
        .to_string();
    assert!(!e.contains("no-such-parent"), "{e}");
}

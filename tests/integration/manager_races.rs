//! The manager's rules hold at the commit, not only when a save starts: a replacement of the
//! newest step raced against the save of the next step as a delta of it, many rounds with varied
//! timing, on a local root and on an object store (Garage, which ignores conditional writes, so
//! that the root's lock there is the flag lock). Whatever the order, every save that reports
//! success is a whole step holding its model, and a save that fails names the one that won.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::garage;

use saver::io::manage::Retention;
use saver::{
    CheckpointManager, Dtype, EmbeddingTable, KeyDtype, LoadOptions, Policy, SaveInput,
    SaveOptions, SlotSpec,
};

/// id → one f32 value.
type State = BTreeMap<u64, f32>;

/// A table of 200 rows whose values depend on `seed`, without change tracking (its deltas are
/// compared with the parent's rows).
fn model(seed: u64) -> (EmbeddingTable, State) {
    let t = EmbeddingTable::new(
        "emb",
        KeyDtype::U64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![1])],
    )
    .unwrap();
    let mut state = State::new();
    for id in 0..200u64 {
        // Most rows alike in every model, so a delta is small; some differ by seed.
        let v = if id % 10 == 0 {
            seed as f32 * 1000.0 + id as f32
        } else {
            id as f32
        };
        t.insert(id, &[&v.to_le_bytes()[..]]).unwrap();
        state.insert(id, v);
    }
    (t, state)
}

fn restored(path: &Path) -> State {
    let r = saver::Checkpoint::open(path)
        .unwrap()
        .restore(&LoadOptions::default())
        .unwrap();
    let t = r.table("emb").unwrap();
    t.ids()
        .into_iter()
        .map(|id| {
            let v = t.get_slot(id, 0).unwrap();
            (id, f32::from_le_bytes(v.try_into().unwrap()))
        })
        .collect()
}

fn opts(save_id: &str, overwrite: bool) -> SaveOptions {
    {
        SaveOptions {
            durable: false,
            overwrite,
            save_id: Some(save_id.into()),
            ..Default::default()
        }
    }
}

/// How the rounds ended.
#[derive(Debug, Default)]
struct Outcomes {
    both: usize,
    replacement_won: usize,
    next_won: usize,
}

/// Rounds of: step 30 saved; then, at once, step 30 replaced (another manager, as another process
/// would) and step 40 saved as a delta of step 30, each started up to `spread` ms after the other
/// (about as long as a save takes there), in both orders.
fn replace_newest_racing_save_next(root: &Path, rounds: usize, spread: u64) -> Outcomes {
    let policy = {
        let mut o = Policy {
            full_every: 4,
            max_delta_fraction: 100.0,
            ..Default::default()
        };
        o.retention = {
            Retention {
                keep_latest: 8,
                ..Default::default()
            }
        };
        o
    };
    let (base, _) = model(1);
    let (replacement, replacement_state) = model(2);
    let (next, next_state) = model(3);
    let mut outcomes = Outcomes::default();
    for round in 0..rounds {
        let root: PathBuf = root.join(format!("r{round}"));
        let m = CheckpointManager::open(&root, policy.clone()).unwrap();
        m.save(
            30,
            SaveInput::new().table(&base),
            &opts(&format!("base{round}"), false),
        )
        .unwrap();
        let a_id = format!("replace{round}");
        let b_id = format!("next{round}");
        let r = round as u64;
        let (wait_a, wait_b) = match round % 4 {
            0 => (0, 0),
            1 => (0, r * 7 % spread),
            2 => (r * 11 % spread, 0),
            _ => (r % 5, r % 3 * spread / 8),
        };
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(wait_a));
                let m = CheckpointManager::open_kept(&root).unwrap();
                m.save(30, SaveInput::new().table(&replacement), &opts(&a_id, true))
            });
            let b = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(wait_b));
                let m = CheckpointManager::open_kept(&root).unwrap();
                m.save(40, SaveInput::new().table(&next), &opts(&b_id, false))
            });
            (a.join().unwrap(), b.join().unwrap())
        });
        let listing = m.root().list().unwrap();
        assert!(
            listing.broken.is_empty(),
            "round {round}: a step is broken: {:?} (replace: {a:?}, next: {b:?})",
            listing.broken
        );
        let step = |s: u64| listing.steps.iter().find(|i| i.step == s);
        match (&a, &b) {
            (Ok(_), Ok(b_done)) => {
                outcomes.both += 1;
                // Only if the replacement committed before the next step's save began: a delta
                // of the replacement, or a full save.
                let s40 = step(40).expect("step 40 is whole");
                assert_eq!(s40.save_id, b_id);
                assert_eq!(step(30).unwrap().save_id, a_id, "round {round}");
                assert!(b_done.save.committed_here);
            }
            (Ok(_), Err(e)) => {
                outcomes.replacement_won += 1;
                let msg = e.to_string();
                assert!(msg.contains(&a_id), "round {round}: {msg}");
                assert!(step(40).is_none(), "round {round}");
                assert_eq!(step(30).unwrap().save_id, a_id, "round {round}");
            }
            (Err(e), Ok(_)) => {
                outcomes.next_won += 1;
                let msg = e.to_string();
                assert!(msg.contains("step 40"), "round {round}: {msg}");
                assert_eq!(
                    step(30).unwrap().save_id,
                    format!("base{round}"),
                    "round {round}: the step the next one needs was replaced"
                );
            }
            (Err(ea), Err(eb)) => panic!("round {round}: both failed: {ea}; {eb}"),
        }
        // Each step that is there holds the model its save was given.
        if a.is_ok() {
            assert_eq!(restored(&m.root().step_path(30)), replacement_state);
        }
        if b.is_ok() {
            assert_eq!(m.latest().unwrap().unwrap().step, 40, "round {round}");
            assert_eq!(restored(&m.root().step_path(40)), next_state);
        }
    }
    outcomes
}

#[test]
fn replacing_the_newest_step_racing_the_next_save_never_breaks_a_step_locally() {
    let dir = tempfile::tempdir().unwrap();
    let o = replace_newest_racing_save_next(dir.path(), 40, 40);
    eprintln!("local: {o:?}");
}

#[test]
fn replacing_the_newest_step_racing_the_next_save_never_breaks_a_step_on_the_store() {
    let Some(g) = garage::shared() else { return };
    let url = g.url("manager-races");
    let o = replace_newest_racing_save_next(Path::new(&url), 24, 400);
    eprintln!("object store: {o:?}");
}

//! What a managed root keeps and how it saves: full or delta, what retention keeps, and what a
//! save does when the previous one is still running.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::storage::Storage;

/// The file in a root that keeps its policy, so that every process and every restart applies
/// the same one unless told otherwise.
pub const POLICY_FILE: &str = "saver-policy.json";

/// How a root's checkpoints are saved and kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Save every this many steps ([`crate::manage::CheckpointManager::is_due`]); 1: every step
    /// the trainer asks for.
    pub every_steps: u64,
    /// A full checkpoint every this many saves (1: every save is full); deltas in between.
    pub full_every: u32,
    /// Most links a chain may have, its full checkpoint included: the save that would make a
    /// longer one is full. Kept small so that a restart reads little more than a full
    /// checkpoint (docs/benchmarks/HISTORY.md).
    pub max_chain_links: usize,
    /// The next save is full once the newest delta holds more than this fraction of the bytes
    /// of its chain's full checkpoint: a delta that large saves little.
    pub max_delta_fraction: f64,
    /// What retention keeps.
    pub retention: Retention,
    /// What a background save does when the previous one is still running.
    pub when_busy: WhenBusy,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            every_steps: 1,
            full_every: 4,
            max_chain_links: 4,
            max_delta_fraction: 0.5,
            retention: Retention::default(),
            when_busy: WhenBusy::Wait,
        }
    }
}

/// What retention keeps. A step is kept if any rule keeps it, and so is every link its chain
/// needs; only committed steps count, so a save under way never stands in for one that is done.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retention {
    /// The newest this many committed steps (at least 1).
    pub keep_latest: usize,
    /// Every step that is a multiple of this (e.g. 10000: one checkpoint per 10k steps for
    /// good).
    pub keep_every: Option<u64>,
    /// The newest step of every period of this many seconds (e.g. 86400: one a day), by when
    /// each save started ([`crate::manage::StepInfo::started_unix_ms`]).
    pub keep_one_per_seconds: Option<u64>,
    /// Steps kept whatever the other rules say.
    pub keep_steps: BTreeSet<u64>,
    /// The best steps by a metric of their user metadata, beyond the newest ones.
    pub keep_best: Option<KeepBest>,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_latest: 2,
            keep_every: None,
            keep_one_per_seconds: None,
            keep_steps: BTreeSet::new(),
            keep_best: None,
        }
    }
}

/// Keep the `count` best steps by the metric `metric` of their user metadata (a number). Kept in
/// addition to [`Retention::keep_latest`]: the rule never evicts the newest steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepBest {
    /// The user metadata key that holds the metric.
    pub metric: String,
    /// How many to keep.
    pub count: usize,
    /// Whether higher is better (accuracy) or lower (loss).
    pub higher_is_better: bool,
}

/// What a background save does when the previous one is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenBusy {
    /// Wait for it (and report its failure, if it failed).
    Wait,
    /// Skip this save.
    Skip,
}

impl Policy {
    /// Checks the policy's values.
    pub fn check(&self) -> Result<()> {
        let bad = |option: &'static str, why: &str| {
            Err(Error::InvalidOption {
                option,
                why: why.into(),
            })
        };
        if self.every_steps == 0 {
            return bad("every_steps", "must be at least 1");
        }
        if self.full_every == 0 {
            return bad("full_every", "must be at least 1 (1: every save is full)");
        }
        if self.max_chain_links == 0
            || self.max_chain_links > crate::load::checkpoint::MAX_CHAIN_LINKS
        {
            return bad(
                "max_chain_links",
                &format!(
                    "must be 1 to {} (1: every save is full)",
                    crate::load::checkpoint::MAX_CHAIN_LINKS
                ),
            );
        }
        if self.max_delta_fraction.is_nan() || self.max_delta_fraction <= 0.0 {
            return bad("max_delta_fraction", "must be positive");
        }
        self.retention.check()
    }

    /// The policy kept in `root`, if one is: an error naming the file and the field if it is not
    /// a policy whose every field is known and every value usable. A misspelled field is never
    /// taken for the default, which could make retention remove steps the user meant to keep.
    pub(crate) fn kept_in(root: &dyn Storage) -> Result<Option<Self>> {
        if !root.exists(POLICY_FILE)? {
            return Ok(None);
        }
        let bad = |why: String| Error::BadPolicy {
            file: format!("{}/{POLICY_FILE}", root.location().trim_end_matches('/')),
            why,
        };
        let bytes = root.get(POLICY_FILE, 1 << 20)?;
        let mut json = serde_json::Deserializer::from_slice(&bytes);
        let p: Self = serde_path_to_error::deserialize(&mut json).map_err(|e| {
            let at = e.path().to_string();
            let why = e.into_inner().to_string();
            // The path is "." when the error is not inside a field (not JSON at all).
            bad(if at == "." {
                why
            } else {
                format!("{at}: {why}")
            })
        })?;
        p.check().map_err(|e| match e {
            Error::InvalidOption { option, why } => bad(format!("{option} {why}")),
            e => e,
        })?;
        Ok(Some(p))
    }

    /// Keeps the policy in `root` for later processes and restarts.
    pub(crate) fn keep_in(&self, root: &dyn Storage) -> Result<()> {
        self.check()?;
        let json = serde_json::to_vec_pretty(self).expect("a policy serializes");
        root.put(POLICY_FILE, &json, true)
    }
}

impl Retention {
    /// Checks the rules' values.
    pub fn check(&self) -> Result<()> {
        if self.keep_latest == 0 {
            return Err(Error::InvalidOption {
                option: "keep_latest",
                why: "must be at least 1: retention never removes the newest committed step".into(),
            });
        }
        if self.keep_every == Some(0) {
            return Err(Error::InvalidOption {
                option: "keep_every",
                why: "must be at least 1".into(),
            });
        }
        if self.keep_one_per_seconds == Some(0) {
            return Err(Error::InvalidOption {
                option: "keep_one_per_seconds",
                why: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::LocalFs;

    fn kept(json: &str) -> (tempfile::TempDir, Result<Option<Policy>>) {
        let dir = tempfile::tempdir().unwrap();
        let storage = LocalFs::open_dir(dir.path()).unwrap();
        storage.put(POLICY_FILE, json.as_bytes(), false).unwrap();
        let p = Policy::kept_in(&storage);
        (dir, p)
    }

    #[test]
    fn a_kept_policy_round_trips() {
        let p = Policy {
            full_every: 3,
            retention: Retention {
                keep_latest: 5,
                keep_best: Some(KeepBest {
                    metric: "auc".into(),
                    count: 2,
                    higher_is_better: true,
                }),
                ..Retention::default()
            },
            ..Policy::default()
        };
        let (_d, got) = kept(&serde_json::to_string(&p).unwrap());
        assert_eq!(got.unwrap(), Some(p));
        // Fields left out take their defaults.
        let (_d, got) = kept(r#"{"retention": {"keep_latest": 7}}"#);
        assert_eq!(got.unwrap().unwrap().retention.keep_latest, 7);
    }

    /// Every way a policy file can be unusable is an error naming the file and the field, never
    /// a default taken in its place.
    #[test]
    fn an_unusable_policy_file_is_an_error_naming_the_file_and_the_field() {
        for (json, field) in [
            (r#"{"retention": {"keep_lastest": 9}}"#, "keep_lastest"),
            (r#"{"ful_every": 2}"#, "ful_every"),
            (
                r#"{"retention": {"keep_best": {"metric": "auc", "count": 1, "higher_is_better": true, "x": 1}}}"#,
                "`x`",
            ),
            (r#"{"retention": {"keep_latest": 0}}"#, "keep_latest"),
            (r#"{"full_every": 0}"#, "full_every"),
            (r#"{"every_steps": 0}"#, "every_steps"),
            (r#"{"max_chain_links": 999}"#, "max_chain_links"),
            (r#"{"max_delta_fraction": -0.5}"#, "max_delta_fraction"),
            (r#"{"retention": {"keep_every": 0}}"#, "keep_every"),
            (r#"{"full_every": -1}"#, "full_every"),
            (r#"{"when_busy": "sometimes"}"#, "sometimes"),
            ("not json", "expected"),
        ] {
            let (dir, got) = kept(json);
            let e = got.expect_err(json);
            assert!(matches!(e, Error::BadPolicy { .. }), "{json}: {e:?}");
            let msg = e.to_string();
            assert!(msg.contains(field), "{json}: {msg}");
            let file = format!("{}/{POLICY_FILE}", dir.path().display());
            assert!(msg.contains(&file), "{json}: {msg}");
            assert_eq!(msg.lines().count(), 1, "{msg}");
        }
    }
}

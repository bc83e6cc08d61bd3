//! A save's options as its front ends say them: [`SaveSettings`], words and numbers (what
//! `saver save`'s flags and the Python package's `saver.save` keywords give), turned into
//! [`SaveOptions`] in this one place, so that an option means the same, with the same checks and
//! the same refusals, wherever it is given.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use saver_core::{Compression, Filters, ForeignRows, ScalarCondition};

use super::options::{DirectIo, SaveOptions};
use crate::error::{Error, Result};
use crate::load::restore::globs;

/// The longest wait for a busy checkpoint that a setting may ask: a week.
const LONGEST_WAIT_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// A save's options as words and numbers. Each field is named as the option it sets; a refusal
/// is an [`Error::InvalidOption`] naming that field, which each front end spells its own way
/// (`--keep-rows`, `keep_rows=`).
#[derive(Clone, Debug)]
pub struct SaveSettings {
    /// Shards of the save (`plan.shard_num`; default 1).
    pub shards: u32,
    /// The one shard this process saves, if not all (`plan.shard_index`).
    pub shard_index: Option<u32>,
    /// The save's id, the same in every process of it.
    pub save_id: Option<String>,
    /// Writer threads (default: the plan's).
    pub parallel: Option<usize>,
    /// The training step.
    pub step: Option<u64>,
    /// The user's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Replace a committed checkpoint.
    pub overwrite: bool,
    /// fsync before the commit (default true).
    pub durable: bool,
    /// Every process holds every row: each saves only its shard's (`ForeignRows::Skip`).
    pub skip_foreign_rows: bool,
    /// The parent of a delta.
    pub parent: Option<PathBuf>,
    /// Globs of slots not saved.
    pub exclude_slots: Vec<String>,
    /// Globs of the tables saved (empty: all).
    pub tables: Vec<String>,
    /// Conditions a row must meet to be saved (`slot>value`, ...: [`ScalarCondition`]).
    pub keep_rows: Vec<String>,
    /// `"zstd"`, or `None` for no compression.
    pub compress: Option<String>,
    /// zstd's level (default: [`Compression::default`]'s).
    pub compress_level: Option<i32>,
    /// `"auto"`, `"on"` or `"off"` ([`DirectIo`]).
    pub direct_io: String,
    /// Seconds to wait for a checkpoint another save holds (0 to a week; `None`: do not wait).
    pub wait_seconds: Option<f64>,
    /// Largest data file, in bytes (default: the plan's).
    pub max_file_size: Option<u64>,
    /// Memory the plan may hold before it spills rows to disk, in bytes (default: the plan's).
    pub plan_memory: Option<u64>,
}

impl Default for SaveSettings {
    fn default() -> Self {
        Self {
            shards: 1,
            shard_index: None,
            save_id: None,
            parallel: None,
            step: None,
            metadata: BTreeMap::new(),
            overwrite: false,
            durable: true,
            skip_foreign_rows: false,
            parent: None,
            exclude_slots: Vec::new(),
            tables: Vec::new(),
            keep_rows: Vec::new(),
            compress: None,
            compress_level: None,
            direct_io: "auto".into(),
            wait_seconds: None,
            max_file_size: None,
            plan_memory: None,
        }
    }
}

impl SaveSettings {
    /// The [`SaveOptions`] these settings say, checked: the plan's options valid, every glob and
    /// row condition parsed, the wait within bounds.
    pub fn options(&self) -> Result<SaveOptions> {
        let invalid = |option: &'static str, why: String| Error::InvalidOption { option, why };
        let direct_io = match self.direct_io.as_str() {
            "auto" => DirectIo::Auto,
            "on" => DirectIo::On,
            "off" => DirectIo::Off,
            other => {
                return Err(invalid(
                    "direct_io",
                    format!("must be \"auto\", \"on\" or \"off\", got {other:?}"),
                ))
            }
        };
        let wait = match self.wait_seconds {
            None => None,
            Some(s) if s.is_finite() && (0.0..=LONGEST_WAIT_SECONDS).contains(&s) => {
                Some(Duration::from_secs_f64(s))
            }
            Some(s) => {
                return Err(invalid(
                    "wait_seconds",
                    format!("must be a number of seconds from 0 to a week, got {s}"),
                ))
            }
        };
        let mut o = SaveOptions {
            save_id: self.save_id.clone(),
            step: self.step,
            overwrite: self.overwrite,
            durable: self.durable,
            user_metadata: self.metadata.clone(),
            parent: self.parent.clone(),
            direct_io,
            wait,
            ..SaveOptions::default()
        };
        let plan = &mut o.plan;
        plan.shard_num = self.shards;
        plan.shard_index = self.shard_index;
        if let Some(p) = self.parallel {
            plan.parallel = p;
        }
        if let Some(m) = self.max_file_size {
            plan.max_file_size = m;
        }
        if let Some(m) = self.plan_memory {
            plan.plan_memory = m;
        }
        if self.skip_foreign_rows {
            plan.foreign_rows = ForeignRows::Skip;
        }
        plan.compression = match self.compress.as_deref() {
            None => None,
            Some("zstd") => Some(Compression {
                level: self.compress_level.unwrap_or(Compression::default().level),
            }),
            Some(other) => {
                return Err(invalid(
                    "compress",
                    format!("must be \"zstd\" or none, got {other:?}"),
                ))
            }
        };
        plan.filters = self.filters()?;
        plan.validate()?;
        Ok(o)
    }

    /// What these settings keep of the model: slots, tables and rows.
    fn filters(&self) -> Result<Filters> {
        let mut f = Filters::new();
        for g in &self.exclude_slots {
            f = f.exclude_slots(g).map_err(|e| Error::InvalidOption {
                option: "exclude_slots",
                why: format!("{g:?}: {e}"),
            })?;
        }
        if let Some(set) = globs("tables", &self.tables)? {
            f = f.keep_blocks(move |blk| blk.table.is_none_or(|t| set.is_match(t)));
        }
        for c in &self.keep_rows {
            let cond: ScalarCondition = c.parse().map_err(|e| Error::InvalidOption {
                option: "keep_rows",
                why: format!("{c:?}: {e}"),
            })?;
            f = f.keep_rows_where(cond);
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_save_options_defaults() {
        let o = SaveSettings::default().options().unwrap();
        let d = SaveOptions::default();
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
    }

    #[test]
    fn each_refusal_names_its_setting() {
        let cases: [(SaveSettings, &str); 6] = [
            (
                SaveSettings {
                    direct_io: "sometimes".into(),
                    ..SaveSettings::default()
                },
                "direct_io",
            ),
            (
                SaveSettings {
                    wait_seconds: Some(-1.0),
                    ..SaveSettings::default()
                },
                "wait_seconds",
            ),
            (
                SaveSettings {
                    wait_seconds: Some(f64::NAN),
                    ..SaveSettings::default()
                },
                "wait_seconds",
            ),
            (
                SaveSettings {
                    compress: Some("gzip".into()),
                    ..SaveSettings::default()
                },
                "compress",
            ),
            (
                SaveSettings {
                    keep_rows: vec!["no condition".into()],
                    ..SaveSettings::default()
                },
                "keep_rows",
            ),
            (
                SaveSettings {
                    tables: vec!["[".into()],
                    ..SaveSettings::default()
                },
                "tables",
            ),
        ];
        for (s, option) in cases {
            match s.options() {
                Err(Error::InvalidOption { option: o, .. }) => assert_eq!(o, option, "{s:?}"),
                other => panic!("{s:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn each_setting_reaches_its_option() {
        let s = SaveSettings {
            shards: 4,
            shard_index: Some(2),
            save_id: Some("run7-a1".into()),
            parallel: Some(3),
            step: Some(1200),
            overwrite: true,
            durable: false,
            skip_foreign_rows: true,
            compress: Some("zstd".into()),
            compress_level: Some(9),
            direct_io: "off".into(),
            wait_seconds: Some(2.5),
            max_file_size: Some(1 << 20),
            ..SaveSettings::default()
        };
        let o = s.options().unwrap();
        assert_eq!((o.plan.shard_num, o.plan.shard_index), (4, Some(2)));
        assert_eq!(o.save_id.as_deref(), Some("run7-a1"));
        assert_eq!((o.plan.parallel, o.step), (3, Some(1200)));
        assert!(o.overwrite && !o.durable);
        assert_eq!(o.plan.foreign_rows, ForeignRows::Skip);
        assert_eq!(o.plan.compression, Some(Compression { level: 9 }));
        assert_eq!(o.direct_io, DirectIo::Off);
        assert_eq!(o.wait, Some(Duration::from_millis(2500)));
        assert_eq!(o.plan.max_file_size, 1 << 20);
    }
}

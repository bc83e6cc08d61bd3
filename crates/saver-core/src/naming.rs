//! Names: what a table, slot or dense tensor may be called, and how their tensors and files are
//! named on disk.
//!
//! Sparse tensors are named `<table>/<slot>:s<shard>.<segment>` (plus the reserved slots `ids` and
//! `__buckets__`). Table and slot names may not contain `/` or `:`, so those names can never
//! collide with each other; dense tensors keep their own names, and the planner checks the whole set
//! for collisions before writing.

use crate::error::{Error, Result};

/// Slot name of the ids tensor of a table segment.
pub const IDS: &str = "ids";
/// Slot name of the bucket index tensor of a table segment.
pub const BUCKET_INDEX: &str = "__buckets__";
/// safetensors reserves this key for string metadata.
pub const SAFETENSORS_METADATA: &str = "__metadata__";
/// File name of the Hugging Face style global index; its presence is the commit point.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Longest name accepted for a table, slot or dense tensor.
pub const MAX_NAME_LEN: usize = 512;

fn invalid(what: &'static str, name: &str, why: impl Into<String>) -> Error {
    Error::InvalidName {
        what,
        name: name.to_string(),
        why: why.into(),
    }
}

fn check_common(what: &'static str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(invalid(what, name, "it is empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid(
            what,
            name,
            format!("longer than {MAX_NAME_LEN} bytes"),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid(what, name, "it contains a control character"));
    }
    Ok(())
}

/// Checks a table name: non-empty, no `/`, `:` or control characters.
pub fn check_table_name(name: &str) -> Result<()> {
    check_common("table", name)?;
    if name.contains(['/', ':']) {
        return Err(invalid("table", name, "'/' and ':' are reserved"));
    }
    Ok(())
}

/// Suffix of the companion table of a delta checkpoint that holds a table's removed ids.
pub const REMOVED_SUFFIX: &str = ":removed";

/// Name of the companion table of `table` in a delta checkpoint: the ids removed since the
/// parent, without slots. The `:` keeps it apart from every table name a user can give.
#[doc(hidden)]
pub fn removed_table_name(table: &str) -> String {
    format!("{table}{REMOVED_SUFFIX}")
}

/// The table whose removed ids `name` holds, if `name` is such a companion table's name.
#[doc(hidden)]
pub fn removed_table_of(name: &str) -> Option<&str> {
    name.strip_suffix(REMOVED_SUFFIX)
        .filter(|t| check_table_name(t).is_ok())
}

/// Checks a table name given to the planner: a table name, or the companion table of one that
/// holds its removed ids in a delta (`removed_table_name`).
pub(crate) fn check_plan_table_name(name: &str) -> Result<()> {
    match removed_table_of(name) {
        Some(_) => Ok(()),
        None => check_table_name(name),
    }
}

/// Checks a slot name: as a table name, and not one of the reserved slot names.
pub fn check_slot_name(name: &str) -> Result<()> {
    check_common("slot", name)?;
    if name.contains(['/', ':']) {
        return Err(invalid("slot", name, "'/' and ':' are reserved"));
    }
    if name == IDS || name == BUCKET_INDEX {
        return Err(invalid(
            "slot",
            name,
            "this slot name is reserved for the table's ids",
        ));
    }
    Ok(())
}

/// Checks a dense tensor name: non-empty, no control characters, not the safetensors metadata key.
pub(crate) fn check_dense_name(name: &str) -> Result<()> {
    check_common("dense tensor", name)?;
    if name == SAFETENSORS_METADATA {
        return Err(invalid("dense tensor", name, "reserved by safetensors"));
    }
    Ok(())
}

/// Tensor name of one slot (or [`IDS`] / [`BUCKET_INDEX`]) of one segment of a table partition.
pub(crate) fn sparse_tensor_name(table: &str, slot: &str, shard: u32, segment: u32) -> String {
    format!("{table}/{slot}:s{shard}.{segment}")
}

/// Checks a save id: 1 to 64 characters of `[A-Za-z0-9_-]`, because it becomes part of file names.
#[doc(hidden)]
pub fn check_save_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidOption {
            option: "save_id",
            why: format!("{id:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"),
        })
    }
}

/// Checks a file name a document gives (or a storage call takes): one plain name inside the
/// checkpoint directory, never a path out of it. `named_in` says where the name came from.
#[doc(hidden)]
pub fn check_file_name(name: &str, named_in: &str) -> Result<()> {
    let why = if name.is_empty() {
        "empty"
    } else if name.contains('/') || name.contains('\\') {
        "contains a path separator"
    } else if name == "." || name == ".." {
        "names a directory"
    } else if name.contains('\0') {
        "contains NUL"
    } else if name.len() > 255 {
        "longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(Error::UnsafePath {
        name: name.to_string(),
        named_in: named_in.to_string(),
        why,
    })
}

/// Data file name of file `file` of shard `shard` of the save `save_id`.
///
/// Deterministic, so processes of a multi-process save never need to agree on names at run time,
/// and different per save, so a new save never overwrites the files of the checkpoint it replaces.
pub(crate) fn data_file_name(save_id: &str, shard: u32, file: u32) -> String {
    format!("model-{save_id}-s{shard:05}-f{file:04}.safetensors")
}

/// File name of the manifest one shard writes once its data are durable.
#[doc(hidden)]
pub fn shard_manifest_name(save_id: &str, shard: u32) -> String {
    format!("saver-{save_id}-s{shard:05}.shard.json")
}

/// File name of the global manifest.
pub fn manifest_name(save_id: &str) -> String {
    format!("saver-{save_id}.manifest.json")
}

/// File name of the commit claim that format 1 writers before the ownership rules created; a
/// replaced checkpoint's claim is removed with its other files.
#[doc(hidden)]
pub fn legacy_commit_claim_name(save_id: &str) -> String {
    format!("saver-{save_id}.commit-claim")
}

/// File name of the claim the one writer of shard `shard` of save `save_id` creates exclusively
/// before writing anything: a second writer of the same shard finds it and is refused.
#[doc(hidden)]
pub fn writer_claim_name(save_id: &str, shard: u32) -> String {
    format!("saver-{save_id}-s{shard:05}.writer.json")
}

/// File name of the marker that says save `save_id` can never commit, and why (written under the
/// commit lock, read by the save's other processes).
#[doc(hidden)]
pub fn rejected_name(save_id: &str) -> String {
    format!("saver-{save_id}.rejected")
}

/// File name of the lock that serialises commits into one directory. Never removed.
pub const COMMIT_LOCK: &str = ".saver-commit.lock";

/// Whether `name` is the commit lock or one of the flags of an object store's flag lock
/// (`.saver-commit.lock.<token>`): the lock's, never a save's file nor a user's.
#[doc(hidden)]
pub fn is_commit_lock(name: &str) -> bool {
    name.strip_prefix(COMMIT_LOCK)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// What a file name says about the save that wrote it, for the files saver names after a save.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaverFile<'a> {
    /// A data file (`model-<id>-s<shard>-f<file>.safetensors`) or its temporary.
    Data {
        /// The save.
        save_id: &'a str,
        /// The shard.
        shard: u32,
    },
    /// A per-shard file: shard manifest or writer claim (or a temporary of one).
    Shard {
        /// The save.
        save_id: &'a str,
        /// The shard.
        shard: u32,
    },
    /// A per-save file: global manifest, rejection marker, legacy commit claim (or a temporary).
    Save {
        /// The save.
        save_id: &'a str,
    },
}

impl<'a> SaverFile<'a> {
    /// The save the file belongs to.
    pub fn save_id(&self) -> &'a str {
        match self {
            Self::Data { save_id, .. } | Self::Shard { save_id, .. } | Self::Save { save_id } => {
                save_id
            }
        }
    }

    /// Parses a name saver gives to a save's file (or to a temporary of one: `<name>.tmp-…`).
    /// `None` for every other name, the index and the commit lock included.
    pub fn parse(name: &'a str) -> Option<Self> {
        let name = name.split_once(TMP_MARK).map_or(name, |(base, _)| base);
        if let Some(rest) = name
            .strip_prefix("model-")
            .and_then(|r| r.strip_suffix(".safetensors"))
        {
            let (rest, file) = rest.rsplit_once("-f")?;
            let (save_id, shard) = rest.rsplit_once("-s")?;
            if file.len() < 4 || !file.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return Some(Self::Data {
                save_id: checked_id(save_id)?,
                shard: parse_shard(shard)?,
            });
        }
        let rest = name.strip_prefix("saver-")?;
        for suffix in [".shard.json", ".writer.json"] {
            if let Some((save_id, shard)) =
                rest.strip_suffix(suffix).and_then(|r| r.rsplit_once("-s"))
            {
                return Some(Self::Shard {
                    save_id: checked_id(save_id)?,
                    shard: parse_shard(shard)?,
                });
            }
        }
        for suffix in [".manifest.json", ".rejected", ".commit-claim"] {
            if let Some(save_id) = rest.strip_suffix(suffix) {
                return Some(Self::Save {
                    save_id: checked_id(save_id)?,
                });
            }
        }
        None
    }
}

/// The marker in the names of temporary files: `<final name>.tmp-<writer>`.
pub const TMP_MARK: &str = ".tmp-";

fn checked_id(id: &str) -> Option<&str> {
    check_save_id(id).ok().map(|()| id)
}

fn parse_shard(s: &str) -> Option<u32> {
    (s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_table_name("user_id").is_ok());
        assert!(check_table_name("").is_err());
        assert!(check_table_name("a/b").is_err());
        assert!(check_table_name("a:b").is_err());
        assert!(check_table_name("a\nb").is_err());
        assert!(check_slot_name("ids").is_err());
        assert!(check_slot_name("__buckets__").is_err());
        assert!(check_slot_name("embedding").is_ok());
        assert!(check_dense_name("mlp/0.weight:0").is_ok());
        assert!(check_dense_name("__metadata__").is_err());
        assert!(check_dense_name(&"x".repeat(MAX_NAME_LEN + 1)).is_err());
        let e = check_table_name("a/b").unwrap_err().to_string();
        assert!(e.contains("\"a/b\""), "{e}");
    }

    #[test]
    fn save_ids_are_file_name_safe() {
        assert!(check_save_id("step-100_a").is_ok());
        assert!(check_save_id("").is_err());
        assert!(check_save_id("../x").is_err());
        assert!(check_save_id(&"a".repeat(65)).is_err());
    }

    #[test]
    fn saver_file_names_parse_back_to_their_save() {
        let id = "run7-step1200";
        for (name, expected) in [
            (
                data_file_name(id, 3, 1),
                SaverFile::Data {
                    save_id: id,
                    shard: 3,
                },
            ),
            (
                format!("{}.tmp-host-12-3", data_file_name(id, 3, 1)),
                SaverFile::Data {
                    save_id: id,
                    shard: 3,
                },
            ),
            (
                shard_manifest_name(id, 2),
                SaverFile::Shard {
                    save_id: id,
                    shard: 2,
                },
            ),
            (
                writer_claim_name(id, 0),
                SaverFile::Shard {
                    save_id: id,
                    shard: 0,
                },
            ),
            (manifest_name(id), SaverFile::Save { save_id: id }),
            (rejected_name(id), SaverFile::Save { save_id: id }),
            (
                legacy_commit_claim_name(id),
                SaverFile::Save { save_id: id },
            ),
        ] {
            assert_eq!(SaverFile::parse(&name), Some(expected), "{name}");
        }
        // Exports, user files, the index and the lock are nobody's save.
        for name in [
            "model-00001-of-00004.safetensors",
            "model-final.safetensors",
            "model.safetensors",
            "saver-notes.txt",
            INDEX_FILE,
            COMMIT_LOCK,
            ".saver-commit.lock.4711-ab12-0",
            "model-a b-s00000-f0000.safetensors",
        ] {
            assert_eq!(SaverFile::parse(name), None, "{name}");
        }
        // The lock and its flags, and nothing that only looks like them.
        assert!(is_commit_lock(COMMIT_LOCK));
        assert!(is_commit_lock(".saver-commit.lock.4711-ab12-0"));
        assert!(!is_commit_lock(".saver-commit.lockx"));
        assert!(!is_commit_lock("saver-commit.lock"));
    }

    #[test]
    fn file_names_are_deterministic() {
        assert_eq!(
            data_file_name("abc", 3, 1),
            "model-abc-s00003-f0001.safetensors"
        );
        assert_eq!(
            sparse_tensor_name("user", "embedding", 2, 0),
            "user/embedding:s2.0"
        );
    }
}

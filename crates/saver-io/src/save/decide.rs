//! The first step of every save, full or delta: what it is called, what it replaces, and that
//! its options hold, decided once and before a row is read. What follows (a delta's comparison
//! with its parent, the claim of the shards, the plan, the writes, the commit) only reads the
//! [`Decided`].

use std::time::{SystemTime, UNIX_EPOCH};

use saver_core::manifest::CheckpointRef;
use saver_core::naming::{check_save_id, removed_table_of, INDEX_FILE};
use saver_core::{PlanOptions, SaveInput};

use crate::error::{Error, Result};
use crate::load::documents::committed;
use crate::save::commit::check_not_rejected;
use crate::save::options::SaveOptions;
use crate::storage::Storage;

/// What a save decided before it reads a row.
pub(crate) struct Decided {
    /// Its save id: given, or drawn at random for a single-process save.
    pub(crate) save_id: String,
    /// The checkpoint committed in the directory when the save decided (`None`: none). The save
    /// commits only over it: one that another save overtook meanwhile fails instead of
    /// replacing it unseen.
    pub(crate) replaces: Option<CheckpointRef>,
}

/// Checks `opts` and the directory for a save of `input` into `storage` (a delta when
/// `delta`), and names the save.
pub(crate) fn decide(
    storage: &dyn Storage,
    input: &SaveInput<'_>,
    opts: &SaveOptions,
    delta: bool,
) -> Result<Decided> {
    saver_core::manifest::check_user_metadata(&opts.user_metadata)?;
    if !delta {
        // The companion tables of removed ids belong to deltas: in a full checkpoint a reader
        // refuses them.
        if let Some(t) = input
            .all_tables()
            .find(|t| removed_table_of(t.name()).is_some())
        {
            return Err(saver_core::Error::InvalidName {
                what: "table",
                name: t.name().to_string(),
                why: "'/' and ':' are reserved".into(),
            }
            .into());
        }
    }
    let save_id =
        match (&opts.save_id, opts.plan.shard_index) {
            (Some(id), _) => id.clone(),
            (None, None) => random_save_id(),
            (None, Some(_)) => return Err(Error::InvalidOption {
                option: "save_id",
                why: "a multi-process save (shard_index set) needs an explicit save id, the same \
                      in every process of that save and used by no other save or retry (for \
                      example run7-step1200-a1); one derived from the model could join shards of \
                      two different runs"
                    .into(),
            }),
        };
    check_save_id(&save_id)?;
    // The plan's own save id is the save's to set: one set by the caller would be overwritten
    // unseen, so it is refused (the default is the only value the caller may leave there).
    if opts.plan.save_id != PlanOptions::default().save_id && opts.plan.save_id != save_id {
        return Err(Error::InvalidOption {
            option: "plan.save_id",
            why: format!(
                "a save names itself from SaveOptions::save_id ({save_id}), never from \
                 plan.save_id ({}): set save_id instead",
                opts.plan.save_id
            ),
        });
    }
    plan_options(opts, &save_id).validate()?;
    let replaces = committed_before_save(storage)?;
    if let Some(existing) = &replaces {
        if existing.save_id == save_id {
            return Err(Error::Mismatch(format!(
                "{} already holds the committed save {save_id}; use another save id",
                storage.location()
            )));
        }
        if !opts.overwrite {
            return Err(Error::Exists {
                dir: storage.location().into(),
                save_id: existing.save_id.clone(),
            });
        }
    }
    check_not_rejected(storage, &save_id)?;
    Ok(Decided { save_id, replaces })
}

/// `opts.plan`, for the save named `save_id`.
pub(crate) fn plan_options(opts: &SaveOptions, save_id: &str) -> PlanOptions {
    let mut plan = opts.plan.clone();
    plan.save_id = save_id.to_string();
    plan
}

/// A save id for a single-process save given none: the time and 32 random bits.
fn random_save_id() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format!(
        "{}-{:08x}",
        now.as_secs(),
        crate::storage::identity::random_u64() as u32
    )
}

/// The committed checkpoint, with a clear error where the index is not saver's.
fn committed_before_save(storage: &dyn Storage) -> Result<Option<CheckpointRef>> {
    committed(storage).map_err(|e| match e {
        Error::Corrupt { .. } | Error::UnsupportedVersion { .. } => Error::Mismatch(format!(
            "{} holds a {INDEX_FILE} that saver cannot read as a checkpoint's ({e}); a save would \
             replace it, so save into another directory or move that file away",
            storage.location()
        )),
        e => e,
    })
}

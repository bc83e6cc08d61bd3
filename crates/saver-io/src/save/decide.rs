//! The first step of every save, full or delta: what it is called, what it replaces, that its
//! options hold, and, for a delta, its parent (opened, and checked to be one a delta may name),
//! decided once and before a row is read. What follows (a delta's comparison with its parent,
//! the claim of the shards, the plan, the writes, the commit) only reads the [`Decided`], and
//! checks here, before the save's shard manifests, that its parent is still there, and again at
//! the commit itself, under the parent directory's commit lock ([`Parent`] is a [`CommitRule`]).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use saver_core::manifest::{CheckpointRef, ParentRef};
use saver_core::naming::{check_save_id, removed_table_of, INDEX_FILE};
use saver_core::{PlanOptions, SaveInput};

use crate::error::{Error, Result};
use crate::load::checkpoint::{Checkpoint, MAX_CHAIN_LINKS};
use crate::load::documents::committed;
use crate::save::commit::CommitRule;
use crate::save::options::SaveOptions;
use crate::save::owned::check_not_rejected;
use crate::storage::{CommitLock, Storage, COMMIT_LOCK_WAIT};

/// What a save decided before it reads a row.
pub(crate) struct Decided {
    /// Its save id: given, or drawn at random for a single-process save.
    pub(crate) save_id: String,
    /// The checkpoint committed in the directory when the save decided (`None`: none). The save
    /// commits only over it: one that another save overtook meanwhile fails instead of
    /// replacing it unseen.
    pub(crate) replaces: Option<CheckpointRef>,
    /// A delta's parent ([`SaveOptions::parent`]), or `None` for a full save.
    pub(crate) parent: Option<Parent>,
}

/// A delta's parent: the chain it ends, opened once, and how the delta names it.
pub(crate) struct Parent {
    /// The parent's chain, newest link first.
    pub(crate) chain: Checkpoint,
    /// Where the delta goes.
    pub(crate) child_dir: PathBuf,
    /// What the delta's manifests name as its parent.
    pub(crate) parent_ref: ParentRef,
}

/// Checks `opts` and the directory for a save of `input` into `storage` (a delta when
/// [`SaveOptions::parent`] is set: its parent is opened last, once the rest holds), and names
/// the save.
pub(crate) fn decide(
    storage: &dyn Storage,
    input: &SaveInput<'_>,
    opts: &SaveOptions,
) -> Result<Decided> {
    let delta = opts.parent.is_some();
    saver_core::manifest::check_user_metadata(&opts.user_metadata)?;
    if !delta {
        // A chunk reduced to its changed rows stands for rows of a parent.
        if let Some(c) = input.row_chunks.iter().find(|c| c.changed_rows().is_some()) {
            return Err(Error::InvalidOption {
                option: "row-range chunk",
                why: format!(
                    "table {:?} slot {:?}: a chunk of changed rows only (only_rows) belongs to a \
                     delta; a full save holds whole chunks (or set SaveOptions::parent)",
                    c.table(),
                    c.slot()
                ),
            });
        }
    }
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
    let parent = opts
        .parent
        .as_deref()
        .map(|p| Parent::open(storage, p))
        .transpose()?;
    Ok(Decided {
        save_id,
        replaces,
        parent,
    })
}

impl Parent {
    /// Opens the chain of `parent` for a delta saved into `storage`, refusing a delta saved
    /// over a link of its own chain, or one that would make the chain too long to read.
    fn open(storage: &dyn Storage, parent: &Path) -> Result<Self> {
        let child_dir = PathBuf::from(storage.location());
        let chain = Checkpoint::open(parent).map_err(|e| match e {
            e @ Error::Chain { .. } => e,
            e => Error::Chain {
                link: child_dir.display().to_string(),
                message: format!("parent {} cannot be opened: {e}", parent.display()),
            },
        })?;
        // Refused before anything is written: a longer chain would commit and then be unreadable.
        if chain.links().len() >= MAX_CHAIN_LINKS {
            return Err(Error::Chain {
                link: child_dir.display().to_string(),
                message: format!(
                    "parent {}'s chain has {} links, the most a chain may have: compact it \
                     (saver compact) and save the delta of the compacted checkpoint, or save a \
                     full checkpoint",
                    parent.display(),
                    chain.links().len()
                ),
            });
        }
        if let Some(d) = chain
            .dirs()
            .iter()
            .find(|d| crate::storage::same_location(d, &child_dir))
        {
            return Err(Error::Chain {
                link: child_dir.display().to_string(),
                message: format!(
                    "{} is a link of the parent's chain: a delta saved over it would remove the \
                     rows it depends on; save the delta into a directory of its own",
                    d.display()
                ),
            });
        }
        // The same directory by another path (a bind mount, an NFS export, a second mount of a
        // bucket): the checkpoint it holds is a link of the chain, by its save id.
        if let Some(held) = committed(storage)? {
            if let Some(link) = chain
                .links()
                .iter()
                .position(|l| l.manifest().save_id == held.save_id)
            {
                return Err(Error::Chain {
                    link: child_dir.display().to_string(),
                    message: format!(
                        "it holds save {}, a link of the parent's chain (link {}, {}): a delta \
                         saved over it would remove the rows it depends on; save the delta into \
                         a directory of its own",
                        held.save_id,
                        link,
                        chain.dirs()[link].display()
                    ),
                });
            }
        }
        let parent_ref = chain.parent_ref_for(&child_dir)?;
        Ok(Self {
            chain,
            child_dir,
            parent_ref,
        })
    }

    /// `e`, or, when the parent was replaced while the delta was saved (an object store does
    /// not keep a replaced checkpoint's objects readable, so its reads fail as not found), the
    /// error that names the parent and what replaced it.
    pub(crate) fn explain(&self, e: Error) -> Error {
        if !e.is_about_the_checkpoint() {
            return e;
        }
        match self.check_held() {
            Err(replaced) => replaced,
            Ok(()) => e,
        }
    }

    /// An error naming the parent and what replaced it if its directory no longer commits it:
    /// the delta would name a checkpoint that is gone, and no chain through it could be read.
    /// Checked again before the delta's shard manifests are written.
    pub(crate) fn check_held(&self) -> Result<()> {
        let dir = &self.chain.dirs()[0];
        let parent = &self.parent_ref;
        let now = committed(&*crate::storage::open_location(dir)?)?;
        if now.as_ref().is_some_and(|c| parent.names(c)) {
            return Ok(());
        }
        Err(Error::Chain {
            link: dir.display().to_string(),
            message: format!(
                "the parent {} was replaced{} while a delta of it was saved; save the delta \
                 again against what the directory holds now",
                parent.save_id,
                now.map_or(" (it holds no checkpoint now)".into(), |c| format!(
                    " by save {c}"
                ))
            ),
        })
    }
}

/// A delta commits only while its parent's directory still commits the save it was made from:
/// a save that replaced the parent meanwhile (and removed its files) would leave a delta that no
/// read can follow. Checked under the parent directory's commit lock, taken before the delta's
/// own (a parent's lock before its child's, always, so no two saves wait on each other in a
/// circle), so
/// the parent cannot be replaced between the check and the delta's index.
impl CommitRule for Parent {
    fn lock(&self) -> Result<Box<dyn CommitLock>> {
        crate::storage::open_location(&self.chain.dirs()[0])?.lock_commit(COMMIT_LOCK_WAIT)
    }

    fn refusal(&self, _manifest: &saver_core::Manifest) -> Result<Option<String>> {
        match self.check_held() {
            Ok(()) => Ok(None),
            Err(Error::Chain { link, message }) => Ok(Some(format!("{link}: {message}"))),
            Err(e) => Err(e),
        }
    }
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

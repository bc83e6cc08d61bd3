//! A training job's checkpoints: [`CheckpointManager`] saves step after step into one root,
//! full or delta by its [`Policy`], keeps what the policy's [`Retention`] keeps, and restarts from
//! the newest committed step.
//!
//! Layout: the root holds one directory per step, `step-<20 digits>` ([`root`]), each an ordinary
//! checkpoint (a delta names its parent as `../step-…`), and the policy the root keeps
//! ([`policy::POLICY_FILE`]). A step is committed when its directory's index commits a save, and
//! listed only when its chain is whole down to a full checkpoint: a save under way, a crashed
//! save's files and a removal cut short are never a step anyone restores.
//!
//! What the manager guarantees, each tested in `tests/integration/manager.rs`:
//!
//! - retention runs only after the save that makes a step unnecessary has committed, counts only
//!   committed steps (a background save still running keeps nothing), keeps every link a kept
//!   step's chain needs, and removes in an order that leaves every other step whole if it is
//!   killed at any point ([`prune`]);
//! - a background save's failure is reported as soon as it happens (a callback, by default a
//!   line on stderr) and again by [`CheckpointManager::wait`] and the next save;
//! - retention and listing run off the training thread for background saves;
//! - several processes of one save (`PlanOptions::shard_index`) decide full or delta alike (from
//!   the committed steps, which every process sees once the previous save's commit is waited
//!   for), and retention is run by shard 0's process; two retentions at once remove the same
//!   files and tolerate each other.

pub mod clean;
mod order;
pub mod policy;
pub mod prune;
pub mod root;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use saver_core::SaveInput;

use crate::error::{Error, Result};
use crate::load::checkpoint::Checkpoint;
use crate::load::restore::{LoadOptions, Restored};
use crate::save::background::save_async;
use crate::save::{save, SaveOptions, SaveReport};

pub use clean::CleanReport;
pub use policy::{KeepBest, Policy, Retention, WhenBusy};
pub use prune::PruneReport;
pub use root::{Fallback, Listing, Root, StepInfo};

/// How long a process of a multi-process managed save waits for the others and the commit, when
/// its options do not say.
pub const MULTI_PROCESS_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Called with the error of a background save (or of the retention after it) as soon as it
/// fails, on the background thread.
pub type OnFailure = dyn Fn(u64, &Error) + Send + Sync;

/// What a managed save did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ManagedSave {
    /// The step saved.
    pub step: u64,
    /// Where its checkpoint is.
    pub path: PathBuf,
    /// The save's report (full or delta: see [`SaveReport::delta_tables`]).
    pub save: SaveReport,
    /// Why the save is full rather than a delta of the newest step (`None`: a delta).
    pub full_because: Option<String>,
    /// What retention did after the commit (`None`: another process of the save runs it).
    pub pruned: Option<PruneReport>,
}

/// What [`CheckpointManager::save_async`] did.
#[derive(Debug)]
pub enum Started {
    /// The save's moment is fixed; it goes on in the background.
    Saving {
        /// Its step.
        step: u64,
    },
    /// Skipped: the previous save is still running ([`WhenBusy::Skip`]).
    Skipped {
        /// The step that was not saved.
        step: u64,
        /// The step still being saved.
        running: u64,
    },
}

/// A background save and the retention after it.
struct InFlight {
    step: u64,
    thread: JoinHandle<Result<ManagedSave>>,
}

/// A training job's checkpoints in one root (local or `s3://…`): see the module docs.
///
/// ```
/// use std::sync::Arc;
/// use saver_core::{Dtype, EmbeddingTable, KeyDtype, SaveInput, SlotSpec};
/// use saver_io::{CheckpointManager, LoadOptions, Policy, SaveOptions};
///
/// # let dir = tempfile::tempdir()?;
/// let table = Arc::new(EmbeddingTable::new("item", KeyDtype::I64, vec![SlotSpec::new("w", Dtype::F32, vec![4])])?);
/// let mut policy = Policy::default();
/// policy.every_steps = 100;
/// policy.full_every = 1; // every save full (the default saves deltas between full ones)
/// policy.retention.keep_latest = 2;
/// let manager = CheckpointManager::open(dir.path(), policy)?;
/// for step in 0..=400 {
///     table.upsert(step, |row| row.slot_mut::<f32>(0).fill(step as f32)); // a training step
///     if manager.is_due(step) {
///         manager.save_async(step, SaveInput::new().table(Arc::clone(&table)), &SaveOptions::default())?;
///     }
/// }
/// manager.wait()?;
/// let kept: Vec<u64> = manager.steps()?.iter().map(|s| s.step).collect();
/// assert_eq!(kept, [300, 400]);
/// let (step, restored) = manager.restore_latest(&LoadOptions::default())?.expect("a step");
/// assert_eq!((step, restored.shards[0].tables[0].len()), (400, 401));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CheckpointManager {
    root: Root,
    policy: Policy,
    in_flight: Mutex<Option<InFlight>>,
    on_failure: Arc<OnFailure>,
    /// The next save is full, whatever the policy ([`CheckpointManager::force_full`]).
    force_full: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointManager")
            .field("root", &self.root.location())
            .field("policy", &self.policy)
            .finish()
    }
}

impl CheckpointManager {
    /// The manager of `root` (created if missing) with `policy`, which the root keeps for later
    /// processes and restarts.
    pub fn open(root: impl AsRef<Path>, policy: Policy) -> Result<Self> {
        policy.check()?;
        let root = Root::open(root.as_ref())?;
        if Policy::kept_in(root.storage())?.as_ref() != Some(&policy) {
            policy.keep_in(root.storage())?;
        }
        Ok(Self::with(root, policy))
    }

    /// The manager of `root` with the policy it keeps (the default if it keeps none).
    pub fn open_kept(root: impl AsRef<Path>) -> Result<Self> {
        let root = Root::open(root.as_ref())?;
        let policy = Policy::kept_in(root.storage())?.unwrap_or_default();
        Ok(Self::with(root, policy))
    }

    fn with(root: Root, policy: Policy) -> Self {
        Self {
            root,
            policy,
            in_flight: Mutex::new(None),
            force_full: std::sync::atomic::AtomicBool::new(false),
            on_failure: Arc::new(|step, e| {
                eprintln!("saver: the background save of step {step} failed: {e}");
            }),
        }
    }

    /// Calls `f` instead of printing a line on stderr when a background save fails. It runs on
    /// the save's own thread, while the trainer's thread may be waiting for that thread: it must
    /// not call this manager (report, set a flag, or send on a channel instead).
    pub fn on_failure(mut self, f: impl Fn(u64, &Error) + Send + Sync + 'static) -> Self {
        self.on_failure = Arc::new(f);
        self
    }

    /// The root.
    pub fn root(&self) -> &Root {
        &self.root
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether the policy saves at `step` ([`Policy::every_steps`]).
    pub fn is_due(&self, step: u64) -> bool {
        step.is_multiple_of(self.policy.every_steps)
    }

    /// The committed steps whose chains are whole, ascending.
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        Ok(self.root.list()?.steps)
    }

    /// The newest committed step whose chain is whole (`None`: the root holds none).
    pub fn latest(&self) -> Result<Option<StepInfo>> {
        self.root.latest()
    }

    /// Opens committed step `step`; an error if the root holds no such committed step.
    pub fn open_step(&self, step: u64) -> Result<Checkpoint> {
        self.root.open_step(step)
    }

    /// Restores the newest committed step with `opts` (any shard count): its step and the
    /// restored tables, or `None` when the root holds no committed step.
    pub fn restore_latest(&self, opts: &LoadOptions) -> Result<Option<(u64, Restored)>> {
        let Some(latest) = self.latest()? else {
            return Ok(None);
        };
        let r = Checkpoint::open(&latest.path)?.restore(opts)?;
        Ok(Some((latest.step, r)))
    }

    /// Saves `input` as step `step` and applies retention after its commit: full or delta by
    /// the policy, the parent the newest committed step. Waits for a background save still
    /// running first (and returns its error, if it failed). `opts` are the save's options; its
    /// `parent` and `step` are the manager's to set.
    pub fn save(&self, step: u64, input: SaveInput<'_>, opts: &SaveOptions) -> Result<ManagedSave> {
        self.wait()?;
        let (opts, full_because) = self.options_for(step, &input, opts)?;
        let path = self.root.step_path(step);
        // A failed save removes the step directory it made (see `save`).
        let report = save(&path, input, &opts)?;
        let pruned = retention_after(&self.root, &self.policy.retention, &opts)?;
        Ok(ManagedSave {
            step,
            path,
            save: report,
            full_because,
            pruned,
        })
    }

    /// Starts saving `input` as step `step` in the background ([`save_async`]): returns once
    /// the save's moment is fixed; the save, its commit and the retention after it go on on a
    /// thread of their own. One save runs at a time: with one still running, this waits for it
    /// ([`WhenBusy::Wait`], returning its error if it failed) or skips this step
    /// ([`WhenBusy::Skip`]). A failure after the moment is reported to [`Self::on_failure`]'s
    /// callback at once, and returned by [`Self::wait`] or the next save.
    pub fn save_async(
        &self,
        step: u64,
        input: SaveInput<'_>,
        opts: &SaveOptions,
    ) -> Result<Started> {
        let mut slot = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = slot.as_ref() {
            if !f.thread.is_finished() && self.policy.when_busy == WhenBusy::Skip {
                return Ok(Started::Skipped {
                    step,
                    running: f.step,
                });
            }
        }
        if let Some(f) = slot.take() {
            join(f)?;
        }
        let (opts, full_because) = self.options_for(step, &input, opts)?;
        let path = self.root.step_path(step);
        let handle = save_async(&path, input, opts.clone())?;
        let root = self.root.clone();
        let rules = self.policy.retention.clone();
        let on_failure = Arc::clone(&self.on_failure);
        let thread = std::thread::Builder::new()
            .name(format!("saver-manager-{step}"))
            .spawn(move || {
                let done = handle.wait().and_then(|report| {
                    let pruned = retention_after(&root, &rules, &opts)?;
                    Ok(ManagedSave {
                        step,
                        path,
                        save: report,
                        full_because,
                        pruned,
                    })
                });
                if let Err(e) = &done {
                    on_failure(step, e);
                }
                done
            })
            .map_err(|e| Error::Io {
                op: "start the manager's background thread",
                path: self.root.location().to_path_buf(),
                source: e,
            })?;
        *slot = Some(InFlight { step, thread });
        Ok(Started::Saving { step })
    }

    /// Waits for the background save (and its retention), if one runs: its result, or `None`
    /// when none was running.
    pub fn wait(&self) -> Result<Option<ManagedSave>> {
        let f = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        f.map(join).transpose()
    }

    /// The background save not yet waited for, if there is one: its step, and whether it has
    /// ended ([`Self::wait`] then returns at once).
    pub fn in_flight(&self) -> Option<(u64, bool)> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|f| (f.step, f.thread.is_finished()))
    }

    /// The background save's result if it has ended (then it is taken), without waiting.
    pub fn poll(&self) -> Option<Result<ManagedSave>> {
        let mut slot = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|f| f.thread.is_finished()) {
            return slot.take().map(join);
        }
        None
    }

    /// Applies `rules` (the policy's retention if `None`) to the root now.
    pub fn prune(&self, rules: Option<&Retention>, dry_run: bool) -> Result<PruneReport> {
        prune::prune(&self.root, rules.unwrap_or(&self.policy.retention), dry_run)
    }

    /// Reclaims the leftovers of crashed saves and of removals cut short ([`clean`]).
    pub fn clean(&self, dry_run: bool) -> Result<CleanReport> {
        clean::clean(&self.root, dry_run)
    }

    /// Makes the next save full, whatever the policy says (a save after a change the policy
    /// cannot see, or to start a new chain). Cleared by that save's start.
    pub fn force_full(&self) {
        self.force_full
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Checks that step `step` may be saved now (with `overwrite`, replacing the newest step):
    /// what a save checks first, to be called before any work that a refusal would waste, such
    /// as reading the model from files. The same rule holds again at the save's commit.
    pub fn check_step(&self, step: u64, overwrite: bool) -> Result<()> {
        let newest = self.root.latest()?;
        self.check_after(step, overwrite, newest.as_ref())
    }

    fn check_after(&self, step: u64, overwrite: bool, newest: Option<&StepInfo>) -> Result<()> {
        let Some(last) = newest else { return Ok(()) };
        // Only the newest step may be replaced: an older one may be a link of a newer step's
        // chain, which its replacement would break.
        if last.step > step || (last.step == step && !overwrite) {
            return Err(self.root.error(format!(
                "step {step} is not after the newest committed step {}: steps only grow \
                 (overwrite replaces the newest step)",
                last.step
            )));
        }
        Ok(())
    }

    /// The options of step `step`'s save of `input`: full or delta by the policy, its parent the
    /// newest committed step; and why it is full, if it is.
    fn options_for(
        &self,
        step: u64,
        input: &SaveInput<'_>,
        opts: &SaveOptions,
    ) -> Result<(SaveOptions, Option<String>)> {
        let mut opts = opts.clone();
        if opts.parent.is_some() {
            return Err(Error::InvalidOption {
                option: "parent",
                why: "a managed save's parent is the manager's to choose: leave it unset".into(),
            });
        }
        opts.step = Some(step);
        // What is checked below holds again at the commit, under the root's lock.
        opts.commit_rule = Some(Arc::new(order::StepOrder {
            root: self.root.clone(),
            step,
        }));
        if opts.plan.shard_index.is_some() && opts.wait.is_none() {
            // Every process returns once the save is committed, so that each decides the next
            // save (full or delta, and of which parent) from the same committed steps.
            opts.wait = Some(MULTI_PROCESS_WAIT);
        }
        // The newest step's chain only (newest first): what the decision needs, without
        // reading every step of the root on the trainer's thread.
        let mut chain = self.root.latest_chain()?;
        self.check_after(step, opts.overwrite, chain.first())?;
        chain.reverse();
        let forced = self
            .force_full
            .swap(false, std::sync::atomic::Ordering::Relaxed);
        let decided = match delta_parent(&chain, step, &self.policy) {
            _ if forced => Err("a full save was asked for".to_string()),
            Ok(parent) => match self.why_not_a_delta_of(parent, input)? {
                Some(why) => Err(why),
                None => Ok(parent),
            },
            Err(why) => Err(why),
        };
        Ok(match decided {
            Ok(parent) => {
                opts.parent = Some(parent.path.clone());
                (opts, None)
            }
            Err(why) => (opts, Some(why)),
        })
    }

    /// Why `input` cannot be saved as a delta of step `parent`: `input`'s tables differ from its
    /// in what a delta needs alike (key dtype, each slot's dtype and shape); `None` if it can. (A
    /// row-range slot whose shape or dtype changed is held whole by the delta.)
    fn why_not_a_delta_of(
        &self,
        parent: &StepInfo,
        input: &SaveInput<'_>,
    ) -> Result<Option<String>> {
        let (_, manifest) =
            crate::load::link::load_manifest(&*self.root.step_storage(parent.step)?)?;
        let changed = |change: String| {
            Ok(Some(format!(
                "the tables changed since step {}: {change}",
                parent.step
            )))
        };
        for t in input.all_tables() {
            let Some(was) = manifest.tables.iter().find(|m| m.name == t.name()) else {
                continue;
            };
            if was.key_dtype != t.key_dtype() {
                return changed(format!(
                    "table {:?} has {} ids, {} before",
                    t.name(),
                    t.key_dtype(),
                    was.key_dtype
                ));
            }
            for s in t.slots() {
                match was.slots.iter().find(|w| w.name == s.name) {
                    Some(w) if w == s => {}
                    Some(w) => {
                        return changed(format!(
                            "slot {:?} of table {:?} is {} {:?}, {} {:?} before",
                            s.name,
                            t.name(),
                            s.dtype,
                            s.shape,
                            w.dtype,
                            w.shape
                        ))
                    }
                    None => {
                        return changed(format!("table {:?} has a new slot {:?}", t.name(), s.name))
                    }
                }
            }
        }
        Ok(None)
    }
}

impl Drop for CheckpointManager {
    /// Waits for the background save: a save is never left half-done by its manager. Its
    /// failure was reported when it happened.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

/// Retention with `rules` after a save with `opts` committed, by the process that runs it: the
/// only process of a single-process save, shard 0's of a multi-process one (`None` elsewhere).
fn retention_after(
    root: &Root,
    rules: &Retention,
    opts: &SaveOptions,
) -> Result<Option<PruneReport>> {
    opts.plan
        .shard_index
        .is_none_or(|i| i == 0)
        .then(|| prune::prune(root, rules, false))
        .transpose()
}

/// The step the save of `step` is a delta of, or why it is full: by `policy`, given the
/// committed steps (ascending, steps before `step` only count).
pub(crate) fn delta_parent<'s>(
    steps: &'s [StepInfo],
    step: u64,
    policy: &Policy,
) -> std::result::Result<&'s StepInfo, String> {
    let Some(&last) = steps
        .iter()
        .filter(|s| s.step < step)
        .collect::<Vec<_>>()
        .last()
    else {
        return Err("no earlier step to be a delta of".into());
    };
    if policy.full_every <= 1 {
        return Err("the policy saves every step full (full_every 1)".into());
    }
    if last.links + 1 > policy.max_chain_links {
        return Err(format!(
            "a delta would make a chain of {} links, past max_chain_links {}",
            last.links + 1,
            policy.max_chain_links
        ));
    }
    // Saves since the last full one, this one included.
    if last.links as u32 + 1 > policy.full_every {
        return Err(format!(
            "every {}th save is full (full_every)",
            policy.full_every
        ));
    }
    if last.is_delta() {
        let Some(base) = chain_base(steps, last) else {
            return Err(format!("the chain of step {} is not whole", last.step));
        };
        if last.bytes as f64 > policy.max_delta_fraction * base.bytes.max(1) as f64 {
            return Err(format!(
                "the delta of step {} holds more than {} of its base's bytes \
                 (max_delta_fraction)",
                last.step, policy.max_delta_fraction
            ));
        }
    }
    Ok(last)
}

/// The full checkpoint at the root of `s`'s chain.
fn chain_base<'s>(steps: &'s [StepInfo], s: &'s StepInfo) -> Option<&'s StepInfo> {
    let mut at = s;
    while let Some(p) = at.parent {
        at = steps.iter().find(|x| x.step == p)?;
    }
    Some(at)
}

fn join(f: InFlight) -> Result<ManagedSave> {
    f.thread.join().unwrap_or_else(|_| {
        Err(Error::Mismatch(format!(
            "the background save of step {} panicked",
            f.step
        )))
    })
}

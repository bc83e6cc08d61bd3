//! A managed root: one directory (or object-store prefix) of step directories, each a checkpoint.
//!
//! Step `S` lives in `step-<S as 20 digits>`, so that a listing sorted by name is sorted by step.
//! A step is *committed* when its directory's index commits a save (the same rule as any
//! checkpoint), and *whole* when every parent of its chain is a committed step of the root that
//! holds the save the child names (save id and manifest checksum) down to a full checkpoint.
//! Listing reads the index and the manifest of each step, never a data file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use saver_core::naming::{SaverFile, INDEX_FILE};
use saver_core::Manifest;

use crate::error::{Error, Result};
use crate::storage::Storage;

/// Prefix of a step directory's name.
pub const STEP_PREFIX: &str = "step-";

/// Name of the marker a prune writes into a step directory before it removes the step's
/// files: a directory holding it and no index is a removal that was cut short, which
/// [`crate::manage::CheckpointManager::clean`] finishes.
pub const PRUNE_MARKER: &str = "saver-pruning.json";

/// The directory name of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:020}")
}

/// The step a directory name names, if it is a step directory's name.
pub(crate) fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// One committed step of a root, as its manifest tells it.
#[derive(Clone, Debug, Serialize)]
pub struct StepInfo {
    /// The trainer step.
    pub step: u64,
    /// Its checkpoint's location (a directory, or an object-store URL).
    pub path: PathBuf,
    /// The save id of its checkpoint.
    pub save_id: String,
    /// The step whose checkpoint this one is a delta of (`None`: a full checkpoint).
    pub parent: Option<u64>,
    /// Links of its chain, itself included (1 for a full checkpoint).
    pub links: usize,
    /// Bytes of its own data files.
    pub bytes: u64,
    /// Shards it was saved with.
    pub shards: u32,
    /// When its first writer started, in milliseconds since the Unix epoch (0 when unknown).
    pub started_unix_ms: u64,
    /// The processes that wrote it (`host:pid`).
    pub writers: Vec<String>,
    /// The save's user metadata (metrics kept by a best-by-metric rule live here).
    pub user_metadata: BTreeMap<String, String>,
}

impl StepInfo {
    /// Whether the checkpoint is a delta.
    pub fn is_delta(&self) -> bool {
        self.parent.is_some()
    }
}

/// What a listing found beside the committed, whole steps.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Listing {
    /// Committed steps whose chains are whole, by step.
    pub steps: Vec<StepInfo>,
    /// Step directories that hold no committed checkpoint (a save under way, or a crashed
    /// one's leftovers, or a removal cut short), by step.
    pub uncommitted: Vec<u64>,
    /// Committed steps that cannot be read (a broken chain, an unreadable manifest), and why.
    pub broken: Vec<(u64, String)>,
    /// Committed steps whose directories hold files of other saves beside the committed one
    /// (a save under way, or a killed one's leftovers, which `clean` reclaims once its writers
    /// have ended), with how many: what is on disk beyond what is committed.
    pub others_beside: Vec<(u64, usize)>,
}

/// What [`Root::latest_verified`] found.
#[derive(Clone, Debug, Serialize)]
pub struct Fallback {
    /// The newest committed step that verifies (`None`: none does).
    pub step: Option<StepInfo>,
    /// Newer committed steps that do not verify, newest first, with the first problem found.
    pub passed_over: Vec<(u64, String)>,
}

/// Opens the storage of a step directory.
pub type StepOpener = dyn Fn(&Path) -> Result<Arc<dyn Storage>> + Send + Sync;

/// A root: where its step directories are.
#[derive(Clone)]
pub struct Root {
    location: PathBuf,
    storage: Arc<dyn Storage>,
    open_step: Arc<StepOpener>,
}

impl std::fmt::Debug for Root {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Root")
            .field("location", &self.location)
            .finish()
    }
}

/// A committed step's manifest, before its chain is checked.
struct Read {
    step: u64,
    manifest_crc32: u32,
    manifest: Manifest,
}

impl Root {
    /// The root at `location` (a directory, created if missing, or an object-store URL).
    pub fn open(location: &Path) -> Result<Self> {
        let storage = crate::storage::create_location(location)?;
        let root = Self::with(location, storage);
        root.check_not_a_checkpoint()?;
        Ok(root)
    }

    /// An error if the location holds a checkpoint itself (its index): a managed root holds
    /// step directories, and taking a checkpoint for an empty root would list nothing and save
    /// steps inside it.
    fn check_not_a_checkpoint(&self) -> Result<()> {
        if self.storage.exists(INDEX_FILE)? {
            return Err(self.error(format!(
                "holds a checkpoint ({INDEX_FILE}), not the step directories of a managed \
                 root: give the checkpoint's path without --step/--root, or the root that holds \
                 it"
            )));
        }
        Ok(())
    }

    fn with(location: &Path, storage: Arc<dyn Storage>) -> Self {
        Self {
            location: location.to_path_buf(),
            storage,
            open_step: Arc::new(|p: &Path| crate::storage::open_location(p)),
        }
    }

    /// This root with its step directories' storage opened by `open` (a storage that counts,
    /// delays or fails operations: how the removal's crash safety is tested).
    pub fn with_step_opener(
        mut self,
        open: impl Fn(&Path) -> Result<Arc<dyn Storage>> + Send + Sync + 'static,
    ) -> Self {
        self.open_step = Arc::new(open);
        self
    }

    /// The root at `location`, which must exist (for commands that only read or prune it).
    pub fn open_existing(location: &Path) -> Result<Self> {
        let storage = crate::storage::open_location(location)?;
        let root = Self::with(location, storage);
        root.check_not_a_checkpoint()?;
        Ok(root)
    }

    /// Where the root is.
    pub fn location(&self) -> &Path {
        &self.location
    }

    /// The root's own storage (where its policy file is).
    pub fn storage(&self) -> &dyn Storage {
        &*self.storage
    }

    /// The location of step `step`'s directory.
    pub fn step_path(&self, step: u64) -> PathBuf {
        self.location.join(step_dir_name(step))
    }

    /// The steps that have a directory, ascending.
    pub(crate) fn step_dirs(&self) -> Result<Vec<u64>> {
        let mut steps: Vec<u64> = self
            .storage
            .list_dirs()?
            .iter()
            .filter_map(|n| parse_step_dir(n))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// The storage of step `step`'s directory.
    pub(crate) fn step_storage(&self, step: u64) -> Result<Arc<dyn Storage>> {
        (self.open_step)(&self.step_path(step))
    }

    /// Reads step `step`'s committed manifest; `None` if the step holds no committed checkpoint.
    fn read(&self, step: u64) -> Result<Option<Read>> {
        let storage = self.step_storage(step)?;
        // Three requests a step on an object store: the index's HEAD, then the index and the
        // manifest, which are read and checked against each other as one.
        if !storage.exists(INDEX_FILE)? {
            return Ok(None);
        }
        let (index, manifest) = crate::load::link::load_manifest(&*storage)?;
        Ok(Some(Read {
            step,
            manifest_crc32: index.metadata.saver_manifest_crc32,
            manifest,
        }))
    }

    /// [`Self::read`] of each of `steps`, several at a time: an object store answers each in
    /// milliseconds, and a root may hold thousands.
    fn read_all(&self, steps: &[u64]) -> Vec<Result<Option<Read>>> {
        const AT_ONCE: usize = 16;
        let chunk = steps.len().div_ceil(AT_ONCE).max(1);
        std::thread::scope(|s| {
            let running: Vec<_> = steps
                .chunks(chunk)
                .map(|part| s.spawn(move || part.iter().map(|&st| self.read(st)).collect()))
                .collect();
            running
                .into_iter()
                .flat_map(|h| -> Vec<Result<Option<Read>>> {
                    h.join().unwrap_or_else(|_| {
                        vec![Err(Error::Mismatch("a listing thread panicked".into()))]
                    })
                })
                .collect()
        })
    }

    /// Every step: committed and whole, uncommitted, or broken.
    pub fn list(&self) -> Result<Listing> {
        let mut listing = Listing::default();
        let mut read: BTreeMap<u64, Read> = BTreeMap::new();
        let steps = self.step_dirs()?;
        for (step, r) in steps.iter().copied().zip(self.read_all(&steps)) {
            match r {
                Ok(Some(r)) => {
                    read.insert(step, r);
                }
                Ok(None) => listing.uncommitted.push(step),
                Err(e) => listing.broken.push((step, e.to_string())),
            }
        }
        let mut links: BTreeMap<u64, std::result::Result<(Option<u64>, usize), String>> =
            BTreeMap::new();
        for &step in read.keys() {
            let chain = chain_of(step, &read, &mut links);
            match chain {
                Ok((parent, n)) => listing.steps.push(self.info(&read[&step], parent, n)),
                Err(why) => listing.broken.push((step, why)),
            }
        }
        listing.broken.sort_by_key(|b| b.0);
        let committed: Vec<(u64, String)> = read
            .values()
            .map(|r| (r.step, r.manifest.save_id.clone()))
            .collect();
        let counted = crate::storage::at_once::all_at_once(committed, 16, |(step, id)| {
            let names = self.step_storage(step)?.list()?;
            let others = names
                .iter()
                .filter(|n| SaverFile::parse(n).is_some_and(|f| f.save_id() != id))
                .count();
            Ok::<_, Error>((step, others))
        });
        for c in counted {
            let (step, others) = c?;
            if others > 0 {
                listing.others_beside.push((step, others));
            }
        }
        Ok(listing)
    }

    /// The newest committed step whose chain is whole, reading only the manifests of the newest
    /// steps and their chains (not the whole root).
    pub fn latest(&self) -> Result<Option<StepInfo>> {
        Ok(self.latest_chain()?.into_iter().next())
    }

    /// The newest committed step whose chain is whole and every link of its chain, newest
    /// first (empty: the root holds none), reading only those steps' manifests and those of
    /// newer steps that are not whole.
    pub(crate) fn latest_chain(&self) -> Result<Vec<StepInfo>> {
        let mut read: BTreeMap<u64, Read> = BTreeMap::new();
        let mut links = BTreeMap::new();
        for step in self.step_dirs()?.into_iter().rev() {
            let Ok(Some(r)) = self.read(step) else {
                continue;
            };
            read.insert(step, r);
            // Its chain's links, read as the chain names them.
            let mut at = step;
            while let Some(p) = read[&at].manifest.parent.as_ref().and_then(parent_step) {
                if read.contains_key(&p) {
                    break;
                }
                match self.read(p) {
                    Ok(Some(r)) => {
                        read.insert(p, r);
                        at = p;
                    }
                    _ => break,
                }
            }
            if chain_of(step, &read, &mut links).is_err() {
                continue;
            }
            let mut chain = Vec::new();
            let mut at = Some(step);
            while let Some(s) = at {
                let Ok((parent, n)) = chain_of(s, &read, &mut links) else {
                    break;
                };
                chain.push(self.info(&read[&s], parent, n));
                at = parent;
            }
            return Ok(chain);
        }
        Ok(Vec::new())
    }

    /// The newest committed step whose chain is whole and verifies (every CRC32 of every link:
    /// `saver verify`), and the newer committed steps passed over, with why: where a restart
    /// goes when asked to fall back rather than fail on a damaged newest step. Verifying reads
    /// each step tried whole.
    pub fn latest_verified(&self, parallel: usize) -> Result<Fallback> {
        let mut passed_over = Vec::new();
        for s in self.list()?.steps.into_iter().rev() {
            let report = crate::tools::verify::verify(&s.path, parallel)?;
            if report.status == crate::tools::verify::Status::Ok {
                return Ok(Fallback {
                    step: Some(s),
                    passed_over,
                });
            }
            let why = report
                .problems
                .first()
                .map_or(format!("{:?}", report.status), |p| {
                    format!("{}: {}", p.file, p.detail)
                });
            passed_over.push((s.step, why));
        }
        Ok(Fallback {
            step: None,
            passed_over,
        })
    }

    /// Opens committed step `step`; an error if the root holds no such committed step. Reads
    /// no policy: a restart needs none.
    pub fn open_step(&self, step: u64) -> Result<crate::load::checkpoint::Checkpoint> {
        let path = self.step_path(step);
        let held = self
            .step_storage(step)
            .and_then(|s| crate::load::documents::committed(&*s))
            .ok()
            .flatten();
        if held.is_none() {
            let latest = self.latest()?.map(|s| s.step);
            return Err(self.error(format!(
                "step {step} is not a committed checkpoint of this root (latest committed: {})",
                latest.map_or("none".into(), |s| s.to_string())
            )));
        }
        crate::load::checkpoint::Checkpoint::open(&path)
    }

    fn info(&self, r: &Read, parent: Option<u64>, links: usize) -> StepInfo {
        let m = &r.manifest;
        let writers: Vec<_> = m.shards.iter().filter_map(|s| s.writer.as_ref()).collect();
        StepInfo {
            step: r.step,
            path: self.step_path(r.step),
            save_id: m.save_id.clone(),
            parent,
            links,
            bytes: m.files.iter().map(|f| f.bytes).sum(),
            shards: m.shard_num,
            started_unix_ms: writers.iter().map(|w| w.started_unix_ms).min().unwrap_or(0),
            writers: writers
                .iter()
                .map(|w| format!("{}:{}", w.host, w.pid))
                .collect(),
            user_metadata: m.user_metadata.clone(),
        }
    }

    /// An error naming the root.
    pub(crate) fn error(&self, why: String) -> Error {
        Error::Mismatch(format!("{}: {why}", self.location.display()))
    }
}

/// The step a parent reference names, when it is a sibling step directory of the root (how the
/// manager writes every parent).
pub(crate) fn parent_step(p: &saver_core::ParentRef) -> Option<u64> {
    parse_step_dir(p.path.strip_prefix("../")?)
}

/// The parent step and the chain length of committed step `step`, or why its chain is not
/// whole; memoised in `done`.
fn chain_of(
    step: u64,
    read: &BTreeMap<u64, Read>,
    done: &mut BTreeMap<u64, std::result::Result<(Option<u64>, usize), String>>,
) -> std::result::Result<(Option<u64>, usize), String> {
    // Walk to the base first (no recursion: a chain may be long), then fill in upwards.
    let mut path = vec![step];
    let mut result: std::result::Result<usize, String> = Ok(0);
    loop {
        let at = *path.last().expect("one step");
        if let Some(d) = done.get(&at) {
            path.pop();
            result = d.clone().map(|(_, n)| n);
            break;
        }
        let Some(r) = read.get(&at) else {
            path.pop();
            result = Err(format!(
                "its parent step {at} holds no committed checkpoint"
            ));
            break;
        };
        let Some(p) = &r.manifest.parent else {
            break;
        };
        let Some(ps) = parent_step(p) else {
            result = Err(format!("its parent {} is not a step of this root", p.path));
            break;
        };
        if let Some(pr) = read.get(&ps) {
            if pr.manifest.save_id != p.save_id || pr.manifest_crc32 != p.manifest_crc32 {
                result = Err(format!(
                    "its parent step {ps} holds save {}, not save {} it was made from",
                    pr.manifest.save_id, p.save_id
                ));
                break;
            }
        }
        if path.contains(&ps) || path.len() > crate::load::checkpoint::MAX_CHAIN_LINKS {
            result = Err("its chain is a cycle or too long".into());
            break;
        }
        path.push(ps);
    }
    // `result` is the chain length below the last step in `path` (0: it is the base itself,
    // not yet counted), or the error every step above inherits.
    let mut below = result;
    while let Some(at) = path.pop() {
        let entry = match &below {
            Ok(n) => {
                let parent = read[&at].manifest.parent.as_ref().and_then(parent_step);
                Ok((parent, n + 1))
            }
            Err(why) => Err(why.clone()),
        };
        below = entry.clone().map(|(_, n)| n);
        done.insert(at, entry);
    }
    done.get(&step)
        .cloned()
        .unwrap_or_else(|| Err("not read".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_sort_by_step() {
        let mut names: Vec<String> = [10u64, 9, 100, 0, u64::MAX]
            .iter()
            .map(|&s| step_dir_name(s))
            .collect();
        names.sort();
        let steps: Vec<u64> = names.iter().map(|n| parse_step_dir(n).unwrap()).collect();
        assert_eq!(steps, vec![0, 9, 10, 100, u64::MAX]);
        assert_eq!(parse_step_dir("step-12"), None);
        assert_eq!(parse_step_dir("step-0000000000000000001x"), None);
        assert_eq!(parse_step_dir("other"), None);
    }
}

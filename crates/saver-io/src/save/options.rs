//! What a save is asked to do.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use saver_core::manifest::trainer_state;
use saver_core::PlanOptions;

use crate::error::Result;
use crate::save::commit::CommitRule;

/// How far a save's writing has come, as handed to [`SaveOptions::progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes of tensor data just written, by the call that reports it.
    pub bytes: u64,
    /// Bytes of tensor data written so far by this call.
    pub written: u64,
    /// Bytes of tensor data this call writes in all: `written / total` is the fraction done.
    pub total: u64,
}

/// Called with the save's [`Progress`] as pieces are written, from writer threads.
pub type ProgressFn = dyn Fn(Progress) + Send + Sync;

/// How to save.
#[derive(Clone)]
pub struct SaveOptions {
    /// Shards, filters, parallelism, file sizes. The save sets `plan.save_id` from
    /// [`Self::save_id`]: a save refuses one set here to anything else.
    pub plan: PlanOptions,
    /// Identifies the save; part of every file name. Default: random, for a single-process save.
    /// A multi-process save (`plan.shard_index` set) must be given one, the same in every process
    /// of that save and used by no other save, nor by a retry of it (for example
    /// `run7-step1200-a1`, with the job's attempt number): a second writer of a shard under one
    /// save id gets the save rejected rather than mixed.
    pub save_id: Option<String>,
    /// The trainer step this save belongs to, if the trainer gives one. Stored in the manifest;
    /// every process of a multi-process save must give the same.
    pub step: Option<u64>,
    /// fsync data, manifests and directory before each rename (default true). Without it a power
    /// loss can lose a checkpoint that looked committed.
    pub durable: bool,
    /// Replace a committed checkpoint in the directory. The old one stays loadable until the new
    /// one is committed, then its files are removed.
    pub overwrite: bool,
    /// Multi-process: wait up to this long for the other shards and the commit. `None`: return as
    /// soon as this process's shard is durable (committing if it completes the set).
    pub wait: Option<Duration>,
    /// Free-form metadata stored in the manifest.
    pub user_metadata: BTreeMap<String, String>,
    /// This process's trainer state, already encoded (see [`Self::with_trainer_state`]).
    pub trainer_state: Option<String>,
    /// Whether durable saves by [`crate::save()`] write their data files with direct I/O (`O_DIRECT`,
    /// around the page cache). Default [`DirectIo::Auto`]. [`crate::save_to`] leaves it to the storage
    /// it is given (see [`crate::storage::LocalFs::with_direct_io`]).
    pub direct_io: DirectIo,
    /// Save a delta of the checkpoint in this directory (which may itself be a delta): only the
    /// rows inserted or changed since it, whole, and the ids removed since it, found by comparing
    /// each table's rows with the parent's (see [`crate::save`](mod@crate::save)). `None` (default): a full
    /// checkpoint. The manifest names the parent by its path relative to the new checkpoint, its
    /// save id and its manifest's checksum; loading the delta resolves the chain.
    pub parent: Option<PathBuf>,
    /// Progress callback, called from writer threads with the bytes just written, the bytes
    /// written so far and the total ([`Progress`]). It must own what it uses (`'static`): to
    /// count into a variable of yours, share it through an `Arc`:
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// let percent = Arc::new(AtomicU64::new(0));
    /// let shown = Arc::clone(&percent);
    /// let mut opts = saver_io::SaveOptions::default();
    /// opts.progress = Some(Arc::new(move |p: saver_io::Progress| {
    ///     shown.store(p.written * 100 / p.total.max(1), Ordering::Relaxed);
    /// }));
    /// // ... save with `opts`, then read `percent.load(Ordering::Relaxed)`.
    /// ```
    pub progress: Option<Arc<ProgressFn>>,
    /// A rule the save must pass at its commit, beyond the directory's own (see
    /// [`CommitRule`]). [`crate::CheckpointManager`] sets its own; `None` (default) for a plain
    /// save.
    pub commit_rule: Option<Arc<dyn CommitRule>>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            plan: PlanOptions::default(),
            save_id: None,
            step: None,
            durable: true,
            overwrite: false,
            wait: None,
            user_metadata: BTreeMap::new(),
            trainer_state: None,
            direct_io: DirectIo::Auto,
            parent: None,
            progress: None,
            commit_rule: None,
        }
    }
}

impl SaveOptions {
    /// The options of one process of a multi-process save: it writes `shard` (of
    /// `shard.count`), in the save named `save_id`, the same in every process of the save.
    ///
    /// ```
    /// use saver_core::Shard;
    /// use saver_io::SaveOptions;
    /// let opts = SaveOptions::for_shard(Shard { index: 3, count: 8 }, "run7-step1200");
    /// assert_eq!((opts.plan.shard_num, opts.plan.shard_index), (8, Some(3)));
    /// ```
    pub fn for_shard(shard: saver_core::Shard, save_id: impl Into<String>) -> Self {
        let mut o = Self::default();
        o.plan.shard_num = shard.count;
        o.plan.shard_index = Some(shard.index);
        o.save_id = Some(save_id.into());
        o
    }

    /// Stores a typed trainer state (step, RNG state, data position…), read back with
    /// [`crate::Link::trainer_state`].
    pub fn with_trainer_state<T: Serialize>(mut self, state: &T) -> Result<Self> {
        self.trainer_state = Some(trainer_state::encode(state)?);
        Ok(self)
    }
}

/// When a save writes its data files with direct I/O.
///
/// Direct I/O skips the kernel's copy into the page cache and the writeback the fsync then waits
/// for: durable saves took half the time in our measurements (docs/benchmarks/HISTORY.md), and a large
/// checkpoint no longer evicts the training data from the page cache. The checkpoint is then not
/// in the page cache either, so a load right after a save on the same machine reads the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectIo {
    /// For durable saves on local disk filesystems known to do direct I/O well (ext4, XFS); off
    /// elsewhere (network and FUSE filesystems, tmpfs, btrfs) and for saves without fsync, which
    /// leave the data in the page cache for the kernel to write when it likes.
    #[default]
    Auto,
    /// Wherever the filesystem accepts `O_DIRECT`, with or without fsync.
    On,
    /// Never.
    Off,
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("plan", &self.plan)
            .field("save_id", &self.save_id)
            .field("step", &self.step)
            .field("durable", &self.durable)
            .field("overwrite", &self.overwrite)
            .field("wait", &self.wait)
            .field("user_metadata", &self.user_metadata)
            .field(
                "trainer_state",
                &self.trainer_state.as_ref().map(String::len),
            )
            .field("direct_io", &self.direct_io)
            .field("parent", &self.parent)
            .field("progress", &self.progress.as_ref().map(|_| "<fn>"))
            .field("commit_rule", &self.commit_rule.as_ref().map(|_| "<rule>"))
            .finish()
    }
}

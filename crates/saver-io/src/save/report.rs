//! What a save did.

use std::collections::BTreeMap;

use serde::Serialize;

use saver_core::table::TableSemantics;

/// What a save did.
#[derive(Clone, Debug, Serialize)]
pub struct SaveReport {
    /// The save id (part of every file name).
    pub save_id: String,
    /// Shards this call wrote.
    pub shards: Vec<u32>,
    /// Data files this call wrote.
    pub files: usize,
    /// Rows written, over all tables.
    pub rows: u64,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// Data files written with direct I/O, around the page cache (see [`crate::DirectIo`]); the rest
    /// went through the page cache, by choice or because their filesystem refused `O_DIRECT`.
    pub direct_io_files: usize,
    /// Rows whose place in the plan waited in the spill file rather than memory
    /// (`PlanOptions::plan_memory`).
    pub spilled_rows: u64,
    /// Rows given to this process that belong to shards it does not write, left out because
    /// `PlanOptions::foreign_rows` is `ForeignRows::Skip` (another process writes them).
    pub skipped_rows: u64,
    /// Seconds spent snapshotting and planning.
    pub plan_seconds: f64,
    /// Seconds spent writing data and making it durable.
    pub write_seconds: f64,
    /// Seconds spent committing (shard manifests, index; waiting, if asked).
    pub commit_seconds: f64,
    /// Whether the checkpoint is committed when the call returns.
    pub committed: bool,
    /// Whether this call wrote the index.
    pub committed_here: bool,
    /// The checkpoint this call's commit replaced, whose files it then removed.
    pub replaced: Option<String>,
    /// Files in the directory that belong neither to this checkpoint nor to the one it replaced,
    /// left untouched: other saves' files (in progress, or left by a save that failed or
    /// crashed) and files that are not saver's. Filled in by the call that committed.
    pub left_alone: Vec<String>,
    /// What writers of this host that had ended (killed, crashed) left, cleaned up by this save
    /// before it wrote: an object store's incomplete multipart uploads, named by their markers,
    /// and the files of saves whose every writer has provably ended.
    pub cleaned_up: Vec<String>,
    /// What the saved rows of each table show: their values at the save's moment (point-in-time,
    /// whatever was written during the save), or each row as the save reached it.
    pub table_semantics: BTreeMap<String, TableSemantics>,
    /// A delta save: how each table's changes were found, tracked or compared (and why). Empty
    /// for a full save.
    pub delta_tables: BTreeMap<String, DeltaMethod>,
    /// The most memory copy-on-write held for this save's moment at once: pre-images of rows
    /// the trainers wrote while the save read them (each table's peak, summed).
    pub copy_on_write_peak_bytes: u64,
}

/// How a delta save found a table's changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "method")]
pub enum DeltaMethod {
    /// The table's record of its changes since the parent gave them: nothing was compared.
    Tracked,
    /// Every row was compared with the parent's chain, for the reason given.
    Compared {
        /// Why the table's changes could not be tracked.
        why: String,
    },
}

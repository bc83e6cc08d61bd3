//! Rewriting a checkpoint for another number of shards, and compacting a chain into one
//! checkpoint.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use saver_core::{ByteSource, RowRangeChunk, SaveInput};

use crate::error::Result;
use crate::load::checkpoint::Checkpoint;
use crate::load::checkpoint::RowsInto;
use crate::load::link::Link;
use crate::save::{save, SaveOptions, SaveReport};
use crate::source::first_trainer_state;
use crate::source::{save_input, Source, SourceTables};

/// Rewrites the newest state of `src` (a delta resolved over its chain) into `out` as a full
/// checkpoint of `opts.plan.shard_num` shards. Tables, slots, dense tensors and user metadata are
/// kept; trainer state is per worker and does not map onto a new worker count, so shard 0's state
/// is given to every new shard.
///
/// Row-range tables are cut anew into one chunk of rows per new shard (all their columns), their
/// deltas' changed rows put over their parents'.
///
/// Memory: the rows of hashed tables are read from `src` as the save writes them, in the order
/// they lie in its files, so the rewrite holds what a save holds (`opts.plan`'s buffers) plus the
/// dense tensors, whatever the number of rows: the row-range tables are read a writer's chunk at
/// a time too ([`row_chunks`]). Every byte read is checked against its checksum.
pub fn reshard(src: &Checkpoint, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    let tables = SourceTables::of_checkpoint(src)?;
    let dense = src.dense_tensors(None, &mut crate::LoadReport::default())?;
    let chunks = row_chunks(src, opts.plan.shard_num, None)?;
    rewrite(src.newest(), tables, dense, chunks, out, opts)
}

/// The row-range tables of `src` (resolved over its chain) as chunks of rows for `shards`
/// shards: table rows cut into `shards` even ranges ([`saver_core::Shard::rows_of`]), each
/// range of every slot (all its columns) one chunk; only shard `only`'s when given, for a process
/// of a multi-process save.
///
/// The chunks hold no rows: the save reads each writer's chunk of them from `src` as it writes
/// it ([`RowRangeChunk::of_rows_deferred`]), each byte checked against its checksum, so that a
/// copy of tables larger than memory holds what a save holds. Every read is of `src` as it was
/// opened: a checkpoint replaced meanwhile fails the save (which [`compact`] then runs again on
/// the new one), never a copy of two saves.
pub fn row_chunks(
    src: &Checkpoint,
    shards: u32,
    only: Option<u32>,
) -> Result<Vec<RowRangeChunk<'_>>> {
    let mut chunks = Vec::new();
    for shard in saver_core::Shard::selected(shards, only) {
        for t in &src.manifest().row_tables {
            let rows = shard.rows_of(t.rows);
            // A shard of no rows is a chunk too: it keeps a table of no rows in the copy.
            for s in &t.slots {
                let width = s.shape.get(1).copied().unwrap_or(1);
                let source = SlotRows {
                    src,
                    table: t.name.clone(),
                    slot: s.name.clone(),
                    rows: rows.clone(),
                    row_bytes: s.dtype.byte_len(width).unwrap_or(0),
                };
                chunks.push(RowRangeChunk::of_rows_deferred(
                    &t.name,
                    &s.name,
                    s.dtype,
                    &s.shape,
                    rows.clone(),
                    Arc::new(source),
                )?);
            }
        }
    }
    Ok(chunks)
}

/// Rows `rows` of one slot of a row-range table of a checkpoint, as bytes read on demand.
#[derive(Debug)]
struct SlotRows<'c> {
    src: &'c Checkpoint,
    table: String,
    slot: String,
    rows: Range<u64>,
    row_bytes: u64,
}

impl ByteSource for SlotRows<'_> {
    fn len(&self) -> u64 {
        (self.rows.end - self.rows.start) * self.row_bytes
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> saver_core::Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // The whole rows the bytes asked for lie in; a writer's chunk that starts or ends
        // within a row reads that row whole, beside.
        let first = offset / self.row_bytes;
        let last = (offset + out.len() as u64).div_ceil(self.row_bytes);
        let rows = self.rows.start + first..self.rows.start + last;
        let skip = (offset - first * self.row_bytes) as usize;
        let covering = ((last - first) * self.row_bytes) as usize;
        let read = |buf: &mut [u8]| {
            self.src
                .load_rows_once(
                    &self.table,
                    rows.clone(),
                    &mut [RowsInto::new(&self.slot, buf)],
                )
                .map(drop)
        };
        if skip == 0 && covering == out.len() {
            read(out)?;
        } else {
            let mut whole = vec![0u8; covering];
            read(&mut whole)?;
            out.copy_from_slice(&whole[skip..skip + out.len()]);
        }
        Ok(())
    }
}

/// What `saver save --from` saves: the model of `source` (a checkpoint or chain, or a plain
/// safetensors input) as this process's input, handed to `save` with `opts` completed: the
/// source's trainer state where `opts` gives none, its user metadata, and this process's shard
/// of rows of every row-range table (`opts.plan.shard_index`, or all of them). A plain input's
/// rows are first distributed by bucket into temporary files beside `beside` (the checkpoint's
/// location, on its filesystem, gone with the process; the system's temporary directory when it
/// is an object store), in `rounds` rounds (`None`: as many as suit the table and the machine).
/// Nothing is held whole but the dense tensors: the tables' rows are read as the save writes
/// them.
pub fn with_source_input<T, E: From<crate::Error>>(
    source: &Source,
    opts: &mut SaveOptions,
    beside: &Path,
    rounds: Option<usize>,
    save: impl FnOnce(SaveInput<'_>, &SaveOptions) -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let (shards, only) = (opts.plan.shard_num, opts.plan.shard_index);
    let row_chunks = match source {
        Source::Checkpoint(c) => row_chunks(c, shards, only)?,
        Source::Plain(p) => p.row_chunks(shards, only)?,
    };
    if opts.trainer_state.is_none() {
        opts.trainer_state = source.trainer_state();
    }
    opts.user_metadata = source.user_metadata();
    let scratch = crate::storage::scratch_dir(beside);
    if crate::storage::location_url(beside).is_none() {
        std::fs::create_dir_all(beside).map_err(crate::error::io_err("create", beside))?;
    }
    let tables = source.tables_in_rounds(&scratch, opts.plan.parallel, rounds)?;
    let dense = source.dense()?;
    let mut input = save_input(&tables, &dense)?;
    input.row_chunks = row_chunks;
    save(input, opts)
}

/// Compacts the checkpoint in `dir` (a delta and its chain) into `out`: one full checkpoint
/// holding the newest state, which reads without its parents, with `opts.plan.shard_num` shards
/// (keep the chain's to compact without resharding). What `saver compact` runs; [`reshard`] of
/// the opened checkpoint, opened anew if it is replaced while it is read.
pub fn compact(dir: &Path, out: &Path, opts: &SaveOptions) -> Result<SaveReport> {
    crate::load::link::read_latest(dir, || reshard(&Checkpoint::open(dir)?, out, opts))
}

/// Saves `tables`, `dense` and `chunks` with `src`'s trainer state and user metadata.
fn rewrite(
    src: &Link,
    tables: SourceTables<'_>,
    dense: Vec<crate::LoadedDense>,
    chunks: Vec<RowRangeChunk<'_>>,
    out: &Path,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let mut input = save_input(&tables, &dense)?;
    input.row_chunks = chunks;
    let mut opts = opts.clone();
    opts.plan.shard_index = None;
    opts.parent = None;
    if opts.trainer_state.is_none() {
        opts.trainer_state = first_trainer_state(src);
    }
    for (k, v) in &src.manifest().user_metadata {
        opts.user_metadata
            .entry(k.clone())
            .or_insert_with(|| v.clone());
    }
    save(out, input, &opts)
}

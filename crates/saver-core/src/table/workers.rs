//! The tables of in-process workers joined into one: [`WorkerTable`].
//!
//! When the workers of a job are threads of one process and each holds its shard of every table
//! (`EmbeddingTable::for_shard`), one save of the whole worker set gives, per table name, one
//! table whose rows are the workers' rows: worker `s`'s table holds the rows of shard `s`. Its
//! snapshot takes every worker's snapshot in one [`moment::at_one_moment`] group, so all shards
//! show one moment; reads go to the worker that holds the id's shard. A row a worker holds for
//! another shard (a *foreign* row) is refused or skipped, as [`ForeignRows`] says, never saved
//! twice.

use crate::dtype::KeyDtype;
use crate::error::{Error, Result};
use crate::partition::PartitionRule;
use crate::table::{moment, ChangeTracking, RowChunk, SparseTable, TableSchema, TableSnapshot};

/// What to do with rows a process holds that the partition rule assigns to a shard it does not plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForeignRows {
    /// Refuse to plan: saving would silently lose those rows. The safe default.
    #[default]
    Error,
    /// Skip them: right when every process holds the whole table (replicated, or generated).
    Skip,
}

/// One table of a worker set: worker `s`'s table (`members[s]`) holds the rows of shard `s` of
/// `members.len()`. Made by `crate::SaveInput::worker_tables`.
pub struct WorkerTable<'a> {
    members: Vec<&'a dyn SparseTable>,
    foreign: ForeignRows,
}

impl<'a> WorkerTable<'a> {
    /// Joins `members` (one per shard, in shard order), checking that they agree on the key
    /// dtype and slots.
    pub fn new(members: Vec<&'a dyn SparseTable>, foreign: ForeignRows) -> Result<Self> {
        let first = *members.first().ok_or_else(|| Error::InvalidOption {
            option: "shard_table",
            why: "a worker table needs at least one worker".into(),
        })?;
        for (s, m) in members.iter().enumerate() {
            if m.key_dtype() != first.key_dtype() || m.slots() != first.slots() {
                return Err(Error::Table {
                    table: first.name().to_string(),
                    message: format!(
                        "the worker of shard {s} gives it {} ids and slots {:?}, the worker of \
                         shard 0 {} ids and slots {:?}: every worker's table of one name must \
                         have the same key dtype and slots",
                        m.key_dtype(),
                        m.slots(),
                        first.key_dtype(),
                        first.slots()
                    ),
                });
            }
        }
        Ok(Self { members, foreign })
    }

    fn join<'s>(&'s self, members: Vec<Box<dyn TableSnapshot + 's>>) -> WorkerSnapshot<'s> {
        let first_part = members
            .iter()
            .scan(0, |at, m| {
                let start = *at;
                *at += m.scan_parts().max(1);
                Some(start)
            })
            .collect();
        WorkerSnapshot {
            table: self.name(),
            key_dtype: self.key_dtype(),
            foreign: self.foreign,
            members,
            first_part,
        }
    }

    fn trackers(&self) -> Option<Vec<&dyn ChangeTracking>> {
        self.members.iter().map(|m| m.change_tracking()).collect()
    }
}

impl SparseTable for WorkerTable<'_> {
    fn schema(&self) -> &TableSchema {
        self.members[0].schema()
    }
    fn len(&self) -> usize {
        self.members.iter().map(|m| m.len()).sum()
    }
    fn snapshot(&self) -> Result<Box<dyn TableSnapshot + '_>> {
        let members = moment::at_one_moment(|| {
            self.members
                .iter()
                .map(|m| m.snapshot())
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(Box::new(self.join(members)))
    }
    fn point_in_time(&self) -> bool {
        self.members.iter().all(|m| m.point_in_time())
    }
    fn change_tracking(&self) -> Option<&dyn ChangeTracking> {
        self.trackers().map(|_| self as &dyn ChangeTracking)
    }
}

impl ChangeTracking for WorkerTable<'_> {
    fn baseline(&self) -> Option<(String, u64)> {
        let trackers = self.trackers()?;
        let first = trackers[0].baseline()?;
        trackers[1..]
            .iter()
            .all(|t| t.baseline().as_ref() == Some(&first))
            .then_some(first)
    }
    fn baseline_of(&self, save_id: &str) -> Option<u64> {
        let trackers = self.trackers()?;
        // Every worker is asked (each may take the save as its baseline now); one token for all,
        // since one delta reads the changes of every worker since it.
        let tokens: Vec<Option<u64>> = trackers.iter().map(|t| t.baseline_of(save_id)).collect();
        let first = tokens[0]?;
        tokens.iter().all(|&t| t == Some(first)).then_some(first)
    }
    fn last_snapshot(&self) -> u64 {
        self.trackers().map_or(0, |t| {
            t.iter().map(|t| t.last_snapshot()).max().unwrap_or(0)
        })
    }
    fn changed_since(&self, since: u64) -> Result<(Box<dyn TableSnapshot + '_>, u64)> {
        let trackers = self.trackers().ok_or_else(|| Error::Table {
            table: self.name().to_string(),
            message: "not every worker's table tracks its changes".into(),
        })?;
        let changed = moment::at_one_moment(|| {
            trackers
                .iter()
                .map(|t| t.changed_since(since))
                .collect::<Result<Vec<_>>>()
        })?;
        let token = changed.iter().map(|c| c.1).max().unwrap_or(0);
        let members = changed.into_iter().map(|c| c.0).collect();
        Ok((Box::new(self.join(members)), token))
    }
    fn changed_hint(&self) -> usize {
        self.trackers()
            .map_or(0, |t| t.iter().map(|t| t.changed_hint()).sum())
    }
    fn removed_between(&self, since: u64, until: u64) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .trackers()
            .into_iter()
            .flatten()
            .flat_map(|t| t.removed_between(since, until))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
    fn committed(&self, save_id: Option<&str>, token: u64) {
        for t in self.trackers().into_iter().flatten() {
            t.committed(save_id, token);
        }
    }
    fn written(&self, save_id: &str, token: u64) {
        for t in self.trackers().into_iter().flatten() {
            t.written(save_id, token);
        }
    }
}

/// The workers' snapshots of one moment, read as one.
struct WorkerSnapshot<'a> {
    table: &'a str,
    key_dtype: KeyDtype,
    foreign: ForeignRows,
    /// `members[s]`: the snapshot of shard `s`'s worker.
    members: Vec<Box<dyn TableSnapshot + 'a>>,
    /// The first scan part of each member among the joined parts.
    first_part: Vec<usize>,
}

impl WorkerSnapshot<'_> {
    fn shard_num(&self) -> u32 {
        self.members.len() as u32
    }

    /// Visits a member's chunk with the rows of other shards refused or left out.
    fn own_rows(
        &self,
        shard: u32,
        chunk: RowChunk<'_>,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        let n = self.shard_num();
        let mine = |id: u64| PartitionRule::shard_of(id, n) == shard;
        let foreign = chunk.ids.iter().filter(|&&id| !mine(id)).count();
        if foreign == 0 {
            return visit(chunk);
        }
        if self.foreign == ForeignRows::Error {
            let first = chunk.ids.iter().find(|&&id| !mine(id)).expect("counted");
            return Err(Error::ForeignRows {
                table: self.table.to_string(),
                shard,
                count: foreign as u64,
                first_id: self.key_dtype.format_id(*first),
            });
        }
        let keep: Vec<usize> = (0..chunk.ids.len())
            .filter(|&i| mine(chunk.ids[i]))
            .collect();
        let ids: Vec<u64> = keep.iter().map(|&i| chunk.ids[i]).collect();
        let handles: Vec<u64> = if chunk.handles.is_empty() {
            Vec::new()
        } else {
            keep.iter().map(|&i| chunk.handles[i]).collect()
        };
        let slots: Vec<Vec<u8>> = chunk
            .slots
            .iter()
            .map(|s| {
                let w = if chunk.ids.is_empty() {
                    0
                } else {
                    s.len() / chunk.ids.len()
                };
                keep.iter()
                    .flat_map(|&i| s[i * w..(i + 1) * w].iter().copied())
                    .collect()
            })
            .collect();
        let slot_refs: Vec<&[u8]> = slots.iter().map(Vec::as_slice).collect();
        visit(RowChunk {
            ids: &ids,
            handles: &handles,
            slots: &slot_refs,
        })
    }

    /// Reads rows by id (and handle), each from the worker of its shard.
    fn read(&self, ids: &[u64], handles: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let n = self.shard_num();
        let first = ids.first().map_or(0, |&id| PartitionRule::shard_of(id, n));
        // The writer reads one partition, so one shard, at a time: handed on whole.
        if ids
            .iter()
            .all(|&id| PartitionRule::shard_of(id, n) == first)
        {
            // SAFETY: the handles are the ones this member's scan gave with these ids, or none.
            return unsafe { self.members[first as usize].read_rows_by_handle(ids, handles, out) };
        }
        let widths: Vec<usize> = out
            .iter()
            .map(|o| {
                if ids.is_empty() {
                    0
                } else {
                    o.len() / ids.len()
                }
            })
            .collect();
        for shard in 0..n {
            let at: Vec<usize> = (0..ids.len())
                .filter(|&i| PartitionRule::shard_of(ids[i], n) == shard)
                .collect();
            if at.is_empty() {
                continue;
            }
            let sub_ids: Vec<u64> = at.iter().map(|&i| ids[i]).collect();
            let sub_handles: Vec<u64> = if handles.is_empty() {
                Vec::new()
            } else {
                at.iter().map(|&i| handles[i]).collect()
            };
            let mut bufs: Vec<Vec<u8>> = widths.iter().map(|&w| vec![0; w * at.len()]).collect();
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            // SAFETY: as above, for this member's ids.
            unsafe {
                self.members[shard as usize].read_rows_by_handle(
                    &sub_ids,
                    &sub_handles,
                    &mut outs,
                )?
            };
            for ((o, b), &w) in out.iter_mut().zip(&bufs).zip(&widths) {
                for (k, &i) in at.iter().enumerate() {
                    o[i * w..(i + 1) * w].copy_from_slice(&b[k * w..(k + 1) * w]);
                }
            }
        }
        Ok(())
    }
}

impl TableSnapshot for WorkerSnapshot<'_> {
    fn scan(
        &self,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        crate::table::scan_every_part(self, max_rows, with_values, visit)
    }

    fn scan_parts(&self) -> usize {
        self.first_part.last().copied().unwrap_or(0)
            + self.members.last().map_or(0, |m| m.scan_parts().max(1))
    }

    fn scan_part(
        &self,
        part: usize,
        max_rows: usize,
        with_values: bool,
        visit: &mut dyn FnMut(RowChunk<'_>) -> Result<()>,
    ) -> Result<()> {
        let shard = self.first_part.partition_point(|&p| p <= part) - 1;
        let local = part - self.first_part[shard];
        self.members[shard].scan_part(local, max_rows, with_values, &mut |chunk| {
            self.own_rows(shard as u32, chunk, visit)
        })
    }

    fn rows_in_buckets(
        &self,
        buckets: std::ops::Range<u32>,
        ids: &mut Vec<u64>,
        handles: &mut Vec<u64>,
    ) -> Result<bool> {
        let (start_ids, start_handles) = (ids.len(), handles.len());
        for (s, m) in self.members.iter().enumerate() {
            let own = PartitionRule::bucket_range(s as u32, self.shard_num());
            let range = buckets.start.max(own.start)..buckets.end.min(own.end);
            // Asked with an empty range, every member must be able to answer.
            if (range.is_empty() && !buckets.is_empty())
                || m.rows_in_buckets(range, ids, handles)?
            {
                continue;
            }
            ids.truncate(start_ids);
            handles.truncate(start_handles);
            return Ok(false);
        }
        Ok(true)
    }

    fn read_rows(&self, ids: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        self.read(ids, &[], out)
    }

    unsafe fn read_rows_by_handle(
        &self,
        ids: &[u64],
        handles: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        self.read(ids, handles, out)
    }

    fn copy_on_write_peak(&self) -> u64 {
        self.members.iter().map(|m| m.copy_on_write_peak()).sum()
    }
}

impl std::fmt::Debug for WorkerTable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerTable")
            .field("table", &self.members.first().map(|t| &t.schema().name))
            .field("members", &self.members.len())
            .field("foreign", &self.foreign)
            .finish()
    }
}

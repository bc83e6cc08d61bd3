//! Any table put in (bucket, id bits) order in memory, for a delta's comparison.

use rayon::slice::ParallelSliceMut;

use saver_core::table::TableSnapshot;
use saver_core::TableSchema;
use saver_core::{PartitionRule, SparseTable};

use super::BATCH_ROWS;
use crate::error::Result;
use crate::load::rows::{BucketRows, VisitRows};

/// Any table put in (bucket, id bits) order: its snapshot's ids and row handles, sorted in
/// memory (16 bytes a row), its rows read by handle a batch at a time.
pub(crate) struct InMemoryOrder<'t> {
    table: &'t dyn SparseTable,
    snapshot: Box<dyn TableSnapshot + 't>,
    /// (bucket, id, handle), sorted; no handle (`u64::MAX`) when the snapshot gives none.
    order: Vec<(u32, u64, u64)>,
    row_bytes: Vec<u64>,
}

impl<'t> InMemoryOrder<'t> {
    /// Sorts the ids of `snapshot`, taken of `table` (with the other tables' of a save, at one
    /// moment).
    pub(crate) fn of_snapshot(
        table: &'t dyn SparseTable,
        snapshot: Box<dyn TableSnapshot + 't>,
    ) -> Result<Self> {
        let mut order = Vec::with_capacity(table.len());
        let mut handles_given = true;
        snapshot.scan(BATCH_ROWS, false, &mut |chunk| {
            handles_given &= chunk.handles.len() == chunk.ids.len();
            for (i, &id) in chunk.ids.iter().enumerate() {
                let h = chunk.handles.get(i).copied().unwrap_or(u64::MAX);
                order.push((PartitionRule::bucket_of(id), id, h));
            }
            Ok(())
        })?;
        order.par_sort_unstable();
        if !handles_given {
            order.iter_mut().for_each(|o| o.2 = u64::MAX);
        }
        let row_bytes = table
            .slots()
            .iter()
            .map(|s| s.row_bytes())
            .collect::<saver_core::Result<_>>()?;
        Ok(Self {
            table,
            snapshot,
            order,
            row_bytes,
        })
    }
}

impl SparseTable for InMemoryOrder<'_> {
    fn schema(&self) -> &TableSchema {
        self.table.schema()
    }
    fn len(&self) -> usize {
        self.order.len()
    }
    fn snapshot(&self) -> saver_core::Result<Box<dyn TableSnapshot + '_>> {
        self.table.snapshot()
    }
    fn point_in_time(&self) -> bool {
        self.table.point_in_time()
    }
}

impl BucketRows for InMemoryOrder<'_> {
    fn row_bytes(&self) -> &[u64] {
        &self.row_bytes
    }
    fn rows(&self) -> u64 {
        self.order.len() as u64
    }
    fn visit_in_bucket_order(
        &self,
        batch: usize,
        visit: &mut VisitRows<'_>,
    ) -> saver_core::Result<()> {
        let mut ids = Vec::new();
        let mut handles = Vec::new();
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); self.row_bytes.len()];
        for part in self.order.chunks(batch.max(1)) {
            ids.clear();
            ids.extend(part.iter().map(|p| p.1));
            handles.clear();
            if part.first().is_some_and(|p| p.2 != u64::MAX) {
                handles.extend(part.iter().map(|p| p.2));
            }
            for (b, &w) in bufs.iter_mut().zip(&self.row_bytes) {
                b.resize(part.len() * w as usize, 0);
            }
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            // SAFETY: the handles are those this snapshot's scan gave with these ids, or none.
            unsafe {
                self.snapshot
                    .read_rows_by_handle(&ids, &handles, &mut outs)?
            };
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            visit(&ids, &views)?;
        }
        Ok(())
    }
}

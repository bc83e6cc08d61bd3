//! Tables whose rows can be read in storage order, (bucket, id bits), as they are: a table read
//! from files (a checkpoint's, a delta chain's, a plain input distributed by bucket).
//!
//! What the digest, the export's sort and a delta save's comparison with its parent read. A
//! delta save of such a table reads it beside the parent in one pass, in bounded memory; any
//! other table is put in that order first (its ids sorted in memory).

use crate::error::Result;
use crate::table::SparseTable;

/// What receives rows in batches: ids, and each slot's rows back to back (in the table's slot
/// order).
pub type VisitRows<'a> = dyn FnMut(&[u64], &[&[u8]]) -> Result<()> + 'a;

/// A table whose rows can be visited in storage order, (bucket, id bits).
pub trait BucketRows: SparseTable {
    /// Bytes of one row of each slot, in [`SparseTable::slots`] order.
    fn row_bytes(&self) -> &[u64];
    /// The exact number of rows.
    fn rows(&self) -> u64;
    /// Visits every row in (bucket, id bits) order, at most `batch` rows at a time: ids, and each
    /// slot's rows back to back.
    fn visit_in_bucket_order(&self, batch: usize, visit: &mut VisitRows<'_>) -> Result<()>;
    /// Checks what was read only in part against its checksums (a chain's older links, a
    /// target's buckets): called before what was read is returned or committed. Default: every
    /// read was checked as it was made.
    fn finish_checks(&self) -> Result<()> {
        Ok(())
    }
}

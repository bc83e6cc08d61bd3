//! Rows read in storage order, (bucket, id bits): what every reader of a checkpoint's tables
//! gives, and what the digest, the export's sort and a delta's comparison take.

use saver_core::SparseTable;

use crate::error::{Error, Result};

/// What receives rows in batches: ids, and each slot's rows back to back (in the table's slot
/// order).
pub type VisitRows<'a> = dyn FnMut(&[u64], &[&[u8]]) -> Result<()> + 'a;

/// A table whose rows can be visited in storage order, (bucket, id bits): what the digest, the
/// export's sort and the delta's comparison read.
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

/// An error of reading table `table`'s rows, as a table snapshot returns it.
pub(crate) fn core_error(table: &str, e: Error) -> saver_core::Error {
    match e {
        Error::Core(e) => e,
        e => saver_core::Error::Table {
            table: table.into(),
            message: e.to_string(),
        },
    }
}

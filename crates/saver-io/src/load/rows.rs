//! Rows read in storage order, (bucket, id bits): what every reader of a checkpoint's tables
//! gives, and what the digest, the export's sort and a delta's comparison take.

use crate::error::Error;

pub use saver_core::table::{BucketRows, VisitRows};

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

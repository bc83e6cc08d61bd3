//! Rows read in storage order, (bucket, id bits): what every reader of a checkpoint's tables
//! gives, and what the digest, the export's sort and a delta's comparison take.

use crate::error::Error;

pub(crate) use saver_core::table::{BucketRows, VisitRows};

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

/// The row handles of `ids`, each found by `locate` in the table `schema` describes. An id it
/// does not find is an error naming the table and `place` (the checkpoint, the input, the
/// delta), never a zeroed row: what every table read from files does in `read_rows` before it
/// reads by handle.
pub(crate) fn handles_of(
    schema: &saver_core::TableSchema,
    place: &str,
    ids: &[u64],
    mut locate: impl FnMut(u64) -> crate::error::Result<Option<u64>>,
) -> saver_core::Result<Vec<u64>> {
    ids.iter()
        .map(|&id| match locate(id) {
            Ok(Some(h)) => Ok(h),
            Ok(None) => Err(saver_core::Error::Table {
                table: schema.name.clone(),
                message: format!("id {} is not in {place}", schema.key_dtype.format_id(id)),
            }),
            Err(e) => Err(core_error(&schema.name, e)),
        })
        .collect()
}

/// One buffer per slot for the chunks a table's scan hands on: sized for each chunk's rows and
/// filled only when the scan was asked for values.
pub(crate) struct SlotBuffers {
    bufs: Vec<Vec<u8>>,
    widths: Vec<usize>,
}

impl SlotBuffers {
    /// Buffers for slots of `widths` bytes a row.
    pub(crate) fn new(widths: impl IntoIterator<Item = usize>) -> Self {
        let widths: Vec<usize> = widths.into_iter().collect();
        Self {
            bufs: vec![Vec::new(); widths.len()],
            widths,
        }
    }

    /// With `with_values`, sizes every buffer for `rows` rows, has `fill` write them, and returns
    /// the slices a chunk carries; without, returns none and reads nothing.
    pub(crate) fn fill<E>(
        &mut self,
        rows: usize,
        with_values: bool,
        fill: impl FnOnce(&mut [&mut [u8]]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<&[u8]>, E> {
        if !with_values {
            return Ok(Vec::new());
        }
        for (b, &w) in self.bufs.iter_mut().zip(&self.widths) {
            b.resize(rows * w, 0);
        }
        let mut outs: Vec<&mut [u8]> = self.bufs.iter_mut().map(Vec::as_mut_slice).collect();
        fill(&mut outs)?;
        Ok(self.bufs.iter().map(Vec::as_slice).collect())
    }
}

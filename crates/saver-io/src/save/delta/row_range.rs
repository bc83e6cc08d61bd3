//! A delta's row-range tables: each chunk given is compared with the parent chain's values of
//! its rectangle, a bounded batch of rows at a time, and becomes what the delta holds of it: its
//! changed rows ([`RowRangeChunk::only_rows`], a patch of the format), or the whole chunk when the
//! parent holds no such slot or most of its rows changed (a patch would then be read beside its
//! parent for little saved). A chunk given with its changed rows already (tracked by the caller)
//! is taken as it is.

use std::collections::BTreeMap;

use rayon::prelude::*;

use saver_core::RowRangeChunk;

use crate::error::Result;
use crate::load::checkpoint::{Checkpoint, RowsInto};
use crate::save::report::DeltaMethod;

/// Bytes of a chunk compared at a time: the parent's rows read into a buffer of this size.
const COMPARE_BYTES: usize = 8 << 20;

/// What the delta holds of each of `chunks` against the parent `chain`; how each table's changes
/// were found goes to `methods`.
pub(crate) fn changed_chunks<'t>(
    chunks: &'t [RowRangeChunk<'_>],
    chain: &Checkpoint,
    methods: &mut BTreeMap<String, DeltaMethod>,
) -> Result<Vec<RowRangeChunk<'t>>> {
    for c in chunks {
        let why = if c.changed_rows().is_some() {
            None
        } else if chain.row_table(c.table()).is_none() {
            Some("the parent holds no row-range table of this name: saved whole")
        } else {
            Some("a row-range table's chunks are compared with the parent's rows")
        };
        let method = match why {
            None => DeltaMethod::Tracked,
            Some(why) => DeltaMethod::Compared { why: why.into() },
        };
        methods.entry(c.table().to_string()).or_insert(method);
    }
    chunks.par_iter().map(|c| changes_of(c, chain)).collect()
}

/// What the delta holds of chunk `c`.
fn changes_of<'t>(c: &'t RowRangeChunk<'_>, chain: &Checkpoint) -> Result<RowRangeChunk<'t>> {
    let values = c.values();
    let dtype = values.dtype();
    let held = chain
        .row_table(c.table())
        .and_then(|t| t.slots.iter().find(|s| s.name == c.slot()));
    let comparable = held.is_some_and(|s| s.dtype == dtype && s.shape == c.whole())
        && dtype.bits().is_multiple_of(8)
        && c.changed_rows().is_none();
    if !comparable {
        return Ok(c.view());
    }
    let rows = c.rows();
    let width = c.shape().get(1).copied().unwrap_or(1);
    let cols = c.offset().get(1).map(|&o| o..o + width);
    let Some(row_bytes) = dtype.byte_len(width).map(|b| b as usize).filter(|&b| b > 0) else {
        return Ok(c.view());
    };
    let count = (rows.end - rows.start) as usize;
    let step = (COMPARE_BYTES / row_bytes).max(1) as u64;
    let (mut changed, mut changed_values) = (Vec::new(), Vec::new());
    // Ours a step at a time too: a chunk read on demand (a reshard's, `save --from`'s) is never
    // held whole.
    let (mut parent, mut ours) = (Vec::new(), Vec::new());
    let mut at = rows.start;
    while at < rows.end {
        let end = (at + step).min(rows.end);
        parent.resize((end - at) as usize * row_bytes, 0);
        let mut into = RowsInto::new(c.slot(), &mut parent);
        if let Some(cols) = &cols {
            into = into.columns(cols.clone());
        }
        chain.load_rows(c.table(), at..end, &mut [into])?;
        ours.resize(parent.len(), 0);
        values.read_at((at - rows.start) * row_bytes as u64, &mut ours)?;
        for (i, (old, new)) in parent
            .chunks_exact(row_bytes)
            .zip(ours.chunks_exact(row_bytes))
            .enumerate()
        {
            // Bitwise: a NaN that stays a NaN is unchanged, and -0.0 is not 0.0.
            if old != new {
                changed.push(at + i as u64);
                changed_values.extend_from_slice(new);
            }
        }
        if changed.len() * 2 > count {
            return Ok(c.view());
        }
        at = end;
    }
    Ok(c.view().only_rows(changed, changed_values)?)
}

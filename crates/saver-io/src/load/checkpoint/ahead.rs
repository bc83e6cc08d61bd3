//! Reading ahead for a chain's load from a remote store: which bytes, fetched at once, and
//! forgotten when the load ends (see [`crate::load::ahead`]).

use std::ops::Range;

use rayon::prelude::*;

use saver_core::manifest::TensorRef;

use crate::error::Result;
use crate::load::ahead::AHEAD_BYTES;
use crate::load::link::Link;

/// Bytes `2` of tensor `1` (of link `0`), which a load will read.
pub(crate) type Wanted<'c> = (&'c Link, &'c TensorRef, Range<u64>);

/// Bytes `1` of tensor `0`, of one link.
type Piece<'c> = (&'c TensorRef, Range<u64>);

/// Bytes read ahead for one load; forgotten when it is dropped.
pub(crate) struct Ahead<'c> {
    held: Vec<(&'c Link, Vec<(String, u64)>)>,
    /// What more may be read ahead.
    budget: u64,
}

impl<'c> Ahead<'c> {
    /// Nothing read ahead yet, [`AHEAD_BYTES`] to read.
    pub(crate) fn new() -> Self {
        Self {
            held: Vec::new(),
            budget: AHEAD_BYTES,
        }
    }

    /// Reads ahead the bytes of `wanted` (of a remote link each) that fit what is left of the
    /// budget, smallest first, each link's in one batch and the links at once; compressed
    /// tensors are left to their frame reads.
    pub(crate) fn read(&mut self, wanted: Vec<Wanted<'c>>) -> Result<()> {
        let mut wanted: Vec<_> = wanted
            .into_iter()
            .filter(|(l, t, r)| l.is_remote() && t.codec.is_none() && !r.is_empty())
            .collect();
        let len = |r: &Range<u64>| r.end - r.start;
        // Smallest first; the same bytes twice lie side by side, for the dedup below.
        wanted.sort_by(|(_, a, x), (_, b, y)| {
            (len(x), &a.file, a.offset + x.start).cmp(&(len(y), &b.file, b.offset + y.start))
        });
        wanted.dedup_by(|a, b| {
            std::ptr::eq(a.0, b.0) && a.1.file == b.1.file && a.1.offset == b.1.offset && a.2 == b.2
        });
        let mut by_link: Vec<(&'c Link, Vec<Piece<'c>>)> = Vec::new();
        for (link, t, r) in wanted {
            if len(&r) > self.budget {
                break;
            }
            self.budget -= len(&r);
            match by_link.iter_mut().find(|(l, _)| std::ptr::eq(*l, link)) {
                Some((_, ts)) => ts.push((t, r)),
                None => by_link.push((link, vec![(t, r)])),
            }
        }
        let held = by_link
            .into_par_iter()
            .map(|(link, wanted)| {
                let mut bufs: Vec<Vec<u8>> = wanted
                    .iter()
                    .map(|(_, r)| vec![0u8; len(r) as usize])
                    .collect();
                let mut reads: Vec<(&TensorRef, u64, &mut [u8])> = wanted
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|((t, r), b)| (*t, r.start, b.as_mut_slice()))
                    .collect();
                link.read_tensor_ranges(&mut reads)?;
                drop(reads);
                let mut keys = Vec::with_capacity(wanted.len());
                for ((t, r), b) in wanted.iter().zip(bufs) {
                    link.ahead().hold(&t.file, t.offset + r.start, b);
                    keys.push((t.file.clone(), t.offset + r.start));
                }
                Ok((link, keys))
            })
            .collect::<Result<Vec<_>>>()?;
        self.held.extend(held);
        Ok(())
    }
}

impl Drop for Ahead<'_> {
    fn drop(&mut self) {
        for (link, keys) in &self.held {
            link.ahead().forget(keys);
        }
    }
}

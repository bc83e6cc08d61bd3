//! Reading ahead for a chain's load from a remote store: which tensors, fetched at once, and
//! forgotten when the load ends (see [`crate::load::ahead`]).

use rayon::prelude::*;

use saver_core::manifest::TensorRef;

use crate::error::Result;
use crate::load::ahead::AHEAD_BYTES;
use crate::load::link::Link;

/// Tensors read ahead for one load; forgotten when it is dropped.
pub(crate) struct Ahead<'c> {
    held: Vec<(&'c Link, Vec<(String, u64)>)>,
}

impl<'c> Ahead<'c> {
    /// Reads ahead the tensors of `wanted` (of a remote link each) that fit the budget, smallest
    /// first; compressed tensors are left to their frame reads.
    pub(crate) fn plan(wanted: Vec<(&'c Link, &'c TensorRef)>) -> Result<Self> {
        let mut wanted: Vec<_> = wanted
            .into_iter()
            .filter(|(l, t)| l.is_remote() && t.codec.is_none() && t.len > 0)
            .collect();
        // Smallest first; the same tensor twice lies side by side, for the dedup below.
        wanted
            .sort_by(|(_, a), (_, b)| (a.len, &a.file, a.offset).cmp(&(b.len, &b.file, b.offset)));
        wanted.dedup_by(|a, b| {
            std::ptr::eq(a.0, b.0) && a.1.file == b.1.file && a.1.offset == b.1.offset
        });
        let mut budget = AHEAD_BYTES;
        let mut by_link: Vec<(&'c Link, Vec<&'c TensorRef>)> = Vec::new();
        for (link, t) in wanted {
            if t.len > budget {
                break;
            }
            budget -= t.len;
            match by_link.iter_mut().find(|(l, _)| std::ptr::eq(*l, link)) {
                Some((_, ts)) => ts.push(t),
                None => by_link.push((link, vec![t])),
            }
        }
        let held = by_link
            .into_par_iter()
            .map(|(link, tensors)| {
                let mut bufs: Vec<Vec<u8>> =
                    tensors.iter().map(|t| vec![0u8; t.len as usize]).collect();
                let mut reads: Vec<(&TensorRef, u64, &mut [u8])> = tensors
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(t, b)| (*t, 0, b.as_mut_slice()))
                    .collect();
                link.read_tensor_ranges(&mut reads)?;
                drop(reads);
                let mut keys = Vec::with_capacity(tensors.len());
                for (t, b) in tensors.iter().zip(bufs) {
                    link.ahead().hold(&t.file, t.offset, b);
                    keys.push((t.file.clone(), t.offset));
                }
                Ok((link, keys))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { held })
    }
}

impl Drop for Ahead<'_> {
    fn drop(&mut self) {
        for (link, keys) in &self.held {
            link.ahead().forget(keys);
        }
    }
}

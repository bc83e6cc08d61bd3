//! Checking the CRC32s of a tensor from the pieces a read path took of it.
//!
//! Loads for another shard count and the links of a chain read only some rows of a tensor. So that
//! every byte they return is still covered by a checksum that was checked, each piece's CRC32 is
//! kept, cut at the tensor's checksummed blocks ([`BlockCrcs`]), and every block a piece touched
//! is checked: the pieces' CRC32s combined with the bytes of the block they leave out, read only
//! to be hashed (where pieces overlap, the block is hashed whole). A tensor without blocks (short,
//! or written before blocks existed) is one block with the tensor's CRC32. A load that knows its
//! rows before it reads them reads those left-out bytes with the rows beside them ([`EdgeGaps`]),
//! in the same requests, so that the checks at its end read nothing.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use crc32fast::Hasher;

use saver_core::manifest::TensorRef;

use crate::error::Result;
use crate::load::link::Link;

/// One piece of a tensor that was read, within one of its blocks.
pub(crate) struct Piece {
    /// Offset of the piece's first byte in the tensor.
    pub offset: u64,
    /// The piece's length in bytes.
    pub len: u64,
    /// CRC32 state of the piece's bytes.
    pub crc: Hasher,
}

/// The size of `t`'s checksummed blocks: the whole tensor when it has none.
fn block_bytes(t: &TensorRef) -> u64 {
    t.blocks.as_ref().map_or(t.len, |b| b.bytes).max(1)
}

/// The bytes of the blocks of `t` that `range` touches: what a check of a read of `range` reads.
pub(crate) fn blocks_around(t: &TensorRef, range: Range<u64>) -> Range<u64> {
    if range.is_empty() {
        return range;
    }
    let block = block_bytes(t);
    range.start / block * block..range.end.div_ceil(block).saturating_mul(block).min(t.len)
}

/// Bytes `range` of `t` cut at its blocks' ends: `(offset, len)` per block they touch, in order.
fn block_spans(t: &TensorRef, range: Range<u64>) -> impl Iterator<Item = (u64, u64)> {
    let block = block_bytes(t);
    let mut at = range.start;
    std::iter::from_fn(move || {
        (at < range.end).then(|| {
            let n = (block - at % block).min(range.end - at);
            at += n;
            (at - n, n)
        })
    })
}

/// Adds to `out` the pieces of `bytes`, read from `t` at `offset`: one per block they touch.
pub(crate) fn push(t: &TensorRef, offset: u64, bytes: &[u8], out: &mut Vec<Piece>) {
    for (at, len) in block_spans(t, offset..offset + bytes.len() as u64) {
        let within = (at - offset) as usize..(at - offset + len) as usize;
        let mut crc = Hasher::new();
        crc.update(&bytes[within]);
        out.push(Piece {
            offset: at,
            len,
            crc,
        });
    }
}

/// A tensor's identity within one load: its address in the manifest.
pub(crate) fn key(t: &TensorRef) -> usize {
    t as *const TensorRef as usize
}

/// The gaps ([`planned_gaps`]) of the tensors a load reads in part, each to be read once, by
/// the read of the rows beside it: the gap then travels in the same request as those rows (they
/// touch, so the ranges merge), and the check at the end finds its blocks whole. A gap no read
/// took is read by the check.
#[derive(Default)]
pub(crate) struct EdgeGaps(HashMap<usize, Vec<(Range<u64>, AtomicBool)>>);

impl EdgeGaps {
    /// Adds the gaps that reads of exactly `ranges` of `t` (disjoint) leave in its blocks.
    pub(crate) fn plan(&mut self, t: &TensorRef, ranges: &[Range<u64>]) {
        let gaps = planned_gaps(t, ranges);
        if !gaps.is_empty() {
            let entry = self.0.entry(key(t)).or_default();
            entry.extend(gaps.into_iter().map(|g| (g, AtomicBool::new(false))));
        }
    }

    /// The gaps of `t` that touch bytes `range` and that no read took yet: the caller's now, to
    /// read with `range`.
    pub(crate) fn take_beside(&self, t: &TensorRef, range: &Range<u64>) -> Vec<Range<u64>> {
        let Some(gaps) = self.0.get(&key(t)) else {
            return Vec::new();
        };
        gaps.iter()
            .filter(|(g, _)| g.end == range.start || g.start == range.end)
            .filter(|(_, taken)| !taken.swap(true, Ordering::Relaxed))
            .map(|(g, _)| g.clone())
            .collect()
    }
}

/// What one block's bytes are made of, in order.
enum Part {
    /// Span `n` of the spans laid out.
    Read(usize),
    /// Bytes no span holds.
    Gap(Range<u64>),
}

/// The blocks of `t` that `spans` (`(offset, len)` within `t`, sorted by offset, none crossing a
/// block's end) touch, each with its parts in order. Where spans of a block overlap, the block
/// is one gap: it is hashed whole.
fn layout(t: &TensorRef, spans: &[(u64, u64)]) -> Vec<(u64, Vec<Part>)> {
    let block = block_bytes(t);
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < spans.len() {
        let k = spans[i].0 / block;
        let range = k * block..((k + 1) * block).min(t.len);
        let mut j = i;
        while j < spans.len() && spans[j].0 / block == k {
            j += 1;
        }
        let of_block = &spans[i..j];
        let tiles = of_block.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
        let mut parts = Vec::new();
        let gap = |parts: &mut Vec<Part>, r: Range<u64>| {
            if !r.is_empty() {
                parts.push(Part::Gap(r));
            }
        };
        if tiles {
            let mut at = range.start;
            for (n, &(offset, len)) in of_block.iter().enumerate() {
                gap(&mut parts, at..offset);
                at = offset + len;
                parts.push(Part::Read(i + n));
            }
            gap(&mut parts, at..range.end);
        } else {
            // Some bytes were read twice: the block is hashed whole.
            gap(&mut parts, range);
        }
        blocks.push((k, parts));
        i = j;
    }
    blocks
}

/// The byte ranges of `t` that a check of pieces reading exactly `ranges` of it (disjoint) will
/// need besides them: the rest of each block they touch. A load that knows its rows before it
/// reads them reads these with the rows beside them ([`EdgeGaps`]).
pub(crate) fn planned_gaps(t: &TensorRef, ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut spans: Vec<(u64, u64)> = ranges
        .iter()
        .flat_map(|r| block_spans(t, r.clone()))
        .collect();
    spans.sort_unstable();
    layout(t, &spans)
        .into_iter()
        .flat_map(|(_, parts)| parts)
        .filter_map(|p| match p {
            Part::Gap(r) => Some(r),
            Part::Read(_) => None,
        })
        .collect()
}

/// Checks every block of `t` that `pieces` touch against the manifest's CRC32s, reading from
/// `ckpt` the bytes of those blocks the pieces leave out (all in a few batched requests, which a
/// remote store fetches at once). Returns the count of bytes read here, or `None` when a block
/// fails its check.
pub(crate) fn check(ckpt: &Link, t: &TensorRef, pieces: Vec<Piece>) -> Result<Option<u64>> {
    check_with(t, pieces, |ranges| hash_ranges(ckpt, t, ranges))
}

/// [`check`], with the gaps of `t` it must read hashed by `hash`.
fn check_with(
    t: &TensorRef,
    mut pieces: Vec<Piece>,
    hash: impl FnOnce(&[Range<u64>]) -> Result<Vec<Hasher>>,
) -> Result<Option<u64>> {
    pieces.sort_by_key(|p| p.offset);
    let spans: Vec<(u64, u64)> = pieces.iter().map(|p| (p.offset, p.len)).collect();
    let blocks = layout(t, &spans);
    let missing: Vec<Range<u64>> = blocks
        .iter()
        .flat_map(|(_, parts)| parts)
        .filter_map(|p| match p {
            Part::Gap(r) => Some(r.clone()),
            Part::Read(_) => None,
        })
        .collect();
    let read_now = hash(&missing)?;
    let mut read_now = read_now.iter();
    for (k, parts) in blocks {
        let mut combined = Hasher::new();
        for part in &parts {
            match part {
                Part::Read(n) => combined.combine(&pieces[*n].crc),
                Part::Gap(_) => combined.combine(read_now.next().expect("one state a gap")),
            }
        }
        let want = match &t.blocks {
            Some(b) => match b.crc32.get(k as usize) {
                Some(&c) => c,
                None => return Ok(None),
            },
            None => t.crc32,
        };
        if combined.finalize() != want {
            return Ok(None);
        }
    }
    Ok(Some(missing.iter().map(|r| r.end - r.start).sum()))
}

/// The CRC32 states of bytes `ranges` of `t`: ranges read together up to [`BATCH_BYTES`] at a
/// time, a longer one (a whole tensor without blocks) a window at a time.
fn hash_ranges(ckpt: &Link, t: &TensorRef, ranges: &[Range<u64>]) -> Result<Vec<Hasher>> {
    const BATCH_BYTES: u64 = 8 << 20;
    let len = |r: &Range<u64>| r.end - r.start;
    let mut out = Vec::with_capacity(ranges.len());
    let mut i = 0;
    while i < ranges.len() {
        if len(&ranges[i]) > BATCH_BYTES {
            let mut h = Hasher::new();
            hash_range(ckpt, t, ranges[i].clone(), &mut h)?;
            out.push(h);
            i += 1;
            continue;
        }
        let (mut j, mut total) = (i, 0);
        while j < ranges.len() && total + len(&ranges[j]) <= BATCH_BYTES {
            total += len(&ranges[j]);
            j += 1;
        }
        let mut bufs: Vec<Vec<u8>> = ranges[i..j]
            .iter()
            .map(|r| vec![0; len(r) as usize])
            .collect();
        let mut reads: Vec<(&TensorRef, u64, &mut [u8])> = ranges[i..j]
            .iter()
            .zip(bufs.iter_mut())
            .map(|(r, b)| (t, r.start, b.as_mut_slice()))
            .collect();
        ckpt.read_tensor_ranges(&mut reads)?;
        out.extend(bufs.iter().map(|b| {
            let mut h = Hasher::new();
            h.update(b);
            h
        }));
        i = j;
    }
    Ok(out)
}

/// Adds bytes `range` of `t` to `h`, read a bounded window at a time; returns their count.
fn hash_range(ckpt: &Link, t: &TensorRef, range: Range<u64>, h: &mut Hasher) -> Result<u64> {
    const WINDOW: u64 = 4 << 20;
    let mut buf = vec![0u8; WINDOW.min(range.end.saturating_sub(range.start)) as usize];
    let mut at = range.start;
    while at < range.end {
        let n = WINDOW.min(range.end - at) as usize;
        ckpt.read_tensor_range(t, at, &mut buf[..n])?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(range.end.saturating_sub(range.start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use saver_core::manifest::BlockCrcs;
    use saver_core::Dtype;

    /// A tensor over `bytes`, with blocks of `block` bytes (or none: one CRC32 for all).
    fn tensor(bytes: &[u8], block: Option<u64>) -> TensorRef {
        TensorRef {
            file: "f".into(),
            name: "t".into(),
            dtype: Dtype::U8,
            shape: vec![bytes.len() as u64],
            offset: 0,
            len: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
            blocks: block.map(|b| BlockCrcs {
                bytes: b,
                crc32: bytes.chunks(b as usize).map(crc32fast::hash).collect(),
            }),
            codec: None,
        }
    }

    /// Hashes ranges of `bytes`, counting the bytes asked for.
    fn hash_of<'a>(
        bytes: &'a [u8],
        asked: &'a mut u64,
    ) -> impl FnOnce(&[Range<u64>]) -> Result<Vec<Hasher>> + 'a {
        move |ranges| {
            Ok(ranges
                .iter()
                .map(|r| {
                    *asked += r.end - r.start;
                    let mut h = Hasher::new();
                    h.update(&bytes[r.start as usize..r.end as usize]);
                    h
                })
                .collect())
        }
    }

    proptest! {
        /// The bytes a read-ahead takes around a range ([`blocks_around`]) hold the range, leave
        /// its check nothing more to read, and reach no further than the blocks it touches.
        #[test]
        fn blocks_around_a_range_are_all_its_check_reads(
            len in 1usize..5000,
            block in prop::option::of(1u64..700),
            a in 0.0f64..1.0,
            b in 0.0f64..1.0,
        ) {
            let bytes = vec![7u8; len];
            let t = tensor(&bytes, block);
            let (a, b) = ((a * len as f64) as u64, (b * len as f64) as u64);
            let range = a.min(b)..a.max(b);
            prop_assume!(!range.is_empty());
            let around = blocks_around(&t, range.clone());
            prop_assert!(around.start <= range.start && range.end <= around.end);
            prop_assert!(around.end <= t.len);
            prop_assert!(planned_gaps(&t, std::slice::from_ref(&around)).is_empty());
            let size = block_bytes(&t);
            prop_assert!(range.start - around.start < size);
            prop_assert!(around.end - range.end < size);
        }

        /// A load that reads rows `ranges` (disjoint) of a tensor in chunks, in any order, each
        /// chunk taking the gaps beside it ([`EdgeGaps`]), takes every planned gap exactly once
        /// and leaves its check nothing to read; without the gaps the check reads exactly them;
        /// a flipped byte in a gap read with the rows fails the check.
        #[test]
        fn gaps_read_beside_the_rows_are_all_a_check_needs(
            len in 1usize..5000,
            block in prop::option::of(1u64..700),
            cuts in prop::collection::vec(0.0f64..1.0, 0..8),
            chunk in 1u64..900,
            seed in any::<u64>(),
            flip in 0.0f64..1.0,
        ) {
            let bytes: Vec<u8> = (0..len)
                .map(|i| saver_core::partition::fmix64(i as u64) as u8)
                .collect();
            let t = tensor(&bytes, block);
            // Disjoint ranges: every other interval between sorted cut points.
            let mut at: Vec<u64> = cuts.iter().map(|c| (c * len as f64) as u64).collect();
            at.sort_unstable();
            let ranges: Vec<Range<u64>> = at
                .chunks_exact(2)
                .map(|w| w[0]..w[1])
                .filter(|r| !r.is_empty())
                .collect();
            prop_assume!(!ranges.is_empty());
            let mut chunks = Vec::new();
            for r in &ranges {
                let mut a = r.start;
                while a < r.end {
                    chunks.push(a..(a + chunk).min(r.end));
                    a = (a + chunk).min(r.end);
                }
            }
            chunks.sort_by_key(|c| saver_core::partition::fmix64(c.start ^ seed));
            let gaps = planned_gaps(&t, &ranges);
            let gap_bytes: u64 = gaps.iter().map(|g| g.end - g.start).sum();
            // The pieces of the chunks read from `src`, with the gaps beside them if `beside`.
            let read = |src: &[u8], beside: bool| {
                let mut planned = EdgeGaps::default();
                planned.plan(&t, &ranges);
                let (mut pieces, mut taken) = (Vec::new(), Vec::new());
                for c in &chunks {
                    let mut parts = vec![c.clone()];
                    if beside {
                        let g = planned.take_beside(&t, c);
                        taken.extend(g.iter().cloned());
                        parts.extend(g);
                    }
                    for p in parts {
                        push(&t, p.start, &src[p.start as usize..p.end as usize], &mut pieces);
                    }
                }
                taken.sort_by_key(|g| g.start);
                (pieces, taken)
            };
            let mut asked = 0;
            let (pieces, taken) = read(&bytes, true);
            prop_assert_eq!(&taken, &gaps);
            let got = check_with(&t, pieces, hash_of(&bytes, &mut asked)).unwrap();
            prop_assert_eq!(got, Some(0));
            prop_assert_eq!(asked, 0);
            let got = check_with(&t, read(&bytes, false).0, hash_of(&bytes, &mut asked)).unwrap();
            prop_assert_eq!(got, Some(gap_bytes));
            prop_assert_eq!(asked, gap_bytes);
            if gap_bytes > 0 {
                // A byte of the gaps, changed in the file that the load reads.
                let mut n = (flip * gap_bytes as f64) as u64;
                let mut at = None;
                for g in &gaps {
                    if n < g.end - g.start {
                        at = Some(g.start + n);
                        break;
                    }
                    n -= g.end - g.start;
                }
                let mut bad = bytes.clone();
                bad[at.unwrap() as usize] ^= 1;
                let got = check_with(&t, read(&bad, true).0, hash_of(&bad, &mut asked)).unwrap();
                prop_assert_eq!(got, None);
            }
        }
    }
}

//! Checking the CRC32s of a tensor from the pieces a read path took of it.
//!
//! Loads for another shard count and the links of a chain read only some rows of a tensor. So that
//! every byte they return is still covered by a checksum that was checked, each piece's CRC32 is
//! kept, cut at the tensor's checksummed blocks ([`BlockCrcs`]), and every block a piece touched
//! is checked: the pieces' CRC32s combined with the bytes of the block they leave out, read only
//! to be hashed (where pieces overlap, the block is hashed whole). A tensor without blocks (short,
//! or written before blocks existed) is one block with the tensor's CRC32.

use std::ops::Range;

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

/// Adds to `out` the pieces of `bytes`, read from `t` at `offset`: one per block they touch.
pub(crate) fn push(t: &TensorRef, offset: u64, bytes: &[u8], out: &mut Vec<Piece>) {
    let block = block_bytes(t);
    let mut at = 0;
    while at < bytes.len() {
        let offset = offset + at as u64;
        let n = ((block - offset % block) as usize).min(bytes.len() - at);
        let mut crc = Hasher::new();
        crc.update(&bytes[at..at + n]);
        out.push(Piece {
            offset,
            len: n as u64,
            crc,
        });
        at += n;
    }
}

/// The CRC32 states of one block's bytes, in order.
enum Part {
    /// A piece the caller read.
    Read(Hasher),
    /// Gap `n` of the gaps read here.
    Gap(usize),
}

/// Checks every block of `t` that `pieces` touch against the manifest's CRC32s, reading from
/// `ckpt` the bytes of those blocks the pieces leave out (all in a few batched requests, which a
/// remote store fetches at once). Returns the count of bytes read, or `None` when a block fails
/// its check.
pub(crate) fn check(ckpt: &Link, t: &TensorRef, mut pieces: Vec<Piece>) -> Result<Option<u64>> {
    let block = block_bytes(t);
    pieces.sort_by_key(|p| p.offset);
    let mut blocks: Vec<(u64, Vec<Part>)> = Vec::new();
    let mut gaps: Vec<Range<u64>> = Vec::new();
    let mut rest = pieces.into_iter().peekable();
    while let Some(first) = rest.peek() {
        let k = first.offset / block;
        let range = k * block..((k + 1) * block).min(t.len);
        let mut of_block = Vec::new();
        while let Some(p) = rest.next_if(|p| p.offset / block == k) {
            of_block.push(p);
        }
        let tiles = of_block
            .windows(2)
            .all(|w| w[0].offset + w[0].len <= w[1].offset);
        let mut parts = Vec::new();
        let mut gap = |parts: &mut Vec<Part>, r: Range<u64>| {
            if !r.is_empty() {
                parts.push(Part::Gap(gaps.len()));
                gaps.push(r);
            }
        };
        if tiles {
            let mut at = range.start;
            for p in of_block {
                gap(&mut parts, at..p.offset);
                at = p.offset + p.len;
                parts.push(Part::Read(p.crc));
            }
            gap(&mut parts, at..range.end);
        } else {
            // Some bytes were read twice: the block is hashed whole.
            gap(&mut parts, range);
        }
        blocks.push((k, parts));
    }
    let gap_crcs = hash_ranges(ckpt, t, &gaps)?;
    for (k, parts) in blocks {
        let mut combined = Hasher::new();
        for part in &parts {
            match part {
                Part::Read(h) => combined.combine(h),
                Part::Gap(n) => combined.combine(&gap_crcs[*n]),
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
    Ok(Some(gaps.iter().map(|r| r.end - r.start).sum()))
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

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
use crate::reader::Checkpoint;

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

/// Checks every block of `t` that `pieces` touch against the manifest's CRC32s, reading from
/// `ckpt` the bytes of those blocks the pieces leave out. Returns the count of bytes read, or
/// `None` when a block fails its check.
pub(crate) fn check(
    ckpt: &Checkpoint,
    t: &TensorRef,
    mut pieces: Vec<Piece>,
) -> Result<Option<u64>> {
    let block = block_bytes(t);
    pieces.sort_by_key(|p| p.offset);
    let mut read = 0;
    let mut rest = pieces.as_slice();
    while let Some(first) = rest.first() {
        let k = first.offset / block;
        let n = rest.iter().take_while(|p| p.offset / block == k).count();
        let (of_block, after) = rest.split_at(n);
        rest = after;
        let range = k * block..((k + 1) * block).min(t.len);
        let want = match &t.blocks {
            Some(b) => match b.crc32.get(k as usize) {
                Some(&c) => c,
                None => return Ok(None),
            },
            None => t.crc32,
        };
        let (crc, r) = crc_of_block(ckpt, t, range, of_block)?;
        read += r;
        if crc != want {
            return Ok(None);
        }
    }
    Ok(Some(read))
}

/// The CRC32 of bytes `range` of `t` from the `pieces` within it (sorted by offset) and the bytes
/// between them; and the count of bytes read for it.
fn crc_of_block(
    ckpt: &Checkpoint,
    t: &TensorRef,
    range: Range<u64>,
    pieces: &[Piece],
) -> Result<(u32, u64)> {
    let tiles = pieces
        .windows(2)
        .all(|w| w[0].offset + w[0].len <= w[1].offset);
    let mut combined = Hasher::new();
    let (mut at, mut read) = (range.start, 0);
    if tiles {
        for p in pieces {
            read += hash_range(ckpt, t, at..p.offset, &mut combined)?;
            combined.combine(&p.crc);
            at = p.offset + p.len;
        }
    }
    read += hash_range(ckpt, t, at..range.end, &mut combined)?;
    Ok((combined.finalize(), read))
}

/// Adds bytes `range` of `t` to `h`, read a bounded window at a time; returns their count.
fn hash_range(ckpt: &Checkpoint, t: &TensorRef, range: Range<u64>, h: &mut Hasher) -> Result<u64> {
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

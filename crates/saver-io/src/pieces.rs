//! The CRC32 of a tensor from the pieces a read path took of it.
//!
//! A checkpoint stores one CRC32 per tensor, but loads for another shard count and the links of a
//! chain read only some rows of a tensor. So that every byte returned is still covered by a
//! checksum that was checked, the pieces' CRC32s are combined with the bytes between them, read
//! only to be hashed; where pieces overlap (bytes read twice), the tensor is hashed whole.

use std::ops::Range;

use crc32fast::Hasher;

use saver_core::manifest::TensorRef;

use crate::error::Result;
use crate::reader::Checkpoint;

/// One piece of a tensor that was read: its offset in the tensor and the CRC32 state of its bytes.
pub(crate) struct Piece {
    /// Offset of the piece's first byte in the tensor.
    pub offset: u64,
    /// CRC32 state of the piece's bytes (it also knows their count).
    pub crc: Hasher,
    /// The piece's length in bytes.
    pub len: u64,
}

impl Piece {
    /// The piece of `bytes` read at `offset`.
    pub fn of(offset: u64, bytes: &[u8]) -> Self {
        let mut crc = Hasher::new();
        crc.update(bytes);
        Self {
            offset,
            crc,
            len: bytes.len() as u64,
        }
    }
}

/// The tensor's CRC32 from `pieces`, with the bytes they leave out read from `ckpt`; and the
/// count of bytes read to get it.
pub(crate) fn crc_of(
    ckpt: &Checkpoint,
    t: &TensorRef,
    mut pieces: Vec<Piece>,
) -> Result<(u32, u64)> {
    pieces.sort_by_key(|p| p.offset);
    let tiles = pieces
        .windows(2)
        .all(|w| w[0].offset + w[0].len <= w[1].offset);
    let mut combined = Hasher::new();
    let (mut at, mut read) = (0, 0);
    if tiles {
        for p in &pieces {
            read += hash_range(ckpt, t, at..p.offset, &mut combined)?;
            combined.combine(&p.crc);
            at = p.offset + p.len;
        }
    }
    read += hash_range(ckpt, t, at..t.len, &mut combined)?;
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

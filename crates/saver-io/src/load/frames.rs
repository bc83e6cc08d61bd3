//! Reads of compressed tensors (format versions 3 and 4): a range of a tensor's raw bytes is read
//! as the stored frames that hold it, which are decompressed and cut to the range. Every read of
//! tensor bytes goes through [`crate::load::link::Link::read_tensor_ranges`], which plans these,
//! so every command reads compressed checkpoints as it reads raw ones.

use saver_core::compress::{decompress_frame, Filter};
use saver_core::manifest::TensorRef;

use crate::error::{Error, Result};

/// The stored frames of a compressed tensor that hold a range of its raw bytes.
pub(crate) struct FrameRead {
    /// First frame read.
    first: usize,
    /// Where the first frame's stored bytes start in the file.
    pub file_offset: u64,
    /// The frames' stored bytes, back to back, filled by the read.
    pub stored: Vec<u8>,
}

impl FrameRead {
    /// The frames of `t` (which must have a codec that `TensorRef::check_codec` accepted)
    /// holding raw bytes `offset..offset + len`.
    pub(crate) fn plan(t: &TensorRef, offset: u64, len: u64) -> Self {
        let c = t.codec.as_ref().expect("a compressed tensor");
        let frame = t.frame_bytes();
        let first = (offset / frame) as usize;
        // An empty range reads no frame, wherever it lies.
        let last = if len == 0 {
            first
        } else {
            ((offset + len - 1) / frame) as usize + 1
        };
        let last = last.min(c.frames.len());
        let before: u64 = c.frames[..first.min(c.frames.len())]
            .iter()
            .map(|&l| u64::from(l))
            .sum();
        let stored: u64 = c.frames[first.min(last)..last]
            .iter()
            .map(|&l| u64::from(l))
            .sum();
        Self {
            first,
            file_offset: t.offset + before,
            stored: vec![0; stored as usize],
        }
    }

    /// Decompresses the frames read into `out`, raw bytes `offset..offset + out.len()` of `t`.
    pub(crate) fn decode(&self, t: &TensorRef, offset: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            // Planned with no frame (see `plan`).
            return Ok(());
        }
        let c = t.codec.as_ref().expect("a compressed tensor");
        let filter = Filter::parse(&c.filter).expect("checked with the manifest");
        let frame = t.frame_bytes();
        let end = offset + out.len() as u64;
        let mut scratch = Vec::new();
        let mut at = 0usize;
        let mut k = self.first;
        while k < c.frames.len() && (k as u64) * frame < end {
            let raw_start = k as u64 * frame;
            let raw_len = (t.len - raw_start).min(frame);
            let stored = &self.stored[at..at + c.frames[k] as usize];
            at += stored.len();
            let corrupt = |e: saver_core::compress::CodecError| Error::Corrupt {
                file: t.file.clone(),
                what: format!("tensor {:?}: compressed frame {k}: {e}", t.name),
            };
            let lo = offset.max(raw_start);
            let hi = end.min(raw_start + raw_len);
            let dst = &mut out[(lo - offset) as usize..(hi - offset) as usize];
            if lo == raw_start && hi == raw_start + raw_len {
                decompress_frame(filter, stored, dst).map_err(corrupt)?;
            } else {
                scratch.resize(raw_len as usize, 0);
                decompress_frame(filter, stored, &mut scratch).map_err(corrupt)?;
                dst.copy_from_slice(&scratch[(lo - raw_start) as usize..(hi - raw_start) as usize]);
            }
            k += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use saver_core::compress::{compress, Filter};
    use saver_core::manifest::{Codec, ZSTD};
    use saver_core::Dtype;

    /// Every range of a compressed tensor, empty ones anywhere included, decodes to the raw
    /// bytes it covers from the frames its plan reads.
    #[test]
    fn every_range_decodes_to_its_raw_bytes() {
        let raw: Vec<u8> = (0..10_000u32).flat_map(|i| (i / 7).to_le_bytes()).collect();
        let frame = 4096;
        let c = compress(&raw, Filter::Shuffle(4), frame, 1).unwrap();
        let stored_at = 100u64;
        let mut file = vec![0u8; stored_at as usize];
        file.extend_from_slice(&c.bytes);
        let t = TensorRef {
            file: "f".into(),
            name: "t".into(),
            dtype: Dtype::U32,
            shape: vec![10_000],
            offset: stored_at,
            len: raw.len() as u64,
            crc32: 0,
            blocks: Some(saver_core::BlockCrcs {
                bytes: frame as u64,
                crc32: vec![0; raw.len().div_ceil(frame)],
            }),
            codec: Some(Codec {
                name: ZSTD.into(),
                filter: Filter::Shuffle(4).name(),
                stored: c.bytes.len() as u64,
                frames: c.frame_lens.clone(),
            }),
        };
        t.check_codec().unwrap();
        for (offset, len) in [
            (0, raw.len()),
            (0, 0),
            (5, 0),
            (raw.len(), 0),
            (4095, 2),
            (4096, 4096),
            (100, 9000),
            (raw.len() - 3, 3),
            (12_345, 17),
        ] {
            let mut fr = FrameRead::plan(&t, offset as u64, len as u64);
            let at = fr.file_offset as usize;
            let n = fr.stored.len();
            fr.stored.copy_from_slice(&file[at..at + n]);
            let mut out = vec![0u8; len];
            fr.decode(&t, offset as u64, &mut out).unwrap();
            assert_eq!(out, raw[offset..offset + len], "{offset}+{len}");
        }
    }
}

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
    /// The frames of `t` (which must have a codec that [`TensorRef::check_codec`] accepted)
    /// holding raw bytes `offset..offset + len`.
    pub fn plan(t: &TensorRef, offset: u64, len: u64) -> Self {
        let c = t.codec.as_ref().expect("a compressed tensor");
        let frame = t.frame_bytes();
        let first = (offset / frame) as usize;
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
    pub fn decode(&self, t: &TensorRef, offset: u64, out: &mut [u8]) -> Result<()> {
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

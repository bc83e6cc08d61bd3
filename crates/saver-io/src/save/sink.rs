//! Where a writer thread puts the pieces of the chunks it produces: into the files of the plan
//! (straight, or through a compressed file), recording their CRCs (`checksum`) and the save's
//! progress.
//!
//! Slot rows are gathered into memory the file lends where it has any ([`WriteHandle::lend`]:
//! direct I/O writes from its own page-aligned buffers), so they are copied once, from the table
//! into the memory the disk reads; elsewhere into this thread's own reusable buffers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use saver_core::plan::{crc_block_bytes, Loc, Piece, PieceSink};
use saver_core::SavePlan;

use crate::error::{Error, Result};
use crate::save::checksum::CrcRuns;
use crate::save::compressing::CompressedFile;
use crate::save::options::{Progress, ProgressFn};
use crate::storage::{Lent, WriteHandle};

/// Memory a piece's rows are gathered into.
pub(super) enum PieceMemory {
    /// Lent by the file the piece goes to.
    Lent(Lent),
    /// The writer thread's own, reused for its next chunks.
    Own(Vec<u8>),
}

impl AsRef<[u8]> for PieceMemory {
    fn as_ref(&self) -> &[u8] {
        match self {
            PieceMemory::Lent(l) => l.as_ref(),
            PieceMemory::Own(v) => v,
        }
    }
}

impl AsMut<[u8]> for PieceMemory {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            PieceMemory::Lent(l) => l.as_mut(),
            PieceMemory::Own(v) => v,
        }
    }
}

/// What every writer thread's sink shares: the plan's open files and the save's progress.
pub(super) struct Files<'a> {
    pub plan: &'a SavePlan<'a>,
    /// `handles[shard][file]`.
    pub handles: &'a [Vec<Box<dyn WriteHandle>>],
    /// Set for a compressed save: `compressed[shard][file]`.
    pub compressed: Option<&'a [Vec<CompressedFile<'a>>]>,
    pub durable: bool,
    pub progress: Option<&'a ProgressFn>,
    /// Bytes of data produced so far, of `total`.
    pub done: &'a AtomicU64,
    pub total: u64,
}

/// One writer thread's sink.
pub(super) struct FileSink<'a> {
    files: &'a Files<'a>,
    /// The CRCs of the pieces this thread wrote.
    pub crcs: CrcRuns,
    /// Buffers of this thread's own, for pieces no file lends memory for: taken from the front
    /// and given back to the back, so that each slot of a chunk gets the buffer the same slot
    /// had in the chunk before, already of its size.
    spare: VecDeque<Vec<u8>>,
}

impl<'a> FileSink<'a> {
    pub(super) fn new(files: &'a Files<'a>) -> Self {
        Self {
            files,
            crcs: CrcRuns::default(),
            spare: VecDeque::new(),
        }
    }

    /// The file a piece goes to, and the piece's offset in it.
    fn place(&self, shard: usize, loc: Loc, offset: u64) -> (&'a dyn WriteHandle, u64) {
        let f = &self.files.plan.shards()[shard].files[loc.file];
        let t = &f.tensors[loc.tensor];
        let h = &self.files.handles[shard][loc.file];
        (&**h, f.data_start + t.start + offset)
    }

    /// Records the CRC of a piece and reports progress.
    fn record(&mut self, shard: usize, loc: Loc, offset: u64, bytes: &[u8]) {
        let t = &self.files.plan.shards()[shard].files[loc.file].tensors[loc.tensor];
        let block = crc_block_bytes(t.end - t.start).unwrap_or(u64::MAX);
        self.crcs.record(shard, loc, offset, bytes, block);
        if let Some(p) = self.files.progress {
            let n = bytes.len() as u64;
            let written = self.files.done.fetch_add(n, Ordering::Relaxed) + n;
            p(Progress {
                bytes: n,
                written,
                total: self.files.total,
            });
        }
    }

    /// Writes bytes held in memory of the caller's.
    fn write(&self, shard: usize, loc: Loc, offset: u64, bytes: &[u8]) -> Result<()> {
        if let Some(files) = self.files.compressed {
            return files[shard][loc.file].put(loc.tensor, offset, bytes);
        }
        let (h, at) = self.place(shard, loc, offset);
        h.write_at(at, bytes)?;
        if self.files.durable {
            h.start_writeback(at, bytes.len() as u64);
        }
        Ok(())
    }
}

impl PieceSink for FileSink<'_> {
    type Error = Error;
    type Buf = PieceMemory;

    fn lend(&mut self, shard: usize, loc: Loc, offset: u64, len: usize) -> Result<PieceMemory> {
        if self.files.compressed.is_none() {
            let (h, at) = self.place(shard, loc, offset);
            if let Some(lent) = h.lend(at, len)? {
                return Ok(PieceMemory::Lent(lent));
            }
        }
        let mut own = self.spare.pop_front().unwrap_or_default();
        own.resize(len, 0);
        Ok(PieceMemory::Own(own))
    }

    fn put(&mut self, piece: Piece<'_>) -> Result<()> {
        self.write(piece.shard, piece.loc, piece.offset, piece.bytes)?;
        self.record(piece.shard, piece.loc, piece.offset, piece.bytes);
        Ok(())
    }

    fn put_lent(&mut self, shard: usize, loc: Loc, offset: u64, buf: PieceMemory) -> Result<()> {
        // Recorded first: lent memory goes to the file, and the file may reuse it at once.
        self.record(shard, loc, offset, buf.as_ref());
        match buf {
            PieceMemory::Lent(lent) => self.place(shard, loc, offset).0.write_lent(lent),
            PieceMemory::Own(own) => {
                let written = self.write(shard, loc, offset, &own);
                self.spare.push_back(own);
                written
            }
        }
    }
}

//! Producing a plan's bytes lazily, in bounded chunks.
//!
//! The writer asks [`SavePlan::chunks`] for the work list and calls `SavePlan::produce` for each
//! chunk from any thread. A row chunk reads a run of rows of a segment *once*, all kept slots
//! together (so a row is never torn across slot tensors), and hands out the ids bytes and every
//! slot's bytes, each with its destination. Nothing larger than one chunk is ever materialised;
//! ids, bucket indexes and dense tensors are handed out without a copy, and the slots' rows are
//! gathered straight into memory the [`PieceSink`] lends: a sink that writes from memory of its
//! own (direct I/O needs aligned memory) then copies no byte a second time.

use std::borrow::Cow;
use std::ops::Range;

use crate::error::Error;

use super::{Loc, SavePlan};

/// One unit of writer work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Chunk {
    /// Rows `rows` (relative to the segment) of a segment: its ids and every kept slot.
    Rows {
        /// Planned shard position.
        shard: usize,
        /// Partition within the shard.
        partition: usize,
        /// Segment within the partition.
        segment: usize,
        /// Row range within the segment.
        rows: Range<usize>,
    },
    /// The bucket index of a segment.
    BucketIndex {
        /// Planned shard position.
        shard: usize,
        /// Partition within the shard.
        partition: usize,
        /// Segment within the partition.
        segment: usize,
    },
    /// Bytes `bytes` of a dense tensor.
    Dense {
        /// Planned shard position.
        shard: usize,
        /// Index into the shard's dense list.
        dense: usize,
        /// Byte range within the tensor.
        bytes: Range<u64>,
    },
}

/// Bytes bound for one tensor at one offset.
#[derive(Debug)]
pub struct Piece<'b> {
    /// Planned shard position.
    pub shard: usize,
    /// Where the tensor is.
    pub loc: Loc,
    /// Offset within the tensor.
    pub offset: u64,
    /// The bytes.
    pub bytes: &'b [u8],
}

/// Where `SavePlan::produce` hands a chunk's bytes.
///
/// Bytes the plan already holds (ids, bucket indexes, dense tensors) are lent *to* the sink
/// ([`PieceSink::put`]); rows the chunk gathers go into memory the sink lends
/// ([`PieceSink::lend`]) and come back filled ([`PieceSink::put_lent`]).
pub trait PieceSink {
    /// What a failure of the sink is; the plan's own errors convert into it.
    type Error: From<Error>;
    /// Memory the sink lends for one piece.
    type Buf: AsRef<[u8]> + AsMut<[u8]>;
    /// Memory of exactly `len` bytes for the piece at `offset` of the tensor at `loc`, which
    /// the plan fills whole (its prior contents never reach a file).
    fn lend(
        &mut self,
        shard: usize,
        loc: Loc,
        offset: u64,
        len: usize,
    ) -> Result<Self::Buf, Self::Error>;
    /// Bytes of a piece that the plan holds.
    fn put(&mut self, piece: Piece<'_>) -> Result<(), Self::Error>;
    /// The memory [`PieceSink::lend`] gave for the piece at `offset` of the tensor at `loc`,
    /// filled.
    fn put_lent(
        &mut self,
        shard: usize,
        loc: Loc,
        offset: u64,
        buf: Self::Buf,
    ) -> Result<(), Self::Error>;
}

/// Reusable buffers of one writer thread.
#[derive(Default, Debug)]
pub struct ChunkBuffer {
    ids: Vec<u64>,
    handles: Vec<u64>,
}

/// Raw little-endian bytes of a `u64` slice, without a copy on little-endian machines.
fn u64_bytes(v: &[u64]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

impl SavePlan<'_> {
    /// Every chunk of every planned shard: shard by shard, each partition's segments in order,
    /// then the dense tensors. Each tensor is covered front to back.
    pub fn chunks(&self) -> Vec<Chunk> {
        let chunk_bytes = self.opts.chunk_bytes;
        let mut out = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            for (p, part) in shard.partitions.iter().enumerate() {
                let t = &self.tables[part.table];
                let row_bytes = t.saved_row_bytes(&part.slots);
                let step = (chunk_bytes / row_bytes).max(1) as usize;
                for (g, seg) in part.segments.iter().enumerate() {
                    out.push(Chunk::BucketIndex {
                        shard: s,
                        partition: p,
                        segment: g,
                    });
                    let n = seg.rows.len();
                    let mut r = 0;
                    while r < n {
                        let end = (r + step).min(n);
                        out.push(Chunk::Rows {
                            shard: s,
                            partition: p,
                            segment: g,
                            rows: r..end,
                        });
                        r = end;
                    }
                }
            }
            for (d, dp) in shard.dense.iter().enumerate() {
                let len = self.dense[dp.dense].byte_len();
                let mut b = 0;
                while b < len {
                    let end = (b + chunk_bytes).min(len);
                    out.push(Chunk::Dense {
                        shard: s,
                        dense: d,
                        bytes: b..end,
                    });
                    b = end;
                }
            }
        }
        out
    }

    /// The file that receives most of a chunk's bytes, as (planned shard position, index into its
    /// files). A row chunk's ids and slots may lie in different files; this is the file of its
    /// widest slot.
    #[doc(hidden)]
    pub fn chunk_file(&self, chunk: &Chunk) -> (usize, usize) {
        match chunk {
            Chunk::Rows {
                shard,
                partition,
                segment,
                ..
            } => {
                let part = &self.shards[*shard].partitions[*partition];
                let seg = &part.segments[*segment];
                let t = &self.tables[part.table];
                let widest = part
                    .slots
                    .iter()
                    .zip(&seg.slots)
                    .max_by_key(|(&k, _)| t.slot_bytes[k])
                    .map_or(seg.ids, |(_, loc)| *loc);
                (*shard, widest.file)
            }
            Chunk::BucketIndex {
                shard,
                partition,
                segment,
            } => {
                let seg = &self.shards[*shard].partitions[*partition].segments[*segment];
                (*shard, seg.index_loc.file)
            }
            Chunk::Dense { shard, dense, .. } => {
                (*shard, self.shards[*shard].dense[*dense].loc.file)
            }
        }
    }

    /// Produces a chunk's bytes and hands each piece to `sink`: for a row chunk, the ids, then
    /// every kept slot in order.
    #[doc(hidden)]
    pub fn produce<S: PieceSink>(
        &self,
        chunk: &Chunk,
        buf: &mut ChunkBuffer,
        sink: &mut S,
    ) -> Result<(), S::Error> {
        match chunk {
            Chunk::Rows {
                shard,
                partition,
                segment,
                rows,
            } => {
                let part = &self.shards[*shard].partitions[*partition];
                let seg = &part.segments[*segment];
                let table = &self.tables[part.table];
                let abs = seg.rows.start + rows.start..seg.rows.start + rows.end;
                let ChunkBuffer { ids, handles } = buf;
                table
                    .rows
                    .copy(&*table.snapshot, abs, true, ids, handles)
                    .map_err(S::Error::from)?;
                let n = ids.len();
                // One lent buffer per kept slot, in `part.slots` order, with the place it is
                // for; the table is asked for every slot, the ones not kept with no room.
                let mut lent = Vec::with_capacity(part.slots.len());
                for (k, &s) in part.slots.iter().enumerate() {
                    let (loc, offset) = (seg.slots[k], (rows.start * table.slot_bytes[s]) as u64);
                    let len = n * table.slot_bytes[s];
                    lent.push((loc, offset, sink.lend(*shard, loc, offset, len)?));
                }
                {
                    let mut outs: Vec<&mut [u8]> =
                        (0..table.slots.len()).map(|_| &mut [][..]).collect();
                    for (&s, (_, _, b)) in part.slots.iter().zip(lent.iter_mut()) {
                        outs[s] = b.as_mut();
                    }
                    // SAFETY: `handles` is empty or came from this snapshot's scan, with `ids`,
                    // and the region sort moved them together.
                    unsafe { table.snapshot.read_rows_by_handle(ids, handles, &mut outs) }
                        .map_err(S::Error::from)?;
                }
                sink.put(Piece {
                    shard: *shard,
                    loc: seg.ids,
                    offset: rows.start as u64 * 8,
                    bytes: &u64_bytes(ids),
                })?;
                for (loc, offset, buf) in lent {
                    sink.put_lent(*shard, loc, offset, buf)?;
                }
                Ok(())
            }
            Chunk::BucketIndex {
                shard,
                partition,
                segment,
            } => {
                let seg = &self.shards[*shard].partitions[*partition].segments[*segment];
                sink.put(Piece {
                    shard: *shard,
                    loc: seg.index_loc,
                    offset: 0,
                    bytes: &u64_bytes(&seg.bucket_index),
                })
            }
            Chunk::Dense {
                shard,
                dense,
                bytes,
            } => {
                let dp = &self.shards[*shard].dense[*dense];
                let tensor = &self.dense[dp.dense];
                match tensor.data() {
                    Some(data) => sink.put(Piece {
                        shard: *shard,
                        loc: dp.loc,
                        offset: bytes.start,
                        bytes: &data[bytes.start as usize..bytes.end as usize],
                    }),
                    // Read on demand: this chunk's bytes only, into the sink's own memory.
                    None => {
                        let len = (bytes.end - bytes.start) as usize;
                        let mut buf = sink.lend(*shard, dp.loc, bytes.start, len)?;
                        tensor
                            .read_at(bytes.start, buf.as_mut())
                            .map_err(S::Error::from)?;
                        sink.put_lent(*shard, dp.loc, bytes.start, buf)
                    }
                }
            }
        }
    }
}

//! The data files of a compressed save (`PlanOptions::compression`, format versions 3 and 4).
//!
//! A tensor's place in its file is known only once the tensors before it are stored, so a file
//! is stored front to back: each tensor's bytes, as writer threads produce them in any order,
//! fill frames of its CRC blocks' size; a whole frame is compressed at once by the thread that
//! completed it, and frames are appended in file order as soon as every frame before them is.
//! Frames that arrive ahead wait in memory: a segment's later tensors wait for its ids, which is
//! why compressed saves cut small segments (`COMPRESSED_SEGMENT_BYTES`).
//!
//! Each tensor's filter is chosen on its first frame, among those that suit what it holds
//! (`compress::choose`'s candidates); a tensor whose first frame does not shrink by
//! `compress::MIN_RATIO` is stored as it is, and so is every tensor under 4 KiB.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use saver_core::compress::{self, ColumnKind, Filter, FrameCompressor, MIN_RATIO};
use saver_core::manifest::{Codec, ZSTD};
use saver_core::plan::{crc_block_bytes, Loc, ShardPlan, Stored};

use crate::error::{Error, Result};
use crate::storage::WriteHandle;

/// Tensors smaller than this are stored as they are: too little to win.
const MIN_COMPRESSED_BYTES: u64 = 4096;

/// What a tensor's frames become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    /// Not known until its first frame is compressed.
    Undecided,
    /// Stored as it is.
    Raw,
    /// Compressed through this filter.
    Compress(Filter),
}

/// One frame of a tensor on its way into the file.
enum Frame {
    /// Receiving its raw bytes.
    Filling { raw: Vec<u8>, filled: u64 },
    /// Whole, waiting for its tensor's decision.
    Waiting(Vec<u8>),
    /// Being compressed by a thread.
    Busy,
    /// Its stored bytes, waiting for the frames before it.
    Ready(Vec<u8>),
}

struct Tensor {
    name: String,
    len: u64,
    /// Raw bytes of each frame but the last.
    frame: u64,
    /// What it holds, for the filter's choice; `None`: stored as it is.
    kind: Option<ColumnKind>,
    decision: Decision,
    frames: BTreeMap<usize, Frame>,
    /// Stored lengths of the frames appended so far.
    stored: Vec<u32>,
    /// Where its stored bytes start in the data section, once it is reached.
    start: u64,
}

impl Tensor {
    fn frames(&self) -> usize {
        self.len.div_ceil(self.frame) as usize
    }

    fn frame_len(&self, k: usize) -> u64 {
        (self.len - k as u64 * self.frame).min(self.frame)
    }
}

struct State {
    tensors: Vec<Tensor>,
    /// The first tensor not yet wholly appended.
    cursor: usize,
    /// Where the next stored byte goes, within the data section.
    at: u64,
    /// Compressors not in use, so threads reuse their contexts.
    compressors: Vec<FrameCompressor>,
}

/// Work a thread does outside the lock.
enum Job {
    /// Choose tensor's filter on its first frame.
    Decide(usize, Vec<u8>),
    /// Compress frame `k` of the tensor.
    Compress(usize, usize, Vec<u8>, Filter),
}

/// One data file of a compressed save, being stored.
pub(crate) struct CompressedFile<'h> {
    handle: &'h dyn WriteHandle,
    data_start: u64,
    level: i32,
    /// Whether the save is durable: stored bytes then start their writeback at once.
    durable: bool,
    state: Mutex<State>,
}

impl<'h> CompressedFile<'h> {
    /// File `file` of `shard`, written through `handle` at zstd `level`.
    pub(super) fn new(
        shard: &ShardPlan,
        file: usize,
        handle: &'h dyn WriteHandle,
        level: i32,
        durable: bool,
    ) -> Self {
        let f = &shard.files[file];
        let mut kinds: Vec<Option<ColumnKind>> = f
            .tensors
            .iter()
            .map(|t| {
                Some(ColumnKind::Values {
                    size: (t.dtype.bits() / 8).max(1) as usize,
                })
            })
            .collect();
        let here = |l: &Loc| l.file == file;
        for seg in shard.partitions.iter().flat_map(|p| &p.segments) {
            for l in [seg.ids, seg.index_loc].iter().filter(|l| here(l)) {
                kinds[l.tensor] = Some(ColumnKind::Ids);
            }
        }
        let tensors = f
            .tensors
            .iter()
            .zip(kinds)
            .map(|(t, kind)| {
                let len = t.end - t.start;
                let small = len < MIN_COMPRESSED_BYTES;
                Tensor {
                    name: t.name.clone(),
                    len,
                    frame: crc_block_bytes(len).unwrap_or(len).max(1),
                    kind: kind.filter(|_| !small),
                    decision: if small {
                        Decision::Raw
                    } else {
                        Decision::Undecided
                    },
                    frames: BTreeMap::new(),
                    stored: Vec::new(),
                    start: 0,
                }
            })
            .collect();
        Self {
            handle,
            data_start: f.data_start,
            level,
            durable,
            state: Mutex::new(State {
                tensors,
                cursor: 0,
                at: 0,
                compressors: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes bytes `offset..` of tensor `tensor` (its number in the file), and stores whatever
    /// they complete.
    pub(super) fn put(&self, tensor: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let mut jobs = Vec::new();
        {
            let mut st = self.lock();
            let t = &mut st.tensors[tensor];
            if offset + bytes.len() as u64 > t.len {
                return Err(Error::Mismatch(format!(
                    "internal: bytes {offset}.. of tensor {} run past its {} bytes",
                    t.name, t.len
                )));
            }
            let mut at = 0usize;
            while at < bytes.len() {
                let pos = offset + at as u64;
                let k = (pos / t.frame) as usize;
                let in_frame = (pos - k as u64 * t.frame) as usize;
                let flen = t.frame_len(k);
                let n = (flen as usize - in_frame).min(bytes.len() - at);
                let frame = t.frames.entry(k).or_insert_with(|| Frame::Filling {
                    raw: vec![0; flen as usize],
                    filled: 0,
                });
                let Frame::Filling { raw, filled } = frame else {
                    return Err(Error::Mismatch(format!(
                        "internal: frame {k} of tensor {} was produced twice",
                        t.name
                    )));
                };
                raw[in_frame..in_frame + n].copy_from_slice(&bytes[at..at + n]);
                *filled += n as u64;
                if *filled == flen {
                    let raw = std::mem::take(raw);
                    *frame = match t.decision {
                        Decision::Raw => Frame::Ready(raw),
                        Decision::Compress(f) => {
                            jobs.push(Job::Compress(tensor, k, raw, f));
                            Frame::Busy
                        }
                        Decision::Undecided if k == 0 => {
                            jobs.push(Job::Decide(tensor, raw));
                            Frame::Busy
                        }
                        Decision::Undecided => Frame::Waiting(raw),
                    };
                }
                at += n;
            }
        }
        while let Some(job) = jobs.pop() {
            self.run(job, &mut jobs)?;
        }
        self.append()
    }

    /// Does `job`, outside the lock, then records its outcome; queues the frames a decision
    /// releases.
    fn run(&self, job: Job, jobs: &mut Vec<Job>) -> Result<()> {
        let mut c = match self.lock().compressors.pop() {
            Some(c) => c,
            None => FrameCompressor::new(self.level).map_err(codec_error)?,
        };
        let outcome = match job {
            Job::Compress(t, k, raw, filter) => {
                let mut out = Vec::with_capacity(raw.len() / 2);
                c.compress_frame(&raw, filter, &mut out)
                    .map_err(codec_error)?;
                let mut st = self.lock();
                st.tensors[t].frames.insert(k, Frame::Ready(out));
                st.compressors.push(c);
                return Ok(());
            }
            Job::Decide(t, raw) => {
                let kind = self.lock().tensors[t].kind;
                let mut best: Option<(Filter, Vec<u8>)> = None;
                for filter in compress::candidates(kind.expect("only kinds are decided")) {
                    if !raw.len().is_multiple_of(filter.element()) {
                        continue;
                    }
                    let mut out = Vec::with_capacity(raw.len() / 2);
                    c.compress_frame(&raw, filter, &mut out)
                        .map_err(codec_error)?;
                    if best.as_ref().is_none_or(|(_, b)| out.len() < b.len()) {
                        best = Some((filter, out));
                    }
                }
                let wins = |b: &Vec<u8>| raw.len() as f64 >= MIN_RATIO * b.len() as f64;
                match best.filter(|(_, b)| wins(b)) {
                    Some((filter, stored)) => (t, Decision::Compress(filter), stored),
                    None => (t, Decision::Raw, raw),
                }
            }
        };
        let (t, decision, first) = outcome;
        let mut st = self.lock();
        st.compressors.push(c);
        let tensor = &mut st.tensors[t];
        tensor.decision = decision;
        tensor.frames.insert(0, Frame::Ready(first));
        for (&k, frame) in tensor.frames.iter_mut() {
            if let Frame::Waiting(raw) = frame {
                let raw = std::mem::take(raw);
                *frame = match decision {
                    Decision::Compress(f) => {
                        jobs.push(Job::Compress(t, k, raw, f));
                        Frame::Busy
                    }
                    _ => Frame::Ready(raw),
                };
            }
        }
        Ok(())
    }

    /// Appends, in file order, every frame whose turn has come.
    fn append(&self) -> Result<()> {
        let mut writes = Vec::new();
        {
            let mut st = self.lock();
            let State {
                tensors,
                cursor,
                at,
                ..
            } = &mut *st;
            while let Some(t) = tensors.get_mut(*cursor) {
                let k = t.stored.len();
                if k == 0 {
                    t.start = *at;
                }
                if k == t.frames() {
                    *cursor += 1;
                    continue;
                }
                let Some(Frame::Ready(_)) = t.frames.get(&k) else {
                    break;
                };
                let Some(Frame::Ready(bytes)) = t.frames.remove(&k) else {
                    unreachable!("just matched");
                };
                t.stored.push(bytes.len() as u32);
                writes.push((*at, bytes));
                *at += writes.last().expect("just pushed").1.len() as u64;
            }
        }
        for (at, bytes) in writes {
            self.handle.write_at(self.data_start + at, &bytes)?;
            if self.durable {
                self.handle
                    .start_writeback(self.data_start + at, bytes.len() as u64);
            }
        }
        Ok(())
    }

    /// Where each tensor was stored, in file order, and the data section's length; an error if
    /// some tensor was not produced whole.
    pub(super) fn finish(self) -> Result<(Vec<Stored>, u64)> {
        let st = self
            .state
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = st.tensors.get(st.cursor) {
            return Err(Error::Mismatch(format!(
                "internal: tensor {} was stored up to frame {} of {}",
                t.name,
                t.stored.len(),
                t.frames()
            )));
        }
        let stored = st
            .tensors
            .into_iter()
            .map(|t| {
                let len: u64 = t.stored.iter().map(|&l| u64::from(l)).sum();
                Stored {
                    start: t.start,
                    end: t.start + len,
                    codec: match t.decision {
                        Decision::Compress(f) => Some(Codec {
                            name: ZSTD.into(),
                            filter: f.name(),
                            stored: len,
                            frames: t.stored,
                        }),
                        _ => None,
                    },
                }
            })
            .collect();
        Ok((stored, st.at))
    }
}

fn codec_error(e: compress::CodecError) -> Error {
    Error::Mismatch(format!("internal: {e}"))
}

//! Verifying a checkpoint: structure, then every tensor's CRC32; reports every problem found.

use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use std::collections::HashMap;

use saver_core::manifest::{RowPatchManifest, TensorRef};
use saver_core::naming::INDEX_FILE;

use crate::error::{Error, Result};
use crate::load::checkpoint::{parent_lacks, parent_slot, ChangedRowsOrder};
use crate::load::frames::FrameRead;
use crate::load::link::{describe_incomplete, load_manifest, open_file};
use crate::storage::{open_location, Storage};

/// Overall verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Committed, complete and intact.
    Ok,
    /// Never committed (no index), e.g. shards missing or a save interrupted.
    Incomplete,
    /// Committed, but files are missing, truncated or their bytes changed.
    Corrupt,
}

/// One problem.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    /// The file concerned.
    pub file: String,
    /// The tensor concerned, if one.
    pub tensor: Option<String>,
    /// What is wrong.
    pub detail: String,
}

/// What [`verify`] found.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// The verdict.
    pub status: Status,
    /// The committed save, if any.
    pub save_id: Option<String>,
    /// Data files checked.
    pub files: usize,
    /// Tensors whose CRC32 was recomputed.
    pub tensors: usize,
    /// Tensor bytes read.
    pub bytes: u64,
    /// Every problem found.
    pub problems: Vec<Problem>,
    /// For a delta: every parent link verified, newest first, as `directory (save id)`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<String>,
}

/// Verifies the checkpoint in `dir` and, if it is a delta, every link of its chain: each parent
/// must be where its child says, be the save its child names (save id and manifest checksum),
/// and verify itself. A missing or replaced parent makes the delta corrupt, named in a problem.
pub fn verify(dir: impl AsRef<Path>, parallel: usize) -> Result<VerifyReport> {
    let dir = dir.as_ref();
    let mut report = verify_storage(&*open_location(dir)?, parallel)?;
    if report.status != Status::Ok {
        return Ok(report);
    }
    let chain = match crate::load::checkpoint::Checkpoint::open(dir) {
        Ok(c) => c,
        Err(e) if e.is_about_the_checkpoint() => {
            report.status = Status::Corrupt;
            report.problems.push(problem(&e, INDEX_FILE));
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    // What a read of the chain refuses before it reads: a link's patches over a parent that
    // does not hold their slot as they do, or over no parent at all.
    for (i, (dir, ckpt)) in chain.dirs().iter().zip(chain.links()).enumerate() {
        let parent = chain.links().get(i + 1).map(|l| l.manifest());
        for t in &ckpt.manifest().row_tables {
            for s in t.slots.iter().filter(|s| !s.patches.is_empty()) {
                let lacks = match parent {
                    Some(p) if parent_slot(p, &t.name, s).is_some() => continue,
                    Some(_) => parent_lacks(&t.name, s),
                    None => format!(
                        "row-range table {:?} slot {:?} holds changed rows of a parent, but the \
                         chain ends here",
                        t.name, s.name
                    ),
                };
                let at = chain.dirs().get(i + 1).unwrap_or(dir);
                report.status = Status::Corrupt;
                report.problems.push(Problem {
                    file: at.join(INDEX_FILE).display().to_string(),
                    tensor: None,
                    detail: format!("checkpoint {}: {lacks}", at.display()),
                });
            }
        }
    }
    for (link, ckpt) in chain.dirs().iter().zip(chain.links()).skip(1) {
        let r = verify_storage(&*open_location(link)?, parallel)?;
        report
            .parents
            .push(format!("{} ({})", link.display(), ckpt.manifest().save_id));
        report.files += r.files;
        report.tensors += r.tensors;
        report.bytes += r.bytes;
        for p in r.problems {
            report.problems.push(Problem {
                file: link.join(&p.file).display().to_string(),
                ..p
            });
        }
        if r.status != Status::Ok {
            report.status = Status::Corrupt;
        }
    }
    Ok(report)
}

fn problem(e: &Error, fallback_file: &str) -> Problem {
    let file = match e {
        Error::Corrupt { file, .. } => file.clone(),
        Error::Io { path, .. } => path.display().to_string(),
        _ => fallback_file.to_string(),
    };
    Problem {
        file,
        tensor: None,
        detail: e.to_string(),
    }
}

/// Verifies the checkpoint in `storage`. A checkpoint replaced while it is verified is verified
/// again, so the verdict is about the old or the new checkpoint, never a mixture. Errors that are
/// not about the checkpoint's bytes (permission denied, I/O errors) are returned as errors, not
/// as a "corrupt" verdict.
pub fn verify_storage(storage: &dyn Storage, parallel: usize) -> Result<VerifyReport> {
    crate::load::link::retry_if_replaced(
        storage,
        || verify_once(storage, parallel),
        |r| {
            !matches!(
                r,
                Ok(VerifyReport {
                    status: Status::Ok,
                    ..
                })
            )
        },
    )
}

fn verify_once(storage: &dyn Storage, parallel: usize) -> Result<VerifyReport> {
    let mut report = VerifyReport {
        status: Status::Ok,
        save_id: None,
        files: 0,
        tensors: 0,
        bytes: 0,
        problems: Vec::new(),
        parents: Vec::new(),
    };
    let manifest = match load_manifest(storage) {
        Ok((_, m)) => m,
        Err(Error::Incomplete { .. }) => {
            report.status = Status::Incomplete;
            report.problems.push(Problem {
                file: INDEX_FILE.into(),
                tensor: None,
                detail: describe_incomplete(storage)?,
            });
            return Ok(report);
        }
        Err(e) if e.is_about_the_checkpoint() => {
            report.status = Status::Corrupt;
            report.problems.push(problem(&e, INDEX_FILE));
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    report.save_id = Some(manifest.save_id.clone());
    // The changed-row numbers of patches, checked as a read checks them, by tensor name.
    let patch_rows: HashMap<&str, (&str, &RowPatchManifest)> = manifest
        .row_tables
        .iter()
        .flat_map(|t| {
            t.slots.iter().flat_map(move |s| {
                s.patches.iter().filter_map(move |p| {
                    let c = p.changed.as_ref()?;
                    Some((c.rows.name.as_str(), (t.name.as_str(), p)))
                })
            })
        })
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(parallel.max(1))
        .build()
        .map_err(|e| Error::InvalidOption {
            option: "parallel",
            why: e.to_string(),
        })?;
    let per_file: Vec<Result<(usize, u64, Vec<Problem>)>> = pool.install(|| {
        manifest
            .files
            .par_iter()
            .map(|fm| {
                let f = match open_file(storage, &manifest, fm) {
                    Ok(f) => f,
                    Err(e) if e.is_about_the_checkpoint() => {
                        return Ok((0, 0, vec![problem(&e, &fm.name)]))
                    }
                    Err(e) => return Err(e),
                };
                let refs: Vec<&TensorRef> = manifest
                    .tensor_refs()
                    .filter(|t| t.file == fm.name)
                    .collect();
                let mut problems = Vec::new();
                let mut bytes = 0;
                let mut buf = vec![0u8; 8 << 20];
                for t in &refs {
                    let mut crcs = TensorCrcs::new(t);
                    let changed = patch_rows.get(t.name.as_str());
                    let mut order = changed.map(|(_, p)| ChangedRowsOrder::of(p));
                    let mut off = 0;
                    let mut failed = false;
                    // A compressed tensor is read a whole number of frames at a time.
                    let step = match &t.codec {
                        Some(_) => {
                            let frame = t.frame_bytes();
                            (buf.len() as u64 / frame).max(1) * frame
                        }
                        None => buf.len() as u64,
                    };
                    if buf.len() < step as usize {
                        buf.resize(step as usize, 0);
                    }
                    while off < t.len {
                        let n = (t.len - off).min(step) as usize;
                        let read = match &t.codec {
                            None => f.handle.read_at(t.offset + off, &mut buf[..n]),
                            Some(_) => {
                                let mut fr = FrameRead::plan(t, off, n as u64);
                                f.handle
                                    .read_at(fr.file_offset, &mut fr.stored)
                                    .and_then(|()| fr.decode(t, off, &mut buf[..n]))
                            }
                        };
                        if let Err(e) = read {
                            if !e.is_about_the_checkpoint() {
                                return Err(e);
                            }
                            problems.push(Problem {
                                tensor: Some(t.name.clone()),
                                ..problem(&e, &fm.name)
                            });
                            failed = true;
                            break;
                        }
                        crcs.update(&buf[..n]);
                        if let Some(o) = &mut order {
                            o.feed(&buf[..n]);
                        }
                        off += n as u64;
                    }
                    bytes += off;
                    if failed {
                        continue;
                    }
                    let (whole, bad_block) = crcs.finish();
                    let detail = if whole != t.crc32 {
                        format!("tensor {:?} fails its CRC32 check (bytes changed)", t.name)
                    } else if let Some(k) = bad_block {
                        // The bytes match the tensor's CRC32: the manifest's block list is wrong,
                        // and partial reads would refuse what whole reads accept.
                        format!(
                            "tensor {:?} fails the CRC32 of its block {k} (the manifest's block \
                             checksums disagree with its bytes)",
                            t.name
                        )
                    } else if let Some(Err(e)) = changed
                        .zip(order.as_ref())
                        .map(|((table, _), o)| o.check(table, t))
                    {
                        e.to_string()
                    } else {
                        continue;
                    };
                    problems.push(Problem {
                        file: fm.name.clone(),
                        tensor: Some(t.name.clone()),
                        detail,
                    });
                }
                Ok((refs.len(), bytes, problems))
            })
            .collect()
    });
    report.files = manifest.files.len();
    for checked in per_file {
        let (tensors, bytes, problems) = checked?;
        report.tensors += tensors;
        report.bytes += bytes;
        report.problems.extend(problems);
    }
    if !report.problems.is_empty() {
        report.status = Status::Corrupt;
    }
    Ok(report)
}

/// The CRC32 of a tensor read front to back, and of each of its checksummed blocks.
struct TensorCrcs<'t> {
    t: &'t TensorRef,
    whole: crc32fast::Hasher,
    block: crc32fast::Hasher,
    /// Bytes fed so far.
    at: u64,
    /// The first block whose CRC32 differs from the manifest's.
    bad_block: Option<u64>,
}

impl<'t> TensorCrcs<'t> {
    fn new(t: &'t TensorRef) -> Self {
        Self {
            t,
            whole: crc32fast::Hasher::new(),
            block: crc32fast::Hasher::new(),
            at: 0,
            bad_block: None,
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        let Some(blocks) = &self.t.blocks else {
            self.whole.update(bytes);
            self.at += bytes.len() as u64;
            return;
        };
        let size = blocks.bytes.max(1);
        while !bytes.is_empty() {
            let n = ((size - self.at % size) as usize).min(bytes.len());
            self.block.update(&bytes[..n]);
            self.at += n as u64;
            bytes = &bytes[n..];
            if self.at.is_multiple_of(size) || self.at == self.t.len {
                let block = std::mem::take(&mut self.block);
                self.whole.combine(&block);
                let k = (self.at - 1) / size;
                if self.bad_block.is_none()
                    && blocks.crc32.get(k as usize) != Some(&block.finalize())
                {
                    self.bad_block = Some(k);
                }
            }
        }
    }

    /// The tensor's CRC32, and the first block that failed its check.
    fn finish(self) -> (u32, Option<u64>) {
        (self.whole.finalize(), self.bad_block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use saver_core::manifest::BlockCrcs;
    use saver_core::Dtype;

    /// Bytes fed in reads of any size give the tensor's CRC32 and find the block whose CRC32 the
    /// manifest has wrong, even when the whole tensor's matches.
    #[test]
    fn a_wrong_block_crc_is_found_whatever_the_read_size() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut blocks: Vec<u32> = data.chunks(64).map(crc32fast::hash).collect();
        blocks[9] ^= 1;
        let t = TensorRef {
            file: "f".into(),
            name: "t".into(),
            dtype: Dtype::U8,
            shape: vec![1000],
            offset: 0,
            len: 1000,
            crc32: crc32fast::hash(&data),
            blocks: Some(BlockCrcs {
                bytes: 64,
                crc32: blocks,
            }),
            codec: None,
        };
        for read in [1, 63, 64, 65, 300, 1000] {
            let mut c = TensorCrcs::new(&t);
            data.chunks(read).for_each(|b| c.update(b));
            assert_eq!(c.finish(), (t.crc32, Some(9)), "reads of {read}");
        }
    }
}

//! Verifying a checkpoint: structure, then every tensor's CRC32; reports every problem found.

use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use saver_core::manifest::TensorRef;
use saver_core::naming::INDEX_FILE;

use crate::error::{Error, Result};
use crate::reader::{describe_incomplete, load_manifest, open_file};
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
    let chain = match crate::chain::Chain::open(dir) {
        Ok(c) => c,
        Err(e) if e.is_about_the_checkpoint() => {
            report.status = Status::Corrupt;
            report.problems.push(problem(&e, INDEX_FILE));
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
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
    crate::reader::retry_if_replaced(
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
                    let mut h = crc32fast::Hasher::new();
                    let mut off = 0;
                    let mut failed = false;
                    while off < t.len {
                        let n = (t.len - off).min(buf.len() as u64) as usize;
                        if let Err(e) = f.handle.read_at(t.offset + off, &mut buf[..n]) {
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
                        h.update(&buf[..n]);
                        off += n as u64;
                    }
                    bytes += off;
                    if !failed && h.finalize() != t.crc32 {
                        problems.push(Problem {
                            file: fm.name.clone(),
                            tensor: Some(t.name.clone()),
                            detail: format!(
                                "tensor {:?} fails its CRC32 check (bytes changed)",
                                t.name
                            ),
                        });
                    }
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

//! The error type of saver-io. Every message names the file, tensor, table or shard concerned.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

/// Errors of writing, committing, reading, verifying and restoring checkpoints.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A planning or data-model error.
    #[error(transparent)]
    Core(saver_core::Error),
    /// An operating-system I/O error on a file.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("write", "fsync", "rename", …).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The directory holds a committed checkpoint and overwriting was not asked for.
    #[error(
        "{dir} already holds a committed checkpoint (save id {save_id}); to replace it, pass \
         --overwrite (SaveOptions::overwrite in the library)"
    )]
    Exists {
        /// The directory.
        dir: PathBuf,
        /// The committed save id.
        save_id: String,
    },
    /// The checkpoint was never committed (no index), or shards are missing.
    #[error("{dir} is not a complete checkpoint: {what}")]
    Incomplete {
        /// The directory.
        dir: PathBuf,
        /// What is missing.
        what: String,
    },
    /// Waiting for the other shards of a multi-process save timed out.
    #[error("timed out after {waited:?} waiting for save {save_id} to be committed; missing shards: {missing:?}")]
    Timeout {
        /// The save.
        save_id: String,
        /// Shards whose manifests never appeared.
        missing: Vec<u32>,
        /// How long it waited.
        waited: Duration,
    },
    /// The save can never commit: two writers claimed one shard, its shards disagree, or
    /// another save committed into the directory while it was being written.
    #[error("save {save_id} will not be committed in {dir}: {why}")]
    Rejected {
        /// The directory.
        dir: PathBuf,
        /// The rejected save.
        save_id: String,
        /// Why, naming the shards, writers, tensors or the save that won.
        why: String,
    },
    /// Another process held the directory's commit lock for longer than the wait allowed.
    #[error(
        "timed out after {waited:?} waiting for the commit lock {lock} (another process is \
         committing into that directory; a process that dies releases it at once)"
    )]
    LockTimeout {
        /// The lock file.
        lock: PathBuf,
        /// How long it waited.
        waited: Duration,
    },
    /// A commit lock whose lease ran out under its holder (paused, or cut off from the store)
    /// and that another process may have taken since: the holder writes nothing more under it.
    #[error("the commit lock {lock} is no longer this process's: {why}")]
    LockLost {
        /// The lock object.
        lock: PathBuf,
        /// What shows it (the process that took it over, when known).
        why: String,
    },
    /// A committed file's bytes or structure are wrong.
    #[error("corrupt checkpoint file {file}: {what}")]
    Corrupt {
        /// The file, relative to the checkpoint directory.
        file: String,
        /// What is wrong (names the tensor where one is concerned).
        what: String,
    },
    /// A name in an index or manifest points outside the checkpoint directory.
    #[error("refusing file name {name:?} (named in {named_in}): {why}")]
    UnsafePath {
        /// The name.
        name: String,
        /// Where the name came from (an index, a manifest, a storage call).
        named_in: String,
        /// Why.
        why: &'static str,
    },
    /// The checkpoint was written by a format version this build does not read.
    #[error(
        "{file}: format version {found} is not supported (this build reads versions 1 to {supported})"
    )]
    UnsupportedVersion {
        /// The file declaring it.
        file: String,
        /// The version found.
        found: String,
        /// The newest version this build reads.
        supported: u32,
    },
    /// What the caller asked to load does not fit the checkpoint or the target.
    #[error("{0}")]
    Mismatch(String),
    /// A reader was overtaken by overwrites: the checkpoint it was reading was replaced (and its
    /// files removed) again and again. Not a verdict on any checkpoint: read again.
    #[error(
        "{location} was replaced {times} times while it was read, each time before the read \
         ended: read it again once saves into it pause"
    )]
    KeptReplaced {
        /// The checkpoint's location.
        location: String,
        /// How many times the reader started over.
        times: usize,
    },
    /// A link of a chain of delta checkpoints is missing, replaced, or does not fit its child.
    #[error("checkpoint {link}: {message}")]
    Chain {
        /// The link whose parent is at fault (its directory).
        link: String,
        /// What is wrong.
        message: String,
    },
    /// The policy file a managed root keeps cannot be used: an unknown field, a value out of
    /// range, or not JSON.
    #[error(
        "{file}: not a usable saver policy: {why}; correct the file, or remove it to go back to \
         the default policy"
    )]
    BadPolicy {
        /// The policy file.
        file: String,
        /// What is wrong, naming the field.
        why: String,
    },
    /// An option's value is unusable.
    #[error("invalid option {option}: {why}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// Why.
        why: String,
    },
}

impl Error {
    /// Whether the error is an I/O error for a file that does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }

    /// Whether the error says something about a checkpoint's bytes (missing, truncated, changed,
    /// malformed), as opposed to the reader's situation (permission denied, I/O error, options):
    /// only the former make a checkpoint corrupt.
    pub fn is_about_the_checkpoint(&self) -> bool {
        match self {
            Error::Io { .. } => self.is_not_found(),
            Error::Corrupt { .. }
            | Error::UnsafePath { .. }
            | Error::UnsupportedVersion { .. }
            | Error::Chain { .. }
            | Error::Core(_) => true,
            _ => false,
        }
    }
}

impl From<saver_core::Error> for Error {
    /// A saver-io error that went through one of saver-core's traits (as
    /// [`saver_core::Error::External`]) comes back as it was.
    fn from(e: saver_core::Error) -> Self {
        match e {
            saver_core::Error::External(inner) => match inner.downcast::<Error>() {
                Ok(e) => *e,
                Err(inner) => Error::Core(saver_core::Error::External(inner)),
            },
            // The documents are parsed in saver-core; their faults are the checkpoint's, reported
            // as every other corrupt file is.
            saver_core::Error::Corrupt { file, what } => Error::Corrupt { file, what },
            saver_core::Error::UnsafePath {
                name,
                named_in,
                why,
            } => Error::UnsafePath {
                name,
                named_in,
                why,
            },
            saver_core::Error::UnsupportedVersion {
                file,
                found,
                supported,
            } => Error::UnsupportedVersion {
                file,
                found,
                supported,
            },
            e => Error::Core(e),
        }
    }
}

impl From<Error> for saver_core::Error {
    /// A saver-io error raised inside one of saver-core's traits (a table read from files),
    /// carried unchanged.
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            e => saver_core::Error::External(Box::new(e)),
        }
    }
}

/// Result with [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches the operation and path to an `io::Error`.
pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_errors_about_the_bytes_make_a_checkpoint_corrupt() {
        let io = |kind| Error::Io {
            op: "open",
            path: "model-x-s00000-f0000.safetensors".into(),
            source: std::io::Error::from(kind),
        };
        assert!(io(std::io::ErrorKind::NotFound).is_about_the_checkpoint());
        assert!(!io(std::io::ErrorKind::PermissionDenied).is_about_the_checkpoint());
        assert!(!io(std::io::ErrorKind::Interrupted).is_about_the_checkpoint());
        let corrupt = Error::Corrupt {
            file: "f".into(),
            what: "truncated".into(),
        };
        assert!(corrupt.is_about_the_checkpoint());
        let busy = Error::LockTimeout {
            lock: "l".into(),
            waited: std::time::Duration::ZERO,
        };
        assert!(!busy.is_about_the_checkpoint());
    }
}

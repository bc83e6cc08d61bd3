//! The rejection marker `saver-X.rejected`: a save that can never commit (two writers of one
//! shard, shards that do not make one save, a rule that refused it), with the first reason
//! recorded. Written under the commit lock, read by every later step of that save.

use saver_core::naming::rejected_name;

use crate::error::{Error, Result};
use crate::load::documents::committed;
use crate::storage::Storage;

/// Largest rejection marker read.
const MAX_MARKER_BYTES: u64 = 64 << 10;

/// Whether `save_id` is the committed save of `storage`.
pub(crate) fn is_committed(storage: &dyn Storage, save_id: &str) -> Result<bool> {
    Ok(committed(storage)?.is_some_and(|c| c.save_id == save_id))
}

/// The error of a rejected save.
fn rejected(storage: &dyn Storage, save_id: &str, why: String) -> Error {
    Error::Rejected {
        dir: storage.location().into(),
        save_id: save_id.to_string(),
        why,
    }
}

/// Fails if `save_id` was marked rejected, with the reason recorded.
pub(crate) fn check_not_rejected(storage: &dyn Storage, save_id: &str) -> Result<()> {
    let name = rejected_name(save_id);
    if !storage.exists(&name)? {
        return Ok(());
    }
    let why = storage.get(&name, MAX_MARKER_BYTES)?;
    Err(rejected(
        storage,
        save_id,
        String::from_utf8_lossy(&why).into_owned(),
    ))
}

/// Marks `save_id` rejected for `why` (the first reason recorded stays), unless it is committed.
/// Call with the commit lock held, so a commit cannot slip in between the check and the mark.
pub(crate) fn mark_rejected(storage: &dyn Storage, save_id: &str, why: &str) -> Result<Error> {
    if is_committed(storage, save_id)? {
        return Ok(rejected(
            storage,
            save_id,
            format!("it is already committed; {why}"),
        ));
    }
    storage.create_exclusive(&rejected_name(save_id), why.as_bytes())?;
    Ok(match check_not_rejected(storage, save_id) {
        Err(e) => e,
        Ok(()) => rejected(storage, save_id, why.to_string()),
    })
}

//! The order of a root's steps, kept at the commit: a managed save commits only while its step is
//! at least the newest whole step of the root (equal only when it replaces that step, which the
//! step directory's own compare-and-swap then guards), and a delta only while its parent step still
//! holds the save it was made from.
//!
//! The manager checks the same when a save starts, to refuse early; but a save takes a while, and
//! another process may commit a later step, or replace or remove the parent, meanwhile. So the
//! rule is checked again under the root's commit lock, which every managed commit and every
//! prune's removal of an index take before anything else: a replacement of step 30 and a delta of
//! it saved as step 40 commit one after the other, and the second fails naming the first.

use saver_core::Manifest;

use crate::error::Result;
use crate::load::documents::committed;
use crate::manage::root::{parent_step, Root};
use crate::save::commit::CommitRule;
use crate::storage::CommitLock;
use crate::storage::COMMIT_LOCK_WAIT;

/// The rule of the save of `step` into `root`.
pub(crate) struct StepOrder {
    pub root: Root,
    pub step: u64,
}

impl CommitRule for StepOrder {
    fn lock(&self) -> Result<Box<dyn CommitLock>> {
        self.root.storage().lock_commit(COMMIT_LOCK_WAIT)
    }

    fn refusal(&self, manifest: &Manifest) -> Result<Option<String>> {
        let step = self.step;
        if let Some(newest) = self.root.latest()? {
            if newest.step > step {
                return Ok(Some(format!(
                    "step {} (save {}) was committed while step {step} was being saved: a root's \
                     steps only grow, and only the newest step may be replaced",
                    newest.step, newest.save_id
                )));
            }
        }
        let Some(parent) = &manifest.parent else {
            return Ok(None);
        };
        let Some(ps) = parent_step(parent) else {
            return Ok(Some(format!(
                "its parent {} is not a step of this root",
                parent.path
            )));
        };
        let now = committed(&*self.root.step_storage(ps)?)?;
        if now.as_ref().is_some_and(|c| parent.names(c)) {
            return Ok(None);
        }
        Ok(Some(format!(
            "its parent step {ps} now holds {}, not save {} that this delta of step {step} was \
             made from: step {ps} was replaced or removed meanwhile; save step {step} again",
            now.map_or("no committed checkpoint".into(), |c| format!(
                "save {}",
                c.save_id
            )),
            parent.save_id
        )))
    }
}

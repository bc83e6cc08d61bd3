//! Saving while training: [`save_async`] starts a save on a thread of its own and returns to the
//! trainer as soon as the save's moment is fixed.
//!
//! The save is point-in-time for tables that support it
//! ([`SparseTable::point_in_time`](saver_core::SparseTable::point_in_time), which
//! [`saver_core::EmbeddingTable`] does): every saved row is its value at the moment, however the
//! trainer writes to the tables meanwhile. Dense tensors are copied before the call returns, so the
//! trainer may change its own buffers at once. The trainer state in [`SaveOptions`] is the one the
//! trainer passed: taken with the call, it belongs to the moment too.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use saver_core::table::moment::MomentHook;
use saver_core::SaveInput;

use crate::error::{Error, Result};
use crate::save::options::{Progress, SaveOptions};
use crate::save::report::SaveReport;
use crate::save::save_on_this_thread;
use crate::save::storage_for_save;

/// A save running in the background, started by [`save_async`].
///
/// Dropping the handle waits for the save to end (committed or failed): a save is never left
/// half-done by its handle, and nothing uncommitted ever looks like a checkpoint.
pub struct SaveHandle {
    thread: Option<JoinHandle<Result<SaveReport>>>,
    written: Arc<AtomicU64>,
}

impl std::fmt::Debug for SaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveHandle")
            .field("finished", &self.is_finished())
            .field("bytes_written", &self.bytes_written())
            .finish()
    }
}

impl SaveHandle {
    /// Waits for the save and returns its report, or the error that ended it.
    pub fn wait(mut self) -> Result<SaveReport> {
        join(self.thread.take().expect("taken only here or in drop"))
    }

    /// Whether the save has ended (then [`Self::wait`] returns at once).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Bytes of data files written so far.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

impl Drop for SaveHandle {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = join(t);
        }
    }
}

/// Lowers the calling thread's CPU priority (nice +10), and so that of every thread it starts:
/// where cores are scarce the trainer's threads run first, and the save takes the time they leave.
fn lower_priority() {
    // SAFETY: gettid and setpriority on the calling thread have no memory effects; failure (no
    // permission to change it) leaves the priority as it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (now + 10).min(19));
    }
}

fn join(t: JoinHandle<Result<SaveReport>>) -> Result<SaveReport> {
    t.join().unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        Err(Error::Mismatch(format!(
            "the background save panicked: {what}"
        )))
    })
}

/// Starts saving `input` into directory `dir` on a thread of its own, and returns once the save's
/// moment is fixed: every table's point-in-time snapshot taken (no row is copied for that), and
/// the dense tensors copied. From then on the trainer may write to the tables and its dense
/// buffers; the save shows them as they were at the call. Errors found before the moment (bad
/// options, names) are returned here; later ones by [`SaveHandle::wait`].
///
/// `input` is the input of [`save`](fn@crate::save): its tables must be shared (`Arc`), since the
/// save outlives the call; tables of in-process workers ([`SaveInput::shard_table`]) are saved
/// by this one call, every shard at one moment, one commit.
///
/// A table can be in one save at a time: a save started while another save of the same table
/// is under way fails with an error naming the table, since it could only show the rows as they
/// were at the other save's moment, under its own step (tables held together by
/// [`moment::hold`](saver_core::table::moment::hold) are the exception: their saves share the
/// held moment). Check [`SaveHandle::is_finished`], or wait for the handle, before starting the
/// next.
pub fn save_async(
    dir: impl Into<PathBuf>,
    input: SaveInput<'_>,
    mut opts: SaveOptions,
) -> Result<SaveHandle> {
    let dir = dir.into();
    let input = input.into_owned()?;
    let written = Arc::new(AtomicU64::new(0));
    let user_progress = opts.progress.take();
    let counter = Arc::clone(&written);
    opts.progress = Some(Arc::new(move |p: Progress| {
        counter.fetch_add(p.bytes, Ordering::Relaxed);
        if let Some(user) = &user_progress {
            user(p);
        }
    }));
    let (moment_tx, moment_rx) = mpsc::sync_channel::<()>(1);
    let user_hook = opts.plan.on_moment.take();
    opts.plan.on_moment = Some(MomentHook(Arc::new(move || {
        if let Some(h) = &user_hook {
            (h.0)();
        }
        let _ = moment_tx.try_send(());
    })));
    // As many threads as the save has writers, and no more: a trainer shares the machine with
    // them, and each thread the save runs beyond the cores the trainer leaves free takes its
    // turns on a trainer's core.
    let threads = opts.plan.parallel.max(1);
    let thread = std::thread::Builder::new()
        .name("saver-background".into())
        .spawn(move || {
            lower_priority();
            // The save's scans run on a pool of this save's own, made by this thread so that its
            // threads share the lower priority (a thread inherits it from the thread that makes
            // it). Never one pool for several saves: a save that waits on a pool's thread runs
            // the pool's other jobs meanwhile, and another save's job that waits for this one's
            // commit would then block underneath it.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("saver-background-{i}"))
                .build();
            let made = !dir.exists();
            let save = || {
                let storage = storage_for_save(&dir, &opts)?;
                save_on_this_thread(&*storage, input, &opts)
            };
            let report = match pool {
                Ok(pool) => pool.install(save),
                Err(_) => save(),
            };
            // A save that failed into a directory it made leaves no empty directory.
            if report.is_err() && made {
                crate::storage::remove_dir_if_empty(&dir);
            }
            // The hook (and with it the sender) goes with the options: a save that failed
            // before its moment wakes the caller with a closed channel.
            drop(opts);
            report
        })
        .map_err(|e| Error::Io {
            op: "start the background save thread",
            path: PathBuf::new(),
            source: e,
        })?;
    let handle = SaveHandle {
        thread: Some(thread),
        written,
    };
    match moment_rx.recv() {
        Ok(()) => Ok(handle),
        // The save ended before its moment: report why now.
        Err(mpsc::RecvError) => handle.wait().and_then(|r| {
            Err(Error::Mismatch(format!(
                "internal: save {} ended without fixing its moment",
                r.save_id
            )))
        }),
    }
}

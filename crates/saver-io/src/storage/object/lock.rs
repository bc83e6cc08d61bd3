//! The commit lock of a prefix of an object store, one of two kinds by what the store honours.
//!
//! * **A lease object** where the store honours conditional creation (`If-None-Match: *`):
//!   `.saver-commit.lock`, created conditionally and holding its expiry (the storage's lease,
//!   [`LEASE`](super::LEASE) by default); one left by
//!   a holder that died is taken over once expired, by a conditional update of the version read
//!   (`If-Match`), so two processes never take it together. The holder renews it, and releases
//!   it, by conditional updates of the version it wrote: a holder that lost it can neither.
//! * **Flags** where it does not (Garage 2.5 accepts the header and overwrites anyway): each taker
//!   puts a flag of its own, `.saver-commit.lock.<token>`, then lists the prefix; it holds the lock
//!   if no other live flag is there, and otherwise removes its flag, waits a random while and tries
//!   again. This needs only what every S3-compatible store gives, read-after-write consistency of
//!   PUT, DELETE and LIST: of two takers whose flags overlap in time, the one that listed last put
//!   its flag after the other's listing, so it lists after the other's put and sees that flag. So
//!   at most one holds the lock; both may back off, and their random waits part them. A flag
//!   expires as a lease does, so a holder that died never blocks the next. A taker that finds an
//!   expired flag first puts `<flag>.lapsed` (who took over, and when), then removes the flag.
//!
//! **Fencing.** A lease can run out under a holder that is alive: paused (SIGSTOP, a VM frozen),
//! or cut off from the store for longer than the lease. While it holds the lock, a background
//! thread renews the lease every third of it; and [`CommitLock::check_held`] tells the holder,
//! at its commit point and again right after it, whether another process took the lock since:
//! the lease object holds another version, or the flag was marked lapsed or removed. What the
//! holder does then is the commit's business (`save::commit`): it writes nothing more, and puts
//! back what it wrote after it lost the lock.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{PutMode, UpdateVersion};
use saver_core::naming::{is_commit_lock, COMMIT_LOCK};

use super::ObjectStorage;
use crate::error::{Error, Result};
use crate::storage::CommitLock;

/// The end of the name of the marker a taker puts beside a flag whose lease ran out.
const LAPSED: &str = ".lapsed";

/// Takes the commit lock of `storage`'s prefix, waiting up to `wait` for its holder.
pub(super) fn take(storage: &ObjectStorage, wait: Duration) -> Result<Box<dyn CommitLock>> {
    let held = if storage.honours_conditional_create()? {
        take_lease(storage, wait)?
    } else {
        take_flag(storage, wait)?
    };
    Ok(Box::new(Renewed::start(held)))
}

fn take_lease(storage: &ObjectStorage, wait: Duration) -> Result<Held> {
    let key = storage.key(COMMIT_LOCK)?;
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let lease = Lease::new(storage.lease);
        if let Some(version) = storage.put_conditional(&key, lease.to_bytes(), PutMode::Create)? {
            return Ok(Held::new(storage, key, Kind::Lease(version), lease));
        }
        // Held, or left by a holder that died or released it: take it over once its lease has
        // run out, only if nobody else did first (a conditional update of the version read).
        if let Some((bytes, version)) = storage.get_versioned(&key, 4096)? {
            if Lease::parse(&bytes).is_none_or(|l| l.expired()) {
                let mode = PutMode::Update(version);
                if let Some(mine) = storage.put_conditional(&key, lease.to_bytes(), mode)? {
                    return Ok(Held::new(storage, key, Kind::Lease(mine), lease));
                }
            }
        }
        if start.elapsed() >= wait {
            return Err(timeout(storage, &key, start));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

fn take_flag(storage: &ObjectStorage, wait: Duration) -> Result<Held> {
    static TAKES: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "{COMMIT_LOCK}.{}-{}-{}",
        std::process::id(),
        crate::storage::identity::process_token(),
        TAKES.fetch_add(1, Ordering::Relaxed)
    );
    let key = storage.key(&name)?;
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let lease = Lease::new(storage.lease);
        storage.put_bytes(&key, lease.to_bytes())?;
        let held = Held::new(storage, key.clone(), Kind::Flag, lease);
        if !another_live_flag(storage, &name)? {
            return Ok(held);
        }
        // Removes the flag before the wait, so that the other taker can see it gone.
        held.release();
        if start.elapsed() >= wait {
            return Err(timeout(storage, &key, start));
        }
        // Random, so that two takers that saw each other do not meet again in step.
        let ms = pause.as_millis() as u64;
        let jitter = crate::storage::identity::random_u64() % ms.max(1);
        std::thread::sleep(Duration::from_millis(ms / 2 + jitter));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Whether a flag of another taker is in the prefix and has not expired. An expired one is
/// marked lapsed, then removed: its holder, if it is alive, learns from the mark that the lock
/// is no longer its own.
fn another_live_flag(storage: &ObjectStorage, mine: &str) -> Result<bool> {
    let objects = storage.list_level()?.objects;
    let names: Vec<&str> = objects
        .iter()
        .filter_map(|o| o.location.filename())
        .collect();
    for object in &objects {
        let Some(name) = object.location.filename() else {
            continue;
        };
        if let Some(flag) = name.strip_suffix(LAPSED) {
            // A mark whose flag is gone, left by a holder that never came back: removed once
            // it is old enough that no paused holder can still be waiting to read it.
            let old = SystemTime::from(object.last_modified)
                .elapsed()
                .is_ok_and(|age| age > storage.lease * 100);
            if old && !names.contains(&flag) {
                let _ = storage.delete(&object.location);
            }
            continue;
        }
        if name == mine || name == COMMIT_LOCK || !is_commit_lock(name) {
            continue;
        }
        // Gone since the listing (released): not live.
        let Some((bytes, _)) = storage.get_versioned(&object.location, 4096)? else {
            continue;
        };
        if Lease::parse(&bytes).is_none_or(|l| !l.expired()) {
            return Ok(true);
        }
        // Expired, and so taken over: its holder is told before the flag goes, so that a holder
        // that was only paused never takes the lock for still its own.
        let mark = storage.key(&format!("{name}{LAPSED}"))?;
        storage.put_bytes(&mark, Lease::new(storage.lease).to_bytes())?;
        storage.delete(&object.location)?;
    }
    Ok(false)
}

fn timeout(storage: &ObjectStorage, key: &ObjectPath, start: Instant) -> Error {
    Error::LockTimeout {
        lock: PathBuf::from(storage.client.url(key)),
        waited: start.elapsed(),
    }
}

/// What a lock object holds: who holds it, and when the lease runs out.
struct Lease {
    expires_unix_ms: u64,
}

impl Lease {
    fn now_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64
    }

    fn new(lease: Duration) -> Self {
        Self {
            expires_unix_ms: Self::now_ms() + lease.as_millis() as u64,
        }
    }

    /// A lease that has already run out: what a holder leaves when it releases the lease
    /// object, so that the next taker takes it over at once.
    fn released() -> Self {
        Self { expires_unix_ms: 0 }
    }

    fn to_bytes(&self) -> Bytes {
        Bytes::from(format!(
            "{{\"holder\":\"{}\",\"expires_unix_ms\":{}}}",
            this_process(),
            self.expires_unix_ms
        ))
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        Some(Self {
            expires_unix_ms: v.get("expires_unix_ms")?.as_u64()?,
        })
    }

    /// The process a lock object names, for messages.
    fn holder(bytes: &[u8]) -> String {
        serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|v| v.get("holder")?.as_str().map(str::to_string))
            .unwrap_or_else(|| "an unknown process".into())
    }

    fn expired(&self) -> bool {
        Self::now_ms() > self.expires_unix_ms
    }
}

/// `host:pid` of this process, as lock objects name their holder.
fn this_process() -> String {
    format!(
        "{}:{}",
        crate::storage::identity::host_name().replace(['"', '\\'], "_"),
        std::process::id()
    )
}

/// Which kind of lock object is held.
enum Kind {
    /// The lease object, at the version this holder wrote last.
    Lease(UpdateVersion),
    /// A flag of this holder's own.
    Flag,
}

/// A held lock object (the lease or a flag).
struct Held {
    storage: ObjectStorage,
    key: ObjectPath,
    kind: Mutex<Kind>,
    /// How long each lease it writes runs.
    lease: Duration,
    /// When the lease this holder wrote last runs out.
    expires_unix_ms: AtomicU64,
}

impl Held {
    fn new(storage: &ObjectStorage, key: ObjectPath, kind: Kind, lease: Lease) -> Self {
        Self {
            storage: storage.clone(),
            key,
            kind: Mutex::new(kind),
            lease: storage.lease,
            expires_unix_ms: AtomicU64::new(lease.expires_unix_ms),
        }
    }

    fn url(&self) -> String {
        self.storage.client.url(&self.key)
    }

    fn lapsed_mark(&self) -> ObjectPath {
        ObjectPath::from(format!("{}{LAPSED}", self.key))
    }

    fn lost(&self, why: String) -> Error {
        Error::LockLost {
            lock: PathBuf::from(self.url()),
            why,
        }
    }

    /// Fails if another process may have taken the lock since this one took it.
    fn check(&self) -> Result<()> {
        let kind = self.kind.lock().unwrap_or_else(PoisonError::into_inner);
        match &*kind {
            Kind::Lease(mine) => match self.storage.get_versioned(&self.key, 4096)? {
                Some((_, now)) if same_version(&now, mine) => Ok(()),
                Some((bytes, _)) => Err(self.lost(format!(
                    "its lease ran out and {} took it",
                    Lease::holder(&bytes)
                ))),
                None => Err(self.lost("the lease object was removed".into())),
            },
            Kind::Flag => {
                if let Some((bytes, _)) = self.storage.get_versioned(&self.lapsed_mark(), 4096)? {
                    return Err(self.lost(format!(
                        "its lease ran out and {} took it",
                        Lease::holder(&bytes)
                    )));
                }
                if self.storage.get_versioned(&self.key, 4096)?.is_none() {
                    return Err(self.lost("its flag was removed".into()));
                }
                Ok(())
            }
        }
    }

    /// Writes a new lease, only while the lock is still this holder's.
    fn renew(&self) -> Result<()> {
        let lease = Lease::new(self.lease);
        let expires = lease.expires_unix_ms;
        let mut kind = self.kind.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut *kind {
            Kind::Lease(mine) => {
                let mode = PutMode::Update(mine.clone());
                match self
                    .storage
                    .put_conditional(&self.key, lease.to_bytes(), mode)?
                {
                    Some(version) => *mine = version,
                    None => return Err(self.lost("its lease ran out and another took it".into())),
                }
            }
            Kind::Flag => {
                drop(kind);
                self.check()?;
                self.storage.put_bytes(&self.key, lease.to_bytes())?;
            }
        }
        self.expires_unix_ms.store(expires, Ordering::Relaxed);
        Ok(())
    }

    /// How long the lease this holder wrote last still runs.
    fn remaining(&self) -> Duration {
        let expires = self.expires_unix_ms.load(Ordering::Relaxed);
        Duration::from_millis(expires.saturating_sub(Lease::now_ms()))
    }

    /// Gives the lock up: the flag and any mark beside it removed; the lease object removed
    /// while it is still this holder's with time left on it (nobody can take it over before it
    /// runs out, so the removal cannot hit another's), else left expired by a conditional update
    /// of this holder's version (a holder that lost it never releases another's).
    fn release(&self) {
        let kind = self.kind.lock().unwrap_or_else(PoisonError::into_inner);
        match &*kind {
            Kind::Lease(mine) => {
                let ours = matches!(
                    self.storage.get_versioned(&self.key, 4096),
                    Ok(Some((_, now))) if same_version(&now, mine)
                );
                if ours && self.remaining() > self.lease / 2 {
                    let _ = self.storage.delete(&self.key);
                    return;
                }
                let mode = PutMode::Update(mine.clone());
                let _ = self
                    .storage
                    .put_conditional(&self.key, Lease::released().to_bytes(), mode);
            }
            Kind::Flag => {
                let _ = self.storage.delete(&self.key);
                let _ = self.storage.delete(&self.lapsed_mark());
            }
        }
    }
}

fn same_version(a: &UpdateVersion, b: &UpdateVersion) -> bool {
    a.e_tag == b.e_tag && a.version == b.version
}

/// A held lock with the thread that renews its lease; dropping it stops the thread and releases
/// the lock.
struct Renewed {
    held: Arc<Held>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    renewer: Option<JoinHandle<()>>,
}

impl Renewed {
    fn start(held: Held) -> Self {
        let held = Arc::new(held);
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let (h, s) = (held.clone(), stop.clone());
        let renewer = std::thread::Builder::new()
            .name("saver-lease".into())
            .spawn(move || {
                let (stopped, wake) = &*s;
                let mut stopped = stopped.lock().unwrap_or_else(PoisonError::into_inner);
                let mut due = Instant::now() + h.lease / 3;
                // Told to stop before it first waited, or while it waits: it ends at once.
                while !*stopped {
                    let left = due.saturating_duration_since(Instant::now());
                    if !left.is_zero() {
                        stopped = wake
                            .wait_timeout(stopped, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        continue;
                    }
                    // A holder that lost the lock stops renewing it; its commit learns of the
                    // loss from `check_held`.
                    if h.renew().is_err() {
                        return;
                    }
                    due = Instant::now() + h.lease / 3;
                }
            })
            .ok();
        Self {
            held,
            stop,
            renewer,
        }
    }
}

impl CommitLock for Renewed {
    fn check_held(&self) -> Result<Duration> {
        self.held.check()?;
        // Little of the lease left (the renewer was held up): renewed here, so that the steps
        // after the check have a good part of a lease before another may take the lock.
        if self.held.remaining() < self.held.lease / 2 {
            self.held.renew()?;
        }
        // A quarter of the lease kept back for the clocks of the takers, which judge the
        // expiry this process wrote by their own.
        Ok(self.held.remaining().saturating_sub(self.held.lease / 4))
    }
}

impl Drop for Renewed {
    fn drop(&mut self) {
        let (stopped, wake) = &*self.stop;
        *stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        wake.notify_all();
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
        self.held.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A storage on an in-memory store with short leases, whose lock is a lease object where
    /// `conditional` (the store honours it) or flags where not (told so, as Garage's probe
    /// would).
    fn storage(conditional: bool) -> ObjectStorage {
        let store = Arc::new(object_store::memory::InMemory::new());
        let s = ObjectStorage::with_store(store, "memory://test", "ck")
            .with_lease(Duration::from_millis(300));
        if !conditional {
            s.conditional.set(false).unwrap();
        }
        assert_eq!(s.honours_conditional_create().unwrap(), conditional);
        s
    }

    /// A holder frozen as a paused process is: taken, and never renewed.
    fn frozen(storage: &ObjectStorage) -> Held {
        if storage.honours_conditional_create().unwrap() {
            take_lease(storage, Duration::from_secs(5)).unwrap()
        } else {
            take_flag(storage, Duration::from_secs(5)).unwrap()
        }
    }

    #[test]
    fn a_holder_paused_past_its_lease_learns_that_it_lost_the_lock() {
        for conditional in [true, false] {
            let storage = storage(conditional);
            let paused = frozen(&storage);
            paused.check().unwrap();
            std::thread::sleep(Duration::from_millis(400));
            // Expired: the next taker takes it over...
            let next = take(&storage, Duration::from_secs(5)).unwrap();
            next.check_held().unwrap();
            // ... and the paused holder, resumed, is told, naming who took it.
            let err = paused.check().unwrap_err().to_string();
            assert!(err.contains("is no longer this process's"), "{err}");
            assert!(
                err.contains(&format!(":{}", std::process::id())),
                "names the taker: {err}"
            );
            assert!(paused.renew().is_err(), "a lost lock is never renewed");
            // Its release leaves the new holder's lock alone.
            paused.release();
            next.check_held().unwrap();
            let busy = take(&storage, Duration::from_millis(200));
            assert!(
                matches!(busy, Err(Error::LockTimeout { .. })),
                "conditional {conditional}: the lock stays the new holder's"
            );
            drop(next);
            take(&storage, Duration::from_secs(5)).unwrap();
        }
    }

    #[test]
    fn a_holder_that_lives_keeps_the_lock_past_its_first_lease() {
        for conditional in [true, false] {
            let storage = storage(conditional);
            let holder = take(&storage, Duration::from_secs(5)).unwrap();
            // Three leases long: renewed meanwhile.
            std::thread::sleep(Duration::from_millis(900));
            let held_for = holder.check_held().unwrap();
            assert!(held_for > Duration::ZERO && held_for <= Duration::from_millis(300));
            let busy = take(&storage, Duration::from_millis(400));
            assert!(
                matches!(busy, Err(Error::LockTimeout { .. })),
                "conditional {conditional}: {busy:?}",
                busy = busy.err()
            );
            drop(holder);
            take(&storage, Duration::from_secs(5)).unwrap();
        }
    }
}

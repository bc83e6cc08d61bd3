//! The commit lock of a prefix of an object store, one of two kinds by what the store honours.
//!
//! * **A lease object** where the store honours conditional creation (`If-None-Match: *`):
//!   `.saver-commit.lock`, created conditionally and holding its expiry ([`LEASE`]); one left by a
//!   holder that died is taken over once expired, by a conditional update of the version read
//!   (`If-Match`), so two processes never take it together.
//! * **Flags** where it does not (Garage 2.5 accepts the header and overwrites anyway): each taker
//!   puts a flag of its own, `.saver-commit.lock.<token>`, then lists the prefix; it holds the lock
//!   if no other live flag is there, and otherwise removes its flag, waits a random while and tries
//!   again. This needs only what every S3-compatible store gives, read-after-write consistency of
//!   PUT, DELETE and LIST: of two takers whose flags overlap in time, the one that listed last put
//!   its flag after the other's listing, so it lists after the other's put and sees that flag. So
//!   at most one holds the lock; both may back off, and their random waits part them. A flag
//!   expires as a lease does, so a holder that died never blocks the next.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{PutMode, PutOptions};
use saver_core::naming::{is_commit_lock, COMMIT_LOCK};

use super::{ObjectStorage, LEASE};
use crate::error::{Error, Result};
use crate::storage::CommitLock;

/// Takes the commit lock of `storage`'s prefix, waiting up to `wait` for its holder.
pub(super) fn take(storage: &ObjectStorage, wait: Duration) -> Result<Box<dyn CommitLock>> {
    if storage.honours_conditional_create()? {
        take_lease(storage, wait)
    } else {
        take_flag(storage, wait)
    }
}

fn take_lease(storage: &ObjectStorage, wait: Duration) -> Result<Box<dyn CommitLock>> {
    let key = storage.key(COMMIT_LOCK)?;
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let lease = Lease::new();
        if storage.put_if_absent(&key, lease.to_bytes())? {
            return Ok(Box::new(Held {
                storage: storage.clone(),
                key,
            }));
        }
        // Held, or left by a holder that died: take it over once its lease has run out, only if
        // nobody else did first (a conditional update of the version read).
        if let Some((bytes, version)) = storage.get_versioned(&key, 4096)? {
            if Lease::parse(&bytes).is_none_or(|l| l.expired()) {
                let (c, k) = (storage.client.clone(), key.clone());
                let opts = PutOptions {
                    mode: PutMode::Update(version),
                    ..PutOptions::default()
                };
                let body = lease.to_bytes();
                match storage.client.block(&key, async move {
                    c.store.put_opts(&k, body.into(), opts).await
                }) {
                    Ok(_) => {
                        return Ok(Box::new(Held {
                            storage: storage.clone(),
                            key,
                        }))
                    }
                    Err(object_store::Error::Precondition { .. })
                    | Err(object_store::Error::AlreadyExists { .. })
                    | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(storage.client.err("take the lease", &key, e)),
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

fn take_flag(storage: &ObjectStorage, wait: Duration) -> Result<Box<dyn CommitLock>> {
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
        storage.put_bytes(&key, Lease::new().to_bytes())?;
        let held = Held {
            storage: storage.clone(),
            key: key.clone(),
        };
        if !another_live_flag(storage, &name)? {
            return Ok(Box::new(held));
        }
        // Removes the flag before the wait, so that the other taker can see it gone.
        drop(held);
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

/// Whether a flag of another taker is in the prefix and has not expired.
fn another_live_flag(storage: &ObjectStorage, mine: &str) -> Result<bool> {
    for object in storage.list_level()?.objects {
        let Some(name) = object.location.filename() else {
            continue;
        };
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
        // Left by a holder that died: removed, so that the next takers do not read it again.
        let _ = storage.delete(&object.location);
    }
    Ok(false)
}

fn timeout(storage: &ObjectStorage, key: &ObjectPath, start: Instant) -> Error {
    Error::LockTimeout {
        lock: PathBuf::from(storage.client.url(key)),
        waited: start.elapsed(),
    }
}

/// What a lock object holds: when the lease runs out.
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

    fn new() -> Self {
        Self {
            expires_unix_ms: Self::now_ms() + LEASE.as_millis() as u64,
        }
    }

    fn to_bytes(&self) -> Bytes {
        Bytes::from(format!(
            "{{\"holder\":\"{}:{}\",\"expires_unix_ms\":{}}}",
            crate::storage::identity::host_name().replace(['"', '\\'], "_"),
            std::process::id(),
            self.expires_unix_ms
        ))
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        Some(Self {
            expires_unix_ms: v.get("expires_unix_ms")?.as_u64()?,
        })
    }

    fn expired(&self) -> bool {
        Self::now_ms() > self.expires_unix_ms
    }
}

/// A held lock (a lease or a flag); released by removing its object.
struct Held {
    storage: ObjectStorage,
    key: ObjectPath,
}

impl CommitLock for Held {}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.storage.delete(&self.key);
    }
}

//! Writing one object: a file smaller than a part is put whole at commit; a larger one is a
//! multipart upload whose parts are fixed byte ranges, each sent in the background as soon as its
//! last byte is written.
//!
//! A writer thread that fills a part hands it to an upload thread and goes on producing: parts go
//! up while the next ones are filled, not one after the other. The uploads of one storage (one
//! save) share [`UploadSlots`], a fixed number of parts in flight; a writer that fills a part when
//! all are taken waits for one, so memory stays bounded by the parts being filled plus the slots.
//! A data file's first part waits for its header, which the save writes last: it waits in a
//! nameless temporary file (in the page cache, not the process's memory) rather than in memory,
//! where every file being written would hold one.
//!
//! Parts being filled are bounded too. A writer thread writes a segment's tensors side by side,
//! each at its own place in the file, and parts straddle the segments of different writers, so
//! each writer keeps three or four parts partly filled at once. At most [`FILLING_IN_MEMORY`]
//! of them (`SAVER_S3_FILLING`; none by default) fill in memory; the others fill in nameless
//! temporary files like the first part, and are read back into a buffer by the thread that
//! uploads them. So a save's part buffers are at most the parts filling in memory plus those in
//! flight, whatever the number of writers.
//! The first failed part fails the next write and the commit, which waits for every part in
//! flight before it completes or aborts the upload, so no part lands after the upload's end.

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use object_store::multipart::PartId;
use object_store::path::Path as ObjectPath;
use object_store::{MultipartId, ObjectStoreExt, PutPayload};

use super::{block, Client};
use crate::error::{Error, Result};
use crate::storage::WriteHandle;

/// Parts of one storage's uploads in flight at once, unless `SAVER_S3_UPLOADS` says otherwise.
/// With four (32 MiB), a save's parts went up to Garage on loopback at about 0.94 of the rate of a
/// plain upload keeping eight in flight (one traced run; docs/benchmarks/HISTORY.md has the saves' figures);
/// more would mostly hold more memory.
pub const UPLOADS_IN_FLIGHT: usize = 4;

/// Parts of one storage's uploads that fill in memory at once, unless `SAVER_S3_FILLING` says
/// otherwise (0 to 64); the others being filled wait in temporary files. None by default, so a
/// save's part buffers are the parts in flight alone. Filling in memory saves a write and a read
/// through the page cache a byte, for about 24 MiB a writer thread more (docs/benchmarks/HISTORY.md,
/// "Object storage at the limit", has both).
pub const FILLING_IN_MEMORY: usize = 0;

/// How many parts may be on their way up at once, shared by every file a storage writes; and the
/// buffers of parts that have gone up, for the next parts to fill.
#[derive(Debug)]
pub(super) struct UploadSlots {
    limit: usize,
    taken: Mutex<usize>,
    freed: Condvar,
    /// How many parts may fill in memory at once, and how many do.
    filling_limit: usize,
    filling: Mutex<usize>,
    /// Buffers of parts sent, at most `limit` of them. Reused rather than freed: the allocator
    /// kept about 25 MiB of freed part buffers of a 1 GiB save beyond those in use (measured
    /// with `MALLOC_MMAP_THRESHOLD_` set), and a new buffer costs a page fault every 4 KiB.
    spare: Mutex<Vec<PartBuf>>,
}

impl UploadSlots {
    /// [`UPLOADS_IN_FLIGHT`] slots and [`FILLING_IN_MEMORY`] parts filling in memory, or
    /// `SAVER_S3_UPLOADS` (1 to 64) and `SAVER_S3_FILLING` (0 to 64) where set.
    pub(super) fn from_env() -> Self {
        let var = |name: &str, range: std::ops::RangeInclusive<usize>, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|n| range.contains(n))
                .unwrap_or(default)
        };
        Self::new(
            var("SAVER_S3_UPLOADS", 1..=64, UPLOADS_IN_FLIGHT),
            var("SAVER_S3_FILLING", 0..=64, FILLING_IN_MEMORY),
        )
    }

    /// `in_flight` parts on their way up at once (at least one) and `filling` parts filling in
    /// memory.
    pub(super) fn new(in_flight: usize, filling: usize) -> Self {
        Self {
            limit: in_flight.max(1),
            taken: Mutex::new(0),
            freed: Condvar::new(),
            filling_limit: filling,
            filling: Mutex::new(0),
            spare: Mutex::default(),
        }
    }

    /// Part buffers alive now: (filling in memory, in flight, spare).
    #[cfg(test)]
    pub(super) fn buffers(&self) -> (usize, usize, usize) {
        let lock = |m: &Mutex<usize>| *m.lock().unwrap_or_else(PoisonError::into_inner);
        let spare = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        (lock(&self.filling), lock(&self.taken), spare)
    }

    /// The most part buffers that may be alive at once.
    #[cfg(test)]
    pub(super) fn most_buffers(&self) -> usize {
        self.limit + self.filling_limit
    }

    /// A place in memory for a part to fill, if fewer than the limit fill there.
    fn reserve_filling(self: &Arc<Self>) -> Option<FillingSlot> {
        let mut filling = self.filling.lock().unwrap_or_else(PoisonError::into_inner);
        (*filling < self.filling_limit).then(|| {
            *filling += 1;
            FillingSlot(self.clone())
        })
    }

    /// A buffer of `len` bytes for a part, whose bytes are all to be written before it is sent
    /// (a reused one still holds an earlier part's).
    fn buffer(&self, len: usize) -> std::io::Result<PartBuf> {
        let reused = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        // A file cut into more than 10 000 parts has larger ones than the spare buffers.
        let map = match reused.and_then(|b| b.map) {
            Some(map) if map.len() >= len => map,
            _ => memmap2::MmapMut::map_anon(len.max(1))?,
        };
        Ok(PartBuf {
            map: Some(map),
            len,
        })
    }

    /// Takes back the buffer of a part that has gone up, to be reused while the buffers alive
    /// (spare, filling and in flight, this one among them) stay within the two limits.
    fn recycle(&self, buf: PartBuf) {
        let filling = *self.filling.lock().unwrap_or_else(PoisonError::into_inner);
        let in_flight = *self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() + filling + in_flight <= self.limit + self.filling_limit {
            spare.push(buf);
        }
    }

    fn take(&self) {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        while *taken >= self.limit {
            taken = self
                .freed
                .wait(taken)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *taken += 1;
    }

    fn give_back(&self) {
        *self.taken.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
        self.freed.notify_one();
    }
}

/// A part's place among those filling in memory ([`UploadSlots::reserve_filling`]), given back
/// when the part goes up or is dropped.
#[derive(Debug)]
struct FillingSlot(Arc<UploadSlots>);

impl Drop for FillingSlot {
    fn drop(&mut self) {
        *self
            .0
            .filling
            .lock()
            .unwrap_or_else(PoisonError::into_inner) -= 1;
    }
}

/// A part's bytes in memory: an anonymous mapping of its own rather than the allocator's
/// memory. Parts are freed by upload threads, a new one for each part: glibc's allocator kept
/// about 25 MiB more of a save's 8 MiB buffers in its per-thread arenas (a `save --from` to
/// Garage peaked at 157 MiB, 127–132 MiB with the arenas or the mapping threshold fixed).
#[derive(Debug, Default)]
struct PartBuf {
    map: Option<memmap2::MmapMut>,
    len: usize,
}

impl PartBuf {
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl std::ops::Deref for PartBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_ref().map_or(&[], |m| &m[..self.len])
    }
}

impl std::ops::DerefMut for PartBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.map {
            Some(m) => &mut m[..self.len],
            None => &mut [],
        }
    }
}

/// One fixed byte range of a multipart upload.
#[derive(Default)]
struct Part {
    /// The bytes written so far; allocated at the part's first write, given up at its upload.
    buf: PartBuf,
    /// Its place among the parts filling in memory, while `buf` is one of them.
    in_memory: Option<FillingSlot>,
    /// Where the part's bytes wait instead, if a temporary file could be made: a data file's
    /// header, at its start, is written last, so its first part waits for the whole file (in
    /// memory, each file being written would hold a part for all that time); other parts wait
    /// there when [`FILLING_IN_MEMORY`] parts already fill in memory.
    waiting: Option<std::fs::File>,
    /// How many of its bytes were written.
    filled: u64,
    /// Set when it is handed to an upload, so that a second write of its bytes is refused.
    sent: bool,
    /// Set once uploaded.
    id: Option<PartId>,
}

/// The parts of one upload in flight, and the first error one of them met.
#[derive(Default)]
struct Flights {
    state: Mutex<FlightState>,
    landed: Condvar,
}

#[derive(Default)]
struct FlightState {
    running: usize,
    /// The first failure, kept as its parts so that every writer thread and the commit can
    /// report the same error (the save reports whichever of them fails first).
    failed: Option<Failure>,
}

/// A part upload's error, as its parts.
struct Failure {
    op: &'static str,
    path: std::path::PathBuf,
    kind: std::io::ErrorKind,
    message: String,
}

impl Failure {
    fn of(e: Error) -> Self {
        match e {
            Error::Io { op, path, source } => Self {
                op,
                path,
                kind: source.kind(),
                message: source.to_string(),
            },
            other => Self {
                op: "upload a part of",
                path: Default::default(),
                kind: std::io::ErrorKind::Other,
                message: other.to_string(),
            },
        }
    }

    fn error(&self) -> Error {
        Error::Io {
            op: self.op,
            path: self.path.clone(),
            source: std::io::Error::new(self.kind, self.message.clone()),
        }
    }
}

impl Flights {
    fn lock(&self) -> std::sync::MutexGuard<'_, FlightState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until no part is in flight.
    fn wait_all(&self) {
        let mut s = self.lock();
        while s.running > 0 {
            s = self.landed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The first failure of a part's upload, if any.
    fn failure(&self) -> Result<()> {
        self.lock()
            .failed
            .as_ref()
            .map_or(Ok(()), |f| Err(f.error()))
    }
}

/// Where the bytes of a file put whole wait for its commit.
enum WholeBytes {
    /// A nameless temporary file of the file's length: a save creates all its data files
    /// before it writes any, and commits them after it has written all, so in memory a save of
    /// many files smaller than a part would hold all of them, the whole checkpoint, at once.
    File(std::fs::File),
    /// Memory, where no temporary file could be made.
    Memory(Vec<u8>),
}

enum Body {
    /// A file smaller than a part, put whole at commit.
    Whole(Mutex<WholeBytes>),
    /// A multipart upload in fixed-size parts.
    Parts {
        upload: MultipartId,
        /// The object that records the upload until it is completed or aborted.
        marker: ObjectPath,
        part_size: u64,
        parts: Arc<Vec<Mutex<Part>>>,
        flights: Arc<Flights>,
        slots: Arc<UploadSlots>,
    },
}

/// An object being written ([`WriteHandle`]).
pub(super) struct ObjectWrite {
    client: Arc<Client>,
    key: ObjectPath,
    /// The file's length: as created, or as [`WriteHandle::truncate`] cut it.
    len: AtomicU64,
    body: Body,
}

/// A part whose bytes are all written, before it is sent.
enum Full {
    /// Filled in memory, with its place among the parts filling there.
    Memory(PartBuf, Option<FillingSlot>),
    /// Filled in a temporary file, of this many bytes.
    Waiting(std::fs::File, u64),
}

/// A part's buffer on its way up: back to its storage's spare buffers once the store is done
/// with it.
struct Sending {
    buf: PartBuf,
    slots: Arc<UploadSlots>,
}

impl AsRef<[u8]> for Sending {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        self.slots.recycle(std::mem::take(&mut self.buf));
    }
}

/// An error of the temporary file a part of `key`, or all of it, waits in.
fn waiting_error(client: &Client, key: &ObjectPath, source: std::io::Error) -> Error {
    Error::Io {
        op: "keep, in a temporary file until it goes up, a part of",
        path: client.url(key).into(),
        source,
    }
}

/// Sends part `i` of `upload` and waits for the store's answer.
fn upload_part(
    client: &Arc<Client>,
    key: &ObjectPath,
    upload: &MultipartId,
    i: usize,
    buf: Sending,
) -> Result<PartId> {
    let (c, k, id) = (client.clone(), key.clone(), upload.clone());
    let payload = PutPayload::from(bytes::Bytes::from_owner(buf));
    client
        .block(key, async move {
            c.multipart.put_part(&k, &id, i, payload).await
        })
        .map_err(|e| client.err("upload a part of", key, e))
}

impl ObjectWrite {
    /// A file of `len` bytes, put whole at commit.
    pub(super) fn whole(client: Arc<Client>, key: ObjectPath, len: u64) -> Self {
        Self {
            client,
            key,
            len: AtomicU64::new(len),
            body: Body::Whole(Mutex::new(
                tempfile::tempfile()
                    .and_then(|f| f.set_len(len).map(|()| f))
                    .map_or_else(
                        |_| WholeBytes::Memory(vec![0; len as usize]),
                        WholeBytes::File,
                    ),
            )),
        }
    }

    /// A file of `len` bytes, going up as the started multipart `upload` in parts of
    /// `part_size`, at most `slots` of them in flight.
    pub(super) fn in_parts(
        client: Arc<Client>,
        key: ObjectPath,
        len: u64,
        upload: MultipartId,
        marker: ObjectPath,
        part_size: u64,
        slots: Arc<UploadSlots>,
    ) -> Self {
        let parts = (0..len.div_ceil(part_size))
            .map(|_| Mutex::new(Part::default()))
            .collect();
        Self {
            client,
            key,
            len: AtomicU64::new(len),
            body: Body::Parts {
                upload,
                marker,
                part_size,
                parts: Arc::new(parts),
                flights: Arc::default(),
                slots,
            },
        }
    }

    fn waiting_error(&self, source: std::io::Error) -> Error {
        waiting_error(&self.client, &self.key, source)
    }

    fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    fn part_range(&self, part_size: u64, i: usize) -> Range<u64> {
        let start = i as u64 * part_size;
        start..(start + part_size).min(self.len())
    }

    /// Part `p`, of `plen` bytes, once all are written, marked sent: its buffer or the
    /// temporary file it waited in.
    fn take_full(p: &mut Part, plen: u64) -> Option<Full> {
        p.sent = p.filled == plen;
        if !p.sent {
            return None;
        }
        Some(match p.waiting.take() {
            None => {
                let mut bytes = std::mem::take(&mut p.buf);
                // A last part cut short by a truncate was allocated at its planned length.
                bytes.truncate(plen as usize);
                Full::Memory(bytes, p.in_memory.take())
            }
            Some(f) => Full::Waiting(f, plen),
        })
    }

    /// Hands the full part `i` to an upload thread once a slot is free; a part that waited in
    /// a temporary file is read into a buffer only then.
    fn send(
        &self,
        upload: &MultipartId,
        i: usize,
        full: Full,
        parts: &Arc<Vec<Mutex<Part>>>,
        flights: &Arc<Flights>,
        slots: &Arc<UploadSlots>,
    ) -> Result<()> {
        slots.take();
        flights.lock().running += 1;
        let (client, key, upload) = (self.client.clone(), self.key.clone(), upload.clone());
        let (parts, flights2, slots2) = (parts.clone(), flights.clone(), slots.clone());
        let spawned = std::thread::Builder::new()
            .name("saver-upload".into())
            .spawn(move || {
                // A part that waited in a file is read here, not by the writer thread, which
                // goes on producing.
                let bytes = match full {
                    // Its buffer now counts among the parts in flight, not those filling.
                    Full::Memory(buf, _filling) => Ok(buf),
                    Full::Waiting(f, plen) => slots2
                        .buffer(plen as usize)
                        .and_then(|mut buf| f.read_exact_at(&mut buf, 0).map(|()| buf))
                        .map_err(|e| waiting_error(&client, &key, e)),
                };
                let sent = bytes.and_then(|buf| {
                    let buf = Sending {
                        buf,
                        slots: slots2.clone(),
                    };
                    upload_part(&client, &key, &upload, i, buf)
                });
                let mut s = flights2.lock();
                match sent {
                    Ok(id) => parts[i].lock().unwrap_or_else(PoisonError::into_inner).id = Some(id),
                    Err(e) => {
                        s.failed.get_or_insert_with(|| Failure::of(e));
                    }
                }
                s.running -= 1;
                drop(s);
                flights2.landed.notify_all();
                slots2.give_back();
            });
        if let Err(e) = spawned {
            flights.lock().running -= 1;
            slots.give_back();
            return Err(Error::Io {
                op: "start an upload thread for",
                path: self.client.url(&self.key).into(),
                source: e,
            });
        }
        Ok(())
    }
}

impl WriteHandle for ObjectWrite {
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.len() {
            return Err(Error::Mismatch(format!(
                "internal: a write of bytes {offset}..{end} past the end ({}) of {}",
                self.len(),
                self.client.url(&self.key)
            )));
        }
        match &self.body {
            Body::Whole(whole) => match &mut *whole.lock().expect("no panic while held") {
                WholeBytes::File(f) => f
                    .write_all_at(buf, offset)
                    .map_err(|e| self.waiting_error(e)),
                WholeBytes::Memory(bytes) => {
                    bytes[offset as usize..end as usize].copy_from_slice(buf);
                    Ok(())
                }
            },
            Body::Parts {
                upload,
                part_size,
                parts,
                flights,
                slots,
                ..
            } => {
                // A failed part fails the save at its next write, not only at the commit.
                flights.failure()?;
                let mut at = offset;
                while at < end {
                    let i = (at / part_size) as usize;
                    let range = self.part_range(*part_size, i);
                    let n = range.end.min(end) - at;
                    let src = &buf[(at - offset) as usize..(at - offset + n) as usize];
                    let full = {
                        let mut p = parts[i].lock().expect("no panic while held");
                        let plen = range.end - range.start;
                        if p.sent || p.filled + n > plen {
                            return Err(Error::Mismatch(format!(
                                "internal: bytes {at}..{} of {} written twice",
                                at + n,
                                self.client.url(&self.key)
                            )));
                        }
                        if p.buf.is_empty() && p.waiting.is_none() {
                            p.in_memory = if i == 0 {
                                None
                            } else {
                                slots.reserve_filling()
                            };
                            if p.in_memory.is_none() {
                                // Only a saving of memory: without a temporary file, the part
                                // fills in memory after all.
                                p.waiting = tempfile::tempfile().ok();
                            }
                            if p.waiting.is_none() {
                                p.buf =
                                    slots.buffer(plen as usize).map_err(|source| Error::Io {
                                        op: "map memory for a part of",
                                        path: self.client.url(&self.key).into(),
                                        source,
                                    })?;
                            }
                        }
                        let from = at - range.start;
                        match &p.waiting {
                            Some(f) => f
                                .write_all_at(src, from)
                                .map_err(|e| self.waiting_error(e))?,
                            None => p.buf[from as usize..(from + n) as usize].copy_from_slice(src),
                        }
                        p.filled += n;
                        Self::take_full(&mut p, plen)
                    };
                    if let Some(bytes) = full {
                        self.send(upload, i, bytes, parts, flights, slots)?;
                    }
                    at += n;
                }
                Ok(())
            }
        }
    }

    fn truncate(&self, len: u64) -> Result<()> {
        let url = || self.client.url(&self.key);
        if len > self.len() {
            return Err(Error::Mismatch(format!(
                "internal: {} cannot grow to {len} bytes by a truncate",
                url()
            )));
        }
        match &self.body {
            Body::Whole(whole) => {
                match &mut *whole.lock().expect("no panic while held") {
                    WholeBytes::File(f) => f.set_len(len).map_err(|e| self.waiting_error(e))?,
                    WholeBytes::Memory(bytes) => bytes.truncate(len as usize),
                }
                self.len.store(len, Ordering::Release);
                Ok(())
            }
            Body::Parts {
                upload,
                part_size,
                parts,
                flights,
                slots,
                ..
            } => {
                let kept = len.div_ceil(*part_size) as usize;
                for p in &parts[kept.min(parts.len())..] {
                    if p.lock().expect("no panic while held").filled > 0 {
                        return Err(Error::Mismatch(format!(
                            "internal: {} was written past {len}, where it is cut",
                            url()
                        )));
                    }
                }
                self.len.store(len, Ordering::Release);
                // The new last part may now be whole.
                let Some(i) = kept.checked_sub(1) else {
                    return Ok(());
                };
                let range = self.part_range(*part_size, i);
                let full = {
                    let mut p = parts[i].lock().expect("no panic while held");
                    if p.filled > range.end - range.start {
                        return Err(Error::Mismatch(format!(
                            "internal: {} was written past {len}, where it is cut",
                            url()
                        )));
                    }
                    if p.sent {
                        None
                    } else {
                        Self::take_full(&mut p, range.end - range.start)
                    }
                };
                if let Some(bytes) = full {
                    self.send(upload, i, bytes, parts, flights, slots)?;
                }
                Ok(())
            }
        }
    }

    fn commit(self: Box<Self>, _durable: bool) -> Result<()> {
        match &self.body {
            Body::Whole(whole) => {
                let bytes = match &mut *whole.lock().expect("no panic while held") {
                    WholeBytes::File(f) => {
                        let mut bytes = vec![0; self.len() as usize];
                        f.read_exact_at(&mut bytes, 0)
                            .map_err(|e| self.waiting_error(e))?;
                        bytes
                    }
                    WholeBytes::Memory(bytes) => std::mem::take(bytes),
                };
                let (c, k) = (self.client.clone(), self.key.clone());
                self.client
                    .block(
                        &self.key,
                        async move { c.store.put(&k, bytes.into()).await },
                    )
                    .map(|_| ())
                    .map_err(|e| self.client.err("put", &self.key, e))
            }
            Body::Parts {
                upload,
                marker,
                part_size,
                parts,
                flights,
                ..
            } => {
                flights.wait_all();
                if let Err(e) = flights.failure() {
                    self.abort();
                    return Err(e);
                }
                let kept = self.len().div_ceil(*part_size) as usize;
                let mut ids = Vec::with_capacity(kept);
                for (i, p) in parts.iter().enumerate().take(kept) {
                    let p = p.lock().expect("no panic while held");
                    match &p.id {
                        Some(id) => ids.push(id.clone()),
                        None => {
                            let range = self.part_range(*part_size, i);
                            let e = Error::Mismatch(format!(
                                "internal: only {} of bytes {range:?} of {} were written",
                                p.filled,
                                self.client.url(&self.key)
                            ));
                            drop(p);
                            self.abort();
                            return Err(e);
                        }
                    }
                }
                let (c, k, id) = (self.client.clone(), self.key.clone(), upload.clone());
                let done = self.client.block(&self.key, async move {
                    c.multipart.complete_multipart(&k, &id, ids).await
                });
                match done {
                    Ok(_) => {
                        // A marker left by a failure here names a completed upload, which a
                        // cleanup's abort leaves alone.
                        let (c, m) = (self.client.clone(), marker.clone());
                        let _ = self
                            .client
                            .block(marker, async move { c.store.delete(&m).await });
                        Ok(())
                    }
                    Err(e) => {
                        let e = self.client.err("complete the upload of", &self.key, e);
                        self.abort();
                        Err(e)
                    }
                }
            }
        }
    }

    fn abort(self: Box<Self>) {
        if let Body::Parts {
            upload,
            marker,
            flights,
            ..
        } = &self.body
        {
            // A part still in flight could otherwise land after the abort and, on stores that
            // keep parts of aborted uploads until they expire, be stored for nothing.
            flights.wait_all();
            let (c, k, id, m) = (
                self.client.clone(),
                self.key.clone(),
                upload.clone(),
                marker.clone(),
            );
            block(async move {
                if c.multipart.abort_multipart(&k, &id).await.is_ok() {
                    let _ = c.store.delete(&m).await;
                }
            });
        }
    }
}

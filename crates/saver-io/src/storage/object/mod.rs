//! [`ObjectStorage`]: a checkpoint under a prefix of an S3-compatible bucket, on the
//! `object_store` crate.
//!
//! How the [`Storage`] operations map onto an object store:
//!
//! * **Data files** go up as multipart uploads whose parts are fixed byte ranges of the file
//!   (`part_size`, 8 MiB or more): a part goes up in the background as soon as its last byte is
//!   written, while the writer threads fill the next ones, at most [`UPLOADS_IN_FLIGHT`] parts of a
//!   storage at once (`SAVER_S3_UPLOADS`). At most [`FILLING_IN_MEMORY`] parts fill in memory
//!   (`SAVER_S3_FILLING`); the others fill in nameless temporary files, so a save's part buffers
//!   are bounded whatever its number of writer threads ([`upload`]). The first part holds the
//!   header, which the save writes last, so it is the last to go up. Nothing is visible under the file's name until the upload is completed
//!   ([`WriteHandle::commit`]); an aborted or killed upload leaves no object. Files smaller than one
//!   part are put whole.
//! * **Commit without rename:** every object appears atomically when its PUT or its completion
//!   succeeds, and the store's read-after-write consistency makes it visible to every reader from
//!   then on. The index, put last, stays the commit point.
//! * **Exclusive creation and the commit lock** use conditional creation (`If-None-Match: *`) where
//!   the store honours it, which is probed once per storage (some stores, Garage among them,
//!   accept the header and overwrite anyway). The commit lock is then a lease object that expires
//!   ([`LEASE`]), so a committer that dies never blocks the next. Where the store does not honour
//!   conditional creation, creation is check-then-put and the commit lock is made of flags that
//!   need only read-after-write consistency ([`lock`]).
//! * **Reads** are ranged GETs; every request has a timeout and bounded retries with backoff, so a
//!   store that stops answering is an error naming it, never a hang (30 s a request and 60 s of
//!   retries by default; `SAVER_S3_TIMEOUT_SECONDS` and `SAVER_S3_RETRY_SECONDS` change them).

use std::collections::HashMap;
use std::future::Future;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjectPath;
use object_store::{
    ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, RetryConfig,
    UpdateVersion,
};
use saver_core::naming::TMP_MARK;

use super::{check_file_name, CommitLock, ReadHandle, Storage, WriteHandle};
use crate::error::{Error, Result};

mod lock;
mod upload;

use upload::{ObjectWrite, UploadSlots};
pub use upload::{FILLING_IN_MEMORY, UPLOADS_IN_FLIGHT};

/// The smallest part of a multipart upload (S3 refuses smaller parts but the last).
pub const MIN_PART_SIZE: u64 = 8 << 20;

/// Most parts of one multipart upload (S3's limit).
const MAX_PARTS: u64 = 10_000;

/// How long a commit lock lasts if its holder neither releases it nor renews it (by default:
/// `SAVER_S3_LEASE_SECONDS` sets another). Commits hold the lock for a few small requests, far
/// less than this, and renew it every third of it while they hold it.
pub const LEASE: Duration = Duration::from_secs(30);

/// Timeout of one request (`SAVER_S3_TIMEOUT_SECONDS`); a request that takes longer is retried,
/// within [`retry_for`].
fn request_timeout() -> Duration {
    seconds_from_env("SAVER_S3_TIMEOUT_SECONDS", 30)
}

/// How long one operation is retried, with exponential backoff, before it fails
/// (`SAVER_S3_RETRY_SECONDS`).
fn retry_for() -> Duration {
    seconds_from_env("SAVER_S3_RETRY_SECONDS", 60)
}

fn seconds_from_env(var: &str, default: u64) -> Duration {
    let secs = std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0);
    secs.map_or(Duration::from_secs(default), Duration::from_secs_f64)
}

/// The runtime that runs every request of every object storage in the process. Callers block on
/// their request from any thread, inside or outside another runtime.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("saver-object-store")
            .on_thread_start(block_sigpipe)
            .enable_all()
            .build()
            .expect("a tokio runtime for object storage")
    })
}

/// Keeps SIGPIPE from the calling thread. A process may give SIGPIPE its default action (the
/// `saver` binary does, so that `saver … | head` ends quietly), and then a request written to a
/// connection the server has just closed (`writev` sends no `MSG_NOSIGNAL`) would kill it
/// without a word. Blocked, the signal stays pending and the write fails with `EPIPE`, which
/// the request reports and retries like any broken connection.
fn block_sigpipe() {
    // SAFETY: an empty set with one valid signal added, applied to the calling thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Runs `f` on the object-store runtime and waits for it. Spawned rather than `block_on`, so a
/// caller that is itself on a runtime's thread does not panic.
fn block<T: Send + 'static>(f: impl Future<Output = T> + Send + 'static) -> T {
    let handle = runtime().spawn(f);
    match futures::executor::block_on(handle) {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Where to say what a request that gets no answer is waiting for; see [`on_slow_request`].
static SLOW_NOTICE: OnceLock<fn(&str)> = OnceLock::new();

/// Has `notice` told, once per request, when a request has waited longer than one request
/// timeout (`SAVER_S3_TIMEOUT_SECONDS`) for the store: which object, and for how much longer it
/// is retried. The `saver` binary prints it; a library user may log it. Set once per process.
pub fn on_slow_request(notice: fn(&str)) {
    let _ = SLOW_NOTICE.set(notice);
}

/// Stores that did not answer for a whole retry window, by bucket URL: when, and the error. A
/// command makes many requests; without this, each would wait its own window (verify against
/// a store that accepts connections but never answers took three windows, 180 s by default).
fn unanswering() -> &'static Mutex<HashMap<String, (Instant, String)>> {
    static SILENT: OnceLock<Mutex<HashMap<String, (Instant, String)>>> = OnceLock::new();
    SILENT.get_or_init(Mutex::default)
}

/// The store's client, shared by the storage and its open files.
struct Client {
    store: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
    /// `s3://bucket`, for messages.
    bucket_url: String,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("bucket_url", &self.bucket_url)
            .finish_non_exhaustive()
    }
}

impl Client {
    fn url(&self, key: &ObjectPath) -> String {
        format!("{}/{key}", self.bucket_url)
    }

    /// Runs request `f` about `key` and waits for it, saying what it waits for once it has
    /// waited a request timeout ([`on_slow_request`]). A store that did not answer for a whole
    /// retry window less than a window ago is not asked again: the request fails at once with
    /// that store's error, so that one window bounds a command against a silent store.
    fn block<X: Send + 'static>(
        &self,
        key: &ObjectPath,
        f: impl Future<Output = object_store::Result<X>> + Send + 'static,
    ) -> object_store::Result<X> {
        self.check_answering()?;
        let started = Instant::now();
        let notice = SLOW_NOTICE.get().map(|&notice| {
            let what = format!(
                "waiting for {}: no answer after {} s; retried for up to {} s \
                 (SAVER_S3_TIMEOUT_SECONDS, SAVER_S3_RETRY_SECONDS)",
                self.url(key),
                request_timeout().as_secs_f64(),
                retry_for().as_secs_f64()
            );
            runtime().spawn(async move {
                tokio::time::sleep(request_timeout()).await;
                notice(&what);
            })
        });
        let out = block(f);
        if let Some(n) = notice {
            n.abort();
        }
        self.note_answer(started, out.as_ref().err());
        out
    }

    /// An error if this store did not answer for a whole retry window less than a window ago.
    fn check_answering(&self) -> object_store::Result<()> {
        let mut silent = unanswering().lock().unwrap_or_else(PoisonError::into_inner);
        match silent.get(&self.bucket_url) {
            Some((at, why)) if at.elapsed() < retry_for() => Err(object_store::Error::Generic {
                store: "S3",
                source: format!(
                    "not sent: {} did not answer for {} s just before (SAVER_S3_RETRY_SECONDS): \
                     {why}",
                    self.bucket_url,
                    retry_for().as_secs_f64()
                )
                .into(),
            }),
            Some(_) => {
                silent.remove(&self.bucket_url);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Records whether the store answered a request started at `started`: a transport failure
    /// after a whole retry window marks it silent; an answer clears that.
    fn note_answer(&self, started: Instant, err: Option<&object_store::Error>) {
        let mut silent = unanswering().lock().unwrap_or_else(PoisonError::into_inner);
        match err {
            None => {
                silent.remove(&self.bucket_url);
            }
            Some(e @ object_store::Error::Generic { .. }) if started.elapsed() >= retry_for() => {
                let said = one_line(&e.to_string());
                let why = match self.cause(e) {
                    Some(cause) => format!("{cause} ({said})"),
                    None => said,
                };
                silent.insert(self.bucket_url.clone(), (Instant::now(), why));
            }
            Some(_) => {}
        }
    }

    /// An object-store error as saver's, naming the operation and the object. Missing objects
    /// become `NotFound` I/O errors, so they count as a checkpoint's fault where a file's would.
    fn err(&self, op: &'static str, key: &ObjectPath, e: object_store::Error) -> Error {
        use std::io::ErrorKind;
        let kind = match &e {
            object_store::Error::NotFound { .. } => ErrorKind::NotFound,
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => ErrorKind::PermissionDenied,
            object_store::Error::AlreadyExists { .. } => ErrorKind::AlreadyExists,
            _ => ErrorKind::Other,
        };
        let said = one_line(&e.to_string());
        let message = match self.cause(&e) {
            Some(cause) => format!("{cause} ({said})"),
            None => said,
        };
        Error::Io {
            op,
            path: PathBuf::from(self.url(key)),
            source: std::io::Error::new(kind, message),
        }
    }

    /// What a user can act on in `e`, said first: the store refused the connection or did not
    /// answer, no credentials were found, the credentials or the bucket were refused.
    fn cause(&self, e: &object_store::Error) -> Option<String> {
        let endpoint = std::env::var("AWS_ENDPOINT_URL")
            .or_else(|_| std::env::var("AWS_ENDPOINT"))
            .unwrap_or_else(|_| "the store".into());
        let text = e.to_string();
        if text.contains("not sent: ") {
            // A request not sent after a silent window: its text already says the cause.
            return None;
        }
        // Every error of the chain said, for the causes known only by their words.
        let mut chain = String::new();
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(s) = source {
            chain.push_str(&s.to_string());
            chain.push('\n');
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                match io.kind() {
                    std::io::ErrorKind::ConnectionRefused => {
                        return Some(format!(
                            "{endpoint} refused the connection: is the store running there?"
                        ))
                    }
                    std::io::ErrorKind::TimedOut => {
                        return Some(format!("{endpoint} did not answer in time"))
                    }
                    _ => {}
                }
            }
            source = s.source();
        }
        let has = |code: &str| text.contains(code);
        if has("169.254.169.254") || has("169.254.170.2") {
            return Some(
                "no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or \
                 AWS_PROFILE), or run where the instance metadata service gives some"
                    .into(),
            );
        }
        if has("NoSuchBucket") {
            return Some(format!("the bucket {} does not exist", self.bucket_url));
        }
        if has("InvalidAccessKeyId") || has("SignatureDoesNotMatch") || has("AccessDenied") {
            return Some("the store refused the credentials".into());
        }
        let timed_out = ["timed out", "deadline has elapsed"];
        if timed_out.iter().any(|t| chain.to_lowercase().contains(t)) {
            return Some(format!("{endpoint} did not answer in time"));
        }
        None
    }
}

/// A store's error message on one line: an S3 error body (XML) becomes its code and message.
fn one_line(msg: &str) -> String {
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = msg.find(&open)? + open.len();
        let len = msg[start..].find('<')?;
        Some(&msg[start..start + len])
    };
    let msg = match (
        msg.find("<?xml").or_else(|| msg.find("<Error>")),
        tag("Code"),
    ) {
        (Some(xml), Some(code)) => format!(
            "{} {code}: {}",
            msg[..xml].trim_end_matches([' ', ':']),
            tag("Message").unwrap_or("")
        ),
        _ => msg.to_string(),
    };
    let mut out = String::with_capacity(msg.len().min(400));
    for word in msg.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
        if out.len() > 400 {
            out.push('…');
            break;
        }
    }
    out
}

/// A checkpoint "directory" under a prefix of an object-store bucket: `s3://bucket/prefix`.
#[derive(Clone, Debug)]
pub struct ObjectStorage {
    client: Arc<Client>,
    prefix: ObjectPath,
    url: String,
    part_size: u64,
    /// Whether the store honours conditional creation, probed at first need.
    conditional: Arc<OnceLock<bool>>,
    /// The parts in flight of every file this storage writes.
    uploads: Arc<UploadSlots>,
    /// How long a lease of this storage's commit lock runs ([`LEASE`], or
    /// `SAVER_S3_LEASE_SECONDS`).
    lease: Duration,
}

/// A URL split into bucket and prefix, with `.` and `..` segments resolved (a chain names its
/// parents relative to the child), refusing any that would leave the bucket.
fn parse_s3_url(url: &str) -> Result<(String, String)> {
    let bad = |why: String| Error::InvalidOption {
        option: "location",
        why: format!("{url}: {why}"),
    };
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| bad("not an s3:// URL".into()))?;
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(bad("no bucket name (s3://bucket/prefix)".into()));
    }
    if bucket.contains(['?', '#', '\\']) || bucket.chars().any(char::is_whitespace) {
        return Err(bad(format!("{bucket:?} is not a bucket name")));
    }
    let mut parts: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(bad("`..` leaves the bucket".into()));
                }
            }
            s if s.chars().any(char::is_control) => {
                return Err(bad("a control character in the prefix".into()))
            }
            s => parts.push(s),
        }
    }
    Ok((bucket.to_string(), parts.join("/")))
}

/// Whether `endpoint` is an `http://` URL of this machine (loopback), where plain HTTP is safe.
fn is_loopback_http(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl ObjectStorage {
    /// The objects and the common prefixes ("directories") directly under the prefix.
    fn list_level(&self) -> Result<object_store::ListResult> {
        let (c, p) = (self.client.clone(), self.prefix.clone());
        let prefix = (!self.prefix.as_ref().is_empty()).then_some(p);
        self.client
            .block(&self.prefix, async move {
                c.store.list_with_delimiter(prefix.as_ref()).await
            })
            .map_err(|e| self.client.err("list", &self.prefix, e))
    }

    /// Opens `s3://bucket/prefix`, configured from the standard AWS environment
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, …). Plain `http://` endpoints are allowed on loopback and where
    /// `AWS_ALLOW_HTTP=true`. Nothing is requested until the first operation.
    pub fn from_url(url: &str) -> Result<Self> {
        let (bucket, prefix) = parse_s3_url(url)?;
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(&bucket);
        let endpoint = std::env::var("AWS_ENDPOINT_URL")
            .or_else(|_| std::env::var("AWS_ENDPOINT"))
            .unwrap_or_default();
        // A store of one's own (an endpoint given) has no instance metadata service to ask for
        // credentials: without keys, say so rather than ask a cloud's link-local address.
        let keys = std::env::var_os("AWS_ACCESS_KEY_ID").is_some()
            || std::env::var_os("AWS_WEB_IDENTITY_TOKEN_FILE").is_some()
            || std::env::var_os("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").is_some()
            || std::env::var_os("AWS_CONTAINER_CREDENTIALS_FULL_URI").is_some();
        if !endpoint.is_empty() && !keys {
            return Err(Error::InvalidOption {
                option: "location",
                why: format!(
                    "{url}: no credentials found for the store at {endpoint}: set \
                     AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                ),
            });
        }
        let mut client = ClientOptions::new()
            .with_timeout(request_timeout())
            .with_connect_timeout(Duration::from_secs(5));
        if is_loopback_http(&endpoint) {
            client = client.with_allow_http(true);
        }
        if std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
            client = client.with_allow_http(true);
        }
        builder = builder.with_client_options(client).with_retry(RetryConfig {
            max_retries: 8,
            retry_timeout: retry_for(),
            ..RetryConfig::default()
        });
        let s3 = Arc::new(builder.build().map_err(|e| Error::InvalidOption {
            option: "location",
            why: format!("{url}: {}", one_line(&e.to_string())),
        })?);
        Ok(Self::with_store(s3, &format!("s3://{bucket}"), &prefix))
    }

    /// A storage under `prefix` of any `object_store` store with multipart uploads (S3, GCS,
    /// Azure, or the in-memory store of tests); `bucket_url` (`s3://bucket`, `gs://bucket`, …)
    /// names it in messages.
    pub fn with_store<S: ObjectStore + MultipartStore>(
        store: Arc<S>,
        bucket_url: &str,
        prefix: &str,
    ) -> Self {
        let prefix = prefix.trim_matches('/');
        let url = if prefix.is_empty() {
            bucket_url.to_string()
        } else {
            format!("{bucket_url}/{prefix}")
        };
        Self {
            client: Arc::new(Client {
                store: store.clone(),
                multipart: store,
                bucket_url: bucket_url.to_string(),
            }),
            prefix: ObjectPath::from(prefix),
            url,
            part_size: MIN_PART_SIZE,
            conditional: Arc::default(),
            uploads: Arc::new(UploadSlots::from_env()),
            lease: seconds_from_env("SAVER_S3_LEASE_SECONDS", LEASE.as_secs()),
        }
    }

    /// Leases of `lease` for this storage's commit lock instead of [`LEASE`]. A holder renews
    /// its lease every third of it while it holds the lock; one paused for longer than the
    /// lease may lose the lock to another process, and then writes nothing more under it.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// Uploads data files in parts of `bytes` (at least [`MIN_PART_SIZE`]; larger for files
    /// that would need more than 10 000 parts). Memory of a save's parts is at most
    /// [`FILLING_IN_MEMORY`] parts being filled and [`UPLOADS_IN_FLIGHT`] on their way up; the
    /// other parts being filled, the first part of every file among them, wait in temporary
    /// files.
    pub fn with_part_size(mut self, bytes: u64) -> Self {
        self.part_size = bytes.max(MIN_PART_SIZE);
        self
    }

    /// Whether the store honours conditional creation (`If-None-Match: *` on PUT): probed once,
    /// by creating a probe object of this storage's own twice and removing it.
    pub fn honours_conditional_create(&self) -> Result<bool> {
        if let Some(&c) = self.conditional.get() {
            return Ok(c);
        }
        static PROBES: AtomicU64 = AtomicU64::new(0);
        let key = self.prefix.clone().join(format!(
            ".saver-probe-{}-{}-{}",
            std::process::id(),
            crate::storage::identity::process_token(),
            PROBES.fetch_add(1, Ordering::Relaxed)
        ));
        let first = self.put_if_absent(&key, Bytes::from_static(b"probe"))?;
        let second = self.put_if_absent(&key, Bytes::from_static(b"probe"));
        let _ = self.delete(&key);
        if !first {
            return Err(Error::Mismatch(format!(
                "{}: the store refused to create a new probe object {key}",
                self.url
            )));
        }
        let honoured = !second?;
        Ok(*self.conditional.get_or_init(|| honoured))
    }

    fn key(&self, name: &str) -> Result<ObjectPath> {
        check_file_name(name, &format!("a request to {}", self.url))?;
        Ok(self.prefix.clone().join(name))
    }

    /// PUT with `If-None-Match: *`; `Ok(false)` if the store said the object exists.
    fn put_if_absent(&self, key: &ObjectPath, bytes: Bytes) -> Result<bool> {
        Ok(self.put_conditional(key, bytes, PutMode::Create)?.is_some())
    }

    /// PUT in `mode` (create, or update of a version): the version written, or `None` if the
    /// store refused it (the object exists, or no longer holds the version named).
    fn put_conditional(
        &self,
        key: &ObjectPath,
        bytes: Bytes,
        mode: PutMode,
    ) -> Result<Option<UpdateVersion>> {
        let (c, k) = (self.client.clone(), key.clone());
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        match self.client.block(key, async move {
            c.store.put_opts(&k, bytes.into(), opts).await
        }) {
            Ok(put) => Ok(Some(UpdateVersion {
                e_tag: put.e_tag,
                version: put.version,
            })),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. })
            | Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.client.err("create", key, e)),
        }
    }

    fn put_bytes(&self, key: &ObjectPath, bytes: Bytes) -> Result<()> {
        let (c, k) = (self.client.clone(), key.clone());
        self.client
            .block(key, async move { c.store.put(&k, bytes.into()).await })
            .map(|_| ())
            .map_err(|e| self.client.err("put", key, e))
    }

    /// Aborts upload `id` of `key`; not an error if the store no longer knows it (aborted, or
    /// completed: completing made the object, which an abort leaves alone).
    fn abort_upload(&self, key: &ObjectPath, id: &str) -> Result<()> {
        let (c, k, id) = (self.client.clone(), key.clone(), id.to_string());
        match self.client.block(
            key,
            async move { c.multipart.abort_multipart(&k, &id).await },
        ) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.client.err("abort the upload of", key, e)),
        }
    }

    /// What upload marker `name` records, if it is one, is still there and reads as a record:
    /// the data object's key and the record. The key comes from the marker's own name, never
    /// from its contents: a marker cannot make us abort another object's upload.
    fn marker_record(&self, name: &str) -> Result<Option<(ObjectPath, UploadRecord)>> {
        let Some(data) = upload_marker_target(name) else {
            return Ok(None);
        };
        let Some((bytes, _)) = self.get_versioned(&self.key(name)?, 4096)? else {
            return Ok(None);
        };
        match UploadRecord::parse(&bytes) {
            Some(record) => Ok(Some((self.key(data)?, record))),
            None => Ok(None),
        }
    }

    fn delete(&self, key: &ObjectPath) -> Result<()> {
        let (c, k) = (self.client.clone(), key.clone());
        match self
            .client
            .block(key, async move { c.store.delete(&k).await })
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.client.err("remove", key, e)),
        }
    }

    /// The object's bytes and version, or `None` if it does not exist.
    fn get_versioned(
        &self,
        key: &ObjectPath,
        limit: u64,
    ) -> Result<Option<(Bytes, UpdateVersion)>> {
        let (c, k) = (self.client.clone(), key.clone());
        let got = self.client.block(key, async move {
            let r = c.store.get(&k).await?;
            if r.meta.size > limit {
                return Ok(Err(r.meta.size));
            }
            let version = UpdateVersion {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            Ok(Ok((r.bytes().await?, version)))
        });
        match got {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(size)) => Err(Error::Corrupt {
                file: self.client.url(key),
                what: format!("{size} bytes, more than the {limit} allowed for this kind of file"),
            }),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.client.err("read", key, e)),
        }
    }
}

impl Storage for ObjectStorage {
    fn location(&self) -> String {
        self.url.clone()
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn create(&self, name: &str, len: u64) -> Result<Box<dyn WriteHandle>> {
        let key = self.key(name)?;
        let part_size = self.part_size.max(len.div_ceil(MAX_PARTS));
        if len <= part_size {
            return Ok(Box::new(ObjectWrite::whole(self.client.clone(), key, len)));
        }
        let (c, k) = (self.client.clone(), key.clone());
        let upload = self
            .client
            .block(&key, async move { c.multipart.create_multipart(&k).await })
            .map_err(|e| self.client.err("start the upload of", &key, e))?;
        // An upload a killed writer leaves is invisible to listings; its marker is not, and
        // says how to abort it (see `clean_ended_writers`).
        static UPLOADS: AtomicU64 = AtomicU64::new(0);
        let marker = self.key(&format!(
            "{name}{TMP_MARK}{}-{}{UPLOAD_MARK}",
            crate::storage::identity::process_token(),
            UPLOADS.fetch_add(1, Ordering::Relaxed)
        ))?;
        let record = UploadRecord::of_this_process(upload.clone());
        if let Err(e) = self.put_bytes(&marker, record.to_bytes()) {
            let (c, k, id) = (self.client.clone(), key.clone(), upload.clone());
            let _ = self.client.block(
                &key,
                async move { c.multipart.abort_multipart(&k, &id).await },
            );
            return Err(e);
        }
        Ok(Box::new(ObjectWrite::in_parts(
            self.client.clone(),
            key,
            len,
            upload,
            marker,
            part_size,
            self.uploads.clone(),
        )))
    }

    fn put(&self, name: &str, bytes: &[u8], _durable: bool) -> Result<()> {
        self.put_bytes(&self.key(name)?, Bytes::copy_from_slice(bytes))
    }

    /// A conditional PUT of the version read, where the store honours it: a compare-and-swap
    /// that no other writer can slip into.
    fn put_if_unchanged(
        &self,
        name: &str,
        bytes: &[u8],
        expected: Option<&[u8]>,
        durable: bool,
    ) -> Result<bool> {
        if !self.honours_conditional_create()? {
            return super::check_then_put(self, name, bytes, expected, durable);
        }
        let key = self.key(name)?;
        let limit = expected.map_or(0, |e| e.len() as u64) + 1;
        let mode = match self.get_versioned(&key, limit) {
            Ok(None) if expected.is_none() => PutMode::Create,
            Ok(Some((now, version))) if expected == Some(&now[..]) => PutMode::Update(version),
            Ok(_) | Err(Error::Corrupt { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        let put = self.put_conditional(&key, Bytes::copy_from_slice(bytes), mode)?;
        Ok(put.is_some())
    }

    fn create_exclusive(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        let key = self.key(name)?;
        if self.honours_conditional_create()? {
            return self.put_if_absent(&key, Bytes::copy_from_slice(bytes));
        }
        // Check, then put: racing creators may both succeed (see the module docs).
        if self.exists(name)? {
            return Ok(false);
        }
        self.put_bytes(&key, Bytes::copy_from_slice(bytes))?;
        Ok(true)
    }

    fn open(&self, name: &str) -> Result<Box<dyn ReadHandle>> {
        let key = self.key(name)?;
        let (c, k) = (self.client.clone(), key.clone());
        let meta = self
            .client
            .block(&key, async move { c.store.head(&k).await })
            .map_err(|e| self.client.err("open", &key, e))?;
        Ok(Box::new(ObjectRead {
            client: self.client.clone(),
            key,
            len: meta.size,
        }))
    }

    fn get(&self, name: &str, limit: u64) -> Result<Vec<u8>> {
        let key = self.key(name)?;
        match self.get_versioned(&key, limit)? {
            Some((bytes, _)) => Ok(bytes.to_vec()),
            None => Err(self.client.err(
                "read",
                &key,
                object_store::Error::NotFound {
                    path: key.to_string(),
                    source: "no such object".into(),
                },
            )),
        }
    }

    fn exists(&self, name: &str) -> Result<bool> {
        let key = self.key(name)?;
        let (c, k) = (self.client.clone(), key.clone());
        match self
            .client
            .block(&key, async move { c.store.head(&k).await })
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.client.err("look up", &key, e)),
        }
    }

    fn list(&self) -> Result<Vec<String>> {
        Ok(self
            .list_level()?
            .objects
            .into_iter()
            .filter_map(|o| o.location.filename().map(str::to_string))
            .collect())
    }

    fn list_dirs(&self) -> Result<Vec<String>> {
        Ok(self
            .list_level()?
            .common_prefixes
            .into_iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Removing an upload marker aborts the upload it records first.
    fn remove(&self, name: &str) -> Result<()> {
        if let Some((data, record)) = self.marker_record(name)? {
            self.abort_upload(&data, &record.upload_id)?;
        }
        self.delete(&self.key(name)?)
    }

    /// Aborts the uploads that processes of this pid namespace (this machine, this boot) left
    /// when they ended without finishing them (killed), found through their markers.
    fn clean_ended_writers(&self) -> Result<Vec<String>> {
        let mut cleaned = Vec::new();
        for name in self.list()? {
            let Some((data, record)) = self.marker_record(&name)? else {
                continue;
            };
            if crate::storage::identity::has_ended(&record.namespace, record.pid, record.start) {
                self.abort_upload(&data, &record.upload_id)?;
                self.delete(&self.key(&name)?)?;
                cleaned.push(name);
            }
        }
        Ok(cleaned)
    }

    /// Nothing to do: an object is durable once its PUT or upload completes.
    fn sync_dir(&self) -> Result<()> {
        Ok(())
    }

    fn lock_commit(&self, wait: Duration) -> Result<Box<dyn CommitLock>> {
        lock::take(self, wait)
    }
}

/// The end of an upload marker's name: `<data file>.tmp-<writer>.upload`.
const UPLOAD_MARK: &str = ".upload";

/// The data file whose upload marker `name` is, if it is one.
fn upload_marker_target(name: &str) -> Option<&str> {
    let (data, rest) = name.split_once(TMP_MARK)?;
    rest.ends_with(UPLOAD_MARK).then_some(data)
}

/// What an upload marker holds: the upload, and the process that owns it.
#[derive(serde::Serialize, serde::Deserialize)]
struct UploadRecord {
    upload_id: String,
    /// For people reading the marker.
    host: String,
    /// The pid namespace of the process ([`crate::storage::identity::pid_namespace`]); empty if unknown.
    #[serde(default)]
    namespace: String,
    pid: u32,
    /// When the process started ([`crate::storage::identity::process_start`]); 0 if unknown.
    start: u64,
}

impl UploadRecord {
    fn of_this_process(upload_id: String) -> Self {
        let pid = std::process::id();
        Self {
            upload_id,
            host: crate::storage::identity::host_name(),
            namespace: crate::storage::identity::pid_namespace()
                .unwrap_or_default()
                .to_string(),
            pid,
            start: crate::storage::identity::process_start(pid).unwrap_or(0),
        }
    }

    fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("a plain struct serializes"))
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }
}

struct ObjectRead {
    client: Arc<Client>,
    key: ObjectPath,
    len: u64,
}

impl ReadHandle for ObjectRead {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn is_remote(&self) -> bool {
        true
    }

    /// Merges neighbouring ranges ([`fetch_plan`]) and sends the ranged GETs concurrently, up to
    /// [`READ_CONCURRENCY`] at a time; each answer is copied into place as it streams in, so
    /// memory stays within the buffers plus [`ARRIVING_PIECES`] pieces of answers.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.read_many_counted(reads).map(|_| ())
    }

    fn read_many_counted(&self, reads: &mut [(u64, &mut [u8])]) -> Result<u64> {
        let mut wanted = Vec::with_capacity(reads.len());
        for (offset, buf) in reads.iter() {
            let end = offset.saturating_add(buf.len() as u64);
            if end > self.len {
                return Err(Error::Corrupt {
                    file: self.client.url(&self.key),
                    what: format!("ends before byte {end} (truncated)"),
                });
            }
            wanted.push(*offset..end);
        }
        let requests = fetch_plan(&wanted, READ_PIECE);
        if requests.is_empty() {
            return Ok(0);
        }
        let fetched: u64 = requests.iter().map(|r| r.end - r.start).sum();
        self.client
            .check_answering()
            .map_err(|e| self.client.err("read", &self.key, e))?;
        let started = Instant::now();
        // The answers stream back a few KiB at a time, each copied into place as it arrives: no
        // request's answer is gathered whole first (a copy more, and up to 8 MiB a request).
        let (tx, mut rx) = futures::channel::mpsc::channel(ARRIVING_PIECES);
        let (c, k, reqs) = (self.client.clone(), self.key.clone(), requests.clone());
        runtime().spawn(async move {
            use futures::{SinkExt, StreamExt};
            futures::stream::iter(reqs)
                .for_each_concurrent(READ_CONCURRENCY, |r| {
                    let (c, k, mut tx) = (c.clone(), k.clone(), tx.clone());
                    async move {
                        let opts = GetOptions::new().with_range(Some(r.clone()));
                        let mut body = match c.store.get_opts(&k, opts).await {
                            Ok(got) => got.into_stream(),
                            Err(e) => {
                                let _ = tx.send(Arrived::Failed(e)).await;
                                return;
                            }
                        };
                        let mut at = r.start;
                        while let Some(piece) = body.next().await {
                            let (arrived, failed) = match piece {
                                Ok(bytes) => {
                                    let from = at;
                                    at += bytes.len() as u64;
                                    (Arrived::Bytes(r.clone(), from, bytes), false)
                                }
                                Err(e) => (Arrived::Failed(e), true),
                            };
                            // A send fails once the reader gave up after an error.
                            if tx.send(arrived).await.is_err() || failed {
                                return;
                            }
                        }
                        let _ = tx.send(Arrived::Ended(r.clone(), at - r.start)).await;
                    }
                })
                .await;
        });
        let mut ended = 0;
        while ended < requests.len() {
            let Some(arrived) = futures::executor::block_on(futures::StreamExt::next(&mut rx))
            else {
                return Err(Error::Mismatch(format!(
                    "internal: the reads of {} ended early",
                    self.client.url(&self.key)
                )));
            };
            let came_back = |r: &Range<u64>, n: u64| Error::Corrupt {
                file: self.client.url(&self.key),
                what: format!(
                    "bytes {}..{} came back as {n} bytes (the object changed or ends early)",
                    r.start, r.end
                ),
            };
            match arrived {
                Arrived::Failed(e) => {
                    self.client.note_answer(started, Some(&e));
                    return Err(self.client.err("read", &self.key, e));
                }
                Arrived::Ended(r, n) => {
                    if n != r.end - r.start {
                        return Err(came_back(&r, n));
                    }
                    ended += 1;
                }
                Arrived::Bytes(r, at, got) => {
                    let end = at + got.len() as u64;
                    if end > r.end {
                        return Err(came_back(&r, end - r.start));
                    }
                    for (offset, buf) in reads.iter_mut() {
                        let lo = at.max(*offset);
                        let hi = end.min(*offset + buf.len() as u64);
                        if lo < hi {
                            buf[(lo - *offset) as usize..(hi - *offset) as usize]
                                .copy_from_slice(&got[(lo - at) as usize..(hi - at) as usize]);
                        }
                    }
                }
            }
        }
        self.client.note_answer(started, None);
        Ok(fetched)
    }
}

/// The largest ranged GET of a read: larger reads go as several requests at once, which a store
/// serves faster than one stream. 8 MiB, as the plain GETs that Garage served fastest here
/// (4 MiB requests were slower per byte).
const READ_PIECE: u64 = 8 << 20;

/// Where a read cuts a long range into requests: on multiples of this (see [`fetch_plan`]).
const READ_ALIGN: u64 = 1 << 20;

/// Most ranged GETs in flight for one [`ReadHandle::read_many`].
const READ_CONCURRENCY: usize = 8;

/// Pieces of answers that may wait for the reader of one [`ReadHandle::read_many`] to copy them
/// into place (each as large as the HTTP client reads at once, a few KiB to a few hundred).
const ARRIVING_PIECES: usize = 64;

/// What the requests of one [`ReadHandle::read_many`] hand its reader.
enum Arrived {
    /// Bytes of the answer to request `.0`, starting at byte `.1` of the object.
    Bytes(Range<u64>, u64, Bytes),
    /// The answer to a request ended after this many bytes.
    Ended(Range<u64>, u64),
    /// A request failed.
    Failed(object_store::Error),
}

/// The largest gap between two wanted ranges that is fetched rather than cut (a request costs a
/// round trip; a small gap costs less).
const MERGE_GAP: u64 = 256 << 10;

/// The ranged GETs that fetch byte ranges `wanted` of an object. Overlapping and touching ranges
/// merge; ranges a small gap apart merge too, as long as the gaps of a merged run stay within 1/16
/// of its wanted bytes (so at most 1/16 more is read than wanted); each run is cut into as few
/// requests as pieces of `piece` bytes need, the cuts on multiples of [`READ_ALIGN`] (so a
/// request may exceed `piece` by less than that). Sorted, disjoint, none empty.
fn fetch_plan(wanted: &[Range<u64>], piece: u64) -> Vec<Range<u64>> {
    let mut sorted: Vec<Range<u64>> = wanted.iter().filter(|r| !r.is_empty()).cloned().collect();
    sorted.sort_by_key(|r| r.start);
    // (run, wanted bytes in it, gap bytes in it)
    let mut runs: Vec<(Range<u64>, u64, u64)> = Vec::new();
    for r in sorted {
        if let Some((run, want, gaps)) = runs.last_mut() {
            if r.start <= run.end {
                *want += r.end.saturating_sub(run.end);
                run.end = run.end.max(r.end);
                continue;
            }
            let gap = r.start - run.end;
            let more = r.end - r.start;
            if gap <= MERGE_GAP && (*gaps + gap) * 16 <= *want + more {
                *want += more;
                *gaps += gap;
                run.end = r.end;
                continue;
            }
        }
        let want = r.end - r.start;
        runs.push((r, want, 0));
    }
    let piece = piece.max(1);
    // Cuts inside a run fall on multiples of `align` where pieces are large enough: a store that
    // keeps objects in blocks (Garage: 1 MiB) reads a block whole for each request that touches
    // it, so a cut inside one makes it read that block twice.
    let align = if piece >= 2 * READ_ALIGN {
        READ_ALIGN
    } else {
        1
    };
    let mut requests = Vec::new();
    for (run, _, _) in runs {
        let len = run.end - run.start;
        let n = len.div_ceil(piece);
        let mut at = run.start;
        for k in 1..n {
            let ideal = run.start + (u128::from(len) * u128::from(k) / u128::from(n)) as u64;
            let cut = ideal / align * align;
            let cut = if cut > at { cut } else { ideal };
            requests.push(at..cut);
            at = cut;
        }
        requests.push(at..run.end);
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_resolve_dots_and_never_leave_the_bucket() {
        assert_eq!(parse_s3_url("s3://b").unwrap(), ("b".into(), "".into()));
        assert_eq!(
            parse_s3_url("s3://b/x//y/").unwrap(),
            ("b".into(), "x/y".into())
        );
        assert_eq!(
            parse_s3_url("s3://b/ck/step2/../step1").unwrap(),
            ("b".into(), "ck/step1".into())
        );
        for bad in [
            "s3:///x",
            "s3://b/..",
            "s3://b/x/../../y",
            "gs://b/x",
            "s3://b/a\n",
        ] {
            assert!(parse_s3_url(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        /// Every wanted byte is fetched, at most 1/16 more than wanted is, no request is larger
        /// than a piece, and requests stay few: one per piece of a merged run.
        #[test]
        fn fetch_plans_cover_merge_and_bound(
            wanted in proptest::collection::vec((0u64..1 << 24, 0u64..1 << 22), 0..12),
            piece in 1u64..1 << 23,
        ) {
            let wanted: Vec<Range<u64>> = wanted.iter().map(|&(s, n)| s..s + n).collect();
            let plan = fetch_plan(&wanted, piece);
            for w in plan.windows(2) {
                proptest::prop_assert!(w[0].end <= w[1].start, "sorted and disjoint: {plan:?}");
            }
            let align = if piece >= 2 * READ_ALIGN { READ_ALIGN } else { 1 };
            for r in &plan {
                proptest::prop_assert!(!r.is_empty() && r.end - r.start <= piece + align);
            }
            // Requests that abut were cut from one run: the cut is aligned.
            for w in plan.windows(2) {
                if w[0].end == w[1].start {
                    proptest::prop_assert!(w[0].end % align == 0, "cut at {}: {plan:?}", w[0].end);
                }
            }
            let mut union: Vec<Range<u64>> = Vec::new();
            let mut sorted: Vec<_> = wanted.iter().filter(|r| !r.is_empty()).cloned().collect();
            sorted.sort_by_key(|r| r.start);
            for r in sorted {
                match union.last_mut() {
                    Some(u) if r.start <= u.end => u.end = u.end.max(r.end),
                    _ => union.push(r),
                }
            }
            for u in &union {
                let mut at = u.start;
                for r in plan.iter().filter(|r| r.end > u.start && r.start < u.end) {
                    proptest::prop_assert!(r.start <= at, "byte {at} is not fetched");
                    at = at.max(r.end);
                }
                proptest::prop_assert!(at >= u.end, "bytes {at}..{} are not fetched", u.end);
            }
            let want: u64 = union.iter().map(|u| u.end - u.start).sum();
            let fetched: u64 = plan.iter().map(|r| r.end - r.start).sum();
            proptest::prop_assert!(fetched * 16 <= want * 17, "{fetched} fetched for {want}");
            proptest::prop_assert!(plan.len() as u64 <= union.len() as u64 + fetched / piece);
        }
    }

    /// A writer's unfinished upload is aborted by a later cleanup only once its process has ended.
    #[test]
    fn only_uploads_of_ended_writers_are_cleaned_up() {
        let store = Arc::new(object_store::memory::InMemory::new());
        let storage = ObjectStorage::with_store(store, "memory://test", "ck");
        let len = 3 * MIN_PART_SIZE;
        let live = storage.create("live.safetensors", len).unwrap();
        live.write_at(0, &vec![1; MIN_PART_SIZE as usize]).unwrap();
        let dead = storage.create("dead.safetensors", len).unwrap();
        let markers = storage.list().unwrap();
        assert_eq!(markers.len(), 2, "one marker per open upload: {markers:?}");
        assert!(
            storage.clean_ended_writers().unwrap().is_empty(),
            "this process runs"
        );

        // Make the second upload's record name a process of this machine that has ended.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = crate::storage::identity::process_start(pid).expect("a running child");
        child.kill().unwrap();
        child.wait().unwrap();
        let marker = markers.iter().find(|m| m.starts_with("dead.")).unwrap();
        let mut record = UploadRecord::parse(&storage.get(marker, 4096).unwrap()).unwrap();
        (record.pid, record.start) = (pid, start);
        storage.put(marker, &record.to_bytes(), false).unwrap();
        assert_eq!(storage.clean_ended_writers().unwrap(), vec![marker.clone()]);
        assert!(
            dead.write_at(0, &vec![2; MIN_PART_SIZE as usize]).is_err() || {
                // Some stores take parts of an aborted upload; none completes it.
                (1..3).for_each(|i| {
                    let at = i * MIN_PART_SIZE;
                    let _ = dead.write_at(at, &vec![2; MIN_PART_SIZE as usize]);
                });
                dead.commit(false).is_err()
            }
        );
        assert!(!storage.exists("dead.safetensors").unwrap());

        // The live upload finishes, and leaves no marker.
        for i in 1..3 {
            live.write_at(i * MIN_PART_SIZE, &vec![1; MIN_PART_SIZE as usize])
                .unwrap();
        }
        live.commit(false).unwrap();
        assert_eq!(
            storage.list().unwrap(),
            vec!["live.safetensors".to_string()]
        );
        assert_eq!(
            upload_marker_target("a.safetensors.tmp-1-2.upload"),
            Some("a.safetensors")
        );
        assert_eq!(upload_marker_target("a.safetensors.tmp-1-2"), None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]
        /// A file written in any order of pieces, whatever the limits on parts filling in memory
        /// (the rest fill in temporary files) and in flight, and cut short or not, is stored
        /// byte for byte, as is a file smaller than a part (put whole); the part buffers alive
        /// never pass the limits, and every place among the parts filling in memory is given
        /// back, after a commit and after an abort.
        #[test]
        fn parts_filling_in_memory_or_in_files_store_the_same_bytes(
            filling in 0usize..3,
            in_flight in 1usize..3,
            pieces_per_part in 1u64..4,
            order_seed in proptest::prelude::any::<u64>(),
            abort in proptest::prelude::any::<bool>(),
            whole in proptest::prelude::any::<bool>(),
            cut in 0u64..12_345,
        ) {
            let store = Arc::new(object_store::memory::InMemory::new());
            let mut storage = ObjectStorage::with_store(store, "memory://test", "ck");
            storage.uploads = Arc::new(UploadSlots::new(in_flight, filling));
            // Four parts and a short last one, or less than one part; written up to `cut`
            // bytes before their end, where they are cut.
            let planned = if whole { MIN_PART_SIZE / 2 + 12_345 } else { 4 * MIN_PART_SIZE + 12_345 };
            let len = planned - cut;
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
            let piece = MIN_PART_SIZE / pieces_per_part;
            let mut pieces: Vec<u64> = (0..len.div_ceil(piece)).collect();
            // An order by the seed: pieces of different parts interleave.
            pieces.sort_by_key(|&k| saver_core::partition::fmix64(k ^ order_seed));
            let file = storage.create("a.safetensors", planned).unwrap();
            for &k in &pieces {
                let at = k * piece;
                let end = (at + piece).min(len);
                file.write_at(at, &bytes[at as usize..end as usize]).unwrap();
                let (f, t, s) = storage.uploads.buffers();
                proptest::prop_assert!(f <= filling && t <= in_flight);
                proptest::prop_assert!(f + t + s <= storage.uploads.most_buffers());
            }
            if cut > 0 {
                file.truncate(len).unwrap();
            }
            if abort {
                file.abort();
                proptest::prop_assert!(!storage.exists("a.safetensors").unwrap());
            } else {
                file.commit(false).unwrap();
                proptest::prop_assert!(storage.get("a.safetensors", len).unwrap() == bytes);
            }
            let (f, t, _) = storage.uploads.buffers();
            proptest::prop_assert_eq!((f, t), (0, 0));
        }
    }

    #[test]
    fn store_errors_fit_on_one_line() {
        let xml =
            "list: Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?>\
                   <Error><Code>NoSuchBucket</Code><Message>Bucket not found: b</Message></Error>";
        assert_eq!(
            one_line(xml),
            "list: Server returned non-2xx status code: 404 Not Found NoSuchBucket: Bucket not found: b"
        );
        assert_eq!(one_line("a\n  b"), "a b");
        assert!(one_line(&"x ".repeat(1000)).len() < 420);
    }

    #[test]
    fn only_loopback_endpoints_get_plain_http_by_themselves() {
        for ok in [
            "http://127.0.0.1:3900",
            "http://localhost:3900/",
            "http://[::1]:3900",
            "http://127.2.3.4",
        ] {
            assert!(is_loopback_http(ok), "{ok}");
        }
        for no in [
            "https://127.0.0.1:3900",
            "http://10.0.0.1:3900",
            "http://s3.example.com",
            "http://localhost.example.com",
            "",
        ] {
            assert!(!is_loopback_http(no), "{no}");
        }
    }
}

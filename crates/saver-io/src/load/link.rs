//! One link of a checkpoint: one committed save, opened. Its index, manifest and every data file's header are validated
//! against each other before any tensor byte is read.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::de::DeserializeOwned;

use saver_core::manifest::FileManifest;
use saver_core::naming::{SaverFile, INDEX_FILE};
use saver_core::{Index, Manifest};

use crate::error::{Error, Result};
use crate::load::ahead::ReadAhead;
use crate::load::documents::{get_if_exists, MAX_JSON_BYTES};
use crate::load::frames::FrameRead;
use crate::load::header::{parse_header, MAX_HEADER_BYTES};
use crate::load::open_files::DataFile;
use crate::storage::at_once::{calls_at_once, each_at_once};
use crate::storage::{ReadHandle, Storage};

/// A data file, opened and checked.
pub(crate) struct OpenFile {
    pub handle: Box<dyn ReadHandle>,
}

/// One committed save, opened for reading: a full checkpoint, or one link of a delta's chain.
/// Read it through [`crate::Checkpoint`], which follows a delta's parents.
pub struct Link {
    storage: Arc<dyn Storage>,
    index: Index,
    manifest: Manifest,
    files: HashMap<String, DataFile>,
    /// Bytes its files delivered so far, merged ranges' gaps included.
    fetched: AtomicU64,
    /// Tensors a load read ahead ([`crate::load::ahead`]).
    ahead: ReadAhead,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("location", &self.storage.location())
            .field("save_id", &self.manifest.save_id)
            .finish()
    }
}

/// Describes what an uncommitted directory holds, for the "incomplete" message.
pub(crate) fn describe_incomplete(storage: &dyn Storage) -> Result<String> {
    let names = storage.list()?;
    let mut saves: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for n in names.iter().filter(|n| n.ends_with(".shard.json")) {
        if let Some(SaverFile::Shard { save_id, shard }) = SaverFile::parse(n) {
            saves.entry(save_id.to_string()).or_default().push(shard);
        }
    }
    let mut what = format!("no {INDEX_FILE} (never committed)");
    for (id, shards) in saves {
        // Read one shard manifest to learn how many shards the save needs.
        let total = shards
            .first()
            .and_then(|&s| crate::load::documents::read_shard_manifest(storage, &id, s).ok())
            .map(|m| m.shard_num);
        match total {
            Some(n) => {
                let missing: Vec<u32> = (0..n).filter(|s| !shards.contains(s)).collect();
                what += &if missing.is_empty() {
                    // Every shard is durable: only the commit is missing (a process of the
                    // save committing now, or one killed or refused at its commit).
                    format!(
                        "; save {id}: all {n} shards written, but the commit is missing (under \
                         way, or cut short: a process of the save that waits for the commit, \
                         SaveOptions::wait or --wait-seconds, makes it)"
                    )
                } else {
                    format!(
                        "; save {id}: {} of {n} shards written, missing shards {missing:?}",
                        shards.len()
                    )
                };
            }
            None => what += &format!("; save {id}: shards {shards:?} written"),
        }
    }
    if names.is_empty() {
        what += "; the directory is empty";
    }
    Ok(what)
}

/// How many times a reader starts over when the checkpoint it reads is replaced under it.
const MAX_REOPENS: usize = 32;

/// Runs `read` on the committed checkpoint of `storage` and starts over, up to [`MAX_REOPENS`]
/// times, when its outcome is `failed` and the index changed meanwhile. A save that replaces a
/// checkpoint removes the old one's files after its commit, so a reader caught in between would
/// otherwise report a checkpoint that was never corrupt as corrupt: now it reports the new one.
/// An outcome on an index that did not change stands.
pub(crate) fn retry_if_replaced<T>(
    storage: &dyn Storage,
    mut read: impl FnMut() -> Result<T>,
    failed: impl Fn(&Result<T>) -> bool,
) -> Result<T> {
    let index = || storage.get(INDEX_FILE, MAX_JSON_BYTES).ok();
    let mut before = index();
    let mut out = read();
    for _ in 0..MAX_REOPENS {
        if !failed(&out) {
            return out;
        }
        let now = index();
        if now == before {
            return out;
        }
        before = now;
        out = read();
    }
    // Still failing, on a checkpoint replaced once more meanwhile: the outcome says nothing
    // about any checkpoint.
    if failed(&out) && index() != before {
        return Err(Error::KeptReplaced {
            location: storage.location(),
            times: MAX_REOPENS,
        });
    }
    out
}

/// Runs `read`, which opens the checkpoint (or chain) in `dir` and reads it, and runs it again on
/// the new checkpoint when it failed and the index changed meanwhile: a save that replaces a
/// checkpoint removes the old one's files after its commit, and an object store, unlike a local
/// directory, does not keep a removed object readable for whoever opened it. So a reader racing
/// an overwrite reports the old or the new checkpoint, never a missing object. An error on an
/// index that did not change stands; after 32 reopens, [`Error::KeptReplaced`]. A `dir` that
/// holds no checkpoint (a plain input) is read once.
pub fn read_latest<T>(dir: &Path, mut read: impl FnMut() -> Result<T>) -> Result<T> {
    match crate::storage::open_location(dir) {
        Ok(storage) if storage.exists(INDEX_FILE).unwrap_or(false) => {
            retry_if_replaced(&*storage, read, Result::is_err)
        }
        _ => read(),
    }
}

/// Reads the index and the manifest it names, checking they agree.
pub(crate) fn load_manifest(storage: &dyn Storage) -> Result<(Index, Manifest)> {
    let Some(bytes) = get_if_exists(storage, INDEX_FILE, MAX_JSON_BYTES)? else {
        return Err(Error::Incomplete {
            dir: storage.location().into(),
            what: describe_incomplete(storage)?,
        });
    };
    let index = Index::parse(&bytes, INDEX_FILE)?;
    let name = &index.metadata.saver_manifest;
    let bytes = storage.get(name, MAX_JSON_BYTES).map_err(|e| match e {
        // Permission denied, an I/O error: the reader's trouble, not the checkpoint's.
        e if !e.is_about_the_checkpoint() => e,
        e => Error::Corrupt {
            file: INDEX_FILE.into(),
            what: format!("names manifest {name:?}, which cannot be read: {e}"),
        },
    })?;
    let manifest = Manifest::parse_committed(&bytes, &index)?;
    Ok((index, manifest))
}

/// Opens a data file and checks its size and header against the manifest.
pub(crate) fn open_file(
    storage: &dyn Storage,
    m: &Manifest,
    fm: &FileManifest,
) -> Result<OpenFile> {
    let corrupt = |what: String| Error::Corrupt {
        file: fm.name.clone(),
        what,
    };
    let handle = storage.open(&fm.name)?;
    if handle.len() != fm.bytes {
        return Err(corrupt(format!(
            "{} bytes, the manifest says {} ({})",
            handle.len(),
            fm.bytes,
            if handle.len() < fm.bytes {
                "truncated"
            } else {
                "extended"
            }
        )));
    }
    if fm.data_start > MAX_HEADER_BYTES + 8 || fm.data_start > fm.bytes {
        return Err(corrupt(format!(
            "data start {} is impossible",
            fm.data_start
        )));
    }
    let mut raw = vec![0u8; fm.data_start as usize];
    handle.read_at(0, &mut raw)?;
    if crc32fast::hash(&raw) != fm.header_crc32 {
        return Err(corrupt(
            "header checksum does not match the manifest".into(),
        ));
    }
    // The bytes just checksummed are the header: parse them rather than read them again.
    let header = parse_header(&raw, handle.len(), &fm.name)?;
    if header.data_start != fm.data_start {
        return Err(corrupt(format!(
            "data starts at {}, the manifest says {}",
            header.data_start, fm.data_start
        )));
    }
    let expected: HashMap<&str, &saver_core::manifest::TensorRef> = m
        .tensor_refs()
        .filter(|t| t.file == fm.name)
        .map(|t| (t.name.as_str(), t))
        .collect();
    if expected.len() != header.tensors.len() {
        return Err(corrupt(format!(
            "{} tensors in the header, {} in the manifest",
            header.tensors.len(),
            expected.len()
        )));
    }
    for t in &header.tensors {
        let r = expected
            .get(t.name.as_str())
            .ok_or_else(|| corrupt(format!("tensor {:?} is not in the manifest", t.name)))?;
        // A compressed tensor is a U8 tensor of its stored bytes in the file's header.
        let same_type = match &r.codec {
            Some(c) => t.dtype == saver_core::Dtype::U8 && t.shape == [c.stored],
            None => t.dtype == r.dtype && t.shape == r.shape,
        };
        if !same_type || r.offset != t.offset || r.stored_len() != t.len {
            return Err(corrupt(format!(
                "tensor {:?} differs between header and manifest",
                t.name
            )));
        }
    }
    Ok(OpenFile { handle })
}

/// Byte ranges of one file to read: `(offset in the file, buffer)`.
type FileReads<'a> = Vec<(u64, &'a mut [u8])>;

impl Link {
    /// Opens the checkpoint in directory `dir`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_storage(crate::storage::open_location(dir.as_ref())?)
    }

    /// Opens the checkpoint in `storage`.
    ///
    /// Every data file is opened and its header checked here. Files are read through these
    /// handles later, so a checkpoint replaced (and its files removed) after `open` returns stays
    /// readable, as long as the process keeps fewer data files open than half its descriptor
    /// limit; past that (the links of a long chain), files are closed after the check and
    /// reopened for each read, which then fails if they are gone (see
    /// [`crate::load::link::read_latest`]). One replaced while `open` runs is opened anew: the result
    /// is the old or the new checkpoint, whole.
    pub fn open_storage(storage: Arc<dyn Storage>) -> Result<Self> {
        Ok(Self::open_storage_beside(storage, |_| ())?.0)
    }

    /// [`Self::open_storage`], calling `beside` with the manifest as soon as it is read: on a
    /// remote store, while the data files' headers are read (a chain opens its parent so,
    /// instead of one link's round trips after another's); elsewhere after them. If the
    /// checkpoint is replaced while it is opened, `beside` is called again with the new manifest.
    pub(crate) fn open_storage_beside<R: Send>(
        storage: Arc<dyn Storage>,
        beside: impl Fn(&Manifest) -> R + Sync,
    ) -> Result<(Self, R)> {
        let ((index, manifest, files), r) = retry_if_replaced(
            storage.as_ref(),
            || {
                let (index, manifest) = load_manifest(storage.as_ref())?;
                if !storage.is_remote() {
                    let files = Self::open_files(&storage, &manifest)?;
                    let r = beside(&manifest);
                    return Ok(((index, manifest, files), r));
                }
                let (files, r) = std::thread::scope(|s| {
                    let alongside = s.spawn(|| beside(&manifest));
                    let files = Self::open_files(&storage, &manifest);
                    let r = alongside
                        .join()
                        .expect("what runs beside an open does not panic");
                    (files, r)
                });
                Ok(((index, manifest, files?), r))
            },
            Result::is_err,
        )?;
        Ok((
            Self {
                storage,
                index,
                manifest,
                files,
                fetched: AtomicU64::new(0),
                ahead: ReadAhead::default(),
            },
            r,
        ))
    }

    /// Opens every data file of `manifest` and checks its header.
    fn open_files(
        storage: &Arc<dyn Storage>,
        manifest: &Manifest,
    ) -> Result<HashMap<String, DataFile>> {
        // Several at once on an object store: each file's look-up and header read are round
        // trips (a checkpoint of 32 files on Garage took 1.5 s to open one by one). Checked in
        // the manifest's order, so the error is the first file's.
        let opened = each_at_once(
            manifest.files.iter().collect(),
            calls_at_once(storage.as_ref()),
            |fm| {
                let f = open_file(storage.as_ref(), manifest, fm)?;
                DataFile::new(storage.clone(), &fm.name, f.handle)
            },
            Result::is_ok,
        );
        let n = opened.len();
        let mut files = HashMap::new();
        for (fm, f) in manifest.files.iter().zip(opened) {
            files.insert(fm.name.clone(), f?);
        }
        // Only a failure stops the opens early, and it was returned just above.
        if n < manifest.files.len() {
            return Err(Error::Mismatch(format!(
                "internal: {n} of the {} data files of {} were opened",
                manifest.files.len(),
                storage.location()
            )));
        }
        Ok(files)
    }

    /// Bytes the checkpoint's files have delivered to its reads so far (a remote store's merged
    /// ranges counted whole): what a load's `bytes_read` and read amplification count.
    pub(crate) fn bytes_fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The global index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Whether this link's directory now commits another save than the one it was opened on
    /// (a save replaced it since): its files may be gone, so what failed reading it says nothing
    /// of the checkpoint there now. An index that cannot be read is no replacement.
    pub(crate) fn was_replaced(&self) -> bool {
        self.storage
            .get(INDEX_FILE, MAX_JSON_BYTES)
            .ok()
            .and_then(|b| Index::parse(&b, INDEX_FILE).ok())
            .is_some_and(|now| {
                now.metadata.saver_manifest != self.index().metadata.saver_manifest
                    || now.metadata.saver_manifest_crc32
                        != self.index().metadata.saver_manifest_crc32
            })
    }

    /// Where the checkpoint is.
    pub fn location(&self) -> String {
        self.storage.location()
    }

    /// Shard `shard`'s trainer state, decoded as `T`.
    pub fn trainer_state<T: DeserializeOwned>(&self, shard: u32) -> Result<Option<T>> {
        Ok(self.manifest.trainer_state(shard)?)
    }

    /// Whether the checkpoint's files are remote (reads wait on network round trips).
    pub(crate) fn is_remote(&self) -> bool {
        self.files.values().any(DataFile::is_remote)
    }

    /// Reads `buf.len()` bytes of tensor `t` from byte `offset` of the tensor.
    pub(crate) fn read_tensor_range(
        &self,
        t: &saver_core::manifest::TensorRef,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        self.read_tensor_ranges(&mut [(t, offset, buf)])
    }

    /// Reads several tensor ranges, `(tensor, offset within it, buffer)`, at once: the ranges of
    /// one file go to its handle together, so an object store merges neighbours and fetches them
    /// concurrently. A compressed tensor's range is read as the stored frames that hold it,
    /// then decompressed into the buffer.
    pub(crate) fn read_tensor_ranges(
        &self,
        reads: &mut [(&saver_core::manifest::TensorRef, u64, &mut [u8])],
    ) -> Result<()> {
        let mut frames: Vec<Option<FrameRead>> = Vec::with_capacity(reads.len());
        for (t, offset, buf) in reads.iter() {
            let end = offset.checked_add(buf.len() as u64);
            if end.is_none_or(|e| e > t.len) {
                return Err(Error::Mismatch(format!(
                    "read of {} bytes at {offset} is outside tensor {:?} ({} bytes)",
                    buf.len(),
                    t.name,
                    t.len
                )));
            }
            frames.push(
                t.codec
                    .is_some()
                    .then(|| FrameRead::plan(t, *offset, buf.len() as u64)),
            );
        }
        let mut by_file: Vec<(&str, FileReads<'_>)> = Vec::new();
        for ((t, offset, buf), fr) in reads.iter_mut().zip(frames.iter_mut()) {
            let (at, dst) = match fr {
                Some(fr) => (fr.file_offset, fr.stored.as_mut_slice()),
                None => (t.offset + *offset, &mut **buf),
            };
            match by_file.iter_mut().find(|(f, _)| *f == t.file) {
                Some((_, list)) => list.push((at, dst)),
                None => by_file.push((&t.file, vec![(at, dst)])),
            }
        }
        self.fetch(by_file)?;
        for ((t, offset, buf), fr) in reads.iter_mut().zip(&frames) {
            if let Some(fr) = fr {
                fr.decode(t, *offset, buf)?;
            }
        }
        Ok(())
    }

    /// What a load read ahead of this link's files.
    pub(crate) fn ahead(&self) -> &ReadAhead {
        &self.ahead
    }

    /// Reads byte ranges of the files, file by file: from what was read ahead where it holds
    /// them, from the storage otherwise.
    fn fetch(&self, by_file: Vec<(&str, FileReads<'_>)>) -> Result<()> {
        let mut groups = Vec::with_capacity(by_file.len());
        for (file, mut list) in by_file {
            list.retain_mut(|(at, dst)| !self.ahead.serve(file, *at, dst));
            if list.is_empty() {
                continue;
            }
            let f = self.files.get(file).ok_or_else(|| Error::Corrupt {
                file: file.to_string(),
                what: "not opened".into(),
            })?;
            groups.push((f, list));
        }
        // A remote file's reads wait on round trips: the files go at once (a few at a time).
        if groups.len() > 1 && groups.iter().any(|(f, _)| f.is_remote()) {
            for batch in groups.chunks_mut(8) {
                std::thread::scope(|scope| {
                    let running: Vec<_> = batch
                        .iter_mut()
                        .map(|(f, list)| scope.spawn(move || f.handle()?.read_many_counted(list)))
                        .collect();
                    running.into_iter().try_for_each(|r| {
                        let n = r.join().expect("a read does not panic")?;
                        self.fetched.fetch_add(n, Ordering::Relaxed);
                        Ok::<(), Error>(())
                    })
                })?;
            }
            return Ok(());
        }
        // One file at a time: a file past the descriptor budget is open only while it is read.
        for (f, mut list) in groups {
            let n = f.handle()?.read_many_counted(&mut list)?;
            self.fetched.fetch_add(n, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads a dense tensor whole, checking its CRC32.
    pub fn read_dense(&self, name: &str) -> Result<Vec<u8>> {
        let d = self
            .manifest
            .dense
            .iter()
            .find(|d| d.tensor.name == name)
            .ok_or_else(|| {
                Error::Mismatch(format!("no dense tensor {name:?} in {}", self.location()))
            })?;
        let mut buf = vec![0u8; d.tensor.len as usize];
        self.read_tensor_range(&d.tensor, 0, &mut buf)?;
        if crc32fast::hash(&buf) != d.tensor.crc32 {
            return Err(Error::Corrupt {
                file: d.tensor.file.clone(),
                what: format!("tensor {name:?} fails its CRC32 check"),
            });
        }
        Ok(buf)
    }
}

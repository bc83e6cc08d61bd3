//! The one reader: [`Checkpoint`], a committed checkpoint opened with every link of its chain.
//!
//! A full checkpoint is a chain of one link, read straight from its segments ([`Link`]). A
//! delta checkpoint names its parent ([`ParentRef`]: a path relative to the delta, the parent's
//! save id and the CRC32 of its manifest) and holds, per table, the rows inserted or changed since
//! the parent and, in the companion table `removed_table_name`, the ids removed since it. The
//! parent may itself be a delta. [`Checkpoint::open`] follows the links to a full checkpoint, checking
//! each one; [`ChainTable`] presents one table of the chain as it would be in a full save of the
//! newest state.
//!
//! Every link stores its rows sorted by (bucket, id bits), so resolving is a k-way merge, bucket
//! range by bucket range: for each id, the newest link that holds it as a row or as a removal
//! decides. Nothing is held beyond a few read buffers per link, and a reader of some buckets (a
//! load for shard `j` of `M`) reads only those buckets of every link.

mod ahead;
mod loads;
mod request;
mod row_range;
mod table;

pub use crate::load::link::read_latest;
use ahead::Ahead;
pub use request::{LoadRequest, Loaded, SinkFor};
pub(crate) use row_range::{parent_lacks, parent_slot, ChangedRowsOrder};
pub use row_range::{LoadedRowSlot, LoadedRowTable, RowsInto, RowsLoaded};
pub use table::ChainTable;

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use rayon::prelude::*;

use saver_core::manifest::{DenseManifest, ParentRef, TableManifest};
use saver_core::naming::removed_table_of;

use crate::error::{io_err, Error, Result};
use crate::load::link::Link;
use crate::load::restore::{globs, read_dense_refs, LoadOptions, LoadedDense};

/// Most links a chain may have, the full checkpoint at its root included. Each link is read by
/// every load, so a longer chain is a sign that it should be compacted (`saver compact`).
pub const MAX_CHAIN_LINKS: usize = 64;

/// `to` relative to `from`, both directories that exist (symbolic links resolved), or both
/// prefixes of one bucket.
pub(crate) fn relative_path(from: &Path, to: &Path) -> Result<String> {
    if let Some(rel) = crate::storage::relative_url(from, to)? {
        return Ok(rel);
    }
    let from = from
        .canonicalize()
        .map_err(io_err("resolve the directory", from))?;
    let to_c = to
        .canonicalize()
        .map_err(io_err("resolve the directory", to))?;
    let a: Vec<Component<'_>> = from.components().collect();
    let b: Vec<Component<'_>> = to_c.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut rel = PathBuf::new();
    for _ in common..a.len() {
        rel.push("..");
    }
    for c in &b[common..] {
        rel.push(c.as_os_str());
    }
    let rel = if rel.as_os_str().is_empty() {
        ".".to_string()
    } else {
        rel.to_str()
            .ok_or_else(|| Error::InvalidOption {
                option: "parent",
                why: format!("{} is not a UTF-8 path", to.display()),
            })?
            .to_string()
    };
    Ok(rel)
}

/// A checkpoint and, if it is a delta, every link down to the full checkpoint it starts from.
///
/// ```
/// use saver_core::{Dtype, EmbeddingTable, KeyDtype, SaveInput, Shard, SlotSpec};
/// use saver_io::{save, Checkpoint, LoadOptions, SaveOptions};
///
/// # let dir = tempfile::tempdir()?;
/// let table = EmbeddingTable::new("item", KeyDtype::I64, vec![SlotSpec::new("w", Dtype::F32, vec![4])])?;
/// for id in 0..1000 {
///     table.upsert(id, |row| row.slot_mut::<f32>(0).fill(id as f32));
/// }
/// save(dir.path(), SaveInput::new().table(&table), &SaveOptions::default())?;
///
/// // Saved as one shard, loaded as three: each worker reads only the bytes of its rows.
/// let ckpt = Checkpoint::open(dir.path())?;
/// let mut rows = 0;
/// for index in 0..3 {
///     let restored = ckpt.restore(&LoadOptions::for_shard(Shard { index, count: 3 }))?;
///     rows += restored.shards[0].tables[0].len();
/// }
/// assert_eq!(rows, 1000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    /// Newest first.
    links: Vec<Link>,
    dirs: Vec<PathBuf>,
    /// Whether a load that fails on a replaced checkpoint runs again on the one there now
    /// ([`Self::on_latest`]); not for a [`Self::pinned`] one.
    follows_replacement: bool,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` and follows its parents. Each parent must exist, be
    /// committed, and be the save its child names (save id and manifest checksum); the chain
    /// must end in a full checkpoint within [`MAX_CHAIN_LINKS`] links and never come back to a
    /// link. Each failure is one error naming the link.
    ///
    /// A checkpoint replaced while it is opened (its files removed by the save that replaced it)
    /// is opened again as it is now (see [`read_latest`]); so are its loads (see
    /// [`Self::on_latest`]).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let open = || {
            let first = Opened::open(crate::storage::open_location(&dir)?, &dir, Vec::new())?;
            Self::follow(first, dir.clone())
        };
        // Only a failed opening pays for the look at whether the checkpoint was replaced (on an
        // object store, a round trip or two): an opening that succeeds reads nothing more.
        open().or_else(|_| read_latest(&dir, open))
    }

    /// This checkpoint, whose loads never move to a checkpoint that replaced it: a load that
    /// fails because its files were removed by the replacing save fails
    /// ([`Self::was_replaced`] then says so), where an unpinned one reads the new checkpoint.
    /// For a reader that reads one request in several loads and must get one save from all
    /// of them: it opens again and starts the whole request over.
    pub fn pinned(mut self) -> Self {
        self.follows_replacement = false;
        self
    }

    /// Opens the checkpoint in `storage`, as [`Self::open`] does; a delta's parents are found
    /// by their paths relative to `storage`'s location.
    pub fn open_storage(storage: std::sync::Arc<dyn crate::storage::Storage>) -> Result<Self> {
        let dir = PathBuf::from(storage.location());
        Self::follow(Opened::open(storage, &dir, Vec::new())?, dir)
    }

    /// The chain that starts at `first`, opened from `dir`.
    fn follow(first: Opened, dir: PathBuf) -> Result<Self> {
        let Opened {
            link: first,
            mut parent,
        } = first;
        let key = |c: &Link| {
            (
                c.manifest().save_id.clone(),
                c.index().metadata.saver_manifest_crc32,
            )
        };
        let mut seen = HashSet::from([key(&first)]);
        let mut links = vec![first];
        let mut dirs = vec![dir];
        loop {
            let child = links.last().expect("one link");
            let child_dir = dirs.last().expect("one link").clone();
            let Some(p) = child.manifest().parent.clone() else {
                break;
            };
            let err = |message: String| Error::Chain {
                link: child_dir.display().to_string(),
                message,
            };
            if links.len() >= MAX_CHAIN_LINKS {
                return Err(err(format!(
                    "its chain has more than {MAX_CHAIN_LINKS} links; compact it into a full \
                     checkpoint (saver compact)"
                )));
            }
            saver_core::manifest::check_parent_path(&p.path)
                .map_err(|why| err(format!("parent {why}")))?;
            if seen.contains(&(p.save_id.clone(), p.manifest_crc32)) {
                return Err(err(format!(
                    "parent {p} is already a link of this chain: the chain is a cycle"
                )));
            }
            let parent_dir = child_dir.join(&p.path);
            // Opened beside its child's data files where the child's open did so.
            let opened = match parent.take() {
                Some(opened) => *opened,
                None => crate::storage::open_location(&parent_dir)
                    .and_then(|s| Opened::open(s, &parent_dir, Vec::new())),
            };
            let parent_link = opened.map(|o| {
                parent = o.parent;
                o.link
            });
            let parent = parent_link.map_err(|e| {
                // A resource or permission error (too many open files, EACCES) says nothing
                // about the chain: it stays what it is, never a broken link.
                if matches!(e, Error::Io { .. }) && !e.is_about_the_checkpoint() {
                    return e;
                }
                err(format!(
                    "parent {} cannot be opened: {e}",
                    parent_dir.display()
                ))
            })?;
            let (save_id, crc) = key(&parent);
            if save_id != p.save_id || crc != p.manifest_crc32 {
                return Err(err(format!(
                    "parent {} holds save {save_id} (manifest crc32 {crc:08x}), not save {} \
                     (crc32 {:08x}) that this delta was made from: it was replaced",
                    parent_dir.display(),
                    p.save_id,
                    p.manifest_crc32
                )));
            }
            if parent.manifest().partition != child.manifest().partition {
                return Err(err(format!(
                    "parent {} has another partition rule",
                    parent_dir.display()
                )));
            }
            seen.insert((save_id, crc));
            links.push(parent);
            dirs.push(parent_dir);
        }
        Ok(Self {
            links,
            dirs,
            follows_replacement: true,
        })
    }

    /// The newest link: the save that was opened.
    pub fn newest(&self) -> &Link {
        &self.links[0]
    }

    /// The manifest of the newest link.
    pub fn manifest(&self) -> &saver_core::Manifest {
        self.newest().manifest()
    }

    /// The global index of the newest link.
    pub fn index(&self) -> &saver_core::Index {
        self.newest().index()
    }

    /// Where the checkpoint (its newest link) is.
    pub fn location(&self) -> String {
        self.newest().location()
    }

    /// Shard `shard`'s trainer state, decoded as `T`.
    pub fn trainer_state<T: serde::de::DeserializeOwned>(&self, shard: u32) -> Result<Option<T>> {
        self.newest().trainer_state(shard)
    }

    /// Every link, newest first; the last is a full checkpoint.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// The directory of each link, as reached from the opened one.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Whether the newest link is a delta.
    pub fn is_delta(&self) -> bool {
        self.links.len() > 1
    }

    /// How a delta saved into `child_dir` (which exists) names this chain's newest link.
    pub(crate) fn parent_ref_for(&self, child_dir: &Path) -> Result<ParentRef> {
        let newest = self.newest();
        Ok(ParentRef {
            path: relative_path(child_dir, &self.dirs[0])?,
            save_id: newest.manifest().save_id.clone(),
            manifest_crc32: newest.index().metadata.saver_manifest_crc32,
        })
    }

    /// The dense tensors of the newest state, each with the link that holds it, by name: the
    /// newest link's, and those it keeps from its parent ([`Manifest::dense_in_parent`]), found
    /// in the nearest link that writes them.
    ///
    /// [`Manifest::dense_in_parent`]: saver_core::Manifest::dense_in_parent
    pub fn dense_refs(&self) -> Result<Vec<(&Link, &DenseManifest)>> {
        let newest = self.newest().manifest();
        let mut out: Vec<(&Link, &DenseManifest)> =
            newest.dense.iter().map(|d| (self.newest(), d)).collect();
        for name in &newest.dense_in_parent {
            let mut found = None;
            for (i, link) in self.links.iter().enumerate().skip(1) {
                let m = link.manifest();
                if let Some(d) = m.dense.iter().find(|d| &d.tensor.name == name) {
                    found = Some((link, d));
                    break;
                }
                // A link that neither writes nor keeps it ends the search: not in the chain.
                if !m.dense_in_parent.contains(name) {
                    return Err(Error::Chain {
                        link: self.dirs[i].display().to_string(),
                        message: format!(
                            "dense tensor {name:?} is kept from this parent, which does not hold it"
                        ),
                    });
                }
            }
            out.push(found.ok_or_else(|| Error::Chain {
                link: self.dirs[0].display().to_string(),
                message: format!("dense tensor {name:?} is in no link of the chain"),
            })?);
        }
        out.sort_by(|a, b| a.1.tensor.name.cmp(&b.1.tensor.name));
        Ok(out)
    }

    /// The dense tensors of the newest state that `opts.dense` selects (all when `None`), read
    /// whole from the links that hold them and checked against their CRC32.
    pub(crate) fn dense_tensors(
        &self,
        opts: Option<&LoadOptions>,
        report: &mut crate::LoadReport,
    ) -> Result<Vec<LoadedDense>> {
        let set = match opts {
            Some(o) => globs("dense", &o.dense)?,
            None => None,
        };
        read_dense_refs(self.dense_refs()?, &set, report)
    }

    /// Reads dense tensor `name` of the newest state whole (from the link that holds it),
    /// checking its CRC32.
    pub fn read_dense(&self, name: &str) -> Result<Vec<u8>> {
        let refs = self.dense_refs()?;
        let (link, _) = refs
            .iter()
            .find(|(_, d)| d.tensor.name == name)
            .ok_or_else(|| {
                Error::Mismatch(format!("no dense tensor {name:?} in {}", self.location()))
            })?;
        link.read_dense(name)
    }

    /// The tables of the newest state (the companion tables of removed ids are not tables),
    /// in manifest order.
    pub fn table_manifests(&self) -> impl Iterator<Item = &TableManifest> {
        self.newest()
            .manifest()
            .tables
            .iter()
            .filter(|t| removed_table_of(&t.name).is_none())
    }

    /// Every selected table (globs `tables`, all if empty) without the slots matching
    /// `exclude_slots`, resolved over the chain, in manifest order.
    pub fn tables(
        &self,
        tables: &[String],
        exclude_slots: &[String],
    ) -> Result<Vec<ChainTable<'_>>> {
        let opts = LoadOptions {
            tables: tables.to_vec(),
            exclude_slots: exclude_slots.to_vec(),
            ..LoadOptions::default()
        };
        self.chain_tables(&self.select(&opts)?)
    }

    /// Bytes the links' files have delivered to reads so far: see [`Link::bytes_fetched`].
    pub(crate) fn bytes_fetched(&self) -> u64 {
        self.links().iter().map(Link::bytes_fetched).sum()
    }
}

impl Checkpoint {
    /// The dense tensors `opts.dense` selects (all when empty), CRC-checked: the newest state's,
    /// each read from the link that holds it.
    pub fn load_dense_tensors(&self, opts: &LoadOptions) -> Result<Vec<LoadedDense>> {
        self.dense_tensors(Some(opts), &mut crate::LoadReport::default())
    }
}

/// A link opened, with its parent if it was opened beside it (see [`Link::open_storage_beside`]).
struct Opened {
    link: Link,
    parent: Option<Box<Result<Opened>>>,
}

impl Opened {
    /// Opens the link in `storage` (at `dir`), and on a remote store its parent beside its data
    /// files, and so on down the chain: a chain of `n` links then waits on `n` manifests' round
    /// trips and one link's data files, not on `n` of each. `seen`: the saves of the links above,
    /// where a cycle stops the opening ahead (`Checkpoint::follow` reports it).
    fn open(
        storage: std::sync::Arc<dyn crate::storage::Storage>,
        dir: &Path,
        seen: Vec<(String, u32)>,
    ) -> Result<Self> {
        let remote = storage.is_remote();
        let (link, parent) = Link::open_storage_beside(storage, |m| {
            let p = m.parent.as_ref().filter(|_| remote)?;
            let key = (p.save_id.clone(), p.manifest_crc32);
            if seen.len() + 1 >= MAX_CHAIN_LINKS
                || seen.contains(&key)
                || saver_core::manifest::check_parent_path(&p.path).is_err()
            {
                return None;
            }
            let mut seen = seen.clone();
            seen.push(key);
            let parent_dir = dir.join(&p.path);
            Some(Box::new(
                crate::storage::open_location(&parent_dir)
                    .and_then(|s| Opened::open(s, &parent_dir, seen)),
            ))
        })?;
        Ok(Self { link, parent })
    }
}

/// Reads ahead what a load of `buckets` of `tables` reads from a remote store (see
/// [`crate::load::ahead`]), on the load's `pool`: in two batches, since the rows of a segment that
/// straddles an edge of `buckets` are found in its ids, which the first one fetches.
fn read_ahead<'c>(
    pool: &rayon::ThreadPool,
    tables: &[ChainTable<'c>],
    buckets: &Range<u32>,
) -> Result<Ahead<'c>> {
    pool.install(|| {
        let mut ahead = Ahead::new();
        ahead.read(
            tables
                .iter()
                .flat_map(|t| t.tensors_within(buckets))
                .collect(),
        )?;
        let straddling: Vec<Vec<_>> = tables
            .par_iter()
            .map(|t| t.straddling_within(buckets))
            .collect::<Result<_>>()?;
        ahead.read(straddling.into_iter().flatten().collect())?;
        Ok(ahead)
    })
}

/// Checks what every table of a load read only in part, all tables at once on the load's `pool`:
/// on a remote store each check waits on a round trip, and a thread a check would wait on them
/// one or two at a time.
pub(super) fn finish_all_checks(pool: &rayon::ThreadPool, tables: &[ChainTable<'_>]) -> Result<()> {
    pool.install(|| tables.par_iter().try_for_each(ChainTable::finish_checks))
}

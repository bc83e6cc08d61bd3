//! Manifest types: what a checkpoint holds and where every byte of it lives.
//!
//! Each shard writes a [`ShardManifest`] once its data files are durable; the process that completes
//! the set merges them into the global [`Manifest`] ([`Manifest::merge`]). Both are JSON. The
//! layout is specified in `docs/FORMAT.md`.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::dtype::{Dtype, KeyDtype};
use crate::error::{Error, Result};
use crate::partition::PartitionRule;
use crate::table::SlotSpec;

/// Marks a document built by this crate: by its parser, which checks it, or by the writer. A
/// document type holds one, so no other crate can build one unchecked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sealed;

/// Declares a document type that can only be parsed (by [`parse`], which checks it) or built by
/// this crate: the public struct, with a [`Sealed`] field and no `Deserialize`, and the private
/// `$raw` twin that serde fills, with the same fields and attributes.
macro_rules! sealed_document {
    (
        $(#[$meta:meta])*
        pub struct $name:ident parsed as $raw:ident $(, serde($($serde:tt)*))? {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Serialize)]
        $(#[serde($($serde)*)])?
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
            #[serde(skip)]
            pub(crate) sealed: $crate::manifest::Sealed,
        }

        #[derive(Deserialize)]
        $(#[serde($($serde)*)])?
        pub(in crate::manifest) struct $raw {
            $( $(#[$fmeta])* $field: $ty, )*
        }

        impl $raw {
            /// The document as parsed, before its checks.
            pub(in crate::manifest) fn unchecked(self) -> $name {
                $name {
                    $( $field: self.$field, )*
                    sealed: $crate::manifest::Sealed,
                }
            }
        }
    };
}

mod index;
mod parse;
mod row_range;
pub mod trainer_state;

pub use index::{Index, IndexMetadata};
pub use parse::{check_parent_path, MAX_DOCUMENT_BYTES};
pub use row_range::{
    ChangedRowsManifest, RowChunkManifest, RowPatchManifest, RowSlotManifest, RowTableManifest,
};

/// Value of the `format` field of every manifest.
pub const FORMAT_NAME: &str = "saver";
/// The on-disk format version of a full checkpoint: what this build writes for one, and the
/// version every older build reads.
pub const FORMAT_VERSION: u32 = 1;
/// The format version of a delta checkpoint (one with a [`ParentRef`]). A build that knows only
/// version 1 refuses it instead of taking its changed rows for the whole model.
pub const DELTA_FORMAT_VERSION: u32 = 2;

/// The format version of a full checkpoint some of whose tensors are compressed
/// ([`TensorRef::codec`]): a build that knows only versions 1 and 2 refuses it instead of reading
/// compressed bytes as values.
pub const COMPRESSED_FORMAT_VERSION: u32 = 3;
/// The format version of a delta some of whose tensors are compressed.
pub const COMPRESSED_DELTA_FORMAT_VERSION: u32 = 4;
/// The format version of a checkpoint with row-range tables ([`RowTableManifest`]), compressed
/// or not: a build that knows only versions 1 to 4 refuses it instead of loading the checkpoint
/// without those tables.
pub const ROW_RANGE_FORMAT_VERSION: u32 = 5;
/// The format version of a delta with row-range tables, whose slots may hold patches (only the
/// rows changed since the parent, [`RowPatchManifest`]): a build that knows only versions 1 to 5
/// refuses it instead of taking a patch's rows for the whole slot.
pub const ROW_RANGE_DELTA_FORMAT_VERSION: u32 = 6;
/// The newest format version this build reads.
pub const NEWEST_FORMAT_VERSION: u32 = ROW_RANGE_DELTA_FORMAT_VERSION;

/// The format version a checkpoint's manifest and index carry: [`FORMAT_VERSION`] for a full
/// checkpoint, [`DELTA_FORMAT_VERSION`] for a delta, and [`COMPRESSED_FORMAT_VERSION`] or
/// [`COMPRESSED_DELTA_FORMAT_VERSION`] when some tensor is compressed. A checkpoint that
/// compresses nothing keeps the version older builds read; [`ROW_RANGE_FORMAT_VERSION`] for one
/// with row-range tables, [`ROW_RANGE_DELTA_FORMAT_VERSION`] for a delta with them.
#[doc(hidden)]
pub fn format_version_of(parent: Option<&ParentRef>, compressed: bool, row_range: bool) -> u32 {
    match (parent.is_some(), compressed) {
        (true, _) if row_range => ROW_RANGE_DELTA_FORMAT_VERSION,
        _ if row_range => ROW_RANGE_FORMAT_VERSION,
        (false, false) => FORMAT_VERSION,
        (true, false) => DELTA_FORMAT_VERSION,
        (false, true) => COMPRESSED_FORMAT_VERSION,
        (true, true) => COMPRESSED_DELTA_FORMAT_VERSION,
    }
}

/// Most entries of a checkpoint's user metadata. A manifest claiming more is refused as it is
/// read, before it takes memory: a re-sealed manifest of 14 M entries made `verify` take 1.9 GB.
pub const MAX_USER_METADATA_ENTRIES: usize = 10_000;

/// Most bytes of a checkpoint's user metadata, keys and values together.
pub const MAX_USER_METADATA_BYTES: usize = 16 << 20;

/// Checks user metadata against [`MAX_USER_METADATA_ENTRIES`] and [`MAX_USER_METADATA_BYTES`]:
/// what a save is given, before it writes.
#[doc(hidden)]
pub fn check_user_metadata(m: &BTreeMap<String, String>) -> Result<()> {
    let bytes: usize = m.iter().map(|(k, v)| k.len() + v.len()).sum();
    if m.len() > MAX_USER_METADATA_ENTRIES || bytes > MAX_USER_METADATA_BYTES {
        return Err(Error::Encoding {
            what: "user metadata".into(),
            message: format!(
                "{} entries of {bytes} bytes; at most {MAX_USER_METADATA_ENTRIES} entries and \
                 {MAX_USER_METADATA_BYTES} bytes",
                m.len()
            ),
        });
    }
    Ok(())
}

/// Reads user metadata, refusing it as soon as it passes the bounds, so that a manifest claiming
/// millions of entries costs no more memory than the bounds allow.
fn bounded_metadata<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, String>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a map of strings")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            use serde::de::Error as _;
            let mut out = BTreeMap::new();
            let mut bytes = 0usize;
            while let Some((k, v)) = a.next_entry::<String, String>()? {
                bytes += k.len() + v.len();
                if out.len() >= MAX_USER_METADATA_ENTRIES || bytes > MAX_USER_METADATA_BYTES {
                    return Err(A::Error::custom(format!(
                        "user_metadata holds more than {MAX_USER_METADATA_ENTRIES} entries or \
                         {MAX_USER_METADATA_BYTES} bytes"
                    )));
                }
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Bounded)
}

/// The parent of a delta checkpoint: where it is and which save it must be.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParentRef {
    /// Its directory, relative to the child's (`../step-1000`); never absolute.
    pub path: String,
    /// Its save id.
    pub save_id: String,
    /// CRC32 of its manifest file, as its index records it: a parent replaced by another save at
    /// the same path is told apart, even under the same save id.
    pub manifest_crc32: u32,
}

impl ParentRef {
    /// Whether `committed` is the save this reference names (save id and manifest checksum): a
    /// delta's parent that another save replaced, even under the same id, is not.
    pub fn names(&self, committed: &CheckpointRef) -> bool {
        committed.save_id == self.save_id && committed.manifest_crc32 == self.manifest_crc32
    }
}

impl std::fmt::Display for ParentRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (save {}, manifest crc32 {:08x})",
            self.path, self.save_id, self.manifest_crc32
        )
    }
}

/// Where one tensor lives and what it must contain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRef {
    /// Data file, relative to the checkpoint directory.
    pub file: String,
    /// Tensor name inside the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's first byte in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// CRC32 (IEEE) of the tensor's bytes.
    pub crc32: u32,
    /// CRC32 of each block of the tensor, for a tensor longer than one block: what lets a read
    /// of some of its rows (a load for another shard count, a link of a chain) check what it
    /// read without reading the rest. Absent in checkpoints written before blocks existed; a
    /// reader then checks the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<BlockCrcs>,
    /// How the tensor's bytes are stored when compressed (format versions 3 and 4); absent when
    /// they are stored as they are. `offset` is then where the stored bytes start, while
    /// `dtype`, `shape`, `len`, `crc32` and `blocks` keep describing the raw tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<Codec>,
}

/// How a compressed tensor is stored: cut into frames of its CRC blocks' size (one frame when
/// it has no blocks), each filtered and compressed on its own, back to back. A frame whose
/// stored length equals its raw length holds its raw bytes (zstd did not shrink it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Codec {
    /// The compressor: `"zstd"`.
    pub name: String,
    /// What the bytes of each frame go through before the compressor (`crate::compress::Filter`
    /// names: `plain`, `shuffle2`, `shuffle4`, `shuffle8`, `delta8`).
    pub filter: String,
    /// Stored bytes of the whole tensor: the frames' lengths summed.
    pub stored: u64,
    /// Stored bytes of each frame, 8 hex digits each.
    #[serde(with = "hex_crcs")]
    pub frames: Vec<u32>,
}

/// Every tensor of `tables`, `dense` and `rows`: sparse ones in table, partition and segment
/// order, then dense ones, then the chunks of row-range tables.
pub(crate) fn tensor_refs_of<'a>(
    tables: &'a [TableManifest],
    dense: &'a [DenseManifest],
    rows: &'a [RowTableManifest],
) -> impl Iterator<Item = &'a TensorRef> {
    let sparse = tables.iter().flat_map(|t| {
        t.partitions.iter().flat_map(|p| {
            p.segments.iter().flat_map(|s| {
                std::iter::once(&s.ids)
                    .chain(std::iter::once(&s.bucket_index))
                    .chain(s.slots.iter())
            })
        })
    });
    sparse
        .chain(dense.iter().map(|d| &d.tensor))
        .chain(rows.iter().flat_map(RowTableManifest::tensor_refs))
}

/// The compressor a [`Codec`] names.
pub const ZSTD: &str = "zstd";

impl TensorRef {
    /// Bytes the tensor takes in its file: the stored bytes when compressed.
    #[doc(hidden)]
    pub fn stored_len(&self) -> u64 {
        self.codec.as_ref().map_or(self.len, |c| c.stored)
    }

    /// Raw bytes of each frame of a compressed tensor but the last: its CRC blocks' size, or
    /// the whole tensor when it has none.
    #[doc(hidden)]
    pub fn frame_bytes(&self) -> u64 {
        self.blocks.as_ref().map_or(self.len, |b| b.bytes).max(1)
    }

    /// Checks that the codec, if any, describes this tensor: a known compressor and filter, a
    /// frame per block, frames no longer than their raw bytes, summing to the stored length.
    #[doc(hidden)]
    pub fn check_codec(&self) -> std::result::Result<(), String> {
        let Some(c) = &self.codec else {
            return Ok(());
        };
        if c.name != ZSTD {
            return Err(format!("is compressed with unknown codec {:?}", c.name));
        }
        let filter = crate::compress::Filter::parse(&c.filter)
            .ok_or_else(|| format!("is compressed with unknown filter {:?}", c.filter))?;
        let frame = self.frame_bytes();
        if !self.len.is_multiple_of(filter.element() as u64)
            || !frame.is_multiple_of(filter.element() as u64)
        {
            return Err(format!(
                "is compressed with filter {} but its frames do not hold whole elements",
                c.filter
            ));
        }
        let want = self.len.div_ceil(frame);
        if c.frames.len() as u64 != want {
            return Err(format!(
                "has {} compressed frames for {want} frames of {frame} bytes",
                c.frames.len()
            ));
        }
        let mut sum = 0u64;
        for (k, &f) in c.frames.iter().enumerate() {
            let raw = (self.len - k as u64 * frame).min(frame);
            if f == 0 || u64::from(f) > raw {
                return Err(format!(
                    "has compressed frame {k} of {f} bytes for {raw} raw bytes"
                ));
            }
            sum += u64::from(f);
        }
        if sum != c.stored {
            return Err(format!(
                "has compressed frames of {sum} bytes in all, not the {} stored",
                c.stored
            ));
        }
        Ok(())
    }
}

/// The bytes of a tensor cut into blocks of `bytes` (the last one holds the rest), with a CRC32
/// of each.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCrcs {
    /// Bytes in each block but the last.
    pub bytes: u64,
    /// CRC32 (IEEE) of each block in order, 8 hex digits each: a fifth of the manifest's size as
    /// a JSON list of numbers.
    #[serde(with = "hex_crcs")]
    pub crc32: Vec<u32>,
}

impl BlockCrcs {
    /// The byte range of block `k` of a tensor of `len` bytes.
    pub fn block(&self, k: u64, len: u64) -> std::ops::Range<u64> {
        let start = k * self.bytes;
        start..(start + self.bytes).min(len)
    }

    /// Checks that the blocks cut a tensor of `len` bytes: a block size above zero and one CRC32
    /// per block.
    pub fn check(&self, len: u64) -> std::result::Result<(), String> {
        if self.bytes == 0 {
            return Err("has blocks of 0 bytes".into());
        }
        let want = len.div_ceil(self.bytes);
        if self.crc32.len() as u64 != want {
            return Err(format!(
                "has {} block CRC32s for {want} blocks of {} bytes",
                self.crc32.len(),
                self.bytes
            ));
        }
        Ok(())
    }
}

/// A list of CRC32s (or frame lengths) as one string of 8 hex digits each.
mod hex_crcs {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(crcs: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(crcs.len() * 8);
        for c in crcs {
            out.push_str(&format!("{c:08x}"));
        }
        s.serialize_str(&out)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let hex = String::deserialize(d)?;
        if hex.len() % 8 != 0 || !hex.is_ascii() {
            return Err(D::Error::custom("block CRC32s must be 8 hex digits each"));
        }
        (0..hex.len())
            .step_by(8)
            .map(|i| {
                u32::from_str_radix(&hex[i..i + 8], 16).map_err(|_| {
                    D::Error::custom(format!("block CRC32 {:?} is not hex", &hex[i..i + 8]))
                })
            })
            .collect()
    }
}

/// One run of rows of a table partition, covering a contiguous bucket range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentManifest {
    /// Segment number within the partition.
    pub index: u32,
    /// Buckets covered, `[start, end)`.
    pub buckets: [u32; 2],
    /// Number of rows.
    pub rows: u64,
    /// The ids, sorted by (bucket, id bits).
    pub ids: TensorRef,
    /// U64 entries `(bucket << 48) | first_row` for each non-empty bucket, ascending.
    pub bucket_index: TensorRef,
    /// One tensor per kept slot, in the order of [`PartitionManifest::slots`].
    pub slots: Vec<TensorRef>,
}

/// The rows of one table that one shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionManifest {
    /// The shard.
    pub shard: u32,
    /// Buckets this partition covers (the shard's range under the partition rule).
    pub buckets: [u32; 2],
    /// Number of rows.
    pub rows: u64,
    /// Names of the slots written for this partition (filters may have dropped some).
    pub slots: Vec<String>,
    /// Segments, in bucket order.
    pub segments: Vec<SegmentManifest>,
}

/// One sparse table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableManifest {
    /// Table name.
    pub name: String,
    /// Id dtype.
    pub key_dtype: KeyDtype,
    /// Every slot of the table as saved (a slot dropped in every partition is not listed).
    pub slots: Vec<SlotSpec>,
    /// Total rows over all partitions.
    pub rows: u64,
    /// One entry per shard that holds rows or was planned for this table.
    pub partitions: Vec<PartitionManifest>,
}

/// One dense tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseManifest {
    /// The shard that wrote it.
    pub shard: u32,
    /// Where it is.
    pub tensor: TensorRef,
}

/// One data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileManifest {
    /// File name, relative to the checkpoint directory.
    pub name: String,
    /// The shard that wrote it.
    pub shard: u32,
    /// Total file size in bytes.
    pub bytes: u64,
    /// Offset of the data section (8 + header length).
    pub data_start: u64,
    /// Number of tensors.
    pub tensors: u32,
    /// CRC32 of the whole header (length prefix, JSON and padding).
    pub header_crc32: u32,
}

/// The process that wrote a shard: enough to tell two writers apart and to name them in an error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterInfo {
    /// Host name.
    pub host: String,
    /// Process id on that host.
    pub pid: u32,
    /// Random token of this save call, distinct for two calls of one process.
    pub attempt: String,
    /// When the call started writing, in milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
}

impl std::fmt::Display for WriterInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "host {} pid {} (attempt {})",
            self.host, self.pid, self.attempt
        )
    }
}

/// A committed checkpoint: its save id and the CRC32 of its manifest file, which together tell it
/// from any other checkpoint that was ever committed in the directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckpointRef {
    /// The save id.
    pub save_id: String,
    /// CRC32 of its manifest file's bytes (as recorded in its index).
    pub manifest_crc32: u32,
}

impl std::fmt::Display for CheckpointRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.save_id)
    }
}

/// A dense tensor as one process was given it: every process of a save must agree on these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseGiven {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// CRC32 of its bytes.
    pub crc32: u32,
    /// Whether the block filters keep it: a kept tensor is written by exactly one shard.
    #[serde(default = "kept_by_default")]
    pub kept: bool,
}

fn kept_by_default() -> bool {
    true
}

/// A table as one process was given it (before filters): every process of a save must agree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableGiven {
    /// Name.
    pub name: String,
    /// Id dtype.
    pub key_dtype: KeyDtype,
    /// Every slot.
    pub slots: Vec<SlotSpec>,
}

sealed_document! {
/// What one shard wrote; produced when its data are durable. Read only through
/// [`ShardManifest::parse`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShardManifest parsed as RawShardManifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The save this shard belongs to.
    pub save_id: String,
    /// The partition rule.
    pub partition: PartitionRule,
    /// Number of shards of the save.
    pub shard_num: u32,
    /// This shard.
    pub shard: u32,
    /// Tables with this shard's partition only.
    pub tables: Vec<TableManifest>,
    /// Dense tensors this shard wrote.
    pub dense: Vec<DenseManifest>,
    /// Data files this shard wrote.
    pub files: Vec<FileManifest>,
    /// Free-form metadata given by the trainer (within [`MAX_USER_METADATA_ENTRIES`] and
    /// [`MAX_USER_METADATA_BYTES`], refused past them while it is read).
    #[serde(deserialize_with = "bounded_metadata")]
    pub user_metadata: BTreeMap<String, String>,
    /// This shard's trainer state, as `trainer_state::encode` writes it.
    pub trainer_state: Option<String>,
    /// The process that wrote this shard.
    #[serde(default)]
    pub writer: Option<WriterInfo>,
    /// The checkpoint committed in the directory when this shard's writer started (`None`: none).
    /// The save commits only over a checkpoint one of its shards saw: a save that another save
    /// overtook fails instead of replacing it unseen.
    #[serde(default)]
    pub replaces: Option<CheckpointRef>,
    /// The trainer step, if the trainer gave one; equal in every shard of a save.
    #[serde(default)]
    pub step: Option<u64>,
    /// Every table this process was given, before filters; equal in every shard of a save.
    #[serde(default)]
    pub tables_given: Vec<TableGiven>,
    /// Every dense tensor this process was given, with a checksum of its content; equal in every
    /// shard of a save.
    #[serde(default)]
    pub dense_given: Vec<DenseGiven>,
    /// The parent, for a delta; equal in every shard of a save.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// For a delta: the dense tensors of the new state that are not written because the parent's
    /// chain holds them unchanged; equal in every shard of a save.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_in_parent: Vec<String>,
    /// The chunks of row-range tables this shard wrote (format version 5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_tables: Vec<RowTableManifest>,
}
}

impl ShardManifest {
    /// Whether some tensor of this shard is compressed (format versions 3 and 4).
    pub fn is_compressed(&self) -> bool {
        tensor_refs_of(&self.tables, &self.dense, &self.row_tables).any(|t| t.codec.is_some())
    }
}

/// Per-shard facts kept in the global manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// The shard.
    pub shard: u32,
    /// Its trainer state, as `trainer_state::encode` writes it.
    pub trainer_state: Option<String>,
    /// The process that wrote it.
    #[serde(default)]
    pub writer: Option<WriterInfo>,
}

sealed_document! {
/// The global manifest of a committed checkpoint. Read only through [`Manifest::parse`] or
/// `Manifest::parse_committed`, built only by [`Manifest::merge`].
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest parsed as RawManifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Identifies the save; part of every file name.
    pub save_id: String,
    /// The partition rule.
    pub partition: PartitionRule,
    /// Number of shards the checkpoint was saved with.
    pub shard_num: u32,
    /// Sparse tables.
    pub tables: Vec<TableManifest>,
    /// Dense tensors.
    pub dense: Vec<DenseManifest>,
    /// Data files.
    pub files: Vec<FileManifest>,
    /// Per-shard trainer state.
    pub shards: Vec<ShardInfo>,
    /// Free-form metadata (equal in every shard; bounded as in [`ShardManifest`]).
    #[serde(deserialize_with = "bounded_metadata")]
    pub user_metadata: BTreeMap<String, String>,
    /// The checkpoint this one is a delta of (`None`: a full checkpoint). A delta's tables hold
    /// the rows inserted or changed since the parent, and each has a companion table
    /// (`crate::naming::removed_table_name`) of the ids removed since it.
    pub parent: Option<ParentRef>,
    /// The checkpoint this one replaced in its directory (`None`: the directory held none). Its
    /// files, and only they, were removed after this one was committed.
    #[serde(default)]
    pub replaces: Option<CheckpointRef>,
    /// The trainer step the save was given, if any.
    #[serde(default)]
    pub step: Option<u64>,
    /// For a delta: dense tensors of the state it holds that it does not write, because its
    /// parent's chain holds them unchanged (found in the parent, or further up).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_in_parent: Vec<String>,
    /// Row-range tables (format version 5): every chunk of every slot, which tile it exactly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_tables: Vec<RowTableManifest>,
}
}

impl TableManifest {
    /// Structural checks of a table entry, so readers can size buffers from it safely: every
    /// segment's tensors agree with the table's dtypes, shapes and row counts, and bucket ranges
    /// nest.
    pub(crate) fn check_consistency(&self) -> Result<()> {
        let bad = |what: String| Error::Encoding {
            what: format!("table {:?}", self.name),
            message: what,
        };
        let mut total = 0u64;
        for p in &self.partitions {
            if p.buckets[0] > p.buckets[1] || p.buckets[1] > crate::partition::BUCKETS {
                return Err(bad(format!(
                    "shard {} has bucket range {:?}",
                    p.shard, p.buckets
                )));
            }
            let mut specs = Vec::new();
            for name in &p.slots {
                specs.push(self.slots.iter().find(|s| &s.name == name).ok_or_else(|| {
                    bad(format!("shard {} lists unknown slot {name:?}", p.shard))
                })?);
            }
            let mut rows = 0u64;
            let mut next = p.buckets[0];
            for seg in &p.segments {
                if seg.buckets[0] != next
                    || seg.buckets[1] < seg.buckets[0]
                    || seg.buckets[1] > p.buckets[1]
                {
                    return Err(bad(format!(
                        "shard {} segment {} has bucket range {:?}",
                        p.shard, seg.index, seg.buckets
                    )));
                }
                next = seg.buckets[1];
                rows += seg.rows;
                for t in std::iter::once(&seg.ids).chain(&seg.slots) {
                    if let Some(b) = &t.blocks {
                        b.check(t.len)
                            .map_err(|why| bad(format!("tensor {:?} {why}", t.name)))?;
                    }
                }
                if seg.ids.dtype != self.key_dtype.dtype() || seg.ids.shape != [seg.rows] {
                    return Err(bad(format!(
                        "tensor {:?} does not hold {} ids",
                        seg.ids.name, seg.rows
                    )));
                }
                if seg.bucket_index.dtype != Dtype::U64 || seg.bucket_index.shape.len() != 1 {
                    return Err(bad(format!(
                        "tensor {:?} is not a U64 vector",
                        seg.bucket_index.name
                    )));
                }
                if seg.slots.len() != specs.len() {
                    return Err(bad(format!(
                        "shard {} segment {} has {} slot tensors for {} slots",
                        p.shard,
                        seg.index,
                        seg.slots.len(),
                        specs.len()
                    )));
                }
                for (t, spec) in seg.slots.iter().zip(&specs) {
                    let mut shape = vec![seg.rows];
                    shape.extend_from_slice(&spec.shape);
                    if t.dtype != spec.dtype || t.shape != shape {
                        return Err(bad(format!(
                            "tensor {:?} is {} {:?}, expected {} {:?}",
                            t.name, t.dtype, t.shape, spec.dtype, shape
                        )));
                    }
                }
            }
            if rows != p.rows {
                return Err(bad(format!(
                    "shard {} has {} rows in segments but says {}",
                    p.shard, rows, p.rows
                )));
            }
            total += rows;
        }
        if total != self.rows {
            return Err(bad(format!(
                "{} rows in partitions but says {}",
                total, self.rows
            )));
        }
        Ok(())
    }
}

/// Checks that shard `s` was given the same replicated state as shard 0 (`first`): tables, dense
/// tensors and their content, step and user metadata. Names the shard and the item that differ.
fn check_same_save(first: &ShardManifest, s: &ShardManifest) -> Result<()> {
    let differ = |what: String| {
        mismatch(format!(
            "shard {} and shard {} were not given the same model: {what}; a checkpoint holds one save, \
             so every process of a save must be given the same tables, dense tensors, step and metadata",
            first.shard, s.shard
        ))
    };
    if s.step != first.step {
        return Err(differ(format!(
            "step {:?} against {:?}",
            s.step, first.step
        )));
    }
    // One parent checkpoint, whatever path each process reached it by (a link, a mount).
    let parent = |m: &ShardManifest| {
        m.parent
            .as_ref()
            .map(|p| (p.save_id.clone(), p.manifest_crc32))
    };
    if parent(s) != parent(first) {
        let show = |p: Option<&ParentRef>| p.map_or("none".to_string(), ToString::to_string);
        return Err(differ(format!(
            "parent {} against {}",
            show(s.parent.as_ref()),
            show(first.parent.as_ref())
        )));
    }
    if s.dense_in_parent != first.dense_in_parent {
        return Err(differ(format!(
            "dense tensors kept from the parent {:?} against {:?}",
            s.dense_in_parent, first.dense_in_parent
        )));
    }
    if s.user_metadata != first.user_metadata {
        let key = first
            .user_metadata
            .iter()
            .chain(&s.user_metadata)
            .find(|(k, _)| first.user_metadata.get(*k) != s.user_metadata.get(*k))
            .map(|(k, _)| k.clone())
            .unwrap_or_default();
        return Err(differ(format!("user metadata {key:?} differs")));
    }
    let by_name = |given: &[TableGiven]| -> BTreeMap<String, TableGiven> {
        given.iter().map(|t| (t.name.clone(), t.clone())).collect()
    };
    let (a, b) = (by_name(&first.tables_given), by_name(&s.tables_given));
    if let Some(name) = a.keys().chain(b.keys()).find(|n| a.get(*n) != b.get(*n)) {
        return Err(differ(match (a.get(name), b.get(name)) {
            (Some(_), None) | (None, Some(_)) => format!(
                "table {name:?} was given to shard {} only",
                if a.contains_key(name) {
                    first.shard
                } else {
                    s.shard
                }
            ),
            _ => format!("table {name:?} has different slots or key dtype"),
        }));
    }
    let by_name = |given: &[DenseGiven]| -> BTreeMap<String, DenseGiven> {
        given.iter().map(|d| (d.name.clone(), d.clone())).collect()
    };
    let (a, b) = (by_name(&first.dense_given), by_name(&s.dense_given));
    if let Some(name) = a.keys().chain(b.keys()).find(|n| a.get(*n) != b.get(*n)) {
        return Err(mismatch(match (a.get(name), b.get(name)) {
            (Some(_), None) | (None, Some(_)) => {
                let (has, lacks) = if a.contains_key(name) {
                    (first.shard, s.shard)
                } else {
                    (s.shard, first.shard)
                };
                format!(
                    "dense tensor {name:?} was passed to shard {has} but not to shard {lacks}: every \
                     process of a multi-process save must pass every dense tensor (each writes the \
                     share the plan gives its shard), or the tensor would not be written exactly once"
                )
            }
            (Some(x), Some(y)) if x.dtype != y.dtype || x.shape != y.shape => format!(
                "dense tensor {name:?} is {} {:?} in shard {} but {} {:?} in shard {}",
                x.dtype, x.shape, first.shard, y.dtype, y.shape, s.shard
            ),
            (Some(x), Some(y)) if x.crc32 != y.crc32 => format!(
                "dense tensor {name:?} has different content in shard {} (crc32 {:08x}) and shard {} \
                 (crc32 {:08x}): the processes hold different models, and a checkpoint is one save",
                first.shard, x.crc32, s.shard, y.crc32
            ),
            (Some(_), Some(_)) => format!(
                "dense tensor {name:?} is kept by the filters of shard {} but not of shard {}, or \
                 the other way round: every process must be given the same filters",
                first.shard, s.shard
            ),
            (None, None) => unreachable!("the name came from one of the maps"),
        }));
    }
    Ok(())
}

/// Checks that every dense tensor the processes were given was written by exactly one shard.
fn check_dense_written_once(first: &ShardManifest, written: &[DenseManifest]) -> Result<()> {
    let mut count: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for d in written {
        count.entry(&d.tensor.name).or_default().push(d.shard);
    }
    for d in first.dense_given.iter().filter(|d| d.kept) {
        match count.get(d.name.as_str()).map(Vec::as_slice) {
            Some([_]) => {}
            None | Some([]) => {
                return Err(mismatch(format!(
                    "dense tensor {:?} was given but no shard wrote it",
                    d.name
                )))
            }
            Some(shards) => {
                return Err(mismatch(format!(
                    "dense tensor {:?} was written by shards {shards:?}",
                    d.name
                )))
            }
        }
    }
    if let Some(extra) = count
        .keys()
        .find(|n| !first.dense_given.iter().any(|d| d.kept && d.name == **n))
    {
        return Err(mismatch(format!(
            "dense tensor {extra:?} was written but no process was given it to keep"
        )));
    }
    Ok(())
}

fn mismatch(what: String) -> Error {
    Error::Encoding {
        what: "merging shard manifests".into(),
        message: what,
    }
}

impl Manifest {
    /// Merges the manifests of every shard of one save into the global manifest, checking that
    /// they belong together: same save, rule and shard count, each shard exactly once, identical
    /// table definitions.
    pub fn merge(mut shards: Vec<ShardManifest>) -> Result<Manifest> {
        shards.sort_by_key(|s| s.shard);
        let first = shards
            .first()
            .ok_or_else(|| mismatch("no shard manifests".into()))?;
        let (save_id, rule, shard_num) = (
            first.save_id.clone(),
            first.partition.clone(),
            first.shard_num,
        );
        if shards.len() as u64 != u64::from(shard_num) {
            return Err(mismatch(format!(
                "{} shard manifests for {shard_num} shards",
                shards.len()
            )));
        }
        let mut tables: Vec<TableManifest> = Vec::new();
        let mut dense = Vec::new();
        let mut files = Vec::new();
        let mut infos = Vec::new();
        for (i, s) in shards.iter().enumerate() {
            if s.shard as usize != i {
                return Err(mismatch(format!("shard {i} is missing or repeated")));
            }
            check_same_save(first, s)?;
            if s.save_id != save_id || s.partition != rule || s.shard_num != shard_num {
                return Err(mismatch(format!(
                    "shard {} belongs to save {:?} ({} shards), shard 0 to {:?} ({} shards)",
                    s.shard, s.save_id, s.shard_num, save_id, shard_num
                )));
            }
            if s.format != FORMAT_NAME
                || s.format_version
                    != format_version_of(
                        s.parent.as_ref(),
                        s.is_compressed(),
                        !s.row_tables.is_empty(),
                    )
            {
                return Err(mismatch(format!(
                    "shard {} has format {} version {}",
                    s.shard, s.format, s.format_version
                )));
            }
            for t in &s.tables {
                match tables.iter_mut().find(|m| m.name == t.name) {
                    Some(m) => {
                        if m.key_dtype != t.key_dtype {
                            return Err(mismatch(format!(
                                "table {:?} has key dtype {} in shard {} but {} before",
                                t.name, t.key_dtype, s.shard, m.key_dtype
                            )));
                        }
                        for slot in &t.slots {
                            match m.slots.iter().find(|x| x.name == slot.name) {
                                Some(x) if x != slot => {
                                    return Err(mismatch(format!(
                                        "table {:?} slot {:?} differs between shards",
                                        t.name, slot.name
                                    )))
                                }
                                Some(_) => {}
                                None => m.slots.push(slot.clone()),
                            }
                        }
                        m.rows += t.rows;
                        m.partitions.extend(t.partitions.iter().cloned());
                    }
                    None => tables.push(t.clone()),
                }
            }
            dense.extend(s.dense.iter().cloned());
            files.extend(s.files.iter().cloned());
            infos.push(ShardInfo {
                shard: s.shard,
                trainer_state: s.trainer_state.clone(),
                writer: s.writer.clone(),
            });
        }
        check_dense_written_once(first, &dense)?;
        let row_tables =
            row_range::merge_row_tables(shards.iter().map(|s| (s.shard, s.row_tables.as_slice())))
                .map_err(mismatch)?;
        if let Some(t) = row_tables
            .iter()
            .find(|r| tables.iter().any(|t| t.name == r.name))
        {
            return Err(mismatch(format!(
                "table {:?} is given both as a hashed table and as a row-range table",
                t.name
            )));
        }
        tables.sort_by(|a, b| a.name.cmp(&b.name));
        dense.sort_by(|a: &DenseManifest, b| a.tensor.name.cmp(&b.tensor.name));
        Ok(Manifest {
            format: FORMAT_NAME.into(),
            format_version: format_version_of(
                first.parent.as_ref(),
                shards.iter().any(ShardManifest::is_compressed),
                !row_tables.is_empty(),
            ),
            save_id,
            partition: rule,
            shard_num,
            tables,
            dense,
            files,
            shards: infos,
            user_metadata: shards[0].user_metadata.clone(),
            parent: shards[0].parent.clone(),
            dense_in_parent: shards[0].dense_in_parent.clone(),
            row_tables,
            replaces: None,
            step: shards[0].step,
            sealed: Sealed,
        })
    }

    /// Every tensor the manifest references, with what it is.
    pub fn tensor_refs(&self) -> impl Iterator<Item = &TensorRef> {
        tensor_refs_of(&self.tables, &self.dense, &self.row_tables)
    }

    /// Whether some tensor is compressed (format versions 3 and 4).
    pub fn is_compressed(&self) -> bool {
        self.tensor_refs().any(|t| t.codec.is_some())
    }

    /// Total bytes of tensor data.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensor_refs().map(|t| t.len).sum()
    }

    /// A table by name.
    pub fn table(&self, name: &str) -> Option<&TableManifest> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// Decodes shard `shard`'s trainer state into `T`; `Ok(None)` if that shard saved none.
    pub fn trainer_state<T: DeserializeOwned>(&self, shard: u32) -> Result<Option<T>> {
        match self
            .shards
            .iter()
            .find(|s| s.shard == shard)
            .and_then(|s| s.trainer_state.as_deref())
        {
            Some(stored) => trainer_state::decode(stored).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Block CRC32s survive the manifest's JSON whatever their values and count, and the
        /// check accepts exactly one CRC32 per block.
        #[test]
        fn block_crcs_round_trip_through_json(
            crcs in proptest::collection::vec(any::<u32>(), 0..64),
            bytes in 1u64..1000,
            short in 0u64..1000,
        ) {
            let b = BlockCrcs { bytes, crc32: crcs.clone() };
            let json = serde_json::to_string(&b).unwrap();
            let back: BlockCrcs = serde_json::from_str(&json).unwrap();
            prop_assert_eq!(&back, &b);
            let n = crcs.len() as u64;
            let len = if n == 0 { 0 } else { (n - 1) * bytes + 1 + short % bytes };
            prop_assert!(b.check(len).is_ok());
            prop_assert!(b.check(len + bytes).is_err());
            if n > 0 {
                prop_assert_eq!(b.block(n - 1, len).end, len);
            }
        }
    }

    /// A manifest claiming more user metadata than the bounds is refused while it is read; a
    /// save is refused the same metadata before it writes.
    #[test]
    fn user_metadata_past_its_bounds_is_refused() {
        let entries: Vec<String> = (0..=MAX_USER_METADATA_ENTRIES)
            .map(|i| format!("\"k{i}\":\"v\""))
            .collect();
        let json = format!("{{{}}}", entries.join(","));
        #[derive(Deserialize)]
        struct M {
            #[serde(deserialize_with = "bounded_metadata")]
            #[allow(dead_code)]
            user_metadata: BTreeMap<String, String>,
        }
        let err = serde_json::from_str::<M>(&format!("{{\"user_metadata\":{json}}}"))
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("user_metadata holds more than"),
            "{err}"
        );
        let fits: BTreeMap<String, String> = (0..MAX_USER_METADATA_ENTRIES)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(check_user_metadata(&fits).is_ok());
        let mut over = fits;
        over.insert("one more".into(), "v".into());
        assert!(check_user_metadata(&over).is_err());
        let big: BTreeMap<String, String> =
            [("k".to_string(), "x".repeat(MAX_USER_METADATA_BYTES))].into();
        assert!(check_user_metadata(&big).is_err());
    }

    #[test]
    fn block_crcs_that_are_not_hex_are_refused() {
        for bad in [
            r#"{"bytes":4,"crc32":"0000000"}"#,
            r#"{"bytes":4,"crc32":"0000000g"}"#,
            r#"{"bytes":4,"crc32":[1,2]}"#,
        ] {
            assert!(serde_json::from_str::<BlockCrcs>(bad).is_err(), "{bad}");
        }
        let zero = BlockCrcs {
            bytes: 0,
            crc32: vec![],
        };
        assert!(zero.check(0).is_err());
    }
}

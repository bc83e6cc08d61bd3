//! The one error type of saver-core.
//!
//! Every variant names the table, slot or tensor it is about, because the person reading the message
//! is usually looking at a model with hundreds of tensors and needs to know which one to fix.

use thiserror::Error;

/// Errors raised while describing a model or planning a save.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A name is empty, reserved, or contains a character the naming scheme forbids.
    #[error("invalid {what} name {name:?}: {why}")]
    InvalidName {
        /// "table", "slot" or "dense tensor".
        what: &'static str,
        /// The offending name.
        name: String,
        /// Why it is refused.
        why: String,
    },
    /// Two inputs share a name (two tables, two slots of a table, two dense tensors).
    #[error("duplicate {what} name {name:?}")]
    DuplicateName {
        /// "table", "slot" or "dense tensor".
        what: &'static str,
        /// The repeated name.
        name: String,
    },
    /// Two different inputs would be written under the same tensor name.
    #[error("tensor name {name:?} would be written twice (by {first} and by {second})")]
    NameCollision {
        /// The output tensor name.
        name: String,
        /// What produced it first.
        first: String,
        /// What produced it again.
        second: String,
    },
    /// A shape whose byte size overflows 64 bits or does not fill whole bytes.
    #[error("tensor {name:?}: shape {shape:?} of {dtype} {why}")]
    BadShape {
        /// Tensor, table or slot the shape belongs to.
        name: String,
        /// The shape.
        shape: Vec<u64>,
        /// The dtype's name.
        dtype: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Bytes given for a tensor or a row do not match its shape and dtype.
    #[error("{what} {name:?}: expected {expected} bytes, got {actual}")]
    LengthMismatch {
        /// "dense tensor", "slot row", …
        what: &'static str,
        /// Which tensor, or "table/slot".
        name: String,
        /// What shape × dtype size requires.
        expected: u64,
        /// What was given.
        actual: u64,
    },
    /// A dtype name that safetensors does not define, or a dtype not allowed in this place.
    #[error("{context}: unsupported dtype {dtype:?}")]
    BadDtype {
        /// Where the dtype appeared.
        context: String,
        /// The dtype as given.
        dtype: String,
    },
    /// Rows that cannot be quantized (a value that is not finite, rows of no values).
    #[error("tensor {tensor:?}: cannot quantize: {why}")]
    Unquantizable {
        /// The tensor ("table/slot").
        tensor: String,
        /// Why.
        why: String,
    },
    /// `shard_num` was zero.
    #[error("the number of shards must be at least 1")]
    ZeroShards,
    /// `shard_index` was not below `shard_num`.
    #[error("shard index {index} is out of range for {num} shards (valid: 0..{num})")]
    ShardOutOfRange {
        /// The index asked for.
        index: u32,
        /// The shard count.
        num: u32,
    },
    /// An option's value is unusable.
    #[error("invalid option {option}: {why}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A table snapshot produced the same id twice.
    #[error("table {table:?}: id {id} appears more than once")]
    DuplicateId {
        /// The table.
        table: String,
        /// The repeated id, printed in the table's key dtype.
        id: String,
    },
    /// A row held by this process belongs to another shard under the partition rule.
    #[error(
        "table {table:?}: {count} rows held by shard {shard} belong to other shards under the partition \
         rule (first: id {first_id}); route ids with PartitionRule::shard_of, or set \
         ForeignRows::Skip if every process holds the whole table"
    )]
    ForeignRows {
        /// The table.
        table: String,
        /// The shard being planned.
        shard: u32,
        /// How many rows belong elsewhere.
        count: u64,
        /// One of them, for the message.
        first_id: String,
    },
    /// A table implementation failed to produce its rows.
    #[error("table {table:?}: {message}")]
    Table {
        /// The table.
        table: String,
        /// The implementation's message.
        message: String,
    },
    /// The plan could not move a table's sorted ids to, or back from, its spill store.
    #[error("table {table:?}: plan spill: {source}")]
    Spill {
        /// The table.
        table: String,
        /// The store's error (names the file).
        source: std::io::Error,
    },
    /// A glob pattern did not parse.
    #[error("invalid glob {pattern:?}: {message}")]
    Glob {
        /// The pattern.
        pattern: String,
        /// The parser's message.
        message: String,
    },
    /// A planned data file would have a header larger than safetensors readers accept.
    #[error(
        "data file {file} would have a {bytes}-byte header ({tensors} tensors), over the {limit}-byte \
         limit of safetensors readers; lower max_file_size, or raise max_block_bytes so that tables \
         are cut into fewer segments"
    )]
    HeaderTooLarge {
        /// The file.
        file: String,
        /// Tensors in it.
        tensors: usize,
        /// Its header's size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The manifest or trainer state could not be encoded or decoded.
    #[error("{what}: {message}")]
    Encoding {
        /// What was being encoded or decoded.
        what: String,
        /// The codec's message.
        message: String,
    },
    /// A checkpoint document (index, manifest, shard manifest) is malformed or inconsistent.
    #[error("corrupt checkpoint file {file}: {what}")]
    Corrupt {
        /// The document, relative to the checkpoint directory.
        file: String,
        /// What is wrong with it.
        what: String,
    },
    /// A file name a document gives would lead outside the checkpoint directory.
    #[error("refusing file name {name:?} (named in {named_in}): {why}")]
    UnsafePath {
        /// The name.
        name: String,
        /// The document that gave it.
        named_in: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A document declares a format version this build does not read.
    #[error(
        "{file}: format version {found} is not supported (this build reads versions 1 to {supported})"
    )]
    UnsupportedVersion {
        /// The document declaring it.
        file: String,
        /// The version found.
        found: String,
        /// The newest version this build reads.
        supported: u32,
    },
    /// An error of the layer that implements a table (reading its files, say), carried through
    /// saver-core's traits unchanged: that layer takes it back as it was.
    #[error(transparent)]
    External(Box<dyn std::error::Error + Send + Sync>),
}

/// Result with [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! Reading a committed checkpoint: its documents (index, manifests, file headers), opened and
//! validated before any tensor byte is read; a delta's chain of parents; loads into tables and
//! into arrays for any shard count; rows in storage order for what reads a checkpoint's tables.

pub(crate) mod ahead;
pub mod arrays;
pub mod checkpoint;
pub(crate) mod documents;
pub(crate) mod frames;
pub(crate) mod header;
pub(crate) mod link;
mod open_files;
mod pages;
mod pieces;
pub mod restore;
pub(crate) mod rows;
pub(crate) mod stored;

pub use stored::StoredTable;

//! What is built on loading and saving: verify, content digests, export to plain safetensors,
//! reshard and compact, and the summary `saver inspect` prints.

pub mod digest;
pub mod export;
pub mod inspect;
pub mod reshard;
pub(crate) mod verify;

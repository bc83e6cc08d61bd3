//! What is built on loading and saving: verify, content digests, export to plain safetensors,
//! reshard and compact.

pub mod digest;
pub mod export;
pub mod reshard;
pub mod verify;

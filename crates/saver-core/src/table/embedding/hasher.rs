//! The hash of [`super::EmbeddingTable`]'s map: the partition rule's `fmix64`.
//!
//! Two reasons not to use the standard SipHash. Speed: a training step and a save hash every id,
//! and `fmix64` costs a few cycles where SipHash costs tens of nanoseconds. Locality: dashmap picks
//! a row's lock shard from bits 50–56 of the hash, and the partition rule picks its bucket from
//! bits 48–63 of the same `fmix64`, so every row of one bucket lives under one dashmap lock. A save
//! reads rows bucket by bucket, and can then hold one read lock for a long run of rows instead of
//! taking one per row.
//!
//! The hash is unkeyed: ids chosen to collide could slow the table down (they cannot corrupt it).
//! Embedding ids are feature hashes or dictionary indexes, not raw attacker input.

use std::hash::{BuildHasher, Hasher};

use crate::partition::fmix64;

/// Builds [`IdHasher`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHashBuilder;

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

/// Hashes one `u64` id with `fmix64`; other inputs (never used by the table) are folded in.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = fmix64(self.0 ^ id);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::PartitionRule;

    #[test]
    fn hash_is_the_partition_hash() {
        for id in [0u64, 1, 42, u64::MAX, -7i64 as u64] {
            let h = IdHashBuilder.hash_one(id);
            assert_eq!(h, fmix64(id));
            assert_eq!((h >> 48) as u32, PartitionRule::bucket_of(id));
        }
    }
}

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
//!
//! A table sized up front (a load knows its row count) reorders `fmix64`'s bits for its map
//! ([`OrderedIdHashBuilder`]): the low bits, where a map shard puts the row, rise with the
//! bucket. A checkpoint's rows come in bucket order, so a restore fills each map shard front to
//! back, a few slots apart, instead of one slot anywhere in a map far larger than the caches a
//! row (a cache and TLB miss each, half of a restore's inserts). The hash is still a permutation
//! of `fmix64`'s bits, the shard's bits stay put, and random ids spread over the slots as before.

use std::hash::{BuildHasher, Hasher};

use crate::partition::fmix64;

/// Builds [`IdHasher`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHashBuilder;

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0, 0)
    }
}

/// Builds [`IdHasher`]s whose hashes put the rows of a map shard of `2^position_bits` slots in
/// bucket order (see the module's documentation).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OrderedIdHashBuilder {
    position_bits: u32,
}

impl OrderedIdHashBuilder {
    /// For a map sized for `rows` rows in `shards` shards. A map that grows past that keeps the
    /// hash: its rows are then in no particular order, as with plain `fmix64`.
    pub(crate) fn for_rows(rows: usize, shards: usize) -> Self {
        let per_shard = rows.div_ceil(shards.max(1)).max(1);
        // hashbrown's slots: a power of two with room for 8/7 of the rows.
        let slots = (per_shard.saturating_mul(8) / 7).max(1).next_power_of_two();
        Self {
            position_bits: slots.trailing_zeros(),
        }
    }
}

impl BuildHasher for OrderedIdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0, self.position_bits)
    }
}

/// Hashes one `u64` id with `fmix64`; other inputs (never used by the table) are folded in. Built
/// by an [`OrderedIdHashBuilder`], the bits are then reordered.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64, u32);

/// `f`'s bits reordered for a map shard of `2^m` slots: its low `m` bits (the row's home slot)
/// begin with the bucket's bits that vary within a dashmap shard (`f`'s top 7, then bits 48..51)
/// and go on with bits of `f` that the bucket does not hold; the dashmap shard's bits (51..57)
/// stay where they are; the top 7 (hashbrown's tag, compared before a key) are `f`'s lowest,
/// independent of the slot. Maps below 1024 slots a shard keep `f`.
fn ordered(f: u64, m: u32) -> u64 {
    if !(10..=51).contains(&m) {
        return f;
    }
    let order = (f >> 57) << 3 | (f >> 48 & 7);
    let low = (f >> 7) & ((1 << (m - 10)) - 1);
    let high = (f >> (m - 3)) & ((1 << (51 - m)) - 1);
    low | order << (m - 10) | high << m | (f & (0x3f << 51)) | (f & 0x7f) << 57
}

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
        ordered(self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::PartitionRule;

    /// Every bit of the hash comes from exactly one bit of `fmix64`, so the reordering loses
    /// nothing (no two ids collide that did not before), and the dashmap shard's bits are
    /// `fmix64`'s, which the partition rule's bucket holds.
    #[test]
    fn ordered_hash_is_a_permutation_of_the_partition_hash_bits() {
        for m in 0..64 {
            let images: Vec<u64> = (0..64).map(|i| ordered(1 << i, m)).collect();
            assert!(images.iter().all(|h| h.count_ones() == 1), "m = {m}");
            let all = images.iter().fold(0u64, |a, h| a | h);
            assert_eq!(all, u64::MAX, "m = {m}");
            for (i, &h) in images.iter().enumerate().take(57).skip(51) {
                assert_eq!(h, 1 << i, "m = {m}");
            }
        }
    }

    proptest::proptest! {
        /// Within one dashmap shard, rows in bucket order go to home slots in the same order (up
        /// to the bits the bucket does not decide), and the reordered hash is linear over XOR, as
        /// a bit permutation is.
        #[test]
        fn ordered_slots_follow_the_buckets(a: u64, b: u64, m in 10u32..=51) {
            let (fa, fb) = (fmix64(a), fmix64(b));
            let shard = |f: u64| (f >> 51) & 0x3f;
            let mask = (1u64 << m) - 1;
            let (sa, sb) = (ordered(fa, m) & mask, ordered(fb, m) & mask);
            if shard(fa) == shard(fb) && (fa >> 48) < (fb >> 48) {
                proptest::prop_assert!(sa >> (m - 10) <= sb >> (m - 10));
            }
            proptest::prop_assert_eq!(ordered(fa ^ fb, m), ordered(fa, m) ^ ordered(fb, m));
        }
    }

    #[test]
    fn hash_is_the_partition_hash() {
        for id in [0u64, 1, 42, u64::MAX, -7i64 as u64] {
            let h = IdHashBuilder.hash_one(id);
            assert_eq!(h, fmix64(id));
            assert_eq!((h >> 48) as u32, PartitionRule::bucket_of(id));
        }
    }
}

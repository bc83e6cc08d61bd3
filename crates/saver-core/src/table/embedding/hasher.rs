//! The hash of [`super::EmbeddingTable`]'s map: the partition rule's `fmix64`.
//!
//! Two reasons not to use the standard SipHash. Speed: a training step and a save hash every id,
//! and `fmix64` costs a few cycles where SipHash costs tens of nanoseconds. Locality: dashmap picks
//! a row's lock shard from bits 51–56 of the hash, and the partition rule picks its bucket from
//! bits 48–63 of the same `fmix64`, so every row of one bucket lives under one dashmap lock. A save
//! reads rows bucket by bucket, and can then hold one read lock for a long run of rows instead of
//! taking one per row.
//!
//! The hash is unkeyed: ids chosen to collide could slow the table down (they cannot corrupt it).
//! Embedding ids are feature hashes or dictionary indexes, not raw attacker input.
//!
//! A table sized up front (a load knows its row count), of all buckets or of one shard of a power
//! of two of them, reorders `fmix64`'s bits for its map ([`OrderedIdHashBuilder`]): the low bits,
//! where a map shard puts the row, rise with the bucket. A checkpoint's rows come in bucket
//! order, so a restore fills each map shard front to back, a few slots apart, instead of one slot
//! anywhere in a map far larger than the caches a row (a cache and TLB miss each, half of a
//! restore's inserts). The hash is still a permutation of `fmix64`'s bits, the dashmap shard's
//! bits stay put, and random ids spread over the slots as before.

use std::hash::{BuildHasher, Hasher};

use crate::partition::fmix64;

/// Builds [`IdHasher`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHashBuilder;

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0, SlotOrder::NONE)
    }
}

/// Builds [`IdHasher`]s whose hashes put a table's rows in bucket order in each map shard (see
/// the module's documentation).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OrderedIdHashBuilder(SlotOrder);

impl OrderedIdHashBuilder {
    /// For a map sized for `rows` rows in `shards` shards, of a table whose rows lie in
    /// `buckets`. Only a range of buckets that is an aligned power of two (one shard of a power
    /// of two of them, or all) is ordered: its fixed leading bits are then whole bits of the hash,
    /// put aside, so that the rest fill every slot; other tables keep plain `fmix64`. A map that
    /// grows past its size keeps the hash, its rows then in no particular order.
    pub(crate) fn for_rows(rows: usize, shards: usize, buckets: std::ops::Range<u32>) -> Self {
        let per_shard = rows.div_ceil(shards.max(1)).max(1);
        // hashbrown's slots: a power of two with room for 8/7 of the rows.
        let slots = (per_shard.saturating_mul(8) / 7).max(1).next_power_of_two();
        let len = buckets.end.saturating_sub(buckets.start);
        if !len.is_power_of_two() || !buckets.start.is_multiple_of(len) || len > 1 << 16 {
            return Self(SlotOrder::NONE);
        }
        Self(SlotOrder {
            slot_bits: slots.trailing_zeros(),
            fixed_bits: 16 - len.trailing_zeros(),
        })
    }

    /// The slots a map shard was sized for, as a power of two.
    #[cfg(test)]
    pub(crate) fn slot_bits(&self) -> u32 {
        self.0.slot_bits
    }
}

impl BuildHasher for OrderedIdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(0, self.0)
    }
}

/// How [`ordered`] lays a hash out: for a map shard of `2^slot_bits` slots, over buckets whose
/// top `fixed_bits` bits are the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SlotOrder {
    slot_bits: u32,
    fixed_bits: u32,
}

impl SlotOrder {
    /// Plain `fmix64`.
    const NONE: Self = Self {
        slot_bits: 0,
        fixed_bits: 0,
    };

    /// Whether [`ordered`] reorders for this layout: maps of at least 1024 slots a shard whose
    /// slot leaves the dashmap shard's bits (51..57) room, over at least 512 buckets.
    fn applies(self) -> bool {
        self.slot_bits >= 10 && self.fixed_bits <= 7 && self.slot_bits + self.fixed_bits <= 51
    }
}

/// Hashes one `u64` id with `fmix64`; other inputs (never used by the table) are folded in. Built
/// by an `OrderedIdHashBuilder`, the bits are then reordered.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64, SlotOrder);

/// `f`'s bits reordered for `order`: the low `m = slot_bits` bits (the row's home slot in a map
/// shard) begin with the bucket's bits that vary within a dashmap shard and within the table
/// (`f`'s top 7 but the `c = fixed_bits` fixed ones, then bits 48..51), and go on with bits of
/// `f` that the bucket does not hold; the fixed bits go above the slot's; the dashmap shard's
/// bits (51..57) stay where they are; the top 7 (hashbrown's tag, compared before a key) are
/// `f`'s lowest, independent of the slot. A permutation of `f`'s bits. Maps below 1024 slots a
/// shard (or of more than `2^(51 - c)`), and tables of fewer than 512 buckets (whose dashmap
/// shards' bits are fixed too), keep `f`.
fn ordered(f: u64, order: SlotOrder) -> u64 {
    if !order.applies() {
        return f;
    }
    let (m, c) = (order.slot_bits, order.fixed_bits);
    // The varying bucket bits: q of them, the most significant first.
    let q = 10 - c;
    let varying = ((f >> 57) & ((1 << (7 - c)) - 1)) << 3 | (f >> 48 & 7);
    let low = (f >> 7) & ((1 << (m - q)) - 1);
    // Above the slot: the rest of bits 7..48, then the fixed bucket bits.
    let rest = 48 - (7 + m - q);
    let fixed = f.checked_shr(64 - c).unwrap_or(0);
    let high = (f >> (7 + m - q)) & ((1 << rest) - 1) | fixed << rest;
    low | varying << (m - q) | high << m | (f & (0x3f << 51)) | (f & 0x7f) << 57
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
        for slot_bits in 0..64 {
            for fixed_bits in 0..=16 {
                let order = SlotOrder {
                    slot_bits,
                    fixed_bits,
                };
                let images: Vec<u64> = (0..64).map(|i| ordered(1 << i, order)).collect();
                assert!(images.iter().all(|h| h.count_ones() == 1), "{order:?}");
                assert_eq!(images.iter().fold(0, |a, h| a | h), u64::MAX, "{order:?}");
                for (i, &h) in images.iter().enumerate().take(57).skip(51) {
                    assert_eq!(h, 1 << i, "{order:?}");
                }
            }
        }
    }

    /// The rows of a table that owns shard `j` of `2^k` spread over every home slot of each map
    /// shard: the bucket bits the table shares take no part in the slot (a table of half the
    /// buckets once put all its rows in half the slots).
    #[test]
    fn a_shards_rows_reach_every_slot() {
        for k in 0..=7u32 {
            let shard_num = 1u32 << k;
            for j in [0, shard_num - 1] {
                let buckets = PartitionRule::bucket_range(j, shard_num);
                let rows = 1 << 18;
                let b = OrderedIdHashBuilder::for_rows(rows, 64, buckets.clone());
                let m = b.0.slot_bits;
                assert!(m >= 10, "{k} {m}");
                let mut seen = vec![false; 1 << 10];
                let mut id = 0u64;
                let mut found = 0;
                while found < 200_000 {
                    id += 1;
                    if !buckets.contains(&PartitionRule::bucket_of(id)) {
                        continue;
                    }
                    found += 1;
                    let slot = b.hash_one(id) & ((1 << m) - 1);
                    seen[(slot >> (m - 10)) as usize] = true;
                }
                assert!(seen.iter().all(|&s| s), "shard {j} of {shard_num}");
            }
        }
    }

    proptest::proptest! {
        /// Within one dashmap shard, rows in bucket order go to home slots in the same order (up
        /// to the bits the bucket does not decide) wherever the hash is reordered (larger maps
        /// keep plain `fmix64`), and the reordered hash is linear over XOR, as a bit permutation
        /// is.
        #[test]
        fn ordered_slots_follow_the_buckets(a: u64, b: u64, c in 0u32..=7, m_off in 0u32..=41) {
            // Only layouts the reordering applies to: m + c <= 51.
            let m = 10 + m_off % (42 - c);
            let order = SlotOrder { slot_bits: m, fixed_bits: c };
            proptest::prop_assert!(order.applies());
            // Both in the same table (the same fixed top bits) and the same dashmap shard (bits
            // 51..57): the case the claim is about, made rather than waited for.
            let fixed = if c == 0 { 0 } else { !0u64 << (64 - c) };
            let same = fixed | (0x3f << 51);
            let fa = fmix64(a);
            let fb = fmix64(b) & !same | fa & same;
            proptest::prop_assume!((fa >> 48) != (fb >> 48));
            let (fa, fb) = if (fa >> 48) < (fb >> 48) { (fa, fb) } else { (fb, fa) };
            let mask = (1u64 << m) - 1;
            let q = 10 - c;
            let (sa, sb) = (ordered(fa, order) & mask, ordered(fb, order) & mask);
            proptest::prop_assert!(sa >> (m - q) <= sb >> (m - q));
            proptest::prop_assert_eq!(ordered(fa ^ fb, order), ordered(fa, order) ^ ordered(fb, order));
        }

        /// Beyond the layouts it applies to, the hash is `fmix64`'s, unchanged.
        #[test]
        fn other_layouts_keep_the_plain_hash(a: u64, m in 0u32..64, c in 0u32..=16) {
            let order = SlotOrder { slot_bits: m, fixed_bits: c };
            if !order.applies() {
                proptest::prop_assert_eq!(ordered(fmix64(a), order), fmix64(a));
            }
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

//! The partition rule: which shard owns which id. It is part of the on-disk format.
//!
//! Each id's 64 bits (an `i64` id is taken as its two's-complement bits, so negative ids are ordinary
//! values) go through the MurmurHash3 64-bit finalizer; the top 16 bits of the result are the id's
//! *bucket*, one of 2^16. Shard `j` of `M` owns the contiguous bucket range
//! `[floor(j·B/M), floor((j+1)·B/M))`. Rows are stored grouped by bucket, so a reader for any other
//! shard count finds its rows by bucket range without scanning.
//!
//! Changing any constant here changes which shard every row lives in: it requires a new
//! [`PartitionRule::kind`] string and a format version bump.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Number of buckets of the current rule.
pub const BUCKETS: u32 = 1 << 16;

/// Name of the current rule, written into every manifest.
pub const RULE_KIND: &str = "fmix64-top16";

/// MurmurHash3's 64-bit finalizer: a bijection on u64 with full avalanche, so consecutive or
/// structured ids spread evenly over buckets.
pub const fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// The partition rule as recorded in a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionRule {
    /// Which hash and bucket scheme; only [`RULE_KIND`] exists.
    pub kind: String,
    /// Number of buckets; [`BUCKETS`] for the current rule.
    pub buckets: u32,
}

impl Default for PartitionRule {
    fn default() -> Self {
        Self {
            kind: RULE_KIND.to_string(),
            buckets: BUCKETS,
        }
    }
}

/// One shard of a partition into `count` shards: the part of a table one worker holds. Named
/// fields, so that a call reads which number is which (`Shard { index: 3, count: 8 }`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shard {
    /// Which shard, below `count`.
    pub index: u32,
    /// How many shards the table is partitioned into (≥ 1).
    pub count: u32,
}

impl Shard {
    /// The whole table: shard 0 of 1.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// The rows of a row-range table of `rows` rows this shard holds: `rows·j/M .. rows·(j+1)/M`
    /// for shard `j` of `M`, the row cut of the partition rule (docs/FORMAT.md).
    pub fn rows_of(self, rows: u64) -> std::ops::Range<u64> {
        let (j, m) = (u128::from(self.index), u128::from(self.count.max(1)));
        let cut = |k: u128| (u128::from(rows) * k / m) as u64;
        cut(j)..cut(j + 1)
    }

    /// Shards `0..count` (at least one), or only shard `only` of them: what a save of every
    /// shard, or one process of a multi-process save, writes.
    #[doc(hidden)]
    pub fn selected(count: u32, only: Option<u32>) -> impl Iterator<Item = Shard> {
        let count = count.max(1);
        (0..count)
            .filter(move |i| only.is_none_or(|o| o == *i))
            .map(move |index| Shard { index, count })
    }

    /// Checks that the shard exists: at least one shard, and `index` below their number.
    pub fn check(self) -> Result<Self> {
        PartitionRule::check_shard(self.index, self.count)?;
        Ok(self)
    }
}

impl PartitionRule {
    /// Checks that this build knows the rule (a manifest from a future version may not).
    pub(crate) fn validate(&self) -> Result<()> {
        if self.kind != RULE_KIND || self.buckets != BUCKETS {
            return Err(Error::Encoding {
                what: "partition rule".into(),
                message: format!(
                    "unknown rule {:?} with {} buckets (this build knows {RULE_KIND:?} with {BUCKETS})",
                    self.kind, self.buckets
                ),
            });
        }
        Ok(())
    }

    /// The bucket of an id (its raw 64 bits).
    #[inline]
    pub fn bucket_of(id_bits: u64) -> u32 {
        (fmix64(id_bits) >> 48) as u32
    }

    /// Checks that shard `shard` of `shard_num` exists: at least one shard, and `shard` below
    /// their number.
    #[doc(hidden)]
    pub fn check_shard(shard: u32, shard_num: u32) -> Result<()> {
        if shard_num == 0 {
            return Err(Error::ZeroShards);
        }
        if shard >= shard_num {
            return Err(Error::ShardOutOfRange {
                index: shard,
                num: shard_num,
            });
        }
        Ok(())
    }

    /// The buckets shard `shard` of `shard_num` owns.
    pub fn bucket_range(shard: u32, shard_num: u32) -> Range<u32> {
        debug_assert!(shard < shard_num);
        let b = u64::from(BUCKETS);
        let start = u64::from(shard) * b / u64::from(shard_num);
        let end = (u64::from(shard) + 1) * b / u64::from(shard_num);
        start as u32..end as u32
    }

    /// The shard of `shard_num` that owns `bucket`: the inverse of [`Self::bucket_range`].
    #[inline]
    pub(crate) fn shard_of_bucket(bucket: u32, shard_num: u32) -> u32 {
        ((u64::from(bucket) + 1) * u64::from(shard_num)).div_ceil(u64::from(BUCKETS)) as u32 - 1
    }

    /// The shard of `shard_num` that owns an id. Trainers route ids to workers with this so that
    /// each worker's partition is exactly what it saves.
    #[inline]
    pub fn shard_of(id_bits: u64, shard_num: u32) -> u32 {
        Self::shard_of_bucket(Self::bucket_of(id_bits), shard_num)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values_are_stable() {
        // These pin the format (cross-checked with an independent Python fmix64): if they change,
        // every checkpoint's row placement changes.
        assert_eq!(fmix64(0), 0);
        assert_eq!(PartitionRule::bucket_of(1), 0xb456);
        assert_eq!(PartitionRule::bucket_of(u64::MAX), 0x64b5);
        assert_eq!(PartitionRule::bucket_of((-1i64) as u64), 0x64b5);
        assert_eq!(PartitionRule::bucket_of(i64::MIN as u64), 0x8f78);
        assert_eq!(PartitionRule::bucket_of(i64::MAX as u64), 0xabb9);
    }

    #[test]
    fn extremes_and_negatives_have_owners() {
        for id in [
            0u64,
            1,
            u64::MAX,
            i64::MIN as u64,
            i64::MAX as u64,
            (-12345i64) as u64,
        ] {
            for m in [1u32, 2, 3, 7, 8, 1000, 65536, 100_000, u32::MAX] {
                let s = PartitionRule::shard_of(id, m);
                assert!(s < m);
                assert!(PartitionRule::bucket_range(s, m).contains(&PartitionRule::bucket_of(id)));
            }
        }
    }

    #[test]
    fn one_shard_owns_everything() {
        assert_eq!(PartitionRule::bucket_range(0, 1), 0..BUCKETS);
    }

    proptest! {
        #[test]
        fn ranges_tile_the_buckets(m in 1u32..5000) {
            let mut next = 0;
            for j in 0..m {
                let r = PartitionRule::bucket_range(j, m);
                prop_assert_eq!(r.start, next);
                next = r.end;
            }
            prop_assert_eq!(next, BUCKETS);
        }

        #[test]
        fn shard_of_bucket_inverts_bucket_range(b in 0u32..BUCKETS, m in 1u32..200_000) {
            let s = PartitionRule::shard_of_bucket(b, m);
            prop_assert!(s < m);
            prop_assert!(PartitionRule::bucket_range(s, m).contains(&b));
        }

        #[test]
        fn every_id_has_exactly_one_owner(id in any::<u64>(), m in 1u32..64) {
            let owners = (0..m)
                .filter(|&j| PartitionRule::bucket_range(j, m).contains(&PartitionRule::bucket_of(id)))
                .count();
            prop_assert_eq!(owners, 1);
        }
    }
}

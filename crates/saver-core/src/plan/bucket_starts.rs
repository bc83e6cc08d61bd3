//! [`BucketStarts`]: where each bucket's rows begin in a table's written order, kept small for
//! small tables.
//!
//! The layout needs, for every table, the row at which each of the 65 536 buckets starts. Held
//! densely that is 512 KiB a table whatever its size, so a model of a few hundred small tables
//! spent most of its plan memory on it. A table with fewer non-empty buckets than that keeps only
//! those, with their starts, and answers by binary search.

use std::ops::Range;

use crate::partition::BUCKETS;

/// The first row of every bucket, and the end.
#[derive(Debug, Default)]
pub(crate) enum BucketStarts {
    /// Emptied: the layout, its only reader, is made.
    #[default]
    Freed,
    /// `starts[b]` for every bucket `b`, and the total at `starts[BUCKETS]`.
    Dense(Vec<u64>),
    /// Non-empty buckets in ascending order, the first row of each, and the total.
    Sparse {
        buckets: Vec<u16>,
        starts: Vec<u64>,
        total: u64,
    },
}

impl BucketStarts {
    /// From the dense starts the scan computes (`BUCKETS + 1` entries), in whichever form is
    /// smaller.
    pub(super) fn new(dense: Vec<u64>) -> Self {
        debug_assert_eq!(dense.len(), BUCKETS as usize + 1);
        let nonempty = dense.windows(2).filter(|w| w[1] > w[0]).count();
        // 10 bytes per non-empty bucket against 8 per bucket.
        if nonempty * 10 >= dense.len() * 8 {
            return Self::Dense(dense);
        }
        let mut buckets = Vec::with_capacity(nonempty);
        let mut starts = Vec::with_capacity(nonempty);
        for (b, w) in dense.windows(2).enumerate() {
            if w[1] > w[0] {
                buckets.push(u16::try_from(b).expect("65 536 buckets"));
                starts.push(w[0]);
            }
        }
        Self::Sparse {
            buckets,
            starts,
            total: dense[dense.len() - 1],
        }
    }

    /// The first row of bucket `b` (`b == BUCKETS`: the number of rows).
    pub(super) fn at(&self, b: u32) -> u64 {
        match self {
            Self::Freed => unreachable!("bucket starts read after the layout freed them"),
            Self::Dense(d) => d[b as usize],
            Self::Sparse {
                buckets,
                starts,
                total,
            } => {
                let i = buckets.partition_point(|&x| u32::from(x) < b);
                starts.get(i).copied().unwrap_or(*total)
            }
        }
    }

    /// Rows of each bucket of `range`, in order.
    pub(super) fn counts(&self, range: Range<u32>) -> impl Iterator<Item = u64> + '_ {
        // Sparse: a cursor over the non-empty buckets, so a walk costs one search in all.
        let mut next = match self {
            Self::Sparse { buckets, .. } => {
                buckets.partition_point(|&x| u32::from(x) < range.start)
            }
            _ => 0,
        };
        range.map(move |b| match self {
            Self::Sparse {
                buckets,
                starts,
                total,
            } => {
                if buckets.get(next).is_some_and(|&x| u32::from(x) == b) {
                    let end = starts.get(next + 1).copied().unwrap_or(*total);
                    let n = end - starts[next];
                    next += 1;
                    n
                } else {
                    0
                }
            }
            _ => self.at(b + 1) - self.at(b),
        })
    }

    /// Bytes held, for tests and reports.
    #[cfg(test)]
    pub(super) fn heap_bytes(&self) -> usize {
        match self {
            Self::Freed => 0,
            Self::Dense(d) => d.len() * 8,
            Self::Sparse {
                buckets, starts, ..
            } => buckets.len() * 2 + starts.len() * 8,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    fn dense_of(counts: &[(u16, u64)]) -> Vec<u64> {
        let mut per = vec![0u64; BUCKETS as usize];
        for &(b, n) in counts {
            per[b as usize] += n;
        }
        let mut dense = vec![0u64];
        for n in per {
            dense.push(dense[dense.len() - 1] + n);
        }
        dense
    }

    proptest! {
        // Large cases hold 65 536 buckets: fewer of them.
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn either_form_answers_as_the_dense_starts(
            counts in prop_oneof![
                vec((any::<u16>(), 1u64..5), 0..200),
                vec((any::<u16>(), 0u64..3), 60_000..70_000),
            ],
            ranges in vec((0u32..=BUCKETS, 0u32..=BUCKETS), 1..8),
        ) {
            let dense = dense_of(&counts);
            let s = BucketStarts::new(dense.clone());
            for b in 0..=BUCKETS {
                prop_assert_eq!(s.at(b), dense[b as usize]);
            }
            for (a, z) in ranges {
                let r = a.min(z)..a.max(z);
                let got: Vec<u64> = s.counts(r.clone()).collect();
                let want: Vec<u64> = r.map(|b| dense[b as usize + 1] - dense[b as usize]).collect();
                prop_assert_eq!(got, want);
            }
            prop_assert!(s.heap_bytes() <= dense.len() * 8);
        }
    }

    #[test]
    fn a_small_table_keeps_only_its_non_empty_buckets() {
        let s = BucketStarts::new(dense_of(&[(7, 3), (9000, 1), (65535, 2)]));
        assert!(matches!(s, BucketStarts::Sparse { .. }));
        assert_eq!(s.heap_bytes(), 3 * 10);
        assert_eq!(
            (s.at(0), s.at(8), s.at(9000), s.at(9001), s.at(BUCKETS)),
            (0, 3, 3, 4, 6)
        );
        let full = BucketStarts::new((0..=u64::from(BUCKETS)).collect());
        assert!(matches!(full, BucketStarts::Dense(_)));
    }
}

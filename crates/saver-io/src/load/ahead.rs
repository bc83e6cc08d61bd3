//! Reading ahead from a remote store: the small tensors a load will read, fetched at once in few
//! requests and kept in memory, so that the load's many small reads (a delta chain's merge reads
//! each link's ids, removed ids and rows part by part) do not each wait on a round trip.
//!
//! A load asks for what it will read (`checkpoint::ahead`), in two batches, so that a resharding
//! load reads no byte it would not have read anyway: first the whole tensors of the segments that
//! lie inside its target buckets and the ids of those that straddle an edge; then, found by a
//! binary search of those ids served from memory, the target's rows of the straddling segments'
//! slots, widened to the CRC blocks around them (what their check reads besides). Smallest first,
//! up to [`AHEAD_BYTES`]: a large tensor is read in large pieces, whose round trips matter little.
//! Each link fetches its share with one batch of ranged GETs, which the store merges and sends
//! concurrently, and the links go at once. The reads of the load are served from memory where
//! they fall inside bytes read ahead ([`ReadAhead::serve`]); every other read goes to the store
//! as before. What was read ahead counts once in the load's bytes read, and the CRC32
//! of every tensor is still checked from the bytes the load read.

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLock};

/// Most bytes a load reads ahead: the memory it holds beyond what it loads, for as long as it runs.
pub(crate) const AHEAD_BYTES: u64 = 64 << 20;

/// Bytes read ahead, by (file, offset in the file).
type Held = BTreeMap<(String, u64), Vec<u8>>;

/// Bytes of a link's files read ahead.
#[derive(Default)]
pub(crate) struct ReadAhead {
    held: RwLock<Held>,
}

impl ReadAhead {
    /// Copies bytes `at..at + dst.len()` of `file` into `dst` if they were read ahead.
    pub(crate) fn serve(&self, file: &str, at: u64, dst: &mut [u8]) -> bool {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        if held.is_empty() {
            return false;
        }
        let Some(((_, start), bytes)) = held
            .range(..=(file.to_string(), at))
            .next_back()
            .filter(|((f, _), _)| f == file)
        else {
            return false;
        };
        let from = (at - start) as usize;
        let Some(src) = bytes.get(from..from + dst.len()) else {
            return false;
        };
        dst.copy_from_slice(src);
        true
    }

    pub(crate) fn hold(&self, file: &str, at: u64, bytes: Vec<u8>) {
        self.held
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((file.to_string(), at), bytes);
    }

    pub(crate) fn forget(&self, keys: &[(String, u64)]) {
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        for k in keys {
            held.remove(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read is served only when every byte of it was read ahead, from the file it names.
    #[test]
    fn only_reads_wholly_inside_a_tensor_read_ahead_are_served() {
        let ahead = ReadAhead::default();
        let mut buf = [0u8; 4];
        assert!(!ahead.serve("a", 0, &mut buf));
        ahead.hold("a", 100, (0u8..50).collect());
        ahead.hold("b", 100, vec![9; 50]);
        assert!(ahead.serve("a", 100, &mut buf));
        assert_eq!(buf, [0, 1, 2, 3]);
        assert!(ahead.serve("a", 146, &mut buf));
        assert_eq!(buf, [46, 47, 48, 49]);
        assert!(ahead.serve("b", 120, &mut buf));
        assert_eq!(buf, [9; 4]);
        // Past the end, before the start, another file.
        assert!(!ahead.serve("a", 147, &mut buf));
        assert!(!ahead.serve("a", 99, &mut buf));
        assert!(!ahead.serve("c", 100, &mut buf));
        assert!(!ahead.serve("", 100, &mut buf));
        ahead.forget(&[("a".into(), 100)]);
        assert!(!ahead.serve("a", 100, &mut buf));
        assert!(ahead.serve("b", 100, &mut buf));
    }
}

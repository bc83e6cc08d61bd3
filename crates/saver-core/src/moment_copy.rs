//! The copies a background save takes of the caller's memory at its moment.
//!
//! A background save copies what it cannot keep (a trainer's dense tensors, a PyTorch model's
//! tensors) before its call returns, and the trainer waits for that copy. Copying into fresh
//! memory costs mostly the kernel's page faults, not the copy: 0.19 s for 0.9 GiB here against
//! 0.03 s into memory already faulted in (benches/torch_peers.py's model, "background save"
//! rows of docs/BENCHMARKS.md). So the memory of the large copies is kept when a save ends
//! ([`MomentCopy`]'s drop) and reused by the next save's copies of the same tensors (by name
//! and length): a trainer saves the same tensors every time. What is kept is bounded by one moment: when the last copy
//! in use ends, kept memory that no copy of the moment just ended took or gave back is freed (the
//! model changed shape, or the copies were of another model), so between saves the process holds
//! at most one model's copy, no more than each save holds while it runs. [`release_kept`] frees
//! it all at once.
//!
//! A copy is also placed where its file will put it: the plan tells each copy where within a
//! page its bytes start in their file (`MomentCopy::place_in_page`), and the next moment's copy
//! of the same tensor starts at that place within a page of its memory. A file written with
//! direct I/O then sends the copy's pages to the disk straight from it, instead of copying them
//! into page-aligned memory of its own on the cores the trainer uses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

/// Bytes a piece of a copy on every core: large enough that its bookkeeping is nothing beside
/// its copy.
const PIECE: usize = 4 << 20;

/// Copies shorter than this are not kept: their faults cost nothing worth the memory.
const KEPT_FROM: usize = 1 << 20;

/// The memory page, the unit of placement of a copy: what direct I/O aligns to.
pub const PAGE: usize = 4096;

/// No place within a page is known yet.
const UNPLACED: usize = usize::MAX;

/// A copy of `src`, made by every core of the current rayon pool a piece each: what a
/// background save copies while the trainer waits (its dense tensors, a Python caller's arrays)
/// is copied at the machine's pace, not one core's, the new memory's pages faulted in by every
/// core at once.
pub(crate) fn copy_on_every_core<T: bytemuck::Pod + Send + Sync>(src: &[T]) -> Vec<T> {
    let piece = (PIECE / std::mem::size_of::<T>().max(1)).max(1);
    if src.len() <= piece {
        return src.to_vec();
    }
    // Zeroed by the allocator, whose fresh pages cost nothing until a piece's copy faults them in.
    let mut out: Vec<T> = bytemuck::zeroed_vec(src.len());
    copy_into(&mut out, src);
    out
}

fn copy_into<T: bytemuck::Pod + Send + Sync>(out: &mut [T], src: &[T]) {
    let piece = (PIECE / std::mem::size_of::<T>().max(1)).max(1);
    out.par_chunks_mut(piece)
        .zip(src.par_chunks(piece))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// A kept buffer, with where within a page the next copy into it starts.
struct Buffer {
    mem: Vec<u8>,
    place: usize,
    /// Whether a copy of the current moment gave it back.
    given: bool,
}

/// Memory kept between moments.
#[derive(Default)]
struct Kept {
    /// By tensor name and length.
    free: HashMap<(String, usize), Vec<Buffer>>,
    /// Kept copies in use.
    in_use: usize,
}

/// Memory kept between moments, shared by the process's saves.
type Pool = Mutex<Option<Kept>>;

static KEPT: Pool = Mutex::new(None);

fn with_kept<R>(pool: &Pool, f: impl FnOnce(&mut Kept) -> R) -> R {
    let mut kept = pool.lock().unwrap_or_else(PoisonError::into_inner);
    f(kept.get_or_insert_with(Kept::default))
}

/// A copy of the caller's bytes a background save holds ([`MomentCopy::of`]); its memory is kept
/// for the next save's copy of the same tensor when it is dropped (see the module's text).
pub struct MomentCopy {
    /// The copy is `mem[start..start + len]`; `mem` has a page more, room to place it.
    mem: Vec<u8>,
    start: usize,
    len: usize,
    /// Where within a page the next moment's copy of this tensor starts ([`UNPLACED`] if no
    /// plan said).
    place: AtomicUsize,
    /// Where its memory goes when it ends, under the tensor's name; none for a small copy.
    kept: Option<(&'static Pool, String)>,
}

impl MomentCopy {
    /// A copy of tensor `name`'s bytes `src`, on every core, into the memory a past moment's
    /// copy of the same tensor left if there is any, placed where that copy's file put it.
    pub fn of(name: &str, src: &[u8]) -> Self {
        Self::filled_in(&KEPT, name, src.len(), |out| {
            copy_into(out, src);
            Ok(())
        })
        .expect("a copy of memory cannot fail")
    }

    /// `len` bytes that `fill` writes, in the memory the last moment's copy of `name` left, as
    /// [`Self::of`] copies: a background save's copy of a tensor its save reads on demand (a
    /// device tensor staged through a host ring). A fill that fails gives the memory back.
    pub(crate) fn filled(
        name: &str,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> crate::Result<()>,
    ) -> crate::Result<Self> {
        Self::filled_in(&KEPT, name, len, fill)
    }

    fn filled_in(
        pool: &'static Pool,
        name: &str,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> crate::Result<()>,
    ) -> crate::Result<Self> {
        if len < KEPT_FROM {
            let mut mem = vec![0u8; len];
            fill(&mut mem)?;
            return Ok(Self {
                mem,
                start: 0,
                len,
                place: AtomicUsize::new(UNPLACED),
                kept: None,
            });
        }
        let key = (name.to_string(), len);
        let reused = with_kept(pool, |k| {
            k.in_use += 1;
            let list = k.free.get_mut(&key)?;
            let buf = list.pop()?;
            if list.is_empty() {
                k.free.remove(&key);
            }
            Some(buf)
        });
        let (mem, place) = match reused {
            Some(b) => (b.mem, b.place),
            // Zeroed by the allocator, whose fresh pages cost nothing until the copy faults them
            // in, on every core.
            None => (vec![0u8; len + PAGE], UNPLACED),
        };
        let start = match place {
            UNPLACED => 0,
            p => (p + PAGE - mem.as_ptr() as usize % PAGE) % PAGE,
        };
        // Made before it is filled, so that a fill that fails gives the memory back (`Drop`).
        let mut copy = Self {
            mem,
            start,
            len,
            place: AtomicUsize::new(place),
            kept: Some((pool, key.0)),
        };
        fill(&mut copy.mem[start..start + len])?;
        Ok(copy)
    }

    /// Says that the file these bytes go to puts them at `in_page` bytes into a page, so that the
    /// next moment's copy of this tensor starts there within a page of its memory.
    pub(crate) fn place_in_page(&self, in_page: usize) {
        self.place.store(in_page % PAGE, Ordering::Relaxed);
    }
}

impl std::ops::Deref for MomentCopy {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for MomentCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MomentCopy")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Drop for MomentCopy {
    fn drop(&mut self) {
        let Some((pool, name)) = self.kept.take() else {
            return;
        };
        let buf = Buffer {
            mem: std::mem::take(&mut self.mem),
            place: self.place.load(Ordering::Relaxed),
            given: true,
        };
        // Freed outside the lock: unmapping a large buffer takes a while.
        let _stale = with_kept(pool, |k| {
            k.free.entry((name, self.len)).or_default().push(buf);
            k.in_use -= 1;
            if k.in_use > 0 {
                return Vec::new();
            }
            let mut stale = Vec::new();
            for list in k.free.values_mut() {
                let (given, left): (Vec<_>, Vec<_>) = list.drain(..).partition(|b| b.given);
                stale.extend(left);
                *list = given
                    .into_iter()
                    .map(|b| Buffer { given: false, ..b })
                    .collect();
            }
            k.free.retain(|_, list| !list.is_empty());
            stale
        });
    }
}

/// Bytes of memory kept for the next background save's copies.
pub fn kept_bytes() -> u64 {
    kept_in(&KEPT)
}

fn kept_in(pool: &Pool) -> u64 {
    with_kept(pool, |k| {
        k.free
            .iter()
            .map(|((_, len), list)| (*len * list.len()) as u64)
            .sum()
    })
}

/// Frees the memory kept for the next background save's copies (copies in use keep theirs
/// until they end, and give it back then).
pub fn release_kept() {
    let _freed = with_kept(&KEPT, |k| std::mem::take(&mut k.free));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy made by every core is the bytes of the source, at every size around a piece's.
    #[test]
    fn a_copy_on_every_core_is_a_copy() {
        for len in [
            0usize,
            1,
            7,
            (4 << 20) - 1,
            4 << 20,
            (4 << 20) + 1,
            (9 << 20) + 3,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            assert_eq!(copy_on_every_core(&src), src, "{len} bytes");
        }
        let ids: Vec<u64> = (0..(1u64 << 20) + 5).map(|i| i * 3).collect();
        assert_eq!(copy_on_every_core(&ids), ids);
    }

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect()
    }

    /// A moment's copies reuse the memory of the previous moment's copies of the same tensors,
    /// hold the bytes of their own source whatever the memory held, start where the plan placed
    /// the previous copy within a page, and what no copy of a moment used is freed when it ends.
    #[test]
    fn copies_reuse_the_last_moments_memory_and_only_it() {
        // A pool of the test's own: the process's is shared with every other test's saves.
        let pool: &'static Pool = Box::leak(Box::default());
        let of = |name: &str, src: &[u8]| {
            MomentCopy::filled_in(pool, name, src.len(), |out| {
                copy_into(out, src);
                Ok(())
            })
            .unwrap()
        };
        let (a, b, small) = (bytes(3 << 20, 3), bytes(5 << 20, 7), bytes(100, 9));
        let first = [of("a", &a), of("b", &b), of("s", &small)];
        assert_eq!(&*first[0], &a[..]);
        assert_eq!(&*first[2], &small[..]);
        first[0].place_in_page(100);
        first[1].place_in_page(PAGE + 4000);
        assert_eq!(
            kept_in(pool),
            0,
            "nothing is kept while the copies are in use"
        );
        drop(first);
        let kept = kept_in(pool);
        assert_eq!(
            kept,
            8 << 20,
            "the large copies' memory is kept, not the small one's"
        );
        // The next moment: other bytes of the same tensors, and one more of a's length.
        let (a2, b2, c2) = (bytes(3 << 20, 11), bytes(5 << 20, 13), bytes(3 << 20, 5));
        let second = [of("a", &a2), of("b", &b2), of("c", &c2)];
        assert_eq!(&*second[0], &a2[..]);
        assert_eq!(&*second[1], &b2[..]);
        assert_eq!(&*second[2], &c2[..]);
        assert_eq!(
            second[0].as_ptr() as usize % PAGE,
            100,
            "placed as the plan said"
        );
        assert_eq!(second[1].as_ptr() as usize % PAGE, 4000);
        assert_eq!(kept_in(pool), 0, "a and b reused the memory");
        drop(second);
        assert_eq!(kept_in(pool), 11 << 20);
        // A moment of another model: the old tensors' memory is freed when it ends.
        let d = bytes(2 << 20, 17);
        let third = of("d", &d);
        assert_eq!(&*third, &d[..]);
        assert_eq!(kept_in(pool), 11 << 20, "kept until the moment ends");
        drop(third);
        assert_eq!(kept_in(pool), 2 << 20, "only the moment just ended is kept");
    }
}

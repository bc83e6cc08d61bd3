//! Reading a chain's rows once resolved: [`Run`]s of consecutive rows of one link, read in
//! coalesced pieces by a [`RunReader`].

use std::ops::Range;

use rayon::prelude::*;
use std::sync::atomic::Ordering;

use super::{ChainTable, LINK_SHIFT};
use crate::error::{Error, Result};
use crate::load::stored::{SegmentRows, ROW_BITS};

/// Rows of one link's segment whose gap is at most this many bytes of a slot are read in one
/// piece, with the rows between: a gap smaller than a page saves the device nothing.
const COALESCE_BYTES: u64 = 4096;

/// Most bytes of rows read in one piece through the scratch buffer when runs are coalesced.
const WINDOW_BYTES: u64 = 512 << 10;

/// Rows `first..first + count` of segment `seg` of link `link`'s rows, which are rows
/// `at..at + count` of what is being read.
#[derive(Clone, Copy, Debug)]
pub(in crate::load::checkpoint) struct Run {
    link: usize,
    seg: usize,
    first: u64,
    count: u64,
    at: usize,
}

impl Run {
    /// Adds `count` rows from the row of `handle` as rows from `at`: to the last run if they
    /// continue it, else as a run.
    pub(super) fn push(runs: &mut Vec<Run>, handle: u64, at: usize, count: u64) {
        let link = (handle >> LINK_SHIFT) as usize;
        let seg = ((handle & ((1 << LINK_SHIFT) - 1)) >> ROW_BITS) as usize;
        let row = handle & ((1 << ROW_BITS) - 1);
        if let Some(r) = runs.last_mut() {
            if r.link == link
                && r.seg == seg
                && r.first + r.count == row
                && r.at + r.count as usize == at
            {
                r.count += count;
                return;
            }
        }
        runs.push(Run {
            link,
            seg,
            first: row,
            count,
            at,
        });
    }
}

/// Runs `runs` of a fill, rows `rows` of segment `seg` of link `link`: read in one piece.
struct Group {
    runs: Range<usize>,
    link: usize,
    seg: usize,
    rows: Range<u64>,
}

/// Reads the rows of `groups` (all of one link of `t`) in one batch: one buffer a group and
/// slot, empty for a slot `out` does not want.
fn read_link_groups(
    t: &ChainTable<'_>,
    groups: &[Group],
    widths: &[usize],
    out: &[&mut [u8]],
) -> Result<Vec<Vec<Vec<u8>>>> {
    let rows = &t.links[groups[0].link].rows;
    let mut bufs: Vec<Vec<Vec<u8>>> = groups
        .iter()
        .map(|x| {
            let n = (x.rows.end - x.rows.start) as usize;
            widths
                .iter()
                .zip(out)
                .map(|(&w, o)| vec![0u8; if o.is_empty() { 0 } else { n * w }])
                .collect()
        })
        .collect();
    let mut reads: Vec<SegmentRows<'_>> = groups
        .iter()
        .zip(bufs.iter_mut())
        .map(|(x, b)| {
            (
                x.seg,
                x.rows.clone(),
                b.iter_mut().map(Vec::as_mut_slice).collect(),
            )
        })
        .collect();
    rows.read_segments(&mut reads)?;
    drop(reads);
    let read: u64 = bufs.iter().flatten().map(|s| s.len() as u64).sum();
    t.bytes_read.fetch_add(read, Ordering::Relaxed);
    Ok(bufs)
}

/// Reads runs of link rows, with scratch buffers kept between calls.
#[derive(Default)]
pub(in crate::load::checkpoint) struct RunReader {
    scratch: Vec<Vec<u8>>,
    /// Where [`RunReader::by_link`] puts runs.
    sorted: Vec<Run>,
    /// Whether the rows go to memory that is not read again soon (a load's final arrays), and
    /// so are better copied there past the caches.
    streaming: bool,
}

impl RunReader {
    /// A reader into a load's final arrays: see [`RunReader::streaming`].
    pub(in crate::load::checkpoint) fn into_final_arrays() -> Self {
        Self {
            streaming: true,
            ..Self::default()
        }
    }

    /// Orders `runs` by link, keeping their order within a link (a counting sort: a merge's
    /// runs number a tenth of its rows, and a comparison sort of them cost more than the rest of
    /// the merge's bookkeeping).
    fn by_link(&mut self, runs: &mut [Run]) {
        let links = runs.iter().map(|r| r.link).max().map_or(0, |m| m + 1);
        let mut starts = vec![0usize; links + 1];
        for r in runs.iter() {
            starts[r.link + 1] += 1;
        }
        for l in 0..links {
            starts[l + 1] += starts[l];
        }
        self.sorted.clear();
        self.sorted.resize(runs.len(), runs[0]);
        for r in runs.iter() {
            self.sorted[starts[r.link]] = *r;
            starts[r.link] += 1;
        }
        runs.copy_from_slice(&self.sorted);
    }

    /// Copies the rows of `runs`, read as rows from `first` into `read` (one buffer a slot), to
    /// their places in `out`.
    fn copy_out<B: AsRef<[u8]>>(
        &self,
        runs: &[Run],
        first: u64,
        read: &[B],
        widths: &[usize],
        out: &mut [&mut [u8]],
    ) {
        for r in runs {
            let (from, k) = ((r.first - first) as usize, r.count as usize);
            for ((o, src), &w) in out.iter_mut().zip(read).zip(widths) {
                if !o.is_empty() {
                    let src = src.as_ref();
                    let (to, from) = (
                        &mut o[r.at * w..(r.at + k) * w],
                        &src[from * w..(from + k) * w],
                    );
                    if self.streaming {
                        copy_streaming(to, from);
                    } else {
                        to.copy_from_slice(from);
                    }
                }
            }
        }
    }

    /// Reads the rows of `runs` (of `t`) into `out`, one slice a slot holding the rows at the
    /// runs' `at` (an empty slice: that slot is not wanted). Runs of one link's segment separated
    /// by less than [`COALESCE_BYTES`] of any slot are read in one piece (the rows between them,
    /// which a newer link replaced or removed, are read and skipped), so that a base shadowed
    /// here and there by deltas is read in long runs rather than row by row; a run read alone
    /// goes straight into `out`, the others through a scratch buffer, one copy a run.
    pub(in crate::load::checkpoint) fn fill(
        &mut self,
        t: &ChainTable<'_>,
        runs: &mut [Run],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        // Link by link; within a link, runs come in row order already (a merge emits each
        // link's rows in its order), so a stable sort by link alone is a merge of sorted runs.
        if !runs.is_sorted_by_key(|r| r.link) {
            self.by_link(runs);
        }
        if !runs.is_sorted_by_key(|r| (r.link, r.seg, r.first)) {
            runs.sort_unstable_by_key(|r| (r.link, r.seg, r.first));
        }
        let widths: Vec<usize> = t.row_bytes.iter().map(|&b| b as usize).collect();
        let remote = t.links.iter().any(|l| l.rows.checkpoint().is_remote());
        let window = (WINDOW_BYTES / t.full_row_bytes()).max(1);
        // On a remote store a gap costs bytes, not a round trip: the store fetches short gaps
        // between the ranges asked for anyway, and the CRC check of a tensor read in part reads
        // every gap later, a request each. Rows up to a window apart are read in one piece, so
        // that their gap is read once, now, and counts toward its tensor's check.
        let gap = if remote {
            window
        } else {
            (COALESCE_BYTES / t.row_bytes.iter().copied().max().unwrap_or(1).max(1)).max(1)
        };
        self.scratch.resize_with(widths.len(), Vec::new);
        // The pieces to read: runs `a..b` of `runs`, rows `first..end` of one link's segment.
        let mut groups: Vec<Group> = Vec::new();
        let mut a = 0;
        while a < runs.len() {
            let Run {
                link, seg, first, ..
            } = runs[a];
            let mut end = first + runs[a].count;
            let mut b = a + 1;
            while b < runs.len() {
                let r = &runs[b];
                if r.link != link || r.seg != seg || r.first < end || r.first - end > gap {
                    break;
                }
                if r.first + r.count - first > window {
                    // The rows up to the next run are read with this piece, not left as a gap
                    // that its tensor's CRC check reads later with a request of its own.
                    end = r.first;
                    break;
                }
                end = r.first + r.count;
                b += 1;
            }
            match t.links.get(link) {
                Some(l) if seg < l.rows.segment_count() && end <= l.rows.segment_rows(seg) => {}
                _ => {
                    return Err(Error::Mismatch(format!(
                        "rows {first}..{end} of segment {seg} of link {link} are not table {:?}'s",
                        t.schema.name
                    )))
                }
            }
            groups.push(Group {
                runs: a..b,
                link,
                seg,
                rows: first..end,
            });
            a = b;
        }
        // Groups come link by link: the links' ranges of `groups`.
        let mut by_link: Vec<Range<usize>> = Vec::new();
        for (i, x) in groups.iter().enumerate() {
            match by_link.last_mut() {
                Some(r) if groups[r.start].link == x.link => r.end = i + 1,
                _ => by_link.push(i..i + 1),
            }
        }
        if remote {
            // Every piece of a link in one batch, and the links at once: a remote store fetches
            // them together, where one piece at a time waited a round trip each.
            let read: Vec<Vec<Vec<Vec<u8>>>> = by_link
                .par_iter()
                .map(|r| read_link_groups(t, &groups[r.clone()], &widths, out))
                .collect::<Result<_>>()?;
            for (r, bufs) in by_link.iter().zip(&read) {
                for (x, b) in groups[r.clone()].iter().zip(bufs) {
                    self.copy_out(&runs[x.runs.clone()], x.rows.start, b, &widths, out);
                }
            }
        } else {
            for x in &groups {
                let rows = &t.links[x.link].rows;
                let (first, end) = (x.rows.start, x.rows.end);
                let n = (end - first) as usize;
                if x.runs.len() == 1 {
                    // A run read alone goes straight into `out`.
                    let at = runs[x.runs.start].at;
                    let mut bufs: Vec<&mut [u8]> = out
                        .iter_mut()
                        .zip(&widths)
                        .map(|(o, &w)| {
                            if o.is_empty() {
                                &mut [][..]
                            } else {
                                &mut o[at * w..(at + n) * w]
                            }
                        })
                        .collect();
                    rows.read_segment(x.seg, first..end, &mut [], &mut bufs)?;
                    let read: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                    t.bytes_read.fetch_add(read, Ordering::Relaxed);
                    continue;
                }
                let mut scratch = std::mem::take(&mut self.scratch);
                let mut bufs: Vec<&mut [u8]> = scratch
                    .iter_mut()
                    .zip(&widths)
                    .zip(out.iter())
                    .map(|((s, &w), o)| {
                        if o.is_empty() {
                            &mut [][..]
                        } else {
                            s.resize(n * w, 0);
                            &mut s[..n * w]
                        }
                    })
                    .collect();
                rows.read_segment(x.seg, first..end, &mut [], &mut bufs)?;
                let read: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                t.bytes_read.fetch_add(read, Ordering::Relaxed);
                let views: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
                self.copy_out(&runs[x.runs.clone()], first, &views, &widths, out);
                drop(bufs);
                self.scratch = scratch;
            }
        }
        // The streaming stores of `copy_streaming` ordered before whatever follows.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: SSE is part of x86_64.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
        Ok(())
    }
}

/// Copies `src` into `dst` (of the same length) with stores that bypass the caches where it can:
/// `dst` is memory the load will not read again soon, and an ordinary store first reads the
/// line it writes.
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let (d_head, d_rest) = dst.split_at_mut(head);
        let (s_head, s_rest) = src.split_at(head);
        d_head.copy_from_slice(s_head);
        let body = d_rest.len() / 16 * 16;
        for i in (0..body).step_by(16) {
            // SAFETY: `i + 16 <= body <= len` of both slices, `d_rest` is 16-byte aligned here,
            // and SSE2 is part of x86_64.
            unsafe {
                let v = _mm_loadu_si128(s_rest.as_ptr().add(i).cast::<__m128i>());
                _mm_stream_si128(d_rest.as_mut_ptr().add(i).cast::<__m128i>(), v);
            }
        }
        d_rest[body..].copy_from_slice(&s_rest[body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Streaming copies give the bytes of an ordinary copy, whatever the alignment and
        /// length of either side, and touch nothing outside the destination.
        #[test]
        fn copy_streaming_is_a_copy(
            src in proptest::collection::vec(any::<u8>(), 0..300),
            from in 0usize..17,
            to in 0usize..17,
            len in 0usize..280,
        ) {
            let from = from.min(src.len());
            let len = len.min(src.len() - from);
            let mut dst = vec![0xA5u8; to + len + 17];
            let mut want = dst.clone();
            want[to..to + len].copy_from_slice(&src[from..from + len]);
            copy_streaming(&mut dst[to..to + len], &src[from..from + len]);
            prop_assert_eq!(dst, want);
        }
    }
}

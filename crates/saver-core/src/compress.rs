//! Per-column compression: the codec a compressed checkpoint's tensors are stored with (format
//! versions 3 and 4, `docs/FORMAT.md`).
//!
//! What pays, measured (`cargo bench --bench column_codecs`): fp32 embedding and optimizer rows
//! hardly compress (about 1.1×, a little more with their bytes shuffled), while sorted ids with
//! their differences taken, rows that are mostly zero and values that are really bf16 do (1.5× to
//! several times). So compression is chosen per column ([`choose`]), among the filters that suit
//! its element type, and a column that does not shrink by [`MIN_RATIO`] stays raw.
//!
//! A column is cut into frames of a fixed number of raw bytes (the last one shorter), each one
//! zstd frame compressed on its own with its filter applied to it alone: a read of some rows
//! decompresses only the frames that hold them, as a read of some rows of a raw tensor checks
//! only the CRC blocks it touches. Frames are sized like those blocks.

use std::fmt;

/// Below this ratio of raw to stored bytes a column is stored raw: a reader would pay the
/// decompression for too little.
pub const MIN_RATIO: f64 = 1.1;

/// What a column's bytes go through before zstd, so that it finds what repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// The bytes as they are.
    Plain,
    /// Byte planes of `width`-byte elements: byte 0 of every element, then byte 1, …. The
    /// sign and exponent bytes of floats, or the high bytes of small integers, then lie
    /// together.
    Shuffle(u8),
    /// 64-bit integers: each replaced by its difference from the one before (wrapping), then
    /// shuffled by 8. Sorted ids become small numbers whose high bytes are zero.
    Delta8,
}

impl Filter {
    /// The filter's name, as a compressed column's metadata will give it.
    pub fn name(self) -> String {
        match self {
            Filter::Plain => "plain".into(),
            Filter::Shuffle(w) => format!("shuffle{w}"),
            Filter::Delta8 => "delta8".into(),
        }
    }

    /// The filter called `name` ([`Self::name`]).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "plain" => Some(Filter::Plain),
            "delta8" => Some(Filter::Delta8),
            _ => match name.strip_prefix("shuffle")?.parse::<u8>().ok()? {
                w @ (2 | 4 | 8) => Some(Filter::Shuffle(w)),
                _ => None,
            },
        }
    }

    /// Bytes of one element the filter works on: a column's raw length and every frame's must
    /// be a multiple of it.
    pub fn element(self) -> usize {
        match self {
            Filter::Plain => 1,
            Filter::Shuffle(w) => w as usize,
            Filter::Delta8 => 8,
        }
    }

    /// Writes `raw`, filtered, into `out` (resized to `raw.len()`).
    fn apply(self, raw: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.resize(raw.len(), 0);
        match self {
            Filter::Plain => out.copy_from_slice(raw),
            Filter::Shuffle(w) => shuffle(raw, w as usize, out),
            Filter::Delta8 => {
                let mut diffs = Vec::with_capacity(raw.len());
                let mut before = 0u64;
                for c in raw.chunks_exact(8) {
                    let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                    diffs.extend_from_slice(&v.wrapping_sub(before).to_le_bytes());
                    before = v;
                }
                shuffle(&diffs, 8, out);
            }
        }
    }

    /// Undoes [`Self::apply`]: `filtered` back into `out` (of the same length).
    fn undo(self, filtered: &[u8], out: &mut [u8]) {
        match self {
            Filter::Plain => out.copy_from_slice(filtered),
            Filter::Shuffle(w) => unshuffle(filtered, w as usize, out),
            Filter::Delta8 => {
                unshuffle(filtered, 8, out);
                let mut before = 0u64;
                for c in out.chunks_exact_mut(8) {
                    let v =
                        u64::from_le_bytes((&*c).try_into().expect("8 bytes")).wrapping_add(before);
                    c.copy_from_slice(&v.to_le_bytes());
                    before = v;
                }
            }
        }
    }
}

/// Byte `k` of element `i` of `raw` to `out[k * n + i]`.
fn shuffle(raw: &[u8], width: usize, out: &mut [u8]) {
    match width {
        2 => shuffle_n::<2>(raw, out),
        #[cfg(target_arch = "x86_64")]
        4 => sse2::shuffle4(raw, out),
        #[cfg(not(target_arch = "x86_64"))]
        4 => shuffle_n::<4>(raw, out),
        8 => shuffle_n::<8>(raw, out),
        _ => out.copy_from_slice(raw),
    }
}

/// The inverse of [`shuffle`].
fn unshuffle(planes: &[u8], width: usize, out: &mut [u8]) {
    match width {
        2 => unshuffle_n::<2>(planes, out),
        #[cfg(target_arch = "x86_64")]
        4 => sse2::unshuffle4(planes, out),
        #[cfg(not(target_arch = "x86_64"))]
        4 => unshuffle_n::<4>(planes, out),
        8 => unshuffle_n::<8>(planes, out),
        _ => out.copy_from_slice(planes),
    }
}

/// [`shuffle`] for `W`-byte elements, [`BLOCK`] elements at a time: each block is read once,
/// from cache, and scattered into `W` runs of `BLOCK` bytes (a pass per plane over the whole
/// frame ran about 10 % slower in `column_codecs`). The moves are still byte by byte: a
/// vectorised transpose would take a further few percent off a compressing writer's time.
fn shuffle_n<const W: usize>(raw: &[u8], out: &mut [u8]) {
    let n = raw.len() / W;
    let blocks = n / BLOCK;
    for b in 0..blocks {
        let src = &raw[b * BLOCK * W..(b + 1) * BLOCK * W];
        for k in 0..W {
            let dst = &mut out[k * n + b * BLOCK..k * n + (b + 1) * BLOCK];
            for (j, d) in dst.iter_mut().enumerate() {
                *d = src[j * W + k];
            }
        }
    }
    for i in blocks * BLOCK..n {
        for k in 0..W {
            out[k * n + i] = raw[i * W + k];
        }
    }
}

/// The byte planes of 4-byte elements (fp32 rows, most of a checkpoint's bytes) with SSE2,
/// which every x86-64 processor has: 16 elements at a time, transposed in registers by three
/// rounds of byte interleaves and one of 64-bit ones. The scalar [`shuffle_n`] moved a byte an
/// instruction and took about a quarter of a compressing writer's time.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi64, _mm_unpackhi_epi8,
        _mm_unpacklo_epi64, _mm_unpacklo_epi8,
    };

    /// Interleaves the bytes of `a` and `b`: (of their low halves, of their high halves).
    fn zip8(a: __m128i, b: __m128i) -> (__m128i, __m128i) {
        // SAFETY: SSE2 is part of x86-64; the intrinsics only compute on registers.
        unsafe { (_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)) }
    }

    /// The low 64-bit halves of `a` and `b` side by side, then their high halves.
    fn zip64(a: __m128i, b: __m128i) -> (__m128i, __m128i) {
        // SAFETY: as in `zip8`.
        unsafe { (_mm_unpacklo_epi64(a, b), _mm_unpackhi_epi64(a, b)) }
    }

    fn load(b: &[u8]) -> __m128i {
        let b: &[u8; 16] = b.try_into().expect("16 bytes");
        // SAFETY: an unaligned load of exactly the 16 bytes borrowed.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    fn store(v: __m128i, b: &mut [u8]) {
        let b: &mut [u8; 16] = b.try_into().expect("16 bytes");
        // SAFETY: an unaligned store into exactly the 16 bytes borrowed.
        unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) }
    }

    /// 8 elements (two registers) as [plane 0 | plane 1] and [plane 2 | plane 3]: each round
    /// of byte interleaves halves the distance between an element's bytes of one plane.
    fn planes_of_8(a: __m128i, b: __m128i) -> (__m128i, __m128i) {
        let (x0, x1) = zip8(a, b);
        let (y0, y1) = zip8(x0, x1);
        zip8(y0, y1)
    }

    pub(super) fn shuffle4(raw: &[u8], out: &mut [u8]) {
        let n = raw.len() / 4;
        let blocks = n / 16;
        for b in 0..blocks {
            let src = &raw[b * 64..(b + 1) * 64];
            let (lo01, lo23) = planes_of_8(load(&src[..16]), load(&src[16..32]));
            let (hi01, hi23) = planes_of_8(load(&src[32..48]), load(&src[48..]));
            let (p0, p1) = zip64(lo01, hi01);
            let (p2, p3) = zip64(lo23, hi23);
            for (k, p) in [p0, p1, p2, p3].into_iter().enumerate() {
                store(p, &mut out[k * n + b * 16..k * n + b * 16 + 16]);
            }
        }
        for i in blocks * 16..n {
            for k in 0..4 {
                out[k * n + i] = raw[i * 4 + k];
            }
        }
    }

    pub(super) fn unshuffle4(planes: &[u8], out: &mut [u8]) {
        let n = planes.len() / 4;
        let blocks = n / 16;
        for b in 0..blocks {
            let p: [__m128i; 4] =
                std::array::from_fn(|k| load(&planes[k * n + b * 16..k * n + b * 16 + 16]));
            // Bytes 0 and 2 of each element paired, and 1 and 3; then the pairs interleaved
            // give whole elements, four to a register.
            let (e02lo, e02hi) = zip8(p[0], p[2]);
            let (e13lo, e13hi) = zip8(p[1], p[3]);
            let (a0, a1) = zip8(e02lo, e13lo);
            let (a2, a3) = zip8(e02hi, e13hi);
            let dst = &mut out[b * 64..(b + 1) * 64];
            for (k, a) in [a0, a1, a2, a3].into_iter().enumerate() {
                store(a, &mut dst[k * 16..(k + 1) * 16]);
            }
        }
        for i in blocks * 16..n {
            for k in 0..4 {
                out[i * 4 + k] = planes[k * n + i];
            }
        }
    }
}

/// Elements [`shuffle_n`] and [`unshuffle_n`] move at a time.
const BLOCK: usize = 16;

/// [`unshuffle`] for `W`-byte elements, [`BLOCK`] elements at a time as [`shuffle_n`].
fn unshuffle_n<const W: usize>(planes: &[u8], out: &mut [u8]) {
    let n = planes.len() / W;
    let blocks = n / BLOCK;
    for b in 0..blocks {
        let dst = &mut out[b * BLOCK * W..(b + 1) * BLOCK * W];
        for k in 0..W {
            let src = &planes[k * n + b * BLOCK..k * n + (b + 1) * BLOCK];
            for (j, s) in src.iter().enumerate() {
                dst[j * W + k] = *s;
            }
        }
    }
    for i in blocks * BLOCK..n {
        for k in 0..W {
            out[i * W + k] = planes[k * n + i];
        }
    }
}

/// Why a compressed column cannot be made or read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecError(pub String);

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

/// A column compressed frame by frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compressed {
    /// The filter every frame went through.
    pub filter: Filter,
    /// Raw bytes of every frame but the last (which holds the rest).
    pub frame_raw_bytes: usize,
    /// The raw column's length.
    pub raw_len: usize,
    /// Stored bytes of each frame, in order.
    pub frame_lens: Vec<u32>,
    /// The frames, back to back.
    pub bytes: Vec<u8>,
}

impl Compressed {
    /// Raw bytes over stored bytes.
    pub fn ratio(&self) -> f64 {
        self.raw_len as f64 / self.bytes.len().max(1) as f64
    }

    /// The raw byte range of frame `k`.
    pub(crate) fn frame_raw_range(&self, k: usize) -> std::ops::Range<usize> {
        let start = k * self.frame_raw_bytes;
        start..(start + self.frame_raw_bytes).min(self.raw_len)
    }

    /// Decompresses frame `k` into `out`, which holds exactly its raw bytes.
    #[cfg(test)]
    pub(crate) fn frame_into(&self, k: usize, out: &mut [u8]) -> Result<(), CodecError> {
        let start: usize = self.frame_lens[..k].iter().map(|&l| l as usize).sum();
        let stored = &self.bytes[start..start + self.frame_lens[k] as usize];
        decompress_frame(self.filter, stored, out)
    }

    /// The whole raw column: the frames in order, each found where the one before ended (not
    /// by summing the lengths before it, as a read of one frame must).
    pub fn decompress(&self) -> Result<Vec<u8>, CodecError> {
        let mut out = vec![0u8; self.raw_len];
        let mut start = 0;
        for (k, &len) in self.frame_lens.iter().enumerate() {
            let stored = &self.bytes[start..start + len as usize];
            decompress_frame(self.filter, stored, &mut out[self.frame_raw_range(k)])?;
            start += len as usize;
        }
        Ok(out)
    }
}

/// Compresses `raw` with `filter`, in frames of `frame_raw_bytes` (a multiple of the filter's
/// element), at zstd `level`.
pub fn compress(
    raw: &[u8],
    filter: Filter,
    frame_raw_bytes: usize,
    level: i32,
) -> Result<Compressed, CodecError> {
    let element = filter.element();
    if frame_raw_bytes == 0
        || !frame_raw_bytes.is_multiple_of(element)
        || !raw.len().is_multiple_of(element)
    {
        return Err(CodecError(format!(
            "frames of {frame_raw_bytes} bytes of a {} byte column do not hold whole {element}-byte \
             elements ({})",
            raw.len(),
            filter.name()
        )));
    }
    let mut compressor = FrameCompressor::new(level)?;
    let mut bytes = Vec::new();
    let mut frame_lens = Vec::with_capacity(raw.len().div_ceil(frame_raw_bytes));
    for frame in raw.chunks(frame_raw_bytes) {
        frame_lens.push(compressor.compress_frame(frame, filter, &mut bytes)?);
    }
    Ok(Compressed {
        filter,
        frame_raw_bytes,
        raw_len: raw.len(),
        frame_lens,
        bytes,
    })
}

/// Compresses frames one after the other, reusing its zstd context and buffer.
pub struct FrameCompressor {
    zstd: zstd::bulk::Compressor<'static>,
    filtered: Vec<u8>,
    scratch: Vec<u8>,
}

impl FrameCompressor {
    /// A compressor at zstd `level`.
    pub fn new(level: i32) -> Result<Self, CodecError> {
        Ok(Self {
            zstd: zstd::bulk::Compressor::new(level)
                .map_err(|e| CodecError(format!("zstd level {level}: {e}")))?,
            filtered: Vec::new(),
            scratch: Vec::new(),
        })
    }

    /// Appends frame `raw`, filtered and compressed, to `out` and returns its stored length;
    /// `raw` itself when compression does not make it shorter (a stored frame as long as its
    /// raw bytes holds them as they are). `raw` must hold whole elements of the filter, and at
    /// most `u32::MAX` bytes.
    #[doc(hidden)]
    pub fn compress_frame(
        &mut self,
        raw: &[u8],
        filter: Filter,
        out: &mut Vec<u8>,
    ) -> Result<u32, CodecError> {
        if raw.len() > u32::MAX as usize || !raw.len().is_multiple_of(filter.element()) {
            return Err(CodecError(format!(
                "a frame of {} bytes does not hold whole {}-byte elements ({})",
                raw.len(),
                filter.element(),
                filter.name()
            )));
        }
        filter.apply(raw, &mut self.filtered);
        let before = out.len();
        // Room for a frame one byte shorter than its raw bytes: past that it is stored raw.
        let room = raw.len().saturating_sub(1);
        if self.scratch.len() < room {
            self.scratch.resize(room, 0);
        }
        match self
            .zstd
            .compress_to_buffer(&self.filtered[..], &mut self.scratch[..room])
        {
            Ok(n) => out.extend_from_slice(&self.scratch[..n]),
            Err(_) => out.extend_from_slice(raw),
        }
        Ok((out.len() - before) as u32)
    }
}

/// Decompresses one stored frame into `out`, which must be exactly its raw length: a frame that
/// holds more or fewer bytes, or is not zstd, is an error. A stored frame exactly as long as its
/// raw bytes holds them as they are.
#[doc(hidden)]
pub fn decompress_frame(filter: Filter, stored: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    if stored.len() == out.len() {
        out.copy_from_slice(stored);
        return Ok(());
    }
    if !out.len().is_multiple_of(filter.element()) {
        return Err(CodecError(format!(
            "a frame of {} raw bytes does not hold whole {}-byte elements",
            out.len(),
            filter.element()
        )));
    }
    // Every frame records its raw length (the compressor is told it): a frame claiming another
    // length is refused before anything is decompressed.
    match zstd::zstd_safe::get_frame_content_size(stored) {
        Ok(Some(n)) if n == out.len() as u64 => {}
        Ok(Some(n)) => {
            return Err(CodecError(format!(
                "a stored frame decompresses to {}{} bytes, not {}",
                if n > out.len() as u64 {
                    "more than "
                } else {
                    ""
                },
                n.min(out.len() as u64),
                out.len()
            )))
        }
        Ok(None) => {
            return Err(CodecError(
                "a stored frame does not record its length".into(),
            ))
        }
        Err(_) => return Err(CodecError("a stored frame is not zstd".into())),
    }
    DECODER.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            let d = zstd::bulk::Decompressor::new()
                .map_err(|e| CodecError(format!("zstd could not start: {e}")))?;
            *cell = Some((d, Vec::new()));
        }
        let (decoder, filtered) = cell.as_mut().expect("just made");
        // Straight into `out` when there is no filter to undo; otherwise into a buffer of this
        // thread's.
        let dst: &mut [u8] = if filter == Filter::Plain {
            &mut *out
        } else {
            filtered.resize(out.len(), 0);
            &mut filtered[..]
        };
        let got = decoder
            .decompress_to_buffer(stored, &mut *dst)
            .map_err(|e| CodecError(format!("a stored frame does not decompress: {e}")))?;
        if got != dst.len() {
            return Err(CodecError(format!(
                "a stored frame decompresses to {got} bytes, not {}",
                dst.len()
            )));
        }
        if filter != Filter::Plain {
            filter.undo(filtered, out);
        }
        Ok(())
    })
}

thread_local! {
    /// Each thread's zstd decompression context and filter buffer, reused frame after frame.
    static DECODER: std::cell::RefCell<Option<(zstd::bulk::Decompressor<'static>, Vec<u8>)>> =
        const { std::cell::RefCell::new(None) };
}

/// What a column holds, for [`choose`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnKind {
    /// 64-bit ids in a segment's order (ascending within each bucket).
    Ids,
    /// Elements of `size` bytes (a slot's values).
    Values {
        /// Bytes of one element.
        size: usize,
    },
}

/// The filters worth trying for a column of `kind`.
#[doc(hidden)]
pub fn candidates(kind: ColumnKind) -> Vec<Filter> {
    match kind {
        ColumnKind::Ids => vec![Filter::Delta8, Filter::Shuffle(8), Filter::Plain],
        ColumnKind::Values {
            size: s @ (2 | 4 | 8),
        } => vec![Filter::Shuffle(s as u8), Filter::Plain],
        ColumnKind::Values { .. } => vec![Filter::Plain],
    }
}

/// The best compression of `raw` among the filters that suit `kind`, or `None` when none
/// shrinks it by [`MIN_RATIO`] (store it raw).
pub fn choose(
    raw: &[u8],
    kind: ColumnKind,
    frame_raw_bytes: usize,
    level: i32,
) -> Result<Option<Compressed>, CodecError> {
    let mut best: Option<Compressed> = None;
    for filter in candidates(kind) {
        if !raw.len().is_multiple_of(filter.element())
            || !frame_raw_bytes.is_multiple_of(filter.element())
        {
            continue;
        }
        let c = compress(raw, filter, frame_raw_bytes, level)?;
        if best.as_ref().is_none_or(|b| c.bytes.len() < b.bytes.len()) {
            best = Some(c);
        }
    }
    Ok(best.filter(|b| b.ratio() >= MIN_RATIO))
}

impl std::fmt::Debug for FrameCompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameCompressor")
            .field(
                "buffered",
                &(self.filtered.capacity() + self.scratch.capacity()),
            )
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sorted_ids(n: usize, below: u64) -> Vec<u8> {
        let mut ids: Vec<u64> = (0..n as u64)
            .map(|i| crate::partition::fmix64(i + 1) % below)
            .collect();
        ids.sort_unstable_by_key(|&id| (crate::PartitionRule::bucket_of(id), id));
        ids.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Ids `0..n` (a table whose ids are dense, as a feature's category indices are), in a
    /// segment's order.
    fn dense_ids(n: usize) -> Vec<u8> {
        let mut ids: Vec<u64> = (0..n as u64).collect();
        ids.sort_unstable_by_key(|&id| (crate::PartitionRule::bucket_of(id), id));
        ids.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// The byte planes are what the format defines (byte `k` of element `i` at `k * n + i`),
    /// whichever implementation makes them, for every length.
    #[test]
    fn shuffles_lay_out_the_planes_the_format_defines() {
        for len in [0usize, 4, 60, 64, 68, 1000, 4096, 4100, 65_540] {
            let raw: Vec<u8> = (0..len as u64)
                .map(|i| crate::partition::fmix64(i) as u8)
                .collect();
            for w in [2usize, 4, 8] {
                let raw = &raw[..len / w * w];
                let n = raw.len() / w;
                let mut want = vec![0u8; raw.len()];
                for i in 0..n {
                    for k in 0..w {
                        want[k * n + i] = raw[i * w + k];
                    }
                }
                let mut got = vec![0u8; raw.len()];
                shuffle(raw, w, &mut got);
                assert_eq!(got, want, "shuffle{w} of {len} bytes");
                let mut back = vec![0u8; raw.len()];
                unshuffle(&got, w, &mut back);
                assert_eq!(back, raw, "unshuffle{w} of {len} bytes");
            }
        }
    }

    #[test]
    fn filters_are_named_and_parsed_back() {
        for f in [
            Filter::Plain,
            Filter::Shuffle(2),
            Filter::Shuffle(4),
            Filter::Shuffle(8),
            Filter::Delta8,
        ] {
            assert_eq!(Filter::parse(&f.name()), Some(f));
        }
        for bad in ["", "shuffle", "shuffle3", "shuffle16", "delta", "zstd"] {
            assert_eq!(Filter::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn each_column_gets_the_filter_that_stores_it_smallest_or_stays_raw() {
        // Ids below 2^32 in a segment's order: their high bytes are zero.
        let ids = sorted_ids(1_000_000, 1 << 32);
        let c = choose(&ids, ColumnKind::Ids, 256 << 10, 1)
            .unwrap()
            .expect("compresses");
        assert!(c.ratio() > 1.8, "{}", c.ratio());
        for f in candidates(ColumnKind::Ids) {
            assert!(compress(&ids, f, 256 << 10, 1).unwrap().bytes.len() >= c.bytes.len());
        }
        assert_eq!(c.decompress().unwrap(), ids);
        // Dense ids with many rows a bucket: within a bucket they are close, and their
        // differences small.
        let dense = dense_ids(4_000_000);
        let c = choose(&dense, ColumnKind::Ids, 256 << 10, 1)
            .unwrap()
            .unwrap();
        assert_eq!(c.filter, Filter::Delta8);
        assert!(c.ratio() > 2.9, "{}", c.ratio());
        // Hashed 64-bit ids and uniformly random f32 bits: nothing to find, stored raw.
        let hashed = sorted_ids(200_000, u64::MAX);
        assert_eq!(
            choose(&hashed, ColumnKind::Ids, 256 << 10, 1).unwrap(),
            None
        );
        let noise: Vec<u8> = (0..100_000u64)
            .flat_map(|i| (crate::partition::fmix64(i) as u32).to_le_bytes())
            .collect();
        assert_eq!(
            choose(&noise, ColumnKind::Values { size: 4 }, 256 << 10, 1).unwrap(),
            None
        );
        // Mostly zero rows do compress.
        let mut rows = vec![0u8; 400_000];
        for (i, c) in rows
            .chunks_exact_mut(4)
            .enumerate()
            .filter(|(i, _)| i % 10 == 0)
        {
            c.copy_from_slice(&(crate::partition::fmix64(i as u64) as u32).to_le_bytes());
        }
        let c = choose(&rows, ColumnKind::Values { size: 4 }, 64 << 10, 1)
            .unwrap()
            .unwrap();
        assert!(c.ratio() > 2.0, "{}", c.ratio());
        assert_eq!(c.decompress().unwrap(), rows);
    }

    #[test]
    fn a_frame_that_is_not_what_it_should_be_is_an_error() {
        let ids = sorted_ids(10_000, 1 << 32);
        let c = compress(&ids, Filter::Delta8, 16 << 10, 1).unwrap();
        let mut out = vec![0u8; 16 << 10];
        // Too short a destination: the frame holds more.
        assert!(c
            .frame_into(0, &mut out[..8 << 10])
            .unwrap_err()
            .0
            .contains("more than"));
        // Not zstd.
        let err = decompress_frame(Filter::Plain, b"not a frame", &mut out).unwrap_err();
        assert!(
            err.0.contains("zstd") || err.0.contains("decompress"),
            "{err}"
        );
        // Cut short.
        let first = &c.bytes[..c.frame_lens[0] as usize / 2];
        assert!(decompress_frame(Filter::Delta8, first, &mut out).is_err());
        // Frames must hold whole elements.
        assert!(compress(&ids, Filter::Delta8, 1004, 1).is_err());
    }

    proptest! {
        #[test]
        fn every_frame_decompresses_alone_to_its_raw_bytes(
            words in proptest::collection::vec(any::<u64>(), 0..600),
            small in any::<bool>(),
            frame_words in 1usize..64,
            filter in prop_oneof![
                Just(Filter::Plain),
                Just(Filter::Shuffle(2)),
                Just(Filter::Shuffle(4)),
                Just(Filter::Shuffle(8)),
                Just(Filter::Delta8),
            ],
        ) {
            let raw: Vec<u8> = words
                .iter()
                .map(|&w| if small { w % 1000 } else { w })
                .flat_map(|w| w.to_le_bytes())
                .collect();
            let c = compress(&raw, filter, frame_words * 8, 1).unwrap();
            prop_assert_eq!(c.frame_lens.len(), raw.len().div_ceil(frame_words * 8));
            prop_assert_eq!(c.decompress().unwrap(), raw.clone());
            for k in 0..c.frame_lens.len() {
                let range = c.frame_raw_range(k);
                let mut out = vec![0u8; range.len()];
                c.frame_into(k, &mut out).unwrap();
                prop_assert_eq!(&out[..], &raw[range]);
            }
        }
    }
}

//! Shapes and dense tensors.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::moment_copy::MomentCopy;

/// Number of elements of a shape, refusing overflow.
pub(crate) fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// Exact byte length of a tensor of `shape` and `dtype`, with an error naming `name` when the shape
/// overflows or ends mid-byte.
pub fn byte_len(name: &str, dtype: Dtype, shape: &[u64]) -> Result<u64> {
    let bad = |why| Error::BadShape {
        name: name.to_string(),
        shape: shape.to_vec(),
        dtype: dtype.name().to_string(),
        why,
    };
    let n = element_count(shape).ok_or_else(|| bad("has more elements than fit in 64 bits"))?;
    if !dtype.bits().is_multiple_of(8) && n.checked_mul(dtype.bits()).is_some_and(|b| b % 8 != 0) {
        return Err(bad("does not fill a whole number of bytes"));
    }
    dtype
        .byte_len(n)
        .ok_or_else(|| bad("has a byte size that does not fit in 64 bits"))
}

/// A dense tensor to save: MLP weights, dense optimizer state, anything that is not a sparse table.
///
/// The bytes are borrowed when the trainer can keep them alive for the duration of the save (no
/// copy), owned, or shared with their holder ([`Self::shared`]: a block of a
/// [`crate::RowRangeTable`], which copies it before it changes it). They are little-endian,
/// row-major, as safetensors stores them.
#[derive(Clone, Debug)]
pub struct DenseTensor<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    data: Bytes<'a>,
    read: Arc<ReadCrcs>,
}

/// The CRC32s of the pieces of a tensor read on demand that [`DenseTensor::read_at`] handed
/// out, by offset: once a save's writers have read it all, its [`DenseTensor::crc32`] is theirs
/// combined, so that its bytes are not read a second time (a device tensor's not copied twice
/// through the staging ring).
#[derive(Debug, Default)]
struct ReadCrcs(Mutex<BTreeMap<u64, (u64, crc32fast::Hasher)>>);

impl ReadCrcs {
    fn record(&self, offset: u64, bytes: &[u8]) {
        let mut h = crc32fast::Hasher::new();
        h.update(bytes);
        let mut pieces = self.0.lock().unwrap_or_else(|e| e.into_inner());
        pieces.insert(offset, (bytes.len() as u64, h));
    }

    /// The CRC32 of bytes `0..len`, if the pieces read cover them end to end.
    fn combined(&self, len: u64) -> Option<u32> {
        let pieces = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut whole = crc32fast::Hasher::new();
        let mut at = 0;
        while at < len {
            let (n, h) = pieces.get(&at)?;
            if *n == 0 {
                return None;
            }
            whole.combine(h);
            at += n;
        }
        (at == len).then(|| whole.finalize())
    }
}

/// A tensor's bytes: borrowed, owned, shared, or read on demand.
#[derive(Clone, Debug)]
enum Bytes<'a> {
    Cow(Cow<'a, [u8]>),
    Shared(Arc<Vec<u8>>),
    /// A background save's copy (see [`crate::moment_copy`]).
    Copied(Arc<MomentCopy>),
    /// Read from where they lie as the save writes them ([`DenseTensor::deferred`]).
    Deferred(Arc<dyn ByteSource + 'a>),
    /// Read as the save writes them from a source that outlives every call and holds its bytes
    /// unchanged while a save reads it ([`DenseTensor::lasting`]): a background save keeps it
    /// rather than copying it.
    Lasting(Arc<dyn ByteSource>),
}

/// Where the bytes of a tensor read on demand lie ([`DenseTensor::deferred`]): another
/// checkpoint, a file. A save asks for them a writer's chunk at a time, from several threads
/// at once, so that a tool rewriting a tensor larger than memory holds only those chunks.
pub trait ByteSource: std::fmt::Debug + Send + Sync {
    /// The number of bytes.
    fn len(&self) -> u64;

    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `out` with the bytes from `offset`; `offset + out.len()` is within [`Self::len`].
    /// An error (a checksum that fails, a file gone) fails the save that asked.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()>;
}

/// Every byte of `source`, into memory of their own.
fn read_whole(source: &dyn ByteSource) -> Result<Vec<u8>> {
    let mut out = vec![0u8; source.len() as usize];
    source.read_at(0, &mut out)?;
    Ok(out)
}

impl Bytes<'_> {
    /// The bytes, when they are in memory.
    fn in_memory(&self) -> Option<&[u8]> {
        match self {
            Bytes::Cow(c) => Some(c),
            Bytes::Shared(s) => Some(s),
            Bytes::Copied(c) => Some(c),
            Bytes::Deferred(_) | Bytes::Lasting(_) => None,
        }
    }

    /// Where bytes read on demand come from.
    fn on_demand(&self) -> Option<&dyn ByteSource> {
        match self {
            Bytes::Deferred(d) => Some(&**d),
            Bytes::Lasting(d) => Some(&**d),
            _ => None,
        }
    }

    fn len(&self) -> u64 {
        match self.on_demand() {
            Some(d) => d.len(),
            None => self.in_memory().map_or(0, |b| b.len() as u64),
        }
    }
}

impl<'a> DenseTensor<'a> {
    /// A tensor over `data`, checked: `data.len()` must equal the shape's element count × dtype size.
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<Self> {
        Self::checked(name.into(), dtype, shape, Bytes::Cow(data.into()))
    }

    /// A tensor over bytes shared with their holder: no copy, now or when a background save
    /// takes it; the holder must not change them (it copies them first, as
    /// [`crate::RowRangeTable`] does).
    pub fn shared(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: Arc<Vec<u8>>,
    ) -> Result<DenseTensor<'static>> {
        DenseTensor::checked(name.into(), dtype, shape, Bytes::Shared(data))
    }

    fn checked(name: String, dtype: Dtype, shape: Vec<u64>, data: Bytes<'a>) -> Result<Self> {
        let expected = byte_len(&name, dtype, &shape)?;
        if expected != data.len() {
            return Err(Error::LengthMismatch {
                what: "dense tensor",
                name,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self {
            name,
            dtype,
            shape,
            data,
            read: Arc::default(),
        })
    }

    /// A tensor whose bytes are read from `source` as the save writes them, a writer's chunk at
    /// a time: what `reshard`, `compact` and `save --from` give for a row-range table, so that
    /// they hold what a save holds, not the table. [`Self::bytes`] reads them whole.
    pub fn deferred(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        source: Arc<dyn ByteSource + 'a>,
    ) -> Result<Self> {
        Self::checked(name.into(), dtype, shape, Bytes::Deferred(source))
    }

    /// A tensor read on demand like [`Self::deferred`], from a source that holds its bytes
    /// unchanged for as long as any save reads it (a copy of the save's moment in device
    /// memory): [`Self::into_owned`], and so a background save, keeps it as it is rather than
    /// reading it whole during the call.
    pub fn lasting(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        source: Arc<dyn ByteSource>,
    ) -> Result<Self> {
        Self::checked(name.into(), dtype, shape, Bytes::Lasting(source))
    }

    /// A tensor of `f32` values, borrowed without copy where the platform is little-endian.
    pub fn from_f32(name: impl Into<String>, shape: Vec<u64>, values: &'a [f32]) -> Result<Self> {
        Self::new(
            name,
            Dtype::F32,
            shape,
            bytemuck::cast_slice::<f32, u8>(values),
        )
    }

    /// The tensor's name, as written in the checkpoint.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The raw bytes, when they are in memory: `None` for a tensor read on demand
    /// ([`Self::deferred`]; [`Self::bytes`] reads those).
    pub fn data(&self) -> Option<&[u8]> {
        self.data.in_memory()
    }

    /// The raw bytes, read whole where the tensor is read on demand.
    pub fn bytes(&self) -> Result<Cow<'_, [u8]>> {
        match self.data.on_demand() {
            Some(d) => Ok(Cow::Owned(read_whole(d)?)),
            None => Ok(Cow::Borrowed(self.data.in_memory().unwrap_or_default())),
        }
    }

    /// The CRC32 of the bytes. A tensor read on demand gives the CRC32s of the pieces a save's
    /// writers have read of it, combined, once they cover it ([`Self::read_at`]); otherwise it
    /// is read 8 MiB at a time for it, never whole (a device tensor staged through a bounded
    /// host ring stays bounded).
    pub fn crc32(&self) -> Result<u32> {
        const PIECE: u64 = 8 << 20;
        let Some(source) = self.data.on_demand() else {
            return Ok(crc32fast::hash(self.data.in_memory().unwrap_or_default()));
        };
        let len = source.len();
        if let Some(crc) = self.read.combined(len) {
            return Ok(crc);
        }
        let mut buf = vec![0u8; PIECE.min(len) as usize];
        let mut hasher = crc32fast::Hasher::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            source.read_at(at, &mut buf[..n])?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        Ok(hasher.finalize())
    }

    /// Fills `out` with the bytes from `offset`, wherever they are: what a save's writer asks
    /// for, a chunk at a time. `offset + out.len()` must be within [`Self::byte_len`].
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|end| end > self.byte_len()) {
            return Err(Error::LengthMismatch {
                what: "read of dense tensor",
                name: self.name.clone(),
                expected: self.byte_len(),
                actual: offset.saturating_add(out.len() as u64),
            });
        }
        match self.data.on_demand() {
            Some(d) => {
                d.read_at(offset, out)?;
                self.read.record(offset, out);
                Ok(())
            }
            None => {
                let b = &self.data;
                let at = offset as usize;
                out.copy_from_slice(&b.in_memory().unwrap_or_default()[at..at + out.len()]);
                Ok(())
            }
        }
    }

    /// Byte length.
    pub fn byte_len(&self) -> u64 {
        self.data.len()
    }

    /// The same tensor under another name.
    pub(crate) fn renamed(self, name: String) -> Self {
        Self { name, ..self }
    }

    /// The same tensor over the same bytes, borrowed: no copy (a background save's copy is
    /// shared, so that the plan can tell it where its file puts it).
    pub fn view(&self) -> DenseTensor<'_> {
        let data = match &self.data {
            Bytes::Copied(c) => Bytes::Copied(Arc::clone(c)),
            Bytes::Deferred(d) => Bytes::Deferred(Arc::clone(d) as Arc<dyn ByteSource + '_>),
            Bytes::Lasting(d) => Bytes::Lasting(Arc::clone(d)),
            Bytes::Cow(c) => Bytes::Cow(Cow::Borrowed(c)),
            Bytes::Shared(s) => Bytes::Cow(Cow::Borrowed(s)),
        };
        DenseTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data,
            read: Arc::clone(&self.read),
        }
    }

    /// The background save's copy the bytes are, if they are one ([`Self::into_owned`]).
    pub(crate) fn moment_copy(&self) -> Option<&MomentCopy> {
        match &self.data {
            Bytes::Copied(c) => Some(c),
            _ => None,
        }
    }

    /// The tensor with bytes of its own: a copy where it borrowed them, so that the caller may
    /// change its buffers at once (what a background save needs), made on every core into the
    /// memory the last background save's copy of this tensor left ([`crate::moment_copy`]);
    /// shared bytes stay shared; bytes read on demand are read now, whole, into that memory too
    /// (their source may not outlive the call).
    pub fn into_owned(self) -> Result<DenseTensor<'static>> {
        let data = match self.data {
            Bytes::Cow(Cow::Borrowed(b)) => Bytes::Copied(Arc::new(MomentCopy::of(&self.name, b))),
            Bytes::Cow(Cow::Owned(v)) => Bytes::Cow(Cow::Owned(v)),
            Bytes::Shared(s) => Bytes::Shared(s),
            Bytes::Copied(c) => Bytes::Copied(c),
            Bytes::Lasting(d) => Bytes::Lasting(d),
            Bytes::Deferred(d) => Bytes::Copied(Arc::new(MomentCopy::filled(
                &self.name,
                d.len() as usize,
                |out| d.read_at(0, out),
            )?)),
        };
        Ok(DenseTensor {
            name: self.name,
            dtype: self.dtype,
            shape: self.shape,
            data,
            read: self.read,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes read on demand, counting the largest read and every byte read.
    #[derive(Debug)]
    struct Counted(
        Vec<u8>,
        std::sync::atomic::AtomicUsize,
        std::sync::atomic::AtomicU64,
    );

    impl Counted {
        fn new(bytes: Vec<u8>) -> Self {
            Self(bytes, Default::default(), Default::default())
        }
    }

    impl ByteSource for Counted {
        fn len(&self) -> u64 {
            self.0.len() as u64
        }
        fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
            self.1
                .fetch_max(out.len(), std::sync::atomic::Ordering::Relaxed);
            self.2
                .fetch_add(out.len() as u64, std::sync::atomic::Ordering::Relaxed);
            out.copy_from_slice(&self.0[offset as usize..offset as usize + out.len()]);
            Ok(())
        }
    }

    #[test]
    fn a_lasting_tensor_is_kept_as_it_is_by_a_background_save_not_read_during_the_call() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let source = Arc::new(Counted::new(bytes.clone()));
        let t = DenseTensor::lasting("w", Dtype::U8, vec![10_000], source.clone()).unwrap();
        let owned = t.into_owned().unwrap();
        assert_eq!(source.1.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert!(owned.data().is_none(), "still read on demand");
        let mut out = vec![0u8; 100];
        owned.read_at(5_000, &mut out).unwrap();
        assert_eq!(out, bytes[5_000..5_100]);
        assert_eq!(owned.crc32().unwrap(), crc32fast::hash(&bytes));
    }

    proptest::proptest! {
        /// A tensor whose pieces a save's writers read (in any order, from several threads,
        /// some twice) gives their CRC32s combined, reading nothing more; one they leave a gap
        /// in is read for its CRC32, which is the same.
        #[test]
        fn the_crc_of_a_tensor_its_writers_read_is_theirs_combined(
            len in 0usize..70_000,
            cuts in proptest::collection::vec(1usize..20_000, 0..12),
            gap in proptest::option::of(0usize..12),
            again in 0usize..12,
        ) {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
            let mut pieces = Vec::new();
            let mut at = 0;
            for c in cuts.iter().copied().chain(std::iter::once(usize::MAX)) {
                if at >= len {
                    break;
                }
                let n = c.min(len - at);
                pieces.push(at..at + n);
                at += n;
            }
            let source = Arc::new(Counted::new(bytes.clone()));
            let t = DenseTensor::deferred("w", Dtype::U8, vec![len as u64], source.clone()).unwrap();
            let gap = gap.filter(|&g| g < pieces.len());
            let read: Vec<_> = pieces.iter().enumerate().filter(|(i, _)| Some(*i) != gap).map(|(_, p)| p.clone()).collect();
            std::thread::scope(|s| {
                for (k, p) in read.iter().rev().enumerate() {
                    let t = &t;
                    s.spawn(move || {
                        let mut out = vec![0u8; p.len()];
                        t.read_at(p.start as u64, &mut out).unwrap();
                        if k == again {
                            t.read_at(p.start as u64, &mut out).unwrap();
                        }
                    });
                }
            });
            let before = source.2.load(std::sync::atomic::Ordering::Relaxed);
            proptest::prop_assert_eq!(t.crc32().unwrap(), crc32fast::hash(&bytes));
            let after = source.2.load(std::sync::atomic::Ordering::Relaxed);
            if gap.is_none() {
                proptest::prop_assert_eq!(after, before, "read again for its CRC32");
            } else {
                proptest::prop_assert_eq!(after - before, len as u64);
            }
        }
    }

    #[test]
    fn a_tensor_read_on_demand_is_checksummed_and_copied_a_piece_at_a_time() {
        for len in [0, 1, 4097, (8 << 20) + 3, (17 << 20) + 1] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let source = Arc::new(Counted::new(bytes.clone()));
            let t =
                DenseTensor::deferred("w", Dtype::U8, vec![len as u64], source.clone()).unwrap();
            assert_eq!(t.crc32().unwrap(), crc32fast::hash(&bytes), "{len}");
            let most = source.1.load(std::sync::atomic::Ordering::Relaxed);
            assert!(most <= 8 << 20, "a read of {most} bytes for {len}");
            // A background save's copy of it: the same bytes, owned.
            let owned = t.into_owned().unwrap();
            assert_eq!(owned.data().unwrap(), &bytes[..], "{len}");
        }
    }

    #[test]
    fn dense_tensor_checks_length() {
        assert!(DenseTensor::new("w", Dtype::F32, vec![2, 3], vec![0u8; 24]).is_ok());
        let err = DenseTensor::new("w", Dtype::F32, vec![2, 3], vec![0u8; 23]).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
        assert!(
            err.to_string().contains("expected 24 bytes, got 23"),
            "{err}"
        );
        let err = DenseTensor::new("big", Dtype::U8, vec![u64::MAX, 2], vec![]).unwrap_err();
        assert!(err.to_string().contains("big"), "{err}");
        let err = DenseTensor::new("nib", Dtype::F4, vec![3], vec![0u8; 2]).unwrap_err();
        assert!(err.to_string().contains("whole number of bytes"), "{err}");
    }

    #[test]
    fn scalar_and_empty_shapes() {
        assert_eq!(byte_len("s", Dtype::F64, &[]).unwrap(), 8);
        assert_eq!(byte_len("e", Dtype::F64, &[0, 5]).unwrap(), 0);
    }
}

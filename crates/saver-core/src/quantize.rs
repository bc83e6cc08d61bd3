//! Row-wise quantization of embedding rows into the layouts serving stacks read (FBGEMM's
//! `Fused8BitRowwiseQuantizedSBFloat` and `FusedNBitRowwiseQuantizedSBHalf`, and TorchRec's split
//! form of the latter), bit for bit as FBGEMM's reference conversions compute them.
//!
//! Each row is quantized on its own, against its minimum (the *bias*) and its range:
//!
//! * **8 bits, f32 scale and bias** (`Fused8BitRowwiseQuantizedSBFloat`): `scale = range / 255`,
//!   `bias = min`, `q = round((x - min) * (255 / (range + 1e-8)))`; the row is its `D` bytes, then
//!   `scale` and `bias` as little-endian f32.
//! * **2, 4 or 8 bits, f16 scale and bias** (`FusedNBitRowwiseQuantizedSBHalf`): the minimum is
//!   rounded to f16 first; `scale = range / (2^bits - 1)` rounded to f16 (1 where the range is 0);
//!   `q = clamp(round((x - min) / scale), 0, 2^bits - 1)`, element `i` of a byte in its low bits
//!   first (`q_i << (i * bits)`); the row is its `ceil(D * bits / 8)` bytes, then `scale` and
//!   `bias` as little-endian f16.
//! * **split** (TorchRec's `weight`, `weight_qscale`, `weight_qbias`): the second form's packed
//!   bytes, scales and biases as three tensors.
//!
//! Rounding is to nearest, ties to even (`lrintf` in the default mode); arithmetic is in f32,
//! as in FBGEMM, so the bytes are FBGEMM's own.

use half::f16;

use crate::error::{Error, Result};

/// Bits per quantized value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantBits {
    /// 8 bits, one value a byte.
    Int8,
    /// 4 bits, two values a byte.
    Int4,
    /// 2 bits, four values a byte.
    Int2,
}

impl QuantBits {
    /// The bit rate: 8, 4 or 2.
    pub fn bits(self) -> u32 {
        match self {
            QuantBits::Int8 => 8,
            QuantBits::Int4 => 4,
            QuantBits::Int2 => 2,
        }
    }

    /// Values packed in one byte.
    fn per_byte(self) -> usize {
        (8 / self.bits()) as usize
    }

    /// Bytes of `dim` packed values.
    pub fn packed_bytes(self, dim: usize) -> usize {
        dim.div_ceil(self.per_byte())
    }
}

/// How quantized rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantLayout {
    /// One tensor of fused rows: FBGEMM's `Fused8BitRowwiseQuantizedSBFloat` at 8 bits,
    /// `FusedNBitRowwiseQuantizedSBHalf` at 4 and 2 bits.
    Fused,
    /// One tensor of fused rows in `FusedNBitRowwiseQuantizedSBHalf`, at every bit rate (8 bits
    /// included, with f16 scale and bias).
    FusedHalf,
    /// Three tensors, TorchRec's split form: packed values (u8, `[rows, packed]`), scales and
    /// biases (f16, `[rows, 1]` each), computed as `FusedNBitRowwiseQuantizedSBHalf` does.
    Split,
}

/// Quantized rows: fused rows in `values`, or in the split layout packed values, with scales and
/// biases (f16, little-endian) beside them.
#[derive(Clone, Debug, Default)]
pub struct QuantizedRows {
    /// Fused rows, or the split layout's packed values.
    pub values: Vec<u8>,
    /// The split layout's scales.
    pub scales: Vec<u8>,
    /// The split layout's biases.
    pub biases: Vec<u8>,
}

/// A quantization: bit rate and layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quantization {
    /// Bits per value.
    pub bits: QuantBits,
    /// Layout of the rows.
    pub layout: QuantLayout,
}

impl Quantization {
    /// Whether scale and bias are f32 (FBGEMM's 8-bit SBFloat form) rather than f16.
    fn float_scale(&self) -> bool {
        self.bits == QuantBits::Int8 && self.layout == QuantLayout::Fused
    }

    /// FBGEMM's name of the conversion whose bytes these are: `Fused8BitRowwiseQuantizedSBFloat`
    /// or `FusedNBitRowwiseQuantizedSBHalf` (also for the split layout, whose three tensors are
    /// that form's parts).
    #[doc(hidden)]
    pub fn format_name(&self) -> &'static str {
        if self.float_scale() {
            "Fused8BitRowwiseQuantizedSBFloat"
        } else {
            "FusedNBitRowwiseQuantizedSBHalf"
        }
    }

    /// `fused` or `split`.
    #[doc(hidden)]
    pub fn layout_name(&self) -> &'static str {
        match self.layout {
            QuantLayout::Split => "split",
            QuantLayout::Fused | QuantLayout::FusedHalf => "fused",
        }
    }

    /// Bytes of one fused row of `dim` values: the packed values, then scale and bias.
    #[doc(hidden)]
    pub fn fused_row_bytes(&self, dim: usize) -> usize {
        let scale_bias = if self.float_scale() { 8 } else { 4 };
        self.bits.packed_bytes(dim) + scale_bias
    }

    /// Quantizes `rows` (f32 values, `dim` a row) and appends them to `into`. A non-finite value
    /// is an error naming `what` and the row's index, counted from `first_row`.
    pub fn quantize(
        &self,
        rows: &[f32],
        dim: usize,
        what: &str,
        first_row: u64,
        into: &mut QuantizedRows,
    ) -> Result<()> {
        let QuantizedRows {
            values: out,
            scales,
            biases,
        } = into;
        if dim == 0 {
            return Err(Error::Unquantizable {
                tensor: what.into(),
                why: "its rows hold no values".into(),
            });
        }
        for (k, row) in rows.chunks_exact(dim).enumerate() {
            if row.iter().any(|x| !x.is_finite()) {
                return Err(Error::Unquantizable {
                    tensor: what.into(),
                    why: format!(
                        "row {} holds a value that is not finite",
                        first_row + k as u64
                    ),
                });
            }
            let min = row.iter().copied().fold(f32::INFINITY, f32::min);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let row_at = first_row + k as u64;
            let unfit = |why: String| Error::Unquantizable {
                tensor: what.into(),
                why: format!("row {row_at}: {why}"),
            };
            if self.float_scale() {
                let range = max - min;
                if !range.is_finite() {
                    return Err(unfit(format!(
                        "its values span {min} to {max}, a range past f32's, so no f32 scale \
                         holds it; leave this slot unquantized (--quantize-slots)"
                    )));
                }
                let inverse = 255.0f32 / (range + 1e-8f32);
                // (x - min) * inverse lies in [0, 255] for finite rows, so clamping changes
                // nothing FBGEMM computes.
                out.extend(row.iter().map(|&x| round_in(0, 255, (x - min) * inverse)));
                out.extend_from_slice(&(range / 255.0f32).to_le_bytes());
                out.extend_from_slice(&min.to_le_bytes());
                continue;
            }
            let bias = f16::from_f32(min);
            if bias.is_infinite() {
                return Err(unfit(format!(
                    "its minimum {min} is past f16's range (±65504), where {}'s bias is kept; \
                     export it at int8 in the fused layout (f32 scale and bias) or leave the \
                     slot unquantized (--quantize-slots)",
                    self.format_name()
                )));
            }
            let min = bias.to_f32();
            let range = max - min;
            let levels = (1u32 << self.bits.bits()) - 1;
            let mut scale = if range == 0.0 {
                1.0f32
            } else {
                range / levels as f32
            };
            if f16::from_f32(scale).is_infinite() {
                return Err(unfit(format!(
                    "its values span {min} to {max}: at {} bits that is a step of {}, past \
                     f16's range (±65504), where {}'s scale is kept; export it at int8 in the \
                     fused layout (f32 scale and bias) or leave the slot unquantized \
                     (--quantize-slots)",
                    self.bits.bits(),
                    range / levels as f32,
                    self.format_name()
                )));
            }
            scale = f16::from_f32(scale).to_f32();
            if scale == 0.0 {
                scale = 1.0;
            }
            let mut inverse = 1.0f32 / scale;
            if inverse.is_infinite() {
                scale = 1.0;
                inverse = 1.0;
            }
            let (bits, per_byte) = (self.bits.bits(), self.bits.per_byte());
            for group in row.chunks(per_byte) {
                let mut byte = 0u8;
                for (i, &x) in group.iter().enumerate() {
                    let q = round_in(0, levels as u8, (x - min) * inverse);
                    byte |= q << (i as u32 * bits);
                }
                out.push(byte);
            }
            let (scale, bias) = (f16::from_f32(scale).to_le_bytes(), bias.to_le_bytes());
            if self.layout == QuantLayout::Split {
                scales.extend_from_slice(&scale);
                biases.extend_from_slice(&bias);
            } else {
                out.extend_from_slice(&scale);
                out.extend_from_slice(&bias);
            }
        }
        Ok(())
    }
}

/// `clamp(lrintf(x), low, high)`: `x` rounded to nearest, ties to even, within `[low, high]`.
/// Clamping first gives the same result (rounding is monotonic and the ends are integers) and
/// lets the rounding be an add and a subtract of 2^23, which round to nearest even in IEEE
/// arithmetic, instead of a call to `rintf` on CPUs without SSE4.1's `roundss`.
#[inline]
fn round_in(low: u8, high: u8, x: f32) -> u8 {
    const MAGIC: f32 = 8_388_608.0;
    let x = x.clamp(low as f32, high as f32);
    ((x + MAGIC) - MAGIC) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fused(q: Quantization, rows: &[f32], dim: usize) -> Vec<u8> {
        let mut out = QuantizedRows::default();
        q.quantize(rows, dim, "t/embedding", 0, &mut out).unwrap();
        out.values
    }

    /// Values of one fused row, dequantized as FBGEMM's readers do: `scale * q + bias`.
    fn dequantize(q: Quantization, row: &[u8], dim: usize) -> (Vec<f32>, f32) {
        let packed = q.bits.packed_bytes(dim);
        let (scale, bias) = if q.float_scale() {
            let f = |at: usize| f32::from_le_bytes(row[at..at + 4].try_into().unwrap());
            (f(packed), f(packed + 4))
        } else {
            let h = |at: usize| f16::from_le_bytes(row[at..at + 2].try_into().unwrap()).to_f32();
            (h(packed), h(packed + 2))
        };
        let (bits, per_byte) = (q.bits.bits(), q.bits.per_byte());
        let values = (0..dim)
            .map(|c| {
                let v =
                    (row[c / per_byte] >> ((c % per_byte) as u32 * bits)) & ((1 << bits) - 1) as u8;
                scale * v as f32 + bias
            })
            .collect();
        (values, scale)
    }

    const ALL: [Quantization; 5] = [
        Quantization {
            bits: QuantBits::Int8,
            layout: QuantLayout::Fused,
        },
        Quantization {
            bits: QuantBits::Int8,
            layout: QuantLayout::FusedHalf,
        },
        Quantization {
            bits: QuantBits::Int4,
            layout: QuantLayout::Fused,
        },
        Quantization {
            bits: QuantBits::Int2,
            layout: QuantLayout::Fused,
        },
        Quantization {
            bits: QuantBits::Int4,
            layout: QuantLayout::Split,
        },
    ];

    #[test]
    fn rounding_is_to_nearest_even_within_the_range() {
        for (x, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (2.4999, 2),
            (254.5, 254),
            (-3.0, 0),
        ] {
            assert_eq!(round_in(0, 255, x), want, "{x}");
        }
        assert_eq!(round_in(0, 15, 15.6), 15);
        for k in 0..100_000u32 {
            let x = k as f32 * 0.00317 - 20.0;
            let want = (x.round_ties_even() as i32).clamp(0, 255) as u8;
            assert_eq!(round_in(0, 255, x), want, "{x}");
        }
    }

    #[test]
    fn sizes_follow_the_layouts() {
        let q8 = ALL[0];
        assert_eq!(q8.fused_row_bytes(64), 72, "D bytes + f32 scale + f32 bias");
        assert_eq!(ALL[1].fused_row_bytes(64), 68);
        assert_eq!(ALL[2].fused_row_bytes(64), 36, "4 bits: 32 bytes + two f16");
        assert_eq!(
            ALL[2].fused_row_bytes(7),
            8,
            "odd dims round up to a whole byte"
        );
        assert_eq!(ALL[3].fused_row_bytes(5), 6);
        assert_eq!(q8.format_name(), "Fused8BitRowwiseQuantizedSBFloat");
        assert_eq!(ALL[1].format_name(), "FusedNBitRowwiseQuantizedSBHalf");
        assert_eq!(ALL[4].format_name(), "FusedNBitRowwiseQuantizedSBHalf");
        assert_eq!(ALL[4].layout_name(), "split");
    }

    #[test]
    fn a_known_row_quantizes_to_known_bytes() {
        // min -1, max 1: 4-bit scale 2/15, values 0, 8 (0.0 is 7.5 steps up, a tie to even),
        // 15; packed low bits first.
        let row = [-1.0f32, 0.0, 1.0];
        let out = fused(ALL[2], &row, 3);
        assert_eq!(out[0], 8 << 4, "0 in the low bits, 8 in the high");
        assert_eq!(out[1], 15);
        assert_eq!(
            f16::from_le_bytes([out[2], out[3]]),
            f16::from_f32(2.0 / 15.0)
        );
        assert_eq!(f16::from_le_bytes([out[4], out[5]]), f16::from_f32(-1.0));
        // 8-bit SBFloat: 2 + 1e-8 is 2 in f32, so 0.0 maps to 127.5 exactly, a tie to even.
        let out = fused(ALL[0], &row, 3);
        assert_eq!(&out[..3], &[0, 128, 255]);
        assert_eq!(
            f32::from_le_bytes(out[3..7].try_into().unwrap()),
            2.0 / 255.0
        );
        assert_eq!(f32::from_le_bytes(out[7..11].try_into().unwrap()), -1.0);
    }

    #[test]
    fn constant_rows_and_bad_values() {
        for q in ALL.into_iter().filter(|q| q.layout != QuantLayout::Split) {
            let out = fused(q, &[0.25; 9], 9);
            let (back, _) = dequantize(q, &out, 9);
            assert!(back.iter().all(|&v| v == 0.25), "{q:?}: {back:?}");
        }
        let err = ALL[2]
            .quantize(
                &[1.0, f32::NAN],
                2,
                "t/embedding",
                40,
                &mut QuantizedRows::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t/embedding") && err.contains("row 40"),
            "{err}"
        );
    }

    /// Rows at and past the edges of f16 and f32: each either quantizes into finite scales and
    /// biases that read back within half a step (and what rounding to f16 moves), or is an error
    /// naming the tensor and the row; never an infinite scale or bias, never NaN read back.
    #[test]
    fn rows_past_the_range_of_scale_or_bias_are_errors_naming_the_row() {
        let f16_max = 65504.0f32;
        // (row, which forms must refuse it: f16 forms, the f32 form)
        let rows: [([f32; 4], bool, bool); 10] = [
            ([f16_max, f16_max, f16_max, f16_max], false, false),
            ([-f16_max, -f16_max, 0.0, 1.0], false, false),
            // Rounds to f16's largest, not past it.
            ([65519.0, 65519.0, 65519.0, 65530.0], false, false),
            ([65520.0, 65600.0, 70000.0, 1e6], true, false),
            ([-65520.0, 0.0, 1.0, 2.0], true, false),
            ([-1e30, 1e30, 0.0, 0.0], true, false),
            // A range whose step is past f16's at every bit rate, from an f16 minimum.
            ([0.0, 1e8, 5e7, 3.0], true, false),
            // f32's whole range: no scale holds it.
            ([-3e38, 3e38, 0.0, 1.0], true, true),
            ([f32::MIN, f32::MAX, 0.0, 0.0], true, true),
            ([-1.6e38, 1.6e38, 0.0, 1.0], true, false),
        ];
        for q in ALL {
            for (k, (row, f16_refuses, f32_refuses)) in rows.iter().enumerate() {
                let refuses = if q.float_scale() {
                    *f32_refuses
                } else {
                    *f16_refuses
                };
                let mut out = QuantizedRows::default();
                // Row `k` of the export starts at row 100.
                let got = q.quantize(&row[..], 4, "t/embedding", 100 + k as u64, &mut out);
                if refuses {
                    let e = got.expect_err(&format!("{q:?} {row:?}")).to_string();
                    assert!(e.contains("t/embedding"), "{e}");
                    assert!(e.contains(&format!("row {}", 100 + k)), "{e}");
                    continue;
                }
                got.unwrap_or_else(|e| panic!("{q:?} {row:?}: {e}"));
                let mut fused_row = out.values.clone();
                if q.layout == QuantLayout::Split {
                    fused_row.extend_from_slice(&out.scales);
                    fused_row.extend_from_slice(&out.biases);
                }
                let (back, scale) = dequantize(q, &fused_row, 4);
                assert!(scale.is_finite(), "{q:?} {row:?}: scale {scale}");
                let min = row.iter().copied().fold(f32::INFINITY, f32::min);
                let rounding = if q.float_scale() {
                    0.0
                } else {
                    (f16::from_f32(min).to_f32() - min).abs() + scale * 0.01
                };
                for (x, y) in row.iter().zip(&back) {
                    assert!(y.is_finite(), "{q:?} {row:?}: {x} read back as {y}");
                    assert!(
                        (x - y).abs() <= scale / 2.0 + rounding + x.abs() * 1e-6,
                        "{q:?} {row:?}: {x} read back as {y} (scale {scale})"
                    );
                }
            }
        }
    }

    proptest! {
        /// Every value dequantizes to within half a step of itself, plus what rounding scale and
        /// bias to f16 moves it (none in the f32 form).
        #[test]
        fn dequantized_rows_are_within_half_a_step(
            dim in 1usize..70,
            seed in any::<u64>(),
            spread in prop::sample::select(vec![1e-3f32, 0.05, 1.0, 30.0]),
            which in 0usize..4,
        ) {
            let q = ALL[which];
            let mut r = seed | 1;
            let rows: Vec<f32> = (0..dim * 3)
                .map(|_| {
                    r ^= r << 13; r ^= r >> 7; r ^= r << 17;
                    ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread
                })
                .collect();
            let out = fused(q, &rows, dim);
            let width = q.fused_row_bytes(dim);
            prop_assert_eq!(out.len(), 3 * width);
            for (row, bytes) in rows.chunks(dim).zip(out.chunks(width)) {
                let (back, scale) = dequantize(q, bytes, dim);
                let min = row.iter().copied().fold(f32::INFINITY, f32::min);
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let levels = ((1u32 << q.bits.bits()) - 1) as f32;
                // The f32 form divides by range + 1e-8, which shrinks rows whose range is
                // near 1e-8 by up to that share of their range.
                let slack = if q.float_scale() {
                    scale * 1e-3 + (max - min) * 1e-8 / (max - min + 1e-8)
                } else {
                    (f16::from_f32(min).to_f32() - min).abs()
                        + levels * (scale - (max - f16::from_f32(min).to_f32()) / levels).abs()
                };
                for (x, y) in row.iter().zip(&back) {
                    prop_assert!(
                        (x - y).abs() <= scale / 2.0 + slack + 1e-6 * x.abs().max(1e-6),
                        "{:?} dim {}: {} came back as {} (scale {})", q, dim, x, y, scale
                    );
                }
            }
        }
    }
}

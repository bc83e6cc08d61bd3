//! Element types.
//!
//! saver keeps its own copy of the safetensors dtype list instead of exposing `safetensors::Dtype`
//! directly: that enum is `#[non_exhaustive]` and grows between releases, while the set of dtypes a
//! checkpoint may contain is part of *our* format and must only change with a format version.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

macro_rules! dtypes {
    ($($variant:ident => $name:literal, $bits:literal, $doc:literal;)*) => {
        /// An element type, named and sized exactly as in the safetensors format.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum Dtype {
            $(#[doc = $doc] #[serde(rename = $name)] $variant,)*
        }

        impl Dtype {
            /// Every dtype, in the order safetensors lists them.
            pub const ALL: &'static [Dtype] = &[$(Dtype::$variant,)*];

            /// The name used in safetensors headers (`"F32"`, `"BF16"`, …).
            pub fn name(self) -> &'static str {
                match self { $(Dtype::$variant => $name,)* }
            }

            /// Size of one element in bits (4 and 6 for the micro-scaling float formats).
            pub fn bits(self) -> u64 {
                match self { $(Dtype::$variant => $bits,)* }
            }
        }

        impl FromStr for Dtype {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($name => Ok(Dtype::$variant),)*
                    _ => Err(Error::BadDtype { context: "dtype".into(), dtype: s.into() }),
                }
            }
        }
    };
}

dtypes! {
    BOOL => "BOOL", 8, "Boolean, one byte per element.";
    F4 => "F4", 4, "MX FP4 (two elements per byte).";
    F6_E2M3 => "F6_E2M3", 6, "MX FP6 E2M3.";
    F6_E3M2 => "F6_E3M2", 6, "MX FP6 E3M2.";
    U8 => "U8", 8, "Unsigned 8-bit integer.";
    I8 => "I8", 8, "Signed 8-bit integer.";
    F8_E5M2 => "F8_E5M2", 8, "FP8 E5M2.";
    F8_E4M3 => "F8_E4M3", 8, "FP8 E4M3.";
    F8_E8M0 => "F8_E8M0", 8, "FP8 E8M0 (MX scale).";
    F8_E4M3FNUZ => "F8_E4M3FNUZ", 8, "FP8 E4M3 FNUZ.";
    F8_E5M2FNUZ => "F8_E5M2FNUZ", 8, "FP8 E5M2 FNUZ.";
    I16 => "I16", 16, "Signed 16-bit integer.";
    U16 => "U16", 16, "Unsigned 16-bit integer.";
    F16 => "F16", 16, "IEEE half precision.";
    BF16 => "BF16", 16, "bfloat16.";
    I32 => "I32", 32, "Signed 32-bit integer.";
    U32 => "U32", 32, "Unsigned 32-bit integer.";
    F32 => "F32", 32, "IEEE single precision.";
    C64 => "C64", 64, "Complex of two F32.";
    F64 => "F64", 64, "IEEE double precision.";
    I64 => "I64", 64, "Signed 64-bit integer.";
    U64 => "U64", 64, "Unsigned 64-bit integer.";
}

impl Dtype {
    /// Exact byte size of `elements` elements, refusing overflow and sizes that end mid-byte.
    pub fn byte_len(self, elements: u64) -> Option<u64> {
        let bits = elements.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// Whether the type is a floating-point type that `export --dtype` may cast.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtype of a table's ids: feature ids are 64-bit, signed or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KeyDtype {
    /// Signed ids (`i64`), as PyTorch and TensorFlow hash tables use.
    I64,
    /// Unsigned ids (`u64`).
    U64,
}

impl KeyDtype {
    /// The tensor dtype of the ids block.
    pub fn dtype(self) -> Dtype {
        match self {
            KeyDtype::I64 => Dtype::I64,
            KeyDtype::U64 => Dtype::U64,
        }
    }

    /// Converts a tensor dtype into a key dtype, if it is one.
    pub fn from_dtype(dtype: Dtype) -> Option<KeyDtype> {
        match dtype {
            Dtype::I64 => Some(KeyDtype::I64),
            Dtype::U64 => Some(KeyDtype::U64),
            _ => None,
        }
    }

    /// Renders the raw 64 id bits as the number the user knows.
    #[doc(hidden)]
    pub fn format_id(self, bits: u64) -> String {
        match self {
            KeyDtype::I64 => (bits as i64).to_string(),
            KeyDtype::U64 => bits.to_string(),
        }
    }

    /// Sort key that orders raw id bits numerically in this key dtype.
    #[doc(hidden)]
    pub fn order_key(self, bits: u64) -> u64 {
        match self {
            // Flipping the sign bit maps i64 order onto u64 order.
            KeyDtype::I64 => bits ^ (1 << 63),
            KeyDtype::U64 => bits,
        }
    }
}

impl fmt::Display for KeyDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.dtype().name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference crate's dtype (the test's oracle).
    fn to_safetensors(d: Dtype) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match d {
            Dtype::BOOL => S::BOOL,
            Dtype::F4 => S::F4,
            Dtype::F6_E2M3 => S::F6_E2M3,
            Dtype::F6_E3M2 => S::F6_E3M2,
            Dtype::U8 => S::U8,
            Dtype::I8 => S::I8,
            Dtype::F8_E5M2 => S::F8_E5M2,
            Dtype::F8_E4M3 => S::F8_E4M3,
            Dtype::F8_E8M0 => S::F8_E8M0,
            Dtype::F8_E4M3FNUZ => S::F8_E4M3FNUZ,
            Dtype::F8_E5M2FNUZ => S::F8_E5M2FNUZ,
            Dtype::I16 => S::I16,
            Dtype::U16 => S::U16,
            Dtype::F16 => S::F16,
            Dtype::BF16 => S::BF16,
            Dtype::I32 => S::I32,
            Dtype::U32 => S::U32,
            Dtype::F32 => S::F32,
            Dtype::C64 => S::C64,
            Dtype::F64 => S::F64,
            Dtype::I64 => S::I64,
            Dtype::U64 => S::U64,
        }
    }

    #[test]
    fn every_dtype_matches_safetensors_size_and_name() {
        for &d in Dtype::ALL {
            let s = to_safetensors(d);
            assert_eq!(d.bits() as usize, s.bitsize(), "{d}");
            assert_eq!(format!("{s:?}"), d.name(), "{d}");
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert_eq!(Dtype::ALL.len(), 22);
    }

    #[test]
    fn byte_len_is_exact_or_refused() {
        assert_eq!(Dtype::F32.byte_len(3), Some(12));
        assert_eq!(Dtype::BOOL.byte_len(5), Some(5));
        assert_eq!(Dtype::F4.byte_len(4), Some(2));
        assert_eq!(Dtype::F4.byte_len(3), None, "half a byte");
        assert_eq!(Dtype::F6_E2M3.byte_len(4), Some(3));
        assert_eq!(Dtype::F6_E2M3.byte_len(2), None);
        assert_eq!(Dtype::U64.byte_len(u64::MAX / 4), None, "overflow");
        assert_eq!(Dtype::C64.byte_len(2), Some(16));
    }

    #[test]
    fn i64_order_key_sorts_negative_first() {
        let mut v: Vec<i64> = vec![5, -1, i64::MIN, 0, i64::MAX, -7];
        v.sort_by_key(|&x| KeyDtype::I64.order_key(x as u64));
        assert_eq!(v, vec![i64::MIN, -7, -1, 0, 5, i64::MAX]);
        assert_eq!(KeyDtype::I64.format_id(u64::MAX), "-1");
        assert_eq!(KeyDtype::U64.format_id(u64::MAX), u64::MAX.to_string());
    }
}

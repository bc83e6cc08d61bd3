//! A shard's trainer state (its RNG, its position in the data, anything serde can write), as kept
//! in the manifest's `trainer_state` string.
//!
//! Written as `postcard:` followed by the base64 of the value's [postcard] encoding. Postcard's
//! wire format is specified (<https://postcard.jamesmunns.org/wire-format>) and stable since its
//! 1.0, its crate is maintained, and it keeps every value serde writes, floats' NaN and infinities
//! included (JSON turns them into `null`, which a best-loss-so-far of `f64::INFINITY` would not
//! survive). Checkpoints written before it hold the value encoded with bincode 2 (its standard
//! configuration) and then base64, a string that never holds a `:`; [`decode`] still reads them,
//! through [`legacy`], a decoder of that wire format written here, so that saver no longer depends
//! on bincode (which its authors stopped maintaining, RUSTSEC-2025-0141).
//!
//! [postcard]: https://docs.rs/postcard

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// The prefix of a trainer state in the current encoding.
pub const PREFIX: &str = "postcard:";

fn error(message: impl Into<String>) -> Error {
    Error::Encoding {
        what: "trainer state".into(),
        message: message.into(),
    }
}

/// Encodes a trainer state for a manifest: `postcard:` and the base64 of its postcard bytes.
#[doc(hidden)]
pub fn encode<T: Serialize>(state: &T) -> Result<String> {
    let bytes = postcard::to_stdvec(state).map_err(|e| error(e.to_string()))?;
    Ok(format!("{PREFIX}{}", STANDARD.encode(bytes)))
}

/// Decodes a trainer state written by [`encode`], or by a saver from before it (bincode 2 and
/// base64).
#[doc(hidden)]
pub fn decode<T: DeserializeOwned>(stored: &str) -> Result<T> {
    if let Some(b64) = stored.strip_prefix(PREFIX) {
        let bytes = STANDARD.decode(b64).map_err(|e| error(e.to_string()))?;
        let (value, rest) = postcard::take_from_bytes(&bytes).map_err(|e| error(e.to_string()))?;
        if !rest.is_empty() {
            return Err(error(format!("{} trailing bytes", rest.len())));
        }
        return Ok(value);
    }
    let bytes = STANDARD.decode(stored).map_err(|e| {
        error(format!(
            "neither `{PREFIX}…` nor an older (bincode, base64) state: {e}"
        ))
    })?;
    legacy::from_slice(&bytes).map_err(|e| error(format!("an older (bincode) state: {}", e.0)))
}

pub mod legacy {
    //! A reader of bincode 2's serde encoding in its standard configuration (little-endian,
    //! variable-length integers), the encoding of trainer states in checkpoints written before
    //! `json:`. Only what a reader needs: the format is not self-describing, so the reader is led
    //! by the type it decodes into, as bincode's own is.
    //!
    //! The wire format: `u8`/`i8` and `bool` one byte; other integers a varint (below 251 one
    //! byte, else a marker 251/252/253/254 and a little-endian u16/u32/u64/u128), signed ones
    //! zigzagged first; floats little-endian; a `char` its UTF-8 bytes; strings, byte strings,
    //! sequences and maps a varint length then the items; `Option` a 0/1 byte then the value;
    //! tuples and structs their fields in order; an enum its variant index (varint) then its
    //! fields; unit types nothing.

    use std::fmt;

    use serde::de::{
        self, DeserializeOwned, DeserializeSeed, EnumAccess, IntoDeserializer, MapAccess,
        SeqAccess, VariantAccess, Visitor,
    };

    /// Why bytes are not a value of the type asked for.
    #[derive(Debug)]
    pub struct Error(pub String);

    impl fmt::Display for Error {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for Error {}

    impl de::Error for Error {
        fn custom<T: fmt::Display>(msg: T) -> Self {
            Error(msg.to_string())
        }
    }

    type Result<T> = std::result::Result<T, Error>;

    /// Decodes all of `bytes` as a `T`; trailing bytes are an error.
    pub(crate) fn from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
        let mut d = Decoder { rest: bytes };
        let value = T::deserialize(&mut d)?;
        if !d.rest.is_empty() {
            return Err(Error(format!("{} trailing bytes", d.rest.len())));
        }
        Ok(value)
    }

    struct Decoder<'a> {
        rest: &'a [u8],
    }

    impl<'a> Decoder<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8]> {
            if self.rest.len() < n {
                return Err(Error(format!(
                    "ends early: {n} bytes wanted, {} left",
                    self.rest.len()
                )));
            }
            let (head, tail) = self.rest.split_at(n);
            self.rest = tail;
            Ok(head)
        }

        fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
            Ok(self.take(N)?.try_into().expect("took N bytes"))
        }

        fn varint(&mut self) -> Result<u128> {
            Ok(match self.array::<1>()?[0] {
                b @ 0..=250 => b as u128,
                251 => u16::from_le_bytes(self.array()?) as u128,
                252 => u32::from_le_bytes(self.array()?) as u128,
                253 => u64::from_le_bytes(self.array()?) as u128,
                254 => u128::from_le_bytes(self.array()?),
                _ => return Err(Error("byte 255 is no integer marker".into())),
            })
        }

        fn unsigned<T: TryFrom<u128>>(&mut self, what: &str) -> Result<T> {
            let v = self.varint()?;
            T::try_from(v).map_err(|_| Error(format!("{v} does not fit a {what}")))
        }

        fn signed<T: TryFrom<i128>>(&mut self, what: &str) -> Result<T> {
            let z = self.varint()?;
            let v = (z >> 1) as i128 ^ -((z & 1) as i128);
            T::try_from(v).map_err(|_| Error(format!("{v} does not fit a {what}")))
        }

        /// A length, bounded by the bytes left: every item takes at least one byte, except
        /// items of zero size, which a trainer state does not hold in the millions.
        fn len(&mut self) -> Result<usize> {
            let n: u64 = self.unsigned("length")?;
            if n > self.rest.len() as u64 + (1 << 20) {
                return Err(Error(format!(
                    "a length of {n} with {} bytes left",
                    self.rest.len()
                )));
            }
            Ok(n as usize)
        }

        fn str(&mut self) -> Result<&'a str> {
            let n = self.len()?;
            std::str::from_utf8(self.take(n)?).map_err(|e| Error(e.to_string()))
        }
    }

    macro_rules! unsigned {
        ($($method:ident $visit:ident $ty:ty),*) => {$(
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
                v.$visit(self.unsigned::<$ty>(stringify!($ty))?)
            }
        )*};
    }

    macro_rules! signed {
        ($($method:ident $visit:ident $ty:ty),*) => {$(
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
                v.$visit(self.signed::<$ty>(stringify!($ty))?)
            }
        )*};
    }

    impl<'de> de::Deserializer<'de> for &mut Decoder<'de> {
        type Error = Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
            Err(Error(
                "the older encoding is not self-describing: decode into a concrete type".into(),
            ))
        }

        fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            match self.array::<1>()?[0] {
                0 => v.visit_bool(false),
                1 => v.visit_bool(true),
                b => Err(Error(format!("{b} is no bool"))),
            }
        }

        fn deserialize_u8<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_u8(self.array::<1>()?[0])
        }

        fn deserialize_i8<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_i8(self.array::<1>()?[0] as i8)
        }

        unsigned!(deserialize_u16 visit_u16 u16, deserialize_u32 visit_u32 u32,
            deserialize_u64 visit_u64 u64, deserialize_u128 visit_u128 u128);
        signed!(deserialize_i16 visit_i16 i16, deserialize_i32 visit_i32 i32,
            deserialize_i64 visit_i64 i64, deserialize_i128 visit_i128 i128);

        fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_f32(f32::from_le_bytes(self.array()?))
        }

        fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_f64(f64::from_le_bytes(self.array()?))
        }

        fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            let first = self.rest.first().copied().unwrap_or(0);
            let n = match first {
                0x00..=0x7f => 1,
                0xc0..=0xdf => 2,
                0xe0..=0xef => 3,
                0xf0..=0xf7 => 4,
                b => return Err(Error(format!("{b:#x} begins no UTF-8 char"))),
            };
            let s = std::str::from_utf8(self.take(n)?).map_err(|e| Error(e.to_string()))?;
            v.visit_char(s.chars().next().expect("one char"))
        }

        fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_borrowed_str(self.str()?)
        }

        fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            self.deserialize_str(v)
        }

        fn deserialize_bytes<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            let n = self.len()?;
            v.visit_borrowed_bytes(self.take(n)?)
        }

        fn deserialize_byte_buf<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            self.deserialize_bytes(v)
        }

        fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            match self.array::<1>()?[0] {
                0 => v.visit_none(),
                1 => v.visit_some(self),
                b => Err(Error(format!("{b} is no Option tag"))),
            }
        }

        fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_unit()
        }

        fn deserialize_unit_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            v: V,
        ) -> Result<V::Value> {
            v.visit_unit()
        }

        fn deserialize_newtype_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            v: V,
        ) -> Result<V::Value> {
            v.visit_newtype_struct(self)
        }

        fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            let n = self.len()?;
            v.visit_seq(Items { d: self, left: n })
        }

        fn deserialize_tuple<V: Visitor<'de>>(self, n: usize, v: V) -> Result<V::Value> {
            v.visit_seq(Items { d: self, left: n })
        }

        fn deserialize_tuple_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            n: usize,
            v: V,
        ) -> Result<V::Value> {
            self.deserialize_tuple(n, v)
        }

        fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            let n = self.len()?;
            v.visit_map(Items { d: self, left: n })
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            v: V,
        ) -> Result<V::Value> {
            self.deserialize_tuple(fields.len(), v)
        }

        fn deserialize_enum<V: Visitor<'de>>(
            self,
            _: &'static str,
            _: &'static [&'static str],
            v: V,
        ) -> Result<V::Value> {
            v.visit_enum(self)
        }

        fn deserialize_identifier<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            v.visit_u32(self.unsigned("variant index")?)
        }

        fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
            self.deserialize_any(v)
        }

        fn is_human_readable(&self) -> bool {
            false
        }
    }

    /// The items of a sequence, tuple or map, `left` of them still to come.
    struct Items<'r, 'de> {
        d: &'r mut Decoder<'de>,
        left: usize,
    }

    impl<'de> SeqAccess<'de> for Items<'_, 'de> {
        type Error = Error;

        fn next_element_seed<T: DeserializeSeed<'de>>(
            &mut self,
            seed: T,
        ) -> Result<Option<T::Value>> {
            if self.left == 0 {
                return Ok(None);
            }
            self.left -= 1;
            seed.deserialize(&mut *self.d).map(Some)
        }

        fn size_hint(&self) -> Option<usize> {
            Some(self.left)
        }
    }

    impl<'de> MapAccess<'de> for Items<'_, 'de> {
        type Error = Error;

        fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
            if self.left == 0 {
                return Ok(None);
            }
            self.left -= 1;
            seed.deserialize(&mut *self.d).map(Some)
        }

        fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value> {
            seed.deserialize(&mut *self.d)
        }

        fn size_hint(&self) -> Option<usize> {
            Some(self.left)
        }
    }

    impl<'de> EnumAccess<'de> for &mut Decoder<'de> {
        type Error = Error;
        type Variant = Self;

        fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Self)> {
            let index: u32 = self.unsigned("variant index")?;
            let value = seed.deserialize(index.into_deserializer())?;
            Ok((value, self))
        }
    }

    impl<'de> VariantAccess<'de> for &mut Decoder<'de> {
        type Error = Error;

        fn unit_variant(self) -> Result<()> {
            Ok(())
        }

        fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
            seed.deserialize(self)
        }

        fn tuple_variant<V: Visitor<'de>>(self, n: usize, v: V) -> Result<V::Value> {
            de::Deserializer::deserialize_tuple(self, n, v)
        }

        fn struct_variant<V: Visitor<'de>>(
            self,
            fields: &'static [&'static str],
            v: V,
        ) -> Result<V::Value> {
            de::Deserializer::deserialize_tuple(self, fields.len(), v)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    enum Phase {
        Warmup,
        Train { epoch: u32, lr: f64 },
        Eval(i16, String),
        Done(Option<u8>),
    }

    /// A trainer state with every kind of value serde writes.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct State {
        step: u64,
        small: u8,
        delta: i64,
        wide: i128,
        tiny: i8,
        ratio: f32,
        done: bool,
        letter: char,
        name: String,
        rng: [u64; 4],
        seen: Vec<u32>,
        pair: (u16, i32),
        position: BTreeMap<String, u64>,
        phase: Phase,
        note: Option<String>,
        unit: (),
    }

    fn phase() -> impl Strategy<Value = Phase> {
        prop_oneof![
            Just(Phase::Warmup),
            (any::<u32>(), any::<f64>()).prop_map(|(epoch, lr)| Phase::Train { epoch, lr }),
            (any::<i16>(), ".{0,8}").prop_map(|(a, b)| Phase::Eval(a, b)),
            any::<Option<u8>>().prop_map(Phase::Done),
        ]
    }

    fn state() -> impl Strategy<Value = State> {
        (
            (
                any::<u64>(),
                any::<u8>(),
                any::<i64>(),
                any::<i128>(),
                any::<i8>(),
                any::<f32>(),
                any::<bool>(),
                any::<char>(),
            ),
            (
                ".{0,24}",
                any::<[u64; 4]>(),
                proptest::collection::vec(any::<u32>(), 0..40),
                any::<(u16, i32)>(),
                proptest::collection::btree_map(".{0,6}", any::<u64>(), 0..6),
                phase(),
                proptest::option::of(".{0,6}"),
            ),
        )
            .prop_map(
                |(
                    (step, small, delta, wide, tiny, ratio, done, letter),
                    (name, rng, seen, pair, position, phase, note),
                )| State {
                    step,
                    small,
                    delta,
                    wide,
                    tiny,
                    ratio,
                    done,
                    letter,
                    name,
                    rng,
                    seen,
                    pair,
                    position,
                    phase,
                    note,
                    unit: (),
                },
            )
    }

    /// Equal, with NaN equal to NaN (a float's bits survive both encodings).
    fn same(a: &State, b: &State) -> bool {
        let bits = |s: &State| {
            let mut s = s.clone();
            s.ratio = f32::from_bits(0);
            if let Phase::Train { lr, .. } = &mut s.phase {
                *lr = 0.0;
            }
            s
        };
        let lr = |s: &State| match s.phase {
            Phase::Train { lr, .. } => Some(lr.to_bits()),
            _ => None,
        };
        bits(a) == bits(b) && a.ratio.to_bits() == b.ratio.to_bits() && lr(a) == lr(b)
    }

    proptest! {
        /// A state written by savers before `json:` (bincode 2, standard configuration, then
        /// base64, by the bincode crate itself) reads back equal through the decoder here.
        #[test]
        fn states_written_by_bincode_read_back(s in state()) {
            let bytes = bincode::serde::encode_to_vec(&s, bincode::config::standard()).unwrap();
            let stored = STANDARD.encode(&bytes);
            let back: State = decode(&stored).unwrap();
            prop_assert!(same(&back, &s), "{back:?} != {s:?}");
            // Cut anywhere, the bytes are refused, never misread or a panic.
            if !bytes.is_empty() {
                let cut = bytes.len() / 2;
                let short = STANDARD.encode(&bytes[..cut]);
                prop_assert!(decode::<State>(&short).is_err());
            }
        }

        /// The current encoding round-trips every value, non-finite floats included, and says
        /// what it is.
        #[test]
        fn states_round_trip_as_postcard(s in state()) {
            let stored = encode(&s).unwrap();
            prop_assert!(stored.starts_with(PREFIX));
            let back: State = decode(&stored).unwrap();
            prop_assert!(same(&back, &s), "{back:?} != {s:?}");
        }
    }

    /// An infinite best loss, the usual start of a trainer's "best so far", survives.
    #[test]
    fn infinities_survive() {
        let stored = encode(&(f64::INFINITY, f32::NEG_INFINITY)).unwrap();
        let back: (f64, f32) = decode(&stored).unwrap();
        assert_eq!(back, (f64::INFINITY, f32::NEG_INFINITY));
    }

    #[test]
    fn garbage_is_an_error_naming_the_trainer_state() {
        let e = decode::<u64>("not base64 at all!").unwrap_err().to_string();
        assert!(e.contains("trainer state"), "{e}");
        let e = decode::<u64>("postcard:AAAA!").unwrap_err().to_string();
        assert!(e.contains("trainer state"), "{e}");
        // A length far past the bytes left is refused before any allocation.
        let huge = STANDARD.encode([253u8, 0, 0, 0, 0, 0, 0, 0, 1]);
        let e = decode::<Vec<u8>>(&huge).unwrap_err().to_string();
        assert!(e.contains("length"), "{e}");
    }
}

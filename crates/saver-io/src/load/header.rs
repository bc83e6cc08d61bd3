//! A strict reader of safetensors headers.
//!
//! Stricter than the format requires, because a checkpoint header is untrusted input: duplicate
//! tensor names are refused (JSON parsers silently keep the last one), every length is checked
//! against the real file size before anything is allocated from it, and tensors must tile the data
//! section exactly.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use saver_core::tensor::byte_len;
use saver_core::Dtype;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::{Error, Result};
use crate::storage::ReadHandle;

/// safetensors' own limit on the JSON header.
pub(crate) use saver_core::plan::header::MAX_HEADER_BYTES;

/// One tensor of a parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// A parsed, validated header.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    /// Offset of the data section.
    pub data_start: u64,
    /// The `__metadata__` map.
    pub metadata: BTreeMap<String, String>,
    /// Tensors in data order.
    pub tensors: Vec<HeaderEntry>,
}

struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = map.next_entry::<String, serde_json::Value>()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Reads and validates the header of `file`.
pub(crate) fn read_header(h: &dyn ReadHandle, file: &str) -> Result<Header> {
    let len = h.len();
    if len < 8 {
        return Err(Error::Corrupt {
            file: file.to_string(),
            what: format!("{len} bytes is too short for a safetensors header"),
        });
    }
    let mut n = [0u8; 8];
    h.read_at(0, &mut n)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || n > len - 8 {
        return Err(Error::Corrupt {
            file: file.to_string(),
            what: format!("header length {n} exceeds the file ({len} bytes) or the 100 MB limit"),
        });
    }
    let mut buf = vec![0u8; 8 + n as usize];
    h.read_at(0, &mut buf)?;
    parse_header(&buf, len, file)
}

/// Validates a header already in memory: `prefix` starts at byte 0 of a file of `len` bytes and
/// holds at least the length field and the JSON.
pub(crate) fn parse_header(prefix: &[u8], len: u64, file: &str) -> Result<Header> {
    let corrupt = |what: String| Error::Corrupt {
        file: file.to_string(),
        what,
    };
    let Some(n) = prefix.get(..8) else {
        return Err(corrupt(format!(
            "{len} bytes is too short for a safetensors header"
        )));
    };
    let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES || n > len.saturating_sub(8) || 8 + n > prefix.len() as u64 {
        return Err(corrupt(format!(
            "header length {n} exceeds the file ({len} bytes) or the 100 MB limit"
        )));
    }
    let buf = &prefix[8..8 + n as usize];
    let text =
        std::str::from_utf8(buf).map_err(|e| corrupt(format!("header is not UTF-8: {e}")))?;
    let Entries(entries) = serde_json::from_str(text)
        .map_err(|e| corrupt(format!("header is not valid JSON: {e}")))?;
    let data_start = 8 + n;
    let mut seen = HashSet::new();
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if !seen.insert(name.clone()) {
            return Err(corrupt(format!(
                "tensor {name:?} appears twice in the header"
            )));
        }
        if name == "__metadata__" {
            metadata = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("__metadata__ is not a map of strings: {e}")))?;
            continue;
        }
        let raw: RawTensor =
            serde_json::from_value(value).map_err(|e| corrupt(format!("tensor {name:?}: {e}")))?;
        let dtype: Dtype = raw
            .dtype
            .parse()
            .map_err(|_| corrupt(format!("tensor {name:?}: unknown dtype {:?}", raw.dtype)))?;
        let [start, end] = raw.data_offsets;
        let expected = byte_len(&name, dtype, &raw.shape).map_err(|e| corrupt(e.to_string()))?;
        if end < start || end - start != expected {
            return Err(corrupt(format!(
                "tensor {name:?}: offsets [{start}, {end}) do not hold {expected} bytes of {dtype} {:?}",
                raw.shape
            )));
        }
        tensors.push(HeaderEntry {
            name,
            dtype,
            shape: raw.shape,
            offset: data_start
                .checked_add(start)
                .ok_or_else(|| corrupt("offset overflow".into()))?,
            len: expected,
        });
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    let mut next = data_start;
    for t in &tensors {
        if t.offset != next {
            return Err(corrupt(format!(
                "tensor {:?} starts at byte {} but the previous tensor ends at {next} (gap or overlap)",
                t.name, t.offset
            )));
        }
        next = t.offset + t.len;
    }
    if next != len {
        return Err(corrupt(format!(
            "data section ends at byte {next} but the file has {len} bytes (truncated or padded)"
        )));
    }
    Ok(Header {
        data_start,
        metadata,
        tensors,
    })
}

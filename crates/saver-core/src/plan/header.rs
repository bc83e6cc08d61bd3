//! Rendering safetensors headers whose length is known before the data are written.
//!
//! Every per-tensor CRC32 is stored in the header's `__metadata__` as fixed-width hex, so the header
//! can be sized (and every data offset fixed) at plan time, and rendered with the real checksums
//! once the data are written: the two renderings have exactly the same length.

use std::fmt::Write as _;

use crate::dtype::Dtype;
use crate::manifest::{COMPRESSED_FORMAT_VERSION, FORMAT_VERSION};

/// Largest header (JSON and padding, without the 8-byte length) that safetensors readers accept.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Metadata key holding the per-tensor CRC32s, in data order, as space-separated 8-digit hex.
pub const CRC_KEY: &str = "saver.crc32";

/// Metadata key of a compressed file naming how each tensor is stored, in data order, separated
/// by spaces: `-` for a tensor stored as it is, `zstd:<filter>:<dtype>:<shape>` (the shape's
/// dimensions separated by commas) for one stored compressed as a `U8` tensor of its stored
/// bytes.
pub const CODECS_KEY: &str = "saver.codecs";

/// One tensor of a file, in data order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Offset within the data section.
    pub start: u64,
    /// End offset within the data section.
    pub end: u64,
}

/// Fixed facts written into each file's `__metadata__`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileFacts<'a> {
    /// The save.
    pub save_id: &'a str,
    /// Shard that wrote the file.
    pub shard: u32,
    /// Number of shards.
    pub shard_num: u32,
    /// File number within the shard.
    pub file: u32,
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("strings always serialize")
}

/// Renders the complete header prefix (8-byte length, JSON, space padding) so that the data
/// section starts at a multiple of `align`. `crcs` has one entry per tensor.
pub(crate) fn render_header(
    facts: &FileFacts<'_>,
    tensors: &[HeaderTensor],
    crcs: &[u32],
    align: u64,
) -> Vec<u8> {
    let metadata = metadata_of(facts, crcs, FORMAT_VERSION);
    render_header_with(&metadata, tensors, align)
}

/// A data file's `__metadata__` pairs.
fn metadata_of(facts: &FileFacts<'_>, crcs: &[u32], version: u32) -> Vec<(&'static str, String)> {
    let mut crc_list = String::with_capacity(crcs.len() * 9);
    for (i, crc) in crcs.iter().enumerate() {
        if i > 0 {
            crc_list.push(' ');
        }
        let _ = write!(crc_list, "{crc:08x}");
    }
    vec![
        // What Hugging Face loaders (`huggingface_hub.load_state_dict_from_file`, transformers)
        // require of a safetensors file before they read it.
        ("format", "pt".to_string()),
        ("saver.format_version", version.to_string()),
        ("saver.save_id", facts.save_id.to_string()),
        ("saver.shard", facts.shard.to_string()),
        ("saver.shard_num", facts.shard_num.to_string()),
        ("saver.file", facts.file.to_string()),
        (CRC_KEY, crc_list),
    ]
}

/// How a tensor of a compressed file is stored, for its header: where its stored bytes lie in
/// the data section and, when compressed, its filter's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTensor {
    /// Offset of the stored bytes within the data section.
    pub start: u64,
    /// End of the stored bytes within the data section.
    pub end: u64,
    /// The filter of a compressed tensor; `None` for one stored as it is.
    pub filter: Option<String>,
}

fn codec_token(t: &HeaderTensor, filter: &str) -> String {
    let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
    format!("zstd:{filter}:{}:{}", t.dtype.name(), shape.join(","))
}

/// The metadata of a compressed file's header.
fn compressed_metadata(
    facts: &FileFacts<'_>,
    crcs: &[u32],
    codecs: Vec<String>,
) -> Vec<(&'static str, String)> {
    let mut m = metadata_of(facts, crcs, COMPRESSED_FORMAT_VERSION);
    m.push((CODECS_KEY, codecs.join(" ")));
    m
}

/// The length of the header prefix a compressed file's data section starts after: long enough
/// for whatever each tensor is stored as, since its stored bytes are known only once written.
/// A compressed tensor's stored bytes are never more than its raw bytes, so its rendering as
/// `U8` of its raw length, and every raw offset, bound the final ones.
pub(crate) fn planned_compressed_header_len(
    facts: &FileFacts<'_>,
    tensors: &[HeaderTensor],
    align: u64,
) -> u64 {
    let longest_filter = "shuffle8";
    let worst: Vec<HeaderTensor> = tensors
        .iter()
        .map(|t| {
            let as_bytes = HeaderTensor {
                dtype: Dtype::U8,
                shape: vec![t.end - t.start],
                ..t.clone()
            };
            let len = |t: &HeaderTensor| render_json(&[], std::slice::from_ref(t)).len();
            if len(&as_bytes) > len(t) {
                as_bytes
            } else {
                t.clone()
            }
        })
        .collect();
    let codecs = tensors
        .iter()
        .map(|t| codec_token(t, longest_filter))
        .collect();
    let metadata = compressed_metadata(facts, &vec![0; tensors.len()], codecs);
    (8 + render_json(&metadata, &worst).len() as u64).div_ceil(align) * align
}

/// The final header of a compressed file whose data section starts at `data_start` (from
/// [`planned_compressed_header_len`]), each tensor of `tensors` (raw, in data order) stored as
/// `stored` says; `None` if it does not fit, which the planned length rules out.
pub(crate) fn render_compressed_header(
    facts: &FileFacts<'_>,
    tensors: &[HeaderTensor],
    stored: &[StoredTensor],
    crcs: &[u32],
    data_start: u64,
) -> Option<Vec<u8>> {
    let mut out_tensors = Vec::with_capacity(tensors.len());
    let mut codecs = Vec::with_capacity(tensors.len());
    for (t, s) in tensors.iter().zip(stored) {
        match &s.filter {
            Some(f) => {
                codecs.push(codec_token(t, f));
                out_tensors.push(HeaderTensor {
                    name: t.name.clone(),
                    dtype: Dtype::U8,
                    shape: vec![s.end - s.start],
                    start: s.start,
                    end: s.end,
                });
            }
            None => {
                codecs.push("-".into());
                out_tensors.push(HeaderTensor {
                    start: s.start,
                    end: s.end,
                    ..t.clone()
                });
            }
        }
    }
    let metadata = compressed_metadata(facts, crcs, codecs);
    let json = render_json(&metadata, &out_tensors);
    if 8 + json.len() as u64 > data_start {
        return None;
    }
    Some(pad_header(json, data_start))
}

/// Renders a safetensors header with the given `__metadata__` pairs, padded so the data section
/// starts at a multiple of `align`.
#[doc(hidden)]
pub fn render_header_with(
    metadata: &[(&str, String)],
    tensors: &[HeaderTensor],
    align: u64,
) -> Vec<u8> {
    let json = render_json(metadata, tensors);
    let data_start = (8 + json.len() as u64).div_ceil(align) * align;
    pad_header(json, data_start)
}

/// The 8-byte length, `json`, and spaces up to `data_start`.
fn pad_header(json: String, data_start: u64) -> Vec<u8> {
    let n = data_start - 8;
    let mut out = Vec::with_capacity(data_start as usize);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(data_start as usize, b' ');
    out
}

/// A safetensors header's JSON.
fn render_json(metadata: &[(&str, String)], tensors: &[HeaderTensor]) -> String {
    let mut json = String::with_capacity(256 + tensors.len() * 128);
    json.push_str("{\"__metadata__\":{");
    for (i, (k, v)) in metadata.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        let _ = write!(json, "{}:{}", json_str(k), json_str(v));
    }
    json.push('}');
    for t in tensors {
        let _ = write!(
            json,
            ",{}:{{\"dtype\":\"{}\",\"shape\":[",
            json_str(&t.name),
            t.dtype.name()
        );
        for (i, d) in t.shape.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            let _ = write!(json, "{d}");
        }
        let _ = write!(json, "],\"data_offsets\":[{},{}]}}", t.start, t.end);
    }
    json.push('}');
    json
}

/// Parses the CRC list of a header's metadata value (the tests' reading of what is written).
#[cfg(test)]
fn parse_crcs(value: &str) -> Option<Vec<u32>> {
    if value.is_empty() {
        return Some(Vec::new());
    }
    value
        .split(' ')
        .map(|h| {
            (h.len() == 8)
                .then(|| u32::from_str_radix(h, 16).ok())
                .flatten()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_is_valid_safetensors_and_length_is_independent_of_crcs() {
        let tensors = vec![
            HeaderTensor {
                name: "a/\"quoted\"".into(),
                dtype: Dtype::F32,
                shape: vec![2],
                start: 0,
                end: 8,
            },
            HeaderTensor {
                name: "b".into(),
                dtype: Dtype::U8,
                shape: vec![],
                start: 8,
                end: 9,
            },
        ];
        let facts = FileFacts {
            save_id: "x",
            shard: 1,
            shard_num: 2,
            file: 0,
        };
        let h0 = render_header(&facts, &tensors, &[0, 0], 64);
        let h1 = render_header(&facts, &tensors, &[u32::MAX, 0x1234], 64);
        assert_eq!(h0.len(), h1.len());
        assert_eq!(h0.len() % 64, 0);
        let mut file = h1.clone();
        file.extend_from_slice(&[0u8; 9]);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.tensor("a/\"quoted\"").unwrap().shape(), &[2]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        let crcs = meta.metadata().as_ref().unwrap()[CRC_KEY].clone();
        assert_eq!(parse_crcs(&crcs).unwrap(), vec![u32::MAX, 0x1234]);
        assert_eq!(parse_crcs("zz"), None);
    }

    fn dtype_of(k: usize) -> Dtype {
        [
            Dtype::BOOL,
            Dtype::U8,
            Dtype::BF16,
            Dtype::F32,
            Dtype::I64,
            Dtype::F64,
        ][k % 6]
    }

    proptest! {
        /// Whatever each tensor turns out to be stored as (compressed to any size no larger than
        /// its raw bytes, or raw), the final header of a compressed file fits the length planned
        /// for it, is valid safetensors, and names each tensor's codec, raw dtype and shape.
        #[test]
        fn a_compressed_files_header_fits_its_planned_length(
            tensors in proptest::collection::vec(
                (0usize..6, proptest::collection::vec(0u64..300, 0..3), 0u64..=100, any_filter()),
                1..12,
            ),
            align_bits in 3u32..13,
        ) {
            let align = 1u64 << align_bits;
            let mut raw = Vec::new();
            let mut at = 0;
            for (i, (d, shape, _, _)) in tensors.iter().enumerate() {
                let dtype = dtype_of(*d);
                let len = dtype.byte_len(shape.iter().product()).unwrap();
                raw.push(HeaderTensor {
                    name: format!("t{i}/e:s0.{i}"),
                    dtype,
                    shape: shape.clone(),
                    start: at,
                    end: at + len,
                });
                at += len;
            }
            let facts = FileFacts { save_id: "s", shard: 3, shard_num: 70, file: 1 };
            let planned = planned_compressed_header_len(&facts, &raw, align);
            prop_assert_eq!(planned % align, 0);
            let mut stored = Vec::new();
            let mut at = 0;
            for (t, (_, _, percent, filter)) in raw.iter().zip(&tensors) {
                // A tensor stored raw keeps its length.
                let len = match filter {
                    Some(_) => (t.end - t.start) * percent / 100,
                    None => t.end - t.start,
                };
                stored.push(StoredTensor {
                    start: at,
                    end: at + len,
                    filter: filter.clone(),
                });
                at += len;
            }
            let crcs = vec![u32::MAX; raw.len()];
            let h = render_compressed_header(&facts, &raw, &stored, &crcs, planned)
                .expect("fits the planned length");
            prop_assert_eq!(h.len() as u64, planned);
            let mut file = h;
            file.resize(file.len() + at as usize, 0);
            let st = safetensors::SafeTensors::deserialize(&file).unwrap();
            let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
            let meta = meta.metadata().as_ref().unwrap();
            let codecs: Vec<&str> = meta[CODECS_KEY].split(' ').collect();
            prop_assert_eq!(codecs.len(), raw.len());
            for ((t, s), codec) in raw.iter().zip(&stored).zip(codecs) {
                let view = st.tensor(&t.name).unwrap();
                prop_assert_eq!(view.data().len() as u64, s.end - s.start);
                match &s.filter {
                    None => {
                        prop_assert_eq!(codec, "-");
                        prop_assert_eq!(view.shape().len(), t.shape.len());
                    }
                    Some(f) => {
                        prop_assert_eq!(view.dtype(), safetensors::Dtype::U8);
                        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
                        let want = format!("zstd:{f}:{}:{}", t.dtype.name(), shape.join(","));
                        prop_assert_eq!(codec, want.as_str());
                    }
                }
            }
        }
    }

    fn any_filter() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            Just(None),
            Just(Some("plain".to_string())),
            Just(Some("shuffle8".to_string())),
            Just(Some("delta8".to_string())),
        ]
    }
}

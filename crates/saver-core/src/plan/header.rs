//! Rendering safetensors headers whose length is known before the data are written.
//!
//! Every per-tensor CRC32 is stored in the header's `__metadata__` as fixed-width hex, so the header
//! can be sized (and every data offset fixed) at plan time, and rendered with the real checksums
//! once the data are written: the two renderings have exactly the same length.

use std::fmt::Write as _;

use crate::dtype::Dtype;
use crate::manifest::FORMAT_VERSION;

/// Largest header (JSON and padding, without the 8-byte length) that safetensors readers accept.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Metadata key holding the per-tensor CRC32s, in data order, as space-separated 8-digit hex.
pub const CRC_KEY: &str = "saver.crc32";

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
pub fn render_header(
    facts: &FileFacts<'_>,
    tensors: &[HeaderTensor],
    crcs: &[u32],
    align: u64,
) -> Vec<u8> {
    let mut crc_list = String::with_capacity(crcs.len() * 9);
    for (i, crc) in crcs.iter().enumerate() {
        if i > 0 {
            crc_list.push(' ');
        }
        let _ = write!(crc_list, "{crc:08x}");
    }
    let metadata = [
        // What Hugging Face loaders (`huggingface_hub.load_state_dict_from_file`, transformers)
        // require of a safetensors file before they read it.
        ("format", "pt".to_string()),
        ("saver.format_version", FORMAT_VERSION.to_string()),
        ("saver.save_id", facts.save_id.to_string()),
        ("saver.shard", facts.shard.to_string()),
        ("saver.shard_num", facts.shard_num.to_string()),
        ("saver.file", facts.file.to_string()),
        (CRC_KEY, crc_list),
    ];
    render_header_with(&metadata, tensors, align)
}

/// Renders a safetensors header with the given `__metadata__` pairs, padded so the data section
/// starts at a multiple of `align`.
pub fn render_header_with(
    metadata: &[(&str, String)],
    tensors: &[HeaderTensor],
    align: u64,
) -> Vec<u8> {
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
    let data_start = (8 + json.len() as u64).div_ceil(align) * align;
    let n = data_start - 8;
    let mut out = Vec::with_capacity(data_start as usize);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(data_start as usize, b' ');
    out
}

/// Parses the CRC list of a header's metadata value.
pub fn parse_crcs(value: &str) -> Option<Vec<u32>> {
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
}

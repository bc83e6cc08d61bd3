//! Hostile safetensors files, read by the header parser and as a save's input: a clear error
//! naming the file and the fault, with bounded work, and never a panic on arbitrary bytes.

use std::path::Path;

use proptest::prelude::*;

use super::read_plain;
use crate::load::header::read_header;
use crate::storage::{LocalFs, Storage};

fn fuzz_cases(default: u32) -> u32 {
    std::env::var("SAVER_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn write(path: &Path, header: &str, data_len: usize) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend(std::iter::repeat_n(0u8, data_len));
    std::fs::write(path, b).unwrap();
}

/// Writes one hostile file at the given path.
type MakeFile = Box<dyn Fn(&Path)>;

#[test]
fn hostile_headers_get_clear_errors_with_bounded_work() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let storage = LocalFs::open_dir(dir).unwrap();
    let t = r#""a/ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}"#;
    let cases: Vec<(&str, MakeFile, &str)> = vec![
        (
            "huge-length.safetensors",
            Box::new(|p: &Path| {
                let mut b = (1u64 << 40).to_le_bytes().to_vec();
                b.extend_from_slice(b"{}");
                std::fs::write(p, b).unwrap();
            }),
            "exceeds the file",
        ),
        (
            "not-utf8.safetensors",
            Box::new(|p: &Path| {
                let mut b = 4u64.to_le_bytes().to_vec();
                b.extend_from_slice(&[0xff, 0xfe, b'{', b'}']);
                std::fs::write(p, b).unwrap();
            }),
            "not UTF-8",
        ),
        (
            "duplicate.safetensors",
            Box::new(move |p: &Path| write(p, &format!("{{{t},{t}}}"), 16)),
            "appears twice",
        ),
        (
            "overlap.safetensors",
            Box::new(|p: &Path| {
                write(
                    p,
                    r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#,
                    12,
                )
            }),
            "gap or overlap",
        ),
        (
            "absurd-shape.safetensors",
            Box::new(|p: &Path| {
                write(
                    p,
                    r#"{"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}}"#,
                    8,
                )
            }),
            "\"a\"",
        ),
        (
            "beyond-file.safetensors",
            Box::new(|p: &Path| {
                write(
                    p,
                    r#"{"a":{"dtype":"U8","shape":[1125899906842624],"data_offsets":[0,1125899906842624]}}"#,
                    8,
                )
            }),
            "truncated",
        ),
        (
            "truncated.safetensors",
            Box::new(move |p: &Path| {
                write(p, &format!("{{{t}}}"), 16);
                let b = std::fs::read(p).unwrap();
                std::fs::write(p, &b[..b.len() - 5]).unwrap();
            }),
            "truncated",
        ),
        (
            "not-json.safetensors",
            Box::new(|p: &Path| write(p, "{\"a\":", 0)),
            "not valid JSON",
        ),
        (
            "short.safetensors",
            Box::new(|p: &Path| std::fs::write(p, [1u8, 2, 3]).unwrap()),
            "too short",
        ),
    ];
    for (name, make, needle) in cases {
        let path = dir.join(name);
        make(&path);
        let started = std::time::Instant::now();
        let h = storage.open(name).unwrap();
        let err = read_header(h.as_ref(), name).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains(needle), "{name}: {err}");
        // The same file as `saver save --from` input.
        let err = read_plain(&path).expect_err("refused").to_string();
        assert!(err.contains(name), "{name} via import: {err}");
        assert!(started.elapsed().as_secs() < 5, "{name}: bounded work");
        std::fs::remove_file(&path).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: fuzz_cases(256), ..ProptestConfig::default() })]

    /// The header parser on arbitrary bytes and on mutations of a valid header: never a panic; when
    /// it accepts, what it returns is consistent with the file.
    #[test]
    fn fuzz_header_parser(
        raw in proptest::collection::vec(any::<u8>(), 0..600),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
        mode in 0u8..3,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let storage = LocalFs::open_dir(tmp.path()).unwrap();
        let mut bytes = if mode == 0 { raw } else {
            let mut v = Vec::new();
            let h = r#"{"__metadata__":{"k":"v"},"t/ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"w":{"dtype":"F16","shape":[3],"data_offsets":[16,22]}}"#;
            v.extend_from_slice(&(h.len() as u64).to_le_bytes());
            v.extend_from_slice(h.as_bytes());
            v.extend_from_slice(&[7u8; 22]);
            v
        };
        for (i, b) in &edits {
            if !bytes.is_empty() {
                let k = i.index(bytes.len());
                bytes[k] = *b;
            }
        }
        if mode == 2 && !bytes.is_empty() {
            bytes.truncate(cut.index(bytes.len()));
        }
        std::fs::write(tmp.path().join("f.safetensors"), &bytes).unwrap();
        let h = storage.open("f.safetensors").unwrap();
        if let Ok(header) = read_header(h.as_ref(), "f.safetensors") {
            let mut end = header.data_start;
            for t in &header.tensors {
                prop_assert_eq!(t.offset, end);
                end += t.len;
            }
            prop_assert_eq!(end, bytes.len() as u64);
        }
        let _ = read_plain(&tmp.path().join("f.safetensors"));
    }

}

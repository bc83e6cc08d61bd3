//! The one place where a checkpoint's documents are read: the index, the manifest, the shard
//! manifests and the parent references they hold. A document type has no `Deserialize` of its
//! own; it comes out of these parsers checked, or not at all.
//!
//! Bounds, so that memory follows the checkpoint and not what a file claims: a document is read
//! whole only up to [`MAX_DOCUMENT_BYTES`]; user metadata is refused while it is read past
//! [`super::MAX_USER_METADATA_ENTRIES`] entries or [`super::MAX_USER_METADATA_BYTES`] bytes; the
//! version is probed before anything else is built.
//!
//! ```
//! // The way in: checked, or an error naming the file.
//! let e = saver_core::Manifest::parse(b"{}", "saver-x.manifest.json").unwrap_err();
//! assert!(e.to_string().contains("saver-x.manifest.json"));
//! ```
//!
//! ```compile_fail
//! // No way around the checks: a manifest has no `Deserialize` of its own.
//! let m: saver_core::Manifest = serde_json::from_slice(b"{}").unwrap();
//! ```

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use super::index::{Index, RawIndex};
use super::{
    format_version_of, DenseManifest, FileManifest, Manifest, ParentRef, RawManifest,
    RawShardManifest, RowTableManifest, ShardManifest, TableManifest, TensorRef, FORMAT_NAME,
    FORMAT_VERSION, NEWEST_FORMAT_VERSION,
};
use crate::error::{Error, Result};
use crate::naming::{check_file_name, check_save_id, removed_table_of, INDEX_FILE};
use crate::partition::PartitionRule;

/// Largest document (index, manifest, shard manifest) read whole: a manifest of about a million
/// segments, far past any checkpoint's.
pub const MAX_DOCUMENT_BYTES: u64 = 1 << 30;

fn corrupt(file: &str, what: impl Into<String>) -> Error {
    Error::Corrupt {
        file: file.to_string(),
        what: what.into(),
    }
}

/// Checks a document's format version before the document is built (`found` comes from a probe
/// that skips everything else), so an unknown version is named as such, not as a parse error.
fn check_version(file: &str, found: Option<serde_json::Value>) -> Result<()> {
    let ok = found
        .as_ref()
        .and_then(serde_json::Value::as_u64)
        .is_some_and(|v| {
            (u64::from(FORMAT_VERSION)..=u64::from(NEWEST_FORMAT_VERSION)).contains(&v)
        });
    if ok {
        return Ok(());
    }
    Err(Error::UnsupportedVersion {
        file: file.into(),
        found: found.map_or("none".into(), |v| v.to_string()),
        supported: NEWEST_FORMAT_VERSION,
    })
}

/// A manifest or shard manifest as serde reads it, unchecked: its `format_version` probed first,
/// then the whole parsed once, straight into its types, so memory stays near the file's size.
fn parse_raw<R: serde::de::DeserializeOwned>(bytes: &[u8], file: &str, what: &str) -> Result<R> {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default)]
        format_version: Option<serde_json::Value>,
    }
    let probe: Probe =
        serde_json::from_slice(bytes).map_err(|e| corrupt(file, format!("not valid JSON: {e}")))?;
    check_version(file, probe.format_version)?;
    serde_json::from_slice(bytes).map_err(|e| corrupt(file, format!("not {what}: {e}")))
}

/// What a manifest and a shard manifest both hold, and are checked for alike.
struct Body<'a> {
    format: &'a str,
    version: u32,
    parent: Option<&'a ParentRef>,
    save_id: &'a str,
    partition: &'a PartitionRule,
    files: &'a [FileManifest],
    tables: &'a [TableManifest],
    dense: &'a [DenseManifest],
    rows: &'a [RowTableManifest],
}

/// The [`Body`] of a manifest or a shard manifest: the fields have the same names in both.
macro_rules! body_of {
    ($m:expr) => {
        Body {
            format: &$m.format,
            version: $m.format_version,
            parent: $m.parent.as_ref(),
            save_id: &$m.save_id,
            partition: &$m.partition,
            files: &$m.files,
            tables: &$m.tables,
            dense: &$m.dense,
            rows: &$m.row_tables,
        }
    };
}

impl Index {
    /// Parses and checks an index: known version, saver format, a valid save id, safe names.
    pub fn parse(bytes: &[u8], file: &str) -> Result<Index> {
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            metadata: Option<ProbeMetadata>,
        }
        #[derive(Deserialize)]
        struct ProbeMetadata {
            #[serde(default)]
            saver_format_version: Option<serde_json::Value>,
        }
        let probe: Probe = serde_json::from_slice(bytes)
            .map_err(|e| corrupt(file, format!("not valid JSON: {e}")))?;
        // A missing version is left to the parse below, which names the missing field.
        if let Some(found) = probe.metadata.and_then(|m| m.saver_format_version) {
            check_version(file, Some(found))?;
        }
        let index = serde_json::from_slice::<RawIndex>(bytes)
            .map_err(|e| corrupt(file, format!("not a saver index: {e}")))?
            .unchecked();
        if index.metadata.format != FORMAT_NAME {
            return Err(corrupt(
                file,
                format!(
                    "metadata.format is {:?}, not \"saver\"",
                    index.metadata.format
                ),
            ));
        }
        check_save_id(&index.metadata.saver_save_id).map_err(|e| corrupt(file, e.to_string()))?;
        check_file_name(&index.metadata.saver_manifest, file)?;
        for f in index.weight_map.values() {
            check_file_name(f, file)?;
        }
        Ok(index)
    }
}

impl Manifest {
    /// Parses a manifest and checks it on its own: format and version, parent, tables, files and
    /// the tensors they hold. Use [`Manifest::parse_committed`] to read the one an index commits.
    pub fn parse(bytes: &[u8], file: &str) -> Result<Manifest> {
        let m = parse_raw::<RawManifest>(bytes, file, "a saver manifest")?.unchecked();
        check_manifest(&m, file)?;
        Ok(m)
    }

    /// Parses the manifest `index` commits, given its bytes as read from `index`'s
    /// `saver_manifest`: checks its CRC against the index's, the manifest itself
    /// ([`Manifest::parse`]), and that both list the same save, tensors and bytes.
    #[doc(hidden)]
    pub fn parse_committed(bytes: &[u8], index: &Index) -> Result<Manifest> {
        let file = &index.metadata.saver_manifest;
        let crc = crc32fast::hash(bytes);
        if crc != index.metadata.saver_manifest_crc32 {
            return Err(corrupt(
                file,
                format!(
                    "checksum {crc:08x} differs from {:08x} recorded in {INDEX_FILE} (one of the two is corrupt)",
                    index.metadata.saver_manifest_crc32
                ),
            ));
        }
        let m = Manifest::parse(bytes, file)?;
        check_agrees_with_index(&m, index, file)?;
        Ok(m)
    }
}

impl ShardManifest {
    /// Parses and checks a shard manifest: format and version, save id, shard number, parent,
    /// tables and safe file names. Whether the shards of a save agree is [`Manifest::merge`]'s.
    pub fn parse(bytes: &[u8], file: &str) -> Result<ShardManifest> {
        let m = parse_raw::<RawShardManifest>(bytes, file, "a shard manifest")?.unchecked();
        if m.shard >= m.shard_num {
            return Err(corrupt(
                file,
                format!("shard {} of {} shards", m.shard, m.shard_num),
            ));
        }
        check_body(&body_of!(m), file)?;
        Ok(m)
    }
}

/// Checks a parent path as a manifest gives it: relative, non-empty, no control characters.
#[doc(hidden)]
pub fn check_parent_path(path: &str) -> std::result::Result<(), String> {
    if path.is_empty() {
        return Err("path is empty".into());
    }
    if path.chars().any(char::is_control) {
        return Err(format!("path {path:?} contains a control character"));
    }
    if Path::new(path).is_absolute() || path.starts_with('\\') {
        return Err(format!(
            "path {path:?} is absolute: a parent is named relative to its child"
        ));
    }
    Ok(())
}

/// Format name, and a version that fits a full checkpoint or a delta; a parent's path.
fn check_format(
    format: &str,
    version: u32,
    parent: Option<&ParentRef>,
    compressed: bool,
    row_range: bool,
    file: &str,
) -> Result<()> {
    if format != FORMAT_NAME {
        return Err(corrupt(
            file,
            format!("format is {format:?}, not {FORMAT_NAME:?}"),
        ));
    }
    if version != format_version_of(parent, compressed, row_range) {
        return Err(corrupt(
            file,
            format!(
                "format version {version} does not fit a {}{} checkpoint{}",
                if compressed { "compressed " } else { "" },
                if parent.is_some() { "delta" } else { "full" },
                if row_range {
                    " with row-range tables"
                } else {
                    ""
                }
            ),
        ));
    }
    if let Some(p) = parent {
        check_parent_path(&p.path).map_err(|why| corrupt(file, format!("parent {why}")))?;
    }
    Ok(())
}

/// A removed-ids table (`t:removed`) only in a delta, beside its table, without slots.
fn check_removed_tables(tables: &[TableManifest], delta: bool, file: &str) -> Result<()> {
    for t in tables {
        if let Some(base) = removed_table_of(&t.name) {
            if !delta || !tables.iter().any(|x| x.name == base) || !t.slots.is_empty() {
                return Err(corrupt(
                    file,
                    format!(
                        "table {:?} is not the removed ids of a table of a delta",
                        t.name
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Safe file names; every tensor listed once, in a listed file; every table consistent.
/// Returns each tensor's file by tensor name.
fn check_files_and_tables<'a>(
    files: &[&str],
    tables: &'a [TableManifest],
    dense: impl Iterator<Item = &'a TensorRef>,
    file: &str,
) -> Result<HashMap<&'a str, &'a str>> {
    for f in files {
        check_file_name(f, file)?;
    }
    let sparse = tables.iter().flat_map(|t| {
        t.partitions.iter().flat_map(|p| {
            p.segments.iter().flat_map(|s| {
                std::iter::once(&s.ids)
                    .chain(std::iter::once(&s.bucket_index))
                    .chain(&s.slots)
            })
        })
    });
    let mut refs: HashMap<&str, &str> = HashMap::new();
    for t in sparse.chain(dense) {
        check_file_name(&t.file, file)?;
        t.check_codec()
            .map_err(|why| corrupt(file, format!("tensor {:?} {why}", t.name)))?;
        if refs.insert(&t.name, &t.file).is_some() {
            return Err(corrupt(
                file,
                format!("tensor {:?} is listed twice", t.name),
            ));
        }
        if !files.contains(&t.file.as_str()) {
            return Err(corrupt(
                file,
                format!(
                    "tensor {:?} is in file {:?}, which is not listed",
                    t.name, t.file
                ),
            ));
        }
    }
    for t in tables {
        t.check_consistency()
            .map_err(|e| corrupt(file, e.to_string()))?;
    }
    Ok(refs)
}

/// Row-range tables consistent (see [`RowTableManifest`]), each named once and not like a hashed
/// table. A shard manifest's chunks need not cover their slots; a manifest's do: that is checked
/// where the manifest is checked whole ([`check_manifest`]).
fn check_row_tables(rows: &[RowTableManifest], tables: &[TableManifest], file: &str) -> Result<()> {
    for (i, r) in rows.iter().enumerate() {
        if rows[..i].iter().any(|o| o.name == r.name) || tables.iter().any(|t| t.name == r.name) {
            return Err(corrupt(file, format!("table {:?} is listed twice", r.name)));
        }
        r.check_consistency(false)
            .map_err(|e| corrupt(file, e.to_string()))?;
    }
    Ok(())
}

/// Format and version, save id, partition rule, removed-ids tables, safe file names, tensors
/// listed once in listed files, consistent tables.
fn check_body(b: &Body<'_>, file: &str) -> Result<()> {
    let compressed =
        crate::manifest::tensor_refs_of(b.tables, b.dense, b.rows).any(|t| t.codec.is_some());
    check_format(
        b.format,
        b.version,
        b.parent,
        compressed,
        !b.rows.is_empty(),
        file,
    )?;
    check_save_id(b.save_id).map_err(|e| corrupt(file, e.to_string()))?;
    check_removed_tables(b.tables, b.parent.is_some(), file)?;
    b.partition.validate()?;
    check_files_and_tables(
        &b.files.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
        b.tables,
        b.dense
            .iter()
            .map(|d| &d.tensor)
            .chain(b.rows.iter().flat_map(RowTableManifest::tensor_refs)),
        file,
    )?;
    check_row_tables(b.rows, b.tables, file)?;
    if b.parent.is_none() {
        if let Some(t) = b.rows.iter().find(|t| t.has_patches()) {
            return Err(corrupt(
                file,
                format!(
                    "row-range table {:?} holds changed rows of a parent, but the checkpoint has \
                     none",
                    t.name
                ),
            ));
        }
    }
    Ok(())
}

/// Internal consistency of a manifest.
fn check_manifest(m: &Manifest, file: &str) -> Result<()> {
    check_body(&body_of!(m), file)?;
    for r in &m.row_tables {
        r.check_consistency(true)
            .map_err(|e| corrupt(file, e.to_string()))?;
    }
    if m.shard_num == 0 {
        return Err(corrupt(file, "zero shards"));
    }
    for name in &m.dense_in_parent {
        if m.parent.is_none() || m.dense.iter().any(|d| &d.tensor.name == name) {
            return Err(corrupt(
                file,
                format!(
                    "dense tensor {name:?} is said to be in the parent, but the checkpoint {}",
                    if m.parent.is_none() {
                        "has no parent"
                    } else {
                        "holds it too"
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// A manifest and the index that commits it list the same save, tensors and bytes.
fn check_agrees_with_index(m: &Manifest, index: &Index, file: &str) -> Result<()> {
    if m.save_id != index.metadata.saver_save_id {
        return Err(corrupt(
            file,
            format!(
                "save id {} differs from {INDEX_FILE}'s {}",
                m.save_id, index.metadata.saver_save_id
            ),
        ));
    }
    let refs: HashMap<&str, &str> = m
        .tensor_refs()
        .map(|t| (t.name.as_str(), t.file.as_str()))
        .collect();
    if refs.len() != index.weight_map.len() {
        return Err(corrupt(
            INDEX_FILE,
            format!(
                "lists {} tensors, the manifest {}",
                index.weight_map.len(),
                refs.len()
            ),
        ));
    }
    for (name, f) in &index.weight_map {
        if refs.get(name.as_str()) != Some(&f.as_str()) {
            return Err(corrupt(
                INDEX_FILE,
                format!("tensor {name:?} maps to {f:?}, which the manifest does not say"),
            ));
        }
    }
    let total: u64 = m.total_tensor_bytes();
    if index.metadata.total_size != total {
        return Err(corrupt(
            INDEX_FILE,
            format!(
                "total_size {} but the tensors hold {total} bytes",
                index.metadata.total_size
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::manifest::COMPRESSED_FORMAT_VERSION;
    use crate::plan::{plan, PlanOptions, TensorCrc};
    use crate::synthetic::{SyntheticModel, SyntheticSpec};

    /// The shard manifests, merged manifest and index of a two-shard save of a tiny model, as
    /// JSON, the way a save writes them (CRCs aside).
    fn documents() -> (Vec<Vec<u8>>, Vec<u8>, Vec<u8>) {
        let spec: SyntheticSpec = "tiny,rows=300".parse().unwrap();
        let model = SyntheticModel::generate(&spec).unwrap();
        let input = model.input();
        let p = plan(
            &input,
            &PlanOptions {
                shard_num: 2,
                save_id: "s1".into(),
                ..PlanOptions::default()
            },
        )
        .unwrap();
        let shards: Vec<ShardManifest> = (0..p.shards().len())
            .map(|pos| {
                let crcs: Vec<Vec<TensorCrc>> = p.shards()[pos]
                    .files
                    .iter()
                    .map(|f| {
                        f.tensors
                            .iter()
                            .map(|_| TensorCrc {
                                crc32: 7,
                                blocks: None,
                                stored: None,
                            })
                            .collect()
                    })
                    .collect();
                let mut m = p
                    .shard_manifest(pos, &crcs, &BTreeMap::new(), None)
                    .unwrap();
                m.dense_given = p.dense_given().unwrap();
                m
            })
            .collect();
        let json: Vec<Vec<u8>> = shards
            .iter()
            .map(|s| serde_json::to_vec(s).unwrap())
            .collect();
        let m = Manifest::merge(shards).unwrap();
        let mj = serde_json::to_vec(&m).unwrap();
        let ij = serde_json::to_vec(&Index::for_manifest(&m, crc32fast::hash(&mj))).unwrap();
        (json, mj, ij)
    }

    fn edit(bytes: &[u8], f: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        f(&mut v);
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn documents_a_save_writes_parse_back_equal() {
        let (shards, mj, ij) = documents();
        let parsed: Vec<ShardManifest> = shards
            .iter()
            .enumerate()
            .map(|(i, b)| ShardManifest::parse(b, &format!("shard {i}")).unwrap())
            .collect();
        let m = Manifest::merge(parsed).unwrap();
        assert_eq!(serde_json::to_vec(&m).unwrap(), mj);
        let index = Index::parse(&ij, INDEX_FILE).unwrap();
        assert_eq!(Manifest::parse_committed(&mj, &index).unwrap(), m);
        assert_eq!(index.committed().save_id, "s1");
    }

    #[test]
    fn each_document_refuses_what_would_mislead_a_reader() {
        let (shards, mj, ij) = documents();
        let index = Index::parse(&ij, INDEX_FILE).unwrap();
        let manifest = |b: &[u8]| Manifest::parse(b, "saver-s1.manifest.json").unwrap_err();
        // A file name leading out of the directory.
        let e = manifest(&edit(&mj, |v| {
            v["files"][0]["name"] = "../x.safetensors".into()
        }));
        assert!(matches!(e, Error::UnsafePath { .. }), "{e}");
        // A tensor listed twice.
        let e = manifest(&edit(&mj, |v| {
            let d = v["dense"][0].clone();
            v["dense"].as_array_mut().unwrap().push(d);
        }));
        assert!(e.to_string().contains("listed twice"), "{e}");
        // A version this build does not know, named as such.
        let e = manifest(&edit(&mj, |v| v["format_version"] = 9.into()));
        assert!(matches!(e, Error::UnsupportedVersion { .. }), "{e}");
        // A full checkpoint's manifest claiming the delta version.
        let e = manifest(&edit(&mj, |v| v["format_version"] = 2.into()));
        assert!(e.to_string().contains("does not fit a full"), "{e}");
        // An absolute parent.
        let e = manifest(&edit(&mj, |v| {
            v["format_version"] = 2.into();
            v["parent"] = serde_json::json!({"path": "/etc", "save_id": "p", "manifest_crc32": 1});
        }));
        assert!(e.to_string().contains("absolute"), "{e}");
        // Bytes that are not the ones the index committed.
        let mut other = mj.clone();
        other.push(b' ');
        let e = Manifest::parse_committed(&other, &index).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        // A shard outside its save, and an unsafe save id.
        let e =
            ShardManifest::parse(&edit(&shards[1], |v| v["shard"] = 2.into()), "s").unwrap_err();
        assert!(e.to_string().contains("shard 2 of 2 shards"), "{e}");
        let e = ShardManifest::parse(&edit(&shards[0], |v| v["save_id"] = "../a".into()), "s")
            .unwrap_err();
        assert!(e.to_string().contains("save_id"), "{e}");
        // An index naming a manifest outside the directory.
        let e = Index::parse(
            &edit(&ij, |v| {
                v["metadata"]["saver_manifest"] = "/etc/passwd".into()
            }),
            INDEX_FILE,
        )
        .unwrap_err();
        assert!(matches!(e, Error::UnsafePath { .. }), "{e}");
    }

    /// A compressed tensor's codec must describe it, and only a compressed version may hold one:
    /// a reader of versions 1 and 2 never meets stored bytes it would take for values.
    #[test]
    fn codecs_are_checked_against_their_tensor_and_the_version() {
        let (_, mj, _) = documents();
        let manifest = |b: &[u8]| Manifest::parse(b, "saver-s1.manifest.json");
        // The first dense tensor, with blocks of 1 KiB when it has them.
        let m: serde_json::Value = serde_json::from_slice(&mj).unwrap();
        let t = &m["dense"][0]["tensor"];
        let len = t["len"].as_u64().unwrap();
        let frame = t["blocks"]["bytes"].as_u64().unwrap_or(len);
        let frames = len.div_ceil(frame);
        let lens =
            |n: u64, each: u64| -> String { (0..n).map(|_| format!("{each:08x}")).collect() };
        let with = |version: u32, codec: serde_json::Value| {
            edit(&mj, |v| {
                v["format_version"] = version.into();
                v["dense"][0]["tensor"]["codec"] = codec;
            })
        };
        let good = serde_json::json!({
            "name": "zstd", "filter": "shuffle4", "stored": frames, "frames": lens(frames, 1)
        });
        let ok = manifest(&with(COMPRESSED_FORMAT_VERSION, good.clone())).unwrap();
        assert!(ok.is_compressed());
        // The same codec under version 1: refused.
        let e = manifest(&with(FORMAT_VERSION, good.clone())).unwrap_err();
        assert!(e.to_string().contains("compressed full"), "{e}");
        // Version 3 with nothing compressed: refused too.
        let e = manifest(&edit(&mj, |v| {
            v["format_version"] = COMPRESSED_FORMAT_VERSION.into()
        }))
        .unwrap_err();
        assert!(e.to_string().contains("does not fit a full"), "{e}");
        for (codec, says) in [
            (
                serde_json::json!({"name": "lz4", "filter": "plain", "stored": frames,
                                   "frames": lens(frames, 1)}),
                "unknown codec",
            ),
            (
                serde_json::json!({"name": "zstd", "filter": "shuffle3", "stored": frames,
                                   "frames": lens(frames, 1)}),
                "unknown filter",
            ),
            (
                serde_json::json!({"name": "zstd", "filter": "plain", "stored": frames + 1,
                                   "frames": lens(frames + 1, 1)}),
                "compressed frames for",
            ),
            (
                serde_json::json!({"name": "zstd", "filter": "plain", "stored": frames + 5,
                                   "frames": lens(frames, 1)}),
                "not the",
            ),
            (
                serde_json::json!({"name": "zstd", "filter": "plain", "stored": 0,
                                   "frames": lens(frames, 0)}),
                "of 0 bytes",
            ),
            (
                serde_json::json!({"name": "zstd", "filter": "plain",
                                   "stored": frames * (frame + 1),
                                   "frames": lens(frames, frame + 1)}),
                "raw bytes",
            ),
        ] {
            let e = manifest(&with(COMPRESSED_FORMAT_VERSION, codec)).unwrap_err();
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
    }
}

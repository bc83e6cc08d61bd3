//! What an export refuses, each with one line naming what is wrong, and nothing left that looks
//! like an export: rows its quantized form cannot hold, a dense tensor bearing a table column's
//! name, a checkpoint as the destination.

use std::path::Path;

use saver::core::quantize::{QuantBits, QuantLayout, Quantization};
use saver::io::tools::export::{export, ExportOptions};
use saver::{
    save, Checkpoint, DenseTensor, Dtype, EmbeddingTable, KeyDtype, SaveInput, SaveOptions,
    SlotSpec,
};

fn table(name: &str, rows: &[[f32; 4]]) -> EmbeddingTable {
    let t = EmbeddingTable::new(
        name,
        KeyDtype::I64,
        vec![SlotSpec::new("embedding", Dtype::F32, vec![4])],
    )
    .unwrap();
    for (id, row) in rows.iter().enumerate() {
        let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
        t.insert(id as u64, &[&bytes[..]]).unwrap();
    }
    t
}

fn opts() -> SaveOptions {
    {
        SaveOptions {
            durable: false,
            ..Default::default()
        }
    }
}

fn export_opts(quantize: Option<Quantization>) -> ExportOptions {
    {
        ExportOptions {
            quantize,
            durable: false,
            parallel: 2,
            ..Default::default()
        }
    }
}

fn no_export_in(dir: &Path) {
    assert!(
        !dir.join("model.safetensors.index.json").exists(),
        "a failed export left an index"
    );
}

/// Row 2 (by id) holds values past f16's range: every f16 form refuses it naming the tensor and
/// the row; int8 in the fused layout (f32 scale and bias) exports it.
#[test]
fn a_row_past_f16_is_refused_by_the_f16_forms_and_exported_at_int8_fused() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let rows = [
        [0.5f32, 1.0, -1.0, 0.0],
        [2.0, 3.0, 4.0, 5.0],
        [-70000.0, 1.0, 2.0, 1e5],
        [0.0; 4],
    ];
    save(&ck, SaveInput::new().table(&table("item", &rows)), &opts()).unwrap();
    let ck = Checkpoint::open(&ck).unwrap();
    for (bits, layout) in [
        (QuantBits::Int4, QuantLayout::Fused),
        (QuantBits::Int2, QuantLayout::Fused),
        (QuantBits::Int8, QuantLayout::FusedHalf),
        (QuantBits::Int4, QuantLayout::Split),
    ] {
        let out = d.path().join(format!("{bits:?}-{layout:?}"));
        let e = export(&ck, &out, &export_opts(Some(Quantization { bits, layout })))
            .expect_err("values past f16 are refused");
        let msg = e.to_string();
        assert!(
            msg.contains("item/embedding") && msg.contains("row 2"),
            "{msg}"
        );
        assert_eq!(msg.lines().count(), 1, "{msg}");
        no_export_in(&out);
    }
    let out = d.path().join("int8");
    let q = Quantization {
        bits: QuantBits::Int8,
        layout: QuantLayout::Fused,
    };
    export(&ck, &out, &export_opts(Some(q))).unwrap();
}

#[test]
fn a_dense_tensor_named_like_a_table_column_is_named_by_the_export() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let t = table("t", &[[1.0; 4]]);
    let values = [1.0f32, 2.0];
    let dense = DenseTensor::from_f32("t/ids", vec![2], &values).unwrap();
    save(&ck, SaveInput::new().table(&t).dense(dense), &opts()).unwrap();
    let out = d.path().join("out");
    let e = export(&Checkpoint::open(&ck).unwrap(), &out, &export_opts(None)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("dense tensor \"t/ids\"") && msg.contains("table \"t\""),
        "{msg}"
    );
    assert!(!msg.contains("quantiz"), "{msg}");
    no_export_in(&out);
}

/// A checkpoint as the destination is refused as one, with or without overwrite: the error
/// never suggests an overwrite that would then be refused.
#[test]
fn an_export_into_a_checkpoint_is_refused_without_suggesting_overwrite() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    save(
        &a,
        SaveInput::new().table(&table("t", &[[1.0; 4]])),
        &opts(),
    )
    .unwrap();
    save(
        &b,
        SaveInput::new().table(&table("u", &[[2.0; 4]])),
        &opts(),
    )
    .unwrap();
    let ck = Checkpoint::open(&a).unwrap();
    for overwrite in [false, true] {
        let e = export(&ck, &b, &{
            let mut o = export_opts(None);
            o.overwrite = overwrite;
            o
        })
        .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("holds a saver checkpoint"), "{msg}");
        assert!(!msg.contains("overwrite"), "{msg}");
    }
    saver::verify(&b, 1)
        .map(|r| assert_eq!(r.status, saver::Status::Ok))
        .unwrap();
    // An earlier export, though, is replaced when asked, and only then.
    let out = d.path().join("out");
    export(&ck, &out, &export_opts(None)).unwrap();
    let msg = export(&ck, &out, &export_opts(None))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("already holds an export") && msg.contains("--overwrite"),
        "{msg}"
    );
    export(&ck, &out, &{
        let mut o = export_opts(None);
        o.overwrite = true;
        o
    })
    .unwrap();
}

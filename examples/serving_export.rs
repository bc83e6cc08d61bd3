//! A serving export: keep embeddings only (filter closures drop the optimizer state and cold rows),
//! then write a consolidated plain safetensors copy cast to f16 that any safetensors reader opens.
//!
//! Run: `cargo run --release --example serving_export [DIR]`

use std::path::PathBuf;

use saver::core::synthetic::{SyntheticModel, SyntheticSpec};
use saver::core::BlockKind;
use saver::io::tools::export::{export, ExportOptions};
use saver::{save, Checkpoint, Dtype, Filters, SaveOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("saver-serving-example"));
    let _ = std::fs::remove_dir_all(&root);
    let spec: SyntheticSpec =
        "tables=4,rows=20000,dim=32,slots=embedding+adagrad+freq,dense=1MiB".parse()?;
    let model = SyntheticModel::generate(&spec)?;

    let mut opts = SaveOptions::default();
    opts.plan.shard_num = 4;
    opts.plan.filters = Filters::new()
        // Serving needs no optimizer state and no counters.
        .keep_blocks(|b| b.kind != BlockKind::Slot || b.slot == Some("embedding"))
        // Rows seen fewer than 10 times are not served.
        .keep_rows(|row| row.scalar("freq").is_some_and(|f| f >= 10.0));
    let ckpt_dir = root.join("serving-ckpt");
    let r = save(&ckpt_dir, model.input(), &opts)?;
    println!("serving checkpoint: {} rows in {} files", r.rows, r.files);

    let ck = Checkpoint::open(&ckpt_dir)?;
    let out = root.join("export-f16");
    let e = export(&ck, &out, &{
        ExportOptions {
            dtype: Some(Dtype::F16),
            max_file_size: 1 << 20,
            ..Default::default()
        }
    })?;
    println!(
        "export: {} tensors in {} files under {}",
        e.tensors,
        e.files,
        out.display()
    );

    // Any safetensors reader can open the export: check with the reference crate.
    for entry in std::fs::read_dir(&out)? {
        let path = entry?.path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path)?;
            let st = safetensors::SafeTensors::deserialize(&bytes)?;
            for (name, view) in st.tensors() {
                if name.ends_with("/embedding") {
                    assert_eq!(view.dtype(), safetensors::Dtype::F16);
                }
                assert!(!name.ends_with("/adagrad") && !name.ends_with("/freq"));
            }
        }
    }
    println!(
        "ok: every file opens with the safetensors crate; embeddings are f16, no optimizer state"
    );
    Ok(())
}

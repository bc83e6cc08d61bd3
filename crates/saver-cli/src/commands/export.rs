//! `saver export`.

use std::process::ExitCode;

use saver_core::quantize::{QuantBits, QuantLayout, Quantization};
use saver_core::Dtype;
use saver_io::load::checkpoint::read_latest;
use saver_io::tools::export::{export, ExportOptions};
use saver_io::Checkpoint;

use super::CmdResult;
use crate::cli::{CastDtype, ExportArgs, QuantizeBits, QuantizeLayout};
use crate::output;

#[allow(clippy::too_many_arguments)]
pub(super) fn run(args: ExportArgs) -> CmdResult {
    let ExportArgs {
        src,
        out,
        max_file_size,
        exclude_slots,
        tables,
        dtype,
        quantize,
        quantize_layout,
        quantize_slots,
        overwrite,
        out_fmt: fmt,
    } = args;
    let quantize = quantize.map(|bits| Quantization {
        bits: match bits {
            QuantizeBits::Int8 => QuantBits::Int8,
            QuantizeBits::Int4 => QuantBits::Int4,
            QuantizeBits::Int2 => QuantBits::Int2,
        },
        layout: match quantize_layout {
            QuantizeLayout::Fused => QuantLayout::Fused,
            QuantizeLayout::FusedHalf => QuantLayout::FusedHalf,
            QuantizeLayout::Split => QuantLayout::Split,
        },
    });
    let (src, out) = (src.as_path(), out.as_path());
    let opts = {
        ExportOptions {
            max_file_size,
            tables,
            exclude_slots,
            dtype: dtype.map(|d| match d {
                CastDtype::F32 => Dtype::F32,
                CastDtype::F16 => Dtype::F16,
                CastDtype::Bf16 => Dtype::BF16,
            }),
            quantize,
            quantize_slots,
            overwrite,
            ..Default::default()
        }
    };
    // Read again if the source is replaced meanwhile (see `read_latest`).
    let r = output::while_working(fmt.json, "exporting", || {
        read_latest(src, || export(&Checkpoint::open(src)?, out, &opts))
    })?;
    if fmt.json {
        output::json(&r);
    } else {
        println!(
            "exported {} tensors in {} files ({}) to {} in {:.2}s",
            r.tensors,
            r.files,
            output::size(r.bytes_written),
            out.display(),
            r.seconds
        );
    }
    Ok(ExitCode::SUCCESS)
}

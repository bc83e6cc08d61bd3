//! Casting floating-point tensors between F64, F32, F16 and BF16 (for serving exports).

use half::{bf16, f16};

use crate::dtype::Dtype;
use crate::error::{Error, Result};

fn read(bytes: &[u8], dtype: Dtype) -> Vec<f64> {
    match dtype {
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        _ => unreachable!("checked by cast"),
    }
}

/// Casts little-endian `bytes` of `from` to `to`. Both must be floating types ([`Dtype::is_float`]);
/// rounding is to nearest even, as the `half` crate and numpy do.
pub fn cast(bytes: &[u8], from: Dtype, to: Dtype) -> Result<Vec<u8>> {
    for d in [from, to] {
        if !d.is_float() {
            return Err(Error::BadDtype {
                context: format!("cast from {from} to {to}"),
                dtype: d.name().into(),
            });
        }
    }
    if from == to {
        return Ok(bytes.to_vec());
    }
    // F32 -> F16/BF16 directly: the common serving case, and exact (no double rounding via f64).
    if from == Dtype::F32 && matches!(to, Dtype::F16 | Dtype::BF16) {
        let it = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
        return Ok(match to {
            Dtype::F16 => it.flat_map(|x| f16::from_f32(x).to_le_bytes()).collect(),
            _ => it.flat_map(|x| bf16::from_f32(x).to_le_bytes()).collect(),
        });
    }
    let vals = read(bytes, from);
    Ok(match to {
        Dtype::F64 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F32 => vals
            .iter()
            .flat_map(|&x| (x as f32).to_le_bytes())
            .collect(),
        Dtype::F16 => vals
            .iter()
            .flat_map(|&x| f16::from_f64(x).to_le_bytes())
            .collect(),
        Dtype::BF16 => vals
            .iter()
            .flat_map(|&x| bf16::from_f64(x).to_le_bytes())
            .collect(),
        _ => unreachable!("checked above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_round_trip_representable_values() {
        let v: Vec<u8> = [1.5f32, -2.0, 0.0, 65504.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let h = cast(&v, Dtype::F32, Dtype::F16).unwrap();
        assert_eq!(h.len(), 8);
        assert_eq!(cast(&h, Dtype::F16, Dtype::F32).unwrap(), v);
        let b = cast(&v[..8], Dtype::F32, Dtype::BF16).unwrap();
        assert_eq!(cast(&b, Dtype::BF16, Dtype::F32).unwrap(), v[..8]);
        assert!(cast(&v, Dtype::F32, Dtype::I32)
            .unwrap_err()
            .to_string()
            .contains("I32"));
    }
}

//! Synthetic models, generated deterministically from a spec: for tests, benchmarks and the
//! `saver save --synthetic` command. Every process given the same spec builds the same model, so
//! N processes can each save their shard of one checkpoint.
//!
//! A spec is either a preset name (`tiny`, `small`, `criteo-kaggle`), optionally followed by
//! overrides, or a list of `key=value` pairs:
//!
//! ```text
//! tables=8,rows=1000000,dim=64,slots=embedding+adagrad,dense=64MiB,seed=7
//! criteo-kaggle,scale=0.5
//! ```
//!
//! Keys: `tables`, `rows` (per table), `dim`, `slots` (`+`-separated among `embedding`, `adagrad`,
//! `adam_m`, `adam_v` (F32 × dim), `freq`, `step` (I64 scalars)), `dense` (bytes, with an optional
//! KiB/MiB/GiB suffix), `seed`, `scale` (multiplies row counts and dense bytes).

use std::str::FromStr;

use rayon::prelude::*;

use crate::dtype::{Dtype, KeyDtype};
use crate::error::{Error, Result};
use crate::partition::{fmix64, Shard};
use crate::table::{EmbeddingTable, SlotSpec};
use crate::tensor::DenseTensor;

/// Row counts of the 26 categorical features of the Criteo Kaggle display-advertising dataset, as
/// DLRM uses them (`dataset.npz` counts).
pub const CRITEO_KAGGLE_ROWS: [u64; 26] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
];

/// Slots a synthetic table may have.
const KNOWN_SLOTS: [&str; 6] = ["embedding", "adagrad", "adam_m", "adam_v", "freq", "step"];

/// A parsed synthetic model spec.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// Rows of each table (before `scale`).
    pub rows: Vec<u64>,
    /// Embedding width.
    pub dim: u64,
    /// Slot names.
    pub slots: Vec<String>,
    /// Dense bytes in total (before `scale`).
    pub dense_bytes: u64,
    /// Seed of every value.
    pub seed: u64,
    /// Multiplies rows and dense bytes.
    pub scale: f64,
    /// Row-range tables (`kind=rows`: ids `0..rows`, each slot a dense matrix) instead of hashed
    /// ones (`kind=hashed`, the default).
    pub row_range: bool,
    /// Percent of each row-range table's rows changed (`touched=P`), as a step of training
    /// would: a model to save as a delta of the untouched one.
    pub touched: u64,
}

fn bad(spec: &str, why: impl Into<String>) -> Error {
    Error::InvalidOption {
        option: "synthetic spec",
        why: format!("{spec:?}: {}", why.into()),
    }
}

/// Parses a byte size: a number with an optional `B`, `KiB`, `MiB`, `GiB`, `TiB` (or `K`, `M`,
/// `G`, `T`, `KB`, `MB`, `GB`, `TB`, all binary) suffix.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    let v = num * mult as f64;
    (v.is_finite() && v >= 0.0 && v < u64::MAX as f64).then_some(v as u64)
}

impl SyntheticSpec {
    fn preset(name: &str) -> Option<Self> {
        let slots = |s: &[&str]| s.iter().map(|x| x.to_string()).collect();
        Some(match name {
            "tiny" => Self {
                rows: vec![1000; 3],
                dim: 8,
                slots: slots(&["embedding", "adagrad", "freq"]),
                dense_bytes: 64 << 10,
                seed: 7,
                scale: 1.0,
                row_range: false,
                touched: 0,
            },
            "small" => Self {
                rows: vec![100_000; 4],
                dim: 64,
                slots: slots(&["embedding", "adagrad"]),
                dense_bytes: 16 << 20,
                seed: 7,
                scale: 1.0,
                row_range: false,
                touched: 0,
            },
            "criteo-kaggle" => Self {
                rows: CRITEO_KAGGLE_ROWS.to_vec(),
                dim: 16,
                slots: slots(&["embedding", "adagrad"]),
                dense_bytes: 4 << 20,
                seed: 7,
                scale: 1.0,
                row_range: false,
                touched: 0,
            },
            _ => return None,
        })
    }

    /// Row counts after scaling (at least one row per table).
    pub fn table_rows(&self) -> Vec<u64> {
        self.rows
            .iter()
            .map(|&r| ((r as f64 * self.scale).round() as u64).max(1))
            .collect()
    }

    /// The slot specs of every table.
    pub(crate) fn slot_specs(&self) -> Vec<SlotSpec> {
        self.slots
            .iter()
            .map(|s| match s.as_str() {
                "freq" | "step" => SlotSpec::new(s.clone(), Dtype::I64, vec![]),
                _ => SlotSpec::new(s.clone(), Dtype::F32, vec![self.dim]),
            })
            .collect()
    }

    /// Approximate bytes of the generated model (ids, slots and dense).
    pub fn model_bytes(&self) -> u64 {
        let ids = if self.row_range { 0 } else { 8 };
        let row: u64 = ids
            + self
                .slot_specs()
                .iter()
                .map(|s| s.row_bytes().unwrap_or(0))
                .sum::<u64>();
        self.table_rows().iter().sum::<u64>() * row + (self.dense_bytes as f64 * self.scale) as u64
    }
}

impl FromStr for SyntheticSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let mut parts = s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .peekable();
        let first = parts.peek().copied().ok_or_else(|| bad(s, "empty spec"))?;
        let mut spec = if first.contains('=') {
            Self::preset("tiny").expect("tiny exists")
        } else {
            parts.next();
            Self::preset(first).ok_or_else(|| {
                bad(
                    s,
                    format!("unknown preset {first:?} (known: tiny, small, criteo-kaggle)"),
                )
            })?
        };
        let mut tables = None;
        let mut rows = None;
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(s, format!("{part:?} is not key=value")))?;
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| bad(s, format!("{k}={v} is not a whole number")))
            };
            match k {
                "tables" => tables = Some(num(v)?),
                "rows" => rows = Some(num(v)?),
                "dim" => spec.dim = num(v)?,
                "seed" => spec.seed = num(v)?,
                "touched" => {
                    spec.touched = num(v)?;
                    if spec.touched > 100 {
                        return Err(bad(s, format!("touched={v} is not a percent")));
                    }
                }
                "kind" => {
                    spec.row_range = match v {
                        "rows" => true,
                        "hashed" => false,
                        _ => {
                            return Err(bad(s, format!("kind={v}: give kind=hashed or kind=rows")))
                        }
                    }
                }
                "dense" => {
                    spec.dense_bytes =
                        parse_size(v).ok_or_else(|| bad(s, format!("dense={v} is not a size")))?
                }
                "scale" => {
                    spec.scale = v
                        .parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && *x > 0.0 && *x <= 1e6)
                        .ok_or_else(|| bad(s, format!("scale={v} is not a positive number")))?
                }
                "slots" => {
                    spec.slots = v.split('+').map(str::to_string).collect();
                    for slot in &spec.slots {
                        if !KNOWN_SLOTS.contains(&slot.as_str()) {
                            return Err(bad(
                                s,
                                format!(
                                    "unknown slot {slot:?} (known: {})",
                                    KNOWN_SLOTS.join(", ")
                                ),
                            ));
                        }
                    }
                }
                _ => return Err(bad(s, format!("unknown key {k:?}"))),
            }
        }
        if tables.is_some() || rows.is_some() {
            let n = tables.unwrap_or(spec.rows.len() as u64);
            let r = rows.unwrap_or(spec.rows.first().copied().unwrap_or(1000));
            if n > 10_000 {
                return Err(bad(s, "more than 10000 tables"));
            }
            spec.rows = vec![r; n as usize];
        }
        if spec.dim == 0 || spec.dim > 65_536 {
            return Err(bad(s, "dim must be between 1 and 65536"));
        }
        let bytes = spec.model_bytes();
        if bytes > 1 << 40 {
            return Err(bad(
                s,
                format!("the model would take {bytes} bytes of memory"),
            ));
        }
        Ok(spec)
    }
}

/// A generated model, owning its tables and dense tensors.
#[derive(Debug)]
pub struct SyntheticModel {
    /// Tables `t0`, `t1`, … (hashed ones; none for `kind=rows`).
    pub tables: Vec<EmbeddingTable>,
    /// Row-range tables `t0`, `t1`, … (`kind=rows`): per table, its rows and each slot's name,
    /// dtype, whole shape and values (row-major).
    pub row_tables: Vec<RowTableValues>,
    /// Dense tensors `dense.0`, `dense.1`, … as (name, shape, f32 little-endian bytes).
    pub dense: Vec<(String, Vec<u64>, Vec<u8>)>,
}

impl SyntheticModel {
    /// Generates the model of `spec`, in parallel.
    pub fn generate(spec: &SyntheticSpec) -> Result<Self> {
        let specs = spec.slot_specs();
        let row_tables = if spec.row_range {
            spec.table_rows()
                .into_iter()
                .enumerate()
                .map(|(t, rows)| (format!("t{t}"), rows, row_slots(&specs, rows, spec.touched)))
                .collect()
        } else {
            Vec::new()
        };
        let hashed = if spec.row_range {
            Vec::new()
        } else {
            spec.table_rows()
        };
        let tables = hashed
            .into_iter()
            .enumerate()
            .map(|(t, rows)| {
                let table = EmbeddingTable::new(format!("t{t}"), KeyDtype::I64, specs.clone())?;
                let salt = fmix64(spec.seed ^ ((t as u64 + 1) << 32));
                (0..rows).into_par_iter().for_each(|k| {
                    // fmix64 is a bijection: distinct k give distinct ids, negative ones included.
                    let id = fmix64(salt ^ k);
                    table.upsert(id, |row| {
                        for (s, slot) in specs.iter().enumerate() {
                            let h = fmix64(id ^ (s as u64 + 1));
                            if slot.dtype == Dtype::I64 {
                                row.slot_mut::<i64>(s)[0] = (h % 100) as i64;
                            } else {
                                for (i, v) in row.slot_mut::<f32>(s).iter_mut().enumerate() {
                                    *v = (fmix64(h ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32
                                        - 0.5;
                                }
                            }
                        }
                    });
                });
                Ok(table)
            })
            .collect::<Result<Vec<_>>>()?;
        let total = (spec.dense_bytes as f64 * spec.scale) as u64 / 4;
        let mut dense = Vec::new();
        // Four layers of decreasing size, like an MLP tower.
        let mut left = total;
        for (i, share) in [8u64, 4, 2, 1].iter().enumerate() {
            let n = if i == 3 { left } else { total * share / 15 };
            left -= n;
            if n == 0 {
                continue;
            }
            let bytes: Vec<u8> = (0..n)
                .flat_map(|k| {
                    ((fmix64(spec.seed ^ (i as u64) << 56 ^ k) >> 40) as f32 / 1e7).to_le_bytes()
                })
                .collect();
            dense.push((format!("dense.{i}.weight"), vec![n], bytes));
        }
        Ok(Self {
            tables,
            row_tables,
            dense,
        })
    }

    /// The row-range tables as chunks: each table's rows cut into `parts` equal row ranges
    /// (every slot alike), all of them, or only part `part` (what process `part` of a save of
    /// `parts` shards holds).
    pub fn row_chunks(
        &self,
        parts: u32,
        part: Option<u32>,
    ) -> Result<Vec<crate::RowRangeChunk<'_>>> {
        let mut out = Vec::new();
        for (name, rows, slots) in &self.row_tables {
            for shard in Shard::selected(parts, part) {
                let std::ops::Range { start: a, end: b } = shard.rows_of(*rows);
                for (slot, dtype, whole, bytes) in slots {
                    let row_bytes = bytes.len() as u64 / (*rows).max(1);
                    let mut shape = whole.clone();
                    shape[0] = b - a;
                    let mut offset = vec![0; whole.len()];
                    offset[0] = a;
                    let data = &bytes[(a * row_bytes) as usize..(b * row_bytes) as usize];
                    out.push(
                        crate::RowRangeChunk::new(name, slot, *dtype, shape, data)?
                            .at(&offset, whole)?,
                    );
                }
            }
        }
        Ok(out)
    }

    /// The model as save input.
    pub fn input(&self) -> crate::plan::SaveInput<'_> {
        let mut input = crate::plan::SaveInput::new();
        for t in &self.tables {
            input = input.table(t);
        }
        for (name, shape, bytes) in &self.dense {
            input = input.dense(
                DenseTensor::new(name.clone(), Dtype::F32, shape.clone(), bytes.as_slice())
                    .expect("sizes match"),
            );
        }
        input
    }
}

/// A row-range table of a synthetic model: name, rows, and each slot's name, dtype, whole shape
/// and values.
pub type RowTableValues = (String, u64, Vec<(String, Dtype, Vec<u64>, Vec<u8>)>);

/// The slots of a row-range table of `rows` rows: row `r`'s values are what a hashed table's
/// row of id `r` would hold.
fn row_slots(
    specs: &[SlotSpec],
    rows: u64,
    touched: u64,
) -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    specs
        .iter()
        .enumerate()
        .map(|(s, slot)| {
            let width = slot.shape.first().copied().unwrap_or(1);
            let whole = if slot.shape.is_empty() {
                vec![rows]
            } else {
                vec![rows, width]
            };
            let el = slot.dtype.bits() as usize / 8;
            let mut bytes = vec![0u8; rows as usize * width as usize * el];
            bytes
                .par_chunks_mut(width as usize * el)
                .enumerate()
                .for_each(|(r, row)| {
                    let h = fmix64(r as u64 ^ (s as u64 + 1));
                    if slot.dtype == Dtype::I64 {
                        row.copy_from_slice(&((h % 100) as i64).to_le_bytes());
                    } else {
                        for (i, v) in row.chunks_mut(4).enumerate() {
                            let x = (fmix64(h ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                            v.copy_from_slice(&x.to_le_bytes());
                        }
                    }
                    // A touched row: its first value's lowest bit flipped, in every slot.
                    if fmix64(r as u64 ^ (0x7 << 60)) % 100 < touched {
                        row[0] ^= 1;
                    }
                });
            (slot.name.clone(), slot.dtype, whole, bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::SparseTable;

    #[test]
    fn presets_and_overrides() {
        let s: SyntheticSpec = "criteo-kaggle,scale=0.001".parse().unwrap();
        assert_eq!(s.rows.len(), 26);
        assert_eq!(s.table_rows()[2], 10131);
        assert_eq!(s.dim, 16);
        let s: SyntheticSpec =
            "tables=8,rows=1000,dim=64,slots=embedding+adagrad,dense=64MiB,seed=7"
                .parse()
                .unwrap();
        assert_eq!(s.rows, vec![1000; 8]);
        assert_eq!(s.dense_bytes, 64 << 20);
        assert_eq!(s.slot_specs()[1].name, "adagrad");
        for bad in [
            "nope",
            "tables=x",
            "slots=embedding+momentum",
            "dense=3 parsecs",
            "dim=0",
            "scale=-1",
            "rows=10,foo=1",
            "",
        ] {
            let e = bad.parse::<SyntheticSpec>().unwrap_err().to_string();
            assert!(e.contains("synthetic spec"), "{bad}: {e}");
        }
        assert_eq!(parse_size("1.5KiB"), Some(1536));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn generation_is_deterministic() {
        let s: SyntheticSpec = "tiny,rows=500".parse().unwrap();
        let a = SyntheticModel::generate(&s).unwrap();
        let b = SyntheticModel::generate(&s).unwrap();
        assert_eq!(a.tables.len(), 3);
        for (x, y) in a.tables.iter().zip(&b.tables) {
            assert_eq!(x.len(), 500);
            let mut ids = x.ids();
            ids.sort_unstable();
            let mut ids2 = y.ids();
            ids2.sort_unstable();
            assert_eq!(ids, ids2);
            for &id in ids.iter().take(20) {
                assert_eq!(x.get_slot(id, 0), y.get_slot(id, 0));
            }
            assert_eq!(SparseTable::slots(x).len(), 3);
        }
        assert_eq!(a.dense, b.dense);
        assert_eq!(a.dense.iter().map(|d| d.2.len()).sum::<usize>(), 64 << 10);
    }
}

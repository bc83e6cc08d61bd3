//! What zstd does to each kind of column a checkpoint holds (issue 44): for every column, the
//! ratio of raw to stored bytes with each filter `saver_core::compress` knows, and the speed of
//! the one `choose` keeps, compressing and decompressing on one thread, at zstd level 1, in
//! frames of 256 KiB (a CRC block's size). The columns are 32 MiB each, in a segment's order:
//!
//! - ids: dense (`0..n`, as a feature's category indices), below 2^32 at random, hashed 64-bit;
//! - an fp32 embedding (small normal-like values), an Adagrad accumulator (positive, growing);
//! - optimizer rows that are mostly zero (9 rows of 10 never touched);
//! - fp32 values that are really bf16 (their low 16 bits zero).
//!
//! The last column is a plain copy of the column into fresh memory on the same thread, in the
//! same run: the scale the codec's speeds compare with.
//!
//! `cargo bench --bench column_codecs [-- --mib N]`

use std::time::Instant;

use saver::core::compress::{choose, compress, ColumnKind, Filter};
use saver::core::partition::{fmix64, PartitionRule};

/// A deterministic stream of uniform numbers in [0, 1).
struct Uniform(u64);

impl Uniform {
    fn next(&mut self) -> f64 {
        self.0 += 1;
        (fmix64(self.0) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly normal: the sum of four uniforms, centred.
    fn normal(&mut self) -> f64 {
        (self.next() + self.next() + self.next() + self.next() - 2.0) * 1.7
    }
}

fn ids_in_segment_order(mut ids: Vec<u64>) -> Vec<u8> {
    ids.sort_unstable_by_key(|&id| (PartitionRule::bucket_of(id), id));
    ids.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(n: usize, mut f: impl FnMut(usize) -> f32) -> Vec<u8> {
    (0..n).flat_map(|i| f(i).to_le_bytes()).collect()
}

fn main() {
    let mut mib = 32usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--mib" => mib = args.next().and_then(|v| v.parse().ok()).expect("--mib N"),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let bytes = mib << 20;
    let (n8, n4) = (bytes / 8, bytes / 4);
    let mut u = Uniform(7);
    let dim = 32;
    let columns: Vec<(&str, ColumnKind, Vec<u8>)> = vec![
        (
            "ids, dense",
            ColumnKind::Ids,
            ids_in_segment_order((0..n8 as u64).collect()),
        ),
        (
            "ids, below 2^32",
            ColumnKind::Ids,
            ids_in_segment_order((0..n8 as u64).map(|i| fmix64(i) >> 32).collect()),
        ),
        (
            "ids, hashed 64-bit",
            ColumnKind::Ids,
            ids_in_segment_order((0..n8 as u64).map(fmix64).collect()),
        ),
        (
            "fp32 embedding",
            ColumnKind::Values { size: 4 },
            f32s(n4, |_| (u.normal() * 0.01) as f32),
        ),
        (
            "fp32 Adagrad accumulator",
            ColumnKind::Values { size: 4 },
            f32s(n4, |_| (u.next() * u.next() * 4.0) as f32),
        ),
        (
            "fp32 rows, 9 in 10 zero",
            ColumnKind::Values { size: 4 },
            f32s(n4, |i| {
                if fmix64((i / dim) as u64).is_multiple_of(10) {
                    (u.normal() * 0.01) as f32
                } else {
                    0.0
                }
            }),
        ),
        (
            "fp32 holding bf16 values",
            ColumnKind::Values { size: 4 },
            f32s(n4, |_| {
                f32::from_bits(((u.normal() * 0.01) as f32).to_bits() & 0xffff_0000)
            }),
        ),
    ];
    println!("## Column codecs: zstd level 1, 256 KiB frames, {mib} MiB a column, one thread\n");
    println!(
        "| column | plain | shuffled | delta + shuffled | kept | compress | decompress | plain copy |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    const FRAME: usize = 256 << 10;
    for (name, kind, raw) in &columns {
        let ratio = |f: Filter| compress(raw, f, FRAME, 1).unwrap().ratio();
        let shuffled = match kind {
            ColumnKind::Ids => Filter::Shuffle(8),
            ColumnKind::Values { .. } => Filter::Shuffle(4),
        };
        let delta = match kind {
            ColumnKind::Ids => format!("{:.2}", ratio(Filter::Delta8)),
            ColumnKind::Values { .. } => "—".into(),
        };
        let start = Instant::now();
        let kept = choose(raw, *kind, FRAME, 1).unwrap();
        let chose = start.elapsed().as_secs_f64();
        let (kept_s, comp, decomp) = match &kept {
            Some(c) => {
                let start = Instant::now();
                let again = compress(raw, c.filter, FRAME, 1).unwrap();
                let comp = start.elapsed().as_secs_f64();
                let start = Instant::now();
                let back = again.decompress().unwrap();
                let decomp = start.elapsed().as_secs_f64();
                assert_eq!(&back, raw);
                (
                    format!("{} {:.2}×", c.filter.name(), c.ratio()),
                    format!("{:.0} MB/s", raw.len() as f64 / comp / 1e6),
                    format!("{:.0} MB/s", raw.len() as f64 / decomp / 1e6),
                )
            }
            None => (
                "raw".into(),
                format!("(tried in {:.2} s)", chose),
                "—".into(),
            ),
        };
        // The scale: a plain copy of the same bytes, in the same run.
        let mut copy = vec![0u8; raw.len()];
        let start = Instant::now();
        copy.copy_from_slice(raw);
        let copied = start.elapsed().as_secs_f64();
        assert_eq!(copy.len(), raw.len());
        println!(
            "| {name} | {:.2} | {:.2} | {delta} | {kept_s} | {comp} | {decomp} | {:.0} MB/s |",
            ratio(Filter::Plain),
            ratio(shuffled),
            raw.len() as f64 / copied / 1e6,
        );
    }
}

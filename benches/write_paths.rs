//! Ways to write rows scattered over the heap to a file, for choosing the writer's next step.
//!
//! `cargo bench --bench write_paths -- [rows]` (default 16 M rows of 136 bytes, as criteo ×0.5):
//! the two 64-byte slots of every row, in an order random with respect to memory (as bucket order
//! is), written slot tensor by slot tensor, one thread, three rounds each, interleaved:
//! - `gather`: copy rows into an 8 MiB buffer, `pwrite` it (what saver's writer does);
//! - `pwritev`: no buffer, one 64-byte iovec per row, 1024 per call;
//! - `gather + fsync` and `O_DIRECT gather + fsync`: the durable case, through the page cache and
//!   around it.

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;

const SLOT: usize = 64;
const ROW: usize = 136;
const CHUNK: usize = 8 << 20;

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Gather,
    Pwritev,
    GatherFsync,
    DirectFsync,
}

/// An 8 MiB buffer aligned for `O_DIRECT`.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new() -> Self {
        let layout = std::alloc::Layout::from_size_align(CHUNK, 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Self { ptr, layout }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds CHUNK zero-initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, CHUNK) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

fn write(path: Path, file: &File, rows: &[&[u8]]) {
    let per_chunk = CHUNK / SLOT;
    let slot_len = (rows.len() * SLOT) as u64;
    let mut buf = Aligned::new();
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(1024);
    for slot in 0..2 {
        let mut at = slot as u64 * slot_len;
        if path == Path::Pwritev {
            for c in rows.chunks(1024) {
                iov.clear();
                iov.extend(c.iter().map(|r| libc::iovec {
                    iov_base: r[slot * SLOT..].as_ptr() as *mut _,
                    iov_len: SLOT,
                }));
                // SAFETY: every iovec points into a live row of SLOT bytes.
                let n = unsafe {
                    libc::pwritev(file.as_raw_fd(), iov.as_ptr(), iov.len() as i32, at as i64)
                };
                assert_eq!(n as usize, c.len() * SLOT, "short pwritev");
                at += n as u64;
            }
            continue;
        }
        for c in rows.chunks(per_chunk) {
            let bytes = buf.bytes();
            for (k, r) in c.iter().enumerate() {
                bytes[k * SLOT..(k + 1) * SLOT].copy_from_slice(&r[slot * SLOT..(slot + 1) * SLOT]);
            }
            // O_DIRECT needs 4 KiB multiples: every chunk but the last is; pad the last.
            let len = (c.len() * SLOT).next_multiple_of(4096);
            file.write_all_at(&bytes[..len], at).unwrap();
            at += (c.len() * SLOT) as u64;
        }
    }
    if matches!(path, Path::GatherFsync | Path::DirectFsync) {
        file.sync_all().unwrap();
    }
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(16_000_000);
    let heap: Vec<Box<[u8]>> = (0..n)
        .map(|i| vec![(i % 251) as u8; ROW].into_boxed_slice())
        .collect();
    // Bucket order is random with respect to where rows live.
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let rows: Vec<&[u8]> = order.iter().map(|&i| &heap[i][..]).collect();
    let out = common::scratch().join("write_paths.bin");
    let paths = [
        ("gather (no fsync)", Path::Gather),
        ("pwritev, 64-byte iovecs (no fsync)", Path::Pwritev),
        ("gather + fsync", Path::GatherFsync),
        ("O_DIRECT gather + fsync", Path::DirectFsync),
    ];
    let mut times = vec![Vec::new(); paths.len()];
    for _round in 0..3 {
        for (i, &(_, path)) in paths.iter().enumerate() {
            let _ = std::fs::remove_file(&out);
            // SAFETY: sync(2) has no preconditions.
            unsafe { libc::sync() };
            let mut o = OpenOptions::new();
            o.write(true).create(true).truncate(true);
            if path == Path::DirectFsync {
                o.custom_flags(libc::O_DIRECT);
            }
            let file = o.open(&out).unwrap();
            let t = Instant::now();
            write(path, &file, &rows);
            times[i].push(t.elapsed().as_secs_f64());
        }
    }
    let _ = std::fs::remove_file(&out);
    let gib = (n * 2 * SLOT) as f64 / (1u64 << 30) as f64;
    println!("| write path, {n} rows, {gib:.2} GiB | rounds (s) | median |\n| --- | --- | --- |");
    for ((name, _), mut t) in paths.iter().zip(times) {
        let rounds = t
            .iter()
            .map(|s| format!("{s:.2}"))
            .collect::<Vec<_>>()
            .join(" / ");
        t.sort_by(f64::total_cmp);
        println!(
            "| {name} | {rounds} | {:.2} s ({:.2} GiB/s) |",
            t[1],
            gib / t[1]
        );
    }
}

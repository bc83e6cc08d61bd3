//! Limit row of the comparison harness: the least work any *owning* load does, reading the
//! checkpoint's files into new memory. The arrays a load returns are memory the process did not
//! have, so the kernel must map (and zero) every page of them before the bytes land; a plain read
//! into a reused buffer skips that and is no bound for such a load. Two threads, as saver's
//! `load --parallel 2` uses, each reading every other 8 MiB piece of every file, each piece's
//! pages faulted in by one system call first (`MADV_POPULATE_WRITE`, the cheapest way the
//! kernel offers, and what saver's loads do); no checksum, no parsing.
//!
//! `cargo bench --bench read_fresh -- FILE...` prints `{"seconds": ...}`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

/// Bytes one read fills: saver's default chunk.
const PIECE: usize = 8 << 20;

fn main() {
    let files: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let opened: Vec<File> = files.iter().map(|f| File::open(f).unwrap()).collect();
    // Fresh anonymous mappings, which the kernel has not populated yet. Page-aligned like the
    // page cache: with every destination 8 or 16 bytes past the source's offset in its 4 KiB
    // page (as malloc's 16-byte header puts large blocks) this copy took nearly twice as long
    // here, a store-to-load aliasing stall that tensors at offsets spread at random, as a
    // load's are, almost never meet.
    let mut buffers: Vec<memmap2::MmapMut> = opened
        .iter()
        .map(|f| memmap2::MmapMut::map_anon(f.metadata().unwrap().len().max(1) as usize).unwrap())
        .collect();
    let t = Instant::now();
    // Every piece of every file, with its file and offset, dealt to the threads in turn.
    let mut pieces: [Vec<(&File, u64, &mut [u8])>; 2] = [Vec::new(), Vec::new()];
    let mut k = 0;
    for (file, buf) in opened.iter().zip(buffers.iter_mut()) {
        for (i, piece) in buf.chunks_mut(PIECE).enumerate() {
            pieces[k % 2].push((file, (i * PIECE) as u64, piece));
            k += 1;
        }
    }
    std::thread::scope(|s| {
        for list in pieces {
            s.spawn(move || {
                for (file, offset, piece) in list {
                    populate(piece);
                    file.read_exact_at(piece, offset).unwrap();
                }
            });
        }
    });
    let seconds = t.elapsed().as_secs_f64();
    std::hint::black_box(&buffers);
    println!("{{\"seconds\": {seconds}}}");
}

/// Faults in the whole pages of `buf` at once (Linux 5.14+; a hint, ignored where refused).
fn populate(buf: &mut [u8]) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let start = (buf.as_ptr() as usize).div_ceil(4096) * 4096;
    let end = (buf.as_ptr() as usize + buf.len()) / 4096 * 4096;
    if end > start {
        // SAFETY: the range lies inside `buf`, held mutably; populating keeps its contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, MADV_POPULATE_WRITE) };
    }
}

//! Peer row of the comparison harness: the reference Rust `safetensors::serialize_to_file` writing
//! the tensors of a plain safetensors directory (as `saver export` wrote it), with fsync.
//!
//! `cargo bench --bench st_serialize -- PLAIN_DIR OUT_FILE` prints `{"seconds": ...}`: the time of
//! serialize_to_file plus fsync, with the tensors already in memory.

use std::time::Instant;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn main() {
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let (src, out) = (&args[1], &args[2]);
    let mut files: Vec<_> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let buffers: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let parsed: Vec<SafeTensors<'_>> = buffers
        .iter()
        .map(|b| SafeTensors::deserialize(b).unwrap())
        .collect();
    let views: Vec<(String, TensorView<'_>)> = parsed
        .iter()
        .flat_map(|st| st.tensors())
        .map(|(n, v)| {
            (
                n,
                TensorView::new(v.dtype(), v.shape().to_vec(), v.data()).unwrap(),
            )
        })
        .collect();
    let t = Instant::now();
    safetensors::serialize_to_file(views, None, std::path::Path::new(out)).unwrap();
    std::fs::File::open(out).unwrap().sync_all().unwrap();
    println!("{{\"seconds\": {}}}", t.elapsed().as_secs_f64());
}

//! Writes the seeds of `migration_stream` into
//! `fuzz/seeds/migration_stream/`: whole streams the destination takes (the
//! handshake, two memory batches, and as the state image each
//! `snapshot_reader` seed that is a state of the target's destination),
//! each checked through `tandem_fuzz::stream::receive` before it is
//! written, and the first one cut after its Config; and those of
//! `colo_checkpoint` into `fuzz/seeds/colo_checkpoint/`: the same batches
//! and state images as checkpoints (and the first without its commit),
//! each checked through `tandem_fuzz::checkpoint::receive`; and those of
//! `migration_streams` into `fuzz/seeds/migration_streams/`: the same
//! batches and images over three streams, each checked through
//! `tandem_fuzz::stream::receive_streams`.
//!
//!     cd fuzz && cargo run --example make_stream_seeds

use std::fs;
use std::path::Path;

use migration::format::MAGIC;
use tandem_fuzz::checkpoint::{self, checkpoint};
use tandem_fuzz::stream::{batches, receive, receive_streams, stream, three_streams};

fn main() {
    let out = Path::new("seeds/migration_stream");
    fs::create_dir_all(out).expect("create the seed directory");
    let mut n = 0;
    let mut entries: Vec<_> = fs::read_dir("seeds/snapshot_reader")
        .expect("snapshot_reader seeds (run make_seeds first)")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let image = fs::read(&path).expect("read a seed");
        if !image.starts_with(&MAGIC) {
            continue;
        }
        let s = stream(&batches(), image.clone());
        if receive(&s).is_err() {
            continue;
        }
        if n == 0 {
            // Hello and Config only: the stream ends before any memory.
            let cut = 4 + 1 + 12 + 4;
            let cut =
                cut + 5 + u32::from_le_bytes(s[cut..cut + 4].try_into().unwrap()) as usize + 4;
            fs::write(out.join("cut-after-config"), &s[..cut]).expect("write a seed");
        }
        fs::write(out.join(format!("stream-{n}")), &s).expect("write a seed");
        let multi = three_streams(image.clone());
        assert_eq!(
            receive_streams(&multi),
            Ok(18),
            "a whole three-stream migration is taken"
        );
        let streams = Path::new("seeds/migration_streams");
        fs::create_dir_all(streams).expect("create the seed directory");
        fs::write(streams.join(format!("three-{n}")), &multi).expect("write a seed");
        let c = checkpoint(&batches(), image.clone());
        checkpoint::receive(&c).expect("a whole checkpoint is taken");
        let colo = Path::new("seeds/colo_checkpoint");
        fs::create_dir_all(colo).expect("create the seed directory");
        if n == 0 {
            fs::write(colo.join("no-commit"), &c[..c.len() - 9]).expect("write a seed");
        }
        fs::write(colo.join(format!("checkpoint-{n}")), &c).expect("write a seed");
        n += 1;
    }
    assert!(
        n > 0,
        "no snapshot_reader seed is a state of the destination"
    );
    println!("{n} streams in {}", out.display());
}

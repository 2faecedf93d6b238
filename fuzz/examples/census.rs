//! How far the inputs of a `snapshot_reader` corpus get along the restore
//! path: runs each file (both forms, see the target) through
//! `tandem_fuzz::restore` and counts the outcomes, digits left out so that
//! like refusals count together:
//!
//!     cd fuzz && cargo run --example census -- <corpus directory>

use std::collections::BTreeMap;

use migration::format::MAGIC;
use tandem_fuzz::restore::{assemble, resealed, restore};

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: census <corpus directory>");
        std::process::exit(2);
    };
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("read the corpus directory") {
        let bytes = std::fs::read(entry.expect("a corpus entry").path()).expect("read an input");
        let forms = if bytes.starts_with(&MAGIC) {
            vec![
                ("file", Some(bytes.clone())),
                ("resealed", resealed(&bytes)),
            ]
        } else {
            vec![("sections", Some(assemble(&bytes)))]
        };
        for (form, input) in forms {
            let Some(input) = input else { continue };
            let outcome = match restore(&input) {
                Ok(r) => format!("restored, {} devices, {} pages", r.devices, r.pages),
                Err(e) => e.chars().filter(|c| !c.is_ascii_digit()).take(90).collect(),
            };
            *outcomes.entry(format!("{form}: {outcome}")).or_default() += 1;
        }
    }
    let mut sorted: Vec<_> = outcomes.into_iter().collect();
    sorted.sort_by_key(|e| std::cmp::Reverse(e.1));
    for (outcome, n) in sorted {
        println!("{n:6} {outcome}");
    }
}

//! Turns the raw samples of a profile into what a user reads: folded stacks
//! (`root;...;leaf COUNT` lines, the input of flamegraph tools) and a table
//! of the functions that took the most samples. Pure logic, run on the VMM
//! thread when a profile ends.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::symbols::Symbols;
use super::USER_FRAME;

/// The name of user-mode samples (one frame: tandem does not unwind user code).
pub const USER_NAME: &str = "[user]";

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub function: String,
    /// Samples with this function as the leaf.
    pub self_samples: u64,
    pub self_pct: f64,
    /// Samples with this function anywhere in the chain.
    pub total_samples: u64,
    pub total_pct: f64,
}

/// Names one address: its function, or the address in hex. Return
/// addresses (`leaf == false`) are looked up one byte back, so that a call
/// at the very end of a function is named after that function.
fn name(symbols: Option<&Symbols>, addr: u64, leaf: bool) -> String {
    if addr == USER_FRAME {
        return USER_NAME.into();
    }
    let at = if leaf { addr } else { addr.wrapping_sub(1) };
    match symbols.and_then(|s| s.lookup(at)) {
        Some(n) => n.to_string(),
        None => format!("{addr:#x}"),
    }
}

/// Symbolized stacks, root first, with their sample counts.
pub fn symbolize(
    stacks: &HashMap<Box<[u64]>, u64>,
    symbols: Option<&Symbols>,
) -> Vec<(Vec<String>, u64)> {
    // Stacks that differ only in addresses within one function merge.
    let mut merged: HashMap<Vec<String>, u64> = HashMap::new();
    for (chain, n) in stacks {
        let names: Vec<String> = chain
            .iter()
            .enumerate()
            .rev()
            .map(|(i, a)| name(symbols, *a, i == 0))
            .collect();
        *merged.entry(names).or_default() += n;
    }
    let mut out: Vec<(Vec<String>, u64)> = merged.into_iter().collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// The folded-stacks text: one `root;...;leaf COUNT` line per stack.
pub fn folded(stacks: &[(Vec<String>, u64)]) -> String {
    let mut s = String::new();
    for (names, n) in stacks {
        let _ = writeln!(s, "{} {n}", names.join(";"));
    }
    s
}

/// The `top` functions by self samples (then by total samples).
pub fn table(stacks: &[(Vec<String>, u64)], top: usize) -> Vec<Row> {
    let all: u64 = stacks.iter().map(|s| s.1).sum();
    let mut own: HashMap<&str, u64> = HashMap::new();
    let mut total: HashMap<&str, u64> = HashMap::new();
    for (names, n) in stacks {
        if let Some(leaf) = names.last() {
            *own.entry(leaf).or_default() += n;
        }
        let mut seen: Vec<&str> = Vec::with_capacity(names.len());
        for f in names {
            if !seen.contains(&f.as_str()) {
                seen.push(f);
                *total.entry(f).or_default() += n;
            }
        }
    }
    let pct = |x: u64| {
        if all == 0 {
            0.0
        } else {
            100.0 * x as f64 / all as f64
        }
    };
    let mut rows: Vec<Row> = total
        .iter()
        .map(|(f, t)| {
            let s = own.get(f).copied().unwrap_or(0);
            Row {
                function: f.to_string(),
                self_samples: s,
                self_pct: pct(s),
                total_samples: *t,
                total_pct: pct(*t),
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        (b.self_samples, b.total_samples, &a.function).cmp(&(
            a.self_samples,
            a.total_samples,
            &b.function,
        ))
    });
    rows.truncate(top);
    rows
}

/// The table as text, for a terminal.
pub fn table_text(rows: &[Row]) -> String {
    let mut s = format!(
        "{:>4} {:>7} {:>8} {:>7} {:>8}  function\n",
        "rank", "self%", "self", "total%", "total"
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "{:>4} {:>6.2}% {:>8} {:>6.2}% {:>8}  {}",
            i + 1,
            r.self_pct,
            r.self_samples,
            r.total_pct,
            r.total_samples,
            r.function
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stacks() -> HashMap<Box<[u64]>, u64> {
        let mut m: HashMap<Box<[u64]>, u64> = HashMap::new();
        // leaf first: a <- b <- c, twice at two addresses inside `a`.
        m.insert(vec![0x1001, 0x2005, 0x3005].into(), 5);
        m.insert(vec![0x1002, 0x2005, 0x3005].into(), 3);
        m.insert(vec![0x2001, 0x3005].into(), 2);
        m.insert(vec![USER_FRAME].into(), 10);
        m.insert(vec![0x9999].into(), 1);
        m
    }

    fn syms() -> Symbols {
        Symbols::from_system_map("1000 T func_a\n2000 T func_b\n3000 T func_c\n4000 T end_marker\n")
    }

    #[test]
    fn folds_root_first_and_merges_one_function() {
        let s = symbolize(&stacks(), Some(&syms()));
        let text = folded(&s);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "[user] 10");
        assert!(lines.contains(&"func_c;func_b;func_a 8"), "{text}");
        assert!(lines.contains(&"func_c;func_b 2"), "{text}");
        // 0x9999 lies within 1 MiB past the last symbol: named after it.
        assert!(lines.contains(&"end_marker 1"), "{text}");
    }

    #[test]
    fn unknown_addresses_stay_hex_and_return_addresses_look_back() {
        let s = symbolize(&stacks(), None);
        assert!(folded(&s).contains("0x3005;0x2005;0x1001 5"));
        // A return address right at the start of the next function belongs
        // to the caller.
        let mut m: HashMap<Box<[u64]>, u64> = HashMap::new();
        m.insert(vec![0x1001, 0x2000].into(), 1);
        let s = symbolize(&m, Some(&syms()));
        assert_eq!(folded(&s), "func_a;func_a 1\n");
    }

    #[test]
    fn the_table_ranks_by_self_then_total() {
        let s = symbolize(&stacks(), Some(&syms()));
        let rows = table(&s, 30);
        assert_eq!(rows[0].function, USER_NAME);
        assert_eq!(rows[0].self_samples, 10);
        assert_eq!(rows[1].function, "func_a");
        assert_eq!((rows[1].self_samples, rows[1].total_samples), (8, 8));
        let b = rows.iter().find(|r| r.function == "func_b").unwrap();
        assert_eq!((b.self_samples, b.total_samples), (2, 10));
        let c = rows.iter().find(|r| r.function == "func_c").unwrap();
        assert_eq!((c.self_samples, c.total_samples), (0, 10));
        assert!((rows[0].self_pct - 100.0 * 10.0 / 21.0).abs() < 1e-9);
        assert_eq!(table(&s, 2).len(), 2);
        assert!(table_text(&rows).contains("func_a"));
    }

    #[test]
    fn recursion_counts_once_in_total() {
        let mut m: HashMap<Box<[u64]>, u64> = HashMap::new();
        m.insert(vec![0x1001, 0x1005, 0x1009].into(), 4);
        let s = symbolize(&m, Some(&syms()));
        let rows = table(&s, 30);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].self_samples, rows[0].total_samples), (4, 4));
    }
}

//! The layering rule of `vmm` (issue 33), checked on its sources:
//!
//! 1. the VM core (vCPUs, memory and state, device wiring, the device
//!    thread, snapshot, `vm.rs`, configuration, boot, host emulation, the
//!    profiler, pause and KVM helpers, the console) names no module above
//!    it: not `streams`, `migrate`, `colo`, the API (`api`, `control`), the
//!    CLI (`cli`), `builder` or `vm_loop`;
//! 2. the top-level modules of `vmm` import each other without a circle.
//!
//! Paths are read from the text: `crate::a::…` anywhere (a `use` line, an
//! inline path, a doc link), the items of a `use crate::{a, b::c}` group
//! (nested and across lines), and `super::super::…` escapes that climb to
//! the crate root. Runs as an ordinary `cargo test -p vmm`; reads files
//! only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The core: folders and files under `vmm/src`.
const CORE: &[&str] = &[
    "vstate",
    "device_manager",
    "device_manager.rs",
    "device_thread",
    "snapshot",
    "vm.rs",
    "config.rs",
    "boot",
    "host_emu",
    "profile",
    "pause.rs",
    "kvm_util.rs",
    "sandbox",
    "console.rs",
];

/// What the core must not name.
const ABOVE_CORE: &[&str] = &[
    "streams", "migrate", "colo", "api", "control", "cli", "builder", "vm_loop",
];

/// The module(s) named right after a path's root at `at` (one name, or
/// each head of a `{…}` group), each with its line; a single name is
/// placed on the line of the path's start `from`.
fn heads_at(text: &str, at: usize, from: usize, found: &mut Vec<(usize, String)>) {
    let line_of = |i: usize| text[..i].matches('\n').count() + 1;
    if text[at..].starts_with('{') {
        for (off, name) in group_heads(&text[at..]) {
            found.push((line_of(at + off), name));
        }
    } else if let Some(name) = ident_at(&text[at..]) {
        found.push((line_of(from), name));
    }
}

/// Top-level modules that `path` (a file's text) names, with the line of
/// each mention. `depth`: how deep the file's module is (`a.rs` and
/// `a/mod.rs`: 1, `a/b.rs`: 2), for `super::` escapes.
fn named_modules(text: &str, depth: usize) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let prev_ok = i == 0 || !is_ident(bytes[i - 1]) && bytes[i - 1] != b':';
        if prev_ok && rest.starts_with("crate::") {
            let after = i + "crate::".len();
            heads_at(text, after, i, &mut found);
            i = after;
            continue;
        }
        if prev_ok && rest.starts_with("super::") {
            let mut k = 0;
            let mut at = i;
            while text[at..].starts_with("super::") {
                k += 1;
                at += "super::".len();
            }
            // From a file's module, `depth` supers reach the crate root.
            if k >= depth {
                heads_at(text, at, i, &mut found);
            }
            i = at;
            continue;
        }
        i += rest.chars().next().map_or(1, char::len_utf8);
    }
    found
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The identifier at the start of `s`, if any.
fn ident_at(s: &str) -> Option<String> {
    let n = s.bytes().take_while(|&b| is_ident(b)).count();
    (n > 0).then(|| s[..n].to_string())
}

/// The first identifier of each item of the `{…}` group at the start of
/// `s` (nested groups skipped), with its offset in `s`.
fn group_heads(s: &str) -> Vec<(usize, String)> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut want = true;
    let mut i = 0;
    let bytes = s.as_bytes();
    while i < s.len() {
        match bytes[i] {
            b'{' => {
                depth += 1;
                want = depth == 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => want = true,
            b if want && depth == 1 && is_ident(b) => {
                if let Some(name) = ident_at(&s[i..]) {
                    i += name.len();
                    if name != "self" {
                        heads.push((i - name.len(), name));
                    }
                    want = false;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    heads
}

/// A circle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|s| s == m).unwrap_or(0);
                    let mut c = stack[from..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(m, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, graph, &mut state, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// A file of `vmm/src` (relative path): its top-level module and depth;
/// `None` for the crate roots.
fn module_of(rel: &str) -> Option<(String, usize)> {
    if rel == "lib.rs" || rel == "main.rs" {
        return None;
    }
    let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
    let depth = if parts.last() == Some(&"mod") {
        parts.len() - 1
    } else {
        parts.len()
    };
    Some((parts[0].to_string(), depth))
}

fn is_core(rel: &str) -> bool {
    CORE.iter()
        .any(|c| rel == *c || rel.starts_with(&format!("{c}/")))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn the_core_names_no_module_above_it() {
    let root = src();
    let mut bad = Vec::new();
    let mut read = 0;
    for path in rust_files(&root) {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .to_string();
        if !is_core(&rel) {
            continue;
        }
        let Some((_, depth)) = module_of(&rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&path).unwrap();
        read += 1;
        for (line, name) in named_modules(&text, depth) {
            if ABOVE_CORE.contains(&name.as_str()) {
                bad.push(format!("vmm/src/{rel}:{line}: names crate::{name}"));
            }
        }
    }
    assert!(
        read > 20,
        "only {read} core files found under {}",
        root.display()
    );
    assert!(
        bad.is_empty(),
        "the VM core imports a layer above it:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_top_level_modules_form_no_circle() {
    let root = src();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut lines: BTreeMap<(String, String), String> = BTreeMap::new();
    for path in rust_files(&root) {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .to_string();
        let Some((module, depth)) = module_of(&rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&path).unwrap();
        graph.entry(module.clone()).or_default();
        for (line, name) in named_modules(&text, depth) {
            if name != module {
                lines
                    .entry((module.clone(), name.clone()))
                    .or_insert_with(|| format!("vmm/src/{rel}:{line}"));
                graph.entry(module.clone()).or_default().insert(name);
            }
        }
    }
    assert!(graph.len() > 15, "only {} modules found", graph.len());
    if let Some(c) = find_cycle(&graph) {
        let at: Vec<String> = c
            .windows(2)
            .map(|w| {
                let (a, b) = (&w[0], &w[1]);
                let at = lines
                    .get(&(a.clone(), b.clone()))
                    .cloned()
                    .unwrap_or_default();
                format!("{a} -> {b} ({at})")
            })
            .collect();
        panic!("an import circle between vmm's modules:\n{}", at.join("\n"));
    }
}

#[test]
fn the_reader_finds_paths_groups_and_escapes() {
    let text = "\
//! A doc link to [`crate::builder::build`].
use crate::vm::VmHandle;
use crate::{
    config::{self, VmConfig},
    colo::Side, self,
};
fn f() { let _ = crate::migrate::Params::default(); }
use super::super::api::Control;
use super::sibling::Thing;
fn g() { notcrate::x(); my_crate::y(); }
";
    let got = named_modules(text, 2);
    let names: Vec<(usize, &str)> = got.iter().map(|(l, n)| (*l, n.as_str())).collect();
    assert_eq!(
        names,
        vec![
            (1, "builder"),
            (2, "vm"),
            (4, "config"),
            (5, "colo"),
            (7, "migrate"),
            (8, "api"),
        ]
    );
    // One `super::` from a depth-2 file stays inside its folder.
    assert!(named_modules("use super::x;", 2).is_empty());
    assert_eq!(
        named_modules("use super::x;", 1),
        vec![(1, "x".to_string())]
    );
}

#[test]
fn the_circle_finder_finds_a_circle_and_only_one() {
    let g = |edges: &[(&str, &str)]| {
        let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            m.entry(a.to_string()).or_default().insert(b.to_string());
            m.entry(b.to_string()).or_default();
        }
        m
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    let c = find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]));
    assert_eq!(c.map(|c| c.len()), Some(4));
    assert!(find_cycle(&g(&[("x", "y"), ("y", "x")])).is_some());
}

#[test]
fn the_layers_are_told_apart() {
    assert!(is_core("vstate/vcpu.rs"));
    assert!(is_core("vm.rs"));
    assert!(!is_core("vm_loop.rs"));
    assert!(!is_core("vmx.rs"));
    assert_eq!(module_of("cli/probe/plot.rs"), Some(("cli".into(), 3)));
    assert_eq!(module_of("colo/mod.rs"), Some(("colo".into(), 1)));
    assert_eq!(
        module_of("device_manager/disks.rs"),
        Some(("device_manager".into(), 2))
    );
    assert_eq!(module_of("lib.rs"), None);
}

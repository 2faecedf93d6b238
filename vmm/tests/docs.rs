//! Keeps the documentation honest: every option and verb that `tandem
//! --help` lists, and every control API `cmd`, appears on its docs page
//! (`docs/cli.md`, `docs/api.md`), so a new option or verb without
//! documentation fails CI. Runs the built binary's `--help`; no guest.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn page(name: &str) -> String {
    let path = repo().join("docs").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .arg("--help")
        .output()
        .expect("run tandem --help");
    assert!(out.status.success(), "tandem {args:?} --help failed");
    String::from_utf8(out.stdout).expect("--help is UTF-8")
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// Whether `text` has `word` with no word character on either side.
fn has_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// The `--long` options a clap help text lists (its option lines).
fn options(help: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in help.lines() {
        let line = line.trim_start();
        let line = match line.strip_prefix('-') {
            Some(rest) if !rest.starts_with('-') => match line.split_once(", ") {
                Some((_, long)) => long,
                None => continue,
            },
            _ => line,
        };
        if let Some(rest) = line.strip_prefix("--") {
            let name: String = rest.chars().take_while(|&c| is_word(c)).collect();
            if !name.is_empty() && name != "help" && name != "version" {
                found.push(format!("--{name}"));
            }
        }
    }
    found
}

/// The subcommands a clap help text lists under "Commands:".
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn the_help_parsers_find_what_they_should() {
    let h = "Usage: x\n\nCommands:\n  pause   Stop\n  colo-start  Go\n  help  Print\n\n\
             Options:\n  -m, --mem <SIZE>  Memory\n      --api-sock <PATH>  Socket\n  -h, --help\n";
    assert_eq!(commands(h), ["pause", "colo-start"]);
    assert_eq!(options(h), ["--mem", "--api-sock"]);
    assert!(has_word("give `--mem 1G`", "--mem"));
    assert!(!has_word("give `--memory`", "--mem"));
}

#[test]
fn every_run_and_ctl_option_and_verb_is_in_docs_cli() {
    let doc = page("cli.md");
    let mut missing = Vec::new();
    let top = help(&[]);
    let mut seen = 0;
    for sub in commands(&top) {
        seen += 1;
        if !has_word(&doc, &sub) {
            missing.push(format!("tandem {sub}"));
        }
        let h = help(&[&sub]);
        for opt in options(&h) {
            seen += 1;
            if !has_word(&doc, &opt) {
                missing.push(format!("tandem {sub} {opt}"));
            }
        }
        for verb in commands(&h) {
            seen += 1;
            if !has_word(&doc, &verb) {
                missing.push(format!("tandem {sub} {verb}"));
            }
            for opt in options(&help(&[&sub, &verb])) {
                seen += 1;
                if !has_word(&doc, &opt) {
                    missing.push(format!("tandem {sub} {verb} {opt}"));
                }
            }
        }
    }
    assert!(
        seen > 40,
        "only {seen} options and verbs found in --help: the parser is broken"
    );
    assert!(missing.is_empty(), "not in docs/cli.md: {missing:?}");
}

#[test]
fn every_api_cmd_is_in_docs_api() {
    // serde names every variant it knows when it meets an unknown one.
    let err = vmm::api::Request::parse(br#"{"cmd":"no-such-verb"}"#)
        .expect_err("an unknown cmd is refused")
        .to_string();
    let (_, expected) = err
        .split_once("expected one of ")
        .unwrap_or_else(|| panic!("serde's error names no variants: {err}"));
    let cmds: Vec<&str> = expected
        .split('`')
        .enumerate()
        .filter_map(|(i, s)| (i % 2 == 1).then_some(s))
        .collect();
    assert!(cmds.len() > 15 && cmds.contains(&"colo_status"), "{cmds:?}");
    let doc = page("api.md");
    let missing: Vec<_> = cmds
        .iter()
        .filter(|c| !doc.contains(&format!("`{c}`")))
        .collect();
    assert!(missing.is_empty(), "not in docs/api.md: {missing:?}");
}

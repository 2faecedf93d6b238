//! The guest kernel's function symbols, for naming sampled addresses: read
//! from an ELF `vmlinux` (its symbol table, through the `object` crate) or
//! from a `System.map` (`ADDRESS TYPE NAME` lines, text symbols only).
//!
//! Both files are user input: a file that is neither, or holds no text
//! symbol, is a one-line error. Runs on the VMM thread when a profile is
//! written; never on a vCPU thread.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSymbol, SectionKind, SymbolKind};

/// Symbol file errors.
#[derive(Debug, thiserror::Error)]
pub enum SymbolsError {
    #[error("cannot read guest symbols from {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("{path}: not an ELF file with a symbol table ({err}) nor a System.map")]
    Format { path: PathBuf, err: String },
    #[error("{0}: no function symbols in it")]
    Empty(PathBuf),
}

/// A sorted table of text symbols.
#[derive(Debug, Default)]
pub struct Symbols {
    /// (start address, size or 0 when unknown, name), sorted by address.
    entries: Vec<(u64, u64, String)>,
}

impl Symbols {
    /// Loads the symbols of `path`, an ELF vmlinux or a System.map.
    pub fn load(path: &Path) -> Result<Symbols, SymbolsError> {
        let data = std::fs::read(path).map_err(|err| SymbolsError::Read {
            path: path.to_path_buf(),
            err,
        })?;
        let syms = if data.starts_with(b"\x7fELF") {
            Symbols::from_elf(&data).map_err(|err| SymbolsError::Format {
                path: path.to_path_buf(),
                err,
            })?
        } else {
            Symbols::from_system_map(&String::from_utf8_lossy(&data))
        };
        if syms.entries.is_empty() {
            return Err(SymbolsError::Empty(path.to_path_buf()));
        }
        Ok(syms)
    }

    /// Text symbols from an ELF file's symbol table: functions, and the
    /// untyped labels of assembly code (the kernel's entry code) in
    /// executable sections.
    pub fn from_elf(data: &[u8]) -> Result<Symbols, String> {
        let file = object::File::parse(data).map_err(|e| e.to_string())?;
        let in_text = |s: &object::Symbol| {
            s.section_index()
                .and_then(|i| file.section_by_index(i).ok())
                .is_some_and(|sec| sec.kind() == SectionKind::Text)
        };
        let entries = file
            .symbols()
            .filter(|s| s.address() != 0 && !s.is_undefined())
            .filter(|s| match s.kind() {
                SymbolKind::Text => true,
                SymbolKind::Unknown => in_text(s),
                _ => false,
            })
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .filter(|(_, _, name)| !name.is_empty())
            .collect();
        Ok(Symbols::sorted(entries))
    }

    /// Text symbols (`t`, `T`, `w`, `W`) from a System.map; other lines are
    /// skipped.
    pub fn from_system_map(text: &str) -> Symbols {
        let entries = text
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let addr = u64::from_str_radix(f.next()?, 16).ok()?;
                let kind = f.next()?;
                let name = f.next()?;
                matches!(kind, "t" | "T" | "w" | "W").then(|| (addr, 0, name.to_string()))
            })
            .collect();
        Symbols::sorted(entries)
    }

    fn sorted(mut entries: Vec<(u64, u64, String)>) -> Symbols {
        entries.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.2.cmp(&b.2)));
        entries.dedup_by_key(|e| e.0);
        Symbols { entries }
    }

    /// Whether the table has no symbol.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The function holding `addr`: the last symbol at or below it, unless
    /// its size is known and `addr` lies beyond it, or it is the last
    /// symbol and `addr` is more than 1 MiB past it.
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self
            .entries
            .partition_point(|e| e.0 <= addr)
            .checked_sub(1)?;
        let (start, size, name) = &self.entries[i];
        let beyond_size = *size != 0 && addr - start >= *size;
        let beyond_end = i + 1 == self.entries.len() && addr - start > 1 << 20;
        (!beyond_size && !beyond_end).then_some(name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_map_text_symbols_name_addresses() {
        let map = "ffffffff81000000 T _stext\n\
                   ffffffff81000100 t helper\n\
                   ffffffff81000200 D some_data\n\
                   ffffffff81000300 W weak_fn\n\
                   garbage line\n\
                   zzzz T bad_address\n";
        let s = Symbols::from_system_map(map);
        assert_eq!(s.lookup(0xffffffff81000000), Some("_stext"));
        assert_eq!(s.lookup(0xffffffff810000ff), Some("_stext"));
        assert_eq!(s.lookup(0xffffffff81000250), Some("helper"), "data skipped");
        assert_eq!(s.lookup(0xffffffff81000301), Some("weak_fn"));
        assert_eq!(s.lookup(0xffffffff80000000), None, "below every symbol");
        assert_eq!(s.lookup(0xffffffff82000000), None, "far past the last");
    }

    #[test]
    fn elf_symbols_with_sizes() {
        let s = Symbols::sorted(vec![
            (0x1000, 0x10, "a".into()),
            (0x2000, 0, "b".into()),
            (0x1000, 0x10, "a_alias".into()),
        ]);
        assert_eq!(s.lookup(0x100f), Some("a"));
        assert_eq!(s.lookup(0x1010), None, "past a's size");
        assert_eq!(s.lookup(0x2fff), Some("b"));
    }

    #[test]
    fn the_test_binary_itself_parses_as_elf() {
        // Any ELF with a symbol table will do: this test's own executable.
        let exe = std::env::current_exe().unwrap();
        let s = Symbols::load(&exe).unwrap();
        assert!(!s.is_empty());
    }

    #[test]
    fn garbage_is_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-syms-{}", std::process::id()));
        std::fs::write(&dir, b"\x7fELF not really").unwrap();
        assert!(matches!(
            Symbols::load(&dir),
            Err(SymbolsError::Format { .. })
        ));
        std::fs::write(&dir, b"hello\nworld\n").unwrap();
        assert!(matches!(Symbols::load(&dir), Err(SymbolsError::Empty(_))));
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(
            Symbols::load(&dir),
            Err(SymbolsError::Read { .. })
        ));
    }
}

//! The `--config` file: reading it (bounded), telling JSON from TOML, the
//! serde readers of the keys whose values are not plain strings (sizes,
//! counts, the `net` and `disk` lists) with the same checks as the command
//! line, and one-line error messages that name the file, the key and the
//! place. Never here: a second set of rules for what a valid value is (they
//! are [`crate::config`]'s).

use std::fmt;
use std::io::Read;
use std::marker::PhantomData;
use std::path::Path;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::{RunArgs, RunArgsError};
use crate::config::{self, DiskSpec, NetSpec};

/// The most a config file may hold (a typo such as `--config /dev/zero`
/// ends with an error, not with all of memory).
pub const MAX_FILE: u64 = 1 << 20;

/// The two formats a config file can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Toml,
}

impl Format {
    /// By the extension `.json` or `.toml`, else by the content: JSON when
    /// the first character that is not white space is `{`.
    pub fn of(path: &Path, text: &str) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => Format::Json,
            Some(e) if e.eq_ignore_ascii_case("toml") => Format::Toml,
            _ if text.trim_start().starts_with('{') => Format::Json,
            _ => Format::Toml,
        }
    }
}

/// Reads and parses the config file at `path`.
pub fn load(path: &Path) -> Result<RunArgs, RunArgsError> {
    let read = |source| RunArgsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE + 1).read_to_string(&mut text))
        .map_err(read)?;
    if text.len() as u64 > MAX_FILE {
        return Err(RunArgsError::TooBig {
            path: path.to_path_buf(),
        });
    }
    parse(path, &text)
}

/// Parses `text`, the content of the config file at `path`.
pub fn parse(path: &Path, text: &str) -> Result<RunArgs, RunArgsError> {
    match Format::of(path, text) {
        Format::Json => {
            let json = |field, source| RunArgsError::Json {
                path: path.to_path_buf(),
                field,
                source,
            };
            // Serde also reads a struct from an array, by position.
            if !text.trim_start().starts_with('{') {
                return Err(RunArgsError::JsonNotObject {
                    path: path.to_path_buf(),
                });
            }
            let mut de = serde_json::Deserializer::from_str(text);
            let args = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let field = Some(e.path().to_string()).filter(|p| p != ".");
                json(field, e.into_inner())
            })?;
            // Nothing but white space after the object.
            de.end().map_err(|e| json(None, e))?;
            Ok(args)
        }
        Format::Toml => {
            let toml = |field, source: toml::de::Error| RunArgsError::Toml {
                path: path.to_path_buf(),
                at: source.span().map(|s| line_column(text, s.start)),
                field,
                source: Box::new(source),
            };
            let de = toml::de::Deserializer::parse(text).map_err(|e| toml(None, e))?;
            serde_path_to_error::deserialize(de).map_err(|e| {
                let field = Some(e.path().to_string()).filter(|p| p != ".");
                toml(field, e.into_inner())
            })
        }
    }
}

/// Line and column, from 1, of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// A JSON error on one line: `field: message at line L column C`.
pub(super) fn json_message(field: &Option<String>, e: &serde_json::Error) -> String {
    match field {
        Some(f) => format!("{f}: {e}"),
        None => e.to_string(),
    }
}

/// A TOML error on one line, like [`json_message`] (the toml crate's own
/// display is a multi-line excerpt of the file).
pub(super) fn toml_message(
    field: &Option<String>,
    e: &toml::de::Error,
    at: &Option<(usize, usize)>,
) -> String {
    let mut m = String::new();
    if let Some(f) = field {
        m.push_str(f);
        m.push_str(": ");
    }
    m.push_str(&e.message().trim().replace('\n', "; "));
    if let Some((line, column)) = at {
        m.push_str(&format!(" at line {line} column {column}"));
    }
    m
}

/// A value given as a string or as a whole number (`"512M"` or `512`),
/// handed on as the string the command line would have had.
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string such as \"512M\" or a whole number")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                u64::try_from(v)
                    .map(|v| Scalar(v.to_string()))
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// `mem`: as `--mem`.
pub(super) fn mem<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let s = Scalar::deserialize(d)?;
    config::parse_mem(&s.0).map(Some).map_err(de::Error::custom)
}

/// `cpus`: a whole number, as `--cpus`.
pub(super) fn cpus<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u8>, D::Error> {
    let n = u64::deserialize(d)?;
    config::check_cpus(n, config::max_cpus())
        .map(Some)
        .map_err(de::Error::custom)
}

/// `guest_profile_hz`: a whole number, as `--guest-profile-hz`.
pub(super) fn hz<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let n = u32::deserialize(d)?;
    crate::profile::check_hz(n)
        .map(Some)
        .map_err(de::Error::custom)
}

/// `landlock_rule`: a list of `--landlock-rule` strings.
pub(super) fn landlock_rules<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<crate::sandbox::landlock::FsRule>, D::Error> {
    let entries: Vec<String> = Vec::deserialize(d)?;
    entries
        .iter()
        .map(|e| e.parse().map_err(de::Error::custom))
        .collect()
}

/// `net`: a list of `--net` strings or tables.
pub(super) fn nets<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<NetSpec>, D::Error> {
    let entries: Vec<Entry<NetTable>> = Vec::deserialize(d)?;
    Ok(entries.into_iter().map(|e| e.0).collect())
}

/// `disk`: a list of `--disk` strings or tables.
pub(super) fn disks<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<DiskSpec>, D::Error> {
    let entries: Vec<Entry<DiskTable>> = Vec::deserialize(d)?;
    Ok(entries.into_iter().map(|e| e.0).collect())
}

/// A table form of a device option: its keys, and how it becomes the
/// device (through the command line's own rules).
trait DeviceTable: for<'de> Deserialize<'de> {
    type Spec;
    /// What the entry's string form is parsed with.
    fn parse_str(s: &str) -> Result<Self::Spec, config::ConfigError>;
    /// The `key=value` pairs this table stands for.
    fn pairs(&self) -> Vec<(&'static str, String)>;
    /// The device from `pairs`; `s` is their string form, for errors.
    fn from_pairs(s: &str, pairs: &[(&str, &str)]) -> Result<Self::Spec, config::ConfigError>;
}

/// One entry of a device list: the option's string, or its table `T`.
struct Entry<T: DeviceTable>(T::Spec);

impl<'de, T: DeviceTable> Deserialize<'de> for Entry<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: DeviceTable> Visitor<'de> for V<T> {
            type Value = Entry<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an option string (\"key=value,...\") or a table")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Entry<T>, E> {
                T::parse_str(v).map(Entry).map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Entry<T>, A::Error> {
                let table = T::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let owned = table.pairs();
                let pairs: Vec<(&str, &str)> =
                    owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let s = pairs
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                T::from_pairs(&s, &pairs)
                    .map(Entry)
                    .map_err(de::Error::custom)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A `net` table: the keys of `--net`, with `rsc` true or false.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NetTable {
    tap: String,
    mac: Option<String>,
    sndbuf: Option<Scalar>,
    rsc: Option<bool>,
    rsc_interval_us: Option<u64>,
}

impl DeviceTable for NetTable {
    type Spec = NetSpec;
    fn parse_str(s: &str) -> Result<NetSpec, config::ConfigError> {
        config::parse_net(s)
    }
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p = vec![("tap", self.tap.clone())];
        if let Some(m) = &self.mac {
            p.push(("mac", m.clone()));
        }
        if let Some(s) = &self.sndbuf {
            p.push(("sndbuf", s.0.clone()));
        }
        if let Some(r) = self.rsc {
            p.push(("rsc", on_off(r)));
        }
        if let Some(us) = self.rsc_interval_us {
            p.push(("rsc_interval_us", us.to_string()));
        }
        p
    }
    fn from_pairs(s: &str, pairs: &[(&str, &str)]) -> Result<NetSpec, config::ConfigError> {
        config::net_from_pairs(s, pairs)
    }
}

/// A `disk` table: the keys of `--disk`, with `readonly` true or false.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskTable {
    path: String,
    readonly: Option<bool>,
    id: Option<String>,
}

impl DeviceTable for DiskTable {
    type Spec = DiskSpec;
    fn parse_str(s: &str) -> Result<DiskSpec, config::ConfigError> {
        config::parse_disk(s)
    }
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p = vec![("path", self.path.clone())];
        if let Some(r) = self.readonly {
            p.push(("readonly", on_off(r)));
        }
        if let Some(id) = &self.id {
            p.push(("id", id.clone()));
        }
        p
    }
    fn from_pairs(s: &str, pairs: &[(&str, &str)]) -> Result<DiskSpec, config::ConfigError> {
        config::disk_from_pairs(s, pairs)
    }
}

fn on_off(b: bool) -> String {
    if b { "on" } else { "off" }.to_string()
}

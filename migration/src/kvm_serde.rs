//! Serde of KVM structures through kvm-bindings' own impls, made strict for hostile input.
//!
//! kvm-bindings (feature `serde`) writes each KVM structure as its raw bytes
//! (`serialize_bytes`: in JSON, an array of numbers) and reads it back leniently: a short
//! area is zero-padded and a long byte string truncated, so that a build whose kernel
//! headers grew a struct still reads an old one. A snapshot is hostile input, so tandem
//! reads every structure through [`Exact`]: the area must have exactly the structure's
//! size, or the section is refused naming both sizes; only then does kvm-bindings' own
//! `Deserialize` turn the bytes into the structure. Writing is kvm-bindings' `Serialize`
//! unchanged.
//!
//! Lists of entries (MSRs, CPUID) are read by [`list`], which enforces the kernel's
//! maximum while it reads: an over-long list is refused after at most `max` entries were
//! kept (the rest is only counted, for the message). The fam wrappers (`Msrs`, `CpuId`)
//! are not used for this: their serde impl is vmm-sys-util's `with-serde` (not enabled
//! here), which collects every entry before it checks the count and reads each entry
//! leniently; the vmm builds the wrapper from the checked list at the ioctl.
//!
//! No KVM call, no thread, no state: pure functions used wherever a section is read or
//! written.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

use serde::de::value::BytesDeserializer;
use serde::de::{self, DeserializeOwned, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The last path segment of `T`'s name (`kvm_regs`), for messages.
pub fn short_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

fn wrong_size<T, E: de::Error>(found: usize) -> E {
    E::custom(format_args!(
        "{} is {found} bytes, KVM takes {}",
        short_name::<T>(),
        size_of::<T>()
    ))
}

/// Reads the raw bytes of a `T`: exactly `size_of::<T>()` of them.
struct RawBytes<T>(PhantomData<T>);

impl<'de, T> Visitor<'de> for RawBytes<T> {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "the {} bytes of {}", size_of::<T>(), short_name::<T>())
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        if v.len() == size_of::<T>() {
            Ok(v.to_vec())
        } else {
            Err(wrong_size::<T, E>(v.len()))
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        let want = size_of::<T>();
        let mut out = Vec::with_capacity(want);
        while let Some(b) = seq.next_element::<u8>()? {
            if out.len() == want {
                let mut found = want + 1;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    found += 1;
                }
                return Err(wrong_size::<T, A::Error>(found));
            }
            out.push(b);
        }
        if out.len() != want {
            return Err(wrong_size::<T, A::Error>(out.len()));
        }
        Ok(out)
    }
}

/// A KVM structure serialized by kvm-bindings and read back only at its exact size.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Exact<T>(pub T);

impl<T: Serialize> Serialize for Exact<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Exact<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = d.deserialize_bytes(RawBytes::<T>(PhantomData))?;
        T::deserialize(BytesDeserializer::<D::Error>::new(&bytes)).map(Exact)
    }
}

/// `#[serde(with = "crate::kvm_serde::exact")]` for a field of a kvm-bindings type.
pub mod exact {
    use super::*;

    /// kvm-bindings' own encoding: the structure's bytes.
    pub fn serialize<T: Serialize, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }

    /// The structure, refused unless the area has exactly its size.
    pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        Exact::<T>::deserialize(d).map(|e| e.0)
    }
}

/// Reads a list of at most `max` entries of `T`, each through [`Exact`].
struct List<T> {
    what: &'static str,
    max: usize,
    entry: PhantomData<T>,
}

impl<'de, T: DeserializeOwned> Visitor<'de> for List<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of at most {} {}", self.max, self.what)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max));
        while let Some(Exact(e)) = seq.next_element::<Exact<T>>()? {
            if out.len() == self.max {
                let mut found = self.max + 1;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    found += 1;
                }
                return Err(de::Error::custom(format_args!(
                    "{}: {found} entries, KVM takes at most {}",
                    self.what, self.max
                )));
            }
            out.push(e);
        }
        Ok(out)
    }
}

/// A list of KVM entries (`what`, for messages), at most `max` of them; for a
/// `deserialize_with` function. Written as a plain sequence of kvm-bindings' encodings.
pub fn list<'de, T: DeserializeOwned, D: Deserializer<'de>>(
    d: D,
    what: &'static str,
    max: usize,
) -> Result<Vec<T>, D::Error> {
    d.deserialize_seq(List {
        what,
        max,
        entry: PhantomData,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::{kvm_mp_state, kvm_msr_entry, kvm_regs};

    fn read<T: DeserializeOwned>(json: &str) -> Result<T, String> {
        serde_json::from_str::<Exact<T>>(json)
            .map(|e| e.0)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_encoding_is_kvm_bindings_own() {
        let mp = kvm_mp_state {
            mp_state: 0x0403_0201,
        };
        let ours = serde_json::to_string(&Exact(mp)).unwrap();
        assert_eq!(ours, serde_json::to_string(&mp).unwrap());
        assert_eq!(ours, "[1,2,3,4]");
        assert_eq!(read::<kvm_mp_state>(&ours), Ok(mp));
        let regs = kvm_regs {
            rip: 0xffff_ffff_8100_0000,
            rflags: 2,
            ..Default::default()
        };
        let text = serde_json::to_string(&Exact(regs)).unwrap();
        assert_eq!(read::<kvm_regs>(&text), Ok(regs));
    }

    #[test]
    fn an_area_of_another_size_is_refused_where_kvm_bindings_would_pad() {
        // kvm-bindings alone zero-pads a short area.
        let lenient: kvm_mp_state = serde_json::from_str("[1]").unwrap();
        assert_eq!(lenient.mp_state, 1);
        let e = read::<kvm_mp_state>("[1]").unwrap_err();
        assert!(e.starts_with("kvm_mp_state is 1 bytes, KVM takes 4"), "{e}");
        let e = read::<kvm_mp_state>("[1,2,3,4,5,6]").unwrap_err();
        assert!(e.starts_with("kvm_mp_state is 6 bytes, KVM takes 4"), "{e}");
        assert!(read::<kvm_mp_state>("[]").is_err());
        assert!(read::<kvm_mp_state>("[1,2,3,256]").is_err(), "not a byte");
        assert!(read::<kvm_mp_state>("{\"mp_state\":1}").is_err());
        // A byte string (what a binary format would use) is held to the size too.
        assert_eq!(
            read::<kvm_mp_state>("\"abcd\"").unwrap().mp_state,
            0x6463_6261
        );
        assert!(read::<kvm_mp_state>("\"abcde\"").is_err());
    }

    #[test]
    fn a_list_is_bounded_while_it_is_read() {
        let entry = serde_json::to_string(&kvm_msr_entry {
            index: 0x10,
            reserved: 0,
            data: 7,
        })
        .unwrap();
        let json = |n: usize| format!("[{}]", vec![entry.as_str(); n].join(","));
        let read_list = |text: &str| {
            let mut d = serde_json::Deserializer::from_str(text);
            list::<kvm_msr_entry, _>(&mut d, "MSRs", 3).map_err(|e| e.to_string())
        };
        assert_eq!(read_list(&json(3)).unwrap().len(), 3);
        assert_eq!(read_list("[]").unwrap().len(), 0);
        let e = read_list(&json(5)).unwrap_err();
        assert!(e.starts_with("MSRs: 5 entries, KVM takes at most 3"), "{e}");
        let e = read_list("[[1,2,3]]").unwrap_err();
        assert!(
            e.starts_with("kvm_msr_entry is 3 bytes, KVM takes 16"),
            "{e}"
        );
    }
}

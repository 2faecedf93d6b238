//! A migration stream through the destination's receive short of KVM, for
//! the `migration_stream` target: `vmm::migrate::dest::receive_guest` (the
//! handshake, the manifest check, every memory batch checked and written
//! into guest memory, the final state image checked as a restore checks
//! it), against a fixed destination: [`MEM`] of memory, one vCPU, the
//! serial console.
//!
//! Invariants asserted (a panic is a finding): the receiver writes nothing
//! outside the destination's memory (guaranteed by vm-memory, which would
//! return an error; asserted here as "no write error"), and whatever it
//! accepts as the final state is this VM's.

use std::io::{self, Read, Write};
use std::sync::OnceLock;

use devices::GuestMemoryMmap;
use migration::protocol::{self, MemoryBatch, Message, PageRange};
use migration::{DeviceConfig, Manifest};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm::migrate::MigrateError;

/// The destination's memory.
pub const MEM: u64 = 16 << 20;

/// The destination's manifest.
pub fn manifest() -> Manifest {
    Manifest {
        tandem_version: "fuzz".into(),
        mem_bytes: MEM,
        vcpus: 1,
        firmware: None,
        devices: vec![DeviceConfig::Serial { id: "com1".into() }],
    }
}

pub(crate) fn memory() -> &'static GuestMemoryMmap {
    static MEMORY: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEMORY.get_or_init(|| {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).expect("guest memory")
    })
}

/// The source's side of the stream: the fuzzer's bytes to read, what the
/// destination answers thrown away.
struct Peer<'a>(&'a [u8]);

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Zeroes the pages the last input wrote (vm-memory's dirty bitmap says
/// which), so that no input sees another's memory.
pub(crate) fn reset(mem: &GuestMemoryMmap) {
    let zero = [0u8; 4096];
    for region in mem.iter() {
        let start = region.start_addr().raw_value();
        let bits = vm_memory::MmapRegion::bitmap(region).get_and_reset();
        for (w, word) in bits.iter().enumerate() {
            for b in (0..64).filter(|b| word & (1u64 << b) != 0) {
                let gpa = start + (w as u64 * 64 + b) * 4096;
                let _ = mem.write_slice(&zero, GuestAddress(gpa));
            }
        }
        vm_memory::MmapRegion::bitmap(region).reset();
    }
}

/// Runs the receive on `bytes`: `Ok(pages)` when a whole guest was taken.
pub fn receive(bytes: &[u8]) -> Result<u64, String> {
    let ours = manifest();
    let mem = memory();
    reset(mem);
    match vmm::migrate::dest::receive_guest(&mut Peer(bytes), &ours, mem) {
        Ok((state, pages)) => {
            assert_eq!(
                state.manifest.mem_bytes, MEM,
                "a state of another VM was accepted"
            );
            assert_eq!(state.vcpus.len(), 1, "a state of another VM was accepted");
            Ok(pages)
        }
        Err(e @ (MigrateError::Write(..) | MigrateError::Read(..))) => {
            panic!("a checked batch failed against guest memory: {e}")
        }
        Err(e) => Err(e.to_string()),
    }
}

/// A well-formed stream: the handshake, `batches` and the state `image`.
pub fn stream(batches: &[MemoryBatch], image: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut msgs = vec![
        Message::Hello {
            version: protocol::VERSION,
        },
        Message::Config(manifest()),
    ];
    msgs.extend(batches.iter().cloned().map(Message::Memory));
    msgs.push(Message::State(image));
    for m in &msgs {
        protocol::write_message(&mut out, m).expect("encode a message");
    }
    out
}

/// Two small batches (data, zero, data).
pub fn batches() -> Vec<MemoryBatch> {
    vec![
        MemoryBatch {
            ranges: vec![PageRange {
                gpa: 0x1000,
                pages: 1,
                zero: false,
            }],
            data: vec![0xab; 4096],
        },
        MemoryBatch {
            ranges: vec![
                PageRange {
                    gpa: 0x10_0000,
                    pages: 16,
                    zero: true,
                },
                PageRange {
                    gpa: MEM - 0x1000,
                    pages: 1,
                    zero: false,
                },
            ],
            data: vec![0x5a; 4096],
        },
    ]
}

/// The other streams of a multi-stream input, handed to the receive when
/// the main stream asks for exactly as many.
struct Given(Vec<Vec<u8>>);

impl vmm::migrate::joined::Joiner for Given {
    type Stream = io::Cursor<Vec<u8>>;

    fn join(
        &mut self,
        streams: &protocol::streams::Streams,
    ) -> Result<Vec<Self::Stream>, MigrateError> {
        if usize::from(streams.count) != self.0.len() + 1 {
            return Err(MigrateError::Join(format!(
                "{} streams asked, {} given",
                streams.count,
                self.0.len() + 1
            )));
        }
        Ok(std::mem::take(&mut self.0)
            .into_iter()
            .map(io::Cursor::new)
            .collect())
    }
}

/// Splits a `migration_streams` input: byte 0 says how many other
/// streams (its value mod 4), each then a 2-byte length and its bytes; the
/// rest is the main stream.
pub fn split_streams(bytes: &[u8]) -> (Vec<Vec<u8>>, &[u8]) {
    let Some((&n, mut rest)) = bytes.split_first() else {
        return (Vec::new(), bytes);
    };
    let mut others = Vec::new();
    for _ in 0..n % 4 {
        let Some((len, tail)) = rest.split_first_chunk::<2>() else {
            break;
        };
        let len = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        others.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    (others, rest)
}

/// The inverse of [`split_streams`].
pub fn join_streams(others: &[Vec<u8>], main: &[u8]) -> Vec<u8> {
    let mut out = vec![others.len() as u8];
    for o in others {
        out.extend_from_slice(&(o.len() as u16).to_le_bytes());
        out.extend_from_slice(o);
    }
    out.extend_from_slice(main);
    out
}

/// Runs the multi-stream receive on `bytes` ([`split_streams`]): `Ok(pages)`
/// when a whole guest was taken from every stream.
pub fn receive_streams(bytes: &[u8]) -> Result<u64, String> {
    let (others, main) = split_streams(bytes);
    let ours = manifest();
    let mem = memory();
    reset(mem);
    let mut given = Given(others);
    match vmm::migrate::dest::receive_guest_joined(&mut Peer(main), &ours, mem, &mut given) {
        Ok((state, pages)) => {
            assert_eq!(
                state.manifest.mem_bytes, MEM,
                "a state of another VM was accepted"
            );
            Ok(pages)
        }
        Err(e @ (MigrateError::Write(..) | MigrateError::Read(..))) => {
            panic!("a checked batch failed against guest memory: {e}")
        }
        Err(e) => Err(e.to_string()),
    }
}

/// A well-formed three-stream input: the main stream with the handshake,
/// `Streams`, the first batch and the state `image`; the second batch on
/// stream 1; stream 2 with nothing but its `Commit`.
pub fn three_streams(image: Vec<u8>) -> Vec<u8> {
    let b = batches();
    let token = [0x42; protocol::streams::TOKEN_BYTES];
    let encode = |msgs: &[Message]| {
        let mut out = Vec::new();
        for m in msgs {
            protocol::write_message(&mut out, m).expect("encode a message");
        }
        out
    };
    let main = encode(&[
        Message::Hello {
            version: protocol::VERSION,
        },
        Message::Config(manifest()),
        Message::Streams(protocol::streams::Streams { count: 3, token }),
        Message::Memory(b[0].clone()),
        Message::State(image),
    ]);
    let one = encode(&[Message::Memory(b[1].clone()), Message::Commit]);
    let two = encode(&[Message::Commit]);
    join_streams(&[one, two], &main)
}

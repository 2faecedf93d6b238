//! A TCP stream from the host into a guest's `nc`, sent slowly so that it
//! runs across a migration or a COLO failover, and checked whole (sha256)
//! in the guest at the end.
//!
//! Runs on the test's threads; the sender on a thread of its own inside the
//! test's namespace.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::base::GUEST_IP0;
use crate::netns::NetNs;
use crate::{hex, pseudo_random, TestVm, CMD_TIMEOUT as CMD};

/// How a stream is sent: its bytes, in pieces of `piece` bytes `every`
/// apart.
#[derive(Clone, Copy)]
pub struct Pace {
    pub bytes: usize,
    pub piece: usize,
    pub every: Duration,
}

/// A stream sent as fast as TCP goes, with Linux's default congestion
/// control (cubic, which fills the queues on the way; a test namespace
/// otherwise takes the host's, e.g. bbr, which paces).
pub const BULK: Pace = Pace {
    bytes: 3 << 20,
    piece: 64 << 10,
    every: Duration::ZERO,
};

/// A TCP stream from the host into the guest's `nc`, running across a
/// migration or a failover.
pub struct Stream {
    sender: JoinHandle<(usize, String)>,
    want: String,
    file: String,
    bytes: usize,
    port: u16,
}

impl Stream {
    /// Starts `nc` on `port` in the guest (its pid in `$ncpidPORT`) and the
    /// sender, which sends slowly so that the stream runs across the
    /// migration.
    pub fn start(vm: &mut TestVm, ns: &NetNs, port: u16, seed: u64, pace: Pace) -> Stream {
        Self::start_after(vm, ns, port, seed, pace, |_| {})
    }

    /// As [`Stream::start`], with `between` run on the guest once `nc`
    /// listens and before the host connects (a COLO test's checkpoint, so
    /// that the connection is opened after it).
    pub fn start_after(
        vm: &mut TestVm,
        ns: &NetNs,
        port: u16,
        seed: u64,
        pace: Pace,
        between: impl FnOnce(&mut TestVm),
    ) -> Stream {
        let blob = pseudo_random(pace.bytes, seed);
        let want = hex(&Sha256::digest(&blob));
        let file = format!("/tmp/in{port}");
        // Listening before the command returns: `between` may snapshot it.
        let hexport = format!("{port:04X}");
        vm.ok(
            &format!(
                "nc -l -p {port} </dev/null >{file} & ncpid{port}=$!; \
                 while ! grep -q ':{hexport} ' /proc/net/tcp /proc/net/tcp6; do sleep 0.1; done"
            ),
            CMD,
        );
        between(vm);
        let sender = ns.spawn(move || send_slowly(&blob, port, pace));
        std::thread::sleep(Duration::from_secs(1));
        Stream {
            sender,
            want,
            file,
            bytes: pace.bytes,
            port,
        }
    }

    /// Whether the host is still sending (or waiting for the guest's end).
    pub fn running(&self) -> bool {
        !self.sender.is_finished()
    }

    /// At the destination: the whole stream arrived, in order.
    pub fn check(self, dst: &mut TestVm) {
        // Until nc ended: `wait` blocks without a fork per turn, and
        // fails at once (127) for a job the shell already reaped, which
        // has ended too.
        dst.ok(&format!("wait $ncpid{} 2>/dev/null; true", self.port), CMD);
        let (sent, end) = self.sender.join().expect("the sender");
        assert_eq!(sent, self.bytes, "the host sent the whole stream");
        let tcp = dst.ok("grep Tcp: /proc/net/snmp", CMD);
        eprintln!("stream: {end}; the guest's TCP counters:\n{tcp}");
        // The shell may first report the finished background job: take the sum.
        let got = dst.ok(&format!("ls -l {0}; sha256sum {0}", self.file), CMD);
        let sum = got
            .split_whitespace()
            .find(|t| t.len() == 64 && t.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(
            sum,
            Some(self.want.as_str()),
            "the stream across the migration arrived whole: {got}\nstream: {end}\n{tcp}"
        );
    }
}

/// Sends `blob` to the guest's `port` at `pace`; returns the bytes sent
/// and how the connection ended (the guest closes it once it has read
/// everything).
fn send_slowly(blob: &[u8], port: u16, pace: Pace) -> (usize, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = loop {
        match TcpStream::connect((GUEST_IP0, port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("connect to the guest: {e}"),
        }
    };
    if pace.every.is_zero() {
        set_cubic(&s);
    }
    for piece in blob.chunks(pace.piece) {
        s.write_all(piece).expect("send to the guest");
        std::thread::sleep(pace.every);
    }
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    let mut byte = [0u8; 1];
    let end = match s.read(&mut byte) {
        Ok(0) => "closed by the guest".to_string(),
        Ok(_) => "the guest sent data".to_string(),
        Err(e) => format!("error: {e}"),
    };
    (blob.len(), end)
}

/// Sets the connection's congestion control to cubic.
fn set_cubic(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let name = b"cubic";
    // SAFETY: setsockopt reads `name.len()` bytes from a live buffer.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "TCP_CONGESTION cubic: {}",
        std::io::Error::last_os_error()
    );
}

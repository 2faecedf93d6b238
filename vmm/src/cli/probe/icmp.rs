//! The pinger: ICMP echo requests to the guest on a fixed schedule, and
//! their round trips.
//!
//! Runs on the probe's `probe-ping` thread, which owns the socket and the
//! pings until [`Pinger::run`] returns them. The socket is raw
//! (`SOCK_RAW`, root) or, failing that, an unprivileged ping socket
//! (`SOCK_DGRAM`, `net.ipv4.ping_group_range`), connected to the guest; it
//! is opened by [`Pinger::open`] on the caller's thread, so in the caller's
//! network namespace. A raw socket sees every ICMP packet of the namespace:
//! a reply counts only if it is an echo reply from the guest with a valid
//! checksum, this probe's identifier and its 64-bit token, and the sequence
//! number of a ping still waiting.
//!
//! Request `k` goes at `start + k * interval`; slots the thread missed
//! (it was not scheduled) are skipped, never sent in a burst. A ping with
//! no reply within [`LOST_AFTER`] is lost. Never sends more than one ping
//! per interval, never blocks on a send.

use std::collections::hash_map::RandomState;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Clock, Ping, ProbeError};

/// A ping with no reply this long after it was sent is lost.
pub const LOST_AFTER: Duration = Duration::from_secs(1);
/// The longest the thread waits before looking at the stop flag.
const STOP_CHECK: Duration = Duration::from_millis(50);

const ECHO_REPLY: u8 = 0;
const ECHO_REQUEST: u8 = 8;
/// The ICMP header, then the payload: this probe's token, the full seq.
const HEADER_LEN: usize = 8;
const PACKET_LEN: usize = HEADER_LEN + 16;
/// `setsockopt(SOL_RAW, ICMP_FILTER)`: a mask of the ICMP types a raw
/// socket drops (linux/icmp.h).
const ICMP_FILTER: libc::c_int = 1;

/// Which kind of ICMP socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Receives IP headers and everyone's ICMP; we set the identifier.
    Raw,
    /// Receives ICMP only, only ours; the kernel sets the identifier.
    Dgram,
}

/// What the pinger recorded.
#[derive(Debug, Default)]
pub struct PingLog {
    pub pings: Vec<Ping>,
    pub send_errors: u64,
}

/// An open ICMP socket aimed at the guest, not yet pinging.
pub struct Pinger {
    fd: OwnedFd,
    kind: Kind,
    guest: Ipv4Addr,
    ident: u16,
    token: u64,
    interval: Duration,
}

/// A ping sent and not yet answered nor lost.
struct Waiting {
    seq: u64,
    index: usize,
    sent: Instant,
}

impl Pinger {
    /// Opens the socket (raw, else datagram) and connects it to `guest`.
    pub fn open(guest: Ipv4Addr, interval: Duration) -> Result<Pinger, ProbeError> {
        let (fd, kind) = match socket(libc::SOCK_RAW) {
            Ok(fd) => (fd, Kind::Raw),
            Err(raw) => match socket(libc::SOCK_DGRAM) {
                Ok(fd) => (fd, Kind::Dgram),
                Err(dgram) => return Err(ProbeError::IcmpSocket { raw, dgram }),
            },
        };
        if kind == Kind::Raw {
            // Only echo replies, so the kernel keeps the rest of the
            // namespace's ICMP off our queue (best effort: we filter too).
            let drop_mask: u32 = !(1u32 << ECHO_REPLY);
            if let Err(e) = setsockopt(&fd, libc::SOL_RAW, ICMP_FILTER, &drop_mask) {
                log::debug!("jitter probe: ICMP_FILTER: {e}");
            }
        }
        connect(&fd, guest).map_err(|e| ProbeError::IcmpConnect(guest, e))?;
        let random = RandomState::new().build_hasher().finish();
        Ok(Pinger {
            fd,
            kind,
            guest,
            ident: (random >> 48) as u16,
            token: RandomState::new().build_hasher().finish(),
            interval,
        })
    }

    /// Which kind of socket it got.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Pings until `stop`, then waits for the replies still due (at most
    /// [`LOST_AFTER`]), and returns every ping.
    pub fn run(self, clock: Clock, stop: &AtomicBool) -> PingLog {
        let mut log = PingLog::default();
        let mut waiting = VecDeque::new();
        let first = Instant::now();
        let mut slot: u32 = 0;
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            let due = first + self.interval * slot;
            if now >= due {
                self.send(&mut log, &mut waiting, clock, now);
                slot = next_slot(slot, now - first, self.interval);
                continue;
            }
            let wait = (due - now).min(STOP_CHECK);
            self.receive(wait, &mut log, &mut waiting);
            expire(&mut waiting, Instant::now());
        }
        // The last pings' replies, if they come within their second.
        while let Some(deadline) = waiting.back().map(|w| w.sent + LOST_AFTER) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            self.receive((deadline - now).min(STOP_CHECK), &mut log, &mut waiting);
            expire(&mut waiting, Instant::now());
        }
        log
    }

    /// Sends ping number `pings.len()`, recording it (lost if not sent).
    fn send(&self, log: &mut PingLog, waiting: &mut VecDeque<Waiting>, clock: Clock, now: Instant) {
        let seq = log.pings.len() as u64;
        let packet = echo_request(self.ident, seq, self.token);
        let sent = Instant::now();
        // SAFETY: the descriptor is open; the buffer is valid for its length.
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                libc::MSG_DONTWAIT,
            )
        };
        log.pings.push(Ping {
            t_ms: clock.ms(now),
            seq,
            rtt_ms: None,
        });
        if n == packet.len() as isize {
            waiting.push_back(Waiting {
                seq,
                index: log.pings.len() - 1,
                sent,
            });
        } else {
            log.send_errors += 1;
            if log.send_errors == 1 {
                log::debug!("jitter probe: ping: {}", io::Error::last_os_error());
            }
        }
    }

    /// Waits up to `wait` for the socket, then takes every reply queued.
    fn receive(&self, wait: Duration, log: &mut PingLog, waiting: &mut VecDeque<Waiting>) {
        if !poll_in(&self.fd, wait) {
            return;
        }
        let mut buf = [0u8; 2048];
        loop {
            // SAFETY: the descriptor is open; the buffer is valid for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            let Ok(n) = usize::try_from(n) else {
                return; // EAGAIN: drained (or an error the next poll sees)
            };
            let at = Instant::now();
            let Some(seq) = self.reply_seq(&buf[..n.min(buf.len())]) else {
                continue;
            };
            if let Some(i) = waiting.iter().position(|w| w.seq == seq) {
                if let Some(w) = waiting.remove(i) {
                    let rtt = at.saturating_duration_since(w.sent);
                    if rtt <= LOST_AFTER {
                        if let Some(p) = log.pings.get_mut(w.index) {
                            p.rtt_ms = Some(rtt.as_secs_f64() * 1000.0);
                        }
                    }
                }
            }
        }
    }

    /// The full seq of `packet` if it is a reply to one of this probe's
    /// pings.
    fn reply_seq(&self, packet: &[u8]) -> Option<u64> {
        let icmp = match self.kind {
            Kind::Raw => {
                let icmp = strip_ip(packet, self.guest)?;
                if checksum(icmp) != 0 || u16::from_be_bytes([icmp[4], icmp[5]]) != self.ident {
                    return None;
                }
                icmp
            }
            // The kernel matched the identifier (it chose it) and the
            // connected peer.
            Kind::Dgram => packet,
        };
        parse_reply(icmp, self.token)
    }
}

/// The slot after `slot` that is still ahead at `elapsed`: missed ones are
/// skipped.
fn next_slot(slot: u32, elapsed: Duration, interval: Duration) -> u32 {
    let behind = elapsed.as_nanos() / interval.as_nanos().max(1);
    let behind = u32::try_from(behind).unwrap_or(u32::MAX - 1);
    slot.saturating_add(1).max(behind.saturating_add(1))
}

/// Forgets the pings older than [`LOST_AFTER`] (they stay lost).
fn expire(waiting: &mut VecDeque<Waiting>, now: Instant) {
    while waiting
        .front()
        .is_some_and(|w| now.saturating_duration_since(w.sent) > LOST_AFTER)
    {
        waiting.pop_front();
    }
}

/// An echo request: identifier, the low 16 bits of `seq`, and a payload
/// of the token and the full `seq`.
pub fn echo_request(ident: u16, seq: u64, token: u64) -> [u8; PACKET_LEN] {
    let mut p = [0u8; PACKET_LEN];
    p[0] = ECHO_REQUEST;
    p[4..6].copy_from_slice(&ident.to_be_bytes());
    p[6..8].copy_from_slice(&(seq as u16).to_be_bytes());
    p[8..16].copy_from_slice(&token.to_be_bytes());
    p[16..24].copy_from_slice(&seq.to_be_bytes());
    let sum = checksum(&p);
    p[2..4].copy_from_slice(&sum.to_be_bytes());
    p
}

/// The seq of an echo reply (ICMP, from its header on) carrying `token`.
pub fn parse_reply(icmp: &[u8], token: u64) -> Option<u64> {
    if icmp.len() < PACKET_LEN || icmp[0] != ECHO_REPLY || icmp[1] != 0 {
        return None;
    }
    let got = u64::from_be_bytes(icmp[8..16].try_into().ok()?);
    let seq = u64::from_be_bytes(icmp[16..24].try_into().ok()?);
    let seq16 = u16::from_be_bytes([icmp[6], icmp[7]]);
    (got == token && seq16 == seq as u16).then_some(seq)
}

/// The ICMP message in an IPv4 packet from `from`.
pub fn strip_ip(packet: &[u8], from: Ipv4Addr) -> Option<&[u8]> {
    let first = *packet.first()?;
    let ihl = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || ihl < 20 || packet.len() < ihl + HEADER_LEN {
        return None;
    }
    let src = Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]);
    (packet[9] == 1 && src == from).then(|| &packet[ihl..])
}

/// The Internet checksum (RFC 1071); 0 over a message that carries its own.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn socket(kind: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC, libc::IPPROTO_ICMP) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: the descriptor is open; `value` is valid for its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(value).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn connect(fd: &OwnedFd, to: Ipv4Addr) -> io::Result<()> {
    // SAFETY: sockaddr_in is plain old data; all zeroes is valid.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    addr.sin_family = libc::AF_INET as libc::sa_family_t;
    addr.sin_addr.s_addr = u32::from(to).to_be();
    // SAFETY: the descriptor is open; `addr` is a valid sockaddr_in of the
    // length given.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            std::ptr::from_ref(&addr).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `fd` has something to read within `wait`: a packet or a
/// pending error (which the next `recv` returns and clears).
fn poll_in(fd: &OwnedFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(wait.subsec_nanos()),
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask.
    let r = unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) };
    r > 0 && p.revents & (libc::POLLIN | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_checksums_to_zero_and_parses_as_reply() {
        let mut p = echo_request(0x1234, 70_000, 0xfeed);
        assert_eq!(checksum(&p), 0);
        assert_eq!(p[0], ECHO_REQUEST);
        assert_eq!(
            &p[4..8],
            &[0x12, 0x34, (70_000u64 >> 8) as u8, 70_000u64 as u8]
        );
        assert_eq!(parse_reply(&p, 0xfeed), None, "a request is no reply");
        p[0] = ECHO_REPLY;
        assert_eq!(parse_reply(&p, 0xfeed), Some(70_000));
        assert_eq!(parse_reply(&p, 0xbeef), None, "another probe's token");
        assert_eq!(parse_reply(&p[..20], 0xfeed), None, "short");
        p[7] ^= 1;
        assert_eq!(parse_reply(&p, 0xfeed), None, "seq fields disagree");
    }

    #[test]
    fn checksum_odd_length() {
        // RFC 1071's example, plus an odd byte.
        let d = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7, 0x10];
        let sum: u32 = 0x0001 + 0xf203 + 0xf4f5 + 0xf6f7 + 0x1000;
        let folded = (sum & 0xffff) + (sum >> 16);
        assert_eq!(checksum(&d), !(folded as u16));
    }

    #[test]
    fn strip_ip_checks_version_protocol_source() {
        let guest = Ipv4Addr::new(10, 0, 0, 2);
        let mut p = vec![0u8; 20 + PACKET_LEN];
        p[0] = 0x45;
        p[9] = 1;
        p[12..16].copy_from_slice(&guest.octets());
        assert_eq!(strip_ip(&p, guest).map(<[u8]>::len), Some(PACKET_LEN));
        assert!(strip_ip(&p, Ipv4Addr::new(10, 0, 0, 3)).is_none());
        p[9] = 17;
        assert!(strip_ip(&p, guest).is_none());
        p[9] = 1;
        p[0] = 0x44; // IHL 16 bytes
        assert!(strip_ip(&p, guest).is_none());
        assert!(strip_ip(&[], guest).is_none());
        p[0] = 0x45;
        assert!(
            strip_ip(&p[..27], guest).is_none(),
            "shorter than an ICMP header"
        );
    }

    /// A pinger that never sends: for its receive filter.
    fn pinger(kind: Kind) -> Pinger {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        Pinger {
            fd: OwnedFd::from(udp),
            kind,
            guest: Ipv4Addr::new(10, 0, 0, 2),
            ident: 0x4242,
            token: 77,
            interval: Duration::from_millis(10),
        }
    }

    fn reply(ident: u16, seq: u64, token: u64) -> [u8; PACKET_LEN] {
        let mut p = echo_request(ident, seq, token);
        p[0] = ECHO_REPLY;
        p[2..4].fill(0);
        let sum = checksum(&p);
        p[2..4].copy_from_slice(&sum.to_be_bytes());
        p
    }

    fn ip(from: Ipv4Addr, icmp: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 20];
        p[0] = 0x45;
        p[9] = 1;
        p[12..16].copy_from_slice(&from.octets());
        p.extend_from_slice(icmp);
        p
    }

    #[test]
    fn raw_replies_are_filtered() {
        let p = pinger(Kind::Raw);
        let guest = p.guest;
        assert_eq!(p.reply_seq(&ip(guest, &reply(0x4242, 9, 77))), Some(9));
        let other = Ipv4Addr::new(10, 0, 0, 3);
        assert_eq!(
            p.reply_seq(&ip(other, &reply(0x4242, 9, 77))),
            None,
            "source"
        );
        assert_eq!(
            p.reply_seq(&ip(guest, &reply(0x4243, 9, 77))),
            None,
            "identifier"
        );
        assert_eq!(
            p.reply_seq(&ip(guest, &reply(0x4242, 9, 78))),
            None,
            "token"
        );
        let mut bad = reply(0x4242, 9, 77);
        bad[20] ^= 0xff;
        assert_eq!(p.reply_seq(&ip(guest, &bad)), None, "checksum");
        let request = echo_request(0x4242, 9, 77);
        assert_eq!(p.reply_seq(&ip(guest, &request)), None, "our own request");
        assert_eq!(p.reply_seq(&reply(0x4242, 9, 77)), None, "no IP header");
    }

    #[test]
    fn dgram_replies_have_no_ip_header() {
        let p = pinger(Kind::Dgram);
        // The kernel chose the identifier: any is ours.
        assert_eq!(p.reply_seq(&reply(0x1111, 3, 77)), Some(3));
        assert_eq!(p.reply_seq(&reply(0x1111, 3, 78)), None, "token");
    }

    #[test]
    fn missed_slots_are_skipped() {
        let i = Duration::from_millis(10);
        assert_eq!(next_slot(0, Duration::from_millis(1), i), 1);
        assert_eq!(next_slot(3, Duration::from_millis(35), i), 4);
        assert_eq!(next_slot(3, Duration::from_millis(95), i), 10);
    }

    #[test]
    fn pings_loopback() {
        let pinger = Pinger::open(Ipv4Addr::LOCALHOST, Duration::from_millis(10)).unwrap();
        let stop = AtomicBool::new(false);
        let clock = Clock::new();
        let log = std::thread::scope(|s| {
            let run = s.spawn(|| pinger.run(clock, &stop));
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::SeqCst);
            run.join().unwrap()
        });
        let n = log.pings.len();
        assert!((10..=32).contains(&n), "{n} pings in 0.3 s");
        assert_eq!(log.send_errors, 0);
        let t0 = log.pings[0].t_ms;
        for (i, p) in log.pings.iter().enumerate() {
            assert_eq!(p.seq, i as u64);
            let rtt = p.rtt_ms.unwrap_or_else(|| panic!("ping {i} lost"));
            assert!(rtt < 50.0, "ping {i}: rtt {rtt} ms");
            // Never ahead of the schedule (slots may be skipped under load).
            assert!(
                p.t_ms - t0 >= 10.0 * i as f64 - 1.0,
                "ping {i} at {} ms",
                p.t_ms
            );
        }
    }
}

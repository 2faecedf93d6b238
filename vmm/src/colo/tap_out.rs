//! A proxy's tap and the released frames waiting for room in it: a frame
//! the tap cannot take now waits here, in order, and goes out when the
//! tap is writable again (the proxy polls it for that), instead of the
//! proxy's thread sleeping on it.
//!
//! Runs on the proxy's thread. Never writes while its side's [`Fence`] is
//! closed (what waits is dropped and counted as fenced); never holds more
//! than [`MAX_WAITING`] frames (one more is dropped and counted).

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::time::Instant;

use devices::virtio::net::backend::NetBackend;
use replication::histogram::Histogram;

use super::arbiter::Fence;
use super::proxy::ProxyCounters;

/// Most frames waiting for one tap.
pub const MAX_WAITING: usize = 1024;

/// See the module doc.
pub struct Tap {
    pub dev: Box<dyn NetBackend>,
    waiting: VecDeque<(Vec<u8>, Instant)>,
}

impl Tap {
    pub fn new(dev: Box<dyn NetBackend>) -> Tap {
        Tap {
            dev,
            waiting: VecDeque::new(),
        }
    }

    /// Sends `frame` after those waiting, if `fence` lets it; `h` times
    /// its wait for room.
    pub fn put(&mut self, frame: Vec<u8>, fence: &Fence, c: &mut ProxyCounters, h: &mut Histogram) {
        if !fence.open() {
            c.fenced += 1;
            return;
        }
        if self.waiting.len() >= MAX_WAITING {
            c.dropped += 1;
            return;
        }
        self.waiting.push_back((frame, Instant::now()));
        self.drain(fence, c, h);
    }

    /// Writes what waits, as far as the tap takes it.
    pub fn drain(&mut self, fence: &Fence, c: &mut ProxyCounters, h: &mut Histogram) {
        if !fence.open() {
            c.fenced += self.waiting.len() as u64;
            self.waiting.clear();
            return;
        }
        while let Some((frame, since)) = self.waiting.front() {
            match self.dev.write_frame(frame) {
                Ok(_) => {
                    c.to_taps += 1;
                    h.record(since.elapsed());
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => c.dropped += 1,
            }
            self.waiting.pop_front();
        }
    }

    /// The descriptors to poll: the tap's for reading (when the proxy
    /// would `read` it now), and for writing while frames wait.
    pub fn poll_fds(&self, read: bool, out: &mut Vec<(i32, i16)>) {
        if read {
            out.push((self.dev.rx_fd(), libc::POLLIN));
        }
        if !self.waiting.is_empty() {
            out.push((self.dev.tx_fd(), libc::POLLOUT));
        }
    }
}

//! The serial console: a 16550A UART (vm-superio) on COM1, with input held
//! by the VMM until the guest is ready for it.
//!
//! A UART has a 64-byte receive FIFO, and Linux clears it when it opens the
//! port, so bytes that arrive before the guest listens would be lost. Here
//! input waits in `pending` (bounded by the caller) and moves into the FIFO
//! only while the guest has the receive interrupt enabled, refilled whenever
//! the guest touches the port. Nothing typed or piped in is dropped.
//!
//! IIR reports received data for as long as the FIFO holds any (see
//! [`Serial::iir_as_16550`]): vm-superio clears the receive interrupt at
//! every read of the receive buffer, and a driver that stops short of an
//! empty FIFO would otherwise wait for input that never comes.

use std::collections::VecDeque;
use std::io::{self, Write};

use vm_superio::{Serial as Uart, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Base port of COM1 and its legacy interrupt line.
pub const COM1_PORT: u64 = 0x3f8;
/// ISA IRQ of COM1.
pub const COM1_IRQ: u32 = 4;
/// Number of ports a UART decodes.
pub const UART_PORTS: u64 = 8;

const DATA_OFFSET: u8 = 0;
const IER_OFFSET: u8 = 1;
const FCR_OFFSET: u8 = 2;
/// IIR: read at the offset FCR is written at.
const IIR_OFFSET: u8 = 2;
const IIR_NONE: u8 = 0x01;
const IIR_RDA: u8 = 0x04;
const LCR_OFFSET: u8 = 3;
const LSR_OFFSET: u8 = 5;
const IER_RDA: u8 = 0x01;
const FCR_CLEAR_RX: u8 = 0x02;
const LCR_DLAB: u8 = 0x80;
const LSR_DATA_READY: u8 = 0x01;

/// Raises the UART's interrupt by writing to an eventfd (an irqfd in KVM).
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// COM1, writing what the guest prints to `W`.
pub struct Serial<W: Write + Send> {
    uart: Uart<EventFdTrigger, vm_superio::serial::NoEvents, W>,
    pending: VecDeque<u8>,
    rx_enabled: bool,
}

impl<W: Write + Send> Serial<W> {
    /// A UART raising its interrupt on `irq` and printing to `out`.
    pub fn new(irq: EventFd, out: W) -> Self {
        Serial {
            uart: Uart::new(EventFdTrigger(irq), out),
            pending: VecDeque::new(),
            rx_enabled: false,
        }
    }

    /// A UART in a saved state (registers and unread FIFO bytes), raising
    /// its interrupt on `irq` if that state has one pending. Console input
    /// held by the VMM is host-side and not part of the state.
    pub fn from_state(
        irq: EventFd,
        out: W,
        state: &vm_superio::serial::SerialState,
    ) -> io::Result<Self> {
        let uart = Uart::from_state(
            state,
            EventFdTrigger(irq),
            vm_superio::serial::NoEvents,
            out,
        )
        .map_err(io::Error::other)?;
        Ok(Serial {
            uart,
            pending: VecDeque::new(),
            rx_enabled: state.interrupt_enable & IER_RDA != 0,
        })
    }

    /// The UART's registers and unread FIFO bytes.
    pub fn state(&self) -> vm_superio::serial::SerialState {
        self.uart.state()
    }

    /// Queues console input for the guest. It reaches the guest's FIFO as
    /// soon as the guest listens; until then it waits here.
    pub fn queue_input(&mut self, bytes: &[u8]) {
        self.pending.extend(bytes);
        self.pump();
    }

    /// Bytes still waiting for the guest.
    pub fn pending_input(&self) -> usize {
        self.pending.len()
    }

    /// The writer the guest's output goes to.
    pub fn output(&mut self) -> &mut W {
        self.uart.writer_mut()
    }

    fn pump(&mut self) {
        if self.pending.is_empty() || !self.rx_enabled {
            return;
        }
        let room = self.uart.fifo_capacity().min(self.pending.len());
        if room == 0 {
            return;
        }
        let chunk: Vec<u8> = self.pending.drain(..room).collect();
        if let Err(e) = self.uart.enqueue_raw_bytes(&chunk) {
            log::warn!("serial: cannot raise the receive interrupt: {e:?}");
        }
    }

    /// IIR `iir` (as vm-superio gave it) as a 16550 reports it: received
    /// data while the FIFO holds any and the receive interrupt is enabled.
    /// vm-superio clears its receive interrupt at every read of the receive
    /// buffer, even when bytes remain; Linux reads at most 256 bytes per
    /// turn of its handler and then asks IIR whether more is to be done: a
    /// "no interrupt" there left the rest of a long command line in the
    /// FIFO until the next input came (a test's console stalled).
    fn iir_as_16550(&self, iir: u8) -> u8 {
        let st = self.uart.state();
        if iir & IIR_NONE != 0 && st.interrupt_enable & IER_RDA != 0 && !st.in_buffer.is_empty() {
            (iir & !IIR_NONE) | IIR_RDA
        } else {
            iir
        }
    }

    fn is_dlab_set(&mut self) -> bool {
        self.uart.read(LCR_OFFSET) & LCR_DLAB != 0
    }

    /// Moves bytes the guest has not read from the FIFO back to `pending`.
    /// Done when the guest stops listening (IER without RDA) or clears the
    /// receive FIFO: those bytes were only placed there speculatively, and
    /// Linux clears the FIFO and reads RX "for luck" while it opens the port.
    fn take_back(&mut self) {
        let lcr = self.uart.read(LCR_OFFSET);
        if lcr & LCR_DLAB != 0 {
            let _ = self.uart.write(LCR_OFFSET, lcr & !LCR_DLAB);
        }
        let mut unread = Vec::new();
        while self.uart.read(LSR_OFFSET) & LSR_DATA_READY != 0 {
            unread.push(self.uart.read(DATA_OFFSET));
        }
        if lcr & LCR_DLAB != 0 {
            let _ = self.uart.write(LCR_OFFSET, lcr);
        }
        for b in unread.into_iter().rev() {
            self.pending.push_front(b);
        }
    }
}

impl<W: Write + Send> BusDevice for Serial<W> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let Some(first) = data.first_mut() else {
            return;
        };
        *first = match u8::try_from(offset) {
            Ok(IIR_OFFSET) => {
                let iir = self.uart.read(IIR_OFFSET);
                self.iir_as_16550(iir)
            }
            Ok(o) if o < UART_PORTS as u8 => self.uart.read(o),
            _ => 0xff,
        };
        self.pump();
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (Some(&value), Ok(o)) = (data.first(), u8::try_from(offset)) else {
            return;
        };
        if o >= UART_PORTS as u8 {
            return;
        }
        // A FIFO clear means the guest is (re)initialising the port: hold
        // input until it enables the receive interrupt again.
        let mut stop_listening = o == FCR_OFFSET && value & FCR_CLEAR_RX != 0;
        if stop_listening {
            self.rx_enabled = false;
        }
        if o == IER_OFFSET && !self.is_dlab_set() {
            self.rx_enabled = value & IER_RDA != 0;
            stop_listening |= !self.rx_enabled;
        }
        if let Err(e) = self.uart.write(o, value) {
            log::debug!("serial: write at {o}: {e:?}");
        }
        if stop_listening {
            self.take_back();
        }
        self.pump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serial() -> (Serial<Vec<u8>>, EventFd) {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (Serial::new(irq.try_clone().unwrap(), Vec::new()), irq)
    }

    fn read_all(s: &mut Serial<Vec<u8>>) -> Vec<u8> {
        let mut got = vec![];
        loop {
            let mut lsr = [0u8];
            s.read(5, &mut lsr);
            if lsr[0] & 1 == 0 {
                return got;
            }
            let mut b = [0u8];
            s.read(0, &mut b);
            got.push(b[0]);
        }
    }

    #[test]
    fn input_waits_until_the_guest_listens_and_nothing_is_lost() {
        let (mut s, irq) = serial();
        let input: Vec<u8> = (0..200u8).collect();
        s.queue_input(&input);
        assert!(read_all(&mut s).is_empty(), "guest not listening yet");
        assert_eq!(s.pending_input(), 200);
        s.write(1, &[IER_RDA]);
        assert!(irq.read().is_ok(), "interrupt raised when enabled");
        assert_eq!(read_all(&mut s), input);
        assert_eq!(s.pending_input(), 0);
    }

    #[test]
    fn bytes_in_the_fifo_survive_a_clear_and_a_masked_ier() {
        let (mut s, _irq) = serial();
        s.write(1, &[0x0f]);
        s.queue_input(b"uname -r\n");
        // Linux opening the port: clear FIFOs, read RX for luck, mask IER.
        s.write(2, &[0x07]);
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b[0], 0, "cleared FIFO reads empty");
        s.write(1, &[0x05]);
        assert_eq!(read_all(&mut s), b"uname -r\n");
        s.queue_input(b"ab");
        s.write(1, &[0]);
        assert!(read_all(&mut s).is_empty());
        s.write(1, &[0x05]);
        assert_eq!(read_all(&mut s), b"ab");
    }

    #[test]
    fn iir_reports_received_data_while_the_fifo_holds_any() {
        let (mut s, _irq) = serial();
        s.write(1, &[IER_RDA]);
        s.queue_input(b"abc");
        let iir = |s: &mut Serial<Vec<u8>>| {
            let mut b = [0u8];
            s.read(u64::from(IIR_OFFSET), &mut b);
            b[0] & 0x0f
        };
        assert_eq!(iir(&mut s), IIR_RDA);
        // A driver that reads one byte and asks again (Linux after its
        // 256-byte turn) still finds the receive interrupt.
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b[0], b'a');
        assert_eq!(iir(&mut s), IIR_RDA, "two bytes remain");
        assert_eq!(read_all(&mut s), b"bc");
        assert_eq!(iir(&mut s), IIR_NONE, "the FIFO is empty");
        // Not with the receive interrupt disabled.
        s.write(1, &[0]);
        s.write(1, &[IER_RDA]);
        s.queue_input(b"d");
        s.write(1, &[0]);
        assert_eq!(iir(&mut s), IIR_NONE);
    }

    #[test]
    fn divisor_latch_write_does_not_enable_input() {
        let (mut s, _irq) = serial();
        s.write(3, &[0x80]); // DLAB on
        s.write(1, &[IER_RDA]); // divisor high, not IER
        s.queue_input(b"x");
        assert!(read_all(&mut s).is_empty());
        s.write(3, &[0x03]);
        s.write(1, &[IER_RDA]);
        assert_eq!(read_all(&mut s), b"x");
    }

    #[test]
    fn state_round_trip_keeps_registers_and_unread_bytes() {
        let (mut s, _irq) = serial();
        s.write(3, &[0x03]);
        s.write(1, &[IER_RDA]);
        s.queue_input(b"ab");
        let state = s.state();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut r = Serial::from_state(irq.try_clone().unwrap(), Vec::new(), &state).unwrap();
        assert!(irq.read().is_ok(), "pending RX interrupt raised again");
        assert_eq!(read_all(&mut r), b"ab");
        let mut lcr = [0u8];
        r.read(3, &mut lcr);
        assert_eq!(lcr[0], 0x03);
        r.queue_input(b"c");
        assert_eq!(read_all(&mut r), b"c", "still listening after restore");
    }

    #[test]
    fn output_and_odd_accesses() {
        let (mut s, _irq) = serial();
        s.write(0, b"h");
        s.write(0, &[]);
        s.write(99, b"x");
        let mut b = [0u8; 4];
        s.read(1000, &mut b);
        assert_eq!(b[0], 0xff);
        s.read(0, &mut []);
        assert_eq!(s.output().as_slice(), b"h");
    }
}

//! A minimal i8042 keyboard controller: only what a Linux guest needs to
//! reboot (`reboot=k` writes the pulse-reset command 0xFE to port 0x64).
//! Ports 0x60 (data) and 0x64 (status/command) are one range of 5 bytes.

use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

#[cfg(test)]
const DATA: u64 = 0;
const COMMAND: u64 = 4;
const CMD_RESET: u8 = 0xfe;

/// The controller; `reset_evt` is written when the guest asks for a reset.
pub struct I8042 {
    reset_evt: EventFd,
}

impl I8042 {
    /// A controller that signals resets on `reset_evt`.
    pub fn new(reset_evt: EventFd) -> Self {
        I8042 { reset_evt }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Data and status both read 0: no keyboard data, buffers empty.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == COMMAND && data.first() == Some(&CMD_RESET) {
            if let Err(e) = self.reset_evt.write(1) {
                log::error!("i8042: cannot signal the reset: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_signals_and_others_do_not() {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = I8042::new(evt.try_clone().unwrap());
        dev.write(COMMAND, &[0xaa]);
        dev.write(DATA, &[CMD_RESET]);
        dev.write(COMMAND, &[]);
        assert!(evt.read().is_err(), "no reset expected yet");
        dev.write(COMMAND, &[CMD_RESET]);
        assert_eq!(evt.read().unwrap(), 1);
        let mut b = [0xffu8; 2];
        dev.read(COMMAND, &mut b);
        assert_eq!(b, [0, 0]);
    }
}

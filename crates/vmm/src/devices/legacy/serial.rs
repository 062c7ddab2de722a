//! COM1: vm-superio's 16550 UART, its interrupt on an irqfd, its output to
//! the configured console (a file, a pipe, the terminal, or nowhere).

use std::io::Write;

use vm_superio::Serial;
use vm_superio::serial::NoEvents;

use crate::devices::IrqLine;
use crate::devices::bus::BusDevice;

/// The console UART.
pub struct SerialConsole {
    uart: Serial<IrqLine, NoEvents, Box<dyn Write + Send>>,
}

impl std::fmt::Debug for SerialConsole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialConsole").finish_non_exhaustive()
    }
}

impl SerialConsole {
    /// A UART raising `irq` and writing what the guest sends to `out`.
    pub fn new(irq: IrqLine, out: Box<dyn Write + Send>) -> Self {
        Self { uart: Serial::new(irq, out) }
    }

    /// Feeds host input to the guest; returns how many bytes fit the FIFO.
    pub fn enqueue_input(&mut self, input: &[u8]) -> usize {
        match self.uart.enqueue_raw_bytes(input) {
            Ok(n) => n,
            Err(e) => {
                crate::guest_triggered!(warn, "Console input dropped: {e:?}");
                0
            }
        }
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let Ok(offset) = u8::try_from(offset) else { return };
        if let Some(first) = data.first_mut() {
            *first = self.uart.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (Ok(offset), Some(&value)) = (u8::try_from(offset), data.first()) else { return };
        if let Err(e) = self.uart.write(offset, value) {
            // A closed console must not stop the guest; say it once per byte
            // at debug level only, as a guest can write a lot.
            tracing::debug!("Console output lost: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn transmits_to_the_console_and_receives_input() {
        let out = Shared::default();
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let irq_probe = irq.try_clone().expect("eventfd clone");
        let mut serial = SerialConsole::new(IrqLine(irq), Box::new(out.clone()));
        for b in b"hi" {
            serial.write(0, &[*b]);
        }
        assert_eq!(out.0.lock().expect("not poisoned").as_slice(), b"hi");
        // Enable the received-data interrupt (IER bit 0), then feed input.
        serial.write(1, &[1]);
        assert_eq!(serial.enqueue_input(b"x"), 1);
        assert!(irq_probe.read().is_ok(), "input raised the interrupt");
        let mut lsr = [0u8];
        serial.read(5, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "data ready");
        let mut rbr = [0u8];
        serial.read(0, &mut rbr);
        assert_eq!(rbr[0], b'x');
    }
}

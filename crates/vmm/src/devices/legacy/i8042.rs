//! A minimal i8042 keyboard controller: enough for Linux's driver to probe
//! it, for the guest to reset the machine (command 0xfe, how Linux reboots
//! with `reboot=k`), and for the host to press Ctrl+Alt+Del — the graceful
//! shutdown request a Linux guest understands without any agent of its own.

use std::collections::VecDeque;

use vm_superio::Trigger;

use crate::devices::bus::BusDevice;
use crate::devices::{EventTrigger, IrqLine};

const OFFSET_DATA: u64 = 0;
const OFFSET_COMMAND: u64 = 4;

const STATUS_OUTPUT_FULL: u8 = 0x01;
const STATUS_SYSTEM: u8 = 0x04;
const STATUS_LAST_WAS_COMMAND: u8 = 0x08;
const STATUS_KEYBOARD_UNLOCKED: u8 = 0x10;

const CMD_READ_CONFIG: u8 = 0x20;
const CMD_WRITE_CONFIG: u8 = 0x60;
const CMD_DISABLE_AUX: u8 = 0xa7;
const CMD_ENABLE_AUX: u8 = 0xa8;
const CMD_TEST_AUX: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_TEST_KEYBOARD: u8 = 0xab;
const CMD_DISABLE_KEYBOARD: u8 = 0xad;
const CMD_ENABLE_KEYBOARD: u8 = 0xae;
const CMD_READ_INPUT_PORT: u8 = 0xc0;
const CMD_READ_OUTPUT_PORT: u8 = 0xd0;
const CMD_WRITE_OUTPUT_PORT: u8 = 0xd1;
const CMD_RESET_CPU: u8 = 0xfe;

/// Configuration byte bit 0: raise IRQ 1 when the keyboard has data.
const CONFIG_KEYBOARD_INTERRUPT: u8 = 0x01;

const KBD_ACK: u8 = 0xfa;
const KBD_RESET: u8 = 0xff;
const KBD_SELF_TEST_PASSED: u8 = 0xaa;
const KBD_IDENTIFY: u8 = 0xf2;
/// Commands followed by one parameter byte (LEDs, typematic rate, scan set).
const KBD_COMMANDS_WITH_PARAMETER: [u8; 3] = [0xed, 0xf0, 0xf3];

/// The most bytes waiting for the guest to read. A real keyboard buffers
/// 16; a guest that writes commands without reading their answers (in a
/// loop, to make the host hold its answers) loses what does not fit.
const OUTPUT_CAP: usize = 16;

/// Ctrl, Alt, Delete as scan code set 2 make codes, which Linux's atkbd
/// decodes (the controller does not translate).
const CTRL_ALT_DEL: [&[u8]; 3] = [&[0x14], &[0x11], &[0xe0, 0x71]];

/// The keyboard controller.
#[derive(Debug)]
pub struct I8042 {
    reset: EventTrigger,
    irq: IrqLine,
    config: u8,
    status: u8,
    output: VecDeque<u8>,
    /// A controller command waiting for its data byte.
    pending_command: Option<u8>,
    /// A keyboard command waiting for its parameter byte.
    pending_keyboard_parameter: bool,
}

impl I8042 {
    /// A controller that signals `reset` on a reset command and raises `irq`
    /// when the keyboard has something for the guest.
    pub fn new(reset: EventTrigger, irq: IrqLine) -> Self {
        Self {
            reset,
            irq,
            config: CONFIG_KEYBOARD_INTERRUPT,
            status: STATUS_SYSTEM | STATUS_KEYBOARD_UNLOCKED,
            output: VecDeque::new(),
            pending_command: None,
            pending_keyboard_parameter: false,
        }
    }

    /// Presses Ctrl+Alt+Del. What the guest left unread goes, so that the
    /// keys always fit.
    pub fn press_ctrl_alt_del(&mut self) {
        self.output.clear();
        for key in CTRL_ALT_DEL {
            self.output.extend(key);
        }
        self.raise();
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = OUTPUT_CAP.saturating_sub(self.output.len());
        self.output.extend(bytes.iter().take(room));
        self.raise();
    }

    fn raise(&mut self) {
        if self.output.is_empty() {
            self.status &= !STATUS_OUTPUT_FULL;
            return;
        }
        self.status |= STATUS_OUTPUT_FULL;
        if self.config & CONFIG_KEYBOARD_INTERRUPT != 0
            && let Err(e) = self.irq.trigger()
        {
            crate::guest_triggered!(warn, "Cannot raise the keyboard interrupt: {e}");
        }
    }

    fn command(&mut self, command: u8) {
        self.status |= STATUS_LAST_WAS_COMMAND;
        match command {
            CMD_READ_CONFIG => self.push(&[self.config]),
            CMD_WRITE_CONFIG | CMD_WRITE_OUTPUT_PORT => self.pending_command = Some(command),
            CMD_SELF_TEST => self.push(&[0x55]),
            CMD_TEST_KEYBOARD | CMD_TEST_AUX => self.push(&[0x00]),
            CMD_READ_INPUT_PORT => self.push(&[0x00]),
            CMD_READ_OUTPUT_PORT => self.push(&[0x01]),
            CMD_DISABLE_KEYBOARD | CMD_ENABLE_KEYBOARD | CMD_DISABLE_AUX | CMD_ENABLE_AUX => {}
            CMD_RESET_CPU => {
                if let Err(e) = self.reset.trigger() {
                    crate::guest_triggered!(error, "Cannot signal the guest's reset request: {e}");
                }
            }
            _ => tracing::debug!("i8042: ignoring controller command {command:#x}"),
        }
    }

    fn data(&mut self, value: u8) {
        self.status &= !STATUS_LAST_WAS_COMMAND;
        match self.pending_command.take() {
            Some(CMD_WRITE_CONFIG) => {
                self.config = value;
                return;
            }
            Some(_) => return,
            None => {}
        }
        if std::mem::take(&mut self.pending_keyboard_parameter) {
            self.push(&[KBD_ACK]);
            return;
        }
        match value {
            KBD_RESET => self.push(&[KBD_ACK, KBD_SELF_TEST_PASSED]),
            KBD_IDENTIFY => self.push(&[KBD_ACK, 0xab, 0x83]),
            v if KBD_COMMANDS_WITH_PARAMETER.contains(&v) => {
                self.pending_keyboard_parameter = true;
                self.push(&[KBD_ACK]);
            }
            _ => self.push(&[KBD_ACK]),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let Some(first) = data.first_mut() else { return };
        *first = match offset {
            OFFSET_DATA => {
                let byte = self.output.pop_front().unwrap_or(0);
                self.raise();
                byte
            }
            OFFSET_COMMAND => self.status,
            _ => 0,
        };
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        match offset {
            OFFSET_DATA => self.data(value),
            OFFSET_COMMAND => self.command(value),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    fn controller() -> (I8042, EventFd, EventFd) {
        let reset = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let probes = (reset.try_clone().expect("clone"), irq.try_clone().expect("clone"));
        (I8042::new(EventTrigger(reset), IrqLine(irq)), probes.0, probes.1)
    }

    fn read(dev: &mut I8042, offset: u64) -> u8 {
        let mut b = [0u8];
        dev.read(offset, &mut b);
        b[0]
    }

    #[test]
    fn reset_command_signals_the_vmm() {
        let (mut dev, reset, _) = controller();
        assert!(reset.read().is_err(), "nothing yet");
        dev.write(OFFSET_COMMAND, &[CMD_RESET_CPU]);
        assert_eq!(reset.read().expect("signalled"), 1);
    }

    #[test]
    fn answers_the_linux_probe() {
        let (mut dev, _, _) = controller();
        dev.write(OFFSET_COMMAND, &[CMD_SELF_TEST]);
        assert_eq!(read(&mut dev, OFFSET_COMMAND) & STATUS_OUTPUT_FULL, 1);
        assert_eq!(read(&mut dev, OFFSET_DATA), 0x55);
        assert_eq!(read(&mut dev, OFFSET_COMMAND) & STATUS_OUTPUT_FULL, 0);
        dev.write(OFFSET_COMMAND, &[CMD_WRITE_CONFIG]);
        dev.write(OFFSET_DATA, &[0x47]);
        dev.write(OFFSET_COMMAND, &[CMD_READ_CONFIG]);
        assert_eq!(read(&mut dev, OFFSET_DATA), 0x47);
        dev.write(OFFSET_DATA, &[KBD_RESET]);
        assert_eq!((read(&mut dev, OFFSET_DATA), read(&mut dev, OFFSET_DATA)), (KBD_ACK, KBD_SELF_TEST_PASSED));
        dev.write(OFFSET_DATA, &[0xed]);
        dev.write(OFFSET_DATA, &[0x02]);
        assert_eq!((read(&mut dev, OFFSET_DATA), read(&mut dev, OFFSET_DATA)), (KBD_ACK, KBD_ACK));
    }

    #[test]
    fn a_guest_that_never_reads_makes_the_host_hold_no_more_than_a_keyboard_would() {
        let (mut dev, _, _) = controller();
        for _ in 0..100_000 {
            dev.write(OFFSET_DATA, &[KBD_RESET]);
            dev.write(OFFSET_COMMAND, &[CMD_SELF_TEST]);
        }
        assert_eq!(dev.output.len(), OUTPUT_CAP);
        assert_eq!((read(&mut dev, OFFSET_DATA), read(&mut dev, OFFSET_DATA)), (KBD_ACK, KBD_SELF_TEST_PASSED));
        // The host's Ctrl+Alt+Del still gets through, whole.
        dev.press_ctrl_alt_del();
        let keys: Vec<u8> = (0..4).map(|_| read(&mut dev, OFFSET_DATA)).collect();
        assert_eq!(keys, [0x14, 0x11, 0xe0, 0x71]);
        assert_eq!(read(&mut dev, OFFSET_COMMAND) & STATUS_OUTPUT_FULL, 0);
    }

    #[test]
    fn ctrl_alt_del_is_queued_with_an_interrupt() {
        let (mut dev, _, irq) = controller();
        dev.press_ctrl_alt_del();
        assert!(irq.read().is_ok());
        let keys: Vec<u8> = (0..4).map(|_| read(&mut dev, OFFSET_DATA)).collect();
        assert_eq!(keys, [0x14, 0x11, 0xe0, 0x71]);
        assert_eq!(read(&mut dev, OFFSET_COMMAND) & STATUS_OUTPUT_FULL, 0);
    }
}

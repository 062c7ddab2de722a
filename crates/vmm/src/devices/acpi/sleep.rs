//! The FADT's sleep control register (hardware-reduced ACPI, ACPI 6.5 §4.8.3.7).
//!
//! Linux powers off by writing `SLP_EN | SLP_TYP` here, with `SLP_TYP` from
//! the DSDT's `_S5_` object; the VMM then ends the VM as a clean shutdown.

use vm_superio::Trigger;

use crate::devices::EventTrigger;
use crate::devices::bus::BusDevice;

/// `SLP_TYP` of the S5 (soft off) state, as the DSDT's `_S5_` says.
pub const S5_SLEEP_TYPE: u8 = 5;
const SLP_EN: u8 = 1 << 5;

/// The register, at `layout::ACPI_SLEEP_PORT`.
#[derive(Debug)]
pub struct SleepControl {
    poweroff: EventTrigger,
}

impl SleepControl {
    /// A register that signals `poweroff` when the guest enters S5.
    pub fn new(poweroff: EventTrigger) -> Self {
        Self { poweroff }
    }
}

impl BusDevice for SleepControl {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status: never asleep, so WAK_STS is clear.
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        if value & SLP_EN != 0
            && (value >> 2) & 0x7 == S5_SLEEP_TYPE
            && let Err(e) = self.poweroff.trigger()
        {
            crate::guest_triggered!(error, "Cannot signal the guest's power-off: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    #[test]
    fn s5_with_slp_en_powers_off() {
        let evt = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut dev = SleepControl::new(EventTrigger(evt.try_clone().expect("clone")));
        dev.write(0, &[S5_SLEEP_TYPE << 2]);
        assert!(evt.read().is_err(), "SLP_EN not set: nothing");
        dev.write(0, &[(3 << 2) | SLP_EN]);
        assert!(evt.read().is_err(), "S3 is not power-off");
        dev.write(0, &[(S5_SLEEP_TYPE << 2) | SLP_EN]);
        assert_eq!(evt.read().expect("signalled"), 1);
    }
}

//! ACPI tables, generated with `acpi_tables`: RSDP → XSDT → FADT
//! (hardware-reduced, with the DSDT and the sleep control register), MADT
//! (a local APIC per vCPU, the IOAPIC), and a DSDT describing COM1, the
//! i8042, each virtio-mmio device (`LNRO0005`, its window and interrupt) and
//! the S5 state. Debian's kernel has no `virtio_mmio.device=` command-line
//! support, so the DSDT is how it finds virtio devices.

use acpi_tables::Aml;
use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, LocalInterruptController, MADT, ProcessorLocalApic};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::sleep::S5_SLEEP_TYPE;
use crate::arch::x86_64::layout::{
    ACPI_END, ACPI_SLEEP_PORT, ACPI_START, I8042_IRQ, I8042_PORT, IOAPIC_ADDR, LAPIC_ADDR, SERIAL_IRQ, SERIAL_PORT,
    SERIAL_PORT_LEN, VIRTIO_MMIO_SIZE,
};

const OEM_ID: [u8; 6] = *b"MOAT  ";
const OEM_REVISION: u32 = 1;
/// FADT IA-PC boot architecture flags: an 8042 is present (bit 1), no VGA
/// (bit 2), no MSI (bit 3: there is no PCI), no ASPM control (bit 4), no
/// CMOS RTC (bit 5: otherwise Linux's rtc_cmos probes ports 0x70/0x71, an
/// exit each, for seconds under nested virtualization; the guest reads the
/// wall clock from kvmclock instead).
const IAPC_BOOT_ARCH: u16 = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5);
/// "MOATVMM" as the FADT's hypervisor vendor identity.
const HYPERVISOR_VENDOR: u64 = u64::from_le_bytes(*b"MOATVMM\0");

/// A virtio-mmio device as the guest must be told about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmioDevice {
    pub base: u64,
    pub irq: u32,
}

/// Why the tables could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("The ACPI tables ({size} bytes) do not fit their {room}-byte area")]
    TooLarge { size: u64, room: u64 },
    #[error("Cannot write the ACPI tables into guest memory")]
    Write(#[source] vm_memory::GuestMemoryError),
}

/// The tables, each with its guest address.
#[derive(Debug, Clone)]
pub struct AcpiTables {
    pub rsdp: u64,
    pub tables: Vec<(u64, Vec<u8>)>,
}

impl AcpiTables {
    /// Builds the tables for `vcpus` vCPUs and `virtio` devices.
    pub fn new(vcpus: u8, virtio: &[VirtioMmioDevice]) -> Result<Self, AcpiError> {
        let mut next = ACPI_START;
        let mut place = |len: usize| {
            let addr = next;
            next = (next + len as u64 + 15) & !15;
            addr
        };
        let rsdp_addr = place(Rsdp::len());
        let dsdt = dsdt(virtio);
        let dsdt_addr = place(dsdt.len());
        let fadt = bytes(&fadt(dsdt_addr));
        let fadt_addr = place(fadt.len());
        let madt = bytes(&madt(vcpus));
        let madt_addr = place(madt.len());
        let mut xsdt = XSDT::new(OEM_ID, *b"MOATXSDT", OEM_REVISION);
        xsdt.add_entry(fadt_addr);
        xsdt.add_entry(madt_addr);
        let xsdt = bytes(&xsdt);
        let xsdt_addr = place(xsdt.len());
        if next > ACPI_END {
            return Err(AcpiError::TooLarge { size: next - ACPI_START, room: ACPI_END - ACPI_START });
        }
        let rsdp = bytes(&Rsdp::new(OEM_ID, xsdt_addr));
        Ok(Self {
            rsdp: rsdp_addr,
            tables: vec![(rsdp_addr, rsdp), (dsdt_addr, dsdt), (fadt_addr, fadt), (madt_addr, madt), (xsdt_addr, xsdt)],
        })
    }

    /// Copies the tables into guest memory.
    pub fn write(&self, mem: &GuestMemoryMmap) -> Result<(), AcpiError> {
        for (addr, table) in &self.tables {
            mem.write_slice(table, GuestAddress(*addr)).map_err(AcpiError::Write)?;
        }
        Ok(())
    }

    /// The table with `signature` (`b"DSDT"`, …; `b"RSD "` for the RSDP).
    pub fn find(&self, signature: &[u8; 4]) -> Option<&[u8]> {
        self.tables.iter().map(|(_, t)| t.as_slice()).find(|t| t.starts_with(signature))
    }
}

fn bytes(table: &dyn Aml) -> Vec<u8> {
    let mut out = Vec::new();
    table.to_aml_bytes(&mut out);
    out
}

fn fadt(dsdt_addr: u64) -> acpi_tables::fadt::FADT {
    let mut fadt = FADTBuilder::new(OEM_ID, *b"MOATFACP", OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        // No fixed-feature buttons: a power button would be a device.
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    let sleep = GAS::new(AddressSpace::SystemIo, 8, 0, AccessSize::ByteAccess, u64::from(ACPI_SLEEP_PORT));
    fadt.sleep_control_reg = sleep;
    fadt.sleep_status_reg = sleep;
    fadt.hypervisor_vendor_identity = HYPERVISOR_VENDOR.into();
    fadt.finalize()
}

fn madt(vcpus: u8) -> MADT {
    let lapic = u32::try_from(LAPIC_ADDR).unwrap_or_default();
    let mut madt = MADT::new(OEM_ID, *b"MOATMADT", OEM_REVISION, LocalInterruptController::Address(lapic));
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(0, u32::try_from(IOAPIC_ADDR).unwrap_or_default(), 0));
    madt
}

/// The DSDT's AML.
pub fn dsdt(virtio: &[VirtioMmioDevice]) -> Vec<u8> {
    // Each object is serialized in the statement that builds it: the AML
    // builders borrow their children, which are temporaries.
    let mut devices = Vec::new();
    aml::Device::new(
        "COM1".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::IO::new(SERIAL_PORT, SERIAL_PORT, 1, u8::try_from(SERIAL_PORT_LEN).unwrap_or(8)),
                    &aml::Interrupt::new(true, true, false, false, SERIAL_IRQ),
                ]),
            ),
        ],
    )
    .to_aml_bytes(&mut devices);
    aml::Device::new(
        "PS2_".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0303")),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::IO::new(I8042_PORT, I8042_PORT, 1, 1),
                    &aml::IO::new(I8042_PORT + 4, I8042_PORT + 4, 1, 1),
                    &aml::Interrupt::new(true, true, false, false, I8042_IRQ),
                ]),
            ),
        ],
    )
    .to_aml_bytes(&mut devices);
    let window = u32::try_from(VIRTIO_MMIO_SIZE).unwrap_or_default();
    for (index, device) in virtio.iter().enumerate() {
        let hid: &'static str = "LNRO0005";
        aml::Device::new(
            format!("V{index:03X}").as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &hid),
                &aml::Name::new("_UID".into(), &index),
                &aml::Name::new("_CCA".into(), &aml::ONE),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![
                        &aml::Memory32Fixed::new(true, u32::try_from(device.base).unwrap_or_default(), window),
                        // Edge-triggered: virtio-mmio interrupts are irqfd pulses.
                        &aml::Interrupt::new(true, true, false, false, device.irq),
                    ]),
                ),
            ],
        )
        .to_aml_bytes(&mut devices);
    }
    let mut body = aml::Scope::raw("_SB_".into(), devices);
    aml::Name::new("_S5_".into(), &aml::Package::new(vec![&S5_SLEEP_TYPE])).to_aml_bytes(&mut body);
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, *b"MOATDSDT", OEM_REVISION);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checksum_ok(table: &[u8]) -> bool {
        table.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
    }

    fn u32_at(t: &[u8], o: usize) -> u32 {
        u32::from_le_bytes(t[o..o + 4].try_into().expect("4 bytes"))
    }

    fn u64_at(t: &[u8], o: usize) -> u64 {
        u64::from_le_bytes(t[o..o + 8].try_into().expect("8 bytes"))
    }

    fn devices() -> Vec<VirtioMmioDevice> {
        vec![VirtioMmioDevice { base: 0xd000_0000, irq: 5 }, VirtioMmioDevice { base: 0xd000_1000, irq: 6 }]
    }

    #[test]
    fn every_table_checksums_and_has_its_length() {
        let acpi = AcpiTables::new(2, &devices()).expect("tables fit");
        for (addr, table) in &acpi.tables {
            assert!(*addr >= ACPI_START && addr + table.len() as u64 <= ACPI_END);
            if table.starts_with(b"RSD PTR ") {
                assert!(checksum_ok(&table[..20]), "RSDP v1 checksum");
                assert!(checksum_ok(table), "RSDP extended checksum");
            } else {
                assert!(checksum_ok(table), "{:?}", String::from_utf8_lossy(&table[..4]));
                assert_eq!(u32_at(table, 4) as usize, table.len(), "length field");
            }
        }
    }

    #[test]
    fn tables_point_at_each_other() {
        let acpi = AcpiTables::new(1, &[]).expect("tables fit");
        let (rsdp_addr, rsdp) = &acpi.tables[0];
        assert_eq!(*rsdp_addr, acpi.rsdp);
        assert_eq!(rsdp[15], 2, "ACPI 2.0+ RSDP");
        let xsdt_addr = u64_at(rsdp, 24);
        let by_addr = |a: u64| acpi.tables.iter().find(|(addr, _)| *addr == a).map(|(_, t)| t.as_slice());
        let xsdt = by_addr(xsdt_addr).expect("RSDP points at the XSDT");
        assert!(xsdt.starts_with(b"XSDT"));
        let entries: Vec<_> = (36..xsdt.len()).step_by(8).map(|o| by_addr(u64_at(xsdt, o))).collect();
        let sigs: Vec<_> = entries.iter().map(|t| t.map(|t| &t[..4])).collect();
        assert_eq!(sigs, vec![Some(&b"FACP"[..]), Some(&b"APIC"[..])]);
        let fadt = entries[0].expect("FADT present");
        assert_ne!(u32_at(fadt, 112) & (1 << 20), 0, "hardware-reduced ACPI");
        let dsdt = by_addr(u64_at(fadt, 140)).expect("X_DSDT points at the DSDT");
        assert!(dsdt.starts_with(b"DSDT"));
    }

    #[test]
    fn madt_lists_each_vcpu_and_the_ioapic() {
        let acpi = AcpiTables::new(3, &[]).expect("tables fit");
        let madt = acpi.find(b"APIC").expect("MADT present");
        assert_eq!(u32_at(madt, 36), 0xfee0_0000);
        let mut lapics = Vec::new();
        let mut ioapics = Vec::new();
        let mut o = 44;
        while o < madt.len() {
            match madt[o] {
                0 => lapics.push((madt[o + 2], madt[o + 3], u32_at(madt, o + 4))),
                1 => ioapics.push(u32_at(madt, o + 4)),
                t => panic!("unexpected MADT entry type {t}"),
            }
            o += usize::from(madt[o + 1]);
        }
        assert_eq!(lapics, vec![(0, 0, 1), (1, 1, 1), (2, 2, 1)]);
        assert_eq!(ioapics, vec![0xfec0_0000]);
    }

    #[test]
    fn dsdt_names_virtio_devices_and_the_serial_port() {
        let dsdt = dsdt(&devices());
        let has = |needle: &[u8]| dsdt.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"LNRO0005"));
        assert!(has(b"V000") && has(b"V001"));
        assert!(has(b"COM1") && has(b"PS2_") && has(b"_S5_"));
        // Memory32Fixed descriptor (0x86) with the second device's window.
        let mut window = vec![0x86, 9, 0, 1];
        window.extend_from_slice(&0xd000_1000u32.to_le_bytes());
        window.extend_from_slice(&0x1000u32.to_le_bytes());
        assert!(has(&window));
        // Extended interrupt descriptor for IRQ 6, edge-triggered consumer.
        assert!(has(&[0x89, 6, 0, 0x03, 1, 6, 0, 0, 0]));
    }

    #[test]
    fn tables_fit_with_every_ioapic_pin_used() {
        let many: Vec<_> = (0..19)
            .map(|i| {
                let (base, irq) = crate::arch::x86_64::layout::virtio_mmio_slot(i).expect("slot");
                VirtioMmioDevice { base, irq }
            })
            .collect();
        AcpiTables::new(8, &many).expect("the ACPI area holds the largest machine");
    }

    /// `iasl -d` disassembles the tables: proof they parse as ACPI.
    #[test]
    #[ignore = "needs iasl (Debian acpica-tools); cargo xtask test provides it"]
    fn iasl_disassembles_the_tables() {
        let dir = tempfile::tempdir().expect("temp dir");
        let acpi = AcpiTables::new(2, &devices()).expect("tables fit");
        for sig in [b"DSDT", b"FACP", b"APIC", b"XSDT"] {
            let table = acpi.find(sig).expect("table present");
            let name = String::from_utf8_lossy(sig).to_lowercase();
            let path = dir.path().join(format!("{name}.dat"));
            std::fs::write(&path, table).expect("written");
            let out = std::process::Command::new("iasl")
                .arg("-d")
                .arg(&path)
                .current_dir(dir.path())
                .output()
                .expect("iasl runs (apt-get install acpica-tools)");
            let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "iasl -d {name}: {log}");
            let dsl = std::fs::read_to_string(dir.path().join(format!("{name}.dsl"))).expect("iasl wrote a .dsl");
            assert!(!log.contains("Error") && !dsl.contains("**** ACPI table terminates"), "{log}\n{dsl}");
            if sig == b"DSDT" {
                for needle in ["LNRO0005", "PNP0501", "0xD0001000", "_S5_"] {
                    assert!(dsl.contains(needle), "DSDT lacks {needle}:\n{dsl}");
                }
            }
        }
    }
}

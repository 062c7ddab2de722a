//! ACPI: the tables that describe the machine to the guest, and the sleep
//! control register through which a hardware-reduced ACPI guest powers off.

pub mod sleep;
pub mod tables;

pub use sleep::SleepControl;
pub use tables::{AcpiTables, VirtioMmioDevice};

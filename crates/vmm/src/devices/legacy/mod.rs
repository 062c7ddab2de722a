//! Legacy PC devices on port I/O: the 16550 console and the i8042.

pub mod i8042;
pub mod serial;

pub use i8042::I8042;
pub use serial::SerialConsole;

//! `moat-vmm`: one microVM per process. Not built yet (issue M5).

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("moat-vmm: the microVM monitor is not part of this build yet; sandboxes use the jail backend");
    ExitCode::from(2)
}

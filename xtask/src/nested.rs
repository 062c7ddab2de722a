//! `cargo xtask nested`: the nested test host (crates/nested) from the
//! command line: run a command in level 1, open a level-1 shell, or measure
//! level-1 and level-2 boots.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
use moat_core::image::{Image, data_dir};
use moat_nested::{Bundle, Machine, Payload, Sources, Stage, Timeouts, level2};

use crate::host::{BASE_PACKAGES, cargo, ensure_packages, root, run};
use crate::{build, image};

/// What level 1 is built from, beyond the base packages.
pub const NESTED_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "qemu-system-x86_64"),
    // The level-1 userland; the dynamic `busybox` package will not do.
    ("busybox-static", "busybox"),
    // mkfs.ext4 -d makes the bundle disk without root or loop devices.
    ("e2fsprogs", "mkfs.ext4"),
];

/// The host-side moat binaries level 1 gets (debug builds: what the tests build).
const HOST_BINARIES: &[&str] = &["moat", "moat-mcp", "moat-vmm"];

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run CMD in level 1 (moat binaries on PATH, the image at the default
    /// data directory) and exit with its status.
    Run {
        /// Seconds the command may run.
        #[arg(long, default_value_t = 1800)]
        timeout: u64,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// An interactive level-1 shell on this terminal (`exit` or Ctrl-A X ends it).
    Shell,
    /// Measure level 1's boot and level-2 boots under QEMU microvm in level 1.
    Bench {
        /// Level-2 boots, one after another in one level 1.
        #[arg(long, default_value_t = 5)]
        runs: u32,
        /// The level-2 QEMU machine (default: moat_nested::level2::MACHINE).
        #[arg(long)]
        machine: Option<String>,
        /// The level-2 kernel command line (default: moat_nested::level2::CMDLINE).
        #[arg(long)]
        cmdline: Option<String>,
        /// Boot level 2 under moat-vmm too, alternating with QEMU (same
        /// kernel, initramfs, disk and command line), and print the ratio.
        #[arg(long)]
        moat_vmm: bool,
    },
}

pub fn main(command: Command) -> ExitCode {
    let result = match command {
        Command::Run { timeout, command } => run_command(command, timeout),
        Command::Shell => prepare().and_then(|b| Ok(moat_nested::shell_in(&b, Machine::default())?)),
        Command::Bench { runs, machine, cmdline, moat_vmm } => bench(
            runs,
            machine.as_deref().unwrap_or(level2::MACHINE),
            cmdline.as_deref().unwrap_or(level2::CMDLINE),
            moat_vmm,
        )
        .map(|()| 0),
    };
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Host packages, the static agent, the debug host binaries, the image (only
/// when there is none: a current one is used as it is, and `cargo xtask
/// image` refreshes it), then the level-1 bundle.
pub fn prepare() -> Result<Bundle> {
    ensure_packages(BASE_PACKAGES)?;
    ensure_packages(NESTED_PACKAGES)?;
    let agent = build::static_agent()?;
    host_binaries()?;
    if Image::open(&data_dir(), "default").is_err() {
        image::build("default", false)?;
    }
    let mut sources = Sources::from_env()?;
    sources.agent = agent;
    // The debug host binaries, unless MOAT_BIN_DIR names others (a
    // release build's, to measure).
    sources.bin_dir = std::env::var_os("MOAT_BIN_DIR").map_or_else(|| root().join("target/debug"), Into::into);
    sources.cache_dir = root().join("target/nested");
    eprintln!("preparing the level-1 bundle under {}", sources.cache_dir.display());
    Ok(moat_nested::bundle::prepare(&sources)?)
}

/// Builds the debug host binaries level 1 gets.
pub fn host_binaries() -> Result<()> {
    let mut command = cargo();
    command.arg("build");
    for bin in HOST_BINARIES {
        command.args(["--bin", bin]);
    }
    run(&mut command)
}

fn run_command(command: Vec<String>, timeout: u64) -> Result<i32> {
    let bundle = prepare()?;
    let timeouts = Timeouts { finish: Duration::from_secs(timeout), ..Timeouts::default() };
    let out = moat_nested::run_in(&bundle, &Payload::new(command).timeouts(timeouts).echo(true))?;
    Ok(out.code)
}

#[allow(clippy::print_stdout)]
fn bench(runs: u32, machine: &str, cmdline: &str, with_moat_vmm: bool) -> Result<()> {
    let bundle = prepare()?;
    let mut boots = vec![level2::Boot::qemu_microvm(machine, cmdline)];
    if with_moat_vmm {
        boots.push(level2::Boot::moat_vmm(cmdline));
    }
    let out = moat_nested::run_in(&bundle, &level2::boots(runs, &boots))?;
    let times = level2::boot_times(&out, "qemu")?;
    let at = |stage| out.reached(stage).map_or_else(|| "-".into(), |d: Duration| format!("{:.2} s", d.as_secs_f64()));
    println!(
        "level 1 (QEMU TCG -cpu max, microvm, {} MiB, {} vCPUs):",
        Machine::default().memory_mib,
        Machine::default().cpus
    );
    println!("  booted (/init reports)      {}", at(Stage::Booted));
    println!("  KVM working                 {}", at(Stage::Kvm));
    println!("level 2 (QEMU microvm -accel kvm in level 1, to the agent's last boot line), {runs} runs:");
    println!("  -M {machine}, kernel command line: {cmdline}");
    for (i, t) in times.iter().enumerate() {
        println!("  run {}                       {:.2} s", i + 1, t.as_secs_f64());
    }
    let mut sorted = times.clone();
    sorted.sort_unstable();
    let median = sorted.get(sorted.len() / 2).context("no level-2 boot")?;
    println!("  median                      {:.2} s", median.as_secs_f64());
    if with_moat_vmm {
        let ours = level2::boot_times(&out, "moat-vmm")?;
        let mut sorted = ours.clone();
        sorted.sort_unstable();
        let ours_median = sorted.get(sorted.len() / 2).context("no moat-vmm boot")?;
        println!(
            "level 2 under moat-vmm in the same level 1, alternating with QEMU (same kernel, initramfs, disk, command line):"
        );
        for (i, t) in ours.iter().enumerate() {
            println!("  run {}                       {:.2} s", i + 1, t.as_secs_f64());
        }
        println!("  median                      {:.2} s", ours_median.as_secs_f64());
        println!("  ratio moat-vmm / QEMU       {:.2}", ours_median.as_secs_f64() / median.as_secs_f64());
    }
    Ok(())
}

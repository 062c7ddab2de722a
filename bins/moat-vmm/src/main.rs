//! `moat-vmm`: one KVM microVM per process.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{CommandFactory, Parser};
use moat_vmm::arch::x86_64::boot::BootError;
use moat_vmm::builder::{BuildError, build_microvm_on};
use moat_vmm::config::{self, ConfigError, DiskConfig, NetConfig, VmConfig, VsockConfig};
use moat_vmm::jail::{self, Ended, Jail, JailError, Side};
use moat_vmm::vstate::vm::{Kvm, open_kvm};

/// Exit status for an invalid configuration (clap's usage errors use it too).
const EXIT_CONFIG: u8 = 2;
/// Exit status when the VM could not be built or failed.
const EXIT_FAILURE: u8 = 1;

#[derive(Debug, Parser)]
#[command(
    name = "moat-vmm",
    version,
    about = "Runs one KVM microVM: moat's minimal rust-vmm monitor.",
    long_about = "Runs one KVM microVM: moat's minimal rust-vmm monitor.\n\n\
        Configure it with a JSON file (--config), flags, or both (flags win). \
        The guest's serial console goes to --console; the VM is driven through \
        the JSON-lines --control-socket (status, pause, resume, shutdown). \
        See docs/vmm.md for the configuration format and the protocols.",
    after_help = "Exit status: 0 when the guest powers off, reboots or is shut down on request; \
        1 when the VM cannot be built or fails (the reason is printed); \
        2 when the configuration is invalid (one line names the field).\n\n\
        Example:\n  moat-vmm --kernel vmlinux --initramfs initramfs.cpio.gz --memory-mib 512 \\\n    \
        --console file:/tmp/console.log --control-socket /tmp/vm.sock"
)]
struct Args {
    /// JSON configuration file (fields as in docs/vmm.md); flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Guest kernel: ELF vmlinux (entered by its PVH note when present) or bzImage.
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initramfs to load.
    #[arg(long, value_name = "PATH")]
    initramfs: Option<PathBuf>,
    /// Kernel command line [default: "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux"].
    #[arg(long, value_name = "TEXT")]
    cmdline: Option<String>,
    /// Number of vCPUs, 1 to 8 [default: 1].
    #[arg(long, value_name = "N")]
    vcpus: Option<u8>,
    /// Guest memory in MiB [default: 256].
    #[arg(long, value_name = "MIB")]
    memory_mib: Option<u32>,
    /// A disk image, repeated for more disks (vda, vdb, …). Options after
    /// commas: `ro` (read-only), `overlay=FILE` (copy-on-write: PATH is a
    /// read-only base, writes land in FILE), `overlay_limit_mib=N` (the most
    /// the overlay holds). `PATH:ro` is read-only too.
    #[arg(long = "disk", value_name = "PATH[,ro][,overlay=FILE][,overlay_limit_mib=N]")]
    disks: Vec<String>,
    /// Guest vsock context id (3 or more); needs --vsock-uds.
    #[arg(long, value_name = "CID", requires = "vsock_uds")]
    vsock_cid: Option<u32>,
    /// Host Unix socket behind the guest's vsock (Firecracker's protocol:
    /// `CONNECT <port>` to reach the guest, `<path>_<port>` for the guest's
    /// connections to the host).
    #[arg(long, value_name = "PATH", requires = "vsock_cid")]
    vsock_uds: Option<PathBuf>,
    /// The host ports the guest may connect to over vsock, comma-separated,
    /// or `none` [default: any].
    #[arg(long, value_name = "PORTS|none", requires = "vsock_cid")]
    vsock_host_ports: Option<String>,
    /// A network device served by passt listening on this Unix socket
    /// (`passt --socket PATH`).
    #[arg(long, value_name = "PATH", conflicts_with = "net_passt_fd")]
    net_passt_socket: Option<PathBuf>,
    /// A network device served by passt on this inherited descriptor, one
    /// end of a socketpair whose other end passt has (`passt --fd`).
    #[arg(long, value_name = "FD")]
    net_passt_fd: Option<i32>,
    /// The network device's MAC address [default: 02:6d:6f:61:74:01].
    #[arg(long, value_name = "MAC")]
    net_mac: Option<String>,
    /// Serial console destination: stdout, none, file:PATH or fd:N [default: stdout].
    #[arg(long, value_name = "DEST")]
    console: Option<String>,
    /// Unix socket to serve the JSON-lines control protocol on.
    #[arg(long, value_name = "PATH")]
    control_socket: Option<PathBuf>,
    /// How long a graceful shutdown waits before stopping the guest [default: 5000].
    #[arg(long, value_name = "MS")]
    shutdown_timeout_ms: Option<u64>,
    /// Run jailed, as Firecracker's jailer does: own mount, pid, ipc, uts and
    /// network namespaces, a root made at DIR (a tmpfs in the VMM's own
    /// mount namespace) holding only the files and socket directories the
    /// configuration names, no capabilities, no_new_privs. See docs/vmm.md.
    #[arg(long, value_name = "DIR")]
    jail: Option<PathBuf>,
    /// Run without seccomp filters (debugging only).
    #[arg(long)]
    no_seccomp: bool,
    /// Print the effective configuration as JSON and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> ExitCode {
    moat_sys::fds::keep_inherited_descriptors_to_this_process();
    // `cargo xtask dist` asks each binary for its manual pages, rendered
    // from this very parser (clap_mangen), so they never drift from --help.
    if let Some(dir) = manual_dir() {
        return match clap_mangen::generate_to(Args::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("moat-vmm: cannot write manual pages into {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let started = Instant::now();
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MOAT_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let mut config = match configure(&args) {
        Ok(config) => config,
        Err(e) => return fail(EXIT_CONFIG, &e),
    };
    if args.print_config {
        #[allow(clippy::print_stdout)] // the user asked for it on stdout
        {
            println!("{}", serde_json::to_string_pretty(&config).unwrap_or_default());
        }
        return ExitCode::SUCCESS;
    }
    let kvm = match &args.jail {
        None => None,
        Some(dir) => match enter_jail(dir, &mut config) {
            Ok(Ok(kvm)) => Some(kvm),
            Ok(Err(Ended::Exited(code))) => return ExitCode::from(code),
            Ok(Err(Ended::Killed(signal))) => return ExitCode::from(jail::end_like(signal)),
            Err(e @ JailError::Path { .. }) => return fail(EXIT_CONFIG, &e),
            Err(e) => return fail(EXIT_FAILURE, &e),
        },
    };
    let mut vmm = match build_microvm_on(kvm, &config, started) {
        Ok(vmm) => vmm,
        Err(BuildError::Config(e)) => return fail(EXIT_CONFIG, &e),
        Err(BuildError::Boot(e @ BootError::Kernel { .. })) => {
            return fail(EXIT_CONFIG, &ConfigError { field: "kernel".into(), reason: chain(&e) });
        }
        Err(e) => return fail(EXIT_FAILURE, &e),
    };
    if args.jail.is_some() {
        vmm.leave_socket_files();
    }
    match vmm.run(!args.no_seccomp) {
        Ok(exit) if exit.exit_code() == 0 => {
            tracing::info!("VM ended: {exit}");
            ExitCode::SUCCESS
        }
        Ok(exit) => {
            eprintln!("moat-vmm: the VM failed: {exit}");
            ExitCode::from(exit.exit_code())
        }
        Err(e) => fail(EXIT_FAILURE, &e),
    }
}

/// Plans the jail at `dir`, opens `/dev/kvm` (the jail has no `/dev`), and
/// enters the jail: `Ok(kvm)` in the jailed VMM, `Err(how it ended)` in its
/// supervisor.
fn enter_jail(dir: &std::path::Path, config: &mut VmConfig) -> Result<Result<Kvm, Ended>, JailError> {
    let jail = Jail::plan(dir, config)?;
    let kvm = open_kvm().map_err(|e| JailError::Path { path: "/dev/kvm".into(), why: chain(&e) })?;
    Ok(match jail.enter()? {
        Side::Jailed => Ok(kvm),
        Side::Supervisor(ended) => Err(ended),
    })
}

/// The JSON file (if any) with the flags applied on top, validated.
fn configure(args: &Args) -> Result<VmConfig, ConfigError> {
    let invalid = |field: &str, reason: String| ConfigError { field: field.into(), reason };
    let mut config = match (&args.config, &args.kernel) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid("config", format!("cannot read {}: {e}", path.display())))?;
            config::from_json(&text)?
        }
        (None, Some(kernel)) => VmConfig::new(kernel),
        (None, None) => return Err(invalid("kernel", "required; pass --kernel PATH or --config FILE".into())),
    };
    if let Some(kernel) = &args.kernel {
        config.kernel = kernel.clone();
    }
    if let Some(initramfs) = &args.initramfs {
        config.initramfs = Some(initramfs.clone());
    }
    if let Some(cmdline) = &args.cmdline {
        config.cmdline = cmdline.clone();
    }
    if let Some(vcpus) = args.vcpus {
        config.vcpus = vcpus;
    }
    if let Some(memory) = args.memory_mib {
        config.memory_mib = memory;
    }
    if !args.disks.is_empty() {
        config.disks = (0..).zip(&args.disks).map(|(i, d)| parse_disk(i, d)).collect::<Result<_, _>>()?;
    }
    if let (Some(cid), Some(uds_path)) = (args.vsock_cid, &args.vsock_uds) {
        config.vsock = Some(VsockConfig::new(cid, uds_path.clone()));
    }
    if let (Some(ports), Some(vsock)) = (&args.vsock_host_ports, &mut config.vsock) {
        vsock.host_ports = Some(match ports.as_str() {
            "none" => Vec::new(),
            list => list
                .split(',')
                .map(|p| p.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|_| invalid("vsock.host_ports", format!("{list:?} is not a list of ports or none")))?,
        });
    }
    if args.net_passt_socket.is_some() || args.net_passt_fd.is_some() {
        let net = config.net.get_or_insert_with(|| NetConfig::socket(""));
        net.passt_socket = args.net_passt_socket.clone();
        net.passt_fd = args.net_passt_fd;
    }
    if let Some(mac) = &args.net_mac {
        match &mut config.net {
            Some(net) => net.mac = mac.clone(),
            None => return Err(invalid("net.mac", "needs --net-passt-socket or --net-passt-fd".into())),
        }
    }
    if let Some(console) = &args.console {
        config.console = console.clone();
    }
    if let Some(path) = &args.control_socket {
        config.control_socket = Some(path.clone());
    }
    if let Some(ms) = args.shutdown_timeout_ms {
        config.shutdown_timeout_ms = ms;
    }
    config::validate(&config)?;
    Ok(config)
}

/// `PATH[,ro][,overlay=FILE][,overlay_limit_mib=N]` (or `PATH:ro`).
fn parse_disk(index: usize, text: &str) -> Result<DiskConfig, ConfigError> {
    let invalid = |field: &str, reason: String| ConfigError { field: format!("disks[{index}].{field}"), reason };
    let mut parts = text.split(',');
    let path = parts.next().unwrap_or_default();
    let mut disk = match path.strip_suffix(":ro") {
        Some(path) => DiskConfig::new(path, true),
        None => DiskConfig::new(path, false),
    };
    if path.is_empty() {
        return Err(invalid("path", "empty".into()));
    }
    for option in parts {
        match option.split_once('=') {
            None if option == "ro" => disk.read_only = true,
            Some(("overlay", file)) if !file.is_empty() => disk.overlay = Some(file.into()),
            Some(("overlay_limit_mib", n)) => {
                disk.overlay_limit_mib =
                    Some(n.parse().map_err(|_| invalid("overlay_limit_mib", format!("{n:?} is not a number of MiB")))?)
            }
            _ => {
                return Err(invalid(
                    "path",
                    format!("unknown option {option:?}; use ro, overlay=FILE or overlay_limit_mib=N"),
                ));
            }
        }
    }
    Ok(disk)
}

/// An error and its sources on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn fail(code: u8, e: &dyn std::error::Error) -> ExitCode {
    eprintln!("moat-vmm: {}", chain(e));
    ExitCode::from(code)
}

/// The directory of `NAME --write-manual DIR`, a hidden option of the
/// package build.
fn manual_dir() -> Option<std::path::PathBuf> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    match &args[..] {
        [flag, dir] if flag == "--write-manual" => Some(dir.into()),
        _ => None,
    }
}

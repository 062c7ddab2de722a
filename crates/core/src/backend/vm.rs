//! The vm backend, host side: one `moat-vmm` process per sandbox, booting
//! the image's kernel and initramfs with the image's `rootfs.ext4` as its
//! root disk; the agent reached over the VM's vsock socket.
//!
//! The image's root disk is the read-only base shared by every VM of the
//! image; each sandbox's writes land in its own copy-on-write overlay
//! (`overlay.img` in its state directory, at most `disk_mib` of written
//! blocks), kept by moat-vmm's block device and removed with the sandbox.
//! The guest mounts `/dev/vda` read-write and never sees the difference.
//!
//! Network `none` and `filtered` VMs have no network device at all
//! (`filtered` reaches the host through the agent's vsock connection). An
//! `open` VM gets moat-vmm's virtio-net device, whose other end is its own
//! passt process ([`crate::backend::passt`]), and `moat.net=` on its command line.
//!
//! moat-vmm runs jailed (`--jail <state>/jail`, docs/vmm.md): in its own
//! mount, pid, ipc, uts and network namespaces, with a root holding only
//! the image's kernel, initramfs and root disk (read-only), the sandbox's
//! overlay and console, and its socket directory (`<state>/sockets`, where
//! this side connects to the same paths); no capabilities, no_new_privs.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moat_proto::{AgentClient, UnixConnector};
use moat_vmm_api::config::{DiskConfig, NetConfig, VmConfig, VsockConfig};
use moat_vmm_api::control::{Reply, Request, Status};
use serde::de::DeserializeOwned;

use crate::backend::passt::Passt;
use crate::backend::rootdisk::RootDisk;
use crate::backend::{Backend, BackendKind, Instance};
use crate::capped_log::{CappedLog, LOG_CAP};
use crate::error::{CreateError, IoError};
use crate::image::Image;
use crate::process::Pidfd;
use crate::sandbox::{NetworkPolicy, SandboxSpec};
use crate::state::StateDir;

/// The vsock port the agent serves in a microVM (its default).
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// The guest's vsock context id; each VM has its own device, so all can
/// use the first id available to guests.
const GUEST_CID: u32 = 3;

/// The descriptor moat-vmm inherits the serial console's pipe as (passt's
/// socket is [`crate::backend::passt::CHILD_FD`]).
const CONSOLE_FD: i32 = 101;

/// moat-vmm's boot-timer page (see docs/vmm.md): the agent writes to it
/// when ready, and the VMM records the time.
const BOOT_TIMER: u64 = 0xc000_0000;

/// A guard against a wedged boot, far above the seconds a boot takes, even
/// under nested emulation in tests.
const BOOT_GUARD: Duration = Duration::from_secs(180);

/// How long a control request may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// While a VM boots, how often the agent itself is asked whether it is up
/// when moat-vmm's boot timer has not said so (a guest that never writes
/// the timer still comes up, only noticed later).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Starts microVMs with `moat-vmm`.
#[derive(Debug, Clone)]
pub struct VmBackend {
    vmm: PathBuf,
}

/// A running microVM.
#[derive(Debug)]
pub struct Vm {
    id: String,
    vmm: Child,
    /// Readable once `vmm` has ended.
    exit: Pidfd,
    state: Option<StateDir>,
    vsock: PathBuf,
    control: PathBuf,
    /// The other end of the network device of an `open` VM.
    passt: Option<Passt>,
    /// The serial console and moat-vmm's own output, each capped.
    logs: Vec<CappedLog>,
    /// The host disk its overlay may grow to, kept from copies, task
    /// records and other VMs' overlays while it lives.
    _disk: crate::hostfs::Promise,
}

/// Where a VM's files are: its image's (in the image's directory), and its
/// own in its state directory. The sockets have a directory of their own:
/// the jailed VMM sees it (it makes its sockets there), and nothing else of
/// the state directory but its console and overlay.
#[derive(Debug)]
struct VmFiles {
    kernel: PathBuf,
    initramfs: PathBuf,
    rootfs: PathBuf,
    overlay: PathBuf,
    console: PathBuf,
    sockets: PathBuf,
    vsock: PathBuf,
    control: PathBuf,
}

impl VmFiles {
    fn new(image: &Path, state: &Path) -> Self {
        let sockets = state.join("sockets");
        Self {
            kernel: image.join("vmlinux"),
            initramfs: image.join("initramfs.cpio.gz"),
            rootfs: image.join("rootfs.ext4"),
            overlay: state.join("overlay.img"),
            console: state.join("console.log"),
            vsock: sockets.join("vsock.sock"),
            control: sockets.join("control.sock"),
            sockets,
        }
    }
}

/// moat-vmm's configuration (docs/vmm.md) for the VM of `spec`: its root
/// disk under a copy-on-write overlay of at most `overlay_limit_mib`, a
/// vsock device, the console on an inherited pipe, and a network device
/// when `passt` (an `open` VM's) is there.
fn vmm_config(
    files: &VmFiles,
    spec: &SandboxSpec,
    cmdline: String,
    overlay_limit_mib: u64,
    passt: bool,
) -> Result<VmConfig, CreateError> {
    let too_big = |what: &str| CreateError::InvalidSpec(format!("{what} is more than a microVM takes; ask for less"));
    let mut config = VmConfig::new(&files.kernel);
    config.initramfs = Some(files.initramfs.clone());
    config.cmdline = cmdline;
    config.vcpus = u8::try_from(spec.cpus).map_err(|_| too_big("cpus"))?;
    config.memory_mib = u32::try_from(spec.memory_mib).map_err(|_| too_big("memory_mib"))?;
    config.disks = vec![DiskConfig {
        overlay: Some(files.overlay.clone()),
        overlay_limit_mib: Some(overlay_limit_mib),
        ..DiskConfig::new(&files.rootfs, false)
    }];
    // The guest may connect to no host port (the host always connects to
    // the agent), so the VMM's seccomp filter allows no `socket` or
    // `connect` once the guest runs.
    config.vsock = Some(VsockConfig { host_ports: Some(Vec::new()), ..VsockConfig::new(GUEST_CID, &files.vsock) });
    config.net = passt.then(|| NetConfig {
        mac: crate::backend::passt::GUEST_MAC.into(),
        ..NetConfig::fd(crate::backend::passt::CHILD_FD)
    });
    config.console = format!("fd:{CONSOLE_FD}");
    config.control_socket = Some(files.control.clone());
    Ok(config)
}

impl VmBackend {
    pub fn new(vmm: PathBuf) -> Self {
        Self { vmm }
    }
}

/// The kernel command line of a sandbox's VM (public for the benchmark
/// that boots the same guest under QEMU).
pub fn kernel_cmdline(hostname: &str, disk_mib: u64) -> String {
    format!(
        "console=ttyS0 reboot=k panic=-1 pci=off i8042.noaux i8042.nomux quiet \
         moat.root=/dev/vda moat.disk_mib={disk_mib} moat.hostname={hostname} \
         moat.port={AGENT_VSOCK_PORT} moat.boot_timer={BOOT_TIMER:#x}"
    )
}

/// The command line of the VM of `spec`: an `open` one is told its
/// addresses.
fn cmdline_for(hostname: &str, spec: &SandboxSpec) -> String {
    let line = kernel_cmdline(hostname, spec.disk_mib);
    match spec.network {
        NetworkPolicy::Open => format!("{line} {}", crate::backend::passt::guest_cmdline()),
        NetworkPolicy::None | NetworkPolicy::Filtered => line,
    }
}

/// The overlay limit of a VM whose guest may write `disk_mib`, after
/// checking that its image's root file system has that much room.
fn overlay_limit_mib(image: &Image, disk_mib: u64) -> Result<u64, CreateError> {
    let disk = RootDisk::read(&image.path("rootfs.ext4")).map_err(|e| {
        CreateError::Image(crate::image::ImageError::Corrupt {
            name: image.manifest.name.clone(),
            what: format!("its rootfs.ext4 has no readable ext4 superblock ({e})"),
        })
    })?;
    let room = disk.available >> 20;
    if disk_mib > room {
        return Err(CreateError::InvalidSpec(format!(
            "disk_mib {disk_mib} is more than a microVM's root disk holds: its image's file system has {room} MiB \
             free; ask for at most {room}, or use the jail backend"
        )));
    }
    Ok(disk.overlay_limit_mib(disk_mib))
}

/// The host disk a VM's overlay (in its state directory, beneath
/// `data_dir`) may grow to, promised for the VM's life: the overlay is a
/// sparse file that fills as the guest writes, up to `overlay_limit_mib`,
/// so a guest that writes its whole disk must find the room there, beyond
/// what moat keeps free ([`crate::hostfs::RESERVE_RULE`]) and what copies
/// and other VMs may still write there; else the create is refused. Once
/// the overlay exists, only what it may still write stays promised.
fn promise_disk(
    id: &str,
    data_dir: &Path,
    disk_mib: u64,
    overlay_limit_mib: u64,
) -> Result<crate::hostfs::Promise, CreateError> {
    let dir = std::fs::File::open(data_dir).map_err(|source| IoError {
        id: id.into(),
        what: format!("opening the data directory {}", data_dir.display()),
        source,
    })?;
    crate::hostfs::promise_room(&dir, overlay_limit_mib << 20).map_err(|left| {
        CreateError::HostDisk(format!(
            "a microVM with disk_mib {disk_mib} may write {overlay_limit_mib} MiB to the host's disk, and the file \
             system of moat's data directory has {} MiB left beyond what moat keeps free ({}) and what copies \
             and other microVMs' disks may still write; destroy a microVM, ask for a smaller disk_mib, or free \
             space there",
            left >> 20,
            crate::hostfs::RESERVE_RULE
        ))
    })
}

impl Backend for VmBackend {
    type Instance = Vm;

    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }

    async fn start(
        &self,
        id: &str,
        hostname: &str,
        spec: &SandboxSpec,
        image: &Image,
        data_dir: &Path,
    ) -> Result<Vm, CreateError> {
        let io = |what: &str| {
            let (id, what) = (id.to_owned(), what.to_owned());
            move |source| IoError { id, what, source }
        };
        let passt_binary = match spec.network {
            NetworkPolicy::Open => Some(crate::backend::passt::find_passt().ok_or_else(|| {
                CreateError::StartFailed {
                    id: id.into(),
                    reason: "network open needs passt, from Debian's passt package (apt-get install passt); \
                         or use network filtered"
                        .into(),
                }
            })?),
            NetworkPolicy::None | NetworkPolicy::Filtered => None,
        };
        let overlay_limit_mib = overlay_limit_mib(image, spec.disk_mib)?;
        let disk = promise_disk(id, data_dir, spec.disk_mib, overlay_limit_mib)?;
        let state = StateDir::create(data_dir, id).map_err(io("creating its state directory"))?;
        // passt first: moat-vmm inherits its end of passt's socketpair.
        let (passt, vmm_net_end) = match &passt_binary {
            Some(binary) => {
                let log = std::fs::File::create(state.path.join("passt.log")).map_err(io("creating passt's log"))?;
                let (passt, end) = Passt::start(binary, log).map_err(io(&format!("starting {}", binary.display())))?;
                (Some(passt), Some(end))
            }
            None => (None, None),
        };
        let files = VmFiles::new(&image.dir, &state.path);
        disk.filled_by(files.overlay.clone());
        std::fs::create_dir(&files.sockets).map_err(io("creating its socket directory"))?;
        let config = vmm_config(&files, spec, cmdline_for(hostname, spec), overlay_limit_mib, vmm_net_end.is_some())?;
        let config_path = state.path.join("vm.json");
        let text = serde_json::to_vec_pretty(&config).map_err(|e| io("writing its configuration")(e.into()))?;
        std::fs::write(&config_path, text).map_err(io("writing its configuration"))?;
        let (console_end, console_log) =
            CappedLog::start(&files.console, LOG_CAP).map_err(io("creating its console log"))?;
        let (log, vmm_log) = CappedLog::start(&state.path.join("vmm.log"), LOG_CAP).map_err(io("creating its log"))?;
        let mut command = Command::new(&self.vmm);
        command.env_clear().envs(crate::process::helper_env());
        // Jailed (docs/vmm.md): its own namespaces, a root holding only the
        // image's kernel, initramfs and disk, this sandbox's overlay and
        // socket directory; no capabilities. The console is an inherited pipe.
        command.arg("--config").arg(&config_path).arg("--jail").arg(state.path.join("jail"));
        let stdout = log.try_clone().map_err(io("opening its log"))?;
        command.stdin(Stdio::null()).stdout(stdout).stderr(log);
        // Its own process group, so a terminal's Ctrl-C reaches only the host
        // process, which then destroys the sandbox in order.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let net_fd = vmm_net_end.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let console_fd = std::os::fd::AsRawFd::as_raw_fd(&console_end);
        // SAFETY: prctl(2) is async-signal-safe and touches no memory of
        // the parent; the closure runs in the child between fork and exec.
        // dup2 and fcntl (passing passt's socket) are async-signal-safe too.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                if let Some(fd) = net_fd {
                    crate::backend::passt::inherit(fd, crate::backend::passt::CHILD_FD)?;
                }
                crate::backend::passt::inherit(console_fd, CONSOLE_FD)?;
                // Die with the process that started it: a SIGKILLed owner
                // leaves no VM running.
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let vmm = command.spawn().map_err(io(&format!("starting {}", self.vmm.display())))?;
        // The children hold their ends now (and the command its copies of
        // the log's: gone with it, so that the logs end with moat-vmm).
        drop(vmm_net_end);
        drop(console_end);
        drop(command);
        let exit = match Pidfd::of(&vmm) {
            Ok(exit) => exit,
            Err(e) => {
                let mut vmm = vmm;
                let _ = vmm.kill();
                let _ = vmm.wait();
                state.remove();
                return Err(io("watching its VMM (pidfd_open needs Linux 5.3)")(e).into());
            }
        };
        state.record_monitor(vmm.id()).map_err(io("recording its VMM"))?;
        let logs = vec![console_log, vmm_log];
        let (vsock, control) = (files.vsock, files.control);
        let mut vm = Vm { id: id.into(), vmm, exit, state: Some(state), vsock, control, passt, logs, _disk: disk };
        let ready = match vm.wait_ready().await {
            Ok(()) => vm.check_passt(),
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            let _ = tokio::task::spawn_blocking(move || vm.stop()).await;
            return Err(e);
        }
        Ok(vm)
    }
}

impl Instance for Vm {
    fn client(&self) -> AgentClient<UnixConnector> {
        // The socket's directory is the jailed VMM's to write: only its
        // own socket (served by moat-vmm or the VMM it forks) is spoken to.
        AgentClient::vsock_of(&self.vsock, AGENT_VSOCK_PORT, self.vmm.id())
    }

    fn power_switch(&self) -> Option<crate::backend::PowerSwitch> {
        let (id, control, server) = (self.id.clone(), self.control.clone(), self.vmm.id());
        Some(std::sync::Arc::new(move |suspended| {
            let request = if suspended { Request::Pause } else { Request::Resume };
            control_request::<Status>(&control, server, &request).map(drop).map_err(|source| IoError {
                id: id.clone(),
                what: format!("asking its VMM to {}", request.op()),
                source,
            })
        }))
    }

    fn destroy(&mut self) {
        self.stop();
    }

    fn host_pid(&self) -> u32 {
        self.vmm.id()
    }

    fn exit_watch(&self) -> std::io::Result<Pidfd> {
        self.exit.try_clone()
    }

    fn ended(&mut self) -> Option<String> {
        let status = self.vmm.try_wait().ok()??;
        // The console's last lines say why a guest ended (a kernel panic
        // when its agent, PID 1, died); read before the state goes.
        // Its tail only: this is read with every sandbox's map locked, and
        // the guest wrote the file (up to its cap).
        let console = self.state.as_ref().map(|s| read_tail(&s.path.join("console.log"), 16 << 10)).unwrap_or_default();
        let lines: Vec<&str> = console.lines().filter(|l| !l.trim().is_empty()).collect();
        // What the guest wrote, kept with the failed sandbox and shown in
        // its listing: a line's first 512 bytes.
        let clipped: Vec<&str> =
            lines[lines.len().saturating_sub(3)..].iter().map(|line| &line[..line.floor_char_boundary(512)]).collect();
        let tail = clipped.join("\n");
        let console = if tail.is_empty() { String::new() } else { format!("; its console ended with:\n{tail}") };
        Some(format!("the microVM ended unexpectedly (moat-vmm {status}){console}"))
    }
}

/// `request` as one line of moat-vmm's control protocol.
fn request_line(request: &Request) -> std::io::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(request).map_err(std::io::Error::other)?;
    line.push(b'\n');
    Ok(line)
}

/// The last `max` bytes of the file at `path` (lossy UTF-8; empty if it
/// cannot be read).
fn read_tail(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let len = file.metadata().map_or(0, |m| m.len());
    if file.seek(SeekFrom::Start(len.saturating_sub(max))).is_err() {
        return String::new();
    }
    let mut tail = Vec::new();
    let _ = file.take(max).read_to_end(&mut tail);
    String::from_utf8_lossy(&tail).into_owned()
}

/// The longest answer a VMM's control socket may give (its answers are a
/// few hundred bytes).
const CONTROL_REPLY_MAX: usize = 64 << 10;

/// One request on a VMM's control socket; its answer. The whole exchange
/// is bounded by [`CONTROL_TIMEOUT`], not each read: a VMM that sends a
/// byte now and then, and never the line's end (a guest that took over
/// the jailed VMM), holds its caller no longer than one that says nothing.
fn control_request<T: DeserializeOwned>(control: &Path, server: u32, request: &Request) -> std::io::Result<T> {
    use std::io::Read;
    let deadline = Instant::now() + CONTROL_TIMEOUT;
    let mut stream = connect_at_once(control, server)?;
    stream.set_write_timeout(Some(CONTROL_TIMEOUT))?;
    stream.write_all(&request_line(request)?)?;
    let late = || {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("moat-vmm did not answer {} within {} s", request.op(), CONTROL_TIMEOUT.as_secs()),
        )
    };
    let mut line = Vec::new();
    let mut chunk = [0u8; 4096];
    while !line.contains(&b'\n') {
        let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or_else(late)?;
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut chunk) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "moat-vmm closed its control socket without answering",
                ));
            }
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(late());
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        line.extend_from_slice(&chunk[..n]);
        if line.len() > CONTROL_REPLY_MAX {
            return Err(std::io::Error::other(format!(
                "moat-vmm's answer to {} is longer than {CONTROL_REPLY_MAX} bytes",
                request.op()
            )));
        }
    }
    let end = line.iter().position(|b| *b == b'\n').unwrap_or(line.len());
    let reply: Reply<T> = serde_json::from_slice(&line[..end]).map_err(std::io::Error::other)?;
    reply.into_result().map_err(|error| std::io::Error::other(format!("moat-vmm refused {}: {error}", request.op())))
}

/// A connection to the control socket at `control`, made without waiting:
/// a VMM that does not accept (its thread stuck, its backlog full) is an
/// error now, where a blocking `connect(2)` would wait for a place for as
/// long as it takes, with whatever lock its caller holds.
/// Only `server`'s socket (moat-vmm's, or its jailed VMM's) is taken
/// (see [`moat_proto::served_by`]).
fn connect_at_once(control: &Path, server: u32) -> std::io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    use std::os::fd::AsRawFd;
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    let address = UnixAddr::new(control)?;
    match connect(fd.as_raw_fd(), &address) {
        Ok(()) => {}
        Err(nix::errno::Errno::EAGAIN) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "its control socket takes no more connections: the VMM is not serving it",
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let stream = UnixStream::from(fd);
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)?.pid();
    moat_proto::served_by(Some(peer), control, server)?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Whether the moat-vmm behind `control` reports the guest ready (its boot
/// timer written); `false` while it cannot be asked.
async fn guest_ready(control: &Path, server: u32) -> bool {
    let control = control.to_owned();
    let status =
        tokio::task::spawn_blocking(move || control_request::<Status>(&control, server, &Request::Status)).await;
    matches!(status, Ok(Ok(Status { guest_ready_us: Some(_), .. })))
}

impl Vm {
    /// Waits until the agent answers its handshake. The agent writes
    /// moat-vmm's boot timer once it listens, and the VMM's `status` says
    /// so: that is polled (the VMM answers it alone), and the agent asked
    /// then, or every [`PROBE_EVERY`] — not every poll, since each try
    /// costs the booting guest a vsock round trip.
    async fn wait_ready(&mut self) -> Result<(), CreateError> {
        let started = Instant::now();
        let client = self.client();
        let mut probed: Option<Instant> = None;
        loop {
            let timer_says_ready = guest_ready(&self.control, self.vmm.id()).await;
            if (timer_says_ready || probed.is_none_or(|at| at.elapsed() >= PROBE_EVERY)) && self.vsock.exists() {
                probed = Some(Instant::now());
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), client.info()).await {
                    return Ok(());
                }
            }
            if let Ok(Some(status)) = self.vmm.try_wait() {
                // Its last words are in the logs once their copies are done.
                self.logs.iter_mut().for_each(CappedLog::finish);
                return Err(self.start_failed(&format!("moat-vmm exited ({status})")));
            }
            if started.elapsed() > BOOT_GUARD {
                return Err(self.start_failed(&format!("the agent did not answer within {} s", BOOT_GUARD.as_secs())));
            }
            // Exception to "wait on events": nothing on the host tells
            // when the guest's agent listens on vsock (the muxer refuses a
            // CONNECT until then), so a microVM's boot retries, bounded by
            // BOOT_GUARD and cut short by moat-vmm's exit. Jails never
            // come here.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An `open` VM whose passt has ended would have a network device
    /// leading nowhere: that is a failed start, with passt's last words.
    fn check_passt(&mut self) -> Result<(), CreateError> {
        let Some(status) = self.passt.as_mut().and_then(Passt::exited) else { return Ok(()) };
        let log = self
            .state
            .as_ref()
            .and_then(|s| std::fs::read_to_string(s.path.join("passt.log")).ok())
            .unwrap_or_default();
        let last = log.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("(no message)");
        Err(CreateError::StartFailed { id: self.id.clone(), reason: format!("passt exited ({status}): {last}") })
    }

    /// Where the boot got to and how the console ended, for a failed start.
    fn start_failed(&self, what: &str) -> CreateError {
        let read = |name: &str| {
            self.state.as_ref().and_then(|s| std::fs::read_to_string(s.path.join(name)).ok()).unwrap_or_default()
        };
        let console = read("console.log");
        let stage = console.lines().filter_map(|l| l.split("moat-agent: ").nth(1)).next_back().map_or_else(
            || "the kernel did not reach the agent".to_owned(),
            |s| format!("the agent's last stage: {s}"),
        );
        let tail = |text: &str, n: usize| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        CreateError::StartFailed {
            id: self.id.clone(),
            reason: format!(
                "{what}; {stage}\nconsole:\n{}\nmoat-vmm:\n{}",
                tail(&console, 20),
                tail(&read("vmm.log"), 5)
            ),
        }
    }

    /// Asks the VMM to stop the guest now, waits for it, SIGKILL if it does
    /// not go, then removes the state directory (sockets, console, log).
    fn stop(&mut self) {
        if let Ok(None) = self.vmm.try_wait() {
            // A forced shutdown ends the VM at once, paused or not.
            let forced = connect_at_once(&self.control, self.vmm.id()).and_then(|mut s| {
                s.set_write_timeout(Some(CONTROL_TIMEOUT))?;
                s.write_all(&request_line(&Request::Shutdown { force: true, timeout_ms: None })?)
            });
            if forced.is_err() {
                let pid = nix::unistd::Pid::from_raw(i32::try_from(self.vmm.id()).unwrap_or(i32::MAX));
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            }
            if !self.exit.wait_timeout(Duration::from_secs(5)) {
                let _ = self.vmm.kill();
            }
        }
        let _ = self.vmm.wait();
        self.logs.iter_mut().for_each(CappedLog::finish);
        // The VM is gone: its network's other end goes too.
        drop(self.passt.take());
        if let Some(state) = self.state.take() {
            state.remove();
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The boot timer is read from a control socket answering as moat-vmm
    /// does (docs/vmm.md); no socket, or no time yet, is not ready.
    #[tokio::test]
    async fn the_boot_timer_is_read_from_the_vmms_status() {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("control.sock");
        let me = std::process::id();
        assert!(!guest_ready(&path, me).await, "no VMM yet");
        let listener = tokio::net::UnixListener::bind(&path).expect("binds");
        let server = tokio::spawn(async move {
            for ready in ["null", "81234"] {
                let (stream, _) = listener.accept().await.expect("accepts");
                let (read, mut write) = stream.into_split();
                let mut line = String::new();
                tokio::io::BufReader::new(read).read_line(&mut line).await.expect("reads");
                assert_eq!(line, "{\"op\":\"status\"}\n");
                let reply = format!(
                    "{{\"ok\":true,\"state\":\"running\",\"vcpus\":1,\"memory_mib\":512,\"uptime_ms\":9,\"guest_ready_us\":{ready}}}\n"
                );
                write.write_all(reply.as_bytes()).await.expect("answers");
            }
        });
        assert!(!guest_ready(&path, me).await, "guest_ready_us null");
        assert!(guest_ready(&path, me).await, "guest_ready_us set");
        server.await.expect("served");
    }

    /// A control socket that answers a byte at a time and never ends its
    /// line (a guest that took over its jailed VMM), or answers without
    /// end, holds its caller (a suspend, a resume, with the sandbox's power
    /// lock) no longer than one that says nothing.
    #[test]
    fn a_vmm_that_never_finishes_its_answer_is_given_up() {
        use std::io::Read;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("control.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("binds");
        std::thread::spawn(move || {
            // A trickle: a byte every 100 ms, for longer than the bound.
            let (mut stream, _) = listener.accept().expect("accepts");
            let mut request = [0u8; 64];
            let _ = stream.read(&mut request);
            for _ in 0..(CONTROL_TIMEOUT.as_millis() / 100 * 3) {
                if stream.write_all(b" ").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // A flood: more than any answer, no line's end.
            let (mut stream, _) = listener.accept().expect("accepts");
            let _ = stream.read(&mut request);
            let _ = stream.write_all(&vec![b'x'; CONTROL_REPLY_MAX * 2]);
        });
        let me = std::process::id();
        let trickled = control_request::<Status>(&path, me, &Request::Pause).expect_err("a trickle is no answer");
        assert_eq!(trickled.kind(), std::io::ErrorKind::TimedOut, "{trickled}");
        assert!(trickled.to_string().contains("did not answer pause within 5 s"), "{trickled}");
        let flooded = control_request::<Status>(&path, me, &Request::Resume).expect_err("a flood is no answer");
        assert!(flooded.to_string().contains("longer than 65536 bytes"), "{flooded}");
    }

    /// A failed VM's console is read with every sandbox's map locked:
    /// only its tail, whatever the guest wrote.
    #[test]
    fn only_a_consoles_tail_is_read() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("console.log");
        std::fs::write(&log, format!("{}\nKernel panic - not syncing: the end\n", "x".repeat(1 << 20))).expect("write");
        let tail = read_tail(&log, 16 << 10);
        assert_eq!(tail.len(), 16 << 10);
        assert!(tail.ends_with("Kernel panic - not syncing: the end\n"), "{}", &tail[tail.len() - 64..]);
        assert_eq!(read_tail(&dir.path().join("none"), 16), "");
    }

    #[test]
    fn the_command_line_boots_the_agent_from_its_overlay_disk() {
        let line = kernel_cmdline("box", 512);
        for word in [
            "moat.root=/dev/vda",
            "moat.disk_mib=512",
            "moat.hostname=box",
            "moat.port=1024",
            "moat.boot_timer=0xc0000000",
        ] {
            assert!(line.split_whitespace().any(|w| w == word), "{word} missing from {line}");
        }
        // Writable through the block device's overlay: no tmpfs overlay in the guest.
        assert!(!line.split_whitespace().any(|w| w == "moat.ro" || w.starts_with("moat.overlay_mib=")), "{line}");
    }

    /// What core writes is parsed by moat-vmm's own loader and passes its
    /// validation, with the root disk under an overlay, no host port open to
    /// the guest, and a network device only for an `open` VM.
    #[test]
    fn the_configuration_is_what_moat_vmm_reads() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (image, state) = (dir.path().join("image"), dir.path().join("state"));
        std::fs::create_dir(&image).expect("image dir");
        for file in ["vmlinux", "initramfs.cpio.gz", "rootfs.ext4"] {
            std::fs::write(image.join(file), b"").expect("image file");
        }
        let files = VmFiles::new(&image, &state);
        std::fs::create_dir_all(&files.sockets).expect("socket dir");
        let spec = SandboxSpec { cpus: 2, memory_mib: 512, ..SandboxSpec::default() };
        let written = |passt: bool| {
            let config = vmm_config(&files, &spec, cmdline_for("box", &spec), 2048, passt).expect("configures");
            let text = serde_json::to_string_pretty(&config).expect("serializes");
            let read = moat_vmm::config::from_json(&text).expect("moat-vmm parses it");
            moat_vmm::config::validate(&read).expect("moat-vmm accepts it");
            read
        };
        let config = written(false);
        assert!(config.net.is_none(), "no network device unless open: {config:?}");
        assert_eq!((config.vcpus, config.memory_mib), (2, 512));
        assert_eq!(config.initramfs.as_deref(), Some(image.join("initramfs.cpio.gz").as_path()));
        let disk = &config.disks[..];
        assert_eq!(disk.len(), 1);
        assert_eq!((&disk[0].path, disk[0].read_only), (&image.join("rootfs.ext4"), false));
        assert_eq!(disk[0].overlay.as_deref(), Some(state.join("overlay.img").as_path()));
        assert_eq!(disk[0].overlay_limit_mib, Some(2048));
        let vsock = config.vsock.as_ref().expect("a vsock device");
        assert_eq!(vsock.cid, 3);
        assert!(!vsock.guest_connects(), "the guest connects to no host port");
        assert_eq!(config.console, "fd:101");
        assert_eq!(config.control_socket.as_deref(), Some(state.join("sockets/control.sock").as_path()));
        let net = written(true).net.expect("an open VM's network device");
        assert_eq!((net.passt_fd, net.mac.as_str()), (Some(crate::backend::passt::CHILD_FD), "02:6d:6f:61:74:01"));
    }

    #[test]
    fn more_cpus_than_a_configuration_holds_are_refused() {
        let files = VmFiles::new(Path::new("/i"), Path::new("/s"));
        let spec = SandboxSpec { cpus: 256, ..SandboxSpec::default() };
        let e = vmm_config(&files, &spec, String::new(), 1, false).expect_err("too many");
        assert!(e.to_string().contains("cpus"), "{e}");
    }

    /// The control requests core sends are the lines moat-vmm parses.
    #[test]
    fn control_requests_are_lines_moat_vmm_parses() {
        for request in
            [Request::Status, Request::Pause, Request::Resume, Request::Shutdown { force: true, timeout_ms: None }]
        {
            let line = request_line(&request).expect("encodes");
            assert_eq!(line.last(), Some(&b'\n'));
            let text = String::from_utf8(line).expect("UTF-8");
            assert_eq!(moat_vmm::control::parse(&text), Ok(request));
        }
    }

    #[test]
    fn only_open_vms_are_told_their_network() {
        let spec = |network| SandboxSpec { network, ..SandboxSpec::default() };
        assert!(cmdline_for("box", &spec(NetworkPolicy::Open)).ends_with(" moat.net=10.0.2.15/24,10.0.2.2,10.0.2.3"));
        for policy in [NetworkPolicy::None, NetworkPolicy::Filtered] {
            assert!(!cmdline_for("box", &spec(policy)).contains("moat.net"), "{policy:?}");
        }
    }
}

//! The running microVM: starts the vCPU threads, installs the seccomp
//! filters, and runs the event loop on the calling thread until the VM ends.
//!
//! The loop waits (epoll) on: a vCPU ending the VM, the guest's reset
//! (i8042) and power-off (ACPI S5) requests, SIGTERM/SIGINT/SIGHUP, console
//! input, the graceful-shutdown timer, and the control socket.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::control::{self, ControlServer, Incoming, Request, Shutdown, State, Status};
use crate::devices::boot_timer::BootReady;
use crate::devices::bus::lock;
use crate::devices::legacy::{I8042, SerialConsole};
use crate::devices::virtio::MmioTransport;
use crate::seccomp::{self, ThreadKind};
use crate::vstate::vcpu::{StartGate, Target, Vcpu, VcpuError, VcpuHandle, VcpuShared, VmExit};
use crate::vstate::vm::Vm;

const EXIT: u64 = 1;
const RESET: u64 = 2;
const POWEROFF: u64 = 3;
const SIGNAL: u64 = 4;
const STDIN: u64 = 5;
const SHUTDOWN_TIMER: u64 = 6;
const LISTENER: u64 = 7;
/// virtio devices: `VIRTIO_TOKENS + 32 × device + queue`, and `+ 31` for
/// the device's host descriptor (19 devices at most: below the control tokens).
const VIRTIO_TOKENS: u64 = 100;
const VIRTIO_HOST: u64 = 31;
/// Control connections get tokens from here up.
pub const CONTROL_TOKENS: u64 = 1000;

/// How long `pause` waits for every vCPU to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the VMM could not run the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error("Cannot set up the event loop ({what})")]
    EventLoop { what: &'static str, source: std::io::Error },
}

/// Everything the builder made.
#[derive(Debug)]
pub struct VmmParts {
    pub vm: Vm,
    pub vcpus: Vec<Vcpu>,
    pub serial: Arc<Mutex<SerialConsole>>,
    /// The virtio-mmio transports, whose queue and host events this loop serves.
    pub virtio: Vec<Arc<Mutex<MmioTransport>>>,
    pub i8042: Arc<Mutex<I8042>>,
    pub reset_evt: EventFd,
    pub poweroff_evt: EventFd,
    pub control: Option<ControlServer>,
    pub console_input: bool,
    pub ready: BootReady,
    pub started: Instant,
    pub memory_mib: u32,
    pub shutdown_timeout: Duration,
    /// What the VMM thread's seccomp filter must allow beyond its descriptors.
    pub needs: seccomp::Needs,
}

/// A built microVM, ready to run.
#[derive(Debug)]
pub struct Vmm {
    parts: VmmParts,
}

struct Running {
    shared: Arc<VcpuShared>,
    handles: Vec<VcpuHandle>,
    epoll: Epoll,
    timer: TimerFd,
    signals: OwnedFd,
    stdin_open: bool,
}

impl Vmm {
    /// Wraps what the builder made.
    pub fn new(parts: VmmParts) -> Self {
        Self { parts }
    }

    /// Leaves the control socket's file behind when the VM ends, and so
    /// needs no `unlink`: a jailed VMM's supervisor removes it.
    pub fn leave_socket_files(&mut self) {
        if let Some(control) = &mut self.parts.control {
            control.leave_file();
        }
        self.parts.needs.unlink = false;
    }

    /// Runs the VM until it ends. With `seccomp`, every thread is filtered
    /// before the guest executes its first instruction.
    pub fn run(mut self, seccomp: bool) -> Result<VmExit, VmmError> {
        let loop_err = |what| move |source| VmmError::EventLoop { what, source };
        let signals = block_termination_signals().map_err(loop_err("signalfd"))?;
        let epoll = Epoll::new().map_err(loop_err("epoll"))?;
        let timer = TimerFd::new().map_err(|e| VmmError::EventLoop { what: "timerfd", source: e.into() })?;
        let shared = VcpuShared::new().map_err(loop_err("eventfd"))?;
        let add = |fd: RawFd, token: u64| {
            epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token)).map_err(loop_err("epoll_ctl"))
        };
        add(shared.exit_evt.as_raw_fd(), EXIT)?;
        add(self.parts.reset_evt.as_raw_fd(), RESET)?;
        add(self.parts.poweroff_evt.as_raw_fd(), POWEROFF)?;
        add(signals.as_raw_fd(), SIGNAL)?;
        add(timer.as_raw_fd(), SHUTDOWN_TIMER)?;
        if let Some(control) = &self.parts.control {
            add(control.listener_fd(), LISTENER)?;
        }
        for (device, transport) in (0u64..).zip(&self.parts.virtio) {
            let transport = lock(transport);
            for (queue, evt) in (0u64..).zip(transport.queue_events()) {
                add(evt.as_raw_fd(), VIRTIO_TOKENS + 32 * device + queue)?;
            }
            if let Some(fd) = transport.host_fd() {
                add(fd, VIRTIO_TOKENS + 32 * device + VIRTIO_HOST)?;
            }
        }
        // Console input only from something pollable (a terminal, a pipe);
        // /dev/null and regular files are refused by epoll and skipped.
        let stdin_open = self.parts.console_input
            && epoll.ctl(ControlOperation::Add, libc::STDIN_FILENO, EpollEvent::new(EventSet::IN, STDIN)).is_ok();
        // Keystrokes go to the guest as typed; restored when this returns.
        let _raw = stdin_open.then(RawTerminal::enter).flatten();

        let (vcpu_filter, vmm_filter) = if seccomp {
            let needs = self.parts.needs;
            (Some(seccomp::filter(ThreadKind::Vcpu, needs)?), Some(seccomp::filter(ThreadKind::Vmm, needs)?))
        } else {
            (None, None)
        };
        let start = StartGate::new();
        let mut handles = Vec::new();
        for vcpu in std::mem::take(&mut self.parts.vcpus) {
            match vcpu.start(shared.clone(), vcpu_filter.clone(), start.clone()) {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    // End the threads already started.
                    start.open(false);
                    handles.into_iter().for_each(VcpuHandle::join);
                    return Err(e.into());
                }
            }
        }
        if let Some(filter) = &vmm_filter
            && let Err(e) = seccomp::install(filter)
        {
            start.open(false);
            handles.into_iter().for_each(VcpuHandle::join);
            return Err(e.into());
        }
        tracing::info!("Starting the guest: {} vCPUs, {} MiB", handles.len(), self.parts.memory_mib);
        start.open(true);

        let mut running = Running { shared, handles, epoll, timer, signals, stdin_open };
        let exit = self.event_loop(&mut running);
        running.shared.request(Target::Stop);
        for handle in &running.handles {
            handle.kick();
        }
        running.handles.into_iter().for_each(VcpuHandle::join);
        Ok(exit)
    }

    fn event_loop(&mut self, r: &mut Running) -> VmExit {
        let mut events = vec![EpollEvent::default(); 32];
        loop {
            if let Some(exit) = r.shared.exit() {
                return exit;
            }
            let n = match r.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return VmExit::Failed(format!("The VMM event loop failed: {e}")),
            };
            for event in &events[..n] {
                match event.data() {
                    EXIT => {
                        let _ = r.shared.exit_evt.read();
                    }
                    RESET => {
                        let _ = self.parts.reset_evt.read();
                        r.shared.end(VmExit::Reset("i8042 reset"));
                    }
                    POWEROFF => {
                        let _ = self.parts.poweroff_evt.read();
                        r.shared.end(VmExit::PowerOff);
                    }
                    SIGNAL => {
                        let signal = read_signal(&r.signals);
                        tracing::info!("Signal {signal} received; shutting the guest down");
                        self.shutdown(r, false, None);
                    }
                    STDIN => self.console_input(r),
                    SHUTDOWN_TIMER => {
                        let _ = r.timer.wait();
                        tracing::warn!("The guest did not shut down in time; stopping it");
                        r.shared.end(VmExit::Stopped);
                    }
                    LISTENER => self.accept(r),
                    token @ VIRTIO_TOKENS..CONTROL_TOKENS => self.virtio_event(token - VIRTIO_TOKENS),
                    token => self.control_request(r, token),
                }
            }
        }
    }

    /// A queue notification or a device's host descriptor: the device's
    /// work runs here, on the VMM thread, never on a vCPU thread.
    fn virtio_event(&mut self, token: u64) {
        let Some(transport) = usize::try_from(token / 32).ok().and_then(|d| self.parts.virtio.get(d)) else { return };
        let mut transport = lock(transport);
        if token % 32 == VIRTIO_HOST {
            transport.process_host();
        } else {
            transport.process_notifications();
        }
    }

    fn console_input(&mut self, r: &mut Running) {
        let mut buf = [0u8; 64];
        // Straight from fd 0: std's buffered stdin would keep bytes that
        // epoll no longer reports.
        match read_fd(libc::STDIN_FILENO, &mut buf) {
            Ok(0) | Err(_) => {
                // End of input: the guest keeps running without it.
                let _ = r.epoll.ctl(ControlOperation::Delete, libc::STDIN_FILENO, EpollEvent::default());
                r.stdin_open = false;
            }
            Ok(n) => {
                let taken = lock(&self.parts.serial).enqueue_input(&buf[..n]);
                if taken < n {
                    tracing::debug!("Console input: {} bytes dropped (guest not reading)", n - taken);
                }
            }
        }
    }

    fn accept(&mut self, r: &mut Running) {
        let Some(control) = &mut self.parts.control else { return };
        for (token, fd) in control.accept() {
            let event = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
            if r.epoll.ctl(ControlOperation::Add, fd, event).is_err() {
                control.close(token);
            }
        }
    }

    fn control_request(&mut self, r: &mut Running, token: u64) {
        let Some(control) = self.parts.control.as_mut() else { return };
        if !control.owns(token) {
            return;
        }
        let lines = match control.read(token) {
            Incoming::Lines(lines) => lines,
            Incoming::Closed => return,
        };
        for line in lines {
            let reply = match line {
                Err(message) => control::error(&message),
                Ok(Request::Status) => control::ok(&self.status(r)),
                Ok(Request::Pause) => self.pause(r),
                Ok(Request::Resume) => {
                    r.shared.request(Target::Run);
                    control::ok(&self.status(r))
                }
                Ok(Request::Shutdown { force, timeout_ms }) => {
                    self.shutdown(r, force, timeout_ms.map(Duration::from_millis));
                    control::ok(&Shutdown::Stopping)
                }
            };
            if let Some(control) = self.parts.control.as_mut() {
                control.reply(token, &reply);
            }
        }
    }

    fn status(&self, r: &Running) -> Status {
        let state = match r.shared.target() {
            Target::Run => State::Running,
            Target::Pause => State::Paused,
            Target::Stop => State::Stopping,
        };
        Status {
            state,
            vcpus: u8::try_from(r.handles.len()).unwrap_or(u8::MAX),
            memory_mib: self.parts.memory_mib,
            uptime_ms: u64::try_from(self.parts.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            guest_ready_us: self.parts.ready.micros(),
        }
    }

    fn pause(&mut self, r: &mut Running) -> String {
        r.shared.request(Target::Pause);
        for handle in &r.handles {
            handle.kick();
        }
        if r.shared.wait_parked(r.handles.len(), PAUSE_TIMEOUT) {
            control::ok(&self.status(r))
        } else {
            r.shared.request(Target::Run);
            control::error("Not every vCPU stopped within 5 s; the VM keeps running")
        }
    }

    /// Asks the guest to shut down (Ctrl+Alt+Del), stopping it after
    /// `timeout`; stops it at once when `force`d or paused.
    fn shutdown(&mut self, r: &mut Running, force: bool, timeout: Option<Duration>) {
        if force || r.shared.target() == Target::Pause {
            r.shared.end(VmExit::Stopped);
            return;
        }
        lock(&self.parts.i8042).press_ctrl_alt_del();
        let timeout = timeout.unwrap_or(self.parts.shutdown_timeout).max(Duration::from_millis(1));
        if let Err(e) = r.timer.reset(timeout, None) {
            tracing::error!("Cannot arm the shutdown timer ({e}); stopping the guest now");
            r.shared.end(VmExit::Stopped);
        }
    }
}

/// A terminal on stdin switched to raw mode (but keeping Ctrl+C as SIGINT,
/// which shuts the VM down), and put back as it was on drop.
struct RawTerminal(libc::termios);

impl RawTerminal {
    fn enter() -> Option<Self> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(libc::STDIN_FILENO) } != 1 {
            return None;
        }
        // SAFETY: an all-zero termios is a valid buffer for tcgetattr to fill.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid, exclusively borrowed termios.
        if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: `raw` is a valid termios; cfmakeraw only edits it.
        unsafe { libc::cfmakeraw(&mut raw) };
        raw.c_lflag |= libc::ISIG;
        // SAFETY: `raw` is a valid termios for stdin, a terminal.
        if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(Self(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: restores the settings read from this same terminal.
        unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &self.0) };
    }
}

/// Blocks SIGTERM, SIGINT and SIGHUP in this thread (and the vCPU threads
/// it starts) and returns a signalfd that reports them.
fn block_termination_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: an all-zero sigset_t is a valid value to initialize with
    // sigemptyset, which the next call does.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
    }
    // SAFETY: `set` is initialized; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // SAFETY: `set` is initialized; -1 asks for a new descriptor.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: signalfd returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One `read(2)` from a descriptor this process owns elsewhere.
fn read_fd(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut file = std::mem::ManuallyDrop::new(
        // SAFETY: the descriptor stays owned by its owner; ManuallyDrop keeps
        // this temporary File from closing it.
        unsafe { std::fs::File::from_raw_fd(fd) },
    );
    file.read(buf)
}

fn read_signal(fd: &OwnedFd) -> u32 {
    let mut info = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
    let n = read_fd(fd.as_raw_fd(), &mut info).unwrap_or(0);
    if n < 4 {
        return 0;
    }
    u32::from_ne_bytes([info[0], info[1], info[2], info[3]])
}

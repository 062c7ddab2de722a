//! vCPUs: boot configuration, the exit loop, and one thread each.
//!
//! A vCPU thread installs its seccomp filter, waits for the VMM to start the
//! guest, then runs `KVM_RUN` until the VM stops. Port I/O and MMIO exits are
//! dispatched on the buses; every other exit either ends the VM (shutdown,
//! reset, power-off) or fails it with a report of where the guest was.
//! Pausing and stopping kick the thread out of `KVM_RUN` with a signal whose
//! handler sets `kvm_run.immediate_exit`, so a kick that lands just before
//! `KVM_RUN` is not lost.

use std::cell::Cell;
use std::fmt::Write as _;
use std::os::unix::thread::JoinHandleExt;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{
    KVM_INTERNAL_ERROR_DELIVERY_EV, KVM_INTERNAL_ERROR_EMULATION, KVM_INTERNAL_ERROR_SIMUL_EX,
    KVM_INTERNAL_ERROR_UNEXPECTED_EXIT_REASON, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET,
    KVM_SYSTEM_EVENT_SHUTDOWN, Msrs, kvm_run,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::vm::{Vm, VmError};
use crate::arch::x86_64::regs::{self, EntryPoint};
use crate::arch::x86_64::{cpuid, msr};
use crate::devices::bus::{Bus, lock};

/// A vCPU thread's stack: exit handling and device emulation need far less;
/// under 2 MiB so that a host with transparent huge pages always on cannot
/// back it with a 2 MiB page (Rust's default stack is 2 MiB).
const VCPU_STACK: usize = 512 << 10;
/// Why a vCPU could not be configured or started.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("Cannot set vCPU {index}'s {what}")]
    Configure { index: u8, what: &'static str, source: kvm_ioctls::Error },
    #[error("KVM accepted {set} of vCPU {index}'s {wanted} boot MSRs")]
    Msrs { index: u8, set: usize, wanted: usize },
    #[error("Cannot start vCPU {index}'s thread")]
    Spawn { index: u8, source: std::io::Error },
    #[error("Cannot install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
}

/// How the VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off (ACPI S5 or a KVM shutdown system event).
    PowerOff,
    /// The guest reset the machine (i8042 reset, triple fault, reset
    /// event): a microVM does not reboot, it ends.
    Reset(&'static str),
    /// A vCPU halted with no in-kernel interrupt controller to wake it.
    Halted,
    /// The control socket (or a signal) asked the VMM to stop.
    Stopped,
    /// The guest or KVM failed; the message says where and why.
    Failed(String),
}

impl VmExit {
    /// The VMM process's exit status for this ending.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Failed(_) => 1,
            _ => 0,
        }
    }
}

impl std::fmt::Display for VmExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PowerOff => write!(f, "the guest powered off"),
            Self::Reset(how) => write!(f, "the guest reset the machine ({how}); a microVM ends on reset"),
            Self::Halted => write!(f, "a vCPU halted"),
            Self::Stopped => write!(f, "stopped on request"),
            Self::Failed(why) => write!(f, "{why}"),
        }
    }
}

/// What the vCPUs are asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Run,
    Pause,
    Stop,
}

/// Shared between the VMM loop and the vCPU threads: the requested run
/// state, how many vCPUs are parked, and the first reason the VM ended.
#[derive(Debug)]
pub struct VcpuShared {
    state: Mutex<(Target, usize)>,
    changed: Condvar,
    exit: Mutex<Option<VmExit>>,
    /// Written when a vCPU ends the VM; the VMM loop waits on it.
    pub exit_evt: EventFd,
}

impl VcpuShared {
    /// Shared state for a VM about to run.
    pub fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            state: Mutex::new((Target::Run, 0)),
            changed: Condvar::new(),
            exit: Mutex::new(None),
            exit_evt: EventFd::new(libc::EFD_NONBLOCK)?,
        }))
    }

    /// Records why the VM ends (the first reason wins) and wakes the VMM.
    pub fn end(&self, why: VmExit) {
        let mut exit = lock(&self.exit);
        if exit.is_none() {
            *exit = Some(why);
            if let Err(e) = self.exit_evt.write(1) {
                tracing::error!("Cannot wake the VMM loop: {e}");
            }
        }
    }

    /// Why the VM ended, once it did.
    pub fn exit(&self) -> Option<VmExit> {
        lock(&self.exit).clone()
    }

    /// Asks every vCPU for `target` (the caller kicks them).
    pub fn request(&self, target: Target) {
        lock(&self.state).0 = target;
        self.changed.notify_all();
    }

    /// The requested state.
    pub fn target(&self) -> Target {
        lock(&self.state).0
    }

    /// Waits until `count` vCPUs are parked, or `timeout` passes.
    pub fn wait_parked(&self, count: usize, timeout: Duration) -> bool {
        let guard = lock(&self.state);
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |(target, parked)| *target == Target::Pause && *parked < count)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.1 >= count
    }

    /// Parks the calling vCPU while paused; `false` once it must stop.
    fn park_while_paused(&self) -> bool {
        let mut guard = lock(&self.state);
        if guard.0 == Target::Pause {
            guard.1 += 1;
            self.changed.notify_all();
            while guard.0 == Target::Pause {
                guard = self.changed.wait(guard).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            guard.1 -= 1;
        }
        guard.0 != Target::Stop
    }
}

/// Holds vCPU threads until the VMM has finished its own setup (its
/// seccomp filter above all), then lets them run the guest — or end.
#[derive(Debug, Default)]
pub struct StartGate {
    state: Mutex<Option<bool>>,
    opened: Condvar,
}

impl StartGate {
    /// A closed gate.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Releases every waiting thread: to run the guest, or (`false`) to end.
    pub fn open(&self, run: bool) {
        *lock(&self.state) = Some(run);
        self.opened.notify_all();
    }

    /// Waits for the gate; whether to run the guest.
    fn wait(&self) -> bool {
        let mut state = lock(&self.state);
        loop {
            if let Some(run) = *state {
                return run;
            }
            state = self.opened.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// What one `KVM_RUN` came back with.
#[derive(Debug, PartialEq, Eq)]
pub enum VcpuEvent {
    /// Handled; run again.
    Continue,
    /// Kicked out by a signal: look at the requested state.
    Interrupted,
    /// The VM ends.
    Exit(VmExit),
}

/// One vCPU.
#[derive(Debug)]
pub struct Vcpu {
    index: u8,
    fd: VcpuFd,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    memory: Arc<GuestMemoryMmap>,
}

impl Vcpu {
    /// Creates vCPU `index` of `vm`, dispatching exits on the two buses.
    pub fn new(vm: &Vm, index: u8, io_bus: Arc<Bus>, mmio_bus: Arc<Bus>) -> Result<Self, VcpuError> {
        let fd = vm.create_vcpu(index)?;
        Ok(Self { index, fd, io_bus, mmio_bus, memory: vm.memory().clone() })
    }

    /// The vCPU's KVM file descriptor (tests set registers through it).
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Sets CPUID, MSRs, registers, FPU and LAPIC for a Linux boot at `entry`.
    /// Application processors get the same state; KVM holds them until the
    /// boot processor sends INIT/SIPI.
    pub fn configure(&self, vm: &Vm, count: u8, entry: EntryPoint) -> Result<(), VcpuError> {
        let index = self.index;
        let fail = |what| move |source| VcpuError::Configure { index, what, source };
        let mut cpuid = vm.supported_cpuid()?;
        cpuid::normalize(cpuid.as_mut_slice(), index, count);
        self.fd.set_cpuid2(&cpuid).map_err(fail("CPUID"))?;
        let entries = msr::boot_msrs(&vm.msr_index_list()?);
        let msrs =
            Msrs::from_entries(&entries).map_err(|_| VcpuError::Msrs { index, set: 0, wanted: entries.len() })?;
        let set = self.fd.set_msrs(&msrs).map_err(fail("MSRs"))?;
        if set != entries.len() {
            return Err(VcpuError::Msrs { index, set, wanted: entries.len() });
        }
        let sregs = self.fd.get_sregs().map_err(fail("special registers"))?;
        self.fd.set_sregs(&regs::boot_sregs(sregs, entry)).map_err(fail("special registers"))?;
        self.fd.set_regs(&regs::boot_regs(entry)).map_err(fail("registers"))?;
        self.fd.set_fpu(&regs::boot_fpu()).map_err(fail("FPU"))?;
        let mut lapic = self.fd.get_lapic().map_err(fail("local APIC"))?;
        regs::set_lint(&mut lapic);
        self.fd.set_lapic(&lapic).map_err(fail("local APIC"))?;
        Ok(())
    }

    /// Runs the guest until its next exit and handles it.
    pub fn run_once(&mut self) -> VcpuEvent {
        enum Unhandled {
            Internal,
            FailEntry(u64, u32),
            Other(String),
            Errno(kvm_ioctls::Error),
        }
        let unhandled = match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.io_bus.read(u64::from(port), data) {
                    // Nothing there: the bus floats high, as on a PC.
                    data.fill(0xff);
                }
                return VcpuEvent::Continue;
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                self.io_bus.write(u64::from(port), data);
                return VcpuEvent::Continue;
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio_bus.read(addr, data) {
                    data.fill(0xff);
                }
                return VcpuEvent::Continue;
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio_bus.write(addr, data) {
                    tracing::debug!("vCPU {}: MMIO write to unmapped {addr:#x}", self.index);
                }
                return VcpuEvent::Continue;
            }
            Ok(VcpuExit::Hlt) => return VcpuEvent::Exit(VmExit::Halted),
            Ok(VcpuExit::Shutdown) => return VcpuEvent::Exit(VmExit::Reset("triple fault")),
            Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN => return VcpuEvent::Exit(VmExit::PowerOff),
                KVM_SYSTEM_EVENT_RESET => return VcpuEvent::Exit(VmExit::Reset("system reset event")),
                KVM_SYSTEM_EVENT_CRASH => Unhandled::Other("the guest reported a crash".into()),
                other => Unhandled::Other(format!("unexpected system event {other}")),
            },
            Ok(VcpuExit::InternalError) => Unhandled::Internal,
            Ok(VcpuExit::FailEntry(reason, cpu)) => Unhandled::FailEntry(reason, cpu),
            Ok(other) => Unhandled::Other(format!("unexpected exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                self.fd.set_kvm_immediate_exit(0);
                return VcpuEvent::Interrupted;
            }
            Err(e) => Unhandled::Errno(e),
        };
        let what = match unhandled {
            Unhandled::Internal => self.internal_error(),
            Unhandled::FailEntry(reason, cpu) => {
                format!("KVM could not enter the guest (hardware reason {reason:#x}, host CPU {cpu})")
            }
            Unhandled::Other(what) => what,
            Unhandled::Errno(e) => format!("KVM_RUN failed: {e}"),
        };
        VcpuEvent::Exit(VmExit::Failed(self.fault_report(&what)))
    }

    fn internal_error(&mut self) -> String {
        // SAFETY: the exit reason was KVM_EXIT_INTERNAL_ERROR, so `internal`
        // is the union member the kernel filled in.
        let internal = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal };
        let kind = match internal.suberror {
            KVM_INTERNAL_ERROR_EMULATION => "emulation failure",
            KVM_INTERNAL_ERROR_SIMUL_EX => "exception while delivering an exception",
            KVM_INTERNAL_ERROR_DELIVERY_EV => "event delivery failed",
            KVM_INTERNAL_ERROR_UNEXPECTED_EXIT_REASON => "unexpected exit reason",
            _ => "unknown",
        };
        let ndata = usize::try_from(internal.ndata).unwrap_or(0).min(internal.data.len());
        let data: Vec<String> = internal.data[..ndata].iter().map(|d| format!("{d:#x}")).collect();
        format!("KVM internal error, suberror {} ({kind}), data [{}]", internal.suberror, data.join(", "))
    }

    /// "vCPU n: <what> at RIP … (CS …); instruction bytes …".
    fn fault_report(&self, what: &str) -> String {
        let mut report = format!("vCPU {}: {what}", self.index);
        let (Ok(regs), Ok(sregs)) = (self.fd.get_regs(), self.fd.get_sregs()) else {
            report.push_str(" (registers unreadable)");
            return report;
        };
        let mode = if sregs.cs.l == 1 {
            "64-bit"
        } else if sregs.cr0 & 1 == 0 {
            "real mode"
        } else {
            "32-bit"
        };
        let _ = write!(report, " at RIP {:#x} (CS {:#x}, {mode})", regs.rip, sregs.cs.selector);
        let linear = sregs.cs.base.wrapping_add(regs.rip);
        let physical = match self.fd.translate_gva(linear) {
            Ok(t) if t.valid != 0 => Some(t.physical_address),
            _ => None,
        };
        let mut bytes = [0u8; 15];
        match physical.map(|p| self.memory.read_slice(&mut bytes, GuestAddress(p))) {
            Some(Ok(())) => {
                let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
                let _ = write!(report, "; instruction bytes {}", hex.join(" "));
            }
            _ => report.push_str("; instruction bytes unreadable (RIP not mapped to guest RAM)"),
        }
        report
    }

    /// Starts the vCPU's thread. It installs `filter`, waits at `start`,
    /// then runs until the VM stops.
    pub fn start(
        mut self,
        shared: Arc<VcpuShared>,
        filter: Option<seccompiler::BpfProgram>,
        start: Arc<StartGate>,
    ) -> Result<VcpuHandle, VcpuError> {
        install_kick_handler()?;
        let index = self.index;
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .stack_size(VCPU_STACK)
            .spawn(move || {
                let run = std::ptr::from_mut::<kvm_run>(self.fd.get_kvm_run());
                KVM_RUN.with(|p| p.set(run));
                if let Some(filter) = filter
                    && let Err(e) = seccompiler::apply_filter(&filter)
                {
                    shared.end(VmExit::Failed(format!("vCPU {index}: cannot install its seccomp filter: {e}")));
                }
                let run = start.wait();
                while run && shared.park_while_paused() && shared.exit().is_none() {
                    match self.run_once() {
                        VcpuEvent::Continue | VcpuEvent::Interrupted => {}
                        VcpuEvent::Exit(why) => {
                            shared.end(why);
                            break;
                        }
                    }
                }
                KVM_RUN.with(|p| p.set(std::ptr::null_mut()));
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuHandle { index, thread })
    }
}

/// A running vCPU thread.
#[derive(Debug)]
pub struct VcpuHandle {
    index: u8,
    thread: JoinHandle<()>,
}

impl VcpuHandle {
    /// Kicks the thread out of `KVM_RUN` to look at the requested state.
    pub fn kick(&self) {
        if self.thread.is_finished() {
            return;
        }
        // SAFETY: the thread has not been joined (we own its handle), so its
        // pthread_t is valid; the kick signal has a handler installed.
        let rc = unsafe { libc::pthread_kill(self.thread.as_pthread_t(), kick_signal()) };
        if rc != 0 {
            tracing::warn!("Cannot kick vCPU {}: error {rc}", self.index);
        }
    }

    /// Waits for the thread to end.
    pub fn join(self) {
        if self.thread.join().is_err() {
            tracing::error!("vCPU {} thread panicked", self.index);
        }
    }
}

thread_local! {
    /// This thread's `kvm_run`, for the kick signal handler.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// The real-time signal that kicks vCPUs out of `KVM_RUN`.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN.with(|run| {
        let run = run.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's own mapped `kvm_run`,
            // valid until the thread clears it before dropping its vCPU fd;
            // a volatile byte store is async-signal-safe.
            unsafe { std::ptr::write_volatile(&raw mut (*run).immediate_exit, 1) };
        }
    });
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALLED: std::sync::OnceLock<Result<(), vmm_sys_util::errno::Error>> = std::sync::OnceLock::new();
    (*INSTALLED.get_or_init(|| vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)))
        .map_err(VcpuError::Signal)
}

//! From a validated configuration to a VM ready to run: memory, KVM VM,
//! kernel and initramfs, ACPI tables, boot parameters, devices on their
//! buses with their interrupts, configured vCPUs, the control socket.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvm_ioctls::{IoEventAddress, Kvm};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::arch::x86_64::layout::{
    ACPI_SLEEP_PORT, BOOT_TIMER_ADDR, BOOT_TIMER_SIZE, I8042_IRQ, I8042_PORT, I8042_PORT_LEN, SERIAL_IRQ, SERIAL_PORT,
    SERIAL_PORT_LEN, VIRTIO_MMIO_SIZE, virtio_mmio_slot,
};
use crate::arch::x86_64::{boot, regs};
use crate::config::{self, Console, DiskConfig, NetConfig, VmConfig};
use crate::control::{ControlError, ControlServer};
use crate::devices::acpi::{AcpiTables, SleepControl, VirtioMmioDevice};
use crate::devices::boot_timer::BootTimer;
use crate::devices::bus::Bus;
use crate::devices::legacy::{I8042, SerialConsole};
use crate::devices::virtio::block::cow::CowError;
use crate::devices::virtio::block::{Block, CowDisk, DiskBackend, RawDisk};
use crate::devices::virtio::mmio::QUEUE_NOTIFY_OFFSET;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{MmioTransport, VirtioDevice};
use crate::devices::{EventTrigger, IrqLine};
use crate::vmm::{CONTROL_TOKENS, Vmm};
use crate::vstate::memory::{MemoryError, create_guest_memory};
use crate::vstate::vcpu::{Vcpu, VcpuError};
use crate::vstate::vm::{Vm, VmError};

/// Why the VM could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("Cannot open {what} {path}")]
    Open { what: &'static str, path: std::path::PathBuf, source: std::io::Error },
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    BootTables(#[from] regs::BootTablesError),
    #[error(transparent)]
    Acpi(#[from] crate::devices::acpi::tables::AcpiError),
    #[error("Cannot place a device on its bus (a bug in the memory map)")]
    Bus(#[from] crate::devices::bus::BusError),
    #[error("Cannot create an eventfd; the process may be out of file descriptors")]
    EventFd(#[source] std::io::Error),
    #[error("The console descriptor fd:{0} is not open; pass it to moat-vmm or choose another console")]
    ConsoleFd(i32),
    #[error("Cannot set up the console on the VMM's standard output")]
    Stdout(#[source] std::io::Error),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Disk(crate::devices::virtio::block::cow::CowError),
    #[error("No IOAPIC pin is left for a virtio device; attach fewer devices")]
    NoIrq,
    #[error("Cannot connect to passt at {path}; is passt running with --socket there?")]
    PasstConnect { path: std::path::PathBuf, source: std::io::Error },
    #[error("The passt descriptor fd:{0} is not an open socket; pass a socket connected to passt")]
    PasstFd(i32),
    #[error("Cannot set up the network device")]
    Net(#[source] std::io::Error),
}

/// Builds the VM `config` describes. `started` is when the VMM started,
/// the zero of the boot timer.
pub fn build_microvm(config: &VmConfig, started: Instant) -> Result<Vmm, BuildError> {
    build_microvm_on(None, config, started)
}

/// As [`build_microvm`], on `kvm` (`/dev/kvm` opened already) when given.
pub fn build_microvm_on(kvm: Option<Kvm>, config: &VmConfig, started: Instant) -> Result<Vmm, BuildError> {
    config::validate(config)?;
    let mut steps = Steps::new(started);
    // virtio-mmio devices first, in window order, so that a bad disk is
    // reported before anything else is set up: the entropy source, the disks
    // (vda, vdb, … in config order), the vsock device, the network device
    // (last, so that adding it moves no other device's window).
    let mut devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new().map_err(BuildError::EventFd)?)];
    for (i, disk) in config.disks.iter().enumerate() {
        devices.push(Box::new(open_disk(i, disk)?));
    }
    if let Some(vsock) = &config.vsock {
        let mut device = Vsock::new(u64::from(vsock.cid), &vsock.uds_path).map_err(|source| BuildError::Open {
            what: "the vsock socket",
            path: vsock.uds_path.clone(),
            source,
        })?;
        device.limit_host_ports(vsock.host_ports.clone());
        devices.push(Box::new(device));
    }
    if let Some(net) = &config.net {
        devices.push(Box::new(open_net(net)?));
    }
    steps.done("devices");
    let memory = create_guest_memory(config.memory_bytes())?;
    let vm = match kvm {
        Some(kvm) => Vm::with_kvm(kvm, memory)?,
        None => Vm::new(memory)?,
    };
    steps.done("memory and KVM");
    let mem = vm.memory().clone();
    let open = |what, path: &std::path::Path| {
        File::open(path).map_err(|source| BuildError::Open { what, path: path.into(), source })
    };
    let mut kernel_file = open("the kernel", &config.kernel)?;
    let kernel = boot::load_kernel(&mem, &mut kernel_file)?;
    steps.done("kernel");
    let initramfs = match &config.initramfs {
        Some(path) => Some(boot::load_initramfs(&mem, &mut open("the initramfs", path)?, kernel.end)?),
        None => None,
    };
    steps.done("initramfs");
    let slots = (0u32..)
        .zip(&devices)
        .map(|(i, _)| virtio_mmio_slot(i).map(|(base, irq)| VirtioMmioDevice { base, irq }).ok_or(BuildError::NoIrq))
        .collect::<Result<Vec<_>, _>>()?;
    let acpi = AcpiTables::new(config.vcpus, &slots)?;
    acpi.write(&mem)?;
    let entry = boot::write_boot_params(&mem, &kernel, &config.cmdline, initramfs, acpi.rsdp)?;
    regs::write_boot_tables(&mem)?;
    tracing::info!(
        "Kernel {} loaded: {entry}{}",
        config.kernel.display(),
        initramfs.map(|i| format!(", initramfs {} bytes at {:#x}", i.size, i.addr)).unwrap_or_default()
    );

    let eventfd = || EventFd::new(EFD_NONBLOCK).map_err(BuildError::EventFd);
    let irq = |gsi| -> Result<IrqLine, BuildError> {
        let evt = eventfd()?;
        vm.register_irq(&evt, gsi)?;
        Ok(IrqLine(evt))
    };
    let serial = Arc::new(Mutex::new(SerialConsole::new(irq(SERIAL_IRQ)?, console_writer(config)?)));
    let reset_evt = eventfd()?;
    let poweroff_evt = eventfd()?;
    let i8042 = Arc::new(Mutex::new(I8042::new(
        EventTrigger(reset_evt.try_clone().map_err(BuildError::EventFd)?),
        irq(I8042_IRQ)?,
    )));
    let sleep = SleepControl::new(EventTrigger(poweroff_evt.try_clone().map_err(BuildError::EventFd)?));
    let (timer, ready) = BootTimer::new(started);

    let mut io = Bus::default();
    io.insert(serial.clone(), u64::from(SERIAL_PORT), u64::from(SERIAL_PORT_LEN))?;
    io.insert(i8042.clone(), u64::from(I8042_PORT), u64::from(I8042_PORT_LEN))?;
    io.insert(Arc::new(Mutex::new(sleep)), u64::from(ACPI_SLEEP_PORT), 1)?;
    let mut mmio = Bus::default();
    mmio.insert(Arc::new(Mutex::new(timer)), BOOT_TIMER_ADDR, BOOT_TIMER_SIZE)?;
    let mut virtio = Vec::new();
    let mut ioeventfds = true;
    for (device, slot) in devices.into_iter().zip(&slots) {
        let transport = MmioTransport::new(device, mem.clone(), irq(slot.irq)?).map_err(BuildError::EventFd)?;
        // The guest's queue notifications become eventfd writes inside KVM.
        // Without ioeventfds (a KVM that refuses them) the same eventfds are
        // signalled from the vCPU's MMIO exit instead: slower, same result.
        for (queue, evt) in (0u32..).zip(transport.queue_events()) {
            let addr = IoEventAddress::Mmio(slot.base + QUEUE_NOTIFY_OFFSET);
            if ioeventfds && let Err(e) = vm.fd().register_ioevent(evt, &addr, queue) {
                tracing::warn!("KVM refuses ioeventfds ({e}); queue notifications exit to the VMM");
                ioeventfds = false;
            }
        }
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), slot.base, VIRTIO_MMIO_SIZE)?;
        virtio.push(transport);
    }
    let (io, mmio) = (Arc::new(io), Arc::new(mmio));

    let vcpus = (0..config.vcpus)
        .map(|index| {
            let vcpu = Vcpu::new(&vm, index, io.clone(), mmio.clone())?;
            vcpu.configure(&vm, config.vcpus, entry)?;
            Ok(vcpu)
        })
        .collect::<Result<Vec<_>, BuildError>>()?;
    let control = match &config.control_socket {
        Some(path) => Some(ControlServer::bind(path, CONTROL_TOKENS)?),
        None => None,
    };
    steps.done("vCPUs and buses");
    tracing::info!("VM built {}", steps.summary());
    Ok(Vmm::new(crate::vmm::VmmParts {
        vm,
        vcpus,
        serial,
        virtio,
        i8042,
        reset_evt,
        poweroff_evt,
        control,
        console_input: config::console(config).ok() == Some(Console::Stdout),
        ready,
        started,
        memory_mib: config.memory_mib,
        shutdown_timeout: std::time::Duration::from_millis(config.shutdown_timeout_ms),
        needs: crate::seccomp::Needs {
            connect: config.vsock.as_ref().is_some_and(crate::config::VsockConfig::guest_connects),
            unlink: config.control_socket.is_some(),
        },
    }))
}

/// How long each step of a build took, for the VMM's log: where a slow
/// start went (the kernel's copy into guest memory, the overlay's creation…).
struct Steps {
    started: Instant,
    last: Instant,
    done: Vec<(&'static str, std::time::Duration)>,
}

impl Steps {
    fn new(started: Instant) -> Self {
        let now = Instant::now();
        Self { started, last: now, done: vec![("process start", now - started)] }
    }

    fn done(&mut self, step: &'static str) {
        let now = Instant::now();
        self.done.push((step, now - self.last));
        self.last = now;
    }

    /// "in 120 ms after the process started (process start 3 ms, devices 20 ms, …)".
    fn summary(&self) -> String {
        let steps: Vec<String> = self.done.iter().map(|(step, d)| format!("{step} {} ms", d.as_millis())).collect();
        format!(
            "{} ms after the process started ({})",
            self.last.duration_since(self.started).as_millis(),
            steps.join(", ")
        )
    }
}

/// Opens disk `index`: its file as is, or its base under its overlay.
fn open_disk(index: usize, disk: &DiskConfig) -> Result<Block, BuildError> {
    let backend: Box<dyn DiskBackend> = match &disk.overlay {
        Some(overlay) => {
            let limit = disk.overlay_limit_mib.map_or(u64::MAX, |mib| mib << 20);
            Box::new(CowDisk::open(&disk.path, overlay, limit).map_err(|e| match e {
                // An overlay made for another base is a configuration mistake.
                CowError::Mismatch { .. } => BuildError::Config(crate::config::ConfigError {
                    field: format!("disks[{index}].overlay"),
                    reason: e.to_string(),
                }),
                e => BuildError::Disk(e),
            })?)
        }
        None => Box::new(RawDisk::open(&disk.path, disk.read_only).map_err(|source| BuildError::Open {
            what: "the disk",
            path: disk.path.clone(),
            source,
        })?),
    };
    Ok(Block::new(backend, disk.read_only, &format!("moat-disk-{index}")))
}

/// The network device on its passt stream, connected now so that a passt
/// that is not there is reported before the guest starts.
fn open_net(net: &NetConfig) -> Result<Net, BuildError> {
    let mac = config::mac_bytes(net)?;
    let stream = match (&net.passt_socket, net.passt_fd) {
        (Some(path), _) => {
            UnixStream::connect(path).map_err(|source| BuildError::PasstConnect { path: path.clone(), source })?
        }
        (None, Some(fd)) => {
            // SAFETY: fstat only fills `stat`, which we own.
            let mut stat: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above; an invalid descriptor makes fstat fail.
            if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                return Err(BuildError::PasstFd(fd));
            }
            // SAFETY: the descriptor is an open socket (checked above),
            // inherited for this purpose, and nothing else here owns it.
            unsafe { UnixStream::from_raw_fd(fd) }
        }
        (None, None) => {
            return Err(BuildError::Config(crate::config::ConfigError {
                field: "net".into(),
                reason: "give passt_socket or passt_fd".into(),
            }));
        }
    };
    Net::new(mac, stream).map_err(BuildError::Net)
}

fn console_writer(config: &VmConfig) -> Result<Box<dyn Write + Send>, BuildError> {
    Ok(match config::console(config)? {
        // A private duplicate of fd 1, unbuffered: the console is a byte
        // stream and a partial line (a prompt) must show at once.
        Console::Stdout => {
            Box::new(File::from(std::io::stdout().as_fd().try_clone_to_owned().map_err(BuildError::Stdout)?))
        }
        Console::None => Box::new(std::io::sink()),
        Console::File(path) => Box::new(
            std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|source| BuildError::Open {
                what: "the console file",
                path,
                source,
            })?,
        ),
        Console::Fd(fd) => {
            // SAFETY: F_GETFD only inspects the descriptor table.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(BuildError::ConsoleFd(fd));
            }
            // SAFETY: the descriptor is open (checked above), was inherited
            // for this purpose, and nothing else in this process owns it.
            Box::new(unsafe { File::from_raw_fd(fd) })
        }
    })
}

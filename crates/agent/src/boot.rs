//! Booting a microVM: from the initramfs to the root disk.
//!
//! When the kernel command line carries `moat.root=DEVICE`, the agent is the
//! `/init` of moat's initramfs. It loads the kernel modules the initramfs
//! holds (virtio, virtio-mmio, virtio-blk, vsock, …) in the dependency order
//! of the kernel's own `modules.dep`, waits for the root block device,
//! mounts it, and switches root to it. Each stage is reported on the console
//! (`moat-agent: modules loaded`, `root mounted`, `ready`) so that the host
//! can tell how far a boot got.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::kmod::{ModuleInitFlags, finit_module};
use nix::mount::{MsFlags, mount};

/// What the kernel command line asks of the agent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BootConfig {
    /// `moat.root=`: the root block device.
    pub root: Option<PathBuf>,
    /// `moat.rootfstype=` (default ext4).
    pub fstype: String,
    /// `moat.ro`: mount the root read-only under a tmpfs overlay.
    pub read_only: bool,
    /// `moat.overlay_mib=`: the size of that overlay (default: the tmpfs
    /// default, half of the guest's memory).
    pub overlay_mib: Option<u64>,
    /// `moat.disk_mib=`: what the sandbox may write to its root disk; the
    /// root file system's free space beyond it is held by
    /// [`DISK_RESERVE`], so that writes past it fail with "No space left on
    /// device" rather than reach the end of the copy-on-write overlay.
    pub disk_mib: Option<u64>,
    /// `moat.hostname=`.
    pub hostname: Option<String>,
    /// `moat.port=`: the vsock port to serve (default 1024).
    pub port: Option<u32>,
    /// `moat.boot_timer=ADDR` (hex): the physical address of moat-vmm's
    /// boot-timer page, written once the agent is ready.
    pub boot_timer: Option<u64>,
    /// `moat.net=ADDR/PREFIX,GATEWAY,DNS`: configure `eth0` (see
    /// [`crate::netconf`]); kept as written until the boot parses it.
    pub net: Option<String>,
}

impl BootConfig {
    /// Parses `/proc/cmdline`. Unknown words are the kernel's business.
    pub fn from_cmdline(cmdline: &str) -> Self {
        let mut config = Self { fstype: "ext4".into(), ..Self::default() };
        for word in cmdline.split_whitespace() {
            match word.split_once('=') {
                Some(("moat.root", dev)) => config.root = Some(dev.into()),
                Some(("moat.rootfstype", fs)) => config.fstype = fs.into(),
                Some(("moat.hostname", name)) => config.hostname = Some(name.into()),
                Some(("moat.port", port)) => config.port = port.parse().ok(),
                Some(("moat.overlay_mib", mib)) => config.overlay_mib = mib.parse().ok(),
                Some(("moat.disk_mib", mib)) => config.disk_mib = mib.parse().ok(),
                Some(("moat.net", net)) => config.net = Some(net.into()),
                Some(("moat.boot_timer", addr)) => {
                    config.boot_timer = u64::from_str_radix(addr.trim_start_matches("0x"), 16).ok();
                }
                None if word == "moat.ro" => config.read_only = true,
                _ => {}
            }
        }
        config
    }

    /// Whether this is a microVM boot (as opposed to PID 1 of a jail).
    pub fn is_vm_boot(&self) -> bool {
        self.root.is_some()
    }
}

/// The value moat-vmm's boot timer takes as "the guest is ready".
pub const BOOT_TIMER_READY: u8 = 123;

/// Tells moat-vmm's boot timer that the agent is ready: one byte written to
/// the timer's MMIO page through `/dev/mem`. The VMM records the time.
pub fn signal_boot_timer(addr: u64) -> std::io::Result<()> {
    use std::os::fd::AsFd;

    use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
    let mem = std::fs::OpenOptions::new().read(true).write(true).open("/dev/mem")?;
    let offset = i64::try_from(addr).map_err(|_| std::io::Error::other("boot timer address out of range"))?;
    let len = std::num::NonZeroUsize::new(4096).ok_or_else(|| std::io::Error::other("page size"))?;
    // SAFETY: a new shared mapping of one page of /dev/mem at a device
    // address; it aliases no memory of this process.
    let page = unsafe { mmap(None, len, ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, mem.as_fd(), offset) }
        .map_err(std::io::Error::from)?;
    // SAFETY: `page` is a live, writable mapping of at least one byte;
    // volatile because the write is a device access, not memory.
    unsafe { page.cast::<u8>().as_ptr().write_volatile(BOOT_TIMER_READY) };
    // SAFETY: unmapping exactly the mapping made above, no longer used.
    unsafe { munmap(page, len.get()) }.map_err(std::io::Error::from)
}

/// One line on the console, where a host watching the boot reads it.
pub fn stage(message: &str) {
    eprintln!("moat-agent: {message}");
}

/// Why a boot could not proceed.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("Cannot read {path}; the initramfs is incomplete, rebuild the image with `cargo xtask image --force`")]
    ReadModulesDep { path: PathBuf, source: std::io::Error },
    #[error(
        "Module {module} is listed in modules.dep but cannot be loaded; rebuild the image with `cargo xtask image --force`"
    )]
    LoadModule { module: String, source: std::io::Error },
    #[error(
        "Root device {0} did not appear within 10 s; is a virtio-blk disk attached and virtio_mmio described in ACPI?"
    )]
    NoRootDevice(PathBuf),
    #[error("Cannot mount the root device {device} ({fstype})")]
    MountRoot { device: PathBuf, fstype: String, source: nix::Error },
    #[error("Cannot switch to the new root at {0}")]
    SwitchRoot(PathBuf, #[source] nix::Error),
    #[error(
        "moat.net={0} is not ADDR/PREFIX,GATEWAY,DNS (IPv4); the host's vm backend writes it, so this is a bug there"
    )]
    BadNet(String),
    #[error(
        "Cannot hold the root file system's free space beyond moat.disk_mib in /{DISK_RESERVE}; is the image's rootfs.ext4 intact? (`cargo xtask image --force` rebuilds it)"
    )]
    ReserveDisk(#[source] std::io::Error),
    #[error(transparent)]
    Network(#[from] crate::netconf::NetError),
}

/// The file, at the root of a microVM's root file system, that holds the
/// free space beyond the sandbox's disk limit (unwritten extents: it costs
/// the overlay a few metadata blocks, not its size).
pub const DISK_RESERVE: &str = ".moat-disk-reserve";

/// Leaves `allowed_mib` MiB free on the file system mounted at `root`
/// (fewer when it has less) by allocating the rest to [`DISK_RESERVE`].
/// Returns the bytes held.
///
/// The copy-on-write overlay under the root disk holds at most the disk
/// limit (plus room for metadata); without this, the guest's file system
/// would see the whole image's free space and learn of the limit as I/O
/// errors, on which ext4 aborts its journal and the sandbox's root becomes
/// unusable. With it, a full disk is the ordinary "No space left on device".
pub fn reserve_beyond(root: &Path, allowed_mib: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::OpenOptionsExt;

    use nix::fcntl::{FallocateFlags, fallocate};
    let path = root.join(DISK_RESERVE);
    // Emptied before it is unlinked: a process that still holds it open (a
    // child forked while it was) would otherwise keep its blocks taken.
    if let Ok(old) = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
        let _ = old.set_len(0);
    }
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let stat = nix::sys::statvfs::statvfs(root)?;
    let free = stat.blocks_available().saturating_mul(stat.fragment_size());
    let Some(excess) = free.checked_sub(allowed_mib.saturating_mul(1 << 20)).filter(|n| *n > 0) else { return Ok(0) };
    let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o400).open(&path)?;
    let len = i64::try_from(excess).map_err(|_| std::io::Error::other("free space beyond i64"))?;
    fallocate(&file, FallocateFlags::empty(), 0, len)?;
    Ok(excess)
}

/// The dependency graph of `modules.dep`: module path → the paths it needs.
#[derive(Debug, Default, Clone)]
pub struct ModuleDeps {
    deps: HashMap<String, Vec<String>>,
    order: Vec<String>,
}

impl ModuleDeps {
    /// Parses the text of a `modules.dep` file.
    pub fn parse(text: &str) -> Self {
        let mut graph = Self::default();
        for line in text.lines() {
            let Some((module, deps)) = line.split_once(':') else { continue };
            let module = module.trim().to_owned();
            graph.order.push(module.clone());
            graph.deps.insert(module, deps.split_whitespace().map(str::to_owned).collect());
        }
        graph
    }

    /// The path of the module named `name` (`virtio_blk`, `virtio-rng`…).
    pub fn find(&self, name: &str) -> Option<&str> {
        self.order.iter().map(String::as_str).find(|path| module_name(path) == name)
    }

    /// `wanted` and everything they need, each after its dependencies.
    pub fn load_order<'a>(&'a self, wanted: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
        fn visit<'a>(graph: &'a ModuleDeps, module: &'a str, seen: &mut HashSet<&'a str>, out: &mut Vec<&'a str>) {
            if !seen.insert(module) {
                return;
            }
            for dep in graph.deps.get(module).into_iter().flatten() {
                visit(graph, dep, seen, out);
            }
            out.push(module);
        }
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for module in wanted {
            visit(self, module, &mut seen, &mut out);
        }
        out
    }

    /// Every module listed, each after its dependencies.
    pub fn all_in_order(&self) -> Vec<&str> {
        self.load_order(self.order.iter().map(String::as_str))
    }

    /// The `modules.dep` text for just `modules` (which must be closed under
    /// dependencies), for the initramfs.
    pub fn render(&self, modules: &[&str]) -> String {
        modules
            .iter()
            .map(|m| format!("{m}: {}\n", self.deps.get(*m).map(|d| d.join(" ")).unwrap_or_default()))
            .collect()
    }
}

/// `kernel/drivers/block/virtio_blk.ko` → `virtio_blk`.
pub fn module_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file)
}

/// Loads every module of `/lib/modules/$(uname -r)/modules.dep` in order.
pub fn load_modules() -> Result<usize, BootError> {
    let release = nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
    let dir = Path::new("/lib/modules").join(release);
    let dep_path = dir.join("modules.dep");
    let text =
        std::fs::read_to_string(&dep_path).map_err(|source| BootError::ReadModulesDep { path: dep_path, source })?;
    let graph = ModuleDeps::parse(&text);
    let order = graph.all_in_order();
    let params = CString::default();
    for module in &order {
        let load = || -> std::io::Result<()> {
            let file = std::fs::File::open(dir.join(module))?;
            match finit_module(&file, &params, ModuleInitFlags::empty()) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
                Err(e) => Err(e.into()),
            }
        };
        load().map_err(|source| BootError::LoadModule { module: module_name(module).to_owned(), source })?;
    }
    Ok(order.len())
}

/// Waits for `device` to appear (devtmpfs creates it when the driver probes).
pub fn wait_for_device(device: &Path, timeout: Duration) -> Result<(), BootError> {
    let deadline = Instant::now() + timeout;
    while !device.exists() {
        if Instant::now() > deadline {
            return Err(BootError::NoRootDevice(device.to_path_buf()));
        }
        // Exception to "wait on events": a microVM's boot only, never a
        // jail's create, exec or destroy. The event would be the kernel's
        // uevent (NETLINK_KOBJECT_UEVENT); this bounded check runs a few
        // times at most, while the guest kernel probes the disk.
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Mounts the root device at `/newroot` (read-only under a tmpfs overlay
/// with `moat.ro`), moves /dev, /proc and /sys into it and makes it `/`.
pub fn switch_root(config: &BootConfig) -> Result<(), BootError> {
    let Some(device) = &config.root else { return Ok(()) };
    let new_root = Path::new("/newroot");
    let _ = std::fs::create_dir_all(new_root);
    // Online discard on a writable ext4 root: a deleted file's blocks
    // leave the overlay, so writing and deleting does not fill it.
    let options = (config.fstype == "ext4" && !config.read_only).then_some("discard");
    let mount_root = |target: &Path, flags: MsFlags| {
        mount(Some(device.as_path()), target, Some(config.fstype.as_str()), flags, options)
            .map_err(|source| BootError::MountRoot { device: device.clone(), fstype: config.fstype.clone(), source })
    };
    if config.read_only {
        let (lower, scratch) = (Path::new("/lower"), Path::new("/scratch"));
        let _ = std::fs::create_dir_all(lower);
        let _ = std::fs::create_dir_all(scratch);
        mount_root(lower, MsFlags::MS_RDONLY)?;
        let options = match config.overlay_mib {
            Some(mib) => format!("mode=0755,size={mib}m"),
            None => "mode=0755".to_owned(),
        };
        let tmpfs = mount(Some("tmpfs"), scratch, Some("tmpfs"), MsFlags::empty(), Some(options.as_str()));
        tmpfs.map_err(|e| BootError::SwitchRoot(scratch.to_path_buf(), e))?;
        let _ = std::fs::create_dir_all(scratch.join("upper"));
        let _ = std::fs::create_dir_all(scratch.join("work"));
        let options = "lowerdir=/lower,upperdir=/scratch/upper,workdir=/scratch/work";
        mount(Some("overlay"), new_root, Some("overlay"), MsFlags::empty(), Some(options))
            .map_err(|e| BootError::SwitchRoot(new_root.to_path_buf(), e))?;
    } else {
        mount_root(new_root, MsFlags::empty())?;
        if let Some(mib) = config.disk_mib {
            let held = reserve_beyond(new_root, mib).map_err(BootError::ReserveDisk)?;
            stage(&format!("disk limited to {mib} MiB ({} MiB of free space held)", held >> 20));
        }
    }
    for fs in ["/dev", "/proc", "/sys"] {
        let target = new_root.join(fs.trim_start_matches('/'));
        let _ = std::fs::create_dir_all(&target);
        if let Err(e) = mount(Some(fs), &target, None::<&str>, MsFlags::MS_MOVE, None::<&str>) {
            tracing::warn!("cannot move {fs} into the new root: {e}");
        }
    }
    let switch = || -> nix::Result<()> {
        nix::unistd::chdir(new_root)?;
        mount(Some(new_root), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)?;
        nix::unistd::chroot(".")?;
        nix::unistd::chdir("/")
    };
    switch().map_err(|e| BootError::SwitchRoot(new_root.to_path_buf(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/net/vmw_vsock/vsock.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
";

    #[test]
    fn dependencies_load_first() {
        let graph = ModuleDeps::parse(DEP);
        let order = graph.all_in_order();
        assert_eq!(order.len(), 7);
        let pos = |name: &str| order.iter().position(|m| module_name(m) == name).expect(name);
        assert!(pos("virtio_ring") < pos("virtio"));
        assert!(pos("virtio") < pos("virtio_mmio"));
        assert!(pos("vsock") < pos("vmw_vsock_virtio_transport_common"));
        assert!(pos("vmw_vsock_virtio_transport_common") < pos("vmw_vsock_virtio_transport"));
    }

    #[test]
    fn closure_of_wanted_modules() {
        let graph = ModuleDeps::parse(DEP);
        let wanted = graph.find("virtio_mmio").expect("listed");
        let order = graph.load_order([wanted]);
        let names: Vec<_> = order.iter().map(|m| module_name(m)).collect();
        assert_eq!(names, ["virtio_ring", "virtio", "virtio_mmio"]);
        assert_eq!(module_name(graph.find("virtio-rng").expect("dash name")), "virtio-rng");
        let text = graph.render(&order);
        assert_eq!(ModuleDeps::parse(&text).all_in_order(), order);
    }

    #[test]
    fn cmdline_words() {
        let config = BootConfig::from_cmdline("console=ttyS0 moat.root=/dev/vda moat.ro moat.hostname=box quiet");
        assert_eq!(config.root.as_deref(), Some(Path::new("/dev/vda")));
        assert!(config.read_only && config.is_vm_boot());
        assert_eq!((config.fstype.as_str(), config.hostname.as_deref()), ("ext4", Some("box")));
        assert!(!BootConfig::from_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1").is_vm_boot());
        assert_eq!(BootConfig::from_cmdline("moat.boot_timer=0xc0000000").boot_timer, Some(0xc000_0000));
        assert_eq!(config.boot_timer, None);
        assert_eq!(BootConfig::from_cmdline("moat.ro moat.overlay_mib=512").overlay_mib, Some(512));
        assert_eq!(BootConfig::from_cmdline("moat.root=/dev/vda moat.disk_mib=2048").disk_mib, Some(2048));
        assert_eq!(config.disk_mib, None);
    }

    #[test]
    fn the_reserve_leaves_the_disk_limit_free_and_writes_past_it_say_no_space() {
        let dir = tempfile::tempdir().expect("tempdir");
        // More allowed than there is free: nothing held, no file.
        assert_eq!(reserve_beyond(dir.path(), u64::MAX).expect("reserves"), 0);
        assert!(!dir.path().join(DISK_RESERVE).exists());
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping the tmpfs half: mounting one needs root");
            return;
        }
        let fs = dir.path().join("fs");
        std::fs::create_dir(&fs).expect("mount point");
        mount(Some("tmpfs"), &fs, Some("tmpfs"), MsFlags::empty(), Some("size=64m")).expect("a tmpfs");
        let checks = || {
            let avail = |path: &Path| {
                let stat = nix::sys::statvfs::statvfs(path).expect("statvfs");
                stat.blocks_available() * stat.fragment_size()
            };
            let held = reserve_beyond(&fs, 16).expect("reserves");
            assert!(held > 40 << 20, "held {held}");
            assert!(avail(&fs).abs_diff(16 << 20) <= 64 << 10, "{} bytes left free", avail(&fs));
            // Again (a reboot of the same disk): the old reserve is replaced.
            assert_eq!(reserve_beyond(&fs, 16).expect("reserves again"), held);
            let err = std::fs::write(fs.join("big"), vec![1u8; 20 << 20]).expect_err("past the limit");
            assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
            std::fs::write(fs.join("big"), vec![1u8; 8 << 20]).expect("under the limit");
        };
        let result = std::panic::catch_unwind(checks);
        nix::mount::umount(&fs).expect("unmounts the tmpfs");
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}

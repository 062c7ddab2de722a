//! The jail a VMM runs in (`moat-vmm --jail DIR`), after Firecracker's
//! jailer, but inside moat-vmm itself so that it is one place:
//!
//! 1. The paths of the configuration are made absolute and canonical, and
//!    the files the VMM will create (a disk's overlay, the console file)
//!    are created, as the caller, before anything else.
//! 2. `/dev/kvm` is opened by the caller (the jail has no `/dev`).
//! 3. [`Jail::enter`] unshares a PID namespace (and a user namespace when
//!    not root, or root without `CAP_SYS_ADMIN`, mapping the caller's ids
//!    onto themselves) and forks. The
//!    parent stays outside as the jail's **supervisor**: it forwards
//!    SIGTERM, SIGINT and SIGHUP to the VMM, waits for it, removes its
//!    socket files and ends the way the VMM ended, so that whoever started
//!    moat-vmm sees the same exit status and signals as without a jail.
//! 4. The child is PID 1 of its namespace. It unshares mount, IPC, UTS and
//!    network namespaces, makes every mount private, mounts a small tmpfs
//!    on DIR and bind-mounts into it, each at its own host path, only what
//!    the configuration names: the kernel, the initramfs and the disks
//!    read-only (a disk without an overlay read-write unless `read_only`),
//!    overlays and the console file read-write, passt's socket, and the
//!    directories of the control and vsock sockets (their files are created
//!    there, so the caller reaches them at the same host paths). Every
//!    mount is `nosuid,nodev,noexec`; the tmpfs is then made read-only and
//!    the VMM `pivot_root`s into it, leaving the host's tree behind.
//! 5. It drops every capability from every set and the bounding set, locks
//!    the securebits so that uid 0 cannot regain any, sets
//!    `no_new_privs`, and asks for SIGKILL when the supervisor dies.
//!
//! The mounts live in the VMM's private mount namespace: they vanish with
//! it, and nothing is left mounted on the host.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::config::{self, Console, VmConfig};

/// Why the jail could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("Cannot use {path} for the jail: {why}")]
    Path { path: PathBuf, why: String },
    #[error("Cannot create {path} before jailing the VMM")]
    Create { path: PathBuf, source: std::io::Error },
    #[error(
        "Cannot create the jail's namespaces ({what}); run moat-vmm as root, or allow unprivileged user \
         namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu \
         kernel.apparmor_restrict_unprivileged_userns=0), or run without --jail"
    )]
    Namespaces { what: &'static str, source: std::io::Error },
    #[error("Cannot fork the jailed VMM; the host may be out of processes or memory")]
    Fork(#[source] std::io::Error),
    #[error("Cannot set up the jail's file system ({what} {path})")]
    Mount { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("Cannot drop the VMM's privileges ({what})")]
    Privileges { what: &'static str, source: std::io::Error },
}

/// How a bind mount may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    ReadOnly,
    ReadWrite,
}

/// One host path made visible in the jail, at the same path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bind {
    path: PathBuf,
    directory: bool,
    access: Access,
}

/// A planned jail: its root and what is bound into it.
#[derive(Debug)]
pub struct Jail {
    root: PathBuf,
    binds: Vec<Bind>,
    /// Socket files the VMM creates; the supervisor removes them.
    sockets: Vec<PathBuf>,
}

/// How the jailed VMM ended, as its supervisor saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this status.
    Exited(u8),
    /// A signal killed it.
    Killed(i32),
}

/// Which process [`Jail::enter`] returned in.
#[derive(Debug)]
pub enum Side {
    /// The VMM, now jailed: build and run the VM.
    Jailed,
    /// The supervisor, after the VMM ended: end the same way ([`end_like`]).
    Supervisor(Ended),
}

/// The signals the supervisor passes on (the ones the VMM shuts down on).
const FORWARDED: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// The securebits a jailed VMM runs with: uid 0 gets no capabilities back
/// from exec or setuid, ambient capabilities cannot be raised, all locked.
const SECUREBITS: libc::c_ulong = 0b1110_1111;

impl Jail {
    /// Plans the jail at `root` for `config`, rewriting the configuration's
    /// paths to their canonical forms (which the jail reproduces), and
    /// creating the overlay and console files that do not exist yet.
    pub fn plan(root: &Path, config: &mut VmConfig) -> Result<Self, JailError> {
        let bad = |path: &Path, why: &str| JailError::Path { path: path.into(), why: why.into() };
        std::fs::create_dir_all(root).map_err(|source| JailError::Create { path: root.into(), source })?;
        let root = canonical(root)?;
        let mut binds = Vec::new();
        let mut sockets = Vec::new();
        let mut file = |path: &mut PathBuf, access: Access, create: bool| -> Result<(), JailError> {
            if create {
                create_file(path)?;
            }
            *path = canonical(path)?;
            if std::fs::metadata(&*path).is_ok_and(|m| m.is_dir()) {
                return Err(bad(path, "a directory where a file is expected"));
            }
            binds.push(Bind { path: path.clone(), directory: false, access });
            Ok(())
        };
        file(&mut config.kernel, Access::ReadOnly, false)?;
        if let Some(initramfs) = &mut config.initramfs {
            file(initramfs, Access::ReadOnly, false)?;
        }
        for disk in &mut config.disks {
            let writable = !disk.read_only && disk.overlay.is_none();
            file(&mut disk.path, if writable { Access::ReadWrite } else { Access::ReadOnly }, false)?;
            if let Some(overlay) = &mut disk.overlay {
                file(overlay, Access::ReadWrite, true)?;
            }
        }
        if let Some(path) = config.net.as_mut().and_then(|n| n.passt_socket.as_mut()) {
            file(path, Access::ReadWrite, false)?;
        }
        if let Ok(Console::File(path)) = config::console(config) {
            let mut path = path;
            file(&mut path, Access::ReadWrite, true)?;
            config.console = format!("file:{}", path.display());
        }
        let mut socket = |path: &mut PathBuf| -> Result<(), JailError> {
            let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
                return Err(bad(path, "not a socket path in a directory"));
            };
            let dir = canonical(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?;
            if dir == Path::new("/") {
                return Err(bad(path, "the jail would see the whole host; put the socket in a directory of its own"));
            }
            *path = dir.join(name);
            sockets.push(path.clone());
            binds.push(Bind { path: dir, directory: true, access: Access::ReadWrite });
            Ok(())
        };
        if let Some(vsock) = &mut config.vsock {
            socket(&mut vsock.uds_path)?;
        }
        if let Some(control) = &mut config.control_socket {
            socket(control)?;
        }
        Ok(Self { binds: tidy(binds, &root)?, root, sockets })
    }

    /// Enters the jail: returns [`Side::Jailed`] in the jailed VMM and
    /// [`Side::Supervisor`] in the caller once the VMM has ended. Must be
    /// called while the process has a single thread.
    pub fn enter(self) -> Result<Side, JailError> {
        let ns = |what| move |source| JailError::Namespaces { what, source };
        // SAFETY: geteuid/getegid/getppid only read the caller's credentials.
        let (uid, gid, parent) = unsafe { (libc::geteuid(), libc::getegid(), libc::getppid()) };
        // A new user namespace clears the parent-death signal our starter
        // may have asked for; the supervisor sets it again (below).
        let mut death_signal: libc::c_int = 0;
        // SAFETY: PR_GET_PDEATHSIG writes one int to the pointer given.
        unsafe { libc::prctl(libc::PR_GET_PDEATHSIG, &mut death_signal as *mut libc::c_int, 0, 0, 0) };
        // Root needs no user namespace; root without CAP_SYS_ADMIN (in a
        // container) gets one, as any other user does.
        let user_namespace = uid != 0
            || match check(
                // SAFETY: unshare(2) with constant flags; no memory is passed.
                unsafe { libc::unshare(libc::CLONE_NEWPID) },
            ) {
                Ok(()) => false,
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => true,
                Err(e) => return Err(ns("pid")(e)),
            };
        if user_namespace {
            // SAFETY: as above.
            check(unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWPID) }).map_err(ns("user and pid"))?;
            let write = |file: &str, text: String| std::fs::write(format!("/proc/self/{file}"), text);
            write("setgroups", "deny".into()).map_err(ns("setgroups"))?;
            write("uid_map", format!("{uid} {uid} 1\n")).map_err(ns("uid_map"))?;
            write("gid_map", format!("{gid} {gid} 1\n")).map_err(ns("gid_map"))?;
        }
        // Blocked from before the fork: a signal that arrives while the
        // VMM sets up waits for it (its signalfd), and the supervisor
        // takes SIGCHLD and what it forwards with sigwaitinfo.
        let mut mask = signal_set(&FORWARDED);
        // SAFETY: adds to a set this function owns.
        unsafe { libc::sigaddset(&mut mask, libc::SIGCHLD) };
        // SAFETY: sets this thread's mask from a valid set.
        match unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &mask, std::ptr::null_mut()) } {
            0 => {}
            e => return Err(ns("signal mask")(std::io::Error::from_raw_os_error(e))),
        }
        // The jailed VMM learns that its supervisor is gone when this
        // pipe's write end closes (see `jailed`).
        let mut ends = [0; 2];
        // SAFETY: pipe2 fills the two-element array it is given.
        check(unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) }).map_err(JailError::Fork)?;
        // SAFETY: both descriptors were just created and are owned here only.
        let (alive_read, alive_write) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        // SAFETY: the caller guarantees a single thread, so the child
        // inherits no lock held by another thread.
        let pid = unsafe { libc::fork() };
        match pid {
            -1 => Err(JailError::Fork(std::io::Error::last_os_error())),
            0 => {
                drop(alive_write);
                // SAFETY: SIGCHLD was blocked for the supervisor's sake only.
                unsafe {
                    let mut chld = signal_set(&[]);
                    libc::sigaddset(&mut chld, libc::SIGCHLD);
                    libc::pthread_sigmask(libc::SIG_UNBLOCK, &chld, std::ptr::null_mut());
                }
                self.jailed(&alive_read)?;
                Ok(Side::Jailed)
            }
            child => {
                drop(alive_read);
                // The supervisor needs no privilege either.
                drop_privileges()?;
                if death_signal != 0 {
                    // SAFETY: prctl with plain values; getppid reads only;
                    // kill signals the supervisor's own child.
                    unsafe {
                        libc::prctl(libc::PR_SET_PDEATHSIG, death_signal, 0, 0, 0);
                        if libc::getppid() != parent {
                            // The starter died meanwhile: end as it asked.
                            libc::kill(child, libc::SIGKILL);
                        }
                    }
                }
                let ended = supervise(child, &mask);
                for socket in &self.sockets {
                    use std::os::unix::fs::FileTypeExt;
                    if std::fs::symlink_metadata(socket).is_ok_and(|m| m.file_type().is_socket()) {
                        let _ = std::fs::remove_file(socket);
                    }
                }
                drop(alive_write);
                Ok(Side::Supervisor(ended))
            }
        }
    }

    /// The child's half: namespaces, the file system, privileges.
    fn jailed(&self, alive: &OwnedFd) -> Result<(), JailError> {
        // SAFETY: unshare(2) with constant flags.
        check(unsafe {
            libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET)
        })
        .map_err(|source| JailError::Namespaces { what: "mount, ipc, uts and network", source })?;
        let root = &self.root;
        let fail = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| JailError::Mount { what, path, source }
        };
        mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)
            .map_err(fail("making private", Path::new("/")))?;
        let hidden = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        mount(Some(Path::new("moat-vmm")), root, Some("tmpfs"), hidden, Some("size=64k,nr_inodes=256,mode=0755"))
            .map_err(fail("mounting a tmpfs on", root))?;
        for bind in &self.binds {
            let target = beneath(root, &bind.path);
            make_mount_point(root, &target, bind.directory).map_err(fail("creating the mount point", &target))?;
            mount(Some(&bind.path), &target, None, libc::MS_BIND, None).map_err(fail("bind-mounting", &bind.path))?;
            let mut flags = libc::MS_BIND | libc::MS_REMOUNT | hidden | locked_flags(&bind.path);
            if bind.access == Access::ReadOnly {
                flags |= libc::MS_RDONLY;
            }
            mount(None, &target, None, flags, None).map_err(fail("restricting", &target))?;
        }
        mount(None, root, None, libc::MS_REMOUNT | libc::MS_RDONLY | hidden, None)
            .map_err(fail("making read-only", root))?;
        std::env::set_current_dir(root).map_err(fail("entering", root))?;
        let dot = c".";
        // SAFETY: pivot_root(".", ".") with NUL-terminated constant strings:
        // the old root is stacked under the new one, then detached.
        match check(unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) }) {
            Ok(()) => {
                // SAFETY: detaches the old root, now mounted on "."; no memory passed.
                check(unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) })
                    .map_err(fail("detaching the host from", root))?;
            }
            // The host's root is the initial ramfs, which cannot be pivoted
            // away (a machine that never left its initramfs, like the nested
            // test host): move the jail's root over it and chroot there, as
            // switch_root and runc do. The ramfs below is out of reach of a
            // process without CAP_SYS_CHROOT and without /proc.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                mount(Some(root), Path::new("/"), None, libc::MS_MOVE, None)
                    .map_err(fail("moving over the initial ramfs", root))?;
                // SAFETY: chroot(".") with a constant string; cwd is the jail's root.
                check(unsafe { libc::chroot(dot.as_ptr()) }).map_err(fail("entering", root))?;
            }
            Err(e) => return Err(fail("pivoting into", root)(e)),
        }
        std::env::set_current_dir("/").map_err(fail("entering", Path::new("/")))?;
        let name = b"moat-vmm";
        // SAFETY: sethostname reads `name.len()` bytes of `name`.
        let _ = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
        drop_privileges()?;
        // Last, since changing credentials clears it: die with the supervisor.
        // SAFETY: prctl with constant arguments.
        check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
            .map_err(|source| JailError::Privileges { what: "parent-death signal", source })?;
        // A supervisor that died before that would never signal.
        let mut poll = libc::pollfd { fd: alive.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: polls one descriptor this process owns, without waiting.
        if unsafe { libc::poll(&mut poll, 1, 0) } != 0 {
            // SAFETY: ends this process at once; nothing needs flushing.
            unsafe { libc::_exit(1) };
        }
        Ok(())
    }
}

/// The absolute, canonical form of an existing `path`.
fn canonical(path: &Path) -> Result<PathBuf, JailError> {
    std::fs::canonicalize(path).map_err(|e| JailError::Path { path: path.into(), why: e.to_string() })
}

/// Creates `path` (empty, for the caller only) when it does not exist.
fn create_file(path: &Path) -> Result<(), JailError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map(drop)
        .map_err(|source| JailError::Create { path: path.into(), source })
}

/// The binds in mount order, each once: nothing inside the jail's root,
/// nothing already under a bound directory, directories first.
fn tidy(mut binds: Vec<Bind>, root: &Path) -> Result<Vec<Bind>, JailError> {
    if let Some(b) = binds.iter().find(|b| b.path.starts_with(root)) {
        return Err(JailError::Path { path: b.path.clone(), why: format!("inside the jail {}", root.display()) });
    }
    binds.sort_by(|a, b| b.directory.cmp(&a.directory).then(a.path.cmp(&b.path)));
    let mut kept: Vec<Bind> = Vec::new();
    for bind in binds {
        if let Some(same) = kept.iter_mut().find(|k| k.path == bind.path) {
            if bind.access == Access::ReadWrite {
                same.access = Access::ReadWrite;
            }
        } else if !kept.iter().any(|k| k.directory && bind.path.starts_with(&k.path)) {
            kept.push(bind);
        }
    }
    Ok(kept)
}

/// `path` (absolute, canonical) under `root`.
fn beneath(root: &Path, path: &Path) -> PathBuf {
    root.join(path.components().filter(|c| matches!(c, Component::Normal(_))).collect::<PathBuf>())
}

/// Creates the directories down to `target` on the jail's fresh tmpfs
/// (where no link can redirect them), then `target` itself.
fn make_mount_point(root: &Path, target: &Path, directory: bool) -> std::io::Result<()> {
    if let Some(parent) = target.parent()
        && parent != root
    {
        std::fs::create_dir_all(parent)?;
    }
    if directory {
        match std::fs::create_dir(target) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    } else {
        std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(target)?;
    }
    Ok(())
}

/// The flags of the mount holding `path` that a bind of it must keep (a
/// user namespace may not clear them).
fn locked_flags(path: &Path) -> libc::c_ulong {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else { return 0 };
    // SAFETY: statvfs fills the struct it is given from a NUL-terminated path.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
        return 0;
    }
    [
        (libc::ST_RDONLY, libc::MS_RDONLY),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ]
    .into_iter()
    .filter(|(st, _)| stat.f_flag & st != 0)
    .fold(0, |flags, (_, ms)| flags | ms)
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> std::io::Result<()> {
    let c = |bytes: &[u8]| CString::new(bytes).map_err(|_| std::io::ErrorKind::InvalidInput);
    let source = source.map(|s| c(s.as_os_str().as_bytes())).transpose()?;
    let target = c(target.as_os_str().as_bytes())?;
    let fstype = fstype.map(|s| c(s.as_bytes())).transpose()?;
    let data = data.map(|s| c(s.as_bytes())).transpose()?;
    let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string that
    // outlives the call.
    check(unsafe { libc::mount(ptr(&source), target.as_ptr(), ptr(&fstype), flags, ptr(&data).cast()) })
}

/// Drops every capability from every set and from the bounding set, locks
/// the securebits, and sets `no_new_privs`.
pub fn drop_privileges() -> Result<(), JailError> {
    let fail = |what| move |source| JailError::Privileges { what, source };
    // SAFETY: prctl with constant arguments (needs CAP_SETPCAP, held until below).
    check(unsafe { libc::prctl(libc::PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0) }).map_err(fail("securebits"))?;
    for cap in 0..64 {
        // SAFETY: prctl with constant arguments; past the last capability
        // the kernel answers EINVAL, which ends the loop.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) && cap > 0 {
                break;
            }
            return Err(fail("bounding set")(e));
        }
    }
    // SAFETY: prctl with constant arguments.
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) })
        .map_err(fail("ambient set"))?;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let header = Header { version: VERSION_3, pid: 0 };
    let data = [Data { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset reads a version-3 header and two data words, both
    // laid out as <linux/capability.h> defines them.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) }).map_err(fail("capset"))?;
    // SAFETY: prctl with constant arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }).map_err(fail("no_new_privs"))
}

/// Waits for `child`, passing it the forwarded signals; how it ended.
fn supervise(child: libc::pid_t, mask: &libc::sigset_t) -> Ended {
    loop {
        // SAFETY: waits for a signal of `mask`, all blocked on this thread.
        let signal = unsafe { libc::sigwaitinfo(mask, std::ptr::null_mut()) };
        if FORWARDED.contains(&signal) {
            // SAFETY: signals the supervisor's own child.
            unsafe { libc::kill(child, signal) };
            continue;
        }
        let mut status = 0;
        // SAFETY: reaps the supervisor's own child, filling `status`.
        match unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } {
            0 => {}
            -1 if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            -1 => return Ended::Exited(1),
            _ if libc::WIFSIGNALED(status) => return Ended::Killed(libc::WTERMSIG(status)),
            _ if libc::WIFEXITED(status) => {
                return Ended::Exited(u8::try_from(libc::WEXITSTATUS(status)).unwrap_or(1));
            }
            _ => {}
        }
    }
}

/// Ends the supervisor the way its VMM ended: the same signal (without a
/// core dump of its own), or 128 + the signal should that not kill it.
pub fn end_like(signal: i32) -> u8 {
    let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: setrlimit reads the struct it is given; signal, sigprocmask
    // and raise take plain values and a set built here.
    unsafe {
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::signal(signal, libc::SIG_DFL);
        let set = signal_set(&[signal]);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(signal);
    }
    u8::try_from(128 + signal).unwrap_or(1)
}

fn signal_set(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: sigemptyset initializes the set; sigaddset adds valid signals.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in signals {
            libc::sigaddset(&mut set, *s);
        }
        set
    }
}

/// A system call's result: negative is the error in `errno`.
fn check(result: impl Into<i64>) -> std::io::Result<()> {
    if result.into() < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskConfig, VsockConfig};

    #[test]
    fn the_plan_binds_what_the_configuration_names_at_canonical_paths() {
        let dir = tempfile::tempdir().expect("dir");
        let d = canonical(dir.path()).expect("canonical");
        std::fs::write(d.join("vmlinux"), b"k").expect("kernel");
        std::fs::write(d.join("rootfs"), b"r").expect("disk");
        std::fs::create_dir(d.join("sock")).expect("socket dir");
        std::os::unix::fs::symlink(d.join("vmlinux"), d.join("link")).expect("link");
        let mut config = VmConfig::new(d.join("link"));
        config.disks = vec![DiskConfig { overlay: Some(d.join("ov")), ..DiskConfig::new(d.join("rootfs"), false) }];
        config.vsock = Some(VsockConfig { cid: 3, uds_path: d.join("sock/v.sock"), host_ports: None });
        config.control_socket = Some(d.join("sock/./ctl.sock"));
        config.console = format!("file:{}", d.join("console").display());
        let jail = Jail::plan(&d.join("jail"), &mut config).expect("plans");
        assert_eq!(config.kernel, d.join("vmlinux"), "links resolved");
        assert!(d.join("ov").is_file() && d.join("console").is_file(), "created before jailing");
        let binds: Vec<_> = jail.binds.iter().map(|b| (b.path.strip_prefix(&d).expect("in dir"), b.access)).collect();
        assert_eq!(
            binds,
            [
                (Path::new("sock"), Access::ReadWrite),
                (Path::new("console"), Access::ReadWrite),
                (Path::new("ov"), Access::ReadWrite),
                (Path::new("rootfs"), Access::ReadOnly),
                (Path::new("vmlinux"), Access::ReadOnly),
            ]
        );
        assert_eq!(jail.sockets, [d.join("sock/v.sock"), d.join("sock/ctl.sock")]);
    }

    #[test]
    fn the_plan_refuses_sockets_in_the_root_directory_and_files_in_the_jail() {
        let dir = tempfile::tempdir().expect("dir");
        let d = canonical(dir.path()).expect("canonical");
        std::fs::write(d.join("vmlinux"), b"k").expect("kernel");
        let mut config = VmConfig::new(d.join("vmlinux"));
        config.control_socket = Some("/ctl.sock".into());
        assert!(matches!(Jail::plan(&d.join("jail"), &mut config), Err(JailError::Path { .. })));
        let mut config = VmConfig::new(d.join("vmlinux"));
        assert!(matches!(Jail::plan(&d, &mut config), Err(JailError::Path { .. })), "kernel inside the jail");
    }
}

//! Seccomp filters, one per kind of thread, installed before the guest runs.
//!
//! Each thread may make only the system calls its job needs; anything else
//! kills the whole VMM process (`SECCOMP_RET_KILL_PROCESS`), so a guest that
//! subverts a device model gains no new powers on the host. The vCPU threads
//! may issue only the KVM ioctls of the run loop (and of the fault report);
//! the VMM thread (event loop, control socket, console input) may not issue
//! KVM ioctls at all. Neither may open files or exec. The VMM thread may
//! create and connect Unix sockets only when the guest may open
//! connections to the host (vsock `host_ports` not empty), and remove files
//! only when it is not jailed (a jail's supervisor removes its sockets):
//! see [`Needs`].

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// The kinds of threads a VMM runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// The event loop: control socket, console input, VM lifecycle.
    Vmm,
    /// A vCPU's run loop and the device emulation it calls into.
    Vcpu,
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("Cannot build the {0:?} seccomp filter (a bug in its rules)")]
    Build(ThreadKind, #[source] seccompiler::BackendError),
    #[error("Cannot install a seccomp filter; does this kernel have CONFIG_SECCOMP_FILTER?")]
    Install(#[source] seccompiler::Error),
}

const KVMIO: u64 = 0xae;
const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (KVMIO << 8) | nr
}
const IOC_READ: u64 = 2;
const IOC_WRITE: u64 = 1;
const KVM_RUN: u64 = ioc(0, 0x80, 0);
const KVM_GET_REGS: u64 = ioc(IOC_READ, 0x81, size_of::<kvm_bindings::kvm_regs>());
const KVM_GET_SREGS: u64 = ioc(IOC_READ, 0x83, size_of::<kvm_bindings::kvm_sregs>());
const KVM_TRANSLATE: u64 = ioc(IOC_READ | IOC_WRITE, 0x85, size_of::<kvm_bindings::kvm_translation>());

/// System calls every thread makes: memory, locks, signals, time, exit.
const COMMON: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    // Rust's std checks descriptors with F_GETFD before closing them.
    libc::SYS_fcntl,
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_sched_yield,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getrandom,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // A panic aborts with tgkill(SIGABRT); it must not turn into SIGSYS.
    libc::SYS_tgkill,
];

/// What the VMM thread adds: epoll, the control socket, timers; the
/// devices' work on the descriptors they hold (disk reads, writes and
/// flushes; vsock's and passt's Unix sockets).
const VMM: &[i64] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_fallocate,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_timerfd_settime,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_poll,
    libc::SYS_ppoll,
];

/// What the VMM thread may do beyond working on the descriptors it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// Open new Unix socket connections (`socket(AF_UNIX)`, `connect`): the
    /// vsock device's connections from the guest to `<uds_path>_<port>`.
    pub connect: bool,
    /// Remove files (`unlink`): the control socket's file when the VMM
    /// ends. A jailed VMM leaves that to its supervisor.
    pub unlink: bool,
}

impl Needs {
    /// Everything a VMM may be configured to need.
    pub const ALL: Self = Self { connect: true, unlink: true };
    /// Nothing beyond the descriptors it holds.
    pub const NONE: Self = Self { connect: false, unlink: false };
}

fn rule(ioctl: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, ioctl)?])
}

/// The filter for `kind`; `needs` widens the VMM thread's.
pub fn filter(kind: ThreadKind, needs: Needs) -> Result<BpfProgram, SeccompError> {
    let build = || -> Result<BpfProgram, seccompiler::BackendError> {
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = COMMON.iter().map(|s| (*s, vec![])).collect();
        match kind {
            ThreadKind::Vmm => {
                rules.extend(VMM.iter().map(|s| (*s, vec![])));
                // Rust's std sets O_NONBLOCK and FD_CLOEXEC this way;
                // TCGETS and TCSETS put a raw console terminal back as it
                // was (glibc's tcsetattr reads the settings back too).
                let ioctls = [libc::FIONBIO, libc::FIOCLEX, libc::TCGETS, libc::TCSETS];
                rules.insert(libc::SYS_ioctl, ioctls.into_iter().map(rule).collect::<Result<_, _>>()?);
                if needs.connect {
                    // vsock connects guest connections to Unix sockets only.
                    let unix =
                        SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::AF_UNIX as u64)?;
                    rules.insert(libc::SYS_socket, vec![SeccompRule::new(vec![unix])?]);
                    rules.insert(libc::SYS_connect, vec![]);
                }
                if needs.unlink {
                    rules.insert(libc::SYS_unlink, vec![]);
                    rules.insert(libc::SYS_unlinkat, vec![]);
                }
            }
            ThreadKind::Vcpu => {
                // A driver's status write resets or activates its device on
                // the vCPU thread that made it: the device may take its
                // descriptors out of (or into) the VMM thread's epoll sets
                // and disarm timers. Nothing here creates a descriptor.
                rules.insert(libc::SYS_epoll_ctl, vec![]);
                rules.insert(libc::SYS_timerfd_settime, vec![]);
                let ioctls = [KVM_RUN, KVM_GET_REGS, KVM_GET_SREGS, KVM_TRANSLATE];
                rules.insert(libc::SYS_ioctl, ioctls.into_iter().map(rule).collect::<Result<_, _>>()?);
            }
        }
        let filter = SeccompFilter::new(rules, SeccompAction::KillProcess, SeccompAction::Allow, TargetArch::x86_64)?;
        filter.try_into()
    };
    build().map_err(|e| SeccompError::Build(kind, e))
}

/// Installs `program` on the calling thread (threads it starts inherit it).
pub fn install(program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(SeccompError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // From <linux/kvm.h> on x86_64.
        assert_eq!(KVM_RUN, 0xae80);
        assert_eq!(KVM_GET_REGS, 0x8090_ae81);
        assert_eq!(KVM_GET_SREGS, 0x8138_ae83);
        assert_eq!(KVM_TRANSLATE, 0xc018_ae85);
    }

    #[test]
    fn both_filters_build() {
        for kind in [ThreadKind::Vmm, ThreadKind::Vcpu] {
            assert!(!filter(kind, Needs::ALL).expect("builds").is_empty());
        }
    }

    /// A forbidden system call from a thread under the vCPU filter kills
    /// the whole process with SIGSYS. Run in a child process (this test's
    /// own binary, re-executed) so that the test harness survives.
    #[test]
    fn a_forbidden_syscall_on_a_vcpu_thread_kills_the_process() {
        if std::env::var_os("MOAT_SECCOMP_CHILD").is_some() {
            let program = filter(ThreadKind::Vcpu, Needs::ALL).expect("builds");
            let thread = std::thread::spawn(move || {
                install(&program).expect("installs");
                // Allowed: a write. Then forbidden: socket(2).
                let _ = std::io::Write::write_all(&mut std::io::stderr(), b"vcpu filter installed\n");
                // SAFETY: socket(2) with constant arguments; the filter kills
                // the process before it returns.
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
                eprintln!("still alive after socket() = {fd}");
            });
            let _ = thread.join();
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("test binary path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "seccomp::tests::a_forbidden_syscall_on_a_vcpu_thread_kills_the_process", "--nocapture"])
            .env("MOAT_SECCOMP_CHILD", "1")
            .output()
            .expect("child runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("vcpu filter installed"), "{stderr}");
        assert!(!stderr.contains("still alive"), "{stderr}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{:?}\n{stderr}", out.status);
    }

    /// The devices' work on the VMM thread (disk I/O through a copy-on-write
    /// overlay, vsock connections both ways, network frames both ways and
    /// passt hanging up) passes the VMM filter, while an
    /// Internet socket from that thread still kills the process.
    #[test]
    fn device_work_passes_the_vmm_filter() {
        use std::io::{Read, Write};

        use crate::devices::virtio::block::{CowDisk, DiskBackend};
        use crate::devices::virtio::testing::VsockGuest;
        use crate::devices::virtio::vsock::packet::{HOST_CID, Header, OP_REQUEST, OP_RW, TYPE_STREAM};

        if std::env::var_os("MOAT_SECCOMP_VMM_CHILD").is_some() {
            let dir = tempfile::tempdir().expect("dir");
            std::fs::write(dir.path().join("base"), vec![1u8; 1 << 20]).expect("base");
            let mut disk = CowDisk::open(&dir.path().join("base"), &dir.path().join("ov"), 1 << 20).expect("cow");
            let uds = dir.path().join("v.sock");
            let mut guest = VsockGuest::new(3, &uds, 4096);
            let listener = std::os::unix::net::UnixListener::bind(format!("{}_80", uds.display())).expect("binds");
            let host = std::thread::spawn(move || {
                let (mut s, _) = listener.accept().expect("guest connection");
                let mut buf = [0u8; 2];
                s.read_exact(&mut buf).expect("reads");
                let mut c = std::os::unix::net::UnixStream::connect(&uds).expect("host connection");
                c.write_all(b"CONNECT 1024\n").expect("writes");
                buf
            });
            let (vmm_end, mut passt) = std::os::unix::net::UnixStream::pair().expect("socketpair");
            let mut net = crate::devices::virtio::net::Net::new([2, 0, 0, 0, 0, 1], vmm_end).expect("net");
            let program = filter(ThreadKind::Vmm, Needs::ALL).expect("builds");
            let device = std::thread::spawn(move || {
                install(&program).expect("installs");
                net_work(&mut net, &mut passt);
                let mut got = vec![0u8; 8192];
                disk.write_at(&[2u8; 4096], 4096).expect("cow write");
                disk.read_at(&mut got, 0).expect("cow read");
                disk.flush().expect("flush");
                disk.discard(0, 8192).expect("discard punches a hole");
                assert_eq!((got[0], got[4096]), (1, 2));
                let h = Header {
                    src_cid: 3,
                    dst_cid: HOST_CID,
                    src_port: 9,
                    dst_port: 80,
                    kind: TYPE_STREAM,
                    buf_alloc: 1 << 20,
                    ..Header::default()
                };
                guest.send(Header { op: OP_REQUEST, ..h }, &[]);
                guest.send(Header { op: OP_RW, ..h }, b"hi");
                let mut requested = false;
                for _ in 0..200 {
                    guest.poll(10);
                    requested |= guest.recv().iter().any(|(p, _)| p.op == OP_REQUEST && p.dst_port == 1024);
                    if requested {
                        break;
                    }
                }
                assert!(requested, "the host connection reached the guest");
                eprintln!("device work done");
                // SAFETY: socket(2) with constant arguments; the filter kills the process.
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
                eprintln!("still alive after socket() = {fd}");
            });
            assert_eq!(&host.join().expect("host thread"), b"hi");
            let _ = device.join();
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("test binary path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "seccomp::tests::device_work_passes_the_vmm_filter", "--nocapture"])
            .env("MOAT_SECCOMP_VMM_CHILD", "1")
            .output()
            .expect("child runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("device work done"), "{stderr}");
        assert!(!stderr.contains("still alive"), "{stderr}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{:?}\n{stderr}", out.status);
    }

    /// A jailed VMM whose guest may reach no host port needs neither new
    /// connections nor file removal: under that filter, a VMM thread that
    /// `connect`s to a Unix socket (set up before, as an exploit would
    /// find one) or `unlink`s a file kills the process, and neither
    /// happens.
    #[test]
    fn without_needs_connect_and_unlink_kill_the_vmm() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::ExitStatusExt;

        if let Some(what) = std::env::var_os("MOAT_SECCOMP_NEEDS_CHILD") {
            let dir = std::path::PathBuf::from(std::env::var_os("MOAT_SECCOMP_NEEDS_DIR").expect("dir given"));
            let program = filter(ThreadKind::Vmm, Needs::NONE).expect("builds");
            let thread = std::thread::spawn(move || {
                // Made before the filter, as at setup: a socket to connect.
                // SAFETY: socket(2) with constant arguments.
                let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
                assert!(fd >= 0, "socket");
                install(&program).expect("installs");
                eprintln!("vmm filter installed");
                if what == "connect" {
                    let path = dir.join("host.sock");
                    // SAFETY: a zeroed sockaddr_un is a valid value.
                    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
                    addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).expect("AF_UNIX fits");
                    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
                        *d = *s as libc::c_char;
                    }
                    let len = u32::try_from(size_of::<libc::sockaddr_un>()).expect("small");
                    // SAFETY: connect(2) reads `len` bytes of `addr`, which we own.
                    let r = unsafe { libc::connect(fd, (&raw const addr).cast(), len) };
                    eprintln!("still alive after connect() = {r}");
                } else {
                    let r = std::fs::remove_file(dir.join("victim"));
                    eprintln!("still alive after unlink: {r:?}");
                }
            });
            let _ = thread.join();
            std::process::exit(0);
        }
        for what in ["connect", "unlink"] {
            let dir = tempfile::tempdir().expect("dir");
            let listener = std::os::unix::net::UnixListener::bind(dir.path().join("host.sock")).expect("binds");
            listener.set_nonblocking(true).expect("nonblocking");
            std::fs::write(dir.path().join("victim"), b"x").expect("victim");
            let exe = std::env::current_exe().expect("test binary path");
            let out = std::process::Command::new(exe)
                .args(["--exact", "seccomp::tests::without_needs_connect_and_unlink_kill_the_vmm", "--nocapture"])
                .env("MOAT_SECCOMP_NEEDS_CHILD", what)
                .env("MOAT_SECCOMP_NEEDS_DIR", dir.path())
                .output()
                .expect("child runs");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains("vmm filter installed"), "{what}: {stderr}");
            assert!(!stderr.contains("still alive"), "{what}: {stderr}");
            assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{what}: {:?}\n{stderr}", out.status);
            assert!(listener.accept().is_err(), "{what}: no connection reached the host socket");
            assert!(dir.path().join("victim").exists(), "{what}: the file is still there");
        }
    }

    /// The network device's work under a filter: a frame each way through
    /// passt's stream, then passt hanging up.
    fn net_work(net: &mut crate::devices::virtio::net::Net, passt: &mut std::os::unix::net::UnixStream) {
        use std::io::{Read, Write};

        use vm_memory::{Bytes, GuestAddress};

        use crate::devices::virtio::VirtioDevice;
        use crate::devices::virtio::testing::{Buf, QueueDriver, guest_memory};

        let mem = guest_memory(1 << 20);
        let (mut rx, mut tx) = (QueueDriver::new(0x1000, 16), QueueDriver::new(0x2000, 16));
        let mut queues = vec![rx.queue(), tx.queue()];
        // A header, then an ARP frame (ethertype 0x0806).
        let mut frame = [7u8; 72];
        frame[..12].fill(0);
        frame[24..26].copy_from_slice(&[0x08, 0x06]);
        mem.write_slice(&frame, GuestAddress(0x8000)).expect("frame");
        tx.add_chain(&mem, &[Buf::read(0x8000, 72)]);
        net.process_queue(1, &mut queues, &mem);
        let mut got = [0u8; 64];
        passt.read_exact(&mut got).expect("frame to passt");
        passt.write_all(&[0, 0, 0, 60]).and_then(|()| passt.write_all(&[9u8; 60])).expect("frame from passt");
        rx.add_chain(&mem, &[Buf::write(0x9000, 2048)]);
        for _ in 0..100 {
            net.process_host(Some(&mut queues), &mem);
            if !rx.take_used(&mem).is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = passt.shutdown(std::net::Shutdown::Both);
        for _ in 0..100 {
            net.process_host(Some(&mut queues), &mem);
            if !net.link().is_up() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!net.link().is_up(), "the hang-up was seen");
    }

    /// A driver's reset is a status write on a vCPU thread: resetting a
    /// vsock device with live connections (closing them, leaving the VMM's
    /// epoll) and an rng device must pass the vCPU filter (the seccomp kill
    /// the nested host found).
    #[test]
    fn a_device_reset_on_a_vcpu_thread_passes_its_filter() {
        use std::io::Write;

        use crate::devices::virtio::VirtioDevice;
        use crate::devices::virtio::rng::Rng;
        use crate::devices::virtio::testing::VsockGuest;

        if std::env::var_os("MOAT_SECCOMP_RESET_CHILD").is_some() {
            let dir = tempfile::tempdir().expect("dir");
            let uds = dir.path().join("v.sock");
            let mut guest = VsockGuest::new(3, &uds, 4096);
            let mut host = std::os::unix::net::UnixStream::connect(&uds).expect("connects");
            host.write_all(b"CONNECT 1024\n").expect("writes");
            guest.poll(1000);
            assert_eq!(guest.dev.muxer().connections(), 1);
            let mut rng = Rng::new().expect("rng");
            // A network device holding frames from passt, which a reset drops.
            let (vmm_end, mut passt) = std::os::unix::net::UnixStream::pair().expect("socketpair");
            let mut net = crate::devices::virtio::net::Net::new([2, 0, 0, 0, 0, 1], vmm_end).expect("net");
            passt.write_all(&[0, 0, 0, 4, 1, 2, 3, 4]).expect("a frame");
            let mem = crate::devices::virtio::testing::guest_memory(1 << 16);
            net.process_host(None, &mem);
            let program = filter(ThreadKind::Vcpu, Needs::ALL).expect("builds");
            let vcpu = std::thread::spawn(move || {
                install(&program).expect("installs");
                guest.dev.reset();
                rng.reset();
                net.reset();
                eprintln!("reset done: {} connections", guest.dev.muxer().connections());
            });
            let _ = vcpu.join();
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("test binary path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "seccomp::tests::a_device_reset_on_a_vcpu_thread_passes_its_filter", "--nocapture"])
            .env("MOAT_SECCOMP_RESET_CHILD", "1")
            .output()
            .expect("child runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("reset done: 0 connections"), "{:?}\n{stderr}", out.status);
        assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    }
}

//! The seccomp filter of a jail: system calls no sandbox ever needs fail
//! with `EPERM`, everything else is allowed.
//!
//! A deny list, not an allow list: sandboxes run arbitrary Debian software
//! (compilers, package managers, language runtimes), and the namespaces and
//! the unprivileged id mapping already bound what the rest can reach. These
//! calls are the kernel's largest attack surface from a user namespace, or
//! would let a sandbox change the machine rather than itself.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Denied system calls, with why.
pub const DENIED: &[(&str, i64)] = &[
    // Replacing or extending the kernel.
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    // Large attack surface, no use in a sandbox.
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    // The file system layout was set up before the agent started.
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("fsopen", libc::SYS_fsopen),
    ("fsmount", libc::SYS_fsmount),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    // Machine-wide state.
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("acct", libc::SYS_acct),
    ("quotactl", libc::SYS_quotactl),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("vhangup", libc::SYS_vhangup),
    // io_uring reaches much of the kernel outside seccomp's view.
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
];

/// Socket families no sandbox needs: `socket(2)` for them fails with
/// `EPERM`. `AF_PACKET`: a sandbox's root could write whole frames onto
/// pasta's tap interface (network `open`), and Debian bookworm's pasta
/// connects a crafted TCP SYN for 127.0.0.1 to the host's loopback
/// services. (MicroVMs filter such frames in moat-vmm instead.)
pub const DENIED_SOCKET_FAMILIES: &[(&str, i32)] = &[("AF_PACKET", libc::AF_PACKET)];

/// x32 system calls are x86_64 calls with this bit set in their number;
/// the deny list above names x86_64 numbers only.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Builds the filter's BPF program.
pub fn program() -> Result<BpfProgram, seccompiler::BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    let families = DENIED_SOCKET_FAMILIES
        .iter()
        .map(|(_, family)| {
            let family = u64::try_from(*family).unwrap_or_default();
            let condition = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family)?;
            SeccompRule::new(vec![condition])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_socket, families);
    let errno = u32::try_from(libc::EPERM).unwrap_or(1);
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(errno), TargetArch::x86_64)?;
    filter.try_into()
}

/// A filter that fails every x32-ABI system call with `EPERM`, so that the
/// deny list cannot be bypassed through the x32 numbers of the same calls.
/// Hand-written: three instructions, which seccompiler has no rule for.
pub fn x32_program() -> BpfProgram {
    const SECCOMP_DATA_NR: u32 = 0;
    let errno = libc::SECCOMP_RET_ERRNO | u32::try_from(libc::EPERM).unwrap_or(1);
    let insn = |code: u32, jt: u8, jf: u8, k: u32| seccompiler::sock_filter {
        code: u16::try_from(code).unwrap_or_default(),
        jt,
        jf,
        k,
    };
    vec![
        insn(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, SECCOMP_DATA_NR),
        insn(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, 0, 1, X32_SYSCALL_BIT),
        insn(libc::BPF_RET | libc::BPF_K, 0, 0, errno),
        insn(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Installs both filters on the calling thread (inherited across fork and
/// exec). `no_new_privs` must be set first.
pub fn install() -> Result<(), String> {
    let program = program().map_err(|e| e.to_string())?;
    seccompiler::apply_filter(&program).map_err(|e| e.to_string())?;
    seccompiler::apply_filter(&x32_program()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_sockets_are_refused_and_others_are_not() {
        // On a thread of its own: seccomp filters are per thread.
        std::thread::spawn(|| {
            let open = |family: i32, kind: i32| {
                // SAFETY: socket(2) with constant arguments; the descriptor
                // is closed right away.
                let fd = unsafe { libc::socket(family, kind, 0) };
                let err = std::io::Error::last_os_error();
                if fd >= 0 {
                    // SAFETY: `fd` was just opened here and is not used again.
                    unsafe { libc::close(fd) };
                }
                (fd >= 0, err.raw_os_error())
            };
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            if root {
                assert!(open(libc::AF_PACKET, libc::SOCK_RAW).0, "root may open a packet socket without the filter");
            }
            nix::sys::prctl::set_no_new_privs().expect("no_new_privs");
            install().expect("the filters install");
            assert_eq!(open(libc::AF_PACKET, libc::SOCK_RAW), (false, Some(libc::EPERM)));
            assert_eq!(open(libc::AF_PACKET, libc::SOCK_DGRAM), (false, Some(libc::EPERM)));
            assert!(open(libc::AF_INET, libc::SOCK_STREAM).0);
            assert!(open(libc::AF_UNIX, libc::SOCK_STREAM).0);
            assert!(open(libc::AF_INET6, libc::SOCK_DGRAM).0);
        })
        .join()
        .expect("the filtered thread's checks pass");
    }

    #[test]
    fn the_filter_compiles() {
        let program = program().expect("compiles");
        assert!(program.len() > DENIED.len(), "one or more instructions per denied call");
    }
}

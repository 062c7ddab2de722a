//! The seccomp filter of a jail: an allow list modelled on Docker's default
//! profile, and stricter than it where a sandbox has no use for a call.
//!
//! One BPF program, [`program`]:
//!
//! - a call for another architecture (i386 through `int 0x80`) kills the
//!   process;
//! - x32-ABI calls fail with `EPERM` (the lists name x86_64 numbers only);
//! - `clone3` (whose flags live in memory, out of seccomp's reach) and calls
//!   newer than [`NEWEST_KNOWN`] fail with `ENOSYS`, so that libc falls back
//!   to what the list permits (glibc's `clone3` → `clone`), as Docker and
//!   runc do;
//! - the calls in [`ALLOWED`] are allowed, and `socket`, `socketpair`,
//!   `clone`, `unshare` and `personality` only with the arguments
//!   [`conditional_rules`] lists;
//! - anything else fails with `EPERM`, as in Docker's profile.
//!
//! Sandboxes run arbitrary Debian software (compilers, package managers,
//! language runtimes); the list holds what such software calls. What it
//! leaves out is the kernel's largest attack surface from a user namespace
//! (new namespaces, the mount API, `bpf`, `io_uring`, keyrings, raw and
//! packet sockets, rare socket families and netlink protocols), or would
//! let a sandbox change the machine rather than itself. `docs/security.md`
//! lists each difference from Docker's profile and why.
//!
//! The call number is looked up in a search tree of the ranges of numbers
//! that share an answer, written here: seccompiler, like every filter
//! compiler this workspace could use, tests the numbers one after another,
//! which for this list is 1,722 instructions that the kernel checks,
//! converts and JITs each time a jail starts (0.6 ms of CPU, on the path
//! of every sandbox's start), and runs in part for each call that its
//! per-call cache does not answer. The argument checks of the five conditional calls are
//! seccompiler's, appended to the tree. The tests run both this program and
//! seccompiler's linear one on every call number and many arguments, and
//! require the same answer.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

mod calls;

pub use calls::{ALLOWED, NEWEST_KNOWN, REFUSED};

/// Flags of `clone` and `unshare` that make namespaces. The sandbox's own
/// were made by the monitor; a new user namespace would hand the sandbox's
/// processes every capability again over fresh namespaces (nf_tables,
/// mounts), the most common path to a kernel bug from an unprivileged
/// process. (Docker's mask, 0x7E020000, plus `CLONE_NEWTIME` for
/// `unshare`, where that bit is not the exit signal.)
pub const NAMESPACE_FLAGS: u64 = 0x7E02_0000;
const CLONE_NEWTIME: u64 = 0x80;

/// `socket(2)` types are the argument's low four bits; `SOCK_NONBLOCK`
/// and `SOCK_CLOEXEC` sit above them (the kernel masks the same way).
/// Each allowed family is allowed with its usual types only, so
/// `SOCK_PACKET` is refused with any family.
const SOCK_TYPE_MASK: u64 = 0xf;
/// The obsolete packet type: with any family, a socket that writes whole
/// frames (the kernel turns `socket(AF_INET, SOCK_PACKET)` into
/// `AF_PACKET`).
pub const SOCK_PACKET: i32 = 10;

/// Netlink protocols a sandbox may open: routes and addresses (libc's
/// `getaddrinfo`, `ip`), socket diagnostics (`ss`), audit (PAM and the
/// shadow tools open it and cope with refusals the kernel gives outside the
/// initial namespace), and device events. Not `NETLINK_NETFILTER` (12,
/// nf_tables and iptables), `NETLINK_XFRM` (6), `NETLINK_GENERIC` (16),
/// `NETLINK_CRYPTO` (21) and the rest: root tooling only, and a large part
/// of the kernel's attack surface.
pub const NETLINK_PROTOCOLS: &[(&str, i32)] =
    &[("NETLINK_ROUTE", 0), ("NETLINK_SOCK_DIAG", 4), ("NETLINK_AUDIT", 9), ("NETLINK_KOBJECT_UEVENT", 15)];

/// Internet sockets a sandbox may open: (type, protocol). TCP, UDP, and
/// ICMP echo sockets (`ping` without privilege); never `SOCK_RAW` (forged
/// IP headers) or `SOCK_PACKET` (forged frames), nor SCTP, DCCP, UDP-Lite
/// or MPTCP, whose modules the kernel would otherwise load on demand.
const INET_SOCKETS: &[(i32, i32)] = &[
    (libc::SOCK_STREAM, 0),
    (libc::SOCK_STREAM, libc::IPPROTO_TCP),
    (libc::SOCK_DGRAM, 0),
    (libc::SOCK_DGRAM, libc::IPPROTO_UDP),
];

/// `personality(2)` values a sandbox may set, as in Docker's profile:
/// `PER_LINUX`, `PER_LINUX32`, `UNAME26` and both, and the query
/// `0xffffffff`. Not `ADDR_NO_RANDOMIZE`, `READ_IMPLIES_EXEC` and other
/// flags that weaken the process's own hardening.
pub const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// x32 system calls are x86_64 calls with this bit set in their number.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn condition(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, seccompiler::BackendError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value)
}

/// A 32-bit argument as the comparison's value (negative ints do not occur
/// among the constants used here).
fn word(value: i32) -> u64 {
    u64::from(value.unsigned_abs())
}

/// The calls allowed only with some arguments, each rule one allowed case.
pub fn conditional_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    use SeccompCmpOp::{Eq, MaskedEq};
    let mut socket = Vec::new();
    for kind in [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET] {
        socket.push(SeccompRule::new(vec![
            condition(0, Eq, word(libc::AF_UNIX))?,
            condition(1, MaskedEq(SOCK_TYPE_MASK), word(kind))?,
        ])?);
    }
    for family in [libc::AF_INET, libc::AF_INET6] {
        let icmp = if family == libc::AF_INET { libc::IPPROTO_ICMP } else { libc::IPPROTO_ICMPV6 };
        for (kind, protocol) in INET_SOCKETS.iter().copied().chain([(libc::SOCK_DGRAM, icmp)]) {
            socket.push(SeccompRule::new(vec![
                condition(0, Eq, word(family))?,
                condition(1, MaskedEq(SOCK_TYPE_MASK), word(kind))?,
                condition(2, Eq, word(protocol))?,
            ])?);
        }
    }
    for (_, protocol) in NETLINK_PROTOCOLS {
        for kind in [libc::SOCK_RAW, libc::SOCK_DGRAM] {
            socket.push(SeccompRule::new(vec![
                condition(0, Eq, word(libc::AF_NETLINK))?,
                condition(1, MaskedEq(SOCK_TYPE_MASK), word(kind))?,
                condition(2, Eq, word(*protocol))?,
            ])?);
        }
    }
    let socketpair = vec![SeccompRule::new(vec![condition(0, Eq, word(libc::AF_UNIX))?])?];
    let no_namespaces = |mask: u64| -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
        let flags = SeccompCondition::new(0, SeccompCmpArgLen::Qword, MaskedEq(mask), 0)?;
        Ok(vec![SeccompRule::new(vec![flags])?])
    };
    let personality =
        PERSONALITIES.iter().map(|p| SeccompRule::new(vec![condition(0, Eq, *p)?])).collect::<Result<Vec<_>, _>>()?;
    Ok(BTreeMap::from([
        (libc::SYS_socket, socket),
        (libc::SYS_socketpair, socketpair),
        (libc::SYS_clone, no_namespaces(NAMESPACE_FLAGS)?),
        (libc::SYS_unshare, no_namespaces(NAMESPACE_FLAGS | CLONE_NEWTIME)?),
        (libc::SYS_personality, personality),
    ]))
}

/// The verdicts of the search tree, for a range of call numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Allow,
    /// `EPERM`.
    Refuse,
    /// `ENOSYS`: `clone3`.
    Unknown,
    /// The argument checks decide.
    Check,
}

/// The verdict of every call number from 0 to [`NEWEST_KNOWN`], as ranges:
/// each entry's verdict holds from its number up to the next entry's.
fn ranges(conditional: &BTreeMap<i64, Vec<SeccompRule>>) -> Vec<(u32, Verdict)> {
    let allowed: std::collections::BTreeSet<i64> = ALLOWED.iter().map(|(_, nr)| *nr).collect();
    let mut ranges: Vec<(u32, Verdict)> = Vec::new();
    for nr in 0..=NEWEST_KNOWN {
        let call = i64::from(nr);
        let verdict = if conditional.contains_key(&call) {
            Verdict::Check
        } else if call == libc::SYS_clone3 {
            Verdict::Unknown
        } else if allowed.contains(&call) {
            Verdict::Allow
        } else {
            Verdict::Refuse
        };
        if ranges.last().is_none_or(|(_, last)| *last != verdict) {
            ranges.push((nr, verdict));
        }
    }
    ranges
}

/// Why the filter cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    #[error("the argument checks: {0}")]
    Rules(#[from] seccompiler::BackendError),
    #[error("the call number tree needs a jump of {0} instructions; classic BPF jumps at most 255 forward")]
    TooFar(usize),
}

/// Builds the filter's BPF program (see the module's comment).
pub fn program() -> Result<BpfProgram, FilterError> {
    const SECCOMP_DATA_NR: u32 = 0;
    const SECCOMP_DATA_ARCH: u32 = 4;
    /// `AUDIT_ARCH_X86_64`: `EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`.
    const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
    let conditional = conditional_rules()?;
    let eperm = libc::SECCOMP_RET_ERRNO | u32::try_from(libc::EPERM).unwrap_or(1);
    let enosys = libc::SECCOMP_RET_ERRNO | u32::try_from(libc::ENOSYS).unwrap_or(38);
    let (ld, ret) = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, libc::BPF_RET | libc::BPF_K);
    let (jeq, jge, jgt) = (
        libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
        libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K,
        libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K,
    );
    let mut program = vec![
        insn(ld, 0, 0, SECCOMP_DATA_ARCH),
        insn(jeq, 1, 0, AUDIT_ARCH_X86_64),
        insn(ret, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        insn(ld, 0, 0, SECCOMP_DATA_NR),
        // x32: EPERM.
        insn(jge, 0, 1, X32_SYSCALL_BIT),
        insn(ret, 0, 0, eperm),
        // Newer than the list: ENOSYS.
        insn(jgt, 0, 1, NEWEST_KNOWN),
        insn(ret, 0, 0, enosys),
    ];
    // The tree, then the argument checks it jumps to.
    let mut checks_jumps = Vec::new();
    tree(&ranges(&conditional), &mut program, &mut checks_jumps, [eperm, enosys])?;
    let checks_at = program.len();
    for at in checks_jumps {
        program[at].k = u32::try_from(checks_at - at - 1).map_err(|_| FilterError::TooFar(checks_at - at - 1))?;
    }
    let errno = u32::try_from(libc::EPERM).unwrap_or(1);
    let checks =
        SeccompFilter::new(conditional, SeccompAction::Errno(errno), SeccompAction::Allow, TargetArch::x86_64)?;
    program.extend(BpfProgram::try_from(checks)?);
    Ok(program)
}

/// The same allow list as seccompiler compiles it alone, testing the call
/// numbers one after another (1,722 instructions for this list), without
/// the number checks [`program`] makes first: what [`program`] is tested
/// against, and the baseline of its benchmark (`cargo bench -p
/// moat-agent-bin --bench agent`).
pub fn linear_program() -> Result<BpfProgram, FilterError> {
    let mut rules = conditional_rules()?;
    rules.extend(ALLOWED.iter().map(|(_, nr)| (*nr, Vec::new())));
    let errno = u32::try_from(libc::EPERM).unwrap_or(1);
    let list = SeccompFilter::new(rules, SeccompAction::Errno(errno), SeccompAction::Allow, TargetArch::x86_64)?;
    Ok(BpfProgram::try_from(list)?)
}

/// One classic BPF instruction.
fn insn(code: u32, jt: u8, jf: u8, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter { code: u16::try_from(code).unwrap_or_default(), jt, jf, k }
}

/// Appends the search tree over `ranges` (the call number loaded) to
/// `program`: at each node, `nr >= first of the upper half` jumps over the
/// lower half's subtree, which follows. A leaf returns its verdict, or
/// jumps to the argument checks (its index is pushed to `checks_jumps`, to
/// be aimed once their place is known).
fn tree(
    ranges: &[(u32, Verdict)],
    program: &mut BpfProgram,
    checks_jumps: &mut Vec<usize>,
    [eperm, enosys]: [u32; 2],
) -> Result<(), FilterError> {
    let ret = libc::BPF_RET | libc::BPF_K;
    match ranges {
        [] => {}
        [(_, verdict)] => match verdict {
            Verdict::Allow => program.push(insn(ret, 0, 0, libc::SECCOMP_RET_ALLOW)),
            Verdict::Refuse => program.push(insn(ret, 0, 0, eperm)),
            Verdict::Unknown => program.push(insn(ret, 0, 0, enosys)),
            Verdict::Check => {
                checks_jumps.push(program.len());
                program.push(insn(libc::BPF_JMP | libc::BPF_JA, 0, 0, 0));
            }
        },
        _ => {
            let (lower, upper) = ranges.split_at(ranges.len() / 2);
            let node = program.len();
            program.push(insn(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, 0, 0, upper[0].0));
            tree(lower, program, checks_jumps, [eperm, enosys])?;
            let skip = program.len() - node - 1;
            program[node].jt = u8::try_from(skip).map_err(|_| FilterError::TooFar(skip))?;
            tree(upper, program, checks_jumps, [eperm, enosys])?;
        }
    }
    Ok(())
}

/// One instruction of a filter's program.
pub type Instruction = seccompiler::sock_filter;

/// Installs the filter on the calling thread (inherited across fork and
/// exec). `no_new_privs` must be set first.
pub fn install() -> Result<(), String> {
    let program = program().map_err(|e| format!("building the seccomp filter: {e}"))?;
    apply(&program)
}

/// Installs `program` on the calling thread.
pub fn apply(program: &[Instruction]) -> Result<(), String> {
    seccompiler::apply_filter(program).map_err(|e| format!("installing the seccomp filter: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `checks` on a thread of its own after installing the filters
    /// there (seccomp filters are per thread), and returns what it returns.
    fn filtered<T: Send + 'static>(checks: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(|| {
            nix::sys::prctl::set_no_new_privs().expect("no_new_privs");
            install().expect("the filters install");
            checks()
        })
        .join()
        .expect("the filtered thread's checks pass")
    }

    /// `socket(family, kind, protocol)`: whether it opened, and errno.
    fn open(family: i32, kind: i32, protocol: i32) -> (bool, Option<i32>) {
        // SAFETY: socket(2) with integer arguments; the descriptor is
        // closed right away.
        let fd = unsafe { libc::socket(family, kind, protocol) };
        let err = std::io::Error::last_os_error();
        if fd >= 0 {
            // SAFETY: `fd` was just opened here and is not used again.
            unsafe { libc::close(fd) };
        }
        (fd >= 0, if fd >= 0 { None } else { err.raw_os_error() })
    }

    /// errno of a raw system call with junk arguments (the filter answers
    /// before the kernel reads them), or `None` if it succeeded.
    fn errno_of(nr: i64) -> Option<i32> {
        // SAFETY: every call tried here is refused by the filter before the
        // kernel looks at its (null and zero) arguments.
        let rc = unsafe { libc::syscall(nr, 0, 0, 0, 0, 0, 0) };
        if rc < 0 { std::io::Error::last_os_error().raw_os_error() } else { None }
    }

    #[test]
    fn frames_and_raw_packets_cannot_be_forged() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(open(libc::AF_PACKET, libc::SOCK_RAW, 0).0, "root may open a packet socket without the filter");
        }
        let eperm = (false, Some(libc::EPERM));
        let results = filtered(|| {
            let flags = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
            let mut refused = Vec::new();
            for kind in [libc::SOCK_RAW, libc::SOCK_DGRAM, SOCK_PACKET, libc::SOCK_RAW | flags] {
                refused.push(("AF_PACKET", open(libc::AF_PACKET, kind, 0)));
            }
            for family in [libc::AF_INET, libc::AF_INET6, libc::AF_UNIX, libc::AF_NETLINK] {
                refused.push(("SOCK_PACKET", open(family, SOCK_PACKET, 0)));
                refused.push(("SOCK_PACKET|flags", open(family, SOCK_PACKET | flags, 0)));
            }
            for family in [libc::AF_INET, libc::AF_INET6] {
                for protocol in [0, libc::IPPROTO_RAW, libc::IPPROTO_TCP, libc::IPPROTO_ICMP] {
                    refused.push(("SOCK_RAW", open(family, libc::SOCK_RAW, protocol)));
                    refused.push(("SOCK_RAW|flags", open(family, libc::SOCK_RAW | flags, protocol)));
                }
                refused.push(("SCTP", open(family, libc::SOCK_STREAM, libc::IPPROTO_SCTP)));
                refused.push(("SEQPACKET", open(family, libc::SOCK_SEQPACKET, 0)));
                refused.push(("DCCP", open(family, 6, 33)));
            }
            for family in [libc::AF_VSOCK, libc::AF_ALG, libc::AF_KEY, libc::AF_TIPC, libc::AF_BLUETOOTH, 44] {
                refused.push(("family", open(family, libc::SOCK_DGRAM, 0)));
                refused.push(("family", open(family, libc::SOCK_STREAM, 0)));
            }
            refused.push(("NETLINK_NETFILTER", open(libc::AF_NETLINK, libc::SOCK_RAW, 12)));
            refused.push(("NETLINK_XFRM", open(libc::AF_NETLINK, libc::SOCK_RAW, 6)));
            refused.push(("NETLINK_GENERIC", open(libc::AF_NETLINK, libc::SOCK_RAW, 16)));
            let allowed = vec![
                ("tcp", open(libc::AF_INET, libc::SOCK_STREAM | flags, 0)),
                ("tcp6", open(libc::AF_INET6, libc::SOCK_STREAM, libc::IPPROTO_TCP)),
                ("udp", open(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::IPPROTO_UDP)),
                ("udp6", open(libc::AF_INET6, libc::SOCK_DGRAM, 0)),
                ("unix", open(libc::AF_UNIX, libc::SOCK_STREAM, 0)),
                ("unix dgram", open(libc::AF_UNIX, libc::SOCK_DGRAM | flags, 0)),
                ("netlink route", open(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0)),
                ("netlink route dgram", open(libc::AF_NETLINK, libc::SOCK_DGRAM, 0)),
                ("unix seqpacket", open(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0)),
            ];
            (refused, allowed)
        });
        let (refused, allowed) = results;
        for (what, result) in refused {
            assert_eq!(result, eperm, "{what} must be refused");
        }
        for (what, result) in allowed {
            assert!(result.0, "{what} must open: {result:?}");
        }
    }

    #[test]
    fn no_new_namespaces_and_clone3_falls_back() {
        let (unshare, clone, clone3, plain_unshare) = filtered(|| {
            // SAFETY: unshare(2) with flags only; refused by the filter.
            let unshare = unsafe { libc::unshare(libc::CLONE_NEWUSER) };
            let unshare = (unshare, std::io::Error::last_os_error().raw_os_error());
            let flags = libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::SIGCHLD;
            // SAFETY: raw clone(2) without a new stack, like fork; if it
            // were allowed, the child would only _exit.
            let rc = unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) };
            if rc == 0 {
                // SAFETY: the child exits at once, touching nothing.
                unsafe { libc::_exit(0) };
            }
            let clone = (rc, std::io::Error::last_os_error().raw_os_error());
            let clone3 = errno_of(libc::SYS_clone3);
            // SAFETY: unshare(2) of the file descriptor table: no namespace.
            let plain_unshare = unsafe { libc::unshare(libc::CLONE_FILES) };
            (unshare, clone, clone3, plain_unshare)
        });
        assert_eq!(unshare, (-1, Some(libc::EPERM)), "unshare(CLONE_NEWUSER)");
        assert_eq!(clone, (-1, Some(libc::EPERM)), "clone(CLONE_NEWUSER)");
        assert_eq!(clone3, Some(libc::ENOSYS), "clone3 must fail with ENOSYS so that libc falls back");
        assert_eq!(plain_unshare, 0, "unshare without namespaces");
    }

    #[test]
    fn the_refused_calls_fail_with_eperm() {
        let errors = filtered(|| REFUSED.iter().map(|(name, nr)| (*name, errno_of(*nr))).collect::<Vec<_>>());
        for (name, errno) in errors {
            assert_eq!(errno, Some(libc::EPERM), "{name}");
        }
        let (x32, newer) =
            filtered(|| (errno_of(0x4000_0000 | libc::SYS_mount), errno_of(i64::from(NEWEST_KNOWN) + 1)));
        assert_eq!(x32, Some(libc::EPERM), "an x32 call");
        assert_eq!(newer, Some(libc::ENOSYS), "a call newer than the list");
    }

    #[test]
    fn personality_may_only_be_queried_or_set_to_the_usual_values() {
        let (query, linux32, no_aslr) = filtered(|| {
            // SAFETY: personality(2) with integer arguments; the test
            // thread's persona changes, then changes back.
            unsafe {
                let query = libc::personality(0xffff_ffff);
                let linux32 = libc::personality(0x8);
                libc::personality(0);
                let no_aslr = libc::personality(0x0040000);
                (query, linux32, (no_aslr, std::io::Error::last_os_error().raw_os_error()))
            }
        });
        assert!(query >= 0 && linux32 >= 0, "{query} {linux32}");
        assert_eq!(no_aslr, (-1, Some(libc::EPERM)), "ADDR_NO_RANDOMIZE");
    }

    /// What the agent and ordinary programs do still works under the
    /// filter: threads (glibc tries clone3 first), processes, files, pipes.
    #[test]
    fn threads_processes_and_files_still_work() {
        let (thread, child, file) = filtered(|| {
            let thread = std::thread::spawn(|| 7).join().ok();
            let child = std::process::Command::new("sh").args(["-c", "echo $((6 * 7))"]).output().ok();
            let dir = tempfile::tempdir().ok();
            let file = dir.as_ref().and_then(|d| {
                std::fs::write(d.path().join("f"), b"x").ok()?;
                std::fs::read(d.path().join("f")).ok()
            });
            (thread, child, file)
        });
        assert_eq!(thread, Some(7));
        let child = child.expect("a child process starts");
        assert_eq!(String::from_utf8_lossy(&child.stdout).trim(), "42");
        assert_eq!(file.as_deref(), Some(&b"x"[..]));
    }

    #[test]
    fn the_namespace_mask_is_every_namespace_flag() {
        let flags = libc::CLONE_NEWNS
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUSER
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWCGROUP;
        assert_eq!(NAMESPACE_FLAGS, u64::from(flags.unsigned_abs()));
        assert_eq!(CLONE_NEWTIME, u64::from(libc::CLONE_NEWTIME.unsigned_abs()));
    }

    /// What the kernel's classic BPF does with `program` for one call:
    /// the instructions seccompiler and [`program`] use, and a panic on
    /// any other.
    fn run(program: &[seccompiler::sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u32; 16];
        data[0] = nr;
        data[1] = arch;
        for (i, arg) in args.iter().enumerate() {
            let [low, high] = [*arg & 0xffff_ffff, *arg >> 32].map(|half| u32::try_from(half).expect("32 bits"));
            data[4 + 2 * i] = low;
            data[5 + 2 * i] = high;
        }
        let (mut pc, mut a) = (0usize, 0u32);
        loop {
            let i = &program[pc];
            let code = u32::from(i.code);
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                    assert!(i.k.is_multiple_of(4) && i.k < 64, "load at {}", i.k);
                    a = data[i.k as usize / 4];
                }
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => a &= i.k,
                c if c == libc::BPF_RET | libc::BPF_K => return i.k,
                c if c == libc::BPF_JMP | libc::BPF_JA => pc += i.k as usize,
                c if c & 0x07 == libc::BPF_JMP => {
                    let taken = match c {
                        c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => a == i.k,
                        c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => a >= i.k,
                        c if c == libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K => a > i.k,
                        c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => a & i.k != 0,
                        other => panic!("jump {other:#x} at {}", pc - 1),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                other => panic!("instruction {other:#x} at {}", pc - 1),
            }
        }
    }

    /// The filter as it was written with seccompiler alone: its linear
    /// allow list, under the number filter, stacked as the kernel stacks
    /// two filters (the stricter action wins; between two of the same
    /// kind, the later filter's).
    fn reference(list: &[seccompiler::sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let first = run(list, arch, nr, args);
        let errno = |e: i32| libc::SECCOMP_RET_ERRNO | e.unsigned_abs();
        let second = if nr >= X32_SYSCALL_BIT {
            errno(libc::EPERM)
        } else if i64::from(nr) == libc::SYS_clone3 || nr > NEWEST_KNOWN {
            errno(libc::ENOSYS)
        } else {
            libc::SECCOMP_RET_ALLOW
        };
        let action = |ret: u32| (ret & libc::SECCOMP_RET_ACTION_FULL) as i32;
        if action(first) < action(second) { first } else { second }
    }

    /// Every call number the kernel may see, in both architectures' views,
    /// with plain arguments; and the conditional calls with arguments
    /// around every boundary their rules draw: both filters answer alike.
    #[test]
    fn the_tree_answers_as_the_linear_allow_list() {
        let program = program().expect("builds");
        let list = linear_program().expect("compiles");
        assert!(program.len() < 500, "a tree, not a chain: {} instructions", program.len());
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        let arch = 62 | 0x8000_0000 | 0x4000_0000;
        let mut numbers: Vec<u32> = (0..NEWEST_KNOWN + 64).collect();
        numbers.extend((0..NEWEST_KNOWN + 64).map(|nr| nr | X32_SYSCALL_BIT));
        numbers.extend([X32_SYSCALL_BIT - 1, 0x7fff_ffff, 0x8000_0000, 0xffff_fffe, u32::MAX]);
        let mut compared = 0;
        for nr in numbers {
            for a in [arch, AUDIT_ARCH_I386] {
                for args in [[0; 6], [u64::MAX; 6], [1, 2, 3, 4, 5, 6]] {
                    assert_eq!(
                        run(&program, a, nr, args),
                        reference(&list, a, nr, args),
                        "call {nr} arch {a:#x} {args:?}"
                    );
                    compared += 1;
                }
            }
        }
        // The conditional calls: each argument from the values the rules
        // name, their neighbours and flag bits, high halves included.
        let mut values: Vec<u64> = vec![0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 14, 15, 16, 17, 33, 58, 0xff, u64::MAX];
        values.extend([libc::AF_UNIX, libc::AF_INET, libc::AF_INET6, libc::AF_NETLINK, libc::AF_PACKET].map(word));
        values.extend([libc::SOCK_NONBLOCK, libc::SOCK_CLOEXEC].map(|f| word(f | libc::SOCK_STREAM)));
        values.extend([libc::IPPROTO_ICMP, libc::IPPROTO_ICMPV6, libc::IPPROTO_TCP, libc::IPPROTO_UDP].map(word));
        values.extend(PERSONALITIES.iter().flat_map(|p| [*p, p + 1, p | 1 << 32]));
        values.extend((0..64).map(|bit| 1u64 << bit));
        values.extend((0..64).map(|bit| (1u64 << bit) | u64::from(libc::SIGCHLD.unsigned_abs())));
        for nr in [libc::SYS_socket, libc::SYS_socketpair, libc::SYS_clone, libc::SYS_unshare, libc::SYS_personality] {
            let nr = u32::try_from(nr).expect("number");
            for &x in &values {
                for &y in &values[..29] {
                    for &z in &values[..29] {
                        let args = [x, y, z, 0, 0, 0];
                        assert_eq!(
                            run(&program, arch, nr, args),
                            reference(&list, arch, nr, args),
                            "call {nr} {args:?}"
                        );
                        compared += 1;
                    }
                }
            }
        }
        assert!(compared > 100_000, "{compared}");
    }

    #[test]
    fn the_lists_are_consistent() {
        let program = program().expect("compiles");
        assert!(program.len() < 4096, "within the kernel's bound: {}", program.len());
        let conditional = conditional_rules().expect("builds");
        let mut seen = std::collections::BTreeSet::new();
        for (name, nr) in ALLOWED {
            assert!(seen.insert(*nr), "{name} listed twice");
            assert!(!conditional.contains_key(nr), "{name} is conditional");
            assert!(REFUSED.iter().all(|(_, r)| r != nr), "{name} is both allowed and refused");
            assert!(*nr <= i64::from(NEWEST_KNOWN), "{name} is newer than NEWEST_KNOWN");
        }
    }
}

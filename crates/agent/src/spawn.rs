//! Starting a command: a child made with `clone(CLONE_VM | CLONE_VFORK)`,
//! as `posix_spawn(3)` makes its own, that sets itself up and execs.
//!
//! The child runs in its parent's memory, on a stack of its own, while the
//! calling thread waits: no page table is copied, nothing is copied on
//! write, and the exec tears down no copy of the parent. For the agent, a
//! multi-threaded process of some megabytes, a `fork` also sent every CPU
//! running one of its threads a TLB shootdown; profiled on `moat run`, the
//! fork and the exec of its copy were most of a command's start in the
//! agent (docs/benchmarks.md).
//!
//! Written by hand because `posix_spawn` cannot do what a command's start
//! needs between the clone and the exec: join its cgroups, take a
//! controlling terminal, take another user's credentials; std's `Command`
//! forks for any of these.
//!
//! What the child may do is narrow: it shares every page with its parent
//! (and, in the agent, with the parent's other threads, which go on
//! running), so it allocates nothing, takes no lock and makes its system
//! calls directly — glibc's wrappers for the credential calls signal the
//! other threads of a process to change theirs too, and those are the
//! parent's. Everything it uses is made before the clone ([`Prepared`]).

use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::launcher::{Launch, NotStarted};

/// The stack the child runs on until it execs: its set-up is a few
/// shallow calls. Allocated untouched (calloc of this size maps fresh
/// pages), so only the pages it uses are ever made.
const CHILD_STACK: usize = 256 << 10;

/// Starts `launch` with `stdio` (stdin, stdout, stderr) as its standard
/// streams, after it joins the cgroups whose `cgroup.procs` descriptors
/// are `join`; waits until it has exec'd (its exec-error pipe closes) or
/// failed (the pipe carries the errno of the failing step). Returns its
/// pid; the caller reaps it.
///
/// The command leads a new session (so a new process group), starts with
/// no signal blocked and every signal the caller handles or ignores back
/// at its default.
pub fn start(launch: &Launch, stdio: [OwnedFd; 3], join: &[RawFd]) -> Result<i32, NotStarted> {
    start_with(launch, stdio, join, &Extras::default())
}

/// What some starts add to a [`Launch`].
#[derive(Debug, Default)]
pub struct Extras<'a> {
    /// The program to run, when not `argv[0]` (which it then only names).
    pub program: Option<&'a str>,
    /// A descriptor the command finds as its descriptor 3.
    pub fd3: Option<&'a OwnedFd>,
}

/// [`start`], with [`Extras`].
pub fn start_with(
    launch: &Launch,
    stdio: [OwnedFd; 3],
    join: &[RawFd],
    extras: &Extras<'_>,
) -> Result<i32, NotStarted> {
    let fail = |what: &str, errno: nix::errno::Errno| NotStarted { errno: errno as i32, what: what.to_owned() };
    let cstring = |s: &str| CString::new(s).map_err(|_| fail("reading the request", nix::errno::Errno::EINVAL));
    let argv: Vec<CString> = launch.argv.iter().map(|a| cstring(a)).collect::<Result<_, _>>()?;
    let env: Vec<CString> = launch.env.iter().map(|e| cstring(e)).collect::<Result<_, _>>()?;
    let cwd = cstring(&launch.cwd)?;
    let Some(program) = extras.program.or(launch.argv.first().map(String::as_str)) else {
        return Err(fail("reading the request", nix::errno::Errno::EINVAL));
    };
    let candidates: Vec<CString> = if program.contains('/') {
        vec![cstring(program)?]
    } else {
        let path = launch.env.iter().find_map(|e| e.strip_prefix("PATH=")).unwrap_or("/usr/bin:/bin");
        path.split(':')
            .map(|dir| if dir.is_empty() { "." } else { dir })
            .map(|dir| cstring(&format!("{dir}/{program}")))
            .collect::<Result<_, _>>()?
    };
    let null_terminated = |strings: &[CString]| -> Vec<*const libc::c_char> {
        strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
    };
    // The child moves each stream onto 0, 1, 2 (and 3) in turn: none may
    // sit there already, where an earlier move would overwrite it.
    let above_3 = |fd: &OwnedFd| -> Result<Option<OwnedFd>, NotStarted> {
        if fd.as_raw_fd() > 3 {
            return Ok(None);
        }
        nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(4))
            // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor.
            .map(|raw| Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) }))
            .map_err(|e| fail("setting up the standard streams", e))
    };
    let stdio: Vec<OwnedFd> =
        stdio.into_iter().map(|fd| Ok(above_3(&fd)?.unwrap_or(fd))).collect::<Result<_, NotStarted>>()?;
    let fd3_copy = match extras.fd3 {
        Some(fd) => above_3(fd)?,
        None => None,
    };
    let fd3 = fd3_copy.as_ref().or(extras.fd3).map(AsRawFd::as_raw_fd);
    let (report_read, report_write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| fail("making a pipe", e))?;
    let prepared = Prepared {
        stdio: [stdio[0].as_raw_fd(), stdio[1].as_raw_fd(), stdio[2].as_raw_fd()],
        fd3,
        join,
        argv: null_terminated(&argv),
        env: null_terminated(&env),
        cwd: &cwd,
        candidates: &candidates,
        user: launch.user.as_ref().map(|(uid, gid, groups)| (*uid, *gid, groups.as_slice())),
        pty: launch.pty,
        report: report_write.as_raw_fd(),
    };
    let mut stack = vec![0u8; CHILD_STACK];
    // The stack grows down from its end, aligned as the ABI wants.
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !0xf;
    // No signal reaches the child before it has put the dispositions
    // back to their defaults: a handler of the parent's run in the child
    // would run in the parent's memory.
    let blocked = SignalsBlocked::all();
    // SAFETY: the child runs `child_entry` on `stack` with `prepared`,
    // both alive until clone returns: CLONE_VFORK suspends this thread
    // until the child has exec'd or exited. The child allocates nothing,
    // takes no lock and writes nothing of the parent's but its own stack
    // (see `child`), so the parent's other threads may run meanwhile.
    let pid = unsafe {
        libc::clone(
            child_entry,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(&prepared).cast_mut().cast(),
        )
    };
    let errno = nix::errno::Errno::last();
    drop(blocked);
    drop(stack);
    if pid < 0 {
        return Err(fail("starting the command", errno));
    }
    drop(report_write);
    drop(stdio);
    drop(fd3_copy);
    let mut report = Vec::new();
    let _ = std::fs::File::from(report_read).read_to_end(&mut report);
    if report.len() < 4 {
        return Ok(pid);
    }
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    let errno = i32::from_le_bytes([report[0], report[1], report[2], report[3]]);
    Err(NotStarted { errno, what: String::from_utf8_lossy(&report[4..]).into_owned() })
}

/// Every signal blocked in the calling thread, until dropped (the
/// thread's mask before is put back).
struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    fn all() -> Self {
        // SAFETY: sigfillset and pthread_sigmask write only the two sets
        // owned here.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut before: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
            Self(before)
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: puts back the mask read in `all`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut());
        }
    }
}

/// `struct sigaction` as the kernel takes it (x86-64): the handler, the
/// flags, the restorer, the mask of 64 signals. All zero is the default
/// disposition.
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: libc::sighandler_t,
    mask: u64,
}

/// Everything the child uses, made before the clone.
struct Prepared<'a> {
    stdio: [RawFd; 3],
    fd3: Option<RawFd>,
    /// `cgroup.procs` descriptors to write the child's pid to.
    join: &'a [RawFd],
    /// Null-terminated arrays of pointers into the request's strings.
    argv: Vec<*const libc::c_char>,
    env: Vec<*const libc::c_char>,
    cwd: &'a CString,
    candidates: &'a [CString],
    user: Option<(u32, u32, &'a [u32])>,
    pty: bool,
    /// The exec-error pipe's writing end (close-on-exec).
    report: RawFd,
}

/// The child's entry: sets up and execs, or reports the failing step on
/// the pipe and exits.
extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Prepared` that `start` keeps alive while this
    // child runs (its thread waits, CLONE_VFORK).
    let prepared = unsafe { &*arg.cast::<Prepared<'_>>() };
    let (errno, what) = child(prepared);
    let code = (errno as i32).to_le_bytes();
    // SAFETY: plain writes of buffers that outlive the calls, then _exit,
    // which ends the child at once, running nothing of the parent's (no
    // atexit handlers, no buffered output).
    unsafe {
        libc::write(prepared.report, code.as_ptr().cast(), code.len());
        libc::write(prepared.report, what.as_ptr().cast(), what.len());
        libc::_exit(127)
    }
}

/// The child's set-up; returns only on failure, with the errno and the
/// step. System calls only (see the module's comment).
fn child(prepared: &Prepared<'_>) -> (nix::errno::Errno, &'static str) {
    let failed = |what| (nix::errno::Errno::last(), what);
    // SAFETY: each call below passes only integers, or pointers to
    // buffers `start` keeps alive (the streams, the working directory, the
    // groups, argv and the environment, null-terminated) or to locals.
    unsafe {
        // The dispositions are the child's own copy (no CLONE_SIGHAND):
        // every signal the agent handles or ignores goes back to its
        // default, as for a fresh program (an ignored signal would stay
        // ignored across exec: SIGPIPE, which Rust ignores, and glibc's
        // internal ones, which its own wrapper refuses to touch, hence
        // the raw call). Then the mask the command starts with: empty.
        for signal in 1..=64 {
            let mut action = KernelSigaction::default();
            if libc::syscall(libc::SYS_rt_sigaction, signal, std::ptr::null::<KernelSigaction>(), &mut action, 8) == 0
                && action.handler != libc::SIG_DFL
            {
                let default = KernelSigaction::default();
                libc::syscall(libc::SYS_rt_sigaction, signal, &default, std::ptr::null_mut::<KernelSigaction>(), 8);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        // The cgroups first, while the child has the agent's credentials,
        // which may move it.
        if crate::cgroup::join(prepared.join).is_err() {
            return failed("joining the command's cgroup");
        }
        for (target, fd) in (0..).zip(prepared.stdio.into_iter().chain(prepared.fd3)) {
            // dup2 clears close-on-exec on the copy: the command keeps 0, 1, 2 (and 3).
            if libc::dup2(fd, target) < 0 {
                return failed("setting up the standard streams");
            }
        }
        if libc::setsid() < 0 {
            return failed("starting a session");
        }
        if prepared.pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            return failed("taking the terminal");
        }
        if libc::chdir(prepared.cwd.as_ptr()) < 0 {
            return failed("entering the working directory");
        }
        if let Some((uid, gid, groups)) = prepared.user {
            if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) < 0 {
                return failed("setting groups");
            }
            if libc::syscall(libc::SYS_setresgid, gid, gid, gid) < 0 {
                return failed("setting the group id");
            }
            if libc::syscall(libc::SYS_setresuid, uid, uid, uid) < 0 {
                return failed("setting the user id");
            }
        }
    }
    // As execvp(3): the first candidate that execs; EACCES from any of them
    // wins over a later ENOENT.
    let mut error = nix::errno::Errno::ENOENT;
    for candidate in prepared.candidates {
        // SAFETY: null-terminated arrays of pointers to live C strings.
        unsafe { libc::execve(candidate.as_ptr(), prepared.argv.as_ptr(), prepared.env.as_ptr()) };
        match nix::errno::Errno::last() {
            nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR => {}
            nix::errno::Errno::EACCES => error = nix::errno::Errno::EACCES,
            other => return (other, "exec"),
        }
    }
    (error, "exec")
}

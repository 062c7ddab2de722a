//! Launchers: commands started inside their cgroup, with no migration.
//!
//! On cgroup v1 a process joins a cgroup by writing `cgroup.procs`, and
//! that migration takes two locks global to the host: the cgroup mutex and
//! the rwsem every fork on the host takes for reading. A migration waits
//! for every fork in flight and holds up every new one, so on a host where
//! one sandbox runs a fork bomb, every other sandbox's command start queued
//! behind it (measured: good sessions' p99 50× their p99 alone).
//!
//! So each command cgroup of a v1 host gets a launcher: a small process of
//! this binary (`moat-agent launcher`), moved into the cgroup once when the
//! cgroup is made, that starts each command the agent asks for. A child is
//! born in its parent's cgroups, so a command cgroup reused for the next
//! command costs no migration at all. (cgroup v2 has `CLONE_INTO_CGROUP`
//! for the same end; there the agent is a microVM's own PID 1, alone in its
//! kernel, and joins as before.)
//!
//! The agent and a launcher speak over a Unix stream socket, one command at
//! a time: the agent sends a request (a frame: length, then JSON) with the
//! command's three standard streams as `SCM_RIGHTS`; the launcher answers
//! `{"pid": N}` once the command has exec'd (or `{"errno": E, "what": ...}`
//! when it could not), then `{"code": C}` or `{"signal": S}` when it exits.
//! The launcher ends when the agent closes the socket.
//!
//! Written by hand: no crate spawns from a process of its own over a
//! socket. A command starts as the agent's own do ([`crate::spawn`]).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::reaper::{Exit, Reaper};

/// The subcommand that runs a launcher (`moat-agent launcher`).
pub const SUBCOMMAND: &str = "launcher";

/// The descriptor a launcher finds its socket on.
const SOCKET_FD: RawFd = 3;

/// The largest request a launcher reads (argv and environment of one
/// command; the agent's own frames are smaller).
const MAX_REQUEST: usize = 64 << 20;

/// What one command is: everything the launcher's child sets up.
#[derive(Debug, Clone)]
pub struct Launch {
    /// `argv[0]` is the program, found on the environment's `PATH` when it
    /// holds no `/`.
    pub argv: Vec<String>,
    /// `NAME=value` each.
    pub env: Vec<String>,
    pub cwd: String,
    /// uid, gid and supplementary groups to take, when not the launcher's.
    pub user: Option<(u32, u32, Vec<u32>)>,
    /// Make stdin the controlling terminal.
    pub pty: bool,
}

impl Launch {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "argv": self.argv,
            "env": self.env,
            "cwd": self.cwd,
            "user": self.user,
            "pty": self.pty,
        })
    }

    fn from_json(value: &serde_json::Value) -> Option<Self> {
        let strings = |key: &str| -> Option<Vec<String>> {
            value.get(key)?.as_array()?.iter().map(|s| s.as_str().map(str::to_owned)).collect()
        };
        let user = match value.get("user")? {
            serde_json::Value::Null => None,
            user => {
                let (uid, gid, groups): (u32, u32, Vec<u32>) = serde_json::from_value(user.clone()).ok()?;
                Some((uid, gid, groups))
            }
        };
        Some(Self {
            argv: strings("argv")?,
            env: strings("env")?,
            cwd: value.get("cwd")?.as_str()?.to_owned(),
            user,
            pty: value.get("pty")?.as_bool()?,
        })
    }
}

/// Why a command did not start: the failing step's errno, and the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotStarted {
    pub errno: i32,
    pub what: String,
}

/// The agent's side of one launcher.
#[derive(Debug)]
pub struct Launcher {
    pid: i32,
    socket: OwnedFd,
}

impl Launcher {
    /// Starts a launcher (this binary, re-executed) that joins the cgroups
    /// whose `cgroup.procs` descriptors are `join` before it execs: the one
    /// migration its cgroup will ever need.
    pub fn spawn(reaper: &Reaper, join: &[i32]) -> io::Result<Self> {
        Self::spawn_program(reaper, join, std::path::Path::new("/proc/self/exe"))
    }

    /// [`Launcher::spawn`] with `program` as the agent binary.
    pub fn spawn_program(reaper: &Reaper, join: &[i32], program: &std::path::Path) -> io::Result<Self> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )?;
        let null = || std::fs::File::open("/dev/null").map(OwnedFd::from);
        let program = program.to_string_lossy();
        let launch = Launch {
            argv: vec!["moat-agent".into(), SUBCOMMAND.into()],
            env: Vec::new(),
            cwd: "/".into(),
            user: None,
            pty: false,
        };
        let extras = crate::spawn::Extras { program: Some(&program), fd3: Some(&theirs) };
        let stdio = [null()?, null()?, null()?];
        let (pid, _exit) = reaper.spawn(|| crate::spawn::start_with(&launch, stdio, join, &extras)).map_err(
            |NotStarted { errno, what }| {
                io::Error::new(io::Error::from_raw_os_error(errno).kind(), format!("starting a launcher ({what})"))
            },
        )?;
        drop(theirs);
        nix::fcntl::fcntl(&ours, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))?;
        Ok(Self { pid, socket: ours })
    }

    /// The launcher's pid (in the agent's pid namespace).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Starts `launch` with `stdio` (stdin, stdout, stderr) as its standard
    /// streams. Returns the command's pid and a receiver of its exit,
    /// which hands the launcher back to `slot` first (it is then free for
    /// the cgroup's next command). A launcher that fails on the way is
    /// not handed back.
    pub async fn start(
        self,
        launch: &Launch,
        stdio: [OwnedFd; 3],
        slot: std::sync::Arc<std::sync::Mutex<Option<Launcher>>>,
    ) -> io::Result<Result<(i32, oneshot::Receiver<Exit>), NotStarted>> {
        // SAFETY: the OwnedFd is open, and the AsyncFd owns it until
        // `into_inner` hands it back: its descriptor stays the same.
        let socket = unsafe { AsyncFd::register(self.socket) }.map_err(io::Error::from)?;
        let body = serde_json::to_vec(&launch.to_json()).map_err(io::Error::other)?;
        let mut frame = u32::try_from(body.len()).map_err(io::Error::other)?.to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        send_frame(&socket, &frame, &stdio).await?;
        drop(stdio);
        let reply = read_frame(&socket).await?;
        if let Some(errno) = reply.get("errno").and_then(serde_json::Value::as_i64) {
            let what = reply.get("what").and_then(serde_json::Value::as_str).unwrap_or("starting").to_owned();
            let launcher = Launcher { pid: self.pid, socket: socket.into_inner() };
            *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(launcher);
            return Ok(Err(NotStarted { errno: i32::try_from(errno).unwrap_or(libc::EIO), what }));
        }
        let pid = reply
            .get("pid")
            .and_then(serde_json::Value::as_i64)
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| io::Error::other(format!("the launcher answered {reply}, not a pid")))?;
        let (tx, rx) = oneshot::channel();
        let launcher_pid = self.pid;
        tokio::spawn(async move {
            let Ok(reply) = read_frame(&socket).await else { return };
            let exit = match (reply.get("code"), reply.get("signal")) {
                (Some(code), _) => code.as_i64().and_then(|c| i32::try_from(c).ok()).map(Exit::Code),
                (_, Some(signal)) => signal.as_i64().and_then(|s| i32::try_from(s).ok()).map(Exit::Signal),
                _ => None,
            };
            if let Some(exit) = exit {
                let launcher = Launcher { pid: launcher_pid, socket: socket.into_inner() };
                *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(launcher);
                let _ = tx.send(exit);
            }
        });
        Ok(Ok((pid, rx)))
    }
}

/// Sends `frame` with `fds` attached to its first bytes.
async fn send_frame(socket: &AsyncFd<OwnedFd>, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut sent = 0;
    while sent < frame.len() {
        let mut guard = socket.writable().await?;
        let first = sent == 0;
        let result = guard.try_io(|fd| {
            let rights = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if first { &rights } else { &[] };
            sendmsg::<()>(fd.as_raw_fd(), &[IoSlice::new(&frame[sent..])], cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                .map_err(io::Error::from)
        });
        match result {
            Ok(Ok(n)) => sent += n,
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => {}
        }
    }
    Ok(())
}

/// Reads one frame (length, then JSON) from the launcher.
async fn read_frame(socket: &AsyncFd<OwnedFd>) -> io::Result<serde_json::Value> {
    let mut header = [0u8; 4];
    read_exact(socket, &mut header).await?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_REQUEST {
        return Err(io::Error::other(format!("the launcher sent a frame of {len} bytes")));
    }
    let mut body = vec![0; len];
    read_exact(socket, &mut body).await?;
    serde_json::from_slice(&body).map_err(io::Error::other)
}

async fn read_exact(socket: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> io::Result<()> {
    let mut read = 0;
    while read < buf.len() {
        let mut guard = socket.readable().await?;
        match guard.try_io(|fd| nix::unistd::read(fd.get_ref(), &mut buf[read..]).map_err(io::Error::from)) {
            Ok(Ok(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(n)) => read += n,
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => {}
        }
    }
    Ok(())
}

/// The launcher process: serves requests on [`SOCKET_FD`] until the agent
/// closes it. Returns the exit code.
pub fn run() -> i32 {
    // Sandbox processes of the launcher's uid may not ptrace it (what it
    // starts is dumpable again once it execs).
    let _ = nix::sys::prctl::set_dumpable(false);
    // SAFETY: the agent installed the socket at SOCKET_FD before exec;
    // nothing else in this process owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(SOCKET_FD) };
    // Close-on-exec: the commands it starts must not inherit it (one could
    // write the agent made-up exit statuses).
    if nix::fcntl::fcntl(&socket, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC)).is_err() {
        return 1;
    }
    loop {
        let (request, stdio) = match receive(&socket) {
            Ok(Some(received)) => received,
            Ok(None) => return 0,
            Err(_) => return 1,
        };
        let Some(launch) = Launch::from_json(&request) else {
            let _ = reply(&socket, &serde_json::json!({"errno": libc::EINVAL, "what": "reading the request"}));
            continue;
        };
        match start(&launch, stdio) {
            Ok(pid) => {
                if reply(&socket, &serde_json::json!({ "pid": pid })).is_err() {
                    return 1;
                }
                let status = match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None) {
                    Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => serde_json::json!({ "code": code }),
                    Ok(nix::sys::wait::WaitStatus::Signaled(_, signal, _)) => {
                        serde_json::json!({ "signal": signal as i32 })
                    }
                    _ => serde_json::json!({ "code": 255 }),
                };
                if reply(&socket, &status).is_err() {
                    return 1;
                }
            }
            Err(e) => {
                if reply(&socket, &serde_json::json!({"errno": e.errno, "what": e.what})).is_err() {
                    return 1;
                }
            }
        }
    }
}

/// Reads one request and the three descriptors sent with it; `None` at
/// end of file.
fn receive(socket: &OwnedFd) -> io::Result<Option<(serde_json::Value, Vec<OwnedFd>)>> {
    let mut header = [0u8; 4];
    let mut space = nix::cmsg_space!([RawFd; 3]);
    let (got, fds) = {
        let mut iov = [IoSliceMut::new(&mut header)];
        let msg = recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors in
                // this process; nothing else owns them.
                fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        (msg.bytes, fds)
    };
    if got == 0 {
        return Ok(None);
    }
    let mut stream = std::fs::File::from(socket.try_clone()?);
    stream.read_exact(&mut header[got..])?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_REQUEST {
        return Err(io::Error::other("request too large"));
    }
    let mut body = vec![0; len];
    stream.read_exact(&mut body)?;
    let request = serde_json::from_slice(&body).map_err(io::Error::other)?;
    Ok(Some((request, fds)))
}

fn reply(socket: &OwnedFd, value: &serde_json::Value) -> io::Result<()> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    let mut frame = u32::try_from(body.len()).map_err(io::Error::other)?.to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    std::fs::File::from(socket.try_clone()?).write_all(&frame)
}

/// Starts the command in this (already joined) cgroup: see
/// [`crate::spawn::start`].
fn start(launch: &Launch, stdio: Vec<OwnedFd>) -> Result<i32, NotStarted> {
    let stdio: [OwnedFd; 3] = stdio
        .try_into()
        .map_err(|_| NotStarted { errno: libc::EBADF, what: "receiving the standard streams".into() })?;
    crate::spawn::start(launch, stdio, &[])
}

//! The exec operation: run a process, stream its output, report its exit.
//!
//! Each process leads its own session and process group, so a timeout, a
//! signal or a vanished client reaches its whole tree (`kill(-pgid)`).
//! Output is read in chunks as the process writes it and sent on at once;
//! when the client stops reading, sends block, the pipe fills, and the
//! process blocks on its next write: memory stays bounded.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use moat_proto::conn::{FrameSink, FrameStream};
use moat_proto::{AgentMsg, ClientMsg, Connection, ExecRequest, ExitStatus, Frame, StreamId, WinSize, WireError};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use crate::error::{check_path, invalid, io_error};
use crate::launcher::{Launch, Launcher, NotStarted};
use crate::reaper::{Exit, Reaper};
use crate::users;

/// The longest timeout a request may ask for.
const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long output is still read after the process exited, for descendants
/// that keep its pipes open (`cmd &`): their later output is not waited for.
const DRAIN_GRACE: Duration = Duration::from_millis(100);

/// Bytes read from a pipe at once: the default pipe capacity.
const READ_CHUNK: usize = 64 * 1024;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A checked request, ready to spawn.
struct Prepared {
    /// What the child runs, as a launcher takes it.
    launch: Launch,
    pty: Option<WinSize>,
    stdin: bool,
    timeout: Option<Duration>,
    /// The `cgroup.procs` descriptors of the command's cgroups, joined by
    /// the child before anything else (empty through a launcher, which
    /// is in them already).
    join: Vec<i32>,
}

impl Prepared {
    /// The program, as the request named it.
    fn program(&self) -> &str {
        self.launch.argv.first().map_or("", String::as_str)
    }
}

/// Checks `req` and builds its command; the child joins the cgroups whose
/// `cgroup.procs` descriptors are `join` before anything else.
fn prepare(req: &ExecRequest, join: Vec<i32>) -> Result<Prepared, WireError> {
    let argv: Vec<String> = match &req.command {
        moat_proto::Command::Argv(argv) => argv.clone(),
        moat_proto::Command::Shell(script) => vec!["/bin/sh".into(), "-c".into(), script.clone()],
    };
    let Some(program) = argv.first() else {
        return Err(invalid("argv is empty; give at least the program to run"));
    };
    if program.is_empty() {
        return Err(invalid("argv[0] is empty; give the program to run"));
    }
    if let Some(i) = argv.iter().position(|a| a.contains('\0')) {
        return Err(invalid(format!("argv[{i}] contains a NUL byte, which no argument may hold")));
    }
    for (key, value) in &req.env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(invalid(format!(
                "environment variable {key:?} is invalid: names must be non-empty without '=' or NUL, values without NUL"
            )));
        }
    }
    let timeout = match req.timeout_ms {
        None => None,
        Some(0) => return Err(invalid("timeout_ms must be at least 1 (or absent for no timeout)")),
        Some(ms) if Duration::from_millis(ms) > MAX_TIMEOUT => {
            return Err(invalid(format!("timeout_ms {ms} is longer than the 7-day maximum (604800000)")));
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let user = match &req.user {
        Some(spec) => users::lookup(spec)?,
        None => users::current(),
    };
    let cwd = match &req.cwd {
        Some(cwd) => {
            let path = check_path(cwd)?;
            match std::fs::metadata(path) {
                Ok(m) if m.is_dir() => path.to_path_buf(),
                Ok(_) => return Err(io_error(cwd, &std::io::Error::from_raw_os_error(libc::ENOTDIR))),
                Err(e) => return Err(io_error(&format!("working directory {cwd}"), &e)),
            }
        }
        None if user.home.is_dir() => user.home.clone(),
        None => "/".into(),
    };

    // The request's variables override moat's own, each name once.
    let home = user.home.to_string_lossy();
    let mut env: std::collections::BTreeMap<&str, &str> = [
        ("PATH", DEFAULT_PATH),
        ("HOME", &*home),
        ("USER", &user.name),
        ("LOGNAME", &user.name),
        ("SHELL", &user.shell),
        ("LANG", "C.UTF-8"),
    ]
    .into_iter()
    .collect();
    if req.pty.is_some() {
        env.insert("TERM", "xterm-256color");
    }
    env.extend(req.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let switch = (nix::unistd::geteuid().as_raw() != user.uid).then(|| (user.uid, user.gid, user.groups.clone()));
    let launch = Launch {
        env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        argv,
        cwd: cwd.to_string_lossy().into_owned(),
        user: switch,
        pty: req.pty.is_some(),
    };
    Ok(Prepared { launch, pty: req.pty, stdin: req.stdin, timeout, join })
}

/// A pseudo-terminal pair opened close-on-exec, so that no other process the
/// agent starts meanwhile inherits it (`openpty(3)` opens both ends without).
fn open_pty(size: &libc::winsize) -> std::io::Result<nix::pty::OpenptyResult> {
    use nix::fcntl::OFlag;
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let name = nix::pty::ptsname_r(&master)?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(name)?
        .into();
    // SAFETY: the master is open for the call; TIOCSWINSZ only reads `size`.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, size) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `into_raw_fd` hands over the open master; OwnedFd takes it.
    let master: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(master)) };
    Ok(nix::pty::OpenptyResult { master, slave })
}

/// The parent's ends of a spawned process's standard streams.
struct Streams {
    stdin: Option<pipe::Sender>,
    stdout: Option<pipe::Receiver>,
    stderr: Option<pipe::Receiver>,
    /// The PTY master, kept for resizing.
    pty: Option<OwnedFd>,
}

/// What a failed start says: "command not found" with the search path
/// for a missing program.
fn spawn_error(program: &str, e: &std::io::Error) -> WireError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => WireError::new(
            moat_proto::ErrorKind::NotFound,
            format!("command not found: {program} (searched PATH={DEFAULT_PATH}; install it or give its full path)"),
        ),
        Some(libc::EAGAIN) => limit_full(program, e),
        _ => io_error(&format!("starting {program}"), e),
    }
}

/// The words of [`limit_full`]'s error, by which a start that failed there
/// is told from others.
const LIMIT_FULL: &str = "the sandbox's process limit is full";

/// What a command that could not start because the sandbox's process
/// limit is full says: the limit, what holds it, and what to do.
fn limit_full(program: &str, e: &std::io::Error) -> WireError {
    let held = crate::cgroup::user_cgroups().and_then(crate::cgroup::UserCgroups::pids_in_use);
    let figures = held.map_or_else(String::new, |(current, max)| format!(" ({current} of {max} in use)"));
    WireError::new(
        moat_proto::ErrorKind::Io,
        format!(
            "starting {program}: {LIMIT_FULL}{figures}: processes and threads that earlier commands left running \
             hold it ({e}). Wait for them to end and try again, or destroy this sandbox and create another"
        ),
    )
}

impl Streams {
    /// The streams of a command on a PTY: its master, read for output,
    /// written for input, kept for resizing.
    fn of_pty(master: OwnedFd) -> Result<Self, WireError> {
        let io = |what: &str, e: std::io::Error| io_error(what, &e);
        let reader = master.try_clone().map_err(|e| io("duplicating the pty", e))?;
        let writer = master.try_clone().map_err(|e| io("duplicating the pty", e))?;
        Ok(Self {
            stdout: Some(pipe::Receiver::from_owned_fd_unchecked(reader).map_err(|e| io("pty", e))?),
            stdin: Some(pipe::Sender::from_owned_fd_unchecked(writer).map_err(|e| io("pty", e))?),
            stderr: None,
            pty: Some(master),
        })
    }
}

/// The three streams the command's child gets, and the agent's ends of
/// them.
fn streams_of(prepared: &Prepared) -> Result<([OwnedFd; 3], Streams), WireError> {
    let io = |what: &str, e: std::io::Error| io_error(what, &e);
    let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io("making a pipe", e.into()));
    let (stdio, streams) = if let Some(size) = prepared.pty {
        let ws = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
        let pty = open_pty(&ws).map_err(|e| io("opening a pseudo-terminal", e))?;
        let slave = || pty.slave.try_clone().map_err(|e| io("duplicating the pty", e));
        ([slave()?, slave()?, slave()?], Streams::of_pty(pty.master)?)
    } else {
        let (stdin_child, stdin) = if prepared.stdin {
            let (read, write) = pipe()?;
            (read, Some(pipe::Sender::from_owned_fd(write).map_err(|e| io("stdin pipe", e))?))
        } else {
            let null = std::fs::File::open("/dev/null").map_err(|e| io("opening /dev/null", e))?;
            (OwnedFd::from(null), None)
        };
        let (out_read, out_write) = pipe()?;
        let (err_read, err_write) = pipe()?;
        let streams = Streams {
            stdin,
            stdout: Some(pipe::Receiver::from_owned_fd(out_read).map_err(|e| io("stdout pipe", e))?),
            stderr: Some(pipe::Receiver::from_owned_fd(err_read).map_err(|e| io("stderr pipe", e))?),
            pty: None,
        };
        ([stdin_child, out_write, err_write], streams)
    };
    Ok((stdio, streams))
}

/// What a command that did not start says, by the step that failed.
fn not_started(program: &str, NotStarted { errno, what }: NotStarted) -> WireError {
    let e = std::io::Error::from_raw_os_error(errno);
    match what.as_str() {
        "exec" => spawn_error(program, &e),
        _ if errno == libc::EAGAIN => limit_full(program, &e),
        _ => io_error(&format!("starting {program} ({what})"), &e),
    }
}

/// Starts `prepared` from the agent itself ([`crate::spawn`]); returns
/// the command's pid, its exit, and the agent's ends of its streams.
fn spawn(reaper: &Reaper, prepared: &Prepared) -> Result<(i32, oneshot::Receiver<Exit>, Streams), WireError> {
    let (stdio, streams) = streams_of(prepared)?;
    match reaper.spawn(|| crate::spawn::start(&prepared.launch, stdio, &prepared.join)) {
        Ok((pid, exit)) => Ok((pid, exit, streams)),
        Err(why) => Err(not_started(prepared.program(), why)),
    }
}

/// Starts `prepared` through its cgroup's launcher ([`crate::launcher`]);
/// returns the command's pid, its exit, and the agent's ends of its streams.
async fn spawn_launched(
    launcher: Launcher,
    slot: crate::cgroup::LauncherSlot,
    prepared: &Prepared,
) -> Result<(i32, oneshot::Receiver<Exit>, Streams), WireError> {
    let program = prepared.program();
    let (stdio, streams) = streams_of(prepared)?;
    match launcher.start(&prepared.launch, stdio, slot).await {
        Ok(Ok((pid, exit))) => Ok((pid, exit, streams)),
        Ok(Err(why)) => Err(not_started(program, why)),
        Err(e) => Err(io_error(&format!("starting {program} through its cgroup's launcher"), &e)),
    }
}

/// A started command: what was asked, its pid, its exit and its streams.
type Started = (Prepared, i32, oneshot::Receiver<Exit>, Streams);

/// Starts `req`'s command in `cgroup`, where it has one: through the
/// cgroup's launcher when it has one at hand (cgroup v1), else joined to
/// it between fork and exec. Never outside it: a command started by the
/// agent alone would run in the agent's cgroup, beside its reserve.
async fn start_in(
    reaper: &Reaper,
    req: &ExecRequest,
    cgroup: Option<&crate::cgroup::ExecCgroup>,
) -> Result<Started, WireError> {
    // Checked first: a request refused before its start (a missing cwd,
    // an unknown user) leaves the launcher in its place.
    let mut prepared = prepare(req, Vec::new())?;
    let launcher = cgroup.and_then(crate::cgroup::ExecCgroup::take_launcher);
    let mut opened = Vec::new();
    if let Some(cgroup) = cgroup
        && launcher.is_none()
    {
        prepared.join =
            cgroup.join_fds(&mut opened).map_err(|e| io_error("opening the command's cgroup to start it there", &e))?;
    }
    let (pid, exit, streams) = match (launcher, cgroup) {
        (Some(launcher), Some(cgroup)) => spawn_launched(launcher, cgroup.launcher_slot(), &prepared).await?,
        _ => spawn(reaper, &prepared)?,
    };
    Ok((prepared, pid, exit, streams))
}

/// Serves one exec request on `conn` until the process exits or the client goes away.
pub async fn serve<S>(reaper: Arc<Reaper>, req: ExecRequest, mut conn: Connection<S>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Runaway processes of earlier commands go before this one starts;
    // then its own cgroup. One trip to a blocking thread for both.
    let cgroups = crate::cgroup::user_cgroups();
    let (mut reclaimed, mut cgroup) = match cgroups {
        Some(cgroups) => match tokio::task::spawn_blocking({
            let reaper = reaper.clone();
            move || (cgroups.reclaim(), cgroups.create_exec(&reaper))
        })
        .await
        {
            Ok((reclaimed, Ok(cgroup))) => (reclaimed, Some(cgroup)),
            Ok((reclaimed, Err(e))) => {
                tracing::warn!("running a command without its own cgroup: {e}");
                (reclaimed, None)
            }
            Err(_) => (None, None),
        },
        None => (None, None),
    };
    // A sandbox that keeps running away at its pids limit waits a while
    // before each command (its report said how long).
    if let Some(hold) = cgroups.and_then(crate::cgroup::UserCgroups::hold) {
        tokio::time::sleep(hold).await;
    }
    let mut spawned = start_in(&reaper, &req, cgroup.as_ref()).await;
    // A runaway of an earlier command may fill the limit between the look
    // for runaways above and the start (a fork bomb left in the background
    // grows by hundreds a second): looked for again, and the start tried
    // once more, the same way, if one was killed; else the refusal stands.
    if let (Err(error), Some(cgroups)) = (&spawned, cgroups)
        && error.message.contains(LIMIT_FULL)
        && let Ok(Some(note)) = tokio::task::spawn_blocking(move || cgroups.reclaim()).await
    {
        reclaimed = Some(reclaimed.map_or_else(|| note.clone(), |first| first + &note));
        spawned = start_in(&reaper, &req, cgroup.as_ref()).await;
    }
    if let Some(cgroup) = cgroup.as_mut() {
        cgroup.joined();
    }
    let mut tree = Tree {
        group: Pid::from_raw(0),
        cgroup: cgroup.map(Arc::new),
        acting: tokio::sync::Mutex::new(()),
        equip: AtomicBool::new(false),
        last: req.last,
    };
    let (prepared, pid, exit, streams) = match spawned {
        Ok(spawned) => spawned,
        Err(error) => {
            let _ = conn.send(&AgentMsg::Error { error }).await;
            tree.finish().await;
            return;
        }
    };
    let started = Instant::now();
    let group = Pid::from_raw(pid);
    tree.group = group;
    let tree = Arc::new(tree);
    if conn.send(&AgentMsg::Started { pid: pid.unsigned_abs() }).await.is_err() {
        tree.kill().await;
        return;
    }
    let (mut sink, stream) = conn.split();
    if let Some(note) = reclaimed {
        let _ = sink.send_data(StreamId::Error, Bytes::from(note)).await;
    }
    let Streams { stdin, stdout, stderr, pty } = streams;
    let abandoned = Arc::new(AtomicBool::new(false));
    let control = tokio::spawn(control_loop(stream, stdin, tree.clone(), abandoned.clone(), pty));
    // The report of a limit the command reached, when moat stopped it there
    // or it timed out there.
    let stopped = Arc::new(std::sync::Mutex::new(None));
    let timed_out = Arc::new(AtomicBool::new(false));
    let timer = prepared.timeout.map(|timeout| {
        let (timed_out, tree, stopped) = (timed_out.clone(), tree.clone(), stopped.clone());
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            timed_out.store(true, Ordering::SeqCst);
            // A limit met on the way to the timeout is said beside it: a
            // thread bomb meets the pids limit once and holds it, which
            // moat's watch (forks that keep failing) does not stop.
            if let Some(report) = tree.limit_at_timeout().await {
                stopped.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(report);
            }
            tree.kill().await;
        })
    });

    // A fork bomb is stopped at the pids limit, not left to churn there;
    // a memory bomb thrashing at the memory limit, not left to stall there.
    let (watch_done, mut watch_until) = oneshot::channel::<()>();
    let fork_watch = tree.cgroup.clone().map(|cgroup| {
        let (tree, stopped) = (tree.clone(), stopped.clone());
        tokio::spawn(async move {
            let period = crate::cgroup::FORK_WATCH_PERIOD;
            let mut forks = crate::cgroup::ForkWatch::new(cgroup.failed_forks());
            let cgroups = crate::cgroup::user_cgroups();
            let mut shared = crate::cgroup::ForkWatch::new(cgroups.map_or(0, |c| c.failed_forks()));
            let mut memory = crate::cgroup::MemoryWatch::new(cgroup.memory_stall());
            loop {
                tokio::select! {
                    _ = &mut watch_until => return,
                    () = tokio::time::sleep(period) => {}
                }
                let filling = match cgroups {
                    // Forks failing at the limit all commands share: this
                    // command goes if it holds the most processes.
                    Some(cgroups) if shared.observe(cgroups.failed_forks()) => {
                        let cgroup = cgroup.clone();
                        tokio::task::spawn_blocking(move || {
                            cgroups.holds_the_most(&cgroup).then(|| cgroups.shared_pids_hit())
                        })
                        .await
                        .ok()
                        .flatten()
                    }
                    _ => None,
                };
                let report = if forks.observe(cgroup.failed_forks()) {
                    tree.stop_at_limit().await
                } else if let Some(hit) = filling {
                    tree.stop_with(hit).await
                } else if memory.observe(cgroup.memory_stall(), period) {
                    let hit = crate::cgroup::LimitHit::MemoryStall {
                        limit_bytes: cgroup.memory_limit(),
                        seconds: memory.stalled_for(period).as_secs(),
                    };
                    tree.stop_with(hit).await
                } else {
                    continue;
                };
                *stopped.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = report;
                return;
            }
        })
    });

    let limit = req.output_limit.unwrap_or(u64::MAX);
    let mut dropped = 0;
    let result = pump_output(&mut sink, [stdout, stderr], exit, limit, &mut dropped).await;
    control.abort();
    if let Some(timer) = timer {
        // One that fired is finishing its kill and report, which ended the
        // command: awaited, not cut off before its report is kept.
        if timed_out.load(Ordering::SeqCst) {
            let _ = timer.await;
        } else {
            timer.abort();
        }
    }
    // A stop under way finishes first: its kill and report are this command's.
    drop(watch_done);
    if let Some(fork_watch) = fork_watch {
        let _ = fork_watch.await;
    }
    let stopped = stopped.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    if timed_out.load(Ordering::SeqCst) || abandoned.load(Ordering::SeqCst) || result.is_err() {
        if let Some(report) = stopped.filter(|_| timed_out.load(Ordering::SeqCst) && result.is_ok()) {
            let _ = sink.send_data(StreamId::Error, Bytes::from(report)).await;
        }
        // Everything the command started goes with it, even what left its
        // process group.
        tree.kill().await;
    } else if let Some(report) = stopped {
        let _ = sink.send_data(StreamId::Error, Bytes::from(report)).await;
        tree.finish().await;
    } else {
        match tree.end().await {
            Ended::Limit(report) => {
                let _ = sink.send_data(StreamId::Error, Bytes::from(report)).await;
            }
            Ended::Left => {
                if let (Some(cgroups), Some(cgroup)) = (cgroups, tree.cgroup.clone()) {
                    watch_background(cgroups, cgroup);
                }
            }
            Ended::Clean => {}
        }
    }
    match result {
        Ok(exit) => {
            let status = ExitStatus {
                code: match exit {
                    Exit::Code(code) => Some(code),
                    Exit::Signal(_) => None,
                },
                signal: match exit {
                    Exit::Signal(signal) => Some(signal),
                    Exit::Code(_) => None,
                },
                timed_out: timed_out.load(Ordering::SeqCst),
                duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                dropped_bytes: dropped,
            };
            let _ = sink.send(&AgentMsg::Exited { status }).await;
        }
        Err(Lost::Client) => {
            // The client went away mid-stream: nobody will read the output,
            // so the process tree went too (above).
        }
        Err(Lost::Exit) => {
            // Its launcher ended before saying how the command ended (the
            // tree went too, above): said so, never a silent close, which
            // the host would take for the agent's end.
            let error = WireError::new(
                moat_proto::ErrorKind::Internal,
                "the command's exit status was lost: the process that started it in its cgroup ended first, \
                 and the command and everything it started were stopped; check whether it did what it should \
                 (it may have finished), then run it again if not",
            );
            let _ = sink.send(&AgentMsg::Error { error }).await;
        }
    }
}

/// Why a command's output ended before its exit was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// The client stopped listening.
    Client,
    /// The command's exit never came: its launcher ended first.
    Exit,
}

/// How a command that exited on its own left its cgroup ([`Tree::end`]).
enum Ended {
    /// It reached a pids or memory limit: what was left was killed, and
    /// this is the report.
    Limit(String),
    /// Processes it started still run (`cmd &`).
    Left,
    /// Nothing of it is left.
    Clean,
}

/// Watches what a finished command left running (`cmd &`) until it ends:
/// a fork bomb sent to the background is stopped at the pids limit as one
/// in the foreground is, and the next command says so.
fn watch_background(cgroups: &'static crate::cgroup::UserCgroups, cgroup: Arc<crate::cgroup::ExecCgroup>) {
    if cgroup.process_count() == 0 {
        return;
    }
    tokio::spawn(async move {
        let mut watch = crate::cgroup::ForkWatch::new(cgroup.failed_forks());
        let mut shared = crate::cgroup::ForkWatch::new(cgroups.failed_forks());
        loop {
            tokio::time::sleep(crate::cgroup::FORK_WATCH_PERIOD).await;
            // Emptied (and perhaps another command's since): nothing left to watch.
            if cgroup.process_count() == 0 || !cgroups.holds_left(&cgroup) {
                return;
            }
            if watch.observe(cgroup.failed_forks()) {
                let _ = tokio::task::spawn_blocking(move || cgroups.reclaim_for_later()).await;
                return;
            }
            // Forks failing at the limit all commands share: the command
            // holding the most processes goes.
            if shared.observe(cgroups.failed_forks()) {
                let cgroup = cgroup.clone();
                let filling = tokio::task::spawn_blocking(move || cgroups.stop_filling(&cgroup)).await;
                match filling {
                    // Stopped, or no longer what that command left: done.
                    Ok(crate::cgroup::Filling::Stopped | crate::cgroup::Filling::Gone) => return,
                    // Not the most, or another pass judging it now: watched on.
                    Ok(crate::cgroup::Filling::NotTheMost | crate::cgroup::Filling::Busy) | Err(_) => {}
                }
            }
        }
    });
}

/// What a command started: its process group and, where the sandbox has
/// them, its own cgroups, which also hold what left the group.
#[derive(Debug)]
struct Tree {
    group: Pid,
    cgroup: Option<Arc<crate::cgroup::ExecCgroup>>,
    /// One kill or hand-back at a time (the timer, the control loop and the
    /// end of the command may each act): once the cgroups are handed back,
    /// they may be the next command's.
    acting: tokio::sync::Mutex<()>,
    /// Set when the command's cgroup waits for its launcher.
    equip: AtomicBool,
    /// The request said no command follows: its cgroup gets no launcher.
    last: bool,
}

impl Tree {
    /// Kills the process group and everything in the command's cgroups.
    async fn kill(&self) {
        let _acting = self.acting.lock().await;
        if self.group.as_raw() > 0 {
            let _ = killpg(self.group, Signal::SIGKILL);
        }
        if let Some(cgroup) = self.cgroup.clone() {
            let _ = tokio::task::spawn_blocking(move || {
                cgroup.kill();
                cgroup.release(false);
            })
            .await;
        }
    }

    /// While the command runs: kills it and everything it started, since
    /// its forks keep failing at the pids limit; returns the report for
    /// its stderr. The cgroup is kept until the command's end hands it back.
    async fn stop_at_limit(&self) -> Option<String> {
        let _acting = self.acting.lock().await;
        let cgroup = self.cgroup.clone()?;
        tokio::task::spawn_blocking(move || cgroup.reached_limit().map(|hit| cgroup.kill_for(&hit)))
            .await
            .ok()
            .flatten()
    }

    /// At the command's timeout: when its cgroup reached a limit, kills
    /// everything in it and returns the report (the cgroup is handed back
    /// by the kill that follows).
    async fn limit_at_timeout(&self) -> Option<String> {
        let _acting = self.acting.lock().await;
        let cgroup = self.cgroup.clone()?;
        tokio::task::spawn_blocking(move || cgroup.kill_reporting_limit()).await.ok().flatten()
    }

    /// Kills everything in the command's cgroup for `hit`, which moat
    /// found (the kernel's counters do not say it), and returns the report.
    async fn stop_with(&self, hit: crate::cgroup::LimitHit) -> Option<String> {
        let _acting = self.acting.lock().await;
        let cgroup = self.cgroup.clone()?;
        tokio::task::spawn_blocking(move || cgroup.kill_for(&hit)).await.ok()
    }

    /// After the command exited on its own: when it reached a pids or
    /// memory limit, kills what is left of it and returns the report;
    /// else hands its cgroup back ([`Tree::finish`]) and says whether it
    /// left processes running. One trip to a blocking thread for all of it.
    async fn end(&self) -> Ended {
        let _acting = self.acting.lock().await;
        let Some(cgroup) = self.cgroup.clone() else { return Ended::Clean };
        let last = self.last;
        let (ended, equip) = tokio::task::spawn_blocking(move || {
            if let Some(hit) = cgroup.reached_limit() {
                let report = cgroup.kill_for(&hit);
                cgroup.release(false);
                return (Ended::Limit(report), false);
            }
            let equip = cgroup.release(!last);
            let ended = if cgroup.process_count() > 0 { Ended::Left } else { Ended::Clean };
            (ended, equip)
        })
        .await
        .unwrap_or((Ended::Clean, false));
        self.equip.store(equip, Ordering::SeqCst);
        ended
    }

    /// Hands the command's cgroups back (background processes keep theirs
    /// until they end).
    async fn finish(&self) {
        let _acting = self.acting.lock().await;
        if let Some(cgroup) = self.cgroup.clone() {
            let last = self.last;
            let equip = tokio::task::spawn_blocking(move || cgroup.release(!last)).await.unwrap_or(false);
            self.equip.store(equip, Ordering::SeqCst);
        }
    }
}

impl Drop for Tree {
    /// A clean command cgroup kept back for its launcher gets it now, once
    /// the command's answer was sent ([`crate::cgroup::ExecCgroup::release`]).
    fn drop(&mut self) {
        if self.equip.load(Ordering::SeqCst)
            && let Some(cgroup) = self.cgroup.clone()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn_blocking(move || cgroup.equip());
        }
    }
}

/// How fast output past a request's `output_limit` is read (to be
/// dropped): a process that floods its output (`yes`) then writes no faster
/// than this, instead of keeping a CPU busy copying bytes nobody keeps,
/// while one that prints a long log and goes on is barely held up.
const DROP_RATE: u64 = 64 << 20;

/// Waits `pause` before the next read of output being dropped: the pace of
/// [`DROP_RATE`] (a rate limit, not a wait for an event).
async fn drain_slowly(pause: Duration) {
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
}

/// Sends output as it comes until the process has exited and its pipes are
/// drained; `Err` when the client stopped listening. Past `limit` bytes of
/// a stream the rest is read at [`DROP_RATE`] and dropped, counted in
/// `dropped`: a command that floods its output costs neither the host's
/// memory nor much of anyone's CPU.
async fn pump_output<S>(
    sink: &mut FrameSink<S>,
    [mut stdout, mut stderr]: [Option<pipe::Receiver>; 2],
    mut exit: oneshot::Receiver<Exit>,
    limit: u64,
    dropped: &mut u64,
) -> Result<Exit, Lost>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut out_buf = BytesMut::new();
    let mut err_buf = BytesMut::new();
    let mut sent = [0u64; 2];
    // The part of `bytes` within the limit of stream `which`; the rest is
    // counted as dropped.
    // The part of `bytes` within the limit of stream `which`, and how long
    // to pause for the rest, which is dropped (counted).
    let mut within = |which: usize, mut bytes: Bytes| {
        let room = usize::try_from(limit.saturating_sub(sent[which])).unwrap_or(usize::MAX);
        let mut pause = Duration::ZERO;
        if bytes.len() > room {
            let cut = (bytes.len() - room) as u64;
            *dropped += cut;
            pause = Duration::from_micros(cut.saturating_mul(1_000_000) / DROP_RATE);
            bytes.truncate(room);
        }
        sent[which] += bytes.len() as u64;
        ((!bytes.is_empty()).then_some(bytes), pause)
    };
    let mut exited: Option<Exit> = None;
    let drain_deadline = tokio::time::sleep(Duration::MAX);
    tokio::pin!(drain_deadline);
    loop {
        if stdout.is_none() && stderr.is_none() {
            match exited {
                Some(exit) => return Ok(exit),
                None => return exit.await.map_err(|_| Lost::Exit),
            }
        }
        // Biased: output already in the pipes goes before the exit and the
        // drain deadline, and each chunk after the exit restarts the grace,
        // so only idle time ends the drain, never a slow client.
        tokio::select! {
            biased;
            chunk = read_chunk(&mut stdout, &mut out_buf), if stdout.is_some() => match chunk {
                Some(bytes) => {
                    let (kept, pause) = within(0, bytes);
                    if let Some(bytes) = kept {
                        sink.send_data(StreamId::Output, bytes).await.map_err(|_| Lost::Client)?;
                    }
                    drain_slowly(pause).await;
                    if exited.is_some() {
                        drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                    }
                }
                None => stdout = None,
            },
            chunk = read_chunk(&mut stderr, &mut err_buf), if stderr.is_some() => match chunk {
                Some(bytes) => {
                    let (kept, pause) = within(1, bytes);
                    if let Some(bytes) = kept {
                        sink.send_data(StreamId::Error, bytes).await.map_err(|_| Lost::Client)?;
                    }
                    drain_slowly(pause).await;
                    if exited.is_some() {
                        drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
                    }
                }
                None => stderr = None,
            },
            status = &mut exit, if exited.is_none() => {
                exited = Some(status.map_err(|_| Lost::Exit)?);
                drain_deadline.as_mut().reset(tokio::time::Instant::now() + DRAIN_GRACE);
            },
            () = &mut drain_deadline, if exited.is_some() => {
                // Descendants still hold the pipes open; stop reading.
                stdout = None;
                stderr = None;
            },
        }
    }
}

/// The next chunk from a pipe, or `None` at end of file. A PTY master reads
/// `EIO` once the last slave is closed: that is its end of file.
async fn read_chunk(pipe: &mut Option<pipe::Receiver>, buf: &mut BytesMut) -> Option<Bytes> {
    let pipe = pipe.as_mut()?;
    buf.reserve(READ_CHUNK);
    match pipe.take(READ_CHUNK as u64).read_buf(buf).await {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(buf.split().freeze()),
    }
}

/// Applies what the client sends while the process runs: stdin data, end of
/// stdin, signals and resizes. A client that disconnects (a cancelled
/// call) kills the command and everything it started, and sets `abandoned`.
async fn control_loop<S>(
    mut stream: FrameStream<S>,
    mut stdin: Option<pipe::Sender>,
    tree: Arc<Tree>,
    abandoned: Arc<AtomicBool>,
    pty: Option<OwnedFd>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let group = tree.group;
    loop {
        let frame = match stream.recv().await {
            Some(Ok(frame)) => frame,
            None | Some(Err(_)) => {
                abandoned.store(true, Ordering::SeqCst);
                tree.kill().await;
                return;
            }
        };
        match frame {
            Frame::Data(StreamId::Input, bytes) => {
                if let Some(pipe) = stdin.as_mut()
                    && pipe.write_all(&bytes).await.is_err()
                {
                    // The process closed its stdin; like a pipe in a shell,
                    // further input is dropped.
                    stdin = None;
                }
            }
            Frame::Data(..) => {}
            Frame::Message(body) => match moat_proto::conn::decode_message::<ClientMsg>(&body) {
                Ok(ClientMsg::End) => {
                    if pty.is_some() {
                        // A terminal has no end of file to close: send ^D.
                        if let Some(pipe) = stdin.as_mut() {
                            let _ = pipe.write_all(&[4]).await;
                        }
                    } else {
                        stdin = None;
                    }
                }
                Ok(ClientMsg::Signal { signal }) => match Signal::try_from(signal) {
                    Ok(signal) => {
                        let _ = killpg(group, signal);
                    }
                    Err(_) => tracing::debug!(signal, "ignoring an unknown signal number"),
                },
                Ok(ClientMsg::Resize { size }) => {
                    if let Some(master) = &pty {
                        resize(master, size);
                    }
                }
                Ok(other) => tracing::debug!(?other, "ignoring an unexpected message during exec"),
                Err(e) => tracing::debug!("ignoring an undecodable message during exec: {e}"),
            },
        }
    }
}

fn resize(master: &OwnedFd, size: WinSize) {
    let ws = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: `master` is an open PTY master for the duration of the call and
    // TIOCSWINSZ only reads the `winsize` we pass by reference.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc < 0 {
        tracing::debug!("resizing the pty failed: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_that_cannot_start_at_the_process_limit_says_so() {
        for what in ["fork", "exec"] {
            let error = not_started("bash", NotStarted { errno: libc::EAGAIN, what: what.into() });
            for words in ["starting bash: the sandbox's process limit is full", "destroy this sandbox"] {
                assert!(error.message.contains(words), "{words:?} missing: {}", error.message);
            }
        }
        let missing = not_started("nope", NotStarted { errno: libc::ENOENT, what: "exec".into() });
        assert!(missing.message.starts_with("command not found: nope"), "{}", missing.message);
    }
}

//! Accepting connections and dispatching each one's operation.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moat_proto::{
    AgentMsg, ClientMsg, Connection, ErrorKind, Frame, FrameError, OPERATIONS, PROTOCOL_VERSION, Reply, Request,
    WireError,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Semaphore;

use crate::egress::EgressHub;
use crate::reaper::Reaper;
use crate::{egress, exec, files, forward, info, tarball};

/// The vsock port the agent listens on by default (and the VMM connects to).
pub const DEFAULT_VSOCK_PORT: u32 = 1024;

/// How long a new connection may take to say hello and send its request.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;

/// Where the agent listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Vsock(u32),
    /// A Unix socket already bound and listening, inherited as this file
    /// descriptor (a jail's monitor binds it outside the sandbox).
    Fd(i32),
}

impl FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let usage = "expected unix:PATH, vsock:PORT (for example vsock:1024) or fd:N";
        match s.split_once(':') {
            Some(("unix", path)) if !path.is_empty() => Ok(Self::Unix(path.into())),
            Some(("fd", fd)) => match fd.parse::<i32>() {
                Ok(fd) if fd >= 3 => Ok(Self::Fd(fd)),
                _ => Err(format!("invalid file descriptor {fd:?}: {usage} with N >= 3")),
            },
            Some(("vsock", port)) => {
                port.parse().map(Self::Vsock).map_err(|_| format!("invalid vsock port {port:?}: {usage}"))
            }
            _ => Err(format!("invalid listen address {s:?}: {usage}")),
        }
    }
}

/// A bound listening socket.
#[derive(Debug)]
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Vsock(tokio_vsock::VsockListener),
}

impl Listener {
    /// Binds `addr`. A vsock bind fails when the machine has no vsock device.
    pub fn bind(addr: &ListenAddr) -> std::io::Result<Self> {
        match addr {
            ListenAddr::Unix(path) => {
                // A socket left by an earlier run would make bind fail.
                let _ = std::fs::remove_file(path);
                Ok(Self::Unix(tokio::net::UnixListener::bind(path)?))
            }
            ListenAddr::Fd(fd) => {
                use std::os::fd::{FromRawFd, OwnedFd};
                // Refuse a descriptor that is not an open socket before owning it.
                // SAFETY: `stat` is plain old data, all-zero is valid; fstat
                // writes only into it and fails with EBADF on a closed fd.
                let mut stat: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                if unsafe { libc::fstat(*fd, &mut stat) } < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                    return Err(std::io::Error::other(format!("file descriptor {fd} is not a socket")));
                }
                // SAFETY: the descriptor was handed to this process to own
                // (nothing else in it uses it), and fstat just showed it is open.
                let owned = unsafe { OwnedFd::from_raw_fd(*fd) };
                let listener = std::os::unix::net::UnixListener::from(owned);
                listener.set_nonblocking(true)?;
                let _ = nix::fcntl::fcntl(&listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
                Ok(Self::Unix(tokio::net::UnixListener::from_std(listener)?))
            }
            ListenAddr::Vsock(port) => {
                let no_device = |why: String| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!(
                            "no vsock device: {why}; the VM needs a virtio-vsock device (moat-vmm's, or vhost-vsock)"
                        ),
                    )
                };
                // With the transport module loaded but no device, binding
                // works and nothing ever connects: ask for our own CID, which
                // stays unassigned without a device.
                match vsock::get_local_cid() {
                    Ok(tokio_vsock::VMADDR_CID_ANY) => {
                        return Err(no_device("the vsock transport has no device (no CID assigned)".into()));
                    }
                    Ok(_) => {}
                    Err(e) => return Err(no_device(format!("cannot ask /dev/vsock for this machine's CID ({e})"))),
                }
                let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, *port);
                tokio_vsock::VsockListener::bind(addr)
                    .map(Self::Vsock)
                    .map_err(|e| no_device(format!("cannot listen on vsock port {port} ({e})")))
            }
        }
    }
}

/// The agent: serves one operation per connection.
#[derive(Debug)]
pub struct Agent {
    reaper: Arc<Reaper>,
    started: Instant,
    init: bool,
    slots: Arc<Semaphore>,
    egress: Arc<EgressHub>,
}

impl Agent {
    /// Starts the reaper; must run inside a tokio runtime.
    pub fn new(init: bool) -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            reaper: Reaper::start()?,
            started: Instant::now(),
            init,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            egress: Arc::default(),
        }))
    }

    pub fn reaper(&self) -> &Arc<Reaper> {
        &self.reaper
    }

    /// Serves connections on `listener` until the process ends.
    pub async fn serve(self: Arc<Self>, listener: Listener) -> std::io::Result<()> {
        if let Some(cgroups) = crate::cgroup::user_cgroups() {
            let reaper = self.reaper.clone();
            tokio::task::spawn_blocking(move || cgroups.prepare(&reaper));
        }
        match listener {
            Listener::Unix(listener) => loop {
                let (stream, _) = listener.accept().await?;
                self.clone().spawn_connection(stream).await;
            },
            Listener::Vsock(listener) => loop {
                let (stream, _) = listener.accept().await?;
                self.clone().spawn_connection(stream).await;
            },
        }
    }

    async fn spawn_connection<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Ok(permit) = self.slots.clone().acquire_owned().await else { return };
        tokio::spawn(async move {
            self.handle(stream).await;
            drop(permit);
        });
    }

    /// Serves the one operation of a connection.
    pub async fn handle<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut conn = Connection::new(stream);
        let request = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut conn)).await {
            Ok(Ok(request)) => request,
            Ok(Err(Some(error))) => {
                tracing::debug!(%error, "refused a connection");
                let _ = conn.send(&AgentMsg::Error { error }).await;
                return;
            }
            Ok(Err(None)) => return,
            Err(_) => {
                let error = WireError::new(
                    ErrorKind::Malformed,
                    "no hello and request within 10 s; send both right after connecting",
                );
                let _ = conn.send(&AgentMsg::Error { error }).await;
                return;
            }
        };
        tracing::debug!(op = request.op(), "request");
        let welcome = AgentMsg::Welcome { version: PROTOCOL_VERSION, agent: agent_name() };
        if conn.send(&welcome).await.is_err() {
            return;
        }
        match request {
            Request::Exec(req) => exec::serve(self.reaper.clone(), req, conn).await,
            Request::PortForward { port } => forward::serve(port, conn).await,
            Request::EgressListen { port } => egress::serve_listen(self.egress.clone(), port, conn).await,
            Request::EgressAttach { id } => egress::serve_attach(&self.egress, id, conn).await,
            Request::ReadFile(req) => {
                let result = files::read(req, &mut conn).await;
                streamed(&mut conn, result).await;
            }
            Request::WriteFile(req) => {
                let result = files::write(req, &mut conn).await;
                streamed(&mut conn, result).await;
            }
            Request::TarOut { path } => {
                let result = tarball::tar_out(&path, &mut conn).await;
                streamed(&mut conn, result).await;
            }
            Request::TarIn { path, owner } => {
                let result = tarball::tar_in(&path, owner.as_deref(), &mut conn).await;
                streamed(&mut conn, result).await;
            }
            Request::Stat { path } => reply(&mut conn, files::stat(&path)).await,
            Request::ListDir { path, depth } => {
                reply(&mut conn, blocking(move || files::list(&path, depth)).await).await
            }
            Request::MakeDir { path, owner } => reply(&mut conn, files::make_dir(&path, owner.as_deref())).await,
            Request::Move { from, to, overwrite } => reply(&mut conn, files::move_path(&from, &to, overwrite)).await,
            Request::Remove { path, recursive } => {
                reply(&mut conn, blocking(move || files::remove(&path, recursive)).await).await;
            }
            Request::Info => reply(&mut conn, Ok(info::info(self.started, self.init))).await,
            Request::Unknown => {
                let error = WireError::new(
                    ErrorKind::UnknownOperation,
                    format!(
                        "this agent ({}) does not know that operation; it supports: {}",
                        agent_name(),
                        OPERATIONS.join(", ")
                    ),
                );
                reply(&mut conn, Err(error)).await;
            }
        }
    }
}

fn agent_name() -> String {
    format!("moat-agent/{}", env!("CARGO_PKG_VERSION"))
}

/// Reads the hello and the request. `Err(None)`: the peer left silently.
async fn handshake<S>(conn: &mut Connection<S>) -> Result<Request, Option<WireError>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match next_client_msg(conn).await? {
        ClientMsg::Hello { version, .. } if version.major == PROTOCOL_VERSION.major => {}
        ClientMsg::Hello { version, client } => {
            return Err(Some(WireError::new(
                ErrorKind::VersionMismatch,
                format!(
                    "{client} speaks protocol {version}, this agent {PROTOCOL_VERSION}; rebuild the image (`cargo xtask image --force`) or the host binaries so they match"
                ),
            )));
        }
        _ => return Err(Some(WireError::new(ErrorKind::Malformed, "the first message must be hello"))),
    }
    match next_client_msg(conn).await? {
        ClientMsg::Request { request } => Ok(request),
        _ => Err(Some(WireError::new(ErrorKind::Malformed, "the second message must be the request"))),
    }
}

async fn next_client_msg<S>(conn: &mut Connection<S>) -> Result<ClientMsg, Option<WireError>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match conn.recv().await {
        None => Err(None),
        Some(Err(FrameError::Io(_))) => Err(None),
        Some(Err(e)) => Err(Some(WireError::new(ErrorKind::Malformed, e.to_string()))),
        Some(Ok(Frame::Data(..))) => {
            Err(Some(WireError::new(ErrorKind::Malformed, "data before the request; send hello and a request first")))
        }
        Some(Ok(Frame::Message(body))) => moat_proto::conn::decode_message(&body)
            .map_err(|e| Some(WireError::new(ErrorKind::Malformed, format!("undecodable message: {e}")))),
    }
}

async fn reply<S>(conn: &mut Connection<S>, result: Result<Reply, WireError>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let msg = match result {
        Ok(reply) => AgentMsg::Reply { reply },
        Err(error) => AgentMsg::Error { error },
    };
    let _ = conn.send(&msg).await;
}

/// Sends the error of a streaming operation, if it failed.
async fn streamed<S>(conn: &mut Connection<S>, result: Result<(), WireError>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if let Err(error) = result {
        let _ = conn.send(&AgentMsg::Error { error }).await;
    }
}

/// Runs a file-system walk off the async threads.
async fn blocking(f: impl FnOnce() -> Result<Reply, WireError> + Send + 'static) -> Result<Reply, WireError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(WireError::new(ErrorKind::Internal, format!("operation failed: {e}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse() {
        assert_eq!("unix:/run/a.sock".parse(), Ok(ListenAddr::Unix("/run/a.sock".into())));
        assert_eq!("vsock:1024".parse(), Ok(ListenAddr::Vsock(1024)));
        assert_eq!("fd:3".parse(), Ok(ListenAddr::Fd(3)));
        for bad in ["", "tcp:1", "unix:", "vsock:x", "vsock:-1", "fd:1", "fd:x"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
    }
}

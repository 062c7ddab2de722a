//! The async client: one method per operation, each on its own connection.

use std::future::Future;
use std::path::PathBuf;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::conn::{Connection, FrameSink, FrameStream, Prefixed, decode_message};
use crate::error::ProtoError;
use crate::frame::{DATA_CHUNK, Frame, StreamId};
use crate::message::{
    AgentInfo, AgentMsg, ClientMsg, ExecRequest, ExitStatus, FileInfo, MAX_LIST_ENTRIES, PROTOCOL_VERSION,
    ReadFileRequest, Reply, Request, WinSize, WriteFileRequest,
};

/// Opens a new byte stream to the agent; one is opened per operation.
pub trait Connector: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn connect(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

/// Connects to an agent through a Unix socket: the agent's own (a jail), or
/// a microVM's vsock socket, where each connection first asks for the
/// agent's vsock port (`CONNECT <port>\n`, answered `OK <host port>\n`:
/// the protocol of Firecracker's vsock device, which moat-vmm speaks).
#[derive(Debug, Clone)]
pub struct UnixConnector {
    pub path: PathBuf,
    /// The guest's vsock port to ask for; `None` for a plain socket.
    pub vsock_port: Option<u32>,
    /// Only a socket served by this process (a host pid) or a child of it
    /// is spoken to ([`served_by`]); `None`: any.
    pub server: Option<u32>,
    /// Counts the connections open through this connector, each until its
    /// stream is dropped; `None`: not counted.
    pub in_use: Option<InUse>,
}

/// How many connections to an agent are open through the connectors that
/// share it: a sandbox's owner counts the calls in flight, which are its
/// use (an idle sandbox is one with none).
#[derive(Debug, Clone, Default)]
pub struct InUse(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl InUse {
    /// The connections open now.
    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn hold(&self) -> Held {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Held(self.clone())
    }
}

/// One counted connection, until dropped.
#[derive(Debug)]
struct Held(InUse);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A stream to an agent through a [`UnixConnector`]: the socket, counted in
/// its connector's [`InUse`] while it is open.
#[derive(Debug)]
pub struct AgentStream {
    socket: tokio::net::UnixStream,
    _held: Option<Held>,
}

impl AsyncRead for AgentStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.socket).poll_read(cx, buf)
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.socket).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.socket).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.socket).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.socket).poll_shutdown(cx)
    }
}

/// Checks that a connection's peer (the process that listened on its
/// socket) is `server` or a child of it. Where the directory of a socket is writable
/// by a process the host does not trust (a jailed VMM's socket
/// directory), that process could swap the socket for a link to another
/// sandbox's: `connect(2)` follows it, so who answers is checked instead.
///
/// `peer` is the pid `SO_PEERCRED` gives for the connection.
pub fn served_by(peer: Option<i32>, path: &std::path::Path, server: u32) -> std::io::Result<()> {
    let peer = peer.and_then(|pid| u32::try_from(pid).ok()).unwrap_or(0);
    if peer == server || parent_of(peer) == Some(server) {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "{} is served by process {peer}, neither the sandbox's ({server}) nor a child of it: the socket was \
             replaced, and is not spoken to; destroy the sandbox",
            path.display()
        ),
    ))
}

/// The parent of process `pid`, from `/proc/PID/stat` (after the command
/// name, in parentheses that it may itself hold: the state, then the
/// parent).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// The largest frame accepted on a connection whose messages are all small
/// (a port forward's or an egress tunnel's, before its bytes flow raw).
pub const SMALL_FRAME_LEN: usize = 64 * 1024;

/// What [`AgentClient::run`] keeps of each output stream when the request
/// sets no `output_limit`: an agent that sends without end (a guest's root
/// may run any agent) holds no more of the host's memory.
pub const RUN_OUTPUT_DEFAULT: u64 = 64 << 20;

/// The longest answer to `CONNECT` accepted (`OK 4294967295\n` is 14 bytes).
const MAX_VSOCK_ANSWER: usize = 32;

impl Connector for UnixConnector {
    type Stream = AgentStream;
    fn connect(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send {
        let (path, port, server) = (self.path.clone(), self.vsock_port, self.server);
        // Counted from the start: a connection being made is a call in flight.
        let held = self.in_use.as_ref().map(InUse::hold);
        async move {
            let mut stream = tokio::net::UnixStream::connect(&path).await?;
            if let Some(server) = server {
                served_by(stream.peer_cred()?.pid(), &path, server)?;
            }
            if let Some(port) = port {
                vsock_handshake(&mut stream, port).await?;
            }
            Ok(AgentStream { socket: stream, _held: held })
        }
    }
}

/// Asks the vsock muxer on `stream` for guest port `port`. Reads the answer
/// a byte at a time so that nothing of the agent's first frame is consumed.
async fn vsock_handshake(stream: &mut tokio::net::UnixStream, port: u32) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(format!("CONNECT {port}\n").as_bytes()).await?;
    let mut answer = Vec::with_capacity(MAX_VSOCK_ANSWER);
    loop {
        let mut byte = [0u8; 1];
        if stream.read(&mut byte).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("the microVM refused vsock port {port}: its agent is not listening (yet)"),
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        answer.push(byte[0]);
        if answer.len() > MAX_VSOCK_ANSWER {
            break;
        }
    }
    match std::str::from_utf8(&answer).ok().and_then(|a| a.strip_prefix("OK ")) {
        Some(host_port) if host_port.parse::<u32>().is_ok() => Ok(()),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "the vsock socket answered {:?} to CONNECT {port}; expected \"OK <port>\"",
                String::from_utf8_lossy(&answer)
            ),
        )),
    }
}

/// A client of one agent.
///
/// ```no_run
/// # async fn demo() -> Result<(), moat_proto::ProtoError> {
/// use moat_proto::{AgentClient, ExecRequest};
/// let agent = AgentClient::unix("/run/moat/agent.sock");
/// let out = agent.run(ExecRequest::shell("echo hello")).await?;
/// assert_eq!(out.stdout, b"hello\n");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct AgentClient<C> {
    connector: C,
}

impl AgentClient<UnixConnector> {
    /// A client of the agent listening on the Unix socket at `path`.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Self::new(UnixConnector { path: path.into(), vsock_port: None, server: None, in_use: None })
    }

    /// This client, its connections counted in `in_use` while open.
    #[must_use]
    pub fn counted(mut self, in_use: InUse) -> Self {
        self.connector.in_use = Some(in_use);
        self
    }

    /// A client of the agent listening on vsock port `port` of the microVM
    /// whose vsock device is bridged to the Unix socket at `path`.
    pub fn vsock(path: impl Into<PathBuf>, port: u32) -> Self {
        Self::new(UnixConnector { path: path.into(), vsock_port: Some(port), server: None, in_use: None })
    }

    /// [`AgentClient::vsock`], spoken to only where `server` (a host pid)
    /// or a child of it serves the socket (see [`served_by`]).
    pub fn vsock_of(path: impl Into<PathBuf>, port: u32, server: u32) -> Self {
        Self::new(UnixConnector { path: path.into(), vsock_port: Some(port), server: Some(server), in_use: None })
    }
}

type Conn<C> = Connection<<C as Connector>::Stream>;

impl<C: Connector> AgentClient<C> {
    pub fn new(connector: C) -> Self {
        Self { connector }
    }

    pub fn connector(&self) -> &C {
        &self.connector
    }

    /// Connects, sends the handshake and the request together, and waits for
    /// the agent's welcome.
    async fn open(&self, request: Request) -> Result<Conn<C>, ProtoError> {
        let stream = self.connector.connect().await.map_err(ProtoError::Connect)?;
        // The connections a sandbox's own traffic opens, up to hundreds at
        // once (egress tunnels, preview connections), carry only small
        // messages before their bytes flow raw: a hostile agent's message
        // that trickles in on each holds no more than this of the host's
        // memory, not a whole frame's 4 MiB.
        let small = matches!(
            request,
            Request::PortForward { .. } | Request::EgressAttach { .. } | Request::EgressListen { .. }
        );
        let mut conn =
            if small { Connection::with_max_frame(stream, SMALL_FRAME_LEN) } else { Connection::new(stream) };
        conn.feed(&ClientMsg::Hello { version: PROTOCOL_VERSION, client: client_name() }).await?;
        conn.send(&ClientMsg::Request { request }).await?;
        match next_msg(&mut conn, "the handshake").await? {
            AgentMsg::Welcome { version, .. } if version.major == PROTOCOL_VERSION.major => Ok(conn),
            AgentMsg::Welcome { version, .. } => {
                Err(ProtoError::VersionMismatch { agent: version, client: PROTOCOL_VERSION })
            }
            AgentMsg::Error { error } => Err(ProtoError::Agent(error)),
            other => Err(unexpected("welcome", &other)),
        }
    }

    /// Sends a request whose answer is one reply.
    async fn call(&self, request: Request) -> Result<Reply, ProtoError> {
        let mut conn = self.open(request).await?;
        expect_reply(&mut conn).await
    }

    /// Starts a process; see [`ExecHandle`] for its streams and exit.
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecHandle, ProtoError> {
        let mut conn = self.open(Request::Exec(request)).await?;
        let pid = match next_msg(&mut conn, "the process started").await? {
            AgentMsg::Started { pid } => pid,
            AgentMsg::Error { error } => return Err(ProtoError::Agent(error)),
            other => return Err(unexpected("started", &other)),
        };
        Ok(ExecHandle::spawn(pid, conn))
    }

    /// Runs a process to completion with stdin closed and collects its
    /// output: at most the request's `output_limit` of each stream
    /// ([`RUN_OUTPUT_DEFAULT`] unset), whatever the agent sends.
    pub async fn run(&self, mut request: ExecRequest) -> Result<Output, ProtoError> {
        request.stdin = false;
        let limit = *request.output_limit.get_or_insert(RUN_OUTPUT_DEFAULT);
        self.exec(request).await?.output_limited(usize::try_from(limit).unwrap_or(usize::MAX)).await
    }

    /// Streams (a range of) a file into `sink`; returns the byte count.
    pub async fn read_file_to<W: AsyncWrite + Unpin>(
        &self,
        request: ReadFileRequest,
        sink: &mut W,
    ) -> Result<u64, ProtoError> {
        let asked = request.length;
        let mut conn = self.open(Request::ReadFile(request)).await?;
        let length = match expect_reply(&mut conn).await? {
            Reply::FileData { length, .. } => length,
            other => return Err(unexpected_reply("file_data", &other)),
        };
        // The agent's word on the length is not trusted beyond what was asked.
        download(&mut conn, sink, Some(asked.map_or(length, |asked| asked.min(length)))).await
    }

    /// Reads (a range of) a file into memory.
    pub async fn read_file(&self, request: ReadFileRequest) -> Result<Vec<u8>, ProtoError> {
        let mut buf = Vec::new();
        self.read_file_to(request, &mut buf).await?;
        Ok(buf)
    }

    /// Writes everything `source` yields to a file, atomically replacing it.
    pub async fn write_file<R: AsyncRead + Unpin>(
        &self,
        request: WriteFileRequest,
        source: &mut R,
    ) -> Result<u64, ProtoError> {
        let mut conn = self.open(Request::WriteFile(request)).await?;
        upload(&mut conn, source).await?;
        match expect_reply(&mut conn).await? {
            Reply::Written { bytes } => Ok(bytes),
            other => Err(unexpected_reply("written", &other)),
        }
    }

    pub async fn stat(&self, path: impl Into<String>) -> Result<FileInfo, ProtoError> {
        match self.call(Request::Stat { path: path.into() }).await? {
            Reply::Stat { info } => Ok(info),
            other => Err(unexpected_reply("stat", &other)),
        }
    }

    /// Lists a directory `depth` levels deep (1–5). The flag is `true` when
    /// the agent cut the listing short.
    /// Lists `path` to `depth`: its entries, and whether they were cut
    /// (at [`MAX_LIST_ENTRIES`], here too: a guest may send more).
    pub async fn list_dir(&self, path: impl Into<String>, depth: u8) -> Result<(Vec<FileInfo>, bool), ProtoError> {
        match self.call(Request::ListDir { path: path.into(), depth }).await? {
            Reply::Entries { mut entries, truncated } => {
                let cut = entries.len() > MAX_LIST_ENTRIES;
                entries.truncate(MAX_LIST_ENTRIES);
                Ok((entries, truncated || cut))
            }
            other => Err(unexpected_reply("entries", &other)),
        }
    }

    /// `mkdir -p`, optionally handing new directories to `owner`.
    pub async fn make_dir(&self, path: impl Into<String>, owner: Option<String>) -> Result<(), ProtoError> {
        self.expect_done(Request::MakeDir { path: path.into(), owner }).await
    }

    pub async fn move_path(
        &self,
        from: impl Into<String>,
        to: impl Into<String>,
        overwrite: bool,
    ) -> Result<(), ProtoError> {
        self.expect_done(Request::Move { from: from.into(), to: to.into(), overwrite }).await
    }

    pub async fn remove(&self, path: impl Into<String>, recursive: bool) -> Result<(), ProtoError> {
        self.expect_done(Request::Remove { path: path.into(), recursive }).await
    }

    async fn expect_done(&self, request: Request) -> Result<(), ProtoError> {
        match self.call(request).await? {
            Reply::Done => Ok(()),
            other => Err(unexpected_reply("done", &other)),
        }
    }

    /// Streams a tar archive of the tree at `path` into `sink`; returns its size.
    pub async fn tar_out<W: AsyncWrite + Unpin>(
        &self,
        path: impl Into<String>,
        sink: &mut W,
    ) -> Result<u64, ProtoError> {
        let mut conn = self.open(Request::TarOut { path: path.into() }).await?;
        match expect_reply(&mut conn).await? {
            Reply::TarStream => {}
            other => return Err(unexpected_reply("tar_stream", &other)),
        }
        download(&mut conn, sink, None).await
    }

    /// Unpacks the tar archive `source` yields into the directory `path`;
    /// returns the number of entries unpacked.
    pub async fn tar_in<R: AsyncRead + Unpin>(
        &self,
        path: impl Into<String>,
        owner: Option<String>,
        source: &mut R,
    ) -> Result<u64, ProtoError> {
        let mut conn = self.open(Request::TarIn { path: path.into(), owner }).await?;
        upload(&mut conn, source).await?;
        match expect_reply(&mut conn).await? {
            Reply::Unpacked { entries, .. } => Ok(entries),
            other => Err(unexpected_reply("unpacked", &other)),
        }
    }

    /// A raw byte stream to 127.0.0.1:`port` inside the sandbox.
    pub async fn port_forward(&self, port: u16) -> Result<Prefixed<C::Stream>, ProtoError> {
        let mut conn = self.open(Request::PortForward { port }).await?;
        match expect_reply(&mut conn).await? {
            Reply::Connected => Ok(conn.into_raw()),
            other => Err(unexpected_reply("connected", &other)),
        }
    }

    /// Starts the egress proxy on 127.0.0.1:`port` inside the sandbox; it
    /// runs while the returned control connection stays open.
    pub async fn egress_listen(&self, port: u16) -> Result<EgressControl<C::Stream>, ProtoError> {
        let mut conn = self.open(Request::EgressListen { port }).await?;
        match expect_reply(&mut conn).await? {
            Reply::Listening { .. } => Ok(EgressControl { conn }),
            other => Err(unexpected_reply("listening", &other)),
        }
    }

    /// Takes on the tunnel of proxy client `id`: the returned stream is
    /// spliced to that client (after the agent told it the tunnel is up).
    pub async fn egress_attach(&self, id: u64) -> Result<Prefixed<C::Stream>, ProtoError> {
        let mut conn = self.open(Request::EgressAttach { id }).await?;
        match expect_reply(&mut conn).await? {
            Reply::Connected => Ok(conn.into_raw()),
            other => Err(unexpected_reply("connected", &other)),
        }
    }

    pub async fn info(&self) -> Result<AgentInfo, ProtoError> {
        match self.call(Request::Info).await? {
            Reply::Info { info } => Ok(info),
            other => Err(unexpected_reply("info", &other)),
        }
    }
}

/// One proxy client's wish, from the agent's egress proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRequest {
    /// Names the client in `deny` and `egress_attach`.
    pub id: u64,
    /// The host name (or address literal) the client asked for.
    pub host: String,
    pub port: u16,
}

/// The control connection of a running egress proxy; dropping it stops
/// the proxy.
#[derive(Debug)]
pub struct EgressControl<S> {
    conn: Connection<S>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> EgressControl<S> {
    /// The next request, or `None` when the agent closed the connection.
    /// Cancel-safe: usable in `select!`.
    pub async fn next_request(&mut self) -> Option<Result<EgressRequest, ProtoError>> {
        let frame = match self.conn.recv().await? {
            Ok(frame) => frame,
            Err(e) => return Some(Err(e.into())),
        };
        Some(match frame {
            Frame::Message(body) => match decode(&body) {
                Ok(AgentMsg::EgressRequest { id, host, port }) => Ok(EgressRequest { id, host, port }),
                Ok(AgentMsg::Error { error }) => Err(ProtoError::Agent(error)),
                Ok(other) => Err(unexpected("egress_request", &other)),
                Err(e) => Err(e),
            },
            Frame::Data(stream, _) => {
                Err(ProtoError::Unexpected { expected: "egress_request", got: format!("data on stream {stream:?}") })
            }
        })
    }

    /// Refuses client `id`; the agent answers it HTTP 403 with `reason`.
    pub async fn deny(&mut self, id: u64, reason: String) -> Result<(), ProtoError> {
        self.conn.send(&ClientMsg::EgressDeny { id, reason }).await.map_err(Into::into)
    }
}

fn client_name() -> String {
    format!("moat-proto/{}", env!("CARGO_PKG_VERSION"))
}

/// The next message; data frames and a closed connection are errors here.
async fn next_msg<S>(conn: &mut Connection<S>, waiting_for: &'static str) -> Result<AgentMsg, ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match conn.recv().await {
        None => Err(ProtoError::Closed(closed_while(waiting_for))),
        Some(Err(e)) => Err(e.into()),
        Some(Ok(Frame::Message(body))) => decode(&body),
        Some(Ok(Frame::Data(stream, _))) => {
            Err(ProtoError::Unexpected { expected: waiting_for, got: format!("data on stream {stream:?}") })
        }
    }
}

fn closed_while(waiting_for: &'static str) -> &'static str {
    match waiting_for {
        "the handshake" => "during the handshake (is it a moat agent?)",
        "the process started" => "before the process started",
        _ => "before answering",
    }
}

fn decode(body: &[u8]) -> Result<AgentMsg, ProtoError> {
    decode_message(body).map_err(|e| ProtoError::Malformed(e.to_string()))
}

async fn expect_reply<S>(conn: &mut Connection<S>) -> Result<Reply, ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match next_msg(conn, "a reply").await? {
        AgentMsg::Reply { reply } => Ok(reply),
        AgentMsg::Error { error } => Err(ProtoError::Agent(error)),
        other => Err(unexpected("reply", &other)),
    }
}

fn unexpected(expected: &'static str, got: &AgentMsg) -> ProtoError {
    ProtoError::Unexpected { expected, got: format!("{got:?}") }
}

fn unexpected_reply(expected: &'static str, got: &Reply) -> ProtoError {
    ProtoError::Unexpected { expected, got: format!("{got:?}") }
}

/// Copies output data frames into `sink` until `End`; more than `max`
/// bytes (the length the agent announced) is a protocol error.
async fn download<S, W>(conn: &mut Connection<S>, sink: &mut W, max: Option<u64>) -> Result<u64, ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    loop {
        match conn.recv().await {
            None => return Err(ProtoError::Closed("in the middle of a download")),
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(Frame::Data(StreamId::Output, bytes))) => {
                total += bytes.len() as u64;
                if max.is_some_and(|max| total > max) {
                    return Err(ProtoError::Unexpected {
                        expected: "no more data than announced",
                        got: format!("more than {} bytes", max.unwrap_or_default()),
                    });
                }
                sink.write_all(&bytes).await?;
            }
            Some(Ok(Frame::Data(stream, _))) => {
                return Err(ProtoError::Unexpected { expected: "output data", got: format!("data on {stream:?}") });
            }
            Some(Ok(Frame::Message(body))) => match decode(&body)? {
                AgentMsg::End => break,
                AgentMsg::Error { error } => return Err(ProtoError::Agent(error)),
                other => return Err(unexpected("data or end", &other)),
            },
        }
    }
    sink.flush().await?;
    Ok(total)
}

/// Sends everything `source` yields as input data frames, then `End`. When
/// the agent gives up early (it refused the upload), its error is returned
/// rather than the broken pipe.
async fn upload<S, R>(conn: &mut Connection<S>, source: &mut R) -> Result<(), ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
{
    let result = async {
        let mut buf = BytesMut::with_capacity(DATA_CHUNK);
        loop {
            buf.reserve(DATA_CHUNK);
            let n = (&mut *source).take(DATA_CHUNK as u64).read_buf(&mut buf).await?;
            if n == 0 {
                break;
            }
            conn.send_data(StreamId::Input, buf.split().freeze()).await?;
        }
        conn.send(&ClientMsg::End).await?;
        Ok::<(), ProtoError>(())
    }
    .await;
    match result {
        Ok(()) => Ok(()),
        Err(ProtoError::Io(_) | ProtoError::Frame(_)) => match next_msg(conn, "a reply").await {
            Ok(AgentMsg::Error { error }) => Err(ProtoError::Agent(error)),
            _ => result,
        },
        Err(e) => Err(e),
    }
}

/// Everything a finished process produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
    /// Output beyond the collection limit was dropped.
    pub truncated: bool,
}

enum Control {
    Stdin(Bytes),
    End,
    Signal(i32),
    Resize(WinSize),
}

/// A running process.
///
/// Its stdout and stderr arrive as chunks on the receivers from
/// [`take_stdout`](Self::take_stdout) and [`take_stderr`](Self::take_stderr)
/// as the process produces them. Unread output back-pressures the process
/// (it blocks on a full pipe); output whose receiver was never taken or was
/// dropped is discarded. Dropping the handle kills the process group.
#[derive(Debug)]
pub struct ExecHandle {
    pid: u32,
    stdin: Option<ExecStdin>,
    stdout: Option<mpsc::Receiver<Bytes>>,
    stderr: Option<mpsc::Receiver<Bytes>>,
    control: mpsc::Sender<Control>,
    exit: Option<oneshot::Receiver<Result<ExitStatus, ProtoError>>>,
    tasks: [JoinHandle<()>; 2],
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdin(b) => write!(f, "Stdin({} bytes)", b.len()),
            Self::End => f.write_str("End"),
            Self::Signal(s) => write!(f, "Signal({s})"),
            Self::Resize(w) => write!(f, "Resize({w:?})"),
        }
    }
}

impl ExecHandle {
    fn spawn<S>(pid: u32, conn: Connection<S>) -> Self
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sink, stream) = conn.split();
        let (control_tx, control_rx) = mpsc::channel(16);
        let (stdout_tx, stdout_rx) = mpsc::channel(16);
        let (stderr_tx, stderr_rx) = mpsc::channel(16);
        let (exit_tx, exit_rx) = oneshot::channel();
        let writer = tokio::spawn(write_controls(sink, control_rx));
        let reader = tokio::spawn(async move {
            let result = read_outputs(stream, Some(stdout_tx), Some(stderr_tx)).await;
            let _ = exit_tx.send(result);
        });
        Self {
            pid,
            stdin: Some(ExecStdin { control: control_tx.clone(), closed: false }),
            stdout: Some(stdout_rx),
            stderr: Some(stderr_rx),
            control: control_tx,
            exit: Some(exit_rx),
            tasks: [writer, reader],
        }
    }

    /// The process id inside the sandbox.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process's stdin, when the request asked for `stdin: true`.
    /// Dropping it (or [`ExecStdin::close`]) ends the input.
    pub fn take_stdin(&mut self) -> Option<ExecStdin> {
        self.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<mpsc::Receiver<Bytes>> {
        self.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<mpsc::Receiver<Bytes>> {
        self.stderr.take()
    }

    /// Sends `signal` to the process group.
    pub async fn signal(&self, signal: i32) -> Result<(), ProtoError> {
        self.control.send(Control::Signal(signal)).await.map_err(|_| ProtoError::Closed("after the process ended"))
    }

    /// Resizes the PTY (no effect without one).
    pub async fn resize(&self, size: WinSize) -> Result<(), ProtoError> {
        self.control.send(Control::Resize(size)).await.map_err(|_| ProtoError::Closed("after the process ended"))
    }

    /// Waits for the process to exit. Output not taken is discarded.
    pub async fn wait(mut self) -> Result<ExitStatus, ProtoError> {
        self.stdout = None;
        self.stderr = None;
        drop(self.stdin.take());
        let exit = self.exit.take().ok_or(ProtoError::Closed("twice"))?;
        exit.await.unwrap_or(Err(ProtoError::Closed("before the process exited")))
    }

    /// Closes stdin (unless taken), collects all output and waits for exit.
    /// Memory grows with the output: see [`output_limited`](Self::output_limited).
    pub async fn output(self) -> Result<Output, ProtoError> {
        self.output_limited(usize::MAX).await
    }

    /// Like [`output`](Self::output), keeping at most `limit` bytes of each
    /// stream (the rest is read and dropped; `truncated` says so).
    pub async fn output_limited(mut self, limit: usize) -> Result<Output, ProtoError> {
        let stdout = collect(self.stdout.take(), limit);
        let stderr = collect(self.stderr.take(), limit);
        let ((stdout, cut_out), (stderr, cut_err)) = tokio::join!(stdout, stderr);
        let status = self.wait().await?;
        Ok(Output { stdout, stderr, status, truncated: cut_out || cut_err || status.dropped_bytes > 0 })
    }
}

impl Drop for ExecHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn collect(rx: Option<mpsc::Receiver<Bytes>>, limit: usize) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut truncated = false;
    if let Some(mut rx) = rx {
        while let Some(chunk) = rx.recv().await {
            let room = limit.saturating_sub(out.len());
            truncated |= chunk.len() > room;
            out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        }
    }
    (out, truncated)
}

async fn write_controls<S>(mut sink: FrameSink<S>, mut control: mpsc::Receiver<Control>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    while let Some(msg) = control.recv().await {
        let sent = match msg {
            Control::Stdin(bytes) => sink.send_data(StreamId::Input, bytes).await,
            Control::End => sink.send(&ClientMsg::End).await,
            Control::Signal(signal) => sink.send(&ClientMsg::Signal { signal }).await,
            Control::Resize(size) => sink.send(&ClientMsg::Resize { size }).await,
        };
        if sent.is_err() {
            // The reader half sees the same failure and reports it.
            break;
        }
    }
}

async fn read_outputs<S>(
    mut stream: FrameStream<S>,
    mut stdout: Option<mpsc::Sender<Bytes>>,
    mut stderr: Option<mpsc::Sender<Bytes>>,
) -> Result<ExitStatus, ProtoError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let frame = match stream.recv().await {
            None => return Err(ProtoError::Closed("before the process exited")),
            Some(frame) => frame?,
        };
        match frame {
            Frame::Data(StreamId::Output, bytes) => forward(&mut stdout, bytes).await,
            Frame::Data(StreamId::Error, bytes) => forward(&mut stderr, bytes).await,
            Frame::Data(StreamId::Input, _) => {
                return Err(ProtoError::Unexpected { expected: "output data", got: "input data".into() });
            }
            Frame::Message(body) => match decode(&body)? {
                AgentMsg::Exited { status } => return Ok(status),
                AgentMsg::Error { error } => return Err(ProtoError::Agent(error)),
                other => return Err(unexpected("output or exit", &other)),
            },
        }
    }
}

async fn forward(tx: &mut Option<mpsc::Sender<Bytes>>, bytes: Bytes) {
    if let Some(sender) = tx
        && sender.send(bytes).await.is_err()
    {
        *tx = None;
    }
}

/// The stdin of a running process.
#[derive(Debug)]
pub struct ExecStdin {
    control: mpsc::Sender<Control>,
    closed: bool,
}

impl ExecStdin {
    /// Sends bytes to the process; waits while the process is not reading.
    pub async fn write(&mut self, mut bytes: Bytes) -> Result<(), ProtoError> {
        while !bytes.is_empty() {
            let chunk = bytes.split_to(bytes.len().min(DATA_CHUNK));
            self.control.send(Control::Stdin(chunk)).await.map_err(|_| ProtoError::Closed("stdin: process ended"))?;
        }
        Ok(())
    }

    /// Ends the input (the process reads end-of-file).
    pub async fn close(mut self) -> Result<(), ProtoError> {
        self.closed = true;
        self.control.send(Control::End).await.map_err(|_| ProtoError::Closed("stdin: process ended"))
    }
}

impl Drop for ExecStdin {
    fn drop(&mut self) {
        if !self.closed {
            let control = self.control.clone();
            if let Err(mpsc::error::TrySendError::Full(_)) = control.try_send(Control::End)
                && let Ok(rt) = tokio::runtime::Handle::try_current()
            {
                rt.spawn(async move {
                    let _ = control.send(Control::End).await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::message::FileKind;

    /// A muxer that expects `CONNECT 1024`, answers `answer` and then sends
    /// `then` right behind it, as an agent's first bytes would be.
    async fn muxer(answer: &'static [u8], then: &'static [u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vsock.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut request = [0u8; 13];
            stream.read_exact(&mut request).await.expect("request");
            assert_eq!(&request, b"CONNECT 1024\n");
            stream.write_all(answer).await.expect("answer");
            stream.write_all(then).await.expect("then");
        });
        (dir, path)
    }

    #[tokio::test]
    async fn only_the_named_server_or_its_child_is_spoken_to() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("vsock.sock");
        let _listener = tokio::net::UnixListener::bind(&path).expect("binds");
        let me = std::process::id();
        let connector =
            |server| UnixConnector { path: path.clone(), vsock_port: None, server: Some(server), in_use: None };
        connector(me).connect().await.expect("served by this process");
        let parent = parent_of(me).expect("a parent");
        connector(parent).connect().await.expect("served by a child of the named process");
        let err = connector(u32::MAX).connect().await.expect_err("served by another");
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("was replaced"), "{err}");
    }

    /// A counted connection is use from its connect to its drop, a failed
    /// connect none once it has failed; an uncounted client counts nothing.
    #[tokio::test]
    async fn counted_connections_are_use_while_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let _listener = tokio::net::UnixListener::bind(&path).expect("binds");
        let in_use = InUse::default();
        let client = AgentClient::unix(&path).counted(in_use.clone());
        let first = client.connector().connect().await.expect("connects");
        let second = client.connector().connect().await.expect("connects");
        assert_eq!(in_use.count(), 2);
        drop(first);
        assert_eq!(in_use.count(), 1);
        drop(second);
        assert_eq!(in_use.count(), 0);
        AgentClient::unix(&path).connector().connect().await.expect("connects");
        AgentClient::unix(dir.path().join("none"))
            .counted(in_use.clone())
            .connector()
            .connect()
            .await
            .expect_err("no socket");
        assert_eq!(in_use.count(), 0);
    }

    #[tokio::test]
    async fn vsock_connect_leaves_the_agents_bytes_unread() {
        let (_dir, path) = muxer(b"OK 1073741824\n", b"agent").await;
        let connector = UnixConnector { path, vsock_port: Some(1024), server: None, in_use: None };
        let mut stream = connector.connect().await.expect("connects");
        let mut first = [0u8; 5];
        stream.read_exact(&mut first).await.expect("agent bytes");
        assert_eq!(&first, b"agent");
    }

    /// A lying agent's socket: it greets the first connection, answers its
    /// request with `reply`, sends `chunks` KiB of output and ends.
    fn liar(dir: &tempfile::TempDir, reply: Reply, chunks: usize) -> PathBuf {
        let path = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.expect("accept");
            let mut conn = Connection::new(stream);
            for _ in 0..2 {
                let _ = conn.recv().await;
            }
            let welcome = AgentMsg::Welcome { version: PROTOCOL_VERSION, agent: "liar".into() };
            conn.send(&welcome).await.expect("welcome");
            conn.send(&AgentMsg::Reply { reply }).await.expect("reply");
            for _ in 0..chunks {
                conn.send_data(StreamId::Output, Bytes::from_static(&[7; 1024])).await.expect("data");
            }
            conn.send(&AgentMsg::End).await.expect("end");
        });
        path
    }

    /// An agent that announces a file of 1 GiB and sends more than was asked.
    #[tokio::test]
    async fn a_read_takes_no_more_than_it_asked_for_whatever_the_agent_announces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = liar(&dir, Reply::FileData { size: 1 << 30, length: 1 << 30 }, 4);
        let client = AgentClient::new(UnixConnector { path, vsock_port: None, server: None, in_use: None });
        let request = ReadFileRequest { path: "/big".into(), offset: 0, length: Some(1500) };
        let err = client.read_file(request).await.expect_err("more than asked");
        assert!(err.to_string().contains("more than 1500 bytes"), "{err}");
    }

    /// An agent that lists more entries than a listing carries.
    #[tokio::test]
    async fn a_listing_keeps_no_more_entries_than_a_listing_carries() {
        let entry = FileInfo {
            name: String::new(),
            path: String::new(),
            kind: FileKind::File,
            size: 0,
            mode: 0,
            uid: 0,
            gid: 0,
            mtime: 0,
            link_target: None,
            lossy_name: false,
        };
        let entries = vec![entry; MAX_LIST_ENTRIES + 5];
        let dir = tempfile::tempdir().expect("tempdir");
        let path = liar(&dir, Reply::Entries { entries, truncated: false }, 0);
        let client = AgentClient::new(UnixConnector { path, vsock_port: None, server: None, in_use: None });
        let (entries, truncated) = client.list_dir("/", 1).await.expect("a listing");
        assert_eq!(entries.len(), MAX_LIST_ENTRIES);
        assert!(truncated, "said to be cut");
    }

    /// An agent that answers a tunnel's or a port forward's opening with
    /// the head of a message frame of 1 MiB, then trickles it: refused at
    /// the head, not buffered (each of hundreds of tunnels held 4 MiB so).
    #[tokio::test]
    async fn a_tunnels_opening_holds_no_large_message() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut conn = Connection::new(stream);
                    for _ in 0..2 {
                        let _ = conn.recv().await;
                    }
                    let welcome = AgentMsg::Welcome { version: PROTOCOL_VERSION, agent: "liar".into() };
                    conn.send(&welcome).await.expect("welcome");
                    let mut raw = conn.into_raw();
                    raw.write_all(&[0, 0x10, 0, 0, 0x01, b'{']).await.expect("a head of 1 MiB");
                    std::future::pending::<()>().await;
                });
            }
        });
        let client = AgentClient::unix(&path);
        let guard = std::time::Duration::from_secs(30);
        let attach = tokio::time::timeout(guard, client.egress_attach(1)).await.expect("refused, not waited on");
        let err = attach.expect_err("too large");
        assert!(
            matches!(err, ProtoError::Frame(crate::frame::FrameError::TooLarge { max: SMALL_FRAME_LEN, .. })),
            "the small limit: {err:?}"
        );
        let forward = tokio::time::timeout(guard, client.port_forward(80)).await.expect("refused, not waited on");
        assert!(forward.is_err());
    }

    #[tokio::test]
    async fn vsock_refusals_say_what_happened() {
        let (_dir, path) = muxer(b"", b"").await;
        let err = UnixConnector { path, vsock_port: Some(1024), server: None, in_use: None }
            .connect()
            .await
            .expect_err("closed");
        assert!(err.to_string().contains("not listening"), "{err}");
        let (_dir, path) = muxer(b"NO\n", b"").await;
        let err = UnixConnector { path, vsock_port: Some(1024), server: None, in_use: None }
            .connect()
            .await
            .expect_err("garbage");
        assert!(err.to_string().contains("expected \"OK <port>\""), "{err}");
    }
}

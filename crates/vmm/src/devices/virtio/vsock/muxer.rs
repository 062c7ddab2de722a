//! The host side of virtio-vsock: guest stream connections bridged to Unix
//! sockets, speaking Firecracker's protocol.
//!
//! - A host process connects to the VM's socket (`uds_path`) and sends
//!   `CONNECT <port>\n`; the muxer asks the guest (REQUEST to that port)
//!   and answers `OK <host port>\n` when the guest accepts, or closes the
//!   socket when it refuses (RST).
//! - A guest connection to host port P is connected to `<uds_path>_P`;
//!   RST when nothing listens there.
//!
//! Flow control is virtio's credit scheme both ways. Towards the host, the
//! muxer advertises `BUF_ALLOC` bytes per connection and buffers at most
//! that much for a host reader that is not keeping up: the guest runs out
//! of credit and waits, and a guest that ignores its credit is reset.
//! Towards the guest, the muxer reads from a host socket only as far as the
//! guest's credit goes, so a guest that does not read leaves the data in
//! the host socket and its writer blocks. At most `MAX_CONNECTIONS`
//! connections (including host ones still sending their CONNECT line)
//! exist at a time; beyond that host connections are closed at once and
//! guest requests are reset.
//!
//! Everything runs on the VMM thread, driven by the muxer's own epoll
//! descriptor (polled by the VMM loop) and by the device's queues.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::packet::*;

/// Bytes the muxer buffers per connection towards the host (the credit it
/// gives the guest).
pub const BUF_ALLOC: u32 = 256 * 1024;
/// The largest payload of one packet either way.
pub const MAX_PKT_PAYLOAD: usize = 64 * 1024;
/// Connections at once, host-initiated and guest-initiated together.
pub const MAX_CONNECTIONS: usize = 256;
/// The longest `CONNECT <port>\n` line accepted.
const MAX_CONNECT_LINE: usize = 32;
/// Control packets waiting for guest RX buffers, at most; beyond it (a
/// guest that never reads) they are dropped.
const MAX_CONTROL_BACKLOG: usize = 4 * MAX_CONNECTIONS;
/// Host-side port numbers of host-initiated connections start here, above
/// the ports guests usually listen on (as Firecracker does).
const LOCAL_PORT_START: u32 = 1 << 30;

const LISTENER_TOKEN: u64 = 0;

/// (host-side port, guest port).
type Key = (u32, u32);

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    token: u64,
    /// False while a host-initiated connection waits for the guest's RESPONSE.
    established: bool,
    /// Guest bytes not yet written to the host socket.
    tx_buf: VecDeque<u8>,
    /// Guest bytes written to the host socket, and the count last told.
    fwd_cnt: u32,
    last_fwd_sent: u32,
    /// Bytes sent to the guest, and the guest's receive window.
    rx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The host will send no more (read returned 0).
    host_eof: bool,
    /// The host socket hung up: it is out of epoll, read to its end.
    hup: bool,
    /// In the muxer's `readable` list.
    queued: bool,
    /// The guest will send no more.
    guest_done_sending: bool,
    /// The guest closed the connection: it ends once `tx_buf` is written
    /// to the host (what the guest sent last must not be lost to a host
    /// that reads slower than the guest wrote).
    guest_closed: bool,
    /// The epoll interest registered (0: not registered).
    events: u32,
}

impl Conn {
    fn new(stream: UnixStream, token: u64, established: bool, peer: &Header) -> Self {
        Self {
            stream,
            token,
            established,
            tx_buf: VecDeque::new(),
            fwd_cnt: 0,
            last_fwd_sent: 0,
            rx_cnt: 0,
            peer_buf_alloc: peer.buf_alloc,
            peer_fwd_cnt: peer.fwd_cnt,
            host_eof: false,
            hup: false,
            queued: false,
            guest_done_sending: false,
            guest_closed: false,
            events: 0,
        }
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc.saturating_sub(self.rx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    fn wanted_events(&self) -> u32 {
        if self.hup {
            return 0;
        }
        let mut events = 0;
        if self.established && !self.host_eof && !self.guest_closed && !self.queued && self.peer_credit() > 0 {
            events |= EventSet::IN.bits();
        }
        if !self.tx_buf.is_empty() {
            events |= EventSet::OUT.bits();
        }
        events
    }

    /// Writes buffered guest bytes to the host; `Err` when the host is gone.
    fn flush(&mut self) -> std::io::Result<()> {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(u32::try_from(n).unwrap_or(0));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.tx_buf.is_empty() && self.guest_done_sending {
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }
}

/// A host connection that has not sent its `CONNECT` line yet.
#[derive(Debug)]
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
}

/// The vsock connection multiplexer of one VM.
#[derive(Debug)]
pub struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    /// The host ports the guest may connect to; `None`: any.
    host_ports: Option<Vec<u32>>,
    listener: UnixListener,
    epoll: Epoll,
    conns: HashMap<Key, Conn>,
    by_token: HashMap<u64, Key>,
    pending: HashMap<u64, Pending>,
    /// Packets without payload waiting for guest RX buffers.
    control: VecDeque<Header>,
    /// Connections whose host socket may have bytes for the guest.
    readable: VecDeque<Key>,
    next_token: u64,
    next_local_port: u32,
}

impl VsockMuxer {
    /// Listens on `uds_path` (a stale socket file there is replaced) for the
    /// VM whose context id is `guest_cid`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        if std::fs::symlink_metadata(uds_path).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        }) {
            std::fs::remove_file(uds_path)?;
        }
        let listener = UnixListener::bind(uds_path)?;
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.ctl(ControlOperation::Add, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, LISTENER_TOKEN))?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.into(),
            host_ports: None,
            listener,
            epoll,
            conns: HashMap::new(),
            by_token: HashMap::new(),
            pending: HashMap::new(),
            control: VecDeque::new(),
            readable: VecDeque::new(),
            next_token: LISTENER_TOKEN + 1,
            next_local_port: LOCAL_PORT_START,
        })
    }

    /// Lets the guest connect only to `ports` on the host (`None`: any);
    /// a connection to another port is reset without touching the host.
    pub fn limit_host_ports(&mut self, ports: Option<Vec<u32>>) {
        self.host_ports = ports;
    }

    /// The descriptor the VMM loop polls.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Connections open (or being opened).
    pub fn connections(&self) -> usize {
        self.conns.len() + self.pending.len()
    }

    /// Whether a packet may be ready for the guest.
    pub fn has_rx(&self) -> bool {
        !self.control.is_empty() || !self.readable.is_empty()
    }

    /// The driver reset the device: every connection ends.
    pub fn reset(&mut self) {
        for (_, conn) in self.conns.drain() {
            let _ = self.epoll.ctl(ControlOperation::Delete, conn.stream.as_raw_fd(), EpollEvent::default());
        }
        self.by_token.clear();
        self.control.clear();
        self.readable.clear();
    }

    fn header(&self, key: Key, op: u16) -> Header {
        let conn = self.conns.get(&key);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.0,
            dst_port: key.1,
            len: 0,
            kind: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: conn.map_or(0, |c| c.fwd_cnt),
        }
    }

    fn push_control(&mut self, header: Header) {
        if self.control.len() >= MAX_CONTROL_BACKLOG {
            crate::guest_triggered!(
                warn,
                "vsock: the guest is not taking packets; dropping a {} to port {}",
                header.op,
                header.dst_port
            );
            return;
        }
        if let Some(conn) = self.conns.get_mut(&(header.src_port, header.dst_port)) {
            conn.last_fwd_sent = header.fwd_cnt;
        }
        self.control.push_back(header);
    }

    fn remove(&mut self, key: Key) {
        if let Some(conn) = self.conns.remove(&key) {
            if conn.events != 0 {
                let _ = self.epoll.ctl(ControlOperation::Delete, conn.stream.as_raw_fd(), EpollEvent::default());
            }
            self.by_token.remove(&conn.token);
        }
    }

    /// Resets connection `key`: the guest gets an RST, the host socket closes.
    fn reset_conn(&mut self, key: Key) {
        if self.conns.contains_key(&key) {
            let rst = self.header(key, OP_RST);
            self.remove(key);
            self.push_control(rst);
        }
    }

    /// Brings the epoll interest of `key` in line with its state.
    fn sync(&mut self, key: Key) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if conn.hup && !conn.queued && !conn.host_eof && conn.peer_credit() > 0 {
            // Out of epoll: read to the end by the RX path.
            conn.queued = true;
            self.readable.push_back(key);
        }
        let want = conn.wanted_events();
        if want == conn.events {
            return;
        }
        let fd = conn.stream.as_raw_fd();
        let event = EpollEvent::new(EventSet::from_bits_truncate(want), conn.token);
        let result = match (conn.events, want) {
            (0, _) => self.epoll.ctl(ControlOperation::Add, fd, event),
            (_, 0) => self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default()),
            _ => self.epoll.ctl(ControlOperation::Modify, fd, event),
        };
        match result {
            Ok(()) => conn.events = want,
            Err(e) => {
                crate::guest_triggered!(warn, "vsock: cannot watch a host socket ({e}); resetting its connection");
                self.reset_conn(key);
            }
        }
    }

    /// Tells the guest about freed buffer space once half of it is free
    /// again, so a guest out of credit always hears back.
    fn maybe_credit_update(&mut self, key: Key) {
        let Some(conn) = self.conns.get(&key) else { return };
        if conn.fwd_cnt.wrapping_sub(conn.last_fwd_sent) >= BUF_ALLOC / 2 {
            let update = self.header(key, OP_CREDIT_UPDATE);
            self.push_control(update);
        }
    }

    /// Handles a packet the guest sent.
    pub fn from_guest(&mut self, hdr: &Header, payload: &[u8]) {
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID || hdr.kind != TYPE_STREAM {
            if hdr.op != OP_RST {
                self.push_control(Header { src_cid: HOST_CID, dst_cid: self.guest_cid, ..hdr.reset_reply() });
            }
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        match hdr.op {
            OP_REQUEST => self.guest_connect(key, hdr),
            OP_RST => self.remove(key),
            op => {
                let Some(conn) = self.conns.get_mut(&key) else {
                    self.push_control(hdr.reset_reply());
                    return;
                };
                conn.peer_buf_alloc = hdr.buf_alloc;
                conn.peer_fwd_cnt = hdr.fwd_cnt;
                match op {
                    OP_RESPONSE if !conn.established => {
                        conn.established = true;
                        let ok = format!("OK {}\n", key.0);
                        if conn.stream.write_all(ok.as_bytes()).is_err() {
                            self.reset_conn(key);
                            return;
                        }
                    }
                    OP_RW if conn.established && !conn.guest_done_sending => {
                        if !self.forward(key, payload) {
                            return;
                        }
                    }
                    OP_SHUTDOWN => {
                        if hdr.flags & SHUTDOWN_SEND != 0 {
                            conn.guest_done_sending = true;
                        }
                        let flushed = conn.flush();
                        if hdr.flags & (SHUTDOWN_SEND | SHUTDOWN_RCV) == SHUTDOWN_SEND | SHUTDOWN_RCV {
                            if flushed.is_ok() && !conn.tx_buf.is_empty() {
                                // The guest closed, but the host has not
                                // taken all it sent: the connection ends
                                // once it has (`host_ready`).
                                conn.guest_closed = true;
                            } else {
                                // The guest closed: the connection ends
                                // (Linux waits for this RST to finish its
                                // close).
                                self.reset_conn(key);
                                return;
                            }
                        }
                    }
                    OP_CREDIT_UPDATE => {}
                    OP_CREDIT_REQUEST => {
                        let update = self.header(key, OP_CREDIT_UPDATE);
                        self.push_control(update);
                    }
                    _ => {
                        self.reset_conn(key);
                        return;
                    }
                }
                self.sync(key);
            }
        }
    }

    /// A packet too large or cut short: its connection (if any) is reset.
    pub fn malformed(&mut self, hdr: &Header) {
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.src_cid == self.guest_cid && self.conns.contains_key(&key) {
            self.reset_conn(key);
        } else if hdr.op != OP_RST {
            self.push_control(Header { src_cid: HOST_CID, dst_cid: self.guest_cid, ..hdr.reset_reply() });
        }
    }

    /// Bytes buffered towards the host on all connections.
    pub fn buffered(&self) -> usize {
        self.conns.values().map(|c| c.tx_buf.len()).sum()
    }

    /// Writes guest bytes to the host, buffering what the socket will not
    /// take now; false when the connection was reset.
    fn forward(&mut self, key: Key, payload: &[u8]) -> bool {
        let Some(conn) = self.conns.get_mut(&key) else { return false };
        let mut written = 0;
        if conn.tx_buf.is_empty() {
            while written < payload.len() {
                match conn.stream.write(&payload[written..]) {
                    Ok(0) => break,
                    Ok(n) => written += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        self.reset_conn(key);
                        return false;
                    }
                }
            }
            conn.fwd_cnt = conn.fwd_cnt.wrapping_add(u32::try_from(written).unwrap_or(0));
        }
        let rest = &payload[written..];
        if conn.tx_buf.len() + rest.len() > BUF_ALLOC as usize {
            crate::guest_triggered!(warn, "vsock: the guest sent past its credit on port {}; resetting", key.0);
            self.reset_conn(key);
            return false;
        }
        conn.tx_buf.extend(rest);
        self.maybe_credit_update(key);
        true
    }

    fn guest_connect(&mut self, key: Key, hdr: &Header) {
        let allowed = self.host_ports.as_ref().is_none_or(|ports| ports.contains(&key.0));
        if !allowed || self.conns.contains_key(&key) || self.connections() >= MAX_CONNECTIONS {
            self.push_control(hdr.reset_reply());
            return;
        }
        let path = format!("{}_{}", self.uds_path.display(), key.0);
        let stream = match UnixStream::connect(&path).and_then(|s| s.set_nonblocking(true).map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("vsock: guest connection to {path} refused: {e}");
                self.push_control(hdr.reset_reply());
                return;
            }
        };
        let token = self.token();
        self.conns.insert(key, Conn::new(stream, token, true, hdr));
        self.by_token.insert(token, key);
        let response = self.header(key, OP_RESPONSE);
        self.push_control(response);
        self.sync(key);
    }

    fn token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    /// Handles whatever the muxer's epoll reports (without waiting).
    pub fn process_events(&mut self) {
        let mut events = [EpollEvent::default(); 64];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                if e.kind() != ErrorKind::Interrupted {
                    crate::guest_triggered!(warn, "vsock: epoll failed: {e}");
                }
                return;
            }
        };
        for event in &events[..n] {
            let token = event.data();
            let set = event.event_set();
            if token == LISTENER_TOKEN {
                self.accept();
            } else if self.pending.contains_key(&token) {
                self.read_connect_line(token);
            } else if let Some(key) = self.by_token.get(&token).copied() {
                self.host_ready(key, set);
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    if e.kind() != ErrorKind::WouldBlock {
                        crate::guest_triggered!(warn, "vsock: cannot accept a host connection: {e}");
                    }
                    return;
                }
            };
            if self.connections() >= MAX_CONNECTIONS {
                crate::guest_triggered!(warn, "vsock: {MAX_CONNECTIONS} connections open; refusing a host connection");
                continue; // dropped: the host sees its socket closed
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let token = self.token();
            let event = EpollEvent::new(EventSet::IN, token);
            if self.epoll.ctl(ControlOperation::Add, stream.as_raw_fd(), event).is_ok() {
                self.pending.insert(token, Pending { stream, line: Vec::new() });
                // The line is usually there already.
                self.read_connect_line(token);
            }
        }
    }

    /// Reads a pending host connection's `CONNECT <port>\n` a byte at a
    /// time, so no byte after the line is taken from the socket.
    fn read_connect_line(&mut self, token: u64) {
        let Some(pending) = self.pending.get_mut(&token) else { return };
        let mut byte = [0u8; 1];
        let port = loop {
            match pending.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break parse_connect(&pending.line),
                Ok(1) if pending.line.len() < MAX_CONNECT_LINE => pending.line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // End of stream, an error, or a line too long.
                _ => break None,
            }
        };
        let Some(pending) = self.pending.remove(&token) else { return };
        let _ = self.epoll.ctl(ControlOperation::Delete, pending.stream.as_raw_fd(), EpollEvent::default());
        let Some(port) = port else {
            tracing::debug!("vsock: a host connection sent no valid CONNECT line; closing it");
            return;
        };
        let mut local = self.next_local_port;
        while self.conns.contains_key(&(local, port)) {
            local = local.checked_add(1).unwrap_or(LOCAL_PORT_START);
        }
        self.next_local_port = local.checked_add(1).unwrap_or(LOCAL_PORT_START);
        let key = (local, port);
        let peer = Header::default();
        self.conns.insert(key, Conn::new(pending.stream, token, false, &peer));
        self.by_token.insert(token, key);
        let request = self.header(key, OP_REQUEST);
        self.push_control(request);
    }

    fn host_ready(&mut self, key: Key, set: EventSet) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if set.contains(EventSet::OUT) {
            if conn.flush().is_err() || (conn.guest_closed && conn.tx_buf.is_empty()) {
                // The host is gone, or has all a closed guest sent.
                self.reset_conn(key);
                return;
            }
            self.maybe_credit_update(key);
        }
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if set.intersects(EventSet::HANG_UP | EventSet::ERROR) {
            if !conn.established || conn.host_eof || conn.guest_closed {
                self.reset_conn(key);
                return;
            }
            // Take it out of epoll (a hung-up socket is always ready) and
            // let the RX path read what is left.
            let _ = self.epoll.ctl(ControlOperation::Delete, conn.stream.as_raw_fd(), EpollEvent::default());
            conn.events = 0;
            conn.hup = true;
        } else if set.contains(EventSet::IN) && !conn.queued {
            conn.queued = true;
            self.readable.push_back(key);
        }
        self.sync(key);
    }

    /// The next packet for the guest, for an RX buffer with room for `room`
    /// payload bytes. For data, `read` is called with the host socket and
    /// how much to take: it reads straight into the guest's buffer.
    pub fn next_rx(
        &mut self,
        room: usize,
        read: &mut dyn FnMut(&mut UnixStream, usize) -> std::io::Result<usize>,
    ) -> Option<Header> {
        if let Some(header) = self.control.pop_front() {
            return Some(header);
        }
        while let Some(key) = self.readable.pop_front() {
            let Some(conn) = self.conns.get_mut(&key) else { continue };
            conn.queued = false;
            let want = room.min(MAX_PKT_PAYLOAD).min(conn.peer_credit() as usize);
            if !conn.established || conn.host_eof || want == 0 {
                self.sync(key);
                continue;
            }
            match read(&mut conn.stream, want) {
                Ok(0) => {
                    conn.host_eof = true;
                    if conn.hup {
                        // The host is gone both ways.
                        let mut shutdown = self.header(key, OP_SHUTDOWN);
                        shutdown.flags = SHUTDOWN_SEND | SHUTDOWN_RCV;
                        self.remove(key);
                        return Some(shutdown);
                    }
                    let mut shutdown = self.header(key, OP_SHUTDOWN);
                    shutdown.flags = SHUTDOWN_SEND;
                    self.sync(key);
                    return Some(shutdown);
                }
                Ok(n) => {
                    conn.rx_cnt = conn.rx_cnt.wrapping_add(u32::try_from(n).unwrap_or(0));
                    conn.queued = true;
                    self.readable.push_back(key);
                    let mut rw = self.header(key, OP_RW);
                    rw.len = u32::try_from(n).unwrap_or(0);
                    if let Some(conn) = self.conns.get_mut(&key) {
                        conn.last_fwd_sent = rw.fwd_cnt;
                    }
                    return Some(rw);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    self.sync(key);
                }
                Err(_) => {
                    let rst = self.header(key, OP_RST);
                    self.remove(key);
                    return Some(rst);
                }
            }
        }
        None
    }

    /// Puts a packet `next_rx` returned back (the guest's buffer could not
    /// take it); it goes first next time.
    pub fn unread(&mut self, header: Header) {
        // Only control packets are put back: data is read into the guest's
        // buffer itself, after which nothing can fail.
        if header.op != OP_RW {
            self.control.push_front(header);
        }
    }
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?;
    let line = line.strip_suffix('\r').unwrap_or(line);
    line.strip_prefix("CONNECT ")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines_parse() {
        assert_eq!(parse_connect(b"CONNECT 1024"), Some(1024));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        for bad in [&b"CONNECT"[..], b"CONNECT -1", b"connect 5", b"CONNECT 99999999999", b"\xff"] {
            assert_eq!(parse_connect(bad), None, "{bad:?}");
        }
    }
}

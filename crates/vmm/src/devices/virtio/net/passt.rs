//! The host end of the guest's network: a stream socket to passt (its
//! default "qemu" mode), on which each Ethernet frame is prefixed with its
//! length, 4 bytes big-endian.
//!
//! Both directions go through bounded buffers, so that neither side can
//! make the VMM hold more than `BUFFER_BYTES` per direction:
//!
//! - *From passt*: bytes are read only while the receive buffer has room;
//!   once it is full (a guest that posts no RX buffers), the socket is no
//!   longer polled for input and passt's writes block in its own socket
//!   buffer.
//! - *To passt*: frames are queued only while the send buffer has room for
//!   a whole frame; a passt that does not read leaves the guest's TX
//!   buffers in their queue until the socket is writable again.
//!
//! The link owns an epoll set holding the socket with exactly the interest
//! its buffers call for (input while there is room, output while bytes
//! wait), and the VMM loop polls that set: nothing spins on a socket that
//! is readable while there is nowhere to put its bytes.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

/// The largest frame either way: passt's largest MTU (65520) plus the
/// Ethernet header, rounded up.
pub const MAX_FRAME: usize = 65_536;
/// The length prefix of each frame on the stream.
const PREFIX: usize = 4;
/// Bytes buffered per direction: a few of the largest frames, many
/// ordinary ones.
pub const BUFFER_BYTES: usize = 256 * 1024;

/// The socket to passt and its buffers.
pub struct PasstLink {
    stream: Option<UnixStream>,
    epoll: Epoll,
    /// The interest registered for the socket (empty: not registered).
    interest: EventSet,
    /// Bytes read from passt: `rx[rx_start..rx_end]` are frames not yet
    /// delivered, the last possibly incomplete.
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    /// Bytes for passt: `tx[tx_start..]` are still to be written.
    tx: Vec<u8>,
    tx_start: usize,
}

impl std::fmt::Debug for PasstLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PasstLink")
            .field("up", &self.is_up())
            .field("received", &(self.rx_end - self.rx_start))
            .field("to_send", &self.tx_pending())
            .finish_non_exhaustive()
    }
}

impl PasstLink {
    /// A link over `stream`, a connected socket to passt (made non-blocking here).
    pub fn new(stream: UnixStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        let mut link = Self {
            stream: Some(stream),
            epoll: Epoll::new()?,
            interest: EventSet::empty(),
            rx: vec![0u8; BUFFER_BYTES].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(BUFFER_BYTES),
            tx_start: 0,
        };
        link.update_interest();
        Ok(link)
    }

    /// The epoll set the VMM loop polls.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Whether passt is still connected.
    pub fn is_up(&self) -> bool {
        self.stream.is_some()
    }

    /// Bytes waiting to be written to passt.
    pub fn tx_pending(&self) -> usize {
        self.tx.len() - self.tx_start
    }

    /// Reads what passt has sent, as far as the receive buffer has room.
    pub fn fill(&mut self) {
        if self.rx_start > 0 && self.rx_end == self.rx.len() {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        while self.rx_end < self.rx.len() {
            let Some(stream) = self.stream.as_mut() else { return };
            match stream.read(&mut self.rx[self.rx_end..]) {
                Ok(0) => {
                    self.hang_up("passt closed the connection");
                    return;
                }
                Ok(n) => self.rx_end += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.hang_up(&format!("reading from passt failed: {e}"));
                    return;
                }
            }
        }
        self.update_interest();
    }

    /// The next whole frame from passt, if one is buffered.
    pub fn frame(&mut self) -> Option<&[u8]> {
        loop {
            let buffered = &self.rx[self.rx_start..self.rx_end];
            let prefix: [u8; PREFIX] = buffered.get(..PREFIX)?.try_into().ok()?;
            let len = usize::try_from(u32::from_be_bytes(prefix)).unwrap_or(usize::MAX);
            if len > MAX_FRAME {
                // Not a stream of frames: nothing after this can be trusted.
                self.hang_up(&format!("passt sent a frame of {len} bytes, more than {MAX_FRAME}"));
                return None;
            }
            if len == 0 {
                self.rx_start += PREFIX;
                continue;
            }
            if buffered.len() < PREFIX + len {
                self.compact();
                return None;
            }
            return Some(&self.rx[self.rx_start + PREFIX..self.rx_start + PREFIX + len]);
        }
    }

    /// Drops the frame [`Self::frame`] returned (delivered or not deliverable).
    pub fn consume_frame(&mut self) {
        let buffered = &self.rx[self.rx_start..self.rx_end];
        let Some(prefix) = buffered.get(..PREFIX).and_then(|p| <[u8; PREFIX]>::try_from(p).ok()) else { return };
        let len = usize::try_from(u32::from_be_bytes(prefix)).unwrap_or(usize::MAX);
        if let Some(end) = PREFIX.checked_add(len).filter(|end| *end <= buffered.len()) {
            self.rx_start += end;
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        self.update_interest();
    }

    /// Drops every whole frame buffered from passt, keeping a partial one
    /// (the stream's framing must stay intact): a device reset.
    pub fn drop_received(&mut self) {
        while self.frame().is_some() {
            self.consume_frame();
        }
    }

    /// Whether a frame of the largest size can be queued for passt now.
    pub fn can_send(&self) -> bool {
        self.tx_pending() + PREFIX + MAX_FRAME <= BUFFER_BYTES
    }

    /// Queues `frame` for passt (the caller checked [`Self::can_send`]) and
    /// writes what the socket takes. Without passt the frame is dropped.
    pub fn send(&mut self, frame: &[u8]) {
        if self.stream.is_none() || frame.is_empty() || frame.len() > MAX_FRAME {
            return;
        }
        if self.tx_start == self.tx.len() {
            self.tx.clear();
            self.tx_start = 0;
        } else if self.tx_start > 0 && self.tx.len() + PREFIX + frame.len() > BUFFER_BYTES {
            self.tx.drain(..self.tx_start);
            self.tx_start = 0;
        }
        let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        self.tx.extend_from_slice(&len.to_be_bytes());
        self.tx.extend_from_slice(frame);
    }

    /// Writes queued bytes until the socket would block.
    pub fn flush(&mut self) {
        while self.tx_pending() > 0 {
            let Some(stream) = self.stream.as_ref() else { return };
            let rest = &self.tx[self.tx_start..];
            // SAFETY: `rest` is a live, initialized slice for the duration
            // of the call; send(2) only reads it. MSG_NOSIGNAL: a passt that
            // is gone must not kill the VMM with SIGPIPE.
            let n = unsafe {
                libc::send(
                    stream.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            match usize::try_from(n) {
                Ok(n) => self.tx_start += n,
                Err(_) => {
                    let e = std::io::Error::last_os_error();
                    match e.kind() {
                        std::io::ErrorKind::WouldBlock => break,
                        std::io::ErrorKind::Interrupted => {}
                        _ => {
                            self.hang_up(&format!("writing to passt failed: {e}"));
                            return;
                        }
                    }
                }
            }
        }
        if self.tx_start == self.tx.len() {
            self.tx.clear();
            self.tx_start = 0;
        }
        self.update_interest();
    }

    /// Takes whatever the link's epoll set reports, without waiting: the
    /// interest is level-triggered, so the work itself is done by
    /// [`Self::fill`] and [`Self::flush`].
    pub fn clear_events(&self) {
        let mut events = [EpollEvent::default(); 4];
        let _ = self.epoll.wait(0, &mut events);
    }

    /// Moves a partial frame to the front, so that the buffer's free end
    /// can take the rest of it.
    fn compact(&mut self) {
        if self.rx_start > 0 {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
    }

    /// passt is gone (or spoke nonsense): the guest's link stays without a
    /// peer; frames it sends are dropped.
    fn hang_up(&mut self, why: &str) {
        if let Some(stream) = self.stream.take() {
            crate::guest_triggered!(warn, "virtio-net: {why}; the guest's network is down");
            let _ = self.epoll.ctl(ControlOperation::Delete, stream.as_raw_fd(), EpollEvent::default());
        }
        self.interest = EventSet::empty();
        self.rx_start = 0;
        self.rx_end = 0;
        self.tx.clear();
        self.tx_start = 0;
    }

    /// Brings the socket's epoll interest in line with the buffers.
    fn update_interest(&mut self) {
        let Some(stream) = self.stream.as_ref() else { return };
        let mut want = EventSet::empty();
        if self.rx_end < self.rx.len() || self.rx_start > 0 {
            want |= EventSet::IN;
        }
        if self.tx_pending() > 0 {
            want |= EventSet::OUT;
        }
        if want == self.interest {
            return;
        }
        let fd = stream.as_raw_fd();
        let event = EpollEvent::new(want, 0);
        let done = match (self.interest.is_empty(), want.is_empty()) {
            (true, _) => self.epoll.ctl(ControlOperation::Add, fd, event),
            (_, true) => self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default()),
            _ => self.epoll.ctl(ControlOperation::Modify, fd, event),
        };
        match done {
            Ok(()) => self.interest = want,
            Err(e) => crate::guest_triggered!(warn, "virtio-net: cannot watch the passt socket: {e}"),
        }
    }
}

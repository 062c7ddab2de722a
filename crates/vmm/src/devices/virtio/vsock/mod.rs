//! virtio-vsock (virtio 1.2, §5.10): the guest's sockets to the host. The
//! device moves packets between its queues (RX: to the guest, TX: from the
//! guest, an event queue it never uses) and the `VsockMuxer`, which owns
//! the host-side Unix sockets.

pub mod muxer;
pub mod packet;

use std::io::Read;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader};
use vm_memory::volatile_memory::Error as VolatileMemoryError;
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryMmap, ReadVolatile, VolatileSlice};

use super::{TYPE_VSOCK, VirtioDevice, read_config_bytes};
pub use muxer::VsockMuxer;
use packet::{HDR_LEN, Header};

const QUEUE_SIZES: &[u16] = &[256, 256, 256];
const RX: usize = 0;
const TX: usize = 1;

/// The vsock device.
#[derive(Debug)]
pub struct Vsock {
    cid: u64,
    muxer: VsockMuxer,
    payload: Vec<u8>,
}

impl Vsock {
    /// A device for guest context id `cid`, its host socket at `uds_path`.
    pub fn new(cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        Ok(Self { cid, muxer: VsockMuxer::new(cid, uds_path)?, payload: Vec::new() })
    }

    /// Lets the guest connect only to `ports` on the host (`None`: any).
    pub fn limit_host_ports(&mut self, ports: Option<Vec<u32>>) {
        self.muxer.limit_host_ports(ports);
    }

    /// The muxer (for tests and benchmarks).
    pub fn muxer(&self) -> &VsockMuxer {
        &self.muxer
    }

    /// Takes the guest's packets from TX.
    fn process_tx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        let mut left = queue.size();
        while let Some(chain) = super::next_chain(queue, mem, &mut left) {
            let head = chain.head_index();
            if let Ok(mut reader) = Reader::<()>::new(mem, chain) {
                let mut raw = [0u8; HDR_LEN];
                if reader.read_exact(&mut raw).is_ok() {
                    let hdr = Header::parse(&raw);
                    let len = usize::try_from(hdr.len).unwrap_or(usize::MAX);
                    if len > muxer::MAX_PKT_PAYLOAD || len > reader.available_bytes() {
                        // A malformed packet: its connection is reset.
                        self.muxer.malformed(&hdr);
                    } else {
                        self.payload.resize(len, 0);
                        if reader.read_exact(&mut self.payload).is_ok() {
                            self.muxer.from_guest(&hdr, &self.payload);
                        }
                    }
                }
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                crate::guest_triggered!(warn, "vsock: cannot return a TX buffer to the guest: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Fills the guest's RX buffers with what the muxer has for it; data
    /// goes from the host socket straight into guest memory.
    fn process_rx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        while self.muxer.has_rx() {
            let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
            let head = chain.head_index();
            let mut len = 0;
            if let Some(buffer) = RxBuffer::new(mem, chain) {
                let mut read = |stream: &mut UnixStream, want: usize| buffer.read_payload(stream, want);
                match self.muxer.next_rx(buffer.room(), &mut read) {
                    Some(hdr) => {
                        let payload = if hdr.op == packet::OP_RW { hdr.len } else { 0 };
                        if buffer.write_header(&hdr) {
                            len = u32::try_from(HDR_LEN).unwrap_or(0) + payload;
                        } else {
                            self.muxer.unread(hdr);
                        }
                    }
                    None => {
                        // Nothing after all: the buffer goes back unused.
                        queue.go_to_previous_position();
                        break;
                    }
                }
            }
            // A buffer too small or outside guest memory is returned empty.
            if let Err(e) = queue.add_used(mem, head, len) {
                crate::guest_triggered!(warn, "vsock: cannot return an RX buffer to the guest: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

/// An RX chain's device-writable memory, checked against guest memory.
struct RxBuffer<'a> {
    slices: Vec<VolatileSlice<'a, ()>>,
    total: usize,
}

impl<'a> RxBuffer<'a> {
    /// `None` for a chain with a buffer outside guest memory (or crossing
    /// a region boundary) or too small for a header.
    fn new(mem: &'a GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) -> Option<Self> {
        let mut slices = Vec::new();
        let mut total = 0usize;
        for desc in chain.writable() {
            let len = usize::try_from(desc.len()).ok()?;
            if len == 0 {
                continue;
            }
            slices.push(mem.get_slice(desc.addr(), len).ok()?);
            total = total.checked_add(len)?;
        }
        (total >= HDR_LEN).then_some(Self { slices, total })
    }

    fn room(&self) -> usize {
        (self.total - HDR_LEN).min(muxer::MAX_PKT_PAYLOAD)
    }

    /// The slices from byte `skip` on.
    fn from(&self, mut skip: usize) -> impl Iterator<Item = VolatileSlice<'a, ()>> + '_ {
        self.slices.iter().filter_map(move |s| {
            if skip >= s.len() {
                skip -= s.len();
                return None;
            }
            let rest = s.offset(skip).ok();
            skip = 0;
            rest
        })
    }

    fn write_header(&self, hdr: &Header) -> bool {
        let bytes = hdr.to_bytes();
        let mut done = 0;
        for slice in self.from(0) {
            let n = slice.len().min(HDR_LEN - done);
            if slice.write_slice(&bytes[done..done + n], 0).is_err() {
                return false;
            }
            done += n;
            if done == HDR_LEN {
                return true;
            }
        }
        false
    }

    /// Reads up to `want` bytes from `stream` into the payload area.
    fn read_payload(&self, stream: &mut UnixStream, want: usize) -> std::io::Result<usize> {
        let mut done = 0;
        for slice in self.from(HDR_LEN) {
            if done == want {
                break;
            }
            let mut part = slice.subslice(0, slice.len().min(want - done)).map_err(std::io::Error::other)?;
            let n = match stream.read_volatile(&mut part) {
                Ok(n) => n,
                Err(VolatileMemoryError::IOError(e)) if done == 0 => return Err(e),
                Err(_) if done > 0 => break,
                Err(e) => return Err(std::io::Error::other(e)),
            };
            done += n;
            if n < part.len() {
                break;
            }
        }
        Ok(done)
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.cid.to_le_bytes(), offset, data);
    }

    fn reset(&mut self) {
        self.muxer.reset();
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        if index == TX
            && let Some(tx) = queues.get_mut(TX)
        {
            used |= self.process_tx(tx, mem);
        }
        if index == TX || index == RX {
            self.muxer.process_events();
            if let Some(rx) = queues.get_mut(RX) {
                used |= self.process_rx(rx, mem);
            }
        }
        used
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.muxer.epoll_fd())
    }

    fn process_host(&mut self, queues: Option<&mut [Queue]>, mem: &GuestMemoryMmap) -> bool {
        self.muxer.process_events();
        match queues.and_then(|q| q.get_mut(RX)) {
            Some(rx) => self.process_rx(rx, mem),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;

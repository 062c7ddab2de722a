//! virtio-vsock (virtio 1.2, §5.10): the guest's sockets to the host. The
//! device moves packets between its queues (RX: to the guest, TX: from the
//! guest, an event queue it never uses) and the `VsockMuxer`, which owns
//! the host-side Unix sockets.

pub mod muxer;
pub mod packet;

use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::path::Path;

use virtio_queue::{Queue, QueueOwnedT, QueueT, Reader, Writer};
use vm_memory::GuestMemoryMmap;

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

    /// The muxer (for tests and benchmarks).
    pub fn muxer(&self) -> &VsockMuxer {
        &self.muxer
    }

    /// Takes the guest's packets from TX.
    fn process_tx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
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
                tracing::warn!("vsock: cannot return a TX buffer to the guest: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Fills the guest's RX buffers with what the muxer has for it.
    fn process_rx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        while self.muxer.has_rx() {
            let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
            let head = chain.head_index();
            let mut len = 0;
            if let Ok(mut writer) = Writer::<()>::new(mem, chain)
                && writer.available_bytes() >= HDR_LEN
            {
                match self.muxer.next_rx(writer.available_bytes() - HDR_LEN) {
                    Some(hdr) => {
                        let payload = if hdr.op == packet::OP_RW { self.muxer.payload() } else { &[] };
                        if writer.write_all(&hdr.to_bytes()).is_ok() && writer.write_all(payload).is_ok() {
                            len = u32::try_from(HDR_LEN + payload.len()).unwrap_or(0);
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
                tracing::warn!("vsock: cannot return an RX buffer to the guest: {e}");
                break;
            }
            used = true;
        }
        used
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

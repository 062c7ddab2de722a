//! virtio-net (virtio 1.2, §5.1): an Ethernet interface whose other end is
//! passt, which turns the guest's frames into ordinary sockets of the host
//! (and back). One RX and one TX queue, the 12-byte `virtio_net_hdr_v1` on
//! every buffer, the MAC address in configuration space (`F_MAC`), no
//! offloads: every frame is a whole Ethernet frame with its checksums done
//! by the guest, so the header is all zeros both ways (and its contents
//! from the guest are ignored).
//!
//! Without `MRG_RXBUF` each frame takes one RX chain of its own; a frame
//! larger than the chain the guest posted (Linux posts 1518 bytes plus the
//! header when it has no offloads, matching its MTU of 1500) is dropped,
//! as a NIC drops what exceeds its receive buffers. passt sizes its TCP
//! segments from the guest's MSS, so that does not happen to TCP.
//!
//! Only ARP and IPv4 frames go to passt, and no IPv4 packet addressed to
//! 0.0.0.0/8 or 127.0.0.0/8: the guest's own stack never puts those on the
//! wire, but its root can craft them, and passt (Debian bookworm's, at
//! least) would connect them to the host's loopback services, which a
//! sandbox must never reach. The guest is configured for IPv4 only and
//! passt runs `--ipv4-only`, so nothing else is lost.

pub mod passt;

use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::{TYPE_NET, VirtioDevice, read_config_bytes};
use passt::MAX_FRAME;
pub use passt::PasstLink;

const QUEUE_SIZES: &[u16] = &[256, 256];
const RX: usize = 0;
const TX: usize = 1;

/// `VIRTIO_NET_F_MAC`: the device has a MAC address in its configuration.
pub const F_MAC: u64 = 1 << 5;
/// `VIRTIO_NET_S_LINK_UP`, the link status in configuration space.
const S_LINK_UP: u16 = 1;
/// `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size, csum_start,
/// csum_offset, num_buffers.
pub const HDR_LEN: usize = 12;
/// The most descriptors a frame's chain may have. Linux uses one or two
/// per frame without offloads (at most 19 with scatter-gather); a chain
/// that loops back on itself ends at the queue's size (256), far above.
const MAX_CHAIN: usize = 64;

/// The network device.
#[derive(Debug)]
pub struct Net {
    mac: [u8; 6],
    link: PasstLink,
    /// One TX frame at a time, read out of guest memory.
    frame: Vec<u8>,
    /// Frames from passt dropped because no posted buffer could hold them.
    dropped_rx: u64,
    /// Frames from the guest dropped as malformed or refused.
    dropped_tx: u64,
}

/// Ethernet types passed to passt.
const ETH_ARP: [u8; 2] = [0x08, 0x06];
const ETH_IPV4: [u8; 2] = [0x08, 0x00];

/// Whether a frame from the guest may go to passt: ARP, and IPv4 to any
/// destination but "this host" (0/8), loopback (127/8) and the cloud
/// providers' metadata services, which hand whoever asks the host
/// machine's credentials: link-local (169.254/16, where 169.254.169.254
/// is) and Alibaba's 100.100.100.200 (as moat-agent's jails refuse them).
pub fn allowed_to_passt(frame: &[u8]) -> bool {
    match frame.get(12..14) {
        Some(t) if t == ETH_ARP => true,
        // The destination address is at offset 16 of the IPv4 header, whatever its options.
        Some(t) if t == ETH_IPV4 => match frame.get(30..34) {
            Some([0 | 127, ..] | [169, 254, ..] | [100, 100, 100, 200]) | None => false,
            Some(_) => true,
        },
        _ => false,
    }
}

impl Net {
    /// A device with address `mac` whose frames go to and come from passt
    /// on `stream`.
    pub fn new(mac: [u8; 6], stream: UnixStream) -> std::io::Result<Self> {
        Ok(Self { mac, link: PasstLink::new(stream)?, frame: Vec::new(), dropped_rx: 0, dropped_tx: 0 })
    }

    /// The link to passt (for tests).
    pub fn link(&self) -> &PasstLink {
        &self.link
    }

    /// Frames dropped (from passt, from the guest) so far.
    pub fn dropped(&self) -> (u64, u64) {
        (self.dropped_rx, self.dropped_tx)
    }

    /// Takes the guest's frames from TX while passt's buffer has room.
    fn process_tx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        let mut left = queue.size();
        loop {
            let mut drained = false;
            while self.link.can_send() {
                // Empty, or this pass's share served: the transport comes
                // back for the rest.
                let Some(chain) = super::next_chain(queue, mem, &mut left) else {
                    drained = true;
                    break;
                };
                let head = chain.head_index();
                if !self.read_frame(mem, chain) {
                    self.dropped_tx += 1;
                    tracing::debug!("virtio-net: dropped a malformed TX chain");
                } else if !allowed_to_passt(&self.frame[HDR_LEN..]) {
                    self.dropped_tx += 1;
                    tracing::debug!("virtio-net: dropped a frame that is not ARP or IPv4 to an outside address");
                } else {
                    self.link.send(&self.frame[HDR_LEN..]);
                }
                if let Err(e) = queue.add_used(mem, head, 0) {
                    crate::guest_triggered!(warn, "virtio-net: cannot return a TX buffer to the guest: {e}");
                    self.link.flush();
                    return used;
                }
                used = true;
            }
            self.link.flush();
            // When passt took everything, the chains still queued must be
            // served now: no socket event will come for them (the guest
            // notified once, and nothing is left to write).
            if drained || !self.link.can_send() {
                return used;
            }
        }
    }

    /// Reads a TX chain (header and frame) into `self.frame`; false for a
    /// chain outside guest memory, shorter than the header, with no frame
    /// larger than the largest frame, or of more than `MAX_CHAIN` buffers.
    fn read_frame(&mut self, mem: &GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) -> bool {
        if chain.clone().count() > MAX_CHAIN {
            return false;
        }
        let Ok(mut reader) = Reader::<()>::new(mem, chain) else { return false };
        let len = reader.available_bytes();
        if len <= HDR_LEN || len > HDR_LEN + MAX_FRAME {
            return false;
        }
        self.frame.resize(len, 0);
        std::io::Read::read_exact(&mut reader, &mut self.frame).is_ok()
    }

    /// Delivers frames from passt into the guest's RX buffers, as long as
    /// there are both.
    fn process_rx(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        loop {
            self.link.fill();
            let Some(frame) = self.link.frame() else { break };
            let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
            let head = chain.head_index();
            let Some(buffers) = writable_buffers(mem, chain) else {
                // A hostile chain: returned empty; the frame waits for the next.
                if let Err(e) = queue.add_used(mem, head, 0) {
                    crate::guest_triggered!(warn, "virtio-net: cannot return an RX buffer to the guest: {e}");
                    break;
                }
                used = true;
                continue;
            };
            let room: usize = buffers.iter().map(|(_, len)| *len).sum();
            if room < HDR_LEN + frame.len() {
                // Too big for the buffers this guest posts: dropped, the
                // buffer kept for the next frame.
                queue.go_to_previous_position();
                self.dropped_rx += 1;
                tracing::debug!("virtio-net: dropped a {}-byte frame larger than the guest's buffers", frame.len());
                self.link.consume_frame();
                continue;
            }
            let mut header = [0u8; HDR_LEN];
            // num_buffers: one chain per frame.
            header[10..12].copy_from_slice(&1u16.to_le_bytes());
            let written = write_parts(mem, &buffers, &[&header, frame]);
            self.link.consume_frame();
            let len = u32::try_from(written).unwrap_or(0);
            if let Err(e) = queue.add_used(mem, head, len) {
                crate::guest_triggered!(warn, "virtio-net: cannot return an RX buffer to the guest: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

/// The device-writable buffers of a chain, each checked to lie in guest
/// memory; `None` when one does not, when there is no room for a header,
/// or when there are more than `MAX_CHAIN`.
fn writable_buffers(mem: &GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) -> Option<Vec<(u64, usize)>> {
    if chain.clone().count() > MAX_CHAIN {
        return None;
    }
    let mut buffers = Vec::new();
    let mut total = 0usize;
    for desc in chain.writable() {
        let len = usize::try_from(desc.len()).ok()?;
        if len == 0 {
            continue;
        }
        mem.get_slice(desc.addr(), len).ok()?;
        total = total.checked_add(len)?;
        buffers.push((desc.addr().0, len));
    }
    (total >= HDR_LEN).then_some(buffers)
}

/// Writes `parts` one after the other across `buffers`; returns the bytes written.
fn write_parts(mem: &GuestMemoryMmap, buffers: &[(u64, usize)], parts: &[&[u8]]) -> usize {
    let mut written = 0;
    let mut bufs = buffers.iter().copied();
    let Some((mut addr, mut room)) = bufs.next() else { return 0 };
    for part in parts {
        let mut part: &[u8] = part;
        while !part.is_empty() {
            while room == 0 {
                let Some(next) = bufs.next() else { return written };
                (addr, room) = next;
            }
            let n = room.min(part.len());
            if mem.write_slice(&part[..n], GuestAddress(addr)).is_err() {
                return written;
            }
            written += n;
            part = &part[n..];
            addr += n as u64;
            room -= n;
        }
    }
    written
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        F_MAC
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // mac[6], then status (meaningful with F_STATUS, which is not
        // offered; the link is always up).
        let mut config = [0u8; 8];
        config[..6].copy_from_slice(&self.mac);
        config[6..8].copy_from_slice(&S_LINK_UP.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn reset(&mut self) {
        // Frames already read from passt are dropped; a partial one stays,
        // as do bytes already queued for passt, so that the stream's
        // framing stays whole.
        self.link.drop_received();
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemoryMmap) -> bool {
        let mut used = false;
        if index == TX
            && let Some(tx) = queues.get_mut(TX)
        {
            used |= self.process_tx(tx, mem);
        }
        if (index == RX || index == TX)
            && let Some(rx) = queues.get_mut(RX)
        {
            used |= self.process_rx(rx, mem);
        }
        used
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.link.epoll_fd())
    }

    fn process_host(&mut self, queues: Option<&mut [Queue]>, mem: &GuestMemoryMmap) -> bool {
        self.link.clear_events();
        self.link.flush();
        let Some(queues) = queues else {
            // No driver: read what fits (the buffer bounds it); the socket
            // is no longer polled once it is full.
            self.link.fill();
            return false;
        };
        let mut used = false;
        if let Some(tx) = queues.get_mut(TX) {
            used |= self.process_tx(tx, mem);
        }
        if let Some(rx) = queues.get_mut(RX) {
            used |= self.process_rx(rx, mem);
        }
        used
    }
}

#[cfg(test)]
mod tests;

//! virtio-blk (virtio 1.2, §5.2): one request queue; read, write, flush,
//! get-id, discard and write-zeroes; a read-only flag. The bytes come from a `DiskBackend`: a
//! plain file or a copy-on-write overlay on a shared base (`cow`).
//!
//! Requests run synchronously on the VMM thread. Every descriptor is
//! checked against guest memory before use (virtio-queue's `Reader` and
//! `Writer`); a request the device cannot serve completes with an error
//! status, or, with no writable byte to put a status in, is returned empty.

pub mod cow;
pub mod disk;

use std::io::{Read, Write};

use virtio_queue::{Queue, QueueT, Reader, Writer};
use vm_memory::GuestMemoryMmap;

use super::{TYPE_BLOCK, VirtioDevice, read_config_bytes};
pub use cow::CowDisk;
pub use disk::{DiskBackend, RawDisk};

/// One request queue of 256 entries.
const QUEUE_SIZES: &[u16] = &[256];
/// `VIRTIO_BLK_F_SEG_MAX`: the config says how many data segments a request may have.
const F_SEG_MAX: u64 = 1 << 2;
/// `VIRTIO_BLK_F_RO`: the guest may only read.
const F_RO: u64 = 1 << 5;
/// `VIRTIO_BLK_F_FLUSH`: the device has a volatile cache the driver flushes.
const F_FLUSH: u64 = 1 << 9;
/// `VIRTIO_BLK_F_DISCARD` and `VIRTIO_BLK_F_WRITE_ZEROES` (writable disks).
const F_DISCARD: u64 = 1 << 13;
const F_WRITE_ZEROES: u64 = 1 << 14;
/// Largest discard (a hint, cheap at any size) and write-zeroes (written
/// like data) in sectors; one segment each, 4 KiB aligned discards.
const MAX_DISCARD_SECTORS: u32 = 1 << 21;
const MAX_WRITE_ZEROES_SECTORS: u32 = 8192; // MAX_REQUEST_BYTES in sectors
const DISCARD_ALIGNMENT_SECTORS: u32 = 8;
const _: () = assert!(MAX_WRITE_ZEROES_SECTORS as usize * 512 == MAX_REQUEST_BYTES);
/// Data segments per request (the queue size less header and status).
const SEG_MAX: u32 = 254;
/// The largest request served: bigger ones fail, so one request cannot
/// make the VMM allocate without bound. Linux's default (`max_sectors_kb`
/// 1280 KiB) stays well below it.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;
const SECTOR: u64 = 512;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
/// Request status values.
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;
/// Length of the get-id answer.
const ID_BYTES: usize = 20;

/// A virtio block device.
pub struct Block {
    disk: Box<dyn DiskBackend>,
    read_only: bool,
    id: [u8; ID_BYTES],
    buf: Vec<u8>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block").field("size", &self.disk.size()).field("read_only", &self.read_only).finish()
    }
}

impl Block {
    /// A device over `disk`; `id` is what get-id answers (cut to 20 bytes).
    pub fn new(disk: Box<dyn DiskBackend>, read_only: bool, id: &str) -> Self {
        let mut bytes = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        Self { disk, read_only, id: bytes, buf: Vec::new() }
    }

    /// Runs one request chain; returns the bytes written into it.
    fn execute(&mut self, mem: &GuestMemoryMmap, chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>) -> u32 {
        let Ok(mut data) = Writer::<()>::new(mem, chain.clone()) else { return 0 };
        let total = data.available_bytes();
        if total == 0 {
            return 0;
        }
        let Ok(mut status) = data.split_at(total - 1) else { return 0 };
        let code = match Reader::<()>::new(mem, chain) {
            Ok(mut reader) => self.request(&mut reader, &mut data),
            Err(_) => S_IOERR,
        };
        if status.write_all(&[code]).is_err() {
            return 0;
        }
        u32::try_from(data.bytes_written() + 1).unwrap_or(u32::MAX)
    }

    fn request(&mut self, reader: &mut Reader<'_>, data: &mut Writer<'_>) -> u8 {
        let mut header = [0u8; 16];
        if reader.read_exact(&mut header).is_err() {
            return S_IOERR;
        }
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let mut sector = [0u8; 8];
        sector.copy_from_slice(&header[8..16]);
        let sector = u64::from_le_bytes(sector);
        match kind {
            // Data in the wrong direction is a misdirected buffer: the
            // request fails rather than being half served.
            T_IN => {
                let len = data.available_bytes();
                if reader.available_bytes() != 0 {
                    return S_IOERR;
                }
                let Some(offset) = self.range(sector, len) else { return S_IOERR };
                self.buf.resize(len, 0);
                if let Err(e) = self.disk.read_at(&mut self.buf, offset) {
                    crate::guest_triggered!(warn, "virtio-blk: read of {len} bytes at {offset} failed: {e}");
                    return S_IOERR;
                }
                if data.write_all(&self.buf).is_err() {
                    return S_IOERR;
                }
                S_OK
            }
            T_OUT => {
                if self.read_only {
                    return S_IOERR;
                }
                let len = reader.available_bytes();
                if data.available_bytes() != 0 {
                    return S_IOERR;
                }
                let Some(offset) = self.range(sector, len) else { return S_IOERR };
                self.buf.resize(len, 0);
                if reader.read_exact(&mut self.buf).is_err() {
                    return S_IOERR;
                }
                match self.disk.write_at(&self.buf, offset) {
                    Ok(()) => S_OK,
                    Err(e) if e.kind() == std::io::ErrorKind::StorageFull => {
                        crate::guest_triggered!(warn, "virtio-blk: the overlay is full; a {len}-byte write fails");
                        S_IOERR
                    }
                    Err(e) => {
                        crate::guest_triggered!(warn, "virtio-blk: write of {len} bytes at {offset} failed: {e}");
                        S_IOERR
                    }
                }
            }
            T_FLUSH => match self.disk.flush() {
                Ok(()) => S_OK,
                Err(e) => {
                    crate::guest_triggered!(warn, "virtio-blk: flush failed: {e}");
                    S_IOERR
                }
            },
            T_GET_ID => {
                let n = data.available_bytes().min(ID_BYTES);
                if data.write_all(&self.id[..n]).is_err() {
                    return S_IOERR;
                }
                S_OK
            }
            T_DISCARD | T_WRITE_ZEROES => {
                if self.read_only {
                    return S_IOERR;
                }
                // One segment: sector (le64), sectors (le32), flags (le32).
                let mut seg = [0u8; 16];
                if reader.available_bytes() != seg.len() || reader.read_exact(&mut seg).is_err() {
                    return S_IOERR;
                }
                let mut at = [0u8; 8];
                at.copy_from_slice(&seg[0..8]);
                let sectors = u64::from(u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]));
                let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
                let (max, allowed_flags) = if kind == T_DISCARD {
                    (MAX_DISCARD_SECTORS, 0)
                } else {
                    (MAX_WRITE_ZEROES_SECTORS, 1) // UNMAP: a hint, zeros are written anyway
                };
                if sectors == 0 || sectors > u64::from(max) || flags & !allowed_flags != 0 {
                    return S_IOERR;
                }
                let offset = match u64::from_le_bytes(at).checked_mul(SECTOR) {
                    Some(o) if o.checked_add(sectors * SECTOR).is_some_and(|end| end <= self.disk.size()) => o,
                    _ => return S_IOERR,
                };
                let result = if kind == T_DISCARD {
                    self.disk.discard(offset, sectors * SECTOR)
                } else {
                    self.disk.write_zeroes(offset, sectors * SECTOR)
                };
                match result {
                    Ok(()) => S_OK,
                    Err(e) => {
                        crate::guest_triggered!(warn, "virtio-blk: discard or write-zeroes at {offset} failed: {e}");
                        S_IOERR
                    }
                }
            }
            _ => S_UNSUPP,
        }
    }

    /// The byte offset of a `len`-byte transfer at `sector`, if it is whole
    /// sectors (at least one), not too large, and inside the disk.
    fn range(&self, sector: u64, len: usize) -> Option<u64> {
        if len == 0 || len > MAX_REQUEST_BYTES || !(len as u64).is_multiple_of(SECTOR) {
            return None;
        }
        let offset = sector.checked_mul(SECTOR)?;
        (offset.checked_add(len as u64)? <= self.disk.size()).then_some(offset)
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        F_SEG_MAX | F_FLUSH | if self.read_only { F_RO } else { F_DISCARD | F_WRITE_ZEROES }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config: capacity (le64, sectors) at 0, seg_max
        // at 12, then the discard and write-zeroes limits from 36.
        let mut config = [0u8; 60];
        config[0..8].copy_from_slice(&(self.disk.size() / SECTOR).to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        config[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        config[40..44].copy_from_slice(&1u32.to_le_bytes());
        config[44..48].copy_from_slice(&DISCARD_ALIGNMENT_SECTORS.to_le_bytes());
        config[48..52].copy_from_slice(&MAX_WRITE_ZEROES_SECTORS.to_le_bytes());
        config[52..56].copy_from_slice(&1u32.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn reset(&mut self) {
        // Requests complete synchronously: nothing is in flight. The bounce
        // buffer of a large request is given back.
        self.buf = Vec::new();
    }

    fn process_queue(&mut self, _index: usize, queues: &mut [Queue], mem: &GuestMemoryMmap) -> bool {
        let Some(queue) = queues.first_mut() else { return false };
        let mut used = false;
        let mut left = queue.size();
        while let Some(chain) = super::next_chain(queue, mem, &mut left) {
            let head = chain.head_index();
            let len = self.execute(mem, chain);
            if let Err(e) = queue.add_used(mem, head, len) {
                crate::guest_triggered!(warn, "virtio-blk: cannot return a request to the guest: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests;

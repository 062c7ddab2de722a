//! A copy-on-write disk: a read-only base file shared by every VM of an
//! image, and a per-VM overlay file holding only the blocks the guest wrote.
//!
//! The overlay file:
//!
//! ```text
//! 0        header (4 KiB): "MOATCOW1", version, block size, disk size
//! 4096     allocation map: one bit per 4 KiB block, little-endian u64 words
//! data     block i at data + i × 4096 (the file is sparse: unwritten
//!          blocks take no space)
//! ```
//!
//! A block's data is written before its bit, so a crash never maps a block
//! that holds garbage. Reads of unmapped blocks go to the base. The number
//! of mapped blocks is bounded by the overlay's limit: a write that would
//! map more fails with `StorageFull` before touching anything.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::disk::{DiskBackend, read_or_zero, write_zeros_through};

/// The overlay's granularity: the guest's filesystem block size.
pub const BLOCK_SIZE: u64 = 4096;
const BLOCK_BYTES: usize = 4096;
const BLOCK_SIZE_U32: u32 = 4096;
const MAGIC: &[u8; 8] = b"MOATCOW1";
const VERSION: u32 = 1;
const HEADER_SIZE: u64 = 4096;
const HEADER_BYTES: usize = 4096;

/// Why a copy-on-write disk could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum CowError {
    #[error("Cannot open the base image {path}")]
    Base { path: std::path::PathBuf, source: io::Error },
    #[error("Cannot open or initialize the overlay {path}")]
    Overlay { path: std::path::PathBuf, source: io::Error },
    #[error("The overlay {path} is not a moat copy-on-write overlay of this base ({why})")]
    Mismatch { path: std::path::PathBuf, why: String },
}

/// A base file plus an overlay of written blocks.
#[derive(Debug)]
pub struct CowDisk {
    base: File,
    overlay: File,
    size: u64,
    /// One bit per block, set when the overlay holds it.
    map: Vec<u64>,
    /// Mapped blocks, counted against `limit_blocks` (a discarded block
    /// whose space the file system cannot give back stays mapped).
    mapped: u64,
    limit_blocks: u64,
    data_offset: u64,
}

fn map_words(blocks: u64) -> u64 {
    blocks.div_ceil(64)
}

impl CowDisk {
    /// Opens `base` read-only and `overlay` (created when absent), letting
    /// the overlay hold at most `limit_bytes` of written blocks.
    pub fn open(base: &Path, overlay: &Path, limit_bytes: u64) -> Result<Self, CowError> {
        let base_file = File::open(base).map_err(|source| CowError::Base { path: base.into(), source })?;
        let base_len = base_file.metadata().map_err(|source| CowError::Base { path: base.into(), source })?.len();
        let size = base_len / 512 * 512;
        let blocks = size.div_ceil(BLOCK_SIZE);
        let map_bytes = (map_words(blocks) * 8).next_multiple_of(BLOCK_SIZE);
        let data_offset = HEADER_SIZE + map_bytes;
        let ov = |source| CowError::Overlay { path: overlay.into(), source };
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(overlay).map_err(ov)?;
        let len = file.metadata().map_err(ov)?.len();
        let mut map =
            vec![0u64; usize::try_from(map_words(blocks)).map_err(|_| ov(io::ErrorKind::OutOfMemory.into()))?];
        if len == 0 {
            let mut header = vec![0u8; HEADER_BYTES];
            header[0..8].copy_from_slice(MAGIC);
            header[8..12].copy_from_slice(&VERSION.to_le_bytes());
            header[12..16].copy_from_slice(&BLOCK_SIZE_U32.to_le_bytes());
            header[16..24].copy_from_slice(&size.to_le_bytes());
            file.write_all_at(&header, 0).map_err(ov)?;
            // Sparse: the map and the data cost nothing until written.
            file.set_len(data_offset + blocks * BLOCK_SIZE).map_err(ov)?;
            file.sync_all().map_err(ov)?;
        } else if len < data_offset {
            return Err(CowError::Mismatch { path: overlay.into(), why: "no MOATCOW1 header, or cut short".into() });
        } else {
            let mut header = [0u8; 24];
            file.read_exact_at(&mut header, 0).map_err(ov)?;
            let mismatch = |why: String| CowError::Mismatch { path: overlay.into(), why };
            if &header[0..8] != MAGIC {
                return Err(mismatch("no MOATCOW1 header".into()));
            }
            let field32 = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
            if field32(8) != VERSION || u64::from(field32(12)) != BLOCK_SIZE {
                return Err(mismatch(format!("version {} block size {}", field32(8), field32(12))));
            }
            let mut disk = [0u8; 8];
            disk.copy_from_slice(&header[16..24]);
            let disk = u64::from_le_bytes(disk);
            if disk != size {
                return Err(mismatch(format!("made for a {disk}-byte base, this base has {size} bytes")));
            }
            let mut raw = vec![0u8; map.len() * 8];
            file.read_exact_at(&mut raw, HEADER_SIZE).map_err(ov)?;
            for (word, bytes) in map.iter_mut().zip(raw.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(bytes);
                *word = u64::from_le_bytes(b);
            }
            // Bits past the last block are never set by this code.
            if let Some(last) = map.last_mut()
                && blocks % 64 != 0
            {
                *last &= (1u64 << (blocks % 64)) - 1;
            }
        }
        let mapped = map.iter().map(|w| u64::from(w.count_ones())).sum();
        Ok(Self {
            base: base_file,
            overlay: file,
            size,
            map,
            mapped,
            limit_blocks: limit_bytes / BLOCK_SIZE,
            data_offset,
        })
    }

    /// Bytes of written blocks the overlay holds.
    pub fn used_bytes(&self) -> u64 {
        self.mapped * BLOCK_SIZE
    }

    fn is_mapped(&self, block: u64) -> bool {
        let Ok(word) = usize::try_from(block / 64) else { return false };
        self.map.get(word).is_some_and(|w| w & (1 << (block % 64)) != 0)
    }

    /// Marks `first..=last` mapped and writes the changed map words.
    fn map_blocks(&mut self, first: u64, last: u64) -> io::Result<()> {
        let mut changed = false;
        for block in first..=last {
            if !self.is_mapped(block) {
                let word = usize::try_from(block / 64).map_err(|_| io::ErrorKind::InvalidInput)?;
                self.map[word] |= 1 << (block % 64);
                self.mapped += 1;
                changed = true;
            }
        }
        if !changed {
            return Ok(());
        }
        let (w0, w1) = (first / 64, last / 64);
        let words = &self.map[usize::try_from(w0).unwrap_or(0)..=usize::try_from(w1).unwrap_or(0)];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.overlay.write_all_at(&bytes, HEADER_SIZE + w0 * 8)
    }

    fn block_offset(&self, block: u64) -> u64 {
        self.data_offset + block * BLOCK_SIZE
    }

    /// Reads whole block `block` as the guest sees it.
    fn read_block(&self, block: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.is_mapped(block) {
            self.overlay.read_exact_at(buf, self.block_offset(block))
        } else {
            read_or_zero(&self.base, buf, block * BLOCK_SIZE)
        }
    }
}

impl DiskBackend for CowDisk {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            // The longest run of blocks with the same mapping from `at`.
            let mapped = self.is_mapped(at / BLOCK_SIZE);
            let mut run_end = ((at / BLOCK_SIZE) + 1) * BLOCK_SIZE;
            while run_end < end && self.is_mapped(run_end / BLOCK_SIZE) == mapped {
                run_end += BLOCK_SIZE;
            }
            let run_end = run_end.min(end);
            let dst =
                &mut buf[usize::try_from(at - offset).unwrap_or(0)..usize::try_from(run_end - offset).unwrap_or(0)];
            if mapped {
                self.overlay.read_exact_at(dst, self.data_offset + at)?;
            } else {
                read_or_zero(&self.base, dst, at)?;
            }
            at = run_end;
        }
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let (first, last) = (offset / BLOCK_SIZE, (end - 1) / BLOCK_SIZE);
        let new = (first..=last).filter(|b| !self.is_mapped(*b)).count() as u64;
        if self.mapped + new > self.limit_blocks {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "the overlay is full"));
        }
        let slice = |from: u64, to: u64| {
            &buf[usize::try_from(from - offset).unwrap_or(0)..usize::try_from(to - offset).unwrap_or(0)]
        };
        let mut block_buf = vec![0u8; BLOCK_BYTES];
        // A block written in part: merged with what the guest saw there.
        let mut partial = |disk: &mut Self, block: u64| -> io::Result<()> {
            let start = block * BLOCK_SIZE;
            let (lo, hi) = (offset.max(start), end.min(start + BLOCK_SIZE));
            if disk.is_mapped(block) {
                return disk.overlay.write_all_at(slice(lo, hi), disk.data_offset + lo);
            }
            disk.read_block(block, &mut block_buf)?;
            let at = usize::try_from(lo - start).unwrap_or(0);
            block_buf[at..at + usize::try_from(hi - lo).unwrap_or(0)].copy_from_slice(slice(lo, hi));
            disk.overlay.write_all_at(&block_buf, disk.block_offset(block))
        };
        let whole = |block: u64| block * BLOCK_SIZE >= offset && (block + 1) * BLOCK_SIZE <= end;
        let mut full_first = first;
        if !whole(first) {
            partial(self, first)?;
            full_first = first + 1;
        }
        let mut full_last = last;
        if last >= full_first && !whole(last) {
            partial(self, last)?;
            full_last = last.wrapping_sub(1);
        }
        if full_last >= full_first && full_last != u64::MAX {
            let (lo, hi) = (full_first * BLOCK_SIZE, (full_last + 1) * BLOCK_SIZE);
            self.overlay.write_all_at(slice(lo, hi), self.data_offset + lo)?;
        }
        self.map_blocks(first, last)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.overlay.sync_data()
    }

    /// Whole blocks in the range leave the overlay, so the guest's TRIM
    /// frees room under the limit; they read as the base again.
    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.free(offset, len).map(drop)
    }

    /// Zeros that cost nothing where they can: whole blocks whose base is
    /// zero read as zero from the base, so they are dropped from the
    /// overlay instead of filled. Without this, a guest that zeroes free
    /// space (ext4's lazy inode-table init on first mount, `blkdiscard
    /// -z`) would fill its overlay, and its disk limit, with zeros.
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let (first, last) = (offset.div_ceil(BLOCK_SIZE), end / BLOCK_SIZE);
        if first >= last {
            return write_zeros_through(|buf, at| self.write_at(buf, at), offset, len);
        }
        // The parts of blocks at either end, then the whole blocks between.
        write_zeros_through(|buf, at| self.write_at(buf, at), offset, first * BLOCK_SIZE - offset)?;
        write_zeros_through(|buf, at| self.write_at(buf, at), last * BLOCK_SIZE, end - last * BLOCK_SIZE)?;
        self.zero_blocks(first, last)
    }
}

impl CowDisk {
    /// Takes the whole blocks of the range out of the overlay: each one's
    /// space given back first, then its bit cleared and the map written.
    /// Returns the mapped blocks that stay (their file system cannot give
    /// space back, `punch_hole`): they keep counting against the limit,
    /// since the file keeps them, and read as before (what a discarded
    /// block reads is not promised).
    fn free(&mut self, offset: u64, len: u64) -> io::Result<Vec<u64>> {
        let first = offset.div_ceil(BLOCK_SIZE);
        let end = (offset + len) / BLOCK_SIZE;
        let (mut freed, mut kept) = (Vec::new(), Vec::new());
        for block in first..end {
            if !self.is_mapped(block) {
                continue;
            }
            if !punch_hole(&self.overlay, self.block_offset(block), BLOCK_SIZE) {
                kept.push(block);
                continue;
            }
            let word = usize::try_from(block / 64).map_err(|_| io::ErrorKind::InvalidInput)?;
            self.map[word] &= !(1 << (block % 64));
            self.mapped -= 1;
            freed.push(block);
        }
        if let (Some(&lo), Some(&hi)) = (freed.first(), freed.last()) {
            let (w0, w1) = (lo / 64, hi / 64);
            let words = &self.map[usize::try_from(w0).unwrap_or(0)..=usize::try_from(w1).unwrap_or(0)];
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            self.overlay.write_all_at(&bytes, HEADER_SIZE + w0 * 8)?;
        }
        Ok(kept)
    }

    /// Zeroes the whole blocks `first..end`: a block whose base is zero
    /// leaves the overlay (or never enters it), the others are written as
    /// zeros. Consecutive blocks of one kind are handled as one range.
    fn zero_blocks(&mut self, first: u64, end: u64) -> io::Result<()> {
        const SCAN_BLOCKS: u64 = 256;
        let mut scan = vec![0u8; BLOCK_BYTES * 256];
        // The pending range: (first block, blocks, base is zero there).
        let mut run: Option<(u64, u64, bool)> = None;
        let mut at = first;
        while at < end {
            let count = (end - at).min(SCAN_BLOCKS);
            let bytes = &mut scan[..usize::try_from(count * BLOCK_SIZE).unwrap_or(0)];
            read_or_zero(&self.base, bytes, at * BLOCK_SIZE)?;
            for (i, block) in bytes.chunks_exact(BLOCK_BYTES).enumerate() {
                let zero = block.iter().all(|b| *b == 0);
                let number = at + i as u64;
                run = match run {
                    Some((start, n, kind)) if kind == zero => Some((start, n + 1, kind)),
                    Some(done) => {
                        self.zero_run(done)?;
                        Some((number, 1, zero))
                    }
                    None => Some((number, 1, zero)),
                };
            }
            at += count;
        }
        run.map_or(Ok(()), |done| self.zero_run(done))
    }

    fn zero_run(&mut self, (start, blocks, base_is_zero): (u64, u64, bool)) -> io::Result<()> {
        if base_is_zero {
            // A block that could not leave the overlay is zeroed in it.
            for block in self.free(start * BLOCK_SIZE, blocks * BLOCK_SIZE)? {
                write_zeros_through(|buf, at| self.write_at(buf, at), block * BLOCK_SIZE, BLOCK_SIZE)?;
            }
            Ok(())
        } else {
            write_zeros_through(|buf, at| self.write_at(buf, at), start * BLOCK_SIZE, blocks * BLOCK_SIZE)
        }
    }
}

/// Gives a range of a file's space back; whether it did (a file system
/// without hole punching keeps the space).
fn punch_hole(file: &File, offset: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return false };
    // SAFETY: fallocate on a descriptor `file` owns; no memory is passed.
    let rc = unsafe {
        libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
    };
    if rc != 0 {
        tracing::debug!("virtio-blk: cannot punch a hole in the overlay: {}", io::Error::last_os_error());
    }
    rc == 0
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    fn base(len: usize) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(f.path(), bytes).expect("base written");
        f
    }

    fn expected(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn unwritten_blocks_read_from_the_base_and_writes_stay_in_the_overlay() {
        let b = base(64 * 1024 + 512);
        let dir = tempfile::tempdir().expect("dir");
        let ov = dir.path().join("overlay.img");
        let mut disk = CowDisk::open(b.path(), &ov, 1 << 20).expect("opens");
        assert_eq!(disk.size(), 64 * 1024 + 512);
        let mut all = vec![0u8; 64 * 1024 + 512];
        disk.read_at(&mut all, 0).expect("reads");
        assert_eq!(all, expected(all.len()));
        // Unaligned writes across block boundaries, and the partial last block.
        let mut want = expected(all.len());
        for (at, len, byte) in [(100u64, 5000usize, 0xaau8), (8192, 8192, 0xbb), (65536, 512, 0xcc), (4095, 2, 0xdd)] {
            let data = vec![byte; len];
            disk.write_at(&data, at).expect("writes");
            let at = usize::try_from(at).expect("small");
            want[at..at + len].copy_from_slice(&data);
        }
        disk.read_at(&mut all, 0).expect("reads");
        assert_eq!(all, want);
        let mut mid = vec![0u8; 3000];
        disk.read_at(&mut mid, 7000).expect("reads");
        assert_eq!(mid, want[7000..10000]);
        assert_eq!(std::fs::read(b.path()).expect("base"), expected(all.len()), "the base is untouched");
        assert_eq!(disk.used_bytes(), 5 * BLOCK_SIZE, "blocks 0, 1, 2, 3 and 16");
        disk.flush().expect("flushes");
        drop(disk);
        // The overlay and its map persist.
        let mut disk = CowDisk::open(b.path(), &ov, 1 << 20).expect("reopens");
        assert_eq!(disk.used_bytes(), 5 * BLOCK_SIZE);
        disk.read_at(&mut all, 0).expect("reads");
        assert_eq!(all, want);
        // Sparse: only the written blocks take space.
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(&ov).expect("meta").blocks() * 512;
        assert!(blocks <= 16 * 4096, "{blocks} bytes allocated");
    }

    #[test]
    fn a_full_overlay_refuses_new_blocks_but_rewrites_mapped_ones() {
        let b = base(1 << 20);
        let dir = tempfile::tempdir().expect("dir");
        let ov = dir.path().join("overlay.img");
        let mut disk = CowDisk::open(b.path(), &ov, 2 * BLOCK_SIZE).expect("opens");
        disk.write_at(&[1u8; 8192], 0).expect("two blocks fit");
        let e = disk.write_at(&[2u8; 4096], 8192).expect_err("a third does not");
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        let e = disk.write_at(&[3u8; 8192], 4096).expect_err("a write half in a new block fails whole");
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        disk.write_at(&[4u8; 100], 10).expect("rewrites fit");
        let mut got = vec![0u8; 16384];
        disk.read_at(&mut got, 0).expect("reads");
        let mut want = vec![1u8; 8192];
        want[10..110].fill(4);
        want.extend_from_slice(&expected(16384)[8192..]);
        assert_eq!(got, want, "nothing of the refused writes landed");
        assert_eq!(disk.used_bytes(), 2 * BLOCK_SIZE);
    }

    #[test]
    fn discarded_blocks_leave_the_overlay_and_read_as_the_base() {
        let b = base(1 << 20);
        let dir = tempfile::tempdir().expect("dir");
        let mut disk = CowDisk::open(b.path(), &dir.path().join("ov"), 4 * BLOCK_SIZE).expect("opens");
        disk.write_at(&[9u8; 16384], 0).expect("four blocks");
        assert!(disk.write_at(&[9u8; 512], 65536).is_err(), "full");
        // Blocks 1 and 2 are wholly inside; 0 and 3 only in part and stay.
        disk.discard(100, 12200).expect("discards");
        assert_eq!(disk.used_bytes(), 2 * BLOCK_SIZE);
        let mut got = vec![0u8; 16384];
        disk.read_at(&mut got, 0).expect("reads");
        assert_eq!(&got[..4096], &[9u8; 4096][..]);
        assert_eq!(&got[4096..12288], &expected(12288)[4096..]);
        assert_eq!(&got[12288..], &[9u8; 4096][..]);
        disk.write_at(&[7u8; 512], 65536).expect("room again");
        drop(disk);
        let disk = CowDisk::open(b.path(), &dir.path().join("ov"), 4 * BLOCK_SIZE).expect("reopens");
        assert_eq!(disk.used_bytes(), 3 * BLOCK_SIZE, "the map on disk agrees");
    }

    #[test]
    fn zeroing_blocks_whose_base_is_zero_costs_no_overlay_space() {
        // Blocks 0-3 hold data in the base, 4-15 are zero.
        let f = tempfile::NamedTempFile::new().expect("temp file");
        let mut bytes = vec![0u8; 16 * 4096];
        bytes[..4 * 4096].fill(5);
        std::fs::write(f.path(), &bytes).expect("base written");
        let dir = tempfile::tempdir().expect("dir");
        let mut disk = CowDisk::open(f.path(), &dir.path().join("ov"), 6 * BLOCK_SIZE).expect("opens");
        disk.write_at(&[8u8; 4096], 10 * 4096).expect("a block of data where the base is zero");
        assert_eq!(disk.used_bytes(), BLOCK_SIZE);
        // Everything from byte 2 of block 1 to byte 100 of block 15: the
        // partial blocks at either end and blocks 2-3 (base data) take room;
        // blocks 4-14 (base zero) take none, and block 10 leaves the overlay.
        disk.write_zeroes(4096 + 2, 14 * 4096 - 2 + 100).expect("zeroes");
        assert_eq!(disk.used_bytes(), 4 * BLOCK_SIZE, "blocks 1, 2, 3 and 15");
        let mut got = vec![1u8; 16 * 4096];
        disk.read_at(&mut got, 0).expect("reads");
        let mut want = vec![0u8; 16 * 4096];
        want[..4096 + 2].fill(5);
        assert_eq!(got, want);
        // All of it, whole blocks only: 0-3 hold zeros over the base's
        // data, 15 (zero in the base) leaves the overlay.
        disk.write_zeroes(0, 16 * 4096).expect("zeroes");
        assert_eq!(disk.used_bytes(), 4 * BLOCK_SIZE, "blocks 0-3");
        disk.read_at(&mut got, 0).expect("reads");
        assert_eq!(got, vec![0u8; 16 * 4096]);
    }

    #[test]
    fn an_overlay_of_another_base_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let ov = dir.path().join("overlay.img");
        CowDisk::open(base(8192).path(), &ov, 1 << 20).expect("creates");
        let e = CowDisk::open(base(16384).path(), &ov, 1 << 20).expect_err("size differs");
        assert!(matches!(e, CowError::Mismatch { .. }), "{e}");
        std::fs::write(&ov, b"not an overlay").expect("garbage");
        let e = CowDisk::open(base(8192).path(), &ov, 1 << 20).expect_err("garbage");
        assert!(e.to_string().contains("MOATCOW1"), "{e}");
    }
}

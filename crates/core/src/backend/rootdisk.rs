//! What a microVM's root disk can hold: read from the ext4 superblock of
//! the image's `rootfs.ext4`.
//!
//! A VM's writes land in its copy-on-write overlay, bounded on the host.
//! The guest learns its `disk_mib` as free space (the agent holds the rest,
//! see `moat_agent::boot::reserve_beyond`), so the overlay must also have
//! room for what ext4 writes outside its free blocks: inode tables,
//! journal, bitmaps and descriptors, and the blocks reserved for root. The
//! superblock says how much that is. A few fields at fixed offsets: read by
//! hand rather than through a crate that parses whole file systems.

use std::io::Read;
use std::path::Path;

/// The numbers of an ext4 file system that size a VM's overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootDisk {
    /// Bytes an unprivileged writer can still allocate.
    pub available: u64,
    /// Bytes ext4 may write outside the free blocks: inode tables, the
    /// journal, the root-reserved blocks and per-group metadata.
    pub metadata: u64,
}

/// Where the superblock starts, and its length.
const SUPERBLOCK: u64 = 1024;
const SUPERBLOCK_LEN: usize = 1024;
const MAGIC: u16 = 0xEF53;
/// `INCOMPAT_64BIT`: block counts have high halves.
const INCOMPAT_64BIT: u32 = 0x80;
/// Room beyond the inode tables, journal and reserved blocks (bitmaps and
/// descriptors take another 1/1024 of the disk, added in `parse`).
const SLACK: u64 = 8 << 20;

impl RootDisk {
    /// Reads the superblock of the ext4 image at `path`.
    pub fn read(path: &Path) -> std::io::Result<Self> {
        use std::io::Seek;
        let mut file = std::fs::File::open(path)?;
        file.seek(std::io::SeekFrom::Start(SUPERBLOCK))?;
        let mut sb = [0u8; SUPERBLOCK_LEN];
        file.read_exact(&mut sb)?;
        Self::parse(&sb).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is not an ext4 file system (no superblock magic)", path.display()),
            )
        })
    }

    /// The numbers in a superblock's bytes; `None` without ext4's magic.
    pub fn parse(sb: &[u8; SUPERBLOCK_LEN]) -> Option<Self> {
        let u16_at = |at: usize| u64::from(u16::from_le_bytes([sb[at], sb[at + 1]]));
        let u32_at = |at: usize| u64::from(u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]));
        if u16_at(0x38) != u64::from(MAGIC) {
            return None;
        }
        let wide = u32_at(0x60) & u64::from(INCOMPAT_64BIT) != 0;
        let count = |lo: usize, hi: usize| u32_at(lo) | if wide { u32_at(hi) << 32 } else { 0 };
        let block_size = 1024u64 << u32_at(0x18).min(6);
        let blocks = count(0x04, 0x150);
        let reserved = count(0x08, 0x154);
        let free = count(0x0C, 0x158);
        let inode_tables = u32_at(0x00) * u16_at(0x58).max(128);
        // s_jnl_blocks keeps a copy of the journal inode: [15] and [16]
        // are its size's high and low halves.
        let journal = (u32_at(0x10C + 15 * 4) << 32) | u32_at(0x10C + 16 * 4);
        Some(Self {
            available: free.saturating_sub(reserved) * block_size,
            metadata: inode_tables + journal + reserved * block_size + blocks * block_size / 1024 + SLACK,
        })
    }

    /// How much a VM whose guest may write `disk_mib` MiB may hold in its
    /// overlay, in MiB.
    pub fn overlay_limit_mib(&self, disk_mib: u64) -> u64 {
        disk_mib + self.metadata.div_ceil(1 << 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_file_system_reads_as_mkfs_made_it() {
        let Some(mkfs) = crate::programs::find_program("mkfs.ext4") else {
            eprintln!("skipping: no mkfs.ext4 (Debian's e2fsprogs)");
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("disk.ext4");
        let status = std::process::Command::new(mkfs)
            .args(["-q", "-F", "-b", "4096", "-N", "4096", "-I", "256", "-J", "size=4", "-m", "5", "-O", "64bit"])
            .arg(&image)
            .arg("64M")
            .status()
            .expect("mkfs.ext4 runs");
        assert!(status.success());
        let disk = RootDisk::read(&image).expect("reads the superblock");
        // 16384 blocks of 4 KiB, 819 reserved; the inode tables (1 MiB) and
        // the journal (4 MiB) are not free.
        assert!(disk.available < (64 << 20) - (5 << 20) - 819 * 4096, "{disk:?}");
        assert!(disk.available > 50 << 20, "{disk:?}");
        assert_eq!(disk.metadata, (1 << 20) + (4 << 20) + 819 * 4096 + (64 << 10) + SLACK);
        assert_eq!(disk.overlay_limit_mib(100), 100 + 17);
    }

    #[test]
    fn what_is_not_ext4_is_refused() {
        assert_eq!(RootDisk::parse(&[0; SUPERBLOCK_LEN]), None);
        let file = tempfile::NamedTempFile::new().expect("tempfile");
        std::fs::write(file.path(), vec![0u8; 4096]).expect("zeros");
        let err = RootDisk::read(file.path()).expect_err("zeros are no file system");
        assert!(err.to_string().contains("not an ext4 file system"), "{err}");
    }
}

//! What a virtio-blk device reads and writes: a `DiskBackend`. A plain file
//! (`RawDisk`) or a copy-on-write overlay on a shared base (`CowDisk`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// A disk's bytes. Offsets and lengths are checked against `size` by the
/// device before they get here.
pub trait DiskBackend: Send {
    /// The disk's size in bytes (a multiple of 512).
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`; `ErrorKind::StorageFull` when a bounded
    /// overlay has no room left (and nothing was written).
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> io::Result<()>;
    /// The guest no longer needs `len` bytes at `offset`: a hint, after
    /// which their content is unspecified. Nothing by default.
    fn discard(&mut self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Writes `len` zero bytes at `offset`.
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        write_zeros_through(|buf, at| self.write_at(buf, at), offset, len)
    }
}

/// Writes `len` zero bytes at `offset` through `write`, a megabyte at a time.
pub(crate) fn write_zeros_through(
    mut write: impl FnMut(&[u8], u64) -> io::Result<()>,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let zeros = vec![0u8; usize::try_from(len.min(CHUNK)).unwrap_or(0)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        write(&zeros[..usize::try_from(n).unwrap_or(0)], offset + done)?;
        done += n;
    }
    Ok(())
}

/// Reads `buf.len()` bytes at `offset`, zeros past the end of the file.
pub(crate) fn read_or_zero(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        match file.read_at(&mut buf[done..], at) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A disk that is a file, used as is.
#[derive(Debug)]
pub struct RawDisk {
    file: File,
    size: u64,
}

impl RawDisk {
    /// Opens `path`, read-only or read-write.
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new().read(true).write(!read_only).open(path)?;
        let size = file.metadata()?.len() / 512 * 512;
        Ok(Self { file, size })
    }
}

impl DiskBackend for RawDisk {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        read_or_zero(&self.file, buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

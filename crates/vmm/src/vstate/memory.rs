//! Guest memory: anonymous, private, `MAP_NORESERVE` mappings, so memory the
//! guest never touches costs the host nothing; split around the MMIO hole;
//! 2 MiB-aligned and backed by transparent huge pages where the host allows.

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use crate::arch::x86_64::layout::ram_ranges;

/// Why guest memory could not be created.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("Cannot map {size} bytes of guest memory; lower the VM's memory or free host memory")]
    Map { size: u64, source: vm_memory::mmap::MmapRegionError },
    #[error("Guest memory regions overlap or are empty (a bug in the memory layout)")]
    Regions(#[source] vm_memory::GuestRegionCollectionError),
    #[error("Guest memory of {0} bytes does not fit this host's address space")]
    TooLarge(u64),
}

const HUGE_PAGE: usize = 2 << 20;

/// An anonymous `MAP_NORESERVE` mapping of `bytes` at a 2 MiB-aligned
/// address, advised to use transparent huge pages (as QEMU and Cloud
/// Hypervisor do). A guest page first touched costs KVM a nested-page
/// fault; KVM maps a 2 MiB page at once only when the host page is huge
/// and guest and host addresses agree modulo 2 MiB, hence the alignment.
/// Untouched memory still costs nothing; advice the host refuses is no
/// error.
///
/// The mapping is never unmapped: moat-vmm runs one VM per process, and
/// its guest memory lives as long as the process.
fn map_huge_aligned(bytes: usize) -> Result<vm_memory::mmap::MmapRegion, vm_memory::mmap::MmapRegionError> {
    use vm_memory::mmap::MmapRegionError;
    let total = bytes.checked_add(HUGE_PAGE).ok_or(MmapRegionError::InvalidPointer)?;
    let flags = libc::MAP_ANONYMOUS | libc::MAP_PRIVATE | libc::MAP_NORESERVE;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new anonymous mapping at an address the kernel chooses;
    // no existing memory is affected.
    let raw = unsafe { libc::mmap(std::ptr::null_mut(), total, prot, flags, -1, 0) };
    if raw == libc::MAP_FAILED {
        return Err(MmapRegionError::Mmap(std::io::Error::last_os_error()));
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (aligned - start, start + total - (aligned + bytes));
    // SAFETY: both ranges lie inside the mapping just made and outside the
    // part kept; nothing refers to them.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + bytes) as *mut libc::c_void, tail);
        }
    }
    // SAFETY: the kept range is exactly [aligned, aligned + bytes), mapped
    // above; madvise only changes how the kernel backs it.
    if unsafe { libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) } != 0 {
        tracing::debug!("no transparent huge pages for guest memory: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `aligned` is a private anonymous read-write mapping of
    // `bytes`, page-aligned, that nothing else uses and that stays mapped
    // for the life of the process.
    unsafe { MmapRegionBuilder::new(bytes).with_raw_mmap_pointer(aligned as *mut u8) }
        .with_mmap_prot(prot)
        .with_mmap_flags(flags)
        .build()
}

/// A kernel or initramfs file as a reader of guest memory's boot images
/// that maps rather than copies: every whole page of the file that lands on
/// a whole page of guest memory is mapped there privately (copy-on-write)
/// from the file, the rest is copied.
///
/// Why: copying a 45 MiB `vmlinux` into fresh guest memory faults in and
/// zeroes that memory, then copies over it, before the guest runs at all
/// (1 to 3 s of a nested host's boot, measured; milliseconds on hardware).
/// Mapped, the VM starts at once, the guest faults in only the pages it
/// touches, straight from the page cache, and every microVM of an image
/// shares the kernel pages it never writes. The guest's writes copy the
/// page (`MAP_PRIVATE`); the file is never written. Images are replaced by
/// rename, never rewritten in place, so a running VM's kernel cannot change
/// under it.
///
/// It is a reader (`Read`, `Seek`, `ReadVolatile`) so that `linux-loader`
/// still parses and places the kernel: its segment reads arrive here with
/// their destination in guest memory. Destinations outside `mem` (and
/// files that cannot be mapped) are read as by `read(2)`.
#[derive(Debug)]
pub struct BootImageFile<'a> {
    file: &'a std::fs::File,
    len: u64,
    pos: u64,
    mem: &'a GuestMemoryMmap,
    mapped: u64,
}

impl<'a> BootImageFile<'a> {
    pub fn new(file: &'a std::fs::File, mem: &'a GuestMemoryMmap) -> std::io::Result<Self> {
        Ok(Self { file, len: file.metadata()?.len(), pos: 0, mem, mapped: 0 })
    }

    /// Bytes mapped rather than copied so far.
    pub fn mapped(&self) -> u64 {
        self.mapped
    }

    /// Whether `[addr, addr + len)` lies inside one guest memory mapping.
    fn in_guest_memory(&self, addr: usize, len: usize) -> bool {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
        self.mem.iter().any(|region| {
            region.get_host_address(MemoryRegionAddress(0)).is_ok_and(|host| {
                let (start, size) = (host as usize, usize::try_from(region.len()).unwrap_or(0));
                addr >= start && addr.checked_add(len).is_some_and(|end| end <= start + size)
            })
        })
    }

    /// Copies `len` bytes at the file's `offset` to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes.
    unsafe fn copy(&self, dst: *mut u8, offset: u64, len: usize) -> std::io::Result<()> {
        let mut done = 0;
        while done < len {
            let at = libc::off_t::try_from(offset + done as u64).map_err(|_| std::io::ErrorKind::InvalidInput)?;
            // SAFETY: `dst + done .. dst + len` is valid for writes (the
            // caller's promise); pread writes at most `len - done` bytes.
            let n = unsafe {
                libc::pread(
                    std::os::fd::AsRawFd::as_raw_fd(self.file),
                    dst.add(done).cast(),
                    len - done,
                    at,
                )
            };
            match n {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n if n < 0 => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                n => done += n.unsigned_abs(),
            }
        }
        Ok(())
    }

    /// Maps `len` bytes (whole pages) of the file at `offset` over guest
    /// memory at `dst`. `Ok(false)`: the file cannot be mapped (nothing
    /// changed; copy instead).
    ///
    /// # Safety
    /// `dst .. dst + len` must be page-aligned guest memory inside one of
    /// `mem`'s mappings that nothing reads or writes during the call.
    unsafe fn map(&self, dst: *mut u8, offset: u64, len: usize) -> std::io::Result<bool> {
        let offset = libc::off_t::try_from(offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let fd = std::os::fd::AsRawFd::as_raw_fd(self.file);
        // First where the kernel chooses, so that a file that cannot be
        // mapped leaves guest memory as it was.
        // SAFETY: a new private mapping of the file; no existing memory is
        // affected.
        let probe = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_PRIVATE, fd, offset) };
        if probe == libc::MAP_FAILED {
            return Ok(false);
        }
        // SAFETY: moves the mapping just made over `dst .. dst + len`, which
        // the caller guarantees is guest memory no one is using: the range
        // stays mapped read-write, now to the file's pages.
        let moved = unsafe {
            libc::mremap(probe, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, dst.cast::<libc::c_void>())
        };
        if moved == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: unmapping the probe mapping made above, unused.
            unsafe { libc::munmap(probe, len) };
            return Err(e);
        }
        Ok(true)
    }
}

impl std::io::Read for BootImageFile<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = std::os::unix::fs::FileExt::read_at(self.file, buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl std::io::Seek for BootImageFile<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            std::io::SeekFrom::Start(n) => Some(n),
            std::io::SeekFrom::End(d) => self.len.checked_add_signed(d),
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or(std::io::ErrorKind::InvalidInput)?;
        Ok(self.pos)
    }
}

impl vm_memory::ReadVolatile for BootImageFile<'_> {
    /// Fills all of `buf` (up to the end of the file) in one call, as a
    /// regular file's `read` would: the guest memory readers of vm-memory
    /// expect no short reads.
    fn read_volatile<B: vm_memory::bitmap::BitmapSlice>(
        &mut self,
        buf: &mut vm_memory::VolatileSlice<B>,
    ) -> Result<usize, vm_memory::VolatileMemoryError> {
        const PAGE: usize = 4096;
        let want = usize::try_from(self.len.saturating_sub(self.pos)).unwrap_or(usize::MAX).min(buf.len());
        let guard = buf.ptr_guard_mut();
        let dst = guard.as_ptr();
        let (addr, pos) = (dst as usize, self.pos);
        // Pages can be mapped where the destination and the file offset
        // agree within a page.
        let head = (PAGE - addr % PAGE) % PAGE;
        let pages = want.saturating_sub(head) / PAGE * PAGE;
        let mut mapped = 0;
        if pages > 0 && addr % PAGE == usize::try_from(pos % PAGE as u64).unwrap_or(1) && self.in_guest_memory(addr, want)
        {
            // SAFETY: `dst + head .. + pages` is page-aligned and inside one
            // guest memory mapping (checked just above); the VM is being
            // built, so nothing else touches guest memory now.
            if unsafe { self.map(dst.add(head), pos + head as u64, pages) }.map_err(vm_memory::VolatileMemoryError::IOError)? {
                mapped = pages;
            }
        }
        let copy = |from: usize, len: usize| {
            // SAFETY: `from + len <= want <= buf.len()`: inside `buf`,
            // valid for writes while its guard lives.
            unsafe { self.copy(dst.add(from), pos + from as u64, len) }.map_err(vm_memory::VolatileMemoryError::IOError)
        };
        if mapped > 0 {
            copy(0, head)?;
            copy(head + pages, want - head - pages)?;
        } else {
            copy(0, want)?;
        }
        buf.bitmap().mark_dirty(0, want);
        self.pos += want as u64;
        self.mapped += mapped as u64;
        Ok(want)
    }
}

/// Maps `size` bytes of guest RAM.
pub fn create_guest_memory(size: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let mut regions = Vec::new();
    for (start, len) in ram_ranges(size) {
        let bytes = usize::try_from(len).map_err(|_| MemoryError::TooLarge(size))?;
        let mapping = map_huge_aligned(bytes).map_err(|e| MemoryError::Map { size, source: e })?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(start)).ok_or(MemoryError::TooLarge(size))?;
        regions.push(region);
    }
    GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Regions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{HIGH_RAM_START, MMIO_HOLE_START};
    use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

    /// A file of `len` bytes, each `i * 7 % 251`, and the bytes.
    fn pattern_file(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| u8::try_from(i * 7 % 251).expect("< 251")).collect();
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        std::io::Write::write_all(&mut file, &bytes).expect("written");
        (file, bytes)
    }

    /// The host mappings of `/proc/self/maps` that cover `[start, end)` and name `path`.
    fn mapped_from(path: &std::path::Path, start: usize, end: usize) -> usize {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        maps.lines()
            .filter(|l| l.ends_with(&*path.to_string_lossy()))
            .filter_map(|l| {
                let (a, b) = l.split_whitespace().next()?.split_once('-')?;
                let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
                Some(b.min(end).saturating_sub(a.max(start)))
            })
            .sum()
    }

    #[test]
    fn boot_image_pages_are_mapped_copy_on_write_and_the_rest_copied() {
        use std::io::{Seek, SeekFrom};
        use vm_memory::{Bytes, GuestMemoryBackend, ReadVolatile};
        let mem = create_guest_memory(64 << 20).expect("maps");
        // 5 pages and a bit, read from offset 0x123 of the file to guest
        // 0x10_0123: the 0x123 head and the tail are copied, 4 pages mapped.
        let (file, bytes) = pattern_file(5 * 4096 + 100);
        let mut image = BootImageFile::new(file.as_file(), &mem).expect("opens");
        image.seek(SeekFrom::Start(0x123)).expect("seeks");
        let len = bytes.len() - 0x123;
        let mut slice = mem.get_slice(GuestAddress(0x10_0123), len).expect("in memory");
        assert_eq!(image.read_volatile(&mut slice).expect("reads"), len, "all of it in one call");
        assert_eq!(image.mapped(), 4 * 4096);
        let mut back = vec![0u8; len];
        mem.read_slice(&mut back, GuestAddress(0x10_0123)).expect("readable");
        assert!(back == bytes[0x123..], "guest memory holds the file's bytes");
        let host = mem.get_host_address(GuestAddress(0x10_0000)).expect("host address") as usize;
        assert_eq!(mapped_from(file.path(), host, host + 6 * 4096), 4 * 4096, "4 pages come from the file");
        // The guest's writes stay in guest memory: the file is unchanged.
        mem.write_slice(&[0xee; 8192], GuestAddress(0x10_1000)).expect("writable");
        assert_eq!(std::fs::read(file.path()).expect("file"), bytes);
        let mut page = [0u8; 4096];
        mem.read_slice(&mut page, GuestAddress(0x10_1000)).expect("readable");
        assert_eq!(page, [0xee; 4096]);

        // Offsets that disagree within a page, and memory not the guest's,
        // are copied.
        let mut image = BootImageFile::new(file.as_file(), &mem).expect("opens");
        image.seek(SeekFrom::Start(1)).expect("seeks");
        let mut slice = mem.get_slice(GuestAddress(0x20_0000), 3 * 4096).expect("in memory");
        assert_eq!(image.read_volatile(&mut slice).expect("reads"), 3 * 4096);
        let mut back = vec![0u8; 3 * 4096];
        mem.read_slice(&mut back, GuestAddress(0x20_0000)).expect("readable");
        assert!(back == bytes[1..=3 * 4096]);
        let mut heap = vec![0u8; 8 * 4096];
        let mut image = BootImageFile::new(file.as_file(), &mem).expect("opens");
        // SAFETY: `heap` outlives the slice and nothing else uses it meanwhile.
        let mut slice = unsafe { vm_memory::VolatileSlice::new(heap.as_mut_ptr(), heap.len()) };
        assert_eq!(image.read_volatile(&mut slice).expect("reads"), bytes.len(), "to the end of the file");
        assert_eq!(image.mapped(), 0);
        assert!(heap[..bytes.len()] == bytes[..]);
    }

    #[test]
    fn small_memory_is_one_region() {
        let mem = create_guest_memory(64 << 20).expect("maps");
        assert_eq!(mem.num_regions(), 1);
        assert_eq!(mem.last_addr().raw_value(), (64 << 20) - 1);
    }

    #[test]
    fn large_memory_skips_the_hole_without_committing_it() {
        // 5 GiB of guest memory is only address space until touched.
        let mem = create_guest_memory(5 << 30).expect("maps with MAP_NORESERVE");
        let regions: Vec<_> = mem.iter().map(|r| (r.start_addr().raw_value(), r.len())).collect();
        assert_eq!(regions, vec![(0, MMIO_HOLE_START), (HIGH_RAM_START, (5 << 30) - MMIO_HOLE_START)]);
        assert!(mem.address_in_range(GuestAddress(MMIO_HOLE_START - 1)));
        assert!(!mem.address_in_range(GuestAddress(MMIO_HOLE_START)));
    }
}

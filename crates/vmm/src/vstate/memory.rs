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

//! Guest memory: anonymous, private, `MAP_NORESERVE` mappings, so memory the
//! guest never touches costs the host nothing; split around the MMIO hole.

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

/// Maps `size` bytes of guest RAM.
pub fn create_guest_memory(size: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let mut regions = Vec::new();
    for (start, len) in ram_ranges(size) {
        let bytes = usize::try_from(len).map_err(|_| MemoryError::TooLarge(size))?;
        let mapping = MmapRegionBuilder::new(bytes)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_ANONYMOUS | libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|source| MemoryError::Map { size, source })?;
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

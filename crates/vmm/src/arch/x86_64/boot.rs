//! Loading Linux and describing the machine to it: the kernel (ELF `vmlinux`
//! entered by its PVH note or 64-bit entry, bzImage as a fallback), the
//! initramfs, the command line, the e820 map, and the zero page or PVH
//! start_info that carries them.

use std::fs::File;
use std::io::{Seek, SeekFrom};

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{BzImage, KernelLoader};
use vm_memory::{Address, ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, ReadVolatile};

use super::layout::{
    ACPI_END, ACPI_START, CMDLINE_ADDR, CMDLINE_MAX_SIZE, EBDA_START, HIGH_RAM_START, HIMEM_START, MMIO_HOLE_START,
    PVH_INFO_ADDR, PVH_MEMMAP_ADDR, ZERO_PAGE_ADDR, ram_ranges,
};
use super::regs::EntryPoint;

/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// Linux boot protocol constants (Documentation/arch/x86/boot.rst).
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
/// `hvm_start_info.magic` (xen/include/public/arch-x86/hvm/start_info.h).
const PVH_START_MAGIC: u32 = 0x336e_c578;
/// A bzImage's 64-bit entry is 0x200 past its protected-mode load address.
const BZIMAGE_STARTUP_64_OFFSET: u64 = 0x200;
const PAGE_SIZE: u64 = 4096;

/// One e820 / PVH memory map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// Why the guest could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("The kernel is neither an ELF vmlinux nor a bzImage; pass the kernel's vmlinux (or bzImage) file")]
    Kernel { elf: linux_loader::loader::Error, bzimage: linux_loader::loader::Error },
    #[error("Cannot read the kernel file")]
    ReadKernel(#[source] std::io::Error),
    #[error("The initramfs ({size} bytes) does not fit in guest memory above the kernel; give the VM more memory")]
    InitramfsTooLarge { size: u64 },
    #[error("Cannot read the initramfs file")]
    ReadInitramfs(#[source] std::io::Error),
    #[error("Cannot copy the initramfs into guest memory")]
    WriteInitramfs(#[source] vm_memory::GuestMemoryError),
    #[error("The kernel command line is {len} bytes; at most {max} fit", max = CMDLINE_MAX_SIZE - 1)]
    CmdlineTooLong { len: usize },
    #[error("The kernel command line contains a NUL byte")]
    CmdlineNul,
    #[error("Cannot write the boot parameters into guest memory")]
    WriteParams(#[source] vm_memory::GuestMemoryError),
}

/// What loading the kernel found.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// The 64-bit entry point.
    pub entry: u64,
    /// The PVH entry point, when the ELF has the note.
    pub pvh_entry: Option<u64>,
    /// A bzImage's setup header, to be the base of the zero page's.
    pub setup_header: Option<setup_header>,
    /// First byte after the loaded kernel.
    pub end: u64,
}

/// Where the initramfs landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Initramfs {
    pub addr: u64,
    pub size: u64,
}

/// Loads `kernel` as an ELF, or as a bzImage when it is not one.
pub fn load_kernel(mem: &GuestMemoryMmap, kernel: &mut File) -> Result<LoadedKernel, BootError> {
    let himem = Some(GuestAddress(HIMEM_START));
    let elf = match Elf::load(mem, None, kernel, himem) {
        Ok(result) => {
            let pvh_entry = match result.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => Some(addr.raw_value()),
                _ => None,
            };
            return Ok(LoadedKernel {
                entry: result.kernel_load.raw_value(),
                pvh_entry,
                setup_header: None,
                end: result.kernel_end,
            });
        }
        Err(e) => e,
    };
    kernel.seek(SeekFrom::Start(0)).map_err(BootError::ReadKernel)?;
    match BzImage::load(mem, None, kernel, himem) {
        Ok(result) => Ok(LoadedKernel {
            entry: result.kernel_load.raw_value() + BZIMAGE_STARTUP_64_OFFSET,
            pvh_entry: None,
            setup_header: result.setup_header,
            end: result.kernel_end,
        }),
        Err(bzimage) => Err(BootError::Kernel { elf, bzimage }),
    }
}

/// Copies the initramfs to the top of RAM below the MMIO hole, page aligned.
pub fn load_initramfs(mem: &GuestMemoryMmap, file: &mut File, kernel_end: u64) -> Result<Initramfs, BootError> {
    let size = file.metadata().map_err(BootError::ReadInitramfs)?.len();
    let low_end = mem.last_addr().raw_value().min(MMIO_HOLE_START - 1) + 1;
    let addr = low_end.checked_sub(size).map(|a| a & !(PAGE_SIZE - 1)).filter(|a| *a >= kernel_end.max(HIMEM_START));
    let addr = addr.ok_or(BootError::InitramfsTooLarge { size })?;
    let len = usize::try_from(size).map_err(|_| BootError::InitramfsTooLarge { size })?;
    let slice = mem.get_slice(GuestAddress(addr), len).map_err(BootError::WriteInitramfs)?;
    let mut done = 0;
    while done < len {
        let mut rest = slice.subslice(done, len - done).map_err(|e| BootError::WriteInitramfs(e.into()))?;
        match file.read_volatile(&mut rest) {
            Ok(0) => {
                return Err(BootError::ReadInitramfs(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(n) => done += n,
            Err(e) => return Err(BootError::ReadInitramfs(std::io::Error::other(e))),
        }
    }
    Ok(Initramfs { addr, size })
}

/// The memory map: RAM below the EBDA, the ACPI area reserved, RAM from
/// 1 MiB up to the MMIO hole, and RAM above 4 GiB when there is more.
pub fn e820_map(mem_size: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry { addr: 0, size: EBDA_START, kind: E820_RAM },
        E820Entry { addr: ACPI_START, size: ACPI_END - ACPI_START, kind: E820_RESERVED },
    ];
    for (start, size) in ram_ranges(mem_size) {
        if start == 0 {
            map.push(E820Entry { addr: HIMEM_START, size: size - HIMEM_START, kind: E820_RAM });
        } else {
            debug_assert_eq!(start, HIGH_RAM_START);
            map.push(E820Entry { addr: start, size, kind: E820_RAM });
        }
    }
    map
}

/// Writes the command line (NUL-terminated) at its fixed address.
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &str) -> Result<(), BootError> {
    if cmdline.len() >= CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong { len: cmdline.len() });
    }
    if cmdline.contains('\0') {
        return Err(BootError::CmdlineNul);
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(CMDLINE_ADDR)).map_err(BootError::WriteParams)
}

/// Builds the zero page for the Linux 64-bit boot protocol.
pub fn zero_page(
    kernel: &LoadedKernel,
    cmdline_len: usize,
    initramfs: Option<Initramfs>,
    mem_size: u64,
    rsdp: u64,
) -> boot_params {
    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = u32::try_from(CMDLINE_ADDR).unwrap_or_default();
    params.hdr.cmdline_size = u32::try_from(cmdline_len).unwrap_or_default();
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    if let Some(initramfs) = initramfs {
        // Both are below the MMIO hole, so they fit 32 bits.
        params.hdr.ramdisk_image = u32::try_from(initramfs.addr).unwrap_or_default();
        params.hdr.ramdisk_size = u32::try_from(initramfs.size).unwrap_or_default();
    }
    params.acpi_rsdp_addr = rsdp;
    let map = e820_map(mem_size);
    for (slot, entry) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry { addr: entry.addr, size: entry.size, r#type: entry.kind };
    }
    params.e820_entries = u8::try_from(map.len()).unwrap_or(u8::MAX);
    params
}

/// Writes the boot parameters the entry protocol needs and says how to enter.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline: &str,
    initramfs: Option<Initramfs>,
    rsdp: u64,
) -> Result<EntryPoint, BootError> {
    write_cmdline(mem, cmdline)?;
    let mem_size: u64 = mem.iter().map(vm_memory::GuestMemoryRegion::len).sum();
    if let Some(entry) = kernel.pvh_entry {
        let map = e820_map(mem_size);
        mem.write_slice(&pvh_start_info(&map, initramfs, rsdp), GuestAddress(PVH_INFO_ADDR))
            .map_err(BootError::WriteParams)?;
        mem.write_slice(&pvh_memmap(&map), GuestAddress(PVH_MEMMAP_ADDR)).map_err(BootError::WriteParams)?;
        if let Some(initramfs) = initramfs {
            mem.write_slice(&pvh_module(initramfs), GuestAddress(PVH_MODULE_ADDR)).map_err(BootError::WriteParams)?;
        }
        return Ok(EntryPoint::Pvh { entry, start_info: PVH_INFO_ADDR });
    }
    let params = zero_page(kernel, cmdline.len(), initramfs, mem_size, rsdp);
    mem.write_slice(params.as_slice(), GuestAddress(ZERO_PAGE_ADDR)).map_err(BootError::WriteParams)?;
    Ok(EntryPoint::Linux64 { entry: kernel.entry, zero_page: ZERO_PAGE_ADDR })
}

/// The PVH module list (the initramfs) sits after the memory map.
const PVH_MODULE_ADDR: u64 = PVH_MEMMAP_ADDR + 0x400;

/// `struct hvm_start_info`, little endian, version 1.
pub fn pvh_start_info(map: &[E820Entry], initramfs: Option<Initramfs>, rsdp: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(56);
    b.extend_from_slice(&PVH_START_MAGIC.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes()); // version
    b.extend_from_slice(&0u32.to_le_bytes()); // flags
    b.extend_from_slice(&u32::from(initramfs.is_some()).to_le_bytes()); // nr_modules
    b.extend_from_slice(&if initramfs.is_some() { PVH_MODULE_ADDR } else { 0 }.to_le_bytes());
    b.extend_from_slice(&CMDLINE_ADDR.to_le_bytes());
    b.extend_from_slice(&rsdp.to_le_bytes());
    b.extend_from_slice(&PVH_MEMMAP_ADDR.to_le_bytes());
    b.extend_from_slice(&u32::try_from(map.len()).unwrap_or_default().to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // reserved
    b
}

/// `struct hvm_memmap_table_entry` × n.
pub fn pvh_memmap(map: &[E820Entry]) -> Vec<u8> {
    let mut b = Vec::with_capacity(map.len() * 24);
    for e in map {
        b.extend_from_slice(&e.addr.to_le_bytes());
        b.extend_from_slice(&e.size.to_le_bytes());
        b.extend_from_slice(&e.kind.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
    }
    b
}

/// `struct hvm_modlist_entry` for the initramfs.
fn pvh_module(initramfs: Initramfs) -> Vec<u8> {
    let mut b = Vec::with_capacity(32);
    b.extend_from_slice(&initramfs.addr.to_le_bytes());
    b.extend_from_slice(&initramfs.size.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // cmdline_paddr
    b.extend_from_slice(&0u64.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::MMIO_HOLE_SIZE;

    fn memory(size: u64) -> GuestMemoryMmap {
        let ranges: Vec<_> = ram_ranges(size)
            .into_iter()
            .map(|(start, len)| (GuestAddress(start), usize::try_from(len).expect("fits")))
            .collect();
        GuestMemoryMmap::from_ranges(&ranges).expect("test memory maps")
    }

    #[test]
    fn e820_describes_ram_around_the_holes() {
        let map = e820_map(256 << 20);
        assert_eq!(map[0], E820Entry { addr: 0, size: 0x9fc00, kind: E820_RAM });
        assert_eq!(map[1].kind, E820_RESERVED);
        assert_eq!(map[2], E820Entry { addr: 0x10_0000, size: (256 << 20) - 0x10_0000, kind: E820_RAM });
        assert_eq!(map.len(), 3);
        let big = e820_map(5 << 30);
        assert_eq!(big[2].addr + big[2].size, MMIO_HOLE_START);
        assert_eq!(big[3], E820Entry { addr: 1 << 32, size: (5 << 30) - MMIO_HOLE_START, kind: E820_RAM });
        assert_eq!(MMIO_HOLE_START + MMIO_HOLE_SIZE, 1 << 32);
    }

    #[test]
    fn zero_page_has_the_protocol_fields() {
        let kernel = LoadedKernel { entry: 0x100_0000, pvh_entry: None, setup_header: None, end: 0x200_0000 };
        let initramfs = Initramfs { addr: 0x700_0000, size: 0x1234 };
        let params = zero_page(&kernel, 42, Some(initramfs), 128 << 20, ACPI_START);
        let hdr = params.hdr;
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, 0x5372_6448);
        assert_eq!({ hdr.type_of_loader }, 0xff);
        assert_eq!({ hdr.cmd_line_ptr }, 0x2_0000);
        assert_eq!({ hdr.cmdline_size }, 42);
        assert_eq!(({ hdr.ramdisk_image }, { hdr.ramdisk_size }), (0x700_0000, 0x1234));
        assert_eq!({ params.acpi_rsdp_addr }, ACPI_START);
        assert_eq!(params.e820_entries, 3);
        let last = params.e820_table[2];
        assert_eq!(({ last.addr }, { last.size }, { last.r#type }), (0x10_0000, (128 << 20) - 0x10_0000, 1));
        // The structure is the kernel's 4 KiB zero page.
        assert_eq!(std::mem::size_of::<boot_params>(), 4096);
        assert_eq!(params.as_slice()[0x1fe..0x200], [0x55, 0xaa]);
        assert_eq!(params.as_slice()[0x1e8], 3, "e820_entries at its ABI offset");
    }

    #[test]
    fn pvh_start_info_points_at_everything() {
        let map = e820_map(64 << 20);
        let info = pvh_start_info(&map, Some(Initramfs { addr: 0x300_0000, size: 9 }), ACPI_START);
        assert_eq!(info.len(), 56);
        let u32_at = |o: usize| u32::from_le_bytes(info[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(info[o..o + 8].try_into().expect("8 bytes"));
        assert_eq!(u32_at(0), 0x336e_c578);
        assert_eq!(u32_at(4), 1);
        assert_eq!(u32_at(12), 1);
        assert_eq!(u64_at(16), PVH_MODULE_ADDR);
        assert_eq!(u64_at(24), CMDLINE_ADDR);
        assert_eq!(u64_at(32), ACPI_START);
        assert_eq!(u64_at(40), PVH_MEMMAP_ADDR);
        assert_eq!(u32_at(48), 3);
        assert_eq!(pvh_memmap(&map).len(), 72);
        const { assert!(PVH_MODULE_ADDR + 32 <= ZERO_PAGE_ADDR) };
        const { assert!(PVH_MEMMAP_ADDR + 72 <= PVH_MODULE_ADDR) };
    }

    #[test]
    fn cmdline_is_bounded_and_terminated() {
        let mem = memory(4 << 20);
        write_cmdline(&mem, "console=ttyS0 reboot=k").expect("fits");
        let mut buf = [0u8; 23];
        mem.read_slice(&mut buf, GuestAddress(CMDLINE_ADDR)).expect("readable");
        assert_eq!(&buf, b"console=ttyS0 reboot=k\0");
        assert!(matches!(write_cmdline(&mem, &"x".repeat(2048)), Err(BootError::CmdlineTooLong { .. })));
        assert!(matches!(write_cmdline(&mem, "a\0b"), Err(BootError::CmdlineNul)));
    }

    #[test]
    fn initramfs_goes_to_the_top_of_low_ram() {
        let mem = memory(64 << 20);
        let mut file = tempfile::tempfile().expect("temp file");
        std::io::Write::write_all(&mut file, &[7u8; 5000]).expect("written");
        file.seek(SeekFrom::Start(0)).expect("seekable");
        let initramfs = load_initramfs(&mem, &mut file, 0x200_0000).expect("fits");
        assert_eq!(initramfs, Initramfs { addr: ((64 << 20) - 5000) & !0xfff, size: 5000 });
        let byte: u8 = mem.read_obj(GuestAddress(initramfs.addr + 4999)).expect("readable");
        assert_eq!(byte, 7);
        file.seek(SeekFrom::Start(0)).expect("seekable");
        assert!(matches!(load_initramfs(&mem, &mut file, 64 << 20), Err(BootError::InitramfsTooLarge { .. })));
    }

    #[test]
    fn garbage_is_not_a_kernel() {
        let mem = memory(16 << 20);
        let mut file = tempfile::tempfile().expect("temp file");
        std::io::Write::write_all(&mut file, &[0u8; 8192]).expect("written");
        assert!(matches!(load_kernel(&mem, &mut file), Err(BootError::Kernel { .. })));
    }

    /// The default image's kernel loads and has the PVH note moat relies on.
    #[test]
    #[ignore = "needs the default image (cargo xtask image); cargo xtask test provides it"]
    fn default_image_vmlinux_has_a_pvh_entry() {
        let path = crate::test_support::default_image_file("vmlinux");
        let Some(path) = path else { return };
        let mem = memory(512 << 20);
        let mut file = File::open(&path).expect("vmlinux opens");
        let kernel = load_kernel(&mem, &mut file).expect("vmlinux loads");
        let pvh = kernel.pvh_entry.expect("Debian's vmlinux carries a PVH note");
        assert!(pvh >= HIMEM_START && pvh < kernel.end, "{pvh:#x} inside the kernel");
        assert!(kernel.entry >= HIMEM_START);
        let entry = write_boot_params(&mem, &kernel, "console=ttyS0", None, ACPI_START).expect("params fit");
        assert_eq!(entry, EntryPoint::Pvh { entry: pvh, start_info: PVH_INFO_ADDR });
    }
}

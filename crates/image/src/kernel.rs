//! The guest kernel: Debian's `linux-image-cloud-amd64`, unpacked, with the
//! uncompressed `vmlinux` cut out of its bzImage.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::host::{output, run};

/// Debian's meta package that tracks the current cloud kernel.
pub const META_PACKAGE: &str = "linux-image-cloud-amd64";

/// An unpacked kernel package.
#[derive(Debug)]
pub struct KernelPackage {
    pub package: String,
    pub version: String,
    /// `uname -r`.
    pub release: String,
    /// Where the package was unpacked (with `lib/modules/RELEASE/modules.dep`).
    pub root: PathBuf,
}

impl KernelPackage {
    pub fn vmlinuz(&self) -> PathBuf {
        self.root.join(format!("boot/vmlinuz-{}", self.release))
    }

    pub fn config(&self) -> PathBuf {
        self.root.join(format!("boot/config-{}", self.release))
    }

    pub fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
}

/// The kernel package the meta package points at, and its version.
pub fn resolve() -> Result<(String, String)> {
    let depends = output(Command::new("apt-cache").args(["depends", META_PACKAGE]))?;
    let package =
        depends.lines().find_map(|l| l.trim().strip_prefix("Depends: ")).map(str::to_owned).with_context(|| {
            format!("apt-cache knows no {META_PACKAGE}; run `apt-get update` (Debian bookworm sources needed)")
        })?;
    let policy = output(Command::new("apt-cache").args(["policy", &package]))?;
    let version = policy
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate: "))
        .map(str::to_owned)
        .with_context(|| format!("apt-cache has no candidate version of {package}"))?;
    Ok((package, version))
}

/// Downloads and unpacks the kernel package into `cache` (once per version)
/// and generates its `modules.dep` with depmod.
pub fn fetch(cache: &Path, package: &str, version: &str) -> Result<KernelPackage> {
    let release = package.strip_prefix("linux-image-").unwrap_or(package).to_owned();
    let root = cache.join(format!("{package}_{version}"));
    let kernel = KernelPackage { package: package.into(), version: version.into(), release, root };
    if kernel.modules_dir().join("modules.dep").is_file() && kernel.vmlinuz().is_file() {
        return Ok(kernel);
    }
    let download = cache.join("download");
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download)?;
    // Downloading as root into our own directory: apt's `_apt` sandbox user
    // could not write there, and says so in a warning.
    run(Command::new("apt-get")
        .args(["download", "-q", "-o", "APT::Sandbox::User=root", &format!("{package}={version}")])
        .current_dir(&download))?;
    let deb = std::fs::read_dir(&download)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    let staging = cache.join(format!(".{package}.unpack"));
    let _ = std::fs::remove_dir_all(&staging);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&staging))?;
    run(Command::new("depmod").arg("-b").arg(&staging).arg(&kernel.release))?;
    let _ = std::fs::remove_dir_all(&kernel.root);
    std::fs::rename(&staging, &kernel.root)?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(kernel)
}

/// The magic of an LZ4 "legacy" frame, which the kernel's build uses.
const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];

/// Blocks of a legacy frame decompress to at most 8 MiB each.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;

/// Extracts the uncompressed ELF `vmlinux` from a bzImage whose payload is
/// LZ4-compressed, using the setup header's `payload_offset`/`payload_length`.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>> {
    let field = |offset: usize, len: usize| -> Result<&[u8]> {
        bzimage.get(offset..offset + len).context("file too short for a bzImage setup header")
    };
    ensure!(field(0x202, 4)? == b"HdrS", "not a bzImage (no HdrS boot-protocol magic)");
    let setup_sects = match field(0x1f1, 1)?[0] {
        0 => 4,
        n => usize::from(n),
    };
    let le32 = |offset: usize| -> Result<usize> {
        let bytes: [u8; 4] = field(offset, 4)?.try_into()?;
        Ok(u32::from_le_bytes(bytes) as usize)
    };
    let start = (setup_sects + 1) * 512 + le32(0x248)?;
    let payload = bzimage.get(start..start + le32(0x24c)?).context("bzImage payload runs past the end of the file")?;
    ensure!(
        payload.starts_with(&LZ4_LEGACY_MAGIC),
        "the bzImage payload is not LZ4 (magic {:02x?}); this kernel was compressed otherwise",
        &payload[..4.min(payload.len())]
    );
    // The payload is the legacy frame followed by the 4-byte uncompressed size.
    let (frame, size) = payload.split_at(payload.len().saturating_sub(4));
    let expected = u32::from_le_bytes(size.try_into()?) as usize;
    let mut out = Vec::with_capacity(expected);
    let mut rest = &frame[4..];
    let mut block = vec![0u8; LZ4_LEGACY_BLOCK];
    while rest.len() >= 4 {
        let len = u32::from_le_bytes(rest[..4].try_into()?) as usize;
        if rest[..4] == LZ4_LEGACY_MAGIC {
            rest = &rest[4..];
            continue;
        }
        let data = rest.get(4..4 + len).context("truncated LZ4 block")?;
        let n = lz4_flex::block::decompress_into(data, &mut block).context("corrupt LZ4 block in the bzImage")?;
        out.extend_from_slice(&block[..n]);
        rest = &rest[4 + len..];
    }
    ensure!(out.len() == expected, "decompressed {} bytes, the bzImage says {expected}", out.len());
    ensure!(out.starts_with(b"\x7fELF"), "the decompressed kernel is not an ELF file");
    Ok(out)
}

/// Whether an ELF64 file carries a Xen `PHYS32_ENTRY` note: the PVH entry
/// point that lets a VMM start the kernel in 32-bit protected mode.
pub fn has_pvh_note(elf: &[u8]) -> bool {
    const PT_NOTE: u32 = 4;
    const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o: usize| elf.get(o..o + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    let u64_at = |o: usize| {
        elf.get(o..o + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).and_then(|v| usize::try_from(v).ok())
    };
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    let align4 = |n: usize| (n + 3) & !3;
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        if u32_at(ph) != Some(PT_NOTE) {
            continue;
        }
        let (Some(mut at), Some(size)) = (u64_at(ph + 8), u64_at(ph + 32)) else { continue };
        let end = at + size;
        while at + 12 <= end {
            let (Some(namesz), Some(descsz), Some(kind)) = (u32_at(at), u32_at(at + 4), u32_at(at + 8)) else {
                break;
            };
            let name = elf.get(at + 12..at + 12 + namesz as usize).unwrap_or_default();
            if name.starts_with(b"Xen") && kind == XEN_ELFNOTE_PHYS32_ENTRY {
                return true;
            }
            at += 12 + align4(namesz as usize) + align4(descsz as usize);
        }
    }
    false
}

/// Checks the kernel configuration for what moat's VMs rely on.
pub fn check_config(config: &str) -> Result<()> {
    for needed in ["CONFIG_PVH=y", "CONFIG_ACPI=y", "CONFIG_EXT4_FS=y", "CONFIG_VIRTIO_MMIO=m", "CONFIG_DEVTMPFS=y"] {
        if !config.lines().any(|l| l == needed) {
            bail!("the kernel config lacks {needed}; moat's VMs need it");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal bzImage around an LZ4 legacy frame of a fake ELF.
    fn fake_bzimage(payload_plain: &[u8]) -> Vec<u8> {
        let block = lz4_flex::block::compress(payload_plain);
        let mut payload = LZ4_LEGACY_MAGIC.to_vec();
        payload.extend_from_slice(&u32::try_from(block.len()).expect("small").to_le_bytes());
        payload.extend_from_slice(&block);
        payload.extend_from_slice(&u32::try_from(payload_plain.len()).expect("small").to_le_bytes());
        let mut image = vec![0u8; 5 * 512];
        image[0x1f1] = 4;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x248..0x24c].copy_from_slice(&16u32.to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&u32::try_from(payload.len()).expect("small").to_le_bytes());
        image.extend_from_slice(&[0xcc; 16]);
        image.extend_from_slice(&payload);
        image.extend_from_slice(b"trailing setup code");
        image
    }

    #[test]
    fn extracts_the_lz4_payload() {
        let plain: Vec<u8> = b"\x7fELF".iter().copied().chain((0..100_000u32).map(|i| (i % 97) as u8)).collect();
        assert_eq!(extract_vmlinux(&fake_bzimage(&plain)).expect("extracts"), plain);
    }

    #[test]
    fn refuses_what_is_not_an_lz4_bzimage() {
        assert!(extract_vmlinux(b"short").is_err());
        let mut gzip = fake_bzimage(b"\x7fELFxxxx");
        gzip[5 * 512 + 16] = 0x1f;
        let err = extract_vmlinux(&gzip).expect_err("not lz4");
        assert!(err.to_string().contains("not LZ4"), "{err}");
    }

    #[test]
    fn finds_a_pvh_note() {
        // ELF64 header + one PT_NOTE program header + a Xen note of type 18.
        let mut elf = vec![0u8; 0x40 + 0x38];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let note_at = elf.len() as u64;
        let mut note = Vec::new();
        for v in [4u32, 4, 18] {
            note.extend_from_slice(&v.to_le_bytes());
        }
        note.extend_from_slice(b"Xen\0");
        note.extend_from_slice(&0x0100_0000u32.to_le_bytes());
        elf[0x40..0x44].copy_from_slice(&4u32.to_le_bytes());
        elf[0x48..0x50].copy_from_slice(&note_at.to_le_bytes());
        elf[0x60..0x68].copy_from_slice(&(note.len() as u64).to_le_bytes());
        elf.extend_from_slice(&note);
        assert!(has_pvh_note(&elf));
        elf[0x40 + 0x38 + 8] = 17;
        assert!(!has_pvh_note(&elf));
    }
}

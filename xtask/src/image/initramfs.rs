//! The initramfs: the static agent as `/init`, plus the kernel modules it
//! loads, as a gzip-compressed cpio archive.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use flate2::Compression;
use flate2::write::GzEncoder;
use moat_agent::boot::{ModuleDeps, module_name};

/// The modules a microVM needs before its root disk: the virtio-mmio
/// transport, the disk, vsock for the agent, overlay, entropy. Their
/// dependencies come from the kernel's `modules.dep`.
pub const MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_mmio",
    "virtio_blk",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
    "overlay",
    "virtio-rng",
];

/// A cpio "newc" archive writer.
///
/// Written here: the format is a 110-byte ASCII header per entry, and the
/// archive must be reproducible (fixed owners and times), which takes less
/// code than adapting a general-purpose archiver.
pub struct Cpio<W: Write> {
    out: W,
    inode: u32,
}

impl<W: Write> Cpio<W> {
    pub fn new(out: W) -> Self {
        Self { out, inode: 1 }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| std::io::Error::other("file too large for cpio"))?;
        let name_size = u32::try_from(name.len() + 1).map_err(|_| std::io::Error::other("name too long"))?;
        let fields = [self.inode, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, name_size, 0];
        self.inode += 1;
        let mut header = String::from("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + name.len() + 1)?;
        self.out.write_all(data)?;
        self.pad(data.len())
    }

    fn pad(&mut self, written: usize) -> std::io::Result<()> {
        let padding = (4 - written % 4) % 4;
        self.out.write_all(&[0; 3][..padding])
    }

    pub fn dir(&mut self, name: &str) -> std::io::Result<()> {
        self.entry(name, 0o040_755, &[])
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        self.entry(name, 0o100_000 | mode, data)
    }

    /// Writes the trailer and returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.out)
    }
}

/// Writes `initramfs.cpio.gz` to `dest`; returns the module names in load order.
pub fn build(dest: &Path, agent: &Path, modules_dir: &Path, release: &str) -> Result<Vec<String>> {
    let dep_text = std::fs::read_to_string(modules_dir.join("modules.dep"))
        .with_context(|| format!("reading {}/modules.dep", modules_dir.display()))?;
    let graph = ModuleDeps::parse(&dep_text);
    let wanted: Vec<&str> = MODULES
        .iter()
        .map(|name| graph.find(name).with_context(|| format!("the kernel has no module {name}")))
        .collect::<Result<_>>()?;
    let order = graph.load_order(wanted);

    let file = std::fs::File::create(dest).with_context(|| format!("creating {}", dest.display()))?;
    let mut cpio = Cpio::new(GzEncoder::new(std::io::BufWriter::new(file), Compression::default()));
    let mut dirs = std::collections::BTreeSet::new();
    let module_root = format!("lib/modules/{release}");
    for path in order.iter().map(|m| format!("{module_root}/{m}")).chain([format!("{module_root}/modules.dep")]) {
        let mut ancestor = Path::new(&path).parent();
        while let Some(dir) = ancestor.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(dir.to_string_lossy().into_owned());
            ancestor = dir.parent();
        }
    }
    for dir in ["dev", "proc", "sys", "newroot", "tmp", "run"].into_iter().map(str::to_owned).chain(dirs) {
        cpio.dir(&dir)?;
    }
    cpio.file("init", 0o755, &std::fs::read(agent).with_context(|| format!("reading {}", agent.display()))?)?;
    for module in &order {
        let data = std::fs::read(modules_dir.join(module)).with_context(|| format!("reading module {module}"))?;
        cpio.file(&format!("{module_root}/{module}"), 0o644, &data)?;
    }
    cpio.file(&format!("{module_root}/modules.dep"), 0o644, graph.render(&order).as_bytes())?;
    let gz = cpio.finish()?;
    gz.finish()?.flush()?;
    Ok(order.iter().map(|m| module_name(m).to_owned()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_parse_with_cpio() {
        let mut cpio = Cpio::new(Vec::new());
        cpio.dir("d").expect("dir");
        cpio.file("d/f", 0o644, b"hello").expect("file");
        let archive = cpio.finish().expect("finish");
        assert_eq!(archive.len() % 4, 0);
        assert!(archive.starts_with(b"070701"));
        // Let the real cpio(1) list it when it is installed.
        if let Ok(mut child) = std::process::Command::new("cpio")
            .args(["-t", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
        {
            child.stdin.take().expect("stdin").write_all(&archive).expect("write");
            let out = child.wait_with_output().expect("cpio runs");
            assert_eq!(String::from_utf8_lossy(&out.stdout), "d\nd/f\n");
        }
    }
}

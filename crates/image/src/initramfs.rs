//! The initramfs: the static agent as `/init`, plus the kernel modules it
//! loads, as a gzip-compressed cpio archive.

use std::io::Write;
use std::path::Path;

use crate::cpio::Cpio;
use anyhow::{Context, Result};
use flate2::Compression;
use flate2::write::GzEncoder;
use moat_agent::boot::{ModuleDeps, module_name};

/// The modules a microVM needs before its root disk: the virtio-mmio
/// transport, the disk, vsock for the agent, overlay, entropy; and the
/// network device of `open` sandboxes (loaded in every VM: without the
/// device it binds to nothing). Their dependencies come from the kernel's
/// `modules.dep`.
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
    "virtio_net",
];

/// Bumped when the way the initramfs is put together changes (2: the agent
/// without debug information).
pub const RECIPE: &str = "2";

/// The agent's bytes without its debug information (`strip --strip-debug`):
/// the initramfs stays in every guest's memory, and its size is inflated
/// by every boot (26 MiB with line tables, 4.5 MiB without). Jails run the
/// binary as built, so their backtraces keep their lines.
fn without_debug_info(agent: &Path, dest: &Path) -> Result<Vec<u8>> {
    let stripped = dest.with_extension("init");
    let status = std::process::Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&stripped)
        .arg(agent)
        .status()
        .context("cannot run strip (Debian's binutils)")?;
    anyhow::ensure!(status.success(), "strip --strip-debug {} failed ({status})", agent.display());
    let bytes = std::fs::read(&stripped).with_context(|| format!("reading {}", stripped.display()));
    let _ = std::fs::remove_file(&stripped);
    bytes
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
    cpio.file("init", 0o755, &without_debug_info(agent, dest)?)?;
    for module in &order {
        let data = std::fs::read(modules_dir.join(module)).with_context(|| format!("reading module {module}"))?;
        cpio.file(&format!("{module_root}/{module}"), 0o644, &data)?;
    }
    cpio.file(&format!("{module_root}/modules.dep"), 0o644, graph.render(&order).as_bytes())?;
    let gz = cpio.finish()?;
    gz.finish()?.flush()?;
    Ok(order.iter().map(|m| module_name(m).to_owned()).collect())
}

//! The default image's kernel and initramfs go through the whole builder:
//! loaded (PVH entry), ACPI tables and boot parameters written, vCPUs
//! configured on /dev/kvm. The VM is not run: this project's development
//! hosts have a paravirtual nested KVM that cannot boot Linux. Booting it
//! to `moat-agent: ready` belongs in the nested test host (see README.md).

use std::path::PathBuf;
use std::time::Instant;

use moat_vmm::builder::build_microvm;
use moat_vmm::config::VmConfig;

fn image_dir() -> Option<PathBuf> {
    let data = std::env::var_os("MOAT_DATA_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
            .map(|d| d.join("moat"))
    })?;
    let dir = data.join("images/default");
    if dir.join("vmlinux").exists() {
        Some(dir)
    } else {
        eprintln!("skipping: {} has no vmlinux (cargo xtask image builds it)", dir.display());
        None
    }
}

#[test]
#[ignore = "needs /dev/kvm and the default image; cargo xtask test provides them"]
fn default_image_builds_into_a_vm() {
    let Some(dir) = image_dir() else { return };
    let scratch = tempfile::tempdir().expect("temp dir");
    let mut config = VmConfig::new(dir.join("vmlinux"));
    config.initramfs = Some(dir.join("initramfs.cpio.gz"));
    config.vcpus = 2;
    config.memory_mib = 512;
    config.console = "none".into();
    config.control_socket = Some(scratch.path().join("ctl.sock"));
    let vmm = build_microvm(&config, Instant::now()).expect("the default image builds into a VM");
    assert!(scratch.path().join("ctl.sock").exists(), "control socket listening");
    drop(vmm);
    assert!(!scratch.path().join("ctl.sock").exists(), "control socket removed with the VM");
}

//! The agent as `/init` of a real microVM: the `default` image booted by
//! QEMU (`-M microvm,acpi=on`, TCG), watched on its serial console.
//!
//! Ignored by plain `cargo test` (it needs the image and QEMU); `cargo xtask
//! test` builds both and runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use moat_core::image::{Image, data_dir};

/// A guard against a hung boot, not a performance bound: TCG is slow and
/// the machine may be busy.
const BOOT_GUARD: Duration = Duration::from_secs(300);

#[test]
#[ignore = "needs the default image and qemu-system-x86_64; `cargo xtask test` provides both"]
fn boots_the_default_image_to_its_root_disk() {
    let image = Image::open(&data_dir(), "default").expect("the default image is built (cargo xtask image)");
    let vhost_vsock = std::path::Path::new("/dev/vhost-vsock").exists();
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-M", "microvm,acpi=on", "-accel", "tcg", "-cpu", "max", "-m", "512", "-smp", "1"])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio"])
        .arg("-kernel")
        .arg(image.path("vmlinux"))
        .arg("-initrd")
        .arg(image.path("initramfs.cpio.gz"))
        // TCG's timers are too irregular for the kernel to calibrate the TSC
        // against the PIT reliably: give it a frequency instead.
        .args([
            "-append",
            "console=ttyS0 moat.root=/dev/vda moat.hostname=qemu-test panic=-1 tsc_early_khz=2000000 tsc=reliable",
        ])
        .arg("-drive")
        .arg(format!("id=root,file={},format=raw,if=none,snapshot=on", image.path("rootfs.ext4").display()))
        .args(["-device", "virtio-blk-device,drive=root"]);
    if vhost_vsock {
        qemu.args(["-device", "vhost-vsock-device,guest-cid=42"]);
    }
    let mut child =
        qemu.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("qemu starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    let mut console = Vec::new();
    let outcome = loop {
        let left = BOOT_GUARD.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done =
                    ["moat-agent: ready", "moat-agent: no vsock device", "moat-agent: boot failed", "Kernel panic"]
                        .iter()
                        .any(|marker| line.contains(marker));
                console.push(line);
                if done {
                    break Some(started.elapsed());
                }
            }
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let text = console.join("\n");
    let tail = console.iter().rev().take(40).rev().cloned().collect::<Vec<_>>().join("\n");
    let booted = outcome.unwrap_or_else(|| panic!("no verdict on the console within {BOOT_GUARD:?}:\n{tail}"));
    eprintln!("boot verdict after {booted:?}");
    assert!(text.contains("moat-agent: modules loaded"), "modules not loaded:\n{tail}");
    assert!(text.contains("moat-agent: root mounted (/dev/vda)"), "root not mounted:\n{tail}");
    if vhost_vsock {
        assert!(text.contains("moat-agent: ready"), "agent not ready:\n{tail}");
    } else {
        let line = console.iter().find(|l| l.contains("moat-agent: no vsock device")).expect("missing vsock reported");
        assert!(line.contains("virtio-vsock"), "the line should say what is missing: {line}");
    }
}

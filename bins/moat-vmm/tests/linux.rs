//! moat-vmm booting the real Debian kernel of the `default` image, inside
//! the nested test host (this machine's own KVM cannot boot Linux): with one
//! and with two vCPUs, to the guest agent; and a guest that reboots ends
//! the VM with status 0.
//!
//! Ignored by plain `cargo test`; `cargo xtask test` provides the image,
//! the binaries, QEMU and busybox-static.

use moat_nested::Payload;

const IMAGE: &str = "$HOME/.local/share/moat/images/default";

/// moat-vmm booting the image's kernel and initramfs with `cmdline` and
/// `vcpus`, its console on stdout; prints `status=N` at the end.
fn boot(vcpus: u8, cmdline: &str) -> String {
    format!(
        "moat-vmm --kernel {IMAGE}/vmlinux --initramfs {IMAGE}/initramfs.cpio.gz --vcpus {vcpus} --memory-mib 512 \
         --console stdout --cmdline '{cmdline}'; echo status=$?"
    )
}

#[test]
#[ignore = "needs the nested test host (image, binaries, QEMU, busybox-static); run by `cargo xtask test`"]
fn debian_boots_with_one_and_two_vcpus_and_a_reboot_ends_the_vm_in_the_nested_host() {
    // Without a root disk the agent loads its modules, waits 10 s for the
    // disk, reports the failure and powers off: the VM ends with status 0.
    // What matters here is the kernel: ACPI found, CPUs up, the
    // initramfs's init running, power-off honoured. `rdinit=` a missing
    // program makes the kernel panic, and `panic=-1` reboot at once: that
    // too must end the VM cleanly.
    let base = "console=ttyS0 reboot=k pci=off i8042.noaux i8042.nomux panic=-1";
    let script = [
        boot(1, &format!("{base} moat.root=/dev/vda")),
        boot(2, &format!("{base} moat.root=/dev/vda")),
        boot(1, &format!("{base} rdinit=/no-such-init")),
    ]
    .join("; echo ====; ");
    let out = moat_nested::run(Payload::script(&script)).expect("level 1 runs moat-vmm");
    let text = out.stdout_text();
    let runs: Vec<&str> = text.split("====").collect();
    assert_eq!(runs.len(), 3, "three boots:\n{text}\n{}", out.stderr_text());
    for (run, cpus) in runs[..2].iter().zip(["1 CPU", "2 CPUs"]) {
        assert!(run.contains("ACPI: DSDT"), "the kernel found no ACPI tables:\n{run}");
        assert!(run.contains(&format!("Brought up 1 node, {cpus}")), "expected {cpus}:\n{run}");
        assert!(run.contains("moat-agent: modules loaded"), "the initramfs's agent did not load modules:\n{run}");
        assert!(run.contains("moat-agent: boot failed"), "the agent should report the missing disk:\n{run}");
        assert!(run.trim_end().ends_with("status=0"), "a guest power-off must end the VM with 0:\n{run}");
    }
    assert!(runs[2].contains("Kernel panic"), "expected the panic:\n{}", runs[2]);
    assert!(runs[2].trim_end().ends_with("status=0"), "a guest reboot must end the VM with 0:\n{}", runs[2]);
}

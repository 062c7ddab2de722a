//! Level 2: the image booted under QEMU microvm with KVM inside level 1 —
//! the baseline that moat-vmm's boot is compared to, side by side in the
//! same level 1.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::machine::quote;
use crate::{Output, Payload};

/// The level-2 kernel command line: the one `bins/moat-agent/tests/vm_boot.rs`
/// boots the image with, plus `quiet`. Level 1's TSC is TCG's, so level 2
/// is given its frequency rather than calibrating it. `quiet` because every
/// byte on the emulated UART costs level 2 an exit, and an exit in a nested
/// guest costs tens of microseconds: the kernel's boot log alone would
/// otherwise dominate the figure (see docs/testing.md).
pub const CMDLINE: &str =
    "console=ttyS0 moat.root=/dev/vda moat.hostname=level2 panic=-1 tsc_early_khz=2000000 tsc=reliable quiet";

/// The level-2 QEMU machine. `rtc=on` because microvm leaves its CMOS clock
/// out under KVM, and the kernel's `rtc_cmos` driver then probes the absent
/// device for about 7 s of port I/O, each access a nested exit (measured:
/// see docs/testing.md); with the clock there, the probe takes 0.3 s.
pub const MACHINE: &str = "microvm,acpi=on,rtc=on";

/// The agent's console lines that end a boot: the first two are success
/// (`no vsock device` when level 1 lacks vhost-vsock).
const VERDICTS: &[&str] =
    &["moat-agent: ready", "moat-agent: no vsock device", "moat-agent: boot failed", "Kernel panic"];

/// A payload that boots the image `runs` times, one after another, under
/// `qemu-system-x86_64 -M` [`MACHINE`] `-accel kvm` in level 1 (512 MiB,
/// one vCPU, the root disk copy-on-write, a vhost-vsock device), each until
/// the agent's last boot line, with [`CMDLINE`].
pub fn qemu_microvm_boot(runs: u32) -> Payload {
    qemu_microvm_boot_with(runs, MACHINE, CMDLINE)
}

/// [`qemu_microvm_boot`] with another QEMU machine (`-M`) and kernel
/// command line.
///
/// Each boot's start and verdict are marked on `$MOAT_NESTED_MARKS`, so the
/// host times them. The console goes through `grep`, which reads it in
/// blocks: a shell loop reading it line by line would hold back a chatty
/// guest's UART. The consoles are copied to the payload's stderr at the end.
pub fn qemu_microvm_boot_with(runs: u32, machine: &str, cmdline: &str) -> Payload {
    let patterns: String = VERDICTS.iter().map(|v| format!(" -e '{v}'")).collect();
    let script = format!(
        r#"img="$HOME/.local/share/moat/images/$(cat /etc/nested/image)"
i=0
while [ $i -lt {runs} ]; do
    i=$((i + 1))
    rm -f /tmp/level2.pid /tmp/level2.verdict
    echo "start $i" > "$MOAT_NESTED_MARKS"
    qemu-system-x86_64 -M {machine} -accel kvm -cpu host -m 512 -smp 1 \
        -nodefaults -no-user-config -display none -no-reboot -serial stdio -pidfile /tmp/level2.pid \
        -kernel "$img/vmlinux" -initrd "$img/initramfs.cpio.gz" -append {cmdline} \
        -drive "id=root,file=$img/rootfs.ext4,format=raw,if=none,snapshot=on" -device virtio-blk-device,drive=root \
        -device vhost-vsock-device,guest-cid=3 2>&1 |
    tee "/tmp/level2-$i.console" | {{
        grep -m1{patterns} > /tmp/level2.verdict
        read -r verdict < /tmp/level2.verdict
        echo "end $i ${{verdict#*: }}" > "$MOAT_NESTED_MARKS"
        echo "level 2 boot $i: $verdict"
        kill "$(cat /tmp/level2.pid)"
        cat > /dev/null
    }}
done
cat /tmp/level2-*.console >&2
"#,
        machine = quote(machine),
        cmdline = quote(cmdline)
    );
    Payload::script(&script)
}

/// Each boot's time, from the marks of a [`qemu_microvm_boot`] payload's
/// output: from just before QEMU started to the agent's last boot line,
/// on the host's clock.
pub fn boot_times(output: &Output) -> Result<Vec<Duration>> {
    let failed = |why: String| {
        let stderr = output.stderr_text();
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Error::Payload(format!("{why}; level 2's console ends:\n{}", tail.join("\n")))
    };
    let mut times = Vec::new();
    let mut start = None;
    for (at, mark) in &output.marks {
        if mark.starts_with("start ") {
            start = Some(*at);
        } else if let Some(rest) = mark.strip_prefix("end ") {
            let verdict = rest.split_once(' ').map_or("", |(_, v)| v);
            if !(verdict.starts_with("ready") || verdict.starts_with("no vsock device")) {
                return Err(failed(format!("level 2 did not boot: {verdict}")));
            }
            let began = start.take().ok_or_else(|| failed(format!("a boot ended without starting: {mark}")))?;
            times.push(at.saturating_sub(began));
        }
    }
    if times.is_empty() {
        return Err(failed(format!("no level-2 boot finished (exit status {})", output.code)));
    }
    Ok(times)
}

//! Level 2: the image booted under QEMU microvm with KVM inside level 1 —
//! the baseline that moat-vmm's boot is compared to, side by side in the
//! same level 1 ([`boots`] takes any VMM's command beside QEMU's).

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

/// A way to boot level 2: a name, and a shell command (run by level 1's
/// busybox `sh`, with `$img` the image directory) that boots the image with
/// the guest's serial console on its stdout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Boot {
    pub name: String,
    pub command: String,
}

impl Boot {
    /// `qemu-system-x86_64 -M <machine> -accel kvm` (512 MiB, one vCPU, the
    /// root disk copy-on-write, a vhost-vsock device) with `cmdline`.
    pub fn qemu_microvm(machine: &str, cmdline: &str) -> Self {
        let command = format!(
            "qemu-system-x86_64 -M {} -accel kvm -cpu host -m 512 -smp 1 \
             -nodefaults -no-user-config -display none -no-reboot -serial stdio \
             -kernel \"$img/vmlinux\" -initrd \"$img/initramfs.cpio.gz\" -append {} \
             -drive \"id=root,file=$img/rootfs.ext4,format=raw,if=none,snapshot=on\" \
             -device virtio-blk-device,drive=root -device vhost-vsock-device,guest-cid=3",
            quote(machine),
            quote(cmdline)
        );
        Self { name: "qemu".into(), command }
    }

    /// `moat-vmm` booting the same kernel, initramfs and root disk with the
    /// same devices (512 MiB, one vCPU, the root disk copy-on-write into a
    /// fresh overlay, a vsock device) and `cmdline`. (The command is `exec`ed
    /// by [`boots`]: one program, its paths fresh through the shell's pid.)
    pub fn moat_vmm(cmdline: &str) -> Self {
        let command = format!(
            "moat-vmm --vcpus 1 --memory-mib 512 --console stdout \
             --kernel \"$img/vmlinux\" --initramfs \"$img/initramfs.cpio.gz\" --cmdline {} \
             --disk \"$img/rootfs.ext4,overlay=/tmp/level2-overlay-$$.img\" \
             --vsock-cid 3 --vsock-uds /tmp/level2-vsock-$$.sock",
            quote(cmdline)
        );
        Self { name: "moat-vmm".into(), command }
    }
}

/// A payload that boots the image `runs` times under `qemu-system-x86_64 -M`
/// [`MACHINE`] `-accel kvm` in level 1 with [`CMDLINE`], one boot after
/// another, each until the agent's last boot line.
pub fn qemu_microvm_boot(runs: u32) -> Payload {
    boots(runs, &[Boot::qemu_microvm(MACHINE, CMDLINE)])
}

/// A payload that boots level 2 `runs` times with each of `boots` in turn
/// (A, B, A, B…: level 1's state drifts over a run, and interleaving shares
/// the drift out), each until the agent's last boot line, then stops it.
///
/// Each boot's start and verdict are marked on `$MOAT_NESTED_MARKS`, so the
/// host times them ([`boot_times`]). The console goes through `grep`, which
/// reads it in blocks: a shell loop reading it line by line would hold back
/// a chatty guest's UART. The consoles are copied to the payload's stderr
/// at the end.
pub fn boots(runs: u32, boots: &[Boot]) -> Payload {
    let patterns: String = VERDICTS.iter().map(|v| format!(" -e '{v}'")).collect();
    let mut body = String::new();
    for boot in boots {
        // The command's pid, to stop it: the shell execs the VMM in place.
        let command = quote(&format!("echo $$ > /tmp/level2.pid; exec {}", boot.command));
        body.push_str(&format!(
            r#"    rm -f /tmp/level2.pid /tmp/level2.verdict
    echo "start {name} $i" > "$MOAT_NESTED_MARKS"
    sh -c {command} 2>&1 | tee "/tmp/level2-{name}-$i.console" | {{
        grep -m1{patterns} > /tmp/level2.verdict
        read -r verdict < /tmp/level2.verdict
        echo "end {name} $i ${{verdict#*: }}" > "$MOAT_NESTED_MARKS"
        echo "level 2 {name} boot $i: $verdict"
        kill "$(cat /tmp/level2.pid)"
        cat > /dev/null
    }}
"#,
            name = boot.name,
        ));
    }
    let script = format!(
        r#"img="$HOME/.local/share/moat/images/$(cat /etc/nested/image)"
export img
i=0
while [ $i -lt {runs} ]; do
    i=$((i + 1))
{body}done
cat /tmp/level2-*.console >&2
"#
    );
    Payload::script(&script)
}

/// The times of the boots named `name` in the output of a [`boots`] (or
/// [`qemu_microvm_boot`]: name `qemu`) payload: from just before the VMM
/// started to the agent's last boot line, on the host's clock.
pub fn boot_times(output: &Output, name: &str) -> Result<Vec<Duration>> {
    let failed = |why: String| {
        let stderr = output.stderr_text();
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Error::Payload(format!("{why}; level 2's consoles end:\n{}", tail.join("\n")))
    };
    let mut times = Vec::new();
    let mut start = None;
    for (at, mark) in &output.marks {
        let mut words = mark.splitn(4, ' ');
        let (event, boot, _run, verdict) = (words.next(), words.next(), words.next(), words.next().unwrap_or(""));
        if boot != Some(name) {
            continue;
        }
        match event {
            Some("start") => start = Some(*at),
            Some("end") => {
                if !(verdict.starts_with("ready") || verdict.starts_with("no vsock device")) {
                    return Err(failed(format!("level 2 ({name}) did not boot: {mark}")));
                }
                let began = start.take().ok_or_else(|| failed(format!("a boot ended without starting: {mark}")))?;
                times.push(at.saturating_sub(began));
            }
            _ => {}
        }
    }
    if times.is_empty() {
        return Err(failed(format!("no level-2 {name} boot finished (exit status {})", output.code)));
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(marks: &[(u64, &str)]) -> Output {
        Output {
            code: 0,
            stdout: Vec::new(),
            stderr: b"console".to_vec(),
            stages: Vec::new(),
            marks: marks.iter().map(|(ms, m)| (Duration::from_millis(*ms), (*m).to_owned())).collect(),
            console: String::new(),
        }
    }

    #[test]
    fn boot_times_pair_each_start_with_its_end_by_name() {
        let out = output(&[
            (100, "start qemu 1"),
            (1100, "end qemu 1 ready"),
            (1200, "start vmm 1"),
            (1700, "end vmm 1 no vsock device: none"),
            (1800, "start qemu 2"),
            (3800, "end qemu 2 ready"),
        ]);
        assert_eq!(boot_times(&out, "qemu").expect("booted"), [Duration::from_secs(1), Duration::from_secs(2)]);
        assert_eq!(boot_times(&out, "vmm").expect("booted"), [Duration::from_millis(500)]);
        assert!(boot_times(&out, "other").is_err());
    }

    #[test]
    fn a_failed_boot_is_an_error_with_the_console() {
        let out = output(&[(0, "start qemu 1"), (10, "end qemu 1 boot failed: no root")]);
        let err = boot_times(&out, "qemu").expect_err("failed boot");
        assert!(err.to_string().contains("boot failed: no root") && err.to_string().contains("console"), "{err}");
    }
}

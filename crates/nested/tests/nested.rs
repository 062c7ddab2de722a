//! The nested test host end to end: level 1 boots under TCG, KVM works in
//! it, payloads' output and status come back exactly, hangs are reported,
//! and a level-2 Debian guest boots under QEMU with KVM inside level 1.
//!
//! Ignored by plain `cargo test`: they need the default image, the static
//! agent, the moat binaries, QEMU and busybox-static, which `cargo xtask
//! test` provides. The timeouts guard against hangs; they are not
//! performance bounds.

use std::sync::Mutex;
use std::time::Duration;

use moat_nested::{Error, Payload, Stage, Timeouts};

/// Each level 1 takes host CPUs for TCG: run them one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn run(payload: Payload) -> Result<moat_nested::Output, Error> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let result = moat_nested::run(payload);
    if let Ok(out) = &result {
        eprintln!("stages: {:?}", out.stages);
    }
    result
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_payloads_output_and_exit_status_come_back_from_the_nested_host() {
    // Bytes that would not survive a text console: no trailing newline,
    // a carriage return, a NUL, and something on stderr.
    let out = run(Payload::script(r#"printf 'one\r\ntwo\000three'; printf 'to stderr\n' >&2; ls /dev/kvm >&2"#))
        .expect("the payload runs");
    assert_eq!(out.code, 0, "stderr: {}", out.stderr_text());
    assert_eq!(out.stdout, b"one\r\ntwo\0three");
    assert_eq!(out.stderr_text(), "to stderr\n/dev/kvm\n");
    let stages: Vec<Stage> = out.stages.iter().map(|(s, _)| *s).collect();
    assert_eq!(stages, [Stage::Launched, Stage::Booted, Stage::Kvm, Stage::PayloadStarted, Stage::PayloadFinished]);
    assert!(out.console.contains("moat-nested: kvm works"), "console:\n{}", out.console);
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn the_moat_binaries_and_the_image_are_in_place_in_the_nested_host() {
    // moat finds the image at level 1's default data directory (its root
    // disk a block device) and the agent, and sees KVM with SVM.
    let out = run(Payload::new(["moat", "doctor"])).expect("the payload runs");
    let report = out.stdout_text();
    assert_eq!(out.code, 0, "stdout: {report}\nstderr: {}", out.stderr_text());
    assert!(report.contains("/dev/kvm:                usable"), "{report}");
    assert!(report.contains("hardware virtualization: yes (svm)"), "{report}");
    assert!(report.contains("image \"default\":        /root/.local/share/moat/images/default (kernel"), "{report}");
    assert!(report.contains("agent:                   /usr/bin/moat-agent"), "{report}");
    let out = run(Payload::script(
        "which moat-mcp moat-vmm moat-agent; readlink $HOME/.local/share/moat/images/default/rootfs.ext4; \
         test -f $HOME/.local/share/moat/images/default/rootfs.ext4 && echo regular",
    ))
    .expect("the payload runs");
    let lines: Vec<String> = out.stdout_text().lines().map(str::to_owned).collect();
    let expected =
        ["/usr/bin/moat-mcp", "/usr/bin/moat-vmm", "/usr/bin/moat-agent", "/nested-rootfs/rootfs.ext4", "regular"];
    assert_eq!(lines, expected, "the binaries on PATH, the root disk a regular file");
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_failing_payloads_status_comes_back_from_the_nested_host() {
    let out = run(Payload::new(["sh", "-c", "echo failing >&2; exit 7"]).env("UNUSED", "x")).expect("level 1 runs");
    assert_eq!(out.code, 7);
    assert_eq!(out.stderr_text(), "failing\n");
    let out = run(Payload::new(["no-such-command"])).expect("level 1 runs");
    assert_eq!(out.code, 127, "stderr: {}", out.stderr_text());
    // Level 1 going away under the payload is a failure at that stage.
    let err = run(Payload::script("echo going; poweroff -f; sleep 100000")).expect_err("no exit status");
    assert_eq!(err.stage(), Some(Stage::PayloadStarted), "{err}");
    assert!(err.to_string().contains("QEMU exited"), "{err}");
    assert!(err.tails().is_some_and(|t| t.channel.contains("going")), "{err}");
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_hanging_payload_is_reported_with_its_stage_and_consoles_by_the_nested_host() {
    let timeouts = Timeouts { finish: Duration::from_secs(20), ..Timeouts::default() };
    let err = run(Payload::script("echo about to hang; sleep 100000").timeouts(timeouts))
        .expect_err("the payload never finishes");
    assert_eq!(err.stage(), Some(Stage::PayloadStarted), "{err}");
    let tails = err.tails().expect("both consoles");
    assert!(tails.console.contains("moat-nested: kvm works"), "{err}");
    assert!(tails.channel.contains("about to hang"), "{err}");
    // And where level 1's vCPU was, from QEMU's monitor.
    assert!(tails.cpu.contains("RIP=") && tails.cpu.contains("1 s later"), "{err}");
    let message = err.to_string();
    assert!(message.contains("payload finished") && message.contains("stage reached: payload started"), "{message}");
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_level_2_debian_guest_boots_under_qemu_with_kvm_in_the_nested_host() {
    use moat_nested::level2::{self, Boot};
    // QEMU as the baseline is booted, and beside it (as moat-vmm will be)
    // another VMM command: the same QEMU without a vsock device.
    let qemu = Boot::qemu_microvm(level2::MACHINE, level2::CMDLINE);
    let no_vsock =
        Boot { name: "no-vsock".into(), command: qemu.command.replace("-device vhost-vsock-device,guest-cid=3", "") };
    assert_ne!(no_vsock.command, qemu.command);
    let out = run(level2::boots(1, &[qemu, no_vsock])).expect("level 1 runs");
    let times = level2::boot_times(&out, "qemu").expect("level 2 boots");
    let other = level2::boot_times(&out, "no-vsock").expect("level 2 boots without vsock");
    eprintln!("level 2 boot: {times:?}, without vsock: {other:?}");
    assert_eq!((times.len(), other.len()), (1, 1));
    let stdout = out.stdout_text();
    assert!(
        stdout.contains("level 2 qemu boot 1: moat-agent: ready"),
        "vhost-vsock gives level 2 its vsock:\n{stdout}"
    );
    assert!(stdout.contains("level 2 no-vsock boot 1: moat-agent: no vsock device"), "{stdout}");
    assert!(out.stderr_text().contains("moat-agent: root mounted (/dev/vda)"), "{}", out.stderr_text());
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_run_of_steps_resumes_after_a_level_1_of_the_nested_host_breaks() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let bundle = moat_nested::bundle::prepare(&moat_nested::Sources::from_env().expect("sources")).expect("bundle");
    let steps: Vec<String> = ["one", "two", "three", "four", "five", "six"].map(String::from).to_vec();
    let mut payloads = Vec::new();
    // Two steps a level 1. The first does one and fails two, and ends; the
    // second fails three and then panics its kernel, so three runs again
    // (and passes) in the third, with four, keeping its place. The fourth
    // panics in five before finishing anything, so five runs second in the
    // fifth, after six.
    let out = moat_nested::run_steps(&bundle, &steps, 2, |given| {
        payloads.push(given.to_vec());
        let (fails, breaks) = match payloads.len() {
            2 => ("three", "three"),
            4 => ("none", "five"),
            _ => ("none", "none"),
        };
        Payload::script(&format!(
            r#"for s in {}; do
    echo "ran $s"
    [ $s = {breaks} ] && [ $s != {fails} ] && {{ echo c > /proc/sysrq-trigger; sleep 60; }}
    [ $s = two ] || [ $s = {fails} ] && echo "failed $s" > "$MOAT_NESTED_MARKS"
    echo "done $s" > "$MOAT_NESTED_MARKS"
    [ $s = {breaks} ] && {{ echo c > /proc/sysrq-trigger; sleep 60; }}
done
exit 0"#,
            given.join(" ")
        ))
    })
    .expect("the steps run");
    let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let expected = [
        names(&["one", "two"]),
        names(&["three", "four"]),
        names(&["three", "four"]),
        names(&["five", "six"]),
        names(&["six", "five"]),
    ];
    assert_eq!(payloads, expected);
    let ran = "ran one\nran two\nran three\nran three\nran four\nran five\nran six\nran five\n";
    assert_eq!(out.stdout_text(), ran, "{}", out.stderr_text());
    assert_ne!(out.code, 0, "step two's failure in the first level 1 is kept");
}

#[test]
#[ignore = "needs the default image, the static agent, QEMU and busybox-static; `cargo xtask test` provides them"]
fn a_level_1_of_the_nested_host_that_stops_answering_is_kicked_with_an_nmi() {
    // The heartbeat (init's other child, beside this payload) stopped for
    // 50 s stands in for a lost wake-up: the host kicks level 1 with an
    // NMI after 30 s, which level 1 reports and survives; the payload then
    // finishes as usual.
    let out = run(Payload::script(
        r#"for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    [ "$(awk '/^PPid/ {print $2}' $d/status 2>/dev/null)" = 1 ] && kill -STOP $p && stopped="$stopped $p"
done
sleep 50
kill -CONT $stopped
echo done"#,
    ))
    .expect("level 1 goes on after the NMI");
    assert_eq!((out.code, out.stdout_text().as_str()), (0, "done\n"), "stderr: {}", out.stderr_text());
    // Its kernel's report of the NMI (on QEMU microvm: "NMI: PCI system
    // error (SERR) for reason ff", the reason port reading all ones).
    let reported = out.console.lines().any(|l| l.contains("NMI") && l.contains("reason"));
    assert!(reported, "console:\n{}", out.console);
}

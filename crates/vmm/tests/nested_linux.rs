//! M6 end to end in the nested test host (crates/nested): the default
//! image boots under moat-vmm in level 2 with its root on virtio-blk through
//! a copy-on-write overlay and the agent reached over virtio-vsock, driven by
//! `moat run --backend vm` in level 1.
//!
//! Ignored by plain `cargo test`: it needs QEMU, the default image, the
//! static agent and busybox-static, which `cargo xtask test` provides. The
//! timeouts guard against hangs; they are not performance bounds.

#[test]
#[ignore = "needs the nested test host (QEMU, the default image, the static agent, busybox-static); cargo xtask test provides them"]
fn a_debian_sandbox_boots_on_the_overlay_disk_and_talks_over_vsock_in_the_nested_host() {
    // One sandbox: uname and python3, then 64 MiB of random bytes written
    // to its root (they must show up in its overlay while it runs, and
    // moat-vmm must hold the base read-only) and streamed back to the host
    // over vsock (the agent's stdout), where they must hash as in the guest.
    // The base is not hashed before and after: level 1 mounts it read-only,
    // so such a check could not fail (and hashing 4 GiB under TCG took 88 s
    // a pass); the descriptor's mode is what keeps a base unchanged.
    // (`moat run` does not forward stdin, so the host-to-guest direction is
    // left to core's vm sandbox tests.)
    let script = r#"
set -e
data=$HOME/.local/share/moat
moat run --backend vm -- sh -c 'uname -a; python3 -c "print(1)"; head -c 67108864 /dev/urandom > /workspace/f; sync; md5sum < /workspace/f >&2; sleep 15; cat /workspace/f' > /tmp/out 2> /tmp/err &
grown=no
for i in $(seq 240); do
  for ov in "$data"/sandboxes/*/overlay.img; do
    if [ -f "$ov" ] && [ "$(du -k "$ov" | cut -f1)" -ge 65536 ]; then grown=yes; fi
  done
  [ $grown = yes ] && break
  sleep 1
done
# While the guest sleeps after writing: how moat-vmm holds the base.
# moat-vmm runs jailed (a supervisor and the VMM in its own mount
# namespace): the descriptor is found by the base's device and inode.
base=$(stat -L -c %d:%i "$data/images/default/rootfs.ext4")
held=none
for pid in $(pidof moat-vmm); do
for fd in /proc/$pid/fd/*; do
  if [ "$(stat -L -c %d:%i "$fd" 2>/dev/null)" = "$base" ]; then
    flags=$(sed -n 's/^flags:[[:space:]]*//p' "/proc/$pid/fdinfo/${fd##*/}")
    if [ $(( flags & 3 )) -eq 0 ]; then held=read-only; else held="writable ($flags)"; fi
  fi
done
done
wait $! || { echo "moat run failed" >&2; cat /tmp/err >&2; exit 1; }
echo "overlay grew: $grown"
echo "base held: $held"
head -n 2 /tmp/out
tail -c +$(( $(head -n 2 /tmp/out | wc -c) + 1 )) /tmp/out | md5sum > /tmp/host.md5
cat /tmp/err >&2
if grep -q "$(cut -d' ' -f1 /tmp/host.md5)" /tmp/err; then echo "64 MiB from the guest: same bytes"; fi
"#;
    let out = moat_nested::run(moat_nested::Payload::script(script)).expect("level 1 runs the payload");
    let stdout = out.stdout_text();
    assert_eq!(out.code, 0, "stdout:\n{stdout}\nstderr:\n{}\nconsole:\n{}", out.stderr_text(), out.console);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.get(2).is_some_and(|l| l.starts_with("Linux ")), "uname -a: {stdout}");
    for want in ["1", "overlay grew: yes", "base held: read-only", "64 MiB from the guest: same bytes"] {
        assert!(lines.contains(&want), "{want:?} missing:\n{stdout}");
    }
}

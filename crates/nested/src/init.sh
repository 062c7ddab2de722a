#!/bin/busybox sh
# /init of the nested test host's level 1 (crates/nested).
#
# Reports each stage on the virtio-serial port "moat.control", runs the
# payload (/payload/run) with its stdout and stderr on the ports
# "moat.stdout" and "moat.stderr" (and "moat.marks" as $MOAT_NESTED_MARKS),
# reports its exit status, and powers off.
# With /payload/shell present it opens a shell on the console instead.
# Its own log goes to the serial console, with the kernel's.

/bin/busybox --install -s /bin
export PATH=/usr/bin:/bin HOME=/root TMPDIR=/tmp TERM=linux
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
# nsdelegate, as systemd mounts it: a cgroup namespace is a delegation
# boundary (what jails on cgroup v2 must live with).
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
# moat's data directory is on this root, a tmpfs of half the memory by
# default, and moat promises each microVM's overlay there the whole disk
# it may write (disk_mib): sized as a disk would be, for the tests' disks
# (what their guests write stays far below the memory).
mount -o remount,size=64G / 2>/dev/null || echo "moat-nested: cannot resize /; microVMs may be refused disk"

say() { echo "moat-nested: $*"; }
CONTROL=
report() { [ -n "$CONTROL" ] && echo "$*" > "$CONTROL"; }
halt() {
    sync
    poweroff -f
    # Without ACPI power-off the reset ends QEMU (-no-reboot).
    reboot -f
}
fail() {
    say "failed: $*"
    report "fail $*"
    halt
}

# A virtio-serial port by name: /dev/vportNpM.
port() {
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return 0; }
    done
    return 1
}

# A virtio disk by its serial: /dev/vdX.
disk() {
    for b in /sys/block/vd*; do
        [ "$(cat "$b/serial" 2>/dev/null)" = "$1" ] && { echo "/dev/${b##*/}"; return 0; }
    done
    return 1
}

# Waits (up to 30 s) for "$@" to succeed, printing its output.
await() {
    i=0
    while [ $i -lt 300 ]; do
        "$@" && return 0
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

load() {
    for m in $(cat "/etc/nested/$1"); do
        insmod "/modules/$m" || fail "insmod $m"
    done
}

say "init started"
load modules-early
CONTROL=$(await port moat.control) || fail "no virtio-serial port moat.control"
STDOUT=$(await port moat.stdout) || fail "no virtio-serial port moat.stdout"
STDERR=$(await port moat.stderr) || fail "no virtio-serial port moat.stderr"
MOAT_NESTED_MARKS=$(await port moat.marks) || fail "no virtio-serial port moat.marks"
export MOAT_NESTED_MARKS
read -r up _ < /proc/uptime
report "stage booted $up"
say "booted"

load modules-kvm
[ -c /dev/kvm ] || await test -c /dev/kvm || fail "no /dev/kvm after loading kvm-amd (does the CPU have svm?)"

BUNDLE=$(await disk moat-bundle) || fail "no bundle disk (virtio-blk serial moat-bundle)"
mount -t ext4 -o ro "$BUNDLE" /nested || fail "cannot mount the bundle disk $BUNDLE"

# A real use of /dev/kvm: QEMU creates a KVM VM (KVM_GET_API_VERSION,
# KVM_CREATE_VM, KVM_CREATE_VCPU…) and quits.
if ! echo quit | qemu-system-x86_64 -M none -accel kvm -nodefaults -display none -monitor stdio > /tmp/kvm-check 2>&1; then
    cat /tmp/kvm-check
    fail "QEMU cannot use KVM in level 1"
fi
read -r up _ < /proc/uptime
report "stage kvm $up"
say "kvm works"

# The data directory as moat finds it by default, with the image's small
# files from the bundle disk and its root disk from its own disk.
IMAGE=$(cat /etc/nested/image)
ROOTFS=$(await disk moat-rootfs) || fail "no image root disk (virtio-blk serial moat-rootfs)"
mount -t ext4 -o ro "$ROOTFS" /nested-rootfs || fail "cannot mount the image root disk $ROOTFS"
dir=/root/.local/share/moat/images/$IMAGE
mkdir -p "$dir/rootfs"
# The image's rootfs/ tree (ownership shifted as on the host) for jails.
if [ -d /nested-rootfs/jail-rootfs ]; then
    mount --bind /nested-rootfs/jail-rootfs "$dir/rootfs" || fail "cannot bind the jails' root file system"
fi
for f in vmlinux config initramfs.cpio.gz manifest.json; do
    ln -s "/nested/image/$f" "$dir/$f"
done
ln -s /nested-rootfs/rootfs.ext4 "$dir/rootfs.ext4"
export MOAT_AGENT=/usr/bin/moat-agent
hostname nested
ip link set lo up
cd /root

if [ -e /payload/shell ]; then
    report "stage started"
    say "level-1 shell; the image is at $dir; exit (or Ctrl-A X) powers off"
    dmesg -n 1
    setsid cttyhack sh -l
    report "stage finished $?"
    halt
fi

report "stage started"
# A heartbeat, so that the host tells a level 1 that stopped (a hung
# kernel) from a payload that takes long.
( while sleep 5; do report alive; done ) &
heartbeat=$!
sh /payload/run < /dev/null > "$STDOUT" 2> "$STDERR"
code=$?
kill $heartbeat
report "stage finished $code"
say "payload exited with $code"
halt

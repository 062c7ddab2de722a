//! The Debian package `cargo xtask dist` makes, installed with apt on a
//! fresh Debian root (made here by mmdebstrap, run as a container: its own
//! mount namespace and root, the host's kernel, /dev and /sys).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Builds the container's mounts and enters it (`$1`: its root, `$2`:
/// the host's images, lent read-only so no image is built here), with none
/// of the test's environment (`MOAT_AGENT` and friends point at the
/// checkout). Its own root, not a chroot: user namespaces (jails) are
/// refused to a chrooted process.
const ENTER: &str = r#"set -e
mount --make-rprivate /
mount --bind "$1" "$1"
mount -t proc proc "$1/proc"
mount --rbind /dev "$1/dev"
mount --rbind /sys "$1/sys"
mkdir -p "$1/root/.local/share/moat/images" "$1/.host"
mount --bind -o ro "$2" "$1/root/.local/share/moat/images"
cp /etc/resolv.conf "$1/etc/resolv.conf"
cd "$1"
pivot_root . .host
exec chroot . /.host/usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root sh -c \
    '/.host/usr/bin/umount -l /.host && rmdir /.host && exec sh -s'
"#;

/// What runs in the container, a section for each check.
const CHECKS: &str = r#"export DEBIAN_FRONTEND=noninteractive
apt-get update -q > /dev/null
echo "== install"
apt-get install -y -q --no-install-recommends /tmp/moat.deb > /tmp/install.log 2>&1 || tail -20 /tmp/install.log
echo "== version"
moat --version
echo "== files"
dpkg -L moat
echo "== doctor"
moat doctor 2>&1
echo "== fix"
moat doctor --fix 2>&1 && echo "fix: exit 0"
echo "== run"
MOAT_LOG_LEVEL=error moat run --backend jail -- sh -c 'echo "hello from $(id -un)"; python3 -c "print(6 * 7)"' 2>&1
echo "== mcp"
moat-mcp --help 2>&1
echo "== remove"
apt-get remove -y -q moat > /dev/null 2>&1
ls /usr/bin/moat /usr/lib/moat 2>&1
echo "== end"
"#;

fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let start = out.find(&format!("== {name}\n")).unwrap_or_else(|| panic!("no section {name} in:\n{out}"));
    let body = &out[start + name.len() + 4..];
    let next = body.match_indices("== ").map(|(i, _)| i).find(|&i| i == 0 || body.as_bytes()[i - 1] == b'\n');
    &body[..next.unwrap_or(body.len())]
}

#[test]
#[ignore = "needs root, mmdebstrap, the default image and the package in MOAT_DEB; `cargo xtask test` provides them"]
fn the_package_installs_on_a_fresh_debian_and_runs_a_sandbox() {
    let deb = PathBuf::from(std::env::var_os("MOAT_DEB").expect("MOAT_DEB names the package to install"));
    let images = moat_core::image::data_dir().join("images");
    assert!(images.join("default/manifest.json").is_file(), "the default image is built");
    let dir = tempfile::Builder::new().prefix("moat-dist-").tempdir_in("/var/tmp").expect("a scratch directory");
    let root = dir.path().join("root");
    let mirror = std::env::var("MOAT_DEBIAN_MIRROR").unwrap_or_else(|_| "http://deb.debian.org/debian".into());
    let made = Command::new("mmdebstrap")
        .args(["--mode=root", "--variant=apt", "--format=directory", "--quiet", "bookworm"])
        .arg(&root)
        .arg(&mirror)
        .stdin(Stdio::null())
        .output()
        .expect("mmdebstrap runs");
    assert!(made.status.success(), "mmdebstrap: {}", String::from_utf8_lossy(&made.stderr));
    std::fs::copy(&deb, root.join("tmp/moat.deb")).expect("the package copied in");

    let mut child = Command::new("unshare")
        .args(["--mount", "--fork", "sh", "-c", ENTER, "enter"])
        .arg(&root)
        .arg(&images)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare starts");
    child.stdin.take().expect("stdin").write_all(CHECKS.as_bytes()).expect("the checks written");
    let out = child.wait_with_output().expect("the container ends");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("== end"), "the checks ran to the end");

    assert_eq!(section(&text, "install"), "", "apt installs the package with nothing said");
    assert!(section(&text, "version").starts_with("moat "), "{text}");
    let files = section(&text, "files");
    for file in [
        "/usr/bin/moat",
        "/usr/bin/moat-mcp",
        "/usr/bin/moat-vmm",
        "/usr/lib/moat/moat-agent",
        "/usr/share/man/man1/moat.1.gz",
        "/usr/share/man/man1/moat-doctor.1.gz",
        "/usr/share/man/man1/moat-mcp.1.gz",
        "/usr/share/man/man1/moat-vmm.1.gz",
        "/usr/share/doc/moat/README.md",
        "/usr/share/doc/moat/security.md",
        "/usr/share/doc/moat/copyright",
    ] {
        assert!(files.lines().any(|l| l == file), "{file} is in the package:\n{files}");
    }
    // Installed without recommends: moat runs, and says what is missing.
    let doctor = section(&text, "doctor");
    assert!(doctor.contains("agent:                   /usr/lib/moat/moat-agent"), "{doctor}");
    assert!(doctor.contains("moat-vmm:                /usr/bin/moat-vmm"), "{doctor}");
    assert!(doctor.contains("unavailable: no pasta (apt-get install passt)"), "{doctor}");
    // --fix installs it, leaves the image there as it is, and says so.
    let fix = section(&text, "fix");
    assert!(fix.contains("fix: host packages: installed passt, uidmap"), "{fix}");
    assert!(fix.contains("fix: image \"default\": present"), "{fix}");
    assert!(fix.contains("fix: exit 0"), "{fix}");
    assert!(fix.contains("network open (jail):     pasta at /usr/bin/pasta"), "the report after fixing:\n{fix}");
    // A sandbox from the installed binaries and agent.
    assert_eq!(section(&text, "run"), "hello from user\n42\n", "{text}");
    assert!(section(&text, "mcp").contains("Usage: moat-mcp"), "{text}");
    let removed = section(&text, "remove");
    assert!(
        removed.contains("'/usr/bin/moat': No such file") && removed.contains("'/usr/lib/moat': No such file"),
        "{removed}"
    );
}

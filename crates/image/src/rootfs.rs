//! The root file system: Debian bookworm from mmdebstrap, as a directory
//! (the jail's overlay lower layer) and as an ext4 image (the VM's disk).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// What every sandbox has. Changing this list changes the image's input key.
pub const PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python3-venv",
    "ipython3",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "git",
    "curl",
    "ca-certificates",
    "build-essential",
    "nodejs",
    "npm",
    // Go and Rust, Debian's: `runtime: go` and `runtime: rust` sandboxes.
    "golang-go",
    "rustc",
    "cargo",
    "procps",
    "less",
];

/// The Debian release images are built from.
pub const SUITE: &str = "bookworm";

/// The mirror, `$MOAT_DEBIAN_MIRROR` or Debian's CDN.
pub fn mirror() -> String {
    std::env::var("MOAT_DEBIAN_MIRROR").unwrap_or_else(|_| "http://deb.debian.org/debian".into())
}

/// Shell hooks mmdebstrap runs on the finished tree (`$1` is its root).
const CUSTOMIZE: &[&str] = &[
    r#"chroot "$1" useradd --create-home --uid 1000 --user-group --shell /bin/bash user"#,
    r#"mkdir -p "$1/workspace" && chroot "$1" chown user:user /workspace"#,
    r#"echo 'LANG=C.UTF-8' > "$1/etc/default/locale""#,
    r#"printf 'export LANG=C.UTF-8\n' > "$1/etc/profile.d/moat-locale.sh""#,
    r#"echo sandbox > "$1/etc/hostname""#,
    r#"printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tsandbox\n' > "$1/etc/hosts""#,
    r#"rm -f "$1/etc/resolv.conf" && touch "$1/etc/resolv.conf""#,
    r#"rm -rf "$1/var/lib/apt/lists/"* "$1/var/cache/apt/"*.bin"#,
];

/// Runs mmdebstrap in `mode` (`root`, or `unshare` for a user other than
/// root) into `dest` (a directory that must not exist), logging to `log`.
pub fn debootstrap(dest: &Path, log: &Path, mode: &str) -> Result<()> {
    let log_file = std::fs::File::create(log)?;
    let mut command = Command::new("mmdebstrap");
    command.arg(format!("--mode={mode}")).args(["--variant=minbase", "--format=directory"]);
    command.arg(format!("--include={}", PACKAGES.join(",")));
    for hook in CUSTOMIZE {
        command.arg(format!("--customize-hook={hook}"));
    }
    let mirror = mirror();
    let security = mirror.replace("/debian", "/debian-security");
    command
        .arg(SUITE)
        .arg(dest)
        .arg(format!("deb {mirror} {SUITE} main"))
        .arg(format!("deb {mirror} {SUITE}-updates main"))
        .arg(format!("deb {security} {SUITE}-security main"))
        .stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let status = command.status().context("cannot start mmdebstrap")?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<_> = text.lines().rev().take(15).collect();
        bail!(
            "mmdebstrap failed ({status}); the last lines of {}:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// Debian package → version installed in the tree at `root`.
pub fn package_versions(root: &Path) -> Result<BTreeMap<String, String>> {
    let out = Command::new("dpkg-query")
        .arg(format!("--admindir={}", root.join("var/lib/dpkg").display()))
        .args(["-W", "-f", "${Package}\t${Version}\n"])
        .output()
        .context("cannot run dpkg-query")?;
    if !out.status.success() {
        bail!("dpkg-query failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(p, v)| (p.to_owned(), v.to_owned()))
        .collect())
}

/// The size of the ext4 disk: the guest's file system, whose free space
/// bounds the `disk_mib` a VM sandbox can have (its writes go to its
/// copy-on-write overlay; unused blocks cost the sparse base nothing).
pub const EXT4_SIZE_MIB: u64 = 8192;

/// mkfs.ext4's options for the VM's disk, before `-d TREE FILE SIZE`.
pub fn ext4_args() -> Vec<String> {
    [
        // Inode tables and journal zeroed now, in the shared base, not by
        // ext4's lazy init in every VM on first mount (64 MiB of zeros per
        // sandbox, and I/O while it runs).
        "-q",
        "-F",
        "-L",
        "moat-root",
        "-E",
        "root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0",
        // No blocks reserved for root (a sandbox's root may write what its
        // user may: the agent leaves `disk_mib` free for both); an inode per
        // 32 KiB and a 64 MiB journal, the metadata each VM's overlay
        // leaves room for (see moat-core's `rootdisk`).
        "-m",
        "0",
        "-i",
        "32768",
        "-J",
        "size=64",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The size argument that ends mkfs.ext4's command line.
pub fn ext4_size() -> String {
    format!("{EXT4_SIZE_MIB}M")
}

/// Makes `dest` an ext4 image holding `root`, with ids as they are (0 and 1000).
pub fn make_ext4(root: &Path, dest: &Path) -> Result<()> {
    let status = Command::new("mkfs.ext4")
        .args(ext4_args())
        .arg("-d")
        .arg(root)
        .arg(dest)
        .arg(ext4_size())
        .stdout(std::process::Stdio::null())
        .status()
        .context("cannot start mkfs.ext4")?;
    if !status.success() {
        bail!("mkfs.ext4 failed ({status})");
    }
    Ok(())
}

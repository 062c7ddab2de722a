//! `cargo xtask dist`: the Debian package, `target/dist/moat_VERSION_amd64.deb`.
//!
//! Staged by hand and packed with dpkg-deb, Debian's own tool: the package
//! is four binaries, manual pages and docs, which needs no more than a
//! control file (cargo-deb would add a compile of its own to every
//! machine that builds the package, the gate's among them).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::build;
use crate::host::{cargo, ensure_packages, root, run};

/// The host binaries, installed in `/usr/bin`.
const BINARIES: &[&str] = &["moat", "moat-mcp", "moat-vmm"];

/// What packing needs: dpkg-deb, and strip for the binaries.
const DIST_PACKAGES: &[(&str, &str)] = &[("dpkg", "dpkg-deb"), ("binutils", "strip")];

/// What the package needs and what it uses: glibc (the host binaries link
/// it; the agent is static); pasta/passt for network `open`, newuidmap for
/// rootless jails, and what `moat image build` runs (which `moat doctor
/// --fix` installs when recommends were left out).
const DEPENDS: &str = "libc6 (>= 2.36)";
const RECOMMENDS: &str = "passt, uidmap, mmdebstrap, e2fsprogs, kmod, binutils, apt, dpkg";
const SUGGESTS: &str = "openssh-client";

#[derive(Debug, clap::Args)]
pub struct DistArgs {
    /// Cargo profile of the host binaries: `release`, or `dev` (the test
    /// build's binaries, which the gate packages to spare a release build).
    #[arg(long, default_value = "release")]
    profile: String,
}

impl DistArgs {
    /// The package of the test build's binaries.
    pub fn of_test_build() -> Self {
        Self { profile: "dev".into() }
    }
}

/// Builds the package and returns its path.
pub fn dist(args: &DistArgs) -> Result<PathBuf> {
    ensure_packages(DIST_PACKAGES)?;
    let (profile_dir, compression) = match args.profile.as_str() {
        "release" => ("release", "xz"),
        // Big unoptimized binaries: gzip packs them in seconds.
        "dev" => ("debug", "gzip"),
        other => bail!("unknown profile {other:?}: use release or dev"),
    };
    let agent = build::static_agent()?;
    let mut command = cargo();
    command.args(["build", "--profile", &args.profile]);
    for bin in BINARIES {
        command.args(["--bin", bin]);
    }
    run(&mut command)?;

    let version = env!("CARGO_PKG_VERSION");
    let dist = root().join("target/dist");
    let stage = dist.join(format!("moat_{version}_amd64"));
    let _ = std::fs::remove_dir_all(&stage);
    let bin_dir = stage.join("usr/bin");
    let lib_dir = stage.join("usr/lib/moat");
    let man_dir = stage.join("usr/share/man/man1");
    let doc_dir = stage.join("usr/share/doc/moat");
    for dir in [&bin_dir, &lib_dir, &man_dir, &doc_dir, &stage.join("DEBIAN")] {
        std::fs::create_dir_all(dir)?;
    }
    for bin in BINARIES {
        install(&root().join("target").join(profile_dir).join(bin), &bin_dir.join(bin), 0o755)?;
        // Each binary writes its own pages, from its own clap parser.
        run(Command::new(bin_dir.join(bin)).arg("--write-manual").arg(&man_dir))?;
    }
    // Where moat finds it when installed (`moat_core::moat::find_agent`).
    install(&agent, &lib_dir.join("moat-agent"), 0o755)?;
    for page in std::fs::read_dir(&man_dir)? {
        gzip(&page?.path())?;
    }
    install(&root().join("README.md"), &doc_dir.join("README.md"), 0o644)?;
    for doc in std::fs::read_dir(root().join("docs"))? {
        let doc = doc?.path();
        if doc.extension().is_some_and(|e| e == "md") {
            let name = doc.file_name().context("a doc without a name")?;
            install(&doc, &doc_dir.join(name), 0o644)?;
        }
    }
    std::fs::write(doc_dir.join("copyright"), copyright())?;
    let size_kib = tree_size(&stage)?.div_ceil(1024);
    std::fs::write(stage.join("DEBIAN/control"), control(version, size_kib))?;

    let deb = dist.join(format!("moat_{version}_amd64.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", &format!("-Z{compression}"), "--build"])
        .arg(&stage)
        .arg(&deb))?;
    let _ = std::fs::remove_dir_all(&stage);
    let size = std::fs::metadata(&deb)?.len();
    #[allow(clippy::cast_precision_loss)]
    let mib = size as f64 / f64::from(1 << 20);
    println!("{} ({mib:.1} MiB): install it with `apt install {}`", deb.display(), deb.display());
    Ok(deb)
}

/// Copies `from` to `to` with `mode`; binaries lose their debug sections,
/// as Debian's own packages do.
fn install(from: &Path, to: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(from, to).with_context(|| format!("copying {} into the package", from.display()))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    if mode & 0o111 != 0 {
        run(Command::new("strip").arg("--strip-debug").arg(to))?;
    }
    Ok(())
}

/// Replaces `path` by `path.gz`, compressed as `gzip -9n` would: no name
/// and no time in the header, so the package is the same for the same pages.
fn gzip(path: &Path) -> Result<()> {
    let text = std::fs::read(path)?;
    let mut out = path.as_os_str().to_owned();
    out.push(".gz");
    let file = std::fs::File::create(&out)?;
    let mut encoder = flate2::GzBuilder::new().mtime(0).write(file, flate2::Compression::best());
    std::io::Write::write_all(&mut encoder, &text)?;
    encoder.finish()?;
    std::fs::remove_file(path)?;
    Ok(())
}

fn tree_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { tree_size(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}

fn control(version: &str, size_kib: u64) -> String {
    format!(
        "Package: moat\n\
         Version: {version}\n\
         Architecture: amd64\n\
         Maintainer: moat developers <moat@moat.dev>\n\
         Section: admin\n\
         Priority: optional\n\
         Installed-Size: {size_kib}\n\
         Depends: {DEPENDS}\n\
         Recommends: {RECOMMENDS}\n\
         Suggests: {SUGGESTS}\n\
         Homepage: {}\n\
         Description: disposable, isolated Linux machines for AI agents\n \
         moat gives AI agents sandboxes to run commands and code in, read and\n \
         write files, clone repositories and preview web apps: KVM microVMs\n \
         under moat's own monitor, or namespace jails where the host has no\n \
         hardware virtualization. moat-mcp serves them over the Model Context\n \
         Protocol; moat is the command line for people.\n \
         .\n \
         After installing, `moat doctor --fix` installs what is missing and\n \
         builds the sandbox image.\n",
        env!("CARGO_PKG_REPOSITORY")
    )
}

fn copyright() -> String {
    format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: moat\n\
         Source: {}\n\
         \n\
         Files: *\n\
         Copyright: moat developers\n\
         License: Apache-2.0\n \
         On Debian systems, the full text of the Apache License 2.0 is in\n \
         /usr/share/common-licenses/Apache-2.0.\n",
        env!("CARGO_PKG_REPOSITORY")
    )
}

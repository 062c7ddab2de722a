//! moat's sandbox images: built from Debian's archive, cached and verified
//! under the data directory. `cargo xtask image` and `moat image build`
//! (and `moat doctor --fix`) both build with [`build`].
//!
//! The image is assembled in `images/.NAME.build-PID/` and renamed into
//! place only when complete, so a sandbox never sees half an image. A run
//! whose inputs (agent, kernel version, package list, format) match the
//! existing image's manifest only verifies it; when just the agent or the
//! kernel changed, the root file system is reused.

pub mod cpio;
pub mod host;
mod initramfs;
mod kernel;
mod rootfs;
mod userns;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use moat_core::hostuser::HostUser;
use moat_core::image::{self, Artifact, FILE_ARTIFACTS, FORMAT_VERSION, Image, JAIL_ID_BASE, KernelInfo, Manifest};

use crate::host::{ensure_packages, is_root, run};

/// Host packages an image build needs, each with a program it provides.
pub const HOST_PACKAGES: &[(&str, &str)] = &[
    ("mmdebstrap", "mmdebstrap"),
    ("e2fsprogs", "mkfs.ext4"),
    ("kmod", "depmod"),
    ("dpkg", "dpkg-deb"),
    ("binutils", "strip"),
    ("apt", "apt-get"),
];

/// Bumped when the way images are put together changes.
const RECIPE_VERSION: &str = "3";

/// Why an image could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("Image name {0:?} is not valid: use 1-64 letters, digits, '-' or '_'")]
    Name(String),
    /// A user other than root cannot build (no subordinate ids, say): what
    /// to change, in words.
    #[error("Building an image as this user is not possible yet: {0}")]
    Rootless(String),
    #[error("The agent {0} cannot be read: build it (`cargo xtask build`) or set MOAT_AGENT")]
    Agent(PathBuf, #[source] std::io::Error),
    #[error("There is no image {name:?} at {} (`moat image build --name {name}` builds one)", dir.display())]
    Missing { name: String, dir: PathBuf },
    #[error("Removing image {name:?} failed; what is left is in {}", dir.display())]
    Remove {
        name: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The build drives a dozen Debian tools (apt, mmdebstrap, depmod,
    /// mkfs.ext4); each failure carries the command and what it printed,
    /// added as context where it happened.
    #[error("Building image {name:?} failed")]
    Failed {
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Who builds, and so who owns the jails' root file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Builder {
    /// mmdebstrap `--mode=root`; the tree then moves to [`JAIL_ID_BASE`].
    Root,
    /// Any other user: mmdebstrap `--mode=unshare`, the tree owned from
    /// the user's subordinate range, which starts at `base` ([`userns`]).
    User { base: u32 },
}

impl Builder {
    fn base(self) -> u32 {
        match self {
            Self::Root => JAIL_ID_BASE,
            Self::User { base } => base,
        }
    }

    /// Removes a build or an old image, whoever owns its files.
    fn remove(self, path: &Path) -> std::io::Result<()> {
        match self {
            Self::Root => std::fs::remove_dir_all(path),
            Self::User { .. } => userns::remove_tree(path),
        }
    }
}

/// Builds the image `name` under the data directory around `agent` (the
/// static moat-agent, its `/init`), or only verifies it when its inputs are
/// unchanged (`force` rebuilds everything). Installs the host packages the
/// build needs (as root; a user is told the line to run). Root builds with
/// mmdebstrap's root mode; any other user with its unshare mode, the files
/// owned by the user's subordinate ids. Returns the image's directory.
pub fn build(name: &str, force: bool, agent: &Path) -> std::result::Result<PathBuf, BuildError> {
    validate_name(name)?;
    let builder = if is_root() {
        Builder::Root
    } else {
        Builder::User { base: userns::base(&HostUser::current()).map_err(|e| BuildError::Rootless(e.to_string()))? }
    };
    if let Err(e) = std::fs::File::open(agent) {
        return Err(BuildError::Agent(agent.to_owned(), e));
    }
    build_as(builder, name, force, agent).map_err(|e| BuildError::Failed { name: name.to_owned(), source: e.into() })
}

/// Removes the image `name` from the data directory: renamed aside first,
/// so no sandbox starts from half of it, then deleted. A user's own build,
/// whose files its subordinate ids own, is deleted from inside its user
/// namespace ([`userns`]). Sandboxes started from it should be gone first:
/// a jail's root file system is the image's tree. Returns where it was.
pub fn remove(name: &str) -> std::result::Result<PathBuf, BuildError> {
    validate_name(name)?;
    let data = image::data_dir();
    let dir = image::image_dir(&data, name);
    if !dir.join("manifest.json").exists() {
        return Err(BuildError::Missing { name: name.to_owned(), dir });
    }
    let builder = if is_root() { Builder::Root } else { Builder::User { base: 0 } };
    let aside = data.join("images").join(format!(".{name}.old-{}", std::process::id()));
    let failed = |dir: &Path| {
        let dir = dir.to_owned();
        move |source| BuildError::Remove { name: name.to_owned(), dir, source }
    };
    std::fs::rename(&dir, &aside).map_err(failed(&dir))?;
    builder.remove(&aside).map_err(failed(&aside))?;
    Ok(dir)
}

fn build_as(builder: Builder, name: &str, force: bool, agent: &Path) -> Result<PathBuf> {
    ensure_packages(HOST_PACKAGES)?;
    let data = image::data_dir();
    let images = data.join("images");
    let cache = data.join("cache");
    std::fs::create_dir_all(&images)?;
    std::fs::create_dir_all(&cache)?;
    let final_dir = image::image_dir(&data, name);
    let started = Instant::now();

    // A fresh machine may have no package lists yet: update once and retry.
    let (kernel_package, kernel_version) = match kernel::resolve() {
        Ok(found) => found,
        Err(_) => {
            run(Command::new("apt-get").args(["update", "-q"]))?;
            kernel::resolve()?
        }
    };
    let inputs = inputs(agent, &kernel_package, &kernel_version)?;

    let existing = Image::open(&data, name).ok();
    if !force
        && let Some(image) = &existing
        && image.manifest.inputs == inputs
    {
        let step = Step::start("verify", "checking every artifact against the manifest");
        match builder {
            Builder::Root => image.verify()?,
            Builder::User { base } => image.verify_with(|tree| userns::digest_tree(tree, base))?,
        }
        step.done(&format!("up to date ({})", human(image_size(image))));
        report(&final_dir, image, started);
        return Ok(final_dir);
    }

    clean_stale_builds(builder, &images, name);
    let work = images.join(format!(".{name}.build-{}", std::process::id()));
    let _cleanup = RemoveOnDrop(builder, work.clone());
    std::fs::create_dir_all(&work)?;

    let step = Step::start("kernel", &format!("{kernel_package} {kernel_version}"));
    let kernel = kernel::fetch(&cache, &kernel_package, &kernel_version)?;
    let config = std::fs::read_to_string(kernel.config())?;
    kernel::check_config(&config)?;
    let vmlinux = kernel::extract_vmlinux(&std::fs::read(kernel.vmlinuz())?)?;
    let pvh = kernel::has_pvh_note(&vmlinux);
    std::fs::write(work.join("vmlinux"), &vmlinux)?;
    std::fs::write(work.join("config"), &config)?;
    step.done(&format!("vmlinux {} ({}, PVH entry: {})", kernel.release, human(vmlinux.len() as u64), yes(pvh)));

    let step = Step::start("initramfs", "the static agent as /init and its modules");
    let modules = initramfs::build(&work.join("initramfs.cpio.gz"), agent, &kernel.modules_dir(), &kernel.release)?;
    let size = std::fs::metadata(work.join("initramfs.cpio.gz"))?.len();
    step.done(&format!("{} modules, {}", modules.len(), human(size)));

    // Root links the old tree's files into the new image. A user may not
    // (the kernel refuses hard links to files of other owners, and those
    // are its subordinate ids'), so it builds the tree again.
    let reuse = existing.as_ref().filter(|image| {
        builder == Builder::Root
            && image.manifest.jail_id_base == JAIL_ID_BASE
            && !force
            && image.manifest.inputs.get("rootfs") == inputs.get("rootfs")
    });
    let (packages, tree) = match reuse {
        Some(old) => {
            let step = Step::start("rootfs", "unchanged: linking the existing root file system");
            run(Command::new("cp").arg("-al").arg(old.path("rootfs")).arg(work.join("rootfs")))?;
            std::fs::hard_link(old.path("rootfs.ext4"), work.join("rootfs.ext4"))?;
            step.done("reused");
            (old.manifest.packages.parse()?, old.manifest.rootfs.clone())
        }
        None => {
            let mode = match builder {
                Builder::Root => "root",
                Builder::User { .. } => "unshare",
            };
            let step = Step::start(
                "rootfs",
                &format!(
                    "mmdebstrap --mode={mode} {} with {} packages (log: {})",
                    rootfs::SUITE,
                    rootfs::PACKAGES.len(),
                    cache.join("mmdebstrap.log").display()
                ),
            );
            let tree = work.join("rootfs");
            rootfs::debootstrap(&tree, &cache.join("mmdebstrap.log"), mode)?;
            if let Builder::User { base } = builder {
                userns::check_owner(&tree, base)?;
            }
            let packages = rootfs::package_versions(&tree)?;
            step.done(&format!("{} packages installed (mmdebstrap --mode={mode})", packages.len()));

            let step = Step::start("rootfs.ext4", &format!("{} MiB ext4 disk for microVMs", rootfs::EXT4_SIZE_MIB));
            match builder {
                Builder::Root => rootfs::make_ext4(&tree, &work.join("rootfs.ext4"))?,
                Builder::User { .. } => userns::make_ext4(&tree, &work.join("rootfs.ext4"))?,
            }
            let used = std::fs::metadata(work.join("rootfs.ext4"))
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)?;
            step.done(&format!("{} allocated", human(used)));

            let tree = match builder {
                Builder::Root => {
                    let step = Step::start(
                        "ownership",
                        &format!("shifting rootfs/ to host ids from {JAIL_ID_BASE} for jails"),
                    );
                    let count = image::shift_ownership(&tree, 0, JAIL_ID_BASE)?;
                    step.done(&format!("{count} entries"));
                    image::digest_tree(&tree)?
                }
                // Owned from the user's range already, as its jails map it.
                Builder::User { base } => userns::digest_tree(&tree, base)?,
            };
            (packages, tree)
        }
    };

    let step = Step::start("manifest", "hashing artifacts");
    let mut artifacts = BTreeMap::new();
    for file in FILE_ARTIFACTS {
        artifacts.insert((*file).to_owned(), image::hash_file(&work.join(file))?);
    }
    let manifest = Manifest {
        name: name.into(),
        format: FORMAT_VERSION,
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        kernel: KernelInfo { package: kernel.package, version: kernel.version, release: kernel.release, pvh },
        modules,
        packages: moat_core::image::Packages::new(&packages),
        inputs,
        artifacts,
        rootfs: tree,
        jail_id_base: builder.base(),
    };
    std::fs::write(work.join("manifest.json"), serde_json::to_string_pretty(&manifest)? + "\n")?;
    step.done("written");

    // Swap the finished image in: the old one moves aside, then goes.
    let old = images.join(format!(".{name}.old-{}", std::process::id()));
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old)?;
    }
    std::fs::rename(&work, &final_dir)?;
    let _ = builder.remove(&old);
    let image = Image::open(&data, name)?;
    report(&final_dir, &image, started);
    Ok(final_dir)
}

/// An image name as every image is named ([`image::valid_name`]), and,
/// for a new one, not starting with `-`, which tools would read as an option.
fn validate_name(name: &str) -> std::result::Result<(), BuildError> {
    let ok = image::valid_name(name) && !name.starts_with('-');
    if ok { Ok(()) } else { Err(BuildError::Name(name.to_owned())) }
}

fn inputs(agent: &Path, kernel_package: &str, kernel_version: &str) -> Result<BTreeMap<String, String>> {
    let agent_hash = image::hash_file(agent).with_context(|| format!("hashing {}", agent.display()))?.sha256;
    let rootfs_key = format!(
        "recipe {RECIPE_VERSION}; {} {}; packages {}",
        rootfs::SUITE,
        rootfs::mirror(),
        rootfs::PACKAGES.join(",")
    );
    Ok(BTreeMap::from([
        ("agent".into(), agent_hash),
        ("kernel".into(), format!("{kernel_package} {kernel_version}")),
        // How the initramfs is made and its module list: changing either
        // (adding virtio_net, stripping the agent) rebuilds it.
        ("initramfs".into(), format!("recipe {}; modules {}", initramfs::RECIPE, initramfs::MODULES.join(","))),
        ("recipe".into(), RECIPE_VERSION.into()),
        ("rootfs".into(), rootfs_key),
    ]))
}

/// Removes build directories that crashed runs left behind.
fn clean_stale_builds(builder: Builder, images: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(images) else { return };
    for entry in entries.filter_map(Result::ok) {
        let file = entry.file_name().to_string_lossy().into_owned();
        let owner = file
            .strip_prefix(&format!(".{name}.build-"))
            .or_else(|| file.strip_prefix(&format!(".{name}.old-")))
            .and_then(|pid| pid.parse::<u32>().ok());
        // Another build (another checkout's gate) may be using its own:
        // only a dead builder's directory is a leftover.
        if let Some(pid) = owner
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            eprintln!("removing a leftover build directory {}", entry.path().display());
            let _ = builder.remove(&entry.path());
        }
    }
}

struct RemoveOnDrop(Builder, PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if self.1.exists() {
            let _ = self.0.remove(&self.1);
        }
    }
}

/// One build step on the terminal: a spinner with elapsed time, then a line.
struct Step {
    bar: ProgressBar,
    name: &'static str,
    started: Instant,
}

impl Step {
    fn start(name: &'static str, what: &str) -> Self {
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix:>12} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(name);
        bar.set_message(what.to_owned());
        bar.enable_steady_tick(Duration::from_millis(120));
        Self { bar, name, started: Instant::now() }
    }

    fn done(self, summary: &str) {
        self.bar.finish_and_clear();
        eprintln!("✓ {:>12} {summary} ({:.1}s)", self.name, self.started.elapsed().as_secs_f64());
    }
}

fn image_size(image: &Image) -> u64 {
    image.manifest.artifacts.values().map(|a: &Artifact| a.size).sum::<u64>() + image.manifest.rootfs.bytes
}

#[allow(clippy::print_stdout)]
fn report(dir: &Path, image: &Image, started: Instant) {
    println!("image {:?} at {}", image.name, dir.display());
    for (file, artifact) in &image.manifest.artifacts {
        println!("  {file:<18} {:>10}", human(artifact.size));
    }
    println!(
        "  {:<18} {:>10} in {} entries",
        "rootfs/",
        human(image.manifest.rootfs.bytes),
        image.manifest.rootfs.entries
    );
    println!(
        "  kernel {}, {} Debian packages",
        image.manifest.kernel.release,
        image.manifest.packages.parse().map_or(0, |p| p.len())
    );
    println!("done in {:.1}s", started.elapsed().as_secs_f64());
}

#[allow(clippy::cast_precision_loss)]
pub fn human(bytes: u64) -> String {
    let mib = bytes as f64 / (1024.0 * 1024.0);
    if mib >= 1024.0 { format!("{:.2} GiB", mib / 1024.0) } else { format!("{mib:.1} MiB") }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

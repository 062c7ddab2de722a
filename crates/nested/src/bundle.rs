//! The level-1 boot bundle: what level 1 boots and mounts, built once per
//! content and cached under the cargo target directory.
//!
//! | piece | where | why there |
//! |---|---|---|
//! | the image's `vmlinux` | passed to QEMU as it is | level 1 runs the same kernel as the sandboxes |
//! | `initramfs.cpio.gz` | `<cache>/<key>/` | busybox, `/init`, and only the modules level 1 needs: small, so it unpacks fast under TCG |
//! | `bundle.ext4` | `<cache>/<key>/`, read-only virtio-blk disk | the moat binaries, QEMU with the shared libraries it links, QEMU's firmware, the image's small files: a few hundred MiB, too big for an initramfs |
//! | `rootfs-disk.ext4` | `<cache>/rootfs-<key>/`, read-only virtio-blk disk | an ext4 holding the image's `rootfs.ext4` as a regular file, as moat-vmm takes disks; built once per root file system (about 20 s), not per binary |
//!
//! The key is a SHA-256 over the contents of every input (the image's
//! artifacts through the hashes in its manifest), so a rebuilt binary or
//! image makes a new bundle and an unchanged one is reused as it is.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use flate2::Compression;
use flate2::write::GzEncoder;
use moat_agent::boot::{ModuleDeps, module_name};
use moat_core::image::{Image, data_dir};
use moat_core::programs::find_program;
use sha2::{Digest, Sha256};

use crate::cpio::Cpio;
use crate::error::{Error, Result};

/// Level 1's `/init`.
const INIT: &str = include_str!("init.sh");

/// Bumped when the bundle's layout changes, so that old caches are not reused.
const BUNDLE_FORMAT: &str = "moat-nested bundle 1";

/// Modules level 1 loads before it reports `booted`: the virtio-mmio
/// transport (the devices are described in ACPI), the result channel
/// (virtio-serial) and the disks.
const EARLY_MODULES: &[&str] = &["virtio_mmio", "virtio_console", "virtio_blk"];

/// Modules for the `kvm` stage: KVM on AMD SVM (what TCG's `-cpu max`
/// emulates) and vhost-vsock, so that level-2 guests get a vsock device;
/// and overlayfs, the root of a jail (level 1 is also a cgroup v2 host
/// for jails).
const KVM_MODULES: &[&str] = &["kvm-amd", "vhost_vsock", "overlay"];

/// What the root disk's cache key adds to the root file system's hash: a
/// new layout of that disk makes a new entry.
const ROOTFS_DISK_LAYOUT: &str = "rootfs.ext4 and jail-rootfs/";

/// The moat binaries that run on the host side of a sandbox (dynamically
/// linked: their libraries go into the bundle too).
const HOST_BINARIES: &[&str] = &["moat", "moat-mcp", "moat-vmm"];

/// Where the bundle's inputs come from.
#[derive(Debug, Clone)]
pub struct Sources {
    /// The data directory holding the image and the unpacked kernel package.
    pub data_dir: PathBuf,
    /// The image level 1 boots and offers to level 2.
    pub image: String,
    /// Where `moat`, `moat-mcp` and `moat-vmm` were built.
    pub bin_dir: PathBuf,
    /// The static `moat-agent`.
    pub agent: PathBuf,
    /// A static busybox.
    pub busybox: PathBuf,
    pub qemu: PathBuf,
    /// Where bundles are cached (`<target>/nested`).
    pub cache_dir: PathBuf,
    /// More programs for level 1's `/usr/bin`, with their shared libraries:
    /// a test binary that runs itself there, say.
    pub extra: Vec<PathBuf>,
}

impl Sources {
    /// The defaults, from the environment:
    ///
    /// - the data directory as moat finds it (`$MOAT_DATA_DIR`…), image `default`;
    /// - `$MOAT_BIN_DIR`, else the cargo profile directory of the running
    ///   executable (`target/debug` for tests and the xtask);
    /// - `$MOAT_AGENT`, else `target/x86_64-unknown-linux-gnu/release/moat-agent`
    ///   as `cargo xtask build` makes it;
    /// - `/bin/busybox` (Debian's `busybox-static`);
    /// - `qemu-system-x86_64` on `PATH`;
    /// - `$MOAT_NESTED_CACHE`, else `nested/` in the cargo target directory.
    pub fn from_env() -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| Error::Missing {
            what: "the running executable".into(),
            hint: format!("set MOAT_BIN_DIR and MOAT_NESTED_CACHE ({e})"),
        })?;
        let exe_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
        let profile_dir =
            if exe_dir.ends_with("deps") { exe_dir.parent().map(Path::to_path_buf) } else { Some(exe_dir) };
        let target = profile_dir.as_deref().and_then(|p| p.ancestors().find(|d| d.join("CACHEDIR.TAG").is_file()));
        let target = target.map(Path::to_path_buf).or_else(|| env_path("CARGO_TARGET_DIR"));
        let bin_dir = env_path("MOAT_BIN_DIR").or(profile_dir).ok_or_else(|| Error::Missing {
            what: "the moat binaries".into(),
            hint: "set MOAT_BIN_DIR to the directory holding moat, moat-mcp and moat-vmm".into(),
        })?;
        let agent = env_path("MOAT_AGENT")
            .or_else(|| target.as_ref().map(|t| t.join("x86_64-unknown-linux-gnu/release/moat-agent")))
            .ok_or_else(|| Error::Missing {
                what: "the static moat-agent".into(),
                hint: "build it with `cargo xtask build` or set MOAT_AGENT".into(),
            })?;
        let cache_dir =
            env_path("MOAT_NESTED_CACHE").or_else(|| target.map(|t| t.join("nested"))).ok_or_else(|| {
                Error::Missing {
                    what: "a cache directory for the level-1 bundle".into(),
                    hint: "set MOAT_NESTED_CACHE (the cargo target directory was not found)".into(),
                }
            })?;
        let qemu = find_program("qemu-system-x86_64").ok_or_else(|| Error::Missing {
            what: "qemu-system-x86_64".into(),
            hint: "install it with `apt-get install qemu-system-x86`".into(),
        })?;
        Ok(Self {
            data_dir: data_dir(),
            image: "default".into(),
            bin_dir,
            agent,
            busybox: PathBuf::from("/bin/busybox"),
            qemu,
            cache_dir,
            extra: Vec::new(),
        })
    }
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// A built level-1 bundle.
#[derive(Debug, Clone)]
pub struct Bundle {
    /// The content key (hex SHA-256).
    pub key: String,
    pub dir: PathBuf,
    /// The kernel level 1 boots: the image's `vmlinux`.
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The read-only disk with binaries, libraries and the image's small files.
    pub disk: PathBuf,
    /// An ext4 disk holding the image's `rootfs.ext4`, attached read-only.
    pub rootfs: PathBuf,
    pub qemu: PathBuf,
    /// Shared locks on the cache entries this bundle uses, held while any
    /// clone of it lives: another process's new entry does not remove them.
    _in_use: std::sync::Arc<[InUse; 2]>,
}

/// A shared lock on a cache entry's `complete` file: the entry is in use.
#[derive(Debug)]
struct InUse(#[allow(dead_code)] nix::fcntl::Flock<File>);

/// Everything that goes into a bundle, resolved to host files.
struct Plan {
    /// initramfs path → contents.
    initramfs: BTreeMap<String, Vec<u8>>,
    /// disk path → host file.
    disk: BTreeMap<String, PathBuf>,
    /// Hashes standing in for files too big to hash on every run.
    known_hashes: BTreeMap<String, String>,
}

/// Builds the bundle for `sources`, or finds it in the cache.
pub fn prepare(sources: &Sources) -> Result<Bundle> {
    let image = Image::open(&sources.data_dir, &sources.image)?;
    let plan = plan(sources, &image)?;
    let key = key(&plan)?;
    let (dir, bundle_in_use) = cached(&sources.cache_dir, "bundle-", &key, |work| build(&plan, work))?;
    // The root disk changes only when the image's packages do: its own key.
    let rootfs_hash = image.manifest.artifacts.get("rootfs.ext4").map(|a| a.sha256.clone()).ok_or_else(|| {
        Error::Missing { what: "rootfs.ext4 in the image's manifest".into(), hint: "rebuild the image".into() }
    })?;
    let rootfs_key = hex(&Sha256::digest(format!("{rootfs_hash}\n{ROOTFS_DISK_LAYOUT}")));
    let (rootfs_dir, rootfs_in_use) =
        cached(&sources.cache_dir, "rootfs-", &rootfs_key, |work| build_rootfs_disk(&image, work))?;
    Ok(Bundle {
        key,
        kernel: image.path("vmlinux"),
        initramfs: dir.join("initramfs.cpio.gz"),
        disk: dir.join("bundle.ext4"),
        rootfs: rootfs_dir.join("rootfs-disk.ext4"),
        qemu: sources.qemu.clone(),
        dir,
        _in_use: std::sync::Arc::new([bundle_in_use, rootfs_in_use]),
    })
}

/// The cache entry `<cache>/<prefix><key>/`, made by `build` in a work
/// directory when it is not complete yet, and a shared lock that marks it
/// in use. Tests run in parallel threads and processes: one builds, the
/// others wait on the cache's lock. Entries with the same prefix and
/// another key are removed, unless in use (another test process, with
/// other binaries, booting level 1s from it meanwhile).
fn cached(cache: &Path, prefix: &str, key: &str, build: impl FnOnce(&Path) -> Result<()>) -> Result<(PathBuf, InUse)> {
    let dir = cache.join(format!("{prefix}{}", &key[..16.min(key.len())]));
    if let Some(in_use) = use_entry(&dir) {
        return Ok((dir, in_use));
    }
    let io = |what: &str| {
        let dir = cache.to_path_buf();
        let what = what.to_owned();
        move |source| Error::Bundle { what, dir, source }
    };
    std::fs::create_dir_all(cache).map_err(io("creating the cache directory"))?;
    let lock = File::create(cache.join(".lock")).map_err(io("creating the lock file"))?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| io("locking the cache")(e.into()))?;
    if let Some(in_use) = use_entry(&dir) {
        return Ok((dir, in_use));
    }
    tracing::info!(entry = %dir.display(), "building a level-1 cache entry");
    let work = cache.join(format!(".build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(io("creating the build directory"))?;
    if let Err(e) = build(&work) {
        let _ = std::fs::remove_dir_all(&work);
        return Err(e);
    }
    std::fs::write(work.join(COMPLETE), format!("{key}\n")).map_err(io("marking the entry complete"))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&work, &dir).map_err(io("moving the entry into place"))?;
    let in_use = use_entry(&dir)
        .ok_or_else(|| io("marking the entry in use")(std::io::Error::other("the new entry is gone")))?;
    if let Ok(entries) = std::fs::read_dir(cache) {
        for entry in entries.filter_map(std::result::Result::ok) {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path != dir && path.is_dir() && name.starts_with(prefix) {
                remove_unused(&path);
            }
        }
    }
    Ok((dir, in_use))
}

/// The file that marks a cache entry complete, and is locked shared while
/// the entry is in use.
const COMPLETE: &str = "complete";

/// A shared lock on the complete entry `dir`; `None` when it is not
/// complete (or was removed while the lock was being taken).
fn use_entry(dir: &Path) -> Option<InUse> {
    let file = File::open(dir.join(COMPLETE)).ok()?;
    let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockShared).ok()?;
    // Removed between the open and the lock: the lock holds nothing.
    dir.join(COMPLETE).is_file().then_some(InUse(lock))
}

/// Removes the cache entry `dir` unless a process holds it in use (a
/// shared lock on its `complete` file); an incomplete entry goes.
fn remove_unused(dir: &Path) {
    if let Ok(file) = File::open(dir.join(COMPLETE)) {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            // Held through the removal: a process that opened the file
            // meanwhile finds it gone once it has its lock.
            Ok(_unused) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Err(_) => tracing::info!(entry = %dir.display(), "a level-1 cache entry still in use is kept"),
        }
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// `rootfs-disk.ext4`: an ext4 file system holding the image's `rootfs.ext4`
/// as a regular file, for level 1 to mount read-only. moat-vmm (like most
/// programs) takes a disk image as a regular file, which a block device
/// attached as it is would not be; `mkfs.ext4 -d` copies only the allocated
/// part of the sparse image (1.75 of 8 GiB), once per root file system.
/// Beside it, `jail-rootfs/`: the image's `rootfs/` tree with its shifted
/// ownership, the lower layer of level 1's jails.
fn build_rootfs_disk(image: &Image, work: &Path) -> Result<()> {
    let rootfs = image.path("rootfs.ext4");
    let rootfs = rootfs.as_path();
    let io = |what: String| {
        let dir = work.to_path_buf();
        move |source| Error::Bundle { what, dir, source }
    };
    let tree = work.join("tree");
    std::fs::create_dir_all(&tree).map_err(io("creating the staging tree".into()))?;
    let staged = tree.join("rootfs.ext4");
    // A hard link when the cache shares the data directory's file system.
    if std::fs::hard_link(rootfs, &staged).is_err() {
        let out = Command::new("cp")
            .arg("--sparse=always")
            .arg(rootfs)
            .arg(&staged)
            .output()
            .map_err(io("running cp".into()))?;
        if !out.status.success() {
            return Err(Error::Tool { tool: "cp".into(), message: String::from_utf8_lossy(&out.stderr).into_owned() });
        }
    }
    // Hard links too where they can be; a copy that keeps owners and
    // extended attributes where not.
    let tree_copy =
        |flags: &str| Command::new("cp").arg(flags).arg(image.path("rootfs")).arg(tree.join("jail-rootfs")).output();
    let linked = tree_copy("-al").map(|o| o.status.success()).unwrap_or(false);
    if !linked {
        let _ = std::fs::remove_dir_all(tree.join("jail-rootfs"));
        let out = tree_copy("-a").map_err(io("running cp".into()))?;
        if !out.status.success() {
            return Err(Error::Tool { tool: "cp".into(), message: String::from_utf8_lossy(&out.stderr).into_owned() });
        }
    }
    let jail_tree = Command::new("du")
        .args(["-sk", "--apparent-size"])
        .arg(tree.join("jail-rootfs"))
        .output()
        .map_err(io("running du".into()))?;
    let jail_kib: u64 =
        String::from_utf8_lossy(&jail_tree.stdout).split_whitespace().next().and_then(|k| k.parse().ok()).unwrap_or(0);
    let allocated = std::fs::metadata(&staged)
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .map_err(io(format!("reading {}", staged.display())))?
        + jail_kib * 1024;
    // Room for ext4's metadata and the tree's small files: a tenth more,
    // and 256 MiB.
    let size_kib = (allocated + allocated / 10) / 1024 + 256 * 1024;
    let made = mkfs_ext4(&tree, &work.join("rootfs-disk.ext4"), "moat-rootfs", size_kib);
    std::fs::remove_dir_all(&tree).map_err(io("removing the staging tree".into()))?;
    made
}

fn mkfs_ext4(tree: &Path, dest: &Path, label: &str, size_kib: u64) -> Result<()> {
    let mkfs = find_program("mkfs.ext4").ok_or_else(|| Error::Missing {
        what: "mkfs.ext4".into(),
        hint: "install it with `apt-get install e2fsprogs`".into(),
    })?;
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-L", label, "-O", "^has_journal", "-E", "root_owner=0:0", "-d"])
        .arg(tree)
        .arg(dest)
        .arg(format!("{size_kib}k"))
        .output()
        .map_err(|source| Error::Tool { tool: "mkfs.ext4".into(), message: source.to_string() })?;
    if !out.status.success() {
        return Err(Error::Tool {
            tool: "mkfs.ext4".into(),
            message: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(())
}

fn plan(sources: &Sources, image: &Image) -> Result<Plan> {
    let mut initramfs = BTreeMap::new();
    let mut disk = BTreeMap::new();
    let mut known_hashes = BTreeMap::new();

    require_static(&sources.busybox, "a static busybox", "install it with `apt-get install busybox-static`")?;
    require_static(&sources.agent, "the static moat-agent", "build it with `cargo xtask build` or set MOAT_AGENT")?;
    initramfs.insert("init".to_owned(), INIT.as_bytes().to_vec());
    initramfs.insert("bin/busybox".to_owned(), read(&sources.busybox)?);
    initramfs.insert("etc/nested/image".to_owned(), format!("{}\n", image.name).into_bytes());

    // The kernel's modules, from the package the image build unpacked.
    let kernel = &image.manifest.kernel;
    let modules_dir = sources
        .data_dir
        .join("cache")
        .join(format!("{}_{}", kernel.package, kernel.version))
        .join("lib/modules")
        .join(&kernel.release);
    let dep_text = std::fs::read_to_string(modules_dir.join("modules.dep")).map_err(|_| Error::Missing {
        what: format!("the modules of kernel {} ({}/modules.dep)", kernel.release, modules_dir.display()),
        hint: "run `cargo xtask image`: it unpacks the kernel package there".into(),
    })?;
    let graph = ModuleDeps::parse(&dep_text);
    let find = |name: &&str| {
        graph.find(name).ok_or_else(|| Error::Missing {
            what: format!("module {name} in kernel {}", kernel.release),
            hint: "the nested host needs a kernel with KVM, virtio-mmio and virtio-serial modules".into(),
        })
    };
    let early = graph.load_order(EARLY_MODULES.iter().map(find).collect::<Result<Vec<_>>>()?);
    let kvm: Vec<&str> = graph
        .load_order(KVM_MODULES.iter().map(find).collect::<Result<Vec<_>>>()?)
        .into_iter()
        .filter(|m| !early.contains(m))
        .collect();
    for (list, modules) in [("modules-early", &early), ("modules-kvm", &kvm)] {
        let names: String = modules.iter().map(|m| format!("{m}\n")).collect();
        initramfs.insert(format!("etc/nested/{list}"), names.into_bytes());
        for module in modules.iter() {
            initramfs.insert(format!("modules/{module}"), read(&modules_dir.join(module))?);
        }
    }
    tracing::debug!(modules = ?early.iter().chain(&kvm).map(|m| module_name(m)).collect::<Vec<_>>(), "level-1 modules");

    // Binaries, and the shared libraries of those that are dynamic.
    let mut dynamic = vec![sources.qemu.clone()];
    disk.insert("usr/bin/qemu-system-x86_64".to_owned(), sources.qemu.clone());
    for name in HOST_BINARIES {
        let path = sources.bin_dir.join(name);
        if !path.is_file() {
            return Err(Error::Missing {
                what: format!("{}", path.display()),
                hint: "build the binaries with `cargo build --bins` or set MOAT_BIN_DIR".into(),
            });
        }
        disk.insert(format!("usr/bin/{name}"), path.clone());
        dynamic.push(path);
    }
    disk.insert("usr/bin/moat-agent".to_owned(), sources.agent.clone());
    for path in &sources.extra {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| Error::Missing {
            what: format!("a program named {}", path.display()),
            hint: "pass the path of a file".into(),
        })?;
        disk.insert(format!("usr/bin/{name}"), path.clone());
        dynamic.push(path.clone());
    }
    // passt, the other end of `open` microVMs' network device (optional:
    // without it, creating one says to install it).
    if let Some(passt) = find_program("passt") {
        disk.insert("usr/bin/passt".to_owned(), passt.clone());
        dynamic.push(passt);
    }
    // newuidmap and newgidmap (set-uid root, which the copy keeps): the
    // rootless jails of an unprivileged account in level 1 (optional as
    // passt is).
    for helper in ["newuidmap", "newgidmap"] {
        if let Some(path) = find_program(helper) {
            disk.insert(format!("usr/bin/{helper}"), path.clone());
            dynamic.push(path);
        }
    }
    for binary in &dynamic {
        for library in shared_libraries(binary)? {
            disk.insert(library_destination(&library)?, library);
        }
    }
    // QEMU's firmware (`bios-microvm.bin` and the option ROMs it loads).
    let share = sources.qemu.parent().and_then(Path::parent).map(|p| p.join("share/qemu")).unwrap_or_default();
    if !share.is_dir() {
        return Err(Error::Missing {
            what: format!("QEMU's firmware directory {}", share.display()),
            hint: "install it with `apt-get install qemu-system-x86`".into(),
        });
    }
    for file in walk_files(&share)? {
        let rel = file.strip_prefix(&share).unwrap_or(&file).to_string_lossy().into_owned();
        disk.insert(format!("usr/share/qemu/{rel}"), file);
    }

    // The image's small files; its root disk is attached as it is.
    for artifact in ["vmlinux", "config", "initramfs.cpio.gz"] {
        disk.insert(format!("image/{artifact}"), image.path(artifact));
        if let Some(a) = image.manifest.artifacts.get(artifact) {
            known_hashes.insert(format!("image/{artifact}"), a.sha256.clone());
        }
    }
    disk.insert("image/manifest.json".to_owned(), image.path("manifest.json"));
    Ok(Plan { initramfs, disk, known_hashes })
}

fn key(plan: &Plan) -> Result<String> {
    let mut hasher = Sha256::new();
    hasher.update(BUNDLE_FORMAT);
    for (name, data) in &plan.initramfs {
        hasher.update(format!("\ninitramfs {name} {}\n", data.len()));
        hasher.update(data);
    }
    for (name, source) in &plan.disk {
        let hash = match plan.known_hashes.get(name) {
            Some(hash) => hash.clone(),
            None => hash_file(source)?,
        };
        hasher.update(format!("\ndisk {name} {hash}"));
    }
    Ok(hex(&hasher.finalize()))
}

fn build(plan: &Plan, work: &Path) -> Result<()> {
    let io = |what: String| {
        let dir = work.to_path_buf();
        move |source| Error::Bundle { what, dir, source }
    };
    // The initramfs: every directory, then the files; /usr is the disk.
    let file = File::create(work.join("initramfs.cpio.gz")).map_err(io("creating the initramfs".into()))?;
    let mut cpio = Cpio::new(GzEncoder::new(std::io::BufWriter::new(file), Compression::fast()));
    let mut dirs = std::collections::BTreeSet::new();
    for name in plan.initramfs.keys() {
        let mut ancestor = Path::new(name).parent();
        while let Some(dir) = ancestor.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(dir.to_string_lossy().into_owned());
            ancestor = dir.parent();
        }
    }
    let write = |cpio: &mut Cpio<_>| -> std::io::Result<()> {
        for dir in ["dev", "proc", "sys", "tmp", "run", "root", "nested", "nested-rootfs", "var", "mnt"] {
            cpio.dir(dir)?;
        }
        for dir in &dirs {
            cpio.dir(dir)?;
        }
        cpio.symlink("usr", "nested/usr")?;
        cpio.symlink("lib", "usr/lib")?;
        cpio.symlink("lib64", "usr/lib64")?;
        cpio.symlink("sbin", "bin")?;
        cpio.symlink("var/tmp", "../tmp")?;
        for (name, data) in &plan.initramfs {
            let mode = if name == "init" || name.starts_with("bin/") { 0o755 } else { 0o644 };
            cpio.file(name, mode, data)?;
        }
        Ok(())
    };
    write(&mut cpio).map_err(io("writing the initramfs".into()))?;
    let gz = cpio.finish().map_err(io("writing the initramfs".into()))?;
    gz.finish().and_then(|mut w| w.flush()).map_err(io("writing the initramfs".into()))?;

    // The disk: a staging tree, then mkfs.ext4 -d (no root or loop device needed).
    let tree = work.join("tree");
    let mut bytes = 0u64;
    for (name, source) in &plan.disk {
        let dest = tree.join(name);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
        }
        bytes += std::fs::copy(source, &dest).map_err(io(format!("copying {}", source.display())))?;
    }
    // Room for ext4's metadata: a tenth more, and 32 MiB.
    let size_kib = (bytes + bytes / 10) / 1024 + 32 * 1024;
    mkfs_ext4(&tree, &work.join("bundle.ext4"), "moat-nested", size_kib)?;
    std::fs::remove_dir_all(&tree).map_err(io("removing the staging tree".into()))
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Read { path: path.to_path_buf(), source })
}

fn hash_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|source| Error::Read { path: path.to_path_buf(), source })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|source| Error::Read { path: path.to_path_buf(), source })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Regular files under `dir`, symlinks followed.
fn walk_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| Error::Read { path: dir.clone(), source })?;
        for entry in entries.filter_map(std::result::Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.is_file() {
                files.push(path);
            }
        }
    }
    Ok(files)
}

/// Fails unless `path` is an ELF executable without a program interpreter.
fn require_static(path: &Path, what: &str, hint: &str) -> Result<()> {
    let data =
        read(path).map_err(|_| Error::Missing { what: format!("{what} ({})", path.display()), hint: hint.into() })?;
    match elf_interpreter(&data) {
        Some(false) => Ok(()),
        Some(true) => Err(Error::Missing {
            what: format!("{what} ({} is dynamically linked)", path.display()),
            hint: hint.into(),
        }),
        None => Err(Error::Missing {
            what: format!("{what} ({} is not an ELF executable)", path.display()),
            hint: hint.into(),
        }),
    }
}

/// Whether an ELF64 file has a `PT_INTERP` program header (is dynamically
/// linked); `None` when it is not ELF64.
fn elf_interpreter(elf: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if !elf.starts_with(b"\x7fELF") || elf.get(4) != Some(&2) {
        return None;
    }
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])));
    let u32_at = |o: usize| elf.get(o..o + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    let phoff = elf.get(0x20..0x28).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)?;
    let phoff = usize::try_from(phoff).ok()?;
    let (phentsize, phnum) = (u16_at(0x36)?, u16_at(0x38)?);
    Some((0..phnum).any(|i| u32_at(phoff + i * phentsize) == Some(PT_INTERP)))
}

/// The shared libraries `binary` loads, as `ldd` resolves them on this host.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let ldd = find_program("ldd").ok_or_else(|| Error::Missing {
        what: "ldd".into(),
        hint: "install it with `apt-get install libc-bin`".into(),
    })?;
    let out = Command::new(ldd)
        .arg(binary)
        .output()
        .map_err(|source| Error::Tool { tool: "ldd".into(), message: source.to_string() })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.contains("not found") {
        return Err(Error::Tool {
            tool: "ldd".into(),
            message: format!("{}: {text}{}", binary.display(), String::from_utf8_lossy(&out.stderr)),
        });
    }
    Ok(parse_ldd(&text))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let resolved = line.split_once("=>").map_or(line, |(_, right)| right);
            resolved.split_whitespace().next().filter(|p| p.starts_with('/')).map(PathBuf::from)
        })
        .collect()
}

/// Where a host library goes on the disk, which level 1 mounts as `/usr`'s
/// parent with `/lib` → `usr/lib` and `/lib64` → `usr/lib64` (Debian's
/// merged `/usr`): the dynamic loader then finds it at its host path.
fn library_destination(library: &Path) -> Result<String> {
    let path = library.to_string_lossy();
    if let Some(rest) = path.strip_prefix("/usr/") {
        Ok(format!("usr/{rest}"))
    } else if path.starts_with("/lib/") || path.starts_with("/lib64/") {
        Ok(format!("usr{path}"))
    } else {
        Err(Error::Missing {
            what: format!("a place in level 1 for the shared library {path}"),
            hint: "the nested host copies libraries from /lib, /lib64 and /usr only".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_entry_removes_the_old_ones_but_not_those_in_use() {
        let cache = tempfile::tempdir().expect("tempdir");
        let make = |key: &str| {
            cached(cache.path(), "bundle-", key, |work| {
                std::fs::write(work.join("initramfs.cpio.gz"), key).map_err(|source| Error::Bundle {
                    what: "writing".into(),
                    dir: work.to_path_buf(),
                    source,
                })
            })
            .expect("an entry")
        };
        let (old, in_use) = make("aaaa");
        let (unused, unused_lock) = make("bbbb");
        drop(unused_lock);
        // "aaaa" is held (a test booting from it); "bbbb" is not.
        let (new, _new_lock) = make("cccc");
        assert!(old.join("initramfs.cpio.gz").is_file(), "an entry in use was removed");
        assert!(!unused.exists(), "an unused old entry was kept");
        assert!(new.join("initramfs.cpio.gz").is_file());
        // Once let go, the next new entry removes it; the one in use is found.
        drop(in_use);
        let (again, _) = make("cccc");
        assert_eq!(again, new);
        let _ = make("dddd");
        assert!(!old.exists(), "an entry let go was kept");
        assert!(new.exists(), "an entry in use was removed");
    }

    #[test]
    fn ldd_output_gives_the_resolved_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        let libs = parse_ldd(text);
        assert_eq!(
            libs,
            ["/lib/x86_64-linux-gnu/libz.so.1", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"]
                .map(PathBuf::from)
        );
        let places: Vec<String> = libs.iter().map(|l| library_destination(l).expect("placed")).collect();
        assert_eq!(places[0], "usr/lib/x86_64-linux-gnu/libz.so.1");
        assert_eq!(places[2], "usr/lib64/ld-linux-x86-64.so.2");
        assert!(library_destination(Path::new("/opt/x/libx.so")).is_err());
    }

    #[test]
    fn tells_static_from_dynamic_executables() {
        let exe = std::env::current_exe().expect("the test binary");
        assert_eq!(elf_interpreter(&std::fs::read(exe).expect("readable")), Some(true));
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), None);
        if let Ok(busybox) = std::fs::read("/bin/busybox") {
            // Debian's busybox-static: no interpreter.
            assert!(elf_interpreter(&busybox).is_some());
        }
    }
}

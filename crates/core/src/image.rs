//! Sandbox images: where they live, what their manifest says, and checking
//! that what is on disk is what the manifest describes.
//!
//! An image is a directory `images/<name>/` under the data directory:
//!
//! | file | used by |
//! |---|---|
//! | `vmlinux`, `config`, `initramfs.cpio.gz` | the vm backend |
//! | `rootfs.ext4` | the vm backend (the shared read-only base disk) |
//! | `rootfs/` | the jail backend (the overlayfs lower layer) |
//! | `manifest.json` | everyone: what went in, sizes and SHA-256 |
//!
//! Files in `rootfs/` are owned by host ids shifted by [`JAIL_ID_BASE`], so
//! that the jail's user namespace (sandbox id N = host id BASE + N) sees
//! them owned correctly while sandbox root is never host root.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Host uid/gid that sandbox uid/gid 0 maps to in jails; the image's
/// `rootfs/` is owned by ids shifted by this much. Far above the ranges
/// distributions hand out in `/etc/subuid` (from 100000 up).
pub const JAIL_ID_BASE: u32 = 2_000_000_000;

/// How many ids a jail maps, from [`JAIL_ID_BASE`].
pub const JAIL_ID_COUNT: u32 = 65_536;

/// The image artifacts that are single files.
pub const FILE_ARTIFACTS: &[&str] = &["vmlinux", "config", "initramfs.cpio.gz", "rootfs.ext4"];

/// moat's data directory: `$MOAT_DATA_DIR`, else `$XDG_DATA_HOME/moat`, else
/// `~/.local/share/moat`.
pub fn data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOAT_DATA_DIR").filter(|d| !d.is_empty()) {
        return dir.into();
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("moat");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".local/share/moat")
}

/// What [`valid_name`] allows, for error messages.
pub const NAME_RULE: &str = "1 to 64 letters, digits, '-' or '_' (such as default), naming an image built with \
                             `moat image build --name NAME`, and optionally @ and its version (name@3f2a9c1b0d4e) to \
                             insist on that build";

/// How many hex digits of the manifest's SHA-256 name an image's version.
pub const VERSION_DIGITS: usize = 12;

/// What `name@version` may say after the `@`, in words.
pub const VERSION_RULE: &str =
    "8 to 64 lowercase hex digits of the image's version (image_version of a sandbox made from it)";

/// Splits an image reference, `name` or `name@version`, into the name and
/// the version it insists on; `None` when it is neither (see
/// [`NAME_RULE`] and [`VERSION_RULE`]).
pub fn parse_ref(reference: &str) -> Option<(&str, Option<&str>)> {
    let (name, version) = match reference.split_once('@') {
        Some((name, version)) => (name, Some(version)),
        None => (reference, None),
    };
    let version_ok =
        |v: &str| (8..=64).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (valid_name(name) && version.is_none_or(version_ok)).then_some((name, version))
}

/// Whether `name` can name an image: 1 to 64 ASCII letters, digits, `-`
/// or `_`, so that it is one directory entry under `images/` and never a
/// path (`..`, `/`, NUL are all refused).
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The directory of image `name` under `data_dir` (a name that passed
/// [`valid_name`]; [`Image::open`] checks).
pub fn image_dir(data_dir: &Path, name: &str) -> PathBuf {
    data_dir.join("images").join(name)
}

/// Size and hash of one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub size: u64,
    pub sha256: String,
}

/// Summary of the `rootfs/` tree: a hash over every entry's path, type,
/// mode, owner and size (not contents: that is what `rootfs.ext4`'s hash is for).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeDigest {
    pub entries: u64,
    pub bytes: u64,
    pub sha256: String,
}

/// Debian package → version, kept as the manifest's JSON text until asked
/// for: every sandbox's start reads the manifest and needs none of it, and
/// the map was most of the manifest's bytes and of the time to read it
/// (0.3 ms of CPU, in a fresh process whose every allocation faults in
/// memory).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Packages(Box<serde_json::value::RawValue>);

impl Packages {
    pub fn new(packages: &BTreeMap<String, String>) -> Self {
        // One package a line, as the rest of a manifest written pretty.
        let text = serde_json::to_string_pretty(packages).expect("a map of strings serializes");
        Self(serde_json::value::RawValue::from_string(text).expect("serde_json's own output is JSON"))
    }

    /// The map, read from the text; an error when the manifest's text is
    /// not a map of strings.
    pub fn parse(&self) -> Result<BTreeMap<String, String>, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }
}

impl Default for Packages {
    fn default() -> Self {
        Self::new(&BTreeMap::new())
    }
}

impl PartialEq for Packages {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

impl Eq for Packages {}

/// The kernel an image boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelInfo {
    pub package: String,
    pub version: String,
    /// `uname -r` of the kernel.
    pub release: String,
    /// The `vmlinux` ELF carries a PVH entry note.
    pub pvh: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub format: u32,
    /// Seconds since the Unix epoch.
    pub created: u64,
    pub kernel: KernelInfo,
    /// Modules in the initramfs, in load order.
    pub modules: Vec<String>,
    /// Debian package → version, as installed in the root file system.
    pub packages: Packages,
    /// Keys of what the image was built from; a rebuild is needed when one changes.
    pub inputs: BTreeMap<String, String>,
    pub artifacts: BTreeMap<String, Artifact>,
    pub rootfs: TreeDigest,
    pub jail_id_base: u32,
}

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The name is not an image name. The message shows only the name
    /// asked for, never where images live on the host.
    #[error("Image name {name:?} is not valid: an image name is {NAME_RULE}")]
    BadName { name: String },
    /// Where it was looked for (`path`) is kept for the host's log, not
    /// shown: the caller may be a model, which learns no host path.
    #[error(
        "Image {name:?} is not built; build it as root with `moat image build --name {name}` (`cargo xtask image --name {name}` in a checkout; `moat doctor` shows where images live)"
    )]
    Missing { name: String, path: PathBuf },
    #[error(
        "Image {name:?} has an unreadable manifest ({reason}); rebuild it as root with `moat image build --name {name} --force`"
    )]
    BadManifest { name: String, reason: String },
    #[error(
        "Image {name:?} uses manifest format {found}, this build reads {FORMAT_VERSION}; rebuild it as root with `moat image build --name {name} --force`"
    )]
    Format { name: String, found: u32 },
    #[error("Image {name:?} is corrupt: {what}; rebuild it as root with `moat image build --name {name} --force`")]
    Corrupt { name: String, what: String },
    /// `name@version` asked for a build the image no longer is.
    #[error(
        "Image {name:?} is version {have} (built {built} s after the Unix epoch), not {want}: it was rebuilt since. \
         Ask for {name:?} to use this build, or rebuild the one wanted"
    )]
    OtherVersion { name: String, want: String, have: String, built: u64 },
}

/// Which build of an image a sandbox runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageBuild {
    /// [`Image::version`].
    pub version: String,
    /// The manifest's `created`: seconds since the Unix epoch.
    pub built: u64,
}

/// A built image on disk.
#[derive(Debug, Clone)]
pub struct Image {
    pub name: String,
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Which build it is: the first [`VERSION_DIGITS`] hex digits of its
    /// manifest's SHA-256 (the manifest holds every artifact's hash).
    pub version: String,
}

impl Image {
    /// Opens image `name` and checks, cheaply, that every artifact is there
    /// with the size the manifest records. [`Image::verify`] hashes them.
    pub fn open(data_dir: &Path, name: &str) -> Result<Self, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::BadName { name: name.into() });
        }
        let dir = image_dir(data_dir, name);
        let manifest_path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&manifest_path).map_err(|e| {
            tracing::warn!(path = %manifest_path.display(), "image {name:?} is not usable: {e}");
            ImageError::Missing { name: name.into(), path: manifest_path.clone() }
        })?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| ImageError::BadManifest { name: name.into(), reason: e.to_string() })?;
        if manifest.format != FORMAT_VERSION {
            return Err(ImageError::Format { name: name.into(), found: manifest.format });
        }
        let version = hex(&Sha256::digest(text.as_bytes()))[..VERSION_DIGITS].to_owned();
        let image = Self { name: name.into(), dir, manifest, version };
        // Its names are joined to the image's directory, and root copies
        // them for a user (`moat setup --user`): only the artifacts moat
        // makes, never `../x` or an absolute path.
        if let Some(file) = image.manifest.artifacts.keys().find(|f| !FILE_ARTIFACTS.contains(&f.as_str())) {
            return Err(image.corrupt(format!(
                "its manifest names {file:?}, which is not an artifact moat makes ({})",
                FILE_ARTIFACTS.join(", ")
            )));
        }
        for (file, artifact) in &image.manifest.artifacts {
            let size = std::fs::metadata(image.dir.join(file)).map(|m| m.len()).ok();
            if size != Some(artifact.size) {
                return Err(image.corrupt(match size {
                    None => format!("{file} is missing"),
                    Some(size) => format!("{file} is {size} bytes, the manifest says {}", artifact.size),
                }));
            }
        }
        if !image.dir.join("rootfs").is_dir() {
            return Err(image.corrupt("rootfs/ is missing".into()));
        }
        Ok(image)
    }

    /// Which build this is, for a sandbox made from it.
    pub fn build(&self) -> ImageBuild {
        ImageBuild { version: self.version.clone(), built: self.manifest.created }
    }

    /// Opens the image an image reference (`name` or `name@version`) names,
    /// refusing one that is not the version asked for.
    pub fn open_ref(data_dir: &Path, reference: &str) -> Result<Self, ImageError> {
        let Some((name, want)) = parse_ref(reference) else {
            return Err(ImageError::BadName { name: reference.into() });
        };
        let image = Self::open(data_dir, name)?;
        match want {
            Some(want) if !image.version.starts_with(want) && !want.starts_with(&image.version) => {
                Err(ImageError::OtherVersion {
                    name: name.into(),
                    want: want.into(),
                    have: image.version.clone(),
                    built: image.manifest.created,
                })
            }
            _ => Ok(image),
        }
    }

    /// Hashes every artifact and the `rootfs/` tree against the manifest.
    pub fn verify(&self) -> Result<(), ImageError> {
        self.verify_with(digest_tree)
    }

    /// [`Image::verify`], with the tree's digest taken by `digest` (a
    /// rootless build lists its tree from inside a user namespace, where
    /// its subordinate-owned directories can be read).
    pub fn verify_with(&self, digest: impl FnOnce(&Path) -> std::io::Result<TreeDigest>) -> Result<(), ImageError> {
        for (file, artifact) in &self.manifest.artifacts {
            let actual = hash_file(&self.dir.join(file)).map_err(|e| self.corrupt(format!("{file}: {e}")))?;
            if actual.sha256 != artifact.sha256 {
                return Err(self.corrupt(format!("{file} does not match its SHA-256 in the manifest")));
            }
        }
        let tree = digest(&self.dir.join("rootfs")).map_err(|e| self.corrupt(format!("rootfs/: {e}")))?;
        if tree != self.manifest.rootfs {
            return Err(self.corrupt(format!(
                "rootfs/ has {} entries and {} bytes, the manifest says {} and {}",
                tree.entries, tree.bytes, self.manifest.rootfs.entries, self.manifest.rootfs.bytes
            )));
        }
        Ok(())
    }

    fn corrupt(&self, what: String) -> ImageError {
        ImageError::Corrupt { name: self.name.clone(), what }
    }

    pub fn path(&self, artifact: &str) -> PathBuf {
        self.dir.join(artifact)
    }
}

/// Size and SHA-256 of a file.
pub fn hash_file(path: &Path) -> std::io::Result<Artifact> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(Artifact { size, sha256: hex(&hasher.finalize()) })
}

/// The [`TreeDigest`] of a directory tree (symlinks not followed).
pub fn digest_tree(root: &Path) -> std::io::Result<TreeDigest> {
    use std::os::unix::fs::MetadataExt;
    let mut entries = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path)?;
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let size = if meta.is_file() { meta.len() } else { 0 };
            entries.push(TreeEntry {
                path: rel.display().to_string(),
                mode: meta.mode(),
                uid: meta.uid(),
                gid: meta.gid(),
                size,
            });
        }
    }
    Ok(TreeDigest::of(entries))
}

/// One entry of a tree, as [`TreeDigest`] records it: its path beneath the
/// root, `st_mode` (type and permissions), host owner, and size (regular
/// files; 0 for everything else).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeEntry {
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
}

impl TreeDigest {
    /// The digest of a tree's entries, in any order: one line per entry,
    /// sorted, hashed. Whoever lists the entries (a walk as root, or
    /// find(1) in a rootless build's user namespace) gets the same digest.
    pub fn of(entries: Vec<TreeEntry>) -> Self {
        let bytes = entries.iter().map(|e| e.size).sum();
        let mut lines: Vec<String> =
            entries.iter().map(|e| format!("{} {:o} {} {} {}", e.path, e.mode, e.uid, e.gid, e.size)).collect();
        lines.sort_unstable();
        let mut hasher = Sha256::new();
        for line in &lines {
            hasher.update(line.as_bytes());
            hasher.update(b"\n");
        }
        Self { entries: lines.len() as u64, bytes, sha256: hex(&hasher.finalize()) }
    }
}

/// Moves the owners of every entry of the tree `root` (symlinks not
/// followed) from ids `from..from + JAIL_ID_COUNT` to the same offsets from
/// `to`; returns how many inodes changed. setuid and setgid bits, which
/// chown(2) clears, are set again. An entry owned outside the range (a
/// tree shifted already, or not an image's) is an error, naming it.
pub fn shift_ownership(root: &Path, from: u32, to: u32) -> std::io::Result<u64> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let shift = |id: u32, path: &Path| {
        id.checked_sub(from).filter(|offset| *offset < JAIL_ID_COUNT).map(|offset| to + offset).ok_or_else(|| {
            std::io::Error::other(format!(
                "{} is owned by id {id}, outside the ids from {from} this tree should have; rebuild the image \
                 from scratch (`cargo xtask image --force`)",
                path.display()
            ))
        })
    };
    let mut count = 0u64;
    // Hard links share an inode: shift each inode once.
    let mut linked = std::collections::HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if !meta.is_dir() && meta.nlink() > 1 && !linked.insert((meta.dev(), meta.ino())) {
            continue;
        }
        let (uid, gid) = (shift(meta.uid(), &path)?, shift(meta.gid(), &path)?);
        std::os::unix::fs::lchown(&path, Some(uid), Some(gid))
            .map_err(|e| std::io::Error::new(e.kind(), format!("chown {}: {e}", path.display())))?;
        if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
        count += 1;
    }
    Ok(count)
}

/// Removes the device nodes of the tree at `root` (made by root, not yet
/// the user's: nothing in it moves while this runs). A root-built image's
/// `dev/` holds nodes such as `console` open to all (mmdebstrap makes them
/// so); in a user's home another local user could reach them and write to
/// the system's console. No sandbox needs them: a jail mounts a `/dev` of
/// its own, and a microVM boots from the image's disk file.
fn remove_device_nodes(root: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_char_device() || kind.is_block_device() {
                std::fs::remove_file(entry.path())?;
            }
        }
    }
    Ok(())
}

/// Where `moat setup --user` puts a user's copy of an image: the data
/// directory a user's moat uses by default, relative to the user's home.
pub const USER_DATA_DIR: &str = ".local/share/moat";

/// As root: copies `image` into the data directory ([`USER_DATA_DIR`]) of
/// the user whose home is `home` and whose jails map ids from `base`, its
/// `rootfs/` owned from `base` instead (a rootless jail can map only its
/// user's subordinate ids), and gives the copy's files to `owner` (uid,
/// gid). The other artifacts are hard links where the two directories
/// share a file system (read-only to the user), else sparse copies. The
/// copy gets its own manifest (`jail_id_base` and the tree's digest), and
/// replaces an earlier copy whole. Returns where the copy is.
///
/// Everything below `home` is the user's, who may have made any of it a
/// symbolic link to a system directory, or may rename things while this
/// runs: root works there only through directory descriptors, never by a
/// path the user could redirect. The copy is made in a directory root
/// makes (mode 0700, so nothing of it is the user's to touch until it is
/// done), reached through `/proc/<pid>/fd`, then handed to the user and
/// swapped into place with `renameat2`; an earlier copy is removed
/// through descriptors, never following a link.
pub fn copy_for_user(image: &Image, home: &Path, base: u32, owner: (u32, u32)) -> std::io::Result<PathBuf> {
    use nix::fcntl::{OFlag, RenameFlags, openat, renameat2};
    use nix::sys::stat::Mode;
    use std::os::fd::{AsFd, AsRawFd};
    let io = |what: String| move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"));
    let nix_io =
        |what: String| move |e: nix::Error| std::io::Error::new(std::io::Error::from(e).kind(), format!("{what}: {e}"));
    let rel = Path::new(USER_DATA_DIR).join("images");
    let shown = home.join(&rel);
    let images = open_user_dir(home, &rel, owner)?;
    let work_name = format!(".{}.copy-{}", image.name, std::process::id());
    // A failed run's leftover, removed without following a link.
    crate::hostfs::remove_beneath(&images, std::ffi::OsStr::new(&work_name), 0)
        .map_err(nix_io(format!("removing an earlier {}", shown.join(&work_name).display())))?;
    nix::sys::stat::mkdirat(images.as_fd(), work_name.as_str(), Mode::from_bits_truncate(0o700))
        .map_err(nix_io(format!("making {}", shown.join(&work_name).display())))?;
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let work = openat(images.as_fd(), work_name.as_str(), dir_flags, Mode::empty())
        .map_err(nix_io(format!("opening {}", shown.join(&work_name).display())))?;
    // The directory made above, not one the user put there meanwhile: a
    // directory of root's renamed to this name would pass an owner check
    // alone, so it must also be as made: empty (no entry, which the walk
    // below would follow), its permissions 0700 (a set-group-id bit it
    // inherits from `images/` aside; the link count says nothing on
    // btrfs, whose directories all have one).
    let made = nix::sys::stat::fstat(work.as_fd()).map_err(nix_io("fstat".into()))?;
    let empty = || nix::dir::Dir::from_fd(nix::unistd::dup(&work)?).map(|mut d| d.iter().count() <= 2);
    if made.st_uid != 0 || made.st_mode & 0o777 != 0o700 || !empty().unwrap_or(false) {
        return Err(std::io::Error::other(format!("{} changed hands while it was made", shown.display())));
    }
    // This process's descriptor, for the programs it runs and for paths:
    // the directory itself, wherever its name goes.
    let at = PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), work.as_raw_fd()));
    let result = (|| {
        // cp(1) keeps modes, hard links, special files and extended
        // attributes as they are; only the owners then move.
        let status = std::process::Command::new("cp")
            .args(["-a", "--sparse=always"])
            .arg(image.path("rootfs"))
            .arg(at.join("rootfs"))
            .status()
            .map_err(io("running cp".into()))?;
        if !status.success() {
            return Err(std::io::Error::other(format!(
                "cp -a of {} failed ({status})",
                image.path("rootfs").display()
            )));
        }
        shift_ownership(&at.join("rootfs"), image.manifest.jail_id_base, base)?;
        remove_device_nodes(&at.join("rootfs"))?;
        for file in image.manifest.artifacts.keys() {
            let (from, to) = (image.path(file), at.join(file));
            if std::fs::hard_link(&from, &to).is_err() {
                let status = std::process::Command::new("cp")
                    .args(["--sparse=always"])
                    .arg(&from)
                    .arg(&to)
                    .status()
                    .map_err(io("running cp".into()))?;
                if !status.success() {
                    return Err(std::io::Error::other(format!("copying {} failed ({status})", from.display())));
                }
            }
        }
        let mut manifest = image.manifest.clone();
        manifest.jail_id_base = base;
        manifest.rootfs = digest_tree(&at.join("rootfs"))?;
        let text = serde_json::to_string_pretty(&manifest).map_err(std::io::Error::other)?;
        crate::hostfs::write_new(&at.join("manifest.json"), text.as_bytes())?;
        let (uid, gid) = (Some(owner.0.into()), Some(owner.1.into()));
        nix::unistd::fchownat(work.as_fd(), "manifest.json", uid, gid, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(nix_io("giving the manifest to its user".into()))?;
        nix::sys::stat::fchmodat(
            work.as_fd(),
            "manifest.json",
            Mode::from_bits_truncate(0o644),
            nix::sys::stat::FchmodatFlags::NoFollowSymlink,
        )
        .map_err(nix_io("chmod of the manifest".into()))?;
        nix::unistd::fchown(work.as_fd(), uid, gid).map_err(nix_io("giving the copy to its user".into()))?;
        nix::sys::stat::fchmod(work.as_fd(), Mode::from_bits_truncate(0o755)).map_err(nix_io("chmod".into()))?;
        // Into place: swapped with an earlier copy (whatever the user made
        // of that name, a link included, is not followed), then that one
        // removed; or renamed where there is none.
        let name = image.name.as_str();
        let swapped = renameat2(images.as_fd(), work_name.as_str(), images.as_fd(), name, RenameFlags::RENAME_EXCHANGE);
        match swapped {
            Ok(()) => crate::hostfs::remove_beneath(&images, std::ffi::OsStr::new(&work_name), 0)
                .map_err(nix_io(format!("removing the earlier copy (now {})", shown.join(&work_name).display()))),
            Err(nix::errno::Errno::ENOENT) => {
                renameat2(images.as_fd(), work_name.as_str(), images.as_fd(), name, RenameFlags::RENAME_NOREPLACE)
                    .map_err(nix_io(format!("renaming the copy to {}", shown.join(name).display())))
            }
            Err(e) => Err(nix_io(format!("swapping the copy in at {}", shown.join(name).display()))(e)),
        }
    })();
    if result.is_err() {
        let _ = crate::hostfs::remove_beneath(&images, std::ffi::OsStr::new(&work_name), 0);
    }
    result.map(|()| shown.join(&image.name))
}

/// As root: the directory `rel` beneath the user's `home`, opened one
/// component at a time without following a link; what is missing is made
/// as `owner` (below `home` everything is the user's).
///
/// A missing directory is made with this thread's file-system ids set to
/// the owner's ([`as_owner`]): it is theirs from its first moment, made
/// only where they may make it, and root never gives anything away after
/// the fact. A `chown` after `mkdir` would act on whatever the name holds
/// by then, which the user may rename another directory of root's to.
fn open_user_dir(home: &Path, rel: &Path, owner: (u32, u32)) -> std::io::Result<std::os::fd::OwnedFd> {
    use nix::fcntl::{OFlag, open, openat};
    use nix::sys::stat::Mode;
    use std::os::fd::AsFd;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fail = |path: &Path, what: &str, e: nix::Error| {
        std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!(
                "{what} {}: {e} (each directory there must be a directory of the user's, not a link)",
                path.display()
            ),
        )
    };
    // The home itself is the system's record (passwd), not the user's.
    let mut dir =
        open(home, flags.difference(OFlag::O_NOFOLLOW), Mode::empty()).map_err(|e| fail(home, "opening", e))?;
    let mut path = home.to_path_buf();
    for part in rel.components() {
        path.push(part);
        let name = part.as_os_str();
        let next = match openat(dir.as_fd(), name, flags, Mode::empty()) {
            Err(nix::errno::Errno::ENOENT) => {
                match as_owner(owner, || nix::sys::stat::mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o755))) {
                    Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                    Err(e) => return Err(fail(&path, "making", e)),
                }
                openat(dir.as_fd(), name, flags, Mode::empty())
            }
            other => other,
        };
        dir = next.map_err(|e| fail(&path, "opening", e))?;
        // Whatever the name holds now must be the user's: root writes the
        // copy into it.
        let stat = nix::sys::stat::fstat(&dir).map_err(|e| fail(&path, "checking", e))?;
        if stat.st_uid != owner.0 {
            return Err(fail(&path, "using", nix::errno::Errno::EPERM));
        }
    }
    Ok(dir)
}

/// Runs `op` with this thread's file-system uid and gid set to `owner`'s
/// (`setfsuid(2)`: one thread's, and only the ids that permission checks
/// and new files take), then puts the old ones back: what `op` creates is
/// the owner's, and it may create only where the owner may.
fn as_owner<T>(owner: (u32, u32), op: impl FnOnce() -> T) -> T {
    use nix::unistd::{Gid, Uid, setfsgid, setfsuid};
    let gid = setfsgid(Gid::from_raw(owner.1));
    let uid = setfsuid(Uid::from_raw(owner.0));
    let out = op();
    setfsuid(uid);
    setfsgid(gid);
    out
}

/// As root: the manifest of the user's copy of image `name` (beneath
/// `home`, see [`copy_for_user`]), if there is one to read: reached
/// without following a link, a regular file of at most a megabyte.
pub fn user_copy_manifest(home: &Path, name: &str) -> Option<Manifest> {
    use nix::fcntl::{OFlag, open, openat};
    use nix::sys::stat::Mode;
    use std::os::fd::AsFd;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = open(home, flags.difference(OFlag::O_NOFOLLOW), Mode::empty()).ok()?;
    for part in Path::new(USER_DATA_DIR).join("images").join(name).components() {
        dir = openat(dir.as_fd(), part.as_os_str(), flags, Mode::empty()).ok()?;
    }
    serde_json::from_slice(&crate::hostfs::read_small_file(&dir, "manifest.json", 1 << 20)?).ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_image(data: &Path) -> PathBuf {
        let dir = image_dir(data, "t");
        std::fs::create_dir_all(dir.join("rootfs/etc")).expect("mkdir");
        std::fs::write(dir.join("rootfs/etc/hostname"), "sandbox\n").expect("write");
        std::fs::write(dir.join("vmlinux"), b"\x7fELF fake kernel").expect("write");
        let manifest = Manifest {
            name: "t".into(),
            format: FORMAT_VERSION,
            created: 0,
            kernel: KernelInfo { package: "k".into(), version: "1".into(), release: "6.1".into(), pvh: true },
            modules: vec![],
            packages: Packages::default(),
            inputs: BTreeMap::new(),
            artifacts: [("vmlinux".to_owned(), hash_file(&dir.join("vmlinux")).expect("hash"))].into(),
            rootfs: digest_tree(&dir.join("rootfs")).expect("digest"),
            jail_id_base: JAIL_ID_BASE,
        };
        std::fs::write(dir.join("manifest.json"), serde_json::to_string(&manifest).expect("json")).expect("write");
        dir
    }

    #[test]
    fn a_users_directories_are_theirs_from_the_start_and_never_roots() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root (it makes directories as another user)");
            return;
        }
        let owner = (4_000_123, 4_000_123);
        let home = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::chown(home.path(), Some(owner.0), Some(owner.1)).expect("chown");
        let made = open_user_dir(home.path(), Path::new("a/b/c"), owner).expect("made");
        for dir in ["a", "a/b", "a/b/c"] {
            let meta = std::fs::metadata(home.path().join(dir)).expect(dir);
            assert_eq!((meta.uid(), meta.gid()), owner, "{dir} is the user's");
        }
        assert_eq!(nix::sys::stat::fstat(&made).expect("fstat").st_uid, owner.0);
        // The thread is root again: what it makes now is root's.
        std::fs::create_dir(home.path().join("root's")).expect("mkdir");
        assert_eq!(std::fs::metadata(home.path().join("root's")).expect("stat").uid(), 0);
        // A directory of root's (say one the user renamed into place) or a
        // link is refused, and nothing is made or given away through it.
        std::fs::create_dir(home.path().join("a/b/c/d")).expect("mkdir");
        let err = open_user_dir(home.path(), Path::new("a/b/c/d/e"), owner).expect_err("root's");
        assert!(err.to_string().contains("directory of the user's"), "{err}");
        assert!(!home.path().join("a/b/c/d/e").exists());
        assert_eq!(std::fs::metadata(home.path().join("a/b/c/d")).expect("stat").uid(), 0, "still root's");
        std::os::unix::fs::symlink("/etc", home.path().join("a/link")).expect("symlink");
        assert!(open_user_dir(home.path(), Path::new("a/link/x"), owner).is_err(), "a link is not followed");
        assert!(!Path::new("/etc/x").exists());
        // Where the user may not write, root does not make it for them.
        std::fs::set_permissions(home.path().join("a/b"), std::os::unix::fs::PermissionsExt::from_mode(0o555))
            .expect("chmod");
        assert!(open_user_dir(home.path(), Path::new("a/b/new"), owner).is_err(), "not the user's to make");
        assert!(!home.path().join("a/b/new").exists());
    }

    #[test]
    fn packages_are_kept_as_text_and_read_when_asked() {
        let map: BTreeMap<String, String> =
            [("bash".to_owned(), "5.2.15-2+b7".to_owned()), ("git".to_owned(), "1:2.39.5-0+deb12u2".to_owned())].into();
        let packages = Packages::new(&map);
        assert_eq!(packages.parse().expect("parses"), map);
        // In a manifest, written and read back: the same map, one package a line.
        #[derive(Serialize, Deserialize)]
        struct Holder {
            packages: Packages,
        }
        let text = serde_json::to_string_pretty(&Holder { packages: packages.clone() }).expect("json");
        assert!(text.contains("\n  \"bash\": \"5.2.15-2+b7\",\n"), "{text}");
        let read: Holder = serde_json::from_str(&text).expect("reads");
        assert_eq!(read.packages.parse().expect("parses"), map);
        // A manifest whose map holds something else opens; asking says so.
        let odd: Holder = serde_json::from_str(r#"{"packages": {"bash": 5}}"#).expect("still JSON");
        assert!(odd.packages.parse().is_err());
        assert!(serde_json::from_str::<Holder>(r#"{"packages": {"bash": }"#).is_err(), "not JSON at all");
    }

    /// `moat setup --user` as root in a tree the user controls: links the
    /// user planted are never followed, an earlier copy that is a link
    /// is replaced and not entered, and a manifest that is a link or a
    /// FIFO is not read.
    #[test]
    fn a_users_copy_never_follows_the_users_links() {
        use std::os::unix::fs::MetadataExt;
        let scratch = tempfile::tempdir().expect("tempdir");
        let data = scratch.path().join("root-data");
        let source = fake_image(&data);
        if std::os::unix::fs::chown(&source, Some(0), Some(0)).is_err() {
            return eprintln!("skipping: chown needs root");
        }
        for path in [source.join("rootfs"), source.join("rootfs/etc"), source.join("rootfs/etc/hostname")] {
            std::os::unix::fs::lchown(&path, Some(JAIL_ID_BASE), Some(JAIL_ID_BASE)).expect("chown");
        }
        // A device node open to all, as mmdebstrap makes /dev/console.
        std::fs::create_dir_all(source.join("rootfs/dev")).expect("mkdir");
        nix::sys::stat::mknod(
            &source.join("rootfs/dev/console"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(5, 1),
        )
        .expect("mknod");
        for path in [source.join("rootfs/dev"), source.join("rootfs/dev/console")] {
            std::os::unix::fs::lchown(&path, Some(JAIL_ID_BASE), Some(JAIL_ID_BASE)).expect("chown");
        }
        let image = Image::open(&data, "t").expect("opens");
        let (base, owner) = (500_000, (12_345, 12_345));
        let victim = scratch.path().join("victim");
        std::fs::create_dir_all(victim.join("t")).expect("mkdir");
        std::fs::write(victim.join("t/keep"), "system file").expect("write");
        let home = scratch.path().join("home");
        let images = home.join(USER_DATA_DIR).join("images");

        // A link above the images: refused, nothing made in its target.
        std::fs::create_dir_all(&home).expect("mkdir");
        std::os::unix::fs::symlink(&victim, home.join(".local")).expect("symlink");
        let refused = copy_for_user(&image, &home, base, owner).expect_err("a link in the path is refused");
        assert!(refused.to_string().contains("not a link"), "{refused}");
        assert!(!victim.join("share").exists(), "root made directories through the user's link");
        std::fs::remove_file(home.join(".local")).expect("rm");

        // An earlier copy that is a link to a system directory: replaced
        // by the copy, the directory it named left as it was.
        std::fs::create_dir_all(&images).expect("mkdir");
        // Below the home everything is the user's.
        for dir in images.ancestors().take_while(|d| d.starts_with(&home)) {
            std::os::unix::fs::chown(dir, Some(owner.0), Some(owner.1)).expect("chown");
        }
        std::os::unix::fs::symlink(victim.join("t"), images.join("t")).expect("symlink");
        let copy = copy_for_user(&image, &home, base, owner).expect("copies");
        assert_eq!(copy, images.join("t"));
        assert_eq!(std::fs::read_to_string(victim.join("t/keep")).expect("kept"), "system file");
        let meta = std::fs::symlink_metadata(&copy).expect("lstat");
        assert!(meta.is_dir(), "the copy is a directory of its own");
        assert_eq!((meta.uid(), meta.mode() & 0o777), (owner.0, 0o755));
        assert!(copy.join("rootfs/dev").is_dir() && !copy.join("rootfs/dev/console").exists(), "a device node copied");
        let hostname = std::fs::symlink_metadata(copy.join("rootfs/etc/hostname")).expect("lstat");
        assert_eq!(hostname.uid(), base, "the rootfs is owned from the user's base");
        let manifest = user_copy_manifest(&home, "t").expect("the copy's manifest reads");
        assert_eq!(manifest.jail_id_base, base);
        // Made again over itself: one copy, nothing left beside it.
        copy_for_user(&image, &home, base, owner).expect("copies again");
        let names: Vec<_> = std::fs::read_dir(&images).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, ["t"], "only the copy is left");

        // A manifest that is a link, or a FIFO, is not read.
        std::fs::remove_file(copy.join("manifest.json")).expect("rm");
        std::os::unix::fs::symlink(source.join("manifest.json"), copy.join("manifest.json")).expect("symlink");
        assert!(user_copy_manifest(&home, "t").is_none(), "a linked manifest was read");
        std::fs::remove_file(copy.join("manifest.json")).expect("rm");
        nix::unistd::mkfifo(&copy.join("manifest.json"), nix::sys::stat::Mode::from_bits_truncate(0o644))
            .expect("mkfifo");
        assert!(user_copy_manifest(&home, "t").is_none(), "a FIFO is no manifest");
    }

    #[test]
    fn ownership_shifts_and_setuid_survives() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("usr/bin")).expect("mkdir");
        let su = root.join("usr/bin/su");
        std::fs::write(&su, "x").expect("write");
        if std::os::unix::fs::chown(&su, Some(0), Some(0)).is_err() {
            eprintln!("skipping: chown needs root");
            return;
        }
        std::fs::set_permissions(&su, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
        std::os::unix::fs::symlink("su", root.join("usr/bin/link")).expect("symlink");
        std::fs::hard_link(&su, root.join("usr/bin/su2")).expect("hard link");
        std::os::unix::fs::chown(dir.path(), Some(0), Some(0)).expect("chown");
        for path in [&root, &root.join("usr"), &root.join("usr/bin")] {
            std::os::unix::fs::chown(path, Some(0), Some(0)).expect("chown");
        }
        assert_eq!(shift_ownership(&root, 0, JAIL_ID_BASE).expect("shifts"), 5);
        let meta = std::fs::metadata(&su).expect("stat");
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o7777), (JAIL_ID_BASE, JAIL_ID_BASE, 0o4755));
        assert_eq!(std::fs::symlink_metadata(root.join("usr/bin/link")).expect("lstat").uid(), JAIL_ID_BASE);
        let again = shift_ownership(&root, 0, JAIL_ID_BASE).expect_err("shifting from 0 twice is refused");
        assert!(again.to_string().contains("outside the ids from 0"), "{again}");
        assert_eq!(shift_ownership(&root, JAIL_ID_BASE, 500_000).expect("shifts on"), 5, "one range to another");
        let meta = std::fs::metadata(&su).expect("stat");
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (500_000, 0o4755), "a user's copy keeps setuid bits");
    }

    #[test]
    fn an_intact_image_opens_and_verifies() {
        let data = tempfile::tempdir().expect("tempdir");
        fake_image(data.path());
        let image = Image::open(data.path(), "t").expect("opens");
        image.verify().expect("verifies");
    }

    #[test]
    fn corruption_is_caught_with_a_rebuild_hint() {
        let data = tempfile::tempdir().expect("tempdir");
        let dir = fake_image(data.path());
        std::fs::write(dir.join("vmlinux"), b"\x7fELF fake kernex").expect("same size, other bytes");
        let err = Image::open(data.path(), "t").expect("sizes match").verify().expect_err("hash differs");
        assert!(err.to_string().contains("vmlinux does not match"), "{err}");
        assert!(err.to_string().contains("moat image build --name t --force"), "{err}");

        std::fs::write(dir.join("vmlinux"), b"short").expect("write");
        let err = Image::open(data.path(), "t").expect_err("size differs");
        assert!(err.to_string().contains("vmlinux is 5 bytes"), "{err}");

        std::fs::write(dir.join("rootfs/etc/new"), "x").expect("write");
        std::fs::write(dir.join("vmlinux"), b"\x7fELF fake kernel").expect("restore");
        let err = Image::open(data.path(), "t").expect("opens").verify().expect_err("tree differs");
        assert!(err.to_string().contains("rootfs/ has 3 entries"), "{err}");
    }

    /// A manifest's artifact names are joined to the image's directory and
    /// copied by root for a user: a name that leads elsewhere is refused
    /// before anything is looked at.
    #[test]
    fn a_manifest_names_only_artifacts_moat_makes() {
        let data = tempfile::tempdir().expect("tempdir");
        let dir = fake_image(data.path());
        let text = std::fs::read_to_string(dir.join("manifest.json")).expect("read");
        for bad in ["../../../../etc/shadow", "/etc/shadow", "rootfs/etc/hostname", "vmlinux2"] {
            std::fs::write(dir.join("manifest.json"), text.replacen("\"vmlinux\":", &format!("{bad:?}:"), 1))
                .expect("write");
            let err = Image::open(data.path(), "t").expect_err(bad);
            assert!(err.to_string().contains("not an artifact moat makes"), "{bad}: {err}");
        }
    }

    #[test]
    fn names_that_are_paths_are_refused_without_showing_host_paths() {
        let data = tempfile::tempdir().expect("tempdir");
        fake_image(data.path());
        let outside = data.path().join("outside");
        std::fs::create_dir_all(&outside).expect("mkdir");
        for bad in ["../../../../tmp", "..", ".", "a/b", "/etc", "t\0", "", "t ", &"x".repeat(65), "../images/t"] {
            let err = Image::open(data.path(), bad).expect_err(bad);
            assert!(matches!(err, ImageError::BadName { .. }), "{bad:?}: {err}");
            let text = err.to_string();
            assert!(text.contains("letters, digits, '-' or '_'"), "{text}");
            assert!(!text.contains(&data.path().display().to_string()), "no host path: {text}");
        }
        assert!(valid_name("default") && valid_name("py-3_12") && !valid_name("dé"));
    }

    #[test]
    fn missing_and_unreadable_images_say_how_to_build() {
        let data = tempfile::tempdir().expect("tempdir");
        let err = Image::open(data.path(), "default").expect_err("missing");
        assert!(err.to_string().contains("moat image build --name default"), "{err}");
        assert!(!err.to_string().contains(&data.path().display().to_string()), "no host path: {err}");
        let dir = image_dir(data.path(), "default");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("manifest.json"), "{not json").expect("write");
        assert!(matches!(Image::open(data.path(), "default"), Err(ImageError::BadManifest { .. })));
    }

    #[test]
    fn a_version_names_one_build_and_a_rebuild_is_another() {
        let data = tempfile::tempdir().expect("tempdir");
        let dir = fake_image(data.path());
        let image = Image::open(data.path(), "t").expect("opens");
        assert_eq!(image.version.len(), VERSION_DIGITS);
        assert_eq!(image.build(), ImageBuild { version: image.version.clone(), built: 0 });
        // Its version, whole or in part (8 digits at least), or none.
        for reference in ["t".to_owned(), format!("t@{}", image.version), format!("t@{}", &image.version[..8])] {
            assert_eq!(Image::open_ref(data.path(), &reference).expect(&reference).version, image.version);
        }
        // A rebuild (here: another manifest) is another version.
        let mut manifest = image.manifest.clone();
        manifest.created = 1;
        std::fs::write(dir.join("manifest.json"), serde_json::to_string(&manifest).expect("json")).expect("write");
        let err = Image::open_ref(data.path(), &format!("t@{}", image.version)).expect_err("rebuilt");
        let text = err.to_string();
        assert!(matches!(err, ImageError::OtherVersion { .. }) && text.contains(&image.version), "{text}");
        assert!(text.contains("Ask for \"t\" to use this build"), "{text}");
        // What is not a version is not a name either.
        for bad in ["t@", "t@1234567", "t@ABCDEF12", "t@123456789g", "t@x/y", "@12345678", "t@12345678@12345678"] {
            assert!(parse_ref(bad).is_none(), "{bad}");
            assert!(matches!(Image::open_ref(data.path(), bad), Err(ImageError::BadName { .. })), "{bad}");
        }
    }
}

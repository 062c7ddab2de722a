//! Host paths: the one place moat touches host files on a tool call's behalf.
//!
//! Everything the model names on the host (a copy's source or destination,
//! a task's project) is text from an attacker, and so is everything a
//! sandbox sends back (tar entries, link targets, sizes). The rules:
//!
//! - **Roots.** The operator grants host directories ([`roots_from_env`]:
//!   `MOAT_ROOTS`, or the working directory when that is a project
//!   directory). Each is opened once, at start, and every later path is
//!   resolved beneath that descriptor, component by component with
//!   `O_NOFOLLOW`: a symlink anywhere in a path given by the model is
//!   refused, never followed, and `..` is refused before any lookup.
//! - **Guards by identity.** While walking, each directory is compared by
//!   device and inode (not by name) with moat's data directory and with the
//!   home directory, so neither the data directory nor a dot directory of
//!   the home directory (`~/.ssh`, `~/.config`) is reachable through any
//!   root, bind mounts and hard links included.
//!   The homes of the system's other accounts (`/etc/passwd`) are guarded
//!   alike: a moat run as root from `/home/alice` keeps out of
//!   `/home/alice/.ssh`.
//! - **Nothing the host acts on by itself.** No copy writes a name that
//!   programs on the host run commands from when they meet it ([`ACTED_ON`]:
//!   `.git`, editors' and agents' project settings), anywhere beneath a
//!   root, as a destination or inside a copied tree.
//! - **Create, never replace.** A destination must not exist. A copy is
//!   written under a hidden name beside it (`O_CREAT | O_EXCL | O_NOFOLLOW`,
//!   `mkdirat`) and renamed with `RENAME_NOREPLACE` once everything in it
//!   has been checked; a failed or dropped copy is removed.
//! - **Untrusted archives.** [`unpack`] writes a sandbox's tar stream beneath
//!   the new directory's descriptor, refusing unsafe names, keeping sparse
//!   files sparse, dropping set-id bits, and keeping a symlink only when the
//!   kernel resolves it beneath the copy (`openat2` with `RESOLVE_BENEATH`);
//!   every entry left out is listed in the result.
//! - **Bounded.** Copies stream through a pipe (never the whole tree in
//!   memory) and stop before writing past `MOAT_COPY_MAX_MIB`; the archive's
//!   own metadata is read under a budget, trees are cut at [`MAX_DEPTH`].

mod pack;
mod unpack;

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};

pub use pack::{PackSummary, file_size, measure, pack};
pub use unpack::{CopySummary, Limit, Sink, unpack, unpack_within};

use crate::error::{ConfigError, HostPathError};

/// Directories that are never a root, nor anything beneath them: the
/// operating system's own. `/root` is one too, unless it is the home
/// directory of the user moat runs as (then the home rules apply).
pub const SYSTEM_DIRS: &[&str] = &[
    "/etc", "/usr", "/var", "/proc", "/sys", "/dev", "/boot", "/root", "/run", "/bin", "/sbin", "/lib", "/lib32",
    "/lib64", "/libx32", "/nix", "/snap",
];

/// Names programs on the host act on by themselves when they meet them in a
/// directory, and what they do: written by a sandbox into a shared
/// directory, one would have the host run the sandbox's commands as the
/// person who runs moat (git runs hooks, `core.fsmonitor` and pagers from a
/// `.git` directory, and a `.git` file points it at any directory; editors
/// and agent tools start tasks, hooks and MCP servers from their project
/// settings). A copy from a sandbox never writes one, at any depth; the
/// comparison ignores ASCII case (case-insensitive file systems). Files a
/// person must choose to run (a script, a Makefile) keep their modes: the
/// line is what runs with no one asking.
pub const ACTED_ON: &[(&str, &str)] = &[
    (".git", "git runs hooks and commands from it"),
    (".hg", "Mercurial runs hooks from it"),
    (".jj", "Jujutsu runs the pager, diff and merge tools its repository config names"),
    (".sl", "Sapling runs hooks from it"),
    ("_darcs", "darcs runs the hooks its preferences name"),
    (".vscode", "VS Code and its forks run tasks and MCP servers from it"),
    (".cursor", "Cursor starts MCP servers from it"),
    (".claude", "Claude Code runs hooks from it"),
    (".mcp.json", "MCP clients start the servers it names"),
    (".idea", "JetBrains IDEs run configurations from it"),
    (".zed", "Zed runs tasks from it"),
    (".devcontainer", "editors build and start containers from it"),
    (".envrc", "direnv runs it"),
    (".gemini", "Gemini CLI starts MCP servers and runs hooks from it"),
    (".roo", "Roo Code starts MCP servers from it"),
    (".amazonq", "Amazon Q starts MCP servers from it"),
    (".continue", "Continue starts MCP servers from it"),
    (".kiro", "Kiro starts MCP servers and runs hooks from it"),
    ("opencode.json", "opencode starts the MCP servers it names"),
    (".aider.conf.yml", "aider runs the lint and test commands it names after its edits"),
    // Git hook managers: the hook they installed runs what these name at
    // the next commit.
    (".pre-commit-config.yaml", "pre-commit runs the hooks it names at each commit"),
    (".husky", "husky runs the hooks in it at each commit"),
    ("lefthook.yml", "lefthook runs the commands it names at each commit"),
    (".lefthook.yml", "lefthook runs the commands it names at each commit"),
    // Programs a person runs for another reason run these first.
    ("__pycache__", "Python runs the compiled files in it in place of their sources"),
    ("sitecustomize.py", "Python imports it at every start"),
    ("usercustomize.py", "Python imports it at every start"),
    (".cargo", "cargo runs the runners and compiler wrappers its config names"),
    ("rust-toolchain", "rustup runs the toolchain at the path it names"),
    ("rust-toolchain.toml", "rustup runs the toolchain at the path it names"),
    (".npmrc", "npm runs the shell and Node options it sets"),
    (".yarnrc", "yarn runs the program its yarn-path names in its own place"),
    (".yarnrc.yml", "yarn runs the program its yarnPath names in its own place"),
    (".pnpmfile.cjs", "pnpm runs it at every install"),
];

/// What a program on the host does with `name` ([`ACTED_ON`]), if
/// anything, wherever it is.
pub fn acted_on(name: &[u8]) -> Option<&'static str> {
    ACTED_ON.iter().find(|(known, _)| known.as_bytes().eq_ignore_ascii_case(name)).map(|(_, what)| *what)
}

/// What a program on the host does with the file at `parts` (a path's
/// components, the last its name), if anything: [`acted_on`] for any
/// component, and what acts by place as well as name:
/// - a file named `HEAD` (git's spelling): git takes any directory holding
///   a HEAD, `objects` and `refs` for a (bare) repository, whatever its
///   name, and runs the commands its `config` names there; no HEAD, no
///   repository;
/// - a `.pth` file beneath a `site-packages` or `dist-packages` directory:
///   Python runs its `import` lines at every start (elsewhere `.pth` is a
///   model checkpoint, and nothing runs it).
pub fn acted_on_path<P: AsRef<[u8]>>(parts: &[P]) -> Option<(usize, &'static str)> {
    if let Some(found) = parts.iter().enumerate().find_map(|(i, p)| Some((i, acted_on(p.as_ref())?))) {
        return Some(found);
    }
    let (last, dirs) = parts.split_last()?;
    let last = last.as_ref();
    let index = parts.len() - 1;
    if last == b"HEAD" {
        return Some((
            index,
            "git takes a directory holding it, objects and refs for a repository and runs commands its config names",
        ));
    }
    let pth = last.len() >= 4 && last[last.len() - 4..].eq_ignore_ascii_case(b".pth");
    (pth && dirs.iter().any(|d| is_site_packages(d.as_ref())))
        .then_some((index, "Python runs the import lines of a .pth file in site-packages at each start"))
}

/// What git makes of directory `dir`, by what it holds rather than its
/// name, as git itself judges one: a repository (a `HEAD`, `objects` and
/// `refs`: a bare one, or a `.git` under any name, as `--separate-git-dir`
/// makes), or a linked worktree's own directory (a `HEAD` and a
/// `commondir`). `None` for any other directory.
fn repository_kind(dir: &OwnedFd) -> Option<&'static str> {
    let has = |name: &str| fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok();
    if !has("HEAD") {
        return None;
    }
    if has("objects") && has("refs") {
        Some("a git repository (a directory holding HEAD, objects and refs)")
    } else if has("commondir") {
        Some("a git worktree's own directory (one holding HEAD and commondir)")
    } else {
        None
    }
}

/// Whether `name` is a directory Python takes `.pth` files from.
fn is_site_packages(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"site-packages") || name.eq_ignore_ascii_case(b"dist-packages")
}

/// The file `name` in `dir`, read whole when it is a regular file of at
/// most `max` bytes, reached without following a link and opened without
/// waiting (a FIFO put there answers at once); `None` otherwise.
pub fn read_small_file(dir: &impl AsFd, name: &str, max: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
    let file = std::fs::File::from(openat(dir, name, flags, Mode::empty()).ok()?);
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > max {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// What moat keeps free of a host file system it writes a copy or a task
/// record into, in words.
pub const RESERVE_RULE: &str = "5 % of it, at most 1 GiB";

/// The free space a copy or a record never takes from a file system of
/// `total` bytes ([`RESERVE_RULE`]): a model that copies in a loop fills no
/// host disk, whatever the copy limit.
pub fn disk_reserve(total: u64) -> u64 {
    (total / 20).min(1 << 30)
}

/// The bytes that may still be written on the file system of `fd` before
/// its [`disk_reserve`]; `None` when it cannot be asked, or the file system
/// tells no size (ramfs, some virtual ones: zero blocks).
pub fn room(fd: &impl AsFd) -> Option<u64> {
    let stat = nix::sys::statvfs::fstatvfs(fd).ok()?;
    if stat.blocks() == 0 {
        return None;
    }
    let block = stat.fragment_size();
    let available = stat.blocks_available().saturating_mul(block);
    Some(available.saturating_sub(disk_reserve(stat.blocks().saturating_mul(block))))
}

/// Trees deeper than this are cut there (the rest is listed as skipped),
/// both ways: each level holds a descriptor open while a walk is inside it,
/// and a sandbox could otherwise make a million directories with one name.
pub const MAX_DEPTH: usize = 128;

/// The largest SSH private key [`HostRoots::read_ssh_key`] reads.
pub const SSH_KEY_MAX: u64 = 16 << 10;

/// The default of `MOAT_COPY_MAX_MIB`: the most one copy may move.
pub const DEFAULT_COPY_MAX_MIB: u64 = 1024;

/// What each archive entry counts against a copy's limit beyond its data: a
/// tar header, and about what an inode and a block cost on the disk. It
/// bounds the number of entries as well as the bytes.
pub const ENTRY_COST: u64 = 4096;

/// The limit of one copy, in bytes: `MOAT_COPY_MAX_MIB` or the default.
pub fn copy_limit_from_env() -> Result<u64, ConfigError> {
    mib_from_env("MOAT_COPY_MAX_MIB", DEFAULT_COPY_MAX_MIB)
}

/// A size the operator sets in MiB, 1 to 1048576 (`default` unset), in
/// bytes; anything else is an error that names the setting and its range.
pub fn mib_from_env(var: &str, default: u64) -> Result<u64, ConfigError> {
    match std::env::var(var) {
        Err(_) => Ok(default << 20),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(mib) if (1..=1 << 20).contains(&mib) => Ok(mib << 20),
            _ => Err(ConfigError::Invalid(format!(
                "{var}={text:?} is not a size in MiB from 1 to 1048576 (the default is {default})"
            ))),
        },
    }
}

/// The roots the operator grants, from the environment.
///
/// `MOAT_ROOTS` (colon-separated absolute directories) when set: each must
/// exist, and none may be `/` or a system directory ([`SYSTEM_DIRS`]) —
/// that is an error, for the binaries to exit with. When unset, the working
/// directory, unless it is `/`, the home directory, inside a dot directory of
/// it, or a system directory: then there is no root, and the copy and task
/// tools refuse with a message naming `MOAT_ROOTS`.
pub fn roots_from_env() -> Result<Vec<PathBuf>, ConfigError> {
    roots_from(std::env::var_os("MOAT_ROOTS"), std::env::current_dir().ok(), home_dir().as_deref())
}

/// [`roots_from_env`] with its inputs given.
pub fn roots_from(
    list: Option<OsString>,
    cwd: Option<PathBuf>,
    home: Option<&Path>,
) -> Result<Vec<PathBuf>, ConfigError> {
    match list.filter(|v| !v.is_empty()) {
        Some(list) => std::env::split_paths(&list)
            .filter(|p| !p.as_os_str().is_empty())
            .map(|root| explicit_root(&root, home))
            .collect(),
        None => {
            let Some(cwd) = cwd else { return Ok(Vec::new()) };
            match unsuitable_root(&cwd, home) {
                Some(why) => {
                    tracing::info!(
                        "the working directory {} is {why}: no host directory is shared; set MOAT_ROOTS to share one",
                        cwd.display()
                    );
                    Ok(Vec::new())
                }
                None => Ok(vec![cwd]),
            }
        }
    }
}

fn explicit_root(root: &Path, home: Option<&Path>) -> Result<PathBuf, ConfigError> {
    let refuse = |why: String| Err(ConfigError::Invalid(format!("MOAT_ROOTS: {why}")));
    if !root.is_absolute() {
        return refuse(format!("{} is not an absolute path", root.display()));
    }
    let canonical = match root.canonicalize() {
        Ok(path) if path.is_dir() => path,
        Ok(_) => return refuse(format!("{} is not a directory", root.display())),
        Err(e) => return refuse(format!("{}: {e}", root.display())),
    };
    if canonical == Path::new("/") || is_system(&canonical, home) {
        return refuse(format!(
            "{} is the system's own (/, {}, or beneath them); share a project directory instead",
            root.display(),
            SYSTEM_DIRS.join(", ")
        ));
    }
    // The guard on a home's hidden entries works beneath a root; a root
    // that is one, or inside one (`~/.ssh`, `~/.config`, as named or as a
    // link leads), would share them whole.
    let own = home.map(|h| h.canonicalize().unwrap_or_else(|_| h.to_path_buf()));
    if own.iter().chain(account_homes()).any(|home| in_dot_dir(&canonical, home)) {
        return refuse(format!(
            "{} is {} a hidden directory of a home directory (such as ~/.ssh or ~/.config), which is never \
             shared; share a project directory instead",
            root.display(),
            if canonical == root { "in" } else { "a link into" }
        ));
    }
    Ok(canonical)
}

/// Why `dir` may not be the root taken by default, if it may not.
fn unsuitable_root(dir: &Path, home: Option<&Path>) -> Option<&'static str> {
    let Ok(dir) = dir.canonicalize() else { return Some("unreadable") };
    if dir == Path::new("/") {
        return Some("/");
    }
    if let Some(home) = home {
        if dir == home {
            return Some("the home directory");
        }
        if in_dot_dir(&dir, home) {
            return Some("inside a hidden directory of the home directory");
        }
    }
    for other in account_homes() {
        if dir == *other {
            return Some("an account's home directory");
        }
        if in_dot_dir(&dir, other) {
            return Some("inside a hidden directory of an account's home directory");
        }
    }
    if is_system(&dir, home) { Some("a system directory") } else { None }
}

/// The home directories of the system's accounts (`/etc/passwd`; accounts
/// only a directory service knows are not listed), as they resolve, but
/// `/` and what does not exist.
/// Read once per process: the default root's check and [`HostRoots::open`]
/// both need them, and accounts do not come and go under a running server.
fn account_homes() -> &'static [PathBuf] {
    static HOMES: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    HOMES.get_or_init(|| {
        let Ok(passwd) = std::fs::read_to_string("/etc/passwd") else { return Vec::new() };
        let mut homes: Vec<PathBuf> = passwd
            .lines()
            .filter_map(|line| line.split(':').nth(5))
            .filter(|home| home.starts_with('/'))
            .filter_map(|home| Path::new(home).canonicalize().ok())
            .filter(|home| home != Path::new("/") && home.is_dir())
            .collect();
        homes.sort();
        homes.dedup();
        homes
    })
}

fn is_system(dir: &Path, home: Option<&Path>) -> bool {
    SYSTEM_DIRS.iter().any(|system| {
        let system = Path::new(system);
        // A home under a system directory (/root, /var/home/u) is a home like
        // any other, and only it: the rest of that directory stays the system's.
        let ours = home.is_some_and(|h| h.starts_with(system) && dir.starts_with(h));
        dir.starts_with(system) && !ours
    })
}

fn in_dot_dir(dir: &Path, home: &Path) -> bool {
    dir.strip_prefix(home)
        .ok()
        .and_then(|rest| rest.components().next())
        .is_some_and(|c| c.as_os_str().as_encoded_bytes().starts_with(b"."))
}

/// `$HOME`, else the account's home from the password database.
fn home_dir() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten().map(|user| user.dir));
    home.and_then(|h| h.canonicalize().ok())
}

/// A file's identity: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId(u64, u64);

impl FileId {
    fn of(stat: &FileStat) -> Self {
        Self(stat.st_dev, stat.st_ino)
    }

    fn of_path(path: &Path) -> Option<Self> {
        nix::sys::stat::stat(path).ok().map(|s| Self::of(&s))
    }
}

/// Whether `dir` is the directory `target` or beneath it, by walking `..`
/// up to `/` and comparing identities (a bind mount of `target` included).
fn is_or_beneath(dir: &OwnedFd, target: FileId) -> bool {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let Ok(mut current) = openat(dir, ".", flags, Mode::empty()) else { return false };
    for _ in 0..4096 {
        let Ok(stat) = fstat(&current) else { return false };
        if FileId::of(&stat) == target {
            return true;
        }
        let Ok(parent) = openat(&current, "..", flags, Mode::empty()) else { return false };
        if fstat(&parent).is_ok_and(|p| FileId::of(&p) == FileId::of(&stat)) {
            return false;
        }
        current = parent;
    }
    false
}

/// One granted directory, open for the life of the server.
#[derive(Debug)]
struct Root {
    /// Its canonical path, which model paths are matched against.
    path: PathBuf,
    dir: OwnedFd,
}

/// The host directories a tool call may read from and write to, open.
#[derive(Debug)]
pub struct HostRoots {
    roots: Vec<Root>,
    /// moat's data directory: never reachable through a root.
    data_dir: Option<FileId>,
    /// The home directories (moat's own and every account's), whose dot
    /// entries are never reachable.
    homes: Vec<FileId>,
    /// `~/.ssh`, where [`HostRoots::read_ssh_key`] also reads keys from.
    ssh_dir: Option<PathBuf>,
    /// The most one copy may move, in bytes.
    copy_limit: u64,
}

/// What kind of thing a source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    File,
    Dir,
}

/// A host file or directory opened beneath a root, for reading.
#[derive(Debug)]
pub struct Source {
    pub fd: OwnedFd,
    pub kind: SourceKind,
    /// The path as the model gave it, for messages.
    pub shown: PathBuf,
}

/// A host path that does not exist yet, beneath a root: its parent
/// directory, open, and its name.
#[derive(Debug)]
pub struct Destination {
    parent: OwnedFd,
    name: OsString,
    pub shown: PathBuf,
}

impl HostRoots {
    /// Opens `roots` (each checked as [`roots_from_env`] checks an explicit
    /// one); `data_dir` is kept out of every root; one copy moves at most
    /// `copy_limit` bytes.
    pub fn open(roots: &[PathBuf], data_dir: &Path, copy_limit: u64) -> Result<Self, ConfigError> {
        Self::open_with_home(roots, data_dir, copy_limit, home_dir())
    }

    /// [`HostRoots::open`] with the home directory given.
    pub fn open_with_home(
        roots: &[PathBuf],
        data_dir: &Path,
        copy_limit: u64,
        home: Option<PathBuf>,
    ) -> Result<Self, ConfigError> {
        // The guard needs the data directory's identity: make it now.
        if let Err(e) = std::fs::create_dir_all(data_dir) {
            return Err(ConfigError::Invalid(format!("cannot create the data directory {}: {e}", data_dir.display())));
        }
        let data_id = FileId::of_path(data_dir);
        let data = data_dir.canonicalize().ok();
        let mut opened = Vec::new();
        for root in roots {
            let path = explicit_root(root, home.as_deref())?;
            if data.as_ref().is_some_and(|d| path.starts_with(d)) {
                return Err(ConfigError::Invalid(format!(
                    "MOAT_ROOTS: {} is inside moat's data directory; share a project directory instead",
                    root.display()
                )));
            }
            // The path as checked, which has no link left in it: one put in
            // its way since (a directory swapped for a link to /etc) fails
            // to open rather than becoming the root.
            let how = nix::fcntl::OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
                .resolve(nix::fcntl::ResolveFlag::RESOLVE_NO_SYMLINKS);
            let dir = nix::fcntl::openat2(nix::fcntl::AT_FDCWD, &path, how)
                .map_err(|e| ConfigError::Invalid(format!("MOAT_ROOTS: cannot open {}: {e}", path.display())))?;
            if data_id.is_some_and(|data| is_or_beneath(&dir, data)) {
                return Err(ConfigError::Invalid(format!(
                    "MOAT_ROOTS: {} is moat's data directory or inside it; share a project directory instead",
                    root.display()
                )));
            }
            opened.push(Root { path, dir });
        }
        // Guarded while walking beneath a root: with none, not needed.
        let homes = if opened.is_empty() {
            Vec::new()
        } else {
            home.iter().chain(account_homes()).filter_map(|h| FileId::of_path(h)).collect()
        };
        Ok(Self { roots: opened, data_dir: data_id, homes, ssh_dir: home.map(|h| h.join(".ssh")), copy_limit })
    }

    /// The most one copy may move, in bytes.
    pub fn copy_limit(&self) -> u64 {
        self.copy_limit
    }

    /// The roots' paths.
    pub fn paths(&self) -> Vec<&Path> {
        self.roots.iter().map(|r| r.path.as_path()).collect()
    }

    fn refuse(&self, path: &Path, why: impl std::fmt::Display) -> HostPathError {
        HostPathError(format!("{}: {why}", path.display()))
    }

    fn outside(&self, path: &Path) -> HostPathError {
        if self.roots.is_empty() {
            return self.refuse(
                path,
                "no host directory is shared with sandboxes (the server's working directory is not a project \
                 directory); the operator may set MOAT_ROOTS to the directories to share",
            );
        }
        // The roots are not named: no error shows the model a host path it
        // did not give. The operator sees them in `moat doctor`.
        self.refuse(path, "outside the shared directories; the operator may add it to MOAT_ROOTS")
    }

    /// Which root `path` is in, and its components beneath that root.
    fn locate(&self, path: &Path) -> Result<(&Root, Vec<OsString>), HostPathError> {
        if !path.is_absolute() {
            return Err(self.refuse(path, "not an absolute path; give one such as /home/me/project/file.txt"));
        }
        let mut parts = Vec::new();
        for component in path.components() {
            match component {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(name) => parts.push(name.to_os_string()),
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(self.refuse(path, "`..` is not allowed in host paths; give the path without it"));
                }
            }
        }
        for root in &self.roots {
            let prefix: Vec<&OsStr> = root.path.components().skip(1).map(Component::as_os_str).collect();
            if parts.len() >= prefix.len() && parts.iter().zip(&prefix).all(|(a, b)| a == b) {
                let rest = parts.split_off(prefix.len());
                return Ok((root, rest));
            }
        }
        Err(self.outside(path))
    }

    /// Opens the directory `parts` beneath `root`, refusing symlinks, the
    /// data directory and the home directory's dot directories.
    fn walk(&self, root: &Root, parts: &[OsString], shown: &Path) -> Result<OwnedFd, HostPathError> {
        self.walk_with(root, parts, shown, |_| Ok(()))
    }

    /// [`HostRoots::walk`] to a place a copy is written: no directory on
    /// the way may be a git repository's own, whatever its name.
    fn walk_to_write(&self, root: &Root, parts: &[OsString], shown: &Path) -> Result<OwnedFd, HostPathError> {
        self.walk_with(root, parts, shown, |dir| match repository_kind(dir) {
            None => Ok(()),
            Some(what) => Err(self.refuse(
                shown,
                format!(
                    "moat never writes a copy into {what}: git runs the hooks and the commands in its config there, \
                     so a file from a sandbox could run commands on the host; copy to another path and look at \
                     what you move there yourself"
                ),
            )),
        })
    }

    /// Opens each directory of `parts` beneath `root` in turn, never
    /// following a link; `check` judges each, the root's included.
    fn walk_with(
        &self,
        root: &Root,
        parts: &[OsString],
        shown: &Path,
        check: impl Fn(&OwnedFd) -> Result<(), HostPathError>,
    ) -> Result<OwnedFd, HostPathError> {
        let mut dir = openat(&root.dir, ".", OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| self.refuse(shown, e.desc()))?;
        self.check_dir(&dir, shown)?;
        check(&dir)?;
        for name in parts {
            self.check_entry(&dir, name, shown)?;
            dir = openat(
                &dir,
                name.as_os_str(),
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| self.walk_error(shown, name, e))?;
            self.check_dir(&dir, shown)?;
            check(&dir)?;
        }
        Ok(dir)
    }

    fn walk_error(&self, shown: &Path, name: &OsStr, e: Errno) -> HostPathError {
        let name = name.to_string_lossy();
        match e {
            Errno::ENOTDIR | Errno::ELOOP => self.refuse(
                shown,
                format!(
                    "{name} is a symlink or not a directory; give the real path (links in host paths are not followed)"
                ),
            ),
            Errno::ENOENT => self.refuse(shown, format!("{name} does not exist")),
            other => self.refuse(shown, format!("{name}: {}", other.desc())),
        }
    }

    /// Whether `dir` is a home directory.
    fn is_home(&self, dir: &OwnedFd) -> bool {
        !self.homes.is_empty() && fstat(dir).is_ok_and(|s| self.homes.contains(&FileId::of(&s)))
    }

    /// Refuses `name` in `dir` when `dir` is a home directory and `name`
    /// a dot entry.
    fn check_entry(&self, dir: &OwnedFd, name: &OsStr, shown: &Path) -> Result<(), HostPathError> {
        if name.as_encoded_bytes().starts_with(b".") && self.is_home(dir) {
            return Err(self.refuse(shown, "inside a hidden directory of a home directory, which is never shared"));
        }
        Ok(())
    }

    fn check_dir(&self, dir: &OwnedFd, shown: &Path) -> Result<(), HostPathError> {
        if self.data_dir.is_some_and(|data| fstat(dir).is_ok_and(|s| FileId::of(&s) == data)) {
            return Err(self.refuse(shown, "moat's own data directory, which is never shared"));
        }
        Ok(())
    }

    /// Opens an existing file or directory for reading, to be copied into
    /// a sandbox. Nothing in a Git directory is: its `config` may hold a
    /// remote's credentials.
    pub fn open_source(&self, path: &Path) -> Result<Source, HostPathError> {
        let (root, parts) = self.locate(path)?;
        if parts.iter().any(|part| part.as_encoded_bytes().eq_ignore_ascii_case(b".git")) {
            return Err(self.refuse(
                path,
                "inside a Git directory, whose config may hold a remote's credentials, which is never copied into a \
                 sandbox; copy the working tree (its .git is left out), and clone with git_clone where history is needed",
            ));
        }
        let shown = path.to_path_buf();
        let Some((name, parents)) = parts.split_last() else {
            let fd = openat(&root.dir, ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| self.refuse(path, e.desc()))?;
            self.check_dir(&fd, path)?;
            return Ok(Source { fd, kind: SourceKind::Dir, shown });
        };
        let parent = self.walk(root, parents, path)?;
        self.check_entry(&parent, name, path)?;
        let stat = fstatat(&parent, name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.walk_error(path, name, e))?;
        let kind = match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFREG => SourceKind::File,
            SFlag::S_IFDIR => SourceKind::Dir,
            SFlag::S_IFLNK => {
                return Err(self.refuse(path, "a symlink; give the path it points to (links are not followed)"));
            }
            _ => return Err(self.refuse(path, "not a regular file or directory")),
        };
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK;
        let fd = openat(&parent, name.as_os_str(), flags, Mode::empty()).map_err(|e| self.walk_error(path, name, e))?;
        let opened = fstat(&fd).map_err(|e| self.refuse(path, e.desc()))?;
        if FileId::of(&opened) != FileId::of(&stat) {
            return Err(self.refuse(path, "it changed while being opened; try again"));
        }
        if kind == SourceKind::Dir {
            self.check_dir(&fd, path)?;
        }
        // Reads block as usual from here on.
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
            .map_err(|e| self.refuse(path, e.desc()))?;
        Ok(Source { fd, kind, shown })
    }

    /// Reads the SSH private key at `path`, beneath `~/.ssh` or a root,
    /// walked as [`HostRoots::open_source`] walks (no link followed, no
    /// `..`). What is not a regular file of at most [`SSH_KEY_MAX`] bytes
    /// holding a private key is refused; no error shows the file's text.
    pub fn read_ssh_key(&self, path: &Path) -> Result<Vec<u8>, HostPathError> {
        use std::io::Read;
        let in_ssh_dir = self.ssh_dir.as_ref().filter(|dir| path.starts_with(dir));
        let source = match in_ssh_dir {
            Some(dir) => {
                // The operator's own directory, opened by its name; what the
                // model names beneath it is walked from its descriptor.
                let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
                let fd = nix::fcntl::open(dir, flags, Mode::empty()).map_err(|e| self.refuse(path, e.desc()))?;
                let view = Self {
                    roots: vec![Root { path: dir.clone(), dir: fd }],
                    data_dir: self.data_dir,
                    homes: Vec::new(),
                    ssh_dir: None,
                    copy_limit: 0,
                };
                view.open_source(path)?
            }
            None => self.open_source(path).map_err(|e| {
                let plain = path.is_absolute() && !path.components().any(|c| c == Component::ParentDir);
                if plain && self.locate(path).is_err() {
                    self.refuse(path, "an ssh_key_path must be beneath ~/.ssh or a directory in MOAT_ROOTS")
                } else {
                    e
                }
            })?,
        };
        if source.kind != SourceKind::File {
            return Err(self.refuse(path, "not a file; give the path of a private key such as ~/.ssh/id_ed25519"));
        }
        let mut key = Vec::new();
        std::fs::File::from(source.fd)
            .take(SSH_KEY_MAX + 1)
            .read_to_end(&mut key)
            .map_err(|e| self.refuse(path, format!("cannot read it: {e}")))?;
        let is_key = key.len() as u64 <= SSH_KEY_MAX
            && String::from_utf8_lossy(&key)
                .lines()
                .any(|l| l.starts_with("-----BEGIN ") && l.ends_with("PRIVATE KEY-----"));
        if !is_key {
            return Err(self.refuse(
                path,
                "not an SSH private key (an OpenSSH or PEM file beginning `-----BEGIN ... PRIVATE KEY-----`)",
            ));
        }
        Ok(key)
    }

    /// Checks that `path` is a new name beneath a root, and opens its parent.
    pub fn destination(&self, path: &Path) -> Result<Destination, HostPathError> {
        let (root, parts) = self.locate(path)?;
        let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_encoded_bytes()).collect();
        // A copy into a site-packages directory brings its own names,
        // which the tree's check sees without the place: refused here.
        if let Some(at) = bytes.iter().position(|p| is_site_packages(p)) {
            return Err(self.refuse(
                path,
                format!(
                    "moat never writes a copy into {}: Python runs the .pth files there at each start, so a file \
                     from a sandbox could run commands on the host; copy to another path and look at what you move \
                     there yourself",
                    parts[at].to_string_lossy()
                ),
            ));
        }
        if let Some((at, what)) = acted_on_path(&bytes) {
            return Err(self.refuse(
                path,
                format!(
                    "moat never writes a copy into or as {}: {what}, so a file there from a sandbox could run \
                     commands on the host; copy to another path and look at what you move there yourself",
                    parts[at].to_string_lossy()
                ),
            ));
        }
        let Some((name, parents)) = parts.split_last() else {
            return Err(self.refuse(path, "exists; copy to a new path (nothing on the host is overwritten)"));
        };
        let parent = self.walk_to_write(root, parents, path)?;
        self.check_entry(&parent, name, path)?;
        match fstatat(&parent, name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => {}
            Ok(_) => return Err(self.refuse(path, "exists; copy to a new path (nothing on the host is overwritten)")),
            Err(e) => return Err(self.refuse(path, e.desc())),
        }
        Ok(Destination { parent, name: name.clone(), shown: path.to_path_buf() })
    }
}

/// Room promised on the host's file systems, each by its device number:
/// to copies under way ([`Destination::limit`]) and to microVMs' disk
/// overlays for their lives ([`promise_room`]). Copies, task records and
/// overlays that share a file system share its room instead of each
/// counting on all of it; a promise on one file system takes nothing from
/// another's.
static PROMISES: std::sync::Mutex<Promises> =
    std::sync::Mutex::new(Promises { next: 0, shares: std::collections::BTreeMap::new() });

#[derive(Debug)]
struct Promises {
    next: u64,
    shares: std::collections::BTreeMap<u64, Share>,
}

#[derive(Debug)]
struct Share {
    device: u64,
    bytes: u64,
    /// The file that fills the share ([`Promise::filled_by`]): what it
    /// holds already is on the disk, and counted by its free space.
    file: Option<PathBuf>,
}

impl Share {
    /// What the share may still write.
    fn left(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let written = self.file.as_ref().and_then(|f| std::fs::metadata(f).ok()).map_or(0, |m| m.blocks() * 512);
        self.bytes.saturating_sub(written)
    }
}

impl Promises {
    fn on(&self, device: u64) -> u64 {
        self.shares.values().filter(|s| s.device == device).fold(0, |sum, s| sum.saturating_add(s.left()))
    }

    fn add(&mut self, device: u64, bytes: u64) -> Promise {
        let id = self.next;
        self.next += 1;
        self.shares.insert(id, Share { device, bytes, file: None });
        Promise(id)
    }
}

fn promises() -> std::sync::MutexGuard<'static, Promises> {
    PROMISES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn device(fd: &impl AsFd) -> u64 {
    fstat(fd).map_or(0, |stat| stat.st_dev)
}

/// What may still be written on the file system of `fd`: its [`room`],
/// less what copies and microVMs were promised there and have not written
/// yet; `None` when it cannot be asked.
pub fn room_left(fd: &impl AsFd) -> Option<u64> {
    let room = room(fd)?;
    Some(room.saturating_sub(promises().on(device(fd))))
}

/// One share of a file system's room, given back when it is dropped.
#[derive(Debug)]
pub struct Promise(u64);

/// The most of a file system's room one copy holds at a time (see
/// [`Destination::limit`]): copies at once share the room, and one that
/// stalls (a sandbox can make its archive trickle) holds this, not its
/// whole limit.
pub const COPY_WINDOW: u64 = 64 << 20;

impl Promise {
    /// What the share holds now.
    pub fn held(&self) -> u64 {
        promises().shares.get(&self.0).map_or(0, |s| s.bytes)
    }

    /// Holds a new window of at most `ahead` bytes, in place of the one
    /// held (which its copy has written): what the file system of `fd` has
    /// left beside every other share, up to `ahead`, or `ahead` where the
    /// room cannot be asked. Returns what is held now.
    pub fn renew(&self, fd: &impl AsFd, ahead: u64) -> u64 {
        let room = room(fd);
        let mut promises = promises();
        let Some(device) = promises.shares.get(&self.0).map(|s| s.device) else { return 0 };
        if let Some(share) = promises.shares.get_mut(&self.0) {
            share.bytes = 0;
        }
        let others = promises.on(device);
        let granted = room.map_or(ahead, |r| r.saturating_sub(others).min(ahead));
        if let Some(share) = promises.shares.get_mut(&self.0) {
            share.bytes = granted;
        }
        granted
    }

    /// The share is filled by `file` (a microVM's sparse overlay): from now
    /// on only what it may still write is held, since what it has written
    /// is already gone from the file system's free space.
    pub fn filled_by(&self, file: PathBuf) {
        if let Some(share) = promises().shares.get_mut(&self.0) {
            share.file = Some(file);
        }
    }
}

impl Drop for Promise {
    fn drop(&mut self) {
        promises().shares.remove(&self.0);
    }
}

/// Promises `bytes` of the room of the file system of `fd` ([`room_left`])
/// to something that will write up to that much over its life (a
/// microVM's disk overlay), or says how much is left: `Err(left)`. Where
/// the room cannot be asked, the promise is made.
pub fn promise_room(fd: &impl AsFd, bytes: u64) -> Result<Promise, u64> {
    let (room, device) = (room(fd), device(fd));
    let mut promises = promises();
    if let Some(left) = room.map(|r| r.saturating_sub(promises.on(device)))
        && left < bytes
    {
        return Err(left);
    }
    Ok(promises.add(device, bytes))
}

impl Destination {
    /// What one copy here may write: the copy limit, or less where the
    /// file system's free space beyond its [`disk_reserve`], less what is
    /// promised there ([`room_left`]), is less. The share, held until the
    /// [`Promise`] is dropped, is the first [`COPY_WINDOW`] of it:
    /// [`unpack_within`] holds the next as the copy goes, so that copies
    /// stalled at once hold a window each, not every limit.
    pub fn limit(&self, copy_limit: u64) -> (Limit, Promise) {
        let (room, device) = (room(&self.parent), device(&self.parent));
        let mut promises = promises();
        let limit = match room.map(|r| r.saturating_sub(promises.on(device))) {
            Some(left) if left < copy_limit => Limit { bytes: left, by_disk: true },
            _ => Limit::from(copy_limit),
        };
        let promise = promises.add(device, limit.bytes.min(COPY_WINDOW));
        (limit, promise)
    }

    /// Makes a new, empty file in a private directory beside the
    /// destination; [`Staged::commit`] gives it its name.
    pub fn stage_file(self) -> Result<(Staged, std::fs::File), HostPathError> {
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let (staged, fd) =
            self.stage(false, |box_fd| openat(box_fd, PAYLOAD, flags, Mode::from_bits_truncate(0o600)))?;
        Ok((staged, std::fs::File::from(fd)))
    }

    /// Makes a new, empty directory (mode 0700 until committed) in a
    /// private directory beside the destination, and opens it.
    pub fn stage_dir(self) -> Result<(Staged, OwnedFd), HostPathError> {
        self.stage(true, |box_fd| {
            nix::sys::stat::mkdirat(box_fd, PAYLOAD, Mode::from_bits_truncate(0o700))?;
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            openat(box_fd, PAYLOAD, flags, Mode::empty())
        })
    }

    /// A private directory (mode 0700) under a hidden name beside the
    /// destination, and `make`'s copy in it. The copy is reached only
    /// through the box's descriptor, never by a name in the parent: where
    /// others may write in the parent (a shared root), one who renames the
    /// box away and puts something else at its name gets moat to remove,
    /// chmod or rename nothing of theirs.
    fn stage(
        self,
        dir: bool,
        make: impl Fn(&OwnedFd) -> nix::Result<OwnedFd>,
    ) -> Result<(Staged, OwnedFd), HostPathError> {
        use std::hash::{BuildHasher, Hasher};
        let failed = |e: Errno| HostPathError(format!("{}: cannot create it: {}", self.shown.display(), e.desc()));
        let mut made = None;
        for _ in 0..16 {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u32(std::process::id());
            let temp = OsString::from(format!(".moat-copy-{:016x}", hasher.finish()));
            match nix::sys::stat::mkdirat(&self.parent, temp.as_os_str(), Mode::from_bits_truncate(0o700)) {
                Ok(()) => {
                    made = Some(temp);
                    break;
                }
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(failed(e)),
            }
        }
        let Some(temp) = made else {
            return Err(HostPathError(format!(
                "{}: cannot find a free temporary name beside it",
                self.shown.display()
            )));
        };
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let box_fd = openat(&self.parent, temp.as_os_str(), flags, Mode::empty()).map_err(failed)?;
        let staged = Staged { parent: self.parent, box_fd, temp, name: self.name, shown: self.shown, dir, done: false };
        let fd = make(&staged.box_fd)
            .map_err(|e| HostPathError(format!("{}: cannot create it: {}", staged.shown.display(), e.desc())))?;
        Ok((staged, fd))
    }
}

/// The name of a staged copy in its private directory.
const PAYLOAD: &str = "copy";

/// A copy being written in a private directory under a hidden name beside
/// its destination, so that nothing a sandbox sent is at the destination's
/// name before it has all been checked. Dropped without
/// [`Staged::commit`], it is removed.
#[derive(Debug)]
pub struct Staged {
    parent: OwnedFd,
    /// The private directory, mode 0700, holding the copy as [`PAYLOAD`].
    box_fd: OwnedFd,
    /// The private directory's name in `parent`.
    temp: OsString,
    name: OsString,
    shown: PathBuf,
    dir: bool,
    done: bool,
}

impl Staged {
    /// Gives the copy its name: a rename that never replaces anything.
    pub fn commit(mut self) -> Result<(), HostPathError> {
        if self.dir {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            if let Ok(fd) = openat(&self.box_fd, PAYLOAD, flags, Mode::empty()) {
                let _ = nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(0o755));
            }
        }
        let renamed = nix::fcntl::renameat2(
            &self.box_fd,
            PAYLOAD,
            &self.parent,
            self.name.as_os_str(),
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        );
        match renamed {
            Ok(()) => {
                self.done = true;
                Ok(())
            }
            Err(Errno::EEXIST) => {
                Err(HostPathError(format!("{}: exists now; copy to a new path", self.shown.display())))
            }
            Err(e) => Err(HostPathError(format!("{}: cannot create it: {}", self.shown.display(), e.desc()))),
        }
    }

    /// Removes the private directory from the parent, if the name there is
    /// still it (another's directory put at that name is left alone).
    fn remove_box(&self) {
        let (Ok(own), Ok(named)) = (
            nix::sys::stat::fstat(&self.box_fd),
            fstatat(&self.parent, self.temp.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW),
        ) else {
            return;
        };
        if (own.st_dev, own.st_ino) == (named.st_dev, named.st_ino) {
            let _ = nix::unistd::unlinkat(&self.parent, self.temp.as_os_str(), nix::unistd::UnlinkatFlags::RemoveDir);
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = remove_beneath(&self.box_fd, OsStr::new(PAYLOAD), 0)
        {
            tracing::warn!(path = %self.shown.display(), "could not remove a failed copy: {e}");
        }
        self.remove_box();
    }
}

/// Reads the small file `rel` beneath the directory `dir` (at most 64 KiB),
/// never leaving it and following no link on the way (`RESOLVE_BENEATH`,
/// `RESOLVE_NO_SYMLINKS`), as every other host path is walked; `None` when
/// it is missing, a link, unreadable or larger.
pub fn read_small(dir: &OwnedFd, rel: &str) -> Option<String> {
    use nix::fcntl::ResolveFlag;
    use std::io::Read;
    const MAX: u64 = 64 << 10;
    let how = nix::fcntl::OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = retry_again(|| nix::fcntl::openat2(dir, rel, how)).ok()?;
    let stat = fstat(&fd).ok()?;
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return None;
    }
    let mut text = String::new();
    std::fs::File::from(fd).take(MAX + 1).read_to_string(&mut text).ok()?;
    (text.len() as u64 <= MAX).then_some(text)
}

/// Runs `openat2` again while it fails with `EAGAIN`, which `RESOLVE_BENEATH`
/// returns when a rename anywhere on the system races a `..` in the lookup.
pub(crate) fn retry_again(mut open: impl FnMut() -> nix::Result<OwnedFd>) -> nix::Result<OwnedFd> {
    let mut result = open();
    for _ in 0..16 {
        if !matches!(result, Err(Errno::EAGAIN)) {
            break;
        }
        result = open();
    }
    result
}

/// Writes `bytes` to the new file `path` in moat's own directories: never
/// through a symlink, never over an existing file.
pub fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(0o600)
        .open(path)?
        .write_all(bytes)
}

/// The names in the directory `dir` (an open descriptor of it), without
/// `.` and `..`.
pub(crate) fn names_in(dir: &impl AsFd) -> nix::Result<Vec<OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let listing = openat(dir, ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
    let mut listing = nix::dir::Dir::from_fd(listing)?;
    Ok(listing
        .iter()
        .filter_map(Result::ok)
        .map(|e| OsStr::from_bytes(e.file_name().to_bytes()).to_os_string())
        .filter(|n| n != "." && n != "..")
        .collect())
}

/// Removes `name` in `dir` and everything beneath it, never following a
/// symlink.
pub(crate) fn remove_beneath(dir: &impl AsFd, name: &OsStr, depth: usize) -> nix::Result<()> {
    use nix::unistd::{UnlinkatFlags, unlinkat};
    let stat = match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Err(Errno::ENOENT) => return Ok(()),
        other => other?,
    };
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFDIR {
        return unlinkat(dir, name, UnlinkatFlags::NoRemoveDir);
    }
    // Copies are at most MAX_DEPTH deep; the bound keeps the recursion and
    // its open descriptors small whatever is found.
    if depth > 2 * MAX_DEPTH {
        return Err(Errno::ELOOP);
    }
    let fd =
        openat(dir, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())?;
    for child in names_in(&fd)? {
        remove_beneath(&fd, &child, depth + 1)?;
    }
    unlinkat(dir, name, UnlinkatFlags::RemoveDir)
}

#[cfg(test)]
mod tests;

//! Host tree → tar stream, for a sandbox: `copy_to_sandbox` and task imports.
//!
//! The tree is walked by descriptor (`openat` with `O_NOFOLLOW` from the
//! source's own descriptor), twice: once to measure it against the copy's
//! limit, so an oversized tree is refused before the sandbox sees a byte,
//! and once to stream it. Symlinks travel as links (they point into the
//! sandbox there); devices, sockets and FIFOs are left out and listed.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};

use super::{ENTRY_COST, FileId, HostRoots, MAX_DEPTH};
use crate::error::HostPathError;

/// What a pack sent, and what it left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackSummary {
    /// Regular files and symlinks archived.
    pub files: u64,
    /// Bytes of file data archived.
    pub bytes: u64,
    /// `path: why` for every entry left out.
    pub skipped: Vec<String>,
    /// The names at the top of the tree.
    pub top: Vec<String>,
}

enum Item<'a> {
    Dir,
    File(&'a FileStat, OwnedFd),
    Symlink(OsString),
}

struct Walk<'a> {
    roots: &'a HostRoots,
    /// Leave out `.git` at the top (a task's baseline is made anew).
    skip_git: bool,
    /// Open files for `Item::File` (the streaming pass); otherwise only
    /// their sizes are read.
    open_files: bool,
    summary: PackSummary,
    /// Sum of data and [`ENTRY_COST`]s so far.
    cost: u64,
}

impl Walk<'_> {
    fn skip(&mut self, rel: &Path, why: &str) {
        self.summary.skipped.push(format!("{}: {why}", rel.display()));
    }

    fn visit(
        &mut self,
        dir: &OwnedFd,
        rel: &Path,
        depth: usize,
        emit: &mut dyn FnMut(&Path, Item<'_>) -> Result<(), HostPathError>,
    ) -> Result<(), HostPathError> {
        let failed = |what: &str, e: Errno| HostPathError(format!("{}: {what}: {}", rel.display(), e.desc()));
        let is_home = self.roots.is_home(dir);
        let mut names = super::names_in(dir).map_err(|e| failed("cannot list it", e))?;
        names.sort();
        for name in names {
            let path = rel.join(&name);
            // A Git directory's `config` may hold a remote's credentials
            // (a token in its URL, an `http.extraheader`): none is copied
            // into a sandbox, at any depth (a vendored checkout's, a
            // submodule's), under any case. The project's own, at the top,
            // is left out without a word.
            if self.skip_git && name.as_encoded_bytes().eq_ignore_ascii_case(b".git") {
                if depth > 0 {
                    self.skip(
                        &path,
                        "a Git directory (its config may hold credentials) is never copied into a sandbox",
                    );
                }
                continue;
            }
            if depth == 0 {
                self.summary.top.push(name.to_string_lossy().into_owned());
            }
            if is_home && name.as_bytes().starts_with(b".") {
                self.skip(&path, "a hidden entry of a home directory is never shared");
                continue;
            }
            let stat = match fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(stat) => stat,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(HostPathError(format!("{}: {}", path.display(), e.desc()))),
            };
            match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
                SFlag::S_IFDIR => {
                    if self.roots.data_dir == Some(FileId::of(&stat)) {
                        self.skip(&path, "moat's data directory is never shared");
                        continue;
                    }
                    if depth + 1 >= MAX_DEPTH {
                        self.skip(&path, &format!("deeper than {MAX_DEPTH} levels"));
                        continue;
                    }
                    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
                    let child = match openat(dir, name.as_os_str(), flags, Mode::empty()) {
                        Ok(child) => child,
                        Err(e) => {
                            self.skip(&path, &format!("cannot open it: {}", e.desc()));
                            continue;
                        }
                    };
                    self.charge(&path, 0)?;
                    emit(&path, Item::Dir)?;
                    self.visit(&child, &path, depth + 1, emit)?;
                }
                SFlag::S_IFREG => {
                    let size = u64::try_from(stat.st_size).unwrap_or(0);
                    self.charge(&path, size)?;
                    let fd = if self.open_files {
                        match open_file(dir, &name, &stat) {
                            Ok(fd) => Some(fd),
                            Err(why) => {
                                self.skip(&path, &why);
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    self.summary.files += 1;
                    self.summary.bytes += size;
                    if let Some(fd) = fd {
                        emit(&path, Item::File(&stat, fd))?;
                    }
                }
                SFlag::S_IFLNK => {
                    let target = match readlinkat(dir, name.as_os_str()) {
                        Ok(target) => target,
                        Err(e) => {
                            self.skip(&path, &format!("cannot read the link: {}", e.desc()));
                            continue;
                        }
                    };
                    self.charge(&path, 0)?;
                    self.summary.files += 1;
                    emit(&path, Item::Symlink(target))?;
                }
                _ => self.skip(&path, "not a regular file, directory or symlink"),
            }
        }
        Ok(())
    }

    fn charge(&mut self, rel: &Path, size: u64) -> Result<(), HostPathError> {
        self.cost = self.cost.saturating_add(ENTRY_COST).saturating_add(size);
        if self.cost > self.roots.copy_limit {
            return Err(HostPathError(format!(
                "the copy is larger than the limit of {} MiB (MOAT_COPY_MAX_MIB; each entry counts {} KiB beyond its \
                 data), reached at {}; copy a smaller part, or the operator may raise the limit",
                self.roots.copy_limit >> 20,
                ENTRY_COST >> 10,
                rel.display()
            )));
        }
        Ok(())
    }
}

/// Opens the regular file `name` in `dir` for reading, checking it is still
/// the file `stat` describes.
fn open_file(dir: &OwnedFd, name: &OsStr, stat: &FileStat) -> Result<OwnedFd, String> {
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK;
    let fd = openat(dir, name, flags, Mode::empty()).map_err(|e| format!("cannot open it: {}", e.desc()))?;
    match fstat(&fd) {
        Ok(now) if FileId::of(&now) == FileId::of(stat) => {}
        _ => return Err("it changed while being copied".into()),
    }
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
        .map_err(|e| format!("cannot read it: {}", e.desc()))?;
    Ok(fd)
}

/// Walks the tree under `dir` as [`pack`] will, reading no file: what it
/// holds, what will be left out, and whether it fits the copy limit.
pub fn measure(roots: &HostRoots, dir: &OwnedFd, skip_git: bool) -> Result<PackSummary, HostPathError> {
    let mut walk = Walk { roots, skip_git, open_files: false, summary: PackSummary::default(), cost: 0 };
    walk.visit(dir, Path::new(""), 0, &mut |_, _| Ok(()))?;
    Ok(walk.summary)
}

/// Streams the tree under `dir` as a tar archive into `out`, stopping at the
/// copy limit (call [`measure`] first to refuse before sending anything).
/// `skip_git` leaves every `.git` out (listed as skipped below the top).
///
/// When streaming fails part way, the archive is ended with a block that is
/// not a valid header, so the agent refuses it rather than unpacking a
/// shorter tree as if it were whole.
pub fn pack(roots: &HostRoots, dir: &OwnedFd, skip_git: bool, out: impl Write) -> Result<PackSummary, HostPathError> {
    let mut builder = tar::Builder::new(out);
    let mut walk = Walk { roots, skip_git, open_files: true, summary: PackSummary::default(), cost: 0 };
    let result = walk.visit(dir, Path::new(""), 0, &mut |rel, item| append(&mut builder, rel, item));
    let mut out = builder.into_inner().map_err(|e| HostPathError(format!("cannot finish the archive: {e}")))?;
    if let Err(e) = result {
        let _ = out.write_all(&[0xff; 512]);
        return Err(e);
    }
    Ok(walk.summary)
}

fn append<W: Write>(builder: &mut tar::Builder<W>, rel: &Path, item: Item<'_>) -> Result<(), HostPathError> {
    let failed = |e: std::io::Error| HostPathError(format!("cannot send {}: {e}", rel.display()));
    let mut header = tar::Header::new_gnu();
    header.set_uid(0);
    header.set_gid(0);
    match item {
        Item::Dir => {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            header.set_size(0);
            builder.append_data(&mut header, rel, std::io::empty()).map_err(failed)
        }
        Item::File(stat, fd) => {
            let size = u64::try_from(stat.st_size).unwrap_or(0);
            header.set_entry_type(tar::EntryType::Regular);
            // Permission bits only: no set-id or sticky bits cross.
            header.set_mode(stat.st_mode & 0o777);
            header.set_mtime(u64::try_from(stat.st_mtime).unwrap_or(0));
            header.set_size(size);
            // Exactly `size` bytes, whatever the file does meanwhile: cut
            // when it grew, padded with zeros when it shrank.
            let data = std::fs::File::from(fd).take(size).chain(std::io::repeat(0)).take(size);
            builder.append_data(&mut header, rel, data).map_err(failed)
        }
        Item::Symlink(target) => {
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_mode(0o777);
            header.set_size(0);
            builder.append_link(&mut header, rel, PathBuf::from(target)).map_err(failed)
        }
    }
}

/// The descriptor's file, for size checks of single-file copies.
pub fn file_size(fd: &impl AsFd) -> u64 {
    fstat(fd).ok().and_then(|s| u64::try_from(s.st_size).ok()).unwrap_or(0)
}

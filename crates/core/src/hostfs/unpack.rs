//! A sandbox's tar stream → a new host file or tree: `copy_from_sandbox`.
//!
//! The stream is the sandbox's, so every field of it is untrusted. Names
//! are split into components and each is opened or created beneath the
//! copy's own directory descriptor with `O_NOFOLLOW`; `..`, absolute names,
//! hard links, devices, FIFOs and sockets are left out and listed; set-id
//! and sticky bits are dropped; runs of zeros become holes, so sparse files
//! stay sparse. Symlinks are made last, and each is kept only when the
//! kernel resolves it, through whatever chain, to something beneath the
//! copy (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`); the
//! check is repeated until no link is removed, since removing one can
//! change where another leads.

use std::ffi::OsStr;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{Mode, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};

use super::ENTRY_COST;
use crate::error::CoreError;

/// Where a copy goes.
#[derive(Debug)]
pub enum Sink {
    /// A new directory, open: the archive's entries go beneath it.
    Dir(OwnedFd),
    /// A new, empty file: the archive must hold exactly one regular file.
    File(std::fs::File),
}

/// What a copy wrote, and what it left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CopySummary {
    /// Regular files and symlinks written.
    pub files: u64,
    /// Bytes of file data written.
    pub bytes: u64,
    /// `path: why` for every entry left out.
    pub skipped: Vec<String>,
}

/// A name split into its components, each a plain name.
type Parts = Vec<Vec<u8>>;

/// Writes the archive `input` into `sink`, stopping with an error before the
/// data and entries pass `limit` bytes (each entry counts [`ENTRY_COST`]
/// beyond its data).
pub fn unpack(input: impl Read, sink: Sink, limit: u64) -> Result<CopySummary, CoreError> {
    let mut archive = tar::Archive::new(input);
    let broken = |e: std::io::Error| CoreError::HostPath(format!("the sandbox sent a broken archive: {e}"));
    let mut summary = CopySummary::default();
    let mut cost = 0u64;
    let mut links: Vec<(Parts, Vec<u8>)> = Vec::new();
    let (dir, mut file) = match sink {
        Sink::Dir(dir) => (Some(dir), None),
        Sink::File(file) => (None, Some(file)),
    };
    for entry in archive.entries().map_err(broken)? {
        let mut entry = entry.map_err(broken)?;
        let name = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&name).into_owned();
        let size = entry.size();
        cost = cost.saturating_add(ENTRY_COST).saturating_add(size);
        if cost > limit {
            return Err(CoreError::HostPath(format!(
                "the copy is larger than the limit of {} MiB (MOAT_COPY_MAX_MIB; each entry counts {} KiB beyond its \
                 data), reached at {shown} ({size} bytes); copy a smaller part, or the operator may raise the limit",
                limit >> 20,
                ENTRY_COST >> 10,
            )));
        }
        let kind = entry.header().entry_type();
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        let mtime = entry.header().mtime().unwrap_or(0);
        let Some(parts) = plain_parts(&name) else {
            summary.skipped.push(format!("{shown}: a name with `..` or an absolute path"));
            continue;
        };
        let regular = kind.is_file() || kind.is_contiguous() || kind.is_gnu_sparse();
        if let Some(out) = file.as_mut() {
            // A single file: the archive's one regular file, nothing else.
            if !regular || summary.files > 0 {
                return Err(CoreError::HostPath(format!(
                    "the sandbox sent {shown} where one regular file was expected; copy a regular file, or a directory"
                )));
            }
            let written = write_sparse(&mut entry, out, size)
                .map_err(|e| CoreError::HostPath(format!("cannot write the copy of {shown}: {e}")))?;
            finish_file(out.as_fd(), mode, mtime);
            summary.files += 1;
            summary.bytes += written;
            continue;
        }
        let Some(dir) = dir.as_ref() else { continue };
        let Some((last, parents)) = parts.split_last() else { continue };
        if regular {
            let parent = match parent_dir(dir, parents) {
                Ok(parent) => parent,
                Err(why) => {
                    summary.skipped.push(format!("{shown}: {why}"));
                    continue;
                }
            };
            let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let mut out = match openat(&parent, OsStr::from_bytes(last), flags, Mode::from_bits_truncate(0o600)) {
                Ok(fd) => std::fs::File::from(fd),
                Err(Errno::EEXIST) => {
                    summary.skipped.push(format!("{shown}: a second entry of the same name"));
                    continue;
                }
                Err(e) => return Err(CoreError::HostPath(format!("cannot create the copy of {shown}: {}", e.desc()))),
            };
            let written = write_sparse(&mut entry, &mut out, size)
                .map_err(|e| CoreError::HostPath(format!("cannot write the copy of {shown}: {e}")))?;
            finish_file(out.as_fd(), mode, mtime);
            summary.files += 1;
            summary.bytes += written;
        } else if kind.is_dir() {
            if let Err(why) = parent_dir(dir, &parts) {
                summary.skipped.push(format!("{shown}: {why}"));
            }
        } else if kind.is_symlink() {
            match entry.link_name_bytes() {
                Some(target) if !target.is_empty() => links.push((parts, target.into_owned())),
                _ => summary.skipped.push(format!("{shown}: a symlink without a target")),
            }
        } else if kind.is_hard_link() {
            summary.skipped.push(format!("{shown}: a hard link (not copied; copy the file it links to)"));
        } else if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() {
            // Metadata for other entries, which the tar crate applies itself.
        } else {
            summary.skipped.push(format!("{shown}: not a regular file, directory or symlink"));
        }
    }
    // The agent may still be sending the archive's padding: read it (a
    // little, not forever), so a copy that is whole is not failed by a write
    // into a closed pipe.
    let _ = std::io::copy(&mut archive.into_inner().take(1 << 20), &mut std::io::sink());
    if let Some(dir) = dir.as_ref() {
        make_links(dir, links, &mut summary);
    } else if summary.files == 0 {
        return Err(CoreError::HostPath("the sandbox sent no file; copy a regular file, or a directory".into()));
    }
    Ok(summary)
}

/// The components of an archive name, when each is a plain name (`.` and
/// empty ones dropped); `None` for `..` or an absolute name.
fn plain_parts(name: &[u8]) -> Option<Parts> {
    if name.starts_with(b"/") {
        return None;
    }
    let mut parts = Vec::new();
    for part in name.split(|&b| b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return None,
            plain => parts.push(plain.to_vec()),
        }
    }
    Some(parts)
}

/// Opens the directory `parts` beneath `root`, making what is missing; a
/// component that exists but is not a directory (a symlink included) stops it.
fn parent_dir(root: &OwnedFd, parts: &[Vec<u8>]) -> Result<OwnedFd, String> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = openat(root, ".", flags, Mode::empty()).map_err(|e| e.desc().to_owned())?;
    for part in parts {
        let name = OsStr::from_bytes(part);
        dir = match openat(&dir, name, flags, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::ENOENT) => {
                mkdirat(&dir, name, Mode::from_bits_truncate(0o755)).map_err(|e| e.desc().to_owned())?;
                openat(&dir, name, flags, Mode::empty()).map_err(|e| e.desc().to_owned())?
            }
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                return Err(format!("{} is not a directory in the copy", String::from_utf8_lossy(part)));
            }
            Err(e) => return Err(e.desc().to_owned()),
        };
    }
    Ok(dir)
}

/// Copies exactly `size` bytes of `data` into `out`, seeking over blocks of
/// zeros instead of writing them. Returns the bytes taken.
fn write_sparse(data: &mut impl Read, out: &mut std::fs::File, size: u64) -> std::io::Result<u64> {
    const BLOCK: usize = 64 << 10;
    let mut buf = vec![0u8; BLOCK];
    let mut total = 0u64;
    let mut data = data.take(size);
    loop {
        let n = data.read(&mut buf)?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        if chunk.iter().all(|&b| b == 0) {
            out.seek(SeekFrom::Current(i64::try_from(n).unwrap_or(i64::MAX)))?;
        } else {
            out.write_all(chunk)?;
        }
        total += n as u64;
    }
    // A trailing hole: the length, not written zeros.
    out.set_len(total)?;
    Ok(total)
}

/// Permission bits (never set-id or sticky; always readable and writable
/// by the owner) and modification time.
fn finish_file(fd: std::os::fd::BorrowedFd<'_>, mode: u32, mtime: u64) {
    let _ = nix::sys::stat::fchmod(fd, Mode::from_bits_truncate((mode | 0o600) & 0o777));
    let mtime = nix::sys::time::TimeSpec::new(i64::try_from(mtime).unwrap_or(0), 0);
    let _ = nix::sys::stat::futimens(fd, &nix::sys::time::TimeSpec::UTIME_OMIT, &mtime);
}

/// Makes the archive's symlinks, then keeps only those the kernel resolves
/// beneath `root`.
fn make_links(root: &OwnedFd, links: Vec<(Parts, Vec<u8>)>, summary: &mut CopySummary) {
    let mut made: Vec<(Parts, String, Vec<u8>)> = Vec::new();
    for (parts, target) in links {
        let shown = String::from_utf8_lossy(&parts.join(&b'/')).into_owned();
        let Some((last, parents)) = parts.split_last() else { continue };
        let parent = match parent_dir(root, parents) {
            Ok(parent) => parent,
            Err(why) => {
                summary.skipped.push(format!("{shown}: {why}"));
                continue;
            }
        };
        match nix::unistd::symlinkat(OsStr::from_bytes(&target), &parent, OsStr::from_bytes(last)) {
            Ok(()) => made.push((parts, shown, target)),
            Err(Errno::EEXIST) => summary.skipped.push(format!("{shown}: a second entry of the same name")),
            Err(e) => summary.skipped.push(format!("{shown}: {}", e.desc())),
        }
    }
    loop {
        let mut removed = false;
        made.retain(|(parts, shown, target)| {
            if resolves_beneath(root, parts) {
                return true;
            }
            if let Some((last, parents)) = parts.split_last()
                && let Ok(parent) = parent_dir(root, parents)
            {
                let _ = unlinkat(&parent, OsStr::from_bytes(last), UnlinkatFlags::NoRemoveDir);
            }
            summary.skipped.push(format!(
                "{shown}: a symlink to {} that does not lead to something inside the copy",
                String::from_utf8_lossy(target)
            ));
            removed = true;
            false
        });
        if !removed {
            break;
        }
    }
    summary.files += made.len() as u64;
}

/// Whether the kernel resolves `parts`, following every link, to something
/// that exists beneath `root`.
fn resolves_beneath(root: &OwnedFd, parts: &[Vec<u8>]) -> bool {
    let name = parts.join(&b'/');
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    openat2(root, OsStr::from_bytes(&name), how).is_ok()
}

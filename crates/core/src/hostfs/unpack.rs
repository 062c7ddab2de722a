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

use super::{ENTRY_COST, MAX_DEPTH};
use crate::error::HostPathError;

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

/// Metadata the tar crate may read for one entry beyond its data: its
/// headers, a GNU long name or link, PAX records. Names are at most 4 KiB
/// on Linux; this leaves room and bounds what a hostile archive makes the
/// host buffer.
const METADATA_ALLOWANCE: u64 = 64 << 10;

/// Symlinks one copy may make: each is checked by a path lookup, which a
/// hostile link can make slow.
const MAX_LINKS: usize = 4096;

/// Entries listed as left out, at most; the rest are counted.
const MAX_LISTED: usize = 1000;

/// Names in messages are cut to this many characters.
const MAX_SHOWN: usize = 256;

/// The archive's reader, allowed to hand out only what the entries seen so
/// far account for (their data, and [`METADATA_ALLOWANCE`] each).
struct Budget<R> {
    inner: R,
    allowance: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: Read> Read for Budget<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.allowance.get();
        if left == 0 {
            return Err(std::io::Error::other(format!(
                "more header data for one entry than moat reads ({} KiB)",
                METADATA_ALLOWANCE >> 10
            )));
        }
        let take = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..take])?;
        self.allowance.set(left - n as u64);
        Ok(n)
    }
}

/// What is left out, listed up to [`MAX_LISTED`].
fn skip(summary: &mut CopySummary, dropped: &mut u64, entry: String) {
    if summary.skipped.len() < MAX_LISTED {
        summary.skipped.push(entry);
    } else {
        *dropped += 1;
    }
}

fn shown(name: &[u8]) -> String {
    let text = String::from_utf8_lossy(name);
    if text.chars().count() <= MAX_SHOWN {
        return text.into_owned();
    }
    let cut: String = text.chars().take(MAX_SHOWN).collect();
    format!("{cut}…")
}

/// What bounds one copy, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    /// The host file system's free space bounds it, below the setting.
    pub by_disk: bool,
}

impl From<u64> for Limit {
    /// The operator's `MOAT_COPY_MAX_MIB`.
    fn from(bytes: u64) -> Self {
        Self { bytes, by_disk: false }
    }
}

fn too_large(limit: Limit, shown: &str, size: u64) -> HostPathError {
    if limit.by_disk {
        return HostPathError(format!(
            "the copy would leave the host's file system with less free space than moat keeps free ({}); it was \
             stopped at {shown} ({size} bytes) after {} MiB and nothing of it was kept; free space on the host, or \
             copy a smaller part",
            super::RESERVE_RULE,
            limit.bytes >> 20,
        ));
    }
    HostPathError(format!(
        "the copy is larger than the limit of {} MiB (MOAT_COPY_MAX_MIB; each entry and directory counts {} KiB \
         beyond its data), reached at {shown} ({size} bytes); copy a smaller part, or the operator may raise the limit",
        limit.bytes >> 20,
        ENTRY_COST >> 10,
    ))
}

/// Writes the archive `input` into `sink`, stopping with an error before the
/// data and entries pass `limit` bytes (each entry, and each directory its
/// name makes, counts [`ENTRY_COST`] beyond its data and name).
pub fn unpack(input: impl Read, sink: Sink, limit: impl Into<Limit>) -> Result<CopySummary, HostPathError> {
    unpack_within(input, sink, limit, None)
}

/// [`unpack`], holding the host file system's room through `window` (see
/// [`Destination::limit`](super::Destination::limit)) a window at a time:
/// before an entry would pass what the window holds, the window is renewed
/// from the room left beside every other share; when none is left, the
/// copy stops as one the disk bounds.
pub fn unpack_within(
    input: impl Read,
    sink: Sink,
    limit: impl Into<Limit>,
    window: Option<&super::Promise>,
) -> Result<CopySummary, HostPathError> {
    let limit = limit.into();
    // Where the current window ends, in `cost`.
    let mut held = window.map_or(u64::MAX, super::Promise::held);
    let allowance = std::rc::Rc::new(std::cell::Cell::new(METADATA_ALLOWANCE));
    let mut archive = tar::Archive::new(Budget { inner: input, allowance: allowance.clone() });
    let broken = |e: std::io::Error| HostPathError(format!("the sandbox sent a broken archive: {e}"));
    let mut summary = CopySummary::default();
    let mut dropped = 0u64;
    let mut cost = 0u64;
    let mut links: Vec<(Parts, Vec<u8>)> = Vec::new();
    let (dir, mut file) = match sink {
        Sink::Dir(dir) => (Some(dir), None),
        Sink::File(file) => (None, Some(file)),
    };
    for entry in archive.entries().map_err(broken)? {
        let mut entry = entry.map_err(broken)?;
        let size = entry.size();
        // This entry's data, and the next entry's headers.
        allowance.set(
            allowance.get().saturating_add(size.div_ceil(512).saturating_mul(512)).saturating_add(METADATA_ALLOWANCE),
        );
        let name = entry.path_bytes().into_owned();
        let link = entry.link_name_bytes().map(std::borrow::Cow::into_owned);
        let shown = shown(&name);
        let named = (name.len() + link.as_ref().map_or(0, Vec::len)) as u64;
        let before = cost;
        cost = cost.saturating_add(ENTRY_COST).saturating_add(size).saturating_add(named);
        if cost > limit.bytes {
            return Err(too_large(limit, &shown, size));
        }
        if let Some(window) = window
            && cost > held
        {
            // What was held is written (or counted): hold the next window,
            // at least this entry's worth.
            let fd = match (&dir, &file) {
                (Some(dir), _) => dir.as_fd(),
                (None, Some(file)) => file.as_fd(),
                (None, None) => return Err(HostPathError("the copy has nowhere to go".into())),
            };
            let needed = cost - before;
            let granted = window.renew(&fd, needed.max(super::COPY_WINDOW));
            if granted < needed {
                return Err(too_large(Limit { bytes: before, by_disk: true }, &shown, size));
            }
            held = before.saturating_add(granted);
        }
        let kind = entry.header().entry_type();
        // Permission bits, never set-id or sticky, never writable by others;
        // always readable and writable by the owner.
        let mode = (entry.header().mode().unwrap_or(0o644) & 0o755) | 0o600;
        let mtime = entry.header().mtime().unwrap_or(0);
        let regular = kind.is_file() || kind.is_contiguous() || kind.is_gnu_sparse();
        if let Some(out) = file.as_mut() {
            // A single file: the archive's one regular file, nothing else.
            if !regular || summary.files > 0 {
                return Err(HostPathError(format!(
                    "the sandbox sent {shown} where one regular file was expected; copy a regular file, or a directory"
                )));
            }
            let written = write_sparse(&mut entry, out, size)
                .map_err(|e| HostPathError(format!("cannot write the copy of {shown}: {e}")))?;
            finish_file(out.as_fd(), mode, mtime);
            summary.files += 1;
            summary.bytes += written;
            continue;
        }
        let Some(dir) = dir.as_ref() else { continue };
        if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() {
            // Metadata for other entries, which the tar crate applies itself.
            continue;
        }
        let Some(parts) = plain_parts(&name) else {
            skip(&mut summary, &mut dropped, format!("{shown}: a name with `..` or an absolute path"));
            continue;
        };
        if let Some((at, what)) = super::acted_on_path(&parts) {
            let name = String::from_utf8_lossy(&parts[at]);
            skip(&mut summary, &mut dropped, format!("{shown}: moat never writes {name} from a sandbox ({what})"));
            continue;
        }
        if parts.len() > MAX_DEPTH {
            skip(&mut summary, &mut dropped, format!("{shown}: deeper than {MAX_DEPTH} levels"));
            continue;
        }
        let Some((last, parents)) = parts.split_last() else {
            // `.` itself: the copy's own directory, made already.
            if !kind.is_dir() {
                skip(&mut summary, &mut dropped, format!("{shown}: an empty name"));
            }
            continue;
        };
        if regular {
            let mut made = 0u64;
            let parent = parent_dir(dir, parents, &mut made);
            cost = cost.saturating_add(made * ENTRY_COST);
            if cost > limit.bytes {
                return Err(too_large(limit, &shown, size));
            }
            let parent = match parent {
                Ok(parent) => parent,
                Err(why) => {
                    skip(&mut summary, &mut dropped, format!("{shown}: {why}"));
                    continue;
                }
            };
            let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let mut out = match openat(&parent, OsStr::from_bytes(last), flags, Mode::from_bits_truncate(0o600)) {
                Ok(fd) => std::fs::File::from(fd),
                Err(Errno::EEXIST) => {
                    skip(&mut summary, &mut dropped, format!("{shown}: a second entry of the same name"));
                    continue;
                }
                Err(e) => return Err(HostPathError(format!("cannot create the copy of {shown}: {}", e.desc()))),
            };
            let written = write_sparse(&mut entry, &mut out, size)
                .map_err(|e| HostPathError(format!("cannot write the copy of {shown}: {e}")))?;
            finish_file(out.as_fd(), mode, mtime);
            summary.files += 1;
            summary.bytes += written;
        } else if kind.is_dir() {
            let mut made = 0u64;
            let made_dir = parent_dir(dir, &parts, &mut made);
            cost = cost.saturating_add(made * ENTRY_COST);
            if cost > limit.bytes {
                return Err(too_large(limit, &shown, size));
            }
            if let Err(why) = made_dir {
                skip(&mut summary, &mut dropped, format!("{shown}: {why}"));
            }
        } else if kind.is_symlink() {
            match link {
                _ if links.len() >= MAX_LINKS => {
                    skip(&mut summary, &mut dropped, format!("{shown}: more than {MAX_LINKS} symlinks in one copy"));
                }
                Some(target) if !target.is_empty() => links.push((parts, target)),
                _ => skip(&mut summary, &mut dropped, format!("{shown}: a symlink without a target")),
            }
        } else if kind.is_hard_link() {
            skip(&mut summary, &mut dropped, format!("{shown}: a hard link (not copied; copy the file it links to)"));
        } else {
            skip(&mut summary, &mut dropped, format!("{shown}: not a regular file, directory or symlink"));
        }
    }
    // The agent may still be sending the archive's padding: read it (a
    // little, not forever), so a copy that is whole is not failed by a write
    // into a closed pipe.
    allowance.set(allowance.get().saturating_add(1 << 20));
    let _ = std::io::copy(&mut archive.into_inner().take(1 << 20), &mut std::io::sink());
    if let Some(dir) = dir.as_ref() {
        make_links(dir, links, &mut summary, &mut dropped);
    } else if summary.files == 0 {
        return Err(HostPathError("the sandbox sent no file; copy a regular file, or a directory".into()));
    }
    if dropped > 0 {
        summary.skipped.push(format!("… and {dropped} more entries left out"));
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

/// Opens the directory `parts` beneath `root`, making what is missing
/// (counted in `made`); a component that exists but is not a directory (a
/// symlink included) stops it.
fn parent_dir(root: &OwnedFd, parts: &[Vec<u8>], made: &mut u64) -> Result<OwnedFd, String> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = openat(root, ".", flags, Mode::empty()).map_err(|e| e.desc().to_owned())?;
    for part in parts {
        let name = OsStr::from_bytes(part);
        dir = match openat(&dir, name, flags, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::ENOENT) => {
                mkdirat(&dir, name, Mode::from_bits_truncate(0o755)).map_err(|e| e.desc().to_owned())?;
                *made += 1;
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

/// Permission bits (already cleaned) and modification time.
fn finish_file(fd: std::os::fd::BorrowedFd<'_>, mode: u32, mtime: u64) {
    let _ = nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(mode));
    let mtime = nix::sys::time::TimeSpec::new(i64::try_from(mtime).unwrap_or(0), 0);
    let _ = nix::sys::stat::futimens(fd, &nix::sys::time::TimeSpec::UTIME_OMIT, &mtime);
}

/// Makes the archive's symlinks, then keeps only those the kernel resolves
/// beneath `root`.
fn make_links(root: &OwnedFd, links: Vec<(Parts, Vec<u8>)>, summary: &mut CopySummary, dropped: &mut u64) {
    let mut made: Vec<(Parts, String, Vec<u8>)> = Vec::new();
    for (parts, target) in links {
        let shown = shown(&parts.join(&b'/'));
        let Some((last, parents)) = parts.split_last() else {
            skip(summary, dropped, format!("{shown}: an empty name"));
            continue;
        };
        // Directories were made (and charged) for the entries; a link's own
        // parents must exist already.
        let parent = match existing_dir(root, parents) {
            Ok(parent) => parent,
            Err(why) => {
                skip(summary, dropped, format!("{shown}: {why}"));
                continue;
            }
        };
        match nix::unistd::symlinkat(OsStr::from_bytes(&target), &parent, OsStr::from_bytes(last)) {
            Ok(()) => made.push((parts, shown, target)),
            Err(Errno::EEXIST) => skip(summary, dropped, format!("{shown}: a second entry of the same name")),
            Err(e) => skip(summary, dropped, format!("{shown}: {}", e.desc())),
        }
    }
    loop {
        let mut removed = false;
        made.retain(|(parts, shown, target)| {
            if resolves_beneath(root, parts) {
                return true;
            }
            if let Some((last, parents)) = parts.split_last()
                && let Ok(parent) = existing_dir(root, parents)
            {
                let _ = unlinkat(&parent, OsStr::from_bytes(last), UnlinkatFlags::NoRemoveDir);
            }
            let why = format!(
                "{shown}: a symlink to {} that does not lead to something inside the copy",
                shown_target(target)
            );
            skip(summary, dropped, why);
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
    super::retry_again(|| openat2(root, OsStr::from_bytes(&name), how)).is_ok()
}

fn shown_target(target: &[u8]) -> String {
    shown(target)
}

/// Opens the existing directory `parts` beneath `root`, never following a
/// symlink.
fn existing_dir(root: &OwnedFd, parts: &[Vec<u8>]) -> Result<OwnedFd, String> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = openat(root, ".", flags, Mode::empty()).map_err(|e| e.desc().to_owned())?;
    for part in parts {
        dir = openat(&dir, OsStr::from_bytes(part), flags, Mode::empty())
            .map_err(|_| format!("{} is not a directory in the copy", String::from_utf8_lossy(part)))?;
    }
    Ok(dir)
}

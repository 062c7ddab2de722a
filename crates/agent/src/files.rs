//! File operations: read, atomic write, stat, list, mkdir -p, move, remove.
//!
//! The agent runs inside the sandbox, so every path resolves against the
//! sandbox's own root. Paths must be absolute; contents are bytes, never
//! decoded.

use std::fs::Metadata;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::BytesMut;
use moat_proto::{
    AgentMsg, ClientMsg, Connection, DATA_CHUNK, ErrorKind, FileInfo, FileKind, Frame, ReadFileRequest, Reply,
    StreamId, WireError, WriteFileRequest,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt};

use crate::error::{bad_path, check_path, invalid, io_error};
use crate::users;

/// The most one `read_file` may return; larger reads must give a range.
pub const MAX_READ: u64 = 1 << 30;

/// The most entries one listing returns.
pub const MAX_ENTRIES: usize = moat_proto::MAX_LIST_ENTRIES;

/// Sends (a range of) a file: a `FileData` reply, the bytes, then `End`.
pub async fn read<S>(req: ReadFileRequest, conn: &mut Connection<S>) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let path = check_path(&req.path)?;
    // Without waiting: a FIFO with no writer, or a file another process
    // holds a lease on, would keep open(2) (and the call, and the client's
    // slot) waiting for as long as the sandbox likes. O_NONBLOCK changes
    // nothing for a regular file's reads.
    let mut file = tokio::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .await
        .map_err(|e| io_error(&req.path, &e))?;
    let meta = file.metadata().await.map_err(|e| io_error(&req.path, &e))?;
    if meta.is_dir() {
        return Err(io_error(&req.path, &io::Error::from_raw_os_error(libc::EISDIR)));
    }
    if !meta.is_file() {
        return Err(WireError::new(
            ErrorKind::InvalidRequest,
            format!(
                "{} is a {}, not a regular file: only regular files are read; run a command to read from it \
                 (`run_command` with `timeout 5 cat {}`)",
                req.path,
                kind_name(&meta),
                req.path
            ),
        ));
    }
    let size = meta.len();
    let available = size.saturating_sub(req.offset);
    let length = req.length.map_or(available, |l| l.min(available));
    if length > MAX_READ {
        return Err(WireError::new(
            ErrorKind::TooLarge,
            format!(
                "{}: {length} bytes is more than one read may return ({MAX_READ}); read it in ranges with offset and length",
                req.path
            ),
        ));
    }
    if req.offset > 0 {
        file.seek(io::SeekFrom::Start(req.offset)).await.map_err(|e| io_error(&req.path, &e))?;
    }
    conn.send(&AgentMsg::Reply { reply: Reply::FileData { size, length } }).await.map_err(gone)?;
    let mut left = length;
    let mut buf = BytesMut::with_capacity(DATA_CHUNK);
    while left > 0 {
        buf.reserve(DATA_CHUNK);
        let want = left.min(DATA_CHUNK as u64);
        let n = (&mut file).take(want).read_buf(&mut buf).await.map_err(|e| io_error(&req.path, &e))?;
        if n == 0 {
            // The file shrank while we read it: end early rather than pad.
            break;
        }
        left -= n as u64;
        conn.send_data(StreamId::Output, buf.split().freeze()).await.map_err(gone)?;
    }
    conn.send(&AgentMsg::End).await.map_err(gone)
}

/// What a file that is not a regular one is, in words.
fn kind_name(meta: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_block_device() {
        "block device"
    } else {
        "special file"
    }
}

/// The error for a client that went away; never seen by that client.
pub(crate) fn gone(e: moat_proto::FrameError) -> WireError {
    WireError::new(ErrorKind::Io, format!("client connection lost: {e}"))
}

/// Receives a file's new contents and atomically replaces it: the bytes go
/// to a temporary file beside it, renamed over the target only when all
/// arrived. A failed or abandoned write leaves the old file as it was.
pub async fn write<S>(req: WriteFileRequest, conn: &mut Connection<S>) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let path = check_path(&req.path)?;
    let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(bad_path(&req.path, "names no file; give the path of a file, such as /home/user/notes.txt"));
    };
    if let Some(mode) = req.mode
        && mode > 0o7777
    {
        return Err(invalid(format!("mode {mode:#o} is not a permission mode; allowed are 0 to 0o7777")));
    }
    let owner = req.owner.as_deref().map(users::lookup).transpose()?;
    if req.create_parents {
        make_dirs(parent, owner.as_ref().map(|u| (u.uid, u.gid))).map_err(|e| io_error(&req.path, &e))?;
    } else {
        match std::fs::metadata(parent) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(io_error(&req.path, &io::Error::from_raw_os_error(libc::ENOTDIR))),
            Err(e) => {
                let mut error = io_error(&parent.to_string_lossy(), &e);
                error.message.push_str("; pass create_parents to create missing directories");
                return Err(error);
            }
        }
    }
    let existing = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Err(io_error(&req.path, &io::Error::from_raw_os_error(libc::EISDIR))),
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error(&req.path, &e)),
    };
    let temp = tempfile::Builder::new()
        .prefix(".moat-write-")
        .tempfile_in(parent)
        .map_err(|e| io_error(&parent.to_string_lossy(), &e))?;
    let (file, temp_path) = temp.into_parts();
    let mut file = tokio::fs::File::from_std(file);
    let mut written = 0u64;
    loop {
        match conn.recv().await {
            Some(Ok(Frame::Data(StreamId::Input, bytes))) => {
                file.write_all(&bytes).await.map_err(|e| io_error(&req.path, &e))?;
                written += bytes.len() as u64;
            }
            Some(Ok(Frame::Message(body))) => match moat_proto::conn::decode_message::<ClientMsg>(&body) {
                Ok(ClientMsg::End) => break,
                _ => return Err(invalid("expected file data or end during write_file")),
            },
            Some(Ok(Frame::Data(..))) => return Err(invalid("file data must arrive on the input stream")),
            Some(Err(e)) => return Err(gone(e)),
            None => return Err(WireError::new(ErrorKind::Io, "client went away before the end of the file")),
        }
    }
    file.flush().await.map_err(|e| io_error(&req.path, &e))?;
    let mode = req.mode.or(existing.as_ref().map(|m| m.mode() & 0o7777)).unwrap_or(0o644);
    let ids = owner.as_ref().map(|u| (u.uid, u.gid)).or(existing.as_ref().map(|m| (m.uid(), m.gid())));
    let std_file = file.into_std().await;
    std_file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| io_error(&req.path, &e))?;
    if let Some((uid, gid)) = ids {
        std::os::unix::fs::fchown(&std_file, Some(uid), Some(gid)).map_err(|e| io_error(&req.path, &e))?;
    }
    drop(std_file);
    temp_path.persist(path).map_err(|e| io_error(&req.path, &e.error))?;
    conn.send(&AgentMsg::Reply { reply: Reply::Written { bytes: written } }).await.map_err(gone)
}

pub fn stat(path: &str) -> Result<Reply, WireError> {
    let p = check_path(path)?;
    let meta = std::fs::symlink_metadata(p).map_err(|e| io_error(path, &e))?;
    Ok(Reply::Stat { info: file_info(p, &meta) })
}

/// Describes one file system entry (not following a final symlink).
pub fn file_info(path: &Path, meta: &Metadata) -> FileInfo {
    let file_type = meta.file_type();
    let kind = if file_type.is_symlink() {
        FileKind::Symlink
    } else if file_type.is_dir() {
        FileKind::Dir
    } else if file_type.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let name_os = path.file_name().unwrap_or(path.as_os_str());
    let lossy_name = path.to_str().is_none();
    FileInfo {
        name: name_os.to_string_lossy().into_owned(),
        path: path.to_string_lossy().into_owned(),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime: meta.mtime(),
        link_target: if kind == FileKind::Symlink {
            std::fs::read_link(path).ok().map(|t| t.to_string_lossy().into_owned())
        } else {
            None
        },
        lossy_name,
    }
}

/// Lists a directory `depth` levels deep, sorted by path, without following
/// symlinks, cut at [`MAX_ENTRIES`].
pub fn list(path: &str, depth: u8) -> Result<Reply, WireError> {
    if !(1..=5).contains(&depth) {
        return Err(invalid(format!("depth {depth} is out of range; allowed are 1 to 5")));
    }
    let root = check_path(path)?;
    let meta = std::fs::metadata(root).map_err(|e| io_error(path, &e))?;
    if !meta.is_dir() {
        return Err(io_error(path, &io::Error::from_raw_os_error(libc::ENOTDIR)));
    }
    let mut entries = Vec::new();
    let mut truncated = false;
    walk(root, depth, &mut entries, &mut truncated).map_err(|e| io_error(path, &e))?;
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Reply::Entries { entries, truncated })
}

fn walk(dir: &Path, depth: u8, out: &mut Vec<FileInfo>, truncated: &mut bool) -> io::Result<()> {
    let mut children: Vec<_> = std::fs::read_dir(dir)?.filter_map(Result::ok).collect();
    children.sort_by_key(std::fs::DirEntry::file_name);
    for child in children {
        if out.len() >= MAX_ENTRIES {
            *truncated = true;
            return Ok(());
        }
        let path = child.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        let is_dir = meta.is_dir();
        out.push(file_info(&path, &meta));
        if is_dir && depth > 1 {
            // An unreadable subdirectory is listed but not entered.
            let _ = walk(&path, depth - 1, out, truncated);
        }
    }
    Ok(())
}

/// `mkdir -p`, giving each directory it creates to `owner`.
pub fn make_dir(path: &str, owner: Option<&str>) -> Result<Reply, WireError> {
    let p = check_path(path)?;
    let ids = owner.map(users::lookup).transpose()?.map(|u| (u.uid, u.gid));
    make_dirs(p, ids).map_err(|e| io_error(path, &e))?;
    Ok(Reply::Done)
}

pub(crate) fn make_dirs(path: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    let mut missing: Vec<PathBuf> = Vec::new();
    let mut cursor = Some(path);
    while let Some(dir) = cursor {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => return Err(io::Error::from_raw_os_error(libc::ENOTDIR)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(dir.to_path_buf()),
            Err(e) => return Err(e),
        }
        cursor = dir.parent();
    }
    for dir in missing.iter().rev() {
        match std::fs::create_dir(dir) {
            Ok(()) => {
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Renames `from` to `to`; without `overwrite` an existing `to` is an error.
/// Files move across file systems by copy and delete.
pub fn move_path(from: &str, to: &str, overwrite: bool) -> Result<Reply, WireError> {
    let src = check_path(from)?;
    let dst = check_path(to)?;
    std::fs::symlink_metadata(src).map_err(|e| io_error(from, &e))?;
    let renamed = if overwrite {
        std::fs::rename(src, dst)
    } else {
        nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            src,
            nix::fcntl::AT_FDCWD,
            dst,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(io::Error::from)
    };
    match renamed {
        Ok(()) => Ok(Reply::Done),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) && src.is_file() => {
            if !overwrite && dst.exists() {
                return Err(io_error(to, &io::Error::from_raw_os_error(libc::EEXIST)));
            }
            std::fs::copy(src, dst).map_err(|e| io_error(to, &e))?;
            std::fs::remove_file(src).map_err(|e| io_error(from, &e))?;
            Ok(Reply::Done)
        }
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            Err(WireError::new(ErrorKind::AlreadyExists, format!("{to}: already exists; pass overwrite to replace it")))
        }
        Err(e) => Err(io_error(&format!("moving {from} to {to}"), &e)),
    }
}

/// Removes a file, a symlink, an empty directory, or (with `recursive`) a tree.
pub fn remove(path: &str, recursive: bool) -> Result<Reply, WireError> {
    let p = check_path(path)?;
    if p.parent().is_none() {
        return Err(bad_path(path, "refusing to remove the root directory"));
    }
    let meta = std::fs::symlink_metadata(p).map_err(|e| io_error(path, &e))?;
    let removed = match (meta.is_dir(), recursive) {
        (false, _) => std::fs::remove_file(p),
        (true, true) => std::fs::remove_dir_all(p),
        (true, false) => std::fs::remove_dir(p),
    };
    removed.map_err(|e| io_error(path, &e))?;
    Ok(Reply::Done)
}

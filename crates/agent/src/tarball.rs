//! Tar streams of whole trees, out of and into the sandbox.
//!
//! The `tar` crate is synchronous, so archiving and unpacking run on a
//! blocking thread joined to the connection by bounded channels: a slow
//! client slows the archiver, memory stays at a few chunks.

use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use bytes::Bytes;
use moat_proto::{AgentMsg, ClientMsg, Connection, DATA_CHUNK, Frame, Reply, StreamId, WireError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::error::{check_path, invalid, io_error};
use crate::files::gone;
use crate::users;

/// Chunks in flight between the archiver thread and the connection.
const CHANNEL_DEPTH: usize = 8;

/// Streams a tar archive of `path` (a directory's contents, or one file).
/// Symlinks are archived as links, never followed; modes and times are kept.
pub async fn tar_out<S>(path: &str, conn: &mut Connection<S>) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let root = check_path(path)?.to_path_buf();
    let meta = std::fs::symlink_metadata(&root).map_err(|e| io_error(path, &e))?;
    conn.send(&AgentMsg::Reply { reply: Reply::TarStream }).await.map_err(gone)?;
    let (tx, mut rx) = mpsc::channel::<Bytes>(CHANNEL_DEPTH);
    let display = path.to_owned();
    let archiver = tokio::task::spawn_blocking(move || -> io::Result<()> {
        let writer = io::BufWriter::with_capacity(DATA_CHUNK, ChannelWriter { tx });
        let mut builder = tar::Builder::new(writer);
        builder.follow_symlinks(false);
        if meta.is_dir() {
            append_tree(&mut builder, &root)?;
        } else {
            let name = root.file_name().map_or_else(|| "file".into(), |n| n.to_os_string());
            append_entry(&mut builder, &root, Path::new(&name))?;
        }
        builder.into_inner()?.flush()
    });
    while let Some(chunk) = rx.recv().await {
        conn.send_data(StreamId::Output, chunk).await.map_err(gone)?;
    }
    match archiver.await {
        Ok(Ok(())) => conn.send(&AgentMsg::End).await.map_err(gone),
        Ok(Err(e)) => Err(io_error(&format!("archiving {display}"), &e)),
        Err(e) => Err(WireError::new(moat_proto::ErrorKind::Internal, format!("tar archiver failed: {e}"))),
    }
}

/// The deepest a tree is archived: the host cuts copies at 128 levels
/// anyway, and a walk deeper only spends the sandbox's agent.
const MAX_TREE_DEPTH: usize = 256;

/// Appends the tree at `root` as `.` and `./…`, each entry as
/// [`append_entry`] does, depth first, iteratively.
fn append_tree<W: Write>(builder: &mut tar::Builder<W>, root: &Path) -> io::Result<()> {
    let mut stack = vec![(root.to_path_buf(), std::path::PathBuf::from("."), 0usize)];
    while let Some((src, name, depth)) = stack.pop() {
        if append_entry(builder, &src, &name)? && depth < MAX_TREE_DEPTH {
            for child in std::fs::read_dir(&src)? {
                let child = child?;
                stack.push((child.path(), name.join(child.file_name()), depth + 1));
            }
        }
    }
    Ok(())
}

/// Appends `src` under `name` as what it is when looked at, never
/// following a link and never waiting on an open: a regular file with its
/// content (opened `O_NONBLOCK | O_NOFOLLOW`, and archived as what the
/// descriptor is, so that a FIFO or a link put in its place meanwhile
/// neither keeps the walk waiting nor is followed); a directory, a link, a
/// FIFO or a device as its header; a socket, for which tar has no type,
/// left out. Whether it is a directory, to descend into.
fn append_entry<W: Write>(builder: &mut tar::Builder<W>, src: &Path, name: &Path) -> io::Result<bool> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::symlink_metadata(src)?;
    let kind = meta.file_type();
    if kind.is_symlink() {
        builder.append_path_with_name(src, name)?;
        return Ok(false);
    }
    if kind.is_socket() {
        return Ok(false);
    }
    let meta = if kind.is_file() {
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW).open(src) {
            Ok(mut file) => {
                let now = file.metadata()?;
                if now.is_file() {
                    builder.append_file(name, &mut file)?;
                    return Ok(false);
                }
                now
            }
            // Gone, or a link or a socket now: left out.
            Err(_) => return Ok(false),
        }
    } else {
        meta
    };
    if meta.file_type().is_socket() {
        return Ok(false);
    }
    let mut header = tar::Header::new_gnu();
    header.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
    header.set_size(0);
    builder.append_data(&mut header, name, io::empty())?;
    Ok(meta.is_dir())
}

/// Unpacks the archive the client streams into directory `path` (created if
/// missing). Entries that would land outside it (`..`, absolute names,
/// through symlinks) are refused by the `tar` crate's `unpack_in`.
pub async fn tar_in<S>(path: &str, owner: Option<&str>, conn: &mut Connection<S>) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let dest = check_path(path)?.to_path_buf();
    let ids = owner.map(users::lookup).transpose()?.map(|u| (u.uid, u.gid));
    // Directories made for the destination belong to the owner too.
    crate::files::make_dirs(&dest, ids).map_err(|e| io_error(path, &e))?;
    let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL_DEPTH);
    let display = path.to_owned();
    let unpacker = tokio::task::spawn_blocking(move || unpack(&dest, ids, ChannelReader { rx, current: Bytes::new() }));
    let mut receiving = Ok(());
    loop {
        match conn.recv().await {
            Some(Ok(Frame::Data(StreamId::Input, bytes))) => {
                if tx.send(bytes).await.is_err() {
                    // The unpacker stopped early; its error says why.
                    break;
                }
            }
            Some(Ok(Frame::Message(body))) => {
                if !matches!(moat_proto::conn::decode_message::<ClientMsg>(&body), Ok(ClientMsg::End)) {
                    receiving = Err(invalid("expected archive data or end during tar_in"));
                }
                break;
            }
            Some(Ok(Frame::Data(..))) => {
                receiving = Err(invalid("archive data must arrive on the input stream"));
                break;
            }
            Some(Err(e)) => {
                receiving = Err(gone(e));
                break;
            }
            None => {
                receiving = Err(WireError::new(moat_proto::ErrorKind::Io, "client went away mid-archive"));
                break;
            }
        }
    }
    drop(tx);
    let unpacked = unpacker.await;
    receiving?;
    match unpacked {
        Ok(Ok((entries, bytes))) => {
            conn.send(&AgentMsg::Reply { reply: Reply::Unpacked { entries, bytes } }).await.map_err(gone)
        }
        Ok(Err(e)) => Err(io_error(&format!("unpacking into {display}"), &e)),
        Err(e) => Err(WireError::new(moat_proto::ErrorKind::Internal, format!("tar unpacker failed: {e}"))),
    }
}

fn unpack(dest: &Path, owner: Option<(u32, u32)>, reader: impl Read) -> io::Result<(u64, u64)> {
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_unpack_xattrs(false);
    let (mut entries, mut bytes) = (0u64, 0u64);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let size = entry.header().size().unwrap_or(0);
        let rel = entry.path()?.into_owned();
        if !entry.unpack_in(dest)? {
            tracing::warn!(path = %rel.display(), "refused a tar entry that would land outside the destination");
            continue;
        }
        if let Some((uid, gid)) = owner {
            // Where unpack_in put it: only the normal components of the name
            // (it drops `/` prefixes and `.`), never an absolute path.
            let inside: std::path::PathBuf =
                rel.components().filter(|c| matches!(c, std::path::Component::Normal(_))).collect();
            std::os::unix::fs::lchown(dest.join(inside), Some(uid), Some(gid))?;
        }
        entries += 1;
        bytes += size;
    }
    Ok((entries, bytes))
}

/// `Write` for the archiver thread: each write becomes a chunk on the channel.
struct ChannelWriter {
    tx: mpsc::Sender<Bytes>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(DATA_CHUNK);
        self.tx
            .blocking_send(Bytes::copy_from_slice(&buf[..n]))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "client stopped reading the archive"))?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `Read` for the unpacker thread, fed by chunks from the connection.
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

//! Moving host files into and out of sandboxes: the copy tools and task
//! imports. Every host path goes through [`crate::hostfs`]; data streams
//! through a pipe between the agent's connection and a blocking thread that
//! walks or writes the host tree, so a copy holds a few buffers in memory
//! whatever its size.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use moat_proto::ProtoError;
use nix::fcntl::OFlag;
use tokio::io::AsyncReadExt;

use super::Moat;
use crate::error::{CopyError, HostPathError, SandboxError};
use crate::hostfs::{self, CopySummary, ENTRY_COST, PackSummary, Sink, Source, SourceKind};

/// A pipe: the blocking end as a file, the other as raw descriptor.
fn pipe() -> Result<(OwnedFd, OwnedFd), HostPathError> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .map_err(|e| HostPathError(format!("cannot make a pipe for the copy: {}", e.desc())))
}

fn too_large(limit: u64, shown: &Path, size: u64) -> HostPathError {
    HostPathError(format!(
        "{} is {size} bytes, more than the copy limit of {} MiB (MOAT_COPY_MAX_MIB); copy a smaller part, or the \
         operator may raise the limit",
        shown.display(),
        limit >> 20
    ))
}

/// A writer that remembers whether a write failed (the reader went away).
struct Watched<W> {
    inner: W,
    failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    moved: Arc<AtomicU64>,
}

impl<W: std::io::Write> std::io::Write for Watched<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let result = self.inner.write(buf);
        match &result {
            Ok(n) => _ = self.moved.fetch_add(*n as u64, Ordering::Relaxed),
            Err(_) => self.failed.store(true, Ordering::Relaxed),
        }
        result
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that counts what it read into `moved`.
struct Counted<R> {
    inner: R,
    moved: Arc<AtomicU64>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.moved.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The longest a tree copy may go without a byte moving through its pipe.
/// The agent is the sandbox's: one that stops reading or sending in the
/// middle of a copy must not hold the copy's thread (one of the host's
/// blocking threads, which stopping sandboxes need too) for ever.
const COPY_STALL: Duration = Duration::from_secs(120);

/// However it moves, a copy ends within this, and a second more for every
/// [`COPY_MIN_RATE`] bytes it may carry: a sandbox that trickles its side
/// (a byte a minute never stalls) is given up too.
const COPY_BASE: Duration = super::AGENT_CALL_GUARD;
const COPY_MIN_RATE: u64 = 1 << 20;

/// How long a copy of at most `bytes` may take.
fn copy_guard(bytes: u64) -> Duration {
    COPY_BASE.saturating_add(Duration::from_secs(bytes / COPY_MIN_RATE))
}

/// `work`'s output, or `None` when `moved` stood still for a whole
/// `stall`, or `guard` passed (then `work` is dropped, which closes its
/// end of the pipe).
async fn unless_stalled<F: Future>(moved: &AtomicU64, stall: Duration, guard: Duration, work: F) -> Option<F::Output> {
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + stall, stall);
    let mut last = moved.load(Ordering::Relaxed);
    let over = tokio::time::sleep(guard);
    tokio::pin!(over);
    loop {
        tokio::select! {
            out = &mut work => return Some(out),
            () = &mut over => return None,
            _ = tick.tick() => {
                let now = moved.load(Ordering::Relaxed);
                if now == last {
                    return None;
                }
                last = now;
            }
        }
    }
}

fn stalled(id: &str, way: &str, guard: Duration) -> CopyError {
    HostPathError(format!(
        "the copy {way} sandbox {id} stopped: nothing moved for {} s, or it was not done within {} s (it may \
         take {} s and a second more per MiB), so it was given up and nothing of it kept; check the sandbox \
         with run_command, then copy again",
        COPY_STALL.as_secs(),
        guard.as_secs(),
        COPY_BASE.as_secs()
    ))
    .into()
}

impl Moat {
    /// Copies a host file or tree (beneath a shared root; a tree without its
    /// top-level `.git`; symlinks as links) to `sandbox_path`, owned by
    /// `user`.
    pub async fn copy_to_sandbox(&self, id: &str, host: &Path, sandbox_path: &str) -> Result<CopySummary, CopyError> {
        let result = self.copy_in(id, host, sandbox_path).await;
        self.explained_copy(id, result).await
    }

    /// `result`, with a sandbox's error explained by [`Moat::explain`].
    async fn explained_copy<T>(&self, id: &str, result: Result<T, CopyError>) -> Result<T, CopyError> {
        match result {
            Err(CopyError::Sandbox(error)) => Err(self.explain(id, error).await.into()),
            other => other,
        }
    }

    async fn copy_in(&self, id: &str, host: &Path, sandbox_path: &str) -> Result<CopySummary, CopyError> {
        let source = self.inner.host.open_source(host)?;
        let client = self.client(id).await?;
        if source.kind == SourceKind::Dir {
            let packed = self.send_tree(id, source, sandbox_path, true).await?;
            return Ok(CopySummary { files: packed.files, bytes: packed.bytes, skipped: packed.skipped });
        }
        let size = hostfs::file_size(&source.fd);
        let limit = self.inner.host.copy_limit();
        if size.saturating_add(ENTRY_COST) > limit {
            return Err(too_large(limit, &source.shown, size).into());
        }
        let file = tokio::fs::File::from_std(std::fs::File::from(source.fd));
        let req = moat_proto::WriteFileRequest {
            path: sandbox_path.into(),
            mode: None,
            create_parents: true,
            owner: Some("user".into()),
        };
        // Bounded like any file call, and a second more per MiB: a silent
        // agent (a microVM's guest can put one in its agent's place) does
        // not hold the call for ever.
        let guard = super::AGENT_CALL_GUARD + std::time::Duration::from_secs(size >> 20);
        let written = crate::timing::within(id, guard, client.write_file(req, &mut file.take(size)))
            .await?
            .map_err(|source| SandboxError::Agent { id: id.into(), source })?;
        Ok(CopySummary { files: 1, bytes: written, skipped: Vec::new() })
    }

    /// Streams the host tree `source` into the sandbox directory `dest`,
    /// owned by `user`, after measuring it against the copy limit.
    pub(super) async fn send_tree(
        &self,
        id: &str,
        source: Source,
        dest: &str,
        skip_git: bool,
    ) -> Result<PackSummary, CopyError> {
        // A sandbox of this moat's, resumed if suspended, before the work.
        self.client(id).await?;
        let inner = self.inner.clone();
        let dir = source.fd;
        let (measured, dir) = tokio::task::spawn_blocking(move || {
            let measured = hostfs::measure(&inner.host, &dir, skip_git);
            (measured, dir)
        })
        .await
        .map_err(|e| HostPathError(format!("measuring the tree failed: {e}")))?;
        let measured = measured?;
        // Again after measuring, which may take longer than the sandbox's
        // idle time: resumed if it was suspended meanwhile.
        let client = self.client(id).await?;
        let (read, write) = pipe()?;
        let mut receiver = tokio::net::unix::pipe::Receiver::from_owned_fd(read)
            .map_err(|e| HostPathError(format!("cannot stream the copy: {e}")))?;
        let inner = self.inner.clone();
        let moved = Arc::new(AtomicU64::new(0));
        let sent = Watched { inner: std::fs::File::from(write), failed: Default::default(), moved: moved.clone() };
        let write_failed = sent.failed.clone();
        let packer = tokio::task::spawn_blocking(move || {
            hostfs::pack(&inner.host, &dir, skip_git, std::io::BufWriter::new(sent))
        });
        let guard = copy_guard(measured.bytes);
        let uploaded =
            unless_stalled(&moved, COPY_STALL, guard, client.tar_in(dest, Some("user".into()), &mut receiver)).await;
        // An agent that stopped reading must not leave the packer blocked on
        // a full pipe: closing the read end makes its next write fail.
        drop(receiver);
        let packed = packer.await.map_err(|e| HostPathError(format!("archiving failed: {e}")))?;
        let Some(uploaded) = uploaded else { return Err(stalled(id, "into", guard)) };
        let agent_stopped = write_failed.load(std::sync::atomic::Ordering::Relaxed);
        match (packed, uploaded) {
            // The agent refused the archive (a file in the way, a full disk)
            // and stopped reading: its reason, not the broken pipe's.
            (Err(_), Err(source)) if agent_stopped => Err(SandboxError::Agent { id: id.into(), source }.into()),
            (Err(e), _) => Err(e.into()),
            (Ok(_), Err(source)) => Err(SandboxError::Agent { id: id.into(), source }.into()),
            (Ok(mut packed), Ok(_)) => {
                packed.top = measured.top;
                Ok(packed)
            }
        }
    }

    /// Copies a sandbox file or tree to `host`, a new path beneath a shared
    /// root. Entries left out (unsafe names, links leading out of the copy,
    /// devices) are listed in the result; on failure nothing is left behind.
    pub async fn copy_from_sandbox(&self, id: &str, sandbox_path: &str, host: &Path) -> Result<CopySummary, CopyError> {
        let result = self.copy_out(id, sandbox_path, host).await;
        self.explained_copy(id, result).await
    }

    async fn copy_out(&self, id: &str, sandbox_path: &str, host: &Path) -> Result<CopySummary, CopyError> {
        let dest = self.inner.host.destination(host)?;
        let (limit, share) = dest.limit(self.inner.host.copy_limit());
        let client = self.client(id).await?;
        let agent = |source| SandboxError::Agent { id: id.into(), source };
        let info =
            crate::timing::within(id, super::AGENT_CALL_GUARD, client.stat(sandbox_path)).await?.map_err(agent)?;
        let (staged, sink) = match info.kind {
            moat_proto::FileKind::File => {
                dest.stage_file().map(|(staged, file)| (Held(Some(staged)), Sink::File(file)))?
            }
            moat_proto::FileKind::Dir => dest.stage_dir().map(|(staged, dir)| (Held(Some(staged)), Sink::Dir(dir)))?,
            _ => {
                return Err(HostPathError(format!(
                    "{sandbox_path} in the sandbox is not a regular file or directory; copy one of those"
                ))
                .into());
            }
        };
        let filled = self.fill(id, &client, sandbox_path, sink, limit, share).await;
        // Removing a failed copy (up to the copy limit's worth of entries)
        // and even the rename that commits one are disk work: on a blocking
        // thread, waited for, so that an error leaves nothing behind.
        let Some(staged) = staged.take() else { return filled };
        let done = tokio::task::spawn_blocking(move || match filled {
            Ok(summary) => staged.commit().map(|()| summary).map_err(CopyError::from),
            Err(e) => {
                drop(staged);
                Err(e)
            }
        });
        done.await.map_err(|e| HostPathError(format!("finishing the copy failed: {e}")))?
    }

    /// Streams sandbox `sandbox_path` into `sink`, a staged copy.
    async fn fill(
        &self,
        id: &str,
        client: &moat_proto::AgentClient<moat_proto::UnixConnector>,
        sandbox_path: &str,
        sink: Sink,
        limit: hostfs::Limit,
        share: hostfs::Promise,
    ) -> Result<CopySummary, CopyError> {
        let agent = |source| SandboxError::Agent { id: id.into(), source };
        let (read, write) = pipe()?;
        let mut sender = tokio::net::unix::pipe::Sender::from_owned_fd(write)
            .map_err(|e| HostPathError(format!("cannot stream the copy: {e}")))?;
        let moved = Arc::new(AtomicU64::new(0));
        let received = Counted { inner: std::fs::File::from(read), moved: moved.clone() };
        let unpacker = tokio::task::spawn_blocking(move || {
            let input = std::io::BufReader::with_capacity(64 << 10, received);
            hostfs::unpack_within(input, sink, limit, Some(&share))
        });
        let guard = copy_guard(limit.bytes);
        let downloaded = unless_stalled(&moved, COPY_STALL, guard, client.tar_out(sandbox_path, &mut sender)).await;
        // The unpacker reads to the end of the archive; closing our end ends
        // it when the agent stopped early.
        drop(sender);
        let unpacked = unpacker.await.map_err(|e| HostPathError(format!("unpacking failed: {e}")))?;
        let Some(downloaded) = downloaded else { return Err(stalled(id, "out of", guard)) };
        let summary = match (unpacked, downloaded) {
            (Ok(summary), Ok(_)) => summary,
            // The unpacker stopped (limit, bad entry) and the agent's writes
            // then failed: the unpacker's reason is the one to give.
            (Err(e), Err(ProtoError::Io(_)) | Ok(_)) => return Err(e.into()),
            (_, Err(source)) => return Err(agent(source).into()),
        };
        Ok(summary)
    }
}

/// A staged copy held by an async call. Dropped there (the call was
/// cancelled), its removal goes to a blocking thread: a failed copy may
/// hold a quarter of a million entries, whose removal the async threads
/// that serve every sandbox never wait for.
struct Held(Option<hostfs::Staged>);

impl Held {
    fn take(mut self) -> Option<hostfs::Staged> {
        self.0.take()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(staged) = self.0.take() {
            drop(tokio::task::spawn_blocking(move || drop(staged)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_copy_that_stops_moving_is_given_up_and_one_that_moves_is_not() {
        let stall = Duration::from_secs(120);
        let moved = AtomicU64::new(0);
        // Nothing ever moves: given up after one stall.
        let started = tokio::time::Instant::now();
        let guard = copy_guard(1 << 30);
        assert!(unless_stalled(&moved, stall, guard, std::future::pending::<()>()).await.is_none());
        assert_eq!(started.elapsed(), stall);
        // Slow but moving (a byte every minute for ten minutes): finished.
        let slow = async {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(60)).await;
                moved.fetch_add(1, Ordering::Relaxed);
            }
            "done"
        };
        assert_eq!(unless_stalled(&moved, stall, guard, slow).await, Some("done"));
        // A trickle that never stalls (a byte a minute, for ever) ends at
        // the guard: 300 s, and a second for each MiB of the 1 GiB.
        assert_eq!(guard, Duration::from_secs(300 + 1024));
        let trickle = async {
            loop {
                tokio::time::sleep(Duration::from_secs(60)).await;
                moved.fetch_add(1, Ordering::Relaxed);
            }
        };
        let started = tokio::time::Instant::now();
        assert!(unless_stalled(&moved, stall, guard, trickle).await.is_none());
        assert_eq!(started.elapsed(), guard);
    }
}

//! Logs that a sandbox can make grow, kept bounded on the host.
//!
//! A microVM's serial console and moat-vmm's stdout and stderr are written
//! by processes a guest can drive (a guest printing to its console in a
//! loop). They go to a pipe instead of a file; a thread copies the pipe into
//! the log and, once the log holds [`LOG_CAP`] bytes, moves it to
//! `<name>.1` (replacing the one before) and starts afresh with a line that
//! says so. A log and its previous part never hold more than twice the cap.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// The size at which a log is rotated.
pub const LOG_CAP: u64 = 1 << 20;

/// A log fed through a pipe by [`CappedLog::start`].
#[derive(Debug)]
pub struct CappedLog {
    copier: Option<JoinHandle<()>>,
}

impl CappedLog {
    /// Creates `path` and a pipe whose read end a thread copies into it,
    /// rotating at `cap` bytes. Returns the write end, for the process
    /// that logs (close-on-exec: pass it as stdio or `dup2` it).
    pub fn start(path: &Path, cap: u64) -> std::io::Result<(OwnedFd, Self)> {
        let file = File::create(path)?;
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let path = path.to_path_buf();
        let copier = std::thread::Builder::new()
            .name("moat-log".into())
            .spawn(move || copy(File::from(read), file, &path, cap))?;
        Ok((write, Self { copier: Some(copier) }))
    }

    /// Waits until every writer has closed the pipe and all it held is in
    /// the log (the writer must be gone, or this waits for it).
    pub fn finish(&mut self) {
        if let Some(copier) = self.copier.take() {
            let _ = copier.join();
        }
    }
}

/// The note a rotated log starts with.
fn rotated_note(path: &Path, cap: u64) -> String {
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    format!(
        "[moat: {name} reached {cap} bytes and was rotated: the part before is {name}.1; older parts were dropped]\n"
    )
}

fn previous(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

fn copy(mut pipe: File, mut file: File, path: &Path, cap: u64) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if written + n as u64 > cap {
            let note = rotated_note(path, cap);
            // The state directory may be going away: then the rest is drained
            // unwritten, so the writer never blocks on a full pipe.
            let reopened = std::fs::rename(path, previous(path)).and_then(|()| File::create(path));
            match reopened {
                Ok(fresh) => {
                    file = fresh;
                    written = note.len() as u64;
                    let _ = file.write_all(note.as_bytes());
                }
                Err(_) => {
                    written = 0;
                    continue;
                }
            }
        }
        if file.write_all(&buf[..n]).is_ok() {
            written += n as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_is_rotated_at_its_cap_with_a_note() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("console.log");
        let (write, mut log) = CappedLog::start(&path, 1000).expect("starts");
        let mut pipe = File::from(write);
        for i in 0..100 {
            pipe.write_all(format!("line {i:03} of the guest's console\n").as_bytes()).expect("writes");
        }
        drop(pipe);
        log.finish();
        let now = std::fs::read_to_string(&path).expect("the log");
        let before = std::fs::read_to_string(previous(&path)).expect("the previous part");
        assert!(now.len() <= 1000 + 64 * 1024 && before.len() <= 1000 + 64 * 1024);
        assert!(now.starts_with("[moat: console.log reached 1000 bytes and was rotated"), "{now}");
        assert!(now.contains("console.log.1"), "{now}");
        assert!(now.ends_with("line 099 of the guest's console\n"), "the newest output is kept: {now}");
        assert!(!before.contains("line 000") || !now.contains("line 000"), "older parts are dropped");
    }

    #[test]
    fn a_small_log_is_left_as_written() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("vmm.log");
        let (write, mut log) = CappedLog::start(&path, LOG_CAP).expect("starts");
        File::from(write).write_all(b"moat-vmm: started\n").expect("writes");
        log.finish();
        assert_eq!(std::fs::read_to_string(&path).expect("the log"), "moat-vmm: started\n");
        assert!(!previous(&path).exists());
    }
}

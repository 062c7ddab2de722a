//! Git over SSH without the key ever entering the sandbox.
//!
//! A clone over SSH runs `git` in the sandbox as any clone does, but its
//! transport is on the host: moat starts the host's `ssh` with the key the
//! operator allowed (held in a sealed memory file, never on a disk the
//! sandbox sees), and relays bytes between that `ssh` and the sandbox
//! git's "ssh" (a two-`cat` script on the clone's stdin and stdout). So:
//!
//! - the key, the agent socket and the user's `~/.ssh/config` stay on the
//!   host (`ssh -F /dev/null`, `IdentityAgent none`, this key only);
//! - the command run on the server is fixed here, `git-upload-pack` of the
//!   URL's path: nothing in the sandbox can make it push
//!   (`git-receive-pack`) or run anything else with the key;
//! - host keys are checked, strictly, against the user's `known_hosts` or
//!   the operator's pinned list (`MOAT_SSH_KNOWN_HOSTS`);
//! - the sandbox needs no network: the host connects, to a host among
//!   `MOAT_GIT_HOSTS` only.
//!
//! One clone is one SSH connection (protocol v0, which every server
//! speaks, ends when the pack is sent), so a commit to check out must be
//! in what the clone fetched.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use moat_proto::{ExecHandle, ExitStatus, ProtoError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The port an SSH remote is reached on when its URL names none, and the
/// only one `MOAT_GIT_HOSTS` opens.
pub const SSH_PORT: u16 = 22;

/// An SSH remote taken apart: `ssh://[USER@]HOST[:PORT]/PATH` or the
/// scp-like `[USER@]HOST:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshRemote {
    /// The login name (`git` when the URL names none).
    pub user: String,
    /// The host, lower case.
    pub host: String,
    pub port: Option<u16>,
    /// The repository's path as the server's `git-upload-pack` takes it.
    pub path: String,
}

impl SshRemote {
    /// `None` when `url` is not an SSH URL; else the remote, or why it
    /// cannot be used.
    pub fn parse(url: &str) -> Option<Result<Self, String>> {
        let (authority, path) = if let Some(rest) = url.strip_prefix("ssh://") {
            let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
            // `ssh://host/~user/repo` names a path in a home directory.
            let path = if path.starts_with('~') { path.to_owned() } else { format!("/{path}") };
            (authority, path)
        } else {
            if url.contains("://") {
                return None;
            }
            let (authority, path) = url.split_once(':')?;
            if authority.is_empty() || authority.contains('/') {
                return None;
            }
            (authority, path.to_owned())
        };
        Some(Self::checked(url, authority, path))
    }

    fn checked(url: &str, authority: &str, path: String) -> Result<Self, String> {
        let (user, host_port) = match authority.rsplit_once('@') {
            Some((user, rest)) => (user, rest),
            None => ("git", authority),
        };
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && !s.starts_with('-')
                && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if !name_ok(user) {
            return Err(format!("{url:?}: the login name {user:?} may hold only letters, digits, '-', '_' and '.'"));
        }
        let (host, port) = match host_port.rsplit_once(':') {
            Some((host, port)) if url.starts_with("ssh://") => {
                let port = port.parse::<u16>().ok().filter(|p| *p != 0);
                (host, Some(port.ok_or_else(|| format!("{url:?}: the port is not a number from 1 to 65535"))?))
            }
            _ => (host_port, None),
        };
        let host_ok = !host.is_empty()
            && host.len() <= 253
            && !host.starts_with('-')
            && host.chars().all(|c| c.is_ascii_alphanumeric() || "-.".contains(c));
        if !host_ok {
            return Err(format!("{url:?}: {host:?} is not a host name"));
        }
        let path_ok = !path.trim_start_matches('/').is_empty()
            && !path.starts_with('-')
            && path.len() <= 1024
            && !path.split('/').any(|part| part == "..")
            && path.chars().all(|c| c.is_ascii_alphanumeric() || "-_./~+".contains(c));
        if !path_ok {
            return Err(format!(
                "{url:?}: the repository path may hold only letters, digits, '-', '_', '.', '/', '~' and '+', and no `..`"
            ));
        }
        Ok(Self { user: user.to_owned(), host: host.to_ascii_lowercase(), port, path })
    }

    /// Whether the operator lets a clone reach this remote's port. The
    /// host's own `ssh` makes the connection, outside every sandbox's
    /// egress filter, so `MOAT_GIT_HOSTS` (host names) opens SSH's port
    /// only; another port of a Git host takes a `HOST:PORT` entry in
    /// `MOAT_ALLOW_HOSTS` (which every `filtered` sandbox then reaches
    /// too), as a sandbox's own connections do.
    pub fn port_allowed(&self, allow_hosts: &[String]) -> Result<(), String> {
        let Some(port) = self.port.filter(|port| *port != SSH_PORT) else { return Ok(()) };
        let entry = format!("{}:{port}", self.host);
        if allow_hosts.iter().any(|allowed| allowed.eq_ignore_ascii_case(&entry)) {
            return Ok(());
        }
        Err(format!(
            "SSH clones reach port {SSH_PORT} of a Git host; port {port} of {} is reached only where the \
             server's operator lists {entry} in MOAT_ALLOW_HOSTS",
            self.host
        ))
    }

    /// The one command the key may run on the server.
    pub fn upload_pack(&self) -> String {
        // The path holds no quote (checked above): single quotes keep it
        // one word for the server's shell, as git itself quotes it.
        format!("git-upload-pack '{}'", self.path)
    }
}

/// The host's `ssh` for one clone, with its key in a sealed memory file.
#[derive(Debug)]
pub struct SshTransport {
    command: tokio::process::Command,
    /// The key's memory file: `ssh` reads it through this process's
    /// `/proc/PID/fd`, so it must stay open until `ssh` has run.
    _key: OwnedFd,
}

impl SshTransport {
    /// `ssh` to `remote` with `key` (an OpenSSH or PEM private key), host
    /// keys checked against `known_hosts`; `address`, where given, is
    /// where to connect instead of resolving the host (tests).
    pub fn new(
        remote: &SshRemote,
        key: &[u8],
        known_hosts: &[PathBuf],
        address: Option<IpAddr>,
    ) -> std::io::Result<Self> {
        let ssh = crate::programs::find_program("ssh").ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the host has no ssh client, which clones over SSH need (Debian: apt-get install openssh-client)",
            )
        })?;
        let key_fd = sealed_file("moat-ssh-key", key)?;
        let key_path = format!("/proc/{}/fd/{}", std::process::id(), key_fd.as_raw_fd());
        let known = known_hosts.iter().map(|p| format!("\"{}\"", p.display())).collect::<Vec<_>>().join(" ");
        let mut command = tokio::process::Command::new(ssh);
        // No configuration file, agent, forwarding, proxy or multiplexing
        // of the user's: only what is set here.
        command.args(["-F", "/dev/null", "-T", "-x", "-a"]);
        for option in [
            "BatchMode=yes",
            "StrictHostKeyChecking=yes",
            &format!("UserKnownHostsFile={known}"),
            "GlobalKnownHostsFile=/dev/null",
            "UpdateHostKeys=no",
            "IdentitiesOnly=yes",
            "IdentityAgent=none",
            &format!("IdentityFile={key_path}"),
            "PasswordAuthentication=no",
            "KbdInteractiveAuthentication=no",
            "ControlMaster=no",
            "ControlPath=none",
            "ProxyCommand=none",
            "PermitLocalCommand=no",
            "ClearAllForwardings=yes",
            "ConnectTimeout=20",
            "ServerAliveInterval=15",
            "ServerAliveCountMax=4",
            "LogLevel=ERROR",
        ] {
            command.arg("-o").arg(option);
        }
        let target = match address {
            Some(address) => {
                command.arg("-o").arg(format!("HostKeyAlias={}", remote.host));
                address.to_string()
            }
            None => remote.host.clone(),
        };
        if let Some(port) = remote.port {
            command.arg("-p").arg(port.to_string());
        }
        command.arg("-l").arg(&remote.user).arg("--").arg(target).arg(remote.upload_pack());
        command.env_clear();
        for var in ["HOME", "PATH", "LANG"] {
            if let Some(value) = std::env::var_os(var) {
                command.env(var, value);
            }
        }
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        Ok(Self { command, _key: key_fd })
    }

    /// Runs `ssh` for the clone whose process in the sandbox is `handle`
    /// (started with `stdin: true` and the relay script on its fds 3 and
    /// 4), relaying until the clone exits.
    pub async fn relay(mut self, mut handle: ExecHandle) -> Relayed {
        let mut child = match self.command.spawn() {
            Ok(child) => child,
            Err(e) => {
                drop(handle);
                return Relayed { status: Err(None), stderr: Vec::new(), ssh_stderr: format!("cannot start ssh: {e}") };
            }
        };
        let (Some(mut to_ssh), Some(mut stdin), Some(from_git)) =
            (handle.take_stdout(), handle.take_stdin(), handle.take_stderr())
        else {
            return Relayed { status: Err(None), stderr: Vec::new(), ssh_stderr: "no streams to relay".into() };
        };
        let (Some(mut ssh_in), Some(mut ssh_out), Some(mut ssh_err)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Relayed { status: Err(None), stderr: Vec::new(), ssh_stderr: "ssh has no pipes".into() };
        };
        // The server to git, for as long as ssh runs.
        let down = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n) = ssh_out.read(&mut buf).await {
                if n == 0 || stdin.write(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                    break;
                }
            }
            let _ = stdin.close().await;
        });
        let said = tokio::spawn(async move {
            let mut text = Vec::new();
            let _ = (&mut ssh_err).take(SSH_STDERR_MAX).read_to_end(&mut text).await;
            String::from_utf8_lossy(&text).trim().to_owned()
        });
        // git to the server, until the clone ends.
        let up = async move {
            while let Some(chunk) = to_ssh.recv().await {
                if ssh_in.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        };
        let stderr = async move {
            let mut from_git = from_git;
            let mut text = Vec::new();
            while let Some(chunk) = from_git.recv().await {
                let room = STDERR_MAX.saturating_sub(text.len());
                text.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            text
        };
        let ((), stderr, status) = tokio::join!(up, stderr, handle.wait());
        // The clone has ended: ssh gets a moment to end its session.
        if tokio::time::timeout(SSH_GRACE, child.wait()).await.is_err() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        let _ = down.await;
        let ssh_stderr = said.await.unwrap_or_default();
        Relayed { status: status.map_err(Some), stderr, ssh_stderr }
    }
}

/// What a relayed clone left.
#[derive(Debug)]
pub struct Relayed {
    /// The clone's exit, or how the sandbox failed it (`None`: it never ran).
    pub status: Result<ExitStatus, Option<ProtoError>>,
    /// The clone's stderr (the script prints everything there).
    pub stderr: Vec<u8>,
    /// What the host's `ssh` said (a host key or login refused, ...).
    pub ssh_stderr: String,
}

/// How long `ssh` may take to end once the clone has.
pub const SSH_GRACE: Duration = Duration::from_secs(5);
/// The most of `ssh`'s stderr kept.
const SSH_STDERR_MAX: u64 = 16 << 10;
/// The most of the clone's stderr kept.
const STDERR_MAX: usize = 1 << 20;

/// A memory file holding `bytes`, readable by this user only and sealed
/// against change.
fn sealed_file(name: &str, bytes: &[u8]) -> std::io::Result<OwnedFd> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    let mut written = 0;
    while written < bytes.len() {
        written += nix::unistd::write(&fd, &bytes[written..])?;
    }
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::from_bits_truncate(seals)))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_urls_are_taken_apart_and_checked() {
        let remote = |url: &str| SshRemote::parse(url).expect("an ssh URL").expect("valid");
        let r = remote("ssh://git@Git.Example.com:2222/srv/repo.git");
        assert_eq!(
            (r.user.as_str(), r.host.as_str(), r.port, r.path.as_str()),
            ("git", "git.example.com", Some(2222), "/srv/repo.git")
        );
        assert_eq!(r.upload_pack(), "git-upload-pack '/srv/repo.git'");
        let r = remote("git@github.com:owner/repo.git");
        assert_eq!(
            (r.user.as_str(), r.host.as_str(), r.port, r.path.as_str()),
            ("git", "github.com", None, "owner/repo.git")
        );
        assert_eq!(remote("ssh://host.test/~me/r").path, "~me/r");
        assert_eq!(remote("host.test:r.git").user, "git");
        for not_ssh in ["https://github.com/a/b", "/home/me/project", "git://x/y", "relative/dir"] {
            assert!(SshRemote::parse(not_ssh).is_none(), "{not_ssh}");
        }
        for (bad, why) in [
            ("ssh://-oProxyCommand=x/r", "not a host name"),
            ("ssh://git@host.test:0/r", "port"),
            ("ssh://git@host.test:x/r", "port"),
            ("ssh://git@host.test/", "repository path"),
            ("git@host.test:-u/r", "repository path"),
            ("git@host.test:r';touch x'", "repository path"),
            ("git@host.test:a/../../etc", "repository path"),
            ("-oX@host.test:r", "login name"),
            ("a b@host.test:r", "login name"),
            ("git@ho$t:r", "not a host name"),
        ] {
            let err = SshRemote::parse(bad).expect("an ssh URL").expect_err(bad);
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_git_hosts_other_ports_are_the_operators_to_open() {
        let remote = |url: &str| SshRemote::parse(url).expect("an ssh URL").expect("valid");
        let open = ["git.example.com:2222".to_owned(), "other.example.com:25".to_owned()];
        for url in ["git@git.example.com:r.git", "ssh://git@git.example.com/r", "ssh://git@git.example.com:22/r"] {
            assert_eq!(remote(url).port_allowed(&[]), Ok(()), "{url}");
        }
        assert_eq!(remote("ssh://git@Git.Example.com:2222/r").port_allowed(&open), Ok(()));
        for (url, allowed) in [
            ("ssh://git@git.example.com:25/r", &open[..]),
            ("ssh://git@git.example.com:2222/r", &[]),
            ("ssh://git@git.example.com:2222/r", &["git.example.com:22222".to_owned()]),
        ] {
            let why = remote(url).port_allowed(allowed).expect_err(url);
            assert!(why.contains("MOAT_ALLOW_HOSTS") && why.contains("port 22 of a Git host"), "{url}: {why}");
        }
    }

    #[test]
    fn the_key_lives_in_a_sealed_file_only_its_user_reads() {
        let fd = sealed_file("test-key", b"-----BEGIN OPENSSH PRIVATE KEY-----\n").expect("memfd");
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        assert_eq!(std::fs::read(&path).expect("readable by path"), b"-----BEGIN OPENSSH PRIVATE KEY-----\n");
        let mode = std::fs::metadata(&path).expect("stat").permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
        assert!(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .and_then(|mut f| { std::io::Write::write_all(&mut f, b"more") })
                .is_err(),
            "sealed against writes"
        );
    }
}

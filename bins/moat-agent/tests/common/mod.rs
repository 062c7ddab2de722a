//! A real `moat-agent` process on a Unix socket, for the tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use moat_proto::{AgentClient, UnixConnector};

pub const AGENT: &str = env!("CARGO_BIN_EXE_moat-agent");

/// Where test agents put their sockets and files.
const TEST_DIR: &str = "/var/tmp/moat-agent-tests";

/// A running agent, killed (with its process tree) when dropped.
pub struct TestAgent {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

impl TestAgent {
    /// The agent as a plain process.
    pub async fn start() -> Self {
        Self::start_with(&[], &[]).await
    }

    /// The agent started through `wrapper` (e.g. `unshare …`), with `args`.
    pub async fn start_with(wrapper: &[&str], args: &[&str]) -> Self {
        // Not under /tmp (nor /run, /dev): an agent started with --init
        // mounts fresh ones over them, hiding a socket there. The checkout
        // itself may live under /tmp, so not under target/ either.
        std::fs::create_dir_all(TEST_DIR).expect("creating the test directory");
        let dir = tempfile::Builder::new().prefix("agent-").tempdir_in(TEST_DIR).expect("temp dir");
        // Open to all, so an agent started as another user can bind there.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod temp dir");
        let socket = dir.path().join("agent.sock");
        let listen = format!("unix:{}", socket.display());
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(AGENT);
                c
            }
            None => Command::new(AGENT),
        };
        command.args(["--listen", &listen, "--log-level", "warn"]).args(args).stdin(Stdio::null());
        let child = command.spawn().expect("agent starts");
        let agent = Self { child, dir, socket };
        agent.wait_ready().await;
        agent
    }

    async fn wait_ready(&self) {
        for _ in 0..500 {
            if tokio::net::UnixStream::connect(&self.socket).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("agent did not listen on {}", self.socket.display());
    }

    pub fn client(&self) -> AgentClient<UnixConnector> {
        AgentClient::unix(&self.socket)
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Peak resident memory of the agent process, in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        status_field(self.child.id(), "VmHWM:")
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        // SIGTERM lets the agent stop its children; then make sure.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        std::thread::sleep(Duration::from_millis(50));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A numeric field of /proc/PID/status, in its unit (kB for memory).
pub fn status_field(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Whether a process exists (zombies count as existing).
pub fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

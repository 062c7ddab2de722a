//! [`Moat`]: the entry point for everything that drives sandboxes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moat_proto::{AgentClient, ExecHandle, ExecRequest, Output, UnixConnector};

use crate::backend::BackendKind;
use crate::error::CoreError;
use crate::image::{self, Image};
use crate::jail::{Jail, JailBackend};
use crate::sandbox::{Sandbox, SandboxSpec, SandboxState, now};

/// How a [`Moat`] runs.
#[derive(Debug, Clone)]
pub struct MoatConfig {
    pub data_dir: PathBuf,
    pub backend: BackendKind,
    /// The `moat-agent` binary (static) that jails run.
    pub agent: PathBuf,
    pub max_sandboxes: usize,
}

impl MoatConfig {
    /// The data directory from the environment, backend `auto`, the agent
    /// from `$MOAT_AGENT` or beside the running executable, 16 sandboxes.
    pub fn from_env() -> Result<Self, CoreError> {
        Ok(Self { data_dir: image::data_dir(), backend: BackendKind::Auto, agent: find_agent()?, max_sandboxes: 16 })
    }
}

/// Where the agent binary is: `$MOAT_AGENT`, else the static build
/// (`target/x86_64-unknown-linux-gnu/release/moat-agent`, as `cargo xtask
/// build` makes it) near the current executable, else `moat-agent` beside it.
pub fn find_agent() -> Result<PathBuf, CoreError> {
    if let Some(path) = std::env::var_os("MOAT_AGENT") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(CoreError::AgentMissing(format!("MOAT_AGENT={}", path.display())))
        };
    }
    let exe = std::env::current_exe().map_err(|e| CoreError::AgentMissing(e.to_string()))?;
    let dirs: Vec<&Path> = exe.ancestors().skip(1).take(3).collect();
    let static_builds = dirs.iter().map(|d| d.join("x86_64-unknown-linux-gnu/release/moat-agent"));
    let candidates: Vec<PathBuf> = static_builds.chain(dirs.iter().take(2).map(|d| d.join("moat-agent"))).collect();
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        CoreError::AgentMissing(format!(
            "looked at {}",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}

struct Entry {
    info: Sandbox,
    jail: Jail,
}

struct Inner {
    config: MoatConfig,
    backend: JailBackend,
    sandboxes: Mutex<BTreeMap<String, Entry>>,
    expired: Mutex<Vec<String>>,
}

/// Creates and drives sandboxes. Every sandbox it creates is destroyed when
/// it is dropped, or by the next `Moat` to start if this process is killed.
///
/// ```no_run
/// # async fn demo() -> Result<(), moat_core::CoreError> {
/// use moat_core::{Moat, MoatConfig, SandboxSpec};
/// let moat = Moat::new(MoatConfig::from_env()?).await?;
/// let sandbox = moat.create(SandboxSpec::default()).await?;
/// let out = moat.run(&sandbox.id, moat_proto::ExecRequest::shell("python3 -c 'print(6*7)'")).await?;
/// assert_eq!(out.stdout, b"42\n");
/// moat.destroy(&sandbox.id).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Moat {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Moat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Moat").field("data_dir", &self.inner.config.data_dir).finish_non_exhaustive()
    }
}

impl Moat {
    /// Sweeps what dead owners left, picks the backend, and starts the
    /// lifecycle task (idle suspend, expiry).
    pub async fn new(config: MoatConfig) -> Result<Self, CoreError> {
        // Until the vm backend lands, `auto` means jail everywhere.
        if config.backend == BackendKind::Vm {
            return Err(CoreError::BackendUnavailable("vm"));
        }
        if !config.agent.is_file() {
            return Err(CoreError::AgentMissing(config.agent.display().to_string()));
        }
        let swept = crate::state::sweep(&config.data_dir);
        if !swept.is_empty() {
            tracing::info!(count = swept.len(), "cleaned up sandboxes of dead owners");
        }
        let inner = Arc::new(Inner {
            backend: JailBackend::new(config.agent.clone()),
            config,
            sandboxes: Mutex::new(BTreeMap::new()),
            expired: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                inner.lifecycle();
            }
        });
        Ok(Self { inner })
    }

    pub fn data_dir(&self) -> &Path {
        &self.inner.config.data_dir
    }

    /// Creates a sandbox and waits until its agent answers.
    pub async fn create(&self, spec: SandboxSpec) -> Result<Sandbox, CoreError> {
        spec.validate()?;
        let max = self.inner.config.max_sandboxes;
        if self.inner.lock().len() >= max {
            return Err(CoreError::LimitReached { max });
        }
        let image = Image::open(&self.inner.config.data_dir, &spec.image)?;
        let id = new_id();
        let name = spec.name.clone().unwrap_or_else(|| id.clone());
        let jail = self.inner.backend.start(&id, &name, &spec, &image, &self.inner.config.data_dir).await?;
        let created = now();
        let info = Sandbox {
            id: id.clone(),
            name,
            image: spec.image.clone(),
            backend: BackendKind::Jail.to_string(),
            state: SandboxState::Running,
            created_at: created,
            last_used_at: created,
            expires_at: created + spec.timeout_seconds,
            spec,
        };
        let mut sandboxes = self.inner.lock();
        if sandboxes.len() >= max {
            return Err(CoreError::LimitReached { max });
        }
        sandboxes.insert(id, Entry { info: info.clone(), jail });
        Ok(info)
    }

    pub fn list(&self) -> Vec<Sandbox> {
        self.inner.lock().values().map(|e| e.info.clone()).collect()
    }

    pub fn get(&self, id: &str) -> Result<Sandbox, CoreError> {
        let sandboxes = self.inner.lock();
        sandboxes.get(id).map(|e| e.info.clone()).ok_or_else(|| self.inner.unknown(id, &sandboxes))
    }

    pub async fn destroy(&self, id: &str) -> Result<(), CoreError> {
        let entry = {
            let mut sandboxes = self.inner.lock();
            sandboxes.remove(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?
        };
        tokio::task::spawn_blocking(move || drop(entry)).await.ok();
        Ok(())
    }

    /// Destroys every sandbox.
    pub async fn destroy_all(&self) {
        let entries: Vec<Entry> = std::mem::take(&mut *self.inner.lock()).into_values().collect();
        tokio::task::spawn_blocking(move || drop(entries)).await.ok();
    }

    /// A client of the sandbox's agent, after marking it used and resuming
    /// it if it was suspended.
    pub fn client(&self, id: &str) -> Result<AgentClient<UnixConnector>, CoreError> {
        let mut sandboxes = self.inner.lock();
        if !sandboxes.contains_key(id) {
            return Err(self.inner.unknown(id, &sandboxes));
        }
        let entry = sandboxes.get_mut(id).ok_or_else(|| CoreError::Expired(id.into()))?;
        if entry.info.state == SandboxState::Paused {
            entry.jail.set_frozen(false)?;
            entry.info.state = SandboxState::Running;
            tracing::debug!(%id, "resumed");
        }
        entry.info.last_used_at = now();
        Ok(entry.jail.client())
    }

    /// Starts a process as `user` in `/home/user` unless the request says otherwise.
    pub async fn exec(&self, id: &str, mut request: ExecRequest) -> Result<ExecHandle, CoreError> {
        request.user.get_or_insert_with(|| "user".into());
        let client = self.client(id)?;
        client.exec(request).await.map_err(|source| CoreError::Agent { id: id.into(), source })
    }

    /// Runs a process to completion and collects its output.
    pub async fn run(&self, id: &str, request: ExecRequest) -> Result<Output, CoreError> {
        self.exec(id, request).await?.output().await.map_err(|source| CoreError::Agent { id: id.into(), source })
    }

    /// Suspends a sandbox now (as idleness would).
    pub fn suspend(&self, id: &str) -> Result<(), CoreError> {
        let mut sandboxes = self.inner.lock();
        let Some(entry) = sandboxes.get_mut(id) else { return Err(self.inner.unknown(id, &sandboxes)) };
        if entry.jail.can_freeze() {
            entry.jail.set_frozen(true)?;
            entry.info.state = SandboxState::Paused;
        }
        Ok(())
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // Each critical section is a map operation: a panic leaves it whole.
        self.sandboxes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn unknown(&self, id: &str, sandboxes: &BTreeMap<String, Entry>) -> CoreError {
        let expired = self.expired.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if expired.iter().any(|e| e == id) {
            return CoreError::Expired(id.into());
        }
        CoreError::UnknownSandbox { id: id.into(), known: sandboxes.keys().cloned().collect() }
    }

    /// Expires and suspends sandboxes; runs every second.
    fn lifecycle(&self) {
        let now = now();
        let mut dead = Vec::new();
        {
            let mut sandboxes = self.lock();
            let expired: Vec<String> =
                sandboxes.iter().filter(|(_, e)| e.info.expires_at <= now).map(|(id, _)| id.clone()).collect();
            for id in expired {
                if let Some(entry) = sandboxes.remove(&id) {
                    tracing::info!(%id, "sandbox expired");
                    dead.push(entry);
                    self.expired.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(id);
                }
            }
            for (id, entry) in sandboxes.iter_mut() {
                let idle = entry.info.spec.idle_seconds;
                if idle > 0
                    && entry.info.state == SandboxState::Running
                    && now.saturating_sub(entry.info.last_used_at) >= idle
                    && entry.jail.can_freeze()
                {
                    match entry.jail.set_frozen(true) {
                        Ok(()) => {
                            entry.info.state = SandboxState::Paused;
                            tracing::debug!(%id, "suspended after being idle");
                        }
                        Err(e) => tracing::warn!(%id, "cannot suspend: {e}"),
                    }
                }
            }
        }
        drop(dead);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let entries = std::mem::take(&mut *self.lock());
        drop(entries);
    }
}

/// `sbx-` and 8 random hex digits.
fn new_id() -> String {
    let mut bytes = [0u8; 4];
    if getrandom(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        bytes = (nanos ^ std::process::id()).to_le_bytes();
    }
    format!("sbx-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// For tests: makes sandbox `id` expire now and runs the lifecycle pass.
#[doc(hidden)]
pub fn expire_now(moat: &Moat, id: &str) {
    if let Some(entry) = moat.inner.lock().get_mut(id) {
        entry.info.expires_at = now();
    }
    moat.inner.lifecycle();
}

//! [`Moat`]: the entry point for everything that drives sandboxes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moat_proto::{AgentClient, ExecHandle, ExecRequest, Output, UnixConnector};

use crate::backend::BackendKind;
use crate::egress::{EgressConfig, EgressDecision, EgressProxy, SandboxEgress};
use crate::error::CoreError;
use crate::grants::Grants;
use crate::hostfs::{self, HostRoots, SourceKind};
use crate::image::{self, Image};
use crate::interpreter::{CodeOutput, Language, PythonSession, StreamName, snippet_request};
use crate::jail::JailBackend;
use crate::machine::{Machine, Runner, find_vmm};
use crate::preview::{Preview, PreviewLink};
use crate::sandbox::{NetworkPolicy, Sandbox, SandboxSpec, SandboxState, now};
use crate::task::{self, DiffSummary, LogEntry, Task, TaskRecord};
use crate::vm::VmBackend;

mod copy;

/// The most [`Moat::run`] collects of each of stdout and stderr; what a
/// sandbox prints beyond is dropped (stream with [`Moat::exec`] for more).
pub const RUN_OUTPUT_LIMIT: usize = 64 << 20;

/// How long past a command's own timeout the host waits for the agent to
/// report it ended. The agent kills a command at its timeout and answers
/// at once; silence this long after means the agent or the guest's kernel
/// is stuck, and the caller gets [`CoreError::Unresponsive`] instead of
/// waiting forever.
pub const ANSWER_GRACE: Duration = Duration::from_secs(30);

/// How long a call whose agent connection broke waits for the sandbox's
/// host process to be seen ending, to tell a dead sandbox from a dropped
/// connection. A dead sandbox's process ends within milliseconds of its
/// connection; this only bounds the wait.
const FAILURE_SETTLE: Duration = Duration::from_secs(3);

/// Failed sandboxes kept for `list` at most; the oldest go first.
const FAILED_KEPT: usize = 64;

/// `work`, given up as [`CoreError::Unresponsive`] when it has not finished
/// [`ANSWER_GRACE`] after `timeout` (never without a timeout).
pub async fn answered_within<T>(
    id: &str,
    timeout: Option<Duration>,
    work: impl Future<Output = Result<T, CoreError>>,
) -> Result<T, CoreError> {
    let Some(timeout) = timeout else { return work.await };
    let waited = timeout.saturating_add(ANSWER_GRACE);
    tokio::time::timeout(waited, work)
        .await
        .map_err(|_| CoreError::Unresponsive { id: id.into(), waited_s: waited.as_secs() })?
}

/// How a [`Moat`] runs.
#[derive(Debug, Clone)]
pub struct MoatConfig {
    pub data_dir: PathBuf,
    pub backend: BackendKind,
    /// The `moat-agent` binary (static) that jails run.
    pub agent: PathBuf,
    pub max_sandboxes: usize,
    /// Host directories the copy and task tools may read and write (see
    /// [`hostfs::roots_from_env`]); empty shares none.
    pub roots: Vec<PathBuf>,
    /// The most one copy or import may move, in bytes (`MOAT_COPY_MAX_MIB`).
    pub copy_limit: u64,
    /// Sandboxes kept started ahead of need, for `create` calls whose spec
    /// equals `pool_spec`: those return at once. 0 turns the pool off.
    pub pool_size: usize,
    pub pool_spec: SandboxSpec,
    /// What `filtered` sandboxes may reach beyond their runtime's registries
    /// (and a task's repository host).
    pub egress: EgressConfig,
    /// The most a spec may ask for ([`Grants::check`]): `MOAT_ALLOW_NETWORK`,
    /// and for `allow_hosts`, the hosts of `egress` and the registries.
    pub grants: Grants,
}

impl MoatConfig {
    /// The data directory from the environment, backend `auto`, the agent
    /// from `$MOAT_AGENT` or beside the running executable, 16 sandboxes,
    /// and the grants of `MOAT_ALLOW_NETWORK` (none unless set).
    pub fn from_env() -> Result<Self, CoreError> {
        Ok(Self { grants: Grants::from_env()?, ..Self::operator_from_env()? })
    }

    /// [`MoatConfig::from_env`] for the operator's own tools (the `moat`
    /// CLI): everything is granted, and `MOAT_ALLOW_NETWORK` is not read.
    pub fn operator_from_env() -> Result<Self, CoreError> {
        // The operator's errors (exit 2) before the machine's.
        let roots = hostfs::roots_from_env()?;
        let copy_limit = hostfs::copy_limit_from_env()?;
        Ok(Self {
            data_dir: image::data_dir(),
            backend: BackendKind::Auto,
            agent: find_agent()?,
            max_sandboxes: 16,
            roots,
            copy_limit,
            pool_size: 0,
            pool_spec: SandboxSpec::default(),
            egress: EgressConfig::from_env(),
            grants: Grants::everything(),
        })
    }
}

/// Where the agent binary is: `$MOAT_AGENT`, else the static build
/// (`target/x86_64-unknown-linux-gnu/release/moat-agent`, as `cargo xtask
/// build` makes it) near the current executable, else `moat-agent` beside it.
/// The backend `config.backend` resolves to on this host: `auto` is a
/// microVM where the host has hardware virtualization and `moat-vmm` is
/// found, a jail otherwise (see [`HostVirtualization::choose`]).
fn choose_backend(config: &MoatConfig) -> Result<Runner, CoreError> {
    let choice = crate::backend::HostVirtualization::resolve(config.backend);
    match choice.kind {
        BackendKind::Vm => match find_vmm() {
            Some(vmm) => Ok(Runner::Vm(VmBackend::new(vmm))),
            None if config.backend == BackendKind::Vm => Err(CoreError::VmmMissing),
            None => {
                tracing::info!("{}, but moat-vmm is not found: using jails", choice.reason);
                Ok(Runner::Jail(JailBackend::new(config.agent.clone())))
            }
        },
        _ => Ok(Runner::Jail(JailBackend::new(config.agent.clone()))),
    }
}

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
    /// Network parts, dropped before the sandbox: the egress proxy
    /// (filtered) and the preview links.
    egress: Option<(Arc<SandboxEgress>, EgressProxy)>,
    previews: BTreeMap<u16, Preview>,
    jail: Machine,
    /// The sandbox's Python session for `run_code`, started on first use;
    /// the async lock queues calls on one sandbox.
    python: Arc<tokio::sync::Mutex<Option<PythonSession>>>,
}

struct Inner {
    config: MoatConfig,
    /// `config.roots`, open.
    host: HostRoots,
    egress: Arc<EgressConfig>,
    backend: Runner,
    sandboxes: Mutex<BTreeMap<String, Entry>>,
    expired: Mutex<Vec<String>>,
    /// Sandboxes that ended on their own, listed as `failed` (their
    /// `failure` says why) until destroyed or their expiry; at most
    /// [`FAILED_KEPT`].
    failed: Mutex<BTreeMap<String, Sandbox>>,
    /// Woken each time a sandbox fails.
    failures: tokio::sync::Notify,
    /// Tasks in progress, by task id, with their execution logs.
    tasks: Mutex<BTreeMap<String, (Task, Vec<LogEntry>)>>,
    /// Started sandboxes waiting to be handed out, by id.
    pool: Mutex<Vec<(String, Machine)>>,
    /// The most the live sandboxes' `memory_mib` may add up to
    /// (`MOAT_MAX_MEMORY_MIB`; see [`crate::limits`]).
    max_memory_mib: u64,
    refill: Arc<tokio::sync::Notify>,
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
        let host = HostRoots::open(&config.roots, &config.data_dir, config.copy_limit)?;
        if config.pool_size > 0 {
            config.grants.check(&config.pool_spec, &config.egress)?;
        }
        let max_memory_mib = crate::limits::max_memory_mib_from_env()?;
        let backend = choose_backend(&config)?;
        tracing::info!(backend = %backend.kind(), "sandboxes run in this backend");
        if backend.kind() == BackendKind::Jail && !config.agent.is_file() {
            return Err(CoreError::AgentMissing(config.agent.display().to_string()));
        }
        // Beside the first creates, not before them (see `state::sweep`).
        let data_dir = config.data_dir.clone();
        tokio::task::spawn_blocking(move || {
            let swept = crate::state::sweep(&data_dir);
            if !swept.is_empty() {
                tracing::info!(count = swept.len(), "cleaned up sandboxes of dead owners");
            }
        });
        let inner = Arc::new(Inner {
            host,
            backend,
            egress: Arc::new(config.egress.clone()),
            config,
            sandboxes: Mutex::new(BTreeMap::new()),
            expired: Mutex::new(Vec::new()),
            failed: Mutex::new(BTreeMap::new()),
            failures: tokio::sync::Notify::new(),
            tasks: Mutex::new(BTreeMap::new()),
            pool: Mutex::new(Vec::new()),
            max_memory_mib,
            refill: Arc::new(tokio::sync::Notify::new()),
        });
        if inner.config.pool_size > 0 {
            tokio::spawn(fill_pool(Arc::downgrade(&inner), inner.refill.clone()));
        }
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

    /// Host paths of moat's own that a model is never shown, each with the
    /// words that stand for it: the data directory (images, sandbox state,
    /// task records) and the binaries moat runs (this program, the agent,
    /// moat-vmm). Longest first, so that a caller replacing them in a
    /// message replaces the most specific one. (Directories such as
    /// `/usr/bin` that hold the binaries are not listed: sandbox paths
    /// would be mangled.)
    pub fn private_paths(&self) -> Vec<(String, &'static str)> {
        let data = &self.inner.config.data_dir;
        let mut paths: Vec<(PathBuf, &'static str)> =
            vec![(data.clone(), "<moat data directory>"), (self.inner.config.agent.clone(), "moat-agent")];
        paths.extend(data.canonicalize().ok().map(|real| (real, "<moat data directory>")));
        paths.extend(find_vmm().map(|vmm| (vmm, "moat-vmm")));
        paths.extend(std::env::current_exe().ok().map(|exe| (exe, "<moat's program>")));
        let mut paths: Vec<(String, &'static str)> =
            paths.into_iter().map(|(p, label)| (p.display().to_string(), label)).filter(|(p, _)| p.len() > 1).collect();
        paths.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        paths.dedup_by(|a, b| a.0 == b.0);
        paths
    }

    /// What `filtered` sandboxes may reach beyond their runtime's registries.
    pub fn egress_config(&self) -> &EgressConfig {
        &self.inner.egress
    }

    /// What the operator grants the specs of [`Moat::create`].
    pub fn grants(&self) -> &Grants {
        &self.inner.config.grants
    }

    /// Creates a sandbox and waits until its agent answers. A spec that
    /// asks for more than [`Moat::grants`] is refused.
    pub async fn create(&self, spec: SandboxSpec) -> Result<Sandbox, CoreError> {
        spec.validate()?;
        self.inner.config.grants.check(&spec, &self.inner.egress)?;
        let max = self.inner.config.max_sandboxes;
        if self.inner.lock().len() >= max {
            return Err(CoreError::LimitReached { max });
        }
        let from_pool = spec == self.inner.config.pool_spec && self.pooled() > 0;
        self.inner.check_memory(spec.memory_mib, from_pool)?;
        let pooled = if spec == self.inner.config.pool_spec { self.inner.take_pooled() } else { None };
        let (id, name, jail) = match pooled {
            Some((id, jail)) => (id.clone(), id, jail),
            None => {
                let image = Image::open(&self.inner.config.data_dir, &spec.image)?;
                let id = new_id();
                let name = spec.name.clone().unwrap_or_else(|| id.clone());
                let jail = self.inner.backend.start(&id, &name, &spec, &image, &self.inner.config.data_dir).await?;
                (id, name, jail)
            }
        };
        let egress = match spec.network {
            NetworkPolicy::Filtered => {
                let log = Some(crate::state::sandboxes_dir(&self.inner.config.data_dir).join(&id).join("egress.log"));
                let policy = Arc::new(SandboxEgress::new(self.inner.egress.clone(), spec.allow_hosts.clone(), log));
                match EgressProxy::start(jail.client(), policy.clone()).await {
                    Ok(proxy) => Some((policy, proxy)),
                    Err(source) => {
                        let _ = tokio::task::spawn_blocking(move || drop(jail)).await;
                        return Err(CoreError::Agent { id, source });
                    }
                }
            }
            NetworkPolicy::None | NetworkPolicy::Open => None,
        };
        let created = now();
        let info = Sandbox {
            id: id.clone(),
            name,
            image: spec.image.clone(),
            backend: self.inner.backend.kind().to_string(),
            state: SandboxState::Running,
            created_at: created,
            last_used_at: created,
            expires_at: created + spec.timeout_seconds,
            failure: None,
            spec,
        };
        let rejected = {
            let mut sandboxes = self.inner.lock();
            // Checked again: other creates may have finished meanwhile.
            let memory = self.inner.memory_check(&sandboxes, info.spec.memory_mib, false);
            if sandboxes.len() >= max || memory.is_err() {
                Some((jail, memory.err()))
            } else {
                if let Machine::Vm(vm) = &jail {
                    // How busy the guest is, for idle suspend: asked of its
                    // agent while it runs.
                    let (inner, key) = (Arc::downgrade(&self.inner), id.clone());
                    vm.watch_processes(Duration::from_secs(2), move || {
                        inner.upgrade().is_none_or(|inner| {
                            inner.lock().get(&key).is_none_or(|e| e.info.state == SandboxState::Paused)
                        })
                    });
                }
                self.watch_exit(&id, &jail);
                let entry =
                    Entry { info: info.clone(), egress, previews: BTreeMap::new(), jail, python: Arc::default() };
                sandboxes.insert(id, entry);
                None
            }
        };
        if let Some((jail, memory)) = rejected {
            let _ = tokio::task::spawn_blocking(move || drop(jail)).await;
            return Err(memory.unwrap_or(CoreError::LimitReached { max }));
        }
        Ok(info)
    }

    /// The live sandboxes and the failed ones (state `failed`, with why).
    pub fn list(&self) -> Vec<Sandbox> {
        let mut all: Vec<Sandbox> = self.inner.lock().values().map(|e| e.info.clone()).collect();
        all.extend(self.inner.failed().values().cloned());
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        all
    }

    /// A live sandbox; a failed one is [`CoreError::Failed`].
    pub fn get(&self, id: &str) -> Result<Sandbox, CoreError> {
        let sandboxes = self.inner.lock();
        sandboxes.get(id).map(|e| e.info.clone()).ok_or_else(|| self.inner.unknown(id, &sandboxes))
    }

    /// Destroys a sandbox, or forgets a failed one.
    pub async fn destroy(&self, id: &str) -> Result<(), CoreError> {
        let entry = {
            let mut sandboxes = self.inner.lock();
            match sandboxes.remove(id) {
                Some(entry) => entry,
                None if self.inner.failed().remove(id).is_some() => return Ok(()),
                None => return Err(self.inner.unknown(id, &sandboxes)),
            }
        };
        tokio::task::spawn_blocking(move || drop(entry)).await.ok();
        Ok(())
    }

    /// The host process sandbox `id` lives in (its jail's monitor, or
    /// moat-vmm), for tests that kill it.
    #[doc(hidden)]
    pub fn host_pid(&self, id: &str) -> Result<u32, CoreError> {
        let sandboxes = self.inner.lock();
        sandboxes.get(id).map(|e| e.jail.host_pid()).ok_or_else(|| self.inner.unknown(id, &sandboxes))
    }

    /// Runs `op` with a client of sandbox `id`'s agent (see [`Moat::client`]);
    /// its errors as [`Moat::agent_error`] says.
    pub async fn with_agent<T, F>(
        &self,
        id: &str,
        op: impl FnOnce(AgentClient<UnixConnector>) -> F,
    ) -> Result<T, CoreError>
    where
        F: Future<Output = Result<T, moat_proto::ProtoError>>,
    {
        let client = self.client(id)?;
        match op(client).await {
            Ok(value) => Ok(value),
            Err(source) => Err(self.agent_error(id, source).await),
        }
    }

    /// What an error of sandbox `id`'s agent means: when the connection was
    /// lost because the sandbox died (its agent, jail or microVM ended),
    /// [`CoreError::Failed`], once its host process is seen ending (within
    /// [`FAILURE_SETTLE`]); otherwise [`CoreError::Agent`].
    pub async fn agent_error(&self, id: &str, source: moat_proto::ProtoError) -> CoreError {
        if !source.is_lost_connection() {
            return CoreError::Agent { id: id.into(), source };
        }
        self.settled_failure(id).await.unwrap_or(CoreError::Agent { id: id.into(), source })
    }

    /// [`CoreError::Failed`] (or the error of a sandbox destroyed
    /// meanwhile) when sandbox `id` is seen to have ended within
    /// [`FAILURE_SETTLE`]; `None` while it runs on.
    async fn settled_failure(&self, id: &str) -> Option<CoreError> {
        let settle = async {
            loop {
                let failed = self.inner.failures.notified();
                tokio::pin!(failed);
                // Registered before looking, so that a failure between the
                // look and the wait still wakes it.
                failed.as_mut().enable();
                if let Some(sandbox) = self.inner.failed().get(id) {
                    return Some(CoreError::Failed {
                        id: id.into(),
                        reason: sandbox.failure.clone().unwrap_or_default(),
                    });
                }
                if !self.inner.lock().contains_key(id) {
                    // Destroyed or expired meanwhile: say that.
                    let sandboxes = self.inner.lock();
                    return Some(self.inner.unknown(id, &sandboxes));
                }
                failed.await;
            }
        };
        tokio::time::timeout(FAILURE_SETTLE, settle).await.ok().flatten()
    }

    /// `result`, with a lost agent connection explained by [`Moat::agent_error`].
    async fn explained<T>(&self, id: &str, result: Result<T, CoreError>) -> Result<T, CoreError> {
        match result {
            Err(CoreError::Agent { source, .. }) if source.is_lost_connection() => {
                Err(self.agent_error(id, source).await)
            }
            Err(error @ CoreError::CodeSession { .. }) => Err(self.settled_failure(id).await.unwrap_or(error)),
            other => other,
        }
    }

    /// Watches the host process of sandbox `id`: when it ends on its own,
    /// the sandbox is moved to the failed list and its resources released.
    fn watch_exit(&self, id: &str, machine: &Machine) {
        let exit = match machine.exit_watch() {
            Ok(exit) => exit,
            Err(e) => {
                tracing::warn!(%id, "cannot watch the sandbox's process; a failure shows only on use: {e}");
                return;
            }
        };
        let (inner, id) = (Arc::downgrade(&self.inner), id.to_owned());
        tokio::spawn(async move {
            if exit.exited().await.is_ok()
                && let Some(inner) = inner.upgrade()
            {
                inner.fail(&id);
            }
        });
    }

    /// Destroys every sandbox, pooled ones included, and forgets failed ones.
    pub async fn destroy_all(&self) {
        self.inner.failed().clear();
        let entries: Vec<Entry> = std::mem::take(&mut *self.inner.lock()).into_values().collect();
        let pooled = std::mem::take(&mut *self.inner.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        tokio::task::spawn_blocking(move || drop((entries, pooled))).await.ok();
    }

    /// How many started sandboxes wait in the pool.
    pub fn pooled(&self) -> usize {
        self.inner.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
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
            entry.jail.set_suspended(false)?;
            entry.info.state = SandboxState::Running;
            tracing::debug!(%id, "resumed");
        }
        entry.info.last_used_at = now();
        Ok(entry.jail.client())
    }

    /// The newest egress decisions of a `filtered` sandbox (empty for others).
    pub fn egress_log(&self, id: &str) -> Result<Vec<EgressDecision>, CoreError> {
        let sandboxes = self.inner.lock();
        let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
        Ok(entry.egress.as_ref().map(|(policy, _)| policy.log()).unwrap_or_default())
    }

    /// The host names a `filtered` sandbox may reach (empty for others).
    pub fn allowed_hosts(&self, id: &str) -> Result<Vec<String>, CoreError> {
        let sandboxes = self.inner.lock();
        let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
        Ok(entry.egress.as_ref().map(|(policy, _)| policy.allowed_hosts().into_iter().collect()).unwrap_or_default())
    }

    /// A link on the host's loopback to `port` in sandbox `id`, valid until
    /// the sandbox ends; asking again for the same port returns the same link.
    pub async fn preview_link(&self, id: &str, port: u16) -> Result<PreviewLink, CoreError> {
        if port == 0 {
            return Err(CoreError::InvalidSpec("port must be from 1 to 65535".into()));
        }
        let (expires_at, existing) = {
            let sandboxes = self.inner.lock();
            let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
            (entry.info.expires_at, entry.previews.get(&port).map(Preview::link))
        };
        if let Some(link) = existing {
            return Ok(link);
        }
        let weak = Arc::downgrade(&self.inner);
        let sandbox = id.to_owned();
        let connect = move || -> Result<AgentClient<UnixConnector>, CoreError> {
            let inner = weak.upgrade().ok_or_else(|| CoreError::Expired(sandbox.clone()))?;
            Moat { inner }.client(&sandbox)
        };
        let preview = Preview::start(port, expires_at, Arc::new(connect)).await.map_err(|source| CoreError::Io {
            id: id.into(),
            what: "listening for the preview link".into(),
            source,
        })?;
        let mut sandboxes = self.inner.lock();
        let entry = sandboxes.get_mut(id).ok_or_else(|| CoreError::Expired(id.into()))?;
        Ok(entry.previews.entry(port).or_insert(preview).link())
    }

    /// Starts a process as `user` in `/home/user` unless the request says otherwise.
    /// A `filtered` sandbox's proxy variables come first, then the sandbox's
    /// `env`; the request's own variables override both.
    pub async fn exec(&self, id: &str, mut request: ExecRequest) -> Result<ExecHandle, CoreError> {
        request.user.get_or_insert_with(|| "user".into());
        let spec = self.get(id)?.spec;
        let mut spec_env = spec.env;
        if spec.network == NetworkPolicy::Filtered {
            spec_env = crate::egress::proxy_env().into_iter().chain(spec_env).collect();
        }
        if !spec_env.is_empty() {
            request.env = spec_env.into_iter().chain(std::mem::take(&mut request.env)).collect();
        }
        let client = self.client(id)?;
        match client.exec(request).await {
            Ok(handle) => Ok(handle),
            Err(source) => Err(self.agent_error(id, source).await),
        }
    }

    /// Runs a process to completion and collects its output. In a task's
    /// sandbox, the command goes into the task's execution log.
    /// With a `timeout_ms`, an agent that has not answered
    /// [`ANSWER_GRACE`] past it is [`CoreError::Unresponsive`].
    pub async fn run(&self, id: &str, request: ExecRequest) -> Result<Output, CoreError> {
        let command = command_line(&request);
        let started_at = now();
        let timeout = request.timeout_ms.map(Duration::from_millis);
        let work = async {
            self.exec(id, request)
                .await?
                .output_limited(RUN_OUTPUT_LIMIT)
                .await
                .map_err(|source| CoreError::Agent { id: id.into(), source })
        };
        let output = self.explained(id, answered_within(id, timeout, work).await).await?;
        self.log_command(id, &command, started_at, &output);
        Ok(output)
    }

    /// Runs `code` in sandbox `id` like a notebook cell (see
    /// [`interpreter`](crate::interpreter)): Python in the sandbox's
    /// persistent session, bash and node as one process each. Output text
    /// reaches `on_stream` as it comes. When `cancelled` completes, the
    /// code is interrupted (Python) or killed. Errors of the code are
    /// data in the output; `Err` means the sandbox could not run it.
    pub async fn run_code(
        &self,
        id: &str,
        language: Language,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
    ) -> Result<CodeOutput, CoreError> {
        let started_at = now();
        let output = self.explained(id, self.run_cell(id, language, code, timeout, cancelled, on_stream).await).await?;
        let as_command = Output {
            stdout: output.stdout.clone(),
            stderr: output.stderr.clone(),
            status: moat_proto::ExitStatus {
                code: Some(i32::from(output.error.is_some())),
                signal: None,
                timed_out: output.error.as_ref().is_some_and(|e| e.name == "TimeoutError"),
                duration_ms: now().saturating_sub(started_at) * 1000,
            },
            truncated: output.truncated,
        };
        self.log_command(id, &format!("run_code {language:?}: {code}"), started_at, &as_command);
        Ok(output)
    }

    /// One cell of [`Moat::run_code`], before its errors are explained.
    async fn run_cell(
        &self,
        id: &str,
        language: Language,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
    ) -> Result<CodeOutput, CoreError> {
        Ok(match language {
            Language::Python => {
                let session = {
                    let sandboxes = self.inner.lock();
                    sandboxes.get(id).map(|e| e.python.clone()).ok_or_else(|| self.inner.unknown(id, &sandboxes))?
                };
                let mut session = session.lock().await;
                let running = match session.as_mut() {
                    Some(running) => {
                        // Resumes a suspended sandbox and marks it used.
                        self.client(id)?;
                        running
                    }
                    None => {
                        // Bounded as a command is: the runner is given the
                        // cell's timeout and the grace after it to be ready.
                        let handle =
                            answered_within(id, Some(timeout), self.exec(id, PythonSession::request())).await?;
                        let started = PythonSession::start(handle, timeout.saturating_add(ANSWER_GRACE))
                            .await
                            .map_err(|e| CoreError::CodeSession { id: id.into(), reason: e.to_string() })?;
                        session.insert(started)
                    }
                };
                let (output, alive) = running.execute(code, timeout, cancelled, RUN_OUTPUT_LIMIT, on_stream).await;
                if !alive {
                    *session = None;
                    // The session's end may be the sandbox's.
                    if let Some(failed) = self.settled_failure(id).await {
                        return Err(failed);
                    }
                }
                output
            }
            snippet => {
                let mut request = snippet_request(snippet, code);
                request.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
                // (Python's session bounds its own wait: interrupted at the
                // timeout, dropped when that is not answered.)
                let streamed = answered_within(id, Some(timeout), async {
                    let handle = self.exec(id, request).await?;
                    stream_output(handle, RUN_OUTPUT_LIMIT, cancelled, on_stream)
                        .await
                        .map_err(|source| CoreError::Agent { id: id.into(), source })
                })
                .await?;
                CodeOutput::from_process(streamed, timeout)
            }
        })
    }

    /// Records a finished command in the execution log of the task that
    /// owns sandbox `id`, if one does (for callers that stream with `exec`).
    pub fn log_command(&self, id: &str, command: &str, started_at: u64, output: &Output) {
        let mut tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, log)) = tasks.values_mut().find(|(task, _)| task.sandbox_id == id) {
            let (stdout, cut_out) = task::clip(&output.stdout);
            let (stderr, cut_err) = task::clip(&output.stderr);
            log.push(LogEntry {
                command: command.to_owned(),
                exit_code: output.status.code,
                signal: output.status.signal,
                started_at,
                duration_ms: output.status.duration_ms,
                stdout,
                stderr,
                truncated: cut_out || cut_err,
            });
        }
    }

    /// Imports the project at `path` (inside one of the configured roots)
    /// into `/workspace` of a new sandbox and
    /// commits it as the baseline.
    pub async fn task_start(&self, path: &Path, spec: SandboxSpec) -> Result<Task, CoreError> {
        if let Some(url) = path.to_str().filter(|p| task::is_git_url(p)) {
            return Err(CoreError::ImportRefused(format!(
                "{url} is a Git URL: a task imports a local checkout, and cloning needs network access from the \
                 sandbox; import a local checkout, or create a sandbox with network filtered and use git_clone"
            )));
        }
        let source = self.inner.host.open_source(path)?;
        if source.kind != SourceKind::Dir {
            return Err(CoreError::HostPath(format!(
                "{} is not a directory; give a project directory",
                path.display()
            )));
        }
        let shown = source.shown.clone();
        let repository = hostfs::read_small(&source.fd, ".git/config").and_then(|c| crate::egress::repository_host(&c));
        let sandbox = self.create(spec).await?;
        let id = sandbox.id.clone();
        let result = async {
            let packed = self.send_tree(&id, source, "/workspace", true).await?;
            let baseline = "cd /workspace && git init -q && git add -A && \
                git -c user.name=moat -c user.email=moat@localhost commit -q --allow-empty -m baseline";
            let out = self.exec(&id, ExecRequest::shell(baseline)).await?.output_limited(RUN_OUTPUT_LIMIT).await;
            match out {
                Ok(out) if out.status.success() => {}
                Ok(out) => {
                    return Err(CoreError::StartFailed {
                        id: id.clone(),
                        reason: format!("the baseline commit failed: {}", String::from_utf8_lossy(&out.stderr)),
                    });
                }
                Err(source) => return Err(CoreError::Agent { id: id.clone(), source }),
            }
            Ok(packed)
        }
        .await;
        let packed = match result {
            Ok(packed) => packed,
            Err(e) => {
                let _ = self.destroy(&id).await;
                return Err(e);
            }
        };
        let runtime = task::Runtime::detect(&packed.top);
        if let Some((policy, _)) = self.inner.lock().get(&id).and_then(|e| e.egress.as_ref()) {
            policy.set_runtime(runtime);
            // The checkout's remote is a file the model may have written
            // (copy_from_sandbox into a root): its host is allowed only
            // when the operator allows it anyway.
            if let Some(host) = repository {
                if Grants::hosts(&self.inner.egress).contains(&host) {
                    policy.set_repository_host(host);
                } else {
                    tracing::info!(
                        %host,
                        "the task's repository host is not among the operator's hosts (MOAT_ALLOW_HOSTS, \
                         MOAT_GIT_HOSTS); it stays unreachable"
                    );
                }
            }
        }
        let task = Task {
            id: new_id().replacen("sbx-", "task-", 1),
            sandbox_id: id,
            source: shown.display().to_string(),
            runtime,
            files: packed.files,
            started_at: now(),
        };
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(task.id.clone(), (task.clone(), Vec::new()));
        Ok(task)
    }

    fn task(&self, task_id: &str) -> Result<Task, CoreError> {
        let tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        tasks
            .get(task_id)
            .map(|(t, _)| t.clone())
            .ok_or_else(|| CoreError::UnknownTask { id: task_id.into(), known: tasks.keys().cloned().collect() })
    }

    /// The unified diff of everything changed since the baseline (new and
    /// deleted files included, binary files marked), and its summary.
    pub async fn task_diff(&self, task_id: &str) -> Result<(String, DiffSummary), CoreError> {
        let task = self.task(task_id)?;
        let script = "cd /workspace && git add -A && git -c core.quotepath=off diff --cached --no-color HEAD && \
            echo '@@moat-numstat@@' && git diff --cached --numstat HEAD";
        let out = self.exec(&task.sandbox_id, ExecRequest::shell(script)).await?.output_limited(RUN_OUTPUT_LIMIT).await;
        let out = match out {
            Ok(out) => out,
            Err(source) => return Err(self.agent_error(&task.sandbox_id, source).await),
        };
        if !out.status.success() {
            return Err(CoreError::StartFailed {
                id: task.sandbox_id,
                reason: format!("git diff failed: {}", String::from_utf8_lossy(&out.stderr)),
            });
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (diff, numstat) = text.split_once("@@moat-numstat@@\n").unwrap_or((text.as_str(), ""));
        Ok((diff.to_owned(), DiffSummary::from_numstat(numstat)))
    }

    /// Saves the patch and execution log as a retained record and destroys
    /// the sandbox (unless `keep_sandbox`).
    pub async fn task_finish(&self, task_id: &str, keep_sandbox: bool) -> Result<TaskRecord, CoreError> {
        let (diff, summary) = self.task_diff(task_id).await?;
        let (task, log) = {
            let tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            tasks
                .get(task_id)
                .cloned()
                .ok_or_else(|| CoreError::UnknownTask { id: task_id.into(), known: Vec::new() })?
        };
        let dir = task::tasks_dir(&self.inner.config.data_dir).join(&task.id);
        let record = TaskRecord {
            patch_path: dir.join("patch.diff"),
            log_path: dir.join("log.json"),
            finished_at: now(),
            summary,
            sandbox_kept: keep_sandbox,
            task,
        };
        // The task stays in progress until its whole record is saved: a
        // record that cannot be written (a full disk) is removed, and the
        // call can be repeated once there is room.
        if let Err(e) = self.save_record(&record, &dir, &diff, &log) {
            if dir.exists() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            return Err(e);
        }
        self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(task_id);
        if !keep_sandbox {
            let _ = self.destroy(&record.task.sandbox_id).await;
        }
        Ok(record)
    }

    /// Writes a task's record directory: patch, log, then `record.json`,
    /// which makes it a record ([`task::records`]).
    fn save_record(&self, record: &TaskRecord, dir: &Path, diff: &str, log: &[LogEntry]) -> Result<(), CoreError> {
        let io = |what: &'static str| {
            let id = record.task.id.clone();
            move |source| CoreError::Io { id, what: what.into(), source }
        };
        std::fs::create_dir_all(task::tasks_dir(&self.inner.config.data_dir))
            .map_err(io("creating the task record"))?;
        std::fs::create_dir(dir).map_err(io("creating the task record"))?;
        hostfs::write_new(&record.patch_path, diff.as_bytes()).map_err(io("writing the patch"))?;
        let log_json = serde_json::to_string_pretty(log).unwrap_or_default();
        hostfs::write_new(&record.log_path, log_json.as_bytes()).map_err(io("writing the log"))?;
        let record_json = serde_json::to_string_pretty(record).unwrap_or_default();
        hostfs::write_new(&dir.join("record.json"), record_json.as_bytes()).map_err(io("writing the record"))
    }

    /// Retained task records.
    pub fn task_records(&self) -> Vec<TaskRecord> {
        task::records(&self.inner.config.data_dir)
    }

    pub fn remove_task(&self, task_id: &str) -> Result<(), CoreError> {
        task::remove_record(&self.inner.config.data_dir, task_id)
    }

    /// Suspends a sandbox now (as idleness would).
    pub fn suspend(&self, id: &str) -> Result<(), CoreError> {
        let mut sandboxes = self.inner.lock();
        let Some(entry) = sandboxes.get_mut(id) else { return Err(self.inner.unknown(id, &sandboxes)) };
        if entry.jail.can_suspend() {
            entry.jail.set_suspended(true)?;
            entry.info.state = SandboxState::Paused;
        }
        Ok(())
    }
}

/// Keeps `pool_size` sandboxes of `pool_spec` started.
async fn fill_pool(inner: std::sync::Weak<Inner>, refill: Arc<tokio::sync::Notify>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let pooled = strong.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        if pooled >= strong.config.pool_size {
            // Not holding `strong` while waiting: a dropped Moat must drop.
            drop(strong);
            refill.notified().await;
            continue;
        }
        let spec = strong.config.pool_spec.clone();
        let started = match Image::open(&strong.config.data_dir, &spec.image) {
            Ok(image) => {
                let id = new_id();
                strong.backend.start(&id, &id, &spec, &image, &strong.config.data_dir).await.map(|jail| (id, jail))
            }
            Err(e) => Err(e.into()),
        };
        match started {
            Ok(entry) => strong.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(entry),
            Err(e) => {
                tracing::warn!("cannot fill the sandbox pool: {e}");
                drop(strong);
                // A back-off after a failed start, not a wait for an event.
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

impl Inner {
    /// Refuses a sandbox of `asked` MiB that would bring the live
    /// sandboxes' `memory_mib` over [`Inner::max_memory_mib`]. Pooled
    /// sandboxes count too, unless `pooled_counted` says the new one is
    /// already among them.
    fn check_memory(&self, asked: u64, pooled_counted: bool) -> Result<(), CoreError> {
        let sandboxes = self.lock();
        self.memory_check(&sandboxes, asked, pooled_counted)
    }

    fn memory_check(
        &self,
        sandboxes: &BTreeMap<String, Entry>,
        asked: u64,
        pooled_counted: bool,
    ) -> Result<(), CoreError> {
        let pooled = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        let pooled_mib = self.config.pool_spec.memory_mib.saturating_mul(pooled as u64);
        let live: u64 = sandboxes.values().map(|e| e.info.spec.memory_mib).sum::<u64>().saturating_add(pooled_mib);
        let asked = if pooled_counted { 0 } else { asked };
        crate::limits::check_memory(live, sandboxes.len() + pooled, asked, self.max_memory_mib)
    }

    /// A started sandbox from the pool, if one is ready; the pool refills.
    fn take_pooled(&self) -> Option<(String, Machine)> {
        let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut dead = Vec::new();
        let taken = loop {
            match pool.pop() {
                // One that ended while it waited is not handed out.
                Some((id, mut machine)) => match machine.ended() {
                    Some(reason) => {
                        tracing::warn!(%id, %reason, "a pooled sandbox ended; dropped");
                        dead.push(machine);
                    }
                    None => break Some((id, machine)),
                },
                None => break None,
            }
        };
        drop(pool);
        self.refill.notify_one();
        if !dead.is_empty() {
            tokio::task::spawn_blocking(move || drop(dead));
        }
        taken
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // Each critical section is a map operation: a panic leaves it whole.
        self.sandboxes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn failed(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Sandbox>> {
        self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sandbox `id`'s host process has ended: unless it was being
    /// destroyed (then it is no longer listed), the sandbox failed. It
    /// moves to the failed list, and what it held (cgroups, state
    /// directory, network, previews) is released.
    fn fail(&self, id: &str) {
        let entry = {
            let mut sandboxes = self.lock();
            let Some(reason) = sandboxes.get_mut(id).and_then(|e| e.jail.ended()) else { return };
            let Some(mut entry) = sandboxes.remove(id) else { return };
            entry.info.state = SandboxState::Failed;
            entry.info.failure = Some(reason);
            entry
        };
        tracing::warn!(%id, reason = entry.info.failure.as_deref().unwrap_or_default(), "sandbox failed");
        {
            let mut failed = self.failed();
            failed.insert(id.to_owned(), entry.info.clone());
            while failed.len() > FAILED_KEPT {
                let oldest = failed.values().min_by_key(|s| s.created_at).map(|s| s.id.clone());
                oldest.map(|oldest| failed.remove(&oldest));
            }
        }
        self.failures.notify_waiters();
        // Releasing waits for what is left to die: off the async threads.
        tokio::task::spawn_blocking(move || drop(entry));
    }

    fn unknown(&self, id: &str, sandboxes: &BTreeMap<String, Entry>) -> CoreError {
        if let Some(sandbox) = self.failed().get(id) {
            return CoreError::Failed { id: id.into(), reason: sandbox.failure.clone().unwrap_or_default() };
        }
        let expired = self.expired.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if expired.iter().any(|e| e == id) {
            return CoreError::Expired(id.into());
        }
        CoreError::UnknownSandbox { id: id.into(), known: sandboxes.keys().cloned().collect() }
    }

    /// Expires and suspends sandboxes; runs every second.
    fn lifecycle(&self) {
        let now = now();
        self.failed().retain(|_, s| s.expires_at > now);
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
                // A Python session waiting for its next cell is resident;
                // one running a cell holds its lock.
                let busy = match entry.python.try_lock() {
                    Ok(session) => entry.jail.is_busy(usize::from(session.is_some())),
                    Err(_) => true,
                };
                if idle > 0 && entry.info.state == SandboxState::Running && busy {
                    // A command or server still runs: that is use.
                    entry.info.last_used_at = now;
                    continue;
                }
                if idle > 0
                    && entry.info.state == SandboxState::Running
                    && now.saturating_sub(entry.info.last_used_at) >= idle
                    && entry.jail.can_suspend()
                {
                    match entry.jail.set_suspended(true) {
                        Ok(()) => {
                            entry.info.state = SandboxState::Paused;
                            tracing::debug!(%id, "suspended after being idle");
                        }
                        Err(e) => tracing::warn!(%id, "cannot suspend: {e}"),
                    }
                }
            }
        }
        if !dead.is_empty() {
            // Destroying blocks while processes die: off the async threads.
            tokio::task::spawn_blocking(move || drop(dead));
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let entries = std::mem::take(&mut *self.lock());
        drop(entries);
        let pooled = std::mem::take(&mut *self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        drop(pooled);
        // Wake the pool filler so that it sees this Moat is gone.
        self.refill.notify_one();
    }
}

/// What a request runs, in words, for logs.
pub fn command_line(request: &ExecRequest) -> String {
    match &request.command {
        moat_proto::Command::Shell(script) => script.clone(),
        moat_proto::Command::Argv(argv) => argv.join(" "),
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

/// Collects a process's output (at most `limit` bytes of each stream) while
/// handing each chunk to `on_stream` as it comes. When `cancelled`
/// completes first, the handle is dropped, which kills the process group,
/// and the result is `None`.
pub async fn stream_output(
    mut handle: ExecHandle,
    limit: usize,
    cancelled: impl Future<Output = ()>,
    on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
) -> Result<Option<Output>, moat_proto::ProtoError> {
    async fn next_chunk(rx: &mut Option<tokio::sync::mpsc::Receiver<bytes::Bytes>>) -> Option<bytes::Bytes> {
        match rx {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }
    fn append(buf: &mut Vec<u8>, bytes: &[u8], limit: usize) -> bool {
        let room = limit.saturating_sub(buf.len());
        buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        bytes.len() > room
    }
    let mut stdout = handle.take_stdout();
    let mut stderr = handle.take_stderr();
    let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
    tokio::pin!(cancelled);
    while stdout.is_some() || stderr.is_some() {
        tokio::select! {
            chunk = next_chunk(&mut stdout) => match chunk {
                Some(bytes) => {
                    on_stream(StreamName::Stdout, &bytes);
                    truncated |= append(&mut out, &bytes, limit);
                }
                None => stdout = None,
            },
            chunk = next_chunk(&mut stderr) => match chunk {
                Some(bytes) => {
                    on_stream(StreamName::Stderr, &bytes);
                    truncated |= append(&mut err, &bytes, limit);
                }
                None => stderr = None,
            },
            () = &mut cancelled => return Ok(None),
        }
    }
    let status = handle.wait().await?;
    Ok(Some(Output { stdout: out, stderr: err, status, truncated }))
}

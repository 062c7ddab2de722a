//! [`Moat`]: the entry point for everything that drives sandboxes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moat_proto::{AgentClient, InUse, UnixConnector};

use crate::backend::BackendKind;
use crate::backend::machine::{Machine, Runner, find_vmm};
use crate::error::{ConfigError, CreateError, IoError, SandboxError};
use crate::grants::Grants;
use crate::hostfs::HostRoots;
use crate::image::{Image, ImageBuild};
use crate::interpreter::PythonSession;
use crate::net::egress::{EgressConfig, EgressDecision, EgressProxy, SandboxEgress};
use crate::net::preview::{Preview, PreviewLink};
use crate::sandbox::{NetworkPolicy, Sandbox, SandboxSpec, SandboxState};
use crate::task::{LogEntry, Task};
use crate::timing::now;

mod config;
mod copy;
mod exec;
mod ids;
mod pool;
mod tasks;

use config::choose_backend;
pub use config::{MoatConfig, find_agent};
pub use exec::{COMMAND_OUTPUT_LIMIT, ExecOutcome, RUN_OUTPUT_LIMIT, StreamedCommand};
use ids::new_id;
use pool::fill_pool;

/// How long a call whose agent connection broke waits for the sandbox's
/// host process to be seen ending, to tell a dead sandbox from a dropped
/// connection. A dead sandbox's process ends within milliseconds of its
/// connection; this only bounds the wait.
const FAILURE_SETTLE: Duration = Duration::from_secs(3);

/// How long a runtime's version command may take.
const RUNTIME_PROBE_MS: u64 = 30_000;

/// How long a create at the limits waits for the room a destroyed
/// sandbox's teardown still holds (a teardown takes milliseconds; one
/// whose processes will not die is bounded by the backend's own guards).
const ENDING_WAIT: Duration = Duration::from_secs(30);
/// What is kept of a runtime's version command: its output up to this
/// many bytes, its first lines, and of those joined this many characters.
const PROBE_OUTPUT_LIMIT: usize = 4096;
const PROBE_LINES: usize = 3;
const PROBE_VERSION_CHARS: usize = 200;

/// Failed sandboxes kept for `list` at most; the oldest go first.
const FAILED_KEPT: usize = 64;

/// The longest one file call to an agent ([`Moat::with_agent`]: a read or
/// write of at most a message's 16 MiB, a listing, a move, a removal) may
/// take: far past what any takes, even a recursive removal in a microVM of
/// the nested test host.
pub const AGENT_CALL_GUARD: Duration = Duration::from_secs(300);

/// How many expired sandboxes' ids are kept, to say "expired" rather than
/// "unknown" when one is named again.
const EXPIRED_KEPT: usize = 1024;

struct Entry {
    info: Sandbox,
    /// Network parts, dropped before the sandbox: the egress proxy
    /// (filtered) and the preview links.
    egress: Option<(Arc<SandboxEgress>, EgressProxy)>,
    previews: BTreeMap<u16, Preview>,
    machine: Machine,
    /// The sandbox's Python session for `run_code`, started on first use;
    /// the async lock queues calls on one sandbox.
    python: Arc<tokio::sync::Mutex<Option<PythonSession>>>,
    /// The calls in flight: connections to the agent opened through
    /// [`Moat::client`] (a command waited for, a copy, a preview
    /// connection), each until it closes. A sandbox with none is unused;
    /// what runs in it in the background is not use.
    in_use: InUse,
    /// Its suspend and resume, flipped with no lock of the map held.
    power: Power,
    /// After a suspend failed: not tried again before this time.
    suspend_after: u64,
}

impl Entry {
    /// Whether the sandbox has been unused for its idle time and may be
    /// suspended now. A call in flight is use (a command waited for, a
    /// copy, a preview connection open, a Python cell, which holds its
    /// session's lock); what a sandbox runs in the background is not: a
    /// forgotten sandbox's work stops when the operator's idle time says.
    fn due_to_suspend(&self, now: u64) -> bool {
        let idle = self.info.spec.idle_seconds;
        idle > 0
            && self.info.state == SandboxState::Running
            && !self.busy()
            && now.saturating_sub(self.info.last_used_at) >= idle
            && now >= self.suspend_after
            && self.power.switch.is_some()
    }

    fn busy(&self) -> bool {
        self.in_use.count() > 0 || self.python.try_lock().is_err()
    }
}

/// A sandbox's suspend and resume. Flipping a microVM's waits for its
/// VMM's answer (up to the control socket's bound, seconds): done with the
/// map's lock held, one guest that keeps its VMM busy would stall every
/// sandbox's calls. Each sandbox has a lock of its own for it instead,
/// which only its own callers wait on.
struct Power {
    /// `None`: this sandbox cannot be suspended here.
    switch: Option<crate::backend::PowerSwitch>,
    /// Held while the switch is flipped and the new state recorded.
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Power {
    fn of(machine: &Machine) -> Self {
        Self { switch: machine.power_switch(), lock: Arc::default() }
    }

    /// Whether a suspend or resume is under way.
    fn flipping(&self) -> bool {
        self.lock.try_lock().is_err()
    }
}

/// Flips `switch` on a blocking thread (a VMM's answer is waited for).
async fn flip(id: &str, switch: crate::backend::PowerSwitch, suspended: bool) -> Result<(), SandboxError> {
    let what = if suspended { "suspending" } else { "resuming" };
    Ok(tokio::task::spawn_blocking(move || switch(suspended)).await.map_err(|e| joined(id, what, e))??)
}

/// The error of a task moat started for sandbox or task `id` (a resume, a
/// record written on a blocking thread) that panicked or was cancelled.
pub(crate) fn joined(id: &str, what: &str, e: tokio::task::JoinError) -> IoError {
    IoError { id: id.into(), what: what.into(), source: std::io::Error::other(e) }
}

/// Sandboxes destroyed whose teardown (their processes killed and
/// waited for, their cgroups and state removed) goes on off the caller's
/// path: held against the limits until it ends, and waited for by
/// [`Moat::settled`], [`Moat::destroy_all`] and [`Moat::close`].
#[derive(Default)]
struct Ending {
    /// How many, and the memory they hold (as [`Inner::charged_mib`]).
    held: Mutex<(usize, u64)>,
    /// Told each time one ends.
    done: tokio::sync::Notify,
}

impl Ending {
    fn held(&self) -> (usize, u64) {
        // Each critical section is two additions: a panic leaves it whole.
        *self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Gives back what a background teardown held once it is over, however
/// it ends (a teardown that panicked ends too).
struct Ended {
    ending: Arc<Ending>,
    refill: Arc<tokio::sync::Notify>,
    count: usize,
    mib: u64,
}

impl Drop for Ended {
    fn drop(&mut self) {
        {
            let mut held = self.ending.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            held.0 = held.0.saturating_sub(self.count);
            held.1 = held.1.saturating_sub(self.mib);
        }
        self.ending.done.notify_waiters();
        // The pool may have waited for this room.
        self.refill.notify_one();
    }
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
    /// Held while a task record is checked against the records' limit and
    /// written.
    saving_record: Mutex<()>,
    /// Started sandboxes waiting to be handed out, by id.
    pool: Mutex<Vec<(String, Machine, ImageBuild)>>,
    /// The most the live sandboxes' memory (see [`Inner::charged_mib`])
    /// may add up to (`MOAT_MAX_MEMORY_MIB`; see [`crate::limits`]).
    max_memory_mib: u64,
    /// Creates admitted and not yet live: how many, and their memory.
    /// Taken only while `sandboxes` is held (lock order: `sandboxes`,
    /// then this), so admission is one step however many creates run.
    reserved: Mutex<(usize, u64)>,
    /// Destroyed sandboxes still being torn down.
    ending: Arc<Ending>,
    refill: Arc<tokio::sync::Notify>,
    /// Set by [`Moat::close`]: a create that finishes afterwards destroys
    /// its sandbox instead of keeping it, so none outlives its owner.
    closing: std::sync::atomic::AtomicBool,
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
    pub async fn new(config: MoatConfig) -> Result<Self, ConfigError> {
        let host = HostRoots::open(&config.roots, &config.data_dir, config.copy_limit)?;
        if config.pool_size > 0 {
            config.grants.check(&config.pool_spec, &config.egress)?;
        }
        let max_memory_mib = match config.max_memory_mib {
            Some(mib) => mib,
            None => crate::limits::max_memory_mib_from_env()?,
        };
        let backend = choose_backend(&config)?;
        tracing::info!(backend = %backend.kind(), "sandboxes run in this backend");
        if backend.kind() == BackendKind::Jail && !config.agent.is_file() {
            return Err(ConfigError::AgentMissing(config.agent.display().to_string()));
        }
        // Beside the first creates, not before them (see `state::sweep`).
        let (data_dir, agent) = (config.data_dir.clone(), config.agent.clone());
        tokio::task::spawn_blocking(move || {
            let sweeper = crate::backend::jail::sweeper_for(&agent, &crate::hostuser::HostUser::current(), &data_dir);
            let swept = crate::state::sweep(&data_dir, sweeper.ok().flatten().as_ref());
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
            saving_record: Mutex::new(()),
            pool: Mutex::new(Vec::new()),
            max_memory_mib,
            reserved: Mutex::new((0, 0)),
            ending: Arc::default(),
            refill: Arc::new(tokio::sync::Notify::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
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
                // Each apart: one sandbox's slow suspend holds up no other's.
                for id in inner.lifecycle() {
                    let inner = inner.clone();
                    tokio::spawn(async move { inner.suspend(&id, false).await });
                }
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

    /// Reads an SSH private key for a clone (see
    /// [`HostRoots::read_ssh_key`]): beneath `~/.ssh` or a shared root.
    pub fn read_ssh_key(&self, path: &std::path::Path) -> Result<Vec<u8>, crate::HostPathError> {
        self.inner.host.read_ssh_key(path)
    }

    /// What the operator grants the specs of [`Moat::create`].
    pub fn grants(&self) -> &Grants {
        &self.inner.config.grants
    }

    /// Creates a sandbox and waits until its agent answers. A spec that
    /// asks for more than [`Moat::grants`] is refused.
    pub async fn create(&self, spec: SandboxSpec) -> Result<Sandbox, CreateError> {
        spec.validate()?;
        self.inner.config.grants.check(&spec, &self.inner.egress)?;
        let max = self.inner.config.max_sandboxes;
        // Admitted, with its memory held, before it starts: concurrent
        // creates never start more sandboxes than the limits allow. Room
        // that a destroyed sandbox's teardown still holds comes back within
        // moments: waited for, not refused.
        let Admitted { reservation, pooled, evicted } = loop {
            let done = self.inner.ending.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            match self.inner.reserve(&spec, Admit::Create) {
                Err(full) if self.inner.ending.held().0 > 0 => {
                    if tokio::time::timeout(ENDING_WAIT, done).await.is_err() {
                        return Err(full);
                    }
                }
                reserved => break reserved?,
            }
        };
        if let Some(evicted) = evicted {
            // Its place is this create's now: it is gone before this
            // sandbox starts, so no more than the limit ever run.
            let _ = tokio::task::spawn_blocking(move || drop(evicted)).await;
        }
        let (id, name, machine, build) = match pooled {
            Some((id, machine, build)) => (id.clone(), id, machine, build),
            None => {
                let image = Image::open_ref(&self.inner.config.data_dir, &spec.image)?;
                let id = new_id();
                let name = spec.name.clone().unwrap_or_else(|| id.clone());
                let machine = self.inner.start_machine(&id, &name, &spec, &image).await?;
                (id, name, machine, image.build())
            }
        };
        let egress = match spec.network {
            NetworkPolicy::Filtered => {
                let log = Some(crate::state::sandboxes_dir(&self.inner.config.data_dir).join(&id).join("egress.log"));
                let policy = Arc::new(SandboxEgress::new(self.inner.egress.clone(), spec.allow_hosts.clone(), log));
                if let Some(runtime) = spec.runtime {
                    policy.set_runtime(runtime);
                }
                // Bounded as every wait on an agent is: a guest that never
                // answers fails the create instead of holding it.
                let started = crate::timing::within(
                    &id,
                    crate::timing::ANSWER_GRACE,
                    EgressProxy::start(machine.client(), policy.clone()),
                )
                .await;
                match started {
                    Ok(Ok(proxy)) => Some((policy, proxy)),
                    Ok(Err(source)) => {
                        let _ = tokio::task::spawn_blocking(move || drop(machine)).await;
                        return Err(CreateError::Agent { id, source });
                    }
                    Err(silent) => {
                        let _ = tokio::task::spawn_blocking(move || drop(machine)).await;
                        return Err(CreateError::StartFailed {
                            id,
                            reason: format!("its agent did not start the egress proxy: {silent}"),
                        });
                    }
                }
            }
            NetworkPolicy::None | NetworkPolicy::Open => None,
        };
        let created = now();
        let info = Sandbox {
            id: id.clone(),
            name,
            image: crate::image::parse_ref(&spec.image).map_or(spec.image.as_str(), |(name, _)| name).to_owned(),
            image_version: build.version,
            image_built: build.built,
            backend: self.inner.backend.kind().to_string(),
            state: SandboxState::Running,
            created_at: created,
            last_used_at: created,
            expires_at: created + spec.timeout_seconds,
            failure: None,
            runtime: spec.runtime,
            runtime_version: None,
            spec,
        };
        let rejected = {
            let mut sandboxes = self.inner.lock();
            // Checked again without its own reservation: the pool may have
            // grown meanwhile.
            drop(reservation);
            let memory = self.inner.memory_check(&sandboxes, &info.spec);
            if self.inner.closing.load(std::sync::atomic::Ordering::SeqCst) {
                Some((machine, Some(closing(&id))))
            } else if self.inner.count(&sandboxes) >= max || memory.is_err() {
                Some((machine, memory.err()))
            } else {
                self.watch_exit(&id, &machine);
                let entry = Entry {
                    info: info.clone(),
                    egress,
                    previews: BTreeMap::new(),
                    power: Power::of(&machine),
                    machine,
                    python: Arc::default(),
                    in_use: InUse::default(),
                    suspend_after: 0,
                };
                sandboxes.insert(id, entry);
                None
            }
        };
        if let Some((machine, memory)) = rejected {
            let _ = tokio::task::spawn_blocking(move || drop(machine)).await;
            return Err(memory.unwrap_or(CreateError::LimitReached { max }));
        }
        let Some(runtime) = info.runtime else { return Ok(info) };
        match self.runtime_version(&info.id, runtime).await {
            Ok(version) => Ok(Sandbox { runtime_version: Some(version), ..info }),
            Err(why) => {
                let _ = self.destroy(&info.id).await;
                Err(CreateError::StartFailed {
                    id: info.id,
                    reason: format!(
                        "the image {} has no {} toolchain ({why}); use the default image, or another runtime",
                        info.image,
                        runtime.as_str()
                    ),
                })
            }
        }
    }

    /// The version of `runtime`'s toolchain in sandbox `id` (the first
    /// lines of its version command, joined), recorded in its listing; the
    /// reason when the command fails.
    pub async fn runtime_version(&self, id: &str, runtime: crate::runtime::Runtime) -> Result<String, String> {
        let mut request = moat_proto::ExecRequest::shell(runtime.version_command());
        request.timeout_ms = Some(RUNTIME_PROBE_MS);
        request.output_limit = Some(PROBE_OUTPUT_LIMIT as u64);
        // Not through `run`: no task log records moat's own probe. Bounded
        // in time and size as a command is: what the sandbox prints as its
        // version goes into its listing and its task's record.
        let probe = async {
            match self.exec(id, request).await?.output_limited(PROBE_OUTPUT_LIMIT).await {
                Ok(out) => Ok(out),
                Err(source) => Err(self.agent_error(id, source).await),
            }
        };
        let out = exec::answered_within(id, Some(Duration::from_millis(RUNTIME_PROBE_MS)), probe)
            .await
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            let said = String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default().trim().to_owned();
            return Err(format!("`{}` failed: {said}", runtime.version_command()));
        }
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .take(PROBE_LINES)
            .collect::<Vec<_>>()
            .join(", ");
        let version: String = version.chars().take(PROBE_VERSION_CHARS).collect();
        if let Some(entry) = self.inner.lock().get_mut(id) {
            entry.info.runtime = Some(runtime);
            entry.info.runtime_version = Some(version.clone());
        }
        Ok(version)
    }

    /// The live sandboxes and the failed ones (state `failed`, with why).
    pub fn list(&self) -> Vec<Sandbox> {
        // Both read under the live map's lock, so that a sandbox failing
        // meanwhile is seen in one of them (see `Inner::fail`).
        let live = self.inner.lock();
        let mut all: Vec<Sandbox> = live.values().map(|e| e.info.clone()).collect();
        all.extend(self.inner.failed().values().cloned());
        drop(live);
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        all
    }

    /// A live sandbox; a failed one is [`SandboxError::Failed`].
    pub fn get(&self, id: &str) -> Result<Sandbox, SandboxError> {
        let sandboxes = self.inner.lock();
        sandboxes.get(id).map(|e| e.info.clone()).ok_or_else(|| self.inner.unknown(id, &sandboxes))
    }

    /// Destroys a sandbox, or forgets a failed one.
    pub async fn destroy(&self, id: &str) -> Result<(), SandboxError> {
        let entry = {
            let mut sandboxes = self.inner.lock();
            match sandboxes.remove(id) {
                Some(entry) => entry,
                None if self.inner.failed().remove(id).is_some() => return Ok(()),
                None => return Err(self.inner.unknown(id, &sandboxes)),
            }
        };
        self.inner.end_tasks_of(id);
        // The answer does not wait for the teardown: it goes on in the
        // background, held against the limits until it ends.
        self.inner.end_in_background(vec![entry]);
        Ok(())
    }

    /// Waits until every destroyed sandbox's teardown has ended: its
    /// processes gone, its cgroups and state directory removed.
    pub async fn settled(&self) {
        loop {
            let done = self.inner.ending.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.inner.ending.held().0 == 0 {
                return;
            }
            done.await;
        }
    }

    /// The host process sandbox `id` lives in (its jail's monitor, or
    /// moat-vmm), for tests that kill it.
    #[doc(hidden)]
    pub fn host_pid(&self, id: &str) -> Result<u32, SandboxError> {
        let sandboxes = self.inner.lock();
        sandboxes.get(id).map(|e| e.machine.host_pid()).ok_or_else(|| self.inner.unknown(id, &sandboxes))
    }

    /// Runs `op` with a client of sandbox `id`'s agent (see [`Moat::client`]);
    /// its errors as [`Moat::agent_error`] says. An agent that has not
    /// answered within [`AGENT_CALL_GUARD`] is [`SandboxError::Unresponsive`]:
    /// a microVM's guest may replace its agent with one that never
    /// answers, and the caller's call (and its place among a session's
    /// calls) must not wait for ever.
    pub async fn with_agent<T, F>(
        &self,
        id: &str,
        op: impl FnOnce(AgentClient<UnixConnector>) -> F,
    ) -> Result<T, SandboxError>
    where
        F: Future<Output = Result<T, moat_proto::ProtoError>>,
    {
        let client = self.client(id).await?;
        match crate::timing::within(id, AGENT_CALL_GUARD, op(client)).await? {
            Ok(value) => Ok(value),
            Err(source) => Err(self.agent_error(id, source).await),
        }
    }

    /// What an error of sandbox `id`'s agent means: when the connection was
    /// lost because the sandbox died (its agent, jail or microVM ended),
    /// [`SandboxError::Failed`], once its host process is seen ending (within
    /// [`FAILURE_SETTLE`]); otherwise [`SandboxError::Agent`].
    pub async fn agent_error(&self, id: &str, source: moat_proto::ProtoError) -> SandboxError {
        if !source.is_lost_connection() {
            return SandboxError::Agent { id: id.into(), source };
        }
        self.settled_failure(id).await.unwrap_or(SandboxError::Agent { id: id.into(), source })
    }

    /// [`SandboxError::Failed`] (or the error of a sandbox destroyed
    /// meanwhile) when sandbox `id` is seen to have ended within
    /// [`FAILURE_SETTLE`]; `None` while it runs on.
    async fn settled_failure(&self, id: &str) -> Option<SandboxError> {
        let settle = async {
            loop {
                let failed = self.inner.failures.notified();
                tokio::pin!(failed);
                // Registered before looking, so that a failure between the
                // look and the wait still wakes it.
                failed.as_mut().enable();
                if let Some(sandbox) = self.inner.failed().get(id) {
                    return Some(SandboxError::Failed {
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

    /// `result`, with its error explained by [`Moat::explain`].
    async fn explained<T>(&self, id: &str, result: Result<T, SandboxError>) -> Result<T, SandboxError> {
        match result {
            Err(error) => Err(self.explain(id, error).await),
            ok => ok,
        }
    }

    /// `error` of sandbox `id`, with a lost agent connection explained by
    /// [`Moat::agent_error`], and a Python session that broke because the
    /// sandbox failed told as that failure.
    async fn explain(&self, id: &str, error: SandboxError) -> SandboxError {
        match error {
            SandboxError::Agent { source, .. } if source.is_lost_connection() => self.agent_error(id, source).await,
            error @ SandboxError::CodeSession { .. } => self.settled_failure(id).await.unwrap_or(error),
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
            if crate::process::Exited::exited(exit).await.is_ok()
                && let Some(inner) = inner.upgrade()
            {
                inner.fail(&id);
            }
        });
    }

    /// Destroys every sandbox, as [`Moat::destroy_all`], and every one whose
    /// create finishes afterwards: for an owner that is about to exit.
    pub async fn close(&self) {
        self.inner.closing.store(true, std::sync::atomic::Ordering::SeqCst);
        self.destroy_all().await;
    }

    /// Destroys every sandbox, pooled ones included, and forgets failed ones.
    pub async fn destroy_all(&self) {
        self.inner.failed().clear();
        let entries: Vec<Entry> = std::mem::take(&mut *self.inner.lock()).into_values().collect();
        for entry in &entries {
            self.inner.end_tasks_of(&entry.info.id);
        }
        let pooled = std::mem::take(&mut *self.inner.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        tokio::task::spawn_blocking(move || drop((entries, pooled))).await.ok();
        self.settled().await;
    }

    /// A client of the sandbox's agent, after marking it used and resuming
    /// it if it was suspended.
    ///
    /// Only this sandbox's callers wait for its resume (or for a suspend
    /// under way to finish first); the map of sandboxes is never locked
    /// across one.
    pub async fn client(&self, id: &str) -> Result<AgentClient<UnixConnector>, SandboxError> {
        {
            let mut sandboxes = self.inner.lock();
            if !sandboxes.contains_key(id) {
                return Err(self.inner.unknown(id, &sandboxes));
            }
            let entry = sandboxes.get_mut(id).ok_or_else(|| SandboxError::Expired(id.into()))?;
            // Marked used first: an idle suspend that has not yet looked
            // again (under this lock) now finds it used and leaves it.
            entry.info.last_used_at = now();
            if entry.info.state == SandboxState::Running && !entry.power.flipping() {
                return Ok(entry.machine.client().counted(entry.in_use.clone()));
            }
        }
        // In a task of its own: a caller that goes away mid-resume leaves
        // it finished and recorded, never a sandbox running that is listed
        // as paused (and so never suspended again).
        let (inner, owned) = (self.inner.clone(), id.to_owned());
        tokio::spawn(async move { inner.resume(&owned).await }).await.map_err(|e| joined(id, "resuming", e))?
    }

    /// [`Moat::client`], its connections not counted as use: for what stays
    /// connected while nothing is asked of it (a Python session waiting for
    /// its next cell).
    pub(crate) async fn resident_client(&self, id: &str) -> Result<AgentClient<UnixConnector>, SandboxError> {
        let client = self.client(id).await?;
        Ok(AgentClient::new(UnixConnector { in_use: None, ..client.connector().clone() }))
    }

    /// The newest egress decisions of a `filtered` sandbox (empty for others).
    pub fn egress_log(&self, id: &str) -> Result<Vec<EgressDecision>, SandboxError> {
        let sandboxes = self.inner.lock();
        let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
        Ok(entry.egress.as_ref().map(|(policy, _)| policy.log()).unwrap_or_default())
    }

    /// The host entries a `filtered` sandbox may reach (empty for others):
    /// names, on ports 443 and 80, and `host:port` entries.
    pub fn allowed_hosts(&self, id: &str) -> Result<Vec<String>, SandboxError> {
        let sandboxes = self.inner.lock();
        let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
        Ok(entry.egress.as_ref().map(|(policy, _)| policy.allowed_hosts().into_iter().collect()).unwrap_or_default())
    }

    /// A link to `port` in sandbox `id` (on the host's loopback, or where
    /// [`MoatConfig::preview`] says), until the sandbox ends. Its token
    /// opens it once; asking again for the same port gives the same
    /// listener with a new token.
    pub async fn preview_link(&self, id: &str, port: u16) -> Result<PreviewLink, SandboxError> {
        if port == 0 {
            return Err(SandboxError::InvalidPort);
        }
        let io = |source| IoError { id: id.into(), what: "making the preview link's token".into(), source };
        let (expires_at, existing) = {
            let sandboxes = self.inner.lock();
            let entry = sandboxes.get(id).ok_or_else(|| self.inner.unknown(id, &sandboxes))?;
            (entry.info.expires_at, entry.previews.get(&port).map(Preview::new_link))
        };
        if let Some(link) = existing {
            return Ok(link.map_err(io)?);
        }
        let too_many = |previews: &BTreeMap<u16, Preview>| {
            (previews.len() >= crate::net::preview::MAX_LINKS).then(|| SandboxError::TooManyPreviews {
                id: id.into(),
                max: crate::net::preview::MAX_LINKS,
                ports: previews.keys().map(u16::to_string).collect::<Vec<_>>().join(", "),
            })
        };
        if let Some(refused) = self.inner.lock().get(id).and_then(|entry| too_many(&entry.previews)) {
            return Err(refused);
        }
        let weak = Arc::downgrade(&self.inner);
        let sandbox = id.to_owned();
        let connect: crate::net::preview::Connect = Arc::new(move || {
            let (weak, sandbox) = (weak.clone(), sandbox.clone());
            Box::pin(async move {
                let inner = weak.upgrade().ok_or_else(|| SandboxError::Expired(sandbox.clone()))?;
                Moat { inner }.client(&sandbox).await
            })
        });
        let preview = Preview::start(port, expires_at, &self.inner.config.preview, connect)
            .await
            .map_err(|source| IoError { id: id.into(), what: "listening for the preview link".into(), source })?;
        let mut sandboxes = self.inner.lock();
        let entry = sandboxes.get_mut(id).ok_or_else(|| SandboxError::Expired(id.into()))?;
        // Checked again: another call may have added a port meanwhile.
        if !entry.previews.contains_key(&port)
            && let Some(refused) = too_many(&entry.previews)
        {
            return Err(refused);
        }
        Ok(entry.previews.entry(port).or_insert(preview).new_link().map_err(io)?)
    }

    /// Suspends a sandbox now, used or not (idleness waits for no call in
    /// flight); one that cannot be suspended here stays running.
    pub async fn suspend(&self, id: &str) -> Result<(), SandboxError> {
        let (inner, owned) = (self.inner.clone(), id.to_owned());
        tokio::spawn(async move { inner.suspend(&owned, true).await }).await.map_err(|e| joined(id, "suspending", e))?
    }
}

impl Inner {
    /// Starts a sandbox's machine and makes it what every new sandbox is:
    /// the operator's extra CA certificates trusted. One that cannot be
    /// made so is stopped.
    async fn start_machine(
        &self,
        id: &str,
        name: &str,
        spec: &SandboxSpec,
        image: &Image,
    ) -> Result<Machine, CreateError> {
        let machine = self.backend.start(id, name, spec, image, &self.config.data_dir).await?;
        if let Some(ca) = &self.config.extra_ca
            && let Err(why) =
                tokio::time::timeout(crate::timing::ANSWER_GRACE, ca.install(&machine.client())).await.unwrap_or_else(
                    |_| Err(format!("its agent did not answer within {} s", crate::timing::ANSWER_GRACE.as_secs())),
                )
        {
            let _ = tokio::task::spawn_blocking(move || drop(machine)).await;
            let reason = format!("the CA certificates of {} could not be added: {why}", crate::trust::CA_FILE_ENV);
            return Err(CreateError::StartFailed { id: id.into(), reason });
        }
        Ok(machine)
    }

    /// The host memory a sandbox of `spec` may hold: its `memory_mib`, and
    /// for a jail its `disk_mib` too, since a jail's disk is a tmpfs (its
    /// cgroup's limit is the sum). A microVM's disk is a file.
    fn charged_mib(&self, spec: &SandboxSpec) -> u64 {
        match self.backend.kind() {
            BackendKind::Jail => spec.memory_mib.saturating_add(spec.disk_mib),
            BackendKind::Vm | BackendKind::Auto => spec.memory_mib,
        }
    }

    /// The sandboxes that count against `max_sandboxes`: live, pooled,
    /// admitted and being created, and ending (their teardown not over).
    fn count(&self, sandboxes: &BTreeMap<String, Entry>) -> usize {
        let pooled = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        sandboxes.len() + pooled + self.reserved().0 + self.ending.held().0
    }

    /// Admits a sandbox of `spec`: refused when `max_sandboxes` count
    /// already ([`Inner::count`]), or when its memory would bring theirs
    /// over [`Inner::max_memory_mib`]; else holds its place and its memory
    /// until the reservation is dropped. A create of the pool's spec takes
    /// a pooled sandbox here, under the same lock, so its place and memory
    /// move from the pool to the reservation and are never counted twice
    /// or not at all. A create of another spec that only the pool's
    /// sandboxes keep out takes the place of one of them, which the caller
    /// ends before it starts its own.
    fn reserve(&self, spec: &SandboxSpec, admit: Admit) -> Result<Admitted<'_>, CreateError> {
        let sandboxes = self.lock();
        let max = self.config.max_sandboxes;
        let mib = self.charged_mib(spec);
        let hold = || {
            let mut reserved = self.reserved();
            reserved.0 += 1;
            reserved.1 = reserved.1.saturating_add(mib);
            Reservation { inner: self, mib }
        };
        if admit == Admit::Create
            && *spec == self.config.pool_spec
            && let Some(entry) = self.take_pooled()
        {
            return Ok(Admitted { reservation: hold(), pooled: Some(entry), evicted: None });
        }
        let count = self.count(&sandboxes);
        let mut evicted = None;
        if count >= max {
            let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if admit == Admit::Refill || count > max || pool.is_empty() {
                return Err(CreateError::LimitReached { max });
            }
            // The pool is a head start, not a share of the limit.
            evicted = pool.pop();
        }
        if let Err(e) = self.memory_check(&sandboxes, spec) {
            if let Some(entry) = evicted {
                // Not enough memory even in its place: it goes back, started.
                self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(entry);
            }
            return Err(e);
        }
        let evicted = evicted.map(|(id, machine, _)| {
            tracing::info!(%id, "a pooled sandbox makes room for a create of another spec");
            machine
        });
        Ok(Admitted { reservation: hold(), pooled: None, evicted })
    }

    fn reserved(&self) -> std::sync::MutexGuard<'_, (usize, u64)> {
        // Each critical section is two additions: a panic leaves it whole.
        self.reserved.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Refuses a sandbox of `spec` that would bring the memory of the live,
    /// pooled, admitted and ending sandboxes over [`Inner::max_memory_mib`].
    fn memory_check(&self, sandboxes: &BTreeMap<String, Entry>, spec: &SandboxSpec) -> Result<(), CreateError> {
        let pooled = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        let pooled_mib = self.charged_mib(&self.config.pool_spec).saturating_mul(pooled as u64);
        let (admitted, admitted_mib) = *self.reserved();
        let (ending, ending_mib) = self.ending.held();
        let live: u64 = sandboxes
            .values()
            .map(|e| self.charged_mib(&e.info.spec))
            .sum::<u64>()
            .saturating_add(pooled_mib)
            .saturating_add(admitted_mib)
            .saturating_add(ending_mib);
        let asked = self.charged_mib(spec);
        let jail_disk = (self.backend.kind() == BackendKind::Jail).then_some(spec.disk_mib);
        let count = sandboxes.len() + pooled + admitted + ending;
        crate::limits::check_memory(live, count, crate::limits::Asked { mib: asked, jail_disk }, self.max_memory_mib)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // Each critical section is a map operation: a panic leaves it whole.
        self.sandboxes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets the tasks in progress in sandbox `id`, which has ended: a
    /// task is finished only from its live sandbox, and one kept past it
    /// would hold its log (up to [`crate::task::LOG_ENTRIES`] outputs)
    /// for the life of the server.
    fn end_tasks_of(&self, id: &str) {
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|_, (task, _)| task.sandbox_id != id);
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
            let Some(reason) = sandboxes.get_mut(id).and_then(|e| e.machine.ended()) else { return };
            let Some(mut entry) = sandboxes.remove(id) else { return };
            entry.info.state = SandboxState::Failed;
            entry.info.failure = Some(reason);
            // Listed as failed before the live map's lock is let go: a
            // caller looking in between would find the sandbox in neither
            // and be told it does not exist. (Lock order: live, then failed.)
            let mut failed = self.failed();
            failed.insert(id.to_owned(), entry.info.clone());
            while failed.len() > FAILED_KEPT {
                let oldest = failed.values().min_by_key(|s| s.created_at).map(|s| s.id.clone());
                oldest.map(|oldest| failed.remove(&oldest));
            }
            entry
        };
        tracing::warn!(%id, reason = entry.info.failure.as_deref().unwrap_or_default(), "sandbox failed");
        self.end_tasks_of(id);
        self.failures.notify_waiters();
        // Releasing waits for what is left to die: off the async threads.
        self.end_in_background(vec![entry]);
    }

    /// Tears `entries` down off the async threads (teardown waits for
    /// processes to die), each held against the limits until its own is
    /// over: one whose teardown is slow (processes that take the stop
    /// grace, a large overlay to delete) holds back no other's room.
    fn end_in_background(&self, entries: Vec<Entry>) {
        for entry in entries {
            let (count, mib) = (1, self.charged_mib(&entry.info.spec));
            {
                let mut held = self.ending.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                held.0 += count;
                held.1 = held.1.saturating_add(mib);
            }
            let ended = Ended { ending: self.ending.clone(), refill: self.refill.clone(), count, mib };
            tokio::task::spawn_blocking(move || {
                drop(entry);
                drop(ended);
            });
        }
    }

    fn unknown(&self, id: &str, sandboxes: &BTreeMap<String, Entry>) -> SandboxError {
        if let Some(sandbox) = self.failed().get(id) {
            return SandboxError::Failed { id: id.into(), reason: sandbox.failure.clone().unwrap_or_default() };
        }
        let expired = self.expired.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if expired.iter().any(|e| e == id) {
            return SandboxError::Expired(id.into());
        }
        SandboxError::UnknownSandbox { id: id.into(), known: sandboxes.keys().cloned().collect() }
    }

    /// Sandbox `id`'s power lock (see [`Power`]).
    fn power_lock(&self, id: &str) -> Result<Arc<tokio::sync::Mutex<()>>, SandboxError> {
        let sandboxes = self.lock();
        let Some(entry) = sandboxes.get(id) else { return Err(self.unknown(id, &sandboxes)) };
        Ok(entry.power.lock.clone())
    }

    /// Resumes sandbox `id` if it is paused (after a suspend under way),
    /// holding its power lock until the new state is recorded; then a
    /// client of its agent, as [`Moat::client`].
    async fn resume(&self, id: &str) -> Result<AgentClient<UnixConnector>, SandboxError> {
        let lock = self.power_lock(id)?;
        let _power = lock.lock().await;
        let switch = {
            let mut sandboxes = self.lock();
            let Some(entry) = sandboxes.get_mut(id) else { return Err(self.unknown(id, &sandboxes)) };
            entry.info.last_used_at = now();
            match (entry.info.state, entry.power.switch.clone()) {
                (SandboxState::Paused, Some(switch)) => switch,
                _ => return Ok(entry.machine.client().counted(entry.in_use.clone())),
            }
        };
        flip(id, switch, false).await?;
        let mut sandboxes = self.lock();
        let Some(entry) = sandboxes.get_mut(id) else { return Err(self.unknown(id, &sandboxes)) };
        entry.info.state = SandboxState::Running;
        entry.info.last_used_at = now();
        tracing::debug!(%id, "resumed");
        Ok(entry.machine.client().counted(entry.in_use.clone()))
    }

    /// Suspends sandbox `id`: when `forced`, now (waiting for a resume
    /// under way); else only if it is still due (see
    /// [`Entry::due_to_suspend`]) and no suspend or resume is under way.
    /// Its power lock is held until the new state is recorded, so a call
    /// meanwhile waits and then resumes it.
    async fn suspend(&self, id: &str, forced: bool) -> Result<(), SandboxError> {
        let lock = self.power_lock(id)?;
        let _power = if forced {
            lock.lock().await
        } else {
            let Ok(held) = lock.try_lock() else { return Ok(()) };
            held
        };
        let (switch, idle) = {
            let sandboxes = self.lock();
            let Some(entry) = sandboxes.get(id) else { return Err(self.unknown(id, &sandboxes)) };
            let due = if forced { entry.info.state == SandboxState::Running } else { entry.due_to_suspend(now()) };
            match entry.power.switch.clone().filter(|_| due) {
                Some(switch) => (switch, entry.info.spec.idle_seconds),
                None => return Ok(()),
            }
        };
        let flipped = flip(id, switch, true).await;
        let mut sandboxes = self.lock();
        let Some(entry) = sandboxes.get_mut(id) else { return flipped };
        match &flipped {
            Ok(()) => {
                entry.info.state = SandboxState::Paused;
                tracing::debug!(%id, "suspended");
            }
            Err(e) if !forced => {
                entry.suspend_after = now().saturating_add(idle);
                tracing::warn!(%id, "cannot suspend: {e}; trying again in {idle} s");
            }
            Err(_) => {}
        }
        flipped
    }

    /// Expires sandboxes; runs every second. Returns those due to be
    /// suspended, for [`Inner::suspend`] to suspend each apart.
    fn lifecycle(&self) -> Vec<String> {
        let now = now();
        self.failed().retain(|_, s| s.expires_at > now);
        let mut dead = Vec::new();
        let due = {
            let mut sandboxes = self.lock();
            let expired: Vec<String> =
                sandboxes.iter().filter(|(_, e)| e.info.expires_at <= now).map(|(id, _)| id.clone()).collect();
            for id in expired {
                if let Some(entry) = sandboxes.remove(&id) {
                    tracing::info!(%id, "sandbox expired");
                    dead.push(entry);
                    self.end_tasks_of(&id);
                    let mut expired = self.expired.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    // The newest are named as expired; older ids are unknown.
                    if expired.len() >= EXPIRED_KEPT {
                        expired.remove(0);
                    }
                    expired.push(id);
                }
            }
            for entry in sandboxes.values_mut() {
                if entry.info.state == SandboxState::Running && entry.busy() {
                    entry.info.last_used_at = now;
                }
            }
            sandboxes.iter().filter(|(_, e)| e.due_to_suspend(now)).map(|(id, _)| id.clone()).collect()
        };
        // Destroying blocks while processes die: off the async threads.
        self.end_in_background(dead);
        due
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

/// For tests: makes sandbox `id` expire now and runs the lifecycle pass.
#[doc(hidden)]
pub fn expire_now(moat: &Moat, id: &str) {
    if let Some(entry) = moat.inner.lock().get_mut(id) {
        entry.info.expires_at = now();
    }
    moat.inner.lifecycle();
}

/// For tests: makes sandbox `id` unused for its whole `idle_seconds`,
/// runs the lifecycle pass and the suspends it finds due (it is, unless a
/// call is in flight), and waits for them.
#[doc(hidden)]
pub async fn idle_now(moat: &Moat, id: &str) {
    if let Some(entry) = moat.inner.lock().get_mut(id) {
        entry.info.last_used_at = now().saturating_sub(entry.info.spec.idle_seconds);
    }
    for due in moat.inner.lifecycle() {
        let _ = moat.inner.suspend(&due, false).await;
    }
}

/// For tests: sandbox `id`'s suspend and resume become slow to answer, as
/// a microVM's VMM may be: each flip says it began on the receiver, then
/// waits for a message on (or the drop of) the sender before it acts.
#[doc(hidden)]
pub fn slow_power(moat: &Moat, id: &str) -> (std::sync::mpsc::Sender<()>, tokio::sync::mpsc::UnboundedReceiver<bool>) {
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let (began, flips) = tokio::sync::mpsc::unbounded_channel();
    let wait = Mutex::new(wait);
    if let Some(entry) = moat.inner.lock().get_mut(id)
        && let Some(switch) = entry.power.switch.clone()
    {
        entry.power.switch = Some(Arc::new(move |suspended| {
            let _ = began.send(suspended);
            let _ = wait.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recv();
            switch(suspended)
        }));
    }
    (release, flips)
}

/// The error of a create that finished after [`Moat::close`].
fn closing(id: &str) -> CreateError {
    CreateError::StartFailed {
        id: id.to_owned(),
        reason: "moat is shutting down, so the new sandbox was destroyed; create it again once moat runs".into(),
    }
}

/// How [`Inner::reserve`] admits a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// A create: of the pool's spec, it takes a pooled sandbox if one is
    /// ready; of another, it may take a pooled sandbox's place.
    Create,
    /// The pool's own refill, which never takes one of its own.
    Refill,
}

/// What [`Inner::reserve`] admitted.
struct Admitted<'a> {
    reservation: Reservation<'a>,
    /// A started sandbox from the pool, now the create's.
    pooled: Option<(String, Machine, crate::image::ImageBuild)>,
    /// A pooled sandbox whose place the create takes: ended before the
    /// create starts its own.
    evicted: Option<Machine>,
}

/// A create admitted by [`Inner::reserve`]: its place and memory are held
/// until it is dropped (when the sandbox is live, or its start failed).
struct Reservation<'a> {
    inner: &'a Inner,
    mib: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut reserved = self.inner.reserved();
        reserved.0 = reserved.0.saturating_sub(1);
        reserved.1 = reserved.1.saturating_sub(self.mib);
    }
}

#[cfg(test)]
mod guard_tests {
    use super::*;

    /// An agent that takes the connection and never answers (a microVM's
    /// guest can put one in its agent's place): the call ends at the guard.
    #[tokio::test(start_paused = true)]
    async fn an_agent_that_never_answers_is_unresponsive_at_the_guard() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let silent = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.expect("accept");
            std::future::pending::<()>().await;
            drop(conn);
        });
        let client = AgentClient::unix(&socket);
        let guard = Duration::from_secs(300);
        let started = tokio::time::Instant::now();
        let err = crate::timing::within("sbx-1", guard, client.stat("/etc")).await.expect_err("never answered");
        assert!(matches!(err, SandboxError::Unresponsive { waited_s: 300, .. }), "{err}");
        assert!(err.to_string().contains("did not answer for 300 s"), "{err}");
        assert_eq!(started.elapsed(), guard);
        silent.abort();
    }
}

//! Tasks: a project imported into a sandbox, its diff against the
//! baseline, and the record kept when it finishes.

use std::path::Path;
use std::time::Duration;

use moat_proto::{ExecRequest, Output};

use super::exec::answered_within;
use super::{Inner, Moat, RUN_OUTPUT_LIMIT, joined, new_id};
use crate::error::{CopyError, IoError, TaskError};
use crate::grants::Grants;
use crate::hostfs::{self, SourceKind};
use crate::runtime::Runtime;
use crate::sandbox::SandboxSpec;
use crate::task::{self, DiffSummary, LogEntry, Task, TaskRecord};
use crate::timing::now;

/// The longest one of moat's own git commands in a task's sandbox may run.
/// The sandbox owns its git (its configuration, filters, even the binary),
/// so a command that does not end is stopped, never waited for.
const GIT_TIMEOUT: Duration = Duration::from_secs(300);

/// `git` with what the workspace's configuration could add to a diff turned
/// off: hooks, the file-system monitor, external diff programs and text
/// conversions (they would run, and shape the patch, on every diff).
const GIT: &str = "git -c core.fsmonitor=false -c core.hooksPath=/dev/null -c core.quotepath=off";

impl Moat {
    /// Runs one of moat's own git scripts in task sandbox `id`: bounded in
    /// time and output, outside the task's execution log. Output that
    /// reached the bound, a timeout or a failure is an error naming `what`.
    async fn task_git(&self, id: &str, what: &str, script: String) -> Result<Output, TaskError> {
        let mut request = ExecRequest::shell(script);
        request.cwd = Some("/workspace".into());
        request.env = vec![
            ("GIT_CONFIG_NOSYSTEM".into(), "1".into()),
            ("GIT_CONFIG_GLOBAL".into(), "/dev/null".into()),
            ("GIT_CONFIG_COUNT".into(), "0".into()),
        ];
        request.timeout_ms = Some(GIT_TIMEOUT.as_secs() * 1000);
        request.output_limit = Some(RUN_OUTPUT_LIMIT as u64);
        let work = async {
            let handle = self.exec(id, request).await?;
            match handle.output_limited(RUN_OUTPUT_LIMIT).await {
                Ok(out) => Ok(out),
                Err(source) => Err(self.agent_error(id, source).await),
            }
        };
        let out = answered_within(id, Some(GIT_TIMEOUT), work).await?;
        let failed = |reason: String| Err(TaskError::Git { id: id.into(), reason });
        if out.status.timed_out {
            return failed(format!(
                "{what} did not finish within {} s and was stopped (a git filter or hook in /workspace may \
                 hang); fix the workspace and try again",
                GIT_TIMEOUT.as_secs()
            ));
        }
        if out.truncated || out.status.dropped_bytes > 0 {
            return failed(format!(
                "{what} printed more than {} MiB, more than a task keeps; remove large generated files from \
                 /workspace or list them in its .gitignore, and try again",
                RUN_OUTPUT_LIMIT >> 20
            ));
        }
        if !out.status.success() {
            let (stderr, _) = task::clip(&out.stderr);
            return failed(format!("{what} failed: {}", stderr.trim()));
        }
        Ok(out)
    }

    /// Imports the project at `path` (inside one of the configured roots)
    /// into `/workspace` of a new sandbox and
    /// commits it as the baseline.
    pub async fn task_start(&self, path: &Path, spec: SandboxSpec) -> Result<Task, TaskError> {
        if let Some(url) = path.to_str().filter(|p| task::is_git_url(p)) {
            return Err(TaskError::ImportRefused(format!(
                "{url} is a Git URL: a task imports a local checkout, and cloning needs network access from the \
                 sandbox; import a local checkout, or clone it first and adopt the sandbox (Moat::task_adopt)"
            )));
        }
        let source = self.inner.host.open_source(path).map_err(CopyError::from)?;
        if source.kind != SourceKind::Dir {
            return Err(TaskError::NotADirectory(path.to_owned()));
        }
        let shown = source.shown.clone();
        let repository =
            hostfs::read_small(&source.fd, ".git/config").and_then(|c| crate::net::egress::repository_host(&c));
        let asked = spec.runtime;
        let sandbox = self.create(spec).await?;
        let id = sandbox.id.clone();
        let result = async {
            let packed = self.send_tree(&id, source, "/workspace", true).await?;
            let baseline = format!(
                "{GIT} init -q && {GIT} add -A && \
                 {GIT} -c user.name=moat -c user.email=moat@localhost commit -q --allow-empty --no-verify -m baseline"
            );
            self.task_git(&id, "the baseline commit", baseline).await?;
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
        let task = self.register_task(id, shown.display().to_string(), &packed.top, packed.files, repository, asked);
        Ok(self.with_runtime_version(task).await)
    }

    /// Makes a task of sandbox `id`, whose `/workspace` already holds a Git
    /// checkout (a clone of `source` from `host`): its `HEAD` is the
    /// baseline. The runtime is detected from the checkout's top-level
    /// names unless `runtime` says; a `filtered` sandbox may reach `host`
    /// when the operator allows it.
    pub async fn task_adopt(
        &self,
        id: &str,
        source: &str,
        host: Option<String>,
        runtime: Option<Runtime>,
    ) -> Result<Task, TaskError> {
        // The count comes first: no name in the listing after it can pass
        // for it.
        let script = format!("{GIT} rev-parse --verify -q HEAD >/dev/null && {GIT} ls-files | wc -l && ls -A1");
        let out = self.task_git(id, "reading /workspace as a Git checkout", script).await.map_err(|e| match e {
            TaskError::Git { id, reason } => {
                TaskError::Git { id, reason: format!("/workspace is not a Git checkout ({reason})") }
            }
            other => other,
        })?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut lines = text.lines();
        let files = lines.next().and_then(|count| count.trim().parse().ok()).unwrap_or(0);
        let top: Vec<String> = lines.take(task::MAX_LISTED).map(str::to_owned).collect();
        let task = self.register_task(id.into(), source.into(), &top, files, host, runtime);
        Ok(self.with_runtime_version(task).await)
    }

    /// `task` with the version of its runtime's toolchain (asked of the
    /// sandbox unless its create did), also in the task kept in progress.
    /// A toolchain the image lacks leaves the version unset.
    async fn with_runtime_version(&self, mut task: Task) -> Task {
        let known = self.get(&task.sandbox_id).ok().filter(|s| s.runtime == Some(task.runtime));
        task.runtime_version = match known.and_then(|s| s.runtime_version) {
            Some(version) => Some(version),
            None => self.runtime_version(&task.sandbox_id, task.runtime).await.ok(),
        };
        if let Some((kept, _)) =
            self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_mut(&task.id)
        {
            kept.runtime_version.clone_from(&task.runtime_version);
        }
        task
    }

    /// Records a task in progress for sandbox `id`, and lets a `filtered`
    /// sandbox reach its runtime's registries and its repository host.
    fn register_task(
        &self,
        id: String,
        source: String,
        top: &[String],
        files: u64,
        repository: Option<String>,
        asked: Option<Runtime>,
    ) -> Task {
        let runtime = asked.unwrap_or_else(|| Runtime::detect(top));
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
        let mut task = Task {
            id: new_id().replacen("sbx-", "task-", 1),
            sandbox_id: id,
            source,
            runtime,
            runtime_version: None,
            files,
            started_at: now(),
        };
        let mut tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Ids are short and random: one in progress is never replaced (its
        // log would go to, and its diff be read by, another's caller), nor
        // a retained record's taken (its finish would find the name taken).
        let records = task::tasks_dir(&self.inner.config.data_dir);
        while tasks.contains_key(&task.id) || records.join(&task.id).exists() {
            task.id = new_id().replacen("sbx-", "task-", 1);
        }
        tasks.insert(task.id.clone(), (task.clone(), Vec::new()));
        task
    }

    fn task(&self, task_id: &str) -> Result<Task, TaskError> {
        let tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        tasks
            .get(task_id)
            .map(|(t, _)| t.clone())
            .ok_or_else(|| TaskError::UnknownTask { id: task_id.into(), known: tasks.keys().cloned().collect() })
    }

    /// The unified diff of everything changed since the baseline (new and
    /// deleted files included, binary files marked), and its summary.
    pub async fn task_diff(&self, task_id: &str) -> Result<(String, DiffSummary), TaskError> {
        let task = self.task(task_id)?;
        let id = &task.sandbox_id;
        let flags = "--cached --no-color --no-ext-diff --no-textconv --no-renames HEAD";
        let diff = format!("{GIT} add -A && {GIT} diff {flags}");
        let diff = self.task_git(id, "git diff", diff).await?;
        // The summary is read from the patch itself (up to 64 MiB: on a
        // blocking thread), so it says what the patch holds, whatever the
        // sandbox's git says.
        let summarized = tokio::task::spawn_blocking(move || {
            let patch = String::from_utf8_lossy(&diff.stdout).into_owned();
            let summary = DiffSummary::from_patch(&patch);
            (patch, summary)
        });
        summarized.await.map_err(|e| joined(task_id, "summarizing the patch", e).into())
    }

    /// Saves the patch and execution log as a retained record and destroys
    /// the sandbox (unless `keep_sandbox`).
    pub async fn task_finish(&self, task_id: &str, keep_sandbox: bool) -> Result<TaskRecord, TaskError> {
        let (diff, summary) = self.task_diff(task_id).await?;
        let (task, log) = {
            let tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            tasks
                .get(task_id)
                .cloned()
                .ok_or_else(|| TaskError::UnknownTask { id: task_id.into(), known: Vec::new() })?
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
        // Disk work of a size the sandbox chose (a patch of up to 64 MiB),
        // under a lock every task_finish takes: on a blocking thread, never
        // on one of the async threads that serve every sandbox.
        let (inner, saving) = (self.inner.clone(), record.clone());
        tokio::task::spawn_blocking(move || save_record(&inner, &saving, &dir, &diff, &log))
            .await
            .map_err(|e| joined(&record.task.id, "writing the task record", e))??;
        self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(task_id);
        if !keep_sandbox {
            let _ = self.destroy(&record.task.sandbox_id).await;
        }
        Ok(record)
    }

    /// Retained task records (read on a blocking thread: they may be many,
    /// each up to megabytes of JSON).
    pub async fn task_records(&self) -> Vec<TaskRecord> {
        let data_dir = self.inner.config.data_dir.clone();
        tokio::task::spawn_blocking(move || task::records(&data_dir)).await.unwrap_or_default()
    }

    /// The retained record of task `task_id`, if there is one.
    pub async fn task_record(&self, task_id: &str) -> Option<TaskRecord> {
        let (data_dir, task_id) = (self.inner.config.data_dir.clone(), task_id.to_owned());
        tokio::task::spawn_blocking(move || task::record(&data_dir, &task_id)).await.ok().flatten()
    }

    pub async fn remove_task(&self, task_id: &str) -> Result<(), TaskError> {
        let (data_dir, owned) = (self.inner.config.data_dir.clone(), task_id.to_owned());
        tokio::task::spawn_blocking(move || task::remove_record(&data_dir, &owned))
            .await
            .map_err(|e| joined(task_id, "removing the task record", e))?
    }
}

/// Writes a task's record directory: patch, log, then `record.json`,
/// which makes it a record ([`task::records`]).
fn save_record(inner: &Inner, record: &TaskRecord, dir: &Path, diff: &str, log: &[LogEntry]) -> Result<(), TaskError> {
    let io = |what: &'static str| {
        let id = record.task.id.clone();
        move |source| IoError { id, what: what.into(), source }
    };
    let tasks_dir = task::tasks_dir(&inner.config.data_dir);
    crate::state::private_dir(&tasks_dir).map_err(io("creating the task record"))?;
    // A record never takes the space the file system keeps free: a
    // model finishing tasks in a loop fills no host disk. Refused like
    // a full disk (ENOSPC), which the error explains.
    // What is written, counted as written.
    let log_json = serde_json::to_string_pretty(log).unwrap_or_default();
    let record_json = serde_json::to_string_pretty(record).unwrap_or_default();
    let needed = (diff.len() + log_json.len() + record_json.len()) as u64;
    // One record is saved at a time, so two cannot both pass the check.
    let _saving = inner.saving_record.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    task::room_for_record(&inner.config.data_dir, &record.task.id, needed, inner.config.task_records_limit)?;
    let tasks = std::fs::File::open(&tasks_dir).map_err(io("creating the task record"))?;
    if hostfs::room_left(&tasks).is_some_and(|left| left < needed) {
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        return Err(io("writing the patch (moat keeps 5 % of the disk, at most 1 GiB, free)")(full).into());
    }
    // A directory that is there already is another record's: it is
    // left whole, and only what this call made is removed on failure.
    std::fs::create_dir(dir).map_err(io("creating the task record"))?;
    let written = (|| {
        hostfs::write_new(&record.patch_path, diff.as_bytes()).map_err(io("writing the patch"))?;
        hostfs::write_new(&record.log_path, log_json.as_bytes()).map_err(io("writing the log"))?;
        hostfs::write_new(&dir.join("record.json"), record_json.as_bytes()).map_err(io("writing the record"))
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(dir);
    }
    written.map_err(Into::into)
}

//! The task tools: `task_start`, `task_diff`, `task_finish` and
//! `remove_task`. A session sees only the tasks it started (or, over
//! stdio, every retained record).

use moat_core::SandboxSpec;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use moat_core::NetworkPolicy;

use super::git::{CloneArgs, CloneRequest, clone_into};
use super::{CallContext, Outcome, RichOutcome, Session, Tool, ToolError, clip, plain};

/// The arguments of `task_start`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct TaskStart {
    source: String,
    branch: Option<String>,
    commit: Option<String>,
    username: Option<String>,
    token: Option<String>,
    ssh_key_path: Option<String>,
    name: Option<String>,
    #[schemars(with = "Option<super::sandboxes::RuntimeName>")]
    runtime: Option<moat_core::Runtime>,
}

impl Tool for TaskStart {
    const NAME: &'static str = "task_start";

    async fn run(self, server: &Session<'_>, context: &CallContext) -> RichOutcome {
        plain(task_start(server, self, context).await)
    }
}

/// The arguments of `task_diff`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct TaskDiff {
    task_id: String,
}

impl Tool for TaskDiff {
    const NAME: &'static str = "task_diff";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(task_diff(server, &self.task_id).await)
    }
}

/// The arguments of `task_finish`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct TaskFinish {
    task_id: String,
    keep_sandbox: Option<bool>,
}

impl Tool for TaskFinish {
    const NAME: &'static str = "task_finish";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(task_finish(server, &self.task_id, self.keep_sandbox.unwrap_or(false)).await)
    }
}

/// The arguments of `remove_task`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct RemoveTask {
    task_id: String,
}

impl Tool for RemoveTask {
    const NAME: &'static str = "remove_task";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(remove_task(server, &self.task_id).await)
    }
}

/// Checks that task `id` was started in this session.
fn own_task(server: &Session<'_>, id: &str) -> Result<(), ToolError> {
    if server.scope.sees_task(id) {
        Ok(())
    } else {
        Err(ToolError(format!("No task {id:?} in this session; list_sandboxes shows this session's tasks")))
    }
}

async fn task_start(server: &Session<'_>, args: TaskStart, context: &CallContext) -> Outcome {
    if moat_core::task::is_git_url(&args.source) {
        return task_from_repository(server, args, context).await;
    }
    if let Some(field) = [
        ("branch", &args.branch),
        ("commit", &args.commit),
        ("username", &args.username),
        ("token", &args.token),
        ("ssh_key_path", &args.ssh_key_path),
    ]
    .into_iter()
    .find_map(|(name, value)| value.is_some().then_some(name))
    {
        return Err(ToolError(format!("{field} applies only to a source that is a Git URL (https://HOST/OWNER/REPO)")));
    }
    let spec = SandboxSpec { name: args.name, runtime: args.runtime, ..server.defaults.clone() };
    let place = server.scope.reserve_sandbox().map_err(ToolError)?;
    let task = server.moat.task_start(std::path::Path::new(&args.source), spec).await?;
    place.adopt(&task.sandbox_id, true);
    server.scope.adopt_task(&task.id);
    Ok(task_json(&task))
}

/// `task_start` from a Git URL: the clone is checked as `git_clone`'s
/// (host among `MOAT_GIT_HOSTS`, network granted) before a sandbox is
/// made; the sandbox has the session's default network, `filtered` when
/// that is `none`; the checkout fills `/workspace` and its commit is the
/// baseline. A failed clone leaves no sandbox.
async fn task_from_repository(server: &Session<'_>, args: TaskStart, context: &CallContext) -> Outcome {
    let clone = CloneRequest::check(
        server,
        &CloneArgs {
            url: &args.source,
            path: Some("/workspace"),
            branch: args.branch.as_deref(),
            commit: args.commit.as_deref(),
            username: args.username.as_deref(),
            token: args.token.as_deref(),
            ssh_key_path: args.ssh_key_path.as_deref(),
        },
    )?;
    let mut spec = SandboxSpec { name: args.name, runtime: args.runtime, ..server.defaults.clone() };
    if spec.network == NetworkPolicy::None {
        spec.network = NetworkPolicy::Filtered;
    }
    let place = server.scope.reserve_sandbox().map_err(ToolError)?;
    let sandbox = server.moat.create(spec).await.map_err(moat_core::CoreError::from)?;
    let id = sandbox.id;
    // The session's from the start: a call cut short (its session closed)
    // leaves no sandbox behind the session's end.
    place.adopt(&id, false);
    let adopted = async {
        // A cancelled call stops the clone (see `git_clone`), and the
        // sandbox goes with it below.
        let cloned = tokio::select! {
            cloned = clone_into(server, &clone, &id) => cloned?,
            () = context.cancelled.cancelled() => {
                return Err(ToolError(format!("cancelled: the clone of {} was stopped and its sandbox destroyed", clone.url)));
            }
        };
        let task = server.moat.task_adopt(&id, &args.source, Some(clone.host.clone()), args.runtime).await?;
        Ok::<_, ToolError>((task, cloned))
    };
    let (task, cloned) = match adopted.await {
        Ok(done) => done,
        Err(e) => {
            let _ = server.moat.destroy(&id).await;
            server.scope.forget(&id);
            return Err(e);
        }
    };
    server.scope.adopt(&task.sandbox_id, true);
    server.scope.adopt_task(&task.id);
    let mut value = task_json(&task);
    value["commit"] = cloned["commit"].clone();
    Ok(value)
}

/// What `task_start` returns of a started task.
fn task_json(task: &moat_core::Task) -> serde_json::Value {
    let mut value = json!({
        "task_id": task.id, "sandbox_id": task.sandbox_id, "runtime": task.runtime, "files": task.files,
        "workspace": "/workspace",
    });
    if let Some(version) = &task.runtime_version {
        value["runtime_version"] = json!(version);
    }
    value
}

async fn task_diff(server: &Session<'_>, task_id: &str) -> Outcome {
    own_task(server, task_id)?;
    let (diff, summary) = server.moat.task_diff(task_id).await?;
    let (diff, truncated) = clip(&diff);
    Ok(json!({ "diff": diff, "summary": summary, "truncated": truncated }))
}

async fn task_finish(server: &Session<'_>, task_id: &str, keep_sandbox: bool) -> Outcome {
    own_task(server, task_id)?;
    let record = server.moat.task_finish(task_id, keep_sandbox).await?;
    if !record.sandbox_kept {
        server.scope.forget(&record.task.sandbox_id);
    }
    Ok(json!({
        "task_id": record.task.id, "patch_path": record.patch_path, "log_path": record.log_path,
        "summary": record.summary, "sandbox_kept": record.sandbox_kept,
    }))
}

async fn remove_task(server: &Session<'_>, id: &str) -> Outcome {
    own_task(server, id)?;
    server.moat.remove_task(id).await?;
    server.scope.forget_task(id);
    Ok(json!({ "ok": true, "message": format!("task record {id} removed") }))
}

//! `create_sandbox`, `destroy_sandbox` and `list_sandboxes`.

use std::collections::BTreeMap;

use moat_core::limits::MAX_ARGUMENT_ENTRIES;
use moat_core::{NetworkPolicy, Runtime, SandboxSpec};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{CallContext, Outcome, RichOutcome, Session, Tool, ToolError, in_scope, plain, rfc3339};

/// The network policies by the names the contract gives them (the schema
/// of [`NetworkPolicy`], which core states without `schemars`).
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
#[expect(dead_code, reason = "a schema only: arguments are read as NetworkPolicy")]
enum NetworkName {
    None,
    Filtered,
    Open,
}

/// The runtimes by the names the contract gives them (the schema of
/// [`Runtime`], which core states without `schemars`).
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
#[expect(dead_code, reason = "a schema only: arguments are read as Runtime")]
pub(super) enum RuntimeName {
    Python,
    Node,
    Go,
    Rust,
    Shell,
}

/// The arguments of `create_sandbox`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct CreateSandbox {
    /// 1 to 63 letters, digits or '-', as core's `SandboxSpec::validate`
    /// takes it (it becomes the hostname).
    #[schemars(regex(pattern = "^[A-Za-z0-9][A-Za-z0-9-]{0,62}$"))]
    name: Option<String>,
    image: Option<String>,
    #[schemars(range(min = SandboxSpec::MIN_CPUS, max = SandboxSpec::MAX_CPUS))]
    cpus: Option<u32>,
    #[schemars(range(min = SandboxSpec::MIN_MEMORY_MIB, max = SandboxSpec::MAX_MEMORY_MIB))]
    memory_mib: Option<u64>,
    #[schemars(range(min = SandboxSpec::MIN_DISK_MIB, max = SandboxSpec::MAX_DISK_MIB))]
    disk_mib: Option<u64>,
    #[schemars(with = "Option<NetworkName>")]
    network: Option<NetworkPolicy>,
    #[schemars(length(max = SandboxSpec::MAX_ALLOW_HOSTS))]
    allow_hosts: Option<Vec<String>>,
    #[schemars(extend("maxProperties" = MAX_ARGUMENT_ENTRIES))]
    env: Option<BTreeMap<String, String>>,
    #[schemars(range(min = SandboxSpec::MIN_TIMEOUT_SECONDS, max = SandboxSpec::MAX_TIMEOUT_SECONDS))]
    timeout_seconds: Option<u64>,
    #[schemars(range(min = 0, max = SandboxSpec::MAX_IDLE_SECONDS))]
    idle_seconds: Option<u64>,
    #[schemars(with = "Option<RuntimeName>")]
    runtime: Option<Runtime>,
}

impl Tool for CreateSandbox {
    const NAME: &'static str = "create_sandbox";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(create_sandbox(server, self).await)
    }
}

/// The arguments of `destroy_sandbox`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct DestroySandbox {
    sandbox_id: String,
}

impl Tool for DestroySandbox {
    const NAME: &'static str = "destroy_sandbox";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(destroy_sandbox(server, &self.sandbox_id).await)
    }
}

/// The arguments of `list_sandboxes`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("properties" = {}, "additionalProperties" = false))]
pub(crate) struct ListSandboxes {}

impl Tool for ListSandboxes {
    const NAME: &'static str = "list_sandboxes";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(Ok(list_sandboxes(server).await))
    }
}

fn sandbox_json(server: &Session<'_>, sandbox: &moat_core::Sandbox) -> Value {
    let current = server.scope.current().as_deref() == Some(&sandbox.id);
    let mut value = json!({
        "sandbox_id": sandbox.id,
        "name": sandbox.name,
        "state": sandbox.state,
        "backend": sandbox.backend,
        "image": sandbox.image,
        "image_version": sandbox.image_version,
        "image_built": rfc3339(sandbox.image_built),
        "cpus": sandbox.spec.cpus,
        "memory_mib": sandbox.spec.memory_mib,
        "disk_mib": sandbox.spec.disk_mib,
        "network": sandbox.spec.network,
        "created_at": rfc3339(sandbox.created_at),
        "expires_at": rfc3339(sandbox.expires_at),
        "current": current,
    });
    if let Some(failure) = &sandbox.failure {
        value["failure"] = json!(failure);
    }
    if let Some(runtime) = sandbox.runtime {
        value["runtime"] = json!(runtime);
    }
    if let Some(version) = &sandbox.runtime_version {
        value["runtime_version"] = json!(version);
    }
    value
}

async fn create_sandbox(server: &Session<'_>, args: CreateSandbox) -> Outcome {
    let mut spec = SandboxSpec { name: args.name, ..server.defaults.clone() };
    spec.image = args.image.unwrap_or(spec.image);
    spec.cpus = args.cpus.unwrap_or(spec.cpus);
    spec.memory_mib = args.memory_mib.unwrap_or(spec.memory_mib);
    spec.disk_mib = args.disk_mib.unwrap_or(spec.disk_mib);
    spec.timeout_seconds = args.timeout_seconds.unwrap_or(spec.timeout_seconds);
    spec.idle_seconds = args.idle_seconds.unwrap_or(spec.idle_seconds);
    spec.network = args.network.unwrap_or(spec.network);
    spec.runtime = args.runtime.or(spec.runtime);
    if let Some(hosts) = args.allow_hosts {
        spec.allow_hosts.extend(hosts.iter().map(|host| host.trim().to_ascii_lowercase()));
        if spec.network != NetworkPolicy::Filtered {
            return Err(ToolError(
                "allow_hosts applies to network 'filtered' only; pass network: \"filtered\" with it".into(),
            ));
        }
    }
    spec.env.extend(args.env.into_iter().flatten());
    let place = server.scope.reserve_sandbox().map_err(ToolError)?;
    let sandbox = server.moat.create(spec).await?;
    place.adopt(&sandbox.id, true);
    Ok(sandbox_json(server, &sandbox))
}

async fn destroy_sandbox(server: &Session<'_>, id: &str) -> Outcome {
    // Ownership only: a failed sandbox is destroyed (forgotten) as well.
    in_scope(server, id)?;
    server.moat.destroy(id).await.inspect_err(|_| server.scope.forget(id))?;
    server.scope.forget(id);
    Ok(json!({ "ok": true, "message": format!("sandbox {id} destroyed") }))
}

/// Egress decisions list_sandboxes shows per sandbox (the newest).
const EGRESS_SHOWN: usize = 50;

async fn list_sandboxes(server: &Session<'_>) -> Value {
    let sandboxes: Vec<Value> = server
        .moat
        .list()
        .iter()
        .filter(|s| server.scope.owns(&s.id))
        .map(|s| {
            let mut value = sandbox_json(server, s);
            if s.spec.network == NetworkPolicy::Filtered {
                let log = server.moat.egress_log(&s.id).unwrap_or_default();
                let shown: Vec<Value> = log[log.len().saturating_sub(EGRESS_SHOWN)..]
                    .iter()
                    .map(|d| {
                        json!({
                            "at": rfc3339(d.at), "host": d.host, "port": d.port, "allowed": d.allowed,
                            "address": d.address, "reason": d.reason,
                        })
                    })
                    .collect();
                value["egress"] = json!(shown);
                value["allowed_hosts"] = json!(server.moat.allowed_hosts(&s.id).unwrap_or_default());
            }
            value
        })
        .collect();
    // A session reads its own records only, not every record on the host.
    let records = match server.scope.task_ids() {
        None => server.moat.task_records().await,
        Some(ids) => {
            let mut mine = Vec::new();
            for id in &ids {
                mine.extend(server.moat.task_record(id).await);
            }
            mine.sort_by_key(|r| r.task.started_at);
            mine
        }
    };
    let tasks: Vec<Value> = records
        .iter()
        .filter(|r| server.scope.sees_task(&r.task.id))
        .map(|r| {
            json!({
                "task_id": r.task.id,
                "source": r.task.source,
                "finished_at": rfc3339(r.finished_at),
                "patch_path": r.patch_path,
                "summary": r.summary,
            })
        })
        .collect();
    json!({ "sandboxes": sandboxes, "tasks": tasks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_network_name_of_the_schema_is_a_policy() {
        let schema = schemars::schema_for!(NetworkName);
        let names = schema.get("enum").and_then(Value::as_array).expect("an enum");
        for name in names {
            let name = name.as_str().expect("a name");
            assert_eq!(name.parse::<NetworkPolicy>().map(NetworkPolicy::as_str), Ok(name));
        }
        assert_eq!(names.len(), 3, "none, filtered, open");
    }

    #[test]
    fn the_runtime_names_of_the_schema_are_cores() {
        let schema = schemars::schema_for!(RuntimeName);
        let names: Vec<&str> =
            schema.get("enum").and_then(Value::as_array).expect("an enum").iter().filter_map(Value::as_str).collect();
        assert_eq!(names, Runtime::ALL.map(Runtime::as_str));
    }
}

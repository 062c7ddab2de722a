//! The sandbox model: what a sandbox is asked to be, and what it is.

use serde::{Deserialize, Serialize};

/// What the network of a sandbox may reach, ordered from least to most
/// (the order [`crate::grants::Grants`] caps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NetworkPolicy {
    /// Loopback only.
    #[default]
    None,
    /// Through the agent's proxy to allowed hosts only (see [`crate::net::egress`]).
    Filtered,
    /// Full outbound NAT through pasta (jails) or passt (microVMs; see docs/network.md).
    Open,
}

impl NetworkPolicy {
    /// The policy's name as tool arguments and variables spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Filtered => "filtered",
            Self::Open => "open",
        }
    }
}

impl std::str::FromStr for NetworkPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "filtered" => Ok(Self::Filtered),
            "open" => Ok(Self::Open),
            _ => Err(format!("unknown network policy {s:?}; allowed are none, filtered, open")),
        }
    }
}

/// What a sandbox is asked to be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub name: Option<String>,
    pub image: String,
    pub cpus: u32,
    pub memory_mib: u64,
    pub disk_mib: u64,
    pub network: NetworkPolicy,
    /// Host names this sandbox may reach beyond the server's list (`filtered` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_hosts: Vec<String>,
    /// Added to every process's environment.
    pub env: Vec<(String, String)>,
    /// Hard expiry after creation.
    pub timeout_seconds: u64,
    /// Suspend after this long without use; 0 = never.
    pub idle_seconds: u64,
    /// The toolchain the sandbox is for: under `filtered`, its registries
    /// (instead of Python's and Node's); its version is checked and
    /// reported at create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<crate::runtime::Runtime>,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            name: None,
            image: "default".into(),
            cpus: 1,
            memory_mib: 1024,
            disk_mib: 2048,
            network: NetworkPolicy::None,
            allow_hosts: Vec::new(),
            env: Vec::new(),
            timeout_seconds: 3600,
            idle_seconds: 300,
            runtime: None,
        }
    }
}

/// The bounds of a [`SandboxSpec`], here once: [`SandboxSpec::validate`]
/// checks them and moat-mcp's argument types state them in the tools
/// contract (its contract test fails when `testdata/tools.json` differs).
impl SandboxSpec {
    pub const MIN_CPUS: u32 = 1;
    pub const MAX_CPUS: u32 = 16;
    pub const MIN_MEMORY_MIB: u64 = 128;
    pub const MAX_MEMORY_MIB: u64 = 65_536;
    pub const MIN_DISK_MIB: u64 = 64;
    pub const MAX_DISK_MIB: u64 = 262_144;
    pub const MIN_TIMEOUT_SECONDS: u64 = 60;
    /// Eight hours: the longest a sandbox lives.
    pub const MAX_TIMEOUT_SECONDS: u64 = 28_800;
    /// Idle suspension never comes later than the end of a sandbox's life.
    pub const MAX_IDLE_SECONDS: u64 = Self::MAX_TIMEOUT_SECONDS;
    /// The most extra host names a filtered sandbox may reach.
    pub const MAX_ALLOW_HOSTS: usize = crate::limits::MAX_ARGUMENT_ENTRIES;

    /// Checks every field; the error names the field and what is allowed.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let bad = |field: &str, allowed: &str| Err(InvalidSpec(format!("{field} must be {allowed}")));
        if let Some(name) = &self.name
            && (name.is_empty()
                || name.len() > 63
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                || name.starts_with('-'))
        {
            return bad("name", "1-63 letters, digits or '-' (it becomes the hostname), not starting with '-'");
        }
        if crate::image::parse_ref(&self.image).is_none() {
            return bad("image", crate::image::NAME_RULE);
        }
        let between = |min: &dyn std::fmt::Display, max: &dyn std::fmt::Display| format!("between {min} and {max}");
        if !(Self::MIN_CPUS..=Self::MAX_CPUS).contains(&self.cpus) {
            return bad("cpus", &between(&Self::MIN_CPUS, &Self::MAX_CPUS));
        }
        if !(Self::MIN_MEMORY_MIB..=Self::MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return bad("memory_mib", &between(&Self::MIN_MEMORY_MIB, &Self::MAX_MEMORY_MIB));
        }
        if !(Self::MIN_DISK_MIB..=Self::MAX_DISK_MIB).contains(&self.disk_mib) {
            return bad("disk_mib", &between(&Self::MIN_DISK_MIB, &Self::MAX_DISK_MIB));
        }
        if !(Self::MIN_TIMEOUT_SECONDS..=Self::MAX_TIMEOUT_SECONDS).contains(&self.timeout_seconds) {
            return bad("timeout_seconds", &between(&Self::MIN_TIMEOUT_SECONDS, &Self::MAX_TIMEOUT_SECONDS));
        }
        // At or past `timeout_seconds` is allowed: the sandbox ends first.
        // A short-lived sandbox asked for with the default idle time
        // (`create_sandbox(timeout_seconds: 120)`) was refused otherwise.
        if self.idle_seconds != 0 && !(60..=Self::MAX_IDLE_SECONDS).contains(&self.idle_seconds) {
            return bad("idle_seconds", &format!("0 (never suspend) or 60 to {} seconds", Self::MAX_IDLE_SECONDS));
        }
        if !self.allow_hosts.is_empty() && self.network != NetworkPolicy::Filtered {
            return bad(
                "allow_hosts",
                "empty unless network is filtered (none reaches nothing, open reaches everything)",
            );
        }
        if self.allow_hosts.len() > Self::MAX_ALLOW_HOSTS
            || !self.allow_hosts.iter().all(|h| crate::net::egress::valid_host_entry(h))
        {
            let allowed = format!(
                "at most {} host names such as pypi.org (letters, digits, '-' and '.'; reached on ports 443 and 80), \
                 or host:port entries such as npm.example.com:4873",
                Self::MAX_ALLOW_HOSTS
            );
            return bad("allow_hosts", &allowed);
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
                return bad("env", "NAME=VALUE pairs with a non-empty NAME without '=' or NUL");
            }
        }
        Ok(())
    }
}

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    /// Suspended after being idle; resumes on the next operation.
    Paused,
    Stopped,
    Failed,
}

/// What a sandbox is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub name: String,
    pub image: String,
    /// Which build of the image it runs ([`crate::image::Image::version`]).
    pub image_version: String,
    /// When that build was made, in seconds since the Unix epoch.
    pub image_built: u64,
    pub backend: String,
    pub spec: SandboxSpec,
    pub state: SandboxState,
    /// Seconds since the Unix epoch.
    pub created_at: u64,
    pub last_used_at: u64,
    pub expires_at: u64,
    /// Why a `failed` sandbox ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The runtime it is for (asked for at create, or a task's) and the
    /// version of that toolchain in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<crate::runtime::Runtime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_version: Option<String>,
}

/// A spec field outside what is allowed: the field and what is allowed, in
/// words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSpec(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_validated_field_by_field() {
        assert!(SandboxSpec::default().validate().is_ok());
        let cases = [
            (SandboxSpec { cpus: 0, ..SandboxSpec::default() }, "cpus"),
            (SandboxSpec { image: "../../../../tmp".into(), ..SandboxSpec::default() }, "image"),
            (SandboxSpec { image: "/var/lib".into(), ..SandboxSpec::default() }, "image"),
            (SandboxSpec { memory_mib: 1, ..SandboxSpec::default() }, "memory_mib"),
            (SandboxSpec { timeout_seconds: 10, ..SandboxSpec::default() }, "timeout_seconds"),
            (SandboxSpec { idle_seconds: 30, ..SandboxSpec::default() }, "idle_seconds"),
            (SandboxSpec { idle_seconds: SandboxSpec::MAX_IDLE_SECONDS + 1, ..SandboxSpec::default() }, "idle_seconds"),
            (SandboxSpec { name: Some("bad name".into()), ..SandboxSpec::default() }, "name"),
            (SandboxSpec { env: vec![("A=B".into(), "c".into())], ..SandboxSpec::default() }, "env"),
            (SandboxSpec { allow_hosts: vec!["example.com".into()], ..SandboxSpec::default() }, "allow_hosts"),
            (
                SandboxSpec {
                    network: NetworkPolicy::Filtered,
                    allow_hosts: vec!["http://x".into()],
                    ..SandboxSpec::default()
                },
                "allow_hosts",
            ),
        ];
        for (spec, field) in cases {
            let err = spec.validate().expect_err(field).to_string();
            assert!(err.contains(field), "{err}");
        }
        assert!(SandboxSpec { idle_seconds: 0, ..SandboxSpec::default() }.validate().is_ok());
        // A lifetime shorter than the default idle time: it ends before it
        // would be suspended.
        assert!(SandboxSpec { timeout_seconds: 120, ..SandboxSpec::default() }.validate().is_ok());
    }
}

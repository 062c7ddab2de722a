//! What the operator grants: the ceiling on what a model may ask for.
//!
//! The person who starts moat decides how much network a sandbox may have
//! (`MOAT_ALLOW_NETWORK=none|filtered|open`, default `none`) and which
//! hosts a `filtered` sandbox may reach (`MOAT_ALLOW_HOSTS`, `MOAT_GIT_HOSTS`
//! and the package registries built into [`crate::net::egress`]). A
//! [`SandboxSpec`] — what a tool call asks for — may only ask for something
//! inside that: [`Grants::check`] refuses the rest with a message naming
//! the variable that would allow it. [`Moat::create`](crate::Moat::create)
//! checks every spec, so code that embeds moat-core gets the same ceiling
//! as the MCP server; the `moat` CLI is the operator itself and grants
//! everything ([`Grants::everything`]).

use std::collections::BTreeSet;

use crate::net::egress::{EgressConfig, registries};
use crate::runtime::Runtime;
use crate::sandbox::{NetworkPolicy, SandboxSpec};

/// The variable that sets the network ceiling.
pub const NETWORK_VAR: &str = "MOAT_ALLOW_NETWORK";

/// What the operator allows models to ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grants {
    /// The most network a sandbox may have (`none` < `filtered` < `open`).
    pub network: NetworkPolicy,
}

impl Default for Grants {
    /// Nothing beyond loopback: what a server started without
    /// `MOAT_ALLOW_NETWORK` grants.
    fn default() -> Self {
        Self { network: NetworkPolicy::None }
    }
}

/// `MOAT_ALLOW_NETWORK` holds a value moat does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{NETWORK_VAR}={value:?} is invalid: none, filtered or open (the most network a model may ask for)")]
pub struct GrantsError {
    pub value: String,
}

/// A tool call asked for more than the operator grants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotGranted(pub String);

impl Grants {
    /// Everything: for the operator's own tools (the `moat` CLI) and tests.
    pub fn everything() -> Self {
        Self { network: NetworkPolicy::Open }
    }

    /// `MOAT_ALLOW_NETWORK` from the environment (unset or empty: `none`).
    pub fn from_env() -> Result<Self, GrantsError> {
        Self::from_value(std::env::var(NETWORK_VAR).ok().as_deref())
    }

    /// The grants a value of `MOAT_ALLOW_NETWORK` sets.
    pub fn from_value(value: Option<&str>) -> Result<Self, GrantsError> {
        match value.map(str::trim).filter(|v| !v.is_empty()) {
            None => Ok(Self::default()),
            Some(v) => {
                let network = v.parse::<NetworkPolicy>().map_err(|_| GrantsError { value: v.to_owned() })?;
                Ok(Self { network })
            }
        }
    }

    /// The network policies a model may ask for, lowest first.
    pub fn allowed_networks(&self) -> Vec<NetworkPolicy> {
        [NetworkPolicy::None, NetworkPolicy::Filtered, NetworkPolicy::Open]
            .into_iter()
            .filter(|n| *n <= self.network)
            .collect()
    }

    /// Whether the operator allows `network`.
    pub fn allows_network(&self, network: NetworkPolicy) -> bool {
        network <= self.network
    }

    /// Every host name a `filtered` sandbox may be allowed to reach: the
    /// registries of every runtime, `MOAT_GIT_HOSTS` and `MOAT_ALLOW_HOSTS`.
    pub fn hosts(egress: &EgressConfig) -> BTreeSet<String> {
        let runtimes = [None, Some(Runtime::Python), Some(Runtime::Node), Some(Runtime::Go), Some(Runtime::Rust)];
        runtimes
            .into_iter()
            .flat_map(registries)
            .map(|h| (*h).to_owned())
            .chain(egress.allow_hosts.iter().cloned())
            .chain(egress.git_hosts.iter().cloned())
            .map(|h| h.to_ascii_lowercase())
            .collect()
    }

    /// A refusal of `network`, naming the variable and what it allows.
    pub fn refuse_network(&self, network: NetworkPolicy, why: &str) -> NotGranted {
        let allowed: Vec<String> = self.allowed_networks().iter().map(|n| n.as_str().to_owned()).collect();
        NotGranted(format!(
            "{why} network {:?}, but this server grants at most {:?} ({NETWORK_VAR}={}); ask for one of: {}. \
             Only the operator who starts moat can allow more, by setting {NETWORK_VAR}=none|filtered|open",
            network.as_str(),
            self.network.as_str(),
            self.network.as_str(),
            allowed.join(", ")
        ))
    }

    /// Checks that `spec` asks for nothing beyond the grants: its network
    /// at most [`Grants::network`], its `allow_hosts` among [`Grants::hosts`].
    pub fn check(&self, spec: &SandboxSpec, egress: &EgressConfig) -> Result<(), NotGranted> {
        if !self.allows_network(spec.network) {
            return Err(self.refuse_network(spec.network, "the sandbox asks for"));
        }
        if spec.allow_hosts.is_empty() {
            return Ok(());
        }
        let granted = Self::hosts(egress);
        let outside: Vec<&str> = spec
            .allow_hosts
            .iter()
            .map(String::as_str)
            .filter(|h| !granted.contains(&h.to_ascii_lowercase()))
            .collect();
        if outside.is_empty() {
            return Ok(());
        }
        Err(NotGranted(format!(
            "allow_hosts may only name hosts the operator allows, and {} {} not among them; allowed: {}. \
             Only the operator who starts moat can add hosts, with MOAT_ALLOW_HOSTS",
            outside.join(", "),
            if outside.len() == 1 { "is" } else { "are" },
            granted.into_iter().collect::<Vec<_>>().join(", ")
        )))
    }

    /// One line for `moat doctor` and `moat-mcp --help`.
    pub fn describe(&self, egress: &EgressConfig) -> String {
        let hosts = if self.network == NetworkPolicy::None {
            "no hosts (network none)".to_owned()
        } else {
            format!("filtered sandboxes may reach {}", Self::hosts(egress).into_iter().collect::<Vec<_>>().join(", "))
        };
        let ssh = if egress.ssh_keys { "allowed" } else { "not allowed" };
        format!(
            "network up to {} ({NETWORK_VAR}); {hosts}; SSH keys for clones {ssh} (MOAT_ALLOW_SSH_KEY)",
            self.network.as_str()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(network: NetworkPolicy, hosts: &[&str]) -> SandboxSpec {
        SandboxSpec { network, allow_hosts: hosts.iter().map(|h| (*h).to_owned()).collect(), ..SandboxSpec::default() }
    }

    #[test]
    fn the_default_grants_no_network() {
        let grants = Grants::from_value(None).expect("unset");
        assert_eq!(grants, Grants::default());
        assert_eq!(Grants::from_value(Some("")).expect("empty"), Grants::default());
        let egress = EgressConfig::default();
        assert!(grants.check(&spec(NetworkPolicy::None, &[]), &egress).is_ok());
        for network in [NetworkPolicy::Filtered, NetworkPolicy::Open] {
            let err = grants.check(&spec(network, &[]), &egress).expect_err("above the ceiling").to_string();
            assert!(err.contains("MOAT_ALLOW_NETWORK=none|filtered|open") && err.contains("one of: none"), "{err}");
        }
    }

    #[test]
    fn the_ceiling_orders_none_filtered_open() {
        let egress = EgressConfig::default();
        let filtered = Grants::from_value(Some("filtered")).expect("valid");
        assert!(filtered.check(&spec(NetworkPolicy::Filtered, &[]), &egress).is_ok());
        assert!(filtered.check(&spec(NetworkPolicy::None, &[]), &egress).is_ok());
        let err = filtered.check(&spec(NetworkPolicy::Open, &[]), &egress).expect_err("open is more").to_string();
        assert!(err.contains("grants at most \"filtered\"") && err.contains("none, filtered"), "{err}");
        let open = Grants::from_value(Some("open")).expect("valid");
        assert_eq!(open, Grants::everything());
        assert!(open.check(&spec(NetworkPolicy::Open, &[]), &egress).is_ok());
    }

    #[test]
    fn bad_values_are_refused_with_what_is_allowed() {
        for bad in ["all", "OPEN", "yes", "filtered,open"] {
            let err = Grants::from_value(Some(bad)).expect_err(bad).to_string();
            assert!(err.starts_with("MOAT_ALLOW_NETWORK=") && err.contains("none, filtered or open"), "{err}");
        }
    }

    #[test]
    fn allow_hosts_only_narrow_what_the_operator_allows() {
        let egress = EgressConfig { allow_hosts: vec!["api.example.com".into()], ..EgressConfig::default() };
        let grants = Grants::everything();
        let inside = spec(NetworkPolicy::Filtered, &["api.example.com", "pypi.org", "crates.io"]);
        assert!(grants.check(&inside, &egress).is_ok());
        for outside in ["evil.test", "example.com", "sub.api.example.com"] {
            let err = grants
                .check(&spec(NetworkPolicy::Filtered, &["pypi.org", outside]), &egress)
                .expect_err(outside)
                .to_string();
            assert!(err.contains(outside) && err.contains("MOAT_ALLOW_HOSTS"), "{err}");
            assert!(!err.contains("pypi.org is"), "only the outside host is named: {err}");
        }
        let git = EgressConfig { git_hosts: vec!["git.example.org".into()], ..EgressConfig::default() };
        assert!(grants.check(&spec(NetworkPolicy::Filtered, &["Git.Example.org"]), &git).is_ok());
    }

    #[test]
    fn descriptions_show_the_ceiling_and_hosts() {
        let egress = EgressConfig { allow_hosts: vec!["api.example.com".into()], ..EgressConfig::default() };
        let text = Grants::from_value(Some("filtered")).expect("valid").describe(&egress);
        assert!(
            text.contains("network up to filtered (MOAT_ALLOW_NETWORK)") && text.contains("api.example.com"),
            "{text}"
        );
        assert!(Grants::default().describe(&egress).contains("network up to none"));
    }
}

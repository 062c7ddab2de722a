//! What the operator grants: the ceiling on what a model may ask for.
//!
//! The person who starts moat decides how much network a sandbox may have
//! (`MOAT_ALLOW_NETWORK=none|filtered|open`, default `none`), which hosts a
//! `filtered` sandbox may reach (`MOAT_ALLOW_HOSTS`, `MOAT_GIT_HOSTS` and
//! the package registries built into [`crate::net::egress`]), and how much
//! one sandbox may hold: CPUs (`MOAT_MAX_CPUS`, default the host's),
//! memory (`MOAT_MAX_SANDBOX_MEMORY_MIB`), disk (`MOAT_MAX_DISK_MIB`) and
//! lifetime (`MOAT_MAX_TIMEOUT_SECONDS`, default `MOAT_TIMEOUT_SECONDS`,
//! itself 3600 by default), and how long one may stay unused before it is
//! suspended (`MOAT_MAX_IDLE_SECONDS`, default `MOAT_IDLE_SECONDS`, itself
//! 300 by default; 0 lets sandboxes never suspend). A [`SandboxSpec`] — what a tool call asks for —
//! may only ask for something inside that: [`Grants::check`] refuses the
//! rest with a message naming the variable that would allow it.
//! [`Moat::create`](crate::Moat::create) checks every spec, so code that
//! embeds moat-core gets the same ceiling as the MCP server; the `moat` CLI
//! is the operator itself and grants everything ([`Grants::everything`]).
//!
//! What all sandboxes together may hold (`MOAT_MAX_MEMORY_MIB`,
//! `MOAT_MAX_SANDBOXES`) is [`crate::limits`]'s and the `Moat`'s.

use std::collections::BTreeSet;

use crate::net::egress::{EgressConfig, registries};
use crate::runtime::Runtime;
use crate::sandbox::{NetworkPolicy, SandboxSpec};

/// The variable that sets the network ceiling.
pub const NETWORK_VAR: &str = "MOAT_ALLOW_NETWORK";
/// The most CPUs one sandbox may ask for.
pub const CPUS_VAR: &str = "MOAT_MAX_CPUS";
/// The most memory one sandbox may ask for (the sum over all of them is
/// `MOAT_MAX_MEMORY_MIB`'s).
pub const MEMORY_VAR: &str = "MOAT_MAX_SANDBOX_MEMORY_MIB";
/// The most disk one sandbox may ask for.
pub const DISK_VAR: &str = "MOAT_MAX_DISK_MIB";
/// The longest lifetime one sandbox may ask for.
pub const TIMEOUT_VAR: &str = "MOAT_MAX_TIMEOUT_SECONDS";
/// The lifetime of a sandbox that asks for none, and by default also the
/// longest one may ask for.
pub const DEFAULT_TIMEOUT_VAR: &str = "MOAT_TIMEOUT_SECONDS";
/// The longest one sandbox may stay unused before it is suspended (0: it
/// may ask never to be).
pub const IDLE_VAR: &str = "MOAT_MAX_IDLE_SECONDS";
/// How long a sandbox that asks for nothing stays unused before it is
/// suspended, and by default also the longest one may ask for.
pub const DEFAULT_IDLE_VAR: &str = "MOAT_IDLE_SECONDS";

/// What the operator allows models to ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grants {
    /// The most network a sandbox may have (`none` < `filtered` < `open`).
    pub network: NetworkPolicy,
    /// The most CPUs one sandbox may have.
    pub cpus: u32,
    /// The most memory one sandbox may have, in MiB.
    pub memory_mib: u64,
    /// The most disk one sandbox may have, in MiB.
    pub disk_mib: u64,
    /// The longest one sandbox may live, in seconds.
    pub timeout_seconds: u64,
    /// The longest one sandbox may stay unused before it is suspended, in
    /// seconds; 0: it may ask never to be.
    pub idle_seconds: u64,
}

/// A variable of the grants holds a value moat cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is invalid: {allowed}")]
pub struct GrantsError {
    pub var: &'static str,
    pub value: String,
    /// What the variable takes.
    pub allowed: String,
}

/// One of [`Grants::check`]'s ceilings: the argument, what was asked, the
/// most granted, its variable, what it is when unset (said only in a
/// refusal), and the most the variable may say.
type Ceiling<'a> = (&'static str, u64, u64, &'static str, &'a dyn Fn() -> String, u64);

/// A tool call asked for more than the operator grants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotGranted(pub String);

/// The CPUs this process may run on, as many as a sandbox may have by
/// default (at least 1, at most [`SandboxSpec::MAX_CPUS`]).
pub fn host_cpus() -> u32 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    u32::try_from(cpus).unwrap_or(u32::MAX).clamp(SandboxSpec::MIN_CPUS, SandboxSpec::MAX_CPUS)
}

impl Grants {
    /// Everything: for the operator's own tools (the `moat` CLI) and tests.
    /// One sandbox may still ask for no more than [`SandboxSpec`]'s bounds.
    pub fn everything() -> Self {
        Self {
            network: NetworkPolicy::Open,
            cpus: SandboxSpec::MAX_CPUS,
            memory_mib: SandboxSpec::MAX_MEMORY_MIB,
            disk_mib: SandboxSpec::MAX_DISK_MIB,
            timeout_seconds: SandboxSpec::MAX_TIMEOUT_SECONDS,
            idle_seconds: 0,
        }
    }

    /// What a server started without any of the variables grants: no
    /// network, the host's CPUs, [`SandboxSpec`]'s bounds of memory and
    /// disk, and the default lifetime.
    pub fn unset() -> Self {
        Self::from_lookup(|_| None).unwrap_or_else(|_| Self::everything())
    }

    /// The grants of the environment's variables.
    pub fn from_env() -> Result<Self, GrantsError> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// The grants of the variables `get` gives (unset or empty: the
    /// default).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, GrantsError> {
        let get = |var: &str| get(var).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let network = match get(NETWORK_VAR) {
            None => NetworkPolicy::None,
            Some(v) => v.parse::<NetworkPolicy>().map_err(|_| GrantsError {
                var: NETWORK_VAR,
                value: v.clone(),
                allowed: "none, filtered or open (the most network a model may ask for)".into(),
            })?,
        };
        let number = |var: &'static str, min: u64, max: u64, what: &str| -> Result<Option<u64>, GrantsError> {
            let Some(v) = get(var) else { return Ok(None) };
            match v.parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
                _ => Err(GrantsError { var, value: v, allowed: format!("an integer from {min} to {max} ({what})") }),
            }
        };
        let cpus = number(
            CPUS_VAR,
            SandboxSpec::MIN_CPUS.into(),
            SandboxSpec::MAX_CPUS.into(),
            "the most CPUs one sandbox may ask for",
        )?
        .map_or_else(host_cpus, |n| u32::try_from(n).unwrap_or(SandboxSpec::MAX_CPUS));
        let memory_mib = number(
            MEMORY_VAR,
            SandboxSpec::MIN_MEMORY_MIB,
            SandboxSpec::MAX_MEMORY_MIB,
            "the most memory one sandbox may ask for, in MiB",
        )?
        .unwrap_or(SandboxSpec::MAX_MEMORY_MIB);
        let disk_mib = number(
            DISK_VAR,
            SandboxSpec::MIN_DISK_MIB,
            SandboxSpec::MAX_DISK_MIB,
            "the most disk one sandbox may ask for, in MiB",
        )?
        .unwrap_or(SandboxSpec::MAX_DISK_MIB);
        let lifetime = "in seconds; unset, the most is MOAT_TIMEOUT_SECONDS";
        let timeout_seconds = match number(
            TIMEOUT_VAR,
            SandboxSpec::MIN_TIMEOUT_SECONDS,
            SandboxSpec::MAX_TIMEOUT_SECONDS,
            &format!("the longest lifetime one sandbox may ask for, {lifetime}"),
        )? {
            Some(n) => n,
            // The default lifetime is the ceiling too: an operator who
            // shortens it is not overruled by a tool call. A bad value is
            // the server configuration's to report; here it grants the
            // default.
            None => get(DEFAULT_TIMEOUT_VAR)
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|n| (SandboxSpec::MIN_TIMEOUT_SECONDS..=SandboxSpec::MAX_TIMEOUT_SECONDS).contains(n))
                .unwrap_or(SandboxSpec::default().timeout_seconds),
        };
        let idle_rule = "the longest one sandbox may stay unused before it is suspended, in seconds, 0 to let it \
                         ask never to be; unset, the most is MOAT_IDLE_SECONDS";
        let idle_seconds = match number(IDLE_VAR, 0, SandboxSpec::MAX_IDLE_SECONDS, idle_rule)? {
            // No sandbox may ask for less than a minute: nothing would pass.
            Some(n) if (1..60).contains(&n) => {
                return Err(GrantsError {
                    var: IDLE_VAR,
                    value: n.to_string(),
                    allowed: format!("0, or an integer from 60 to {} ({idle_rule})", SandboxSpec::MAX_IDLE_SECONDS),
                });
            }
            Some(n) => n,
            // The default is the ceiling too, as the lifetime's is.
            None => get(DEFAULT_IDLE_VAR)
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|n| *n <= SandboxSpec::MAX_IDLE_SECONDS)
                .unwrap_or(SandboxSpec::default().idle_seconds),
        };
        Ok(Self { network, cpus, memory_mib, disk_mib, timeout_seconds, idle_seconds })
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
        // What each ceiling is when unset: said only in a refusal.
        let default_lifetime =
            || format!("{DEFAULT_TIMEOUT_VAR}, itself {} unless set", SandboxSpec::default().timeout_seconds);
        let ceilings: [Ceiling<'_>; 4] = [
            (
                "cpus",
                u64::from(spec.cpus),
                u64::from(self.cpus),
                CPUS_VAR,
                &|| "the host's CPUs".to_owned(),
                SandboxSpec::MAX_CPUS.into(),
            ),
            (
                "memory_mib",
                spec.memory_mib,
                self.memory_mib,
                MEMORY_VAR,
                &|| SandboxSpec::MAX_MEMORY_MIB.to_string(),
                SandboxSpec::MAX_MEMORY_MIB,
            ),
            (
                "disk_mib",
                spec.disk_mib,
                self.disk_mib,
                DISK_VAR,
                &|| SandboxSpec::MAX_DISK_MIB.to_string(),
                SandboxSpec::MAX_DISK_MIB,
            ),
            (
                "timeout_seconds",
                spec.timeout_seconds,
                self.timeout_seconds,
                TIMEOUT_VAR,
                &default_lifetime,
                SandboxSpec::MAX_TIMEOUT_SECONDS,
            ),
        ];
        // Unused longer than granted, or never suspended where the
        // operator suspends: a background process of a forgotten sandbox
        // would run on past what the operator allows.
        if self.idle_seconds != 0 && (spec.idle_seconds == 0 || spec.idle_seconds > self.idle_seconds) {
            let asked = match spec.idle_seconds {
                0 => "0 (never suspend)".to_owned(),
                n => n.to_string(),
            };
            return Err(NotGranted(format!(
                "the sandbox asks for idle_seconds {asked}, but this server suspends one after at most {most} s \
                 unused ({IDLE_VAR}; unset, it is {DEFAULT_IDLE_VAR}, itself {} unless set); ask for 60 to {most}. \
                 Only the operator who starts moat can allow more, by setting {IDLE_VAR} (up to {}, or 0 to let \
                 sandboxes never suspend)",
                SandboxSpec::default().idle_seconds,
                SandboxSpec::MAX_IDLE_SECONDS,
                most = self.idle_seconds,
            )));
        }
        for (field, asked, most, var, default, bound) in ceilings {
            if asked > most {
                return Err(NotGranted(format!(
                    "the sandbox asks for {field} {asked}, but this server grants one sandbox at most {most} \
                     ({var}; unset, it is {}); ask for {most} or less. Only the operator who starts moat can \
                     allow more, by setting {var} (up to {bound})",
                    default()
                )));
            }
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
            "network up to {} ({NETWORK_VAR}); {hosts}; SSH keys for clones {ssh} (MOAT_ALLOW_SSH_KEY); one sandbox \
             up to {} CPUs ({CPUS_VAR}), {} MiB of memory ({MEMORY_VAR}), {} MiB of disk ({DISK_VAR}) and {} s of \
             life ({TIMEOUT_VAR}), {} ({IDLE_VAR})",
            self.network.as_str(),
            self.cpus,
            self.memory_mib,
            self.disk_mib,
            self.timeout_seconds,
            match self.idle_seconds {
                0 => "never suspended if it asks".to_owned(),
                n => format!("suspended after at most {n} s unused"),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grants of the variables `vars` (the others unset).
    fn with(vars: &[(&str, &str)]) -> Result<Grants, GrantsError> {
        Grants::from_lookup(|var| vars.iter().find(|(v, _)| *v == var).map(|(_, value)| (*value).to_owned()))
    }

    fn network(value: Option<&str>) -> Result<Grants, GrantsError> {
        match value {
            Some(v) => with(&[(NETWORK_VAR, v)]),
            None => with(&[]),
        }
    }

    fn spec(network: NetworkPolicy, hosts: &[&str]) -> SandboxSpec {
        SandboxSpec { network, allow_hosts: hosts.iter().map(|h| (*h).to_owned()).collect(), ..SandboxSpec::default() }
    }

    #[test]
    fn the_default_grants_no_network() {
        let grants = network(None).expect("unset");
        assert_eq!(grants, Grants::unset());
        assert_eq!(grants.network, NetworkPolicy::None);
        assert_eq!(network(Some("")).expect("empty"), Grants::unset());
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
        let filtered = network(Some("filtered")).expect("valid");
        assert!(filtered.check(&spec(NetworkPolicy::Filtered, &[]), &egress).is_ok());
        assert!(filtered.check(&spec(NetworkPolicy::None, &[]), &egress).is_ok());
        let err = filtered.check(&spec(NetworkPolicy::Open, &[]), &egress).expect_err("open is more").to_string();
        assert!(err.contains("grants at most \"filtered\"") && err.contains("none, filtered"), "{err}");
        let open = network(Some("open")).expect("valid");
        assert_eq!(open.network, Grants::everything().network);
        assert!(open.check(&spec(NetworkPolicy::Open, &[]), &egress).is_ok());
    }

    #[test]
    fn bad_values_are_refused_with_what_is_allowed() {
        for bad in ["all", "OPEN", "yes", "filtered,open"] {
            let err = network(Some(bad)).expect_err(bad).to_string();
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
        let text = network(Some("filtered")).expect("valid").describe(&egress);
        assert!(
            text.contains("network up to filtered (MOAT_ALLOW_NETWORK)") && text.contains("api.example.com"),
            "{text}"
        );
        let text = with(&[(CPUS_VAR, "2"), (TIMEOUT_VAR, "600")]).expect("valid").describe(&egress);
        assert!(text.contains("network up to none") && text.contains("up to 2 CPUs (MOAT_MAX_CPUS)"), "{text}");
        assert!(text.contains("600 s of life (MOAT_MAX_TIMEOUT_SECONDS)"), "{text}");
    }

    #[test]
    fn one_sandbox_asks_for_no_more_than_the_operator_set() {
        let egress = EgressConfig::default();
        let grants =
            with(&[(CPUS_VAR, "2"), (MEMORY_VAR, "512"), (DISK_VAR, "1024"), (TIMEOUT_VAR, "600")]).expect("valid");
        let inside =
            SandboxSpec { cpus: 2, memory_mib: 512, disk_mib: 1024, timeout_seconds: 600, ..SandboxSpec::default() };
        assert!(grants.check(&inside, &egress).is_ok());
        let over = [
            (SandboxSpec { cpus: 3, ..inside.clone() }, "cpus 3", "at most 2", CPUS_VAR),
            (SandboxSpec { memory_mib: 513, ..inside.clone() }, "memory_mib 513", "at most 512", MEMORY_VAR),
            (SandboxSpec { disk_mib: 262_144, ..inside.clone() }, "disk_mib 262144", "at most 1024", DISK_VAR),
            (
                SandboxSpec { timeout_seconds: 28_800, ..inside.clone() },
                "timeout_seconds 28800",
                "at most 600",
                TIMEOUT_VAR,
            ),
        ];
        for (spec, asked, most, var) in over {
            let err = grants.check(&spec, &egress).expect_err(asked).to_string();
            assert!(err.contains(asked) && err.contains(most) && err.contains(&format!("by setting {var}")), "{err}");
        }
        // Suspended after at most the granted idle time; never, only where
        // the operator lets sandboxes never suspend.
        let idle = with(&[(IDLE_VAR, "600")]).expect("valid");
        assert!(idle.check(&SandboxSpec { idle_seconds: 600, ..SandboxSpec::default() }, &egress).is_ok());
        for (asked, words) in [(601, "idle_seconds 601"), (0, "idle_seconds 0 (never suspend)")] {
            let err = idle.check(&SandboxSpec { idle_seconds: asked, ..SandboxSpec::default() }, &egress);
            let err = err.expect_err(words).to_string();
            assert!(
                err.contains(words)
                    && err.contains("at most 600 s")
                    && err.contains("by setting MOAT_MAX_IDLE_SECONDS"),
                "{err}"
            );
        }
        let defaulted = with(&[(DEFAULT_IDLE_VAR, "120")]).expect("valid");
        assert_eq!(defaulted.idle_seconds, 120, "unset, the default idle time is the most");
        assert_eq!(Grants::unset().idle_seconds, 300);
        let never = with(&[(IDLE_VAR, "0")]).expect("valid");
        assert!(never.check(&SandboxSpec { idle_seconds: 0, ..SandboxSpec::default() }, &egress).is_ok());
        assert!(with(&[(IDLE_VAR, "28801")]).is_err(), "past the spec's own bound");
        let short = with(&[(IDLE_VAR, "30")]).expect_err("below any spec's").to_string();
        assert!(short.contains("0, or an integer from 60 to 28800"), "{short}");
        // The CLI's grants stop only at the spec's own bounds.
        let most = SandboxSpec {
            cpus: SandboxSpec::MAX_CPUS,
            memory_mib: SandboxSpec::MAX_MEMORY_MIB,
            disk_mib: SandboxSpec::MAX_DISK_MIB,
            timeout_seconds: SandboxSpec::MAX_TIMEOUT_SECONDS,
            ..SandboxSpec::default()
        };
        assert!(Grants::everything().check(&most, &egress).is_ok());
    }

    #[test]
    fn the_ceilings_default_to_the_host_and_the_default_lifetime() {
        let unset = Grants::unset();
        assert_eq!(unset.cpus, host_cpus());
        assert!((1..=SandboxSpec::MAX_CPUS).contains(&unset.cpus));
        assert_eq!((unset.memory_mib, unset.disk_mib), (SandboxSpec::MAX_MEMORY_MIB, SandboxSpec::MAX_DISK_MIB));
        assert_eq!(unset.timeout_seconds, 3600, "the default lifetime is the longest");
        assert_eq!(with(&[(DEFAULT_TIMEOUT_VAR, "600")]).expect("valid").timeout_seconds, 600);
        let both = with(&[(DEFAULT_TIMEOUT_VAR, "600"), (TIMEOUT_VAR, "7200")]).expect("valid");
        assert_eq!(both.timeout_seconds, 7200, "the ceiling may be above the default");
        assert!(Grants::unset().check(&SandboxSpec::default(), &EgressConfig::default()).is_ok());
    }

    #[test]
    fn bad_ceilings_name_the_variable_and_the_range() {
        for (var, bad, range) in [
            (CPUS_VAR, "0", "from 1 to 16"),
            (CPUS_VAR, "many", "from 1 to 16"),
            (MEMORY_VAR, "64", "from 128 to 65536"),
            (DISK_VAR, "1T", "from 64 to 262144"),
            (TIMEOUT_VAR, "30000", "from 60 to 28800"),
        ] {
            let err = with(&[(var, bad)]).expect_err(bad).to_string();
            assert!(err.starts_with(&format!("{var}={bad:?} is invalid")) && err.contains(range), "{err}");
        }
    }
}

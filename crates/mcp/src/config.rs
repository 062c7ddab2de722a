//! `moat-mcp`'s configuration: environment variables only, each checked;
//! a bad value stops the server with one line naming the variable and what
//! is allowed (exit status 2).

use moat_core::{BackendKind, EgressConfig, Grants, IpNet, NetworkPolicy, SandboxSpec};

/// A variable with a value the server cannot use.
#[derive(Debug, thiserror::Error)]
#[error("{var}={value:?} is invalid: {allowed}")]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub allowed: String,
}

/// What the environment asks of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub backend: BackendKind,
    pub max_sandboxes: usize,
    /// `MOAT_MAX_SANDBOXES_PER_SESSION`: the most live sandboxes one HTTP
    /// session (or all requests without a session, together) may own, so
    /// that one client cannot take every place of a shared server.
    pub sandboxes_per_session: usize,
    pub pool_size: usize,
    /// Defaults for sandboxes created without arguments.
    pub defaults: SandboxSpec,
    /// `MOAT_ALLOW_NETWORK`: the most a tool call may ask for.
    pub grants: Grants,
    /// `MOAT_HTTP_TOKEN`: the bearer token `--http` requires; when unset,
    /// the server generates one into an owner-only file (`http::TokenFile`).
    pub http_token: Option<String>,
    /// `MOAT_ALLOW_HOSTS`: hosts filtered sandboxes may reach beyond the defaults.
    pub allow_hosts: Vec<String>,
    /// `MOAT_GIT_HOSTS`: hosts `git_clone` may clone from.
    pub git_hosts: Vec<String>,
    /// `MOAT_ALLOW_SSH_KEY=1`: clones over SSH may use a host key file.
    pub ssh_keys: bool,
    /// `MOAT_SSH_KNOWN_HOSTS`: the host keys SSH clones trust.
    pub ssh_known_hosts: Option<std::path::PathBuf>,
    /// TEST ONLY `MOAT_TEST_EGRESS_NETS`: address ranges filtered sandboxes
    /// may reach although they are private or loopback.
    pub test_egress_nets: Vec<IpNet>,
    /// TEST ONLY `MOAT_TEST_RESOLVE`: `name=address` pairs the egress
    /// policy uses instead of DNS.
    pub test_resolve: Vec<(String, std::net::IpAddr)>,
    /// TEST ONLY `MOAT_TEST_CONFORMANCE_TOOLS=1`: `--http` lists and
    /// serves the conformance suite's fixtures ([`crate::fixtures`]).
    pub test_conformance_tools: bool,
    /// `MOAT_LOG_LEVEL` (default `warn`).
    pub log_level: moat_core::log::LogLevel,
    /// `MOAT_LOG_FILE`: where logs are appended besides stderr.
    pub log_file: Option<std::path::PathBuf>,
}

/// The hosts `git_clone` may use unless `MOAT_GIT_HOSTS` says otherwise.
pub const DEFAULT_GIT_HOSTS: &[&str] = moat_core::net::egress::DEFAULT_GIT_HOSTS;

/// A comma-separated list of host names; the error is the first bad one.
/// A comma-separated list of host names, or (`ports`) also `host:port`
/// entries; the first that is neither otherwise.
fn host_list(value: &str, ports: bool) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for host in value.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        let host = host.to_ascii_lowercase();
        let ok = if ports {
            moat_core::net::egress::valid_host_entry(&host)
        } else {
            moat_core::net::egress::valid_host_name(&host)
        };
        if !ok {
            return Err(host);
        }
        hosts.push(host);
    }
    Ok(hosts)
}

impl ServerConfig {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
    }

    /// Reads the variables through `get`, so tests need not touch the environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let bad = |var: &'static str, value: &str, allowed: &str| ConfigError {
            var,
            value: value.to_owned(),
            allowed: allowed.to_owned(),
        };
        let number = |var: &'static str, default: u64, min: u64, max: u64| -> Result<u64, ConfigError> {
            match get(var) {
                None => Ok(default),
                Some(v) => match v.parse::<u64>() {
                    Ok(n) if (min..=max).contains(&n) => Ok(n),
                    _ => Err(bad(var, &v, &format!("an integer from {min} to {max}"))),
                },
            }
        };
        let backend = match get("MOAT_BACKEND") {
            None => BackendKind::Auto,
            Some(v) => v.parse().map_err(|_| bad("MOAT_BACKEND", &v, "auto, vm or jail"))?,
        };
        let network = match get("MOAT_NETWORK") {
            None => NetworkPolicy::None,
            Some(v) => v.parse::<NetworkPolicy>().map_err(|_| bad("MOAT_NETWORK", &v, "none, filtered or open"))?,
        };
        let grants =
            Grants::from_lookup(&get).map_err(|e| ConfigError { var: e.var, value: e.value, allowed: e.allowed })?;
        if !grants.allows_network(network) {
            let asked = get("MOAT_NETWORK").unwrap_or_default();
            return Err(bad(
                "MOAT_NETWORK",
                &asked,
                &format!(
                    "at most what MOAT_ALLOW_NETWORK grants ({}); set MOAT_ALLOW_NETWORK={asked} (or higher) to \
                     grant it, or lower MOAT_NETWORK",
                    grants.network.as_str()
                ),
            ));
        }
        let timeout = number("MOAT_TIMEOUT_SECONDS", 3600, 60, 28_800)?;
        if timeout > grants.timeout_seconds {
            return Err(bad(
                "MOAT_TIMEOUT_SECONDS",
                &timeout.to_string(),
                &format!(
                    "at most MOAT_MAX_TIMEOUT_SECONDS ({}), the longest a sandbox may live; raise \
                     MOAT_MAX_TIMEOUT_SECONDS or lower MOAT_TIMEOUT_SECONDS",
                    grants.timeout_seconds
                ),
            ));
        }
        let idle = number("MOAT_IDLE_SECONDS", 300, 0, 28_800)?;
        if idle != 0 && (idle < 60 || idle >= timeout) {
            return Err(bad(
                "MOAT_IDLE_SECONDS",
                &idle.to_string(),
                &format!("0 (never suspend) or from 60 to less than MOAT_TIMEOUT_SECONDS ({timeout})"),
            ));
        }
        if grants.idle_seconds != 0 && (idle == 0 || idle > grants.idle_seconds) {
            return Err(bad(
                "MOAT_IDLE_SECONDS",
                &idle.to_string(),
                &format!(
                    "at most MOAT_MAX_IDLE_SECONDS ({}), the longest a sandbox may stay unused before it is \
                     suspended, and not 0 (never suspend) unless that is 0; give MOAT_IDLE_SECONDS a value from 60 \
                     to {}, or raise MOAT_MAX_IDLE_SECONDS (0 lets sandboxes never suspend)",
                    grants.idle_seconds, grants.idle_seconds
                ),
            ));
        }
        let image = get("MOAT_IMAGE").unwrap_or_else(|| "default".into());
        if moat_core::image::parse_ref(&image).is_none() {
            return Err(bad("MOAT_IMAGE", &image, &format!("an image name: {}", moat_core::image::NAME_RULE)));
        }
        let max_sandboxes = number("MOAT_MAX_SANDBOXES", 16, 1, 1024)?;
        let sandboxes_per_session =
            number("MOAT_MAX_SANDBOXES_PER_SESSION", max_sandboxes.div_ceil(2), 1, max_sandboxes).map_err(|e| {
                ConfigError { allowed: format!("{} (at most MOAT_MAX_SANDBOXES, {max_sandboxes})", e.allowed), ..e }
            })?;
        let pool_size = number("MOAT_POOL_SIZE", 0, 0, 64)?;
        let log_level = match get("MOAT_LOG_LEVEL").filter(|l| !l.trim().is_empty()) {
            Some(level) => level.parse().map_err(|_| bad("MOAT_LOG_LEVEL", &level, moat_core::log::LEVELS))?,
            None => moat_core::log::LogLevel::Warn,
        };
        let log_file = get("MOAT_LOG_FILE").filter(|f| !f.is_empty()).map(std::path::PathBuf::from);
        let http_token = get("MOAT_HTTP_TOKEN");
        if let Some(token) = &http_token
            && (token.len() < 16 || !token.chars().all(|c| c.is_ascii_graphic()))
        {
            return Err(bad("MOAT_HTTP_TOKEN", "(hidden)", "at least 16 printable ASCII characters without spaces"));
        }
        let hosts = |var: &'static str, default: &[&str], ports: bool| -> Result<Vec<String>, ConfigError> {
            match get(var) {
                None => Ok(default.iter().map(|h| (*h).to_owned()).collect()),
                Some(v) => host_list(&v, ports).map_err(|host| {
                    let allowed = if ports {
                        format!(
                            "comma-separated host names such as pypi.org,example.com (reached on ports 443 and 80), \
                             or host:port entries such as npm.example.com:4873 ({host:?} is neither)"
                        )
                    } else {
                        format!("comma-separated host names such as pypi.org,example.com ({host:?} is not one)")
                    };
                    bad(var, &v, &allowed)
                }),
            }
        };
        let allow_hosts = hosts("MOAT_ALLOW_HOSTS", &[], true)?;
        let git_hosts = hosts("MOAT_GIT_HOSTS", DEFAULT_GIT_HOSTS, false)?;
        let ssh_keys = match get("MOAT_ALLOW_SSH_KEY").as_deref().map(str::trim) {
            None | Some("0" | "false" | "no") => false,
            Some("1" | "true" | "yes") => true,
            Some(other) => return Err(bad("MOAT_ALLOW_SSH_KEY", other, "1 (clones over SSH may use a key) or 0")),
        };
        let ssh_known_hosts = match get("MOAT_SSH_KNOWN_HOSTS") {
            None => None,
            Some(v) => {
                let path = std::path::PathBuf::from(&v);
                if !path.is_absolute() || !path.is_file() || v.chars().any(|c| c.is_whitespace() || c == '"') {
                    return Err(bad(
                        "MOAT_SSH_KNOWN_HOSTS",
                        &v,
                        "the absolute path of an existing known_hosts file, without spaces or quotes",
                    ));
                }
                Some(path)
            }
        };
        let mut test_egress_nets = Vec::new();
        if let Some(v) = get("MOAT_TEST_EGRESS_NETS") {
            for net in v.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                test_egress_nets.push(net.parse::<IpNet>().map_err(|why| {
                    bad("MOAT_TEST_EGRESS_NETS", &v, &format!("comma-separated address ranges (test only); {why}"))
                })?);
            }
        }
        let mut test_resolve = Vec::new();
        if let Some(v) = get("MOAT_TEST_RESOLVE") {
            for pair in v.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                let parsed = pair.split_once('=').and_then(|(name, addr)| {
                    Some((name.trim().to_ascii_lowercase(), addr.trim().parse::<std::net::IpAddr>().ok()?))
                });
                test_resolve.push(
                    parsed.ok_or_else(|| {
                        bad("MOAT_TEST_RESOLVE", &v, "comma-separated name=address pairs (test only)")
                    })?,
                );
            }
        }
        let test_conformance_tools = match get(crate::fixtures::VAR).as_deref().map(str::trim) {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(bad(
                    crate::fixtures::VAR,
                    other,
                    "1 (list the conformance suite's fixtures; test only) or 0",
                ));
            }
        };
        // A sandbox made without arguments asks for no more than the
        // ceilings: an operator who lowers one lowers the default with it.
        let base = SandboxSpec::default();
        let defaults = SandboxSpec {
            image,
            network,
            timeout_seconds: timeout,
            idle_seconds: idle,
            cpus: base.cpus.min(grants.cpus),
            memory_mib: base.memory_mib.min(grants.memory_mib),
            disk_mib: base.disk_mib.min(grants.disk_mib),
            ..base
        };
        Ok(Self {
            backend,
            max_sandboxes: usize::try_from(max_sandboxes).unwrap_or(16),
            sandboxes_per_session: usize::try_from(sandboxes_per_session).unwrap_or(8),
            pool_size: usize::try_from(pool_size).unwrap_or(0),
            defaults,
            grants,
            http_token,
            allow_hosts,
            git_hosts,
            ssh_keys,
            ssh_known_hosts,
            test_egress_nets,
            test_resolve,
            test_conformance_tools,
            log_level,
            log_file,
        })
    }

    /// What `moat-core`'s egress policy needs of this configuration.
    pub fn egress(&self) -> EgressConfig {
        EgressConfig {
            allow_hosts: self.allow_hosts.clone(),
            git_hosts: self.git_hosts.clone(),
            ssh_keys: self.ssh_keys,
            ssh_known_hosts: self.ssh_known_hosts.clone(),
            test_nets: self.test_egress_nets.clone(),
            test_resolve: self.test_resolve.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<ServerConfig, ConfigError> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        ServerConfig::from_lookup(|var| vars.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone()))
    }

    #[test]
    fn defaults_without_variables() {
        let config = with(&[]).expect("valid");
        assert_eq!(config.backend, BackendKind::Auto);
        assert_eq!((config.defaults.timeout_seconds, config.defaults.idle_seconds), (3600, 300));
        assert_eq!((config.max_sandboxes, config.sandboxes_per_session, config.pool_size), (16, 8, 0));
        assert_eq!((config.log_level, config.log_file), (moat_core::log::LogLevel::Warn, None));
    }

    #[test]
    fn a_log_level_is_read_in_any_case_and_by_its_other_names() {
        for (value, level) in [("WARNING", "warn"), ("Info", "info"), ("CRITICAL", "error"), ("ERR", "error")] {
            let config = with(&[("MOAT_LOG_LEVEL", value), ("MOAT_LOG_FILE", "/var/log/moat.log")]).expect(value);
            assert_eq!(config.log_level.as_str(), level, "{value}");
            assert_eq!(config.log_file.as_deref(), Some(std::path::Path::new("/var/log/moat.log")));
        }
    }

    #[test]
    fn bad_values_name_the_variable_and_what_is_allowed() {
        let cases = [
            (("MOAT_BACKEND", "docker"), "auto, vm or jail"),
            (("MOAT_TIMEOUT_SECONDS", "10"), "from 60 to 28800"),
            (("MOAT_IDLE_SECONDS", "30"), "0 (never suspend)"),
            (("MOAT_IDLE_SECONDS", "4000"), "less than MOAT_TIMEOUT_SECONDS (3600)"),
            (("MOAT_NETWORK", "wifi"), "none, filtered or open"),
            (("MOAT_ALLOW_NETWORK", "all"), "none, filtered or open"),
            (("MOAT_NETWORK", "filtered"), "set MOAT_ALLOW_NETWORK=filtered"),
            (("MOAT_MAX_SANDBOXES", "-1"), "from 1 to 1024"),
            (("MOAT_MAX_SANDBOXES_PER_SESSION", "0"), "from 1 to 16 (at most MOAT_MAX_SANDBOXES, 16)"),
            (("MOAT_MAX_SANDBOXES_PER_SESSION", "17"), "at most MOAT_MAX_SANDBOXES"),
            (("MOAT_LOG_LEVEL", "loud"), "error, warn"),
            (("MOAT_IMAGE", "../x"), "image name"),
            (("MOAT_HTTP_TOKEN", "short"), "at least 16"),
            (("MOAT_ALLOW_HOSTS", "pypi.org,bad host"), "\"bad host\" is neither"),
            (("MOAT_GIT_HOSTS", "https://github.com"), "host names"),
            (("MOAT_TEST_EGRESS_NETS", "10.0.0.0/40"), "address ranges"),
            (("MOAT_TEST_RESOLVE", "a.test"), "name=address"),
            (("MOAT_TEST_CONFORMANCE_TOOLS", "yes"), "1 (list the conformance suite's fixtures; test only) or 0"),
            (("MOAT_ALLOW_SSH_KEY", "always"), "1 (clones over SSH may use a key) or 0"),
            (("MOAT_SSH_KNOWN_HOSTS", "known_hosts"), "absolute path of an existing known_hosts file"),
            (("MOAT_SSH_KNOWN_HOSTS", "/no/such/known_hosts"), "absolute path of an existing known_hosts file"),
        ];
        for ((var, value), allowed) in cases {
            let err = with(&[(var, value)]).expect_err(var).to_string();
            assert!(err.starts_with(&format!("{var}=")) && err.contains(allowed), "{err}");
        }
        assert_eq!(with(&[("MOAT_IDLE_SECONDS", "0")]).expect("0 turns it off").defaults.idle_seconds, 0);
        // The default idle time within the operator's most.
        let err = with(&[("MOAT_MAX_IDLE_SECONDS", "120")]).expect_err("300 past 120").to_string();
        assert!(
            err.starts_with("MOAT_IDLE_SECONDS=\"300\"") && err.contains("at most MOAT_MAX_IDLE_SECONDS (120)"),
            "{err}"
        );
        let never = with(&[("MOAT_MAX_IDLE_SECONDS", "600"), ("MOAT_IDLE_SECONDS", "0")]).expect_err("never past 600");
        assert!(never.to_string().contains("not 0 (never suspend) unless that is 0"), "{never}");
        assert!(!with(&[]).expect("valid").test_conformance_tools, "fixtures are listed only when asked for");
        assert!(with(&[("MOAT_TEST_CONFORMANCE_TOOLS", "1")]).expect("valid").test_conformance_tools);
    }

    #[test]
    fn the_operator_grants_no_network_unless_it_says_so() {
        assert_eq!(with(&[]).expect("valid").grants, Grants::unset());
        assert_eq!(with(&[]).expect("valid").grants.network, NetworkPolicy::None);
        let open = with(&[("MOAT_ALLOW_NETWORK", "open"), ("MOAT_NETWORK", "filtered")]).expect("within");
        assert_eq!((open.grants.network, open.defaults.network), (NetworkPolicy::Open, NetworkPolicy::Filtered));
        let err = with(&[("MOAT_ALLOW_NETWORK", "filtered"), ("MOAT_NETWORK", "open")]).expect_err("above").to_string();
        assert!(err.starts_with("MOAT_NETWORK=\"open\"") && err.contains("MOAT_ALLOW_NETWORK"), "{err}");
    }

    #[test]
    fn a_session_may_own_half_the_servers_sandboxes_unless_the_operator_says_otherwise() {
        let share = |vars: &[(&str, &str)]| with(vars).expect("valid").sandboxes_per_session;
        assert_eq!(share(&[("MOAT_MAX_SANDBOXES", "5")]), 3, "half, rounded up");
        assert_eq!(share(&[("MOAT_MAX_SANDBOXES", "1")]), 1);
        assert_eq!(share(&[("MOAT_MAX_SANDBOXES", "40"), ("MOAT_MAX_SANDBOXES_PER_SESSION", "40")]), 40);
        assert_eq!(share(&[("MOAT_MAX_SANDBOXES_PER_SESSION", "2")]), 2);
    }

    #[test]
    fn the_operators_ceilings_bound_the_defaults() {
        let config = with(&[("MOAT_MAX_SANDBOX_MEMORY_MIB", "512"), ("MOAT_MAX_DISK_MIB", "1024")]).expect("valid");
        assert_eq!((config.defaults.memory_mib, config.defaults.disk_mib), (512, 1024));
        assert_eq!((config.grants.memory_mib, config.grants.disk_mib), (512, 1024));
        let config = with(&[("MOAT_TIMEOUT_SECONDS", "600")]).expect("valid");
        assert_eq!((config.defaults.timeout_seconds, config.grants.timeout_seconds), (600, 600));
        let config = with(&[("MOAT_TIMEOUT_SECONDS", "600"), ("MOAT_MAX_TIMEOUT_SECONDS", "7200")]).expect("valid");
        assert_eq!((config.defaults.timeout_seconds, config.grants.timeout_seconds), (600, 7200));
        let err = with(&[("MOAT_TIMEOUT_SECONDS", "7200"), ("MOAT_MAX_TIMEOUT_SECONDS", "600")])
            .expect_err("the default above the ceiling")
            .to_string();
        assert!(
            err.starts_with("MOAT_TIMEOUT_SECONDS=\"7200\"") && err.contains("MOAT_MAX_TIMEOUT_SECONDS (600)"),
            "{err}"
        );
        for (var, value) in [("MOAT_MAX_CPUS", "32"), ("MOAT_MAX_SANDBOX_MEMORY_MIB", "1G"), ("MOAT_MAX_DISK_MIB", "0")]
        {
            let err = with(&[(var, value)]).expect_err(var).to_string();
            assert!(err.starts_with(&format!("{var}=")) && err.contains("an integer from"), "{err}");
        }
    }

    #[test]
    fn host_lists_are_read_and_defaulted() {
        let config = with(&[("MOAT_ALLOW_HOSTS", " Example.com, files.pythonhosted.org ,")]).expect("valid");
        assert_eq!(config.allow_hosts, ["example.com", "files.pythonhosted.org"]);
        let config = with(&[("MOAT_ALLOW_HOSTS", "npm.Corp:4873,pypi.org")]).expect("a host:port entry");
        assert_eq!(config.allow_hosts, ["npm.corp:4873", "pypi.org"]);
        assert!(with(&[("MOAT_GIT_HOSTS", "git.corp:8443")]).is_err(), "Git hosts are names");
        assert_eq!(config.git_hosts, DEFAULT_GIT_HOSTS);
        assert_eq!(config.http_token, None);
    }

    #[test]
    fn every_network_policy_is_accepted() {
        for (value, policy) in
            [("none", NetworkPolicy::None), ("filtered", NetworkPolicy::Filtered), ("open", NetworkPolicy::Open)]
        {
            let config = with(&[("MOAT_NETWORK", value), ("MOAT_ALLOW_NETWORK", value)]).expect(value);
            assert_eq!((config.defaults.network, config.grants.network), (policy, policy));
        }
        let config = with(&[("MOAT_TEST_EGRESS_NETS", "127.0.0.1/32"), ("MOAT_TEST_RESOLVE", "Reg.test=127.0.0.1")])
            .expect("test knobs");
        let egress = config.egress();
        assert_eq!(egress.test_nets.len(), 1);
        assert_eq!(egress.test_resolve, [("reg.test".to_owned(), std::net::IpAddr::from([127, 0, 0, 1]))]);
    }
}

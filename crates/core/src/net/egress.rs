//! The host side of `filtered` egress: the policy, the decisions and their
//! log, and the loop that serves one sandbox's proxy.
//!
//! The agent's proxy (`moat_agent::egress`) only reports what a client in
//! the sandbox asks for. Here the host decides: the name must be allowed;
//! the host resolves it itself and refuses loopback, private, link-local
//! (the cloud metadata address 169.254.169.254 among them), CGNAT,
//! unique-local and multicast addresses even for allowed names (so a name
//! that rebinds to an internal address gets nowhere), unless a test
//! configuration explicitly allows a test network; then it connects, and
//! splices the connection to the client through an `egress_attach`
//! connection. Everything runs over a [`Connector`], so the same loop
//! serves a jail's Unix socket and a microVM's vsock alike.

use std::collections::{BTreeSet, VecDeque};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_proto::{AgentClient, Connector, EgressRequest, ProtoError};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::runtime::Runtime;
use crate::timing::now;

/// The port of the proxy inside a `filtered` sandbox.
pub const PROXY_PORT: u16 = 3128;

/// Decisions kept in memory per sandbox (the newest).
pub const LOG_KEPT: usize = 256;
/// The egress log file stops growing at this size (a last line says so).
pub const LOG_FILE_MAX: u64 = 1 << 20;
/// Tunnels one sandbox may have open (or being set up) at once.
pub const MAX_TUNNELS: usize = 256;
/// How long resolving a name may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to an address may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The package registries of each runtime.
pub fn registries(runtime: Option<Runtime>) -> &'static [&'static str] {
    const PYTHON_AND_NODE: &[&str] = &["pypi.org", "files.pythonhosted.org", "registry.npmjs.org"];
    match runtime {
        // A plain sandbox: the image has both Python and Node.js.
        None => PYTHON_AND_NODE,
        Some(Runtime::Python) => &["pypi.org", "files.pythonhosted.org"],
        Some(Runtime::Node) => &["registry.npmjs.org"],
        Some(Runtime::Go) => &["proxy.golang.org", "sum.golang.org"],
        Some(Runtime::Rust) => &["crates.io", "index.crates.io", "static.crates.io"],
        Some(Runtime::Shell) => &[],
    }
}

/// The environment every process of a `filtered` sandbox gets: pip, npm,
/// git (curl), cargo, go and most HTTP clients honour these.
pub fn proxy_env() -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{PROXY_PORT}");
    let no_proxy = "localhost,127.0.0.1,::1";
    [
        ("HTTP_PROXY", url.as_str()),
        ("HTTPS_PROXY", &url),
        ("http_proxy", &url),
        ("https_proxy", &url),
        ("npm_config_proxy", &url),
        ("npm_config_https_proxy", &url),
        ("NO_PROXY", no_proxy),
        ("no_proxy", no_proxy),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Whether `host` is a host name moat accepts in allow lists.
pub fn valid_host_name(host: &str) -> bool {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
    };
    !host.is_empty() && host.len() <= 253 && host.split('.').all(label_ok)
}

/// The ports a host of an allow list is reached on when its entry names
/// none: HTTPS and HTTP, what registries and Git hosts serve.
pub const WEB_PORTS: [u16; 2] = [443, 80];

/// Whether `entry` is an allow-list entry moat accepts: a host name
/// (reached on [`WEB_PORTS`]) or `host:port` (that port only).
pub fn valid_host_entry(entry: &str) -> bool {
    match entry.rsplit_once(':') {
        // Digits as the port is written back (`host:443`, never `+443`
        // or `0443`), so that the entry matches what it names.
        Some((host, port)) => {
            valid_host_name(host)
                && port.bytes().all(|b| b.is_ascii_digit())
                && !port.starts_with('0')
                && port.parse::<u16>().is_ok()
        }
        None => valid_host_name(entry),
    }
}

/// An address range, `ADDR/PREFIX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::str::FromStr for IpNet {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not an address range such as 127.0.0.1/32 or fd00::/8");
        let (addr, prefix) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if prefix.is_empty() { max } else { prefix.parse::<u8>().map_err(|_| bad())? };
        if prefix > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl IpNet {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |a: IpAddr| -> (u128, u32) {
            match a {
                IpAddr::V4(v4) => (u128::from(u32::from(v4)), 32),
                IpAddr::V6(v6) => (u128::from(v6), 128),
            }
        };
        let ((net, width), (addr, addr_width)) = (bits(self.addr), bits(ip));
        if width != addr_width {
            return false;
        }
        let shift = width - u32::from(self.prefix);
        shift >= width || (net >> shift) == (addr >> shift)
    }
}

/// Why an address may not be reached from a sandbox, if it may not.
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden_v4(v4);
            }
            let first = v6.segments()[0];
            if v6.is_loopback() {
                Some("a loopback address")
            } else if v6.is_unspecified() {
                Some("the unspecified address")
            } else if first & 0xfe00 == 0xfc00 {
                Some("a unique-local (private) address")
            } else if first & 0xffc0 == 0xfe80 {
                Some("a link-local address")
            } else if first & 0xff00 == 0xff00 {
                Some("a multicast address")
            } else if v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
                || v6.segments()[..6] == [0; 6]
                || v6.segments()[..6] == [0, 0, 0, 0, 0xffff, 0]
            {
                // NAT64, the deprecated IPv4-compatible form and SIIT's
                // IPv4-translated form (`::ffff:0:a.b.c.d`, RFC 2765):
                // judge the IPv4 address inside.
                let [.., a, b] = v6.segments();
                forbidden_v4(Ipv4Addr::from((u32::from(a) << 16) | u32::from(b)))
            } else if first == 0x2002 {
                // 6to4: the IPv4 address of the relay that unwraps it.
                let [_, a, b, ..] = v6.segments();
                forbidden_v4(Ipv4Addr::from((u32::from(a) << 16) | u32::from(b)))
            } else if v6.segments()[..3] == [0x64, 0xff9b, 1] {
                Some("a local-use NAT64 address (RFC 8215), which the network maps to private IPv4")
            } else if first & 0xffc0 == 0xfec0 {
                Some("a site-local (private) address")
            } else if v6.segments()[..2] == [0x2001, 0] {
                Some("a Teredo (tunnelled) address")
            } else {
                None
            }
        }
    }
}

fn forbidden_v4(v4: Ipv4Addr) -> Option<&'static str> {
    let [a, b, _, _] = v4.octets();
    if v4.is_loopback() {
        Some("a loopback address")
    } else if v4.is_private() {
        Some("a private address")
    } else if v4 == Ipv4Addr::new(169, 254, 169, 254) {
        Some("the cloud metadata address")
    } else if v4.is_link_local() {
        Some("a link-local address")
    } else if a == 100 && (64..128).contains(&b) {
        Some("a carrier-grade NAT (shared) address")
    } else if v4.is_multicast() || v4.is_broadcast() {
        Some("a multicast or broadcast address")
    } else if a == 0 || a >= 240 || (a, b, v4.octets()[2]) == (192, 0, 0) || (a == 198 && (18..20).contains(&b)) {
        // With 192.0.0.0/24 (protocol assignments) and 198.18.0.0/15
        // (benchmarking, which some VPNs and proxies map internal names to).
        Some("a reserved address")
    } else {
        None
    }
}

/// The server-wide egress settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressConfig {
    /// `MOAT_ALLOW_HOSTS`: reachable from every filtered sandbox.
    pub allow_hosts: Vec<String>,
    /// `MOAT_GIT_HOSTS`: the hosts `git_clone` may clone from (reachable
    /// from every filtered sandbox, so that git works from a shell too).
    pub git_hosts: Vec<String>,
    /// `MOAT_ALLOW_SSH_KEY=1`: clones over SSH may use a key the tool
    /// call names (beneath `~/.ssh` or a shared root).
    pub ssh_keys: bool,
    /// `MOAT_SSH_KNOWN_HOSTS`: the host keys SSH clones trust, instead of
    /// the user's `~/.ssh/known_hosts`.
    pub ssh_known_hosts: Option<PathBuf>,
    /// TEST ONLY (`MOAT_TEST_EGRESS_NETS`): address ranges that are
    /// reachable although private or loopback, so that tests can serve
    /// "registries" on this machine.
    pub test_nets: Vec<IpNet>,
    /// TEST ONLY (`MOAT_TEST_RESOLVE`): names resolved to these addresses
    /// instead of asking DNS.
    pub test_resolve: Vec<(String, IpAddr)>,
}

/// The hosts `git_clone` may use unless `MOAT_GIT_HOSTS` says otherwise.
pub const DEFAULT_GIT_HOSTS: &[&str] = &["github.com", "gitlab.com", "bitbucket.org"];

impl EgressConfig {
    /// `MOAT_ALLOW_HOSTS`, `MOAT_GIT_HOSTS` and the SSH settings from the environment (for
    /// tools without their own configuration, such as the `moat` CLI);
    /// names that are not host names are skipped with a warning. The test
    /// knobs are never read here.
    pub fn from_env() -> Self {
        let list = |var: &str, default: &[&str]| -> Vec<String> {
            let Some(value) = std::env::var(var).ok().filter(|v| !v.is_empty()) else {
                return default.iter().map(|h| (*h).to_owned()).collect();
            };
            value
                .split(',')
                .map(|h| h.trim().to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .filter(|h| {
                    let ok = if var == "MOAT_ALLOW_HOSTS" { valid_host_entry(h) } else { valid_host_name(h) };
                    if !ok {
                        tracing::warn!(
                            "{var}: {h:?} is not a host name (nor, for MOAT_ALLOW_HOSTS, host:port); skipped"
                        );
                    }
                    ok
                })
                .collect()
        };
        Self {
            allow_hosts: list("MOAT_ALLOW_HOSTS", &[]),
            git_hosts: list("MOAT_GIT_HOSTS", DEFAULT_GIT_HOSTS),
            ssh_keys: std::env::var("MOAT_ALLOW_SSH_KEY").is_ok_and(|v| ["1", "true", "yes"].contains(&v.trim())),
            ssh_known_hosts: std::env::var_os("MOAT_SSH_KNOWN_HOSTS").filter(|v| !v.is_empty()).map(PathBuf::from),
            ..Self::default()
        }
    }
}

/// The host of a Git remote URL (`https://host/…`, `ssh://git@host/…`,
/// `git@host:owner/repo`), when it is a host name.
pub fn git_remote_host(url: &str) -> Option<String> {
    let authority = match url.split_once("://") {
        Some((_, rest)) => rest.split('/').next().unwrap_or_default(),
        // scp-like syntax: [user@]host:path
        None if url.contains(':') && !url.starts_with('/') => url.split(':').next().unwrap_or_default(),
        None => return None,
    };
    let host = authority.rsplit('@').next()?.split(':').next()?.to_ascii_lowercase();
    valid_host_name(&host).then_some(host)
}

/// The host of the `origin` remote in a checkout's `.git/config`, if any.
pub fn repository_host(config: &str) -> Option<String> {
    let mut in_origin = false;
    for line in config.lines().map(str::trim) {
        if line.starts_with('[') {
            in_origin = line.replace(' ', "") == "[remote\"origin\"]";
        } else if in_origin && let Some(("url", value)) = line.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            return git_remote_host(value);
        }
    }
    None
}

/// One decision of a sandbox's egress policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressDecision {
    /// Seconds since the Unix epoch.
    pub at: u64,
    pub host: String,
    pub port: u16,
    pub allowed: bool,
    /// The address connected to (allowed) or refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Why, in words.
    pub reason: String,
}

/// One sandbox's egress policy and log.
#[derive(Debug)]
pub struct SandboxEgress {
    config: Arc<EgressConfig>,
    /// The sandbox's own `allow_hosts`.
    own_hosts: Vec<String>,
    /// The runtime whose registries are allowed (`None`: Python and Node.js).
    runtime: Mutex<Option<Runtime>>,
    /// A task's repository host.
    repository: Mutex<Option<String>>,
    log: Mutex<EgressLog>,
    /// Host-name lookups under way: each holds one of the blocking threads
    /// every sandbox's work shares until the resolver answers, which a
    /// timed-out wait does not end.
    lookups: Arc<tokio::sync::Semaphore>,
}

/// Host-name lookups one sandbox may have under way at once.
const LOOKUPS: usize = 8;

#[derive(Debug)]
struct EgressLog {
    recent: VecDeque<EgressDecision>,
    file: Option<PathBuf>,
    written: u64,
}

impl SandboxEgress {
    pub fn new(config: Arc<EgressConfig>, own_hosts: Vec<String>, log_file: Option<PathBuf>) -> Self {
        Self {
            config,
            own_hosts,
            runtime: Mutex::new(None),
            repository: Mutex::new(None),
            log: Mutex::new(EgressLog { recent: VecDeque::new(), file: log_file, written: 0 }),
            lookups: Arc::new(tokio::sync::Semaphore::new(LOOKUPS)),
        }
    }

    /// Allows `runtime`'s registries instead of Python's and Node.js's.
    pub fn set_runtime(&self, runtime: Runtime) {
        *self.runtime.lock().unwrap_or_else(PoisonError::into_inner) = Some(runtime);
    }

    /// Allows a task's repository host.
    pub fn set_repository_host(&self, host: String) {
        *self.repository.lock().unwrap_or_else(PoisonError::into_inner) = Some(host);
    }

    /// Whether this sandbox may reach `host` on `port`: a host listed by
    /// name on [`WEB_PORTS`], one listed as `host:port` on that port.
    /// (A name the tests resolve, `MOAT_TEST_RESOLVE`, on any port: test
    /// servers listen where they can.)
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let hosts = self.allowed_hosts();
        // A name is one without a port (a `host:port` entry names no host).
        hosts.contains(&format!("{host}:{port}"))
            || (!host.contains(':')
                && hosts.contains(host)
                && (WEB_PORTS.contains(&port) || self.config.test_resolve.iter().any(|(name, _)| name == host)))
    }

    /// Every host entry this sandbox may reach: host names (on
    /// [`WEB_PORTS`]) and `host:port` entries.
    pub fn allowed_hosts(&self) -> BTreeSet<String> {
        let runtime = *self.runtime.lock().unwrap_or_else(PoisonError::into_inner);
        let repository = self.repository.lock().unwrap_or_else(PoisonError::into_inner).clone();
        registries(runtime)
            .iter()
            .map(|h| (*h).to_owned())
            .chain(repository)
            .chain(self.config.allow_hosts.iter().cloned())
            .chain(self.config.git_hosts.iter().cloned())
            .chain(self.own_hosts.iter().cloned())
            .map(|h| h.to_ascii_lowercase())
            .collect()
    }

    /// The newest decisions, oldest first.
    pub fn log(&self) -> Vec<EgressDecision> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).recent.iter().cloned().collect()
    }

    fn record(&self, decision: EgressDecision) {
        tracing::debug!(host = decision.host, port = decision.port, allowed = decision.allowed, "{}", decision.reason);
        let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = log.file.clone()
            && log.written < LOG_FILE_MAX
        {
            let mut line = serde_json::to_string(&decision).unwrap_or_default();
            line.push('\n');
            // Room is kept for the closing note.
            let full = log.written + line.len() as u64 > LOG_FILE_MAX - 256;
            if full {
                line =
                    "{\"note\":\"the egress log reached its size limit; later decisions are kept in memory only\"}\n"
                        .into();
            }
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(line.as_bytes()));
            log.written = if appended.is_ok() && !full { log.written + line.len() as u64 } else { LOG_FILE_MAX };
        }
        if log.recent.len() >= LOG_KEPT {
            log.recent.pop_front();
        }
        log.recent.push_back(decision);
    }

    /// The addresses of `host`, looked up on a blocking thread that keeps
    /// one of the sandbox's [`LOOKUPS`] places until the resolver answers,
    /// however long after a caller stopped waiting: a sandbox naming slow
    /// hosts ties up that many threads, never the pool.
    async fn lookup(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        let place = self.lookups.clone().try_acquire_owned().map_err(|_| {
            std::io::Error::other(format!(
                "{LOOKUPS} of this sandbox's lookups are still waiting for their DNS answers; try again shortly"
            ))
        })?;
        let host = host.to_owned();
        tokio::task::spawn_blocking(move || {
            let _place = place;
            std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port)).map(Iterator::collect)
        })
        .await
        .map_err(std::io::Error::other)?
    }

    /// Decides on one request: the address to connect to, or why not.
    async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, (String, Option<String>)> {
        let how_to_allow = "the operator who starts moat can allow it with MOAT_ALLOW_HOSTS \
                            (or grant network 'open' with MOAT_ALLOW_NETWORK=open)";
        if !self.allows(host, port) {
            let why = if self.allowed_hosts().contains(host) {
                format!(
                    "moat refused {host}:{port}: {host} is allowed on ports 443 and 80 only; the operator who \
                     starts moat can allow this port with MOAT_ALLOW_HOSTS={host}:{port}"
                )
            } else {
                format!("moat refused {host}:{port}: {host} is not an allowed host; {how_to_allow}")
            };
            return Err((why, None));
        }
        let addrs: Vec<SocketAddr> = match self.config.test_resolve.iter().find(|(name, _)| name == host) {
            Some((_, ip)) => vec![SocketAddr::new(*ip, port)],
            None => match tokio::time::timeout(RESOLVE_TIMEOUT, self.lookup(host, port)).await {
                Ok(Ok(addrs)) => addrs,
                Ok(Err(e)) => return Err((format!("moat refused {host}:{port}: cannot resolve {host}: {e}"), None)),
                Err(_) => return Err((format!("moat refused {host}:{port}: resolving {host} timed out"), None)),
            },
        };
        let mut refused = None;
        let mut usable = Vec::new();
        for addr in addrs {
            let test_allowed = self.config.test_nets.iter().any(|net| net.contains(addr.ip()));
            match forbidden_address(addr.ip()) {
                Some(what) if !test_allowed => refused = refused.or(Some((addr.ip(), what))),
                _ => usable.push(addr),
            }
        }
        if usable.is_empty() {
            return Err(match refused {
                Some((ip, what)) => (
                    format!(
                        "moat refused {host}:{port}: {host} resolves to {ip}, {what}, which sandboxes may never reach \
                         (not even through allowed names)"
                    ),
                    Some(ip.to_string()),
                ),
                None => (format!("moat refused {host}:{port}: {host} has no address"), None),
            });
        }
        Ok(usable)
    }
}

/// A running egress proxy of one sandbox; dropping it stops the proxy and
/// closes its tunnels.
#[derive(Debug)]
pub struct EgressProxy {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EgressProxy {
    /// Starts the proxy in the sandbox behind `client` and serves it.
    pub async fn start<C: Connector>(client: AgentClient<C>, policy: Arc<SandboxEgress>) -> Result<Self, ProtoError> {
        let control = client.egress_listen(PROXY_PORT).await?;
        let task = tokio::spawn(serve(Arc::new(client), policy, control));
        Ok(Self { task })
    }
}

async fn serve<C: Connector>(
    client: Arc<AgentClient<C>>,
    policy: Arc<SandboxEgress>,
    mut control: moat_proto::EgressControl<C::Stream>,
) {
    let (deny, mut denials) = mpsc::channel::<(u64, String)>(64);
    let mut tunnels = JoinSet::new();
    loop {
        tokio::select! {
            request = control.next_request() => match request {
                Some(Ok(request)) => {
                    if tunnels.len() >= MAX_TUNNELS {
                        // The name is not checked yet: it is not repeated.
                        let reason = format!("moat refused a connection: more than {MAX_TUNNELS} tunnels open");
                        policy.record(decision(&request, false, None, reason.clone()));
                        if control.deny(request.id, reason).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    tunnels.spawn(tunnel(client.clone(), policy.clone(), request, deny.clone()));
                }
                Some(Err(e)) => {
                    tracing::warn!("the egress proxy's control connection failed: {e}");
                    break;
                }
                None => break,
            },
            Some((id, reason)) = denials.recv() => {
                if control.deny(id, reason).await.is_err() {
                    break;
                }
            }
            Some(_) = tunnels.join_next(), if !tunnels.is_empty() => {}
        }
    }
}

fn decision(request: &EgressRequest, allowed: bool, address: Option<String>, reason: String) -> EgressDecision {
    // The agent checked the name, but the agent is inside the sandbox: a
    // name the host would not accept is kept as a marker, never as the
    // bytes the sandbox sent (up to a frame's 4 MiB each, 256 decisions).
    let host = if proxy_host_ok(&request.host) { request.host.clone() } else { "(an invalid name)".into() };
    EgressDecision { at: now(), host, port: request.port, allowed, address, reason }
}

/// Whether `host`, as the agent's proxy passed it on, is a name or an
/// address at all: the agent's own rule, checked again on the host.
fn proxy_host_ok(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'))
}

/// Decides, connects and splices one proxy client.
async fn tunnel<C: Connector>(
    client: Arc<AgentClient<C>>,
    policy: Arc<SandboxEgress>,
    request: EgressRequest,
    deny: mpsc::Sender<(u64, String)>,
) {
    let refuse = |reason: String, address: Option<String>| {
        policy.record(decision(&request, false, address, reason.clone()));
        let deny = deny.clone();
        let id = request.id;
        async move {
            let _ = deny.send((id, reason)).await;
        }
    };
    if !proxy_host_ok(&request.host) {
        return refuse("not a host name or address (letters, digits, '.', '-', '_', ':', at most 253)".into(), None)
            .await;
    }
    let addrs = match policy.resolve(&request.host, request.port).await {
        Ok(addrs) => addrs,
        Err((reason, address)) => return refuse(reason, address).await,
    };
    let mut last_error = String::new();
    let mut upstream = None;
    for addr in &addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                upstream = Some((stream, *addr));
                break;
            }
            Ok(Err(e)) => last_error = format!("connecting to {addr} failed: {e}"),
            Err(_) => last_error = format!("connecting to {addr} timed out"),
        }
    }
    let Some((mut upstream, addr)) = upstream else {
        let reason = format!("moat could not reach {}:{}: {last_error}", request.host, request.port);
        return refuse(reason, None).await;
    };
    // Bounded like the connection upstream: an agent that never attaches
    // would hold the upstream connection and a place among the tunnels.
    let mut attached = match tokio::time::timeout(CONNECT_TIMEOUT, client.egress_attach(request.id)).await {
        Ok(Ok(attached)) => attached,
        Ok(Err(e)) => {
            tracing::debug!(host = request.host, "the proxy client left before its tunnel was up: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!(host = request.host, "the agent did not take the tunnel within {CONNECT_TIMEOUT:?}");
            return;
        }
    };
    policy.record(decision(&request, true, Some(addr.ip().to_string()), "allowed host".into()));
    if let Err(e) = tokio::io::copy_bidirectional(&mut attached, &mut upstream).await {
        tracing::debug!(host = request.host, "egress tunnel ended: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_checks_the_name_the_agent_passed_on() {
        for good in ["pypi.org", "10.0.0.1", "::1", "my_host.internal"] {
            assert!(proxy_host_ok(good), "{good}");
        }
        let long = "a".repeat(254);
        for bad in ["", "evil.com\r\nX: y", "a b", "\u{0}", long.as_str(), "h\u{e9}te"] {
            assert!(!proxy_host_ok(bad), "{bad:?}");
        }
        let request = EgressRequest { id: 1, host: "x".repeat(5000), port: 443 };
        assert_eq!(decision(&request, false, None, "no".into()).host, "(an invalid name)");
    }

    #[test]
    fn internal_addresses_are_forbidden() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::1",
            "2002:7f00:1::",
            "::10.0.0.1",
            "::ffff:0:7f00:1",
            "::ffff:0:a9fe:a9fe",
            "64:ff9b:1::a00:1",
            "fec0::1",
            "2001:0:4136:e378::1",
            "192.0.0.170",
            "198.18.0.1",
            "198.19.255.254",
        ] {
            let ip: IpAddr = ip.parse().expect("an address");
            assert!(forbidden_address(ip).is_some(), "{ip} must be forbidden");
        }
        // Documentation ranges are not refused: some networks really route them.
        for ip in [
            "151.101.0.223",
            "8.8.8.8",
            "2a04:4e42::223",
            "100.128.0.1",
            "172.32.0.1",
            "203.0.113.80",
            "2002:808:808::1",
            "::ffff:0:808:808",
            "2001:db8::1",
            "198.20.0.1",
        ] {
            let ip: IpAddr = ip.parse().expect("an address");
            assert_eq!(forbidden_address(ip), None, "{ip} is public");
        }
        assert_eq!(forbidden_address("169.254.169.254".parse().expect("v4")), Some("the cloud metadata address"));
    }

    #[test]
    fn address_ranges_parse_and_match() {
        let net: IpNet = "127.0.0.0/8".parse().expect("parses");
        assert!(net.contains("127.1.2.3".parse().expect("v4")));
        assert!(!net.contains("128.0.0.1".parse().expect("v4")));
        assert!(!net.contains("::1".parse().expect("v6")));
        let one: IpNet = "10.0.0.5".parse().expect("a single address");
        assert_eq!(one.prefix, 32);
        assert!(one.contains("10.0.0.5".parse().expect("v4")) && !one.contains("10.0.0.6".parse().expect("v4")));
        let all: IpNet = "::/0".parse().expect("everything");
        assert!(all.contains("fd00::1".parse().expect("v6")));
        for bad in ["10.0.0.0/33", "x/8", "10.0.0.0/", "::/129"] {
            if bad == "10.0.0.0/" {
                assert!(bad.parse::<IpNet>().is_ok(), "an empty prefix means the single address");
                continue;
            }
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
    }

    fn policy(config: EgressConfig, own: &[&str]) -> SandboxEgress {
        SandboxEgress::new(Arc::new(config), own.iter().map(|h| (*h).to_owned()).collect(), None)
    }

    #[tokio::test]
    async fn names_must_be_allowed_and_resolve_to_public_addresses() {
        let config = EgressConfig {
            allow_hosts: vec!["good.test".into(), "rebind.test".into()],
            test_resolve: vec![
                ("good.test".into(), "127.0.0.1".parse().expect("v4")),
                ("rebind.test".into(), "10.0.0.7".parse().expect("v4")),
            ],
            test_nets: vec!["127.0.0.1/32".parse().expect("net")],
            ..EgressConfig::default()
        };
        let egress = policy(config, &["own.test"]);
        assert!(egress.allowed_hosts().contains("pypi.org"), "a plain sandbox gets Python's registries");
        assert!(egress.allowed_hosts().contains("registry.npmjs.org"), "and Node.js's");
        egress.set_runtime(Runtime::Rust);
        assert!(!egress.allowed_hosts().contains("pypi.org") && egress.allowed_hosts().contains("crates.io"));
        assert!(egress.allowed_hosts().contains("own.test"));

        // Ports: an allowed name on 443 and 80, a host:port entry on its
        // port; nothing else (a Git host's SSH, an internal server's
        // other services).
        let web = policy(
            EgressConfig { allow_hosts: vec!["git.corp".into(), "npm.corp:4873".into()], ..EgressConfig::default() },
            &[],
        );
        assert!(web.allows("git.corp", 443) && web.allows("git.corp", 80) && web.allows("pypi.org", 443));
        assert!(!web.allows("git.corp", 22) && !web.allows("git.corp", 8080) && !web.allows("pypi.org", 25));
        assert!(web.allows("npm.corp", 4873) && !web.allows("npm.corp", 443));
        let (why, _) = web.resolve("git.corp", 8080).await.expect_err("another port");
        assert!(why.contains("ports 443 and 80 only") && why.contains("MOAT_ALLOW_HOSTS=git.corp:8080"), "{why}");
        assert!(valid_host_entry("npm.corp:4873") && !valid_host_entry("npm.corp:0") && !valid_host_entry("a b:1"));
        assert!(!valid_host_entry("npm.corp:99999") && !valid_host_entry(":443"));
        assert!(!valid_host_entry("npm.corp:+4873") && !valid_host_entry("npm.corp:04873"));
        assert!(!web.allows("npm.corp:4873", 443), "an entry with a port is no name");

        let (why, _) = egress.resolve("evil.test", 443).await.expect_err("not allowed");
        assert!(why.contains("evil.test is not an allowed host") && why.contains("MOAT_ALLOW_HOSTS"), "{why}");
        let (why, address) = egress.resolve("rebind.test", 443).await.expect_err("private");
        assert!(why.contains("a private address"), "{why}");
        assert_eq!(address.as_deref(), Some("10.0.0.7"));
        let addrs = egress.resolve("good.test", 8443).await.expect("allowed test address");
        assert_eq!(addrs, [SocketAddr::from(([127, 0, 0, 1], 8443))]);
    }

    #[test]
    fn repository_hosts_are_read_from_remotes() {
        for (url, host) in [
            ("https://github.com/owner/repo.git", Some("github.com")),
            ("https://user@Git.Example.com:8443/r", Some("git.example.com")),
            ("ssh://git@gitlab.com/owner/repo", Some("gitlab.com")),
            ("git@bitbucket.org:owner/repo.git", Some("bitbucket.org")),
            ("/srv/repos/local.git", None),
            ("https://bad host/x", None),
        ] {
            assert_eq!(git_remote_host(url).as_deref(), host, "{url}");
        }
        let config = "[core]\n\tbare = false\n[remote \"upstream\"]\n\turl = https://a.example/x\n[remote \"origin\"]\n\turl = git@code.example.org:me/p.git\n";
        assert_eq!(repository_host(config).as_deref(), Some("code.example.org"));
        let egress = policy(EgressConfig::default(), &[]);
        egress.set_repository_host("code.example.org".into());
        assert!(egress.allowed_hosts().contains("code.example.org"));
    }

    #[test]
    fn the_log_is_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("egress.log");
        let egress = SandboxEgress::new(Arc::default(), Vec::new(), Some(file.clone()));
        let request = EgressRequest { id: 1, host: "x".repeat(200), port: 443 };
        for _ in 0..(LOG_FILE_MAX / 200 + 10) {
            egress.record(decision(&request, false, None, "why".into()));
        }
        assert_eq!(egress.log().len(), LOG_KEPT);
        let size = std::fs::metadata(&file).expect("written").len();
        assert!(size <= LOG_FILE_MAX, "{size}");
        let text = std::fs::read_to_string(&file).expect("reads");
        assert!(text.lines().last().is_some_and(|l| l.contains("size limit")), "ends with a note");
    }
}

//! `git_clone`: clone a repository into a sandbox through its network
//! policy.
//!
//! The URL's host must be one of `MOAT_GIT_HOSTS`, and the server must
//! grant network (`MOAT_ALLOW_NETWORK`). The token reaches only git's
//! credential exchange for the clone's own host:
//!
//! - it travels on the clone's stdin, never in an argument or environment
//!   variable, into a file in a directory only root (in the sandbox) can
//!   read, removed when the clone ends: by the clone's shell when it ends
//!   by itself, and by moat when it is killed at its timeout or cancelled
//!   with its call (`CloneSweep`);
//! - the clone runs as root with an environment of moat's own (none of the
//!   sandbox's `env`), `GIT_CONFIG_NOSYSTEM=1` and `GIT_CONFIG_GLOBAL`
//!   naming a config of moat's own, so the user-writable `~/.gitconfig`
//!   (`insteadOf`, `http.proxy`, `sslVerify`, helpers) is never read;
//!   `protocol.allow=never` with only https allowed;
//! - its credential helper answers only `https` requests for the URL's own
//!   host and port, so a redirect elsewhere gets nothing;
//! - the checkout is made in a root-only staging directory, given to
//!   `user`, and moved into place by `user`, so no user process can swap
//!   in a repository configuration that root's git would read.
//!
//! What git prints is scrubbed of the token anyway before it goes anywhere.

use moat_core::NetworkPolicy;
use moat_core::net::gitssh::{SshRemote, SshTransport};
use moat_proto::ExecRequest;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::{CallContext, Outcome, RichOutcome, SandboxRef, Session, Tool, ToolError, plain};

/// The arguments of `git_clone`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct GitClone {
    url: String,
    path: Option<String>,
    branch: Option<String>,
    commit: Option<String>,
    username: Option<String>,
    token: Option<String>,
    ssh_key_path: Option<String>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for GitClone {
    const NAME: &'static str = "git_clone";

    async fn run(self, server: &Session<'_>, context: &CallContext) -> RichOutcome {
        plain(git_clone(server, self, context).await)
    }
}

/// How long a clone may take.
const CLONE_TIMEOUT_MS: u64 = 600_000;

/// The helper git asks for credentials: answers `get` for https requests
/// to the host in `host` beside it, with `cred` beside it, and nothing else.
const CREDENTIAL_HELPER: &str = r#"#!/bin/sh
[ "$1" = get ] || exit 0
dir=${0%/*}
want=$(cat "$dir/host")
proto= host=
while IFS= read -r line; do
  [ -z "$line" ] && break
  case $line in protocol=*) proto=${line#protocol=} ;; host=*) host=${line#host=} ;; esac
done
host=$(printf '%s' "$host" | tr 'A-Z' 'a-z')
if [ "$proto" = https ] && [ "$host" = "$want" ] && [ -s "$dir/cred" ]; then cat "$dir/cred"; fi
"#;

/// git's whole configuration during a clone (`GIT_CONFIG_GLOBAL`; no system
/// or user file is read). `@HELPER@` is replaced by the helper's path.
const GIT_CONFIG: &str = "[credential]\n\thelper = @HELPER@\n[protocol]\n\tallow = never\n\
                          [protocol \"https\"]\n\tallow = always\n[http]\n\tsslVerify = true\n";

/// The clone, run as root. Inputs: the environment below (no secret; the
/// names of the secret and staging directories, `MOAT_GIT_SECRET` and
/// `MOAT_GIT_STAGE`, are chosen by moat, which removes both if the clone is
/// killed), and on stdin the user name then the token, one line each.
/// Prints the staging directory and the commit checked out, one line each.
const CLONE_SCRIPT: &str = r#"set -eu
umask 077
IFS= read -r user_name || true
IFS= read -r token || true
secret=$MOAT_GIT_SECRET stage=$MOAT_GIT_STAGE
trap 'rm -rf "$secret"; [ -n "${keep:-}" ] || rm -rf "$stage"' EXIT
mkdir -- "$secret" "$stage"
printf '%s
' "$MOAT_GIT_AUTHORITY" > "$secret/host"
if [ -n "$token" ]; then printf 'username=%s
password=%s
' "$user_name" "$token" > "$secret/cred"; fi
unset token user_name
printf '%s' "$MOAT_GIT_HELPER" > "$secret/helper"
chmod 700 "$secret/helper"
printf '%s' "$MOAT_GIT_CONFIG" | sed "s#@HELPER@#$secret/helper#" > "$secret/config"
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL="$secret/config" HOME="$secret" XDG_CONFIG_HOME="$secret"
unset MOAT_GIT_HELPER MOAT_GIT_CONFIG
umask 022
cd "$stage"
if [ -n "$MOAT_GIT_BRANCH" ]; then
  git clone -q --branch "$MOAT_GIT_BRANCH" -- "$MOAT_GIT_URL" repo
else
  git clone -q -- "$MOAT_GIT_URL" repo
fi
cd repo
if [ -n "$MOAT_GIT_COMMIT" ]; then
  git checkout -q "$MOAT_GIT_COMMIT" 2>/dev/null || { git fetch -q origin "$MOAT_GIT_COMMIT" && git checkout -q FETCH_HEAD; }
fi
commit=$(git rev-parse HEAD)
cd /
chown -R user:user "$stage"
chmod 700 "$stage"
keep=1
printf '%s
%s
' "$stage" "$commit"
"#;

/// The clone over SSH, run as root: as [`CLONE_SCRIPT`] (its directories
/// named by moat too), but git's "ssh" is a relay on this process's stdin
/// and stdout, which moat connects to the host's `ssh`
/// (`moat_core::net::gitssh`); everything it prints goes to stderr, its
/// last line `moat-git-result STAGE COMMIT`.
const SSH_CLONE_SCRIPT: &str = r#"set -eu
exec 3<&0 4>&1 </dev/null >&2
umask 077
secret=$MOAT_GIT_SECRET stage=$MOAT_GIT_STAGE
trap 'rm -rf "$secret"; [ -n "${keep:-}" ] || rm -rf "$stage"' EXIT
mkdir -- "$secret" "$stage"
# git's stdin to the host's ssh (fd 4), the host's ssh (fd 3) to git's stdout;
# each cat holds only its own end, so each side sees the other end.
printf '#!/bin/sh\ncat <&3 4>&- 2>/dev/null &\nexec cat >&4 3<&-\n' > "$secret/ssh"
chmod 700 "$secret/ssh"
printf '[protocol]\n\tallow = never\n[protocol "ssh"]\n\tallow = always\n[core]\n\tsshCommand = %s\n[ssh]\n\tvariant = ssh\n' \
  "$secret/ssh" > "$secret/config"
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL="$secret/config" HOME="$secret" XDG_CONFIG_HOME="$secret"
umask 022
cd "$stage"
if [ -n "$MOAT_GIT_BRANCH" ]; then
  git clone -q --branch "$MOAT_GIT_BRANCH" -- "$MOAT_GIT_URL" repo
else
  git clone -q -- "$MOAT_GIT_URL" repo
fi
exec 3<&- 4>&-
cd repo
if [ -n "$MOAT_GIT_COMMIT" ]; then
  git checkout -q "$MOAT_GIT_COMMIT" 2>/dev/null || {
    echo "fatal: commit $MOAT_GIT_COMMIT is not in the clone; over SSH a commit must be on a branch or tag (give that branch too)"
    exit 1
  }
fi
commit=$(git rev-parse HEAD)
cd /
chown -R user:user "$stage"
chmod 700 "$stage"
keep=1
echo "moat-git-result $stage $commit"
"#;

/// Moves the checkout from its staging directory into place, as `user`:
/// a new directory, or into an empty one (a task's `/workspace`).
const PLACE_SCRIPT: &str = r#"set -eu
trap 'rm -rf "$MOAT_GIT_STAGE"' EXIT
if [ -d "$MOAT_GIT_DEST" ] && [ ! -L "$MOAT_GIT_DEST" ] && [ -z "$(ls -A -- "$MOAT_GIT_DEST")" ]; then
  find "$MOAT_GIT_STAGE/repo" -mindepth 1 -maxdepth 1 -exec mv -t "$MOAT_GIT_DEST" -- {} +
elif [ -e "$MOAT_GIT_DEST" ] || [ -L "$MOAT_GIT_DEST" ]; then
  echo "fatal: destination path '$MOAT_GIT_DEST' already exists and is not an empty directory." >&2
  exit 128
else
  mkdir -p -- "$(dirname -- "$MOAT_GIT_DEST")"
  mv -T -- "$MOAT_GIT_STAGE/repo" "$MOAT_GIT_DEST"
fi
"#;

/// A Git URL taken apart: its authority (host and port as git's
/// credential requests name them, lower case) and its host (no port).
fn url_host(url: &str) -> Result<(String, String), ToolError> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        ToolError(format!(
            "url {url:?} is not an http(s) or SSH URL; use https://HOST/OWNER/REPO(.git) or git@HOST:OWNER/REPO"
        ))
    })?;
    if scheme != "https" {
        return Err(ToolError(format!(
            "url scheme {scheme:?} is not supported; git_clone clones over https:// or SSH (ssh://USER@HOST/PATH \
             or USER@HOST:PATH) only (http would send credentials in the clear; git:// authenticates nothing)"
        )));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(ToolError(
            "put credentials in username and token, not in the URL (where they would end up in logs)".into(),
        ));
    }
    // The authority alone is parsed: the same text git takes as the host
    // (and whose port it names in credential requests).
    let host = url::Url::parse(&format!("https://{authority}/")).ok().and_then(|parsed| {
        Some(match parsed.host()? {
            url::Host::Domain(name) => name.to_owned(),
            url::Host::Ipv4(address) => address.to_string(),
            url::Host::Ipv6(address) => address.to_string(),
        })
    });
    let host = match host {
        Some(host) if !host.is_empty() && !url.chars().any(|c| c.is_control() || c == ' ') => host,
        _ => return Err(ToolError(format!("url {url:?} has no host or holds spaces or control characters"))),
    };
    if !authority.chars().all(|c| c.is_ascii_alphanumeric() || "-.:[]".contains(c)) {
        return Err(ToolError(format!("url {url:?} has characters a host name cannot hold")));
    }
    Ok((authority.to_ascii_lowercase(), host.to_ascii_lowercase()))
}

/// `/workspace/<name>` for a URL ending in `<name>` or `<name>.git`.
fn default_path(url: &str) -> Result<String, ToolError> {
    let path = match SshRemote::parse(url) {
        Some(Ok(remote)) => remote.path,
        _ => url.split_once("://").map_or("", |(_, rest)| rest.split_once('/').map_or("", |(_, path)| path)).to_owned(),
    };
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or_default();
    let name = name.strip_suffix(".git").unwrap_or(name);
    if name.is_empty() || name.starts_with('.') || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(ToolError(format!("cannot name a directory after {url:?}; pass path")));
    }
    Ok(format!("/workspace/{name}"))
}

fn check_ref(what: &str, value: &str, hex_only: bool) -> Result<(), ToolError> {
    let ok = if hex_only {
        (4..=64).contains(&value.len()) && value.chars().all(|c| c.is_ascii_hexdigit())
    } else {
        !value.is_empty()
            && value.len() <= 255
            && !value.starts_with('-')
            && value.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    };
    if ok {
        Ok(())
    } else if hex_only {
        Err(ToolError(format!("{what} must be a commit hash (4 to 64 hexadecimal digits)")))
    } else {
        Err(ToolError(format!("{what} must be a branch or tag name (letters, digits, '-', '_', '.', '/')")))
    }
}

/// Replaces every occurrence of the secrets with `***`.
fn scrub(text: &str, secrets: &[&str]) -> String {
    secrets.iter().filter(|s| s.len() >= 4).fold(text.to_owned(), |text, secret| text.replace(secret, "***"))
}

/// A clone's arguments, checked: nothing runs and no sandbox is made before
/// [`CloneRequest::check`] succeeds.
pub(super) struct CloneRequest {
    pub(super) url: String,
    authority: String,
    /// The URL's host, lowercase: one of the operator's Git hosts.
    pub(super) host: String,
    path: String,
    branch: String,
    commit: String,
    username: String,
    token: String,
    /// Set for an SSH URL: the host's side of the clone.
    ssh: Option<SshClone>,
}

/// An SSH clone's host side: where, with which key, trusting which host
/// keys.
pub(super) struct SshClone {
    remote: SshRemote,
    key: Vec<u8>,
    known_hosts: Vec<std::path::PathBuf>,
    /// Where to connect instead of resolving the host (tests only).
    address: Option<std::net::IpAddr>,
}

/// What to clone, as the tools take it.
pub(super) struct CloneArgs<'a> {
    pub(super) url: &'a str,
    pub(super) path: Option<&'a str>,
    pub(super) branch: Option<&'a str>,
    pub(super) commit: Option<&'a str>,
    pub(super) username: Option<&'a str>,
    pub(super) token: Option<&'a str>,
    pub(super) ssh_key_path: Option<&'a str>,
}

impl CloneRequest {
    /// Checks the URL, its host against `MOAT_GIT_HOSTS`, the operator's
    /// network grant, the refs and the credentials.
    pub(super) fn check(server: &Session<'_>, args: &CloneArgs<'_>) -> Result<Self, ToolError> {
        let url = args.url;
        let token = args.token.unwrap_or_default();
        let secrets = [token];
        // Errors of the arguments are built from the URL, which has no token
        // in it (refused above) — but scrub them too.
        let refuse = |e: ToolError| ToolError(scrub(&e.0, &secrets));
        let remote = SshRemote::parse(url).transpose().map_err(ToolError)?;
        let (authority, host) = match &remote {
            Some(remote) => (remote.host.clone(), remote.host.clone()),
            None => url_host(url).map_err(refuse)?,
        };
        let git_hosts = &server.moat.egress_config().git_hosts;
        if !git_hosts.contains(&host) {
            return Err(ToolError(format!(
                "{host} is not a Git host this server clones from ({}); the server's MOAT_GIT_HOSTS lists them",
                git_hosts.join(", ")
            )));
        }
        // The operator's leave for SSH keys first: the more particular refusal.
        let ssh = match remote {
            Some(remote) => Some(SshClone::check(server, remote, args)?),
            None if args.ssh_key_path.is_some() => {
                return Err(ToolError(
                    "ssh_key_path applies to SSH URLs (ssh://git@HOST/OWNER/REPO or git@HOST:OWNER/REPO); an https \
                     URL takes username and token"
                        .into(),
                ));
            }
            None => None,
        };
        // No sandbox is made or used when the operator grants no network.
        let grants = *server.moat.grants();
        if !grants.allows_network(NetworkPolicy::Filtered) {
            return Err(ToolError(grants.refuse_network(NetworkPolicy::Filtered, "cloning needs").to_string()));
        }
        let path = match args.path {
            Some(path) if path.starts_with('/') => path.to_owned(),
            Some(path) => format!("/home/user/{path}"),
            None => default_path(url)?,
        };
        let branch = args.branch.unwrap_or_default();
        if !branch.is_empty() {
            check_ref("branch", branch, false)?;
        }
        let commit = args.commit.unwrap_or_default();
        if !commit.is_empty() {
            check_ref("commit", commit, true)?;
        }
        let username = args.username.unwrap_or("x-access-token");
        if token.chars().any(char::is_control) || username.chars().any(char::is_control) {
            return Err(ToolError("username and token must not hold control characters".into()));
        }
        Ok(Self {
            url: url.to_owned(),
            authority,
            host,
            path,
            branch: branch.to_owned(),
            commit: commit.to_owned(),
            username: username.to_owned(),
            token: token.to_owned(),
            ssh,
        })
    }
}

impl SshClone {
    /// Checks what an SSH clone needs beyond any clone's checks: the
    /// operator's leave to use keys, the key (read now, beneath `~/.ssh`
    /// or a shared root), and host keys to trust.
    fn check(server: &Session<'_>, remote: SshRemote, args: &CloneArgs<'_>) -> Result<Self, ToolError> {
        if args.token.is_some() || args.username.is_some() {
            return Err(ToolError(
                "username and token apply to https URLs; an SSH URL names its login (git@HOST:...) and \
                 authenticates with ssh_key_path"
                    .into(),
            ));
        }
        let egress = server.moat.egress_config();
        remote.port_allowed(&egress.allow_hosts).map_err(ToolError)?;
        let Some(key_path) = args.ssh_key_path else {
            return Err(ToolError(
                "an SSH URL needs ssh_key_path, the host path of a private key (such as ~/.ssh/id_ed25519) that \
                 the server's operator allows with MOAT_ALLOW_SSH_KEY=1; or clone the https URL"
                    .into(),
            ));
        };
        if !egress.ssh_keys {
            return Err(ToolError(
                "this server does not let tool calls use SSH keys; its operator may allow it with \
                 MOAT_ALLOW_SSH_KEY=1, or clone the https URL with a token"
                    .into(),
            ));
        }
        let key_path = match key_path.strip_prefix("~/") {
            Some(rest) => match std::env::var_os("HOME") {
                Some(home) => std::path::Path::new(&home).join(rest),
                None => {
                    return Err(ToolError("ssh_key_path: ~ has no home directory here; give an absolute path".into()));
                }
            },
            None => std::path::PathBuf::from(key_path),
        };
        let key = server.moat.read_ssh_key(&key_path).map_err(|e| ToolError(format!("ssh_key_path: {e}")))?;
        let known_hosts = match &egress.ssh_known_hosts {
            Some(pinned) => vec![pinned.clone()],
            None => std::env::var_os("HOME")
                .map(|home| std::path::Path::new(&home).join(".ssh/known_hosts"))
                .filter(|file| file.is_file())
                .into_iter()
                .collect(),
        };
        if known_hosts.is_empty() {
            return Err(ToolError(format!(
                "no host key to check {} against: the server's user has no ~/.ssh/known_hosts; add the host \
                 (ssh-keyscan {} >> ~/.ssh/known_hosts, after checking its fingerprint) or have the operator \
                 set MOAT_SSH_KNOWN_HOSTS",
                remote.host, remote.host
            )));
        }
        let address = egress.test_resolve.iter().find(|(name, _)| *name == remote.host).map(|(_, address)| *address);
        Ok(Self { remote, key, known_hosts, address })
    }
}

async fn git_clone(server: &Session<'_>, args: GitClone, context: &CallContext) -> Outcome {
    let checked = CloneRequest::check(
        server,
        &CloneArgs {
            url: &args.url,
            path: args.path.as_deref(),
            branch: args.branch.as_deref(),
            commit: args.commit.as_deref(),
            username: args.username.as_deref(),
            token: args.token.as_deref(),
            ssh_key_path: args.ssh_key_path.as_deref(),
        },
    )?;
    let id = args.sandbox.resolve(server).await?;
    // A cancelled call stops the clone: dropped, its connection to the
    // agent closes, and the agent kills git and all it started (its token's
    // directory is then removed, see `CloneSweep`).
    tokio::select! {
        outcome = clone_into(server, &checked, &id) => outcome,
        () = context.cancelled.cancelled() => {
            Err(ToolError(format!("cancelled: the clone of {} was stopped", checked.url)))
        }
    }
}

/// Clones as `request` says into sandbox `id`; the result names the path
/// and the commit checked out.
pub(super) async fn clone_into(server: &Session<'_>, request: &CloneRequest, id: &str) -> Outcome {
    if let Some(ssh) = &request.ssh {
        return clone_over_ssh(server, request, ssh, id).await;
    }
    let CloneRequest { url, authority, host: _, path, branch, commit, username, token, ssh: _ } = request;
    let (url, path) = (url.as_str(), path.clone());
    let secrets = [token.as_str()];
    let grants = *server.moat.grants();
    let id = id.to_owned();
    let sandbox = server.moat.get(&id)?;
    if sandbox.spec.network == NetworkPolicy::None {
        return Err(ToolError(format!(
            "sandbox {id} has no network (policy none), so it cannot clone; create one with create_sandbox \
             network \"filtered\" (this server grants up to {:?})",
            grants.network.as_str()
        )));
    }
    // The clone's environment is moat's own: none of the sandbox's `env`
    // but the CA a test host or private server needs, and the proxy of a
    // filtered sandbox.
    let mut env: Vec<(String, String)> = sandbox
        .spec
        .env
        .iter()
        .filter(|(key, _)| ["GIT_SSL_CAINFO", "GIT_SSL_CAPATH"].contains(&key.as_str()))
        .cloned()
        .collect();
    if sandbox.spec.network == NetworkPolicy::Filtered {
        env.extend(moat_core::net::egress::proxy_env());
    }
    env.extend([
        ("MOAT_GIT_URL".to_owned(), url.to_owned()),
        ("MOAT_GIT_AUTHORITY".to_owned(), authority.clone()),
        ("MOAT_GIT_BRANCH".to_owned(), branch.to_owned()),
        ("MOAT_GIT_COMMIT".to_owned(), commit.to_owned()),
        ("MOAT_GIT_HELPER".to_owned(), CREDENTIAL_HELPER.to_owned()),
        ("MOAT_GIT_CONFIG".to_owned(), GIT_CONFIG.to_owned()),
        // Never wait for a password on a terminal nobody watches.
        ("GIT_TERMINAL_PROMPT".to_owned(), "0".to_owned()),
        ("GIT_ASKPASS".to_owned(), "/bin/false".to_owned()),
    ]);
    let (dirs, named) = clone_dirs(url)?;
    env.extend(named);
    let mut request = ExecRequest::argv(["bash", "-c", CLONE_SCRIPT]);
    request.env = env;
    request.user = Some("root".into());
    request.cwd = Some("/".into());
    request.stdin = true;
    request.timeout_ms = Some(CLONE_TIMEOUT_MS);
    let started_at = moat_core::timing::now();
    let client = server.moat.client(&id).await?;
    let mut sweep = CloneSweep { client: Some(client.clone()), dirs };
    let clone = async {
        let lost = |source| moat_core::SandboxError::Agent { id: id.clone(), source };
        let mut handle = client.exec(request).await.map_err(lost)?;
        if let Some(mut stdin) = handle.take_stdin() {
            let secret = format!("{username}\n{token}\n");
            stdin.write(secret.into_bytes().into()).await.map_err(lost)?;
            stdin.close().await.map_err(lost)?;
        }
        let mut out = handle.output_limited(1 << 20).await.map_err(lost)?;
        sweep.disarm_if_ended(&out.status);
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let stage = text.lines().next().unwrap_or_default().trim().to_owned();
            place(&client, &stage, &path, &mut out).await.map_err(lost)?;
        }
        Ok::<_, moat_core::SandboxError>(out)
    };
    // The agent ends the clone at its timeout; a guest that answers
    // nothing (a microVM's root can replace its agent) is given up here.
    // Two commands (the clone, then its move into place), each given its
    // timeout and the grace.
    let bound = 2 * (std::time::Duration::from_millis(CLONE_TIMEOUT_MS) + moat_core::timing::ANSWER_GRACE);
    let clone = async { moat_core::timing::within(&id, bound, clone).await.and_then(|out| out) };
    let mut out = match clone.await {
        Ok(out) => out,
        // A lost connection may be the sandbox's end: say so.
        Err(moat_core::SandboxError::Agent { source, .. }) => {
            return Err(server.moat.agent_error(&id, source).await.into());
        }
        Err(e) => return Err(e.into()),
    };
    out.stdout = scrub(&String::from_utf8_lossy(&out.stdout), &secrets).into_bytes();
    out.stderr = scrub(&String::from_utf8_lossy(&out.stderr), &secrets).into_bytes();
    let described = format!("git_clone {url} into {path}");
    server.moat.log_command(&id, &scrub(&described, &secrets), started_at, &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let why = if out.status.timed_out {
            format!("the clone took longer than {} s", CLONE_TIMEOUT_MS / 1000)
        } else {
            stderr.trim().to_owned()
        };
        let hint = if sandbox.spec.network == NetworkPolicy::Filtered {
            " (list_sandboxes shows the sandbox's egress decisions)"
        } else {
            ""
        };
        return Err(ToolError(format!("git clone of {url} failed: {why}{hint}")));
    }
    let commit = String::from_utf8_lossy(&out.stdout).lines().nth(1).unwrap_or_default().trim().to_owned();
    Ok(json!({ "path": path, "commit": commit }))
}

/// A clone's secret and staging directories, and the variables that name
/// them to its script (`MOAT_GIT_SECRET`, `MOAT_GIT_STAGE`).
type CloneDirs = ([String; 2], [(String, String); 2]);

/// Names [`CloneDirs`] for a clone of `url`: each a prefix and 256 random
/// bits, chosen here, so that moat can remove them if the clone is killed,
/// and guessed by nobody in the sandbox before they are made.
fn clone_dirs(url: &str) -> Result<CloneDirs, ToolError> {
    let named = |prefix: &str| {
        crate::http::new_token()
            .map(|token| format!("{prefix}{token}"))
            .map_err(|e| ToolError(format!("git clone of {url} cannot start: {e}")))
    };
    let (secret, stage) = (named("/run/moat-git.")?, named("/var/tmp/moat-clone.")?);
    let vars = [("MOAT_GIT_SECRET".to_owned(), secret.clone()), ("MOAT_GIT_STAGE".to_owned(), stage.clone())];
    Ok(([secret, stage], vars))
}

/// Removes a clone's secret directory (an https clone's token file, an SSH
/// clone's relay) and its staging directory from its sandbox when dropped
/// armed: a clone killed at its timeout, or with its call cancelled, ends
/// without its shell's trap, and the token would stay in the sandbox's
/// `/run` (root's alone, but the sandbox's for its life). Disarmed once the
/// clone's shell ended by itself. The removal runs in the background,
/// bounded, so a cancelled call is not held by it.
struct CloneSweep {
    client: Option<moat_proto::AgentClient<moat_proto::UnixConnector>>,
    dirs: [String; 2],
}

impl CloneSweep {
    /// Disarms it where the clone's shell ended by itself (an exit code,
    /// no timeout): its trap did the removal, and a checkout to move into
    /// place is in the staging directory.
    fn disarm_if_ended(&mut self, status: &moat_proto::ExitStatus) {
        if status.code.is_some() && !status.timed_out {
            self.client = None;
        }
    }
}

impl Drop for CloneSweep {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let [secret, stage] = &self.dirs;
        // A few tries: the agent kills the clone as its connection closes,
        // beside this, and git may still make a file while `rm` walks.
        let script = r#"for try in 1 2 3; do rm -rf -- "$@" 2>/dev/null && exit 0; sleep 0.2; done; rm -rf -- "$@""#;
        let mut remove = ExecRequest::argv(["sh", "-c", script, "sh", secret.as_str(), stage.as_str()]);
        remove.user = Some("root".into());
        remove.timeout_ms = Some(SWEEP_TIMEOUT_MS);
        // Its output is not read: the host keeps next to none of it.
        remove.output_limit = Some(1024);
        runtime.spawn(async move {
            let bound = std::time::Duration::from_millis(SWEEP_TIMEOUT_MS) + moat_core::timing::ANSWER_GRACE;
            let _ = tokio::time::timeout(bound, client.run(remove)).await;
        });
    }
}

/// How long the removal of a killed clone's secret may take.
const SWEEP_TIMEOUT_MS: u64 = 10_000;

/// Moves a checkout from `stage` to `path` ([`PLACE_SCRIPT`]); a failure
/// becomes `out`'s.
async fn place(
    client: &moat_proto::AgentClient<impl moat_proto::Connector>,
    stage: &str,
    path: &str,
    out: &mut moat_proto::Output,
) -> Result<(), moat_proto::ProtoError> {
    let mut place = ExecRequest::argv(["bash", "-c", PLACE_SCRIPT]);
    place.env = vec![("MOAT_GIT_STAGE".into(), stage.into()), ("MOAT_GIT_DEST".into(), path.into())];
    place.user = Some("user".into());
    place.timeout_ms = Some(CLONE_TIMEOUT_MS);
    let placed = client.exec(place).await?.output_limited(1 << 20).await?;
    if !placed.status.success() {
        out.status = placed.status;
        out.stderr = placed.stderr;
    }
    Ok(())
}

/// Clones over SSH into sandbox `id`: git runs there, its transport is
/// the host's `ssh` with the key ([`moat_core::net::gitssh`]).
async fn clone_over_ssh(server: &Session<'_>, request: &CloneRequest, ssh: &SshClone, id: &str) -> Outcome {
    let CloneRequest { url, path, branch, commit, .. } = request;
    let transport = SshTransport::new(&ssh.remote, &ssh.key, &ssh.known_hosts, ssh.address)
        .map_err(|e| ToolError(format!("git clone of {url} cannot start: {e}")))?;
    let (dirs, named) = clone_dirs(url)?;
    let mut exec = ExecRequest::argv(["bash", "-c", SSH_CLONE_SCRIPT]);
    exec.env = vec![
        ("MOAT_GIT_URL".into(), url.clone()),
        ("MOAT_GIT_BRANCH".into(), branch.clone()),
        ("MOAT_GIT_COMMIT".into(), commit.clone()),
        ("GIT_TERMINAL_PROMPT".into(), "0".into()),
    ];
    exec.env.extend(named);
    exec.user = Some("root".into());
    exec.cwd = Some("/".into());
    exec.stdin = true;
    exec.timeout_ms = Some(CLONE_TIMEOUT_MS);
    let started_at = moat_core::timing::now();
    let client = server.moat.client(id).await?;
    let mut sweep = CloneSweep { client: Some(client.clone()), dirs };
    // As above, the whole of it: the start, the clone (ssh's moment to end
    // its session after), the move into place. Dropping the relay kills
    // ssh (kill_on_drop).
    let bound = 2 * (std::time::Duration::from_millis(CLONE_TIMEOUT_MS) + moat_core::timing::ANSWER_GRACE)
        + moat_core::net::gitssh::SSH_GRACE;
    let unresponsive = || moat_core::SandboxError::Unresponsive { id: id.into(), waited_s: bound.as_secs() };
    let deadline = tokio::time::Instant::now() + bound;
    let handle = match tokio::time::timeout_at(deadline, client.exec(exec)).await {
        Err(_) => return Err(unresponsive().into()),
        Ok(Ok(handle)) => handle,
        Ok(Err(source)) => return Err(server.moat.agent_error(id, source).await.into()),
    };
    let Ok(relayed) = tokio::time::timeout_at(deadline, transport.relay(handle)).await else {
        return Err(unresponsive().into());
    };
    if let Ok(status) = &relayed.status {
        sweep.disarm_if_ended(status);
    }
    let stderr = String::from_utf8_lossy(&relayed.stderr).into_owned();
    let result = stderr.lines().rev().find_map(|l| l.strip_prefix("moat-git-result ")).map(str::to_owned);
    let git_said: String = stderr.lines().filter(|l| !l.starts_with("moat-git-result ")).collect::<Vec<_>>().join("\n");
    let mut out = match relayed.status {
        Ok(status) => {
            moat_proto::Output { stdout: Vec::new(), stderr: git_said.into_bytes(), status, truncated: false }
        }
        Err(Some(source)) => return Err(server.moat.agent_error(id, source).await.into()),
        Err(None) => return Err(ToolError(format!("git clone of {url} cannot start: {}", relayed.ssh_stderr))),
    };
    let (stage, cloned) = result.as_deref().and_then(|r| r.split_once(' ')).unwrap_or_default();
    if out.status.success() && !stage.is_empty() {
        match tokio::time::timeout_at(deadline, place(&client, stage, path, &mut out)).await {
            Err(_) => return Err(unresponsive().into()),
            Ok(Err(source)) => return Err(server.moat.agent_error(id, source).await.into()),
            Ok(Ok(())) => {}
        }
    }
    server.moat.log_command(id, &format!("git_clone {url} into {path} (over SSH)"), started_at, &out);
    if !out.status.success() || stage.is_empty() {
        let mut why = if out.status.timed_out {
            format!("the clone took longer than {} s", CLONE_TIMEOUT_MS / 1000)
        } else {
            String::from_utf8_lossy(&out.stderr).trim().to_owned()
        };
        if !relayed.ssh_stderr.is_empty() {
            why = format!("ssh on the host said: {}\n{why}", relayed.ssh_stderr);
        }
        return Err(ToolError(format!("git clone of {url} failed: {}", why.trim())));
    }
    Ok(json!({ "path": path, "commit": cloned.trim() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_before_anything_runs() {
        assert_eq!(url_host("https://GitHub.com/a/b.git").map(|(_, h)| h).ok(), Some("github.com".into()));
        assert_eq!(url_host("https://git.test:8443/r.git").map(|(_, h)| h).ok(), Some("git.test".into()));
        assert_eq!(url_host("https://Git.test:8443/r.git").map(|(a, _)| a).ok(), Some("git.test:8443".into()));
        for bad in [
            "git@github.com:a/b.git",
            "ssh://github.com/a/b",
            "https://u:t@github.com/a/b",
            "https:///x",
            "http://github.com/a/b",
            "file:///etc",
            "https://git.test$(id)/r",
        ] {
            assert!(url_host(bad).is_err(), "{bad}");
        }
        let host = |url: &str| url_host(url).map(|(_, h)| h).ok();
        assert_eq!(host("https://[::1]:8443/r.git"), Some("::1".into()));
        assert_eq!(url_host("https://[::1]:8443/r.git").map(|(a, _)| a).ok(), Some("[::1]:8443".into()));
        assert_eq!(host("https://127.0.0.1:8443/r.git"), Some("127.0.0.1".into()));
        assert_eq!(host("https://git.test/r?x#y"), Some("git.test".into()));
        let message = |url: &str| url_host(url).err().map(|e| e.0).unwrap_or_default();
        for empty in ["https:///x", "https:////x", "https://:443/x", "https://[]/x", "https:// x/r", "https://a\tb/r"] {
            assert!(message(empty).contains("has no host or holds spaces or control characters"), "{empty}");
        }
        assert!(message("https://git.test$(id)/r").contains("has characters a host name cannot hold"));
        assert!(message("github.com/a/b.git").contains("is not an http(s) or SSH URL"));
        assert!(message("http://github.com/a/b").contains("url scheme \"http\" is not supported"));
        assert!(message("https://u:t@github.com/a/b").starts_with("put credentials in username and token"));
        assert_eq!(default_path("https://github.com/a/repo.git/").ok(), Some("/workspace/repo".into()));
        assert!(default_path("https://github.com/").is_err());
        assert_eq!(default_path("git@github.com:o/repo.git").ok(), Some("/workspace/repo".into()));
        assert_eq!(default_path("ssh://git@host.test:22/srv/git/tool").ok(), Some("/workspace/tool".into()));
    }

    #[test]
    fn gits_own_configuration_allows_https_only_and_one_helper() {
        let config = GIT_CONFIG.replace("@HELPER@", "/run/moat-git.x/helper");
        assert!(config.contains("helper = /run/moat-git.x/helper") && config.contains("allow = never"), "{config}");
        assert!(config.contains("[protocol \"https\"]\n\tallow = always"), "{config}");
        assert!(CLONE_SCRIPT.contains("GIT_CONFIG_NOSYSTEM=1") && CLONE_SCRIPT.contains("GIT_CONFIG_GLOBAL="));
        assert!(CREDENTIAL_HELPER.contains("\"$proto\" = https") && CREDENTIAL_HELPER.contains("\"$want\""));
    }

    #[test]
    fn refs_are_checked() {
        assert!(check_ref("branch", "feature/x-1", false).is_ok());
        assert!(check_ref("branch", "--upload-pack=x", false).is_err());
        assert!(check_ref("commit", "deadbeef", true).is_ok());
        assert!(check_ref("commit", "HEAD~1", true).is_err());
    }

    #[test]
    fn secrets_are_scrubbed() {
        assert_eq!(scrub("fatal: bad token s3cr3t-t0k3n here", &["s3cr3t-t0k3n"]), "fatal: bad token *** here");
        assert_eq!(scrub("abc", &[""]), "abc", "an empty token scrubs nothing");
        assert!(!CLONE_SCRIPT.contains("MOAT_GIT_TOKEN"), "the token never travels in the environment");
    }
}

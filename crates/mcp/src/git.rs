//! `git_clone`: clone a repository into a sandbox through its network
//! policy.
//!
//! The URL's host must be one of `MOAT_GIT_HOSTS`. The token reaches git
//! only through its credential mechanism: a one-shot `credential.helper`
//! given with `git -c` (so it is not stored in the clone's config) prints
//! the user name and token from the process environment; neither is in
//! any command line, the clone's config or its remote URL. What git prints
//! is scrubbed of the token anyway before it goes anywhere.

use moat_core::NetworkPolicy;
use moat_proto::ExecRequest;
use serde_json::{Value, json};

use crate::tools::{Outcome, Session, ToolError, required, str_arg, target};

/// How long a clone may take.
const CLONE_TIMEOUT_MS: u64 = 600_000;

/// The credential helper: prints what git asks for from the environment.
const CREDENTIAL_HELPER: &str = "credential.helper=!f() { test \"$1\" = get || exit 0; echo username=$MOAT_GIT_USER; echo password=$MOAT_GIT_TOKEN; }; f";

/// The clone, as a script whose inputs all come from the environment.
const CLONE_SCRIPT: &str = r#"set -e
helper() { if [ -n "$MOAT_GIT_TOKEN" ]; then git -c credential.helper= -c "$MOAT_GIT_HELPER" "$@"; else git "$@"; fi; }
mkdir -p "$(dirname "$MOAT_GIT_DEST")"
if [ -n "$MOAT_GIT_BRANCH" ]; then
  helper clone -q --branch "$MOAT_GIT_BRANCH" -- "$MOAT_GIT_URL" "$MOAT_GIT_DEST"
else
  helper clone -q -- "$MOAT_GIT_URL" "$MOAT_GIT_DEST"
fi
cd "$MOAT_GIT_DEST"
if [ -n "$MOAT_GIT_COMMIT" ]; then
  git checkout -q "$MOAT_GIT_COMMIT" 2>/dev/null || { helper fetch -q origin "$MOAT_GIT_COMMIT" && git checkout -q FETCH_HEAD; }
fi
git rev-parse HEAD"#;

/// A Git URL taken apart: scheme and host (lower case, no port).
fn url_host(url: &str) -> Result<(&str, String), ToolError> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| ToolError(format!("url {url:?} is not an http(s) URL; use https://HOST/OWNER/REPO(.git)")))?;
    if scheme != "https" && scheme != "http" {
        return Err(ToolError(format!(
            "url scheme {scheme:?} is not supported; git_clone clones over https:// (ssh and git:// cannot pass the \
             sandbox's proxy)"
        )));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(ToolError(
            "put credentials in username and token, not in the URL (where they would end up in logs)".into(),
        ));
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    };
    if host.is_empty() || url.chars().any(|c| c.is_control() || c == ' ') {
        return Err(ToolError(format!("url {url:?} has no host or holds spaces or control characters")));
    }
    Ok((scheme, host.to_ascii_lowercase()))
}

/// `/workspace/<name>` for a URL ending in `<name>` or `<name>.git`.
fn default_path(url: &str) -> Result<String, ToolError> {
    let path = url.split_once("://").map_or("", |(_, rest)| rest.split_once('/').map_or("", |(_, path)| path));
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
pub fn scrub(text: &str, secrets: &[&str]) -> String {
    secrets.iter().filter(|s| s.len() >= 4).fold(text.to_owned(), |text, secret| text.replace(secret, "***"))
}

pub async fn git_clone(server: &Session<'_>, args: &Value) -> Outcome {
    let url = required(args, "url")?;
    let token = str_arg(args, "token")?.unwrap_or_default();
    let secrets = [token];
    // Errors of the arguments are built from the URL, which has no token
    // in it (refused above) — but scrub them too.
    let refuse = |e: ToolError| ToolError(scrub(&e.0, &secrets));
    let (scheme, host) = url_host(url).map_err(refuse)?;
    if !token.is_empty() && scheme != "https" {
        return Err(ToolError("a token is only sent over https; use an https:// URL".into()));
    }
    let git_hosts = &server.moat.egress_config().git_hosts;
    if !git_hosts.contains(&host) {
        return Err(ToolError(format!(
            "{host} is not a Git host this server clones from ({}); the server's MOAT_GIT_HOSTS lists them",
            git_hosts.join(", ")
        )));
    }
    let path = match str_arg(args, "path")? {
        Some(path) if path.starts_with('/') => path.to_owned(),
        Some(path) => format!("/home/user/{path}"),
        None => default_path(url)?,
    };
    let branch = str_arg(args, "branch")?.unwrap_or_default();
    if !branch.is_empty() {
        check_ref("branch", branch, false)?;
    }
    let commit = str_arg(args, "commit")?.unwrap_or_default();
    if !commit.is_empty() {
        check_ref("commit", commit, true)?;
    }
    let username = str_arg(args, "username")?.unwrap_or("x-access-token");
    if token.chars().any(char::is_control) || username.chars().any(char::is_control) {
        return Err(ToolError("username and token must not hold control characters".into()));
    }
    let id = target(server, args).await?;
    let sandbox = server.moat.get(&id)?;
    if sandbox.spec.network == NetworkPolicy::None {
        return Err(ToolError(format!(
            "sandbox {id} has no network (policy none), so it cannot clone; create one with create_sandbox \
             network \"filtered\" (or \"open\"), or start the server with MOAT_NETWORK=filtered"
        )));
    }
    let mut request = ExecRequest::argv(["bash", "-c", CLONE_SCRIPT]);
    request.env = vec![
        ("MOAT_GIT_URL".into(), url.to_owned()),
        ("MOAT_GIT_DEST".into(), path.clone()),
        ("MOAT_GIT_BRANCH".into(), branch.to_owned()),
        ("MOAT_GIT_COMMIT".into(), commit.to_owned()),
        ("MOAT_GIT_USER".into(), username.to_owned()),
        ("MOAT_GIT_TOKEN".into(), token.to_owned()),
        ("MOAT_GIT_HELPER".into(), CREDENTIAL_HELPER.to_owned()),
        // Never wait for a password on a terminal nobody watches.
        ("GIT_TERMINAL_PROMPT".into(), "0".into()),
        ("GIT_ASKPASS".into(), "/bin/false".into()),
    ];
    request.timeout_ms = Some(CLONE_TIMEOUT_MS);
    let started_at = moat_core::sandbox::now();
    let handle = server.moat.exec(&id, request).await?;
    let mut out = handle.output_limited(1 << 20).await?;
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
    let commit = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_owned();
    Ok(json!({ "path": path, "commit": commit }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_before_anything_runs() {
        assert_eq!(url_host("https://GitHub.com/a/b.git").map(|(_, h)| h).ok(), Some("github.com".into()));
        assert_eq!(url_host("https://git.test:8443/r.git").map(|(_, h)| h).ok(), Some("git.test".into()));
        for bad in ["git@github.com:a/b.git", "ssh://github.com/a/b", "https://u:t@github.com/a/b", "https:///x"] {
            assert!(url_host(bad).is_err(), "{bad}");
        }
        assert_eq!(default_path("https://github.com/a/repo.git/").ok(), Some("/workspace/repo".into()));
        assert!(default_path("https://github.com/").is_err());
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
        assert!(!CLONE_SCRIPT.contains("MOAT_GIT_TOKEN=") && CREDENTIAL_HELPER.contains("$MOAT_GIT_TOKEN"));
    }
}

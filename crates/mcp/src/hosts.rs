//! `moat-mcp init`: adding moat to an agent host's MCP configuration,
//! merged into what is there (other servers and settings are kept).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

/// An agent host whose configuration moat knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    ClaudeCode,
    ClaudeDesktop,
    Cursor,
    VsCode,
    Windsurf,
}

impl std::str::FromStr for Host {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "claude-code" => Ok(Self::ClaudeCode),
            "claude-desktop" => Ok(Self::ClaudeDesktop),
            "cursor" => Ok(Self::Cursor),
            "vscode" => Ok(Self::VsCode),
            "windsurf" => Ok(Self::Windsurf),
            _ => {
                Err(format!("unknown client {s:?}; allowed are claude-code, claude-desktop, cursor, vscode, windsurf"))
            }
        }
    }
}

/// Where a configuration lives: in the project or for the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Project,
    User,
}

impl Host {
    /// The configuration file for `scope`, or why the host has none there.
    pub fn config_path(self, scope: Scope, project: &Path, home: &Path) -> Result<PathBuf, String> {
        Ok(match (self, scope) {
            (Self::ClaudeCode, Scope::Project) => project.join(".mcp.json"),
            (Self::ClaudeCode, Scope::User) => home.join(".claude.json"),
            (Self::ClaudeDesktop, Scope::User) => home.join(".config/Claude/claude_desktop_config.json"),
            (Self::Cursor, Scope::Project) => project.join(".cursor/mcp.json"),
            (Self::Cursor, Scope::User) => home.join(".cursor/mcp.json"),
            (Self::VsCode, Scope::Project) => project.join(".vscode/mcp.json"),
            (Self::VsCode, Scope::User) => home.join(".config/Code/User/mcp.json"),
            (Self::Windsurf, Scope::User) => home.join(".codeium/windsurf/mcp_config.json"),
            (Self::ClaudeDesktop | Self::Windsurf, Scope::Project) => {
                return Err("this client has no project configuration; use --user".into());
            }
        })
    }

    /// The key the host keeps its servers under: VS Code says `servers`.
    fn servers_key(self) -> &'static str {
        if self == Self::VsCode { "servers" } else { "mcpServers" }
    }

    /// moat's entry for this host.
    fn entry(self, launch: &Launch) -> Value {
        let mut entry = json!({ "command": launch.command, "args": launch.args });
        if self == Self::VsCode {
            entry["type"] = json!("stdio");
        }
        entry
    }
}

/// How a host starts moat-mcp: a program and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub command: std::path::PathBuf,
    pub args: Vec<String>,
}

impl Launch {
    /// `moat_mcp` itself, or, where `systemd_run` is given (a user other
    /// than root, on a cgroup v2 host with a systemd user manager), through
    /// `systemd-run --user --scope -p Delegate=yes`: a cgroup of its own,
    /// delegated to the user, in which moat gives its jails their limits
    /// (docs/operations.md, "Rootless"). `--scope` runs it in the
    /// foreground, its stdio the host's.
    pub fn new(moat_mcp: &Path, systemd_run: Option<&Path>) -> Self {
        match systemd_run {
            None => Self { command: moat_mcp.to_owned(), args: Vec::new() },
            Some(systemd_run) => Self {
                command: systemd_run.to_owned(),
                args: ["--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes", "--"]
                    .iter()
                    .map(|a| (*a).to_owned())
                    .chain([moat_mcp.display().to_string()])
                    .collect(),
            },
        }
    }

    /// The command line, for a message.
    pub fn describe(&self) -> String {
        std::iter::once(self.command.display().to_string())
            .chain(self.args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// How a client of `moat-mcp --http` gets its bearer token, for `init` to
/// print: `token_dir` is where a server writes a generated one
/// ([`crate::http::token_dir`]).
pub fn http_token_help(token_dir: &Path) -> String {
    format!(
        "moat-mcp --http requires `Authorization: Bearer <token>` on every request. Either start it with \
         MOAT_HTTP_TOKEN set (16 or more characters) and give the client the same value, or let it generate one: \
         it writes it to {}/http-<port>.token (readable by you only) and prints that path; clients read it from \
         there, e.g. `Authorization: Bearer $(cat {}/http-8000.token)`. The stdio entry written here needs no token.",
        token_dir.display(),
        token_dir.display()
    )
}

/// `existing` (the file's text, if any) with moat added or replaced under
/// the host's servers key. Fails, touching nothing, on a file that is not a
/// JSON object.
pub fn merge(host: Host, existing: Option<&str>, launch: &Launch) -> Result<(String, bool), String> {
    let mut root = match existing.map(str::trim).filter(|t| !t.is_empty()) {
        None => Value::Object(Map::new()),
        Some(text) => serde_json::from_str::<Value>(text)
            .map_err(|e| format!("it is not valid JSON ({e}); fix or move it first"))?,
    };
    let Some(object) = root.as_object_mut() else { return Err("it is not a JSON object; fix or move it first".into()) };
    let servers = object.entry(host.servers_key()).or_insert_with(|| Value::Object(Map::new()));
    let Some(servers) = servers.as_object_mut() else {
        return Err(format!("its {:?} is not an object; fix it first", host.servers_key()));
    };
    let replaced = servers.insert("moat".into(), host.entry(launch)).is_some();
    Ok((serde_json::to_string_pretty(&root).unwrap_or_default() + "\n", replaced))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_keep_other_servers_and_settings() {
        let existing = r#"{"theme": "dark", "mcpServers": {"other": {"command": "x"}}}"#;
        let (text, replaced) =
            merge(Host::Cursor, Some(existing), &Launch::new(Path::new("/opt/moat-mcp"), None)).expect("merges");
        let value: Value = serde_json::from_str(&text).expect("json");
        assert!(!replaced);
        assert_eq!(value["theme"], "dark");
        assert_eq!(value["mcpServers"]["other"]["command"], "x");
        assert_eq!(value["mcpServers"]["moat"]["command"], "/opt/moat-mcp");
        let (again, replaced) =
            merge(Host::Cursor, Some(&text), &Launch::new(Path::new("/opt/moat-mcp"), None)).expect("merges");
        assert!(replaced);
        assert_eq!(again, text);
    }

    /// On a cgroup v2 host, a user's moat-mcp starts in a delegated scope
    /// of its own: systemd-run, then moat-mcp, stdio untouched.
    #[test]
    fn a_delegated_scope_wraps_moat_mcp_in_systemd_run() {
        let launch = Launch::new(Path::new("/usr/bin/moat-mcp"), Some(Path::new("/usr/bin/systemd-run")));
        let (text, _) = merge(Host::ClaudeCode, None, &launch).expect("merges");
        let value: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(value["mcpServers"]["moat"]["command"], "/usr/bin/systemd-run");
        let args: Vec<&str> =
            value["mcpServers"]["moat"]["args"].as_array().expect("args").iter().filter_map(Value::as_str).collect();
        assert_eq!(
            args,
            ["--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes", "--", "/usr/bin/moat-mcp"]
        );
        assert_eq!(Launch::new(Path::new("/m"), None).args, Vec::<String>::new());
    }

    #[test]
    fn vscode_uses_servers_with_a_type() {
        let (text, _) = merge(Host::VsCode, None, &Launch::new(Path::new("/m"), None)).expect("merges");
        let value: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(value["servers"]["moat"]["type"], "stdio");
        assert!(value.get("mcpServers").is_none());
    }

    #[test]
    fn the_http_token_help_says_where_the_token_is() {
        let help = http_token_help(Path::new("/run/user/1000/moat"));
        assert!(help.contains("MOAT_HTTP_TOKEN") && help.contains("/run/user/1000/moat/http-<port>.token"), "{help}");
        assert!(help.contains("Authorization: Bearer"), "{help}");
    }

    #[test]
    fn broken_files_are_left_alone() {
        assert!(
            merge(Host::ClaudeCode, Some("{not json"), &Launch::new(Path::new("/m"), None))
                .expect_err("bad")
                .contains("not valid JSON")
        );
        assert!(
            merge(Host::ClaudeCode, Some("[1]"), &Launch::new(Path::new("/m"), None))
                .expect_err("bad")
                .contains("not a JSON object")
        );
        assert!(merge(Host::ClaudeCode, Some(r#"{"mcpServers": 3}"#), &Launch::new(Path::new("/m"), None)).is_err());
        assert!(Host::Windsurf.config_path(Scope::Project, Path::new("/p"), Path::new("/h")).is_err());
        assert!("zed".parse::<Host>().expect_err("unknown").contains("allowed are"));
    }
}

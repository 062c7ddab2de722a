//! `moat-mcp init` writes and merges agent hosts' configurations.

use std::process::Command;

fn init(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moat-mcp"))
        .arg("init")
        .args(args)
        .current_dir(dir)
        .env("HOME", dir.join("home"))
        .output()
        .expect("runs")
}

#[test]
fn init_merges_into_each_hosts_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(".mcp.json"), r#"{"mcpServers": {"other": {"command": "x"}}, "keep": true}"#)
        .expect("seed");
    let out = init(dir.path(), &["--client", "claude-code"]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("added moat to"), "{out:?}");
    // How an HTTP client gets its bearer token is said too.
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("Authorization: Bearer") && said.contains("MOAT_HTTP_TOKEN"), "{said}");
    let merged: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(".mcp.json")).expect("read")).expect("json");
    assert_eq!(merged["keep"], true);
    assert_eq!(merged["mcpServers"]["other"]["command"], "x");
    assert_eq!(merged["mcpServers"]["moat"]["command"], env!("CARGO_BIN_EXE_moat-mcp"));

    for (client, scope, file, key) in [
        ("cursor", "--project", ".cursor/mcp.json", "mcpServers"),
        ("vscode", "--project", ".vscode/mcp.json", "servers"),
        ("claude-desktop", "--user", "home/.config/Claude/claude_desktop_config.json", "mcpServers"),
        ("windsurf", "--user", "home/.codeium/windsurf/mcp_config.json", "mcpServers"),
    ] {
        let out = init(dir.path(), &["--client", client, scope]);
        assert!(out.status.success(), "{client}: {out:?}");
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(file)).expect(file)).expect("json");
        assert!(written[key]["moat"]["command"].is_string(), "{client}: {written}");
    }

    // --print changes nothing; a broken file is left alone with a clear error.
    let before = std::fs::read_to_string(dir.path().join(".mcp.json")).expect("read");
    assert!(init(dir.path(), &["--client", "claude-code", "--print"]).status.success());
    assert_eq!(std::fs::read_to_string(dir.path().join(".mcp.json")).expect("read"), before);
    std::fs::write(dir.path().join(".cursor/mcp.json"), "{broken").expect("break");
    let out = init(dir.path(), &["--client", "cursor"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"), "{out:?}");
    assert_eq!(std::fs::read_to_string(dir.path().join(".cursor/mcp.json")).expect("read"), "{broken");
}

//! moat-mcp driven by the official Python MCP SDK, 1.x and 2.x, over stdio
//! and streamable HTTP, in both protocol eras: the `initialize` handshake
//! (2025-11-25 and earlier) and `server/discover` (2026-07-28, SDK 2.x).
//!
//! `cargo xtask test` installs both SDKs into virtual environments under
//! `target/` and names their interpreters in `MOAT_TEST_PYTHONS` (1.x
//! first, then 2.x).

use std::process::Command;

#[path = "../../../crates/core/tests/common/uidwatch.rs"]
mod uidwatch;

/// Runs `tests/mcp_client.py` with SDK `major` over `transport` in `era`.
fn drive(major: usize, transport: &str, era: &str) {
    let pythons = std::env::var("MOAT_TEST_PYTHONS").expect("MOAT_TEST_PYTHONS (set by `cargo xtask test`)");
    let python = pythons.split(':').nth(major - 1).expect("MOAT_TEST_PYTHONS names SDK 1.x then 2.x");
    let project =
        tempfile::Builder::new().prefix("mcp-project-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    std::fs::write(project.path().join("main.py"), "print('hello')\n").expect("write");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client.py");
    let contract = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tools.json");
    let out = Command::new(python)
        .args([script, env!("CARGO_BIN_EXE_moat-mcp"), contract])
        .arg(project.path())
        .args([transport, era])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "SDK {major}.x over {transport} ({era}): {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn sdk1_over_stdio() {
    drive(1, "stdio", "handshake");
}

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn sdk1_over_http() {
    drive(1, "http", "handshake");
}

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn sdk2_over_stdio_in_the_2026_era() {
    drive(2, "stdio", "modern");
}

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn sdk2_over_http_with_sessions() {
    drive(2, "http", "handshake");
}

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn sdk2_over_http_in_the_2026_era() {
    drive(2, "http", "modern");
}

/// Issue U1: the same suite, SDK 2.x over stdio and over HTTP, run by the
/// unprivileged account `cargo xtask test` made and prepared (`moat setup
/// --user`), named in `MOAT_TEST_ACCOUNT`, with copies of what it runs in
/// a directory of its own (a checkout may lie where it cannot reach). No
/// process of either run is root on the host, and every process inside a
/// sandbox runs as one of the account's subordinate ids.
#[test]
#[ignore = "needs root, the default image, the static agent, the Python MCP SDKs and the account `cargo xtask test` prepares"]
fn sdk2_over_stdio_and_http_as_an_unprivileged_user() {
    use std::os::unix::fs::PermissionsExt;
    let name = std::env::var("MOAT_TEST_ACCOUNT").expect("MOAT_TEST_ACCOUNT (set by `cargo xtask test`)");
    let user = nix::unistd::User::from_name(&name).ok().flatten().expect("the account exists");
    let (uid, gid) = (user.uid.as_raw(), user.gid.as_raw());
    let subuid = std::fs::read_to_string("/etc/subuid").expect("/etc/subuid");
    let subids = moat_core::hostuser::subordinate(&subuid, uid, Some(&name)).expect("the account's range").start;
    let pythons = std::env::var("MOAT_TEST_PYTHONS").expect("MOAT_TEST_PYTHONS (set by `cargo xtask test`)");
    let python = std::path::PathBuf::from(pythons.split(':').nth(1).expect("SDK 2.x"));
    let venv = python.parent().and_then(std::path::Path::parent).expect("the SDK's environment");
    let agent = std::env::var_os("MOAT_AGENT").expect("MOAT_AGENT (set by `cargo xtask test`)");

    let dir = tempfile::Builder::new().prefix("moat-rootless-mcp-").tempdir().expect("a directory");
    let copied = Command::new("cp").arg("-a").arg(venv).arg(dir.path().join("py")).status().expect("cp runs");
    assert!(copied.success(), "copying {} failed", venv.display());
    let copies = [
        (std::path::PathBuf::from(env!("CARGO_BIN_EXE_moat-mcp")), "moat-mcp"),
        (agent.into(), "moat-agent"),
        (concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client.py").into(), "mcp_client.py"),
        (concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tools.json").into(), "tools.json"),
    ];
    for (from, to) in copies {
        std::fs::copy(&from, dir.path().join(to)).expect("copies what the account runs");
    }
    let project = dir.path().join("projects/project");
    std::fs::create_dir_all(&project).expect("mkdir");
    std::fs::write(project.join("main.py"), "print('hello')\n").expect("write");
    let chown = Command::new("chown").arg("-R").arg(format!("{uid}:{gid}")).arg(dir.path()).status().expect("chown");
    assert!(chown.success());
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");

    for (transport, era) in [("stdio", "modern"), ("http", "handshake")] {
        let child = Command::new("setpriv")
            .args([format!("--reuid={uid}"), format!("--regid={gid}"), "--init-groups".into()])
            .arg(dir.path().join("py/bin/python"))
            .arg(dir.path().join("mcp_client.py"))
            .arg(dir.path().join("moat-mcp"))
            .arg(dir.path().join("tools.json"))
            .arg(&project)
            .args([transport, era])
            .env_clear()
            .env("HOME", &user.dir)
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("MOAT_AGENT", dir.path().join("moat-agent"))
            .current_dir(dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python starts as the account");
        let watch = uidwatch::UidWatch::start(child.id(), subids);
        let out = child.wait_with_output().expect("the run ends");
        let seen = watch.stop();
        assert!(
            out.status.success(),
            "SDK 2.x over {transport} as {name}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(seen.root.is_empty(), "processes of the {transport} run had uid 0 on the host: {:?}", seen.root);
        assert!(seen.misplaced.is_empty(), "sandbox processes outside the subordinate ids: {:?}", seen.misplaced);
        assert!(seen.sandboxed > 0, "the watch saw no sandbox process of the {transport} run");
    }
}

//! moat-mcp driven by the official Python MCP SDK, 1.x and 2.x, over stdio
//! and streamable HTTP, in both protocol eras: the `initialize` handshake
//! (2025-11-25 and earlier) and `server/discover` (2026-07-28, SDK 2.x).
//!
//! `cargo xtask test` installs both SDKs into virtual environments under
//! `target/` and names their interpreters in `MOAT_TEST_PYTHONS` (1.x
//! first, then 2.x).

use std::process::Command;

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

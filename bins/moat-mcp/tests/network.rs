//! The network tools (`git_clone`, `preview_link`) and `filtered` egress
//! through moat-mcp, driven by the official Python MCP SDK 2.x: see
//! `tests/network_client.py`. The "Git host" is an HTTPS server on this
//! machine's loopback with a test CA; nothing leaves the machine.

use std::process::Command;

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn git_clone_preview_links_and_egress_through_the_sdk() {
    let pythons = std::env::var("MOAT_TEST_PYTHONS").expect("MOAT_TEST_PYTHONS (set by `cargo xtask test`)");
    let python = pythons.split(':').next_back().expect("MOAT_TEST_PYTHONS names SDK 1.x then 2.x");
    let work = tempfile::Builder::new().prefix("mcp-net-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/network_client.py");
    let out = Command::new(python)
        .args([script, env!("CARGO_BIN_EXE_moat-mcp")])
        .arg(work.path())
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

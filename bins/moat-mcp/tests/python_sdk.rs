//! moat-mcp driven by the official Python MCP SDK, 1.x and 2.x, over stdio.
//!
//! `cargo xtask test` installs both SDKs into virtual environments under
//! `target/` and names their interpreters in `MOAT_TEST_PYTHONS`.

use std::process::Command;

#[test]
#[ignore = "needs root, the default image, the static agent and the Python MCP SDKs; run by `cargo xtask test`"]
fn python_sdk_clients_use_every_implemented_tool() {
    let pythons = std::env::var("MOAT_TEST_PYTHONS").expect("MOAT_TEST_PYTHONS (set by `cargo xtask test`)");
    let project =
        tempfile::Builder::new().prefix("mcp-project-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    std::fs::write(project.path().join("main.py"), "print('hello')\n").expect("write");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client.py");
    let contract = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tools.json");
    for python in pythons.split(':').filter(|p| !p.is_empty()) {
        let out = Command::new(python)
            .args([script, env!("CARGO_BIN_EXE_moat-mcp"), contract])
            .arg(project.path())
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "{python}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

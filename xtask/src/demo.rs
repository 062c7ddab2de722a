//! `cargo xtask demo`: moat's agent end to end.
//!
//! Builds the static agent, starts it as PID 1 of fresh pid, mount, uts and
//! network namespaces (the skeleton of a jail), and drives it through the
//! `moat-proto` client: processes, files, a tar stream, a timeout.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use moat_proto::{AgentClient, ExecRequest, ReadFileRequest, WriteFileRequest};

use crate::build;
use crate::host::{BASE_PACKAGES, ensure_packages, is_root, root};

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        // unshare --kill-child takes the agent (and its namespace) along.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run() -> Result<()> {
    ensure_packages(BASE_PACKAGES)?;
    let agent = build::static_agent()?;
    let dir = root().join("target/demo");
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("agent.sock");
    let _ = std::fs::remove_file(&socket);
    let mut unshare = Command::new("unshare");
    unshare.args(["--pid", "--fork", "--kill-child", "--mount", "--uts", "--net"]);
    if !is_root() {
        unshare.arg("--map-root-user");
    }
    let child = unshare
        .arg(&agent)
        .args(["--init", "--hostname", "moat-demo", "--log-level", "warn", "--listen"])
        .arg(format!("unix:{}", socket.display()))
        .stdin(Stdio::null())
        .spawn()
        .context("cannot start the agent under unshare")?;
    let _running = Running(child);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(session(&socket))
}

fn step(title: &str) {
    println!("\n\x1b[1m▸ {title}\x1b[0m");
}

async fn session(socket: &Path) -> Result<()> {
    let client = AgentClient::unix(socket);
    let started = Instant::now();
    let info = loop {
        match client.info().await {
            Ok(info) => break info,
            Err(_) if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => bail!("the agent did not answer: {e}"),
        }
    };
    step("agent is up as PID 1 of its own namespaces");
    println!(
        "  {} (protocol {}), kernel {}, hostname {}, init: {}",
        info.agent_version, info.protocol, info.kernel, info.hostname, info.init
    );
    println!("  ready {:.1} ms after start", started.elapsed().as_secs_f64() * 1000.0);

    step("run a command: it sees only its own processes and network");
    let out = client
        .run(ExecRequest::shell("hostname; echo \"processes: $(ls -d /proc/[0-9]* | wc -l)\"; ls /sys/class/net"))
        .await?;
    print_output(&out.stdout);

    step("exec round trip of `true`");
    let mut times = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let out = client.run(ExecRequest::argv(["true"])).await?;
        anyhow::ensure!(out.status.success(), "true failed: {:?}", out.status);
        times.push(t.elapsed());
    }
    times.sort();
    println!("  p50 {:.3} ms, p99 {:.3} ms over 200 runs", ms(times[100]), ms(times[198]));

    step("write a file, read it back, list the directory");
    let path = "/tmp/demo/hello.py";
    let script = b"import sys\nprint('hello from the sandbox, python', sys.version.split()[0])\n";
    let req = WriteFileRequest { path: path.into(), mode: Some(0o644), create_parents: true, owner: None };
    client.write_file(req, &mut &script[..]).await?;
    let back = client.read_file(ReadFileRequest { path: path.into(), offset: 0, length: None }).await?;
    anyhow::ensure!(back == script, "read back differs from what was written");
    let (entries, _) = client.list_dir("/tmp/demo", 1).await?;
    for e in &entries {
        println!("  {:o} {:>6} {}", e.mode, e.size, e.path);
    }
    if Path::new("/usr/bin/python3").exists() {
        let out = client.run(ExecRequest::argv(["python3", path])).await?;
        print_output(&out.stdout);
    }

    step("64 MiB through the agent");
    let data = vec![0x5au8; 64 << 20];
    let t = Instant::now();
    let req = WriteFileRequest { path: "/tmp/demo/big".into(), mode: None, create_parents: false, owner: None };
    client.write_file(req, &mut data.as_slice()).await?;
    let back = client.read_file(ReadFileRequest { path: "/tmp/demo/big".into(), offset: 0, length: None }).await?;
    anyhow::ensure!(back == data, "64 MiB round trip differs");
    let secs = t.elapsed().as_secs_f64();
    println!("  write + read of 64 MiB in {:.0} ms ({:.2} GB/s)", secs * 1000.0, (128u64 << 20) as f64 / secs / 1e9);

    step("a tar stream of /etc out of the sandbox");
    let mut archive = Vec::new();
    let bytes = client.tar_out("/etc", &mut archive).await?;
    println!("  {} KiB of tar", bytes / 1024);

    step("a command that runs too long is killed with its whole process group");
    let mut req = ExecRequest::shell("sleep 60 & sleep 60");
    req.timeout_ms = Some(300);
    let out = client.run(req).await?;
    println!(
        "  timed_out: {}, signal: {:?}, after {} ms",
        out.status.timed_out, out.status.signal, out.status.duration_ms
    );
    anyhow::ensure!(out.status.timed_out, "the timeout did not fire");

    println!(
        "\n\x1b[1mdone\x1b[0m: the agent works end to end. Sandboxes, the MCP server and microVMs build on it (see README.md)."
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn print_output(bytes: &[u8]) {
    for line in String::from_utf8_lossy(bytes).lines() {
        println!("  {line}");
    }
}

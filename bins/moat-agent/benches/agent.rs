//! Agent benchmarks, each beside a baseline measured in the same run:
//!
//! - exec round trip of `true` through the agent vs. spawning `true` directly;
//! - write + read of 64 MiB through the agent vs. the same bytes over a bare
//!   Unix socket pair;
//! - building and installing a jail's seccomp filter (a search tree over the
//!   call numbers) vs. the same allow list as seccompiler's chain.
//!
//! Run with `cargo xtask bench`. Figures go to stdout and to
//! `target/bench/agent.json`. Nothing here fails on a wall-clock figure: the
//! targets are printed beside the measurements for people to judge.

#![allow(clippy::print_stdout, clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use moat_proto::{AgentClient, ExecRequest, ReadFileRequest, UnixConnector, WriteFileRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const EXEC_RUNS: usize = 2000;
const VOLUME: usize = 64 << 20;
const VOLUME_RUNS: usize = 5;
const FILTER_RUNS: usize = 200;

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(bench());
}

struct Agent {
    child: std::process::Child,
    dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_agent() -> (Agent, AgentClient<UnixConnector>) {
    // /dev/shm: the file benchmark measures the protocol, not a disk.
    let dir = tempfile::Builder::new().prefix("moat-bench-").tempdir_in("/dev/shm").expect("temp dir in /dev/shm");
    let socket = dir.path().join("agent.sock");
    // Waited for in `Agent::drop`.
    #[allow(clippy::zombie_processes)]
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_moat-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .args(["--log-level", "error"])
        .spawn()
        .expect("agent starts");
    let client = AgentClient::unix(&socket);
    for _ in 0..500 {
        if client.info().await.is_ok() {
            return (Agent { child, dir }, client);
        }
        // A benchmark's setup, not a sandbox's path: retried until the
        // agent it just spawned binds its socket.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("agent did not come up");
}

/// The `per_mille`th ‰ of sorted durations, in milliseconds.
fn percentile(sorted: &[Duration], per_mille: usize) -> f64 {
    sorted[(sorted.len() - 1) * per_mille / 1000].as_secs_f64() * 1000.0
}

async fn bench() {
    let (agent, client) = start_agent().await;

    // Warm up both paths.
    for _ in 0..50 {
        client.run(ExecRequest::argv(["true"])).await.expect("true");
        std::process::Command::new("true").status().expect("true");
    }
    let mut through_agent = Vec::with_capacity(EXEC_RUNS);
    let mut direct = Vec::with_capacity(EXEC_RUNS);
    for _ in 0..EXEC_RUNS {
        let t = Instant::now();
        std::process::Command::new("true").status().expect("true");
        direct.push(t.elapsed());
        let t = Instant::now();
        let out = client.run(ExecRequest::argv(["true"])).await.expect("true");
        through_agent.push(t.elapsed());
        assert!(out.status.success());
    }
    through_agent.sort();
    direct.sort();
    let (agent_p50, agent_p99) = (percentile(&through_agent, 500), percentile(&through_agent, 990));
    let direct_p50 = percentile(&direct, 500);

    let data = vec![0xa5u8; VOLUME];
    let path = agent.dir.path().join("volume").to_string_lossy().into_owned();
    let mut agent_best = f64::MAX;
    let mut raw_best = f64::MAX;
    for _ in 0..VOLUME_RUNS {
        let t = Instant::now();
        let req = WriteFileRequest { path: path.clone(), mode: None, create_parents: false, owner: None };
        client.write_file(req, &mut data.as_slice()).await.expect("write");
        let back =
            client.read_file(ReadFileRequest { path: path.clone(), offset: 0, length: None }).await.expect("read");
        agent_best = agent_best.min(t.elapsed().as_secs_f64());
        assert_eq!(back.len(), VOLUME);
        raw_best = raw_best.min(raw_socket_round_trip(&data).await);
    }
    let gbps = |secs: f64| (2 * VOLUME) as f64 / secs / 1e9;
    let (agent_gbps, raw_gbps) = (gbps(agent_best), gbps(raw_best));
    let (tree_ms, tree_len) = filter_start(moat_agent::seccomp::program);
    let (chain_ms, chain_len) = filter_start(moat_agent::seccomp::linear_program);

    println!("agent benchmarks (baselines measured in this run)");
    println!("  exec `true` round trip   p50 {agent_p50:.3} ms  p99 {agent_p99:.3} ms   (target p50 <= 1 ms)");
    println!("    baseline: spawn `true` directly  p50 {direct_p50:.3} ms  -> ratio {:.2}x", agent_p50 / direct_p50);
    println!(
        "  write + read 64 MiB      {agent_gbps:.2} GB/s                     (target >= 1 GB/s over a Unix socket)"
    );
    println!("    baseline: bare Unix socket pair  {raw_gbps:.2} GB/s  -> ratio {:.2}", agent_gbps / raw_gbps);
    println!("  jail seccomp filter, built and installed  p50 {tree_ms:.3} ms ({tree_len} instructions)");
    println!(
        "    baseline: seccompiler's chain    p50 {chain_ms:.3} ms ({chain_len} instructions)  -> ratio {:.2}",
        tree_ms / chain_ms
    );

    let json = format!(
        "{{\"exec_true_p50_ms\":{agent_p50:.4},\"exec_true_p99_ms\":{agent_p99:.4},\"spawn_true_p50_ms\":{direct_p50:.4},\
         \"exec_ratio\":{:.3},\"file_64mib_gbps\":{agent_gbps:.3},\"raw_socket_gbps\":{raw_gbps:.3},\"file_ratio\":{:.3},\
         \"seccomp_tree_ms\":{tree_ms:.4},\"seccomp_chain_ms\":{chain_ms:.4},\"seccomp_ratio\":{:.3}}}\n",
        agent_p50 / direct_p50,
        agent_gbps / raw_gbps,
        tree_ms / chain_ms
    );
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).parent().map(|t| t.join("bench"));
    if let Some(dir) = out_dir
        && std::fs::create_dir_all(&dir).is_ok()
    {
        let _ = std::fs::write(dir.join("agent.json"), json);
        println!("  figures written to {}", dir.join("agent.json").display());
    }
}

/// The median time to build a seccomp program with `build` and install it
/// (each time on a new thread: a filter stays with its thread), in
/// milliseconds, and the program's length.
fn filter_start(
    build: fn() -> Result<Vec<moat_agent::seccomp::Instruction>, moat_agent::seccomp::FilterError>,
) -> (f64, usize) {
    let mut times = Vec::with_capacity(FILTER_RUNS);
    let mut len = 0;
    for _ in 0..FILTER_RUNS {
        let (took, built) = std::thread::spawn(move || {
            nix::sys::prctl::set_no_new_privs().expect("no_new_privs");
            let t = Instant::now();
            let program = build().expect("the filter builds");
            moat_agent::seccomp::apply(&program).expect("the filter installs");
            (t.elapsed(), program.len())
        })
        .join()
        .expect("the filtered thread");
        times.push(took);
        len = built;
    }
    times.sort();
    (percentile(&times, 500), len)
}

/// Seconds to send `data` over a Unix socket pair and back, in chunks of
/// the protocol's size, with no framing or file system.
async fn raw_socket_round_trip(data: &[u8]) -> f64 {
    let (mut a, mut b) = tokio::net::UnixStream::pair().expect("pair");
    let t = Instant::now();
    for direction in 0..2 {
        let (tx, rx) = if direction == 0 { (&mut a, &mut b) } else { (&mut b, &mut a) };
        let sender = async {
            for chunk in data.chunks(moat_proto::DATA_CHUNK) {
                tx.write_all(chunk).await.expect("send");
            }
        };
        let receiver = async {
            let mut buf = vec![0u8; moat_proto::DATA_CHUNK];
            let mut received = Vec::with_capacity(data.len());
            while received.len() < data.len() {
                let n = rx.read(&mut buf).await.expect("receive");
                received.extend_from_slice(&buf[..n]);
            }
            received
        };
        let ((), received) = tokio::join!(sender, receiver);
        assert_eq!(received.len(), data.len());
    }
    t.elapsed().as_secs_f64()
}

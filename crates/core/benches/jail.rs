//! Jail benchmarks, beside a baseline measured in the same run:
//!
//! - create a sandbox and finish a first command (`true`) vs.
//!   `bwrap --unshare-all --ro-bind / / --proc /proc --dev /dev true`;
//! - host memory of idle sandboxes (proportional set size of every process
//!   of each sandbox: monitor, agent), at 1, 10 and 50 sandboxes (and
//!   `MOAT_BENCH_IDLE` of them, when set; their `memory_mib` together must
//!   fit `MOAT_MAX_MEMORY_MIB`, so 500 need it set to 128000 or more). Files a
//!   sandbox writes live in its tmpfs and are not counted: an idle sandbox
//!   that wrote nothing has none.
//!
//! Needs root, the default image and the static agent (`MOAT_AGENT`); run
//! with `cargo xtask bench`. Prints figures; never fails on a wall-clock one.

#![allow(clippy::print_stdout, clippy::cast_precision_loss)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use moat_core::{Moat, MoatConfig, SandboxSpec};
use moat_proto::ExecRequest;

const RUNS: usize = 30;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(bench());
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1000.0
}

fn spec() -> SandboxSpec {
    SandboxSpec { memory_mib: 256, disk_mib: 128, idle_seconds: 0, ..SandboxSpec::default() }
}

async fn bench() {
    let agent = std::env::var_os("MOAT_AGENT").map(PathBuf::from).expect("MOAT_AGENT: the static agent");
    let config = MoatConfig {
        data_dir: moat_core::image::data_dir(),
        backend: moat_core::BackendKind::Jail,
        agent,
        max_sandboxes: 1024,
        roots: vec![],
        copy_limit: moat_core::hostfs::DEFAULT_COPY_MAX_MIB << 20,
        task_records_limit: moat_core::task::DEFAULT_RECORDS_MIB << 20,
        pool_size: 0,
        pool_spec: spec(),
        egress: moat_core::EgressConfig::default(),
        // The test is the operator: it grants what it asks for.
        grants: moat_core::Grants::everything(),
        extra_ca: None,
        preview: moat_core::net::preview::PreviewHost::default(),
        max_memory_mib: None,
    };
    let moat = Moat::new(config.clone()).await.expect("moat starts");

    // Warm up both paths (page cache, dentries).
    for _ in 0..3 {
        let s = moat.create(spec()).await.expect("create");
        moat.run(&s.id, ExecRequest::argv(["true"])).await.expect("true");
        moat.destroy(&s.id).await.expect("destroy");
        moat.settled().await;
        bwrap();
    }
    let mut jail = Vec::new();
    let mut baseline = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        bwrap();
        baseline.push(t.elapsed());
        let t = Instant::now();
        let s = moat.create(spec()).await.expect("create");
        let out = moat.run(&s.id, ExecRequest::argv(["true"])).await.expect("true");
        jail.push(t.elapsed());
        assert!(out.status.success());
        moat.destroy(&s.id).await.expect("destroy");
        // Its teardown is over before the next baseline runs beside it.
        moat.settled().await;
    }
    let (jail_ms, bwrap_ms) = (median(jail), median(baseline));
    println!("jail benchmarks (baselines measured in this run)");
    println!("  create -> first command finished   median {jail_ms:.2} ms   (target <= 1.5x bwrap)");
    println!("    baseline: bwrap --unshare-all true  median {bwrap_ms:.2} ms  -> ratio {:.2}x", jail_ms / bwrap_ms);

    // From a warm pool: each create takes a started sandbox.
    let pooled = Moat::new(MoatConfig { pool_size: 2, ..config }).await.expect("moat starts");
    let mut from_pool = Vec::new();
    for _ in 0..RUNS {
        while pooled.pooled() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t = Instant::now();
        let s = pooled.create(spec()).await.expect("create");
        let created = t.elapsed();
        pooled.run(&s.id, ExecRequest::argv(["true"])).await.expect("true");
        from_pool.push((created, t.elapsed()));
        pooled.destroy(&s.id).await.expect("destroy");
        pooled.settled().await;
    }
    let create_ms = median(from_pool.iter().map(|(c, _)| *c).collect());
    let first_ms = median(from_pool.iter().map(|(_, f)| *f).collect());
    println!(
        "  from a warm pool (pool_size 2):     create median {create_ms:.3} ms, create -> first command {first_ms:.2} ms"
    );
    println!("    (the first command alone costs a process spawn inside the sandbox)");
    pooled.destroy_all().await;

    let mut rows = Vec::new();
    let mut ids = Vec::new();
    // MOAT_BENCH_IDLE=N adds a step with N idle sandboxes (e.g. 500).
    let mut targets = vec![1usize, 10, 50];
    targets.extend(std::env::var("MOAT_BENCH_IDLE").ok().and_then(|n| n.parse::<usize>().ok()).filter(|n| *n > 50));
    for target in targets {
        while ids.len() < target {
            ids.push(moat.create(spec()).await.expect("create").id);
        }
        // Let each agent settle into idleness.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let total: u64 = ids.iter().map(|id| sandbox_pss_kib(&moat, id)).sum();
        rows.push((target, total));
    }
    println!("  idle sandboxes, host memory (PSS of each sandbox's monitor and agent processes):");
    for (count, total) in &rows {
        println!(
            "    {count:>3} sandboxes: {:>7.1} MiB total, {:>5.2} MiB each   (target <= 4 MiB each)",
            *total as f64 / 1024.0,
            *total as f64 / 1024.0 / *count as f64
        );
    }
    let each = rows.last().map_or(0.0, |(c, t)| *t as f64 / 1024.0 / *c as f64);
    if each > 0.0 {
        println!("    at that rate, 24 GiB holds about {:.0} idle sandboxes (memory alone)", 24.0 * 1024.0 / each);
    }
    moat.destroy_all().await;
}

fn bwrap() {
    let status = std::process::Command::new("bwrap")
        .args(["--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"])
        .status()
        .expect("bwrap runs (apt-get install bubblewrap)");
    assert!(status.success());
}

/// PSS of the processes of one sandbox, in KiB: its monitor and every
/// process in its pid namespace (found as descendants of the monitor).
fn sandbox_pss_kib(moat: &Moat, id: &str) -> u64 {
    let state = moat.data_dir().join("sandboxes").join(id);
    let Some(monitor) = moat_core::state::live_monitor(&state).and_then(|pid| u32::try_from(pid).ok()) else {
        return 0;
    };
    let mut pids = vec![monitor];
    let mut i = 0;
    while i < pids.len() {
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", pids[i])).unwrap_or_default();
        pids.extend(children.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        i += 1;
    }
    pids.iter()
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
                .unwrap_or_default()
                .lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

//! A sandbox's whole life, beside bubblewrap doing the same in the same run:
//!
//! - `moat run --backend jail -- true` as a whole process (start, create,
//!   command, destroy, exit) vs. `bwrap --unshare-all --ro-bind / /
//!   --proc /proc --dev /dev true`, alternating, [`RUNS`] each: median wall
//!   time and CPU time (the children's rusage, which holds every process
//!   of the sandbox: each is waited for by its parent);
//! - churn in one process: create, run `true` and destroy [`CHURN`]
//!   sandboxes in a row, then the same with [`PARALLEL`] at a time, vs.
//!   the same loops of `bwrap … true`.
//!
//! Needs root, the default image, the static agent (`MOAT_AGENT`) and the
//! `moat` binary (`MOAT_BIN`, a release build); run with `cargo xtask
//! bench`. Prints figures and writes them to `target/bench/churn.json`;
//! never fails on a wall-clock one.

#![allow(clippy::print_stdout, clippy::cast_precision_loss)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use moat_core::{Moat, MoatConfig, SandboxSpec};
use moat_proto::ExecRequest;

/// Whole-process runs of each side.
const RUNS: usize = 30;
/// Sandboxes per churn loop.
const CHURN: usize = 200;
/// Sandboxes alive at once in the parallel churn loop.
const PARALLEL: usize = 4;

const BWRAP: &[&str] = &["--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"];

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

/// CPU time (user + system) of every waited-for descendant so far.
fn children_cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the buffer it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// Runs `command` to its end; its wall and CPU time.
fn timed(command: &mut Command) -> (Duration, Duration) {
    let cpu = children_cpu();
    let t = Instant::now();
    let status = command.status().expect("the command starts");
    let wall = t.elapsed();
    assert!(status.success(), "{command:?}: {status}");
    (wall, children_cpu().saturating_sub(cpu))
}

fn bwrap() -> Command {
    let mut command = Command::new("bwrap");
    command.args(BWRAP);
    command
}

async fn bench() {
    let agent = std::env::var_os("MOAT_AGENT").map(PathBuf::from).expect("MOAT_AGENT: the static agent");
    let moat_bin = std::env::var_os("MOAT_BIN").map(PathBuf::from).expect("MOAT_BIN: the moat binary");
    let mut json = Vec::new();
    println!("whole-life benchmarks (bwrap measured in this run)");
    // Whether a jail's start waits for an RCU grace period to join its
    // cgroups (docs/operations.md, `moat setup`): figures differ by it.
    println!("  cgroup moves: favordynmods {:?}", moat_core::dynmods::state());
    whole_process(&moat_bin, &agent, &mut json);
    if let Some(account) = std::env::var_os("MOAT_BENCH_ACCOUNT") {
        rootless(&moat_bin, &agent, &account.to_string_lossy(), &mut json);
    }

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
        // The benchmark is the operator: it grants what it asks for.
        grants: moat_core::Grants::everything(),
        extra_ca: None,
        preview: moat_core::net::preview::PreviewHost::default(),
        max_memory_mib: None,
    };
    let moat = Moat::new(config).await.expect("moat starts");
    for _ in 0..3 {
        life(&moat).await;
    }
    moat.settled().await;
    for parallel in [1, PARALLEL] {
        let t = Instant::now();
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                let moat = moat.clone();
                tokio::spawn(async move {
                    for _ in 0..CHURN / parallel {
                        life(&moat).await;
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await.expect("a churn worker ends");
        }
        // Every teardown, done off the destroys' path, counts too.
        moat.settled().await;
        let moat_s = t.elapsed().as_secs_f64();
        let bwrap_s = tokio::task::spawn_blocking(move || bwrap_churn(parallel)).await.expect("bwrap churn");
        println!(
            "  churn: {CHURN} x (create -> true -> destroy), {parallel} at a time   {moat_s:.2} s ({:.2} ms each)   \
             (target <= 1.5x bwrap)",
            moat_s * 1000.0 / CHURN as f64
        );
        println!(
            "    baseline: {CHURN} x bwrap true, {parallel} at a time          {bwrap_s:.2} s ({:.2} ms each)  -> ratio {:.2}x",
            bwrap_s * 1000.0 / CHURN as f64,
            moat_s / bwrap_s
        );
        json.push(format!("\"churn_{parallel}_s\":{moat_s:.3},\"bwrap_churn_{parallel}_s\":{bwrap_s:.3}"));
        json.push(format!("\"churn_{parallel}_ratio\":{:.3}", moat_s / bwrap_s));
    }
    moat.destroy_all().await;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("churn.json"), format!("{{{}}}\n", json.join(","))));
    if let Err(e) = written {
        println!("  (cannot write target/bench/churn.json: {e})");
    }
}

/// One life: create, `true`, destroy.
async fn life(moat: &Moat) {
    let s = moat.create(spec()).await.expect("create");
    let out = moat.run(&s.id, ExecRequest::argv(["true"])).await.expect("true");
    assert!(out.status.success());
    moat.destroy(&s.id).await.expect("destroy");
}

/// `moat run --backend jail -- true` vs. `bwrap … true`, alternating.
fn whole_process(moat_bin: &Path, agent: &Path, json: &mut Vec<String>) {
    let moat_run = || {
        let mut command = Command::new(moat_bin);
        command.args(["run", "--backend", "jail", "--", "true"]).env("MOAT_AGENT", agent);
        command
    };
    for _ in 0..3 {
        timed(&mut moat_run());
        timed(&mut bwrap());
    }
    let (mut moat, mut base) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        moat.push(timed(&mut moat_run()));
        base.push(timed(&mut bwrap()));
    }
    let wall = |runs: &[(Duration, Duration)]| median(runs.iter().map(|r| r.0).collect());
    let cpu = |runs: &[(Duration, Duration)]| median(runs.iter().map(|r| r.1).collect());
    let (moat_ms, moat_cpu, bwrap_ms, bwrap_cpu) = (wall(&moat), cpu(&moat), wall(&base), cpu(&base));
    println!(
        "  `moat run --backend jail -- true`, whole process   median {moat_ms:.2} ms ({moat_cpu:.2} ms CPU)   \
         (target <= 1.5x bwrap)"
    );
    println!(
        "    baseline: bwrap --unshare-all true            median {bwrap_ms:.2} ms ({bwrap_cpu:.2} ms CPU)  -> ratio {:.2}x",
        moat_ms / bwrap_ms
    );
    json.push(format!(
        "\"moat_run_ms\":{moat_ms:.3},\"moat_run_cpu_ms\":{moat_cpu:.3},\"bwrap_ms\":{bwrap_ms:.3},\
         \"bwrap_cpu_ms\":{bwrap_cpu:.3},\"moat_run_ratio\":{:.3}",
        moat_ms / bwrap_ms
    ));
}

/// Rootless (issue U1): `moat run --backend jail -- true` run by the
/// unprivileged `account` (prepared by `moat setup --user`), alternating
/// with root's `moat run` and with the same `bwrap … true` run by the
/// account, [`RUNS`] each.
fn rootless(moat_bin: &Path, agent: &Path, account: &str, json: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    let user = nix::unistd::User::from_name(account).ok().flatten().expect("MOAT_BENCH_ACCOUNT names an account");
    // Copies the account can reach, wherever the checkout lies.
    let dir = tempfile::Builder::new().prefix("moat-bench-rootless-").tempdir().expect("a directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for (from, to) in [(moat_bin, "moat"), (agent, "moat-agent")] {
        std::fs::copy(from, dir.path().join(to)).expect("copies what the account runs");
    }
    let as_account = |program: &Path| {
        let mut command = Command::new("setpriv");
        command
            .arg(format!("--reuid={}", user.uid))
            .arg(format!("--regid={}", user.gid))
            .arg("--init-groups")
            .arg(program)
            .env_clear()
            .env("HOME", &user.dir)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("MOAT_AGENT", dir.path().join("moat-agent"));
        command
    };
    let rootless_run = || {
        let mut command = as_account(&dir.path().join("moat"));
        command.args(["run", "--backend", "jail", "--", "true"]);
        command
    };
    let account_bwrap = || {
        let mut command = as_account(Path::new("/usr/bin/bwrap"));
        command.args(BWRAP);
        command
    };
    // Root's run goes through setpriv too (to root itself), so that both
    // pay the same launcher: setpriv's exec and its group lookup are not
    // moat's cost.
    let root_run = || {
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid=0", "--regid=0", "--init-groups"])
            .arg(moat_bin)
            .args(["run", "--backend", "jail", "--", "true"])
            .env("MOAT_AGENT", agent);
        command
    };
    for _ in 0..3 {
        timed(&mut rootless_run());
        timed(&mut account_bwrap());
        timed(&mut root_run());
    }
    let (mut ours, mut base, mut root) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        ours.push(timed(&mut rootless_run()).0);
        base.push(timed(&mut account_bwrap()).0);
        root.push(timed(&mut root_run()).0);
    }
    let (ours, base, root) = (median(ours), median(base), median(root));
    println!(
        "  rootless `moat run --backend jail -- true` (as {account})  median {ours:.2} ms   (target <= 1.5x bwrap, \
         <= 1.1x root's)"
    );
    println!("    baseline: bwrap --unshare-all true as {account}   median {base:.2} ms  -> ratio {:.2}x", ours / base);
    println!("    baseline: root's moat run, same run           median {root:.2} ms  -> ratio {:.2}x", ours / root);
    json.push(format!(
        "\"rootless_run_ms\":{ours:.3},\"rootless_bwrap_ms\":{base:.3},\"rootless_root_run_ms\":{root:.3},\
         \"rootless_bwrap_ratio\":{:.3},\"rootless_root_ratio\":{:.3}",
        ours / base,
        ours / root
    ));
}

/// `CHURN` runs of `bwrap … true`, `parallel` at a time; seconds in all.
fn bwrap_churn(parallel: usize) -> f64 {
    let t = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..parallel {
            scope.spawn(|| {
                for _ in 0..CHURN / parallel {
                    timed(&mut bwrap());
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

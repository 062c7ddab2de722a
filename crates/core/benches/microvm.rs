//! microVM benchmarks, each beside a baseline measured in the same run, in
//! the nested test host (a level 1 under QEMU TCG whose KVM boots level-2
//! guests; on a host whose own KVM boots Linux, `MOAT_BENCH_HERE=1` runs
//! them here instead):
//!
//! - create → first command finished: a sandbox of the vm backend
//!   (moat-vmm) vs. QEMU microvm booting the same kernel, initramfs, root
//!   disk (copy-on-write) and command line to the same agent, reached over
//!   vhost-vsock; runs interleaved (A, B, B, A…) so level 1's drift and
//!   its fast first boot are shared out. Target: ratio ≤ 0.8.
//!   Beside it, where each boot's time went: the guest kernel's log and
//!   its uptime at the first command (on the guest's clock, scaled to the
//!   host's) split it into the VMM's start, the kernel, the agent's boot
//!   and the answer.
//! - moat-vmm's resident memory beyond the guest memory it touched
//!   (target ≤ 5 MiB), and an idle microVM's host memory (guest memory is
//!   mapped `MAP_NORESERVE`: only touched pages count), beside QEMU's.
//! - The agent's exec round trip and a 64 MiB file round trip over the
//!   microVM's vsock, beside the same operations on the same agent binary
//!   over a Unix socket.
//!
//! Figures from the nested host are for the ratios only: every level-2 exit
//! is emulated by level 1's TCG (docs/testing.md). Needs the default image,
//! the moat binaries, QEMU and busybox-static (`cargo xtask bench` provides
//! them). Prints figures; never fails on a wall-clock one.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::cast_precision_loss)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moat_core::{Moat, MoatConfig, SandboxSpec};
use moat_proto::{AgentClient, Connector, ExecRequest, ReadFileRequest, WriteFileRequest};

/// Set in level 1: run the benchmarks rather than level 1.
const HERE: &str = "MOAT_BENCH_HERE";
const GUEST_MIB: u64 = 512;
/// The vhost-vsock context id of QEMU's guest.
const QEMU_CID: u32 = 3;

fn main() {
    if std::env::var_os(HERE).is_some_and(|v| v == "1") {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        runtime.block_on(bench(runs()));
        return;
    }
    let (bundle, name) = moat_nested::bundle_with_this_program().expect("the level-1 bundle");
    let mut payload = moat_nested::Payload::new([name.as_str(), "--bench"]).echo(true);
    payload.env.push((HERE.into(), "1".into()));
    payload.env.push(("MOAT_BENCH_RUNS".into(), runs().to_string()));
    payload.machine.memory_mib = 4096;
    let out = moat_nested::run_in(&bundle, &payload).expect("level 1 runs the benchmarks");
    if out.code != 0 {
        eprintln!("{}", out.stderr_text());
        std::process::exit(out.code);
    }
}

/// Boots of each kind (`MOAT_BENCH_RUNS`, default 3: a boot takes seconds
/// under nested emulation).
fn runs() -> usize {
    std::env::var("MOAT_BENCH_RUNS").ok().and_then(|n| n.parse().ok()).filter(|n| *n > 0).unwrap_or(3)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn spec() -> SandboxSpec {
    SandboxSpec { cpus: 1, memory_mib: GUEST_MIB, idle_seconds: 0, ..SandboxSpec::default() }
}

async fn bench(runs: usize) {
    let data_dir = moat_core::image::data_dir();
    let config = MoatConfig {
        data_dir: data_dir.clone(),
        backend: moat_core::BackendKind::Vm,
        agent: PathBuf::from("/usr/bin/moat-agent"),
        max_sandboxes: 4,
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
    let moat = Moat::new(config).await.expect("moat starts with the vm backend");
    let image = moat_core::Image::open(&data_dir, "default").expect("the default image");

    println!("microVM benchmarks in the nested test host ({runs} runs each, interleaved A B B A; ratios only)");
    let mut ours = Vec::new();
    let mut qemu = Vec::new();
    let mut memory: Option<Memory> = None;
    let mut qemu_rss_kib = 0;
    let (mut our_phases, mut qemu_phases) = (Vec::new(), Vec::new());
    // A, B, B, A, A, B…: the first level-2 boot in a level 1 is the
    // fastest (docs/testing.md), and each side gets its share of firsts.
    for run in 0..runs * 2 {
        if matches!(run % 4, 0 | 3) {
            let started = Instant::now();
            let wall = std::time::SystemTime::now();
            let sandbox = moat.create(spec()).await.expect("a microVM sandbox");
            let out = moat.run(&sandbox.id, ExecRequest::argv(FIRST_COMMAND)).await.expect("the command runs");
            let elapsed = started.elapsed();
            ours.push(elapsed);
            if memory.is_none() {
                memory = Some(vmm_memory(&data_dir, &sandbox.id));
            }
            let client = moat.client(&sandbox.id).await.expect("its client");
            let mut phases = Phases::of(&client, elapsed, &out).await;
            let log = std::fs::read_to_string(data_dir.join("sandboxes").join(&sandbox.id).join("vmm.log"));
            phases.raw.push_str(&vmm_log_times(wall, &log.unwrap_or_default()));
            our_phases.push(phases);
            moat.destroy(&sandbox.id).await.expect("destroyed");
            // Its teardown is over before QEMU's next start runs beside it.
            moat.settled().await;
        } else {
            let (elapsed, rss, phases) = qemu_first_command(&image).await;
            qemu.push(elapsed);
            qemu_phases.push(phases);
            qemu_rss_kib = qemu_rss_kib.max(rss);
        }
    }
    let memory = memory.map(|m| Memory { qemu_rss_kib, ..m });
    let (ours_m, qemu_m) = (median(ours.clone()), median(qemu.clone()));
    println!("  create -> first command finished ({GUEST_MIB} MiB, 1 vCPU, to the same agent):");
    println!("    moat vm (moat-vmm)      median {:>6.2} s   runs {}", ours_m.as_secs_f64(), list(&ours));
    println!("    baseline: QEMU microvm  median {:>6.2} s   runs {}", qemu_m.as_secs_f64(), list(&qemu));
    println!("    ratio {:.2}   (target <= 0.80)", ours_m.as_secs_f64() / qemu_m.as_secs_f64());
    Phases::print(&our_phases, &qemu_phases);
    if let Some(m) = memory {
        println!("  host memory of a microVM that booted and ran a command ({GUEST_MIB} MiB guest):");
        println!(
            "    moat-vmm resident {:.1} MiB = guest memory touched {:.1} MiB + the VMM's own {:.1} MiB   (target <= 5 MiB)",
            kib(m.total_kib),
            kib(m.guest_kib),
            kib(m.total_kib.saturating_sub(m.guest_kib))
        );
        println!("    the VMM's largest mappings (MiB): {}", m.largest);
        println!(
            "    {:.0}% of the guest's {GUEST_MIB} MiB is resident (MAP_NORESERVE: untouched memory costs nothing)",
            kib(m.guest_kib) / GUEST_MIB as f64 * 100.0
        );
        println!("    baseline: QEMU microvm resident {:.1} MiB, same guest", kib(m.qemu_rss_kib));
    }
    channel(&moat).await;
    moat.destroy_all().await;
}

fn kib(k: u64) -> f64 {
    k as f64 / 1024.0
}

fn list(times: &[Duration]) -> String {
    times.iter().map(|t| format!("{:.2}", t.as_secs_f64())).collect::<Vec<_>>().join(" ")
}

struct Memory {
    total_kib: u64,
    guest_kib: u64,
    qemu_rss_kib: u64,
    /// The VMM's own largest mappings, "name MiB".
    largest: String,
}

/// moat-vmm's resident memory, all of it and that of the guest memory
/// mapping (the one mapping of the guest's size).
fn vmm_memory(data_dir: &Path, id: &str) -> Memory {
    let pid = moat_core::state::live_monitor(&data_dir.join("sandboxes").join(id))
        .and_then(|pid| u32::try_from(pid).ok())
        .expect("the sandbox records its VMM's pid");
    let (total_kib, mut mappings) = smaps(pid);
    let guest = mappings.iter().position(|(size, _, _)| *size == GUEST_MIB * 1024);
    let guest_kib = guest.map_or(0, |i| mappings.remove(i).1);
    mappings.sort_by_key(|(_, rss, _)| std::cmp::Reverse(*rss));
    let largest = mappings
        .iter()
        .take(4)
        .map(|(_, rss, name)| format!("{} {:.1}", if name.is_empty() { "anon" } else { name }, kib(*rss)))
        .collect::<Vec<_>>()
        .join(", ");
    Memory { total_kib, guest_kib, qemu_rss_kib: 0, largest }
}

/// A process's resident KiB, and (size, resident, name) of each mapping
/// (KiB; the name is the path or `[heap]`-like tag, empty when anonymous).
fn smaps(pid: u32) -> (u64, Vec<(u64, u64, String)>) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let value = |line: &str| line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let mut mappings = Vec::new();
    let (mut size, mut name) = (0, String::new());
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            name = line.split_whitespace().nth(5).unwrap_or("").to_owned();
        } else if line.starts_with("Size:") {
            size = value(line);
        } else if line.starts_with("Rss:") {
            mappings.push((size, value(line), name.clone()));
        }
    }
    (mappings.iter().map(|(_, rss, _)| rss).sum(), mappings)
}

/// QEMU microvm booting the image as the vm backend does (same kernel,
/// initramfs, command line, root disk copy-on-write, one vCPU), the agent
/// reached over vhost-vsock: the time from spawning QEMU to a first
/// command finished, and QEMU's resident KiB then.
async fn qemu_first_command(image: &moat_core::Image) -> (Duration, u64, Phases) {
    let cmdline = moat_core::backend::vm::kernel_cmdline("level2", spec().disk_mib);
    let started = Instant::now();
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-M", "microvm,acpi=on,rtc=on", "-accel", "kvm", "-cpu", "host", "-smp", "1"])
        .args(["-m", &GUEST_MIB.to_string(), "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-serial", "null"])
        .arg("-kernel")
        .arg(image.path("vmlinux"))
        .arg("-initrd")
        .arg(image.path("initramfs.cpio.gz"))
        .args(["-append", &cmdline, "-drive"])
        .arg(format!("id=root,file={},format=raw,if=none,snapshot=on", image.path("rootfs.ext4").display()))
        .args(["-device", "virtio-blk-device,drive=root"])
        .args(["-device", &format!("vhost-vsock-device,guest-cid={QEMU_CID}")])
        .stdin(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 starts");
    let client = AgentClient::new(Vsock { cid: QEMU_CID, port: moat_core::backend::vm::AGENT_VSOCK_PORT });
    // Polled as the vm backend polls its VM's socket: the agent's
    // handshake, every 20 ms, then the command.
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), client.info()).await {
            break;
        }
        if let Ok(Some(status)) = qemu.try_wait() {
            panic!("QEMU exited before its guest's agent answered ({status})");
        }
        assert!(started.elapsed() < Duration::from_secs(300), "QEMU's guest never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = client.run(ExecRequest::argv(FIRST_COMMAND)).await.expect("the command runs under QEMU");
    let elapsed = started.elapsed();
    let (rss, _) = smaps(qemu.id());
    let phases = Phases::of(&client, elapsed, &out).await;
    stop(&mut qemu);
    (elapsed, rss, phases)
}

/// When moat-vmm logged its milestones, in seconds after `wall` (its log's
/// timestamps are UTC times of day).
fn vmm_log_times(wall: std::time::SystemTime, log: &str) -> String {
    let since_midnight = |d: Duration| d.as_secs_f64() % 86_400.0;
    let zero = since_midnight(wall.duration_since(std::time::UNIX_EPOCH).unwrap_or_default());
    let mut out = String::new();
    for (what, needle) in
        [("VMM built", "VM built"), ("guest started", "Starting the guest"), ("agent ready", "Guest ready")]
    {
        let at = log.lines().find(|l| l.contains(needle)).and_then(|l| {
            let time = l.split_once('T')?.1.split_once('Z')?.0;
            let mut parts = time.split(':').map(|p| p.parse::<f64>().ok());
            Some(parts.next()?? * 3600.0 + parts.next()?? * 60.0 + parts.next()??)
        });
        if let Some(at) = at {
            out.push_str(&format!("; {what} at {:.2}", at - zero));
        }
    }
    // The build's steps: "(process start 3 ms, devices 20 ms, …)".
    if let Some(steps) =
        log.lines().find(|l| l.contains("VM built")).and_then(|l| l.split_once(" ms after the process started "))
    {
        out.push_str(&format!(" {}", steps.1));
    }
    out
}

/// The first command of a boot: it prints the guest's uptime.
const FIRST_COMMAND: [&str; 2] = ["cat", "/proc/uptime"];

/// The guest kernel's log lines that end a boot's phases after the VMM's
/// start: (phase, the line's start after its timestamp).
const MILESTONES: &[(&str, &str)] = &[
    ("kernel: clock started -> /init runs", "Run /init as init process"),
    ("agent: /init -> root mounted", "EXT4-fs (vda): mounted"),
];

/// Where one boot's time went, in host seconds: before the guest kernel's
/// clock started (the VMM's start, loading the kernel and initramfs, the
/// kernel's first steps), then each of [`MILESTONES`], then from the last
/// to the first command (the agent's last steps, the host noticing it is
/// up, the command's round trip).
struct Phases {
    seconds: Vec<f64>,
    /// The figures they came from, for the run's line.
    raw: String,
}

impl Phases {
    const NAMES: [&str; 4] = [
        "VMM start -> guest kernel's clock starts",
        MILESTONES[0].0,
        MILESTONES[1].0,
        "agent ready + first command answered",
    ];

    /// Reads the guest's log and clock rate through `client`, given the
    /// host's time to `first` (the output of [`FIRST_COMMAND`]).
    async fn of<C: Connector>(client: &AgentClient<C>, total: Duration, first: &moat_proto::Output) -> Self {
        assert!(first.status.success(), "the first command failed: {first:?}");
        let uptime = |out: &moat_proto::Output| -> f64 {
            let text = String::from_utf8_lossy(&out.stdout);
            text.split_whitespace().next().and_then(|u| u.parse().ok()).expect("/proc/uptime's first field")
        };
        let at_first = uptime(first);
        let mut root = ExecRequest::argv(["dmesg"]);
        root.user = Some("root".into());
        let log = client.run(root).await.expect("dmesg runs");
        let log = String::from_utf8_lossy(&log.stdout).into_owned();
        // The guest's clock runs at the rate its kernel was told (level 1's
        // TSC under TCG need not agree): two readings 2 s apart on the host.
        let (a, t) = (client.run(ExecRequest::argv(FIRST_COMMAND)).await.expect("uptime"), Instant::now());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (b, elapsed) = (client.run(ExecRequest::argv(FIRST_COMMAND)).await.expect("uptime"), t.elapsed());
        let rate = (uptime(&b) - uptime(&a)) / elapsed.as_secs_f64();
        let mut marks = vec![0.0];
        for (_, line) in MILESTONES {
            let at = log
                .lines()
                .find_map(|l| {
                    let (stamp, text) = l.strip_prefix('[')?.split_once(']')?;
                    text.trim_start().starts_with(line).then(|| stamp.trim().parse::<f64>().ok()).flatten()
                })
                .unwrap_or_else(|| panic!("the guest's log has no line starting {line:?}:\n{log}"));
            marks.push(at);
        }
        marks.push(at_first);
        let guest: Vec<f64> = marks.windows(2).map(|w| (w[1] - w[0]) / rate).collect();
        let before = total.as_secs_f64() - at_first / rate;
        let raw = format!(
            "{:.2} s in all, guest uptime {at_first:.2} at the first command, clock rate {rate:.3}",
            total.as_secs_f64()
        );
        Self { seconds: std::iter::once(before).chain(guest).collect(), raw }
    }

    fn print(ours: &[Self], qemu: &[Self]) {
        let median = |all: &[Self], i: usize| {
            let mut v: Vec<f64> = all.iter().map(|p| p.seconds[i]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        for (name, all) in [("moat-vmm", ours), ("QEMU", qemu)] {
            for p in all {
                println!("    {name:<9} {}", p.raw);
            }
        }
        println!("    where the time went (medians, s; the guest's clock scaled to the host's):");
        println!("      {:<44} {:>9} {:>9}", "", "moat-vmm", "QEMU");
        for (i, name) in Self::NAMES.iter().enumerate() {
            println!("      {name:<44} {:>9.2} {:>9.2}", median(ours, i), median(qemu, i));
        }
    }
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// An agent over AF_VSOCK (QEMU's vhost-vsock).
struct Vsock {
    cid: u32,
    port: u32,
}

impl Connector for Vsock {
    type Stream = tokio_vsock::VsockStream;
    fn connect(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send {
        tokio_vsock::VsockStream::connect(tokio_vsock::VsockAddr::new(self.cid, self.port))
    }
}

/// The agent's exec round trip and a 64 MiB file round trip, over a
/// microVM's vsock and over a Unix socket to the same agent binary.
async fn channel(moat: &Moat) {
    const EXECS: usize = 50;
    let sandbox = moat.create(spec()).await.expect("a microVM sandbox");
    let vsock = moat.client(&sandbox.id).await.expect("its client");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    let mut agent = Command::new("moat-agent")
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("moat-agent starts in level 1");
    let unix = AgentClient::unix(&socket);
    while unix.info().await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let data: Vec<u8> = (0..=255u8).cycle().take(64 << 20).collect();
    println!("  the agent's channel: vsock (moat-vmm's muxer) beside a Unix socket to the same agent binary:");
    let mut rows = Vec::new();
    for (name, file) in [("vsock", "/workspace/bench.bin"), ("unix socket", "")] {
        let file = if file.is_empty() { dir.path().join("bench.bin").display().to_string() } else { file.into() };
        let (execs, transfer) = if name == "vsock" {
            measure(&vsock, EXECS, &data, &file).await
        } else {
            measure(&unix, EXECS, &data, &file).await
        };
        rows.push((name, execs, transfer));
    }
    for (name, execs, transfer) in &rows {
        println!(
            "    {name:<12} exec `true` round trip median {:>6.2} ms   64 MiB write + read back {:>6.0} ms ({:.0} MB/s each way)",
            execs.as_secs_f64() * 1000.0,
            transfer.as_secs_f64() * 1000.0,
            2.0 * 64.0 * 1.048_576 / transfer.as_secs_f64()
        );
    }
    if let [(_, ve, vt), (_, ue, ut)] = rows.as_slice() {
        println!(
            "    ratios vsock / unix socket: exec {:.2}, transfer {:.2}",
            ve.as_secs_f64() / ue.as_secs_f64(),
            vt.as_secs_f64() / ut.as_secs_f64()
        );
    }
    stop(&mut agent);
    moat.destroy(&sandbox.id).await.expect("destroyed");
}

async fn measure<C: Connector>(client: &AgentClient<C>, execs: usize, data: &[u8], path: &str) -> (Duration, Duration) {
    let mut times = Vec::new();
    for _ in 0..execs {
        let t = Instant::now();
        let out = client.run(ExecRequest::argv(["true"])).await.expect("true runs");
        times.push(t.elapsed());
        assert!(out.status.success());
    }
    let t = Instant::now();
    let req = WriteFileRequest { path: path.into(), mode: None, create_parents: true, owner: None };
    client.write_file(req, &mut &data[..]).await.expect("writes 64 MiB");
    let back = client.read_file(ReadFileRequest { path: path.into(), offset: 0, length: None }).await.expect("reads");
    let transfer = t.elapsed();
    assert!(back == data, "the 64 MiB came back changed");
    (median(times), transfer)
}

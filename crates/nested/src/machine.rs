//! Level 1: the QEMU process, its result channel, and the watch over its
//! stages.
//!
//! Level 1 talks back over four virtio-serial ports that QEMU writes to
//! files in a private temporary directory: `moat.control` (one line per
//! stage, then the exit status), `moat.stdout` and `moat.stderr` (the
//! payload's own streams, byte for byte), and `moat.marks` (lines the
//! payload writes to `$MOAT_NESTED_MARKS`, each timestamped by the host as
//! it arrives: level 1's own clock is only as good as TCG's TSC, so
//! benchmarks time their events with the host's). Nothing else writes to them, so
//! kernel messages on the serial console can never be mistaken for results.
//! A blocking write to a virtio-serial port returns only once QEMU has taken
//! the data, so when the control port says `finished` the payload's output
//! is already in its files.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use flate2::Compression;
use flate2::write::GzEncoder;

use crate::bundle::Bundle;
use crate::cpio::Cpio;
use crate::error::{Error, Result, Tails};
use crate::{Machine, Output, Payload, Stage};

/// Level 1's kernel command line. Under TCG the kernel cannot always
/// calibrate the TSC against the PIT: give it a frequency instead.
const CMDLINE: &str = "console=ttyS0 panic=-1 tsc_early_khz=2000000 tsc=reliable";

/// How often the watch looks at the channel and the process.
const POLL: Duration = Duration::from_millis(20);

/// How long level 1 may take to power off once the payload has finished.
const POWER_OFF_GUARD: Duration = Duration::from_secs(60);

/// How long a running payload's level 1 may go without its heartbeat
/// (sent every 5 s) before it counts as hung.
const LIVENESS: Duration = Duration::from_secs(120);

/// How long without a heartbeat before level 1 is kicked with an NMI.
/// Level 1 has been seen to stop with its one vCPU halted, interrupts
/// enabled, in the idle loop: a wake-up lost under TCG's emulated SVM
/// (its timer's interrupt, or the vCPU thread's kick, never came). An NMI
/// from QEMU's monitor wakes the vCPU; the kernel's report of it
/// (harmless: on QEMU microvm "NMI: PCI system error (SERR) for reason
/// ff") makes it leave the idle loop, which programs the timer again.
const KICK_AFTER: Duration = Duration::from_secs(30);

/// Level 1 console lines that mean its kernel broke. (Warnings such as
/// soft-lockup reports are not among them: under TCG they come and go.)
const CRASH_MARKERS: &[&str] = &[
    "Kernel panic - not syncing",
    "Oops:",
    "BUG: unable to handle",
    "general protection fault",
    "kernel BUG at",
    "double fault",
];

/// Lines of the serial console in a failure report.
const CONSOLE_TAIL_LINES: usize = 40;

/// Bytes of each payload stream in a failure report.
const STREAM_TAIL_BYTES: usize = 2048;

/// A running level-1 QEMU, killed and reaped when dropped, with its
/// temporary directory removed.
#[derive(Debug)]
struct Level1 {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Level1 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Level1 {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// How level 1's console is connected.
enum Console {
    /// To a file, for the failure report.
    File,
    /// To this terminal, with QEMU's monitor multiplexed (Ctrl-A C).
    Terminal,
}

fn launch(bundle: &Bundle, machine: Machine, run_files: &[(&str, String)], console: &Console) -> Result<Level1> {
    sweep_orphans(&std::env::temp_dir());
    let dir = tempfile::Builder::new()
        .prefix(LEVEL_DIR_PREFIX)
        .tempdir()
        .map_err(|source| Error::Watch { what: "creating a temporary directory".into(), source })?;
    std::fs::write(dir.path().join(OWNER), std::process::id().to_string())
        .map_err(|source| Error::Watch { what: "recording the level's owner".into(), source })?;
    let initramfs = dir.path().join("initramfs.cpio.gz");
    write_initramfs(&bundle.initramfs, run_files, &initramfs)
        .map_err(|source| Error::Watch { what: format!("writing {}", initramfs.display()), source })?;
    for name in ["control", "stdout", "stderr", "marks", "console", "qemu.log"] {
        File::create(dir.path().join(name))
            .map_err(|source| Error::Watch { what: format!("creating {name}"), source })?;
    }
    let at = |name: &str| dir.path().join(name).display().to_string();
    let mut qemu = Command::new(&bundle.qemu);
    // `vgif=off`: level 1's hangs stop its vCPU halted with interrupts
    // enabled and deaf even to an NMI, which only a global interrupt flag
    // left clear blocks; without virtual GIF, level 1's KVM sets and
    // clears its own GIF with STGI/CLGI alone.
    qemu.args(["-M", "microvm,acpi=on", "-accel", "tcg", "-cpu", "max,vgif=off"])
        .args(["-m", &machine.memory_mib.to_string(), "-smp", &machine.cpus.to_string()])
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .arg("-kernel")
        .arg(&bundle.kernel)
        .arg("-initrd")
        .arg(&initramfs)
        .args(["-append", CMDLINE])
        .args(["-device", "virtio-serial-device,max_ports=8"]);
    for port in ["control", "stdout", "stderr", "marks"] {
        qemu.args(["-chardev", &format!("file,id={port},path={}", at(port))])
            .args(["-device", &format!("virtserialport,chardev={port},name=moat.{port}")]);
    }
    for (id, file) in [("bundle", &bundle.disk), ("rootfs", &bundle.rootfs)] {
        qemu.arg("-drive")
            .arg(format!("id={id},file={},format=raw,if=none,readonly=on", file.display()))
            .args(["-device", &format!("virtio-blk-device,drive={id},serial=moat-{id}")]);
    }
    // QEMU's monitor on a socket, for a look at level 1's vCPU when it
    // hangs (`cpu_state`); not where the path is too long for a socket.
    let monitor = dir.path().join(MONITOR);
    if matches!(console, Console::File) && monitor.as_os_str().len() < 100 {
        qemu.args(["-monitor", &format!("unix:{},server=on,wait=off", monitor.display())]);
    }
    match console {
        Console::File => {
            let log = File::create(at("qemu.log"))
                .map_err(|source| Error::Watch { what: "creating qemu.log".into(), source })?;
            let log2 = log.try_clone().map_err(|source| Error::Watch { what: "opening qemu.log".into(), source })?;
            qemu.args(["-chardev", &format!("file,id=console,path={}", at("console"))])
                .args(["-serial", "chardev:console"])
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2);
        }
        Console::Terminal => {
            qemu.args(["-serial", "mon:stdio"]);
        }
    }
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls prctl(2), which is async-signal-safe.
    unsafe {
        qemu.pre_exec(|| {
            // QEMU dies with the thread that started it, even when this
            // process is killed outright: no level 1 outlives its test.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    tracing::debug!(?qemu, "starting level 1");
    let child = qemu.spawn().map_err(Error::Launch)?;
    Ok(Level1 { child, dir })
}

/// The bundle's initramfs followed by a second archive with this run's
/// files; the kernel unpacks concatenated archives in order.
fn write_initramfs(base: &Path, files: &[(&str, String)], dest: &Path) -> std::io::Result<()> {
    let data = std::fs::read(base)?;
    let mut cpio = Cpio::new(GzEncoder::new(data, Compression::fast()));
    cpio.dir("payload")?;
    for (name, contents) in files {
        cpio.file(&format!("payload/{name}"), 0o755, contents.as_bytes())?;
    }
    let data = cpio.finish()?.finish()?;
    std::fs::write(dest, data)
}

/// `/payload/run`: the environment, then `exec` of the command.
fn payload_script(payload: &Payload) -> Result<String> {
    if payload.command.is_empty() {
        return Err(Error::Payload("the command is empty".into()));
    }
    let mut script = String::new();
    for (name, value) in &payload.env {
        let identifier = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            return Err(Error::Payload(format!("environment variable name {name:?} is not a shell identifier")));
        }
        script.push_str(&format!("export {name}={}\n", quote(value)));
    }
    let argv: Vec<String> = payload.command.iter().map(|a| quote(a)).collect();
    script.push_str(&format!("exec {}\n", argv.join(" ")));
    Ok(script)
}

/// Single-quotes `s` for a POSIX shell.
// Not shlex::try_quote: it fails on a NUL, which the level-2 callers
// cannot report, and quotes each word its own way, where here every word
// reads the same in the script.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Waits for this machine's level-1 turn (see [`crate::run_in`]); the turn
/// lasts as long as the returned lock (released by the kernel if the
/// process dies).
pub fn one_at_a_time() -> Result<Option<nix::fcntl::Flock<File>>> {
    if std::env::var_os("MOAT_NESTED_PARALLEL").is_some_and(|v| v == "1") {
        return Ok(None);
    }
    let path = std::env::temp_dir().join("moat-nested-level1.lock");
    let watch = |source| Error::Watch { what: format!("taking the level-1 turn at {}", path.display()), source };
    let file = File::options().create(true).truncate(false).write(true).open(&path).map_err(watch)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map(Some)
        .map_err(|(_, errno)| watch(errno.into()))
}

/// Each level 1's temporary directory: its consoles, result channel and
/// initramfs; removed when its run ends.
const LEVEL_DIR_PREFIX: &str = "moat-nested-";
/// The file in it that holds the owning process's pid.
const OWNER: &str = "owner";

/// Removes the level directories under `tmp` whose owner died without
/// removing its own (a test process killed by a timeout; its QEMU dies
/// with it). Directories without an owner file are left: one may be
/// being made at this moment.
fn sweep_orphans(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for entry in entries.filter_map(std::result::Result::ok) {
        if !entry.file_name().to_string_lossy().starts_with(LEVEL_DIR_PREFIX) {
            continue;
        }
        let owner = std::fs::read_to_string(entry.path().join(OWNER)).ok().and_then(|p| p.trim().parse::<i32>().ok());
        let Some(pid) = owner.filter(|pid| *pid > 0) else { continue };
        let dead = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH);
        if dead {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// QEMU's monitor socket in a level 1's directory.
const MONITOR: &str = "monitor.sock";

/// Sends `command` to QEMU's monitor in level 1's directory `dir` and
/// returns what it printed until it was quiet for a moment (it never
/// closes); an error when there is no monitor.
fn monitor(dir: &Path, command: &str) -> std::io::Result<String> {
    use std::os::unix::net::UnixStream;
    let mut monitor = UnixStream::connect(dir.join(MONITOR))?;
    monitor.set_read_timeout(Some(Duration::from_millis(300)))?;
    monitor.write_all(format!("{command}\n").as_bytes())?;
    let (mut out, mut buf) = (Vec::new(), [0u8; 4096]);
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        match monitor.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Level 1's vCPU registers from QEMU's monitor (`info registers`), twice
/// a second apart; empty when there is no monitor. A hung level 1 prints
/// nothing: where its vCPU is, and whether it moves, is the clue.
fn cpu_state(dir: &Path) -> String {
    let sample = || -> std::io::Result<String> {
        let text = monitor(dir, "info registers")?;
        // The general, segment and control register lines: no banner,
        // prompts, echo escapes, or floating-point and vector registers.
        let noise = ["FPR", "YMM", "XMM", "ZMM", "DR", "FCW", "Opmask"];
        Ok(text
            .lines()
            .filter(|l| l.contains('=') && !l.contains("(qemu)") && !noise.iter().any(|n| l.starts_with(n)))
            .map(|l| l.chars().filter(|c| !c.is_control()).collect::<String>() + "\n")
            .collect())
    };
    let first = sample().unwrap_or_else(|e| format!("(no monitor: {e})\n"));
    std::thread::sleep(Duration::from_secs(1));
    let second = sample().unwrap_or_else(|e| format!("(no monitor: {e})\n"));
    format!("{first}-- 1 s later --\n{second}")
}

/// Kills level 1's QEMU and reaps it.
fn stop(level1: &mut Level1) {
    let _ = level1.child.kill();
    let _ = level1.child.wait();
}

/// Runs `payload` in level 1 booted from `bundle`.
pub fn run(bundle: &Bundle, payload: &Payload) -> Result<Output> {
    let script = payload_script(payload)?;
    let mut level1 = launch(bundle, payload.machine, &[("run", script)], &Console::File)?;
    let started = Instant::now();
    let mut watch = Watch::new(&level1, payload.echo, started)?;
    let mut stages = vec![(Stage::Launched, Duration::ZERO)];
    let mut since = started;
    let mut alive = started;
    let mut kicked = false;
    let code = loop {
        for event in watch.poll()? {
            match event {
                Event::Alive => {
                    if kicked {
                        eprintln!("moat-nested: level 1 answers again after the NMI");
                    }
                    alive = Instant::now();
                    kicked = false;
                }
                Event::Crashed(line) => {
                    stop(&mut level1);
                    let reason = format!("its kernel crashed: {line}");
                    return Err(Error::Crashed { stage: last(&stages), reason, tails: watch.tails() });
                }
                Event::Stage(stage, detail) => {
                    alive = Instant::now();
                    stages.push((stage, started.elapsed()));
                    since = Instant::now();
                    if stage == Stage::PayloadFinished {
                        let code = detail.trim().parse::<i32>().map_err(|_| Error::Failed {
                            stage,
                            reason: format!("level 1 reported an unreadable exit status {detail:?}"),
                            tails: watch.tails(),
                        })?;
                        watch.flush_echo()?;
                        wait_or_kill(&mut level1.child, POWER_OFF_GUARD);
                        watch.poll()?;
                        return finish(&level1, watch, code, stages);
                    }
                }
                Event::Failed(reason) => {
                    let stage = last(&stages);
                    return Err(Error::Failed { stage, reason, tails: watch.tails() });
                }
            }
        }
        if let Some(status) =
            level1.child.try_wait().map_err(|source| Error::Watch { what: "waiting for QEMU".into(), source })?
        {
            break status;
        }
        let stage = last(&stages);
        if stage == Stage::PayloadStarted && !kicked && alive.elapsed() > KICK_AFTER {
            kicked = true;
            let sent = monitor(level1.dir.path(), "nmi");
            eprintln!(
                "moat-nested: level 1 sent no heartbeat for {} s; kicked it with an NMI ({})",
                KICK_AFTER.as_secs(),
                if sent.is_ok() { "sent" } else { "no monitor" }
            );
        }
        if stage == Stage::PayloadStarted && alive.elapsed() > LIVENESS {
            let tails = Box::new(Tails { cpu: cpu_state(level1.dir.path()), ..*watch.tails() });
            stop(&mut level1);
            let reason = format!("it stopped answering (no heartbeat for {} s)", LIVENESS.as_secs());
            return Err(Error::Crashed { stage, reason, tails });
        }
        let limit = payload.timeouts.after(stage);
        if since.elapsed() > limit {
            let tails = Box::new(Tails { cpu: cpu_state(level1.dir.path()), ..*watch.tails() });
            stop(&mut level1);
            return Err(Error::Timeout { stage, waited: limit, tails });
        }
        std::thread::sleep(POLL);
    };
    // QEMU exited before the payload finished: a last look at the channel.
    let events = watch.poll()?;
    if let Some(reason) = events.iter().find_map(|e| if let Event::Failed(r) = e { Some(r.clone()) } else { None }) {
        return Err(Error::Failed { stage: last(&stages), reason, tails: watch.tails() });
    }
    // Level 1 powers off only after the payload's status: this was a crash
    // (with `panic=-1` a panicking kernel resets, and `-no-reboot` ends QEMU).
    Err(Error::Crashed { stage: last(&stages), reason: qemu_exited(&level1, code), tails: watch.tails() })
}

/// An interactive level-1 shell on this terminal; returns the shell's exit status.
pub fn shell(bundle: &Bundle, machine: Machine) -> Result<i32> {
    let mut level1 = launch(bundle, machine, &[("shell", String::new())], &Console::Terminal)?;
    let status = level1.child.wait().map_err(|source| Error::Watch { what: "waiting for QEMU".into(), source })?;
    let control = std::fs::read_to_string(level1.path("control")).unwrap_or_default();
    let code = control.lines().find_map(|l| l.strip_prefix("stage finished ")).and_then(|c| c.trim().parse().ok());
    code.ok_or_else(|| Error::Failed {
        stage: Stage::Launched,
        reason: format!("QEMU ended ({status}) without the shell's exit status"),
        tails: Box::new(Tails { channel: control, ..Tails::default() }),
    })
}

fn last(stages: &[(Stage, Duration)]) -> Stage {
    stages.last().map_or(Stage::Launched, |(s, _)| *s)
}

fn qemu_exited(level1: &Level1, status: ExitStatus) -> String {
    let log = std::fs::read_to_string(level1.path("qemu.log")).unwrap_or_default();
    let log = log.trim();
    if log.is_empty() { format!("QEMU exited ({status})") } else { format!("QEMU exited ({status}): {log}") }
}

fn wait_or_kill(child: &mut Child, guard: Duration) {
    let deadline = Instant::now() + guard;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(POLL);
    }
    tracing::warn!("level 1 did not power off within {guard:?}; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

fn finish(level1: &Level1, watch: Watch, code: i32, stages: Vec<(Stage, Duration)>) -> Result<Output> {
    let read = |name: &str| {
        std::fs::read(level1.path(name)).map_err(|source| Error::Watch { what: format!("reading {name}"), source })
    };
    Ok(Output {
        code,
        stdout: read("stdout")?,
        stderr: read("stderr")?,
        stages,
        marks: watch.marks,
        console: String::from_utf8_lossy(&read("console")?).into_owned(),
    })
}

enum Event {
    Stage(Stage, String),
    Failed(String),
    Alive,
    /// A console line that says level 1's kernel broke.
    Crashed(String),
}

/// A file QEMU appends lines to, read as it grows.
struct Lines {
    file: File,
    pending: String,
}

impl Lines {
    /// The complete lines added since the last call.
    fn read(&mut self) -> std::io::Result<Vec<String>> {
        let mut bytes = Vec::new();
        self.file.read_to_end(&mut bytes)?;
        self.pending.push_str(&String::from_utf8_lossy(&bytes));
        let mut lines = Vec::new();
        while let Some(end) = self.pending.find('\n') {
            let line: String = self.pending.drain(..=end).collect();
            lines.push(line.trim_end().to_owned());
        }
        Ok(lines)
    }
}

/// Follows the channel files as QEMU writes them.
struct Watch {
    dir: PathBuf,
    started: Instant,
    control: Lines,
    /// The serial console, watched for crash reports.
    console: Lines,
    marks_file: Lines,
    marks: Vec<(Duration, String)>,
    echo: Option<[(File, bool); 2]>,
}

impl Watch {
    fn new(level1: &Level1, echo: bool, started: Instant) -> Result<Self> {
        let open = |name: &str| {
            File::open(level1.path(name)).map_err(|source| Error::Watch { what: format!("opening {name}"), source })
        };
        let echo = if echo { Some([(open("stdout")?, false), (open("stderr")?, true)]) } else { None };
        Ok(Self {
            dir: level1.dir.path().to_path_buf(),
            started,
            control: Lines { file: open("control")?, pending: String::new() },
            console: Lines { file: open("console")?, pending: String::new() },
            marks_file: Lines { file: open("marks")?, pending: String::new() },
            marks: Vec::new(),
            echo,
        })
    }

    fn poll(&mut self) -> Result<Vec<Event>> {
        let marks =
            self.marks_file.read().map_err(|source| Error::Watch { what: "reading the marks port".into(), source })?;
        let now = self.started.elapsed();
        self.marks.extend(marks.into_iter().map(|m| (now, m)));
        self.flush_echo()?;
        let lines =
            self.control.read().map_err(|source| Error::Watch { what: "reading the control port".into(), source })?;
        let mut events = Vec::new();
        let console =
            self.console.read().map_err(|source| Error::Watch { what: "reading the console".into(), source })?;
        if let Some(line) = console.iter().find(|l| CRASH_MARKERS.iter().any(|m| l.contains(m))) {
            events.push(Event::Crashed(line.clone()));
        }
        for line in &lines {
            if line == "alive" {
                events.push(Event::Alive);
            } else if let Some(reason) = line.strip_prefix("fail ") {
                events.push(Event::Failed(reason.to_owned()));
            } else if let Some(rest) = line.strip_prefix("stage ") {
                let (name, detail) = rest.split_once(' ').unwrap_or((rest, ""));
                match Stage::from_wire(name) {
                    Some(stage) => events.push(Event::Stage(stage, detail.to_owned())),
                    None => tracing::warn!(line, "unknown stage on the control port"),
                }
            } else if !line.is_empty() {
                tracing::warn!(line, "unexpected line on the control port");
            }
        }
        Ok(events)
    }

    /// Copies what the payload wrote since the last look to our stdout/stderr.
    fn flush_echo(&mut self) -> Result<()> {
        let Some(streams) = self.echo.as_mut() else { return Ok(()) };
        for (file, is_stderr) in streams {
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)
                .map_err(|source| Error::Watch { what: "reading the payload's output".into(), source })?;
            if bytes.is_empty() {
                continue;
            }
            let written = if *is_stderr {
                std::io::stderr().write_all(&bytes).and_then(|()| std::io::stderr().flush())
            } else {
                std::io::stdout().write_all(&bytes).and_then(|()| std::io::stdout().flush())
            };
            written.map_err(|source| Error::Watch { what: "echoing the payload's output".into(), source })?;
        }
        Ok(())
    }

    fn tails(&self) -> Box<Tails> {
        let console = std::fs::read(self.dir.join("console")).unwrap_or_default();
        let console = String::from_utf8_lossy(&console);
        let lines: Vec<&str> = console.lines().collect();
        let console = lines[lines.len().saturating_sub(CONSOLE_TAIL_LINES)..].join("\n");
        let control = std::fs::read_to_string(self.dir.join("control")).unwrap_or_default();
        let mut channel: String = control.lines().filter(|l| *l != "alive").map(|l| format!("{l}\n")).collect();
        for name in ["stdout", "stderr"] {
            let tail = tail_bytes(&self.dir.join(name), STREAM_TAIL_BYTES);
            channel.push_str(&format!(
                "[payload {name}, last {} bytes]\n{}\n",
                tail.len(),
                String::from_utf8_lossy(&tail)
            ));
        }
        let marks = self.marks.iter().map(|(_, m)| m.clone()).collect();
        let stdout = std::fs::read(self.dir.join("stdout")).unwrap_or_default();
        Box::new(Tails { console, channel, cpu: String::new(), marks, stdout })
    }
}

fn tail_bytes(path: &Path, max: usize) -> Vec<u8> {
    let Ok(mut file) = File::open(path) else { return Vec::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max as u64)));
    let mut out = Vec::new();
    let _ = file.read_to_end(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_script_quotes_every_word() {
        let payload = Payload::new(["printf", "%s\\n", "it's", "$HOME"]).env("GREETING", "a 'b' $c");
        let script = payload_script(&payload).expect("valid");
        assert_eq!(script, "export GREETING='a '\\''b'\\'' $c'\nexec 'printf' '%s\\n' 'it'\\''s' '$HOME'\n");
        // And the shell reads back the same words.
        let out =
            Command::new("sh").arg("-c").arg(script.replace("exec 'printf'", "exec printf")).output().expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's\n$HOME\n");
    }

    #[test]
    fn directories_of_dead_owners_are_swept_and_no_others() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut gone = Command::new("true").spawn().expect("true");
        gone.wait().expect("reaped");
        let level = |name: &str, owner: Option<u32>| {
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).expect("dir");
            std::fs::write(dir.join("console"), "x").expect("console");
            if let Some(pid) = owner {
                std::fs::write(dir.join(OWNER), pid.to_string()).expect("owner");
            }
            dir
        };
        let orphan = level("moat-nested-dead", Some(gone.id()));
        let live = level("moat-nested-live", Some(std::process::id()));
        let unowned = level("moat-nested-new", None);
        let other = level("not-ours", Some(gone.id()));
        sweep_orphans(tmp.path());
        assert!(!orphan.exists(), "a dead owner's directory stays");
        assert!(live.exists() && unowned.exists() && other.exists());
    }

    #[test]
    fn refuses_payloads_level_1_could_not_run() {
        assert!(payload_script(&Payload::new(Vec::<String>::new())).is_err());
        assert!(payload_script(&Payload::new(["true"]).env("NOT AN IDENT", "x")).is_err());
        assert!(payload_script(&Payload::new(["true"]).env("1X", "x")).is_err());
    }

    #[test]
    fn the_run_archive_follows_the_bundle_archive() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.cpio.gz");
        let mut first = Cpio::new(GzEncoder::new(Vec::new(), Compression::fast()));
        first.file("init", 0o755, b"#!/bin/sh\n").expect("file");
        std::fs::write(&base, first.finish().expect("cpio").finish().expect("gz")).expect("write");
        let dest = dir.path().join("run.cpio.gz");
        write_initramfs(&base, &[("run", "exec true\n".into())], &dest).expect("written");
        // Both gzip members decompress, one after the other.
        let data = std::fs::read(&dest).expect("read");
        let mut text = Vec::new();
        flate2::read::MultiGzDecoder::new(&data[..]).read_to_end(&mut text).expect("gzip members");
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("init") && text.contains("payload/run") && text.contains("exec true"), "{text}");
    }
}

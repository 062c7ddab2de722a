//! moat-vmm end to end with tiny hand-assembled kernels, packaged as ELF
//! files the way a real `vmlinux` is: one with a PVH note (entered in
//! 32-bit protected mode), one without (entered in 64-bit long mode).
//! They exercise the whole binary — configuration, loading, devices,
//! seccomp, the event loop, the control socket and exit statuses — on this
//! host's /dev/kvm. (Real Linux boots need the nested test host; see
//! crates/vmm/README.md.)

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LOAD: u64 = 0x10_0000;

/// An ELF64 executable loading `code` at 1 MiB, entered at its start;
/// with `pvh`, a Xen PVH note names the same address as the 32-bit entry.
fn elf(code: &[u8], pvh: bool) -> Vec<u8> {
    let phnum: u16 = if pvh { 2 } else { 1 };
    let code_offset = 0x1000u64;
    let mut f = Vec::new();
    f.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0"); // 64-bit, little endian, SysV
    f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    f.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    f.extend_from_slice(&LOAD.to_le_bytes()); // e_entry
    f.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    f.extend_from_slice(&64u16.to_le_bytes()); // e_ehsize
    f.extend_from_slice(&56u16.to_le_bytes()); // e_phentsize
    f.extend_from_slice(&phnum.to_le_bytes());
    f.extend_from_slice(&[0; 6]); // no sections
    let len = code.len() as u64;
    let phdr = |f: &mut Vec<u8>, kind: u32, offset: u64, addr: u64, size: u64, align: u64| {
        f.extend_from_slice(&kind.to_le_bytes());
        f.extend_from_slice(&7u32.to_le_bytes()); // rwx
        f.extend_from_slice(&offset.to_le_bytes());
        f.extend_from_slice(&addr.to_le_bytes()); // vaddr
        f.extend_from_slice(&addr.to_le_bytes()); // paddr
        f.extend_from_slice(&size.to_le_bytes()); // filesz
        f.extend_from_slice(&size.to_le_bytes()); // memsz
        f.extend_from_slice(&align.to_le_bytes());
    };
    phdr(&mut f, 1, code_offset, LOAD, len, 0x1000); // PT_LOAD
    let note_offset = 64 + 56 * u64::from(phnum);
    let mut note = Vec::new();
    note.extend_from_slice(&4u32.to_le_bytes()); // namesz
    note.extend_from_slice(&4u32.to_le_bytes()); // descsz
    note.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&u32::try_from(LOAD).expect("low").to_le_bytes());
    if pvh {
        phdr(&mut f, 4, note_offset, 0, note.len() as u64, 4); // PT_NOTE
        f.extend_from_slice(&note);
    }
    f.resize(usize::try_from(code_offset).expect("small"), 0);
    f.extend_from_slice(code);
    f
}

/// `out 0x3f8, c` for each byte of `text`.
fn say(text: &str, long_mode: bool) -> Vec<u8> {
    let _ = long_mode; // `mov dx, imm16` needs the 0x66 prefix in both 32- and 64-bit code
    let mut code = vec![0x66, 0xba, 0xf8, 0x03];
    for b in text.bytes() {
        code.extend_from_slice(&[0xb0, b, 0xee]);
    }
    code
}

/// 32-bit: the boot timer's ready write.
fn ready32() -> Vec<u8> {
    let mut code = vec![0xc6, 0x05];
    code.extend_from_slice(&0xc000_0000u32.to_le_bytes());
    code.push(123);
    code
}

/// Enter ACPI S5 through the sleep control register (port 0x600).
fn poweroff() -> Vec<u8> {
    vec![0x66, 0xba, 0x00, 0x06, 0xb0, (5 << 2) | 0x20, 0xee, 0xf4, 0xeb, 0xfd]
}

struct Vm {
    dir: tempfile::TempDir,
    child: Child,
    console: PathBuf,
    socket: PathBuf,
}

impl Vm {
    fn start(code: &[u8], pvh: bool, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, elf(code, pvh)).expect("kernel written");
        let (console, socket) = (dir.path().join("console"), dir.path().join("ctl.sock"));
        let child = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
            .arg("--kernel")
            .arg(&kernel)
            .args(["--memory-mib", "64", "--console", &format!("file:{}", console.display()), "--control-socket"])
            .arg(&socket)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("moat-vmm starts");
        Self { dir, child, console, socket }
    }

    /// A jailed moat-vmm laid out as core lays one out: the kernel in
    /// `image/`, the console and the jail in `state/`, the sockets (and
    /// the host's vsock listeners) in `state/run/`; `{state}` in `extra`
    /// stands for the state directory.
    fn jailed(code: &[u8], extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().canonicalize().expect("canonical temp dir");
        for sub in ["image", "state/run"] {
            std::fs::create_dir_all(d.join(sub)).expect("directories");
        }
        let kernel = d.join("image/vmlinux");
        std::fs::write(&kernel, elf(code, true)).expect("kernel written");
        let (console, socket) = (d.join("state/console"), d.join("state/run/ctl.sock"));
        let child = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
            .arg("--kernel")
            .arg(&kernel)
            .args(["--memory-mib", "64", "--console", &format!("file:{}", console.display()), "--control-socket"])
            .arg(&socket)
            .arg("--jail")
            .arg(d.join("state/jail"))
            .args(extra.iter().map(|a| a.replace("{state}", d.join("state").to_str().expect("utf-8"))))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("moat-vmm starts");
        Self { dir, child, console, socket }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    fn socket(&self) -> PathBuf {
        self.socket.clone()
    }

    /// Waits for the VMM to exit (bounded: a liveness check).
    fn wait(mut self) -> (Output, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait().expect("waitable").is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let console = self.console();
        (self.child.wait_with_output().expect("output"), console)
    }
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Control {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Control {
    fn connect(path: &Path) -> Self {
        // The path appears at bind(2), a moment before listen(2): until then
        // a connect is refused, so it is retried like the path's existence.
        let mut stream = None;
        wait_until("the control socket to accept", || {
            stream = UnixStream::connect(path).ok();
            stream.is_some()
        });
        let writer = stream.expect("connected");
        let reader = BufReader::new(writer.try_clone().expect("clone"));
        Self { writer, reader }
    }

    fn call(&mut self, request: &str) -> serde_json::Value {
        writeln!(self.writer, "{request}").expect("request sent");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("reply read");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("reply {line:?} is not JSON: {e}"))
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn invalid_configuration_exits_2_with_one_line_naming_the_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, elf(&[0xf4], true)).expect("written");
    let garbage = dir.path().join("garbage");
    std::fs::write(&garbage, [0u8; 4096]).expect("written");
    let config = dir.path().join("vm.json");
    std::fs::write(&config, r#"{"kernel": "/k", "memory": 5}"#).expect("written");
    let k = kernel.to_str().expect("utf-8");
    let g = garbage.to_str().expect("utf-8");
    let c = config.to_str().expect("utf-8");
    for (args, field) in [
        (vec![], "kernel"),
        (vec!["--kernel", "/nonexistent/vmlinux"], "kernel"),
        (vec!["--kernel", k, "--vcpus", "9"], "vcpus"),
        (vec!["--kernel", k, "--memory-mib", "4"], "memory_mib"),
        (vec!["--kernel", k, "--console", "serial"], "console"),
        (vec!["--kernel", k, "--disk", "/nonexistent.img:ro"], "disks[0].path"),
        (vec!["--kernel", k, "--disk", &format!("{g},overlay=/nonexistent/dir/ov")], "disks[0].overlay"),
        (vec!["--kernel", k, "--disk", &format!("{g},ro,overlay={g}.ov")], "disks[0].overlay"),
        (
            vec!["--kernel", k, "--disk", &format!("{g},overlay={g}.ov,overlay_limit_mib=lots")],
            "disks[0].overlay_limit_mib",
        ),
        (vec!["--kernel", k, "--disk", &format!("{g},overlay_limit_mib=5")], "disks[0].overlay_limit_mib"),
        (vec!["--kernel", k, "--disk", &format!("{g},cache=none")], "disks[0].path"),
        (vec!["--kernel", k, "--disk", &format!("{g},overlay={k}")], "disks[0].overlay"),
        (vec!["--kernel", k, "--vsock-cid", "1", "--vsock-uds", "/tmp/v.sock"], "vsock.cid"),
        (vec!["--kernel", k, "--control-socket", "/nonexistent/dir/ctl"], "control_socket"),
        (vec!["--config", c], "config"),
        (vec!["--kernel", g], "kernel"),
        (vec!["--kernel", k, "--net-passt-socket", "/nonexistent/passt.sock"], "net.passt_socket"),
        (vec!["--kernel", k, "--net-passt-socket", g], "net.passt_socket"),
        (vec!["--kernel", k, "--net-passt-fd", "1"], "net.passt_fd"),
        (vec!["--kernel", k, "--net-passt-fd", "5", "--net-mac", "03:00:00:00:00:01"], "net.mac"),
        (vec!["--kernel", k, "--net-passt-fd", "5", "--net-mac", "02:00:00:00:01"], "net.mac"),
        (vec!["--kernel", k, "--net-mac", "02:00:00:00:00:01"], "net.mac"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_moat-vmm")).args(&args).output().expect("runs");
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.starts_with(&format!("moat-vmm: Invalid configuration: {field}: ")), "{args:?}: {err}");
    }
}

/// A passt that is not there is reported before the guest starts: a stale
/// socket file nobody listens on, or a descriptor that is not a socket.
#[test]
fn a_missing_passt_fails_the_build_with_what_to_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, elf(&[0xf4], true)).expect("written");
    let stale = dir.path().join("passt.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("binds"));
    let out = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
        .arg("--kernel")
        .arg(&kernel)
        .arg("--net-passt-socket")
        .arg(&stale)
        .args(["--console", "none"])
        .output()
        .expect("runs");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("Cannot connect to passt at") && err.contains("--socket"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
        .arg("--kernel")
        .arg(&kernel)
        .args(["--net-passt-fd", "57", "--console", "none"])
        .output()
        .expect("runs");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("fd:57 is not an open socket"), "{err}");
}

#[test]
fn print_config_shows_the_effective_configuration() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, elf(&[0xf4], true)).expect("written");
    let config = dir.path().join("vm.json");
    std::fs::write(&config, format!(r#"{{"kernel": {kernel:?}, "vcpus": 2, "memory_mib": 128}}"#)).expect("written");
    let out = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
        .arg("--config")
        .arg(&config)
        .args(["--memory-mib", "96", "--print-config"])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((value["vcpus"].as_u64(), value["memory_mib"].as_u64()), (Some(2), Some(96)));
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn pvh_guest_writes_the_console_reports_ready_and_powers_off() {
    let mut code = say("hello from PVH\n", false);
    code.extend(ready32());
    code.extend(poweroff());
    let (out, console) = Vm::start(&code, true, &[]).wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(console, "hello from PVH\n");
    assert!(err.contains("Guest ready after"), "{err}");
    assert!(err.contains("the guest powered off"), "{err}");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn long_mode_guest_runs_on_two_vcpus_and_resets_through_the_i8042() {
    let mut code = say("64-bit entry\n", true);
    code.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64, 0xf4]); // mov al, 0xfe; out 0x64, al; hlt
    let (out, console) = Vm::start(&code, false, &["--vcpus", "2"]).wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(console, "64-bit entry\n");
    assert!(err.contains("i8042 reset"), "{err}");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn triple_fault_ends_the_vm_cleanly() {
    let mut code = say("bye", true);
    code.extend_from_slice(&[0x48, 0xb8]); // mov rax, 0x2000 (zeroed memory: an empty IDTR)
    code.extend_from_slice(&0x2000u64.to_le_bytes());
    code.extend_from_slice(&[0x0f, 0x01, 0x18, 0x0f, 0x0b]); // lidt [rax]; ud2
    let (out, console) = Vm::start(&code, false, &[]).wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(console, "bye");
    assert!(err.contains("triple fault"), "{err}");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn a_guest_kvm_cannot_run_fails_the_vmm_with_a_report() {
    // Jump into the MMIO hole: there is no RAM to fetch instructions from.
    let mut code = say("jumping\n", false);
    code.extend_from_slice(&[0xb8, 0x00, 0x00, 0x00, 0xd0, 0xff, 0xe0]); // mov eax, 0xd0000000; jmp eax
    let (out, _) = Vm::start(&code, true, &[]).wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let report = err.lines().find(|l| l.starts_with("moat-vmm: the VM failed:")).unwrap_or_else(|| panic!("{err}"));
    assert!(report.contains("vCPU 0:") && report.contains("RIP 0xd0000000"), "{report}");
    assert!(report.contains("instruction bytes"), "{report}");
}

/// A guest printing dots forever, slowly.
fn dots() -> Vec<u8> {
    #[rustfmt::skip]
    let code = vec![
        0x66, 0xba, 0xf8, 0x03,       // mov dx, 0x3f8
        0xb0, b'.', 0xee,             // 1: mov al, '.'; out dx, al
        0xb9, 0x00, 0x00, 0x10, 0x00, // mov ecx, 0x100000
        0xe2, 0xfe,                   // loop $
        0xeb, 0xf4,                   // jmp 1b
    ];
    code
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn control_socket_pauses_resumes_and_reports_status() {
    let vm = Vm::start(&dots(), true, &["--vcpus", "2"]);
    let mut control = Control::connect(&vm.socket());
    let status = control.call(r#"{"op":"status"}"#);
    assert_eq!(status["ok"], true, "{status}");
    assert_eq!(status["state"], "running");
    assert_eq!((status["vcpus"].as_u64(), status["memory_mib"].as_u64()), (Some(2), Some(64)));
    wait_until("console output", || !vm.console().is_empty());

    let paused = control.call(r#"{"op":"pause"}"#);
    assert_eq!(paused["state"], "paused", "{paused}");
    // Every vCPU is parked once pause answers, so nothing more is written.
    let frozen = vm.console().len();
    assert_eq!(control.call(r#"{"op":"status"}"#)["state"], "paused");
    assert_eq!(vm.console().len(), frozen);

    let resumed = control.call(r#"{"op":"resume"}"#);
    assert_eq!(resumed["state"], "running", "{resumed}");
    wait_until("output after resume", || vm.console().len() > frozen);

    let bad = control.call(r#"{"op":"reboot"}"#);
    assert_eq!(bad["ok"], false);
    assert!(bad["error"].as_str().unwrap_or_default().contains("reboot"), "{bad}");

    // The guest ignores Ctrl+Alt+Del, so the graceful shutdown times out.
    let stopping = control.call(r#"{"op":"shutdown","timeout_ms":100}"#);
    assert_eq!(stopping["state"], "stopping");
    let socket = vm.socket();
    let (out, _) = vm.wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("did not shut down in time"), "{err}");
    assert!(!socket.exists(), "the control socket is removed on exit");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn forced_shutdown_and_sigterm_stop_the_vm() {
    let vm = Vm::start(&dots(), true, &[]);
    let mut control = Control::connect(&vm.socket());
    assert_eq!(control.call(r#"{"op":"shutdown","force":true}"#)["state"], "stopping");
    let (out, _) = vm.wait();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let vm = Vm::start(&dots(), true, &["--shutdown-timeout-ms", "100"]);
    sigterm_shuts_down(vm);
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn terminal_console_passes_keystrokes_to_the_guest() {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    // Echo what the UART receives until a 'q', then power off.
    #[rustfmt::skip]
    let mut code = vec![
        0x66, 0xba, 0xfd, 0x03, // 1: mov dx, 0x3fd (line status)
        0xec,                   // in al, dx
        0xa8, 0x01,             // test al, 1 (data ready)
        0x74, 0xf7,             // jz 1b
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0xec,                   // in al, dx
        0xee,                   // out dx, al
        0x3c, b'q',             // cmp al, 'q'
        0x75, 0xed,             // jne 1b
    ];
    code.extend(poweroff());
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors into the given integers; the
    // name, termios and winsize pointers may be null.
    let rc =
        unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: openpty returned two fresh descriptors that nothing else owns.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let dir = tempfile::tempdir().expect("temp dir");
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, elf(&code, true)).expect("written");
    let mut child = Command::new(env!("CARGO_BIN_EXE_moat-vmm"))
        .arg("--kernel")
        .arg(&kernel)
        .args(["--memory-mib", "64", "--console", "stdout"])
        .stdin(Stdio::from(slave.try_clone().expect("dup")))
        .stdout(Stdio::from(slave))
        .stderr(Stdio::piped())
        .spawn()
        .expect("moat-vmm starts");
    let mut log = BufReader::new(child.stderr.take().expect("stderr piped"));
    let mut line = String::new();
    // The terminal is raw once the guest starts; typing before would be
    // cooked (echoed, line-buffered) by the terminal itself.
    while !line.contains("Starting the guest") {
        line.clear();
        assert!(log.read_line(&mut line).expect("log readable") > 0, "moat-vmm exited early");
    }
    let mut master = std::fs::File::from(master);
    master.write_all(b"hi q").expect("typed");
    let mut echoed = Vec::new();
    let mut byte = [0u8; 1];
    while !echoed.ends_with(b"q") {
        master.read_exact(&mut byte).expect("guest output");
        echoed.push(byte[0]);
    }
    assert_eq!(echoed, b"hi q");
    let status = child.wait().expect("exits");
    assert_eq!(status.code(), Some(0));
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn guest_driver_reads_entropy_from_virtio_rng() {
    const MMIO: u32 = 0xd000_0000; // the first virtio-mmio window (docs/vmm.md)
    let (desc, avail, used, buf) = (0x1_0000u32, 0x1_1000u32, 0x1_2000u32, 0x1_3000u32);
    let mut code = Vec::new();
    let mut w = |addr: u32, value: u32| {
        code.extend_from_slice(&[0xc7, 0x05]); // mov dword [addr], value
        code.extend_from_slice(&addr.to_le_bytes());
        code.extend_from_slice(&value.to_le_bytes());
    };
    w(MMIO + 0x70, 3); // ACKNOWLEDGE | DRIVER
    w(MMIO + 0x24, 1);
    w(MMIO + 0x20, 1); // VIRTIO_F_VERSION_1
    w(MMIO + 0x70, 11); // | FEATURES_OK
    w(MMIO + 0x30, 0);
    w(MMIO + 0x38, 4);
    for (reg, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
        w(MMIO + reg, addr);
        w(MMIO + reg + 4, 0);
    }
    w(MMIO + 0x44, 1); // QueueReady
    w(MMIO + 0x70, 15); // | DRIVER_OK
    w(desc, buf); // descriptor 0: 32 device-writable bytes at `buf`
    w(desc + 4, 0);
    w(desc + 8, 32);
    w(desc + 12, 2);
    w(avail, 1 << 16); // avail.idx = 1, ring[0] = 0
    w(MMIO + 0x50, 0); // QueueNotify
    // The device runs on the VMM thread, not in this vCPU's exit: wait for
    // the used ring to move, as a driver waits for its interrupt.
    code.push(0xa1); // 1: mov eax, [used + 2]
    code.extend_from_slice(&(used + 2).to_le_bytes());
    code.extend_from_slice(&[0xa8, 0xff, 0x74, 0xf7]); // test al, 0xff; jz 1b
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for addr in [used + 2, used + 8, MMIO + 0x60] {
        code.push(0xa1); // mov eax, [addr]: virtio-mmio registers are read 32 bits wide
        code.extend_from_slice(&addr.to_le_bytes());
        code.push(0xee); // out dx, al
    }
    code.extend(poweroff());
    let (out, console) = Vm::start(&code, true, &[]).wait();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(console.as_bytes(), [1, 32, 1], "used idx, used length, interrupt status");
    assert!(!stderr(&out).contains("ioeventfd"), "KVM took the queue notification itself: {}", stderr(&out));
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn guest_driver_reads_the_base_and_writes_into_the_overlay() {
    const MMIO: u32 = 0xd000_1000; // the second window: the first disk (docs/vmm.md)
    let (desc, avail, used) = (0x1_0000u32, 0x1_1000u32, 0x1_2000u32);
    let (h1, data1, st1, h2, data2, st2) =
        (0x1_3000u32, 0x1_4000u32, 0x1_3100u32, 0x1_3200u32, 0x1_5000u32, 0x1_3300u32);
    let mut code = Vec::new();
    let mut w = |addr: u32, value: u32| {
        code.extend_from_slice(&[0xc7, 0x05]); // mov dword [addr], value
        code.extend_from_slice(&addr.to_le_bytes());
        code.extend_from_slice(&value.to_le_bytes());
    };
    w(MMIO + 0x70, 3);
    w(MMIO + 0x24, 1);
    w(MMIO + 0x20, 1); // VIRTIO_F_VERSION_1, nothing else
    w(MMIO + 0x70, 11);
    w(MMIO + 0x30, 0);
    w(MMIO + 0x38, 8);
    for (reg, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
        w(MMIO + reg, addr);
        w(MMIO + reg + 4, 0);
    }
    w(MMIO + 0x44, 1);
    w(MMIO + 0x70, 15);
    // Request 1: read sector 0 into data1. Request 2: write sector 1 from data2.
    w(h1, 0);
    w(h2, 1);
    w(h2 + 8, 1);
    for i in 0..128 {
        w(data2 + 4 * i, 0x6161_6161); // "aaaa"
    }
    let mut d = |i: u32, addr: u32, len: u32, flags: u32, next: u32| {
        w(desc + 16 * i, addr);
        w(desc + 16 * i + 4, 0);
        w(desc + 16 * i + 8, len);
        w(desc + 16 * i + 12, flags | (next << 16));
    };
    d(0, h1, 16, 1, 1);
    d(1, data1, 512, 3, 2);
    d(2, st1, 1, 2, 0);
    d(3, h2, 16, 1, 4);
    d(4, data2, 512, 1, 5);
    d(5, st2, 1, 2, 0);
    w(st1, 0x7f);
    w(st2, 0x7f);
    w(avail + 4, 3 << 16); // ring = [0, 3]
    w(avail, 2 << 16); // idx = 2
    w(MMIO + 0x50, 0);
    code.push(0xa1); // 1: mov eax, [used + 2]
    code.extend_from_slice(&(used + 2).to_le_bytes());
    code.extend_from_slice(&[0x3c, 0x02, 0x75, 0xf7]); // cmp al, 2; jne 1b
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for addr in [data1, st1, st2] {
        code.push(0xa1);
        code.extend_from_slice(&addr.to_le_bytes());
        code.push(0xee);
    }
    code.extend(poweroff());
    // Jailed too: the overlay is created before the jail, the base bound
    // read-only and the overlay read-write.
    for jailed in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let base = dir.path().join("rootfs.ext4");
        std::fs::write(&base, vec![b'B'; 1 << 20]).expect("base written");
        let overlay = dir.path().join("overlay.img");
        let disk = format!("{},overlay={},overlay_limit_mib=1", base.display(), overlay.display());
        let vm =
            if jailed { Vm::jailed(&code, &["--disk", &disk]) } else { Vm::start(&code, true, &["--disk", &disk]) };
        let (out, console) = vm.wait();
        assert_eq!(out.status.code(), Some(0), "jailed {jailed}: {}", stderr(&out));
        assert_eq!(console.as_bytes(), [b'B', 0, 0], "base byte, read status, write status");
        assert_eq!(std::fs::read(&base).expect("base"), vec![b'B'; 1 << 20], "the base is untouched");
        use moat_vmm::devices::virtio::block::{CowDisk, DiskBackend};
        let mut cow = CowDisk::open(&base, &overlay, 1 << 20).expect("the overlay reopens");
        let mut sectors = vec![0u8; 1024];
        cow.read_at(&mut sectors, 0).expect("reads");
        assert_eq!((&sectors[..512], &sectors[512..]), (&[b'B'; 512][..], &[b'a'; 512][..]));
    }
}

/// A guest driver connecting from vsock port 1234 to the host's port 5000,
/// sending "hi", printing the RESPONSE's op and the host's two bytes.
fn vsock_guest() -> Vec<u8> {
    const MMIO: u32 = 0xd000_1000; // no disks: vsock takes the second window
    // Clear of the boot structures (the command line is at 0x2_0000) and the code.
    let rings = |q: u32| (0x30_0000 + 0x1_0000 * q, 0x30_1000 + 0x1_0000 * q, 0x30_2000 + 0x1_0000 * q);
    let (rx1, rx2, req, rw, payload) = (0x40_0000u32, 0x40_2000u32, 0x41_0000u32, 0x41_0100u32, 0x41_0200u32);
    let mut code = Vec::new();
    let mut w = |addr: u32, value: u32| {
        code.extend_from_slice(&[0xc7, 0x05]); // mov dword [addr], value
        code.extend_from_slice(&addr.to_le_bytes());
        code.extend_from_slice(&value.to_le_bytes());
    };
    w(MMIO + 0x70, 3);
    w(MMIO + 0x24, 1);
    w(MMIO + 0x20, 1);
    w(MMIO + 0x70, 11);
    for q in 0..3 {
        let (desc, avail, used) = rings(q);
        w(MMIO + 0x30, q);
        w(MMIO + 0x38, 4);
        for (reg, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
            w(MMIO + reg, addr);
            w(MMIO + reg + 4, 0);
        }
        w(MMIO + 0x44, 1);
    }
    w(MMIO + 0x70, 15);
    // Packets from cid 3 port 1234 to the host's port 5000: REQUEST, then
    // RW "hi" (header and payload in two descriptors, as Linux sends them).
    for (h, op, len) in [(req, 1u32, 0u32), (rw, 5, 2)] {
        for (off, v) in [(0, 3), (8, 2), (16, 1234), (20, 5000), (24, len), (28, 1 | (op << 16)), (36, 65536)] {
            w(h + off, v);
        }
    }
    w(payload, u32::from_le_bytes(*b"hi\0\0"));
    let desc = |w: &mut dyn FnMut(u32, u32), table: u32, i: u32, addr: u32, len: u32, flags: u32, next: u32| {
        w(table + 16 * i, addr);
        w(table + 16 * i + 4, 0);
        w(table + 16 * i + 8, len);
        w(table + 16 * i + 12, flags | (next << 16));
    };
    let (rx_desc, rx_avail, rx_used) = rings(0);
    let (tx_desc, tx_avail, _) = rings(1);
    desc(&mut w, rx_desc, 0, rx1, 4096, 2, 0);
    desc(&mut w, rx_desc, 1, rx2, 4096, 2, 0);
    w(rx_avail + 4, 1 << 16); // ring = [0, 1]
    w(rx_avail, 2 << 16); // idx = 2
    w(MMIO + 0x50, 0);
    desc(&mut w, tx_desc, 0, req, 44, 0, 0);
    desc(&mut w, tx_desc, 1, rw, 44, 1, 2);
    desc(&mut w, tx_desc, 2, payload, 2, 0, 0);
    w(tx_avail + 4, 1 << 16); // ring = [0, 1]
    w(tx_avail, 2 << 16);
    w(MMIO + 0x50, 1);
    // Wait for two packets: the RESPONSE and the host's answer.
    code.push(0xa1); // 1: mov eax, [rx used + 2]
    code.extend_from_slice(&(rx_used + 2).to_le_bytes());
    code.extend_from_slice(&[0x3c, 0x02, 0x75, 0xf7]); // cmp al, 2; jne 1b
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for addr in [rx1 + 30, rx2 + 44, rx2 + 45] {
        code.push(0xa1);
        code.extend_from_slice(&addr.to_le_bytes());
        code.push(0xee);
    }
    code.extend(poweroff());
    code
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn guest_driver_connects_to_the_host_over_vsock() {
    let code = vsock_guest();
    let dir = tempfile::tempdir().expect("temp dir");
    let uds = dir.path().join("v.sock");
    let listener = std::os::unix::net::UnixListener::bind(format!("{}_5000", uds.display())).expect("binds");
    let host = std::thread::spawn(move || {
        use std::io::Read;
        let (mut s, _) = listener.accept().expect("the guest connects");
        let mut hi = [0u8; 2];
        s.read_exact(&mut hi).expect("reads");
        s.write_all(b"yo").expect("answers");
        hi
    });
    let (out, console) =
        Vm::start(&code, true, &["--vsock-cid", "3", "--vsock-uds", uds.to_str().expect("utf-8")]).wait();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(&host.join().expect("host side"), b"hi");
    assert_eq!(console.as_bytes(), [2, b'y', b'o'], "RESPONSE, then the host's bytes");
}

/// The jailed VMM of the supervisor `vm` (its only child), once it serves
/// its control socket.
fn jailed_pid(vm: &Vm) -> i32 {
    wait_until("the control socket", || vm.socket().exists());
    let outer = vm.child.id().to_string();
    let children: Vec<i32> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // "pid (comm) state ppid …": the comm may hold spaces, not ')'.
            stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)) == Some(outer.as_str())
        })
        .collect();
    assert_eq!(children.len(), 1, "one jailed VMM under the supervisor: {children:?}");
    children[0]
}

/// The value of `field` in /proc/`pid`/status.
fn status_field(pid: i32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status readable");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in {status}"))
        .trim()
        .to_owned()
}

/// Every non-directory under `dir`, relative to it.
fn files_under(dir: &Path, prefix: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable").map(|e| e.expect("entry")) {
        let path = prefix.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            files_under(&entry.path(), &path, found);
        } else {
            found.push(path);
        }
    }
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn a_jailed_vmm_has_no_privileges_its_own_namespaces_and_only_its_files() {
    let vsock = ["--vsock-cid", "3", "--vsock-uds", "{state}/run/v.sock", "--vsock-host-ports", "none"];
    let vm = Vm::jailed(&dots(), &[&["--vcpus", "2"], &vsock[..]].concat());
    let d = vm.dir.path().canonicalize().expect("canonical");
    let mut control = Control::connect(&vm.socket());
    let status = control.call(r#"{"op":"status"}"#);
    assert_eq!((status["ok"].as_bool(), status["vcpus"].as_u64()), (Some(true), Some(2)), "{status}");
    wait_until("console output", || vm.console().contains(".."));
    let outer = i32::try_from(vm.child.id()).expect("pid fits");
    let inner = jailed_pid(&vm);

    for pid in [outer, inner] {
        for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(pid, set), "0000000000000000", "{set} of {pid}");
        }
        assert_eq!(status_field(pid, "NoNewPrivs"), "1", "{pid}");
    }
    assert_eq!(status_field(inner, "Seccomp"), "2", "filtered");
    let nspid = status_field(inner, "NSpid");
    assert!(nspid.ends_with("\t1"), "PID 1 of its own namespace: {nspid:?}");
    let ns = |pid: &str, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("ns link");
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(ns(&inner.to_string(), kind), ns("self", kind), "{kind} namespace");
    }

    // Its root: the kernel, the console, the socket directory; nothing else.
    let mut found = Vec::new();
    files_under(Path::new(&format!("/proc/{inner}/root")), Path::new("/"), &mut found);
    found.sort();
    let expected: Vec<PathBuf> = ["image/vmlinux", "state/console", "state/run/ctl.sock", "state/run/v.sock"]
        .iter()
        .map(|p| d.join(p))
        .collect();
    assert_eq!(found, expected);
    let hostname = std::fs::read_to_string(format!("/proc/{inner}/root/proc/sys/kernel/hostname"));
    assert!(hostname.is_err(), "no /proc in the jail");

    let stopping = control.call(r#"{"op":"shutdown","force":true}"#);
    assert_eq!(stopping["state"], "stopping", "{stopping}");
    let socket = vm.socket();
    let (out, _) = vm.wait();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!socket.exists(), "the supervisor removes the control socket");
    assert!(!d.join("state/run/v.sock").exists(), "and the vsock socket");
    assert!(!Path::new(&format!("/proc/{inner}")).exists(), "the jailed VMM is gone");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(d.to_str().expect("utf-8")), "no mount left on the host: {mounts}");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn a_jailed_vmm_ends_as_its_supervisor_is_told() {
    // SIGTERM to the supervisor reaches the VMM, which shuts down: status 0.
    let vm = Vm::jailed(&dots(), &["--shutdown-timeout-ms", "100"]);
    sigterm_shuts_down(vm);

    // SIGKILL to the supervisor takes the jailed VMM with it.
    let vm = Vm::jailed(&dots(), &[]);
    let inner = jailed_pid(&vm);
    let pid = i32::try_from(vm.child.id()).expect("pid fits");
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let (out, _) = vm.wait();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGKILL));
    wait_until("the jailed VMM to go", || !Path::new(&format!("/proc/{inner}")).exists());

    // A guest that fails its VM: the supervisor exits with the VMM's status.
    let mut code = say("jumping\n", false);
    code.extend_from_slice(&[0xb8, 0x00, 0x00, 0x00, 0xd0, 0xff, 0xe0]); // mov eax, 0xd0000000; jmp eax
    let (out, _) = Vm::jailed(&code, &[]).wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("RIP 0xd0000000"), "{err}");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn a_jailed_guest_reaches_a_listed_host_port_over_vsock() {
    let code = vsock_guest();
    // The listener goes where the jail's socket directory will be.
    let dir = tempfile::tempdir().expect("temp dir");
    let run = dir.path().canonicalize().expect("canonical").join("run");
    std::fs::create_dir(&run).expect("run dir");
    let uds = run.join("v.sock");
    let listener = std::os::unix::net::UnixListener::bind(format!("{}_5000", uds.display())).expect("binds");
    let host = std::thread::spawn(move || {
        use std::io::Read;
        let (mut s, _) = listener.accept().expect("the guest connects");
        let mut hi = [0u8; 2];
        s.read_exact(&mut hi).expect("reads");
        s.write_all(b"yo").expect("answers");
        hi
    });
    let uds = uds.to_str().expect("utf-8");
    let (out, console) =
        Vm::jailed(&code, &["--vsock-cid", "3", "--vsock-uds", uds, "--vsock-host-ports", "5000"]).wait();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(&host.join().expect("host side"), b"hi");
    assert_eq!(console.as_bytes(), [2, b'y', b'o'], "RESPONSE, then the host's bytes");
}

/// Once `vm` prints, SIGTERM to its process makes it shut down cleanly
/// (status 0, the signal named in its log).
fn sigterm_shuts_down(vm: Vm) {
    wait_until("console output", || !vm.console().is_empty());
    let pid = i32::try_from(vm.child.id()).expect("pid fits");
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (out, _) = vm.wait();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("Signal 15 received"), "{err}");
}

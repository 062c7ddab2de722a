//! The `moat` command line, as a person uses it.

use std::process::Command;

const MOAT: &str = env!("CARGO_BIN_EXE_moat");

fn moat(args: &[&str]) -> std::process::Output {
    moat_with(args, &[])
}

/// `moat args…` with `env` added to its environment.
fn moat_with(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> std::process::Output {
    let mut command = moat_command(args);
    command.envs(env.iter().copied());
    command.output().expect("moat runs")
}

/// `moat args…`, finding the static agent of this tree unless
/// `MOAT_AGENT` names one.
fn moat_command(args: &[&str]) -> Command {
    let mut command = Command::new(MOAT);
    command.args(args);
    if std::env::var_os("MOAT_AGENT").is_none() {
        let agent = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/x86_64-unknown-linux-gnu/release/moat-agent");
        command.env("MOAT_AGENT", agent);
    }
    command
}

#[test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
fn run_streams_output_and_passes_the_exit_code_through() {
    let out = moat(&["run", "--", "sh", "-c", "echo out; echo err >&2; id -un; exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\nuser\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    let killed = moat(&["run", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(killed.status.code(), Some(137), "{killed:?}");
}

/// Piped input reaches the command, to its end; and a writer that never
/// closes the pipe does not keep `moat run` once the command is done.
#[test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
fn run_passes_piped_input_to_the_command() {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = moat_command(&["run", "--", "sh", "-c", "wc -c; echo end"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("moat runs");
    let mut input = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || input.write_all(&vec![b'x'; 3 << 20]));
    let out = child.wait_with_output().expect("moat ends");
    writer.join().expect("the writer").expect("all input taken");
    assert_eq!(String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>(), ["3145728", "end"]);

    let mut child = moat_command(&["run", "--", "true"]).stdin(Stdio::piped()).spawn().expect("moat runs");
    let _open = child.stdin.take();
    let status = child.wait().expect("moat ends while its input is still open");
    assert!(status.success(), "{status}");
}

#[test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
fn bad_options_get_clear_errors() {
    let out = moat(&["run", "--network", "wifi", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "clap's usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("allowed are none, filtered, open"), "{out:?}");
    let out = moat(&["run", "--network", "filtered", "--", "sh", "-c", "echo $HTTPS_PROXY"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "http://127.0.0.1:3128\n", "{out:?}");
    let out = moat(&["run", "--cpus", "99", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cpus must be between 1 and 16"), "{out:?}");
    let out = moat(&["run", "--backend", "docker", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "clap's usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("allowed are auto, vm, jail"), "{out:?}");
    let out = moat(&["run", "--image", "nope", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("moat image build --name nope"), "{out:?}");
    let out = moat(&["rm", "sbx-00000000"]);
    assert_eq!(out.status.code(), Some(1));
    let out = moat(&["tasks", "--rm", "task-nope"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("No task"), "{out:?}");
}

#[test]
fn doctor_says_which_backend_and_why() {
    let out = moat(&["doctor"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in
        ["/dev/kvm:", "hardware virtualization:", "user namespaces:", "runs as:", "cgroups:", "backend auto uses:"]
    {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

/// `moat setup --user` names what is wrong: a user that does not exist,
/// root (which needs no setup), or a caller that is not root.
#[test]
fn setup_refuses_what_it_cannot_prepare() {
    let out = moat(&["setup", "--user", "no-such-user-of-moat"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    if nix::unistd::geteuid().is_root() {
        assert!(said.contains("there is no user \"no-such-user-of-moat\""), "{said}");
        let out = moat(&["setup", "--user", "root"]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("root needs no setup"), "{out:?}");
    } else {
        assert!(said.contains("needs root") && said.contains("sudo"), "{said}");
    }
}

/// `moat setup` alone tunes the host's cgroups (root) or says it needs
/// root; `moat doctor` then reports what it left.
#[test]
fn setup_turns_on_cgroup_moves_without_a_grace_period() {
    let out = moat(&["setup"]);
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !nix::unistd::geteuid().is_root() {
        assert_eq!(out.status.code(), Some(1), "{said}{err}");
        assert!(err.contains("needs root") && err.contains("sudo"), "{err}");
        return;
    }
    assert!(out.status.success(), "{said}{err}");
    let doctor = String::from_utf8_lossy(&moat(&["doctor"]).stdout).into_owned();
    if said.contains("favordynmods stays off") {
        assert!(doctor.contains("favordynmods is off"), "setup said:\n{said}\ndoctor said:\n{doctor}");
    } else {
        assert!(said.contains("cgroups: ") && said.contains("favordynmods"), "{said}");
        // A host with no cgroup v2 mount shows the option only while
        // setup's own brief mount lasts.
        let shown = doctor.contains("cgroup moves:            wait for no grace period (favordynmods)");
        let unseen = said.contains("for a moment") && doctor.contains("cgroup moves:            unknown");
        assert!(shown || unseen, "setup said:\n{said}\ndoctor said:\n{doctor}");
    }
}

/// `moat doctor` says what `MOAT_CA_FILE` adds, or why it is wrong.
#[test]
fn doctor_reports_the_extra_cas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = made_ca(dir.path());
    let out = moat_with(&["doctor"], &[("MOAT_CA_FILE", ca.as_os_str())]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = format!("extra CAs (MOAT_CA_FILE): 1 certificate(s) from {}", ca.display());
    assert!(text.contains(&line), "missing {line:?} in:\n{text}");
    let key = dir.path().join("ca.key");
    let out = moat_with(&["doctor"], &[("MOAT_CA_FILE", key.as_os_str())]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("holds a private key") && text.contains("will not start"), "{text}");
}

/// With `MOAT_ALLOW_SSH_KEY=1`, `moat doctor` says whether clones over SSH
/// can work here: the host's ssh and the host keys they would trust.
#[test]
fn doctor_says_what_clones_over_ssh_need() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text =
        |env: &[(&str, &std::ffi::OsStr)]| String::from_utf8_lossy(&moat_with(&["doctor"], env).stdout).into_owned();
    let off = std::ffi::OsStr::new("0");
    assert!(!text(&[("MOAT_ALLOW_SSH_KEY", off)]).contains("git over SSH:"));
    let on = std::ffi::OsStr::new("1");
    let known = dir.path().join("known_hosts");
    std::fs::write(&known, "# pinned\n").expect("write");
    let said = text(&[("MOAT_ALLOW_SSH_KEY", on), ("MOAT_SSH_KNOWN_HOSTS", known.as_os_str())]);
    assert!(said.contains("git over SSH:") && said.contains("holds no host key"), "{said}");
    std::fs::write(&known, "git.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample\n").expect("write");
    let said = text(&[("MOAT_ALLOW_SSH_KEY", on), ("MOAT_SSH_KNOWN_HOSTS", known.as_os_str())]);
    if moat_core::programs::find_program("ssh").is_some() {
        assert!(said.contains("(1 entries)"), "{said}");
    } else {
        assert!(said.contains("no ssh client"), "{said}");
    }
}

/// A CA certificate made with openssl in `dir` (its key beside it).
fn made_ca(dir: &std::path::Path) -> std::path::PathBuf {
    let status = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=moat cli test CA"])
        .arg("-keyout")
        .arg(dir.join("ca.key"))
        .arg("-out")
        .arg(dir.join("ca.crt"))
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(status.success());
    dir.join("ca.crt")
}

/// `moat run` makes its sandbox trust `MOAT_CA_FILE`'s CA: in the system
/// bundle, alone for Node, and in the tools' variables.
#[test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
fn run_trusts_the_operators_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = made_ca(dir.path());
    let pem = std::fs::read_to_string(&ca).expect("the CA");
    let script = "cat /usr/local/share/ca-certificates/moat-extra.crt; echo ---; \
                  tail -n $(wc -l < /usr/local/share/ca-certificates/moat-extra.crt) $REQUESTS_CA_BUNDLE";
    let out = moat_with(&["run", "--backend", "jail", "--", "sh", "-c", script], &[("MOAT_CA_FILE", ca.as_os_str())]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{pem}---\n{pem}"));
}

#[test]
fn help_explains_the_commands() {
    let out = moat(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for command in ["run", "shell", "ls", "rm", "tasks", "doctor"] {
        assert!(text.contains(command), "{command} missing from --help:\n{text}");
    }
}

#[test]
fn image_build_refuses_a_bad_name_before_anything_else() {
    for name in ["", "../etc", "-rf", "a b"] {
        let out = moat(&["image", "build", &format!("--name={name}")]);
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("Image name {name:?} is not valid")), "{err}");
        assert!(err.contains("letters, digits, '-' or '_'"), "{err}");
    }
}

/// `moat image rm` refuses a bad name as the build does, and says how to
/// build an image that is not there; nothing else in the data directory
/// is touched.
#[test]
fn image_rm_names_what_is_missing_and_keeps_the_rest() {
    let data = tempfile::tempdir().expect("a data directory");
    let keep = data.path().join("images/keep");
    std::fs::create_dir_all(&keep).expect("mkdir");
    std::fs::write(keep.join("manifest.json"), "{}").expect("write");
    let env = [("MOAT_DATA_DIR", data.path().as_os_str())];
    let out = moat_with(&["image", "rm", "--name", "nope"], &env);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("There is no image \"nope\"") && err.contains("moat image build --name nope"), "{err}");
    let out = moat_with(&["image", "rm", "--name=../images/keep"], &env);
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not valid"), "{out:?}");
    assert!(keep.join("manifest.json").exists(), "another image was touched");
    let out = moat_with(&["image", "rm", "--name", "keep"], &env);
    assert!(out.status.success(), "{out:?}");
    assert!(!keep.exists() && data.path().join("images").is_dir(), "only the image is gone");
}

#[test]
fn each_binary_writes_its_manual_pages() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let out = moat(&["--write-manual", &dir.path().display().to_string()]);
    assert!(out.status.success(), "{out:?}");
    let page = std::fs::read_to_string(dir.path().join("moat-doctor.1")).expect("moat-doctor.1");
    assert!(page.contains(".TH moat-doctor 1") && page.contains("\\-\\-fix"), "{page}");
    assert!(dir.path().join("moat-image-build.1").is_file());
}

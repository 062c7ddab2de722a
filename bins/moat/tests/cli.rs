//! The `moat` command line, as a person uses it.

use std::process::Command;

const MOAT: &str = env!("CARGO_BIN_EXE_moat");

fn moat(args: &[&str]) -> std::process::Output {
    let mut command = Command::new(MOAT);
    command.args(args);
    if std::env::var_os("MOAT_AGENT").is_none() {
        let agent = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/x86_64-unknown-linux-gnu/release/moat-agent");
        command.env("MOAT_AGENT", agent);
    }
    command.output().expect("moat runs")
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
    assert!(String::from_utf8_lossy(&out.stderr).contains("cargo xtask image --name nope"), "{out:?}");
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
    for line in ["/dev/kvm:", "hardware virtualization:", "user namespaces:", "cgroups:", "backend auto uses:"] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn help_explains_the_commands() {
    let out = moat(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for command in ["run", "shell", "ls", "rm", "tasks", "doctor"] {
        assert!(text.contains(command), "{command} missing from --help:\n{text}");
    }
}

//! The operator's settings are checked before the server starts: a root
//! that would share the system, or a bad copy limit, stops it with exit 2
//! and a message naming the setting (issue 15, item 2).

use std::process::{Command, Stdio};

fn start(env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_moat-mcp"));
    command
        .stdin(Stdio::null())
        .env_remove("MOAT_ROOTS")
        .env_remove("MOAT_COPY_MAX_MIB")
        .env_remove("MOAT_PREVIEW_URL")
        .env_remove("MOAT_PREVIEW_SHARED_HOST");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("runs")
}

#[test]
fn roots_that_share_the_system_stop_the_server() {
    for root in ["/", "/etc", "/usr/lib", "/proc/self", "/var:/tmp", "relative"] {
        let out = start(&[("MOAT_ROOTS", root)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "MOAT_ROOTS={root}: {err}");
        assert!(err.contains("MOAT_ROOTS"), "MOAT_ROOTS={root}: {err}");
    }
}

#[test]
fn a_bad_copy_limit_stops_the_server() {
    for limit in ["0", "lots", "-1"] {
        let out = start(&[("MOAT_COPY_MAX_MIB", limit)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "MOAT_COPY_MAX_MIB={limit}: {err}");
        assert!(err.contains("MOAT_COPY_MAX_MIB"), "{err}");
    }
}

#[test]
fn logs_take_a_level_by_any_name_and_append_to_the_log_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("moat.log");
    let log_file = log.to_str().expect("utf-8");
    // A server that cannot start (no agent) says why on stderr and in the log.
    let failing =
        [("MOAT_LOG_LEVEL", "WARNING"), ("MOAT_LOG_FILE", log_file), ("MOAT_AGENT", "/nonexistent/moat-agent")];
    for run in 1..=2 {
        let out = start(&failing);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(2), "WARNING is a level: {err}");
        assert!(err.contains("moat-mcp: "), "{err}");
        let text = std::fs::read_to_string(&log).expect("the log file was made");
        assert_eq!(text.matches(" ERROR ").count(), run, "each run appends its error: {text}");
    }
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&log).expect("log").permissions());
    assert_eq!(mode & 0o777, 0o600, "the log file is the owner's only");
    let out = start(&[("MOAT_LOG_LEVEL", "loud")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MOAT_LOG_LEVEL=\"loud\" is invalid: error, warn"));
    let out = start(&[("MOAT_LOG_FILE", "/proc/nonexistent/moat.log")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MOAT_LOG_FILE=/proc/nonexistent/moat.log: cannot open"));
}

#[test]
fn a_bad_preview_url_stops_the_server() {
    for url in ["https://box.example", "box.example", "http://user@box.example"] {
        let out = start(&[("MOAT_PREVIEW_URL", url)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "MOAT_PREVIEW_URL={url}: {err}");
        assert!(err.contains("MOAT_PREVIEW_URL must be http://HOST"), "{err}");
    }
    let out = start(&[("MOAT_PREVIEW_SHARED_HOST", "yes")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("MOAT_PREVIEW_SHARED_HOST must be 1 or 0"), "{err}");
}

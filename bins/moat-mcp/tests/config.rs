//! The operator's settings are checked before the server starts: a root
//! that would share the system, or a bad copy limit, stops it with exit 2
//! and a message naming the setting (issue 15, item 2).

use std::process::{Command, Stdio};

fn start(env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_moat-mcp"));
    command.stdin(Stdio::null()).env_remove("MOAT_ROOTS").env_remove("MOAT_COPY_MAX_MIB");
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

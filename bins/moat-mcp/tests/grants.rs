//! What the operator grants, as `moat-mcp` reads and shows it: a bad
//! `MOAT_ALLOW_NETWORK` stops the server (exit 2) with the variable and
//! the values allowed; `--help` shows the grants in force. (The refusals
//! of tool calls beyond the grants are driven through the Python SDK in
//! `mcp_client.py` and unit-tested in `moat_core::grants`.)

use std::process::Command;

fn moat_mcp(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_moat-mcp"));
    command.args(args).env_remove("MOAT_ALLOW_NETWORK").env_remove("MOAT_NETWORK").env_remove("MOAT_ALLOW_HOSTS");
    command.env_remove("MOAT_ALLOW_SSH_KEY").env_remove("MOAT_TIMEOUT_SECONDS");
    for var in ["MOAT_MAX_CPUS", "MOAT_MAX_SANDBOX_MEMORY_MIB", "MOAT_MAX_DISK_MIB", "MOAT_MAX_TIMEOUT_SECONDS"] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied()).stdin(std::process::Stdio::null()).output().expect("moat-mcp runs")
}

#[test]
fn bad_grants_stop_the_server_with_what_is_allowed() {
    for (var, value, allowed) in [
        ("MOAT_ALLOW_NETWORK", "everything", "none, filtered or open"),
        ("MOAT_ALLOW_NETWORK", "Open", "none, filtered or open"),
        ("MOAT_MAX_CPUS", "0", "an integer from 1 to 16"),
        ("MOAT_MAX_SANDBOX_MEMORY_MIB", "4G", "an integer from 128 to 65536"),
        ("MOAT_MAX_TIMEOUT_SECONDS", "30", "an integer from 60 to 28800"),
    ] {
        let out = moat_mcp(&[], &[(var, value)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(stderr.contains(&format!("{var}=")) && stderr.contains(allowed), "{stderr}");
    }
    // So is a default lifetime longer than the longest one granted.
    let out = moat_mcp(&[], &[("MOAT_TIMEOUT_SECONDS", "7200"), ("MOAT_MAX_TIMEOUT_SECONDS", "3600")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("MOAT_TIMEOUT_SECONDS=\"7200\"") && stderr.contains("MOAT_MAX_TIMEOUT_SECONDS (3600)"),
        "{stderr}"
    );
    // A default network above the ceiling is a contradiction the operator must resolve.
    let out = moat_mcp(&["--http"], &[("MOAT_NETWORK", "open"), ("MOAT_ALLOW_NETWORK", "filtered")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("MOAT_NETWORK=\"open\"") && stderr.contains("MOAT_ALLOW_NETWORK"), "{stderr}");
}

#[test]
fn help_shows_the_grants_in_force() {
    let out = moat_mcp(&["--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(help.contains("Grants in force") && help.contains("network up to none (MOAT_ALLOW_NETWORK)"), "{help}");
    assert!(help.contains("SSH keys for clones not allowed (MOAT_ALLOW_SSH_KEY)"), "{help}");
    assert!(help.contains("3600 s of life (MOAT_MAX_TIMEOUT_SECONDS)"), "{help}");
    let out = moat_mcp(&["--help"], &[("MOAT_MAX_CPUS", "1"), ("MOAT_MAX_DISK_MIB", "4096")]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("up to 1 CPUs (MOAT_MAX_CPUS)") && help.contains("4096 MiB of disk"), "{help}");
    let out = moat_mcp(&["--help"], &[("MOAT_ALLOW_SSH_KEY", "1")]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("SSH keys for clones allowed (MOAT_ALLOW_SSH_KEY)"), "{help}");
    let out = moat_mcp(&["--help"], &[("MOAT_ALLOW_NETWORK", "filtered"), ("MOAT_ALLOW_HOSTS", "api.example.com")]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("network up to filtered") && help.contains("api.example.com"), "{help}");
    let out = moat_mcp(&["--help"], &[("MOAT_ALLOW_NETWORK", "wifi")]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("would not start") && help.contains("MOAT_ALLOW_NETWORK=\"wifi\""), "{help}");
}

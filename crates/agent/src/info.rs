//! The info operation: what agent this is and how its machine is doing.

use std::time::Instant;

use moat_proto::{AgentInfo, PROTOCOL_VERSION, Reply};

pub fn info(started: Instant, init: bool) -> Reply {
    let uts = nix::sys::utsname::uname().ok();
    let kernel = uts.as_ref().map_or_else(String::new, |u| {
        format!("{} {} {}", u.sysname().to_string_lossy(), u.release().to_string_lossy(), u.machine().to_string_lossy())
    });
    let hostname = uts.as_ref().map_or_else(String::new, |u| u.nodename().to_string_lossy().into_owned());
    Reply::Info {
        info: AgentInfo {
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol: PROTOCOL_VERSION,
            uptime_secs: first_number(&std::fs::read_to_string("/proc/uptime").unwrap_or_default()).unwrap_or(0.0),
            agent_uptime_secs: started.elapsed().as_secs_f64(),
            kernel,
            hostname,
            load: load(&std::fs::read_to_string("/proc/loadavg").unwrap_or_default()),
            init,
            processes: user_processes(),
        },
    }
}

/// Processes other than this one with a command line (kernel threads have
/// none), from the sandbox's own `/proc`.
fn user_processes() -> u32 {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    let count = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.bytes().all(|b| b.is_ascii_digit()) && *name != me)
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty()))
        .count();
    u32::try_from(count).unwrap_or(u32::MAX)
}

fn first_number(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

fn load(loadavg: &str) -> [f64; 3] {
    let mut fields = loadavg.split_whitespace().map(|f| f.parse().unwrap_or(0.0));
    [fields.next().unwrap_or(0.0), fields.next().unwrap_or(0.0), fields.next().unwrap_or(0.0)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        assert_eq!(first_number("1234.56 789.00\n"), Some(1234.56));
        assert_eq!(load("0.50 0.25 0.10 1/123 4567\n"), [0.5, 0.25, 0.1]);
        assert_eq!(load(""), [0.0; 3]);
    }
}

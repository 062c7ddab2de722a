//! What all sandboxes together may cost the host, set by the operator.
//!
//! - `MOAT_MAX_MEMORY_MIB`: the most the memory of live sandboxes may add
//!   up to (`memory_mib`, and for a jail `disk_mib` too: its disk is in
//!   memory); by default [`DEFAULT_SHARE_PERCENT`] % of the host's
//!   `MemTotal`. [`Moat::create`](crate::Moat::create) refuses a sandbox that
//!   would pass it, naming the figures; sandboxes being created and pooled
//!   ones count.
//! - `MOAT_ALLOW_UNLIMITED=1`: start jails even where their cgroups (the
//!   memory, pids and CPU limits) cannot be set up; refused otherwise.
//!
//! It also holds the bounds of what one tool call may ask for (a command's
//! time, a read's size); the sandbox's own bounds are on
//! [`SandboxSpec`](crate::SandboxSpec).

use crate::error::{ConfigError, CreateError};

/// The share of the host's memory the sandboxes' `memory_mib` may add up to
/// by default: the rest is the host's own (page cache, the server, moat-vmm).
pub const DEFAULT_SHARE_PERCENT: u64 = 75;

/// The longest a command (`run_command`) or a code cell (`run_code`) may
/// run, in seconds: an hour; longer work runs in the background.
pub const MAX_COMMAND_SECONDS: u64 = 3600;

/// The most bytes one `read_file` returns (10 MiB); larger files are read
/// in parts with `offset`.
pub const MAX_READ_BYTES: u64 = 10 << 20;

/// The deepest a directory listing goes; the agent refuses deeper
/// listings with its own bound of the same value (`moat-agent`'s
/// `files::list_dir`, which does not depend on core).
pub const MAX_LIST_DEPTH: u8 = 5;

/// The most entries a list or map argument of a tool (`env`,
/// `allow_hosts`) may hold: a bound on the request, checked before
/// anything reads it.
pub const MAX_ARGUMENT_ENTRIES: usize = 256;

/// Whether the operator allows sandboxes without cgroup limits
/// (`MOAT_ALLOW_UNLIMITED=1`).
pub fn allow_unlimited() -> bool {
    parse_allow_unlimited(std::env::var("MOAT_ALLOW_UNLIMITED").ok().as_deref())
}

fn parse_allow_unlimited(value: Option<&str>) -> bool {
    matches!(value.map(str::trim), Some("1" | "true" | "yes"))
}

/// The most the live sandboxes' `memory_mib` may add up to, from
/// `MOAT_MAX_MEMORY_MIB` or the host's memory (`sysinfo(2)`'s total, which
/// is `/proc/meminfo`'s `MemTotal`: the file costs every `moat run` 0.1 ms
/// of the kernel's summing of every figure it shows).
pub fn max_memory_mib_from_env() -> Result<u64, ConfigError> {
    let total = nix::sys::sysinfo::sysinfo().ok().map(|info| info.ram_total() >> 20);
    parse_max_memory(std::env::var("MOAT_MAX_MEMORY_MIB").ok().as_deref(), total)
}

/// [`max_memory_mib_from_env`] with its inputs given: the variable's value
/// and the host's `MemTotal` in MiB.
fn parse_max_memory(value: Option<&str>, mem_total_mib: Option<u64>) -> Result<u64, ConfigError> {
    match value {
        Some(text) => match text.trim().parse::<u64>() {
            Ok(mib) if mib >= 128 => Ok(mib),
            _ => Err(ConfigError::Invalid(format!(
                "MOAT_MAX_MEMORY_MIB={text:?} is not a size in MiB of at least 128 (the most the memory_mib of live \
                 sandboxes may add up to; unset, it is {DEFAULT_SHARE_PERCENT}% of the host's memory)"
            ))),
        },
        // A host whose memory cannot be read keeps no sum: the per-sandbox
        // limits still hold.
        None => Ok(mem_total_mib.map_or(u64::MAX, |total| total * DEFAULT_SHARE_PERCENT / 100)),
    }
}

/// The host memory a new sandbox asks for.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// In all, in MiB.
    pub mib: u64,
    /// For a jail, the `disk_mib` within `mib` (a jail's disk is a tmpfs).
    pub jail_disk: Option<u64>,
}

/// Refuses a sandbox that asks for `asked` when the live ones already hold
/// `live` MiB of at most `max`; the error names the figures and what to do.
pub fn check_memory(live: u64, live_count: usize, asked: Asked, max: u64) -> Result<(), CreateError> {
    let Asked { mib, jail_disk } = asked;
    if live.saturating_add(mib) <= max {
        return Ok(());
    }
    let what = match jail_disk {
        Some(disk) => {
            format!("memory_mib {} and disk_mib {disk} (a jail's disk is held in memory)", mib.saturating_sub(disk))
        }
        None => format!("memory_mib {mib}"),
    };
    Err(CreateError::HostMemory(format!(
        "{what} would bring the live sandboxes' memory to {} MiB, over the host's limit of {max} MiB ({live_count} \
         live sandbox{} hold {live} MiB); destroy a sandbox, ask for less, or raise MOAT_MAX_MEMORY_MIB (by \
         default {DEFAULT_SHARE_PERCENT}% of the host's memory)",
        live.saturating_add(mib),
        if live_count == 1 { "" } else { "es" },
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_sum_is_checked_with_the_figures_in_the_refusal() {
        let vm = |mib| Asked { mib, jail_disk: None };
        assert!(check_memory(0, 0, vm(1024), 1024).is_ok());
        assert!(check_memory(3072, 3, vm(1024), 4096).is_ok());
        let refused = check_memory(3072, 3, vm(2048), 4096).expect_err("5120 MiB is over 4096").to_string();
        for words in [
            "memory_mib 2048",
            "5120 MiB",
            "limit of 4096 MiB",
            "3 live sandboxes hold 3072 MiB",
            "MOAT_MAX_MEMORY_MIB",
        ] {
            assert!(refused.contains(words), "{words:?} missing from {refused}");
        }
        assert!(check_memory(u64::MAX, 1, vm(128), u64::MAX).is_ok(), "no overflow");
        let jail = Asked { mib: 128 + 262_144, jail_disk: Some(262_144) };
        let refused = check_memory(0, 0, jail, 18_000).expect_err("a jail's disk is memory").to_string();
        assert!(refused.contains("memory_mib 128 and disk_mib 262144") && refused.contains("262272 MiB"), "{refused}");
    }

    #[test]
    fn the_memory_limit_defaults_to_a_share_of_the_host_and_rejects_nonsense() {
        assert_eq!(parse_max_memory(None, Some(24_000)).expect("default"), 18_000);
        assert_eq!(parse_max_memory(None, None).expect("unknown host"), u64::MAX);
        assert_eq!(parse_max_memory(Some(" 8192 "), Some(24_000)).expect("set"), 8192);
        for bad in ["", "lots", "-1", "64", "8G"] {
            let e = parse_max_memory(Some(bad), Some(24_000)).expect_err(bad).to_string();
            assert!(e.contains("MOAT_MAX_MEMORY_MIB"), "{e}");
        }
    }

    /// `MemTotal` of a `/proc/meminfo` text, in MiB.
    fn mem_total_mib(meminfo: &str) -> Option<u64> {
        let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: u64 = line.trim_start_matches("MemTotal:").trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib / 1024)
    }

    #[test]
    fn the_host_memory_is_meminfos_total() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
        let total = nix::sys::sysinfo::sysinfo().expect("sysinfo").ram_total() >> 20;
        assert_eq!(Some(total), mem_total_mib(&meminfo));
        assert_eq!(mem_total_mib("MemTotal:       24683520 kB\n"), Some(24_105));
    }

    #[test]
    fn unlimited_sandboxes_need_an_explicit_yes() {
        assert!(parse_allow_unlimited(Some("1")));
        assert!(parse_allow_unlimited(Some("true")));
        for no in [None, Some(""), Some("0"), Some("no")] {
            assert!(!parse_allow_unlimited(no), "{no:?}");
        }
    }
}

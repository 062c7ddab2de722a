//! What runs in level 1 and what comes back from it.

use std::fmt;
use std::time::Duration;

/// The milestones of a level-1 run, in order. An error names the last one
/// reached; [`Output::stages`] records when each was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// QEMU is running (level 1 has not reported yet).
    Launched,
    /// Level 1's `/init` runs and its result channel works.
    Booted,
    /// `kvm`/`kvm-amd` are loaded and QEMU in level 1 created a KVM VM.
    Kvm,
    /// The payload was started.
    PayloadStarted,
    /// The payload exited; its status is known.
    PayloadFinished,
}

impl Stage {
    /// The name level 1's `/init` reports this stage by on the control port.
    pub(crate) fn wire_name(self) -> &'static str {
        match self {
            Self::Launched => "launched",
            Self::Booted => "booted",
            Self::Kvm => "kvm",
            Self::PayloadStarted => "started",
            Self::PayloadFinished => "finished",
        }
    }

    pub(crate) fn from_wire(name: &str) -> Option<Self> {
        [Self::Launched, Self::Booted, Self::Kvm, Self::PayloadStarted, Self::PayloadFinished]
            .into_iter()
            .find(|s| s.wire_name() == name)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Launched => "QEMU launched",
            Self::Booted => "level 1 booted",
            Self::Kvm => "KVM working in level 1",
            Self::PayloadStarted => "payload started",
            Self::PayloadFinished => "payload finished",
        })
    }
}

/// How long each stage may take before the run is abandoned. These guard
/// against hangs; they are not performance bounds (TCG is slow, and the
/// machine may be busy), so the defaults are generous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// QEMU started → level 1's `/init` reports on the control port.
    pub boot: Duration,
    /// Booted → the KVM modules loaded and a KVM VM created.
    pub kvm: Duration,
    /// KVM working → the payload started (mounting the bundle, the data directory).
    pub start: Duration,
    /// Payload started → payload exited.
    pub finish: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            boot: Duration::from_secs(300),
            kvm: Duration::from_secs(300),
            start: Duration::from_secs(120),
            finish: Duration::from_secs(1800),
        }
    }
}

impl Timeouts {
    /// The limit on reaching the stage after `reached`.
    pub(crate) fn after(&self, reached: Stage) -> Duration {
        match reached {
            Stage::Launched => self.boot,
            Stage::Booted => self.kvm,
            Stage::Kvm => self.start,
            Stage::PayloadStarted | Stage::PayloadFinished => self.finish,
        }
    }
}

/// The level-1 machine's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    pub memory_mib: u32,
    /// Level-1 vCPUs (default 1, `MOAT_NESTED_CPUS` to change it). Each is
    /// a host thread under TCG. One is both faster and steadier: with two,
    /// level-2 boots took 18 s instead of 11 (cross-vCPU kicks and TLB
    /// flushes are slow under MTTCG), and level 1 now and then hung or
    /// crashed in emulated SVM (see docs/testing.md).
    pub cpus: u8,
}

impl Default for Machine {
    fn default() -> Self {
        // Room for a 512 MiB level-2 guest and QEMU or moat-vmm beside it.
        // `MOAT_NESTED_CPUS` overrides the vCPU count (1 to 8).
        let cpus = std::env::var("MOAT_NESTED_CPUS").ok().and_then(|c| c.parse().ok()).filter(|c| (1..=8).contains(c));
        Self { memory_mib: 2048, cpus: cpus.unwrap_or(1) }
    }
}

/// A command to run in level 1, as root, in `/root`, with stdin from
/// `/dev/null`. The moat binaries and QEMU are on `PATH`; the image is at
/// level 1's default data directory. `$MOAT_NESTED_MARKS` names a device
/// the payload can write lines to, to have the host time them
/// ([`Output::marks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// argv; looked up on `PATH` like a shell would.
    pub command: Vec<String>,
    /// Added to the environment (names must be shell identifiers).
    pub env: Vec<(String, String)>,
    pub timeouts: Timeouts,
    pub machine: Machine,
    /// Copy the payload's stdout and stderr to this process's as they
    /// arrive (what `cargo xtask nested run` does); [`Output`] has them all
    /// the same.
    pub echo: bool,
}

impl Payload {
    pub fn new<I, S>(command: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            command: command.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            timeouts: Timeouts::default(),
            machine: Machine::default(),
            echo: false,
        }
    }

    /// A shell script, run by level 1's busybox `sh -c`.
    pub fn script(script: &str) -> Self {
        Self::new(["sh", "-c", script])
    }

    #[must_use]
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    #[must_use]
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    #[must_use]
    pub fn echo(mut self, echo: bool) -> Self {
        self.echo = echo;
        self
    }
}

/// What a finished payload produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The payload's exit status as its shell reports it: the exit code, or
    /// 128 + the signal number when a signal ended it.
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Each stage reached and when, measured on the host from QEMU's start.
    pub stages: Vec<(Stage, Duration)>,
    /// The lines the payload wrote to `$MOAT_NESTED_MARKS`, each with when
    /// the host received it (from QEMU's start, within a few milliseconds).
    pub marks: Vec<(Duration, String)>,
    /// Level 1's serial console (kernel messages and `/init`'s log).
    pub console: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == 0
    }

    /// When `stage` was reached, from QEMU's start.
    pub fn reached(&self, stage: Stage) -> Option<Duration> {
        self.stages.iter().find(|(s, _)| *s == stage).map(|(_, at)| *at)
    }

    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_ordered_and_round_trip_their_wire_names() {
        let all = [Stage::Launched, Stage::Booted, Stage::Kvm, Stage::PayloadStarted, Stage::PayloadFinished];
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        for stage in all {
            assert_eq!(Stage::from_wire(stage.wire_name()), Some(stage));
        }
        assert_eq!(Stage::from_wire("nonsense"), None);
    }
}

//! Why a nested run failed.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::Stage;

/// The end of both of level 1's outputs, for a failure report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tails {
    /// Level 1's serial console: kernel messages and `/init`'s log.
    pub console: String,
    /// The result channel: control messages, then the ends of the payload's
    /// stdout and stderr.
    pub channel: String,
    /// Level 1's vCPU registers as QEMU's monitor showed them, twice a
    /// second apart, when level 1 hung (empty otherwise): whether it was
    /// halted, looping, or stuck in a level-2 guest.
    pub cpu: String,
    /// The lines the payload wrote to `$MOAT_NESTED_MARKS` before level 1
    /// broke: what it had done, for a payload that resumes
    /// ([`crate::run_steps`]).
    pub marks: Vec<String>,
    /// All the payload wrote to stdout before level 1 broke (the channel
    /// above holds only its end).
    pub stdout: Vec<u8>,
}

impl fmt::Display for Tails {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "--- level-1 serial console (tail) ---")?;
        writeln!(f, "{}", self.console.trim_end())?;
        writeln!(f, "--- result channel (tail) ---")?;
        write!(f, "{}", self.channel.trim_end())?;
        if !self.cpu.is_empty() {
            write!(f, "\n--- level 1's vCPU (QEMU monitor, `info registers` 1 s apart) ---\n{}", self.cpu.trim_end())?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Cannot find {what}; {hint}")]
    Missing { what: String, hint: String },
    #[error("Cannot read {}, an input of the level-1 bundle", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Image(#[from] moat_core::image::ImageError),
    #[error("Cannot build the level-1 bundle ({what}); remove {} and retry", dir.display())]
    Bundle {
        what: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed building the level-1 bundle: {message}")]
    Tool { tool: String, message: String },
    #[error("Invalid payload: {0}")]
    Payload(String),
    #[error("Cannot start qemu-system-x86_64; install it with `apt-get install qemu-system-x86`")]
    Launch(#[source] std::io::Error),
    #[error("I/O error watching level 1 ({what})")]
    Watch {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("No '{}' from level 1 within {waited:?} (stage reached: {stage}); raise the timeout if the host is busy, or read the consoles\n{tails}", next_stage(*stage))]
    Timeout { stage: Stage, waited: Duration, tails: Box<Tails> },
    #[error("Level 1 failed after stage '{stage}': {reason}\n{tails}")]
    Failed { stage: Stage, reason: String, tails: Box<Tails> },
    /// Level 1 itself broke: its kernel crashed (an oops or a panic on its
    /// console), it stopped answering, or QEMU ended before the payload
    /// finished. The test host, not the payload: [`crate::run_in`] tries
    /// again (up to [`crate::ATTEMPTS`] level 1s).
    #[error(
        "Level 1 broke after stage '{stage}': {reason} (the nested test host itself: emulated SVM under TCG \
         is not flawless; rerun, and report it if it recurs)\n{tails}"
    )]
    Crashed { stage: Stage, reason: String, tails: Box<Tails> },
}

impl Error {
    /// The last stage level 1 reached, when it got as far as starting.
    pub fn stage(&self) -> Option<Stage> {
        match self {
            Self::Timeout { stage, .. } | Self::Failed { stage, .. } | Self::Crashed { stage, .. } => Some(*stage),
            _ => None,
        }
    }

    /// Both consoles' tails, when level 1 ran.
    pub fn tails(&self) -> Option<&Tails> {
        match self {
            Self::Timeout { tails, .. } | Self::Failed { tails, .. } | Self::Crashed { tails, .. } => Some(tails),
            _ => None,
        }
    }
}

fn next_stage(stage: Stage) -> Stage {
    match stage {
        Stage::Launched => Stage::Booted,
        Stage::Booted => Stage::Kvm,
        Stage::Kvm => Stage::PayloadStarted,
        Stage::PayloadStarted | Stage::PayloadFinished => Stage::PayloadFinished,
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

//! Time as core counts it: wall-clock seconds for what it records, and how
//! long it waits for an agent past a command's own timeout.

use std::time::{Duration, SystemTime};

/// How long past a command's own timeout the host waits for the agent to
/// report it ended. The agent kills a command at its timeout and answers
/// at once; silence this long after means the agent or the guest's kernel
/// is stuck, and the caller gets
/// [`SandboxError::Unresponsive`](crate::SandboxError::Unresponsive) instead of
/// waiting forever.
pub const ANSWER_GRACE: Duration = Duration::from_secs(30);

/// Seconds since the Unix epoch, now.
pub fn now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

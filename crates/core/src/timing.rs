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

/// `work`'s outcome, or [`SandboxError::Unresponsive`](crate::SandboxError::Unresponsive)
/// for sandbox `id` once `guard` has passed without one: every wait on an
/// agent that could stay silent is bounded by this.
pub async fn within<R>(
    id: &str,
    guard: Duration,
    work: impl std::future::Future<Output = R>,
) -> Result<R, crate::SandboxError> {
    tokio::time::timeout(guard, work)
        .await
        .map_err(|_| crate::SandboxError::Unresponsive { id: id.into(), waited_s: guard.as_secs() })
}

/// Seconds since the Unix epoch, now.
pub fn now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

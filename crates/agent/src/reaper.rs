//! Child processes and their exits.
//!
//! The agent is a subreaper (or PID 1), so every orphaned descendant becomes
//! its child and must be reaped, or zombies pile up. One loop therefore calls
//! `waitpid(-1)` for every child, and hands the status of the processes the
//! agent spawned itself to whoever waits for them. Spawning and reaping take
//! the same lock: a child cannot be reaped between `fork` and its
//! registration, and std's own `waitpid` after a failed `exec` cannot race
//! with the loop.

use std::collections::HashMap;
use std::process::Child;
use std::sync::{Arc, Mutex, MutexGuard};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

/// Owner of every child of the agent.
#[derive(Debug, Default)]
pub struct Reaper {
    waiting: Mutex<HashMap<i32, oneshot::Sender<Exit>>>,
    /// Told whenever a reap leaves no spawned child running.
    emptied: tokio::sync::Notify,
}

impl Reaper {
    /// Becomes a subreaper and starts the reaping loop on the current tokio runtime.
    pub fn start() -> std::io::Result<Arc<Self>> {
        // Orphaned grandchildren are re-parented to us instead of to the
        // host's init, so a timeout can't leave zombies behind.
        nix::sys::prctl::set_child_subreaper(true)?;
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Arc::new(Self::default());
        let weak = Arc::downgrade(&reaper);
        tokio::spawn(async move {
            while sigchld.recv().await.is_some() {
                let Some(reaper) = weak.upgrade() else { break };
                reaper.reap();
            }
        });
        Ok(reaper)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<i32, oneshot::Sender<Exit>>> {
        // A panic while holding this lock leaves the map consistent (each
        // operation is one insert or remove), so poisoning is ignored.
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A child that `start` makes (see [`crate::spawn`]) and returns the
    /// pid of, or why it did not start, with a receiver of its exit:
    /// registered under the lock the reaping takes, so that its exit cannot
    /// be reaped before it is waited for.
    pub fn spawn<E>(&self, start: impl FnOnce() -> Result<i32, E>) -> Result<(i32, oneshot::Receiver<Exit>), E> {
        let mut waiting = self.lock();
        let pid = start()?;
        let (tx, rx) = oneshot::channel();
        waiting.insert(pid, tx);
        Ok((pid, rx))
    }

    /// Reaps every child that has exited.
    pub fn reap(&self) {
        let mut waiting = self.lock();
        loop {
            match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => deliver(&mut waiting, pid, Exit::Code(code)),
                Ok(WaitStatus::Signaled(pid, signal, _)) => deliver(&mut waiting, pid, Exit::Signal(signal as i32)),
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => {
                    tracing::warn!("waitpid failed: {e}");
                    break;
                }
            }
        }
        self.tell_if_empty(&waiting);
    }

    fn tell_if_empty(&self, waiting: &HashMap<i32, oneshot::Sender<Exit>>) {
        if waiting.is_empty() {
            self.emptied.notify_waiters();
        }
    }

    /// Waits until no child the agent spawned is running, or `deadline`;
    /// true when none is.
    pub async fn all_ended(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            // Registered before the check: a reap in between still wakes it.
            let emptied = self.emptied.notified();
            if self.lock().is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline, emptied).await.is_err() {
                return self.lock().is_empty();
            }
        }
    }

    /// Process ids of the children still running that the agent spawned.
    pub fn running(&self) -> Vec<i32> {
        self.lock().keys().copied().collect()
    }
}

fn deliver(waiting: &mut HashMap<i32, oneshot::Sender<Exit>>, pid: Pid, exit: Exit) {
    match waiting.remove(&pid.as_raw()) {
        Some(tx) => {
            let _ = tx.send(exit);
        }
        None => tracing::debug!(pid = pid.as_raw(), ?exit, "reaped an orphaned process"),
    }
}

/// The pid of a child as the signed type the kernel's calls take.
pub fn pid_of(child: &Child) -> i32 {
    // Linux pids are at most 2^22 (PID_MAX_LIMIT), so they fit in an i32.
    i32::try_from(child.id()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    // No real children: a reaping loop (`waitpid(-1)`) in the test process
    // would take other tests' children. A delivery is what a reap does.
    fn deliver_now(reaper: &Reaper, pid: i32) {
        let mut waiting = reaper.lock();
        deliver(&mut waiting, Pid::from_raw(pid), Exit::Code(0));
        reaper.tell_if_empty(&waiting);
    }

    #[tokio::test]
    async fn the_end_of_the_last_child_is_awaited_not_polled() {
        let reaper = Arc::new(Reaper::default());
        let soon = || tokio::time::Instant::now() + std::time::Duration::from_millis(50);
        let later = || tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        assert!(reaper.all_ended(soon()).await, "no child: nothing to wait for");
        let (one, _r1) = oneshot::channel();
        let (two, _r2) = oneshot::channel();
        reaper.lock().extend([(-2, one), (-3, two)]);
        assert!(!reaper.all_ended(soon()).await, "two children run at the deadline");
        let waiter = tokio::spawn({
            let reaper = reaper.clone();
            async move { reaper.all_ended(later()).await }
        });
        deliver_now(&reaper, -2);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one child still runs");
        deliver_now(&reaper, -3);
        assert!(waiter.await.expect("joins"), "the last end wakes the waiter");
    }
}

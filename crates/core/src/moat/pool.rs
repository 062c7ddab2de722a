//! The pool: sandboxes of `pool_spec` started ahead of need.

use std::sync::Arc;
use std::time::Duration;

use super::{Admit, Inner, Moat, new_id};
use crate::backend::machine::Machine;
use crate::image::{Image, ImageBuild};

impl Moat {
    /// How many started sandboxes wait in the pool.
    pub fn pooled(&self) -> usize {
        self.inner.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }
}

/// Keeps `pool_size` sandboxes of `pool_spec` started.
pub(super) async fn fill_pool(inner: std::sync::Weak<Inner>, refill: Arc<tokio::sync::Notify>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let pooled = strong.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        if pooled >= strong.config.pool_size {
            // Not holding `strong` while waiting: a dropped Moat must drop.
            drop(strong);
            refill.notified().await;
            continue;
        }
        match strong.refill_one().await {
            Refill::Added => {}
            Refill::Full(full) => {
                // It waits for a take, or looks again after a while (a
                // destroy makes room without a word).
                tracing::debug!("the sandbox pool waits for room: {full}");
                drop(strong);
                let _ = tokio::time::timeout(Duration::from_secs(5), refill.notified()).await;
            }
            Refill::Closing => return,
            Refill::Failed(e) => {
                tracing::warn!("cannot fill the sandbox pool: {e}");
                drop(strong);
                // A back-off after a failed start, not a wait for an event.
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// What one step of [`fill_pool`] came to.
enum Refill {
    Added,
    /// No room under the limits.
    Full(crate::CreateError),
    /// Its owner closed meanwhile: the one started was destroyed.
    Closing,
    Failed(crate::CreateError),
}

impl Inner {
    /// Starts one sandbox of `pool_spec` into the pool. The pool counts
    /// against MOAT_MAX_SANDBOXES and the memory limit like live
    /// sandboxes, the one it starts too: its place is held while it starts.
    async fn refill_one(&self) -> Refill {
        let spec = self.config.pool_spec.clone();
        let reservation = match self.reserve(&spec, Admit::Refill) {
            Ok(admitted) => admitted.reservation,
            Err(full) => return Refill::Full(full),
        };
        let started = match Image::open_ref(&self.config.data_dir, &spec.image) {
            Ok(image) => {
                let id = new_id();
                self.start_machine(&id, &id, &spec, &image).await.map(|machine| (id, machine, image.build()))
            }
            Err(e) => Err(e.into()),
        };
        match started {
            // Started while its owner closed: destroyed, not kept.
            Ok(entry) if self.closing.load(std::sync::atomic::Ordering::SeqCst) => {
                drop(reservation);
                let _ = tokio::task::spawn_blocking(move || drop(entry)).await;
                Refill::Closing
            }
            Ok(entry) => {
                // Counted as pooled before it stops counting as admitted.
                self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(entry);
                drop(reservation);
                Refill::Added
            }
            Err(e) => Refill::Failed(e),
        }
    }

    /// A started sandbox from the pool, if one is ready; the pool refills.
    pub(super) fn take_pooled(&self) -> Option<(String, Machine, ImageBuild)> {
        let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut dead = Vec::new();
        let taken = loop {
            match pool.pop() {
                // One that ended while it waited is not handed out.
                Some((id, mut machine, build)) => match machine.ended() {
                    Some(reason) => {
                        tracing::warn!(%id, %reason, "a pooled sandbox ended; dropped");
                        dead.push(machine);
                    }
                    None => break Some((id, machine, build)),
                },
                None => break None,
            }
        };
        drop(pool);
        self.refill.notify_one();
        if !dead.is_empty() {
            tokio::task::spawn_blocking(move || drop(dead));
        }
        taken
    }
}

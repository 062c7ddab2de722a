//! The pool: sandboxes of `pool_spec` started ahead of need.

use std::sync::Arc;
use std::time::Duration;

use super::{Inner, Moat, new_id};
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
        if let Err(full) = strong.pool_has_room() {
            // The pool counts against MOAT_MAX_SANDBOXES and the memory
            // limit like live sandboxes: it waits for a take, or looks
            // again after a while (a destroy makes room without a word).
            tracing::debug!("the sandbox pool waits for room: {full}");
            drop(strong);
            let _ = tokio::time::timeout(Duration::from_secs(5), refill.notified()).await;
            continue;
        }
        let spec = strong.config.pool_spec.clone();
        let started = match Image::open_ref(&strong.config.data_dir, &spec.image) {
            Ok(image) => {
                let id = new_id();
                strong.start_machine(&id, &id, &spec, &image).await.map(|machine| (id, machine, image.build()))
            }
            Err(e) => Err(e.into()),
        };
        match started {
            // Started while its owner closed: destroyed, not kept.
            Ok(entry) if strong.closing.load(std::sync::atomic::Ordering::SeqCst) => {
                let _ = tokio::task::spawn_blocking(move || drop(entry)).await;
                return;
            }
            Ok(entry) => strong.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(entry),
            Err(e) => {
                tracing::warn!("cannot fill the sandbox pool: {e}");
                drop(strong);
                // A back-off after a failed start, not a wait for an event.
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

impl Inner {
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

//! Who owns which sandboxes: a stdio connection, or one HTTP session.
//!
//! A [`Scope`] remembers the sandboxes and tasks made through it and its
//! current sandbox. Tools only see and touch what their scope owns, so two
//! HTTP sessions of one server cannot reach each other's sandboxes. When a
//! scope ends (its HTTP session closes or expires), its sandboxes are
//! destroyed.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

use moat_core::Moat;

#[derive(Debug, Default)]
struct Owned {
    sandboxes: BTreeSet<String>,
    tasks: BTreeSet<String>,
    current: Option<String>,
}

/// The sandboxes and tasks of one client connection or session.
#[derive(Debug)]
pub struct Scope {
    moat: Moat,
    owned: Mutex<Owned>,
    /// Whether task records left by earlier servers are visible (stdio: the
    /// user's own machine); HTTP sessions see only their own tasks.
    all_records: bool,
}

impl Scope {
    pub fn new(moat: Moat, all_records: bool) -> Self {
        Self { moat, owned: Mutex::default(), all_records }
    }

    fn lock(&self) -> MutexGuard<'_, Owned> {
        self.owned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn adopt(&self, sandbox_id: &str, make_current: bool) {
        let mut owned = self.lock();
        owned.sandboxes.insert(sandbox_id.to_owned());
        if make_current {
            owned.current = Some(sandbox_id.to_owned());
        }
    }

    pub fn forget(&self, sandbox_id: &str) {
        let mut owned = self.lock();
        owned.sandboxes.remove(sandbox_id);
        if owned.current.as_deref() == Some(sandbox_id) {
            owned.current = None;
        }
    }

    pub fn owns(&self, sandbox_id: &str) -> bool {
        self.lock().sandboxes.contains(sandbox_id)
    }

    pub fn current(&self) -> Option<String> {
        self.lock().current.clone()
    }

    pub fn sandboxes(&self) -> Vec<String> {
        self.lock().sandboxes.iter().cloned().collect()
    }

    pub fn adopt_task(&self, task_id: &str) {
        self.lock().tasks.insert(task_id.to_owned());
    }

    pub fn forget_task(&self, task_id: &str) {
        self.lock().tasks.remove(task_id);
    }

    pub fn sees_task(&self, task_id: &str) -> bool {
        self.all_records || self.lock().tasks.contains(task_id)
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let ids: Vec<String> = std::mem::take(&mut self.lock().sandboxes).into_iter().collect();
        if ids.is_empty() {
            return;
        }
        let moat = self.moat.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    for id in ids {
                        let _ = moat.destroy(&id).await;
                    }
                });
            }
            // No runtime any more: the server is exiting, and its Moat
            // destroys every sandbox when it drops.
            Err(_) => tracing::debug!(count = ids.len(), "scope ended outside the runtime"),
        }
    }
}

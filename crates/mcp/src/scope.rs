//! Who owns which sandboxes: a stdio connection, or one HTTP session.
//!
//! A [`Scope`] remembers the sandboxes and tasks made through it and its
//! current sandbox. Tools only see and touch what their scope owns, so two
//! HTTP sessions of one server cannot reach each other's sandboxes. When a
//! scope ends (its HTTP session closes or expires), its sandboxes are
//! destroyed.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use moat_core::Moat;

#[derive(Debug, Default)]
struct Owned {
    sandboxes: BTreeSet<String>,
    tasks: BTreeSet<String>,
    current: Option<String>,
    /// Places held by creates under way ([`SandboxPlace`]).
    making: usize,
}

impl Owned {
    fn take(&mut self, serial: u64, sandbox_id: &str, make_current: bool) {
        claim(sandbox_id, serial);
        self.sandboxes.insert(sandbox_id.to_owned());
        if make_current {
            self.current = Some(sandbox_id.to_owned());
        }
    }
}

/// Which scope owns each sandbox and task id, by the scope's serial: the
/// latest to adopt an id. Ids are short and random, so one may come back:
/// a scope still holding the id of a sandbox long gone (expired, failed,
/// forgotten) must not own another session's new sandbox of the same id.
/// A scope's own list says what it made; this says whether that is still
/// it.
static OWNERS: std::sync::LazyLock<Mutex<std::collections::HashMap<String, u64>>> =
    std::sync::LazyLock::new(Mutex::default);

/// Each scope's serial, for [`OWNERS`].
static SERIALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn owners() -> MutexGuard<'static, std::collections::HashMap<String, u64>> {
    OWNERS.lock().unwrap_or_else(PoisonError::into_inner)
}

fn claim(id: &str, serial: u64) {
    owners().insert(id.to_owned(), serial);
}

fn is_owner(id: &str, serial: u64) -> bool {
    owners().get(id) == Some(&serial)
}

/// Lets go of `id` if `serial` still owns it.
fn release(id: &str, serial: u64) {
    let mut owners = owners();
    if owners.get(id) == Some(&serial) {
        owners.remove(id);
    }
}

/// The most tool calls one connection or session has running at once.
/// Each holds the server's memory (a command's output up to 16 MiB until
/// it ends) and often a thread: a client that sends calls without waiting
/// for answers is told to wait, not served until the host runs out.
pub const MAX_CALLS_IN_FLIGHT: usize = 32;

/// The most tool calls the whole server runs at once, all sessions
/// together: HTTP sessions are many, and each may run
/// [`MAX_CALLS_IN_FLIGHT`].
pub const MAX_SERVER_CALLS: usize = 256;

/// The most HTTP sessions one server keeps at once; one more is refused
/// (503) until a session ends or expires.
pub const MAX_SESSIONS: usize = 256;

/// The server's own gate, shared by every session ([`MAX_SERVER_CALLS`]).
pub static SERVER_CALLS: std::sync::LazyLock<CallGate> =
    std::sync::LazyLock::new(|| CallGate::new(MAX_SERVER_CALLS, "this server", "all sessions together"));

/// HTTP sessions alive, and requests without one being served, against
/// [`MAX_SESSIONS`].
pub static SESSIONS: SessionCount = SessionCount::new(MAX_SESSIONS);

/// Sessions (scopes) counted against a most, with the requests that may
/// start one counted from their check on: a request checked against the
/// most holds a place until the session it starts counts itself, so that
/// requests checked at once (their bodies held back, then sent together)
/// never start more sessions than the most between them.
#[derive(Debug)]
pub struct SessionCount {
    live: AtomicUsize,
    starting: AtomicUsize,
    most: usize,
}

/// A place held by a request that may start a session; given back when
/// dropped, once the request's session (if any) counts itself.
#[derive(Debug)]
pub struct StartingSession<'a>(&'a SessionCount);

impl Drop for StartingSession<'_> {
    fn drop(&mut self) {
        self.0.starting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SessionCount {
    pub const fn new(most: usize) -> Self {
        Self { live: AtomicUsize::new(0), starting: AtomicUsize::new(0), most }
    }

    /// How many scopes are alive.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Holds a place for a request that may start a session, or `None`
    /// when the live sessions and those being started fill the most. A
    /// session counts itself while its request still holds its place
    /// (counted twice for a moment, never not at all).
    pub fn start(&self) -> Option<StartingSession<'_>> {
        let mut starting = self.starting.load(Ordering::SeqCst);
        loop {
            if self.live().saturating_add(starting) >= self.most {
                return None;
            }
            match self.starting.compare_exchange_weak(starting, starting + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(StartingSession(self)),
                Err(now) => starting = now,
            }
        }
    }
}

/// The sandboxes and tasks of one client connection or session.
#[derive(Debug)]
pub struct Scope {
    moat: Moat,
    owned: Mutex<Owned>,
    /// Whether task records left by earlier servers are visible (stdio: the
    /// user's own machine); HTTP sessions see only their own tasks.
    all_records: bool,
    calls: CallGate,
    /// Counted in [`SESSIONS`] ([`Scope::counted`]).
    counted: bool,
    /// The most live sandboxes this scope may own at once
    /// (`MOAT_MAX_SANDBOXES_PER_SESSION` over HTTP; a stdio connection,
    /// the server's only client, may own them all).
    max_sandboxes: usize,
    /// This scope in [`OWNERS`].
    serial: u64,
}

/// A place for one more sandbox of a scope, held from before a create
/// starts until its sandbox is adopted ([`SandboxPlace::adopt`]) or the
/// create fails (the place is given back on drop): creates running at
/// once cannot together pass the scope's share.
#[derive(Debug)]
pub struct SandboxPlace<'a> {
    scope: &'a Scope,
    held: bool,
}

impl SandboxPlace<'_> {
    /// The created sandbox takes the place; `make_current` as
    /// [`Scope::adopt`].
    pub fn adopt(mut self, sandbox_id: &str, make_current: bool) {
        // One lock for both: a reservation in between would see the place
        // neither held nor taken.
        let mut owned = self.scope.lock();
        owned.making = owned.making.saturating_sub(1);
        owned.take(self.scope.serial, sandbox_id, make_current);
        self.held = false;
    }
}

impl Drop for SandboxPlace<'_> {
    fn drop(&mut self) {
        if self.held {
            let mut owned = self.scope.lock();
            owned.making = owned.making.saturating_sub(1);
        }
    }
}

/// A permit per tool call running, at most `most` ([`MAX_CALLS_IN_FLIGHT`]
/// for a session, [`MAX_SERVER_CALLS`] for the server).
#[derive(Debug)]
pub struct CallGate {
    permits: tokio::sync::Semaphore,
    most: usize,
    /// Whose calls, and whose share it is, for the refusal.
    whose: &'static str,
    share: &'static str,
}

impl CallGate {
    pub fn new(most: usize, whose: &'static str, share: &'static str) -> Self {
        Self { permits: tokio::sync::Semaphore::new(most), most, whose, share }
    }

    /// Admits one more call while fewer than the most run; the permit is
    /// held until the call ends.
    pub fn admit(&self) -> Result<tokio::sync::SemaphorePermit<'_>, String> {
        self.permits.try_acquire().map_err(|_| {
            format!(
                "{} already has {} tool calls running, the most {} may have at once; wait for some to finish (or \
                 cancel them) and call again",
                self.whose, self.most, self.share
            )
        })
    }
}

impl Scope {
    /// The scope of a stdio connection, or the one that requests without a
    /// session share.
    /// `max_sandboxes`: the most live sandboxes it may own at once.
    pub fn new(moat: Moat, all_records: bool, max_sandboxes: usize) -> Self {
        let calls = CallGate::new(MAX_CALLS_IN_FLIGHT, "this session", "one session");
        let serial = SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self { moat, owned: Mutex::default(), all_records, calls, counted: false, max_sandboxes, serial }
    }

    /// The scope of one HTTP session (or of a request served without one,
    /// while it is), counted against [`MAX_SESSIONS`].
    pub fn counted(moat: Moat, max_sandboxes: usize) -> Self {
        SESSIONS.live.fetch_add(1, Ordering::SeqCst);
        let mut scope = Self::new(moat, false, max_sandboxes);
        scope.counted = true;
        scope
    }

    /// Holds a place for one more sandbox, or says why there is none: the
    /// scope's live sandboxes and the creates under way already fill its
    /// share. Failed and expired sandboxes take no place (they hold no
    /// resources); a failed one stays listed until destroyed, an expired
    /// one, or one whose id another scope's sandbox took since, is dropped
    /// from the scope here.
    pub fn reserve_sandbox(&self) -> Result<SandboxPlace<'_>, String> {
        // The scope's lock, then the Moat's (in `get`): the Moat never
        // calls back into a scope, so the two are always taken in this order.
        let mut owned = self.lock();
        // Ids of sandboxes that ended, or that another scope's sandbox took
        // since, go: they are no one's here (a failed one stays listed
        // until destroyed), and a scope that never ends (stdio, requests
        // without a session) would keep them for the server's life.
        let serial = self.serial;
        let mut live = 0;
        owned.sandboxes.retain(|id| {
            let found = self.moat.get(id);
            let keep = is_owner(id, serial)
                && !matches!(
                    found,
                    Err(moat_core::SandboxError::UnknownSandbox { .. } | moat_core::SandboxError::Expired(_))
                );
            if !keep {
                release(id, serial);
            } else if found.is_ok() {
                live += 1;
            }
            keep
        });
        if owned.current.as_ref().is_some_and(|id| !owned.sandboxes.contains(id)) {
            owned.current = None;
        }
        if live + owned.making >= self.max_sandboxes {
            return Err(format!(
                "This session already has {live} live sandboxes{}, the most one session may have at once \
                 (MOAT_MAX_SANDBOXES_PER_SESSION={}, which the server's operator sets); destroy one with \
                 destroy_sandbox, or reuse one, and call again",
                match owned.making {
                    0 => String::new(),
                    n => format!(" and {n} being created"),
                },
                self.max_sandboxes
            ));
        }
        owned.making += 1;
        Ok(SandboxPlace { scope: self, held: true })
    }

    /// Admits one more tool call of this scope ([`CallGate::admit`]).
    pub fn admit_call(&self) -> Result<tokio::sync::SemaphorePermit<'_>, String> {
        self.calls.admit()
    }

    fn lock(&self) -> MutexGuard<'_, Owned> {
        self.owned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn adopt(&self, sandbox_id: &str, make_current: bool) {
        self.lock().take(self.serial, sandbox_id, make_current);
    }

    pub fn forget(&self, sandbox_id: &str) {
        let mut owned = self.lock();
        owned.sandboxes.remove(sandbox_id);
        if owned.current.as_deref() == Some(sandbox_id) {
            owned.current = None;
        }
        release(sandbox_id, self.serial);
    }

    /// Whether `sandbox_id` is this scope's: made here, and no scope made
    /// another sandbox of that id since ([`OWNERS`]).
    pub fn owns(&self, sandbox_id: &str) -> bool {
        self.lock().sandboxes.contains(sandbox_id) && is_owner(sandbox_id, self.serial)
    }

    pub fn current(&self) -> Option<String> {
        self.lock().current.clone().filter(|id| is_owner(id, self.serial))
    }

    pub fn sandboxes(&self) -> Vec<String> {
        self.lock().sandboxes.iter().filter(|id| is_owner(id, self.serial)).cloned().collect()
    }

    pub fn adopt_task(&self, task_id: &str) {
        claim(task_id, self.serial);
        self.lock().tasks.insert(task_id.to_owned());
    }

    pub fn forget_task(&self, task_id: &str) {
        self.lock().tasks.remove(task_id);
        release(task_id, self.serial);
    }

    /// The tasks this scope started, or `None` where it sees every
    /// record (stdio).
    pub fn task_ids(&self) -> Option<Vec<String>> {
        (!self.all_records).then(|| self.lock().tasks.iter().cloned().collect())
    }

    /// Whether task `task_id` was started here (and is still that task),
    /// or, on stdio, any task at all.
    pub fn sees_task(&self, task_id: &str) -> bool {
        self.all_records || (self.lock().tasks.contains(task_id) && is_owner(task_id, self.serial))
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.counted {
            SESSIONS.live.fetch_sub(1, Ordering::SeqCst);
        }
        let (ids, tasks) = {
            let mut owned = self.lock();
            (std::mem::take(&mut owned.sandboxes), std::mem::take(&mut owned.tasks))
        };
        // Only what is still this scope's: an id another session's new
        // sandbox took since is that session's to end.
        let ids: Vec<String> = ids.into_iter().filter(|id| is_owner(id, self.serial)).collect();
        for id in ids.iter().chain(&tasks) {
            release(id, self.serial);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests checked at once hold places until their sessions count
    /// themselves: however they interleave, no more start than the most.
    #[test]
    fn requests_checked_at_once_never_start_more_sessions_than_the_most() {
        let count = SessionCount::new(3);
        let held: Vec<_> = (0..5).filter_map(|_| count.start()).collect();
        assert_eq!(held.len(), 3, "three places, then none");
        drop(held);
        // A session counts itself while its request holds its place, then
        // the place goes: counted twice for a moment, never past the most.
        let place = count.start().expect("room");
        count.live.fetch_add(1, Ordering::SeqCst);
        drop(place);
        assert_eq!(count.live(), 1);
        // Threads racing for places, each starting a session and keeping it.
        let started = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..16 {
                scope.spawn(|| {
                    if let Some(place) = count.start() {
                        count.live.fetch_add(1, Ordering::SeqCst);
                        started.fetch_add(1, Ordering::SeqCst);
                        drop(place);
                    }
                });
            }
        });
        assert_eq!(started.load(Ordering::SeqCst), 2, "one was live already, and the most is three");
        assert_eq!(count.live(), 3);
        assert!(count.start().is_none());
        count.live.fetch_sub(1, Ordering::SeqCst);
        assert!(count.start().is_some(), "a session's end makes room");
    }

    #[test]
    fn an_id_that_comes_back_is_owned_by_its_new_scope_alone() {
        // Serials stand for two scopes (a Scope needs a Moat).
        let serial = || SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (old, new) = (serial(), serial());
        let mut stale = Owned::default();
        stale.take(old, "sbx-00c0ffee", true);
        assert!(is_owner("sbx-00c0ffee", old));
        // Another session's create draws the same id.
        let mut fresh = Owned::default();
        fresh.take(new, "sbx-00c0ffee", true);
        assert!(!is_owner("sbx-00c0ffee", old), "the old scope still owns a new sandbox of its id");
        assert!(is_owner("sbx-00c0ffee", new));
        // The old scope letting go leaves the new one's claim.
        release("sbx-00c0ffee", old);
        assert!(is_owner("sbx-00c0ffee", new));
        release("sbx-00c0ffee", new);
        assert!(!is_owner("sbx-00c0ffee", new));
    }

    #[test]
    fn a_session_runs_at_most_its_share_of_calls_at_once() {
        let gate = CallGate::new(3, "this session", "one session");
        let running: Vec<_> = (0..3).map(|_| gate.admit().expect("admitted")).collect();
        let busy = gate.admit().expect_err("a fourth waits");
        assert!(busy.contains("already has 3 tool calls running") && busy.contains("wait"), "{busy}");
        drop(running);
        assert!(gate.admit().is_ok(), "a call that ended gives its place back");
    }
}

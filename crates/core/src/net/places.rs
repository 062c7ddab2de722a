//! Places for the connections of a listener that anyone who reaches it may
//! open: moat-mcp's HTTP server, and preview links served to remote
//! clients.
//!
//! A listener serves at most so many connections at once. Strangers (any
//! local account, or anyone on the network) can open that many and keep
//! them, reconnecting as each head times out; if a full listener only
//! refused or queued new connections, the owner's own client would be kept
//! out for as long as they liked. So each connection gets a [`Place`] whose
//! [`Vouched`] flag the server sets once a request on it has shown the
//! owner's secret (moat-mcp's token, a preview link's session); at the most,
//! a new connection closes the oldest one not vouched for
//! ([`Places::make_room`]). A vouched connection is never closed to make
//! room, so strangers cannot take the places the owner's client holds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// Set on a connection once a request on it has shown the owner's secret:
/// from then on it is the owner's, and is never closed to make room.
#[derive(Debug, Clone, Default)]
pub struct Vouched(Arc<AtomicBool>);

impl Vouched {
    /// Marks the connection as the owner's.
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether a request on the connection has shown the owner's secret.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The places of one listener.
#[derive(Debug)]
pub struct Places {
    slots: Arc<Semaphore>,
    live: Mutex<Live>,
}

/// The connections holding places, oldest first.
#[derive(Debug, Default)]
struct Live {
    next: u64,
    held: VecDeque<(u64, Vouched, CancellationToken)>,
}

/// One connection's place; dropping it frees the place.
#[derive(Debug)]
pub struct Place {
    places: Arc<Places>,
    id: u64,
    vouched: Vouched,
    close: CancellationToken,
    _slot: OwnedSemaphorePermit,
}

impl Place {
    /// The connection's flag: set it once a request shows the owner's secret.
    pub fn vouched(&self) -> &Vouched {
        &self.vouched
    }

    /// Resolves when the connection is to be closed to make room: its task
    /// should then end (and drop the place).
    pub async fn closed(&self) {
        self.close.cancelled().await;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.lock().held.retain(|(id, _, _)| *id != self.id);
    }
}

impl Places {
    /// A listener's places: `most` connections at once.
    pub fn new(most: usize) -> Arc<Self> {
        Arc::new(Self { slots: Arc::new(Semaphore::new(most)), live: Mutex::default() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place, if one is free now.
    pub fn try_take(self: &Arc<Self>) -> Option<Place> {
        let slot = self.slots.clone().try_acquire_owned().ok()?;
        Some(self.held(slot))
    }

    /// A place, once one is free: call [`Places::make_room`] first, or
    /// this waits for a connection to end by itself.
    pub async fn take(self: &Arc<Self>) -> Place {
        // The semaphore is never closed, so acquiring fails never.
        let slot = self.slots.clone().acquire_owned().await.expect("a listener's places are never closed");
        self.held(slot)
    }

    fn held(self: &Arc<Self>, slot: OwnedSemaphorePermit) -> Place {
        let (vouched, close) = (Vouched::default(), CancellationToken::new());
        let mut live = self.lock();
        live.next += 1;
        let id = live.next;
        live.held.push_back((id, vouched.clone(), close.clone()));
        Place { places: self.clone(), id, vouched, close, _slot: slot }
    }

    /// Closes the oldest connection not vouched for (its place frees once
    /// its task ends); false when every connection is vouched for, or being
    /// closed already.
    pub fn make_room(&self) -> bool {
        let live = self.lock();
        match live.held.iter().find(|(_, vouched, close)| !vouched.is_set() && !close.is_cancelled()) {
            Some((_, _, close)) => {
                close.cancel();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_listener_closes_its_oldest_stranger_and_never_a_vouched_connection() {
        let places = Places::new(3);
        let (owner, first, second) = (places.try_take(), places.try_take(), places.try_take());
        let (owner, first, second) = (owner.expect("a place"), first.expect("a place"), second.expect("a place"));
        assert!(places.try_take().is_none(), "three places only");
        owner.vouched().set();
        assert!(places.make_room(), "a stranger holds a place");
        assert!(first.close.is_cancelled() && !second.close.is_cancelled(), "the oldest stranger goes first");
        assert!(!owner.close.is_cancelled());
        assert!(places.make_room(), "the next stranger");
        assert!(second.close.is_cancelled());
        assert!(!places.make_room(), "no stranger left: the owner's connection stays");
        assert!(!owner.close.is_cancelled());
        first.closed().await;
        drop(first);
        let third =
            tokio::time::timeout(std::time::Duration::from_secs(5), places.take()).await.expect("the place freed");
        assert!(places.make_room(), "a stranger being closed is not counted twice: the new one is next");
        assert!(third.close.is_cancelled() && !owner.close.is_cancelled());
        drop((second, third));
        assert_eq!(places.lock().held.len(), 1, "a dropped place leaves the list");
        assert!(places.try_take().is_some());
    }
}

//! The events of streamable HTTP responses, kept so that a client whose
//! SSE stream dropped gets what it missed when it reconnects with
//! `Last-Event-ID` (rmcp's [`EventStore`]).
//!
//! Bounded in size and age: the oldest events go first once the log holds
//! more than [`EVENT_LOG_BYTES`], and none is kept longer than
//! [`EVENT_LOG_AGE`]. A client that comes back later than that, or after a
//! flood of other responses, is told its event is gone and calls again.
//!
//! One log serves every session, and rmcp replays by the event id alone
//! (it does not ask whose session the id came from). So an id is a
//! capability: `KEY-INDEX`, where KEY is 128 random bits of the stream the
//! event belongs to. A client sees only its own streams' ids, and an id
//! replays only the events of the stream whose key it carries; an index
//! guessed with another key is "gone".

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::transport::streamable_http_server::session::{EventStore, EventStoreError, EventStream, ServerSseMessage};

/// How many bytes of events are kept, all sessions together.
pub const EVENT_LOG_BYTES: usize = 64 * 1024 * 1024;

/// How long an event is kept.
pub const EVENT_LOG_AGE: Duration = Duration::from_secs(10 * 60);

/// An in-memory [`EventStore`] bounded by [`EVENT_LOG_BYTES`] and
/// [`EVENT_LOG_AGE`].
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<Inner>,
    max_bytes: usize,
    max_age: Duration,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    bytes: usize,
    events: VecDeque<Stored>,
    /// Each stream's key and how many of its events are kept; a stream
    /// leaves with its last event.
    keys: std::collections::HashMap<Arc<str>, (Arc<str>, usize)>,
}

#[derive(Debug)]
struct Stored {
    index: u64,
    stream: Arc<str>,
    /// The stream's key: the part of an event id that makes it a
    /// capability.
    key: Arc<str>,
    at: Instant,
    size: usize,
    event: ServerSseMessage,
}

/// 128 random bits, as hex.
fn new_key() -> Arc<str> {
    let mut bytes = [0u8; 16];
    // getrandom fails only where the kernel has no random source at all;
    // then the time and pid still make a key no other client has seen.
    if getrandom::fill(&mut bytes).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes[..8].copy_from_slice(&now.as_nanos().to_le_bytes()[..8]);
        bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect::<String>().into()
}

#[derive(Debug, thiserror::Error)]
enum EventLogError {
    #[error(
        "Event {0} is not one this server issued, or it is no longer kept (events are kept {1} minutes, {2} MiB \
         in all); the response it followed is lost: send the request again"
    )]
    Gone(String, u64, usize),
}

impl Default for EventLog {
    fn default() -> Self {
        Self::new(EVENT_LOG_BYTES, EVENT_LOG_AGE)
    }
}

impl EventLog {
    pub fn new(max_bytes: usize, max_age: Duration) -> Self {
        Self { inner: Mutex::new(Inner::default()), max_bytes, max_age }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding it leaves whole entries only (every change
        // is a push or a pop), so a poisoned log is still a good one.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn event_id(key: &str, index: u64) -> String {
        format!("{key}-{index}")
    }

    /// The key and index of an event id.
    fn parse_id(id: &str) -> Option<(&str, u64)> {
        let (key, index) = id.split_once('-')?;
        Some((key, index.parse().ok()?))
    }

    /// Drops what is too old, then the oldest while over the size bound
    /// (the newest event stays, whatever its size).
    fn evict(&self, inner: &mut Inner) {
        let now = Instant::now();
        while let Some(front) = inner.events.front() {
            let too_old = now.duration_since(front.at) > self.max_age;
            let too_big = inner.bytes > self.max_bytes && inner.events.len() > 1;
            if !too_old && !too_big {
                break;
            }
            inner.bytes -= front.size;
            if let Some(gone) = inner.events.pop_front()
                && let Some((_, count)) = inner.keys.get_mut(&gone.stream)
            {
                *count -= 1;
                if *count == 0 {
                    inner.keys.remove(&gone.stream);
                }
            }
        }
    }

    fn gone(&self, id: &str) -> EventStoreError {
        Box::new(EventLogError::Gone(id.to_owned(), self.max_age.as_secs() / 60, self.max_bytes / (1024 * 1024)))
    }

    /// How many events are kept and their bytes (for tests).
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.events.len(), inner.bytes)
    }
}

#[async_trait::async_trait]
impl EventStore for EventLog {
    async fn store_event(&self, stream_id: &str, event: &ServerSseMessage) -> Result<String, EventStoreError> {
        // The size of what would be replayed, roughly its SSE data line.
        let size = event.message.as_ref().map_or(0, |m| serde_json::to_vec(m).map_or(0, |v| v.len())) + 64;
        let mut inner = self.lock();
        let index = inner.next;
        inner.next += 1;
        let (stream, key) = match inner.keys.get_key_value(stream_id) {
            Some((stream, (key, _))) => (stream.clone(), key.clone()),
            None => (Arc::<str>::from(stream_id), new_key()),
        };
        inner.keys.entry(stream.clone()).or_insert_with(|| (key.clone(), 0)).1 += 1;
        let id = Self::event_id(&key, index);
        let mut event = event.clone();
        event.event_id = Some(id.clone());
        inner.bytes += size;
        inner.events.push_back(Stored { index, stream, key, at: Instant::now(), size, event });
        self.evict(&mut inner);
        Ok(id)
    }

    async fn replay_events_after(&self, last_event_id: &str) -> Result<EventStream, EventStoreError> {
        let (key, index) = Self::parse_id(last_event_id).ok_or_else(|| self.gone(last_event_id))?;
        let mut inner = self.lock();
        self.evict(&mut inner);
        // Indexes rise along the deque: find the event by binary search.
        let position =
            inner.events.binary_search_by_key(&index, |stored| stored.index).map_err(|_| self.gone(last_event_id))?;
        // The id must carry its stream's key; compared in constant time.
        let stored_key = inner.events[position].key.as_bytes();
        let same = stored_key.len() == key.len()
            && stored_key.iter().zip(key.as_bytes()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0;
        if !same {
            return Err(self.gone(last_event_id));
        }
        let stream = inner.events[position].stream.clone();
        let after: Vec<ServerSseMessage> = inner
            .events
            .iter()
            .skip(position + 1)
            .filter(|stored| stored.stream == stream)
            .map(|stored| stored.event.clone())
            .collect();
        Ok(Box::pin(futures_util::stream::iter(after)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use rmcp::model::{EmptyResult, JsonRpcResponse, JsonRpcVersion2_0, RequestId, ServerJsonRpcMessage, ServerResult};

    fn response(id: i64) -> ServerSseMessage {
        ServerSseMessage::from_message(ServerJsonRpcMessage::Response(JsonRpcResponse {
            jsonrpc: JsonRpcVersion2_0,
            id: RequestId::Number(id),
            result: ServerResult::EmptyResult(EmptyResult {}),
        }))
    }

    async fn replayed(log: &EventLog, after: &str) -> Vec<String> {
        match log.replay_events_after(after).await {
            Ok(stream) => stream.map(|e| e.event_id.unwrap_or_default()).collect().await,
            Err(e) => vec![format!("error: {e}")],
        }
    }

    #[tokio::test]
    async fn events_after_the_last_seen_are_replayed_from_their_stream_only() {
        let log = EventLog::default();
        let prime = log.store_event("a", &ServerSseMessage::retry(Duration::from_secs(1))).await.expect("stored");
        let other = log.store_event("b", &response(1)).await.expect("stored");
        let answer = log.store_event("a", &response(2)).await.expect("stored");
        assert_eq!(replayed(&log, &prime).await, vec![answer.clone()]);
        assert!(replayed(&log, &answer).await.is_empty());
        assert!(replayed(&log, &other).await.is_empty());
        let unknown = replayed(&log, "00000000-1").await.concat();
        assert!(unknown.contains("send the request again"), "{unknown}");
        assert!(replayed(&log, "garbage").await.concat().contains("error"));
    }

    #[tokio::test]
    async fn an_id_replays_only_its_own_streams_events() {
        let log = EventLog::default();
        // Session A's stream, and session B's, which sees only its own ids.
        let a_first = log.store_event("session-a/1", &response(1)).await.expect("stored");
        let a_secret = log.store_event("session-a/1", &response(2)).await.expect("stored");
        let b_own = log.store_event("session-b/1", &response(3)).await.expect("stored");
        let (a_key, a_index) = EventLog::parse_id(&a_first).expect("an id");
        let (b_key, _) = EventLog::parse_id(&b_own).expect("an id");
        assert_ne!(a_key, b_key, "each stream has a key of its own");
        assert_eq!(a_key.len(), 32, "128 bits");
        // B guesses A's indexes with its own key, or any other: gone.
        for guess in [format!("{b_key}-{a_index}"), format!("{b_key}-0"), format!("{}-{a_index}", "0".repeat(32))] {
            let got = replayed(&log, &guess).await.concat();
            assert!(got.contains("send the request again"), "{guess}: {got}");
        }
        assert_eq!(replayed(&log, &a_first).await, vec![a_secret], "A's own id still works");
        // Keys go with their streams' last events.
        let log = EventLog::new(1 << 20, Duration::from_millis(1));
        log.store_event("old", &response(1)).await.expect("stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
        log.store_event("new", &response(2)).await.expect("stored");
        assert_eq!(log.lock().keys.len(), 1, "the old stream's key is dropped");
    }

    #[tokio::test]
    async fn the_log_is_bounded_in_size_and_age() {
        let log = EventLog::new(1000, Duration::from_secs(3600));
        let first = log.store_event("a", &response(1)).await.expect("stored");
        for i in 0..100 {
            log.store_event("a", &response(i)).await.expect("stored");
        }
        let (count, bytes) = log.usage();
        assert!(bytes <= 1000 && count < 100, "{count} events, {bytes} bytes");
        assert!(replayed(&log, &first).await.concat().contains("error"));

        let log = EventLog::new(1 << 20, Duration::from_millis(1));
        let old = log.store_event("a", &response(1)).await.expect("stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(replayed(&log, &old).await.concat().contains("no longer kept"));
        assert_eq!(log.usage().0, 0);
    }
}

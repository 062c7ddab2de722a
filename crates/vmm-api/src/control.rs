//! The control socket's protocol: JSON lines, one request per line, one
//! answer per request, in order (docs/vmm.md).
//!
//! | request | effect | answer |
//! |---|---|---|
//! | `{"op":"status"}` | none | [`Status`] |
//! | `{"op":"pause"}` | every vCPU parked outside `KVM_RUN` | [`Status`] |
//! | `{"op":"resume"}` | vCPUs run again | [`Status`] |
//! | `{"op":"shutdown"}` | Ctrl+Alt+Del to the guest; stopped after `timeout_ms` (default: the config's `shutdown_timeout_ms`) if it has not ended by then | [`Shutdown`] |
//! | `{"op":"shutdown","force":true}` | stopped now | [`Shutdown`] |
//!
//! Each answer is a [`Reply`]: `{"ok":true,…}` with the answer's fields, or
//! `{"ok":false,"error":"…"}`.

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Reports the VM's [`Status`].
    Status,
    /// Parks every vCPU; answers the [`Status`] once they are.
    Pause,
    /// Lets the vCPUs run again; answers the [`Status`].
    Resume,
    /// Ends the VM: at once when `force`d (or paused), else through the
    /// guest (Ctrl+Alt+Del), stopping it after `timeout_ms`.
    Shutdown {
        #[serde(default)]
        force: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
    },
}

impl Request {
    /// The request's `op`, as it is written on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Shutdown { .. } => "shutdown",
        }
    }
}

/// What the vCPUs are doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Running,
    Paused,
    /// The VM is ending: a shutdown was asked for or the guest ended.
    Stopping,
}

/// The VM's state, as `status`, `pause` and `resume` answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub state: State,
    pub vcpus: u8,
    pub memory_mib: u32,
    pub uptime_ms: u64,
    /// When the guest wrote the boot timer, in µs since the VMM started;
    /// `None` until it has.
    pub guest_ready_us: Option<u64>,
}

/// What `shutdown` answers: `{"state":"stopping"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Shutdown {
    Stopping,
}

/// The answer to one request: done, with the answer's fields next to
/// `"ok":true`, or refused, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply<T> {
    Done(T),
    Refused(String),
}

impl<T> Reply<T> {
    /// The answer, or why the VMM refused the request.
    pub fn into_result(self) -> Result<T, String> {
        match self {
            Self::Done(answer) => Ok(answer),
            Self::Refused(error) => Err(error),
        }
    }
}

#[derive(Serialize)]
struct DoneOnWire<'a, T> {
    ok: bool,
    #[serde(flatten)]
    answer: &'a T,
}

#[derive(Serialize, Deserialize)]
struct RefusedOnWire<E> {
    ok: bool,
    error: E,
}

impl<T: Serialize> Serialize for Reply<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Done(answer) => DoneOnWire { ok: true, answer }.serialize(serializer),
            Self::Refused(error) => RefusedOnWire { ok: false, error }.serialize(serializer),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Reply<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct OnWire<T> {
            ok: bool,
            #[serde(default)]
            error: Option<String>,
            #[serde(flatten)]
            answer: Option<T>,
        }
        let wire = OnWire::<T>::deserialize(deserializer)?;
        match (wire.ok, wire.answer, wire.error) {
            (true, Some(answer), _) => Ok(Self::Done(answer)),
            (true, None, _) => {
                Err(D::Error::custom("an \"ok\":true answer without the fields of its request's answer"))
            }
            (false, _, Some(error)) => Ok(Self::Refused(error)),
            (false, _, None) => Err(D::Error::missing_field("error")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_written_as_moat_vmm_documents_them() {
        let line = |request: &Request| serde_json::to_string(request).expect("serializes");
        assert_eq!(line(&Request::Status), r#"{"op":"status"}"#);
        assert_eq!(line(&Request::Pause), r#"{"op":"pause"}"#);
        assert_eq!(line(&Request::Shutdown { force: true, timeout_ms: None }), r#"{"op":"shutdown","force":true}"#);
        let shutdown = Request::Shutdown { force: false, timeout_ms: Some(10) };
        assert_eq!(serde_json::from_str::<Request>(&line(&shutdown)).expect("parses"), shutdown);
        assert_eq!(shutdown.op(), "shutdown");
    }

    #[test]
    fn replies_carry_ok_and_the_answers_fields() {
        let status = Status { state: State::Running, vcpus: 2, memory_mib: 128, uptime_ms: 5, guest_ready_us: None };
        let line = serde_json::to_string(&Reply::Done(status.clone())).expect("serializes");
        assert_eq!(
            line,
            r#"{"ok":true,"state":"running","vcpus":2,"memory_mib":128,"uptime_ms":5,"guest_ready_us":null}"#
        );
        assert_eq!(serde_json::from_str::<Reply<Status>>(&line).expect("parses"), Reply::Done(status));
        let line = serde_json::to_string(&Reply::Done(Shutdown::Stopping)).expect("serializes");
        assert_eq!(line, r#"{"ok":true,"state":"stopping"}"#);
        assert_eq!(serde_json::from_str::<Reply<Shutdown>>(&line).expect("parses"), Reply::Done(Shutdown::Stopping));
        let line = serde_json::to_string(&Reply::<Status>::Refused("nope".into())).expect("serializes");
        assert_eq!(line, r#"{"ok":false,"error":"nope"}"#);
        assert_eq!(serde_json::from_str::<Reply<Status>>(&line).expect("parses"), Reply::Refused("nope".into()));
    }

    #[test]
    fn a_reply_without_its_answer_is_an_error() {
        assert!(serde_json::from_str::<Reply<Status>>(r#"{"ok":true,"state":"stopping"}"#).is_err());
        assert!(serde_json::from_str::<Reply<Status>>(r#"{"ok":false}"#).is_err());
        assert!(serde_json::from_str::<Reply<Status>>(r#"{"state":"running"}"#).is_err());
    }
}

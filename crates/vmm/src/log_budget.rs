//! Log lines a guest can cause at will, rationed.
//!
//! Some of moat-vmm's log lines follow from what the guest does: a boot
//! marker written to the boot timer, a write to a full overlay, a packet it
//! does not take. One guest instruction each, in a loop, would make the VMM
//! thread format and write a line per iteration (the log is capped on the
//! host, but rotating it costs host CPU and I/O all the same). Each such
//! call site logs through [`guest_triggered!`](crate::guest_triggered):
//! at most [`LINES`] lines per [`WINDOW`]; the first line it logs in a
//! later window is preceded by one saying how many were left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most lines one call site logs per [`WINDOW`].
pub const LINES: u32 = 10;
/// The span [`LINES`] counts over.
pub const WINDOW: Duration = Duration::from_secs(60);

/// One call site's ration.
#[derive(Debug)]
pub struct Site(Mutex<Option<Ration>>);

#[derive(Debug)]
struct Ration {
    opened: Instant,
    logged: u32,
    left_out: u64,
}

/// Whether a line may be logged now, and how many lines of the window
/// before were left out (to say so first).
#[derive(Debug, PartialEq, Eq)]
pub struct Admission {
    pub log: bool,
    pub left_out: u64,
}

impl Site {
    pub const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// Counts one line at `now` against the ration.
    pub fn admit(&self, now: Instant) -> Admission {
        let mut ration = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let ration = ration.get_or_insert(Ration { opened: now, logged: 0, left_out: 0 });
        let mut left_out = 0;
        if now.saturating_duration_since(ration.opened) >= WINDOW {
            left_out = std::mem::take(&mut ration.left_out);
            *ration = Ration { opened: now, logged: 0, left_out: 0 };
        }
        if ration.logged < LINES {
            ration.logged += 1;
            Admission { log: true, left_out }
        } else {
            ration.left_out += 1;
            Admission { log: false, left_out }
        }
    }
}

impl Default for Site {
    fn default() -> Self {
        Self::new()
    }
}

/// `tracing::<level>!(…)` for a line the guest can cause at will: rationed
/// per call site ([`crate::log_budget`]).
#[macro_export]
macro_rules! guest_triggered {
    ($level:ident, $($arg:tt)+) => {{
        static SITE: $crate::log_budget::Site = $crate::log_budget::Site::new();
        let admission = SITE.admit(::std::time::Instant::now());
        if admission.left_out > 0 {
            tracing::$level!(
                "({} more lines like the next were left out in the last minute: the guest caused them faster than \
                 they are logged)",
                admission.left_out
            );
        }
        if admission.log {
            tracing::$level!($($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_logs_its_ration_then_says_how_many_it_left_out() {
        let site = Site::new();
        let start = Instant::now();
        let logged = (0..1000).filter(|_| site.admit(start).log).count();
        assert_eq!(logged, LINES as usize, "a loop of a thousand gets its ration");
        let next = site.admit(start + WINDOW);
        assert_eq!(next, Admission { log: true, left_out: 1000 - u64::from(LINES) }, "then a line says so");
        assert_eq!(site.admit(start + WINDOW).left_out, 0, "once");
    }
}

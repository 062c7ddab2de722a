//! Watching the host uids of a process tree: what a rootless run's tests
//! check (no process of the run is root; a sandbox's processes run as the
//! account's subordinate ids). Shared by path with moat-mcp-bin's tests.

#![allow(dead_code)]

/// What [`UidWatch`] saw of a process tree's host uids.
#[derive(Debug, Default)]
pub struct Seen {
    /// Processes with uid 0 (real, effective, saved or file system).
    pub root: Vec<String>,
    /// Processes in another pid namespace (a sandbox's) whose uid is not
    /// one of the subordinate range.
    pub misplaced: Vec<String>,
    /// How many sandbox processes were seen.
    pub sandboxed: usize,
}

/// Watches the host uids of every process descending from a pid until
/// stopped. A test's observer, not moat's: it samples /proc every few
/// milliseconds, as nothing notifies of another user's new processes.
pub struct UidWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Seen>,
}

impl UidWatch {
    pub fn start(top: u32, subids: u32) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = Seen::default();
            let mut noted = std::collections::HashSet::new();
            let ours = std::fs::read_link("/proc/self/ns/pid").ok();
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                for (pid, status) in descendants(top) {
                    let field = |name: &str| {
                        status
                            .lines()
                            .find_map(|l| l.strip_prefix(name))
                            .map(|v| v.split_whitespace().filter_map(|id| id.parse::<u32>().ok()).collect::<Vec<_>>())
                    };
                    let (Some(uids), Some(name)) =
                        (field("Uid:"), status.lines().find_map(|l| l.strip_prefix("Name:")))
                    else {
                        continue;
                    };
                    let name = name.trim();
                    let what = format!("{name} (pid {pid}, uids {uids:?})");
                    // A process that ended meanwhile has no namespace to
                    // read: it is judged by what was read of it, or not at all.
                    let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/pid")) else { continue };
                    let sandboxed = Some(ns) != ours;
                    // setpriv is root until it has switched to the account
                    // and exec'd the test; a sandbox's init is moat's own
                    // code, still setting its ids, until it execs the
                    // agent (then named `agent`).
                    let switching = (pid == top && name == "setpriv") || (sandboxed && name == "moat-agent");
                    // The system's set-uid helpers that map the account's
                    // subordinate ids (shadow's, as rootless Podman uses
                    // them): root by design, and not moat's.
                    let helper = matches!(name, "newuidmap" | "newgidmap");
                    if switching || helper || !noted.insert((pid, uids.clone())) {
                        continue;
                    }
                    if uids.contains(&0) {
                        seen.root.push(what);
                    } else if sandboxed {
                        seen.sandboxed += 1;
                        if !uids.iter().all(|id| (subids..subids + 65536).contains(id)) {
                            seen.misplaced.push(what);
                        }
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            seen
        });
        Self { stop, thread }
    }

    pub fn stop(self) -> Seen {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the watch ends")
    }
}

/// Every live process below `top` (by parent pid), with its status text.
fn descendants(top: u32) -> Vec<(u32, String)> {
    let mut parents = std::collections::HashMap::new();
    let mut statuses = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().filter_map(Result::ok) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else { continue };
        let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|v| v.trim().parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.insert(pid, ppid);
        }
        statuses.push((pid, status));
    }
    let below = |mut pid: u32| {
        while let Some(&parent) = parents.get(&pid) {
            if parent == top {
                return true;
            }
            if parent <= 1 {
                return false;
            }
            pid = parent;
        }
        false
    };
    statuses.into_iter().filter(|(pid, _)| *pid == top || below(*pid)).collect()
}

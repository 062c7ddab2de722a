//! The kernel's `favordynmods`: moves between cgroups without waiting for a
//! grace period.
//!
//! Every jail moves processes between cgroups: its monitor into the
//! sandbox's cgroups as it starts, the agent each command into a cgroup of
//! its own. A move write-locks the kernel's `cgroup_threadgroup_rwsem`,
//! which by default is tuned for the forks and exits that read-lock it: a
//! writer first waits for an RCU grace period, unless another writer held
//! the lock less than one ago. So the first sandbox after a quiet moment
//! waits a whole grace period before its monitor may clone, 6 to 14 ms on
//! the 2-core test machines (`HZ=250`), as long as the rest of a jail's
//! start. The cgroup mount option `favordynmods` (Linux 6.0) keeps the
//! lock in its writers' mode: moves wait for no grace period, and forks
//! and exits take the lock's slower path (a memory barrier more each).
//!
//! It is the whole kernel's, not a sandbox's: the lock is shared by every
//! hierarchy, and it stays on until reboot once any hierarchy is mounted
//! with the option. cgroup v1 takes no new options on remount, so it is
//! set through the cgroup v2 hierarchy, which every kernel has even where
//! v1 holds all the controllers. `moat setup`, run once as root, turns it
//! on ([`enable`]); `moat doctor` reports it ([`state`]), where a mount
//! shows it. moat works the same without it, only slower to start a jail.

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

/// The mount option.
const OPTION: &str = "favordynmods";

/// Whether moves between cgroups wait for a grace period on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// A cgroup hierarchy is mounted with `favordynmods`.
    On,
    /// None is, and a cgroup v2 hierarchy is mounted that would show it:
    /// the first move after a quiet moment waits.
    Off,
    /// No cgroup v2 hierarchy is mounted, and no v1 hierarchy shows the
    /// option: the kernel does not say (on a v1 host it is set through a
    /// cgroup v2 mount, which is gone again; see [`Enabled::Mounted`]).
    Unseen,
    /// No cgroup hierarchy is mounted (nothing moves).
    NoCgroups,
}

/// A cgroup mount, from a line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    target: PathBuf,
    /// The mount's own options (`nosuid`, `relatime`, ...).
    options: Vec<String>,
    /// `cgroup` or `cgroup2`.
    fs: String,
    /// The hierarchy's options (`nsdelegate`, `favordynmods`, ...).
    super_options: Vec<String>,
}

/// The cgroup mounts in mountinfo's `text`, in its order.
fn cgroup_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            // ID PARENT MAJ:MIN ROOT TARGET OPTIONS [OPTIONAL...] - FS SOURCE SUPER
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let (target, options, fs, super_options) = (left.get(4)?, left.get(5)?, right.first()?, right.get(2)?);
            matches!(*fs, "cgroup" | "cgroup2").then(|| Mount {
                target: PathBuf::from(unescape(target)),
                options: options.split(',').map(str::to_owned).collect(),
                fs: (*fs).to_owned(),
                super_options: super_options.split(',').map(str::to_owned).collect(),
            })
        })
        .collect()
}

/// A mountinfo path with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn state_of(mounts: &[Mount]) -> State {
    if mounts.is_empty() {
        State::NoCgroups
    } else if mounts.iter().any(|m| m.super_options.iter().any(|o| o == OPTION)) {
        State::On
    } else if mounts.iter().any(|m| m.fs == "cgroup2") {
        State::Off
    } else {
        State::Unseen
    }
}

/// This host's state, from `/proc/self/mountinfo`.
pub fn state() -> State {
    state_of(&cgroup_mounts(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default()))
}

/// The flags that keep a mount's own options as they are through a
/// remount (a remount sets them all anew).
fn mount_flags(options: &[String]) -> MsFlags {
    options.iter().fold(MsFlags::empty(), |flags, option| {
        flags
            | match option.as_str() {
                "ro" => MsFlags::MS_RDONLY,
                "nosuid" => MsFlags::MS_NOSUID,
                "nodev" => MsFlags::MS_NODEV,
                "noexec" => MsFlags::MS_NOEXEC,
                "noatime" => MsFlags::MS_NOATIME,
                "nodiratime" => MsFlags::MS_NODIRATIME,
                "relatime" => MsFlags::MS_RELATIME,
                "strictatime" => MsFlags::MS_STRICTATIME,
                _ => MsFlags::empty(),
            }
    })
}

/// The hierarchy options for a remount of `mount` that adds
/// `favordynmods`: cgroup v2 sets every option anew on remount, so the
/// ones it has (`nsdelegate`, `memory_recursiveprot`, ...) are kept.
fn remount_data(mount: &Mount) -> String {
    let mut kept: Vec<&str> =
        mount.super_options.iter().map(String::as_str).filter(|o| !matches!(*o, "rw" | "ro" | OPTION)).collect();
    kept.push(OPTION);
    kept.join(",")
}

/// What [`enable`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enabled {
    /// It was on already.
    Already,
    /// The cgroup v2 hierarchy mounted at the path was remounted with it.
    Remounted(PathBuf),
    /// No cgroup v2 hierarchy was mounted: one was mounted with it for a
    /// moment (the option outlives the mount).
    Mounted,
}

/// Turns `favordynmods` on for this kernel, as root. Fails with what to do
/// where the kernel has no such option (before Linux 6.0) or the caller
/// may not mount.
pub fn enable() -> Result<Enabled, String> {
    let mounts = cgroup_mounts(
        &std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo ({e}); is /proc mounted?"))?,
    );
    if state_of(&mounts) == State::On {
        return Ok(Enabled::Already);
    }
    let explain = |e: nix::Error| {
        let release = nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown".into());
        match e {
            nix::Error::EINVAL => format!(
                "this kernel ({release}) has no cgroup option {OPTION} (Linux 6.0 and later have it); jails work \
                 without it, each waiting a grace period to join its cgroups"
            ),
            nix::Error::EPERM => format!("mounting needs root ({e}); run `moat setup` with sudo"),
            e => format!("the kernel refused ({e})"),
        }
    };
    if let Some(v2) = mounts.iter().find(|m| m.fs == "cgroup2") {
        remount(v2).map_err(|e| format!("remounting {} with {OPTION}: {}", v2.target.display(), explain(e)))?;
        return took(Enabled::Remounted(v2.target.clone()));
    }
    // A directory of this process's own under a name no one could take
    // beforehand, gone again when done.
    let dir = nix::unistd::mkdtemp(&std::env::temp_dir().join("moat-cgroup2-XXXXXX"))
        .map_err(|e| format!("cannot make a directory to mount cgroup v2 on for a moment ({e})"))?;
    // No cgroup v2 mount: no option of the hierarchy's is set to keep.
    let mounted = mount_briefly(&dir, OPTION);
    // Not recursively: were the mount still there, its cgroups are not ours.
    let _ = std::fs::remove_dir(&dir);
    let shown = mounted.map_err(|e| format!("mounting cgroup v2 with {OPTION}: {}", explain(e)))?;
    if shown { Ok(Enabled::Mounted) } else { Err(not_shown()) }
}

fn not_shown() -> String {
    format!(
        "the kernel accepted {OPTION} but does not show it on; run `moat setup` as root in the host's own cgroup \
         namespace, not in a container"
    )
}

/// `done`, once mountinfo shows the option: the kernel applies it only
/// from the host's own cgroup namespace, and says nothing when it does not.
fn took(done: Enabled) -> Result<Enabled, String> {
    match state() {
        State::On => Ok(done),
        _ => Err(not_shown()),
    }
}

/// Remounts `v2` with the option, its other options as they were.
fn remount(v2: &Mount) -> nix::Result<()> {
    let flags = MsFlags::MS_REMOUNT | mount_flags(&v2.options);
    nix::mount::mount(None::<&str>, &v2.target, None::<&str>, flags, Some(remount_data(v2).as_str()))
}

/// Mounts the cgroup v2 hierarchy on `dir` with the hierarchy options
/// `data`, which must hold the option, and unmounts it; says whether the
/// mount showed the option meanwhile (the only time a host without a
/// cgroup v2 mount shows it). Every mount of cgroup v2 sets the
/// hierarchy's options anew, for every mount of it: `data` lists all that
/// are to stay.
fn mount_briefly(dir: &Path, data: &str) -> nix::Result<bool> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    nix::mount::mount(Some("cgroup2"), dir, Some("cgroup2"), flags, Some(data))?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let shown = cgroup_mounts(&info).iter().any(|m| m.target == dir && m.super_options.iter().any(|o| o == OPTION));
    nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH)?;
    Ok(shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755
34 33 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:10 - cgroup cgroup rw,cpu
35 33 0:30 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:11 - cgroup2 cgroup2 rw,nsdelegate
36 33 0:31 / /sys/fs/cgroup/with\\040space rw,relatime - cgroup cgroup rw,pids
";

    /// A directory to mount on, for a test run as root, and the lock that
    /// keeps such tests apart: cgroup v2 mounts share one hierarchy, whose
    /// options each mount and remount sets anew, so one test's mount
    /// showed another's options mid-change. `None` (skipped, said) when
    /// not root.
    /// The options of the host's own cgroup v2 hierarchy, as a mount of it
    /// must pass them to leave them as they are (`nsdelegate`, ...), with
    /// the option added: a test's mount without them would take them from
    /// the host's hierarchy.
    fn host_options() -> String {
        let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        cgroup_mounts(&info).iter().find(|m| m.fs == "cgroup2").map_or_else(|| OPTION.to_owned(), remount_data)
    }

    fn mount_point() -> Option<(tempfile::TempDir, std::sync::MutexGuard<'static, ()>)> {
        static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return None;
        }
        let held = MOUNTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Some((tempfile::tempdir().expect("a directory"), held))
    }

    #[test]
    fn reads_cgroup_mounts_and_their_options() {
        let mounts = cgroup_mounts(HYBRID);
        let targets: Vec<_> = mounts.iter().map(|m| m.target.display().to_string()).collect();
        assert_eq!(targets, ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/with space"]);
        assert_eq!(mounts[1].fs, "cgroup2");
        assert_eq!(mounts[1].super_options, ["rw", "nsdelegate"]);
        assert_eq!(state_of(&mounts), State::Off);
        assert_eq!(state_of(&[]), State::NoCgroups);
        // Without a cgroup v2 mount, nothing shows it either way.
        let v1_only: Vec<Mount> = mounts.into_iter().filter(|m| m.fs == "cgroup").collect();
        assert_eq!(state_of(&v1_only), State::Unseen);
    }

    #[test]
    fn any_hierarchy_with_the_option_turns_it_on() {
        let text = HYBRID.replace("rw,nsdelegate", "rw,nsdelegate,favordynmods");
        assert_eq!(state_of(&cgroup_mounts(&text)), State::On);
    }

    /// As root: a cgroup v2 mount of the test's own, remounted as
    /// [`enable`] does, has the option and keeps its own flags and the
    /// hierarchy's other options. (The option is the kernel's: this
    /// leaves it on, as `moat setup` does.)
    #[test]
    fn a_remount_adds_the_option_and_keeps_the_flags() {
        let Some((dir, _mounting)) = mount_point() else { return };
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        let data = host_options();
        nix::mount::mount(Some("cgroup2"), dir.path(), Some("cgroup2"), flags, Some(data.as_str()))
            .expect("mount cgroup2");
        let mine = |text: &str| cgroup_mounts(text).into_iter().find(|m| m.target == dir.path());
        let info = || std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let before = mine(&info()).expect("the mount in mountinfo");
        let remounted = remount(&before);
        let after = mine(&info());
        nix::mount::umount2(dir.path(), nix::mount::MntFlags::MNT_DETACH).expect("umount");
        match remounted {
            Err(nix::Error::EINVAL) => eprintln!("skipped: this kernel has no {OPTION}"),
            Err(e) => panic!("remount: {e}"),
            Ok(()) => {
                let after = after.expect("the mount after the remount");
                assert!(after.super_options.iter().any(|o| o == OPTION), "{after:?}");
                for kept in &before.super_options {
                    assert!(after.super_options.contains(kept), "{kept} lost: {after:?}");
                }
                assert_eq!(mount_flags(&after.options), mount_flags(&before.options), "{after:?}");
                assert_eq!(state(), State::On);
            }
        }
    }

    /// As root: the brief mount a host without cgroup v2 mounted gets
    /// shows the option while it lasts, and is gone after.
    #[test]
    fn a_brief_mount_shows_the_option_and_leaves_nothing() {
        let Some((dir, _mounting)) = mount_point() else { return };
        match mount_briefly(dir.path(), &host_options()) {
            Err(nix::Error::EINVAL) => eprintln!("skipped: this kernel has no {OPTION}"),
            Err(e) => panic!("mount: {e}"),
            Ok(shown) => assert!(shown, "the brief mount did not show {OPTION}"),
        }
        let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(!cgroup_mounts(&info).iter().any(|m| m.target == dir.path()), "still mounted:\n{info}");
    }

    #[test]
    fn a_remount_keeps_the_mounts_flags_and_the_hierarchys_options() {
        let v2 = cgroup_mounts(HYBRID).remove(1);
        assert_eq!(
            mount_flags(&v2.options),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RELATIME
        );
        assert_eq!(remount_data(&v2), "nsdelegate,favordynmods");
        let again = Mount { super_options: vec!["ro".into(), OPTION.into()], ..v2 };
        assert_eq!(remount_data(&again), OPTION);
    }
}

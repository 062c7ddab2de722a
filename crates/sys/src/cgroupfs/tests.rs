use super::*;

/// Makes `depth` directories, each in the last, each named `name` with its
/// level, below `top`, through descriptors (their path is longer than
/// `PATH_MAX`, so no path-based call could).
fn chain(top: &Path, name: &str, depth: usize) {
    let mut dir = nix::fcntl::open(top, DIR, Mode::empty()).expect("opens the top");
    for level in 0..depth {
        let child = CString::new(format!("{name}{level}")).expect("a name");
        nix::sys::stat::mkdirat(dir.as_fd(), child.as_c_str(), Mode::from_bits_truncate(0o755)).expect("mkdirat");
        dir = open_dir(dir.as_fd(), &child).expect("opens the child");
    }
}

/// A name of 200 bytes, plus the level: 40 levels are 8,000 bytes of path.
fn long_name() -> String {
    "n".repeat(200)
}

#[test]
fn a_tree_deeper_than_a_path_can_name_is_removed_whole() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let top = scratch.path().join("sandbox");
    std::fs::create_dir(&top).expect("mkdir");
    chain(&top, &long_name(), 40);
    chain(&top.join(format!("{}0", long_name())), "wide", 3);
    std::fs::create_dir_all(top.join("a/b/c")).expect("mkdir");
    assert_eq!(processes(&top).expect("counts"), 0, "plain directories hold no processes");
    remove(&top, Busy::Leave, Instant::now()).expect("removes");
    assert!(!top.exists(), "the top is removed");
    assert!(scratch.path().exists(), "nothing above the top is touched");
}

#[test]
fn a_top_that_is_gone_is_removed_already() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let gone = scratch.path().join("gone");
    remove(&gone, Busy::Kill, Instant::now()).expect("nothing to remove");
    remove(&scratch.path().join("no/such/parent"), Busy::Kill, Instant::now()).expect("nothing to remove");
    assert_eq!(processes(&gone).expect("counts"), 0);
    thaw(&gone).expect("nothing to thaw");
}

#[test]
fn what_cannot_be_emptied_is_left_and_named() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let top = scratch.path().join("sandbox");
    std::fs::create_dir_all(top.join("keep/inner")).expect("mkdir");
    // A plain file stands for a process: rmdir(2) refuses the directory.
    std::fs::write(top.join("keep/inner/held"), "").expect("a file");
    let error = remove(&top, Busy::Leave, Instant::now()).expect_err("a directory is held");
    assert!(matches!(&error, Error::Populated { path } if path == &top.join("keep/inner")), "{error}");
    assert!(top.join("keep/inner/held").exists(), "what is held is left as it was");
}

#[test]
fn thawing_outside_the_freezer_hierarchy_walks_nothing() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let top = scratch.path().join("sandbox");
    std::fs::create_dir_all(top.join("child")).expect("mkdir");
    // A freezer.state below a top without one is not looked at.
    std::fs::write(top.join("child/freezer.state"), "FROZEN\n").expect("a file");
    thaw(&top).expect("thaws");
    assert_eq!(std::fs::read_to_string(top.join("child/freezer.state")).expect("reads"), "FROZEN\n");
    // With one at the top, every level is thawed.
    std::fs::write(top.join("freezer.state"), "FROZEN\n").expect("a file");
    thaw(&top).expect("thaws");
    for file in ["freezer.state", "child/freezer.state"] {
        assert_eq!(std::fs::read_to_string(top.join(file)).expect("reads"), "THAWED", "{file}");
    }
}

#[test]
fn cgroup_events_say_whether_processes_are_left() {
    assert!(populated("populated 1\nfrozen 0\n"));
    assert!(!populated("populated 0\nfrozen 0\n"));
    assert!(!populated(""));
}

/// A cgroup hierarchy of this host to test in (root only), and a scratch
/// cgroup in it.
fn scratch_cgroup(controller: &str, name: &str) -> Option<PathBuf> {
    let hierarchy = [Path::new("/sys/fs/cgroup").join(controller), PathBuf::from("/sys/fs/cgroup")]
        .into_iter()
        .find(|h| h.join("cgroup.procs").exists() && (h.ends_with(controller) || h.join("cgroup.events").exists()))?;
    let dir = hierarchy.join(format!("moat-sys-test-{name}-{}", std::process::id()));
    match std::fs::create_dir(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            eprintln!("skipping: cannot make a cgroup in {} ({e}); needs root", hierarchy.display());
            None
        }
    }
}

/// A cgroup tree deeper than a path can name, a process in its deepest
/// cgroup: removed whole, the process killed and waited for.
#[test]
fn a_deep_cgroup_tree_with_a_process_is_emptied_and_removed() {
    let Some(top) = scratch_cgroup("pids", "deep") else { return };
    let name = long_name();
    chain(&top, &name, 24);
    let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
    // The deepest cgroup's procs file, reached through descriptors.
    let mut dir = nix::fcntl::open(&top, DIR, Mode::empty()).expect("opens the top");
    for level in 0..24 {
        dir = open_dir(dir.as_fd(), &CString::new(format!("{name}{level}")).expect("a name")).expect("opens");
    }
    let mut procs = open_file(dir.as_fd(), c"cgroup.procs", OFlag::O_WRONLY, &Trail { top: &top, names: Vec::new() })
        .expect("opens")
        .expect("a procs file");
    procs.write_all(sleeper.id().to_string().as_bytes()).expect("moves sleep into the deepest cgroup");
    drop((procs, dir));
    assert_eq!(processes(&top).expect("counts"), 1);
    let error = remove(&top, Busy::Leave, Instant::now()).expect_err("a process holds it");
    assert!(matches!(error, Error::Populated { .. }), "{error}");
    remove(&top, Busy::Kill, Instant::now() + Duration::from_secs(10)).expect("removes");
    assert!(!top.exists(), "the cgroup is removed");
    assert!(sleeper.wait().expect("reaps sleep").code().is_none(), "sleep was killed");
}

/// cgroup v1: a process in a frozen cgroup beneath a frozen one takes no
/// SIGKILL until both are thawed, the parent first.
#[test]
fn a_frozen_tree_is_thawed_from_the_top_and_removed() {
    let Some(top) = scratch_cgroup("freezer", "frozen") else { return };
    if !top.join("freezer.state").exists() {
        let _ = std::fs::remove_dir(&top);
        return eprintln!("skipping: no cgroup v1 freezer");
    }
    let inner = top.join("a/b");
    std::fs::create_dir_all(&inner).expect("mkdir");
    let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
    std::fs::write(inner.join("cgroup.procs"), sleeper.id().to_string()).expect("moves sleep");
    std::fs::write(inner.join("freezer.state"), "FROZEN").expect("freezes the inner cgroup");
    std::fs::write(top.join("freezer.state"), "FROZEN").expect("freezes the top");
    thaw(&top).expect("thaws");
    for dir in [&top, &top.join("a"), &inner] {
        let state = std::fs::read_to_string(dir.join("freezer.state")).expect("reads");
        assert_eq!(state.trim(), "THAWED", "{}", dir.display());
    }
    remove(&top, Busy::Kill, Instant::now() + Duration::from_secs(10)).expect("removes");
    assert!(!top.exists(), "the cgroup is removed");
    assert!(sleeper.wait().expect("reaps sleep").code().is_none(), "sleep was killed");
}

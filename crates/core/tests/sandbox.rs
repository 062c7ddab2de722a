//! The sandbox contract, end to end with real sandboxes from the `default`
//! image, and the attempts to escape them that must fail. The same tests
//! run for each backend: jails directly (`MOAT_TEST_BACKEND` unset or
//! `jail`), microVMs with `MOAT_TEST_BACKEND=vm` inside the nested test host.
//!
//! Ignored by plain `cargo test` (they need root, the built image and the
//! static agent); `cargo xtask test` provides all three and runs them.

use std::time::Duration;

use moat_core::{
    CoreError, CreateError, Language, Moat, MoatConfig, SandboxError, SandboxSpec, SandboxState, TaskError,
};
use moat_proto::{ExecRequest, ReadFileRequest, WriteFileRequest};

mod common;
use common::sh;

/// The backend under test.
fn backend() -> moat_core::BackendKind {
    std::env::var("MOAT_TEST_BACKEND")
        .map_or(moat_core::BackendKind::Jail, |b| b.parse().unwrap_or_else(|e| panic!("MOAT_TEST_BACKEND: {e}")))
}

async fn moat(max_sandboxes: usize) -> Moat {
    common::moat(backend(), max_sandboxes, moat_core::EgressConfig::default()).await
}

fn small() -> SandboxSpec {
    SandboxSpec { memory_mib: 256, disk_mib: 128, ..SandboxSpec::default() }
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_sandbox_runs_debian_as_user_and_moves_files() {
    let moat = moat(16).await;
    let spec = SandboxSpec { name: Some("box-one".into()), env: vec![("GREETING".into(), "hi".into())], ..small() };
    let sandbox = moat.create(spec).await.expect("created");
    assert_eq!(sandbox.state, SandboxState::Running);
    // In the nested host every guest instruction is emulated: numpy's
    // import is enough to show the image's Python works in a microVM
    // (pandas's, many times larger, runs in the jail run).
    let modules = if nested() { "numpy" } else { "numpy, pandas" };
    let (out, code) = sh(
        &moat,
        &sandbox.id,
        &format!(
            "id -un; pwd; hostname; . /etc/os-release; echo $ID; python3 -c 'import {modules}; print(numpy.__name__)'"
        ),
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["user", "/home/user", "box-one", "debian", "numpy"]);
    let (out, _) = sh(&moat, &sandbox.id, "echo $GREETING").await;
    assert_eq!(out, "hi\n", "the sandbox's env reaches its commands");
    // Scratch directories open to every process of the sandbox, each its
    // own (in a jail, none the image's tree on the host).
    let (out, code) = sh(&moat, &sandbox.id, "touch /tmp/a /var/tmp/a && stat -c %a /tmp /var/tmp").await;
    assert_eq!((out.as_str(), code), ("1777\n1777\n", Some(0)));
    // The wall clock is the host's (a microVM has no RTC: its kernel reads
    // the time from kvmclock), or TLS certificates would not be valid yet.
    let (out, _) = sh(&moat, &sandbox.id, "date +%s").await;
    let host = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs();
    let guest: u64 = out.trim().parse().expect("date +%s prints seconds");
    assert!(guest.abs_diff(host) < 600, "the sandbox's clock says {guest}, the host's {host}");

    let client = moat.client(&sandbox.id).await.expect("client");
    // Past every frame (4 MiB) and chunk (256 KiB) on the way: 64 MiB, or
    // 16 MiB in the nested host, whose vsock moves a few MiB a second.
    let size = if nested() { 16 << 20 } else { 64 << 20 };
    let data: Vec<u8> = (0..=255u8).cycle().take(size).collect();
    let req = WriteFileRequest {
        path: "/workspace/data.bin".into(),
        mode: None,
        create_parents: true,
        owner: Some("user".into()),
    };
    client.write_file(req, &mut data.as_slice()).await.expect("writes");
    let back = client
        .read_file(ReadFileRequest { path: "/workspace/data.bin".into(), offset: 0, length: None })
        .await
        .expect("reads");
    assert_eq!(back, data);
    let (owner, _) = sh(&moat, &sandbox.id, "stat -c %U /workspace/data.bin").await;
    assert_eq!(owner.trim(), "user");

    let mut archive = Vec::new();
    client.tar_out("/etc/apt", &mut archive).await.expect("tar out");
    client.tar_in("/home/user/apt-copy", Some("user".into()), &mut archive.as_slice()).await.expect("tar in");
    let (out, code) = sh(&moat, &sandbox.id, "diff -r /etc/apt /home/user/apt-copy && echo same").await;
    assert_eq!((out.trim(), code), ("same", Some(0)));

    let state = moat.data_dir().join("sandboxes").join(&sandbox.id);
    assert!(state.exists());
    moat.destroy(&sandbox.id).await.expect("destroyed");
    moat.settled().await;
    assert!(!state.exists(), "the state directory outlived the sandbox");
    assert!(matches!(
        moat.run(&sandbox.id, ExecRequest::shell("true")).await,
        Err(SandboxError::UnknownSandbox { .. })
    ));
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn idle_sandboxes_suspend_and_resume_transparently() {
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    moat.suspend(&sandbox.id).await.expect("suspends");
    let state = moat.get(&sandbox.id).expect("listed").state;
    if state != SandboxState::Paused {
        eprintln!("this host cannot freeze cgroups; suspend is a no-op here");
    }
    let (out, code) = sh(&moat, &sandbox.id, "echo awake").await;
    assert_eq!((out.as_str(), code), ("awake\n", Some(0)));
    assert_eq!(moat.get(&sandbox.id).expect("listed").state, SandboxState::Running);
    moat.destroy_all().await;
}

/// Idle is no call in flight. A command being waited for is use; a process
/// left in the background, and a Python session waiting for its next cell,
/// are not: the operator's idle time bounds a forgotten sandbox's work (it
/// kept the sandbox from ever being suspended before). Its work goes on
/// once the next call resumes it.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn background_work_is_no_use_and_a_call_in_flight_is() {
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();
    let (_, code) = sh(&moat, id, "setsid sleep 3000 >/dev/null 2>&1 &").await;
    assert_eq!(code, Some(0));
    let cell = |code: &'static str| {
        moat.run_code(id, Language::Python, code, Duration::from_secs(60), std::future::pending(), &|_, _| {})
    };
    assert_eq!(cell("x = 6 * 7\nx").await.expect("a started session").text, "42");
    let run = moat.run(id, ExecRequest::shell("touch /tmp/waited; sleep 2"));
    let idle_while_it_runs = async {
        while sh(&moat, id, "test -e /tmp/waited && echo yes").await.0.trim() != "yes" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        calls_closed().await;
        moat_core::moat::idle_now(&moat, id).await;
        moat.get(id).expect("listed").state
    };
    let (ran, state) = tokio::join!(run, idle_while_it_runs);
    assert_eq!(ran.expect("ran").status.code, Some(0));
    assert_eq!(state, SandboxState::Running, "suspended under a command being waited for");
    calls_closed().await;
    moat_core::moat::idle_now(&moat, id).await;
    let state = moat.get(id).expect("listed").state;
    if state == SandboxState::Running && !can_freeze(&moat, id).await {
        eprintln!("this host cannot freeze cgroups; nothing to check");
        moat.destroy_all().await;
        return;
    }
    assert_eq!(state, SandboxState::Paused, "a background process or a waiting session kept the sandbox in use");
    let (out, _) = sh(&moat, id, "pgrep -x sleep >/dev/null && echo running").await;
    assert_eq!(out, "running\n", "the background process goes on after the resume");
    assert_eq!(moat.get(id).expect("listed").state, SandboxState::Running);
    assert_eq!(cell("x").await.expect("the same session").text, "42");
    moat.destroy_all().await;
}

/// A sandbox whose suspend does not answer (in life, a microVM whose VMM
/// a guest keeps busy; here, a switch held back) holds up no other
/// sandbox's calls, nor the listing: it was flipped with the lock of every
/// sandbox held. Its own next call waits for the suspend, then resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_sandbox_slow_to_suspend_holds_up_no_other() {
    let moat = moat(16).await;
    let (slow, other) = (moat.create(small()).await.expect("created"), moat.create(small()).await.expect("created"));
    if !can_freeze(&moat, &slow.id).await {
        eprintln!("this host cannot freeze cgroups; nothing to check");
        moat.destroy_all().await;
        return;
    }
    let (release, mut flips) = moat_core::moat::slow_power(&moat, &slow.id);
    let suspending = tokio::spawn({
        let (moat, id) = (moat.clone(), slow.id.clone());
        async move { moat.suspend(&id).await }
    });
    assert_eq!(flips.recv().await, Some(true), "the suspend began");
    let resuming = tokio::spawn({
        let (moat, id) = (moat.clone(), slow.id.clone());
        async move { moat.client(&id).await.map(drop) }
    });
    // A guard against a hang, not a measure: held up, this never ends, and
    // the runtime's threads may all be stuck with it (waiting for the lock
    // of every sandbox), so the guard waits on this thread and ends the
    // process.
    let (done, others) = std::sync::mpsc::channel();
    tokio::spawn({
        let (moat, id) = (moat.clone(), other.id.clone());
        async move {
            let (out, code) = sh(&moat, &id, "echo free").await;
            let _ = done.send((out, code, moat.list().len()));
        }
    });
    let Ok((out, code, listed)) = others.recv_timeout(Duration::from_secs(120)) else {
        eprintln!("another sandbox's suspend held up a call to this one and the listing");
        std::process::exit(101);
    };
    assert_eq!((out.as_str(), code, listed), ("free\n", Some(0), 2));
    assert!(!resuming.is_finished(), "a call to the sandbox being suspended went ahead of its suspend");
    release.send(()).expect("the suspend waits");
    suspending.await.expect("joined").expect("suspends");
    assert_eq!(flips.recv().await, Some(false), "the waiting call resumes it");
    drop(release);
    resuming.await.expect("joined").expect("resumes");
    assert_eq!(moat.get(&slow.id).expect("listed").state, SandboxState::Running);
    assert_eq!(sh(&moat, &slow.id, "echo awake").await.0, "awake\n");
    moat.destroy_all().await;
}

/// Lets the tasks of the calls just answered end: a finished command's
/// connection closes when its aborted tasks are dropped, which this
/// (one-thread) runtime does before a timer's task runs again.
async fn calls_closed() {
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Whether sandbox `id` can be frozen here (it is left running).
async fn can_freeze(moat: &Moat, id: &str) -> bool {
    moat.suspend(id).await.expect("suspends");
    let frozen = moat.get(id).expect("listed").state == SandboxState::Paused;
    moat.client(id).await.expect("resumes");
    frozen
}

/// A sandbox whose agent stops answering mid-command (here: frozen by
/// suspend behind the command's back; in life, a wedged guest kernel) is
/// reported once the command's timeout and the grace after it pass, not
/// waited on forever.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_stuck_sandbox_is_reported_not_waited_on() {
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();
    let mut request = ExecRequest::shell("touch /tmp/started; sleep 600");
    // Long enough for the freeze below to come first: in the nested host,
    // under TCG, the polls that see both started take seconds each.
    let timeout = if nested() { 30 } else { 5 };
    request.timeout_ms = Some(timeout * 1000);
    let waited = timeout + moat_core::timing::ANSWER_GRACE.as_secs();
    let run = moat.run(id, request);
    // A bash cell too: run_code's wait is bounded the same way.
    let cell = "touch /tmp/cell-started; sleep 600";
    let code = moat.run_code(
        id,
        moat_core::Language::Bash,
        cell,
        Duration::from_secs(timeout),
        std::future::pending(),
        &|_, _| {},
    );
    let freeze = async {
        // Frozen once both run (a suspended sandbox's next request would
        // resume it).
        let both = "test -e /tmp/started && test -e /tmp/cell-started && echo yes";
        while sh(&moat, id, both).await.0.trim() != "yes" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        moat.suspend(id).await
    };
    let (result, code_result, suspended) = tokio::join!(run, code, freeze);
    suspended.expect("suspends");
    if moat.get(id).expect("listed").state == SandboxState::Paused {
        let err = result.expect_err("a frozen agent cannot answer");
        assert!(matches!(err, SandboxError::Unresponsive { waited_s, .. } if waited_s == waited), "{err}");
        assert!(err.to_string().contains("Destroy it and create another"), "{err}");
        let err = code_result.expect_err("nor run a cell");
        assert!(matches!(err, SandboxError::Unresponsive { waited_s, .. } if waited_s == waited), "{err}");
    } else {
        eprintln!("this host cannot freeze cgroups; nothing to check");
    }
    moat.client(id).await.expect("resumes");
    moat.destroy_all().await;
}

/// A Python session whose interpreter never becomes ready (here: a user
/// site hook that sleeps; in life, an overloaded or wedged guest) is given
/// up once the cell's timeout and the grace after it pass, its runner is
/// stopped, and the next cell starts a fresh session.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_python_session_that_never_starts_is_given_up() {
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();
    // Python imports `usercustomize` from the user's site directory as it starts.
    let hook = r#"d=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p "$d" &&
        echo 'import time; time.sleep(600)' > "$d/usercustomize.py" && echo "$d""#;
    let (dir, code) = sh(&moat, id, hook).await;
    assert_eq!(code, Some(0), "{dir}");
    let python = |code: &'static str, timeout: u64| {
        moat.run_code(id, Language::Python, code, Duration::from_secs(timeout), std::future::pending(), &|_, _| {})
    };
    let err = python("1 + 1", 1).await.expect_err("the session never becomes ready");
    assert!(matches!(err, SandboxError::CodeSession { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("python3 was not ready within 31 s") && text.contains("destroy the sandbox and create another"),
        "{text}"
    );
    // The runner was stopped with its connection (the agent kills it).
    let mut left = String::new();
    for _ in 0..300 {
        left = sh(&moat, id, "pgrep -a python3 || true").await.0;
        if left.trim().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(left.trim().is_empty(), "the stalled runner is still there: {left}");
    sh(&moat, id, &format!("rm {}/usercustomize.py", dir.trim())).await;
    let out = python("6 * 7", 60).await.expect("a fresh session");
    assert_eq!(out.text, "42", "{out:?}");
    moat.destroy_all().await;
}

/// A Python cell that goes on past its interrupt — catching
/// KeyboardInterrupt, or ignoring SIGINT, and printing meanwhile — ends
/// at its timeout and the grace after it, however often it prints: the
/// session is stopped, and the next cell starts a fresh one.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_python_cell_that_outlives_its_interrupt_is_stopped_at_the_grace() {
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();
    // The session is started first, with a timeout a slow host (the
    // nested host's level 2 under TCG) needs: a stalled cell's 2 s would
    // also bound python3's start, which is not what this test is about.
    let first = moat
        .run_code(id, Language::Python, "6 * 7", Duration::from_secs(60), std::future::pending(), &|_, _| {})
        .await
        .expect("a started session");
    assert_eq!(first.text, "42", "{first:?}");
    let cells = [
        "import time\nwhile True:\n    try:\n        print('on', flush=True); time.sleep(0.5)\n    except KeyboardInterrupt:\n        pass",
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    print('on', flush=True); time.sleep(0.5)",
    ];
    for cell in cells {
        let run = moat.run_code(id, Language::Python, cell, Duration::from_secs(2), std::future::pending(), &|_, _| {});
        // The timeout (2 s) and the grace (5 s), with room for a slow host;
        // before, each line printed started the grace again, for ever.
        let out = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the cell is stopped, not waited on while it prints")
            .expect("an answer");
        let error = out.error.clone().expect("stopped");
        assert_eq!(error.name, "TimeoutError", "{error:?}");
        assert!(error.value.contains("did not stop when interrupted"), "{error:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("on"), "{out:?}");
        let fresh = moat
            .run_code(id, Language::Python, "6 * 7", Duration::from_secs(60), std::future::pending(), &|_, _| {})
            .await
            .expect("a fresh session");
        assert_eq!(fresh.text, "42", "{fresh:?}");
    }
    moat.destroy_all().await;
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn expired_sandboxes_are_destroyed_and_limits_hold() {
    let moat = moat(2).await;
    let a = moat.create(small()).await.expect("first");
    let _b = moat.create(small()).await.expect("second");
    let err = moat.create(small()).await.expect_err("over the limit");
    assert!(matches!(err, CreateError::LimitReached { max: 2 }), "{err}");
    moat_core::moat::expire_now(&moat, &a.id);
    let err = moat.run(&a.id, ExecRequest::shell("true")).await.expect_err("expired");
    assert!(matches!(err, SandboxError::Expired(_)), "{err}");
    assert!(err.to_string().contains("create a new one"), "{err}");
    moat.create(small()).await.expect("room again after expiry");
    moat.destroy_all().await;
}

/// `MOAT_MAX_MEMORY_MIB` holds however many creates run at once: each is
/// admitted, its memory held, before it starts, so none past the limit is
/// ever started (the state directories made are counted by inotify); and
/// a jail's `disk_mib` counts, its disk being memory (256 + 128 MiB each:
/// two fit in 1000 MiB, where three would by `memory_mib` alone).
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn concurrent_creates_never_start_past_the_memory_limit() {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    if backend() != moat_core::BackendKind::Jail {
        return;
    }
    let top = tempfile::tempdir().expect("tempdir");
    let data = top.path().join("data");
    let sandboxes = data.join("sandboxes");
    std::fs::create_dir_all(&sandboxes).expect("mkdir");
    std::os::unix::fs::symlink(moat_core::image::data_dir().join("images"), data.join("images")).expect("images");
    let config = MoatConfig {
        data_dir: data.clone(),
        max_memory_mib: Some(1000),
        ..common::config(backend(), 16, moat_core::EgressConfig::default())
    };
    let moat = Moat::new(config).await.expect("moat starts");
    let watch = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify");
    watch.add_watch(&sandboxes, AddWatchFlags::IN_CREATE).expect("watch");
    let mut creates = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let moat = moat.clone();
        creates.spawn(async move { moat.create(small()).await });
    }
    let results = creates.join_all().await;
    let made = std::iter::from_fn(|| watch.read_events().ok().filter(|events| !events.is_empty()))
        .flatten()
        .filter(|event| event.mask.contains(AddWatchFlags::IN_ISDIR))
        .count();
    let refusals: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(ToString::to_string).collect();
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2, "{refusals:?}");
    for refusal in &refusals {
        assert!(
            refusal.contains("memory_mib 256 and disk_mib 128") && refusal.contains("MOAT_MAX_MEMORY_MIB"),
            "{refusal}"
        );
    }
    assert_eq!(made, 2, "sandboxes started past the limit: {refusals:?}");
    moat.destroy_all().await;
}

/// Rootless: jails join the user namespace that the user's holder keeps
/// mapped (moat_agent::userns_holder) instead of mapping one each; one
/// that a false holder offers (other maps) is refused, the jail maps its
/// own and a holder of its own replaces the false one. Each sandbox still
/// has a user namespace of its own beneath.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn rootless_jails_join_the_held_namespace_and_refuse_a_false_one() {
    if !rootless() {
        return;
    }
    let moat = moat(16).await;
    let data = moat_core::image::data_dir();
    let socket = data.join(moat_core::backend::jail::USERNS_SOCKET);
    let monitor_ns = |id: &str| -> (String, String) {
        let pid = moat_core::state::live_monitor(&data.join("sandboxes").join(id)).expect("monitor pid");
        let ns = std::fs::read_link(format!("/proc/{pid}/ns/user")).expect("the monitor's namespace");
        let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).expect("its uid_map");
        (ns.to_string_lossy().into_owned(), map.split_whitespace().collect::<Vec<_>>().join(" "))
    };
    // The first jail's monitor is gone when the second starts: the
    // namespace is the holder's to give.
    let first = moat.create(small()).await.expect("created");
    let (ns1, map1) = monitor_ns(&first.id);
    moat.destroy(&first.id).await.expect("destroyed");
    moat.settled().await;
    let second = moat.create(small()).await.expect("created");
    let beside = moat.create(small()).await.expect("created");
    let (ns2, _) = monitor_ns(&second.id);
    assert_eq!(ns1, ns2, "the second jail did not join the namespace the first mapped");
    assert_eq!(monitor_ns(&beside.id).0, ns1, "the third jail did not join it either");
    let account = nix::unistd::getuid().as_raw();
    assert!(map1.starts_with(&format!("0 {account} 1 1 ")), "the held namespace maps {map1}");
    // The sandboxes' own namespaces lie beneath, one each.
    let (out1, _) = sh(&moat, &beside.id, "readlink /proc/self/ns/user").await;
    let (out2, _) = sh(&moat, &second.id, "readlink /proc/self/ns/user").await;
    assert_ne!(out1, out2, "two sandboxes share a user namespace");
    assert_ne!(out1.trim(), ns1, "a sandbox runs in the held namespace itself");

    // A false holder: a process of this user's in a namespace with other
    // maps (its root is the account itself), serving its own namespace
    // where the real holder serves.
    let tmp = data.join(".false-holder.sock");
    let _ = std::fs::remove_file(&tmp);
    let mut other = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "python3", "-c", FALSE_HOLDER])
        .arg(&tmp)
        .arg(&socket)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("unshare(1) starts");
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(other.stdout.take().expect("stdout")), &mut ready)
        .expect("the false holder starts");
    let other_ns = ready.trim().strip_prefix("serving ").expect("the false holder's namespace").to_owned();
    let third = moat.create(small()).await.expect("a false holder does not stop a jail");
    assert!(other.wait().expect("the false holder ends").success(), "the false holder was not asked");
    let (ns3, map3) = monitor_ns(&third.id);
    assert_ne!(ns3, other_ns, "the jail joined the false holder's namespace");
    assert_eq!(map3, map1, "the jail's own namespace maps other ids");
    let log = std::fs::read_to_string(data.join("sandboxes").join(&third.id).join("jail.log")).unwrap_or_default();
    assert!(log.contains("the held namespace maps"), "the refusal is not in the jail's log:\n{log}");
    // It started a holder of its own there, which the next jail joins.
    let fourth = moat.create(small()).await.expect("created");
    assert_eq!(monitor_ns(&fourth.id).0, ns3, "the next jail did not join the new holder's namespace");
    let (out, code) = sh(&moat, &fourth.id, "id -un").await;
    assert_eq!((out.as_str(), code), ("user\n", Some(0)));
    moat.destroy_all().await;
}

/// [`rootless_jails_join_the_held_namespace_and_refuse_a_false_one`]'s false
/// holder (Python, run under `unshare --user --map-root-user`): binds argv[1],
/// renames it to argv[2], says which namespace it serves, and hands that
/// namespace to one caller.
const FALSE_HOLDER: &str = r#"
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1]); s.listen(1); os.rename(sys.argv[1], sys.argv[2])
print("serving", os.readlink("/proc/self/ns/user"), flush=True)
s.settimeout(60)
c, _ = s.accept()
socket.send_fds(c, [b"n"], [os.open("/proc/self/ns/user", os.O_RDONLY)])
c.settimeout(5); c.recv(1)
"#;

/// The owner of a suspended sandbox is killed with SIGKILL: the sandbox
/// dies with it, a background process too, and the next `Moat` sweeps its
/// state directory.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn sandboxes_never_outlive_a_killed_owner() {
    if std::env::var_os("MOAT_TEST_OWNER").is_some() {
        let moat = moat(16).await;
        let sandbox = moat.create(small()).await.expect("created");
        // Idle with work in the background, as moat leaves a sandbox no
        // call has used for a while: suspended (on a cgroup v1 host,
        // frozen, its monitor too, which then takes no signal at all).
        let (_, code) = sh(&moat, &sandbox.id, "setsid sleep 3000 >/dev/null 2>&1 &").await;
        assert_eq!(code, Some(0));
        moat.suspend(&sandbox.id).await.expect("suspends");
        // The parent test reads the id from this process's stdout.
        #[allow(clippy::print_stdout)]
        {
            println!("SANDBOX {}", sandbox.id);
        }
        tokio::time::sleep(Duration::from_secs(600)).await;
        return;
    }
    let mut owner = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "sandboxes_never_outlive_a_killed_owner", "--include-ignored", "--nocapture"])
        .env("MOAT_TEST_OWNER", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("owner starts");
    let mut reader = std::io::BufReader::new(owner.stdout.take().expect("stdout"));
    // The line may follow libtest's own "test … ... " (it prints the name
    // first when it runs one test at a time, as on a one-CPU machine).
    let mut line = String::new();
    let mut said = String::new();
    let id = loop {
        line.clear();
        let n = std::io::BufRead::read_line(&mut reader, &mut line).expect("reads");
        if n == 0 {
            let mut stderr = String::new();
            let _ = std::io::Read::read_to_string(&mut owner.stderr.take().expect("stderr"), &mut stderr);
            let status = owner.wait().expect("reaped");
            panic!("the owner exited ({status}) before creating its sandbox:\n{said}\n{stderr}");
        }
        if let Some((_, id)) = line.split_once("SANDBOX ") {
            break id.trim().to_owned();
        }
        said.push_str(&line);
    };
    let state = moat_core::image::data_dir().join("sandboxes").join(&id);
    let monitor: i32 = moat_core::state::live_monitor(&state).expect("monitor pid");
    owner.kill().expect("SIGKILL");
    owner.wait().expect("reaped");
    // The monitor dies with its owner (PR_SET_PDEATHSIG), and the sandbox's
    // pid namespace with it.
    for _ in 0..500 {
        if !std::path::Path::new(&format!("/proc/{monitor}")).exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!std::path::Path::new(&format!("/proc/{monitor}")).exists(), "the sandbox outlived its owner");
    // And so does everything inside: no process is left in the sandbox's
    // cgroups (its init's parent-death signal must survive its change of
    // credentials, which clears it).
    let left = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|p| p.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
            .filter(|p| std::fs::read_to_string(p.path().join("cgroup")).is_ok_and(|c| c.contains(&id)))
            .map(|p| {
                let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                format!("{} {}", p.file_name().to_string_lossy(), String::from_utf8_lossy(&cmdline).replace('\0', " "))
            })
            .collect()
    };
    for _ in 0..500 {
        if left().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(left(), Vec::<String>::new(), "processes of the sandbox outlived its owner");
    assert!(state.exists(), "nothing swept yet");
    let _moat = moat(16).await;
    // The sweep runs beside the new Moat's first creates, not before them.
    for _ in 0..1000 {
        if !state.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!state.exists(), "the next Moat must sweep the dead owner's state");
}

/// Sandbox root (jail only: a microVM's root acts on its own kernel) meets
/// a closed kernel surface: every call below fails, no new user namespace
/// hands capabilities back, the capability sets are Docker's default less
/// `CAP_NET_RAW` and `CAP_MKNOD`, the agent cannot be traced, and ordinary
/// tools (git, python, node, pip, npm) still work afterwards.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn the_kernel_surface_is_closed_to_sandbox_root() {
    if backend() != moat_core::BackendKind::Jail {
        return;
    }
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();
    let as_root = |script: &str| {
        let mut req = ExecRequest::shell(script);
        req.user = Some("root".into());
        req
    };
    let stdout = |out: &moat_proto::Output| String::from_utf8_lossy(&out.stdout).into_owned();

    // Threat: the kernel's attack surface from inside (namespaces, the
    // mount API, bpf, io_uring, keyrings, modules, the clock). Each call
    // prints "name result errno"; all must fail with EPERM, clone3 with
    // ENOSYS (so that libc falls back to clone).
    let calls = [
        ("unshare(CLONE_NEWUSER)", 272, "0x10000000"),
        ("unshare(CLONE_NEWNET)", 272, "0x40000000"),
        ("unshare(CLONE_NEWNS)", 272, "0x20000"),
        ("clone(CLONE_NEWUSER)", 56, "0x10000011"),
        ("setns", 308, "0"),
        ("keyctl", 250, "0"),
        ("add_key", 248, "0"),
        ("request_key", 249, "0"),
        ("bpf", 321, "0"),
        ("userfaultfd", 323, "0"),
        ("perf_event_open", 298, "0"),
        ("io_uring_setup", 425, "0"),
        ("io_uring_enter", 426, "0"),
        ("io_uring_register", 427, "0"),
        ("mount", 165, "0"),
        ("umount2", 166, "0"),
        ("pivot_root", 155, "0"),
        ("fsopen", 430, "0"),
        ("fsconfig", 431, "0"),
        ("fsmount", 432, "0"),
        ("fspick", 433, "0"),
        ("open_tree", 428, "0"),
        ("move_mount", 429, "0"),
        ("mount_setattr", 442, "0"),
        ("kexec_load", 246, "0"),
        ("kexec_file_load", 320, "0"),
        ("init_module", 175, "0"),
        ("finit_module", 313, "0"),
        ("delete_module", 176, "0"),
        ("swapon", 167, "0"),
        ("swapoff", 168, "0"),
        ("reboot", 169, "0"),
        ("settimeofday", 164, "0"),
        ("clock_settime", 227, "0"),
        ("adjtimex", 159, "0"),
        ("acct", 163, "0"),
        ("quotactl", 179, "0"),
        ("lookup_dcookie", 212, "0"),
        ("name_to_handle_at", 303, "0"),
        ("open_by_handle_at", 304, "0"),
        ("modify_ldt", 154, "0"),
        ("iopl", 172, "0"),
        ("ioperm", 173, "0"),
        ("personality(ADDR_NO_RANDOMIZE)", 135, "0x0040000"),
        ("clone3", 435, "0"),
    ];
    let mut script = String::from("import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\nparent = os.getpid()\n");
    for (name, nr, arg) in calls {
        script.push_str(&format!(
            "ctypes.set_errno(0); r = l.syscall({nr}, ctypes.c_long({arg}), 0, 0, 0, 0, 0)\n\
             print({name:?}, r, ctypes.get_errno() if r < 0 else 0)\n\
             os.getpid() != parent and os._exit(0)\n"
        ));
    }
    let out = moat.run(id, as_root(&format!("python3 - <<'EOF'\n{script}EOF"))).await.expect("runs");
    let said = stdout(&out);
    for (name, _, _) in calls {
        let expected = if name == "clone3" { "-1 38" } else { "-1 1" };
        let line = said.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_default();
        assert_eq!(line.strip_prefix(name).map(str::trim), Some(expected), "{name} must fail: {said}");
    }

    // Threat: making cgroups until the host has no memory cgroup id left
    // (65535 for the whole host). On cgroup v2, `user` takes at most 1024
    // beneath it, 2 deep; its bounds are root's (cgroup v1 has no such
    // bound: docs/security.md).
    let out = moat
        .run(
            id,
            as_root(
                "cd /.moat/cgroup/unified 2>/dev/null || { echo v1; exit; }; \
                 mkdir d1 d1/a && mkdir d1/a/b 2>&1 | head -1; rmdir d1/a d1; \
                 i=0; while [ $i -lt 1100 ] && mkdir m$i 2>/dev/null; do i=$((i+1)); done; echo made $i; \
                 { echo 9 > cgroup.max.descendants; } 2>&1 | head -1; rmdir m* 2>/dev/null; true",
            ),
        )
        .await
        .expect("runs");
    let said = stdout(&out);
    if !said.starts_with("v1") {
        let made: usize = said.lines().find_map(|l| l.strip_prefix("made ")?.trim().parse().ok()).unwrap_or(usize::MAX);
        assert!(made < 1024, "sandbox root made {made} cgroups: {said}");
        assert!(said.contains("Resource temporarily unavailable"), "a third level was made: {said}");
        assert!(said.contains("Permission denied"), "sandbox root changed its own bound: {said}");
    }

    // Threat: a new user namespace through the ordinary tools.
    let out = moat
        .run(id, as_root("unshare --user --map-root-user true 2>&1; echo $?; unshare --net true 2>&1; echo $?"))
        .await;
    let said = stdout(&out.expect("runs"));
    let codes: Vec<&str> = said.lines().filter(|l| l.parse::<i32>().is_ok()).collect();
    assert_eq!(codes.len(), 2, "{said}");
    assert!(codes.iter().all(|c| *c != "0"), "unshare made a namespace: {said}");

    // Threat: nf_tables and friends (root tooling over netlink).
    let out = moat
        .run(id, as_root("python3 -c 'import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)' 2>&1"))
        .await
        .expect("runs");
    assert!(stdout(&out).contains("Operation not permitted"), "NETLINK_NETFILTER opened: {}", stdout(&out));

    // Threat: capabilities sandbox root does not need. Root's sets are
    // Docker's default less CAP_NET_RAW and CAP_MKNOD; user's are empty.
    let out = moat.run(id, as_root("grep ^Cap /proc/self/status")).await.expect("runs");
    let caps = stdout(&out);
    for (set, mask) in [
        ("CapBnd", "00000000a00405fb"),
        ("CapEff", "00000000a00405fb"),
        ("CapPrm", "00000000a00405fb"),
        ("CapInh", "0000000000000000"),
        ("CapAmb", "0000000000000000"),
    ] {
        assert!(caps.contains(&format!("{set}:\t{mask}")), "{set} must be {mask}: {caps}");
    }
    let (caps, _) = sh(&moat, id, "grep ^CapEff /proc/self/status").await;
    assert_eq!(caps.trim(), "CapEff:\t0000000000000000");

    // Threat: tracing or reading the agent (moat's side of the sandbox).
    let out = moat
        .run(
            id,
            as_root(
                "python3 -c 'import ctypes; l=ctypes.CDLL(None,use_errno=True); print(l.ptrace(16, 1, 0, 0), ctypes.get_errno())'; \
                 cat /proc/1/environ >/dev/null 2>&1; echo $?; cat /proc/1/maps >/dev/null 2>&1; echo $?",
            ),
        )
        .await
        .expect("runs");
    let said = stdout(&out);
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.first().copied(), Some("-1 1"), "PTRACE_ATTACH to the agent: {said}");
    assert!(lines.iter().skip(1).all(|l| *l != "0"), "the agent's environment or memory map was read: {said}");
    // On a cgroup v1 host a command's parent is its cgroup's launcher
    // (after the sandbox's first command): as closed as the agent.
    let out = moat
        .run(
            id,
            as_root(
                "if tr '\\0' ' ' < /proc/$PPID/cmdline | grep -q '^moat-agent launcher'; then \
                 python3 -c 'import ctypes, sys; l=ctypes.CDLL(None,use_errno=True); print(l.ptrace(16, int(sys.argv[1]), 0, 0), ctypes.get_errno())' $PPID; \
                 cat /proc/$PPID/environ >/dev/null 2>&1; echo $?; cat /proc/$PPID/maps >/dev/null 2>&1; echo $?; \
                 else echo no launcher; fi",
            ),
        )
        .await
        .expect("runs");
    let said = stdout(&out);
    if said.trim() != "no launcher" {
        let lines: Vec<&str> = said.lines().collect();
        assert_eq!(
            lines.first().copied(),
            Some("-1 1"),
            "PTRACE_ATTACH to a launcher: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(lines.iter().skip(1).all(|l| *l != "0"), "a launcher's environment or memory map was read: {said}");
    }

    // And the sandbox still works: the agent, and what people run in it.
    let script = "cd /tmp && git init -q r && cd r && git -c user.email=a@b.c -c user.name=n commit -q --allow-empty -m x \
         && git log --oneline | wc -l; \
         python3 -c 'import threading, multiprocessing, subprocess, socket; \
         t = threading.Thread(target=print, args=(\"thread\",)); t.start(); t.join(); \
         print(multiprocessing.Pool(2).map(abs, [-1, -2])); subprocess.run([\"true\"], check=True); \
         socket.getaddrinfo(\"localhost\", 80); print(\"python\")'; \
         node -e 'console.log(require(\"child_process\").execSync(\"echo node\").toString().trim()); require(\"os\").networkInterfaces()'; \
         pip --version >/dev/null && echo pip; npm --version >/dev/null && echo npm";
    let (out, code) = sh(&moat, id, script).await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["1", "thread", "[1, 2]", "python", "node", "pip", "npm"], "{out}");
    let out = moat
        .run(id, as_root("touch /tmp/owned && chown user:user /tmp/owned && stat -c %U /tmp/owned"))
        .await
        .expect("runs");
    assert_eq!(stdout(&out).trim(), "user");
    moat.destroy_all().await;
}

/// Threat: a descriptor that whatever started moat left open without
/// close-on-exec (here the host's `/`, the worst there is) reaches the
/// sandbox through the monitor and the agent, and a command walks the
/// host's files through it. Commands see their three streams and nothing
/// else, as root or as `user`, on every path a command starts by.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_descriptor_moat_inherited_never_reaches_a_command() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    const LEAKED: i32 = 200;
    let root = nix::fcntl::open(
        "/",
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
        nix::sys::stat::Mode::empty(),
    )
    .expect("open /");
    // SAFETY: dup2 onto a number this test process does not use; the
    // result is owned here and closed at the end.
    let leaked = unsafe {
        assert_eq!(libc::dup2(root.as_raw_fd(), LEAKED), LEAKED, "dup2");
        OwnedFd::from_raw_fd(LEAKED)
    };
    drop(root);
    let moat = moat(4).await;
    let sandbox = moat.create(small()).await.expect("created");
    let list = "ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; ls /proc/self/fd/200/ 2>&1 | head -3";
    let mut as_root = ExecRequest::shell(list);
    as_root.user = Some("root".into());
    for request in [ExecRequest::shell(list), as_root.clone(), ExecRequest::shell(list)] {
        let out = moat.run(&sandbox.id, request).await.expect("runs");
        let said = String::from_utf8_lossy(&out.stdout);
        // 0-2, and 3: the directory `ls` is reading.
        assert!(said.starts_with("0 1 2 3 \n"), "a command holds more than its streams: {said}");
        assert!(said.contains("No such file or directory") && !said.contains("etc"), "{said}");
    }
    let (out, _) = sh(&moat, &sandbox.id, "sleep 1 & ls /proc/self/fd | wc -l; wait").await;
    assert_eq!(out.trim(), "4", "a background command's sibling: {out}");
    moat.destroy_all().await;
    drop(leaked);
}

/// Threat: a sandbox spends host root's per-user kernel budgets. The
/// kernel charges what a user namespace's processes hold to its owner at
/// each level up; a sandbox whose namespace host root owned could take
/// all 128 inotify instances root has by default, and systemd's, udev's
/// and every root process's next one would fail. The sandbox's namespace
/// is owned by the uid its root maps to, so root's budget is untouched;
/// and as each of root's jails maps its own range, another sandbox's is
/// too.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_sandbox_spends_no_one_elses_kernel_budgets() {
    if backend() != moat_core::BackendKind::Jail || !nix::unistd::geteuid().is_root() {
        return;
    }
    let limit: usize =
        std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").expect("limit").trim().parse().expect("n");
    let moat = moat(4).await;
    let sandbox = moat.create(small()).await.expect("created");
    let hold = format!(
        "python3 -c 'import ctypes, time; l = ctypes.CDLL(None); \
         held = [f for f in (l.inotify_init1(0) for _ in range({})) if f >= 0]; \
         open(\"/tmp/held\", \"w\").write(str(len(held))); time.sleep(20)'",
        limit + 16
    );
    let holder = tokio::spawn({
        let (moat, id) = (moat.clone(), sandbox.id.clone());
        async move { sh(&moat, &id, &hold).await }
    });
    let mut held = String::new();
    for _ in 0..200 {
        held = sh(&moat, &sandbox.id, "cat /tmp/held 2>/dev/null").await.0;
        if !held.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held: usize = held.trim().parse().unwrap_or_else(|_| panic!("the sandbox did not report: {held:?}"));
    assert!(held >= limit / 2, "the sandbox got {held} instances of its own");
    // Root here is one of host root's processes: it still gets one.
    let root = nix::sys::inotify::Inotify::init(nix::sys::inotify::InitFlags::IN_CLOEXEC);
    assert!(root.is_ok(), "host root has no inotify instance left while a sandbox holds {held}: {root:?}");
    // So does another sandbox, whose ids are a host range of their own
    // where the image's file system can be idmapped (root's jails, see
    // moat_core::backend::ids), and it sees the image's files as its own.
    let image = moat.data_dir().join("images/default/rootfs");
    if moat_core::backend::ids::shared_because(&image).is_none() {
        let other = moat.create(small()).await.expect("a second sandbox");
        let (out, code) = sh(
            &moat,
            &other.id,
            "python3 -c 'import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)'; \\
             stat -c '%u:%g' /etc/passwd /usr/bin; cat /proc/self/uid_map",
        )
        .await;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(code, Some(0), "{out}");
        assert_eq!(
            lines.first(),
            Some(&"True"),
            "a second sandbox got no inotify instance while the first holds {held}: {out}"
        );
        assert_eq!(lines.get(1..3), Some(&["0:0", "0:0"][..]), "the image's files are not sandbox root's: {out}");
        // Root changes an image file: the copy is root's too.
        let mut copy_up = ExecRequest::shell("echo copied >> /etc/issue && stat -c '%u:%g' /etc/issue");
        copy_up.user = Some("root".into());
        let copied = moat.run(&other.id, copy_up).await.expect("runs");
        assert_eq!(String::from_utf8_lossy(&copied.stdout).trim(), "0:0", "{copied:?}");
        let (first_map, _) = sh(&moat, &sandbox.id, "cat /proc/self/uid_map").await;
        let host_id = |map: &str| map.split_whitespace().nth(1).map(str::to_owned);
        assert_ne!(
            host_id(&first_map),
            host_id(lines.get(3).copied().unwrap_or_default()),
            "two sandboxes map the same host ids"
        );
    }
    // And the sandbox's owner is the uid its root maps to, not host root.
    let monitor = moat.host_pid(&sandbox.id).expect("monitor");
    let children = std::fs::read_to_string(format!("/proc/{monitor}/task/{monitor}/children")).expect("children");
    let own_ns = std::fs::read_link("/proc/self/ns/user").ok();
    let init = children
        .split_whitespace()
        .find(|pid| std::fs::read_link(format!("/proc/{pid}/ns/user")).ok() != own_ns)
        .expect("the sandbox's init among the monitor's children");
    let ns = std::fs::File::open(format!("/proc/{init}/ns/user")).expect("its user namespace");
    let mut owner: libc::uid_t = u32::MAX;
    // SAFETY: NS_GET_OWNER_UID writes one uid_t into the given pointer.
    let done = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&ns), 0xb704, &mut owner) };
    assert_eq!(done, 0, "NS_GET_OWNER_UID: {}", std::io::Error::last_os_error());
    assert_ne!(owner, 0, "host root owns the sandbox's user namespace");
    moat.destroy_all().await;
    let _ = holder.await;
}

/// After an attack, the sandbox still answers.
async fn still_answers(moat: &Moat, id: &str) {
    let (out, _) = sh(moat, id, "echo still-here").await;
    assert_eq!(out.trim(), "still-here");
}

/// A Moat and the small sandbox the hostile tests attack from.
async fn hostile() -> (Moat, moat_core::Sandbox) {
    let moat = moat(16).await;
    let spec = SandboxSpec { memory_mib: 128, disk_mib: 64, ..SandboxSpec::default() };
    let sandbox = moat.create(spec).await.expect("created");
    (moat, sandbox)
}

/// Each check names the threat it guards against.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn escapes_fail() {
    let (moat, sandbox) = hostile().await;
    let id = sandbox.id.as_str();
    let jail = backend() == moat_core::BackendKind::Jail;
    let as_root = |script: &str| {
        let mut req = ExecRequest::shell(script);
        req.user = Some("root".into());
        req
    };

    // Threat: reading host files outside what the sandbox was given.
    let marker = moat.data_dir().join("escape-marker");
    std::fs::write(&marker, "host secret").expect("marker");
    let (out, _) = sh(&moat, id, &format!("cat {} 2>&1; cat /etc/shadow 2>&1 | head -1", marker.display())).await;
    assert!(!out.contains("host secret"), "{out}");
    let host_shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    assert!(host_shadow.lines().next().is_none_or(|l| !out.contains(l)), "host /etc/shadow visible");

    // Jail only: a microVM's guest has its own kernel, file system and devices.
    if jail {
        // Threat: writing outside the sandbox (the agent binary is the one host
        // file inside; it is read-only).
        let out = moat.run(id, as_root("echo x > /.moat/agent 2>&1; echo $?")).await.expect("runs");
        assert_ne!(String::from_utf8_lossy(&out.stdout).trim().lines().last(), Some("0"));

        // Threat: a host file reachable through the agent's socket directory or
        // an inherited descriptor (the monitor binds the socket outside and hands
        // over only the listening descriptor; stdio is /dev/null). Where the
        // sandbox has per-command cgroups, /.moat/cgroup holds its own `user`
        // cgroups, for its root only.
        let out = moat
            .run(id, as_root("ls -A /.moat; ls -l /proc/1/fd | grep -c -e jail.log -e sandboxes || true"))
            .await
            .expect("runs");
        let listed = String::from_utf8_lossy(&out.stdout).trim().replace("\ncgroup", "");
        assert_eq!(listed, "agent\n0", "host paths visible inside");
        // The overlay's options name no host directory (its layers are
        // given by descriptor).
        let (mounts, _) = sh(&moat, id, "cat /proc/self/mountinfo").await;
        let data = moat.data_dir().display().to_string();
        assert!(!mounts.contains(&data) && mounts.contains("lowerdir=/proc/self/fd/"), "{mounts}");
        // Nor does the agent's command line, which every process reads: the
        // init serves as the agent in place, a copy of the monitor whose
        // command line named the data directory, the image and host ids.
        let (cmdline, _) = sh(&moat, id, "tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/1/comm").await;
        assert_eq!(
            cmdline.split_whitespace().collect::<Vec<_>>(),
            ["/.moat/agent", "--listen", "fd:3", "--log-level", "warn", "agent"],
            "{cmdline}"
        );
        let (environ, _) = sh(&moat, id, "cat /proc/1/environ 2>&1 | tr '\\0' ' '").await;
        assert!(!environ.contains(&data) && !environ.contains("MOAT"), "{environ}");
        let out = moat.run(id, ExecRequest::shell("ls /.moat/cgroup 2>&1; echo $?")).await.expect("runs");
        assert_ne!(String::from_utf8_lossy(&out.stdout).trim().lines().last(), Some("0"), "user reaches the cgroups");
        let out = moat
            .run(
                id,
                as_root(
                    "ls /.moat/cgroup 2>/dev/null | grep -v -x -e memory -e pids -e freezer -e cpu -e unified | wc -l",
                ),
            )
            .await
            .expect("runs");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0", "only the sandbox's user cgroups are bound");

        // Threat: bypassing the seccomp deny list through x32 system call numbers.
        let out = moat
            .run(id, as_root("python3 -c 'import ctypes; l=ctypes.CDLL(None,use_errno=True); print(l.syscall(0x40000000 | 165, 0, 0, 0, 0, 0), ctypes.get_errno())'"))
            .await
            .expect("runs");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "-1 1", "x32 mount must fail with EPERM");

        // Threat: crafting frames for pasta's tap (network open) that it
        // would connect to the host's loopback: no packet sockets, even
        // for the sandbox's root.
        let out = moat
            .run(id, as_root("python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)' 2>&1"))
            .await
            .expect("runs");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("PermissionError") && said.contains("Operation not permitted"), "{said}");
    }

    // Threat: seeing or signalling host processes. (A microVM's /proc also
    // lists its own kernel's threads: the count is for jails.)
    if jail {
        let (out, _) = sh(&moat, id, "ls -d /proc/[0-9]* | wc -l").await;
        assert!(out.trim().parse::<u32>().expect("count") < 10, "sandbox sees {out} processes");
    }
    let me = std::env::current_exe().expect("test binary");
    let me = me.file_name().expect("name").to_string_lossy();
    // The name goes through a file in two halves, so that no command line
    // inside (the shell's, grep's) contains it whole.
    let (head, tail) = me.split_at(me.len() / 2);
    let script = format!(
        "printf '%s%s\\n' '{head}' '{tail}' > /tmp/host-name; \
         cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c -F -f /tmp/host-name"
    );
    let (out, _) = sh(&moat, id, &script).await;
    assert_eq!(out.trim(), "0", "the host's test process is visible inside");
    let (out, _) = sh(&moat, id, &format!("kill -0 {} 2>&1; echo $?", std::process::id())).await;
    assert_ne!(out.trim().lines().last(), Some("0"), "signalled a host process");

    // Threat: reaching a host loopback service.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (out, _) = sh(
        &moat,
        id,
        &format!("python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)' 2>&1 | tail -1"),
    )
    .await;
    assert!(out.contains("Connection refused") || out.contains("unreachable"), "{out}");

    // Jail only: in a microVM these act on the guest's own kernel, not the host's.
    if jail {
        // Threat: loading kernel modules, mounting, rebooting: denied to sandbox root.
        let out = moat
            .run(id, as_root("python3 -c 'import ctypes,os; l=ctypes.CDLL(None,use_errno=True); print(l.syscall(313,0,b\"\",0), ctypes.get_errno())'"))
            .await
            .expect("runs");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "-1 1", "finit_module must fail with EPERM");
        let out = moat.run(id, as_root("mount -t tmpfs x /mnt 2>&1; echo $?")).await.expect("runs");
        assert_ne!(String::from_utf8_lossy(&out.stdout).trim().lines().last(), Some("0"), "mount worked");
        let out = moat.run(id, as_root("mknod /tmp/sda b 8 0 2>&1; echo $?")).await.expect("runs");
        assert_ne!(
            String::from_utf8_lossy(&out.stdout).trim().lines().last(),
            Some("0"),
            "a block device node was made"
        );

        // Threat: gaining host privileges. Sandbox root is an unprivileged host uid.
        let info = moat.run(id, as_root("cat /proc/self/uid_map")).await.expect("runs");
        let map = String::from_utf8_lossy(&info.stdout);
        // Rootless, the map is read against the monitor's own namespace,
        // where 1 is the account's first subordinate id (the run's watch
        // checks the host ids themselves).
        let base = if rootless() { "1" } else { "2000000000" };
        assert_eq!(map.split_whitespace().collect::<Vec<_>>(), ["0", base, "65536"], "{map}");

        // Threat: raising privileges with a set-uid binary. no_new_privs makes
        // the kernel ignore the bit: a set-uid-root copy of `id` still says 1000.
        let out = moat
            .run(id, as_root("cp /usr/bin/id /home/user/suid-id && chmod 4755 /home/user/suid-id && echo ok"))
            .await
            .expect("runs");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
        let (out, _) = sh(&moat, id, "/home/user/suid-id -u").await;
        assert_eq!(out.trim(), "1000", "a set-uid binary raised privileges");
    }

    // And after all that, the sandbox still answers.
    still_answers(&moat, id).await;
    std::fs::remove_file(&marker).ok();
    moat.destroy_all().await;
}

/// A sandbox that exhausts its memory, disk or processes hurts only
/// itself. (Split from `escapes_fail`, so that in the nested host a level 1
/// that breaks under one of these loads loses only this step.)
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn memory_disk_and_fork_bombs_are_contained() {
    let (moat, sandbox) = hostile().await;
    let id = sandbox.id.as_str();
    let jail = backend() == moat_core::BackendKind::Jail;

    // Threat: exhausting host memory. The cgroup limit kills the hog, not the
    // host. (The bytes must be written: untouched allocations cost nothing.)
    // In the nested host a microVM's memory and process bombs are
    // a_memory_bomb_…'s and a_fork_bomb_…'s: only the disk is left here.
    let out = if nested() {
        None
    } else {
        Some(
            moat.run(id, ExecRequest::shell("python3 -c 'x = b\"x\" * (1024 * 1024 * 1024); print(len(x))'"))
                .await
                .expect("runs"),
        )
    };
    if let Some(out) =
        out.filter(|_| moat_core::cgroup::CgroupSupport::probe() != moat_core::cgroup::CgroupSupport::None)
    {
        assert!(!out.status.success(), "a 1 GiB allocation succeeded under a 192 MiB limit: {out:?}");
    }

    // Threat: filling the host disk. Writes stop at disk_mib with "No
    // space left" (a jail's tmpfs is that big; a microVM's file system has
    // that much free), and the disk works on once the file is gone. A
    // microVM's overlay holds no more than the limit plus the file
    // system's metadata on the host (its hard bound, which the guest
    // does not reach).
    let (out, _) = sh(
        &moat,
        id,
        "dd if=/dev/zero of=/home/user/fill bs=1M count=200 2>&1; sync; rm -f /home/user/fill; sync; \
         echo still writable > /home/user/after && cat /home/user/after",
    )
    .await;
    assert!(out.contains("No space left"), "{out}");
    assert!(out.contains("still writable"), "the disk is unusable after filling it: {out}");
    if !jail {
        use std::os::unix::fs::MetadataExt;
        let overlay = moat.data_dir().join("sandboxes").join(id).join("overlay.img");
        let held = std::fs::metadata(&overlay).expect("the overlay").blocks() * 512;
        let image = moat_core::Image::open(moat.data_dir(), "default").expect("the default image");
        let disk = moat_core::backend::rootdisk::RootDisk::read(&image.path("rootfs.ext4")).expect("its superblock");
        let bound = disk.overlay_limit_mib(64) << 20;
        assert!(held <= bound, "the overlay holds {held} bytes, past its {bound}: {out}");
    }

    if nested() {
        still_answers(&moat, id).await;
        moat.destroy_all().await;
        return;
    }
    // Threat: a fork bomb. The pids limit holds.
    let (out, _) = sh(&moat, id, "python3 - <<'EOF'\nimport os, time\nn = 0\nfor _ in range(3000):\n    try:\n        if os.fork() == 0:\n            time.sleep(5); os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint(n)\nEOF").await;
    let forked: u32 = out.trim().lines().last().and_then(|l| l.parse().ok()).unwrap_or(0);
    // (A microVM's processes are bounded by its own memory; only its guest suffers.)
    if jail && moat_core::cgroup::CgroupSupport::probe() != moat_core::cgroup::CgroupSupport::None {
        assert!(forked < 1100, "forked {forked} processes past the pids limit");
    }

    // And after all that, the sandbox still answers.
    still_answers(&moat, id).await;
    moat.destroy_all().await;
}

/// Output floods stream through, or are cut in the sandbox on the tools'
/// path, without the owner buffering them.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn output_floods_are_bounded() {
    // Room for a Python session beside the floods: in a microVM of 128 MiB
    // (hostile()'s) the session was seen killed while it printed.
    let moat = moat(16).await;
    let sandbox = moat.create(small()).await.expect("created");
    let id = sandbox.id.as_str();

    // In the nested host every byte crosses emulated hardware (TCG, where
    // these floods took five minutes): there they are a little past the
    // output limit rather than many times it.
    let (stream_mib, flood_bytes) = if nested() { (16u64, 10_000_000u64) } else { (200, 50_000_000) };

    // Threat: flooding output. 200 MiB streams through without the owner
    // buffering it (the reader here counts and drops).
    let stream = format!("head -c {} /dev/zero", stream_mib << 20);
    let mut handle = moat.exec(id, ExecRequest::shell(&stream)).await.expect("starts");
    let mut stdout = handle.take_stdout().expect("stdout");
    let mut bytes = 0u64;
    while let Some(chunk) = stdout.recv().await {
        bytes += chunk.len() as u64;
    }
    assert!(handle.wait().await.expect("exits").success());
    assert_eq!(bytes, stream_mib << 20);
    // Through the tools' path the flood stops in the sandbox: the caller
    // gets COMMAND_OUTPUT_LIMIT of each stream, the agent reads the rest
    // and drops it (counted), and the command runs to its end.
    let flood = format!("head -c {flood_bytes} /dev/zero | tr '\\0' x; echo end >&2");
    let command =
        moat_core::StreamedCommand { request: ExecRequest::argv(["bash", "-c", &flood]), direct: None, stdin: None };
    let seen = std::sync::atomic::AtomicUsize::new(0);
    let on_output = |_, b: &[u8]| {
        seen.fetch_add(b.len(), std::sync::atomic::Ordering::SeqCst);
    };
    let outcome = moat.exec_streaming(id, command, &on_output, std::future::pending()).await.expect("runs");
    let moat_core::ExecOutcome::Finished(out) = outcome else { panic!("not cancelled") };
    let limit = moat_core::moat::COMMAND_OUTPUT_LIMIT;
    assert_eq!((out.status.code, out.stdout.len(), out.stderr.as_slice()), (Some(0), limit, b"end\n".as_slice()));
    assert!(out.truncated && out.stdout.iter().all(|b| *b == b'x'));
    assert_eq!(out.status.dropped_bytes, flood_bytes - limit as u64);
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), limit + 4, "only what was kept was streamed");
    if nested() {
        // A cell's flood is cut by the session's runner, the same in both
        // backends: the jail run covers it.
        still_answers(&moat, id).await;
        moat.destroy_all().await;
        return;
    }
    // A Python cell's flood is cut by the session's runner alike (printed
    // in pieces: a microVM of small() has no room for one 20 MB string).
    let cell = "for _ in range(200):\n    print('y' * 99_999)";
    let out = moat.run_code(id, Language::Python, cell, Duration::from_secs(120), std::future::pending(), &|_, _| {});
    let out = out.await.expect("the cell runs");
    assert!(out.truncated && out.error.is_none(), "{:?}", out.error);
    assert_eq!(out.stdout.len(), limit);
    let out = moat.run_code(
        id,
        Language::Python,
        "print('after')",
        Duration::from_secs(60),
        std::future::pending(),
        &|_, _| {},
    );
    let out = out.await.expect("the next cell runs");
    assert_eq!((out.stdout.as_slice(), out.truncated), (b"after\n".as_slice(), false));
    // Rich results and errors are the cell's to choose too: a flood of
    // displays and a 20 MB exception message are cut on the host.
    let cell = "kept = 7\nfrom IPython.display import display, HTML\nfor i in range(300):\n    \
                display(HTML(f'<b>{i}</b>'))\nraise ValueError('v' * 20_000_000)";
    let out = moat.run_code(id, Language::Python, cell, Duration::from_secs(120), std::future::pending(), &|_, _| {});
    let out = out.await.expect("the cell runs");
    assert_eq!(out.results.len(), moat_core::interpreter::MAX_RESULTS, "the first results are kept");
    assert_eq!(out.results[0]["text/html"], "<b>0</b>");
    let error = out.error.expect("the exception is reported");
    assert_eq!(error.name, "ValueError");
    assert!(out.truncated && error.value.len() <= limit, "{}", error.value.len());
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(note.contains("236 rich results (displays, images or MIME types) were left out"), "{note}");
    let out =
        moat.run_code(id, Language::Python, "print(kept)", Duration::from_secs(60), std::future::pending(), &|_, _| {});
    assert_eq!(out.await.expect("runs").stdout, b"7\n", "the session lived through it");
    // A cell whose value is larger than the output limit: its text is cut
    // by the runner, and the session goes on.
    let big = "'é' * 6_000_000";
    let out = moat.run_code(id, Language::Python, big, Duration::from_secs(120), std::future::pending(), &|_, _| {});
    let out = out.await.expect("the cell runs");
    assert!(out.truncated && out.text.len() <= limit && out.text.starts_with("'éé"), "{}", out.text.len());
    let out =
        moat.run_code(id, Language::Python, "print(kept)", Duration::from_secs(60), std::future::pending(), &|_, _| {});
    assert_eq!(out.await.expect("runs").stdout, b"7\n", "and through that");

    // And after all that, the sandbox still answers.
    still_answers(&moat, id).await;
    moat.destroy_all().await;
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_task_imports_a_project_and_turns_the_work_into_a_patch() {
    let moat = moat(16).await;
    let project = tempfile::Builder::new().prefix("project-").tempdir_in(common::tmp_root()).expect("tempdir");
    let p = project.path();
    std::fs::write(p.join("main.py"), "print('hello')\n").expect("write");
    std::fs::write(p.join("delete_me.txt"), "bye\n").expect("write");
    std::fs::write(p.join("data.bin"), [0u8, 1, 2, 255]).expect("write");
    std::fs::create_dir(p.join(".git")).expect("a host .git is not imported");
    std::os::unix::fs::symlink("main.py", p.join("entry")).expect("symlink");

    let task = moat.task_start(p, small()).await.expect("task starts");
    assert_eq!(task.runtime, moat_core::Runtime::Python);
    let (out, code) =
        sh(&moat, &task.sandbox_id, "cd /workspace && python3 main.py && git log --oneline | wc -l").await;
    assert_eq!((out.as_str(), code), ("hello\n1\n", Some(0)));

    // new.txt holds what moat's diff once split on: the patch keeps it as
    // a line of the file, and the summary is not forged by it.
    let work = "cd /workspace && echo \"print('changed')\" > main.py && rm delete_me.txt && \
                printf 'new\\n@@moat-numstat@@\\n999\\t999\\tforged.txt\\n' > new.txt && printf '\\000\\377' > data.bin && \
                ln -s /etc/passwd .envrc && git config core.fsmonitor 'sleep 1000;'";
    let (_, code) = sh(&moat, &task.sandbox_id, work).await;
    assert_eq!(code, Some(0));
    // A command's text is logged clipped, like its output: a model's
    // 64 KiB of command holds 4 KiB of the host's memory and record.
    let long = format!("true {}", "#".repeat(64 << 10));
    assert_eq!(sh(&moat, &task.sandbox_id, &long).await.1, Some(0));
    let (diff, summary) = moat.task_diff(&task.id).await.expect("diff");
    assert!(diff.contains("+print('changed')"), "{diff}");
    assert!(diff.contains("deleted file mode") && diff.contains("delete_me.txt"), "{diff}");
    assert!(
        diff.contains("new file mode") && diff.contains("+new\n+@@moat-numstat@@\n+999\t999\tforged.txt"),
        "{diff}"
    );
    assert!(diff.contains("Binary files a/data.bin and b/data.bin differ"), "{diff}");
    assert_eq!(summary.files_changed, 5, "{summary:?}");
    // Said beside the file: what a host program would act on by itself.
    assert!(
        summary.files.iter().any(|f| f.starts_with(".envrc (+1 -0; a symlink; a host program acts on it by itself")),
        "{summary:?}"
    );
    assert!(summary.files.iter().any(|f| f == "new.txt (+3 -0)"), "{summary:?}");
    assert!(!summary.files.iter().any(|f| f.contains("forged")) && summary.insertions < 10, "{summary:?}");

    let record = moat.task_finish(&task.id, false).await.expect("finishes");
    assert_eq!(std::fs::read_to_string(&record.patch_path).expect("patch"), diff);
    let log = std::fs::read_to_string(&record.log_path).expect("log");
    assert!(log.contains("python3 main.py") && log.contains("delete_me.txt"), "{log}");
    let entries: Vec<moat_core::task::LogEntry> = serde_json::from_str(&log).expect("the log is a list of entries");
    let clipped = entries.iter().find(|e| e.command.starts_with("true ##")).expect("the long command is logged");
    assert!(
        clipped.command.len() <= moat_core::task::LOG_OUTPUT_BYTES && clipped.truncated,
        "{}",
        clipped.command.len()
    );
    assert!(matches!(moat.get(&task.sandbox_id), Err(SandboxError::UnknownSandbox { .. })), "sandbox destroyed");
    assert!(moat.task_records().await.iter().any(|r| r.task.id == task.id));
    moat.remove_task(&task.id).await.expect("removed");
    assert!(!moat.task_records().await.iter().any(|r| r.task.id == task.id));
    assert!(matches!(moat.remove_task(&task.id).await, Err(TaskError::UnknownTask { .. })));

    // A symlink travels as a link: inside the sandbox it leads into the
    // sandbox. A directory outside the roots, or reached through a link, is refused.
    std::os::unix::fs::symlink("/etc/passwd", p.join("escape")).expect("symlink");
    let task = moat.task_start(p, small()).await.expect("links travel as links");
    let (out, _) = sh(&moat, &task.sandbox_id, "readlink /workspace/escape; head -c 5 /workspace/escape").await;
    assert_eq!(out, "/etc/passwd\nroot:");
    moat.task_finish(&task.id, false).await.expect("finishes");
    // A task ends with its sandbox, however that ends: nothing of it (its
    // log of up to 1024 outputs) stays in the server.
    let task = moat.task_start(p, small()).await.expect("another task");
    let _ = sh(&moat, &task.sandbox_id, "head -c 4096 /dev/urandom").await;
    moat.destroy(&task.sandbox_id).await.expect("destroyed");
    moat.settled().await;
    let err = moat.task_diff(&task.id).await.expect_err("its sandbox is gone");
    assert!(matches!(err, TaskError::UnknownTask { .. }), "{err}");
    let err = moat.task_start(std::path::Path::new("/etc"), small()).await.expect_err("outside the roots");
    assert!(err.to_string().contains("outside the shared directories"), "{err}");
    let via = p.parent().expect("parent").join(format!("via-{}", task.id));
    std::os::unix::fs::symlink(p, &via).expect("symlink");
    let err = moat.task_start(&via, small()).await.expect_err("through a link");
    assert!(err.to_string().contains("symlink"), "{err}");
    std::fs::remove_file(&via).expect("rm");
    let err =
        moat.task_start(std::path::Path::new("https://github.com/x/y.git"), small()).await.expect_err("no network");
    assert!(err.to_string().contains("needs network access"), "{err}");
}

/// Issue 15, items 1, 2 and 5: a sandbox that plants links for a later copy,
/// host paths outside the roots, and a huge sparse file.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn copies_hold_the_host_boundary_against_a_hostile_sandbox() {
    let moat = moat(16).await;
    let base = tempfile::Builder::new().prefix("copies-").tempdir_in(common::tmp_root()).expect("tempdir");
    let b = base.path();
    let marker = tempfile::Builder::new().prefix("moat-escape-").tempdir().expect("tempdir outside the roots");
    let escaped = marker.path().join("escaped");
    let sandbox = moat.create(small()).await.expect("creates");
    let id = &sandbox.id;
    let ups = "../".repeat(24);
    let plant = format!(
        "cd /home/user && mkdir out && ln -s . out/x && ln -s x/x/x/x/x/x/x/x/{ups}{escaped} out/p && \
         ln -s {escaped} out/abs && ln -s ../../../../../../{escaped} out/rel && ln -s p out/chain && \
         echo inside > out/f && ln -s f out/ok && echo evil > payload",
        escaped = escaped.display().to_string().trim_start_matches('/')
    );
    let (out, code) = sh(&moat, id, &plant).await;
    assert_eq!(code, Some(0), "{out}");
    let copied = moat.copy_from_sandbox(id, "/home/user/out", &b.join("out")).await.expect("copies");
    for gone in ["p", "abs", "rel", "chain"] {
        assert!(std::fs::symlink_metadata(b.join("out").join(gone)).is_err(), "{gone} kept: {copied:?}");
        assert!(copied.skipped.iter().any(|s| s.starts_with(&format!("{gone}: "))), "{gone} not listed: {copied:?}");
    }
    assert_eq!(std::fs::read_to_string(b.join("out/ok")).expect("inside link kept"), "inside\n");
    // The second step of the attack: copying onto the planted names.
    for name in ["p", "abs", "rel", "chain"] {
        moat.copy_from_sandbox(id, "/home/user/payload", &b.join("out").join(name)).await.expect("a new file");
    }
    let err = moat.copy_from_sandbox(id, "/home/user/payload", &b.join("out/x/x/new")).await.expect_err("via a link");
    assert!(err.to_string().contains("symlink"), "{err}");
    let err = moat.copy_from_sandbox(id, "/home/user/payload", &b.join("out/f")).await.expect_err("exists");
    assert!(err.to_string().contains("exists"), "{err}");
    assert!(!escaped.exists(), "the sandbox wrote outside the roots");

    // Outside the roots, `..`, and the host's secrets.
    for path in ["/etc/shadow", "/root/.ssh/id_ed25519"] {
        let err = moat.copy_to_sandbox(id, std::path::Path::new(path), "/tmp/x").await.expect_err("outside");
        assert!(err.to_string().contains("MOAT_ROOTS"), "{err}");
    }
    let sneaky = b.join("../../../../../../../etc/shadow");
    let err = moat.copy_to_sandbox(id, &sneaky, "/tmp/x").await.expect_err("dot-dot");
    assert!(err.to_string().contains("`..`"), "{err}");
    let err = moat.copy_from_sandbox(id, "/home/user/payload", &escaped).await.expect_err("outside");
    assert!(err.to_string().contains("MOAT_ROOTS"), "{err}");

    // A 48 GiB sparse file is refused by the copy limit, not skipped in
    // silence; one that fits stays sparse on the host.
    let (_, code) = sh(
        &moat,
        id,
        "mkdir big && truncate -s 48G big/huge.img && mkdir fits && \
        truncate -s 16M fits/sparse.img && printf x | dd of=fits/sparse.img bs=1 seek=4096 conv=notrunc 2>/dev/null",
    )
    .await;
    assert_eq!(code, Some(0));
    let err = moat.copy_from_sandbox(id, "/home/user/big", &b.join("big")).await.expect_err("too large");
    assert!(err.to_string().contains("MOAT_COPY_MAX_MIB"), "{err}");
    assert!(!b.join("big").exists(), "a refused copy leaves nothing");
    let err = moat.copy_from_sandbox(id, "/home/user/big/huge.img", &b.join("huge.img")).await.expect_err("too large");
    assert!(err.to_string().contains("MOAT_COPY_MAX_MIB"), "{err}");
    assert!(!b.join("huge.img").exists(), "a refused copy leaves nothing");
    let copied = moat.copy_from_sandbox(id, "/home/user/fits", &b.join("fits")).await.expect("fits");
    assert_eq!((copied.files, copied.bytes), (1, 16 << 20));
    let meta = std::fs::metadata(b.join("fits/sparse.img")).expect("copied");
    assert!(std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < 1 << 20, "not sparse: {meta:?}");

    // The sandbox still works.
    assert_eq!(sh(&moat, id, "echo alive").await.0, "alive\n");
    moat.destroy(id).await.expect("destroys");
    moat.settled().await;
}

/// The processes a jail lives in are killed in the middle of a call: its
/// agent during a command and during a Python cell, its monitor during a
/// file transfer. Each call returns [`SandboxError::Failed`] (not a hang, not a
/// bare I/O error), the sandbox is listed `failed` with why, its state
/// directory and cgroups are released, it can be destroyed, and another
/// sandbox and the `Moat` carry on.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_sandbox_killed_mid_call_fails_alone_and_is_released() {
    let moat = moat(16).await;
    let bystander = moat.create(small()).await.expect("created").id;
    let base = tempfile::Builder::new().prefix("faults-").tempdir_in(common::tmp_root()).expect("tempdir");
    let big = base.path().join("big.bin");
    // Long enough a transfer to be killed in the middle of (nested vsock
    // moves a few MiB a second).
    let size = if nested() { 64 << 20 } else { 256 << 20 };
    std::fs::write(&big, vec![7u8; size]).expect("a file to transfer");
    let spec = SandboxSpec { disk_mib: 512, ..small() };
    // In the nested host a microVM's Python session takes long to start
    // under emulation, and a cell killed there fails as a command does on
    // the host's side (the same code for both backends, which the jail
    // run covers): the command and the transfer are enough.
    let cases: &[&str] = if nested() { &["command", "transfer"] } else { &["command", "transfer", "cell"] };
    for &case in cases {
        let id = moat.create(spec.clone()).await.expect("created").id;
        let outer = moat.host_pid(&id).expect("its host process");
        // The jail's init (the agent, named so), or the VMM under its
        // supervisor: a child that is not a jail's keeper (cgroup v1,
        // `moat_agent::keeper`). The agent's name is looked for first: a
        // keeper that has not yet named itself on a loaded host looks like
        // neither.
        let children = std::fs::read_to_string(format!("/proc/{outer}/task/{outer}/children")).expect("children");
        let comm = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let inner: i32 = children
            .split_whitespace()
            .find(|pid| comm(pid).trim() == "agent")
            .or_else(|| children.split_whitespace().find(|pid| comm(pid).trim() != "moat-keeper"))
            .expect("the sandbox's child")
            .parse()
            .expect("a pid");
        let victim = if case == "transfer" { i32::try_from(outer).expect("pid") } else { inner };
        let call = async {
            match case {
                "command" => moat
                    .run(&id, ExecRequest::shell("touch /tmp/started; sleep 600"))
                    .await
                    .map(drop)
                    .map_err(CoreError::from),
                "transfer" => {
                    moat.copy_to_sandbox(&id, &big, "/home/user/big.bin").await.map(drop).map_err(CoreError::from)
                }
                _ => {
                    let cell = "open('/tmp/started', 'w').close()\nimport time\ntime.sleep(600)";
                    let timeout = Duration::from_secs(600);
                    moat.run_code(&id, Language::Python, cell, timeout, std::future::pending(), &|_, _| {})
                        .await
                        .map(drop)
                        .map_err(CoreError::from)
                }
            }
        };
        eprintln!("{case}: calling; pid {victim} is killed once the call is under way");
        let kill = async {
            // Killed once the call is under way in the sandbox.
            let started = if case == "transfer" {
                "find /home/user -type f -size +64k | grep -q . && echo yes"
            } else {
                "test -e /tmp/started && echo yes"
            };
            // Not too often in a microVM of the nested host: each check is
            // agent work, which outweighs the commands' (a Python session
            // starting) in a guest's CPU, and TCG makes it slow.
            let pause = Duration::from_millis(if nested() { 1000 } else { 5 });
            while sh(&moat, &id, started).await.0.trim() != "yes" {
                tokio::time::sleep(pause).await;
            }
            eprintln!("{case}: under way; killing {victim}");
            let pid = nix::unistd::Pid::from_raw(victim);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kills");
            std::time::Instant::now()
        };
        // A call that ends before it is under way fails the test (rather
        // than leave the kill waiting for it).
        tokio::pin!(call);
        let killed = tokio::select! {
            early = &mut call => panic!("{case}: the call ended before it was under way: {early:?}"),
            killed = kill => killed,
        };
        // A guard against a hang only; the time taken is printed.
        let result = tokio::time::timeout(Duration::from_secs(120), call).await;
        let err = result.unwrap_or_else(|_| panic!("{case}: the call hung after the kill")).expect_err(case);
        eprintln!("{case}: answered {:?} after the kill: {err}", killed.elapsed());
        assert!(matches!(err, CoreError::Sandbox(SandboxError::Failed { .. })), "{case}: {err}");
        assert!(err.to_string().contains("create another sandbox"), "{err}");
        let listed = moat.list().into_iter().find(|s| s.id == id).expect("still listed");
        assert_eq!(listed.state, SandboxState::Failed, "{case}");
        assert!(listed.failure.as_deref().is_some_and(|f| f.contains("ended unexpectedly")), "{listed:?}");
        // Released off the async threads: soon, not necessarily yet.
        let state = moat_core::image::data_dir().join("sandboxes").join(&id);
        let cgroups = || {
            std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
                .any(|c| c.path().join("moat").join(&id).exists() || c.path().join(&id).exists())
        };
        for _ in 0..1000 {
            if !state.exists() && !cgroups() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!state.exists(), "{case}: its state directory is left");
        assert!(!cgroups(), "{case}: its cgroups are left");
        assert!(!std::path::Path::new(&format!("/proc/{outer}")).exists(), "{case}: its host process is left");
        let again = moat.run(&id, ExecRequest::shell("true")).await.expect_err("a failed sandbox runs nothing");
        assert!(matches!(again, SandboxError::Failed { .. }), "{again}");
        moat.destroy(&id).await.expect("a failed sandbox is destroyed (forgotten)");
        moat.settled().await;
        assert!(moat.list().iter().all(|s| s.id != id), "{case}: still listed after destroy");
        assert_eq!(sh(&moat, &bystander, "echo ok").await.0, "ok\n", "{case}: another sandbox is affected");
    }
    moat.destroy_all().await;
}

/// The disk of the data directory fills up (here: a small tmpfs, the
/// image bound in read-only): finishing a task and creating a sandbox
/// fail, and so does copying out to a root on a full disk, with an error that says the
/// disk is full; the task stays in progress, the record saved before is
/// unchanged, no half-written record or copy is left, and everything works
/// again once there is room. Jails only: a microVM's state is the same
/// directory, and the nested host's minutes are spent elsewhere.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_full_data_disk_fails_clearly_and_damages_nothing() {
    use nix::mount::{MsFlags, mount, umount2};
    if backend() != moat_core::BackendKind::Jail {
        return;
    }
    struct Unmount(Vec<std::path::PathBuf>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            for path in self.0.iter().rev() {
                let _ = umount2(path, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
    let top = tempfile::Builder::new().prefix("full-disk-").tempdir_in(common::tmp_root()).expect("tempdir");
    let data = top.path().join("data");
    std::fs::create_dir(&data).expect("mkdir");
    mount(Some("tmpfs"), &data, Some("tmpfs"), MsFlags::empty(), Some("size=16m,mode=0755")).expect("tmpfs");
    let mut mounts = Unmount(vec![data.clone()]);
    let image = data.join("images/default");
    std::fs::create_dir_all(&image).expect("mkdir");
    let real = moat_core::image::data_dir().join("images/default");
    mount(Some(&real), &image, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>).expect("bind");
    mounts.0.push(image.clone());
    let readonly = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    mount(None::<&str>, &image, None::<&str>, readonly, None::<&str>).expect("read-only");
    // A shared root on a disk as small (its own tmpfs: a root may not be
    // inside the data directory).
    let root = top.path().join("root");
    std::fs::create_dir(&root).expect("mkdir");
    mount(Some("tmpfs"), &root, Some("tmpfs"), MsFlags::empty(), Some("size=1m,mode=0755")).expect("tmpfs");
    mounts.0.push(root.clone());
    let project = top.path().join("project");
    std::fs::create_dir(&project).expect("mkdir");
    std::fs::write(project.join("a.txt"), "a\n").expect("write");
    let config = MoatConfig {
        data_dir: data.clone(),
        roots: vec![project.clone(), root.clone()],
        ..common::config(backend(), 16, moat_core::EgressConfig::default())
    };
    let moat = Moat::new(config).await.expect("moat starts");

    let first = moat.task_start(&project, small()).await.expect("task starts");
    sh(&moat, &first.sandbox_id, "echo b > /workspace/b.txt").await;
    let saved = moat.task_finish(&first.id, false).await.expect("finishes");
    let saved_patch = std::fs::read(&saved.patch_path).expect("patch");
    let record_dir = saved.patch_path.parent().expect("record dir").to_owned();
    let saved_record = std::fs::read(record_dir.join("record.json")).expect("record");

    let second = moat.task_start(&project, small()).await.expect("task starts");
    let (_, code) =
        sh(&moat, &second.sandbox_id, "head -c 2M /dev/urandom > /workspace/big.bin && echo c > /workspace/c.txt")
            .await;
    assert_eq!(code, Some(0));
    let filler = data.join("filler");
    let mut file = std::fs::File::create(&filler).expect("filler");
    let chunk = vec![1u8; 64 << 10];
    while std::io::Write::write_all(&mut file, &chunk).is_ok() {}
    drop(file);

    fn full(e: &dyn std::error::Error) -> bool {
        eprintln!("{e}");
        e.to_string().contains("the disk holding moat's data directory is full")
    }
    let err = moat.task_finish(&second.id, false).await.expect_err("no room for the record");
    assert!(full(&err), "{err}");
    let records: Vec<_> = std::fs::read_dir(data.join("tasks")).expect("tasks").flatten().collect();
    assert_eq!(records.len(), 1, "a half-written record is left: {records:?}");
    assert_eq!(std::fs::read(&saved.patch_path).expect("patch"), saved_patch, "the saved patch changed");
    assert_eq!(std::fs::read(record_dir.join("record.json")).expect("record"), saved_record);
    assert!(moat.task_diff(&second.id).await.is_ok(), "the task is still in progress");

    let err = moat.create(small()).await.expect_err("no room for a sandbox's state");
    assert!(full(&err), "{err}");
    assert_eq!(moat.list().len(), 1, "the refused sandbox is listed");
    let err = moat
        .copy_from_sandbox(&second.sandbox_id, "/workspace/big.bin", &root.join("big.bin"))
        .await
        .expect_err("no room for the copy");
    eprintln!("{err}");
    // Stopped before the disk is full: moat keeps 5 % of it free.
    assert!(err.to_string().contains("less free space than moat keeps free (5 % of it, at most 1 GiB)"), "{err}");
    assert_eq!(std::fs::read_dir(&root).expect("root").count(), 0, "a failed copy leaves something");
    let small_copy = moat.copy_from_sandbox(&second.sandbox_id, "/workspace/c.txt", &root.join("c.txt")).await;
    assert_eq!(small_copy.expect("a copy that fits").bytes, 2);
    std::fs::remove_file(root.join("c.txt")).expect("rm");

    std::fs::remove_file(&filler).expect("frees the disk");
    let record = moat.task_finish(&second.id, false).await.expect("finishes once there is room");
    assert!(std::fs::read_to_string(&record.patch_path).expect("patch").contains("c.txt"));
    moat.create(small()).await.expect("creates once there is room");
    moat.destroy_all().await;
    drop(moat);
    drop(mounts);
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_warm_pool_hands_out_started_sandboxes_and_cleans_up() {
    let config = MoatConfig {
        pool_size: 2,
        pool_spec: small(),
        ..common::config(backend(), 16, moat_core::EgressConfig::default())
    };
    let moat = Moat::new(config).await.expect("moat starts");
    // A guard against a hang: microVMs under nested emulation take seconds each.
    for _ in 0..30_000 {
        if moat.pooled() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(moat.pooled(), 2, "the pool did not fill");
    let sandbox = moat.create(small()).await.expect("from the pool");
    let (out, code) = sh(&moat, &sandbox.id, "hostname; id -un").await;
    assert_eq!(code, Some(0));
    assert_eq!(out.lines().collect::<Vec<_>>(), [sandbox.id.as_str(), "user"]);
    // A spec other than the pool's starts a sandbox of its own.
    let other = moat.create(SandboxSpec { name: Some("custom".into()), ..small() }).await.expect("fresh");
    assert_eq!(sh(&moat, &other.id, "hostname").await.0.trim(), "custom");
    let states: Vec<_> = std::fs::read_dir(moat.data_dir().join("sandboxes"))
        .expect("state dirs")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(states.len() >= 3, "{states:?}");
    drop(moat);
    // Dropping the Moat destroys its sandboxes, pooled ones included (a
    // microVM takes a moment to stop: a guard, not a bound).
    let gone = |id: &String| !moat_core::image::data_dir().join("sandboxes").join(id).exists();
    for _ in 0..3000 {
        if states.iter().filter(|id| *id == &sandbox.id || *id == &other.id).all(gone) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for id in states.iter().filter(|id| *id == &sandbox.id || *id == &other.id) {
        assert!(!moat_core::image::data_dir().join("sandboxes").join(id).exists(), "{id} outlived its Moat");
    }
}

/// A pooled sandbox handed out keeps its place and memory while the create
/// finishes (a filtered one starts its egress proxy then): the pool's
/// refill never starts one more into that room, past the memory limit,
/// nor does it take the room from the create it came from.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_pooled_sandbox_handed_out_at_the_memory_limit_keeps_its_place() {
    let pooled_spec = SandboxSpec { network: moat_core::NetworkPolicy::Filtered, ..small() };
    // Three of `small` (256 MiB and a 128 MiB disk in memory): two live, one pooled.
    let config = MoatConfig {
        pool_size: 1,
        pool_spec: pooled_spec.clone(),
        max_memory_mib: Some(3 * (256 + 128)),
        ..common::config(backend(), 16, moat_core::EgressConfig::default())
    };
    let moat = Moat::new(config).await.expect("moat starts");
    for _ in 0..30_000 {
        if moat.pooled() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(moat.pooled(), 1, "the pool did not fill");
    for name in ["a", "b"] {
        moat.create(SandboxSpec { name: Some(name.into()), ..small() }).await.expect("fits beside the pool");
    }
    for _ in 0..5 {
        let taken = moat.create(pooled_spec.clone()).await.expect("the pooled sandbox, at the limit");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(moat.pooled(), 0, "the refill started past the memory limit");
        assert_eq!(moat.list().len(), 3);
        moat.destroy(&taken.id).await.expect("destroyed");
        moat.settled().await;
        for _ in 0..30_000 {
            if moat.pooled() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(moat.pooled(), 1, "the room came back to the pool");
    }
    moat.destroy_all().await;
    moat.settled().await;
}

/// The pool counts against `MOAT_MAX_SANDBOXES`, and gives way: a create
/// of another spec that only pooled sandboxes keep out takes the place of
/// one, which ends first. Live and pooled never pass the limit together.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_warm_pool_counts_against_the_limit_and_gives_way() {
    let config = MoatConfig {
        pool_size: 2,
        pool_spec: small(),
        ..common::config(backend(), 3, moat_core::EgressConfig::default())
    };
    let moat = Moat::new(config).await.expect("moat starts");
    let moat = &moat;
    let filled = |n: usize| async move {
        // A guard against a hang, not a bound.
        for _ in 0..30_000 {
            if moat.pooled() == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        moat.pooled()
    };
    assert_eq!(filled(2).await, 2, "the pool did not fill");
    let other = || SandboxSpec { memory_mib: 192, ..small() };
    let mut live = Vec::new();
    for n in 1..=3 {
        let sandbox = moat.create(other()).await.unwrap_or_else(|e| panic!("create {n} of another spec: {e}"));
        live.push(sandbox.id);
        moat.settled().await;
        // The pool refills only into room that is left.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(n + moat.pooled() <= 3, "{n} live and {} pooled, over the limit of 3", moat.pooled());
    }
    assert_eq!(moat.pooled(), 0, "three live sandboxes leave the pool no room");
    for spec in [other(), small()] {
        let err = moat.create(spec).await.expect_err("over the limit");
        assert!(matches!(err, CreateError::LimitReached { max: 3 }), "{err}");
    }
    let (out, code) = sh(moat, &live[0], "true").await;
    assert_eq!(code, Some(0), "{out}");
    moat.destroy(&live[0]).await.expect("destroyed");
    // The room a destroy leaves goes back to the pool, and then to a create
    // of the pool's spec, which takes it.
    assert_eq!(filled(1).await, 1, "the pool did not refill");
    moat.create(small()).await.expect("from the pool");
    assert_eq!(moat.pooled(), 0);
    moat.create(small()).await.expect_err("over the limit again");
    moat.destroy_all().await;
    moat.settled().await;
}

/// The same contract for microVMs: this test binary runs itself inside the
/// nested test host (a level-1 Linux under QEMU whose KVM can boot guests),
/// every test above with `MOAT_TEST_BACKEND=vm`, one process per test, one
/// at a time, as an unprivileged account whose one grant is the `kvm`
/// group (issue U1; see [`L1_ACCOUNT`]), while a watch checks that no
/// moat-vmm, passt or test process of the run has uid 0. When level 1
/// itself breaks (emulated SVM under TCG now and then hangs it), a fresh
/// one runs the tests not yet done.
#[test]
#[ignore = "needs the default image, the moat binaries, QEMU and busybox-static (the nested test host); run by `cargo xtask test`"]
fn microvm_sandboxes_pass_the_same_contract_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() {
        // Inside level 1 (or a backend chosen by hand): not again.
        return;
    }
    // `MOAT_CONTRACT_FILTER=NAME` runs only the tests whose names hold NAME.
    let filter = std::env::var("MOAT_CONTRACT_FILTER").unwrap_or_default();
    let known = contract_tests("");
    assert!(NOT_FOR_MICROVMS.iter().all(|t| known.iter().any(|k| k == t)), "a test named in NOT_FOR_MICROVMS is gone");
    let tests: Vec<String> =
        contract_tests(&filter).into_iter().filter(|t| !NOT_FOR_MICROVMS.contains(&t.as_str())).collect();
    assert!(!tests.is_empty(), "no test of this binary matches MOAT_CONTRACT_FILTER={filter:?}");
    let out = in_the_nested_host("vm", &tests, true);
    assert_eq!(out.0, 0, "the contract failed for microVMs:\n{}", out.1);
    assert!(out.1.contains("account: 1001, /dev/kvm 660 993"), "the tests ran as the account:\n{}", out.1);
}

/// The contract tests the microVM run leaves out. Every minute in level 1
/// runs under TCG, so it goes to what a microVM does differently (its
/// VMM, its vsock transport, its own kernel's limits and cgroups, its
/// pause, a guest root that owns the agent), not to what the jail run on
/// this host has shown already:
/// - jail-only subjects, which return at once for microVMs: the host
///   kernel's surface, cgroup v1 launchers, reclaiming a background bomb
///   through the host's cgroups, reusing a cgroup after a limit, telling
///   apart commands that fill the shared limit together, a full
///   data disk under a jail's tmpfs;
/// - host-side logic over the same agent: a task's import and patch,
///   giving up a Python session that never starts, a create that
///   finishes while moat closes, and a stuck sandbox's bounded wait (a
///   paused microVM, which `idle_sandboxes_suspend_…` makes and resumes,
///   is waited on by the same code as a frozen jail);
/// - the agent's own handling of a command's background processes.
const NOT_FOR_MICROVMS: &[&str] = &[
    "the_kernel_surface_is_closed_to_sandbox_root",
    "commands_are_born_in_their_cgroup_on_a_cgroup_v1_host",
    "a_background_fork_bomb_is_reclaimed_by_the_next_command",
    "a_cgroup_that_reached_a_limit_is_reused_and_later_work_in_it_is_left_alone",
    "a_fork_bomb_beside_earlier_work_is_stopped_and_the_work_is_left_alone",
    "a_create_that_finishes_while_moat_closes_leaves_nothing",
    "a_failing_sandbox_is_never_unknown_to_a_caller",
    "frozen_processes_die_with_their_sandbox",
    // The timeout's report is the agent's, the same in both backends; under
    // the nested host's emulation the bomb may not reach the limit before
    // a timeout short enough for the suite (seen once: no report at 10 s).
    "a_thread_bomb_is_reported_at_its_timeout_and_the_sandbox_recovers",
    "files_share_the_disk_and_are_named_at_the_memory_limit",
    "a_full_data_disk_fails_clearly_and_damages_nothing",
    "a_task_imports_a_project_and_turns_the_work_into_a_patch",
    "a_python_session_that_never_starts_is_given_up",
    "a_stuck_sandbox_is_reported_not_waited_on",
    "background_processes_of_a_well_behaved_command_keep_running",
    "a_warm_pool_counts_against_the_limit_and_gives_way",
    "a_pooled_sandbox_handed_out_at_the_memory_limit_keeps_its_place",
    "a_symlink_planted_in_the_image_leads_no_write_out_of_the_root",
];

/// An image whose tree holds a symlink where the jail's monitor makes its
/// mount points (`/.moat` pointing at a host directory) leads no write of
/// the monitor's, host root, out of the sandbox's root: the create is
/// refused naming the link, and the host directory is left as it was (with
/// the names followed as text, the monitor made `old` and `agent` there
/// and gave it to the jail's uid).
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_symlink_planted_in_the_image_leads_no_write_out_of_the_root() {
    use std::os::unix::fs::MetadataExt;
    if backend() != moat_core::BackendKind::Jail || !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: plants a link in an image of root's jails");
        return;
    }
    let data = moat_core::image::data_dir();
    let default = moat_core::image::Image::open(&data, "default").expect("the default image");
    let name = format!("planted-{}", std::process::id());
    let dir = data.join("images").join(&name);
    let victim = common::tmp_root().join(format!("victim-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&victim);
    std::fs::create_dir_all(&victim).expect("the host directory");
    // The default image's files (what `Image::open` checks is there), and a
    // tree of its own with the link.
    std::fs::create_dir_all(dir.join("rootfs/etc")).expect("the image's tree");
    for entry in std::fs::read_dir(data.join("images/default")).expect("the default image's files").flatten() {
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::hard_link(entry.path(), dir.join(entry.file_name())).expect("linked");
        }
    }
    std::os::unix::fs::symlink(&victim, dir.join("rootfs/.moat")).expect("the plant");
    let owner = default.manifest.jail_id_base;
    for path in [dir.join("rootfs"), dir.join("rootfs/etc")] {
        std::os::unix::fs::lchown(&path, Some(owner), Some(owner)).expect("owned as an image's tree is");
    }
    let moat = moat(4).await;
    let refused = moat.create(SandboxSpec { image: name.clone(), ..small() }).await;
    moat.settled().await;
    let listed: Vec<_> = std::fs::read_dir(&victim).expect("listed").flatten().map(|e| e.file_name()).collect();
    let meta = std::fs::metadata(&victim).expect("the host directory");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&victim);
    let refused = refused.map(|s| s.id).expect_err("a root with a planted link is refused");
    assert!(listed.is_empty(), "the monitor wrote {listed:?} into a host directory through the image's link");
    assert_eq!((meta.uid(), meta.gid()), (0, 0), "the monitor gave a host directory away");
    assert!(refused.to_string().contains(".moat"), "the error names the link: {refused}");
}

/// microVMs still run for root, as for hosts that run moat as a service:
/// what differs from the account's contract run is moat-vmm's start and
/// jail, and the files it may reach, so two short tests (Debian itself
/// runs the same, and the guest's escapes meet the same guest), about a
/// minute in level 1.
#[test]
#[ignore = "needs the default image, the moat binaries, QEMU and busybox-static (the nested test host); run by `cargo xtask test`"]
fn microvm_sandboxes_still_run_for_root_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() {
        return;
    }
    let tests = ["copies_hold_the_host_boundary_against_a_hostile_sandbox", "sandboxes_never_outlive_a_killed_owner"];
    let out = named_in_the_nested_host("vm", &tests, false);
    assert_eq!(out.0, 0, "microVMs failed for root:\n{}", out.1);
}

/// The account [`microvm_sandboxes_pass_the_same_contract_in_the_nested_host`]
/// runs as in level 1: `/etc/passwd` and `/etc/group` lines, `/dev/kvm`
/// given to its `kvm` group (mode 0660, as udev leaves it), and its data
/// directory with links to the image's files (the microVM backend reads
/// only those).
const L1_ACCOUNT: &str = r#"[ -f /etc/passwd ] || echo 'root:x:0:0::/root:/bin/sh' > /etc/passwd
[ -f /etc/group ] || echo 'root:x:0:' > /etc/group
echo 'moat-rootless:x:1001:1001::/home/moat-rootless:/bin/sh' >> /etc/passwd
echo 'moat-rootless:x:1001:' >> /etc/group
echo 'kvm:x:993:moat-rootless' >> /etc/group
chgrp 993 /dev/kvm && chmod 0660 /dev/kvm
for image in /root/.local/share/moat/images/*; do
    dst=/home/moat-rootless/.local/share/moat/images/${image##*/}
    mkdir -p "$dst"
    for f in "$image"/*; do ln -s "$(readlink -f "$f")" "$dst/"; done
done
chown -R 1001:1001 /home/moat-rootless
echo "account: $(su -s /bin/sh moat-rootless -c 'id -u'), /dev/kvm $(stat -c '%a %g' /dev/kvm)"
"#;

/// What [`jails_run_for_an_unprivileged_user_in_a_delegated_cgroup_in_the_nested_host`]
/// adds to [`L1_ACCOUNT`]: the account's subordinate ids (from root's jail
/// ids, which the image's tree is owned from), and `/scope.sh`, which runs
/// a test as the account in a cgroup of its own, delegated to it as
/// `systemd-run --user --scope -p Delegate=yes` makes one under
/// `user@1001.service`: the memory, pids and CPU controllers enabled down
/// to `app.slice`, and the scope's directory, `cgroup.procs`,
/// `cgroup.subtree_control` and `cgroup.threads` the account's. The test
/// process is alone in it (su execs).
const L1_DELEGATED_SCOPE: &str = r#"echo 'moat-rootless:JAIL_ID_BASE:65536' > /etc/subuid
echo 'moat-rootless:JAIL_ID_BASE:65536' > /etc/subgid
slice=/sys/fs/cgroup
for level in user.slice user-1001.slice user@1001.service app.slice ''; do
    for c in memory pids cpu; do echo +$c > $slice/cgroup.subtree_control; done
    [ -n "$level" ] && slice=$slice/$level && mkdir -p $slice
done
cat > /scope.sh <<'SCOPE'
scope=/sys/fs/cgroup/user.slice/user-1001.slice/user@1001.service/app.slice/run-$$.scope
mkdir $scope
chown 1001:1001 $scope $scope/cgroup.procs $scope/cgroup.subtree_control $scope/cgroup.threads
echo $$ > $scope/cgroup.procs
echo $scope > /tmp/scope.path
exec su -s /bin/sh moat-rootless -c "exec env HOME=/home/moat-rootless USER=moat-rootless MOAT_TEST_ROOTLESS=1 $*"
SCOPE
"#;

/// Jails without root on a cgroup v2 host (issue U1): in level 1 (cgroup
/// v2, `nsdelegate`, as systemd mounts it) an account with subordinate ids
/// and no other grant runs rootless jail tests, each from a cgroup
/// delegated to it alone (see [`L1_DELEGATED_SCOPE`]): moat moves into its
/// leaf, enables the controllers, and makes its sandboxes' cgroups beside
/// it, whose limits the bombs then meet. A watch fails the run if any of
/// its processes has uid 0.
#[test]
#[ignore = "needs the default image, the moat binaries, QEMU and busybox-static (the nested test host); run by `cargo xtask test`"]
fn jails_run_for_an_unprivileged_user_in_a_delegated_cgroup_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() || rootless() {
        return;
    }
    let tests = [
        "a_fork_bomb_is_reported_and_the_sandbox_recovers",
        "a_memory_bomb_is_reported_and_the_sandbox_recovers",
        "escapes_fail",
    ];
    let out = named_in_the_nested_host("jail", &tests, true);
    assert_eq!(out.0, 0, "rootless jails on cgroup v2 failed:\n{}", out.1);
    for test in tests {
        let line = out.1.lines().find(|l| l.starts_with(&format!("delegated scope of {test}: ")));
        assert!(
            line.is_some_and(|l| l.contains("memory pids") && l.ends_with(", moat in its leaf")),
            "{test} did not run its sandboxes in its delegated cgroup ({line:?}):\n{}",
            out.1
        );
    }
}

/// Jails recover from their limits on a cgroup v2 host too: level 1 is one
/// (cgroup2 mounted with `nsdelegate`, as systemd does; the image's
/// `rootfs/` from the bundle), so the recovery tests run there with
/// `MOAT_TEST_BACKEND=jail`. This host is cgroup v1.
#[test]
#[ignore = "needs the default image, the moat binaries, QEMU and busybox-static (the nested test host); run by `cargo xtask test`"]
fn jails_recover_on_a_cgroup_v2_host_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() {
        return;
    }
    let tests = [
        "a_fork_bomb_is_reported_and_the_sandbox_recovers",
        "a_memory_bomb_is_reported_and_the_sandbox_recovers",
        "a_timed_out_command_is_killed_with_what_left_its_group",
        "background_processes_of_a_well_behaved_command_keep_running",
        "the_kernel_surface_is_closed_to_sandbox_root",
    ];
    let out = named_in_the_nested_host("jail", &tests, false);
    assert_eq!(out.0, 0, "jails on cgroup v2 failed:\n{}", out.1);
}

/// The same contract for jails started by an unprivileged user (issue
/// U1): an account made here, prepared once by `moat setup --user` as
/// root, runs this binary's jail tests (escapes included) with
/// `MOAT_TEST_ROOTLESS=1`. Meanwhile every process of that run is
/// watched: none may have uid 0 on the host, and every process inside a
/// sandbox (another pid namespace) runs as one of the account's
/// subordinate ids, never as the account itself.
#[test]
#[ignore = "needs root (to make the account), the default image, the static agent and the moat binary; run by `cargo xtask test`"]
fn jails_pass_the_same_contract_for_an_unprivileged_user() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() || rootless() {
        return;
    }
    let account = common::rootless_account();
    let tests: Vec<String> = contract_tests("").into_iter().filter(|t| !ROOT_ONLY.contains(&t.as_str())).collect();
    assert!(ROOT_ONLY.iter().all(|t| contract_tests("").iter().any(|k| k == t)), "a test named in ROOT_ONLY is gone");
    let mut command = account.test_binary();
    command
        .args(["--include-ignored", "--test-threads=1", "--exact"])
        .args(&tests)
        .env("MOAT_TEST_ROOTLESS", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = command.spawn().expect("the test binary starts as the account");
    let watch = common::UidWatch::start(child.id(), account.subids);
    let out = child.wait_with_output().expect("the run ends");
    let seen = watch.stop();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the contract failed for {}'s jails:\n{text}", account.name);
    assert!(seen.root.is_empty(), "processes of the rootless run had uid 0 on the host: {:?}", seen.root);
    assert!(seen.misplaced.is_empty(), "sandbox processes ran outside the subordinate ids: {:?}", seen.misplaced);
    assert!(seen.sandboxed > 0, "no sandbox process was seen: the watch saw nothing\n{text}");

    // Its sandboxes are its own: mode 0700, and out of root's sight, as
    // root's are out of its.
    use std::os::unix::fs::PermissionsExt;
    let mode =
        std::fs::metadata(account.home.join(".local/share/moat/sandboxes")).expect("its sandboxes").permissions();
    assert_eq!(mode.mode() & 0o777, 0o700, "the account's sandboxes directory is open to others");
    let moat_bin = std::env::var_os("MOAT_BIN_DIR")
        .map_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"), Into::into)
        .join("moat");
    // Root's, in a data directory of its own (its images those of the
    // default one): no other test's sandboxes in its listing.
    let root_data = tempfile::tempdir().expect("a data directory");
    std::os::unix::fs::symlink(moat_core::image::data_dir().join("images"), root_data.path().join("images"))
        .expect("root's images");
    let mut roots = std::process::Command::new(&moat_bin)
        .args(["run", "--backend", "jail", "--", "sleep", "60"])
        .env("MOAT_AGENT", common::agent())
        .env("MOAT_DATA_DIR", root_data.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("root's moat runs");
    let root_ls = || {
        let out = std::process::Command::new(&moat_bin)
            .arg("ls")
            .env("MOAT_DATA_DIR", root_data.path())
            .output()
            .expect("moat ls");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("sbx-"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let mut listed = root_ls();
    for _ in 0..600 {
        if !listed.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        listed = root_ls();
    }
    assert!(!listed.is_empty(), "root's sandbox never showed in root's moat ls");
    let theirs = account.moat().arg("ls").output().expect("the account's moat ls");
    let theirs = String::from_utf8_lossy(&theirs.stdout).into_owned();
    assert!(!theirs.contains("sbx-"), "the account's moat ls lists root's sandbox: {theirs}");
    let removed = account.moat().args(["rm", "--all"]).output().expect("the account's moat rm --all");
    assert!(removed.status.success(), "{removed:?}");
    assert_eq!(root_ls(), listed, "the account's rm --all touched root's sandbox");
    let _ = roots.kill();
    let _ = roots.wait();

    // Network open: pasta, started by the account's monitor, configures
    // the sandbox's interface (a default route).
    let open = account
        .moat()
        .args(["run", "--backend", "jail", "--network", "open", "--", "cat", "/proc/net/route"])
        .output()
        .expect("the account's moat run");
    let routes = String::from_utf8_lossy(&open.stdout);
    assert!(
        routes.lines().any(|l| l.split_whitespace().nth(1) == Some("00000000")),
        "no default route in the account's open sandbox: {routes}{}",
        String::from_utf8_lossy(&open.stderr)
    );
}

/// An unprivileged user builds an image of its own (issue U1): `moat image
/// build --force` as the account prepared by `moat setup --user` runs
/// mmdebstrap's unshare mode in its subordinate range. The image is then
/// checked as jails and microVMs read it — the manifest maps jail ids from
/// the account's range, the tree is owned from there (`user` at
/// range + 1000), the ext4 disk holds the sandbox's own ids (debugfs:
/// `/home/user` is 1000) — and used: the account's jail runs on it as
/// `user`, Python included. A second build only verifies it; `moat image
/// rm` deletes it, subordinate-owned files and all. In the gate it runs
/// on this binary's second thread, beside the nested host's tests, whose
/// level 1 leaves a core idle.
#[test]
#[ignore = "needs root (to make the account), the network (Debian's archive), mmdebstrap and the moat binary; run by `cargo xtask test`"]
fn images_build_for_an_unprivileged_user() {
    use std::os::unix::fs::MetadataExt;
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() || rootless() {
        return;
    }
    let account = common::rootless_account();
    let name = "user-built";
    let text = |out: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let mut build = account.moat();
    // The mirror root's image came from, when the machine names one.
    build.envs(std::env::var("MOAT_DEBIAN_MIRROR").ok().map(|mirror| ("MOAT_DEBIAN_MIRROR", mirror)));
    let built = build.args(["image", "build", "--force", "--name", name]).output().expect("moat image build");
    assert!(built.status.success(), "the account's image build failed:\n{}", text(&built));
    assert!(text(&built).contains("mmdebstrap --mode=unshare"), "not built in a user namespace:\n{}", text(&built));

    let dir = account.home.join(".local/share/moat/images").join(name);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).expect("its manifest")).expect("JSON");
    assert_eq!(manifest["jail_id_base"], account.subids, "jail ids not from the account's range");
    let owner = |path: &str| std::fs::symlink_metadata(dir.join(path)).map(|m| (m.uid(), m.gid())).expect(path);
    assert_eq!(owner("rootfs"), (account.subids, account.subids), "the tree's root is not sandbox root's");
    assert_eq!(owner("rootfs/home/user"), (account.subids + 1000, account.subids + 1000));
    assert_eq!(owner("manifest.json"), (account.uid, account.gid), "the account does not own its image");
    let disk = std::process::Command::new("debugfs")
        .args(["-R", "stat /home/user"])
        .arg(dir.join("rootfs.ext4"))
        .output()
        .expect("debugfs");
    let stat = String::from_utf8_lossy(&disk.stdout);
    assert!(
        stat.lines().any(|l| l.split_whitespace().take(4).eq(["User:", "1000", "Group:", "1000"])),
        "the microVM disk's /home/user is not 1000:1000:\n{stat}"
    );

    let ran = account
        .moat()
        .args(["run", "--backend", "jail", "--image", name, "--"])
        .args(["sh", "-c", "id -un; stat -c %u:%g /home/user /etc/shadow; python3 -c 'print(6 * 7)'"])
        .output()
        .expect("moat run");
    assert!(ran.status.success(), "a jail on the account's image failed:\n{}", text(&ran));
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "user\n1000:1000\n0:42\n42\n", "{}", text(&ran));

    let again = account.moat().args(["image", "build", "--name", name]).output().expect("moat image build");
    assert!(again.status.success() && text(&again).contains("up to date"), "not verified:\n{}", text(&again));
    let removed = account.moat().args(["image", "rm", "--name", name]).output().expect("moat image rm");
    assert!(removed.status.success(), "{}", text(&removed));
    assert!(!dir.exists(), "the image is still there after moat image rm");
}

/// The tests that need root itself, not only a sandbox: a full data disk
/// is a file system the test mounts.
const ROOT_ONLY: &[&str] = &["a_full_data_disk_fails_clearly_and_damages_nothing"];

/// Whether this run is the unprivileged account's (see
/// [`jails_pass_the_same_contract_for_an_unprivileged_user`]).
fn rootless() -> bool {
    std::env::var_os("MOAT_TEST_ROOTLESS").is_some()
}

/// How long one test may take in level 1 before its watchdog reports what
/// hangs (the slowest take 2-3 minutes on a busy 2-core host; the whole
/// microVM contract 8-10).
const WATCHDOG_SECS: u64 = 900;

/// How many tests one level 1 runs before a fresh one takes over: level 1s
/// that boot microVMs one after another break now and then, more often
/// the longer they run (docs/testing.md).
const TESTS_PER_LEVEL_1: usize = 5;

/// [`in_the_nested_host`] for tests named here, each checked to exist.
fn named_in_the_nested_host(backend: &str, names: &[&str], unprivileged: bool) -> (i32, String) {
    let known = contract_tests("");
    assert!(names.iter().all(|t| known.iter().any(|k| k == t)), "a test named here is gone: {names:?}");
    let tests: Vec<String> = names.iter().map(|t| (*t).to_owned()).collect();
    in_the_nested_host(backend, &tests, unprivileged)
}

/// Runs `tests` of this binary in the nested host with `MOAT_TEST_BACKEND`
/// `backend`, one process per test, resuming in a fresh level 1 where a
/// broken one stopped. Returns the exit code and a report: what the tests
/// printed, then level 1's console tail.
fn in_the_nested_host(backend: &str, tests: &[String], unprivileged: bool) -> (i32, String) {
    let (bundle, name) = moat_nested::bundle_with_this_program().expect("the level-1 bundle");
    // Task tests import projects from the target's temporary directory.
    let tmp = env!("CARGO_TARGET_TMPDIR");
    // Each test under a watchdog inside level 1 (short of the host's own
    // limit) that, when it hangs, shows what level 1 was doing: its
    // processes and each microVM's console and moat-vmm log. A failed
    // test's whole output is printed as soon as it ends.
    // As the account: each test through su, and a watch for uid 0 among
    // the run's processes (level 1's own are root: only these are named).
    // Jails as the account also get subordinate ids and, per test, a
    // delegated cgroup of their own (see L1_DELEGATED_SCOPE).
    let (account, run_test, watch, check) = if unprivileged {
        let (jail_setup, run_test, scope_check) = if backend == "jail" {
            (
                L1_DELEGATED_SCOPE.replace("JAIL_ID_BASE", &moat_core::image::JAIL_ID_BASE.to_string()),
                format!("sh /scope.sh {name} --include-ignored --test-threads=1 --nocapture --exact $t"),
                r#"scope=$(cat /tmp/scope.path)
    echo "delegated scope of $t: $(cat $scope/cgroup.subtree_control)$([ -d $scope/moat ] && echo ', moat in its leaf')""#,
            )
        } else {
            (
                String::new(),
                format!(
                    "su -s /bin/sh moat-rootless -c \"exec env HOME=/home/moat-rootless USER=moat-rootless {name} \
                     --include-ignored --test-threads=1 --nocapture --exact $t\""
                ),
                "",
            )
        };
        (
            format!("{L1_ACCOUNT}{jail_setup}chmod 1777 {tmp}\n"),
            run_test,
            r#"( while sleep 1; do for p in /proc/[0-9]*; do
        case "$(cat $p/comm 2>/dev/null)" in moat-vmm|passt|sandbox-*|moat) ;; *) continue ;; esac
        grep -q '^Uid:[[:space:]]*0[[:space:]]' $p/status 2>/dev/null && echo "$(cat $p/comm) $(cat $p/cmdline | tr '\0' ' ')"
    done; done > /tmp/as-root.txt 2>/dev/null ) &
    rootwatch=$!"#,
            format!(
                r#"kill $rootwatch
    if [ -s /tmp/as-root.txt ]; then echo "processes with uid 0:"; sort -u /tmp/as-root.txt; code=1; fi
    {scope_check}"#
            ),
        )
    } else {
        (
            String::new(),
            format!("{name} --include-ignored --test-threads=1 --nocapture --exact \"$t\""),
            "",
            String::new(),
        )
    };
    let payload = |tests: &[String]| {
        let mut payload = moat_nested::Payload::script(&format!(
            r#"mkdir -p {tmp}
{account}cat > /contract.sh <<'EOF'
failed=0
for t in {tests}; do
    {watch}
    started=$(date +%s)
    {run_test} > /tmp/contract-test.out 2>&1 &
    test=$!
    (
        sleep {WATCHDOG_SECS}
        echo "$t ran past {WATCHDOG_SECS} s; level 1's processes and microVMs:"
        ps
        for dir in "$HOME"/.local/share/moat/sandboxes/*/; do
            echo "== $dir"; ls -ls "$dir"
            for log in console.log vmm.log; do echo "-- $log"; tail -n 40 "$dir$log"; done
        done
        kill $test
    ) >&2 &
    watchdog=$!
    wait $test
    code=$?
    kill $watchdog 2>/dev/null
    {check}
    if [ $code = 0 ]; then
        echo "test $t ... ok ($(( $(date +%s) - started )) s in level 1)"
    else
        tail -c 20000 /tmp/contract-test.out
        echo "test $t ... FAILED (exit $code, $(( $(date +%s) - started )) s in level 1)"
        echo "failed $t" > "$MOAT_NESTED_MARKS"
        failed=1
    fi
    echo "done $t" > "$MOAT_NESTED_MARKS"
done
exit $failed
EOF
{run}"#,
            tests = tests.join(" "),
            // A jail's monitor needs a root it can pivot from.
            run = if backend == "jail" {
                format!("{}\nexec unshare -m --propagation private sh /l1.sh sh /contract.sh", common::L1_SWITCH_ROOT)
            } else {
                "exec sh /contract.sh".into()
            },
        ));
        payload.env.push(("MOAT_TEST_BACKEND".into(), backend.into()));
        // Several microVMs at once (a warm pool), their disks' overlays in
        // level 1's memory: more room than the default level 1.
        payload.machine.memory_mib = 4096;
        payload.timeouts.finish = Duration::from_secs(2400);
        payload
    };
    let out = moat_nested::run_steps(&bundle, tests, TESTS_PER_LEVEL_1, payload).expect("level 1 runs the tests");
    eprintln!("{}", out.stdout_text());
    let console: Vec<&str> = out.console.lines().collect();
    let report = format!(
        "{}\n{}\nlevel 1's console (tail):\n{}",
        out.stdout_text(),
        out.stderr_text(),
        console[console.len().saturating_sub(40)..].join("\n")
    );
    (out.code, report)
}

/// The names of this binary's tests holding `filter`, less those that run
/// them in the nested host.
fn contract_tests(filter: &str) -> Vec<String> {
    let exe = std::env::current_exe().expect("this test binary");
    let list = std::process::Command::new(exe).args(["--list", "--include-ignored"]).output().expect("lists its tests");
    let mut tests = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .filter(|t| !t.ends_with("_in_the_nested_host") && !t.ends_with("_unprivileged_user") && t.contains(filter))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    // The bombs last: they load level 1 the most, and a level 1 that
    // breaks after them has the other tests done already.
    tests.sort_by_key(|t| t.contains("bomb"));
    tests
}

/// Runs `script` with `bash -c` in sandbox `id` under `timeout_ms`: stdout,
/// stderr, the exit code and whether it timed out.
async fn bash(moat: &Moat, id: &str, script: &str, timeout_ms: u64) -> (String, String, Option<i32>, bool) {
    let mut request = ExecRequest::argv(["bash", "-c", script]);
    request.timeout_ms = Some(timeout_ms);
    let out = moat.run(id, request).await.expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (text(&out.stdout), text(&out.stderr), out.status.code, out.status.timed_out)
}

/// Whether this run is inside the nested host, whose minutes go to what
/// differs from the jail run on this host (a microVM's own limits and
/// `cgroup.kill`; a cgroup v2 host's jails), not to agent logic the jail
/// run has already covered: everything there runs under TCG, and a longer
/// run meets more of level 1's own crashes.
fn nested() -> bool {
    std::env::var_os("MOAT_NESTED_MARKS").is_some()
}

/// The sandbox still runs commands and Python after a bomb.
async fn assert_recovered(moat: &Moat, id: &str) {
    let (out, err, code, _) = bash(moat, id, "echo ok", 60_000).await;
    assert_eq!((out.as_str(), code), ("ok\n", Some(0)), "the next command fails: {err}");
    let cell =
        moat.run_code(id, Language::Python, "6 * 7", Duration::from_secs(60), std::future::pending(), &|_, _| {});
    let cell = cell.await.expect("the next cell runs");
    assert_eq!(cell.text, "42", "{cell:?}");
}

/// Runs `echo ok` in sandbox `id` until one says, on stderr, that moat
/// reclaimed what an earlier command left (`note`); true when one did
/// (a guard against a hang: 600 tries). A start refused at the full
/// process limit, with nothing yet to reclaim, is tried again. Each runs
/// in a command cgroup of its own, the one that reclaims too (its first
/// start may meet the limit; the second, after the reclaim, was once made
/// outside any, in the agent's).
async fn run_until_reclaimed(moat: &Moat, id: &str, note: &str) -> bool {
    for _ in 0..600 {
        let mut request =
            ExecRequest::argv(["bash", "-c", "grep -q exec- /proc/self/cgroup && echo ok || cat /proc/self/cgroup"]);
        request.timeout_ms = Some(60_000);
        let out = match moat.run(id, request).await {
            Ok(out) => out,
            Err(e) if format!("{e} {e:?}").contains("the sandbox's process limit is full") => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => panic!("runs: {e:?}"),
        };
        let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!((text.as_ref(), out.status.code), ("ok\n", Some(0)), "{err}");
        if err.contains(note) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// How many processes of the sandbox have `pattern` in their command line.
async fn count_processes(moat: &Moat, id: &str, pattern: &str) -> usize {
    let (out, _, _, _) = bash(moat, id, &format!("pgrep -c -f '{pattern}' || true"), 60_000).await;
    out.trim().parse().unwrap_or(usize::MAX)
}

/// A fork bomb fills the command's share of the pids limit and is stopped
/// there while the command runs, not left to churn until its timeout; the
/// command's result says which limit, what held it and that moat killed
/// it, and the sandbox runs the next command and cell.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_fork_bomb_is_reported_and_the_sandbox_recovers() {
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let (out, err, _, timed_out) = bash(&moat, &id, "bash -c ':(){ :|:& };:'; sleep 60; echo survived", 120_000).await;
    assert!(!timed_out, "{err}");
    assert!(!out.contains("survived"), "the command was left to run on beside its fork bomb: {out}{err}");
    for words in ["moat: this command reached the sandbox's process limit", "Held by: bash ×", "moat killed its"] {
        assert!(err.contains(words), "{words:?} missing from the command's stderr: {err}");
    }
    if nested() {
        // Cooling down and the next Python cell are the agent's, the same
        // in both backends: the jail run covers them. Under the nested
        // host's TCG a cell's session takes 45-50 s to import IPython in a
        // microVM of small(), and a CI machine busier than this one took
        // past the session's 90 s bound after the bomb; the next command,
        // and Python in it, are what the microVM adds.
        let (out, err, code, _) = bash(&moat, &id, "echo ok; python3 -c 'print(6 * 7)'", 120_000).await;
        assert_eq!((out.as_str(), code), ("ok\n42\n", Some(0)), "the next command fails: {err}");
        moat.destroy_all().await;
        return;
    }
    // The sandbox cools down: its next commands start with a sixteenth of
    // the limit (no fewer than 32), so a bomb lit again stops early.
    assert!(err.contains("this sandbox's commands may run at most"), "no word of cooling down: {err}");
    let forks = "import os, time\nkids = []\ntry:\n    for _ in range(300):\n        pid = os.fork()\n        if pid == 0:\n            time.sleep(30)\n            os._exit(0)\n        kids.append(pid)\nexcept OSError:\n    pass\nprint(len(kids))\nfor kid in kids:\n    os.kill(kid, 9)\n";
    let (out, err, _, _) = bash(&moat, &id, &format!("python3 -c '{forks}'"), 120_000).await;
    let started: usize = out.trim().parse().unwrap_or(usize::MAX);
    assert!((16..100).contains(&started), "a command after the bomb started {started} processes: {out}{err}");
    // A bomb of shells lit again under the lower limit fails its forks in
    // bursts (bash pauses between tries), and is stopped all the same.
    let (out, err, _, timed_out) = bash(&moat, &id, "bash -c ':(){ :|:& };:'; sleep 60; echo survived", 120_000).await;
    assert!(!timed_out && !out.contains("survived"), "a bomb lit again ran on: {out}{err}");
    assert!(err.contains("Held by: bash ×"), "no report of the bomb lit again: {err}");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// The cgroup of a command that reached a limit is used again once its
/// processes are killed (a fresh one per command would move a process
/// into it, which on cgroup v1 stalls every fork on the host), and what a
/// later command leaves running there is judged by that command's own
/// counters: the bomb's events do not get it killed.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_cgroup_that_reached_a_limit_is_reused_and_later_work_in_it_is_left_alone() {
    // The agent's bookkeeping, the same in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let whose = "grep -m1 -o 'exec-[0-9]*' /proc/self/cgroup";
    let bomb = format!("{whose}; bash -c ':(){{ :|:& }};:'; sleep 60; echo survived");
    let (out, err, _, _) = bash(&moat, &id, &bomb, 120_000).await;
    assert!(err.contains("moat: this command reached the sandbox's process limit"), "{out}{err}");
    let bombed = out.lines().next().unwrap_or_default().to_owned();
    assert!(bombed.starts_with("exec-"), "no command cgroup: {out}{err}");
    // The cgroup is freed once the bomb's answer is sent (with a launcher
    // on cgroup v1): a later command finds it. (A guard against a hang.)
    let mut reused = false;
    for _ in 0..20 {
        let (out, err, code, _) =
            bash(&moat, &id, &format!("{whose}; setsid sleep 3000 >/dev/null 2>&1 &"), 60_000).await;
        assert_eq!(code, Some(0), "{out}{err}");
        if out.trim() == bombed {
            reused = true;
            break;
        }
    }
    assert!(reused, "no later command ran in {bombed}, the cgroup whose command reached the limit");
    let (_, err, code, _) = bash(&moat, &id, "echo ok", 60_000).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("reached a limit"), "a later command's work was killed for the bomb's events: {err}");
    assert!(count_processes(&moat, &id, "sleep 3000").await >= 1, "the background sleep was killed");
    moat.destroy_all().await;
}

/// A sandbox whose create finishes while its owner closes (a server told
/// to stop while a client creates one) is destroyed, not left running.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_create_that_finishes_while_moat_closes_leaves_nothing() {
    let moat = moat(16).await;
    // Several creates at once on two cores: some finish before the close,
    // some after it.
    let creating: Vec<_> = (0..6)
        .map(|_| {
            let moat = moat.clone();
            tokio::spawn(async move { moat.create(small()).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(5)).await;
    moat.close().await;
    let mut ids = Vec::new();
    for create in creating {
        match create.await.expect("the create task ran") {
            // Made before the close: the close destroyed it.
            Ok(sandbox) => ids.push(sandbox.id),
            Err(moat_core::CreateError::StartFailed { id, reason }) => {
                assert!(reason.contains("moat is shutting down"), "{reason}");
                ids.push(id);
            }
            Err(e) => panic!("an unexpected error: {e}"),
        }
    }
    assert!(moat.list().is_empty(), "sandboxes kept after the close: {:?}", moat.list());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for id in &ids {
        assert!(!mounts.contains(id.as_str()), "mounts of {id} left");
        for controller in ["pids", "memory", "unified"] {
            let dir = std::path::Path::new("/sys/fs/cgroup").join(controller).join("moat").join(id);
            assert!(!dir.exists(), "{} is left", dir.display());
        }
    }
}

/// A sandbox that fails is, at every moment, either live or failed to
/// whoever looks: never unknown (which would tell a client its sandbox
/// never existed, rather than that it failed and why). Jails are killed
/// while a thread looks them up as fast as it can.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_failing_sandbox_is_never_unknown_to_a_caller() {
    let moat = moat(16).await;
    for round in 0..30 {
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(moat.create(small()).await.expect("creates").id);
        }
        let looking = {
            let (moat, ids) = (moat.clone(), ids.clone());
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while std::time::Instant::now() < deadline {
                    for id in &ids {
                        match moat.get(id) {
                            Ok(_) | Err(SandboxError::Failed { .. }) => {}
                            Err(e) => return Err(format!("get({id}): {e}")),
                        }
                    }
                    let listed = moat.list();
                    if let Some(id) = ids.iter().find(|id| !listed.iter().any(|s| &s.id == *id)) {
                        return Err(format!("list() left out {id}"));
                    }
                    let failed = listed.iter().filter(|s| ids.contains(&s.id) && s.state == SandboxState::Failed);
                    if failed.count() == ids.len() {
                        return Ok(());
                    }
                }
                Err("the sandboxes were not seen to fail within 60 s".to_owned())
            })
        };
        for id in &ids {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(moat.host_pid(id).expect("live")).expect("a pid"));
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kills");
        }
        let seen =
            tokio::task::spawn_blocking(move || looking.join().expect("the looking thread ran")).await.expect("joined");
        assert_eq!(seen, Ok(()), "round {round}");
        for id in &ids {
            moat.destroy(id).await.expect("forgets the failed sandbox");
            moat.settled().await;
        }
    }
}

/// Commands that fill the process limit all commands share, none filling
/// its own (a fork bomb lit beside what an earlier command left running),
/// are told apart by size: the bomb, which holds the most processes, is
/// stopped and reported; the earlier command's processes run on. (On
/// cgroup v1, and v2 before Linux 6.15, a cgroup counts the forks that
/// failed in it, whichever limit refused them, so the bomb's own counter
/// rises; on v2 from 6.15 only the shared limit's does, and the agent
/// tells the commands apart by size.)
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_fork_bomb_beside_earlier_work_is_stopped_and_the_work_is_left_alone() {
    // The agent's bookkeeping, the same in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    // Memory enough for 960 processes, so that the OOM killer takes none.
    let id = moat.create(SandboxSpec { memory_mib: 1024, ..small() }).await.expect("created").id;
    // Started, and each one's `sleep` exec'd, before the command ends.
    let sleepers = "for i in $(seq 300); do setsid sleep 3000 >/dev/null 2>&1 & done; \
                    for i in $(seq 600); do [ $(pgrep -c -f '^sleep 3000$') -ge 300 ] && break; sleep 0.1; done; \
                    echo started";
    let (out, err, _, _) = bash(&moat, &id, sleepers, 120_000).await;
    assert!(out.contains("started"), "{out}{err}");
    assert_eq!(count_processes(&moat, &id, "^sleep 3000$").await, 300);
    let (out, err, _, timed_out) = bash(&moat, &id, "bash -c ':(){ :|:& };:'; sleep 60; echo survived", 120_000).await;
    assert!(!timed_out && !out.contains("survived"), "the bomb ran on beside the earlier work: {out}{err}");
    for words in ["moat: this command reached the sandbox's process limit", "Held by: bash ×"] {
        assert!(err.contains(words), "{words:?} missing from the command's stderr: {err}");
    }
    assert_eq!(count_processes(&moat, &id, "^sleep 3000$").await, 300, "the earlier work was killed");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// A thread bomb meets the pids limit once (a thread counts as a process
/// there) and then holds it, which moat's watch for forks that keep
/// failing does not stop: it runs to its timeout, whose result says which
/// limit it reached and what held it, and the sandbox runs the next
/// command and cell.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_thread_bomb_is_reported_at_its_timeout_and_the_sandbox_recovers() {
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let bomb =
        "python3 -c 'import threading, time\nwhile True: threading.Thread(target=time.sleep, args=(300,)).start()'";
    let (out, err, _, timed_out) = bash(&moat, &id, bomb, 10_000).await;
    assert!(timed_out, "{out}{err}");
    for words in ["moat: this command reached the sandbox's process limit", "Held by: python3 ×1 (", " threads)"] {
        assert!(err.contains(words), "{words:?} missing from the command's stderr: {err}");
    }
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// A thread bomb left in the background holds the shared pids limit with
/// one process: when a later command's forks keep failing there, the
/// bomb is the one that holds the most (counted in tasks, as the limit
/// counts), so the bomb is killed, not the later command.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_background_thread_bomb_goes_before_a_later_command() {
    // The fork watch is the agent's, the same in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    // The bomb fills the limit once its command has ended.
    let bomb = "setsid bash -c 'sleep 1; exec python3 -c \"import threading, time\nwhile True: threading.Thread(target=time.sleep, args=(300,)).start()\"' >/dev/null 2>&1 & echo started";
    let (out, err, _, _) = bash(&moat, &id, bomb, 60_000).await;
    assert!(out.contains("started"), "{out}{err}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (out, err, code, timed_out) =
        bash(&moat, &id, "for i in 1 2 3 4 5 6 7 8; do sleep 100 & done; echo forked", 120_000).await;
    assert!(!timed_out, "{out}{err}");
    assert_eq!((out.as_str(), code), ("forked\n", Some(0)), "the later command was stopped: {err}");
    assert_eq!(count_processes(&moat, &id, "^sleep 100$").await, 8, "the later command's work was killed");
    assert_eq!(count_processes(&moat, &id, "^python3").await, 0, "the thread bomb is left");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// Two thread bombs left in the background, each lit by a command of its
/// own at one moment, fill the shared pids limit together, each holding
/// about half of it. Both go before the next command runs, which says so:
/// where a refused fork counts in the forking cgroup (cgroup v1, and v2
/// before Linux 6.15), each reached a limit and is reclaimed; where only
/// the shared limit counts it, the one that holds the most is stopped
/// while later starts keep failing (`stop_filling`), then the other.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn two_background_bombs_that_fill_the_limit_together_give_way() {
    // The fork watch is the agent's, the same in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    // Lit at one moment and growing alike, each stops at its first refused
    // thread with about half the limit, and holds what it made.
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs() + 4;
    let bomb = format!(
        "setsid python3 -c \"import threading, time\ntime.sleep(max(0, {at} - time.time()))\nwhile True:\n    threading.Thread(target=time.sleep, args=(300,)).start()\n    time.sleep(0.002)\" >/dev/null 2>&1 & echo started"
    );
    for _ in 0..2 {
        let (out, err, _, _) = bash(&moat, &id, &bomb, 60_000).await;
        assert!(out.contains("started"), "{out}{err}");
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    let reclaimed = run_until_reclaimed(&moat, &id, "processes of an earlier command that").await;
    assert!(reclaimed, "the bombs were never reclaimed: every command was refused");
    assert!(count_processes(&moat, &id, "^python3").await <= 1, "both bombs are left");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// A fork bomb left running in the background is killed before the next
/// command starts, and that command says so.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_background_fork_bomb_is_reclaimed_by_the_next_command() {
    // The fork watch is the agent's, the same in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    // The bomb starts once the command has ended.
    let script = "setsid bash -c 'sleep 1; :(){ :|:& };:' >/dev/null 2>&1 & echo started";
    let (out, err, _, _) = bash(&moat, &id, script, 120_000).await;
    assert!(out.contains("started"), "{out}{err}");
    // Until the bomb reaches the limit, commands run without a note; the
    // first one after it reclaims the sandbox.
    let reclaimed = run_until_reclaimed(&moat, &id, "earlier command that reached a limit").await;
    assert!(reclaimed, "the background bomb was never reclaimed");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// Every file a jail writes (its disk, `/tmp`, `/dev/shm`, `/run`) comes
/// out of one budget, its disk size, so files can never take the memory
/// its processes need, not even the `rm` that frees them; a command that
/// meets the memory limit while files hold much of it is told which.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn files_share_the_disk_and_are_named_at_the_memory_limit() {
    // A microVM's disk is not its memory.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let fill = "for d in /tmp /dev/shm /run ~; do head -c 127M /dev/zero > $d/fill 2>/dev/null; done; \
                du -cm /tmp/fill /dev/shm/fill /run/fill ~/fill | tail -1";
    let (out, err, _, _) = bash(&moat, &id, fill, 120_000).await;
    let held: u64 = out.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(u64::MAX);
    assert!((120..=small().disk_mib).contains(&held), "files hold {held} MiB, past the disk's size: {out}{err}");
    let (out, err, _, timed_out) = bash(&moat, &id, "python3 -c 'x = bytearray(300 << 20)'", 120_000).await;
    assert!(!timed_out, "{out}{err}");
    for words in ["moat: this command reached the sandbox's memory limit", "moat: files hold", "/tmp, /dev/shm"] {
        assert!(err.contains(words), "{words:?} missing from the command's stderr: {err}");
    }
    let (_, err, code, _) = bash(&moat, &id, "rm -f /tmp/fill /dev/shm/fill /run/fill ~/fill", 60_000).await;
    assert_eq!(code, Some(0), "{err}");
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// Memory bombs end at the sandbox's memory limit, in the command, never
/// in the agent: the result says so and the next command and cell run.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_memory_bomb_is_reported_and_the_sandbox_recovers() {
    let moat = moat(16).await;
    // A microVM's memory holds its kernel too, and its disk is not RAM: as
    // much room for the ballast below as a jail of small() has.
    let spec = match backend() {
        moat_core::BackendKind::Vm => SandboxSpec { memory_mib: 512, ..small() },
        _ => small(),
    };
    let id = moat.create(spec).await.expect("created").id;
    // 16 MiB at a time: each step needs more than the kernel can free by
    // dropping the interpreter's own pages (with 1 MiB steps a microVM may
    // thrash there, reading them back, until moat's stall watch ends it).
    let grow = "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 24))'";
    let (out, err, code, timed_out) = bash(&moat, &id, grow, 120_000).await;
    assert!(code != Some(0) && !timed_out, "the bomb was not stopped at the limit: code {code:?}\n{out}\n{err}");
    assert!(err.contains("moat: this command reached the sandbox's memory limit"), "no report: {err}");
    // Ended by the kernel's OOM killer, or by moat when it thrashed there
    // instead (the kernel dropping and reading back its binary's pages).
    assert!(err.contains("OOM killer ended") || err.contains("it stalled there"), "{err}");
    if nested() {
        // The guest's limit works and the next command, and Python in it,
        // run; the next cell's session is the agent's, the same in both
        // backends, and the jail run covers it (under the nested host's
        // TCG a session's start alone takes 45-50 s).
        let (out, err, code, _) = bash(&moat, &id, "echo ok; python3 -c 'print(6 * 7)'", 120_000).await;
        assert_eq!((out.as_str(), code), ("ok\n42\n", Some(0)), "the next command fails: {err}");
        moat.destroy_all().await;
        return;
    }
    assert_recovered(&moat, &id).await;
    // One allocation far past the limit: refused or killed, never the sandbox.
    let (_, err, code, _) = bash(&moat, &id, "python3 -c 'x = bytearray(10**10)'", 120_000).await;
    assert_ne!(code, Some(0), "{err}");
    assert_recovered(&moat, &id).await;
    // Reached by the sandbox's memory as a whole: files an earlier command
    // left in tmpfs count too.
    let (_, err, code, _) = bash(&moat, &id, "head -c 120M /dev/zero > /dev/shm/ballast", 120_000).await;
    assert_eq!(code, Some(0), "{err}");
    let (_, err, code, _) = bash(&moat, &id, grow, 120_000).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("moat: this command reached the sandbox's memory limit"), "{err}");
    assert_recovered(&moat, &id).await;
    // In the Python session itself.
    let cell = "x = []\nwhile True: x.append(bytearray(1 << 20))";
    let _ =
        moat.run_code(&id, Language::Python, cell, Duration::from_secs(120), std::future::pending(), &|_, _| {}).await;
    assert_recovered(&moat, &id).await;
    moat.destroy_all().await;
}

/// A command that times out is killed with everything it started, even a
/// process that left its process group and session.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_timed_out_command_is_killed_with_what_left_its_group() {
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let (_, err, _, timed_out) = bash(&moat, &id, "setsid sleep 1001 & sleep 1000", 1000).await;
    assert!(timed_out, "{err}");
    assert_eq!(count_processes(&moat, &id, "^sleep 100[01]").await, 0, "a sleep outlived the timeout");
    moat.destroy_all().await;
}

/// A command whose caller goes away (a cancelled tool call) is killed with
/// everything it started.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_cancelled_command_is_killed_with_what_left_its_group() {
    // The kill is the timed-out test's, which runs in both backends.
    if nested() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let handle =
        moat.exec(&id, ExecRequest::argv(["bash", "-c", "setsid sleep 1003 & sleep 1002"])).await.expect("starts");
    // A guard against a hang, not a threshold: both start in milliseconds.
    for _ in 0..600 {
        if count_processes(&moat, &id, "^sleep 100[23]").await == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count_processes(&moat, &id, "^sleep 100[23]").await, 2, "the command started both");
    drop(handle);
    let mut left = usize::MAX;
    for _ in 0..600 {
        left = count_processes(&moat, &id, "^sleep 100[23]").await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 0, "a process of the cancelled command is still running");
    moat.destroy_all().await;
}

/// What a command leaves running in the background without reaching a
/// limit (a server started with `&`) keeps running through later commands.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn background_processes_of_a_well_behaved_command_keep_running() {
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let (out, err, code, _) = bash(&moat, &id, "setsid sleep 1004 >/dev/null 2>&1 & echo started", 60_000).await;
    assert_eq!((out.as_str(), code), ("started\n", Some(0)), "{err}");
    for _ in 0..20 {
        let (out, err, code, _) = bash(&moat, &id, "echo ok", 60_000).await;
        assert_eq!((out.as_str(), code), ("ok\n", Some(0)), "{err}");
        assert!(err.is_empty(), "{err}");
    }
    assert_eq!(count_processes(&moat, &id, "^sleep 1004").await, 1, "the background process was killed");
    moat.destroy_all().await;
}

/// Processes frozen in a command's cgroup die with their sandbox. On a
/// cgroup v1 host a frozen process takes no signal, not even SIGKILL,
/// until it is thawed; an agent that dies in the middle of killing a
/// command (its sandbox destroyed meanwhile) leaves that command's cgroup
/// frozen, which once left a background fork bomb's 900 processes on the
/// host after its sandbox and its server were gone.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn frozen_processes_die_with_their_sandbox() {
    let hierarchy = std::path::Path::new("/sys/fs/cgroup/freezer");
    if nested() || !hierarchy.join("moat").exists() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let (monitor, sandbox) = freezer_cgroup(&moat, &id, hierarchy);
    let script =
        "for i in 1 2 3; do setsid sleep 3000 >/dev/null 2>&1 & done; grep -m1 -o 'user/exec-[0-9]*' /proc/self/cgroup";
    let (out, err, code, _) = bash(&moat, &id, script, 60_000).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let exec = sandbox.join(out.trim());
    let pids: Vec<String> = std::fs::read_to_string(exec.join("cgroup.procs"))
        .expect("the command's cgroup")
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(pids.len() >= 3, "the sleeps are not in {}: {pids:?}", exec.display());
    // Frozen as the agent leaves them, and the whole sandbox as an idle
    // suspend leaves it. An unprivileged user's command cgroups are the
    // sandbox root's, one of its subordinate ids: reached as the jail's
    // monitor reaches them, as root of the monitor's user namespace.
    // A v1 freezer may stay FREEZING while a task is caught in the kernel
    // (a fork under way, a page fault under load); writing FROZEN again
    // retries it (a guard against a hang, not a timing).
    let freeze = || {
        if rootless() {
            let froze = std::process::Command::new("nsenter")
                .args(["--user", "--target", &monitor.to_string(), "sh", "-c", "echo FROZEN > \"$0\""])
                .arg(exec.join("freezer.state"))
                .status()
                .expect("nsenter runs");
            assert!(froze.success(), "could not freeze {} from the monitor's user namespace", exec.display());
        } else {
            std::fs::write(exec.join("freezer.state"), "FROZEN").expect("frozen");
        }
        std::fs::read_to_string(exec.join("freezer.state")).expect("read").trim().to_owned()
    };
    let mut state = freeze();
    for _ in 0..500 {
        if state == "FROZEN" {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        state = freeze();
    }
    assert_eq!(state, "FROZEN");
    std::fs::write(sandbox.join("freezer.state"), "FROZEN").expect("frozen");
    moat.destroy(&id).await.expect("destroyed");
    moat.settled().await;
    assert_eq!(
        alive_after_reaping(&pids).await,
        0,
        "processes of the destroyed sandbox are left on the host: {pids:?}"
    );
    assert!(!sandbox.exists(), "the sandbox's freezer cgroup is left");
    moat.destroy_all().await;
}

/// On a cgroup v1 host, commands are forked by their cgroup's launcher
/// (born in their cgroup: no migration, which would take host-wide locks),
/// once the first command's cgroup has one, and keep what the agent gives
/// a command: their own session, the `user` account, their cgroup.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn commands_are_born_in_their_cgroup_on_a_cgroup_v1_host() {
    if nested() || !std::path::Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let script = "tr '\\0' ' ' < /proc/$PPID/cmdline; echo; echo $$ $(ps -o sid=,pgid= -p $$); id -un; grep :pids: /proc/self/cgroup";
    let mut launched = false;
    // The launcher is made once the first command has answered: a later
    // command finds it (a guard against a hang, not a timing).
    for _ in 0..50 {
        let (out, err, code, _) = bash(&moat, &id, script, 60_000).await;
        assert_eq!(code, Some(0), "{out}{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 4, "{out}{err}");
        let ids: Vec<&str> = lines[1].split_whitespace().collect();
        assert!(ids.len() == 3 && ids[0] == ids[1] && ids[0] == ids[2], "not its own session's leader: {out}");
        assert_eq!(lines[2], "user", "{out}");
        assert!(lines[3].contains("/user/exec-"), "not in a command cgroup: {out}");
        if lines[0].starts_with("moat-agent launcher") {
            launched = true;
            break;
        }
        assert!(lines[0].starts_with("/.moat/agent"), "started by neither the agent nor a launcher: {out}");
    }
    assert!(launched, "no command was forked by a launcher");
    moat.destroy_all().await;
}

/// Sandbox root freezes its own command cgroup, beneath which it made a
/// cgroup of its own with processes in it, then the sandbox is destroyed:
/// the destroy thaws from the top down, so nothing is left frozen on the
/// host and no cgroup is left behind (removing the deepest first alone
/// would wait out its guard on processes a parent holds frozen).
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn sandbox_root_freezing_its_own_cgroups_leaves_nothing_behind() {
    let hierarchy = std::path::Path::new("/sys/fs/cgroup/freezer");
    // Rootless too: there the cgroup sandbox root makes beneath a
    // command's is one of its subordinate ids', which the host user cannot
    // remove; moat-agent cgroup-sweep does.
    if nested() || !hierarchy.join("cgroup.procs").exists() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let mut start = ExecRequest::argv([
        "bash",
        "-c",
        "for i in 1 2; do setsid sleep 3000 >/dev/null 2>&1 & done; sleep 0.1; pgrep -x sleep | head -2",
    ]);
    start.user = Some("root".into());
    let out = moat.run(&id, start).await.expect("runs");
    let sleeps: Vec<String> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_owned).collect();
    assert_eq!(sleeps.len(), 2, "{out:?}");
    let script = format!(
        "set -e; exec=$(grep -o 'user/exec-[0-9]*' /proc/{pid}/cgroup | head -1); dir=/.moat/cgroup/freezer/${{exec#user/}}; \
         mkdir $dir/mine && echo {pid} > $dir/mine/cgroup.procs && echo FROZEN > $dir/freezer.state && \
         cat $dir/freezer.state $dir/mine/freezer.state",
        pid = sleeps[0]
    );
    let mut freeze = ExecRequest::argv(["bash", "-c", script.as_str()]);
    freeze.user = Some("root".into());
    let frozen = moat.run(&id, freeze).await.expect("runs");
    let said = format!("{}{}", String::from_utf8_lossy(&frozen.stdout), String::from_utf8_lossy(&frozen.stderr));
    assert_eq!(frozen.status.code, Some(0), "sandbox root could not freeze its cgroups: {said}");
    let (_, sandbox) = freezer_cgroup(&moat, &id, hierarchy);
    let host_pids = processes_beneath(std::slice::from_ref(&sandbox));
    assert!(host_pids.len() >= 3, "the sandbox's processes: {host_pids:?}");
    moat.destroy(&id).await.expect("destroyed");
    moat.settled().await;
    assert_eq!(
        alive_after_reaping(&host_pids).await,
        0,
        "processes of the destroyed sandbox are left on the host: {host_pids:?}"
    );
    assert!(!sandbox.exists(), "the sandbox's freezer cgroup is left ({said})");
    moat.destroy_all().await;
}

/// The sandbox `id`'s monitor and freezer cgroup, found from the monitor's
/// own: `moat/ID/agent`, or `moat/user-UID/ID/agent` for an unprivileged
/// user's.
fn freezer_cgroup(moat: &Moat, id: &str, hierarchy: &std::path::Path) -> (u32, std::path::PathBuf) {
    let monitor = moat.host_pid(id).expect("live");
    let dir =
        sandbox_cgroups(monitor, id).into_iter().find(|dir| dir.starts_with(hierarchy)).expect("a freezer cgroup");
    (monitor, dir)
}

/// The sandbox `id`'s cgroup in every hierarchy, from its monitor's.
fn sandbox_cgroups(monitor: u32, id: &str) -> Vec<std::path::PathBuf> {
    let cgroups = std::fs::read_to_string(format!("/proc/{monitor}/cgroup")).expect("the monitor's cgroups");
    cgroups
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let at = path.find(id)? + id.len();
            let hierarchy = std::path::Path::new("/sys/fs/cgroup").join(controllers);
            Some(hierarchy.join(path[..at].trim_start_matches('/')))
        })
        .collect()
}

/// Held-out variants of sandbox root's cgroups: in every hierarchy the
/// agent gives it, beneath `user` (one closed to everyone, mode 0) and
/// beneath a command's cgroup, deeper and with a longer path than a walk
/// by path reaches, one holding a process; and the jail's monitor
/// SIGKILLed before the destroy. Nothing
/// of the sandbox, process or cgroup, is left on the host (rootless, the
/// cgroups are its subordinate ids' and moat-agent cgroup-sweep removes
/// them).
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn sandbox_root_cgroups_at_any_depth_leave_nothing_behind() {
    if nested() || !std::path::Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let script = r#"set -e
        long=$(printf 'c%.0s' $(seq 200))
        setsid sleep 3000 >/dev/null 2>&1 < /dev/null &
        sleeper=$!
        for d in /.moat/cgroup/*; do
            exec=$(grep -o 'user/exec-[0-9]*' /proc/self/cgroup | head -1)
            mkdir -p "$d/mine/deeper"
            chmod 0 "$d/mine"
            cd "$d/${exec#user/}"
            for i in $(seq 24); do mkdir "$long$i"; cd "$long$i"; done
            if [ "$(basename "$d")" = pids ]; then echo "$sleeper" > cgroup.procs; fi
        done
        echo "$sleeper""#;
    let mut make = ExecRequest::argv(["bash", "-c", script]);
    make.user = Some("root".into());
    let made = moat.run(&id, make).await.expect("runs");
    let said = format!("{}{}", String::from_utf8_lossy(&made.stdout), String::from_utf8_lossy(&made.stderr));
    assert_eq!(made.status.code, Some(0), "sandbox root could not make its cgroups: {said}");
    let monitor = moat.host_pid(&id).expect("live");
    let dirs = sandbox_cgroups(monitor, &id);
    assert!(dirs.len() >= 2, "the sandbox's cgroups: {dirs:?}");
    let host_pids = processes_beneath(&dirs);
    assert!(host_pids.len() >= 3, "the sandbox's processes: {host_pids:?}");
    // The monitor dies first, as in a crash: its keeper and the sandbox's
    // init see it go, and the destroy finds the rest.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(monitor).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    );
    moat.destroy(&id).await.expect("destroyed");
    moat.settled().await;
    assert_eq!(
        alive_after_reaping(&host_pids).await,
        0,
        "processes of the destroyed sandbox are left on the host: {host_pids:?}"
    );
    let left: Vec<_> = dirs.iter().filter(|dir| dir.exists()).collect();
    assert!(left.is_empty(), "the sandbox's cgroups are left: {left:?} ({said})");
    moat.destroy_all().await;
}

/// How many of `pids` are still on the host once the host has had time to
/// reap them after their kill (a guard against a hang, not a timing).
async fn alive_after_reaping(pids: &[String]) -> usize {
    let alive = || pids.iter().filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists()).count();
    for _ in 0..1000 {
        if alive() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    alive()
}

/// The host pids of every process in the cgroups `dirs` and beneath them.
fn processes_beneath(dirs: &[std::path::PathBuf]) -> Vec<String> {
    dirs.iter()
        .flat_map(|dir| cgroup_dirs(dir))
        .filter_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .flat_map(|procs| procs.lines().map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

/// Every cgroup directory at and beneath `dir`.
fn cgroup_dirs(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < found.len() {
        if let Ok(entries) = std::fs::read_dir(&found[i]) {
            found.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
        i += 1;
    }
    found
}

/// A command marked `last` (a one-shot `moat run`) leaves its cgroup no
/// launcher to make for a next command; one that comes anyway runs, as a
/// first command does, started by the agent.
#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_last_command_leaves_no_launcher_behind() {
    if nested() || !std::path::Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists() {
        return;
    }
    let moat = moat(16).await;
    let id = moat.create(small()).await.expect("created").id;
    let mut last = ExecRequest::argv(["true"]);
    last.last = true;
    let out = moat.run(&id, last).await.expect("runs");
    assert_eq!(out.status.code, Some(0));
    // Were a launcher being made, the command below would see it in the
    // process list (it is made before the cgroup is free for the next).
    let (out, err, code, _) = bash(&moat, &id, "ps -e -o args=; tr '\\0' ' ' < /proc/$PPID/cmdline", 60_000).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(!out.contains("moat-agent launcher"), "a launcher after a last command: {out}");
    assert!(out.trim_end().ends_with("/.moat/agent --listen fd:3 --log-level warn"), "not started by the agent: {out}");
    moat.destroy_all().await;
}

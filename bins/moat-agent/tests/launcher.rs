//! A launcher started from the real binary: commands through it run with
//! their streams, environment, directory, terminal, credentials and exit
//! status, a missing program or directory is named, and the launcher
//! serves the next command and ends when the agent lets it go.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use moat_agent::launcher::{Launch, Launcher, NotStarted};
use moat_agent::reaper::{Exit, Reaper};

fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("a pipe")
}

fn launch(argv: &[&str]) -> Launch {
    Launch {
        argv: argv.iter().map(|a| (*a).to_owned()).collect(),
        env: vec!["PATH=/usr/bin:/bin".into(), "GREETING=hello".into()],
        cwd: "/tmp".into(),
        user: None,
        pty: false,
    }
}

#[tokio::test]
async fn commands_run_through_a_launcher_until_it_is_let_go() {
    let reaper = Reaper::start().expect("a reaper");
    let launcher =
        Launcher::spawn_program(&reaper, &[], env!("CARGO_BIN_EXE_moat-agent").as_ref()).expect("a launcher");
    let launcher_pid = launcher.pid();
    let slot = Arc::new(Mutex::new(None));

    let (out_read, out_write) = pipe();
    let null = || OwnedFd::from(std::fs::File::open("/dev/null").expect("/dev/null"));
    let script = launch(&["sh", "-c", "echo $GREETING from $(pwd) $$; exit 3"]);
    let (pid, exit) = launcher
        .start(&script, [null(), out_write, null()], slot.clone())
        .await
        .expect("the launcher answers")
        .expect("sh starts");
    let mut out = String::new();
    std::fs::File::from(out_read).read_to_string(&mut out).expect("the output");
    assert_eq!(out.trim(), format!("hello from /tmp {pid}"));
    assert_eq!(exit.await.expect("an exit"), Exit::Code(3));

    // Handed back on exit: the next command, and a missing program.
    let launcher = slot.lock().expect("the slot").take().expect("the launcher is back");
    assert_eq!(launcher.pid(), launcher_pid);
    let missing = launcher
        .start(&launch(&["no-such-program-here"]), [null(), null(), null()], slot.clone())
        .await
        .expect("the launcher answers");
    assert_eq!(missing.err(), Some(NotStarted { errno: nix::libc::ENOENT, what: "exec".into() }));
    let launcher = slot.lock().expect("the slot").take().expect("back after a failed start");
    let (_, exit) = launcher
        .start(&launch(&["sh", "-c", "kill -9 $$"]), [null(), null(), null()], slot.clone())
        .await
        .expect("the launcher answers")
        .expect("sh starts");
    assert_eq!(exit.await.expect("an exit"), Exit::Signal(nix::libc::SIGKILL));

    // On a terminal: the command's controlling terminal is the PTY.
    let launcher = slot.lock().expect("the slot").take().expect("back after a signal");
    let pty = nix::pty::openpty(None, None).expect("a pty");
    let slave = || pty.slave.try_clone().expect("the slave");
    let mut on_terminal = launch(&["sh", "-c", "test -t 0 && test -t 1 && echo tty; ps -o tty= -p $$"]);
    on_terminal.pty = true;
    let (_, exit) = launcher
        .start(&on_terminal, [slave(), slave(), slave()], slot.clone())
        .await
        .expect("the launcher answers")
        .expect("sh starts");
    drop(pty.slave);
    assert_eq!(exit.await.expect("an exit"), Exit::Code(0));
    let mut said = Vec::new();
    // A PTY master reads EIO once the last slave is closed: its end.
    let _ = std::fs::File::from(pty.master).read_to_end(&mut said);
    let said = String::from_utf8_lossy(&said);
    let lines: Vec<&str> = said.lines().map(str::trim).collect();
    assert_eq!(lines.first().copied(), Some("tty"), "{said}");
    assert!(lines.get(1).is_some_and(|t| t.starts_with("pts/")), "no controlling terminal: {said}");

    // A working directory that is not there is named, and the launcher
    // serves on: the failed child shared its memory and left it whole.
    let launcher = slot.lock().expect("the slot").take().expect("back after a terminal");
    let mut nowhere = launch(&["true"]);
    nowhere.cwd = "/no/such/directory".into();
    let refused = launcher.start(&nowhere, [null(), null(), null()], slot.clone()).await.expect("the launcher answers");
    assert_eq!(
        refused.err(),
        Some(NotStarted { errno: nix::libc::ENOENT, what: "entering the working directory".into() })
    );

    // Another user's credentials, all of them (as root only: anyone else
    // may not take them).
    let launcher = slot.lock().expect("the slot").take().expect("back after a failed start");
    if nix::unistd::geteuid().is_root() {
        let (out_read, out_write) = pipe();
        let mut nobody = launch(&[
            "sh",
            "-c",
            "echo $(id -u) $(id -g) $(id -G) $(awk '/^Uid:/{print $2 $3 $4 $5}' /proc/$$/status)",
        ]);
        nobody.user = Some((65534, 65534, vec![65534, 100]));
        let (_, exit) = launcher
            .start(&nobody, [null(), out_write, null()], slot.clone())
            .await
            .expect("the launcher answers")
            .expect("sh starts");
        let mut out = String::new();
        std::fs::File::from(out_read).read_to_string(&mut out).expect("the output");
        assert_eq!(exit.await.expect("an exit"), Exit::Code(0));
        assert_eq!(out.trim(), "65534 65534 65534 100 65534655346553465534", "real, effective, saved and file ids");
    } else {
        *slot.lock().expect("the slot") = Some(launcher);
    }

    // Let go, it ends (and is reaped).
    drop(slot.lock().expect("the slot").take().expect("back after a terminal"));
    let pidfd = moat_agent::pidfd::Pidfd::of_pid(launcher_pid);
    if let Ok(pidfd) = pidfd {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        assert!(moat_agent::pidfd::wait_all(&[pidfd], deadline), "the launcher outlived its socket");
    }
}

//! The real agent binary on a Unix socket, driven by the `moat-proto` client:
//! processes.

// Test data is generated with `as u8` on purpose.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{TestAgent, process_exists};
use moat_proto::{ErrorKind, ExecRequest, WinSize};

#[tokio::test]
async fn exit_codes_output_and_environment() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let mut req = ExecRequest::shell("echo out; echo err >&2; echo \"$GREETING $HOME\"; pwd; exit 3");
    req.env.push(("GREETING".into(), "hi".into()));
    req.cwd = Some(agent.dir().to_string_lossy().into_owned());
    let out = client.run(req).await.expect("runs");
    assert_eq!(out.status.code, Some(3));
    assert_eq!(out.stderr, b"err\n");
    let stdout = String::from_utf8(out.stdout).expect("utf8");
    let lines: Vec<_> = stdout.lines().collect();
    assert_eq!(lines[0], "out");
    assert!(lines[1].starts_with("hi /"), "{stdout}");
    assert_eq!(lines[2], agent.dir().to_string_lossy());
}

/// A command starts as a fresh program would: no signal blocked or
/// ignored (the agent, a Rust program, ignores SIGPIPE and handles
/// SIGCHLD), a session of its own.
#[tokio::test]
async fn commands_start_with_default_signals_in_a_session_of_their_own() {
    let agent = TestAgent::start().await;
    let out = agent
        .client()
        .run(ExecRequest::argv([
            "sh",
            "-c",
            "grep -E '^Sig(Blk|Ign)' /proc/self/status; ps -o sid= -o pgid= -p $$; echo $$",
        ]))
        .await
        .expect("runs");
    let stdout = String::from_utf8(out.stdout).expect("utf8");
    let lines: Vec<&str> = stdout.lines().map(str::trim).collect();
    assert_eq!(lines.get(..2), Some(&["SigBlk:\t0000000000000000", "SigIgn:\t0000000000000000"][..]), "{stdout}");
    let ids: Vec<&str> = lines.get(2).map(|l| l.split_whitespace().collect()).unwrap_or_default();
    let pid = lines.get(3).copied().unwrap_or_default();
    assert_eq!(ids, [pid, pid], "the command leads its session and group: {stdout}");
}

#[tokio::test]
async fn argv_is_not_split_by_a_shell() {
    let agent = TestAgent::start().await;
    let out = agent.client().run(ExecRequest::argv(["printf", "%s|", "a b", "$HOME", "*"])).await.expect("runs");
    assert_eq!(out.stdout, b"a b|$HOME|*|");
}

#[tokio::test]
async fn missing_command_and_bad_requests_are_typed_errors() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let err = client.run(ExecRequest::argv(["no-such-program-xyz"])).await.expect_err("not found");
    assert_eq!(err.kind(), Some(ErrorKind::NotFound), "{err}");
    assert!(err.to_string().contains("command not found: no-such-program-xyz"), "{err}");

    let err = client.run(ExecRequest::argv(Vec::<String>::new())).await.expect_err("empty argv");
    assert_eq!(err.kind(), Some(ErrorKind::InvalidRequest));

    let mut req = ExecRequest::shell("true");
    req.cwd = Some("/no/such/dir".into());
    let err = client.run(req).await.expect_err("bad cwd");
    assert_eq!(err.kind(), Some(ErrorKind::NotFound));
    assert!(err.to_string().contains("working directory /no/such/dir"), "{err}");

    let mut req = ExecRequest::shell("true");
    req.user = Some("no-such-user-xyz".into());
    assert_eq!(client.run(req).await.expect_err("bad user").kind(), Some(ErrorKind::NotFound));

    let mut req = ExecRequest::shell("true");
    req.timeout_ms = Some(0);
    assert_eq!(client.run(req).await.expect_err("zero timeout").kind(), Some(ErrorKind::InvalidRequest));
}

#[tokio::test]
async fn runs_as_another_user() {
    let agent = TestAgent::start().await;
    let mut req = ExecRequest::argv(["id", "-u"]);
    req.user = Some("65534".into());
    let out = agent.client().run(req).await.expect("runs");
    assert_eq!(out.stdout, b"65534\n");
}

/// 64 MiB of output streams through without the agent holding it: the
/// agent's peak memory stays far below the volume, even while the client
/// does not read for a while (the process is back-pressured instead).
#[tokio::test]
async fn large_output_streams_with_bounded_memory() {
    const TOTAL: u64 = 64 << 20;
    let agent = TestAgent::start().await;
    let before = agent.peak_rss_kib();
    let mut handle =
        agent.client().exec(ExecRequest::argv(["head", "-c", &TOTAL.to_string(), "/dev/zero"])).await.expect("starts");
    let mut stdout = handle.take_stdout().expect("stdout");
    // Not reading: the writer must block on a full pipe, not fill memory.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stalled = agent.peak_rss_kib();
    let mut received = 0u64;
    while let Some(chunk) = stdout.recv().await {
        assert!(chunk.iter().all(|b| *b == 0));
        received += chunk.len() as u64;
    }
    let status = handle.wait().await;
    assert!(status.as_ref().is_ok_and(|s| s.success()), "{status:?}");
    assert_eq!(received, TOTAL);
    let peak = agent.peak_rss_kib();
    assert!(stalled < before + 16 * 1024, "agent grew from {before} KiB to {stalled} KiB while the client stalled");
    assert!(peak < before + 24 * 1024, "agent grew from {before} KiB to {peak} KiB streaming 64 MiB");
}

/// Past `output_limit`, the agent reads a stream and drops it: the client
/// gets the limit of each stream whole, the process runs to its end
/// unhindered, and the exit says how much was dropped.
#[tokio::test]
async fn output_past_the_limit_is_read_and_dropped() {
    const LIMIT: u64 = 1 << 20;
    let agent = TestAgent::start().await;
    let script = "head -c 40000000 /dev/zero; seq 1 300000 >&2; echo done >&2";
    let mut request = ExecRequest::shell(script);
    request.output_limit = Some(LIMIT);
    let out = agent.client().run(request).await.expect("runs");
    assert_eq!(out.status.code, Some(0));
    assert_eq!(out.stdout.len() as u64, LIMIT);
    assert_eq!(out.stderr.len() as u64, LIMIT);
    assert!(out.stderr.starts_with(b"1\n2\n3\n"), "stderr is kept from its start");
    let seq_bytes: u64 = (1..=300_000u64).map(|n| n.to_string().len() as u64 + 1).sum();
    assert_eq!(out.status.dropped_bytes, 40_000_000 - LIMIT + seq_bytes + 5 - LIMIT);
    assert!(out.truncated);
    // Without a limit, nothing is dropped.
    let out = agent.client().run(ExecRequest::shell("head -c 3000000 /dev/zero")).await.expect("runs");
    assert_eq!((out.stdout.len(), out.status.dropped_bytes, out.truncated), (3_000_000, 0, false));
}

#[tokio::test]
async fn stdin_round_trip() {
    let agent = TestAgent::start().await;
    let mut req = ExecRequest::argv(["sha256sum"]);
    req.stdin = true;
    let mut handle = agent.client().exec(req).await.expect("starts");
    let mut stdin = handle.take_stdin().expect("stdin");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let writer = tokio::spawn(async move {
        stdin.write(Bytes::from(data)).await.expect("stdin accepted");
        stdin.close().await.expect("stdin closed");
    });
    let out = handle.output().await.expect("exits");
    writer.await.expect("writer");
    assert!(out.status.success(), "{out:?}");
    let expected: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let local = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(&expected)?;
            c.wait_with_output()
        })
        .expect("local sha256sum");
    assert_eq!(out.stdout, local.stdout);
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    let agent = TestAgent::start().await;
    let mut req = ExecRequest::shell("sleep 1000 & echo $!; sleep 1000");
    req.timeout_ms = Some(300);
    let mut handle = agent.client().exec(req).await.expect("starts");
    let mut stdout = handle.take_stdout().expect("stdout");
    let first = stdout.recv().await.expect("grandchild pid");
    let grandchild: u32 = String::from_utf8_lossy(&first).trim().parse().expect("a pid");
    let status = handle.wait().await.expect("exits");
    assert!(status.timed_out);
    assert_eq!(status.signal, Some(9));
    // The grandchild was killed too, and reaped by the agent (a subreaper).
    for _ in 0..200 {
        if !process_exists(grandchild) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("grandchild {grandchild} survived the timeout");
}

#[tokio::test]
async fn signals_reach_the_process() {
    let agent = TestAgent::start().await;
    let handle = agent.client().exec(ExecRequest::argv(["sleep", "1000"])).await.expect("starts");
    handle.signal(15).await.expect("signal sent");
    let status = handle.wait().await.expect("exits");
    assert_eq!((status.code, status.signal, status.timed_out), (None, Some(15), false));
}

#[tokio::test]
async fn client_disconnect_kills_the_process() {
    let agent = TestAgent::start().await;
    let out = agent.client().run(ExecRequest::shell("echo $$")).await.expect("runs");
    assert!(out.status.success());
    let handle = agent.client().exec(ExecRequest::shell("sleep 1000")).await.expect("starts");
    let pid = handle.pid();
    drop(handle);
    for _ in 0..200 {
        if !process_exists(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("process {pid} outlived its client");
}

#[tokio::test]
async fn background_children_do_not_hold_the_exec_open() {
    let agent = TestAgent::start().await;
    let out = agent.client().run(ExecRequest::shell("sleep 30 & echo started")).await.expect("runs");
    assert_eq!(out.stdout, b"started\n");
    assert!(out.status.success());
}

#[tokio::test]
async fn pty_echo_and_resize() {
    let agent = TestAgent::start().await;
    let mut req = ExecRequest::shell("stty size; read line; echo \"got:$line\"; stty size");
    req.stdin = true;
    req.pty = Some(WinSize { rows: 24, cols: 80 });
    let mut handle = agent.client().exec(req).await.expect("starts");
    let mut stdin = handle.take_stdin().expect("stdin");
    let mut stdout = handle.take_stdout().expect("stdout");
    let mut seen = String::new();
    while !seen.contains("24 80") {
        seen.push_str(&String::from_utf8_lossy(&stdout.recv().await.expect("size line")));
    }
    handle.resize(WinSize { rows: 40, cols: 100 }).await.expect("resized");
    stdin.write(Bytes::from_static(b"hello\n")).await.expect("typed");
    while let Some(chunk) = stdout.recv().await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let status = handle.wait().await.expect("exits");
    assert!(status.success(), "{seen}");
    // The terminal echoes what was typed, then the shell prints it.
    assert!(seen.contains("hello\r\n"), "{seen:?}");
    assert!(seen.contains("got:hello"), "{seen:?}");
    assert!(seen.contains("40 100"), "{seen:?}");
}

#[tokio::test]
async fn fifty_operations_at_once() {
    let agent = TestAgent::start().await;
    let mut tasks = Vec::new();
    for i in 0..64 {
        let client = agent.client();
        let path = agent.path(&format!("f{i}"));
        tasks.push(tokio::spawn(async move {
            let out = client.run(ExecRequest::shell(format!("echo {i}"))).await.expect("runs");
            assert_eq!(out.stdout, format!("{i}\n").into_bytes());
            let req =
                moat_proto::WriteFileRequest { path: path.clone(), mode: None, create_parents: false, owner: None };
            client.write_file(req, &mut format!("file {i}").as_bytes()).await.expect("writes");
            let back =
                client.read_file(moat_proto::ReadFileRequest { path, offset: 0, length: None }).await.expect("reads");
            assert_eq!(back, format!("file {i}").into_bytes());
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
}

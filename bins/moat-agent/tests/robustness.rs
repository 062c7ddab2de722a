//! The real agent binary: as PID 1 of a pid namespace, and under bad input.

mod common;

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::TestAgent;
use moat_proto::{
    AgentMsg, ClientMsg, Connection, ErrorKind, ExecRequest, Frame, PROTOCOL_VERSION, Request, StreamId, Version,
};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// Zombies among the processes of the agent's pid namespace, read from
/// inside (the agent mounted the namespace's own /proc).
async fn zombies(agent: &TestAgent) -> Vec<String> {
    let script = "for f in /proc/[0-9]*/stat; do cat $f 2>/dev/null; echo; done";
    let out = agent.client().run(ExecRequest::shell(script)).await.expect("lists processes");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn as_pid1_it_sets_up_the_machine_and_reaps_orphans() {
    let agent = TestAgent::start_with(
        &["unshare", "--pid", "--fork", "--kill-child", "--mount", "--uts", "--net"],
        &["--init", "--hostname", "sbx-test"],
    )
    .await;
    let client = agent.client();
    let info = client.info().await.expect("info");
    assert!(info.init, "agent should be PID 1: {info:?}");
    assert_eq!(info.hostname, "sbx-test");

    let out = client
        .run(ExecRequest::shell("echo $$; hostname; cat /sys/class/net/lo/operstate; ls /dev/pts/ptmx"))
        .await
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<_> = text.lines().collect();
    assert!(lines[0].parse::<u32>().is_ok_and(|pid| pid > 1), "{text}");
    assert_eq!(lines[1], "sbx-test");
    assert_ne!(lines[2], "down", "loopback must be up: {text}");

    // Orphans: each inner shell exits at once, leaving its child to be
    // re-parented to PID 1 — the agent — which must reap them.
    let out = client
        .run(ExecRequest::shell("for i in 1 2 3 4 5 6 7 8; do sh -c 'sleep 0.2 &' ; done; echo spawned"))
        .await
        .expect("spawns orphans");
    assert_eq!(out.stdout, b"spawned\n");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut left = zombies(&agent).await;
    for _ in 0..50 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = zombies(&agent).await;
    }
    assert!(left.is_empty(), "zombies were not reaped: {left:#?}");
}

/// A raw connection, for speaking the protocol wrongly on purpose.
async fn raw(agent: &TestAgent) -> UnixStream {
    UnixStream::connect(&agent.socket).await.expect("connect")
}

async fn first_error(conn: &mut Connection<UnixStream>) -> moat_proto::WireError {
    loop {
        match conn.recv().await {
            Some(Ok(Frame::Message(body))) => match moat_proto::conn::decode_message::<AgentMsg>(&body) {
                Ok(AgentMsg::Error { error }) => return error,
                Ok(_) => {}
                Err(e) => panic!("undecodable reply: {e}"),
            },
            other => panic!("expected an error message, got {other:?}"),
        }
    }
}

fn hello() -> ClientMsg {
    ClientMsg::Hello { version: PROTOCOL_VERSION, client: "robustness-test".into() }
}

#[tokio::test]
async fn bad_input_gets_typed_errors_and_the_agent_keeps_serving() {
    let agent = TestAgent::start().await;

    // Garbage that is not even a frame: an unknown tag.
    let mut stream = raw(&agent).await;
    stream.write_all(&[0, 0, 0, 3, 0x7f, 1, 2]).await.expect("write");
    let err = first_error(&mut Connection::new(stream)).await;
    assert_eq!(err.kind, ErrorKind::Malformed);
    assert!(err.message.contains("Unknown frame tag"), "{}", err.message);

    // A frame header announcing 1 GiB: refused before any allocation.
    let mut stream = raw(&agent).await;
    stream.write_all(&(1u32 << 30).to_be_bytes()).await.expect("write");
    let err = first_error(&mut Connection::new(stream)).await;
    assert_eq!(err.kind, ErrorKind::Malformed);
    assert!(err.message.contains("larger than"), "{}", err.message);

    // JSON that is not a message, and invalid UTF-8 inside a JSON string.
    for body in [
        &b"{\"type\":\"warp\"}"[..],
        b"{\"type\":\"hello\",\"version\":{\"major\":1,\"minor\":0},\"client\":\"\xff\xfe\"}",
    ] {
        let mut conn = Connection::new(raw(&agent).await);
        conn.send_frame(Frame::Message(Bytes::copy_from_slice(body))).await.expect("send");
        assert_eq!(first_error(&mut conn).await.kind, ErrorKind::Malformed);
    }

    // Another major version.
    let mut conn = Connection::new(raw(&agent).await);
    conn.send(&ClientMsg::Hello { version: Version { major: 9, minor: 0 }, client: "future".into() })
        .await
        .expect("send");
    let err = first_error(&mut conn).await;
    assert_eq!(err.kind, ErrorKind::VersionMismatch);
    assert!(err.message.contains("protocol 9.0"), "{}", err.message);

    // An operation from the future.
    let mut conn = Connection::new(raw(&agent).await);
    conn.send(&hello()).await.expect("send");
    conn.send_frame(Frame::Message(Bytes::from_static(b"{\"type\":\"request\",\"request\":{\"op\":\"teleport\"}}")))
        .await
        .expect("send");
    let err = first_error(&mut conn).await;
    assert_eq!(err.kind, ErrorKind::UnknownOperation);
    assert!(err.message.contains("it supports: exec, read_file"), "{}", err.message);

    // Absurd numbers: a negative offset and a length beyond u64.
    let mut conn = Connection::new(raw(&agent).await);
    conn.send(&hello()).await.expect("send");
    conn.send_frame(Frame::Message(Bytes::from_static(
        b"{\"type\":\"request\",\"request\":{\"op\":\"read_file\",\"path\":\"/etc/hostname\",\"offset\":-5,\"length\":99999999999999999999999}}",
    )))
    .await
    .expect("send");
    assert_eq!(first_error(&mut conn).await.kind, ErrorKind::Malformed);

    // Data before any request.
    let mut conn = Connection::new(raw(&agent).await);
    conn.send_data(StreamId::Input, Bytes::from_static(b"xx")).await.expect("send");
    assert_eq!(first_error(&mut conn).await.kind, ErrorKind::Malformed);

    // A truncated frame followed by a hang-up: nothing to answer, no crash.
    let mut stream = raw(&agent).await;
    let mut partial = BytesMut::new();
    partial.put_u32(100);
    partial.put_u8(1);
    stream.write_all(&partial).await.expect("write");
    drop(stream);

    // A request with an unknown user and a huge timeout.
    let mut conn = Connection::new(raw(&agent).await);
    conn.send(&hello()).await.expect("send");
    let mut exec = ExecRequest::shell("true");
    exec.timeout_ms = Some(u64::MAX);
    conn.send(&ClientMsg::Request { request: Request::Exec(exec) }).await.expect("send");
    assert_eq!(first_error(&mut conn).await.kind, ErrorKind::InvalidRequest);

    // Through all of it, the agent still serves.
    let out = agent.client().run(ExecRequest::shell("echo alive")).await.expect("still serving");
    assert_eq!(out.stdout, b"alive\n");
}

#[tokio::test]
async fn client_refuses_an_agent_of_another_major_version() {
    // A fake agent that answers with version 2.
    let (client_side, agent_side) = UnixStream::pair().expect("pair");
    let fake = tokio::spawn(async move {
        let mut conn = Connection::new(agent_side);
        let _hello = conn.recv().await;
        let _request = conn.recv().await;
        conn.send(&AgentMsg::Welcome { version: Version { major: 2, minor: 0 }, agent: "fake".into() })
            .await
            .expect("send");
    });
    struct Once(std::sync::Mutex<Option<UnixStream>>);
    impl moat_proto::Connector for Once {
        type Stream = UnixStream;
        #[allow(clippy::manual_async_fn)]
        fn connect(&self) -> impl std::future::Future<Output = std::io::Result<UnixStream>> + Send {
            let stream = self.0.lock().expect("lock").take();
            async move { stream.ok_or_else(|| std::io::Error::other("used twice")) }
        }
    }
    let client = moat_proto::AgentClient::new(Once(std::sync::Mutex::new(Some(client_side))));
    let err = client.info().await.expect_err("refused");
    assert!(matches!(err, moat_proto::ProtoError::VersionMismatch { .. }), "{err}");
    assert!(err.to_string().contains("protocol 2.0"), "{err}");
    fake.await.expect("fake agent");
}

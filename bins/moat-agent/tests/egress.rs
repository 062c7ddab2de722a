//! The egress proxy of the real agent binary, driven over the protocol as
//! the host drives it: requests reported, refusals answered 403 with the
//! host's reason, attached tunnels spliced, unknown ids refused, and the
//! proxy gone with its control connection. Everything stays on loopback.

mod common;

use common::TestAgent;
use moat_proto::ErrorKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

async fn read_all(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test]
async fn the_proxy_reports_clients_and_applies_the_hosts_answers() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let port = free_port();
    let mut control = client.egress_listen(port).await.expect("the proxy listens");

    // Refused: the client gets 403 with the reason in the status line and body.
    let mut refused = TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
    refused.write_all(b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n").await.expect("sends");
    let request = control.next_request().await.expect("a request").expect("decodes");
    assert_eq!((request.host.as_str(), request.port), ("evil.test", 443));
    control.deny(request.id, "moat refused evil.test:443: not allowed\nmore detail".into()).await.expect("denies");
    let response = read_all(&mut refused).await;
    assert!(response.starts_with("HTTP/1.1 403 moat refused evil.test:443: not allowed\r\n"), "{response}");
    assert!(response.ends_with("not allowed\nmore detail\n"), "{response}");

    // Allowed (plain HTTP): the head goes upstream in origin form, then bytes flow.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
    plain
        .write_all(b"GET http://good.test:8080/a?b HTTP/1.1\r\nHost: good.test:8080\r\n\r\nbody")
        .await
        .expect("sends");
    let request = control.next_request().await.expect("a request").expect("decodes");
    assert_eq!((request.host.as_str(), request.port), ("good.test", 8080));
    let mut upstream = client.egress_attach(request.id).await.expect("attaches");
    let mut head = vec![0u8; b"GET /a?b HTTP/1.1\r\nHost: good.test:8080\r\n\r\nbody".len()];
    upstream.read_exact(&mut head).await.expect("the request arrives upstream");
    assert_eq!(head, b"GET /a?b HTTP/1.1\r\nHost: good.test:8080\r\n\r\nbody");
    upstream.write_all(b"HTTP/1.0 200 OK\r\n\r\nhello").await.expect("answers");
    upstream.shutdown().await.expect("closes");
    drop(upstream);
    assert_eq!(read_all(&mut plain).await, "HTTP/1.0 200 OK\r\n\r\nhello");

    // Allowed (CONNECT): 200 to the client, then a tunnel.
    let mut tunnel = TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
    tunnel.write_all(b"CONNECT good.test:443 HTTP/1.1\r\n\r\n").await.expect("sends");
    let request = control.next_request().await.expect("a request").expect("decodes");
    let mut upstream = client.egress_attach(request.id).await.expect("attaches");
    let mut established = vec![0u8; b"HTTP/1.1 200 Connection established\r\n\r\n".len()];
    tunnel.read_exact(&mut established).await.expect("reads");
    assert_eq!(established, b"HTTP/1.1 200 Connection established\r\n\r\n");
    tunnel.write_all(b"ping").await.expect("sends");
    let mut ping = [0u8; 4];
    upstream.read_exact(&mut ping).await.expect("arrives");
    assert_eq!(&ping, b"ping");

    // An id nobody waits for, a bad request, then the proxy ends with its control connection.
    let err = client.egress_attach(999_999).await.expect_err("nobody waits");
    assert_eq!(err.kind(), Some(ErrorKind::NotFound), "{err}");
    let mut bad = TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
    bad.write_all(b"GET /relative HTTP/1.1\r\n\r\n").await.expect("sends");
    assert!(read_all(&mut bad).await.starts_with("HTTP/1.1 400"), "not a proxy request");
    drop(control);
    let mut closed = false;
    for _ in 0..500 {
        if TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(closed, "the proxy outlived its control connection");
}

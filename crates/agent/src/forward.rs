//! Port forwarding: splice the connection to a TCP port on the sandbox's loopback.

use moat_proto::{AgentMsg, Connection, ErrorKind, Reply, WireError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::error::io_error;

/// Connects to 127.0.0.1:`port`, answers `Connected`, then copies raw bytes
/// both ways until either side closes.
pub async fn serve<S>(port: u16, mut conn: Connection<S>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let target = match connect(port).await {
        Ok(target) => target,
        Err(error) => {
            let _ = conn.send(&AgentMsg::Error { error }).await;
            return;
        }
    };
    if conn.send(&AgentMsg::Reply { reply: Reply::Connected }).await.is_err() {
        return;
    }
    let mut client = conn.into_raw();
    let mut target = target;
    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut target).await {
        tracing::debug!(port, "port forward ended: {e}");
    }
}

async fn connect(port: u16) -> Result<TcpStream, WireError> {
    if port == 0 {
        return Err(WireError::new(ErrorKind::InvalidRequest, "port 0 is not a port; allowed are 1 to 65535"));
    }
    TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => WireError::new(
            ErrorKind::ConnectionRefused,
            format!("nothing is listening on 127.0.0.1:{port} in the sandbox; start the server first (listening on 0.0.0.0 or 127.0.0.1)"),
        ),
        _ => io_error(&format!("connecting to 127.0.0.1:{port}"), &e),
    })
}

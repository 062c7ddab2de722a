//! A framed connection: the one type both the client and the agent use to
//! send and receive frames and messages.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::codec::{Framed, FramedParts};

use crate::frame::{Frame, FrameCodec, FrameError, StreamId};

/// A stream of frames over any byte stream.
#[derive(Debug)]
pub struct Connection<S> {
    framed: Framed<S, FrameCodec>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    pub fn new(stream: S) -> Self {
        Self { framed: Framed::new(stream, FrameCodec::default()) }
    }

    /// A connection that refuses frames longer than `max` bytes (for one
    /// whose messages are all small, so that a peer parks no more).
    pub fn with_max_frame(stream: S, max: usize) -> Self {
        Self { framed: Framed::new(stream, FrameCodec::with_max_len(max)) }
    }

    /// Encodes and sends one message frame.
    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), FrameError> {
        self.framed.send(encode_message(msg)?).await
    }

    /// Queues one message frame without flushing, to batch it with the next.
    pub async fn feed<T: Serialize>(&mut self, msg: &T) -> Result<(), FrameError> {
        self.framed.feed(encode_message(msg)?).await
    }

    pub async fn send_data(&mut self, stream: StreamId, bytes: Bytes) -> Result<(), FrameError> {
        self.framed.send(Frame::Data(stream, bytes)).await
    }

    pub async fn send_frame(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.framed.send(frame).await
    }

    /// The next frame, or `None` when the peer closed the connection.
    pub async fn recv(&mut self) -> Option<Result<Frame, FrameError>> {
        self.framed.next().await
    }

    /// Splits into a sending and a receiving half that can be used from two tasks.
    pub fn split(self) -> (FrameSink<S>, FrameStream<S>) {
        let (sink, stream) = self.framed.split();
        (FrameSink(sink), FrameStream(stream))
    }

    /// Ends framing and returns the raw stream, with any bytes already read
    /// past the last frame replayed first.
    pub fn into_raw(self) -> Prefixed<S> {
        let FramedParts { io, read_buf, .. } = self.framed.into_parts();
        Prefixed { prefix: read_buf, io }
    }
}

/// Decodes a message frame's body as `T`.
pub fn decode_message<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(body)
}

fn encode_message<T: Serialize>(msg: &T) -> Result<Frame, FrameError> {
    let json = serde_json::to_vec(msg).map_err(|e| FrameError::Io(std::io::Error::other(e)))?;
    Ok(Frame::Message(Bytes::from(json)))
}

/// The sending half of a split [`Connection`].
#[derive(Debug)]
pub struct FrameSink<S>(futures_util::stream::SplitSink<Framed<S, FrameCodec>, Frame>);

impl<S: AsyncRead + AsyncWrite + Unpin> FrameSink<S> {
    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), FrameError> {
        self.0.send(encode_message(msg)?).await
    }

    pub async fn send_data(&mut self, stream: StreamId, bytes: Bytes) -> Result<(), FrameError> {
        self.0.send(Frame::Data(stream, bytes)).await
    }

    pub async fn close(&mut self) -> Result<(), FrameError> {
        self.0.close().await
    }
}

/// The receiving half of a split [`Connection`].
#[derive(Debug)]
pub struct FrameStream<S>(futures_util::stream::SplitStream<Framed<S, FrameCodec>>);

impl<S: AsyncRead + AsyncWrite + Unpin> FrameStream<S> {
    pub async fn recv(&mut self) -> Option<Result<Frame, FrameError>> {
        self.0.next().await
    }
}

/// A raw stream that first yields bytes that were read ahead while framing.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: BytesMut,
    io: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let chunk = self.prefix.split_to(n);
            buf.put_slice(&chunk);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

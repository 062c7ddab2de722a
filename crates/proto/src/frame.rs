//! Framing: how bytes on a stream become typed frames.
//!
//! ```text
//! +----------------+--------+------------------------------------------+
//! | length: u32 BE | tag u8 | body (length - 1 bytes)                  |
//! +----------------+--------+------------------------------------------+
//!   tag 0x01  message: body is one JSON-encoded message (see `message`)
//!   tag 0x02  data:    body[0] is the stream id, body[1..] raw bytes
//! ```
//!
//! The length counts the tag and the body. Both sides refuse a frame longer
//! than [`MAX_FRAME_LEN`] before reading or writing its body, so a peer can
//! never make the other side allocate more than that for one frame.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

/// The largest frame either side accepts, tag included.
///
/// Data chunks are at most [`DATA_CHUNK`] bytes, so a frame this size leaves
/// room for a message with a large directory listing.
pub const MAX_FRAME_LEN: usize = 4 * 1024 * 1024;

/// The size of the data chunks senders cut bulk data into: large enough that
/// per-frame overhead disappears at GB/s rates, small enough to interleave
/// stdout and stderr and keep latency low.
pub const DATA_CHUNK: usize = 256 * 1024;

/// The largest data frame either side accepts: one [`DATA_CHUNK`], its
/// tag and its stream id. Senders cut data into chunks (the encoder splits
/// a larger one); a receiver buffers data frames by the count, so what a
/// peer can park in its buffers is bounded by chunks, not by
/// [`MAX_FRAME_LEN`].
pub const MAX_DATA_FRAME_LEN: usize = DATA_CHUNK + 2;

const TAG_MESSAGE: u8 = 0x01;
const TAG_DATA: u8 = 0x02;

/// Which byte stream a data frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamId {
    /// Client to agent: stdin of a process, or the contents of an upload.
    Input = 0,
    /// Agent to client: stdout of a process, or the contents of a download.
    Output = 1,
    /// Agent to client: stderr of a process.
    Error = 2,
}

impl StreamId {
    fn from_byte(byte: u8) -> Result<Self, FrameError> {
        match byte {
            0 => Ok(Self::Input),
            1 => Ok(Self::Output),
            2 => Ok(Self::Error),
            other => Err(FrameError::UnknownStream(other)),
        }
    }
}

/// One frame off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A JSON message, not yet decoded into a type (the receiver knows which
    /// type it expects).
    Message(Bytes),
    /// A chunk of a byte stream.
    Data(StreamId, Bytes),
}

/// Why bytes on the wire could not be turned into a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("Frame of {len} bytes is larger than the {max}-byte limit; the peer must split bulk data into chunks")]
    TooLarge { len: usize, max: usize },
    #[error("Empty frame: every frame needs at least a tag byte")]
    Empty,
    #[error("Unknown frame tag {0:#04x}: the peer speaks another framing (expected 0x01 message or 0x02 data)")]
    UnknownTag(u8),
    #[error("Data frame without a stream id byte")]
    MissingStream,
    #[error("Unknown data stream id {0}: allowed are 0 (input), 1 (output), 2 (error)")]
    UnknownStream(u8),
    #[error("I/O error on the agent connection")]
    Io(#[from] std::io::Error),
}

/// Encoder and decoder of [`Frame`]s, with the size limit on both sides.
///
/// Written here rather than wrapping `LengthDelimitedCodec`: the decoder
/// stays stateless (it looks at the length on every call), which lets the
/// error name the refused size, and the whole format is a dozen lines.
#[derive(Debug)]
pub struct FrameCodec {
    max: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self::with_max_len(MAX_FRAME_LEN)
    }
}

impl FrameCodec {
    /// A codec that refuses frames longer than `max` bytes.
    pub fn with_max_len(max: usize) -> Self {
        Self { max }
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(head) = src.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*head) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        // Nothing is reserved before the tag says which limit holds.
        if len > 0 {
            let Some(&tag) = src.get(4) else {
                return Ok(None);
            };
            if tag == TAG_DATA && len > MAX_DATA_FRAME_LEN.min(self.max) {
                return Err(FrameError::TooLarge { len, max: MAX_DATA_FRAME_LEN.min(self.max) });
            }
        }
        if src.len() < 4 + len {
            src.reserve(4 + len - src.len());
            return Ok(None);
        }
        src.advance(4);
        parse(src.split_to(len).freeze()).map(Some)
    }
}

fn parse(mut body: Bytes) -> Result<Frame, FrameError> {
    if body.is_empty() {
        return Err(FrameError::Empty);
    }
    match body.get_u8() {
        TAG_MESSAGE => Ok(Frame::Message(body)),
        TAG_DATA => {
            if body.is_empty() {
                return Err(FrameError::MissingStream);
            }
            let stream = StreamId::from_byte(body.get_u8())?;
            Ok(Frame::Data(stream, body))
        }
        tag => Err(FrameError::UnknownTag(tag)),
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), FrameError> {
        let (header, body): (&[u8], Bytes) = match frame {
            Frame::Message(json) => (&[TAG_MESSAGE], json),
            // Data longer than a chunk goes as several frames of a chunk.
            Frame::Data(stream, mut bytes) if bytes.len() > DATA_CHUNK => {
                while !bytes.is_empty() {
                    let chunk = bytes.split_to(bytes.len().min(DATA_CHUNK));
                    self.encode(Frame::Data(stream, chunk), dst)?;
                }
                return Ok(());
            }
            Frame::Data(stream, bytes) => (&[TAG_DATA, stream as u8][..], bytes),
        };
        let len = header.len() + body.len();
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        dst.reserve(4 + len);
        // The check above bounds `len` by `max`, which is a usize far below u32::MAX.
        dst.put_u32(u32::try_from(len).map_err(|_| FrameError::TooLarge { len, max: self.max })?);
        dst.put_slice(header);
        dst.put_slice(&body);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(frame: Frame) -> BytesMut {
        let mut buf = BytesMut::new();
        FrameCodec::default().encode(frame, &mut buf).expect("frame fits");
        buf
    }

    #[test]
    fn round_trip_message_and_data() {
        let mut buf = encode(Frame::Message(Bytes::from_static(b"{\"a\":1}")));
        buf.extend_from_slice(&encode(Frame::Data(StreamId::Error, Bytes::from_static(b"\0\xffx"))));
        let mut codec = FrameCodec::default();
        assert_eq!(
            codec.decode(&mut buf).expect("valid").expect("complete"),
            Frame::Message(Bytes::from_static(b"{\"a\":1}"))
        );
        assert_eq!(
            codec.decode(&mut buf).expect("valid").expect("complete"),
            Frame::Data(StreamId::Error, Bytes::from_static(b"\0\xffx"))
        );
        assert!(codec.decode(&mut buf).expect("valid").is_none());
    }

    #[test]
    fn data_frames_are_chunks() {
        // A sender's long data goes as chunks.
        let mut buf = encode(Frame::Data(StreamId::Output, Bytes::from(vec![1u8; DATA_CHUNK * 2 + 5])));
        let mut codec = FrameCodec::default();
        let mut lengths = Vec::new();
        while let Some(frame) = codec.decode(&mut buf).expect("valid") {
            let Frame::Data(StreamId::Output, bytes) = frame else { panic!("{frame:?}") };
            lengths.push(bytes.len());
        }
        assert_eq!(lengths, [DATA_CHUNK, DATA_CHUNK, 5]);
        // A peer's longer data frame is refused from its header, before
        // its body is waited for or room made for it; a message of that
        // size is not.
        let len = u32::try_from(MAX_DATA_FRAME_LEN + 1).expect("small");
        let mut head = BytesMut::new();
        head.put_u32(len);
        head.put_u8(TAG_DATA);
        let err = FrameCodec::default().decode(&mut head.clone()).expect_err("too long for data");
        assert!(matches!(err, FrameError::TooLarge { max: MAX_DATA_FRAME_LEN, .. }), "{err}");
        head[4] = TAG_MESSAGE;
        assert!(FrameCodec::default().decode(&mut head).expect("valid").is_none());
        // Nor is room made before the tag has come.
        let mut bare = BytesMut::new();
        bare.put_u32(len);
        assert!(FrameCodec::default().decode(&mut bare).expect("valid").is_none());
        assert!(bare.capacity() < 1024, "{}", bare.capacity());
    }

    #[test]
    fn short_reads_wait_for_the_whole_frame() {
        let whole = encode(Frame::Data(StreamId::Output, Bytes::from(vec![7u8; 1000])));
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::new();
        for (i, byte) in whole.iter().enumerate() {
            buf.put_u8(*byte);
            let got = codec.decode(&mut buf).expect("valid");
            if i + 1 < whole.len() {
                assert!(got.is_none(), "decoded early at byte {i}");
            } else {
                assert_eq!(got, Some(Frame::Data(StreamId::Output, Bytes::from(vec![7u8; 1000]))));
            }
        }
    }

    #[test]
    fn oversize_frame_is_refused_before_its_body_arrives() {
        let mut codec = FrameCodec::with_max_len(64);
        let mut buf = BytesMut::new();
        buf.put_u32(65);
        let err = codec.decode(&mut buf).expect_err("too large");
        assert!(matches!(err, FrameError::TooLarge { len: 65, max: 64 }), "{err}");
        assert!(err.to_string().contains("larger than the 64-byte limit"));
    }

    #[test]
    fn oversize_frame_is_refused_by_the_encoder() {
        let mut codec = FrameCodec::with_max_len(64);
        let err = codec
            .encode(Frame::Data(StreamId::Input, Bytes::from(vec![0u8; 63])), &mut BytesMut::new())
            .expect_err("too large");
        assert!(matches!(err, FrameError::TooLarge { len: 65, .. }));
    }

    #[test]
    fn malformed_frames_have_typed_errors() {
        type Case<'a> = (&'a [u8], fn(&FrameError) -> bool);
        let cases: &[Case] = &[
            (&[0, 0, 0, 0], |e| matches!(e, FrameError::Empty)),
            (&[0, 0, 0, 1, 9], |e| matches!(e, FrameError::UnknownTag(9))),
            (&[0, 0, 0, 1, TAG_DATA], |e| matches!(e, FrameError::MissingStream)),
            (&[0, 0, 0, 2, TAG_DATA, 7], |e| matches!(e, FrameError::UnknownStream(7))),
        ];
        for (bytes, check) in cases {
            let mut buf = BytesMut::from(*bytes);
            let err = FrameCodec::default().decode(&mut buf).expect_err("malformed");
            assert!(check(&err), "{bytes:?} gave {err:?}");
        }
    }

    /// A cheap, deterministic stand-in for the fuzz target, so `cargo test`
    /// exercises the decoder on garbage too: it must never panic.
    #[test]
    #[allow(clippy::cast_possible_truncation)]
    fn random_bytes_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..20_000 {
            let mut buf = BytesMut::new();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 24) as usize;
            for i in 0..len {
                buf.put_u8((state >> (i % 8 * 8)) as u8);
            }
            let mut codec = FrameCodec::with_max_len(16);
            while let Ok(Some(_)) = codec.decode(&mut buf) {}
        }
    }
}

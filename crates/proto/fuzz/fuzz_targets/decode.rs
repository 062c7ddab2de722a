//! Feeds arbitrary bytes to the frame decoder and then to the message
//! decoders, exactly as the agent and the client meet bytes off the wire.
//! Neither may panic, and a decoded frame must re-encode to what was read.

#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use moat_proto::{AgentMsg, ClientMsg, Frame, FrameCodec};
use tokio_util::codec::{Decoder, Encoder};

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    let mut codec = FrameCodec::with_max_len(64 * 1024);
    while let Ok(Some(frame)) = codec.decode(&mut buf) {
        if let Frame::Message(body) = &frame {
            let _ = serde_json::from_slice::<ClientMsg>(body);
            let _ = serde_json::from_slice::<AgentMsg>(body);
        }
        let mut again = BytesMut::new();
        codec.encode(frame.clone(), &mut again).expect("a decoded frame re-encodes");
        let back = codec.decode(&mut again).expect("re-decodes").expect("complete");
        assert_eq!(back, frame);
    }
});

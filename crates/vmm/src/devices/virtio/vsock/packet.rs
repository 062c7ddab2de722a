//! The virtio-vsock packet header (virtio 1.2, §5.10.6), little-endian.

/// Bytes of a header on the wire.
pub const HDR_LEN: usize = 44;
/// The host's context id.
pub const HOST_CID: u64 = 2;
/// `VIRTIO_VSOCK_TYPE_STREAM`, the only socket type offered.
pub const TYPE_STREAM: u16 = 1;

/// Operations.
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// A packet header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub kind: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

fn u64_at(b: &[u8; HDR_LEN], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn u32_at(b: &[u8; HDR_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u16_at(b: &[u8; HDR_LEN], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

impl Header {
    /// Decodes a header.
    pub fn parse(b: &[u8; HDR_LEN]) -> Self {
        Self {
            src_cid: u64_at(b, 0),
            dst_cid: u64_at(b, 8),
            src_port: u32_at(b, 16),
            dst_port: u32_at(b, 20),
            len: u32_at(b, 24),
            kind: u16_at(b, 28),
            op: u16_at(b, 30),
            flags: u32_at(b, 32),
            buf_alloc: u32_at(b, 36),
            fwd_cnt: u32_at(b, 40),
        }
    }

    /// Encodes it.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// The reset answering `self` (ports and cids swapped).
    pub fn reset_reply(&self) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            kind: TYPE_STREAM,
            op: OP_RST,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_in_wire_order() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1024,
            dst_port: 5,
            len: 7,
            kind: 1,
            op: OP_RW,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 9,
        };
        let b = h.to_bytes();
        assert_eq!(&b[0..8], &3u64.to_le_bytes());
        assert_eq!(&b[30..32], &OP_RW.to_le_bytes());
        assert_eq!(Header::parse(&b), h);
    }
}

//! virtio-vsock (placeholder while the device is written).

//! Feeds random queue contents to each virtio device model: the input
//! becomes guest memory holding the descriptor tables, available rings and
//! buffers of the device's queues, the way a hostile guest could write
//! them. No device may panic, hang, or touch memory outside the guest.
//!
//! The first byte picks the device (block over a copy-on-write disk,
//! vsock, rng, net with a socketpair standing in for passt) and the queue
//! notified; the rest is guest memory from
//! address 0, each queue's rings at a 4 KiB boundary.

#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use moat_vmm::devices::virtio::VirtioDevice;
use moat_vmm::devices::virtio::block::{Block, CowDisk};
use moat_vmm::devices::virtio::net::Net;
use moat_vmm::devices::virtio::rng::Rng;
use moat_vmm::devices::virtio::testing::{QueueDriver, guest_memory};
use moat_vmm::devices::virtio::vsock::Vsock;
use vm_memory::{Bytes, GuestAddress};

const MEM: usize = 64 * 1024;
const QUEUE: u16 = 16;

const DEVICE_COUNT: u8 = 4;

/// Block, vsock, rng, net: made once, kept across inputs.
type Devices = [Mutex<Box<dyn VirtioDevice>>; DEVICE_COUNT as usize];

fn devices() -> &'static Devices {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    DEVICES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("moat-vmm-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fuzz directory");
        let base = dir.join("base.img");
        std::fs::write(&base, vec![0x42u8; 1 << 20]).expect("base disk");
        let _ = std::fs::remove_file(dir.join("overlay.img"));
        let disk = CowDisk::open(&base, &dir.join("overlay.img"), 256 << 10).expect("overlay");
        let (vmm_end, passt) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        // passt's end stays open and unread: the device meets a stalled peer.
        std::mem::forget(passt);
        [
            Mutex::new(Box::new(Block::new(Box::new(disk), false, "fuzz"))),
            Mutex::new(Box::new(Vsock::new(3, &dir.join("v.sock")).expect("vsock"))),
            Mutex::new(Box::new(Rng::new().expect("rng"))),
            Mutex::new(Box::new(Net::new([2, 0, 0, 0, 0, 1], vmm_end).expect("net"))),
        ]
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&select, memory)) = data.split_first() else { return };
    let mem = guest_memory(MEM);
    let n = memory.len().min(MEM);
    mem.write_slice(&memory[..n], GuestAddress(0)).expect("inside guest memory");
    let mut device = devices()[usize::from(select % DEVICE_COUNT)].lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let count = device.queue_max_sizes().len();
    let mut queues: Vec<_> = (0..count).map(|i| QueueDriver::new(0x1000 * i as u64, QUEUE).queue()).collect();
    let index = usize::from(select / DEVICE_COUNT) % count;
    device.process_queue(index, &mut queues, &mem);
    device.process_host(Some(&mut queues), &mem);
    if select & 0x80 != 0 {
        device.reset();
    }
});

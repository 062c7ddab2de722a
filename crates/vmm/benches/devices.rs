//! Device model benchmarks, in process (no KVM), each beside a baseline
//! measured in the same run:
//!
//! - virtio-blk: sequential and random 4 KiB reads and writes through the
//!   device (an in-memory virtqueue driver, 32 requests in flight), on a
//!   plain file and through a copy-on-write overlay, beside plain
//!   `pread`/`pwrite` of the same blocks;
//! - virtio-vsock: 64 MiB host → guest and guest → host through the muxer,
//!   beside 64 MiB over a bare Unix socket pair.
//!
//! Run with `cargo xtask bench`. Figures go to stdout and to
//! `target/bench/vmm_devices.json`. Nothing fails on a wall-clock figure.

#![allow(clippy::print_stdout, clippy::cast_precision_loss, clippy::cast_possible_truncation)]

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use moat_vmm::devices::virtio::VirtioDevice;
use moat_vmm::devices::virtio::block::{Block, CowDisk, DiskBackend, RawDisk};
use moat_vmm::devices::virtio::testing::{Buf, QueueDriver, VsockGuest, guest_memory};
use moat_vmm::devices::virtio::vsock::packet::{HOST_CID, Header, OP_CREDIT_UPDATE, OP_REQUEST, OP_RW, TYPE_STREAM};
use vm_memory::{Bytes, GuestAddress};

const DISK: u64 = 256 << 20;
const OPS: usize = 16384; // 64 MiB of 4 KiB requests
const BATCH: usize = 32;
const VOLUME: usize = 64 << 20;

fn main() {
    let dir = tempfile::Builder::new().prefix("moat-vmm-bench-").tempdir_in("/dev/shm").expect("temp dir in /dev/shm");
    let base = dir.path().join("base.img");
    let file = std::fs::File::create(&base).expect("base");
    let block = vec![0x5au8; 1 << 20];
    for i in 0..(DISK >> 20) {
        file.write_all_at(&block, i << 20).expect("base written");
    }
    println!("vmm device benchmarks (in process, baselines measured in this run; files in /dev/shm)");
    let mut json = Vec::new();
    let offsets = |random: bool| -> Vec<u64> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..OPS as u64)
            .map(|i| {
                if random {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % (DISK / 4096)) * 4096
                } else {
                    i * 4096
                }
            })
            .collect()
    };
    for (name, write, random) in
        [("seq read", false, false), ("rand read", false, true), ("seq write", true, false), ("rand write", true, true)]
    {
        let offs = offsets(random);
        let base_copy = dir.path().join("plain.img");
        std::fs::copy(&base, &base_copy).expect("copy");
        let plain = bench_file(&base_copy, &offs, write);
        let raw = bench_blk(Box::new(RawDisk::open(&base_copy, false).expect("raw")), &offs, write);
        let overlay = dir.path().join("overlay.img");
        let _ = std::fs::remove_file(&overlay);
        let cow = bench_blk(Box::new(CowDisk::open(&base, &overlay, DISK).expect("cow")), &offs, write);
        println!(
            "  blk {name:<10} 4 KiB  device/file {:>7.0} IOPS {:>6.2} GB/s | device/overlay {:>7.0} IOPS {:>6.2} GB/s | baseline pread/pwrite {:>7.0} IOPS",
            raw,
            raw * 4096.0 / 1e9,
            cow,
            cow * 4096.0 / 1e9,
            plain
        );
        let key = name.replace(' ', "_");
        json.push(format!("\"blk_{key}_file_iops\":{raw:.0},\"blk_{key}_overlay_iops\":{cow:.0},\"blk_{key}_baseline_iops\":{plain:.0}"));
    }
    let raw = bench_socketpair();
    let to_guest = bench_vsock_to_guest(dir.path());
    let to_host = bench_vsock_to_host(dir.path());
    println!("  vsock 64 MiB host -> guest  {to_guest:.2} GB/s   (target >= 2 GB/s)");
    println!("  vsock 64 MiB guest -> host  {to_host:.2} GB/s   (target >= 2 GB/s)");
    println!("    baseline: bare Unix socket pair  {raw:.2} GB/s");
    json.push(format!(
        "\"vsock_to_guest_gbps\":{to_guest:.3},\"vsock_to_host_gbps\":{to_host:.3},\"raw_socket_gbps\":{raw:.3}"
    ));
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).parent().map(|t| t.join("bench"));
    if let Some(out) = out_dir
        && std::fs::create_dir_all(&out).is_ok()
    {
        let _ = std::fs::write(out.join("vmm_devices.json"), format!("{{{}}}\n", json.join(",")));
        println!("  figures written to {}", out.join("vmm_devices.json").display());
    }
}

/// IOPS of plain `pread`/`pwrite` of the blocks.
fn bench_file(path: &std::path::Path, offs: &[u64], write: bool) -> f64 {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("opens");
    let mut buf = vec![0xa5u8; 4096];
    let start = Instant::now();
    for &off in offs {
        if write {
            file.write_all_at(&buf, off).expect("pwrite");
        } else {
            file.read_exact_at(&mut buf, off).expect("pread");
        }
    }
    offs.len() as f64 / start.elapsed().as_secs_f64()
}

/// IOPS of the virtio-blk device over `disk`.
fn bench_blk(disk: Box<dyn DiskBackend>, offs: &[u64], write: bool) -> f64 {
    const HDR: u64 = 0x10_0000;
    const STATUS: u64 = 0x18_0000;
    const DATA: u64 = 0x20_0000;
    let mem = guest_memory(64 << 20);
    let mut drv = QueueDriver::new(0x1000, 256);
    let mut queues = vec![drv.queue()];
    let mut dev = Block::new(disk, false, "bench");
    let kind: u32 = if write { 1 } else { 0 };
    let start = Instant::now();
    for batch in offs.chunks(BATCH) {
        for (i, &off) in (0u64..).zip(batch) {
            let mut h = [0u8; 16];
            h[0..4].copy_from_slice(&kind.to_le_bytes());
            h[8..16].copy_from_slice(&(off / 512).to_le_bytes());
            mem.write_slice(&h, GuestAddress(HDR + 16 * i)).expect("header");
            let data = if write { Buf::read(DATA + 4096 * i, 4096) } else { Buf::write(DATA + 4096 * i, 4096) };
            drv.add_chain(&mem, &[Buf::read(HDR + 16 * i, 16), data, Buf::write(STATUS + i, 1)]);
        }
        dev.process_queue(0, &mut queues, &mem);
        let used = drv.take_used(&mem);
        assert_eq!(used.len(), batch.len());
        assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).expect("status"), 0, "request failed");
    }
    offs.len() as f64 / start.elapsed().as_secs_f64()
}

fn bench_socketpair() -> f64 {
    let (mut a, mut b) = UnixStream::pair().expect("pair");
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        let mut got = 0;
        while got < VOLUME {
            got += b.read(&mut buf).expect("reads");
        }
    });
    let chunk = vec![1u8; 65536];
    let start = Instant::now();
    for _ in 0..VOLUME / chunk.len() {
        a.write_all(&chunk).expect("writes");
    }
    reader.join().expect("reader");
    VOLUME as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn header(op: u16, port: u32) -> Header {
    Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 1000,
        dst_port: port,
        kind: TYPE_STREAM,
        op,
        buf_alloc: 1 << 20,
        ..Header::default()
    }
}

fn bench_vsock_to_guest(dir: &std::path::Path) -> f64 {
    let uds = dir.join("to_guest.sock");
    let mut guest = VsockGuest::new(3, &uds, 65536 + 44);
    let listener = UnixListener::bind(format!("{}_80", uds.display())).expect("binds");
    guest.send(header(OP_REQUEST, 80), &[]);
    let (mut host, _) = listener.accept().expect("accepted");
    guest.kick_rx();
    guest.drain();
    let writer = std::thread::spawn(move || {
        let chunk = vec![7u8; 65536];
        for _ in 0..VOLUME / chunk.len() {
            host.write_all(&chunk).expect("writes");
        }
        host
    });
    let start = Instant::now();
    let mut got = 0;
    while got < VOLUME {
        let (bytes, _) = guest.drain();
        if bytes == 0 {
            guest.poll(100);
            continue;
        }
        got += bytes;
        // The guest consumed it all: its credit comes back (which also
        // lets the device fill the buffers just posted).
        let mut update = header(OP_CREDIT_UPDATE, 80);
        update.fwd_cnt = got as u32;
        guest.send(update, &[]);
    }
    let secs = start.elapsed().as_secs_f64();
    drop(writer.join().expect("writer"));
    VOLUME as f64 / secs / 1e9
}

fn bench_vsock_to_host(dir: &std::path::Path) -> f64 {
    let uds = dir.join("to_host.sock");
    let mut guest = VsockGuest::new(3, &uds, 4096 + 44);
    let listener = UnixListener::bind(format!("{}_81", uds.display())).expect("binds");
    guest.send(header(OP_REQUEST, 81), &[]);
    let (mut host, _) = listener.accept().expect("accepted");
    guest.kick_rx();
    guest.drain();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        let mut got = 0;
        while got < VOLUME {
            let n = host.read(&mut buf).expect("reads");
            assert!(n > 0, "the muxer closed the connection");
            got += n;
        }
    });
    let (mut sent, mut peer_fwd, mut peer_alloc) = (0u32, 0u32, 256 * 1024u32);
    let start = Instant::now();
    while (sent as usize) < VOLUME {
        if sent.wrapping_sub(peer_fwd) + 65536 <= peer_alloc {
            guest.send_len(header(OP_RW, 81), 65536);
            sent += 65536;
            guest.kick_rx();
        } else {
            guest.poll(100);
        }
        for h in guest.drain().1 {
            peer_fwd = h.fwd_cnt;
            peer_alloc = h.buf_alloc;
        }
    }
    reader.join().expect("reader");
    VOLUME as f64 / start.elapsed().as_secs_f64() / 1e9
}

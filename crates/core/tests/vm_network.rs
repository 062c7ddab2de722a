//! Network policies on the vm backend, end to end: this test binary runs
//! itself inside the nested test host (level 1, whose KVM boots the
//! image's microVMs) with `MOAT_TEST_BACKEND=vm`, and there
//!
//! - an `open` VM reaches a server of level 1 through its virtio-net device
//!   and passt, but not level 1's loopback services; its passt ends with it;
//! - a `none` VM has no network device and reaches nothing;
//! - a `filtered` VM has no network device either, yet reaches an allowed
//!   "registry" through the agent's proxy and the host's policy, exactly as
//!   a jail does (see `network.rs`), and gets the explained 403 otherwise.
//!
//! Level 1 has no network of its own, so its "outside" is an address the
//! test adds to its loopback interface (10.77.0.1), served by a small HTTP
//! server in this process; passt, which finds no default route there, is
//! started with loopback as its template interface.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use moat_core::{EgressConfig, Moat, NetworkPolicy, SandboxSpec};

mod common;
use common::sh;

/// Level 1's stand-in for an outside server's address.
const OUTSIDE: &str = "10.77.0.1";

fn in_level1() -> bool {
    std::env::var("MOAT_TEST_BACKEND").as_deref() == Ok("vm")
}

async fn moat(egress: EgressConfig) -> Moat {
    common::moat(moat_core::BackendKind::Vm, 4, egress).await
}

fn spec(network: NetworkPolicy) -> SandboxSpec {
    SandboxSpec { memory_mib: 256, disk_mib: 128, network, ..SandboxSpec::default() }
}

/// An HTTP server on `addr` answering every request with `hello from
/// <label>`, in a thread of this process (level 1 has no python).
fn serve(addr: &str, label: &'static str) -> u16 {
    let listener = TcpListener::bind((addr, 0)).unwrap_or_else(|e| panic!("binding {addr}: {e}"));
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 16384 {
                    match stream.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let body = format!("hello from {label}\n");
                let _ = write!(stream, "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            });
        }
    });
    port
}

/// Level 1's "outside" address, on its loopback interface (it has no other).
fn add_outside_address() {
    let out =
        Command::new("ip").args(["addr", "add", &format!("{OUTSIDE}/32"), "dev", "lo"]).output().expect("ip runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() || err.contains("exists"), "ip addr add: {err}");
}

fn passt_processes() -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let alive = stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
        if alive && std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|c| c.trim().starts_with("passt")) {
            found.push(pid);
        }
    }
    found
}

#[tokio::test]
#[ignore = "runs inside the nested test host; started by vm_network_policies_hold_in_the_nested_host"]
async fn open_vms_reach_the_outside_through_passt_and_none_vms_nothing() {
    if !in_level1() {
        return;
    }
    add_outside_address();
    let port = serve(OUTSIDE, "the outside");
    let loopback_port = serve("127.0.0.1", "level 1's loopback");
    let moat = moat(EgressConfig::default()).await;

    let open = moat.create(spec(NetworkPolicy::Open)).await.expect("an open VM starts");
    assert_eq!(passt_processes().len(), 1, "one passt serves the open VM");
    let (out, code) = sh(
        &moat,
        &open.id,
        &format!(
            "cat /sys/class/net/eth0/address; cat /etc/resolv.conf; echo ${{HTTPS_PROXY:-direct}}; \
             curl -sS --connect-timeout 20 http://{OUTSIDE}:{port}/hello.txt"
        ),
    )
    .await;
    assert_eq!(
        (out.as_str(), code),
        ("02:6d:6f:61:74:01\nnameserver 10.0.2.3\ndirect\nhello from the outside\n", Some(0)),
        "the open VM's interface, resolver and a request to the outside"
    );
    // Level 1's loopback services stay out of reach: the guest's 127.0.0.1
    // is its own, and the gateway (passt) is not mapped to level 1's.
    let (out, _) = sh(
        &moat,
        &open.id,
        &format!(
            "curl -sS --connect-timeout 5 http://127.0.0.1:{loopback_port}/; \
             curl -sS --connect-timeout 5 http://10.0.2.2:{loopback_port}/"
        ),
    )
    .await;
    assert!(!out.contains("hello from"), "a loopback service of level 1 answered: {out}");
    moat.destroy(&open.id).await.expect("destroyed");
    moat.settled().await;
    assert!(passt_processes().is_empty(), "passt ends with its VM");

    let none = moat.create(spec(NetworkPolicy::None)).await.expect("a VM without network starts");
    assert!(passt_processes().is_empty(), "no passt for network none");
    let (out, code) = sh(
        &moat,
        &none.id,
        &format!("ls /sys/class/net; curl -sS --connect-timeout 5 http://{OUTSIDE}:{port}/hello.txt"),
    )
    .await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.starts_with("lo\n") && out.contains("curl: (7)"), "only loopback, no route: {out}");
    moat.destroy_all().await;
}

#[tokio::test]
#[ignore = "runs inside the nested test host; started by vm_network_policies_hold_in_the_nested_host"]
async fn filtered_vms_reach_allowed_hosts_through_the_host_as_jails_do() {
    if !in_level1() {
        return;
    }
    let port = serve("127.0.0.1", "the registry");
    let ip = |s: &str| s.parse().expect("address");
    let config = EgressConfig {
        allow_hosts: vec!["registry.test".into()],
        test_resolve: vec![("registry.test".into(), ip("127.0.0.1")), ("evil.test".into(), ip("127.0.0.1"))],
        test_nets: vec!["127.0.0.1/32".parse().expect("net")],
        ..EgressConfig::default()
    };
    let moat = moat(config).await;
    let sandbox = moat.create(spec(NetworkPolicy::Filtered)).await.expect("a filtered VM starts");
    let id = &sandbox.id;
    assert!(passt_processes().is_empty(), "no passt for network filtered");
    let (out, _) = sh(&moat, id, "ls /sys/class/net; echo $HTTPS_PROXY").await;
    assert_eq!(out, "lo\nhttp://127.0.0.1:3128\n", "no network device, the proxy in the environment");
    let (out, code) = sh(&moat, id, &format!("curl -sS http://registry.test:{port}/hello.txt")).await;
    assert_eq!((out.as_str(), code), ("hello from the registry\n", Some(0)));
    let (out, code) = sh(&moat, id, &format!("curl -sS --proxytunnel http://registry.test:{port}/hello.txt")).await;
    assert_eq!((out.as_str(), code), ("hello from the registry\n", Some(0)));
    let (out, _) = sh(&moat, id, &format!("curl -sS -w '%{{http_code}}' http://evil.test:{port}/hello.txt")).await;
    assert!(out.contains("evil.test is not an allowed host") && out.ends_with("403"), "{out}");
    let (out, code) =
        sh(&moat, id, &format!("curl -sS --noproxy '*' --connect-timeout 5 http://127.0.0.1:{port}/")).await;
    assert_ne!(code, Some(0), "the VM's own loopback has no such server: {out}");
    let log = moat.egress_log(id).expect("log");
    let decisions: Vec<(&str, bool)> = log.iter().map(|d| (d.host.as_str(), d.allowed)).collect();
    assert_eq!(decisions, [("registry.test", true), ("registry.test", true), ("evil.test", false)], "{log:?}");
    moat.destroy_all().await;
}

/// The tests above, in level 1 with `MOAT_TEST_BACKEND=vm`, one at a time.
#[test]
#[ignore = "needs the default image, the moat binaries, passt, QEMU and busybox-static (the nested test host); run by `cargo xtask test`"]
fn vm_network_policies_hold_in_the_nested_host() {
    if std::env::var_os("MOAT_TEST_BACKEND").is_some() {
        return;
    }
    let (bundle, name) = moat_nested::bundle_with_this_program().expect("the level-1 bundle");
    let tmp = env!("CARGO_TARGET_TMPDIR");
    // passt confines itself with a user namespace and pivot_root(2): the
    // tests run as after a switch_root (`common::L1_SWITCH_ROOT`).
    let mut payload = moat_nested::Payload::script(&format!(
        r#"mkdir -p {tmp}
{}
exec unshare -m --propagation private sh /l1.sh {name} --include-ignored --test-threads=1 --skip vm_network_policies"#,
        common::L1_SWITCH_ROOT
    ));
    payload.env.push(("MOAT_TEST_BACKEND".into(), "vm".into()));
    payload.machine.memory_mib = 2048;
    let out = moat_nested::run_in(&bundle, &payload).expect("level 1 runs the tests");
    eprintln!("{}", out.stdout_text());
    assert_eq!(out.code, 0, "network policies failed for microVMs:\n{}\n{}", out.stdout_text(), out.stderr_text());
    assert!(out.stdout_text().contains("2 passed"), "both tests ran in level 1:\n{}", out.stdout_text());
}

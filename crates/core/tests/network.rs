//! Network policies end to end on the jail backend: `filtered` egress
//! through the agent's proxy and the host's policy, `open` through pasta,
//! and preview links loaded in headless Chromium.
//!
//! Nothing here reaches outside this machine: "registries" are servers on
//! the host's loopback (reachable only because the test configuration
//! names 127.0.0.1 explicitly) or in a network namespace the test makes.
//! Ignored by plain `cargo test` (they need root, the image, the static
//! agent, pasta and Chromium); `cargo xtask test` provides them.

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use moat_core::{EgressConfig, Moat, NetworkPolicy, PreviewLink, SandboxSpec};

mod common;
use common::sh;

async fn moat(egress: EgressConfig) -> Moat {
    common::moat(moat_core::BackendKind::Jail, 8, egress).await
}

fn spec(network: NetworkPolicy) -> SandboxSpec {
    SandboxSpec { memory_mib: 256, disk_mib: 256, network, ..SandboxSpec::default() }
}

/// A `python3 -m http.server` on the host, killed when dropped.
struct HostServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl HostServer {
    /// Serves `hello.txt` ("hello from <label>") on `bind`, optionally
    /// inside network namespace `netns`.
    fn start(label: &str, bind: &str, netns: Option<&str>) -> Self {
        let dir = tempfile::Builder::new().prefix("net-srv-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("dir");
        std::fs::write(dir.path().join("hello.txt"), format!("hello from {label}\n")).expect("write");
        let port = free_port();
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "python3"]);
                c
            }
            None => Command::new("python3"),
        };
        command
            .args(["-m", "http.server", "--bind", bind, &port.to_string(), "--directory"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command.spawn().expect("python3 starts");
        let server = Self { child, port, _dir: dir };
        server.wait_listening(bind, netns);
        server
    }

    fn wait_listening(&self, bind: &str, netns: Option<&str>) {
        for _ in 0..500 {
            let probe =
                format!("import socket; socket.create_connection(('{bind}', {}), timeout=1).close()", self.port);
            let mut command = match netns {
                Some(ns) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", ns, "python3"]);
                    c
                }
                None => Command::new("python3"),
            };
            if command.args(["-c", &probe]).stderr(Stdio::null()).status().is_ok_and(|s| s.success()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the test server on {bind}:{} did not start", self.port);
    }
}

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an address")
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn filtered_egress_allows_listed_hosts_and_explains_refusals() {
    let server = HostServer::start("the registry", "127.0.0.1", None);
    let config = EgressConfig {
        allow_hosts: vec!["registry.test".into(), "rebind.test".into(), "metadata.test".into()],
        // The test's "DNS": the registry on this machine's loopback, which
        // only the explicit test network makes reachable; the others
        // rebind allowed names to internal addresses.
        test_resolve: vec![
            ("registry.test".into(), ip("127.0.0.1")),
            ("evil.test".into(), ip("127.0.0.1")),
            ("rebind.test".into(), ip("10.0.0.7")),
            ("metadata.test".into(), ip("169.254.169.254")),
        ],
        test_nets: vec!["127.0.0.1/32".parse().expect("net")],
        ..EgressConfig::default()
    };
    let moat = moat(config).await;
    let sandbox = moat.create(spec(NetworkPolicy::Filtered)).await.expect("created");
    let id = &sandbox.id;
    let port = server.port;

    let (out, _) = sh(&moat, id, "echo $HTTPS_PROXY $NO_PROXY").await;
    assert_eq!(out.trim(), "http://127.0.0.1:3128 localhost,127.0.0.1,::1");
    // Plain HTTP (absolute-form through the proxy) and a CONNECT tunnel.
    let (out, code) = sh(&moat, id, &format!("curl -sS http://registry.test:{port}/hello.txt")).await;
    assert_eq!((out.as_str(), code), ("hello from the registry\n", Some(0)));
    let (out, code) = sh(&moat, id, &format!("curl -sS --proxytunnel http://registry.test:{port}/hello.txt")).await;
    assert_eq!((out.as_str(), code), ("hello from the registry\n", Some(0)));
    // Python's own HTTP client honours the variables too.
    let script = format!(
        "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://registry.test:{port}/hello.txt').read().decode().strip())\""
    );
    let (out, code) = sh(&moat, id, &script).await;
    assert_eq!((out.trim(), code), ("hello from the registry", Some(0)));

    // A host that is not allowed: 403 with the reason and how to allow it.
    let (out, _) = sh(&moat, id, &format!("curl -sS -w '%{{http_code}}' http://evil.test:{port}/hello.txt")).await;
    assert!(out.contains("evil.test is not an allowed host") && out.contains("MOAT_ALLOW_HOSTS"), "{out}");
    assert!(out.ends_with("403"), "{out}");
    let (out, code) = sh(&moat, id, &format!("curl -sS --proxytunnel https://evil.test:{port}/")).await;
    assert_ne!(code, Some(0));
    assert!(out.contains("403"), "a refused CONNECT says 403: {out}");
    // Allowed names that resolve to internal addresses: refused.
    let (out, _) = sh(&moat, id, &format!("curl -sS http://rebind.test:{port}/")).await;
    assert!(out.contains("resolves to 10.0.0.7, a private address"), "{out}");
    let (out, _) = sh(&moat, id, "curl -sS http://metadata.test/latest/meta-data/").await;
    assert!(out.contains("the cloud metadata address"), "{out}");
    // Address literals are names too: not allowed.
    let (out, _) = sh(&moat, id, "curl -sS http://8.8.8.8/").await;
    assert!(out.contains("8.8.8.8 is not an allowed host"), "{out}");
    // Bypassing the proxy: no route out at all.
    for target in ["1.1.1.1:80", "10.0.0.7:80", &format!("192.0.2.2:{port}")] {
        let (out, code) = sh(&moat, id, &format!("curl -sS --noproxy '*' --connect-timeout 5 http://{target}/")).await;
        assert_ne!(code, Some(0), "{target} reachable without the proxy: {out}");
        assert!(out.contains("unreachable") || out.contains("Couldn't connect"), "{target}: {out}");
    }

    let log = moat.egress_log(id).expect("log");
    let allowed: Vec<_> = log.iter().filter(|d| d.allowed).map(|d| d.host.as_str()).collect();
    assert_eq!(allowed, ["registry.test"; 3], "{log:?}");
    let refused: Vec<_> = log.iter().filter(|d| !d.allowed).map(|d| d.host.as_str()).collect();
    assert_eq!(refused, ["evil.test", "evil.test", "rebind.test", "metadata.test", "8.8.8.8"], "{log:?}");
    let file = moat.data_dir().join("sandboxes").join(id).join("egress.log");
    let lines = std::fs::read_to_string(&file).expect("the egress log file");
    assert_eq!(lines.lines().count(), log.len(), "{lines}");
    moat.destroy(id).await.expect("destroyed");
    moat.settled().await;
    assert!(!file.exists(), "the log goes with the sandbox");
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_sandbox_without_network_reaches_nothing() {
    let moat = moat(EgressConfig::default()).await;
    let sandbox = moat.create(spec(NetworkPolicy::None)).await.expect("created");
    let (out, code) =
        sh(&moat, &sandbox.id, "echo ${HTTPS_PROXY:-unset}; curl -sS --connect-timeout 5 http://1.1.1.1/").await;
    assert_ne!(code, Some(0));
    assert!(out.starts_with("unset\n") && out.contains("curl: (7)"), "{out}");
    moat.destroy_all().await;
}

/// A network namespace with a veth pair to the host, removed when dropped.
struct TestNetns {
    name: String,
}

impl TestNetns {
    fn create(name: &str, host_addr: &str, ns_addr: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).status();
        let host_if = format!("{name}-h");
        let ns_if = format!("{name}-n");
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", name],
            vec!["link", "add", &host_if, "type", "veth", "peer", "name", &ns_if],
            vec!["link", "set", &ns_if, "netns", name],
            vec!["addr", "add", host_addr, "dev", &host_if],
            vec!["link", "set", &host_if, "up"],
            vec!["-n", name, "addr", "add", ns_addr, "dev", &ns_if],
            vec!["-n", name, "link", "set", &ns_if, "up"],
            vec!["-n", name, "link", "set", "lo", "up"],
        ];
        let netns = Self { name: name.to_owned() };
        for args in steps {
            let status = Command::new("ip").args(&args).status().expect("ip runs");
            assert!(status.success(), "ip {}", args.join(" "));
        }
        netns
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it the host's.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

fn pasta_processes() -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // "PID (comm) STATE …"; a zombie is dead, only not reaped yet.
        let alive = stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
        if alive
            && std::fs::read_to_string(entry.path().join("comm"))
                .is_ok_and(|c| c.trim().starts_with("pasta") || c.trim().starts_with("passt"))
        {
            found.push(pid);
        }
    }
    found
}

#[tokio::test]
#[ignore = "needs root, the default image, the static agent and pasta; run by `cargo xtask test`"]
async fn open_network_reaches_a_server_through_pasta() {
    let netns = TestNetns::create("moatnet0", "10.213.7.1/30", "10.213.7.2/30");
    let server = HostServer::start("the outside", "10.213.7.2", Some(&netns.name));
    let before = pasta_processes();
    let moat = moat(EgressConfig::default()).await;
    let sandbox = moat.create(spec(NetworkPolicy::Open)).await.expect("created");
    let started: Vec<i32> = pasta_processes().into_iter().filter(|p| !before.contains(p)).collect();
    assert!(!started.is_empty(), "pasta serves an open sandbox");
    let (out, code) = sh(
        &moat,
        &sandbox.id,
        &format!(
            "echo ${{HTTPS_PROXY:-direct}}; curl -sS --connect-timeout 10 http://10.213.7.2:{}/hello.txt",
            server.port
        ),
    )
    .await;
    assert_eq!((out.as_str(), code), ("direct\nhello from the outside\n", Some(0)));
    // The host's loopback services stay out of reach: the sandbox's
    // 127.0.0.1 is its own, and pasta maps neither ports nor the gateway to it.
    let host_only = HostServer::start("the host's loopback", "127.0.0.1", None);
    let script = format!(
        "curl -sS --connect-timeout 5 http://127.0.0.1:{port}/hello.txt; \
         gw=$(awk '$2 == \"00000000\" {{print $3}}' /proc/net/route | head -1); \
         curl -sS --connect-timeout 5 http://$(printf '%d.%d.%d.%d' 0x${{gw:6:2}} 0x${{gw:4:2}} 0x${{gw:2:2}} 0x${{gw:0:2}}):{port}/hello.txt",
        port = host_only.port
    );
    let (out, _) = sh(&moat, &sandbox.id, &script).await;
    assert!(!out.contains("hello from"), "a host loopback service answered: {out}");
    // Nor the cloud's metadata services (169.254.169.254 hands out the
    // host machine's credentials), link-local beside it, or Alibaba's:
    // refused before any packet leaves.
    let probe = "python3 -c 'import socket, errno\nfor a in (\"169.254.169.254\", \"169.254.1.1\", \"100.100.100.200\"):\n \
                 s = socket.socket(); s.settimeout(5); print(errno.errorcode.get(s.connect_ex((a, 80)), \"connected\"))'";
    let (out, _) = sh(&moat, &sandbox.id, probe).await;
    assert_eq!(out, "EACCES\nEACCES\nEACCES\n", "a metadata address is reachable from an open sandbox");
    moat.destroy(&sandbox.id).await.expect("destroyed");
    moat.settled().await;
    // pasta gets SIGKILL when the jail's monitor exits; give the kernel a moment to deliver it.
    for attempt in 0.. {
        if pasta_processes().iter().all(|p| before.contains(p)) {
            break;
        }
        assert!(attempt < 500, "pasta outlived its sandbox");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(server);
    drop(netns);
}

/// What a sandbox's root tries, in Python, to get a TCP SYN for the host's
/// 127.0.0.1:PORT onto pasta's tap (Debian bookworm's pasta connects such
/// a frame to the host's loopback): every kind of socket that writes
/// frames or IP headers, with and without `SOCK_NONBLOCK`/`SOCK_CLOEXEC`,
/// sending the frame through any that opens; then plain TCP to 127.0.0.1
/// and to the gateway, and a tun device of its own. Prints one line per
/// attempt: `name errno` for a socket refused, `name SENT` for a frame
/// that left.
const FORGE_FRAMES: &str = r#"
import ctypes, socket, struct, os
libc = ctypes.CDLL(None, use_errno=True)
PORT = int(os.environ["PORT"])
route = [l.split() for l in open("/proc/net/route").read().splitlines()[1:]]
ifname, gw = next((r[0], socket.inet_ntoa(struct.pack("<I", int(r[2], 16)))) for r in route if r[1] == "00000000")
try:
    mac = bytes.fromhex(open(f"/sys/class/net/{ifname}/address").read().strip().replace(":", ""))
except OSError:
    mac = bytes(6)
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((gw, 9))
src = socket.inet_aton(probe.getsockname()[0])
dst = socket.inet_aton("127.0.0.1")
def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
tcp = struct.pack("!HHIIBBHHH", 40000, PORT, 1, 0, 5 << 4, 0x02, 64240, 0, 0)
tcp = tcp[:16] + struct.pack("!H", csum(src + dst + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0, 64, 6, 0, src, dst)
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:] + tcp
frame = b"\xff" * 6 + mac + b"\x08\x00" + ip
ETH_P_ALL, ETH_P_IP = socket.htons(3), socket.htons(0x0800)
NB = socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
attempts = []
for flags in (0, NB):
    attempts += [
        ("AF_PACKET/SOCK_RAW", socket.AF_PACKET, socket.SOCK_RAW | flags, ETH_P_ALL, "frame"),
        ("AF_PACKET/SOCK_DGRAM", socket.AF_PACKET, socket.SOCK_DGRAM | flags, ETH_P_IP, "ip"),
        ("AF_INET/SOCK_PACKET", socket.AF_INET, 10 | flags, ETH_P_ALL, "spkt"),
        ("AF_INET6/SOCK_PACKET", socket.AF_INET6, 10 | flags, ETH_P_ALL, "spkt"),
        ("AF_PACKET/SOCK_PACKET", socket.AF_PACKET, 10 | flags, ETH_P_ALL, "spkt"),
        ("AF_INET/SOCK_RAW/IPPROTO_RAW", socket.AF_INET, socket.SOCK_RAW | flags, socket.IPPROTO_RAW, "hdrincl"),
        ("AF_INET/SOCK_RAW/IPPROTO_TCP", socket.AF_INET, socket.SOCK_RAW | flags, socket.IPPROTO_TCP, "tcp"),
        ("AF_INET6/SOCK_RAW", socket.AF_INET6, socket.SOCK_RAW | flags, socket.IPPROTO_RAW, "none"),
    ]
for name, family, kind, proto, payload in attempts:
    name += "/flags" if kind & NB else ""
    fd = libc.socket(family, kind, proto)
    if fd < 0:
        print(name, ctypes.get_errno())
        continue
    try:
        if payload == "spkt":
            # struct sockaddr_pkt: family, device name, protocol.
            addr = struct.pack("H14sH", socket.AF_PACKET, ifname.encode(), ETH_P_ALL)
            if libc.sendto(fd, frame, len(frame), 0, addr, len(addr)) < 0:
                raise OSError(ctypes.get_errno(), "sendto")
            print(name, "SENT")
            continue
        s = socket.socket(fileno=fd)
        if payload == "frame":
            s.bind((ifname, 0)); s.send(frame)
        elif payload == "ip":
            s.sendto(ip, (ifname, 0x0800, 0, 0, b"\xff" * 6))
        elif payload == "hdrincl":
            s.setsockopt(socket.SOL_SOCKET, 25, ifname.encode()); s.sendto(ip, ("127.0.0.1", 0))
        elif payload == "tcp":
            s.setsockopt(socket.SOL_SOCKET, 25, ifname.encode()); s.sendto(tcp, ("127.0.0.1", 0))
        print(name, "SENT")
    except OSError as e:
        print(name, "OPENED", e)
for path in ("/dev/net/tun", "/tmp/tun"):
    try:
        if path == "/tmp/tun":
            os.mknod(path, 0o20666, os.makedev(10, 200))
        os.close(os.open(path, os.O_RDWR))
        print("tun", path, "OPENED")
    except OSError as e:
        print("tun", path, "failed", e.errno)
for host in ("127.0.0.1", gw):
    try:
        socket.create_connection((host, PORT), 3).close()
        print("tcp", host, "CONNECTED")
    except OSError as e:
        print("tcp", host, "failed", e.errno)
"#;

/// Sandbox root, and `user` made uid 0 through `/etc/passwd` (the
/// sandbox's own root, which it may become), try to forge frames for the
/// host's loopback onto pasta's tap and to connect to it: every socket
/// that could write a frame or an IP header is refused, nothing reaches a
/// listener on the host's 127.0.0.1, and the sandbox still runs commands
/// and reaches the outside through pasta afterwards.
#[tokio::test]
#[ignore = "needs root, the default image, the static agent and pasta; run by `cargo xtask test`"]
async fn sandbox_root_cannot_forge_frames_to_the_hosts_loopback() {
    let netns = TestNetns::create("moatnet1", "10.213.8.1/30", "10.213.8.2/30");
    let outside = HostServer::start("the outside", "10.213.8.2", Some(&netns.name));
    let moat = moat(EgressConfig::default()).await;
    let sandbox = moat.create(spec(NetworkPolicy::Open)).await.expect("created");
    let id = sandbox.id.as_str();
    // The target: a listener on the host's loopback that records any
    // connection pasta would make for a forged SYN.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("non-blocking");
    let port = listener.local_addr().expect("addr").port();
    let attack = |user: Option<&str>| {
        let mut req = moat_proto::ExecRequest::shell(format!("PORT={port} python3 - <<'EOF'\n{FORGE_FRAMES}\nEOF"));
        req.user = user.map(str::to_owned);
        req
    };
    let mut root = moat_proto::ExecRequest::shell("sed -i 's/^user:x:1000:/user:x:0:/' /etc/passwd && id -u user");
    root.user = Some("root".into());
    for (who, request) in [("root", attack(Some("root"))), ("setup", root), ("user as uid 0", attack(None))] {
        let out = moat.run(id, request).await.expect("runs");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if who == "setup" {
            assert_eq!(said.trim(), "0", "user is now uid 0: {said}");
            continue;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "{who}: a connection reached the host's loopback listener: {said}"
        );
        let lines: Vec<&str> = said.lines().collect();
        let sockets: Vec<&&str> = lines.iter().filter(|l| l.starts_with("AF_")).collect();
        assert_eq!(sockets.len(), 16, "{who}: every attempt reports: {said}");
        for line in sockets {
            assert!(line.ends_with(" 1"), "{who}: a frame-writing socket was not refused with EPERM: {line}\n{said}");
        }
        let tcp: Vec<&&str> = lines.iter().filter(|l| l.starts_with("tcp ")).collect();
        assert_eq!(tcp.len(), 2, "{who}: {said}");
        assert!(tcp.iter().all(|l| l.contains("failed")), "{who}: reached a host loopback service: {said}");
        let tun: Vec<&&str> = lines.iter().filter(|l| l.starts_with("tun ")).collect();
        assert_eq!(tun.len(), 2, "{who}: {said}");
        assert!(tun.iter().all(|l| l.contains("failed")), "{who}: opened a tun device: {said}");
    }
    // The sandbox still works, and still reaches the outside.
    let (out, code) = sh(
        &moat,
        id,
        &format!("echo still-here; curl -sS --connect-timeout 10 http://10.213.8.2:{}/hello.txt", outside.port),
    )
    .await;
    assert_eq!((out.as_str(), code), ("still-here\nhello from the outside\n", Some(0)));
    moat.destroy_all().await;
    drop(outside);
    drop(netns);
}

/// Headless Chromium, as root, with a fresh profile; returns the DOM it
/// rendered for `url`.
fn chromium_dom(url: &str) -> String {
    chromium_dom_in(None, url)
}

/// [`chromium_dom`] from inside network namespace `netns`, when given.
fn chromium_dom_in(netns: Option<&str>, url: &str) -> String {
    let profile = tempfile::Builder::new().prefix("chromium-").tempdir().expect("profile dir");
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "chromium"]);
            c
        }
        None => Command::new("chromium"),
    };
    let out = command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .stdin(Stdio::null())
        .output()
        .expect("chromium runs (Debian package chromium)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Serves `page` (no single quotes) from port 8000 in sandbox `id` with
/// Python's http.server, and waits until it answers through the agent;
/// returns the agent's client.
async fn serve_page(moat: &Moat, id: &str, page: &str) -> moat_proto::AgentClient<moat_proto::UnixConnector> {
    let script = format!(
        "mkdir -p /home/user/site && printf '%s' '{page}' > /home/user/site/index.html && \
         setsid nohup python3 -m http.server 8000 --bind 127.0.0.1 --directory /home/user/site > /tmp/srv.log 2>&1 < /dev/null &"
    );
    let (out, code) = sh(moat, id, &script).await;
    assert_eq!(code, Some(0), "{out}");
    let client = moat.client(id).await.expect("client");
    for attempt in 0.. {
        if client.port_forward(8000).await.is_ok() {
            break;
        }
        assert!(attempt < 500, "the server in the sandbox did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client
}

/// The `name=value` of the session cookie a link's redirect sets.
fn session_cookie(response: &str, host_port: u16) -> String {
    let name = format!("moat_preview_{host_port}=");
    let set = response.lines().find_map(|l| l.strip_prefix("Set-Cookie: ")).expect("a Set-Cookie header");
    let pair = set.split(';').next().unwrap_or_default().to_owned();
    assert!(pair.starts_with(&name) && pair.len() > name.len(), "{set}");
    pair
}

/// A link for a remote client: with the listener on an address another
/// machine reaches (here a veth's, seen from a network namespace), the
/// link names that address, Chromium over there opens it once, and the
/// host's loopback has no listener for it.
#[tokio::test]
#[ignore = "needs root, the default image, the static agent and Chromium; run by `cargo xtask test`"]
async fn preview_links_open_from_another_machine() {
    let netns = TestNetns::create("moatnet2", "10.213.9.1/30", "10.213.9.2/30");
    // One host for every link: the operator's consent to the sharing
    // (MOAT_PREVIEW_SHARED_HOST=1), without which no link is made there.
    let preview = moat_core::net::preview::PreviewHost {
        shared: true,
        ..moat_core::net::preview::PreviewHost::for_http("10.213.9.1:8080".parse().expect("an address"), None)
            .expect("a preview host")
    };
    let config =
        moat_core::MoatConfig { preview, ..common::config(moat_core::BackendKind::Jail, 8, EgressConfig::default()) };
    let moat = moat_core::Moat::new(config).await.expect("moat starts");
    let sandbox = moat.create(spec(NetworkPolicy::None)).await.expect("created");
    let id = &sandbox.id;
    serve_page(&moat, id, "<h1>seen from afar</h1>").await;
    let link = moat.preview_link(id, 8000).await.expect("a link");
    assert!(link.url.starts_with(&format!("http://10.213.9.1:{}/?moat_token=", link.host_port)), "{}", link.url);
    let url = link.url.clone();
    let ns = netns.name.clone();
    let dom = tokio::task::spawn_blocking(move || chromium_dom_in(Some(&ns), &url)).await.expect("joins");
    assert!(dom.contains("seen from afar"), "Chromium in the other namespace rendered: {dom}");
    let url = link.url.clone();
    let ns = netns.name.clone();
    let dom = tokio::task::spawn_blocking(move || chromium_dom_in(Some(&ns), &url)).await.expect("joins");
    assert!(!dom.contains("seen from afar") && dom.contains("opened already"), "the link opened twice: {dom}");
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", link.host_port)).await.is_err(),
        "a remote link's listener is on the loopback too"
    );
    moat.destroy_all().await;
    drop(netns);
}

/// Where a link listens: the host of its URL (on the loopback, an address
/// of its own) and its port.
fn link_address(link: &PreviewLink) -> (String, u16) {
    let rest = link.url.strip_prefix("http://").expect("an http URL");
    let host = rest.split(':').next().expect("a host").to_owned();
    (host, link.host_port)
}

/// One plain HTTP/1.1 GET; returns the status line and the rest.
async fn http_get(link: &PreviewLink, target: &str, cookie: Option<&str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (host, port) = link_address(link);
    let mut stream = tokio::net::TcpStream::connect((host.as_str(), port)).await.expect("connects");
    let cookie = cookie.map(|c| format!("Cookie: {c}\r\n")).unwrap_or_default();
    let request = format!("GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n{cookie}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("sends");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("reads");
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test]
#[ignore = "needs root, the default image, the static agent and Chromium; run by `cargo xtask test`"]
async fn preview_links_work_in_a_browser_and_only_with_their_token() {
    let moat = moat(EgressConfig::default()).await;
    let sandbox = moat.create(spec(NetworkPolicy::None)).await.expect("created");
    let id = &sandbox.id;
    let client = serve_page(&moat, id, "<html><body><h1 id=greeting>served from the sandbox</h1></body></html>").await;
    let link = moat.preview_link(id, 8000).await.expect("a link");
    let again = moat.preview_link(id, 8000).await.expect("again");
    assert_eq!(again.host_port, link.host_port, "one listener per port");
    assert_ne!(again.token, link.token, "a new one-time token each time");

    let url = link.url.clone();
    let dom = tokio::task::spawn_blocking(move || chromium_dom(&url)).await.expect("joins");
    assert!(dom.contains("served from the sandbox"), "Chromium rendered: {dom}");

    // Without the token, with a wrong one, or with another link's token: refused.
    let response = http_get(&link, "/", None).await;
    assert!(response.starts_with("HTTP/1.1 403"), "{response}");
    assert!(response.contains("no token"), "{response}");
    let other = moat.preview_link(id, 8001).await.expect("another port's link");
    assert_ne!(other.token, link.token);
    let response = http_get(&other, &format!("/?moat_token={}", link.token), None).await;
    assert!(response.starts_with("HTTP/1.1 403"), "another port's token: {response}");
    let cookie = format!("moat_preview_{}={}", other.host_port, link.token);
    let response = http_get(&other, "/", Some(&cookie)).await;
    assert!(response.starts_with("HTTP/1.1 403"), "another port's token as a cookie: {response}");
    // Chromium used the first token: it opens nothing any more.
    let response = http_get(&link, &format!("/?moat_token={}", link.token), None).await;
    assert!(response.starts_with("HTTP/1.1 403") && response.contains("opened already"), "{response}");
    // An unused token: a redirect that sets a session cookie (not the
    // token), then the page.
    let response = http_get(&again, &format!("/?moat_token={}", again.token), None).await;
    assert!(response.starts_with("HTTP/1.1 303"), "{response}");
    let cookie = session_cookie(&response, again.host_port);
    assert!(!cookie.contains(&again.token), "the cookie is a session of its own: {cookie}");
    let response = http_get(&again, "/index.html", Some(&cookie)).await;
    assert!(response.starts_with("HTTP/1.0 200") && response.contains("served from the sandbox"), "{response}");

    // After the first request head the link splices raw bytes: an upgraded
    // (WebSocket-style) connection talks both ways.
    let upgrade = r#"import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', 8002)); s.listen(1)
c, _ = s.accept(); head = b''
while b'\r\n\r\n' not in head: head += c.recv(1024)
c.sendall(b'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n')
while True:
    data = c.recv(1024)
    if not data: break
    c.sendall(data.upper())
"#;
    let client_req = moat_proto::WriteFileRequest {
        path: "/home/user/upgrade.py".into(),
        mode: None,
        create_parents: false,
        owner: Some("user".into()),
    };
    client.write_file(client_req, &mut upgrade.as_bytes()).await.expect("writes the server");
    let (out, code) =
        sh(&moat, id, "setsid nohup python3 /home/user/upgrade.py > /tmp/up.log 2>&1 < /dev/null &").await;
    assert_eq!(code, Some(0), "{out}");
    for attempt in 0.. {
        if sh(&moat, id, "grep -q ':1F42 ' /proc/net/tcp").await.1 == Some(0) {
            break;
        }
        assert!(attempt < 500, "the upgrade server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ws = moat.preview_link(id, 8002).await.expect("a link for the upgrade server");
    let opened = http_get(&ws, &format!("/?moat_token={}", ws.token), None).await;
    let ws_cookie = session_cookie(&opened, ws.host_port);
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(link_address(&ws)).await.expect("connects");
        let request = format!(
            "GET /socket HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nCookie: {ws_cookie}\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("sends");
        let mut head =
            vec![0u8; b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n".len()];
        stream.read_exact(&mut head).await.expect("101");
        assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
        for word in ["hello", "both ways"] {
            stream.write_all(word.as_bytes()).await.expect("sends");
            let mut back = vec![0u8; word.len()];
            stream.read_exact(&mut back).await.expect("echo");
            assert_eq!(back, word.to_uppercase().as_bytes());
        }
    }

    // A sandbox has links for at most MAX_LINKS ports (listeners on the
    // host); a port it has already is always given a new URL.
    let mut port = 9000;
    while moat.preview_link(id, port).await.is_ok() {
        port += 1;
        assert!(port < 9100, "preview links are not bounded");
    }
    let refused = moat.preview_link(id, port).await.expect_err("past the bound").to_string();
    let max = moat_core::net::preview::MAX_LINKS;
    assert_eq!(usize::from(port - 9000) + 3, max, "{refused}");
    assert!(refused.contains(&format!("for {max} ports")) && refused.contains("8000, 8001, 8002"), "{refused}");
    moat.preview_link(id, 8000).await.expect("a port it has: a new URL");

    // The link ends with the sandbox.
    moat.destroy(id).await.expect("destroyed");
    moat.settled().await;
    // The listener's task is aborted with the sandbox and closes as the runtime drops it.
    for attempt in 0.. {
        if tokio::net::TcpStream::connect(link_address(&link)).await.is_err() {
            break;
        }
        assert!(attempt < 500, "the preview listener outlived the sandbox");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
#[ignore = "needs root, the default image and the static agent; run by `cargo xtask test`"]
async fn a_filtered_task_reaches_its_runtimes_registries_and_its_repository_host() {
    let project = tempfile::Builder::new().prefix("net-task-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("dir");
    std::fs::write(project.path().join("package.json"), "{}\n").expect("write");
    std::fs::create_dir(project.path().join(".git")).expect("mkdir");
    std::fs::write(
        project.path().join(".git/config"),
        "[remote \"origin\"]\n\turl = https://code.example.org/me/p.git\n",
    )
    .expect("write");
    // The repository host comes from a file in a root, which a model may
    // have written: it is reachable only when the operator allows it.
    let moat_without = moat(EgressConfig::default()).await;
    let task = moat_without.task_start(project.path(), spec(NetworkPolicy::Filtered)).await.expect("task starts");
    let allowed = moat_without.allowed_hosts(&task.sandbox_id).expect("hosts");
    assert!(!allowed.iter().any(|h| h == "code.example.org"), "not granted, not allowed: {allowed:?}");
    moat_without.destroy_all().await;
    let granted = EgressConfig { allow_hosts: vec!["code.example.org".into()], ..EgressConfig::default() };
    let moat = moat(granted).await;
    let task = moat.task_start(project.path(), spec(NetworkPolicy::Filtered)).await.expect("task starts");
    let allowed = moat.allowed_hosts(&task.sandbox_id).expect("hosts");
    assert!(allowed.iter().any(|h| h == "code.example.org"), "{allowed:?}");
    assert!(allowed.iter().any(|h| h == "registry.npmjs.org"), "{allowed:?}");
    assert!(!allowed.iter().any(|h| h == "pypi.org"), "a node task gets node's registry only: {allowed:?}");
    moat.destroy_all().await;
}

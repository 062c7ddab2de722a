"""Drives moat-mcp with the official Python MCP SDK (1.x or 2.x).

Usage: python mcp_client.py MOAT_MCP_BINARY TOOLS_JSON PROJECT_DIR TRANSPORT ERA
  TRANSPORT: stdio, or http (the script starts `moat-mcp --http` itself)
  ERA: handshake (initialize; 2025-11-25 and earlier) or modern
       (server/discover; 2026-07-28, SDK 2.x only)
Over http it also checks what only HTTP has: the bearer token, Host and
Origin checks, and that two sessions cannot see each other's sandboxes.
Exits non-zero (with the reason) when anything a client relies on is wrong.
"""

import asyncio
import base64
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

TOKEN = "moat-test-token-0123456789abcdef"
LIMIT = 16 * 1024 * 1024  # moat_mcp::limits::MAX_MESSAGE_BYTES
SDK_MAJOR = int(importlib.metadata.version("mcp").split(".")[0])


class HttpServer:
    """`moat-mcp --http --port 0`, its URL (and the file of a generated
    token) read from stderr."""

    def __init__(self, binary, env):
        self.process = subprocess.Popen(
            [binary, "--http", "--port", "0"], env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.token_file = None
        for line in self.process.stderr:
            if "MOAT_HTTP_TOKEN is not set" in line:
                self.token_file = line.split(" with the token in ", 1)[1].split(" (readable", 1)[0]
            if "serving MCP over streamable HTTP at " in line:
                self.url = line.strip().rsplit(" ", 1)[-1]
                break
        else:
            raise AssertionError(f"moat-mcp --http did not start (exit {self.process.wait()})")
        # Keep draining its log so that it never blocks on a full pipe.
        threading.Thread(target=lambda: [sys.stderr.write(line) for line in self.process.stderr], daemon=True).start()

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        assert code == 0, f"moat-mcp --http exited {code} on SIGTERM"


@contextlib.asynccontextmanager
async def connect(binary, env, transport, era, server=None, headers=None, token=TOKEN, cwd=None):
    if transport == "stdio":
        opened = stdio_client(StdioServerParameters(command=binary, args=[], env=env, cwd=cwd))
    else:
        client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}", **(headers or {})})
        opened = streamable_http_client(server.url, http_client=client)
    async with opened as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            if era == "modern":
                found = await session.discover()
                assert "2026-07-28" in found.supported_versions, found
            else:
                await session.initialize()
            yield session


def structured(result):
    value = getattr(result, "structuredContent", None)
    if value is None:
        value = getattr(result, "structured_content", None)
    return value


def is_error(result):
    value = getattr(result, "isError", None)
    if value is None:
        value = getattr(result, "is_error", None)
    return bool(value)


def field(obj, camel, snake):
    """SDK 1.x spells fields in camelCase, 2.x in snake_case."""
    value = getattr(obj, camel, None)
    return getattr(obj, snake, None) if value is None else value


def text(result):
    return "".join(getattr(block, "text", "") for block in result.content)


async def call(session, name, args, expect_error=False):
    result = await session.call_tool(name, args)
    if is_error(result) != expect_error:
        raise AssertionError(f"{name} {args}: isError={is_error(result)}: {text(result)}")
    if not expect_error:
        value = structured(result)
        assert value is not None, f"{name}: no structuredContent"
        assert json.loads(text(result)) == value, f"{name}: text and structuredContent differ"
        return value
    return text(result)


async def main(binary, contract_path, project, transport, era):
    contract = json.load(open(contract_path))["tools"]
    env = dict(os.environ, MOAT_ROOTS=os.path.dirname(project), MOAT_HTTP_TOKEN=TOKEN)
    # The operator grants no network here (the default): tool calls that
    # ask for more are refused (see operator_grants).
    for var in ("MOAT_ALLOW_NETWORK", "MOAT_NETWORK", "MOAT_ALLOW_HOSTS", "MOAT_TIMEOUT_SECONDS",
                "MOAT_MAX_TIMEOUT_SECONDS", "MOAT_MAX_CPUS", "MOAT_MAX_SANDBOX_MEMORY_MIB", "MOAT_MAX_DISK_MIB"):
        env.pop(var, None)
    server = HttpServer(binary, env) if transport == "http" else None
    try:
        async with connect(binary, env, transport, era, server) as session:
            await every_tool(session, contract, project)
            await mistakes_answered(session, transport)
            await a_killed_sandbox_fails(session, env)
        if transport == "stdio":
            raw_stdio_answered(binary, env)
        if transport == "stdio":
            await started_from_root(binary, env, era)
            await trusts_the_operators_ca(binary, env, era)
        if server:
            await http_only(binary, env, server)
    finally:
        if server:
            server.stop()
    print(f"mcp client ({transport}, {era}): all checks passed")


async def every_tool(session, contract, project):
    listed = (await session.list_tools()).tools
    assert [t.name for t in listed] == [t["name"] for t in contract], "tools/list differs from tools.json"
    for tool, spec in zip(listed, contract):
        schema = getattr(tool, "inputSchema", None) or getattr(tool, "input_schema", None)
        assert schema == spec["inputSchema"], f"{tool.name}: input schema differs from tools.json"
        assert tool.description == spec["description"], f"{tool.name}: description differs"

    box = await call(session, "create_sandbox", {"name": "mcp-test"})
    assert box["current"] and box["name"] == "mcp-test" and box["backend"] in ("jail", "vm"), box
    await operator_grants(session, box)

    out = await call(session, "run_command", {"cmd": "echo hi; echo err >&2; exit 3"})
    assert (out["stdout"], out["stderr"], out["exit_code"], out["timed_out"]) == ("hi\n", "err\n", 3, False), out
    out = await call(session, "run_command", {"cmd": "cat", "stdin": "fed"})
    assert out["stdout"] == "fed", out
    out = await call(session, "run_command", {"cmd": "sleep 30", "timeout": 1})
    assert out["timed_out"], out

    # A long command reports progress (with its latest lines) every 2 s.
    updates = []

    async def on_progress(progress, total, message):
        updates.append(message or "")

    slow = await session.call_tool(
        "run_command",
        {"cmd": "for i in 1 2 3 4 5 6; do echo line$i; sleep 1; done"},
        progress_callback=on_progress,
    )
    assert not is_error(slow) and structured(slow)["stdout"].count("line") == 6, text(slow)
    assert len(updates) >= 2 and any("line" in m for m in updates), updates

    # run_code: Python state persists, exceptions are data, figures are images.
    out = await call(session, "run_code", {"code": "x = 21\nprint('hi')\nx * 2"})
    assert (out["text"], out["stdout"], out["error"]) == ("42", "hi\n", None), out
    out = await call(session, "run_code", {"code": "x + 1"})
    assert out["text"] == "22" and out["execution_count"] == 2, out
    out = await call(session, "run_code", {"code": "import os\nos.system('echo from-a-child')\n1/0"})
    assert out["stdout"] == "from-a-child\n", out
    assert out["error"]["name"] == "ZeroDivisionError" and "1/0" in out["error"]["traceback"], out
    plot = await session.call_tool("run_code", {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"})
    assert not is_error(plot), text(plot)
    images = [b for b in plot.content if getattr(b, "type", "") == "image"]
    assert len(images) == 1 and field(images[0], "mimeType", "mime_type") == "image/png", plot.content
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG"), images[0].data[:20]
    assert sorted(structured(plot)["results"][0]["mime_types"]) == ["image/png", "text/plain"], structured(plot)
    svg = await session.call_tool("run_code", {"code": "from IPython.display import SVG, display\ndisplay(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"><circle r=\"4\"/></svg>'))"})
    resources = [b for b in svg.content if getattr(b, "type", "") == "resource"]
    assert len(resources) == 1 and "<circle" in resources[0].resource.text, svg.content
    out = await call(session, "run_code", {"code": "import time\ntime.sleep(30)", "timeout": 1})
    assert out["error"]["name"] == "TimeoutError" and "kept" in out["error"]["value"], out
    out = await call(session, "run_code", {"code": "x"})
    assert out["text"] == "21", out
    out = await call(session, "run_code", {"code": "echo $((6 * 7)); exit 4", "language": "bash"})
    assert out["stdout"] == "42\n" and out["error"]["value"] == "exited with status 4", out
    out = await call(session, "run_code", {"code": "console.log(1 + 1); nope()", "language": "node"})
    assert out["stdout"] == "2\n" and out["error"]["name"] == "ReferenceError", out
    message = await call(session, "run_code", {"code": "1", "language": "ruby"}, expect_error=True)
    assert "python, bash or node" in message, message

    # Cancelling a call (notifications/cancelled) kills what it started.
    # SDK 1.x does not send notifications/cancelled when a call is
    # cancelled (and its session breaks), so only 2.x checks this.
    if SDK_MAJOR >= 2:
        await cancellation_kills(session)

    big = await call(session, "run_command", {"cmd": "python3 -c \"print('x' * 150000)\""})
    assert big["truncated"] and "[truncated: " in big["stdout"], big["stdout"][-80:]
    whole = await call(session, "read_file", {"path": big["full_output_path"], "offset": 149990, "length": 20})
    assert whole["content"].startswith("xxxxxxxxxx"), whole
    # One answer holds 100,000 characters; next_offset goes on from there.
    first = await call(session, "read_file", {"path": big["full_output_path"]})
    assert len(first["content"]) == 100000 and first["truncated"] and first["next_offset"] == 100000, first["size"]
    rest = await call(session, "read_file", {"path": big["full_output_path"], "offset": first["next_offset"]})
    assert rest["content"] == "x" * 50000 + "\n" and not rest["truncated"] and "next_offset" not in rest, rest["length"]
    # A read whose end cuts a character in two stops before it.
    await call(session, "write_file", {"path": "accents.txt", "content": "é" * 8})
    part = await call(session, "read_file", {"path": "accents.txt", "length": 5})
    assert (part["content"], part["length"], part["next_offset"]) == ("éé", 4, 4), part

    await call(session, "write_file", {"path": "notes/hello.txt", "content": "héllo\n"})
    back = await call(session, "read_file", {"path": "/home/user/notes/hello.txt"})
    assert back["content"] == "héllo\n", back
    blob = base64.b64encode(bytes(range(256))).decode()
    await call(session, "write_file", {"path": "blob.bin", "content": blob, "encoding": "base64", "mode": "600"})
    back = await call(session, "read_file", {"path": "blob.bin", "encoding": "base64"})
    assert back["content"] == blob, back
    listing = await call(session, "list_files", {"depth": 2})
    names = {e["path"] for e in listing["entries"]}
    assert "/home/user/notes/hello.txt" in names and "/home/user/blob.bin" in names, names
    await call(session, "make_dir", {"path": "a/b/c"})
    await call(session, "move_file", {"source": "blob.bin", "destination": "a/b/c/blob.bin"})
    await call(session, "delete_file", {"path": "a", "recursive": True})

    # Errors the model can fix: tool results with isError and a way out.
    message = await call(session, "read_file", {"path": "missing.txt"}, expect_error=True)
    assert "no such file" in message, message
    message = await call(session, "read_file", {"path": "blob.bin", "encoding": "hex"}, expect_error=True)
    assert "utf8 or base64" in message, message
    message = await call(session, "run_command", {"cmd": "true", "timeout": 0}, expect_error=True)
    assert "from 1 to 3600" in message, message
    message = await call(session, "run_command", {"cmd": "true", "sandbox_id": "sbx-nope"}, expect_error=True)
    assert box["sandbox_id"] in message, message
    message = await call(session, "git_clone", {"url": "https://github.com/x/y"}, expect_error=True)
    assert "network" in message and "filtered" in message, message
    message = await call(session, "git_clone", {"url": "https://git.example/x/y"}, expect_error=True)
    assert "MOAT_GIT_HOSTS" in message, message
    message = await call(session, "preview_link", {"port": 0}, expect_error=True)
    assert "from 1 to 65535" in message, message
    link = await call(session, "preview_link", {"port": 8000})
    host = urllib.parse.urlsplit(link["url"]).hostname
    assert link["url"].startswith("http://127.") and host != "127.0.0.1" and link["token"] in link["url"], link
    again = await call(session, "preview_link", {"port": 8000})
    assert again["url"].split("?")[0] == link["url"].split("?")[0], "one listener per port"
    assert again["token"] != link["token"], "each call gives a new one-time token"

    # Copies between host (inside MOAT_ROOTS) and sandbox.
    # A tree travels without its top-level .git, whose config may hold a
    # remote's credentials (the contract says so).
    git_dir = os.path.join(project, ".git")
    os.makedirs(git_dir, exist_ok=True)
    with open(os.path.join(git_dir, "config"), "w") as f:
        f.write('[remote "origin"]\n\turl = https://user:secret@git.example/x\n')
    os.makedirs(os.path.join(project, "vendor", ".git"), exist_ok=True)
    with open(os.path.join(project, "vendor", ".git", "config"), "w") as f:
        f.write('[http]\n\textraheader = Authorization: Bearer secret\n')
    copied = await call(session, "copy_to_sandbox", {"host_path": project, "sandbox_path": "copied"})
    assert any(s.startswith("vendor/.git:") for s in copied["skipped"]), copied
    message = await call(session, "copy_to_sandbox", {"host_path": os.path.join(git_dir, "config"),
                                                       "sandbox_path": "config"}, expect_error=True)
    assert "inside a Git directory" in message, message
    shutil.rmtree(git_dir)
    shutil.rmtree(os.path.join(project, "vendor"))
    assert copied["files"] >= 1, copied
    out = await call(session, "run_command", {"cmd": "test ! -e copied/.git && cat copied/main.py && echo extra > copied/new.txt"})
    assert out["stdout"] == "print('hello')\n" and out["exit_code"] == 0, out
    back_dir = os.path.join(os.path.dirname(project), "copied-back-" + str(os.getpid()))
    got = await call(session, "copy_from_sandbox", {"sandbox_path": "copied", "host_path": back_dir})
    assert open(os.path.join(back_dir, "new.txt")).read() == "extra\n", got
    one = await call(session, "copy_to_sandbox", {"host_path": os.path.join(project, "main.py"), "sandbox_path": "one.py"})
    assert one == {"files": 1, "bytes": 15, "skipped": []}, one
    message = await call(session, "copy_from_sandbox", {"sandbox_path": "one.py", "host_path": back_dir}, expect_error=True)
    assert "exists" in message, message
    message = await call(session, "copy_to_sandbox", {"host_path": "/etc/passwd", "sandbox_path": "x"}, expect_error=True)
    assert "outside the shared directories" in message and "MOAT_ROOTS" in message, message
    # Nothing a host program runs by itself is written: not a git hook, nor
    # a .git directory (or an editor's settings) inside a copied tree.
    hook = os.path.join(back_dir, ".git", "hooks", "pre-commit")
    message = await call(session, "copy_from_sandbox", {"sandbox_path": "one.py", "host_path": hook}, expect_error=True)
    assert "moat never writes a copy into or as .git" in message and not os.path.exists(hook), message
    await call(session, "run_command", {"cmd": "mkdir -p planted/.git/hooks planted/.vscode && echo x > planted/.git/hooks/pre-commit && chmod +x planted/.git/hooks/pre-commit && echo '{}' > planted/.vscode/tasks.json && echo ok > planted/ok"})
    planted = os.path.join(os.path.dirname(project), "planted-" + str(os.getpid()))
    got = await call(session, "copy_from_sandbox", {"sandbox_path": "planted", "host_path": planted})
    assert sorted(os.listdir(planted)) == ["ok"], (os.listdir(planted), got)
    assert any(".git" in s and "moat never writes" in s for s in got["skipped"]), got

    # A task: import, change, diff, finish.
    task = await call(session, "task_start", {"source": project})
    assert task["runtime"] == "python", task
    await call(session, "run_command", {"cmd": "cd /workspace && echo \"print('bye')\" >> main.py"})
    diff = await call(session, "task_diff", {"task_id": task["task_id"]})
    assert "+print('bye')" in diff["diff"] and diff["summary"]["files_changed"] == 1, diff
    done = await call(session, "task_finish", {"task_id": task["task_id"]})
    assert os.path.exists(done["patch_path"]), done
    listed = await call(session, "list_sandboxes", {})
    assert any(t["task_id"] == task["task_id"] for t in listed["tasks"]), listed
    await call(session, "remove_task", {"task_id": task["task_id"]})

    await call(session, "destroy_sandbox", {"sandbox_id": box["sandbox_id"]})
    listed = await call(session, "list_sandboxes", {})
    assert all(s["sandbox_id"] != box["sandbox_id"] for s in listed["sandboxes"]), listed


def data_dir_of(env):
    return env.get("MOAT_DATA_DIR") or os.path.join(
        env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share"), "moat")


async def operator_grants(session, box):
    """Issue 15, items 3 and 6: the model asks for more network than the
    operator grants, and for images that are paths. Each is refused with
    the setting or rule that applies, no host path is shown, and the
    session's sandbox still works."""
    data_dir = os.path.realpath(data_dir_of(os.environ))
    for network in ("open", "filtered"):
        message = await call(session, "create_sandbox", {"network": network}, expect_error=True)
        assert "MOAT_ALLOW_NETWORK" in message and "none|filtered|open" in message, message
    message = await call(session, "create_sandbox", {"network": "filtered", "allow_hosts": ["evil.example"]},
                         expect_error=True)
    assert "MOAT_ALLOW_NETWORK" in message, message
    message = await call(session, "git_clone", {"url": "https://github.com/x/y"}, expect_error=True)
    assert "MOAT_ALLOW_NETWORK" in message, message
    # One sandbox's size and life are the operator's too: unset, at most the
    # host's CPUs and the default lifetime (MOAT_TIMEOUT_SECONDS, 3600).
    over = {"timeout_seconds": 28800}
    if len(os.sched_getaffinity(0)) < 16:
        over["cpus"] = len(os.sched_getaffinity(0)) + 1
    for field, value in over.items():
        message = await call(session, "create_sandbox", {field: value}, expect_error=True)
        var = {"cpus": "MOAT_MAX_CPUS", "timeout_seconds": "MOAT_MAX_TIMEOUT_SECONDS"}[field]
        assert f"{field} {value}" in message and f"by setting {var}" in message, message
    # An SSH key is the operator's to allow (MOAT_ALLOW_SSH_KEY), whatever the path.
    for key in ("~/.ssh/id_ed25519", "/etc/ssh/ssh_host_ed25519_key"):
        message = await call(session, "git_clone", {"url": "git@github.com:x/y.git", "ssh_key_path": key},
                             expect_error=True)
        assert "MOAT_ALLOW_SSH_KEY=1" in message and "does not let tool calls use SSH keys" in message, message
    for image in ("../../../../tmp", "../images/default", "/etc", "..", "a/b"):
        message = await call(session, "create_sandbox", {"image": image}, expect_error=True)
        assert "letters, digits" in message, message
        assert data_dir not in message and "/images" not in message, f"a host path in: {message}"
    message = await call(session, "create_sandbox", {"image": "no-such-image"}, expect_error=True)
    assert "not built" in message and data_dir not in message, f"a host path in: {message}"
    # Which build of the image a sandbox runs, and a call that insists on another.
    assert len(box["image_version"]) == 12 and "T" in box["image_built"], box
    message = await call(session, "create_sandbox", {"image": box["image"] + "@00000000"}, expect_error=True)
    assert f"is version {box['image_version']}" in message and "not 00000000" in message, message
    listed = await call(session, "list_sandboxes", {})
    assert [s["sandbox_id"] for s in listed["sandboxes"]] == [box["sandbox_id"]], "a refused call made a sandbox"
    out = await call(session, "run_command", {"cmd": "echo still works", "sandbox_id": box["sandbox_id"]})
    assert out["stdout"] == "still works\n", out


async def cancellation_kills(session):
    running = asyncio.ensure_future(session.call_tool("run_command", {"cmd": "touch started; sleep 61; touch finished"}))
    for _ in range(100):
        await asyncio.sleep(0.1)
        probe = await call(session, "run_command", {"cmd": "test -e started && pgrep -f 'sleep 6[1]'"})
        if probe["exit_code"] == 0:
            break
    else:
        raise AssertionError("the command to cancel did not start")
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    for _ in range(100):
        probe = await call(session, "run_command", {"cmd": "pgrep -f 'sleep 6[1]'"})
        if probe["exit_code"] == 1:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"cancelled command still runs: {probe}")


async def a_killed_sandbox_fails(session, env):
    """The agent of a jail is killed mid-command: the call answers that the
    sandbox failed, list_sandboxes shows it failed with why, and
    destroy_sandbox forgets it."""
    box = await call(session, "create_sandbox", {})
    sid = box["sandbox_id"]
    running = asyncio.ensure_future(
        session.call_tool("run_command", {"cmd": "touch /tmp/started; sleep 600", "sandbox_id": sid}))
    for _ in range(200):
        probe = await call(session, "run_command", {"cmd": "test -e /tmp/started", "sandbox_id": sid})
        if probe["exit_code"] == 0:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the command did not start")
    # The record is "PID START-TICK".
    monitor = open(os.path.join(data_dir_of(env), "sandboxes", sid, "monitor")).read().split()[0]
    # The monitor parses what the sandbox does: it is given none of the
    # server's environment, whose secrets (the HTTP token here) it need not
    # hold. (A rootless run cannot read a non-dumpable process's environ.)
    try:
        environ = open(f"/proc/{monitor}/environ", "rb").read().split(b"\0")
    except PermissionError:
        environ = []
    assert not any(v.startswith(b"MOAT_HTTP_TOKEN=") or TOKEN.encode() in v for v in environ), environ
    # The jail's init: the monitor's child that is not its keeper (cgroup v1).
    children = open(f"/proc/{monitor}/task/{monitor}/children").read().split()
    agent = next(c for c in children if open(f"/proc/{c}/comm").read().strip() != "moat-keeper")
    os.kill(int(agent), signal.SIGKILL)
    result = await asyncio.wait_for(running, 120)
    assert is_error(result) and "failed" in text(result) and "create another" in text(result), text(result)
    listed = await call(session, "list_sandboxes", {})
    mine = [s for s in listed["sandboxes"] if s["sandbox_id"] == sid]
    assert mine and mine[0]["state"] == "failed" and "ended unexpectedly" in mine[0]["failure"], listed
    await call(session, "destroy_sandbox", {"sandbox_id": sid})
    listed = await call(session, "list_sandboxes", {})
    assert all(s["sandbox_id"] != sid for s in listed["sandboxes"]), listed


def raw_post(url, headers):
    """A bare initialize POST; returns (status, headers, body)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read(200).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode(errors="replace")


async def mistakes_answered(session, transport):
    """Issue 16: wrong arguments, huge arrays, unknown tools and (over
    stdio, where the SDK shows JSON-RPC errors of any request) a message
    over the size limit each get a clear error, and the session goes on."""
    if transport == "stdio":
        try:
            await session.call_tool("write_file", {"path": "big.txt", "content": "x" * (LIMIT + 1)})
            raise AssertionError("a message over the limit was not refused")
        except AssertionError:
            raise
        except Exception as e:  # McpError
            assert str(LIMIT) in str(e) and "copy_to_sandbox" in str(e), e
    message = await call(session, "run_command", {"cmd": 5}, expect_error=True)
    assert "cmd must be a string" in message, message
    message = await call(session, "run_command", {"command": "ls"}, expect_error=True)
    assert 'no argument "command"' in message and "cmd" in message, message
    hosts = [f"h{i}.example" for i in range(100_000)]
    message = await call(session, "create_sandbox", {"allow_hosts": hosts}, expect_error=True)
    assert "at most 256" in message, message
    try:
        await session.call_tool("no_such_tool", {})
        raise AssertionError("an unknown tool was not refused")
    except Exception as e:  # McpError
        assert "unknown tool" in str(e) and "run_command" in str(e), e
    out = await call(session, "run_command", {"cmd": "echo still-here"})
    assert out["stdout"] == "still-here\n", out


def raw_stdio_answered(binary, env):
    """Issue 16: over stdio, a message over the limit, one that is not
    JSON, a batch and an unknown method each get an error; none is dropped
    and the server stays up."""
    process = subprocess.Popen([binary], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    def send(obj):
        process.stdin.write((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")
        process.stdin.flush()
    def answer():
        line = process.stdout.readline()
        assert line, "moat-mcp closed stdout"
        return json.loads(line)
    try:
        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        assert "result" in answer()
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        big = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
               "params": {"name": "write_file", "arguments": {"path": "big", "content": "x" * (LIMIT + 1000)}}}
        send(big)
        got = answer()
        assert got["id"] == 2 and got["error"]["code"] == -32600, str(got)[:300]
        assert str(LIMIT) in got["error"]["message"] and "copy_to_sandbox" in got["error"]["message"], got
        send(b"this is not json")
        got = answer()
        assert got["id"] is None and got["error"]["code"] == -32700, got
        send([{"jsonrpc": "2.0", "id": 3, "method": "ping"}])
        got = answer()
        assert got["error"]["code"] == -32600 and "batch" in got["error"]["message"], got
        send({"jsonrpc": "2.0", "id": 4, "method": "no/such/method"})
        got = answer()
        assert got["id"] == 4 and got["error"]["code"] == -32601 and "tools/call" in got["error"]["message"], got
        send({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "run_command", "arguments": [1]}})
        got = answer()
        assert got["id"] == 5 and got["error"]["code"] == -32602 and "arguments" in got["error"]["message"], got
        # An id no answer can carry is answered with id null, not ignored;
        # JSON nested past the parser's depth is answered with its id.
        send({"jsonrpc": "2.0", "id": None, "method": "ping"})
        got = answer()
        assert got["id"] is None and got["error"]["code"] == -32600 and "string or an integer" in got["error"]["message"], got
        send(b'{"jsonrpc":"2.0","id":8,"method":"ping","params":{"x":' + b"[" * 300 + b"]" * 300 + b"}}")
        got = answer()
        assert got["id"] == 8 and got["error"]["code"] == -32700, got
        send({"jsonrpc": "2.0", "id": 6, "method": "ping"})
        assert answer() == {"jsonrpc": "2.0", "id": 6, "result": {}}
    finally:
        process.stdin.close()
        assert process.wait(timeout=60) == 0


def raw_http_answered(server):
    """Issue 16 over HTTP: a body over the limit is a 413 with a JSON-RPC
    error (with the request's id), a body that is not JSON a 400 with one."""
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream"}
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "write_file", "arguments": {"path": "big", "content": "x" * (LIMIT + 1000)}}}).encode()
    for data, status, code, id in [(body, 413, -32600, 7), (b"{not json", 400, -32700, None)]:
        request = urllib.request.Request(server.url, data=data, method="POST", headers=auth)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raise AssertionError(f"answered {response.status}")
        except urllib.error.HTTPError as e:
            got = json.loads(e.read())
            assert e.code == status and e.headers.get("Content-Type") == "application/json", (e.code, got)
            assert got["id"] == id and got["error"]["code"] == code, got
            if status == 413:
                assert str(LIMIT) in got["error"]["message"] and "copy_to_sandbox" in got["error"]["message"], got


def resumed_after_a_drop(server):
    """Issue 16: a result that finishes while the client's SSE stream is
    down is replayed when it reconnects with Last-Event-ID."""
    import http.client
    host, port = server.url.split("/")[2].split(":")
    base = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream"}
    def post(body, headers):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/mcp", json.dumps(body), {**base, **headers})
        return conn, conn.getresponse()
    conn, response = post({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}, {})
    session = response.getheader("Mcp-Session-Id")
    response.read()
    conn.close()
    headers = {"Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-11-25"}
    conn, response = post({"jsonrpc": "2.0", "method": "notifications/initialized"}, headers)
    response.read()
    conn.close()
    conn, response = post({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "run_command", "arguments": {"cmd": "sleep 3; echo resumed-result"}}}, headers)
    last = None
    while last is None:
        line = response.readline().decode()
        assert line, "the stream ended before its first event id"
        if line.startswith("id:"):
            last = line[3:].strip()
    conn.close()  # the network blip: the call goes on without a stream
    deadline = time.monotonic() + 90
    while True:
        time.sleep(2)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/mcp", headers={**base, **headers, "Last-Event-ID": last,
                                             "Accept": "text/event-stream"})
        response = conn.getresponse()
        assert response.status == 200, (response.status, response.read())
        events = response.read().decode()
        conn.close()
        for line in events.splitlines():
            if line.startswith("id:"):
                last = line[3:].strip()
        if "resumed-result" in events:
            return
        assert time.monotonic() < deadline, f"the result was never replayed; last: {events!r}"


def stateless_call(server, name, arguments):
    """A tools/call of protocol 2026-07-28 (no session); its result."""
    import http.client
    host, port = server.url.split("/")[2].split(":")
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {}}
    body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": meta}}
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
               "Mcp-Method": "tools/call", "Mcp-Name": name}
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/mcp", json.dumps(body), headers)
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    assert response.status == 200, (response.status, raw)
    for line in raw.splitlines():
        if line.startswith("data:") and line[5:].strip():
            message = json.loads(line[5:])
            if message.get("id") == 3:
                return message["result"]
    return json.loads(raw)["result"]


def stateless_requests_keep_to_one_share(server):
    """Requests without a session share one scope, and together it owns
    at most one session's share of places (8 of the default 16): clients
    that send no session cannot take every place from those that do."""
    made, refusal = [], None
    for _ in range(9):
        result = stateless_call(server, "create_sandbox", {"memory_mib": 128, "disk_mib": 64})
        if result.get("isError"):
            refusal = result["content"][0]["text"]
            break
        made.append(result["structuredContent"]["sandbox_id"])
    assert refusal and "MOAT_MAX_SANDBOXES_PER_SESSION=8" in refusal, (made, refusal)
    owned = stateless_call(server, "list_sandboxes", {})["structuredContent"]["sandboxes"]
    assert len([s for s in owned if s["state"] != "failed"]) == 8, owned
    for sandbox_id in made:
        stateless_call(server, "destroy_sandbox", {"sandbox_id": sandbox_id})


def resumed_stateless(server):
    """The same for a request of protocol 2026-07-28, which has no session:
    without the event log the call would be cancelled with its stream."""
    import http.client
    host, port = server.url.split("/")[2].split(":")
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28"}
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {}}
    body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "run_command", "arguments": {"cmd": "sleep 3; echo stateless-result"}, "_meta": meta}}
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/mcp", json.dumps(body), {**headers, "Mcp-Method": "tools/call", "Mcp-Name": "run_command"})
    response = conn.getresponse()
    assert response.status == 200, (response.status, response.read())
    last = None
    while last is None:
        line = response.readline().decode()
        assert line, "the stream ended before its first event id"
        if line.startswith("id:"):
            last = line[3:].strip()
    conn.close()
    deadline = time.monotonic() + 90
    while True:
        time.sleep(2)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/mcp", headers={**headers, "Accept": "text/event-stream", "Last-Event-ID": last})
        response = conn.getresponse()
        events = response.read().decode()
        conn.close()
        assert response.status == 200, (response.status, events)
        for line in events.splitlines():
            if line.startswith("id:"):
                last = line[3:].strip()
        if "stateless-result" in events:
            return
        assert time.monotonic() < deadline, f"the result was never replayed; last: {events!r}"


async def started_from_root(binary, env, era):
    """Issue 15, item 2: a server started from / with MOAT_ROOTS unset (as
    several desktop hosts start servers) shares no host directory."""
    env = {k: v for k, v in env.items() if k != "MOAT_ROOTS"}
    async with connect(binary, env, "stdio", era, cwd="/") as session:
        for path in ["/etc/shadow", "/etc/passwd", "/root/.ssh/id_rsa"]:
            message = await call(session, "copy_to_sandbox", {"host_path": path, "sandbox_path": "x"}, expect_error=True)
            assert "no host directory is shared" in message and "MOAT_ROOTS" in message, message
        message = await call(session, "copy_from_sandbox", {"sandbox_path": "/etc/hostname", "host_path": "/tmp/moat-planted"}, expect_error=True)
        assert "MOAT_ROOTS" in message and not os.path.exists("/tmp/moat-planted"), message
        message = await call(session, "task_start", {"source": "/etc"}, expect_error=True)
        assert "MOAT_ROOTS" in message, message
        out = await call(session, "run_command", {"cmd": "echo still-here"})
        assert out["stdout"] == "still-here\n", out


def made_certificates(directory):
    """A CA (as a TLS-inspecting proxy's) and a certificate for localhost
    that it signed, made with openssl."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=moat test inspecting CA",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
            "-out", "server.csr")
    with open(os.path.join(directory, "server.ext"), "w") as ext:
        ext.write("subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "server.ext", "-out", "server.crt")
    return {name: open(os.path.join(directory, name)).read() for name in ("ca.crt", "ca.key", "server.crt", "server.key")}


# An HTTPS server on localhost in the sandbox, with the certificate the
# test's CA signed; and the clients that must trust it.
SERVE_TLS = """
import http.server, ssl
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"hello over tls")
    def log_message(self, *args):
        pass
httpd = http.server.HTTPServer(("127.0.0.1", 8443), Hello)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/tmp/tls/server.crt", "/tmp/tls/server.key")
httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
httpd.serve_forever()
"""
TLS_CLIENTS = {
    "curl": "curl -sS https://localhost:8443/",
    "python": "python3 -c \"import urllib.request; print(urllib.request.urlopen('https://localhost:8443/').read().decode())\"",
    "node": "node --dns-result-order=ipv4first -e \"require('https').get('https://localhost:8443/', r => r.on('data', d => process.stdout.write(d)))"
            ".on('error', e => { console.error(e.message); process.exit(1) })\"",
}


async def serving_tls(session, certificates):
    box = await call(session, "create_sandbox", {})
    for name in ("server.crt", "server.key"):
        await call(session, "write_file", {"path": f"/tmp/tls/{name}", "content": certificates[name],
                                           "sandbox_id": box["sandbox_id"]})
    await call(session, "write_file", {"path": "/tmp/tls/serve.py", "content": SERVE_TLS,
                                       "sandbox_id": box["sandbox_id"]})
    await call(session, "run_command", {"cmd": "python3 /tmp/tls/serve.py", "background": True,
                                        "sandbox_id": box["sandbox_id"]})
    wait = "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8443) 2>/dev/null && exit 0; sleep 0.1; done; exit 1"
    out = await call(session, "run_command", {"cmd": wait, "sandbox_id": box["sandbox_id"]})
    assert out["exit_code"] == 0, f"the TLS server never listened: {out}"
    return box["sandbox_id"]


async def trusts_the_operators_ca(binary, env, era):
    """Issue 19, item 8: on a host behind a TLS-inspecting proxy the
    operator names the proxy's CA in MOAT_CA_FILE, and every new sandbox
    trusts it: the system store (curl, Python's ssl) and Node's own store.
    Without it the same clients refuse the certificate; a file with a
    private key is refused at start."""
    with tempfile.TemporaryDirectory() as directory:
        certificates = made_certificates(directory)
        async with connect(binary, env, "stdio", era) as session:
            sandbox_id = await serving_tls(session, certificates)
            for client, cmd in TLS_CLIENTS.items():
                out = await call(session, "run_command", {"cmd": cmd, "sandbox_id": sandbox_id})
                assert out["exit_code"] != 0, f"{client} trusted an unknown CA: {out}"
        ca_env = dict(env, MOAT_CA_FILE=os.path.join(directory, "ca.crt"))
        async with connect(binary, ca_env, "stdio", era) as session:
            sandbox_id = await serving_tls(session, certificates)
            for client, cmd in TLS_CLIENTS.items():
                out = await call(session, "run_command", {"cmd": cmd, "sandbox_id": sandbox_id})
                assert (out["exit_code"], out["stdout"].strip()) == (0, "hello over tls"), f"{client}: {out}"
            out = await call(session, "run_command", {"cmd": "echo $PIP_CERT $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS",
                                                      "sandbox_id": sandbox_id})
            assert out["stdout"].split() == ["/etc/ssl/certs/ca-certificates.crt"] * 2 + [
                "/usr/local/share/ca-certificates/moat-extra.crt"], out
        with open(os.path.join(directory, "with-key.pem"), "w") as mixed:
            mixed.write(certificates["ca.crt"] + certificates["ca.key"])
        bad_env = dict(env, MOAT_CA_FILE=os.path.join(directory, "with-key.pem"))
        started = subprocess.run([binary], env=bad_env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=60)
        assert started.returncode == 2 and "MOAT_CA_FILE" in started.stderr and "private key" in started.stderr, (
            started.returncode, started.stderr)


async def http_only(binary, env, server):
    authority = server.url.split("/")[2]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, headers, body = raw_post(server.url, {})
    assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (status, dict(headers), body)
    assert "MOAT_HTTP_TOKEN" in body, body
    status, headers, body = raw_post(server.url, {"Authorization": "Bearer wrong-token-wrong-token"})
    assert status == 401 and "invalid_token" in headers.get("WWW-Authenticate", ""), (status, dict(headers), body)
    status, _, body = raw_post(server.url, {**auth, "Origin": "http://evil.example"})
    assert status == 403 and "evil.example" in body, (status, body)
    status, _, body = raw_post(server.url, {**auth, "Host": "rebound.example:80"})
    assert status == 403 and authority in body, (status, body)
    status, _, _ = raw_post(server.url, {**auth, "Origin": f"http://{authority}"})
    assert status == 200, status
    raw_http_answered(server)
    resumed_after_a_drop(server)
    resumed_stateless(server)
    stateless_requests_keep_to_one_share(server)

    # Two sessions: neither sees nor touches the other's sandboxes, and a
    # session's sandboxes end with it.
    data_dir = data_dir_of(env)
    async with connect(binary, env, "http", "handshake", server) as first:
        mine = await call(first, "create_sandbox", {"name": "first"})
        async with connect(binary, env, "http", "handshake", server) as second:
            theirs = await call(second, "list_sandboxes", {})
            assert theirs["sandboxes"] == [], theirs
            message = await call(second, "run_command", {"cmd": "true", "sandbox_id": mine["sandbox_id"]}, expect_error=True)
            assert message.startswith("No sandbox") and "this session" in message, message
            message = await call(second, "destroy_sandbox", {"sandbox_id": mine["sandbox_id"]}, expect_error=True)
            assert "this session" in message, message
        out = await call(first, "run_command", {"cmd": "echo still here"})
        assert out["stdout"] == "still here\n", out
        await a_session_keeps_to_its_share(binary, env, server, first)
    state = os.path.join(data_dir, "sandboxes", mine["sandbox_id"])
    deadline = time.monotonic() + 60
    while os.path.exists(state) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not os.path.exists(state), f"{state} outlived its closed session"
    await generated_token(binary, env)


async def a_session_keeps_to_its_share(binary, env, server, first):
    """One session cannot take every sandbox of a shared server: it owns at
    most MOAT_MAX_SANDBOXES_PER_SESSION live ones (half of MOAT_MAX_SANDBOXES,
    16, by default), creates running at once included, and another session
    still gets one. `first` owns one sandbox already."""
    small = {"memory_mib": 128, "disk_mib": 64}
    tries = await asyncio.gather(*(first.call_tool("create_sandbox", small) for _ in range(8)))
    made = [structured(r)["sandbox_id"] for r in tries if not is_error(r)]
    refused = [text(r) for r in tries if is_error(r)]
    assert len(made) == 7 and len(refused) == 1, (made, refused)
    assert "MOAT_MAX_SANDBOXES_PER_SESSION=8" in refused[0] and "destroy_sandbox" in refused[0], refused[0]
    message = await call(first, "task_start", {"source": "/nonexistent"}, expect_error=True)
    assert "MOAT_MAX_SANDBOXES_PER_SESSION" in message, message
    async with connect(binary, env, "http", "handshake", server) as other:
        theirs = await call(other, "create_sandbox", small)
        await call(other, "destroy_sandbox", {"sandbox_id": theirs["sandbox_id"]})
    await call(first, "destroy_sandbox", {"sandbox_id": made.pop()})
    again = await call(first, "create_sandbox", small)
    for sandbox_id in made + [again["sandbox_id"]]:
        await call(first, "destroy_sandbox", {"sandbox_id": sandbox_id})


async def generated_token(binary, env):
    """Issue 15, item 9: without MOAT_HTTP_TOKEN the server still requires
    a token: one it generates into a file only its owner can read, whose
    path it prints. Without it a local client gets 401; with it, tools."""
    env = {k: v for k, v in env.items() if k != "MOAT_HTTP_TOKEN"}
    server = HttpServer(binary, env)
    try:
        assert server.token_file, "no token file was named on stderr"
        info = os.lstat(server.token_file)
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.geteuid(), oct(info.st_mode)
        assert os.stat(os.path.dirname(server.token_file)).st_mode & 0o077 == 0, "its directory is private"
        token = open(server.token_file).read().strip()
        assert len(token) >= 32, token
        status, headers, body = raw_post(server.url, {})
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (status, body)
        status, _, _ = raw_post(server.url, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 401, "a token other than the generated one is refused"
        status, _, _ = raw_post(server.url, {"Authorization": f"Bearer {token}"})
        assert status == 200, status
        async with connect(binary, env, "http", "handshake", server, token=token) as session:
            out = await call(session, "run_command", {"cmd": "echo with the generated token"})
            assert out["stdout"] == "with the generated token\n", out
    finally:
        server.stop()
    assert not os.path.exists(server.token_file), "the token file outlived its server"


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))

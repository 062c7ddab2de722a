"""Load on moat-mcp over streamable HTTP, through the official Python SDK.

Starts `moat-mcp --http --port 0` with a token and a data directory of its
own, opens N sessions at once (each creates its own sandbox) and makes M
mixed calls in each: a command, a 50 KB file written and read back, an
output flood, a Python cell. It reports the latency of each call kind
(p50/p90/p99), errors, the server's RSS and open descriptors sampled over
the run, and what is left once the server has stopped (processes, state
directories, cgroups, mounts).

With --bad B, the good sessions make their M calls twice: alone, then
beside B misbehaving sessions (a fork bomb, an output flood, a memory bomb,
a client that disconnects mid-call, in turn); it reports the good calls'
p99 in both phases and their ratio.

With --soak, sessions come and go at a steady rate for --minutes, and it
prints the server's RSS and descriptors each minute and whether they stayed
flat (the first against the last ten minutes, or thirds of a shorter run).

Usage: python bench_load.py MOAT_MCP OUT_DIR --images DIR [--sessions N]
       [--calls M] [--bad B] [--soak] [--minutes T] [--rate R]

This is a benchmark, not a test: nothing here asserts a wall-clock figure.
It exits non-zero only when a good call failed or something was left over.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time

import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

TOKEN = "moat-bench-load-token-0123456789abcdef"
FILE_BYTES = 50 * 1000
KINDS = ["command", "write_file", "read_file", "flood", "python"]
BAD_KINDS = ["fork bomb", "output flood", "memory bomb", "disconnect mid-call"]


# ---------------------------------------------------------------- the server


class Server:
    """`moat-mcp --http --port 0`, its URL read from stderr, the rest of its
    log kept in OUT_DIR/server.log."""

    def __init__(self, binary, out_dir, images):
        self.data_dir = os.path.abspath(os.path.join(out_dir, "data"))
        os.makedirs(os.path.join(self.data_dir, "sandboxes"), exist_ok=True)
        # The image is the one `cargo xtask image` built; the state is ours
        # alone, so that what is left over is ours to count.
        link = os.path.join(self.data_dir, "images")
        if not os.path.exists(link):
            os.symlink(images, link)
        env = dict(
            os.environ,
            MOAT_HTTP_TOKEN=TOKEN,
            MOAT_DATA_DIR=self.data_dir,
            MOAT_BACKEND="jail",
            MOAT_MAX_SANDBOXES="1024",
            # Its sandboxes are never suspended (idle_seconds 0): allowed.
            MOAT_MAX_IDLE_SECONDS="0",
            # memory_mib is a cap, not a reservation: many small-use jails
            # fit where their caps' sum would not (docs/operations.md).
            MOAT_MAX_MEMORY_MIB=str(1 << 20),
        )
        for var in ("MOAT_ALLOW_NETWORK", "MOAT_NETWORK", "MOAT_ALLOW_HOSTS", "MOAT_POOL_SIZE"):
            env.pop(var, None)
        self.log = open(os.path.join(out_dir, "server.log"), "w")
        self.process = subprocess.Popen(
            [os.path.abspath(binary), "--http", "--port", "0"],
            env=env,
            cwd=out_dir,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid
        for line in self.process.stderr:
            self.log.write(line)
            if "serving MCP over streamable HTTP at " in line:
                self.url = line.strip().rsplit(" ", 1)[-1]
                break
        else:
            raise SystemExit(f"moat-mcp --http did not start (exit {self.process.wait()}); see {self.log.name}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.process.stderr:
            self.log.write(line)
        self.log.flush()

    def stop(self):
        """SIGTERM, as an operator stops it; returns its exit status and the
        seconds it took."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = f"killed after 120 s ({self.process.wait()})"
        return code, time.monotonic() - started


class Sampler:
    """Samples the server's RSS, descriptors and threads, and the host's
    CPU split, every `period` seconds in a thread of its own."""

    def __init__(self, pid, period=0.5):
        self.pid, self.period = pid, period
        self.samples = []  # (monotonic, rss KiB, fds, threads)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_event.is_set():
            sample = process_sample(self.pid)
            if sample:
                self.samples.append((time.monotonic(),) + sample)
            self.stop_event.wait(self.period)

    def between(self, start, end):
        return [s for s in self.samples if start <= s[0] <= end]

    def stop(self):
        self.stop_event.set()
        self.thread.join()


def process_sample(pid):
    try:
        status = open(f"/proc/{pid}/status").read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0])
    return rss, fds, int(fields["Threads"])


def cpu_times():
    """The host's (user+nice, system+irq+softirq, idle+iowait, total) jiffies."""
    values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = values[:7]
    return user + nice, system + irq + softirq, idle + iowait, sum(values[:8])


def process_cpu(pid):
    """A process's user and system CPU seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# ---------------------------------------------------------------- the calls


def structured(result):
    value = getattr(result, "structuredContent", None)
    return getattr(result, "structured_content", None) if value is None else value


def is_error(result):
    value = getattr(result, "isError", None)
    return bool(getattr(result, "is_error", None) if value is None else value)


def text(result):
    return "".join(getattr(block, "text", "") for block in result.content)


class Stats:
    """Latencies and errors of one phase's calls."""

    def __init__(self):
        self.latency = {}  # kind -> [seconds]
        self.timeline = []  # (monotonic when done, seconds), in order
        self.errors = []  # (kind, message)
        self.start = self.end = None

    def add(self, kind, seconds):
        self.latency.setdefault(kind, []).append(seconds)
        self.timeline.append((time.monotonic(), seconds))

    def all(self, kinds=None):
        return [v for k, values in self.latency.items() if kinds is None or k in kinds for v in values]


@contextlib.asynccontextmanager
async def session_for(url, terminate_on_close=True):
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
    async with client:
        async with streamable_http_client(url, http_client=client, terminate_on_close=terminate_on_close) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                yield session


async def timed(stats, kind, session, tool, args, check=None):
    """One call, timed; a failure (an exception, isError, or `check`
    refusing the result) is counted as an error of `kind`."""
    started = time.perf_counter()
    try:
        result = await session.call_tool(tool, args)
    except Exception as e:  # noqa: BLE001 - every failure is a figure here
        stats.add(kind, time.perf_counter() - started)
        stats.errors.append((kind, f"{type(e).__name__}: {e}"))
        return None
    stats.add(kind, time.perf_counter() - started)
    if is_error(result):
        stats.errors.append((kind, text(result)[:300]))
        return None
    value = structured(result)
    problem = check(value) if check else None
    if problem:
        stats.errors.append((kind, problem))
        return None
    return value


def exited_zero(value):
    if value is None or value.get("exit_code") != 0:
        return f"exit {value and value.get('exit_code')}: {value and value.get('stderr', '')[-200:].strip()}"
    return None


async def good_call(stats, session, sandbox, i, payload):
    """The i-th call of a good session: the kinds in turn."""
    kind = KINDS[i % len(KINDS)]
    ids = {"sandbox_id": sandbox}
    if kind == "command":
        await timed(stats, kind, session, "run_command", {"cmd": f"echo call {i} && ls /etc | wc -l", **ids}, exited_zero)
    elif kind == "write_file":
        await timed(stats, kind, session, "write_file", {"path": f"data-{i % 10}.bin", "content": payload, **ids})
    elif kind == "read_file":
        # The file the write_file call just before this one wrote.
        path = f"data-{(i - 1) % 10}.bin"

        def same(value):
            return None if value and value.get("content") == payload else f"read_file {path}: not what was written"

        await timed(stats, kind, session, "read_file", {"path": path, **ids}, same)
    elif kind == "flood":
        # About 1.3 MB of output; the answer keeps the first 100,000
        # characters and saves the rest in the sandbox.
        await timed(stats, kind, session, "run_command", {"cmd": "seq 1 200000", **ids}, exited_zero)
    else:

        def answered(value):
            return None if value and value.get("text") == str(sum(range(i * 1000))) else f"run_code: {value}"

        await timed(stats, kind, session, "run_code", {"code": f"sum(range({i * 1000}))", **ids}, answered)


async def good_session(url, calls, phases, ready, sandboxes, setup):
    """Opens a session and its sandbox, then for each phase waits for its
    start and makes `calls` calls into that phase's Stats."""
    payload = "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789\n") for _ in range(FILE_BYTES))
    async with session_for(url) as session:
        box = await timed(setup, "create_sandbox", session, "create_sandbox", {})
        if box is None:
            ready.append(False)
            return
        sandboxes.append(box["sandbox_id"])
        # The first Python cell starts the sandbox's Python; it is timed
        # with the setup, so that both phases see warm sessions alike.
        await timed(setup, "python start", session, "run_code", {"code": "1", "sandbox_id": box["sandbox_id"]})
        ready.append(True)
        index = 0
        for start, stats in phases:
            await start.wait()
            for _ in range(calls):
                await good_call(stats, session, box["sandbox_id"], index, payload)
                index += 1
        await timed(setup, "destroy_sandbox", session, "destroy_sandbox", {"sandbox_id": box["sandbox_id"]})


async def bad_session(url, n, kinds, stop, sandboxes, record):
    """Misbehaves in its own way until `stop` is set; `record` collects
    (what, seconds, outcome) of each misdeed."""
    what = kinds[n % len(kinds)]
    commands = {
        # Bash's fork bomb: it fills the pids limit, and is killed at its
        # timeout or when moat notices the limit.
        "fork bomb": (":(){ :|:& };:", 20),
        # Output as fast as the sandbox can write it, until its timeout.
        "output flood": ("yes moat-bench-load-flood", 10),
        # Memory until the OOM killer acts.
        "memory bomb": ("python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 24))'", 30),
    }
    while not stop.is_set():
        if what == "disconnect mid-call":
            await disconnect_mid_call(url, sandboxes, record)
            continue
        async with session_for(url) as session:
            created = await session.call_tool("create_sandbox", {})
            if is_error(created):
                record.append((what, 0, "create_sandbox failed: " + text(created)[:200]))
                await asyncio.sleep(1)
                continue
            sandboxes.append(structured(created)["sandbox_id"])
            cmd, timeout = commands[what]
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    result = await session.call_tool("run_command", {"cmd": cmd, "timeout": timeout})
                    value = structured(result) or {}
                    # An error's first words say which (grouped with its like).
                    outcome = f"error: {text(result)[:400]}" if is_error(result) else f"exit {value.get('exit_code')}"
                    if value.get("timed_out"):
                        outcome += ", timed out"
                    if "moat:" in value.get("stderr", ""):
                        outcome += ", limit reported"
                except Exception as e:  # noqa: BLE001
                    outcome = f"{type(e).__name__}"
                record.append((what, time.perf_counter() - started, outcome))


async def disconnect_mid_call(url, sandboxes, record):
    """A session that starts a long command and goes away a second later:
    every other time without ending its MCP session (the TCP connection
    just closes), the others with the SDK's DELETE."""
    graceful = len(record) % 2 == 0
    started = time.perf_counter()
    with anyio.move_on_after(20):
        async with session_for(url, terminate_on_close=graceful) as session:
            created = await session.call_tool("create_sandbox", {"idle_seconds": 0})
            if not is_error(created):
                sandboxes.append(structured(created)["sandbox_id"])
            with anyio.move_on_after(1):
                await session.call_tool("run_command", {"cmd": "sleep 30; echo never seen"})
    record.append(("disconnect mid-call", time.perf_counter() - started, "graceful" if graceful else "dropped"))


# ---------------------------------------------------------------- reporting


def pct(values, p):
    """The nearest-rank percentile `p` (0..1) of `values`, in seconds."""
    values = sorted(values)
    return values[max(0, math.ceil(len(values) * p) - 1)] if values else float("nan")


def ms(seconds):
    return f"{seconds * 1000:8.1f}"


def latency_table(title, stats, kinds):
    print(f"\n{title}: {len(stats.all())} calls in {stats.end - stats.start:.1f} s, {len(stats.errors)} errors")
    print(f"  {'call':<16} {'n':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for kind in kinds + ["all"]:
        values = stats.all() if kind == "all" else stats.latency.get(kind, [])
        if values:
            row = "".join(ms(pct(values, p)) + " " for p in (0.5, 0.9, 0.99, 1.0))
            print(f"  {kind:<16} {len(values):>5} {row}")
    for kind, message in stats.errors[:5]:
        print(f"  error ({kind}): {message}")


def resources(title, sampler, start, end):
    samples = sampler.between(start, end)
    if not samples:
        return {}
    rss = [s[1] / 1024 for s in samples]
    fds = [s[2] for s in samples]
    threads = [s[3] for s in samples]
    print(
        f"  server during {title}: RSS {rss[0]:.0f} -> max {max(rss):.0f} -> last {rss[-1]:.0f} MiB; "
        f"descriptors {fds[0]} -> max {max(fds)} -> last {fds[-1]}; threads max {max(threads)}"
    )
    return {"rss_mib_max": round(max(rss), 1), "fds_max": max(fds), "threads_max": max(threads)}


def cpu_split(before, after):
    user, system, idle, total = (a - b for a, b in zip(after, before))
    total = total or 1
    return f"host CPU {100 * user / total:.0f}% user, {100 * system / total:.0f}% system, {100 * idle / total:.0f}% idle"


def leftovers(server, sandboxes):
    """What is left once the server has stopped: each item in words."""
    found = []
    ids = set(sandboxes)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cgroups = open(f"/proc/{pid}/cgroup").read()
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(pid) == server.pid or server.data_dir in cmdline or any(i in cgroups for i in ids):
            found.append(f"process {pid}: {cmdline[:120]}")
    for entry in sorted(os.listdir(os.path.join(server.data_dir, "sandboxes"))):
        found.append(f"state directory {os.path.join(server.data_dir, 'sandboxes', entry)}")
    for controller in sorted(os.listdir("/sys/fs/cgroup")):
        parent = os.path.join("/sys/fs/cgroup", controller, "moat")
        if os.path.isdir(parent):
            found.extend(f"cgroup {os.path.join(parent, e)}" for e in sorted(os.listdir(parent)) if e in ids)
    if os.path.isdir("/sys/fs/cgroup/moat"):
        found.extend(f"cgroup /sys/fs/cgroup/moat/{e}" for e in sorted(os.listdir("/sys/fs/cgroup/moat")) if e in ids)
    for line in open("/proc/self/mountinfo"):
        if server.data_dir in line:
            found.append(f"mount {line.split()[4]}")
    return found


# ---------------------------------------------------------------- the runs


async def load(server, sampler, args, report):
    phases = [(asyncio.Event(), Stats())]
    if args.bad:
        phases.append((asyncio.Event(), Stats()))
    setup, ready, sandboxes, bad_record = Stats(), [], [], []
    report["sandboxes"] = sandboxes
    setup.start = time.monotonic()
    goods = [
        asyncio.create_task(good_session(server.url, args.calls, phases, ready, sandboxes, setup))
        for _ in range(args.sessions)
    ]
    while len(ready) < args.sessions and not all(t.done() for t in goods):
        await asyncio.sleep(0.05)
    setup.end = time.monotonic()
    print(f"{args.sessions} sessions opened, {sum(ready)} sandboxes created in {setup.end - setup.start:.1f} s")
    results = {}
    for n, (start, stats) in enumerate(phases):
        bad_tasks, stop = [], asyncio.Event()
        if n == 1:
            bad_tasks = [
                asyncio.create_task(bad_session(server.url, b, args.bad_kinds, stop, sandboxes, bad_record))
                for b in range(args.bad)
            ]
            # Let them get going (sandboxes made, bombs lit) first.
            await asyncio.sleep(args.bad_lead)
        name = "good sessions alone" if n == 0 else f"good sessions beside {args.bad} bad ones"
        before_cpu, before_server = cpu_times(), process_cpu(server.pid)
        stats.start = time.monotonic()
        start.set()
        # The phase ends when every good session has made its calls.
        while sum(len(v) for v in stats.latency.values()) < args.calls * sum(ready) and not all(
            t.done() for t in goods
        ):
            await asyncio.sleep(0.05)
        stats.end = time.monotonic()
        after_cpu, after_server = cpu_times(), process_cpu(server.pid)
        stop.set()
        latency_table(name, stats, KINDS)
        results[name] = {
            "calls": len(stats.all()),
            "errors": len(stats.errors),
            "first_errors": stats.errors[:5],
            **{f"p{int(p * 100)}_ms": round(pct(stats.all(), p) * 1000, 1) for p in (0.5, 0.9, 0.99)},
            "max_ms": round(pct(stats.all(), 1) * 1000, 1),
            "per_kind": {
                k: {f"p{int(p * 100)}_ms": round(pct(v, p) * 1000, 1) for p in (0.5, 0.9, 0.99)}
                for k, v in stats.latency.items()
            },
            **resources(name, sampler, stats.start, stats.end),
        }
        print(
            f"  {cpu_split(before_cpu, after_cpu)}; server CPU "
            f"{after_server[0] - before_server[0]:.1f} s user, {after_server[1] - before_server[1]:.1f} s system"
        )
        if bad_tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*bad_tasks, return_exceptions=True), 60)
            for t in bad_tasks:
                t.cancel()
    await asyncio.gather(*goods, return_exceptions=True)
    setup.end = time.monotonic()
    latency_table("sandbox setup and teardown (all sessions)", setup, ["create_sandbox", "python start", "destroy_sandbox"])
    report["phases"] = results
    report["setup_errors"] = setup.errors[:5]
    errors = sum(r["errors"] for r in results.values()) + len(setup.errors)
    if args.bad:
        print(f"\nbad sessions' calls ({len(bad_record)}):")
        for what in BAD_KINDS:
            done = [r for r in bad_record if r[0] == what]
            if done:
                outcomes = {}
                for r in done:
                    outcomes[r[2]] = outcomes.get(r[2], 0) + 1
                print(
                    f"  {what:<20} {len(done):>3} calls, median {pct([r[1] for r in done], 0.5):.1f} s: "
                    + ", ".join(f"{o} ×{c}" for o, c in sorted(outcomes.items()))
                )
        alone, beside = list(results.values())
        ratio = beside["p99_ms"] / alone["p99_ms"]
        report["good_p99_ratio"] = round(ratio, 2)
        print(
            f"\ngood sessions' p99: {alone['p99_ms']:.0f} ms alone, {beside['p99_ms']:.0f} ms beside {args.bad} "
            f"bad ones (max {beside['max_ms']:.0f} ms): ratio {ratio:.2f} (target <= 2)"
        )
    return errors


async def soak(server, sampler, args, report):
    """Sessions that come and go: each opens, makes a sandbox, makes
    `calls` calls paced to the rate, and closes; `sessions` at a time."""
    stats, sandboxes = Stats(), []
    report["sandboxes"] = sandboxes
    end = time.monotonic() + args.minutes * 60
    pause = args.sessions / args.rate  # seconds between one session's calls

    async def worker():
        payload = "x" * FILE_BYTES
        while time.monotonic() < end:
            try:
                async with session_for(server.url) as session:
                    box = await timed(stats, "create_sandbox", session, "create_sandbox", {})
                    if box is None:
                        await asyncio.sleep(pause)
                        continue
                    sandboxes.append(box["sandbox_id"])
                    await timed(stats, "python start", session, "run_code", {"code": "1", "sandbox_id": box["sandbox_id"]})
                    for i in range(args.calls):
                        if time.monotonic() >= end:
                            break
                        await good_call(stats, session, box["sandbox_id"], i, payload)
                        await asyncio.sleep(pause * random.uniform(0.5, 1.5))
            except Exception as e:  # noqa: BLE001
                stats.errors.append(("session", f"{type(e).__name__}: {e}"))

    stats.start = time.monotonic()
    workers = [asyncio.create_task(worker()) for _ in range(args.sessions)]
    minutes = []
    print(f"soak: {args.sessions} sessions at a time, about {args.rate} calls/s, {args.minutes} min")
    print(f"  {'min':>3} {'calls':>6} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'RSS MiB':>8} {'fds':>5} {'threads':>7}")
    for minute in range(1, math.ceil(args.minutes) + 1):
        await asyncio.sleep(max(0, stats.start + minute * 60 - time.monotonic()))
        since = stats.start + (minute - 1) * 60
        recent = [seconds for done, seconds in stats.timeline if done >= since]
        sample = process_sample(server.pid) or (0, 0, 0)
        minutes.append(
            {
                "minute": minute,
                "calls": len(recent),
                "errors": len(stats.errors),
                "rss_mib": round(sample[0] / 1024, 1),
                "fds": sample[1],
                "threads": sample[2],
            }
        )
        print(
            f"  {minute:>3} {len(recent):>6} {len(stats.errors):>6} {ms(pct(recent, 0.5))} {ms(pct(recent, 0.99))} "
            f"{sample[0] / 1024:>8.1f} {sample[1]:>5} {sample[2]:>7}"
        )
    await asyncio.gather(*workers)
    stats.end = time.monotonic()
    latency_table("soak", stats, ["create_sandbox", "python start"] + KINDS)
    # The server keeps every response event for 10 minutes (up to 64 MiB,
    # for clients that reconnect: moat_mcp::event_log), so its RSS rises
    # for the first ten minutes by design. The verdict compares the ten
    # minutes after those with the last ten (a 30-minute soak), or, in a
    # shorter one, the halves after its first third.
    warmup = 10 if len(minutes) >= 20 else len(minutes) // 3
    steady = minutes[warmup:]
    window = max(1, min(10, len(steady) // 2))
    first, last = steady[:window], steady[-window:]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    rss_first, rss_last = mean(first, "rss_mib"), mean(last, "rss_mib")
    fds_first, fds_last = mean(first, "fds"), mean(last, "fds")
    flat = rss_last <= rss_first * 1.10 + 2 and fds_last <= fds_first * 1.10 + 4
    print(
        f"\nsoak verdict: RSS {rss_first:.1f} MiB (minutes {first[0]['minute']}-{first[-1]['minute']}) -> "
        f"{rss_last:.1f} MiB (minutes {last[0]['minute']}-{last[-1]['minute']}), descriptors {fds_first:.0f} -> "
        f"{fds_last:.0f}: {'flat' if flat else 'GROWING'}"
    )
    report["soak"] = {"minutes": minutes, "window": window, "flat": flat}
    report["phases"] = {"soak": {"calls": len(stats.all()), "errors": len(stats.errors)}}
    return len(stats.errors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("out_dir")
    parser.add_argument("--images", required=True, help="the images directory of moat's data directory")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--bad", type=int, default=0)
    parser.add_argument("--bad-lead", type=float, default=5.0, help="seconds the bad sessions run before phase 2")
    parser.add_argument(
        "--bad-kinds",
        type=lambda v: v.split(","),
        default=BAD_KINDS,
        help="comma-separated: which misdeeds the bad sessions take in turn (" + ", ".join(BAD_KINDS) + ")",
    )
    parser.add_argument("--soak", action="store_true")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=5.0, help="calls per second in a soak, all sessions together")
    args = parser.parse_args()
    unknown = [k for k in args.bad_kinds if k not in BAD_KINDS]
    if unknown:
        parser.error(f"--bad-kinds: unknown {', '.join(unknown)}; known: {', '.join(BAD_KINDS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    # Each session holds a few connections; the server gets the same limit.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = Server(args.binary, args.out_dir, args.images)
    print(f"moat-mcp {server.url} (pid {server.pid}), data directory {server.data_dir}")
    sampler = Sampler(server.pid)
    report = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M")}
    started = time.monotonic()
    try:
        run = soak if args.soak else load
        errors = asyncio.run(run(server, sampler, args, report))
    finally:
        whole = resources("the whole run", sampler, started, time.monotonic())
        sampler.stop()
        code, seconds = server.stop()
    report["server"] = whole
    print(f"  server stopped (SIGTERM): exit {code} in {seconds:.1f} s")
    client = resource.getrusage(resource.RUSAGE_SELF)
    print(f"  this client's own CPU: {client.ru_utime:.1f} s user, {client.ru_stime:.1f} s system")
    # The kernel may take a moment to end the sandboxes' last processes.
    time.sleep(1)
    left = leftovers(server, report["sandboxes"])
    print(f"leftovers after the server stopped: {len(left)}")
    for item in left[:20]:
        print(f"  {item}")
    report.update(leftovers=left, errors=errors, sandboxes=len(report["sandboxes"]))
    with open(os.path.join(args.out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {os.path.join(args.out_dir, 'report.json')}")
    sys.exit(1 if errors or left or code != 0 else 0)


if __name__ == "__main__":
    main()

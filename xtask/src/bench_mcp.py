"""`run_command` of `true` through moat-mcp over stdio, with the official
Python SDK, beside an MCP `ping` round trip (the transport and SDK alone)
and a local spawn of `true` from this process (what a command costs with no
sandbox), measured in the same run. Prints p50/p90 of each and the ratios.

Usage: python bench_mcp.py MOAT_MCP [RUNS]
"""

import asyncio
import os
import subprocess
import sys
import time

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1000


async def main(binary, runs):
    # The sandbox is never suspended between runs: the operator lets it be.
    env = dict(os.environ, MOAT_MAX_IDLE_SECONDS="0")
    async with stdio_client(StdioServerParameters(command=binary, args=[], env=env)) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            await session.call_tool("create_sandbox", {"idle_seconds": 0})
            for _ in range(20):
                await session.call_tool("run_command", {"cmd": "true"})
                await session.send_ping()
            tool, ping, spawn = [], [], []
            for _ in range(runs):
                t = time.perf_counter()
                await session.send_ping()
                ping.append(time.perf_counter() - t)
                t = time.perf_counter()
                subprocess.run(["true"], check=True)
                spawn.append(time.perf_counter() - t)
                t = time.perf_counter()
                await session.call_tool("run_command", {"cmd": "true"})
                tool.append(time.perf_counter() - t)
    print("moat-mcp benchmarks (baseline measured in this run)")
    print(f"  run_command `true` over stdio   p50 {pct(tool, .5):.2f} ms  p90 {pct(tool, .9):.2f} ms   (target p50 <= 2 ms)")
    print(f"    baseline: MCP ping round trip  p50 {pct(ping, .5):.2f} ms  -> run_command adds {pct(tool, .5) - pct(ping, .5):.2f} ms")
    print(f"    baseline: local spawn of true  p50 {pct(spawn, .5):.2f} ms  -> ratio {pct(tool, .5) / pct(spawn, .5):.2f}x (target <= 2x)")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300))

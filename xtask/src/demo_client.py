"""The scripted session of `cargo xtask demo`: a real MCP client (the
official Python SDK) driving moat-mcp over stdio.

Usage: python demo_client.py MOAT_MCP OUT_DIR
"""

import asyncio
import base64
import json
import os
import sys
import time

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

BOLD, RESET = "\033[1m", "\033[0m"


def step(title):
    print(f"\n{BOLD}▸ {title}{RESET}", flush=True)


def payload(result):
    value = getattr(result, "structuredContent", None) or getattr(result, "structured_content", None)
    is_error = getattr(result, "isError", None) or getattr(result, "is_error", None)
    if is_error:
        raise SystemExit("tool error: " + "".join(getattr(b, "text", "") for b in result.content))
    return value


async def main(binary, out_dir):
    project = os.path.join(out_dir, "project")
    os.makedirs(project, exist_ok=True)
    with open(os.path.join(project, "greet.py"), "w") as f:
        f.write('def greet(name):\n    return "Hello, " + name\n\nprint(greet("world"))\n')
    env = dict(os.environ, MOAT_ROOTS=out_dir)
    async with stdio_client(StdioServerParameters(command=binary, args=[], env=env)) as (read, write):
        async with ClientSession(read, write) as session:
            info = await session.initialize()
            tools = (await session.list_tools()).tools
            step(f"connected to {info.serverInfo.name if hasattr(info, 'serverInfo') else 'moat'} over stdio: {len(tools)} tools")
            print("  " + ", ".join(t.name for t in tools))

            step("create a sandbox")
            t = time.monotonic()
            box = payload(await session.call_tool("create_sandbox", {"name": "demo"}))
            print(f"  {box['sandbox_id']} ({box['backend']}, image {box['image']}) in {(time.monotonic() - t) * 1000:.0f} ms")

            step("run a command")
            out = payload(await session.call_tool("run_command", {"cmd": "uname -sr; . /etc/os-release; echo $PRETTY_NAME; id"}))
            print("  " + out["stdout"].strip().replace("\n", "\n  "))

            step("run Python that draws a plot (run_code: a notebook-like session)")
            payload(await session.call_tool("run_code", {"code": "import numpy as np\nx = np.linspace(0, 4 * np.pi, 400)"}))
            code = (
                "import matplotlib.pyplot as plt\n"
                "plt.figure(figsize=(6, 3)); plt.plot(x, np.sin(x), label='sin'); plt.plot(x, np.cos(x), label='cos')\n"
                "plt.legend(); plt.title('drawn inside a moat sandbox'); plt.tight_layout(); plt.show()\n"
                "print(f'{len(x)} points, reused from the previous call')\n"
            )
            result = await session.call_tool("run_code", {"code": code, "timeout": 120})
            out = payload(result)
            if out["error"]:
                raise SystemExit("plotting failed: " + out["error"]["traceback"])
            images = [b for b in result.content if getattr(b, "type", "") == "image"]
            if len(images) != 1:
                raise SystemExit(f"expected one image from run_code, got {len(images)}")
            png = base64.b64decode(images[0].data)
            target = os.path.join(out_dir, "plot.png")
            with open(target, "wb") as f:
                f.write(png)
            print(f"  {out['stdout'].strip()}; the figure came back as a PNG image: {target} ({len(png)} bytes)")

            step("import a project as a task, change it, see the diff")
            task = payload(await session.call_tool("task_start", {"source": project}))
            print(f"  task {task['task_id']}: {task['files']} file(s), runtime {task['runtime']}")
            payload(await session.call_tool("run_command", {"cmd": "cd /workspace && sed -i 's/Hello, /Hello there, /' greet.py && python3 greet.py"}))
            diff = payload(await session.call_tool("task_diff", {"task_id": task["task_id"]}))
            print("  " + diff["diff"].strip().replace("\n", "\n  "))
            done = payload(await session.call_tool("task_finish", {"task_id": task["task_id"]}))
            print(f"  patch saved to {done['patch_path']}")

            payload(await session.call_tool("destroy_sandbox", {"sandbox_id": box["sandbox_id"]}))
    print(f"\n{BOLD}done{RESET}: moat works end to end through a real MCP client.")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

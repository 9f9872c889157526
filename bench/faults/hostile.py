"""Pieces of hostile replicas and a process's CPU time, shared by ``make chaos`` and the tests."""

from __future__ import annotations

import os

# How each hostile replica below serves its /metrics (its handler is ``metrics``): on a port the OS picks, printing
# {"port": N, **INFO} once it listens
_SERVE = r'''
async def main():
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(json.dumps({"port": runner.addresses[0][1], **INFO}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''

# A replica whose /metrics never ends: run with ``python -c``.
ENDLESS_METRICS = r'''
import asyncio, json
from aiohttp import web

INFO = {}

async def metrics(request):
    resp = web.StreamResponse()
    await resp.prepare(request)
    line = b'vllm:num_requests_running{model_name="m"} 1\n' * 2000
    try:
        while True:
            await resp.write(line)
    except Exception:
        pass
    return resp
''' + _SERVE

# A replica whose /metrics names argv[1] data-parallel engines (90,000: ~3.9 MB, under the byte cap).
MANY_ENGINES_METRICS = r'''
import asyncio, json, sys
from aiohttp import web

n = int(sys.argv[1])
page = "".join(f'vllm:num_requests_running{{engine="{i}"}} 0\n' for i in range(n)).encode()
INFO = {"bytes": len(page)}

async def metrics(request):
    return web.Response(body=page, content_type="text/plain")
''' + _SERVE


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), its main thread's view of the whole process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connect_as(path: str, user: str = "nobody", group: str = "nogroup") -> str:
    """Try to connect to a Unix socket as another local user (needs root): "connected", or the error's kind."""
    import subprocess

    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1]); "
            "print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)")
    return subprocess.run(["/usr/bin/python3", "-c", code, path], user=user, group=group, extra_groups=[],
                          capture_output=True, text=True, timeout=30).stdout.strip()

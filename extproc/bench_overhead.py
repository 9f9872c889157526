"""``make bench-overhead``: what the brain adds to Envoy, measured against Envoy direct in the same run.

Both fronts proxy to the same four "replicas": a second Envoy answering
with ``direct_response`` after buffering the body (a static vLLM
``/metrics`` and a small completion), so the numbers are the proxy path's
and not a Python mock's. "Direct" is Envoy with a least-request route and
the same listener limits; "warmroute" is the rendered bootstrap with the
brain (ext_proc + access log). Printed: added latency p50/p99 at a fixed
100 req/s with 2 KB bodies, maximum req/s (wrk), and added latency with
1 KB, 1 MB and 16 MB bodies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from .config import load_config
from .envoy_config import bootstrap
from .stack import EnvoyProc as Envoy
from .stack import Proc, _cli, http_get, wait_for

METRICS = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\",engine=\"0\"} 0\n" \
          "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 0\n"
COMPLETION = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
BIG = 64 * 1024 * 1024


def _listener(name: str, routes: list, filters: list, port: int = 0) -> dict:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "per_connection_buffer_limit_bytes": BIG,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": HCM, "stat_prefix": name, "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": [*filters, ROUTER]}}]}],
    }


def fake_fleet(n: int) -> dict:
    buffer = {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": BIG}}
    routes = [
        {"match": {"path": "/metrics"}, "direct_response": {"status": 200, "body": {"inline_string": METRICS}}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
         "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}]},
    ]
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [_listener(f"fake{i}", routes, [buffer]) for i in range(n)]}}


def direct_front(ports: list[int]) -> dict:
    cluster = {"name": "fleet", "type": "STATIC", "connect_timeout": "1s", "lb_policy": "LEAST_REQUEST",
               "per_connection_buffer_limit_bytes": BIG,
               "load_assignment": {"cluster_name": "fleet", "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports]}]}}
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "fleet", "timeout": "0s"}}]
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [_listener("direct", routes, [])], "clusters": [cluster]}}


def body_of(size: int, i: int) -> bytes:
    head = {"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "You are a coding agent. " * 4},
                                                         {"role": "user", "content": ""}]}
    base = len(json.dumps(head))
    head["messages"][1]["content"] = f"{i} " + "x" * max(0, size - base - 8)
    return json.dumps(head).encode()


async def fixed_rate(url: str, rate: float, count: int, size: int) -> list[float]:
    """Open loop: request i starts at i/rate whatever happened before; returns latencies in seconds."""
    lat: list[float] = []
    bodies = [body_of(size, i) for i in range(50)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
        start = time.monotonic()

        async def one(i: int):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            t0 = time.monotonic()
            async with http.post(url, data=bodies[i % 50], headers={"content-type": "application/json", "x-session-id": f"s{i % 100}"}) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.monotonic() - t0)

        await asyncio.gather(*(one(i) for i in range(count)))
    return lat


async def sequential(url: str, count: int, size: int) -> list[float]:
    lat = []
    body = body_of(size, 0)
    async with aiohttp.ClientSession() as http:
        for i in range(count + 2):
            t0 = time.monotonic()
            async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 2:  # the first two warm connections up
                lat.append(time.monotonic() - t0)
    return lat


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def wrk_rps(url: str, seconds: int, connections: int, workdir: Path) -> float | None:
    if not shutil.which("wrk"):
        return None
    lua = workdir / "post.lua"
    body = body_of(2048, 0).decode()
    lua.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [[{body}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        "local n = 0\n"
        'request = function() n = n + 1; wrk.headers["x-session-id"] = "s" .. (n % 100); return wrk.format() end\n'
    )
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(lua), url],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        print(f"  warning: wrk saw {non2xx.group(1)} non-2xx responses at {url}")
    return float(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Envoy direct vs Envoy + warmroute brain")
    ap.add_argument("--rate-requests", type=int, default=1500, help="requests at the fixed 100 req/s")
    ap.add_argument("--wrk-seconds", type=int, default=8)
    ap.add_argument("--wrk-connections", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rate_requests, args.wrk_seconds = 400, 4

    work = Path(tempfile.mkdtemp(prefix="warmroute-bench-"))
    procs = []
    try:
        fleet = Envoy("fleet", fake_fleet(4), work)
        procs.append(fleet)
        cfg_doc = {"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(fleet.ports)],
                   "brain": {"host": "127.0.0.1", "grpc_port": 0, "admin_port": 0},
                   "envoy": {"listen_host": "127.0.0.1", "listen_port": 0, "admin_port": 0}}
        (work / "warmroute.yaml").write_text(yaml.safe_dump(cfg_doc))
        ready = work / "brain.ready.json"
        brain = Proc("brain", _cli("brain", "--config", str(work / "warmroute.yaml"), "--ready-file", str(ready)), work)
        procs.append(brain)
        info = wait_for(lambda: ready.exists() and json.loads(ready.read_text()), 30, "brain", brain)
        cfg = load_config(work / "warmroute.yaml")
        import dataclasses

        cfg = dataclasses.replace(cfg, brain=dataclasses.replace(cfg.brain, grpc_port=info["grpc_port"]))
        front = Envoy("warmroute", bootstrap(cfg), work)
        direct = Envoy("direct", direct_front(fleet.ports), work)
        procs += [front, direct]
        state_url = f"http://127.0.0.1:{info['admin_port']}/state"
        wait_for(lambda: all(r["state"] == "LIVE" for r in json.loads(http_get(state_url))["replicas"]), 60, "replicas LIVE")
        urls = {"direct": f"http://127.0.0.1:{direct.ports[0]}/v1/chat/completions",
                "warmroute": f"http://127.0.0.1:{front.ports[0]}/v1/chat/completions"}

        print(f"machine: {os.cpu_count()} cores; Envoy --concurrency 1 for both fronts; brain: 1 Python process")
        print(f"\nfixed 100 req/s, 2 KB bodies, {args.rate_requests} requests each (open loop)")
        res = {}
        for name in ("direct", "warmroute", "direct", "warmroute"):  # interleaved: drift hits both
            lat = asyncio.run(fixed_rate(urls[name], 100.0, args.rate_requests // 2, 2048))
            res.setdefault(name, []).extend(lat)
        d50, d99 = pct(res["direct"], 0.5), pct(res["direct"], 0.99)
        w50, w99 = pct(res["warmroute"], 0.5), pct(res["warmroute"], 0.99)
        print(f"{'':<12}{'p50 ms':>10}{'p99 ms':>10}")
        print(f"{'direct':<12}{d50 * 1e3:>10.2f}{d99 * 1e3:>10.2f}")
        print(f"{'warmroute':<12}{w50 * 1e3:>10.2f}{w99 * 1e3:>10.2f}")
        print(f"{'added':<12}{(w50 - d50) * 1e3:>10.2f}{(w99 - d99) * 1e3:>10.2f}   (targets: p50 <= 0.6, p99 <= 2.0)")

        print(f"\nmaximum req/s (wrk, 1 thread, {args.wrk_connections} connections, {args.wrk_seconds} s, 2 KB bodies)")
        rd = wrk_rps(urls["direct"], args.wrk_seconds, args.wrk_connections, work)
        rw = wrk_rps(urls["warmroute"], args.wrk_seconds, args.wrk_connections, work)
        if rd is None or rw is None:
            print("  wrk not found: apt-get install wrk")
        else:
            print(f"direct {rd:,.0f}   warmroute {rw:,.0f}   ratio {rw / rd:.2f}   (target: warmroute >= 2,000)")

        print("\nadded latency by body size (sequential, median of n)")
        print(f"{'body':<8}{'n':>5}{'direct ms':>12}{'warmroute ms':>14}{'added ms':>10}")
        for label, size, n in (("1 KB", 1024, 200), ("1 MB", 2**20, 30), ("16 MB", 16 * 2**20, 6)):
            if args.quick:
                n = max(3, n // 4)
            dl = asyncio.run(sequential(urls["direct"], n, size))
            wl = asyncio.run(sequential(urls["warmroute"], n, size))
            dm, wm = statistics.median(dl), statistics.median(wl)
            print(f"{label:<8}{n:>5}{dm * 1e3:>12.2f}{wm * 1e3:>14.2f}{(wm - dm) * 1e3:>10.2f}")
        st = json.loads(http_get(state_url))
        wait_for(lambda: json.loads(http_get(state_url))["open_reservations"] == 0, 10, "releases")
        print(f"\nbrain: {sum(r['decisions'] for r in st['replicas'])} decisions, open reservations drained to 0")
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``make bench-flood``: a flood of new sessions beside sessions under way (issue 43, finding 5).

Four sessions are under way (a turn, a short think, the next turn of the same growing conversation); the run
measures their time to first token alone, then again while N new sessions of 25K tokens arrive at once. Before
flow control protected them, 73 of 2,000 new sessions were admitted into the engines' queues and the sessions
under way went from a TTFT p50 of 0.08 s to 20.6 s behind their prefills. Printed: each phase's p50 / p99, the
ratio flood / alone, and what the flood's requests got (200, 429 with Retry-After, other). The ratio is the
measurement: absolute times move with the machine. The flood comes from a process of its own (other clients): sent
from the measured sessions' own event loop it slowed their client and itself, and arrived more gently than 2,000
clients do (issue 59: in its own process, 2,000 short new sessions failed 700-1,000 open past the brain).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import aiohttp

from extproc.tools.workload.generate import MOCK_MODEL
from extproc.tools.stack.local import Stack
from extproc.tools.stack.procs import rss_mib, wait_for

MODEL = MOCK_MODEL
SYSTEM = "You are a coding agent working in a large monorepo; follow the style guide and run the tests. " * 180


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _turn(http: aiohttp.ClientSession, url: str, sid: str, history: list[dict]) -> float | None:
    """One streamed turn; seconds to its first token (None: it failed)."""
    body = {"model": MODEL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, *history]}
    t0 = time.monotonic()
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}) as r:
            if r.status != 200:
                await r.read()
                return None
            async for _ in r.content.iter_any():
                ttft = time.monotonic() - t0
                async for _ in r.content.iter_any():
                    pass
                return ttft
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return None


async def _under_way(url: str, sid: str, until: float, think_s: float, out: list[float], failed: list[int],
                     history: list[dict]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        while time.monotonic() < until:
            history.append({"role": "user", "content": f"{sid}: next step, fix test {len(history)} " * 40})
            ttft = await _turn(http, url, sid, history)
            if ttft is None:
                failed[0] += 1
            else:
                out.append(ttft)
            history.append({"role": "assistant", "content": "done " * 20})
            await asyncio.sleep(think_s)


async def _flood(url: str, n: int, tokens: int) -> dict[str, int]:
    got: dict[str, int] = {}
    conn = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(i: int) -> None:
            body = {"model": MODEL, "max_tokens": 8, "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user",
                 "content": f"new session {i}: " + "def handler(event):\n    return event\n" * (tokens // 9)}]}
            try:
                async with http.post(url + "/v1/chat/completions", json=body,
                                     headers={"x-session-id": f"flood-{i}"}) as r:
                    await r.read()
                    key = str(r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                key = type(e).__name__
            got[key] = got.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return got


def _flood_process(url: str, n: int, tokens: int, out) -> None:
    out.put(asyncio.run(_flood(url, n, tokens)))


async def _phase(url: str, seconds: float, think_s: float, flood: int, tokens: int,
                 histories: list[list[dict]]) -> tuple[list[float], int, dict[str, int]]:
    ttfts: list[float] = []
    failed = [0]
    until = time.monotonic() + seconds
    tasks = [_under_way(url, f"under-way-{k}", until, think_s, ttfts, failed,
                        histories[k]) for k in range(len(histories))]
    # the flood comes from other clients: its own process, so that building and sending 2,000 uploads does not delay
    # the measured sessions' own client (in one event loop it did, whatever the router did)
    ctx = multiprocessing.get_context("spawn")
    box = ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(url, flood, tokens, box), daemon=True) if flood else None
    if proc is not None:
        proc.start()
    await asyncio.gather(*tasks)
    outcome = await asyncio.to_thread(box.get, True, 600) if proc is not None else {}
    if proc is not None:
        proc.join(10)
    return ttfts, failed[0], outcome


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood", type=int, default=2000, help="new sessions arriving at once")
    ap.add_argument("--tokens", type=int, default=25_000, help="each new session's first prompt, in tokens")
    ap.add_argument("--sessions", type=int, default=4, help="sessions under way")
    ap.add_argument("--seconds", type=float, default=40.0, help="each phase's length, wall seconds")
    ap.add_argument("--speedup", type=float, default=10.0, help="the mock replicas' time compression")
    ap.add_argument("--think", type=float, default=0.5, help="wall seconds between a session's turns")
    ap.add_argument("--ext-proc-timeout", type=float, default=None,
                    help="envoy.ext_proc_timeout_s (default: the config's)")
    args = ap.parse_args(argv)
    rows = []
    config = {"envoy": {"ext_proc_timeout_s": args.ext_proc_timeout}} if args.ext_proc_timeout else None
    with Stack(4, config=config, mock_args=["--speedup", str(args.speedup)]) as s:
        s.wait_all_live(60)
        histories: list[list[dict]] = [[] for _ in range(args.sessions)]
        asyncio.run(_phase(s.url, 5.0, args.think, 0, args.tokens, histories))  # the sessions get under way
        rss_start = rss_mib(s.brain.popen.pid)
        for label, flood in (("alone", 0), (f"{args.flood} new sessions", args.flood)):
            before = s.envoy_stats()
            ttfts, failed, outcome = asyncio.run(_phase(s.url, args.seconds, args.think, flood, args.tokens, histories))
            after = s.envoy_stats()
            opened = {k.rsplit(".", 2)[-2]: after[k] - before.get(k, 0) for k in after
                      if k.endswith(".failure_mode_allowed") and (".ext_proc." in k or ".ext_authz." in k)}
            rows.append((label, ttfts, failed, outcome))
            print(f"{label:>24}: {len(ttfts)} turns, TTFT p50 {_pct(ttfts, 0.5):.3f} s p99 {_pct(ttfts, 0.99):.3f} s, "
                  f"{failed} failed; the flood got {dict(sorted(outcome.items())) or '-'}; failed open past the brain "
                  f"(by filter): {opened or 0}", flush=True)
        print(f"the brain's refusals by why: {s.state()['flow_control']['refused']}; at their header call: "
              f"{s.envoy_stats().get('http.ingress.ext_authz.warmroute_headers.denied', 0)}",
              flush=True)
        # the brain's memory once the flood is over: every held request answered and every reservation released
        wait_for(lambda: s.state()["open_reservations"] == 0 and not s.state()["flow_control"]["held"], 120,
                 "the flood's requests all ended")
        ended = rss_mib(s.brain.popen.pid)
        time.sleep(12)  # the brain gives the C heap's free pages back every ~10 s
        print(f"brain memory: {rss_start:.0f} MiB with the sessions under way, {ended:.0f} MiB once the flood's "
              f"requests ended, {rss_mib(s.brain.popen.pid):.0f} MiB 12 s later", flush=True)
    (_, a, _, _), (_, b, _, _) = rows
    slow = sorted(t for t in b if t > 2 * _pct(a, 0.99))
    print(f"turns under way slower than twice the alone phase's p99: {len(slow)} of {len(b)}"
          + (f" ({', '.join(f'{t:.2f}' for t in slow[-8:])} s)" if slow else ""))
    print(f"sessions under way with the flood / alone: p50 {_pct(b, 0.5) / _pct(a, 0.5):.2f}x, "
          f"p99 {_pct(b, 0.99) / _pct(a, 0.99):.2f}x (mocks at {args.speedup:g}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

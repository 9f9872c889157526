"""The same engine, twice: one fixed trace through the simulator's engine and through a mock replica over HTTP.

A trace is a list of requests with their arrival times in workload seconds
and real prompt text (sessions that extend a shared system prompt, and
long one-offs that queue the rest). The simulator runs it on one replica
in virtual time; ``replay_trace`` sends it open-loop to a live
``mock-vllm --speedup S`` and measures each time to first token at the
client. The difference per request is the mock's own cost (HTTP, asyncio,
a busy machine), which the mock reports separately as its first-token lag.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from extproc.tools.workload.generate import MOCK_MODEL
from extproc.tools.engine.model import EngineConfig
from extproc.tools.mock.responses import CHARS_PER_TOKEN, text_blocks
from extproc.tools.sim.simulator import Simulation
from extproc.tools.workload.generate import Request, WorkloadConfig


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # workload seconds from the start
    text: str
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return max(1, len(self.text) // CHARS_PER_TOKEN)


def engine_trace(seed: int = 1, span_s: float = 40.0, rate_per_s: float = 1.0) -> list[TraceRequest]:
    """Poisson arrivals over ``span_s``: turns of 6 sessions over 2 system prompts (each turn extends its session's
    text, so the prefix cache hits), and one in five a long one-off (8-16K tokens) that queues whoever comes next."""
    rng = random.Random(seed)
    words = lambda k: "".join(f"w{rng.randrange(10**6):06d} " for _ in range(k))  # noqa: E731  8 chars a word
    systems = [words(rng.randint(250, 1000)) for _ in range(2)]  # 500-2000 tokens
    sessions = [systems[i % 2] + f"session {i}: " for i in range(6)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= span_s:
            return out
        if rng.random() < 0.2:
            text = f"one-off {len(out)}: " + words(rng.randint(4000, 8000))
        else:
            k = rng.randrange(len(sessions))
            sessions[k] += words(rng.randint(50, 800))
            text = sessions[k]
        text = text[: len(text) // CHARS_PER_TOKEN * CHARS_PER_TOKEN]
        out.append(TraceRequest(t, text, rng.randint(16, 300)))


def simulate_trace(trace: list[TraceRequest], engine: EngineConfig | None = None) -> list[float | None]:
    """Each request's TTFT in workload seconds on one simulated replica (None: not answered)."""
    reqs = []
    for i, tr in enumerate(trace):
        r = Request(i + 1, i + 1, 0, tr.prompt_tokens, 0, tr.max_tokens, tr.arrival, oneshot=True)
        r._blocks = text_blocks(tr.text)  # the mock's blocks of the same text: one cache, two clocks
        reqs.append(r)
    minutes = (max((r.arrival for r in trace), default=0.0) + 600.0) / 60
    wl = WorkloadConfig(minutes=minutes, sessions_per_min=0.0, oneshots_per_min=0.0)
    Simulation("envoy_round_robin", replicas=1, workload=wl, engine=engine, trace=tuple(reqs)).run()
    return [r.ttft for r in reqs]


async def replay_trace(url: str, trace: list[TraceRequest], speedup: float,
                       timeout: float = 120.0) -> list[float | None]:
    """Each request's TTFT in workload seconds (wall x ``speedup``), sent open-loop at its arrival over HTTP."""
    out: list[float | None] = [None] * len(trace)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one(i: int, tr: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, t0 + tr.arrival / speedup - time.monotonic()))
            body = {"model": MOCK_MODEL, "prompt": tr.text, "max_tokens": tr.max_tokens, "stream": True}
            start = time.monotonic()
            async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                r.raise_for_status()
                async for line in r.content:
                    if out[i] is None and line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"]
                        if choice and choice[0].get("text"):
                            out[i] = (time.monotonic() - start) * speedup

        await asyncio.gather(*(one(i, tr) for i, tr in enumerate(trace)))
    return out


@dataclass
class Agreement:
    n: int
    sim_p50: float
    live_p50: float
    diff_p50: float  # live - simulated, workload seconds, median over requests
    absdiff_p90: float
    worst_rel: float  # the largest |live - sim| / sim

    def line(self) -> str:
        return (f"{self.n} requests: simulated TTFT p50 {self.sim_p50:.3f} s, live {self.live_p50:.3f} s; live - "
                f"simulated "
                f"median {self.diff_p50 * 1000:+.0f} ms, |diff| p90 {self.absdiff_p90 * 1000:.0f} ms (workload time), "
                f"largest relative {self.worst_rel:.0%}")


def agreement(sim: list[float | None], live: list[float | None]) -> Agreement:
    pairs = [(s, v) for s, v in zip(sim, live) if s is not None and v is not None]
    diffs = sorted(v - s for s, v in pairs)
    absd = sorted(abs(d) for d in diffs)
    return Agreement(len(pairs), statistics.median(s for s, _ in pairs), statistics.median(v for _, v in pairs),
                     statistics.median(diffs), absd[int(0.9 * (len(absd) - 1))],
                     max(abs(v - s) / s for s, v in pairs))

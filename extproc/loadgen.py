"""A short coding-agent load over HTTP: sessions with a shared per-project system prompt and growing context.

Each session is closed-loop: its next turn starts after the previous
response plus a think time. Used by ``warmroute up``; the simulator issue
grows it into the full workload generator.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp

PROJECTS = {
    "billing": "You are a coding agent working on the billing service, a Go monorepo. Follow the style guide. " * 40,
    "search": "You are a coding agent working on the search indexer, a Rust workspace. Keep changes minimal. " * 40,
    "mobile": "You are a coding agent working on the mobile app, a Kotlin project. Write tests first. " * 40,
}


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)


async def _session(http: aiohttp.ClientSession, url: str, sid: str, project: str, turns: int, think_s: float,
                   rng: random.Random, res: LoadResult, stream: bool) -> None:
    history: list[dict] = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"turn {turn}: please change function f{rng.randrange(1000)} " + "x" * rng.randrange(200, 1500)})
        body = {
            "model": "mock-coder-30b",
            "messages": [{"role": "system", "content": PROJECTS[project]}, *history],
            "max_tokens": rng.randrange(16, 64),
            "stream": stream,
        }
        t0 = time.monotonic()
        res.sent += 1
        try:
            async with http.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}) as r:
                await r.read()
                if r.status == 200:
                    res.ok += 1
                    res.latencies.append(time.monotonic() - t0)
                else:
                    res.errors[str(r.status)] = res.errors.get(str(r.status), 0) + 1
        except aiohttp.ClientError as e:
            res.errors[type(e).__name__] = res.errors.get(type(e).__name__, 0) + 1
        history.append({"role": "assistant", "content": "done " * 20})
        await asyncio.sleep(rng.uniform(0.5, 1.5) * think_s)


async def agent_load(url: str, sessions: int = 12, turns: int = 6, think_s: float = 0.3, seed: int = 1, stream: bool = True) -> LoadResult:
    rng = random.Random(seed)
    res = LoadResult()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        jobs = []
        for i in range(sessions):
            project = list(PROJECTS)[i % len(PROJECTS)]
            jobs.append(_session(http, url, f"agent-{seed}-{i}", project, turns, think_s, random.Random(rng.random()), res, stream))
            await asyncio.sleep(rng.uniform(0.0, 0.1))
        await asyncio.gather(*jobs)
    return res

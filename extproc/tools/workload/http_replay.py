"""Drive the simulator's workload over HTTP: the same request stream against a live endpoint.

Each session is closed-loop, as in the simulator: its next turn starts
after the previous answer plus the think time (divided by ``speedup``).
Prompts are rendered as real text with ``generate.text_for``, so a prefix
cache in the replicas sees what the engine model sees. Every request is
streamed so TTFT is measured at the first content chunk.

A request "lost" is one that was sent and never answered (connection
dropped, timeout); an error is an answer with a status other than 200.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from extproc.tools.workload.generate import MOCK_MODEL, Request, Workload, WorkloadConfig, text_for

REPLICA_HEADER = "x-mock-replica"  # the mock's name on its answers (not vLLM's; for benchmarks)


@dataclass
class ReplayResult:
    requests: list[Request] = field(default_factory=list)
    sent: int = 0
    answered: int = 0
    lost: int = 0
    refused: int = 0  # 429s with Retry-After, each sent again (replay's retry_429)
    errors: dict[str, int] = field(default_factory=dict)
    served_by: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, replica)
    # the client's own event-loop lag, wall seconds: how late a 10 ms timer fired, p99 over the run. A client that
    # lags sends late and reads first tokens late: what it measures is then its own scheduling
    client_lag_p99: float = 0.0


def system_texts(n_projects: int, tokens: list[int], seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for p in range(n_projects):
        words = " ".join(f"rule{rng.randrange(10_000)}" for _ in range(64))
        text = f"You are a coding agent for project {p}. Follow these rules: {words}. "
        out.append((text * (tokens[p] * 4 // len(text) + 1))[: tokens[p] * 4])
    return out


APIS = ("chat", "messages", "responses")


def _request(api: str, model: str, req: Request, system: str, user: str) -> tuple[str, dict]:
    """The path and body of one turn in ``api``'s shape (the same conversation text in each)."""
    if api == "messages":  # Anthropic Messages
        return "/v1/messages", {"model": model, "max_tokens": req.max_tokens, "stream": True, "system": system,
                                "messages": [{"role": "user", "content": user}]}
    if api == "responses":  # OpenAI Responses, stateless: the conversation sent whole, as chat sends it
        return "/v1/responses", {"model": model, "max_output_tokens": req.max_tokens, "stream": True,
                                 "instructions": system, "input": user, "store": False}
    return "/v1/chat/completions", {"model": model, "stream": True, "max_tokens": req.max_tokens,
                                    "stream_options": {"include_usage": True},
                                    "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": user}]}


def _read_event(chunk: dict) -> tuple[bool, int | None]:
    """(the event carries generated text, the cached prompt tokens it reports or None) for any of the APIs."""
    kind = chunk.get("type")
    if kind == "content_block_delta":
        return bool((chunk.get("delta") or {}).get("text")), None
    if kind == "message_delta":
        return False, (chunk.get("usage") or {}).get("cache_read_input_tokens") or 0
    if kind == "response.output_text.delta":
        return bool(chunk.get("delta")), None
    if kind == "response.completed":
        usage = (chunk.get("response") or {}).get("usage") or {}
        return False, (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    usage = chunk.get("usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 if usage else None
    return bool(chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content")), cached


async def _one(http: aiohttp.ClientSession, url: str, req: Request, texts: list[str], model: "str | Callable",
               res: ReplayResult, t0: float, timeout: float, extra_headers: "Callable | None" = None,
               api: "str | Callable[[Request], str]" = "chat", retry_speedup: float = 0.0) -> None:
    system, user = text_for(req, texts)
    path, body = _request(api if isinstance(api, str) else api(req), model if isinstance(model, str) else model(req),
                          req, system, user)
    headers = {} if req.oneshot else {"x-session-id": f"sess-{req.sid}"}
    if extra_headers is not None:
        headers.update(extra_headers(req))
    start = time.monotonic()
    res.sent += 1
    try:
        while True:
            async with http.post(url + path, json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status == 429 and retry_speedup and time.monotonic() - start < timeout:
                    # flow control's refusal: a client sends it again after Retry-After (workload seconds, as the
                    # simulator's clients do), its times counted from the first attempt
                    await r.read()
                    after = r.headers.get("retry-after", "")
                    if not after.isdigit():
                        res.errors["429 without Retry-After"] = res.errors.get("429 without Retry-After", 0) + 1
                        req.error = "429"
                        res.answered += 1
                        return
                    res.refused += 1
                    req.extra["refused"] = req.extra.get("refused", 0) + 1
                    await asyncio.sleep(int(after) / retry_speedup)
                    continue
                if r.status != 200:
                    await r.read()
                    req.error = str(r.status)
                    res.errors[req.error] = res.errors.get(req.error, 0) + 1
                    res.answered += 1
                    return
                await _stream(r, req, res, start, t0)
                return
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        req.error = "lost:" + type(e).__name__
        res.lost += 1


async def _stream(r: aiohttp.ClientResponse, req: Request, res: ReplayResult, start: float, t0: float) -> None:
    async for line in r.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        text, cached = _read_event(chunk)
        if cached is not None:  # the last event: what the replica cached, and (a mock) what its engine took
            req.cached_tokens = cached
            prompt = (chunk.get("usage") or {}).get("prompt_tokens")
            if prompt is not None:  # chat's usage: the engine's prompt tokens, for the hit share per request
                req.extra["prompt_tokens"] = prompt
            req.extra["engine"] = chunk.get("x_mock_engine")
        if "response_id" not in req.extra and chunk.get("id"):  # the engine's id of it (a real vLLM logs it)
            req.extra["response_id"] = chunk["id"]
        # who served: chat's system_fingerprint, or the mock's header on the other APIs (no engine says)
        fp = chunk.get("system_fingerprint") or r.headers.get(REPLICA_HEADER)
        if fp and req.replica is None:
            req.extra["served_by"] = fp
            res.served_by[fp] = res.served_by.get(fp, 0) + 1
            res.timeline.append((start - t0, fp))
            req.replica = -1
        if req.ttft is None and text:
            req.ttft = time.monotonic() - start
    req.e2e = time.monotonic() - start
    res.answered += 1


async def replay(url: "str | list[str]", cfg: WorkloadConfig, seed: int = 1, speedup: float = 10.0,
                 model: "str | Callable[[Request], str]" = MOCK_MODEL, timeout: float = 300.0,
                 concurrency_limit: int = 512, extra_headers: "Callable[[Request], dict] | None" = None,
                 api: "str | Callable[[Request], str]" = "chat", retry_429: bool = False) -> ReplayResult:
    """Run the workload of ``cfg`` (its minutes divided by ``speedup``) against ``url``. ``model``: one name, or
    each request's (a fleet of several models); ``extra_headers``: each request's more headers; ``api``: the API
    every request speaks (``APIS``), or each request's (a session keeps one, as a client does). ``url``: a list
    spreads the requests over several Envoys in turn, request by request (clients of several gateways).
    ``retry_429``: a 429 with Retry-After is sent again after it (in workload seconds), as flow control's clients
    do; one without Retry-After counts as an error."""
    retry = speedup if retry_429 else 0.0
    urls = [url] if isinstance(url, str) else list(url)
    sent = itertools.count()

    def pick() -> str:
        return urls[next(sent) % len(urls)]

    wl = Workload(cfg, seed)
    texts = system_texts(len(wl.system_tokens), wl.system_tokens, seed)  # the noisy tenant has a project of its own
    res = ReplayResult()
    end = cfg.minutes * 60 / speedup
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=concurrency_limit)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def session_loop(start_at: float, s) -> None:
            await asyncio.sleep(max(0.0, start_at - (time.monotonic() - t0)))
            while time.monotonic() - t0 < end:
                req = wl.next_turn(s, (time.monotonic() - t0) * speedup)
                if req is None:
                    return
                res.requests.append(req)
                await _one(http, pick(), req, texts, model, res, t0, timeout, extra_headers, api, retry)
                think = wl.after_answer(s, req) / speedup
                await asyncio.sleep(think)

        async def oneshot(start_at: float, req: Request) -> None:
            await asyncio.sleep(max(0.0, start_at - (time.monotonic() - t0)))
            res.requests.append(req)
            await _one(http, pick(), req, texts, model, res, t0, timeout, extra_headers, api, retry)

        # sessions and one-shots are drawn up front, in arrival order: every contender gets the same stream
        jobs = []
        for t, kind in wl.arrivals():
            x = wl.start(kind, t)
            jobs.append(oneshot(t / speedup, x) if isinstance(x, Request) else session_loop(t / speedup, x))
        lags: list[float] = []
        watch = asyncio.ensure_future(_loop_lag(lags))
        try:
            await asyncio.gather(*jobs)
        finally:
            watch.cancel()
    if lags:
        lags.sort()
        res.client_lag_p99 = lags[int(0.99 * (len(lags) - 1))]
    return res


async def _loop_lag(out: list[float], every: float = 0.01) -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(every)
        out.append(max(0.0, time.monotonic() - t - every))

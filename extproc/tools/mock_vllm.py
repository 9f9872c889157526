"""``warmroute mock-vllm``: an OpenAI-compatible vLLM replica driven by the engine model in real time.

The simulator's engine (``extproc.tools.sim.engine``: continuous batching,
paged KV with prefix caching, queueing, chunked prefill, preemption) runs
here against the wall clock, optionally sped up. Prompts are real text;
the model derives 16-token blocks from it deterministically (4 characters
a token, chained hashes of 64-character chunks), so two prompts sharing a
prefix share cached blocks without any tokenizer download.

It exports vLLM's own metric names and types on ``/metrics`` and takes
faults by flags or ``POST /admin/fault``: ``{"healthy": false}``,
``{"fail_rate": 0.3}`` (503s), ``{"stall_s": 5}`` (slow /metrics and
requests), ``{"die_for_s": 10}`` (stop listening, lose in-flight work,
come back with a cold cache); ``--flap-every/--flap-down`` make it die
and return on a timer.
"""

from __future__ import annotations

import argparse
import logging
import asyncio
import hashlib
import math
import zlib
import json
import random
import sys
import time
from dataclasses import replace

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.blocks import BLOCK_CHARS, block_hashes
from .sim.engine import DECODE_HORIZON_S, Engine, EngineConfig, EngineRequest

CHARS_PER_TOKEN = 4
MIN_EMIT_WALL_S = 0.002  # a decode run's tokens go out at most this often (wall time); at real speed, every step


def text_blocks(text: str) -> list[int]:
    """The prefix cache's view of a prompt: the router's own block hashes (``extproc.core.blocks``), so a
    "cache hit" means the same thing to the mock, the router and the simulator. The last, partial block
    gets a hash of its own (the engine never shares it)."""
    data = text.encode("utf-8", "replace")
    out = block_hashes(data)
    if len(data) % BLOCK_CHARS:
        out.append(zlib.crc32(data) << 32 | len(data))
    return out


class _Aborted(Exception):
    pass


class Waiter:
    """Token events of one request from the engine loop to its HTTP handler."""

    __slots__ = ("queue", "req", "first_at")

    def __init__(self, req: EngineRequest):
        self.req = req
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_at: float | None = None  # engine time of the first token (a preempted request keeps its first)


class Driver:
    """Runs the engine in workload time, with the simulator's stepping, against the wall clock.

    The engine's clock is workload time: a step starts where the previous one
    ended (or at the arrival that woke an idle engine), and a client is
    answered when the wall clock reaches that step's end divided by
    ``speedup``. A late event loop therefore delays the answer but never the
    engine, so the simulator and the mock compute the same schedule, and the
    mock's own lateness (asyncio, HTTP, a busy machine) is measured per
    request as ``lag`` instead of silently inflating every later step.
    Pure-decode steps are run ``horizon_s`` at a time, as the simulator does
    (an arrival cuts the run at the next step boundary), so a 20x-compressed
    14 ms step is not a 0.7 ms timer the event loop cannot keep.
    """

    def __init__(self, cfg: EngineConfig, speedup: float, horizon_s: float = DECODE_HORIZON_S):
        self.engine = Engine(cfg)
        self.speedup = speedup
        self.horizon_s = horizon_s
        self.w0 = time.monotonic()
        self.clock = 0.0  # workload time where the next step starts
        self.waiters: dict[int, Waiter] = {}
        self.prefilled: set[int] = set()
        self.on_first = lambda er, prefill_s: None
        self.on_done = lambda er, decode_s: None
        self.on_lag = lambda lag_s: None  # wall seconds a first token reached its client after its due time
        self._wake = asyncio.Event()
        self._end: float | None = None  # workload time the step (or decode run) in progress ends
        self._next_rid = 0
        self.task: asyncio.Task | None = None

    def now(self) -> float:
        return (time.monotonic() - self.w0) * self.speedup

    def wall(self, t: float) -> float:
        return self.w0 + t / self.speedup

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, blocks: list[int], prompt_tokens: int, max_tokens: int) -> Waiter:
        self._next_rid += 1
        er = EngineRequest(self._next_rid, blocks, prompt_tokens, max_tokens, self.now())
        w = Waiter(er)
        self.waiters[er.rid] = w
        self.engine.add(er)
        if self._end is None:
            self._wake.set()
        else:
            cut = self.engine.cut_run(er.arrival)  # vLLM admits it at the next step boundary
            if cut is not None:
                self._end = cut
                self._wake.set()
        return w

    def abort(self, w: Waiter) -> None:
        self.waiters.pop(w.req.rid, None)
        self.prefilled.discard(w.req.rid)
        self.engine.abort(w.req)

    def abort_all(self) -> None:
        self.engine.abort_all()
        self.prefilled.clear()
        for w in self.waiters.values():
            w.queue.put_nowait(_Aborted())
        self.waiters.clear()

    async def _sleep_until(self, t: float) -> None:
        """Until the wall clock reaches engine time ``t``, or the step in progress ends earlier (an arrival cut it)."""
        while (delay := self.wall(min(t, self._end)) - time.monotonic()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _run(self) -> None:
        e = self.engine
        while True:
            if not e.busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            if e.waiting and not e.running:  # idle until now: the step starts at the arrival
                self.clock = max(self.clock, e.waiting[0].arrival)
            before = {r.rid: r.generated for r in e.running}
            dur, first, done = e.step(self.clock, self.horizon_s)
            if dur <= 0:
                await asyncio.sleep(0.001)
                continue
            self._end = self.clock + dur
            emitted = dict(before)
            run = e._run  # a run of pure-decode steps: each of its requests gets one token per step
            if run is not None:
                start, step_s, _, decoding = run
                # stream as vLLM does, a token per step, but not more often than the event loop can keep at high
                # compression (the schedule is the engine's either way; only the chunking changes)
                every = max(1, math.ceil(MIN_EMIT_WALL_S * self.speedup / step_s))
                k = every
                while start + k * step_s < self._end - 1e-12:
                    await self._sleep_until(start + k * step_s)
                    if start + k * step_s >= self._end - 1e-12:  # an arrival cut the run before this boundary
                        break
                    for r in decoding:
                        w = self.waiters.get(r.rid)
                        upto = min(r.generated, before.get(r.rid, 0) + k)
                        if w is not None and upto > emitted.get(r.rid, 0):
                            w.queue.put_nowait((upto - emitted.get(r.rid, 0), False))
                            emitted[r.rid] = upto
                    k += every
            await self._sleep_until(self._end)
            self.clock, self._end = self._end, None
            late = time.monotonic() - self.wall(self.clock)
            for r in first:
                if r.rid not in self.prefilled:  # once per request, as vLLM counts it (not again after preemption)
                    self.prefilled.add(r.rid)
                    self.on_first(r, (self.clock - r.scheduled_at) / self.speedup)
                    self.on_lag(late)
            firsts = {r.rid for r in first}
            for r in [*e.running, *done]:
                w = self.waiters.get(r.rid)
                new = r.generated - emitted.get(r.rid, 0)
                if w is not None and new > 0:
                    if w.first_at is None:
                        w.first_at = self.clock
                    w.queue.put_nowait((new, r.rid in firsts))
            for r in done:
                self.prefilled.discard(r.rid)
                self.on_done(r, (self.clock - r.first_token_at) / self.speedup)
                w = self.waiters.pop(r.rid, None)
                if w is not None:
                    w.queue.put_nowait(None)


class MockReplica:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.metrics_fault: str | None = None  # "nan": /metrics reports NaN (POST /admin/fault {"metrics": "nan"})
        self.model = args.model
        self.healthy = True
        self.fail_rate = args.fail_rate
        self.html = False
        self.stall_s = 0.0
        self.rng = random.Random(args.seed)
        # --speed scales prefill and decode alike (a slower GPU); --speedup only compresses time for tests
        self.engine_cfg = replace(EngineConfig(max_num_seqs=args.max_num_seqs).scaled(args.speed, args.kv_tokens),
                                  prefix_caching=getattr(args, "prefix_caching", "on") == "on")
        self.driver = self._driver()
        self.site: web.TCPSite | None = None
        self.runner: web.AppRunner | None = None
        self.port = args.port
        reg = self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.lv = {"model_name": self.model, "engine": "0"}
        self.g_running = Gauge("vllm:num_requests_running", "Requests in model execution batches", labels, registry=reg)
        self.g_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=reg)
        self.g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", labels, registry=reg)
        self.c_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", labels, registry=reg)
        self.c_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", labels, registry=reg)
        self.c_preempt = Counter("vllm:num_preemptions", "Cumulative preemptions", labels, registry=reg)
        self.c_success = Counter("vllm:request_success", "Finished requests", labels, registry=reg)
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, registry=reg,
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160))
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels, registry=reg,
                               buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640))
        self._engine_counters = [0, 0, 0]  # queries, hits, preemptions already exported
        # what a router learns rates from: vLLM's token counters and per-phase latency histograms
        self.c_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=reg)
        self.c_generation = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=reg)
        # newer vLLM: prompt tokens by where their KV came from (a KV connector's transfers are not prefix-cache hits)
        self.c_by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source", [*labels, "source"],
                                   registry=reg)
        phase_buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
        self.h_prefill = Histogram("vllm:request_prefill_time_seconds", "Time in the prefill phase", labels,
                                   registry=reg, buckets=phase_buckets)
        self.h_decode = Histogram("vllm:request_decode_time_seconds", "Time in the decode phase", labels,
                                  registry=reg, buckets=phase_buckets)
        cfg = self.engine_cfg
        g = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                  ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=reg)
        g.labels(block_size="16", num_gpu_blocks=str(cfg.num_blocks),
                 enable_prefix_caching=str(cfg.prefix_caching)).set(1)  # Python's str(bool), as vLLM exports it

        def first(er, prefill_s):
            self.c_prompt.labels(**self.lv).inc(er.prompt_tokens)
            self.c_by_source.labels(**self.lv, source="local_compute").inc(er.prompt_tokens - er.cached_tokens)
            self.c_by_source.labels(**self.lv, source="local_cache_hit").inc(er.cached_tokens)
            self.h_prefill.labels(**self.lv).observe(prefill_s)

        def done(er, decode_s):
            self.c_generation.labels(**self.lv).inc(er.generated)
            self.h_decode.labels(**self.lv).observe(decode_s)

        # not an engine's metric: how late the mock's event loop delivered first tokens (wall seconds), so a
        # benchmark can tell the engine's time from the mock's own overhead
        self.h_lag = Histogram("mock:first_token_lag_seconds", "Wall time a first token reached its client after "
                               "its due time", registry=reg,
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self._on_first, self._on_done = first, done
        self._wire(self.driver)
        for m in (self.g_running, self.g_waiting, self.g_kv, self.c_queries, self.c_hits, self.c_preempt, self.c_success,
                  self.h_ttft, self.h_e2e, self.c_prompt, self.c_generation, self.h_prefill, self.h_decode):
            m.labels(**self.lv)  # every series exists from the start, at 0, as vLLM exports them
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.c_by_source.labels(**self.lv, source=source)

    def _driver(self) -> "Driver":
        return Driver(self.engine_cfg, self.args.speedup, self.args.decode_horizon_s)

    def _wire(self, d: "Driver") -> None:
        d.on_first, d.on_done, d.on_lag = self._on_first, self._on_done, self.h_lag.observe

    def _sync_metrics(self) -> None:
        e = self.driver.engine
        self.g_running.labels(**self.lv).set(e.num_running)
        self.g_waiting.labels(**self.lv).set(e.num_waiting)
        self.g_kv.labels(**self.lv).set(e.kv_usage)
        q, h, p = e.prefix_queries, e.prefix_hits, e.preemptions
        dq, dh, dp = q - self._engine_counters[0], h - self._engine_counters[1], p - self._engine_counters[2]
        if dq > 0:
            self.c_queries.labels(**self.lv).inc(dq)
        if dh > 0:
            self.c_hits.labels(**self.lv).inc(dh)
        if dp > 0:
            self.c_preempt.labels(**self.lv).inc(dp)
        self._engine_counters = [q, h, p]

    # ------------------------------------------------------------------ http

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        self._sync_metrics()
        text = generate_latest(self.registry)
        if self.metrics_fault == "nan":  # a broken exporter: the gauge the router reads first turns NaN
            text = b"\n".join(ln.rsplit(b" ", 1)[0] + b" NaN" if ln.startswith(b"vllm:num_requests_running{") else ln
                               for ln in text.split(b"\n"))
        if self.args.metrics == "sglang":
            text = _as_sglang(text.decode()).encode()
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "warmroute-mock", "max_model_len": self.engine_cfg.kv_tokens}]})

    # ---- what other routers ask of a replica (vllm-router, sglang-router) --------------------

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "served_model_name": self.model, "tp_size": 2, "dp_size": 1,
                                  "max_total_num_tokens": self.engine_cfg.kv_tokens, "page_size": 16, "version": "mock"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True,
                                  "model_type": "mock"})

    async def tokenize(self, request: web.Request) -> web.Response:
        doc = await _json_object(request)
        if doc is None:
            return _error(400, "expected a JSON object")
        text = _prompt_text(doc)
        ids = text_token_ids(text)
        return web.json_response({"count": len(ids), "max_model_len": self.engine_cfg.kv_tokens, "tokens": ids})

    async def render(self, request: web.Request) -> web.Response:
        doc = await _json_object(request)
        if doc is None:
            return _error(400, "expected a JSON object")
        text = _prompt_text(doc)
        return web.json_response({"prompt": text, "prompt_token_ids": text_token_ids(text)})

    async def fault(self, request: web.Request) -> web.Response:
        doc = await _json_object(request)
        if doc is None:
            return _error(400, "expected a JSON object")
        if "healthy" in doc:
            self.healthy = bool(doc["healthy"])
        if "fail_rate" in doc:
            self.fail_rate = float(doc["fail_rate"])
        if "stall_s" in doc:
            self.stall_s = float(doc["stall_s"])
        if "metrics" in doc:
            self.metrics_fault = "nan" if doc["metrics"] == "nan" else None
        if "die_for_s" in doc:
            asyncio.get_running_loop().create_task(self.die_for(float(doc["die_for_s"])))
        if "html" in doc:  # a misconfigured proxy or portal in front of the engine: 200 with an HTML page
            self.html = bool(doc["html"])
        return web.json_response({"healthy": self.healthy, "fail_rate": self.fail_rate, "stall_s": self.stall_s})

    async def die_for(self, seconds: float) -> None:
        """Stop listening (connections are refused), lose in-flight work, return with a cold cache."""
        if self.site is None:
            return
        await self.site.stop()
        # a crashed process takes its established (keep-alive) connections with it
        for conn in list(getattr(self.runner.server, "connections", [])):
            conn.force_close()
            if conn.transport is not None:
                conn.transport.abort()
        self.driver.abort_all()
        self.driver.task.cancel()
        self.driver = self._driver()
        self._wire(self.driver)
        self.driver.start()
        self._engine_counters = [0, 0, 0]
        print(f"mock-vllm {self.args.name}: down for {seconds:g}s", flush=True)
        await asyncio.sleep(seconds)
        self.site = web.TCPSite(self.runner, self.args.host, self.port, reuse_address=True, ssl_context=self.ssl)
        await self.site.start()
        print(f"mock-vllm {self.args.name}: back", flush=True)

    async def flap_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self.args.flap_every - self.args.flap_down))
            await self.die_for(self.args.flap_down)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        doc = await _json_object(request)
        if doc is None:
            return _error(400, "request body is not a JSON object")
        if not self.healthy or (self.fail_rate and self.rng.random() < self.fail_rate):
            return _error(503, "injected failure", "server_error")
        if self.html:
            return web.Response(text="<html><body>Welcome to nginx!</body></html>", content_type="text/html")
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if chat and not isinstance(doc.get("messages"), list):
            return _error(400, "messages must be a list")
        text = _prompt_text(doc)
        max_tokens = doc.get("max_completion_tokens") or doc.get("max_tokens") or self.args.default_max_tokens
        try:
            max_tokens = max(1, min(int(max_tokens), 32_768))
        except (TypeError, ValueError):
            return _error(400, "max_tokens must be an integer")
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        if not self.driver.engine.fits(prompt_tokens, max_tokens):
            return _error(400, f"prompt of {prompt_tokens} tokens does not fit this replica's KV cache")
        stream = bool(doc.get("stream"))
        include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        return await self._generate(request, chat, text, prompt_tokens, max_tokens, stream, include_usage)

    async def _generate(self, request, chat, text, prompt_tokens, max_tokens, stream, include_usage):
        t0 = time.monotonic()
        waiter = self.driver.submit(text_blocks(text), prompt_tokens, max_tokens)
        rid = "cmpl-" + hashlib.md5(f"{t0}{self.rng.random()}".encode()).hexdigest()[:16]
        created = int(time.time())
        fp = self.args.name
        resp = None
        produced = 0
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
            while True:
                ev = await waiter.queue.get()
                if isinstance(ev, _Aborted):
                    raise ConnectionResetError("replica died")
                if ev is None:
                    break
                n, is_first = ev
                if is_first:
                    self.h_ttft.labels(**self.lv).observe(time.monotonic() - t0)
                if stream:
                    piece = "".join(("" if produced + k == 0 else " ") + "tok" for k in range(n))
                    await resp.write(_sse(_chunk(chat, rid, created, self.model, piece, None, fp)))
                produced += n
            cached = waiter.req.cached_tokens
            self.h_e2e.labels(**self.lv).observe(time.monotonic() - t0)
            self.c_success.labels(**self.lv).inc()
            if not stream:
                return web.json_response(_final_body(chat, rid, created, self.model, " ".join(["tok"] * max_tokens),
                                                     prompt_tokens, max_tokens, cached, fp))
            await resp.write(_sse(_chunk(chat, rid, created, self.model, "", "length", fp)))
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                # beside the usage, what the engine alone took (workload seconds): a benchmark subtracts nothing, but
                # can tell the engine's time to first token from the time the HTTP path and routers added
                er = waiter.req
                engine = {"ttft_s": round(waiter.first_at - er.arrival, 6), "e2e_s": round(er.finished_at - er.arrival, 6)}
                await resp.write(_sse({"id": rid, "object": obj, "created": created, "model": self.model,
                                       "system_fingerprint": fp, "choices": [],
                                       "usage": _usage(prompt_tokens, max_tokens, cached), "x_mock_engine": engine}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            # the replica died under the request: the client sees the connection cut, as with a real crash
            if request.transport is not None:
                request.transport.abort()
            raise
        finally:
            self.driver.abort(waiter)  # no-op once finished; frees KV when the client left early


def text_token_ids(text: str) -> list[int]:
    """Deterministic token ids, 4 characters a token: equal prefixes give equal ids."""
    return [int.from_bytes(hashlib.blake2b(text[i : i + 4].encode("utf-8", "replace"), digest_size=2).digest(), "big")
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def _prompt_text(doc: dict) -> str:
    msgs = doc.get("messages")
    if isinstance(msgs, list):
        return "".join(_content_text(m.get("content")) for m in msgs if isinstance(m, dict))
    p = doc.get("prompt", doc.get("text", ""))
    if isinstance(p, str):
        return p
    return "".join(x for x in p if isinstance(x, str)) if isinstance(p, list) else ""


async def _json_object(request: web.Request) -> dict | None:
    try:
        doc = await request.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _content_text(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _usage(p: int, c: int, cached: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": {"cached_tokens": cached}}


def _final_body(chat, rid, created, model, text, p, c, cached, fp) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length", "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp,
            "choices": [choice], "usage": _usage(p, c, cached)}


def _chunk(chat, rid, created, model, piece, finish, fp) -> dict:
    if chat:
        delta = {"content": piece} if piece or finish is None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": fp, "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": fp,
            "choices": [{"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}]}


def _as_sglang(vllm_text: str) -> str:
    """The same engine state under SGLang's metric names (what ``engine: sglang`` replicas export)."""
    from ..brain.scraper import SGLANG, parse_vllm_metrics

    x = parse_vllm_metrics(vllm_text).sample
    lab = '{model_name="mock-coder-30b"}'
    values = {SGLANG.running: x.running, SGLANG.waiting: x.waiting, "sglang:token_usage": x.kv_usage,
              "sglang:prompt_tokens_total": x.prompt_tokens or 0, "sglang:cached_tokens_total": x.cached_tokens or 0,
              "sglang:generation_tokens_total": x.generation_tokens or 0,
              "sglang:e2e_request_latency_seconds_count": x.requests_done or 0,
              SGLANG.cache_tokens: x.cache_tokens or 0}
    return "".join(f"{name}{lab} {float(v)}\n" for name, v in values.items())


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, typ: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": typ, "code": status}}, status=status)


def build_app(rep: MockReplica) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app["replica"] = rep
    app.router.add_post("/v1/chat/completions", rep.completions)
    app.router.add_post("/v1/completions", rep.completions)
    app.router.add_get("/v1/models", rep.models)
    app.router.add_get("/health", rep.health)
    if rep.args.metrics != "none":  # "none": a third-party OpenAI server with no engine metrics
        app.router.add_get("/metrics", rep.metrics)
    app.router.add_post("/admin/fault", rep.fault)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, rep.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, rep.model_info)
    app.router.add_post("/tokenize", rep.tokenize)
    app.router.add_post("/v1/chat/completions/render", rep.render)

    async def unknown(request: web.Request) -> web.Response:
        print(f"mock-vllm {rep.args.name}: no route for {request.method} {request.path}", flush=True)
        return _error(404, f"no route for {request.path}")

    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 lets the OS pick; the bound port is printed")
    ap.add_argument("--model", default="mock-coder-30b")
    ap.add_argument("--name", default="mock", help="reported as system_fingerprint, so a client can see who served it")
    ap.add_argument("--kv-tokens", type=int, default=d.kv_tokens, help="KV cache size in tokens")
    ap.add_argument("--speed", type=float, default=1.0, help="prefill and decode speed against the default engine "
                    "(0.5: a GPU half as fast); exported cache size and rates follow")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--default-max-tokens", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=1.0, help="divide every engine step time by this")
    ap.add_argument("--decode-horizon-s", type=float, default=DECODE_HORIZON_S,
                    help="pure-decode steps are run and streamed this much engine time at a time (0: token by token)")
    ap.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 503")
    ap.add_argument("--flap-every", type=float, default=0.0, help="die every this many seconds (0: never)")
    ap.add_argument("--flap-down", type=float, default=5.0, help="and stay down this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tls-cert", default=None, help="serve HTTPS with this PEM certificate (and --tls-key)")
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                    help="off: vLLM's --no-enable-prefix-caching (every prompt computed whole; cache_config_info says so)")
    ap.add_argument("--metrics", choices=("vllm", "sglang", "none"), default="vllm",
                    help="whose /metrics names to export (none: no /metrics at all, like a foreign OpenAI server)")


def _no_request_content(record: logging.LogRecord) -> bool:
    """A log record of aiohttp's server, without the request bytes its exception quotes."""
    if record.exc_info and record.exc_info[1] is not None:
        kind = type(record.exc_info[1]).__name__
        record.msg, record.args, record.exc_info, record.exc_text = f"bad request refused: {kind}", (), None, None
    return True


async def serve(args: argparse.Namespace) -> None:
    rep = MockReplica(args)
    rep.driver.start()
    # aiohttp's parser logged a header it refused with its value (a session id in a replica log): accept what Envoy
    # lets through (60 KiB of headers), and log a refusal by its kind alone
    logging.getLogger("aiohttp.server").addFilter(_no_request_content)
    rep.runner = web.AppRunner(build_app(rep), access_log=None, max_line_size=65536, max_field_size=65536)
    await rep.runner.setup()
    rep.ssl = None
    if args.tls_cert:
        import ssl

        rep.ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        rep.ssl.load_cert_chain(args.tls_cert, args.tls_key)
    rep.site = web.TCPSite(rep.runner, args.host, args.port, reuse_address=True, ssl_context=rep.ssl)
    await rep.site.start()
    rep.port = rep.runner.addresses[0][1]
    print(f"mock-vllm listening on {'https' if rep.ssl else 'http'}://{args.host}:{rep.port}", flush=True)
    if args.flap_every > 0:
        asyncio.get_running_loop().create_task(rep.flap_loop())
    try:
        await asyncio.Event().wait()
    finally:
        await rep.runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="warmroute mock-vllm")
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``warmroute mock-vllm``: an OpenAI-compatible stand-in for one vLLM replica.

It behaves enough like vLLM for the router to matter: at most
``max_num_seqs`` requests run at once and the rest queue; prefill takes
time proportional to the prompt tokens not already in its prefix cache;
each output token takes a decode step. It exports vLLM's own metric names
on ``/metrics``. Faults are injected by flags or ``POST /admin/fault``.

Prompts are real text; tokens are estimated as characters / 4 (no
tokenizer download). The prefix cache keys 16-token blocks by a chained
hash of the text, as vLLM's automatic prefix caching does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time
from collections import OrderedDict

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BLOCK_CHARS = 64  # 16 tokens of 4 characters


class PrefixCache:
    """LRU of block hashes; ``lookup`` returns how many leading characters are cached."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def _hashes(self, text: str):
        h = b""
        for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
            h = hashlib.blake2b(h + text[i : i + BLOCK_CHARS].encode("utf-8", "replace"), digest_size=8).digest()
            yield h

    def lookup_and_insert(self, text: str) -> int:
        cached = 0
        hit = True
        for h in self._hashes(text):
            if hit and h in self.blocks:
                cached += BLOCK_CHARS
                self.blocks.move_to_end(h)
                continue
            hit = False
            self.blocks[h] = None
            if len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)
        return cached


class MockReplica:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model = args.model
        self.sem = asyncio.Semaphore(args.max_num_seqs)
        self.running = 0
        self.waiting = 0
        self.healthy = True
        self.fail_rate = args.fail_rate
        self.stall_s = 0.0
        self.rng = random.Random(args.seed)
        self.cache = PrefixCache(args.kv_blocks)
        self.kv_tokens_in_use = 0
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
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=reg,
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds", "E2E latency", labels, registry=reg,
                               buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320))
        self.c_preempt.labels(**self.lv)
        self.c_success.labels(**self.lv)
        self._sync_gauges()

    def _sync_gauges(self) -> None:
        self.g_running.labels(**self.lv).set(self.running)
        self.g_waiting.labels(**self.lv).set(self.waiting)
        self.g_kv.labels(**self.lv).set(min(1.0, self.kv_tokens_in_use / max(1, self.args.kv_tokens)))

    # ------------------------------------------------------------------ http

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        self._sync_gauges()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "warmroute-mock"}]})

    async def fault(self, request: web.Request) -> web.Response:
        doc = await request.json()
        if "healthy" in doc:
            self.healthy = bool(doc["healthy"])
        if "fail_rate" in doc:
            self.fail_rate = float(doc["fail_rate"])
        if "stall_s" in doc:
            self.stall_s = float(doc["stall_s"])
        return web.json_response({"healthy": self.healthy, "fail_rate": self.fail_rate, "stall_s": self.stall_s})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            doc = await request.json()
            if not isinstance(doc, dict):
                raise ValueError
        except (ValueError, json.JSONDecodeError):
            return _error(400, "request body is not a JSON object")
        if not self.healthy or (self.fail_rate and self.rng.random() < self.fail_rate):
            return _error(503, "injected failure", "server_error")
        if chat:
            msgs = doc.get("messages")
            if not isinstance(msgs, list):
                return _error(400, "messages must be a list")
            text = "".join(_content_text(m.get("content")) for m in msgs if isinstance(m, dict))
        else:
            p = doc.get("prompt", "")
            text = p if isinstance(p, str) else "".join(x for x in p if isinstance(x, str)) if isinstance(p, list) else ""
        max_tokens = doc.get("max_completion_tokens") or doc.get("max_tokens") or self.args.default_max_tokens
        max_tokens = max(1, min(int(max_tokens), 4096))
        stream = bool(doc.get("stream"))
        include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        return await self._generate(request, chat, text, max_tokens, stream, include_usage)

    async def _generate(self, request, chat, text, max_tokens, stream, include_usage):
        t0 = time.monotonic()
        prompt_tokens = max(1, len(text) // 4)
        speed = self.args.speedup
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.kv_tokens_in_use += prompt_tokens + max_tokens
        rid = "cmpl-" + hashlib.md5(f"{t0}{self.rng.random()}".encode()).hexdigest()[:16]
        created = int(time.time())
        try:
            cached_chars = self.cache.lookup_and_insert(text)
            cached_tokens = min(prompt_tokens, cached_chars // 4)
            self.c_queries.labels(**self.lv).inc(prompt_tokens)
            self.c_hits.labels(**self.lv).inc(cached_tokens)
            prefill_s = (prompt_tokens - cached_tokens) / self.args.prefill_tokens_per_s
            step_s = self.args.decode_step_s * (1 + 0.05 * self.running)
            await asyncio.sleep(prefill_s / speed)
            self.h_ttft.labels(**self.lv).observe(time.monotonic() - t0)
            words = ["tok"] * max_tokens
            if not stream:
                await asyncio.sleep(step_s * (max_tokens - 1) / speed)
                body = _final_body(chat, rid, created, self.model, " ".join(words), prompt_tokens, max_tokens, cached_tokens,
                                   self.args.name)
                self.h_e2e.labels(**self.lv).observe(time.monotonic() - t0)
                self.c_success.labels(**self.lv).inc()
                return web.json_response(body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for i, w in enumerate(words):
                if i:
                    await asyncio.sleep(step_s / speed)
                await resp.write(_sse(_chunk(chat, rid, created, self.model, ("" if i == 0 else " ") + w, None, self.args.name)))
            await resp.write(_sse(_chunk(chat, rid, created, self.model, "", "length", self.args.name)))
            if include_usage:
                usage = _usage(prompt_tokens, max_tokens, cached_tokens)
                obj = "chat.completion.chunk" if chat else "text_completion"
                await resp.write(_sse({"id": rid, "object": obj, "created": created, "model": self.model, "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.h_e2e.labels(**self.lv).observe(time.monotonic() - t0)
            self.c_success.labels(**self.lv).inc()
            return resp
        finally:
            self.running -= 1
            self.kv_tokens_in_use -= prompt_tokens + max_tokens
            self.sem.release()


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


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, typ: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": typ, "code": status}}, status=status)


def build_app(args: argparse.Namespace) -> web.Application:
    rep = MockReplica(args)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app["replica"] = rep
    app.router.add_post("/v1/chat/completions", rep.completions)
    app.router.add_post("/v1/completions", rep.completions)
    app.router.add_get("/v1/models", rep.models)
    app.router.add_get("/health", rep.health)
    app.router.add_get("/metrics", rep.metrics)
    app.router.add_post("/admin/fault", rep.fault)
    return app


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 lets the OS pick; the bound port is printed")
    ap.add_argument("--model", default="mock-coder-30b")
    ap.add_argument("--name", default="mock", help="reported as system_fingerprint, so a client can see who served it")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=300_000)
    ap.add_argument("--kv-blocks", type=int, default=300_000 // 16)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=8_000.0)
    ap.add_argument("--decode-step-s", type=float, default=0.03)
    ap.add_argument("--default-max-tokens", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=1.0, help="divide every simulated duration by this")
    ap.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 503")
    ap.add_argument("--seed", type=int, default=0)


async def serve(args: argparse.Namespace) -> None:
    app = build_app(args)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    print(f"mock-vllm listening on http://{args.host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


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

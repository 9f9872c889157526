"""``warmroute mock-vllm``: an OpenAI-compatible vLLM replica driven by the engine model in real time.

The simulator's engine (``extproc.tools.engine.model``: continuous batching,
paged KV with prefix caching, queueing, chunked prefill, preemption) runs
here against the wall clock, optionally sped up. Prompts are real text;
the model derives 16-token blocks from it deterministically (4 characters
a token, chained hashes of 64-character chunks), so two prompts sharing a
prefix share cached blocks without any tokenizer download.

It exports vLLM's own metric names and types on ``/metrics`` and takes
faults by flags or ``POST /admin/fault``: ``{"healthy": false}``,
``{"fail_rate": 0.3}`` (503s), ``{"stall_s": 5}`` (slow /metrics and
requests), ``{"die_for_s": 10}`` (stop listening, lose in-flight work,
come back with a cold cache), ``{"die_slowly_s": 1.3, "die_for_s": 10}``
(first a process that still accepts connections but resets every request
before answering, as a SIGKILLed vLLM does while its port closes),
``{"kv_tokens_per_s": 2000}`` (its loads from a prefill replica that slow);
``--flap-every/--flap-down`` make it die and return on a timer. Like
vLLM's uvicorn server it closes a keep-alive connection idle for
``--keep-alive-s`` (5 s, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import random
import sys
import time
import uuid
import zlib
from dataclasses import replace

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from extproc.core.apis import anthropic_error_body
from extproc.core.models import not_found_body
from extproc.tools.engine.metrics import SGLANG_DECODE_LOG_INTERVAL, CacheInfo, Exporter
from extproc.tools.engine.model import EngineConfig
from extproc.tools.mock.kv_transfer import KvConnector, LoadFailed
from extproc.tools.mock.driver import Aborted, Driver, Waiter  # noqa: F401 (Waiter: read from here)
from extproc.tools.mock.options import add_arguments
from extproc.tools.mock.responses import (chunk, error, text_blocks, final_body, json_object, prompt_text, sse,
                                          text_token_ids, usage)
from extproc.tools.mock.apis import (MessagesShape, ResponsesShape, ResponseStore, messages_prompt, not_found,
                                     responses_input)

from extproc.tools.mock.responses import CHARS_PER_TOKEN  # noqa: E402 (read from here too)
ENGINE_HEADER = "x-mock-engine"  # which data-parallel engine served (not vLLM's; for tests and benchmarks)
REPLICA_HEADER = "x-mock-replica"  # which replica served (chat has its system_fingerprint; the other APIs this)
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
POOLING_PATHS = ("/v1/embeddings", "/pooling")


class MockReplica:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dying = False  # die_slowly_s: the port accepts, every request is reset unanswered
        self.metrics_fault: str | None = None  # "nan": /metrics reports NaN (POST /admin/fault {"metrics": "nan"})
        self.model = args.model
        self.started = int(time.time())  # /v1/models' "created"
        self.healthy = True
        self.fail_rate = args.fail_rate
        self.html = False
        self.stall_s = 0.0
        self.rng = random.Random(args.seed)
        # --speed scales prefill and decode alike (a slower GPU); --speedup only compresses time for tests
        # LoRA adapters it serves (vLLM --lora-modules), each listed in /v1/models with this model as parent
        self.adapters = [a for a in (getattr(args, "lora_adapters", "") or "").split(",") if a]
        max_loras = max(1, getattr(args, "max_loras", 1)) if self.adapters else 0
        self.engine_cfg = replace(EngineConfig(max_num_seqs=args.max_num_seqs).scaled(args.speed, args.kv_tokens),
                                  prefix_caching=getattr(args, "prefix_caching", "on") == "on", max_loras=max_loras,
                                  lora_load_s=getattr(args, "lora_load_s", 0.0) if self.adapters else 0.0,
                                  cpu_tier_tokens=getattr(args, "cpu_tier_tokens", 0))
        self.dp = max(1, getattr(args, "data_parallel", 1))
        # vLLM's --max-model-len: the longest prompt + output one request may have (default here: the KV cache's size)
        self.max_model_len = getattr(args, "max_model_len", None) or self.engine_cfg.kv_tokens
        self.store = ResponseStore() if getattr(args, "responses_store", False) else None
        self.background: dict[str, asyncio.Task] = {}  # background responses still generating, by id
        self.drivers = [self._driver(k) for k in range(self.dp)]
        rate = getattr(args, "kv_transfer_tokens_per_s", 0.0) or 0.0
        # prefill/decode disaggregation (vLLM --kv-transfer-config, kv_role kv_both): None, kv_transfer_params ignored
        self.kv = KvConnector(args.name, args.host, rate, args.speedup, getattr(args, "kv_lease_s", 30.0)) \
            if rate > 0 else None
        self.site: web.TCPSite | None = None
        self.runner: web.AppRunner | None = None
        self.port = args.port
        self.dialect = "none" if getattr(args, "no_metrics", False) else args.metrics
        cache = CacheInfo(16, self.engine_cfg.num_blocks, self.engine_cfg.prefix_caching)
        self.exporter = Exporter(self.dialect if self.dialect != "none" else "vllm", self.model, self.dp, cache,
                                 tp=getattr(args, "tp", 1), all_ranks=getattr(args, "metrics_all_ranks", False),
                                 max_model_len=self.max_model_len, max_loras=max_loras,
                                 offload=self.engine_cfg.cpu_tier_tokens > 0)
        self._logged: list[tuple[int, int, int, float]] = [(0, 0, 0, 0.0)] * self.dp  # SGLang: last stats log
        # not an engine's metric: how late the mock's event loop delivered first tokens (wall seconds), so a
        # benchmark can tell the engine's time from the mock's own overhead; and the engine's true speeds
        # (counted as they happen, in wall seconds), the ground truth for the rates a router learns
        reg = self.registry = CollectorRegistry()
        self.h_lag = Histogram("mock:first_token_lag_seconds", "Wall time a first token reached its client after "
                               "its due time", registry=reg,
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.c_not_found = Counter("mock:model_not_found", "Requests refused for a model it does not serve",
                                   registry=reg)
        self.g_truth = Gauge("mock:engine_truth", "The engine's true prefill and decode work, counted when done",
                             ["engine", "quantity"], registry=reg)
        for d in self.drivers:
            d.start_wall = time.monotonic()
            self._wire(d)

    def _driver(self, k: int = 0) -> "Driver":
        return Driver(self.engine_cfg, self.args.speedup, self.args.decode_horizon_s, index=k)

    def _wire(self, d: "Driver") -> None:
        ex, sp = self.exporter, self.args.speedup

        def first(k, er):
            ex.first_token(k, er, (er.first_token_at - er.arrival) / sp, (er.first_token_at - er.scheduled_at) / sp,
                           er.restore_s / sp)

        def done(k, er):
            ex.finished(k, er, queued_s=(er.scheduled_at - er.arrival) / sp,
                        prefill_s=(er.first_token_at - er.scheduled_at) / sp,
                        decode_s=(er.finished_at - er.first_token_at) / sp, e2e_s=(er.finished_at - er.arrival) / sp)

        d.on_first, d.on_done, d.on_chunk, d.on_lag = first, done, ex.chunk, self.h_lag.observe
        d.on_step = self._stepped

    def _stepped(self, k: int) -> None:
        """SGLang logs its scheduler stats (the gauges) on every prefill batch and every decode_log_interval
        decode steps, and at no other time. vLLM records lora_requests_info at every step's stats."""
        if self.dialect != "sglang":
            self.exporter.lora_info(self.drivers[k].engine)
            return
        e = self.drivers[k].engine
        steps, prefills, tokens, at = self._logged[k]
        if e.prefill_steps == prefills and e.steps // SGLANG_DECODE_LOG_INTERVAL == steps // SGLANG_DECODE_LOG_INTERVAL:
            return
        now = time.monotonic()
        produced = e.true_decode_tokens + e.finished
        rate = (produced - tokens) / (now - at) if at and now > at else 0.0
        self._logged[k] = (e.steps, e.prefill_steps, produced, now)
        self.exporter.log_stats(k, e, rate)

    def pick_engine(self, rank: str | None) -> "Driver":
        """vLLM's data-parallel front end: the rank a client names (X-data-parallel-rank), else the engine with the
        least waiting x 4 + running (DPLBAsyncMPClient.get_core_engine_for_request; it reads the engines' counts
        from its coordinator every 100 ms and counts its own sends meanwhile: here the engines' state itself)."""
        if rank is not None:
            return self.drivers[int(rank)]
        return min(self.drivers, key=lambda d: (d.engine.num_waiting * 4 + d.engine.num_running, d.index))

    @property
    def driver(self) -> "Driver":
        return self.drivers[0]

    def _sync_metrics(self) -> None:
        for d in self.drivers:
            self.exporter.scheduled(d.index, d.engine)
            e, lv = d.engine, str(d.index)
            sp = self.args.speedup
            for q, v in (("prefill_tokens", e.true_prefill_tokens), ("prefill_seconds", e.true_prefill_seconds / sp),
                         ("decode_tokens", e.true_decode_tokens), ("decode_seconds", e.true_decode_seconds / sp),
                         ("lora_loads", e.lora_loads)):
                self.g_truth.labels(engine=lv, quantity=q).set(v)

    # ------------------------------------------------------------------ http

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        self._sync_metrics()
        text = self.exporter.text() + generate_latest(self.registry)
        if self.metrics_fault == "nan":  # a broken exporter: the gauge the router reads first turns NaN
            running = b"sglang:num_running_reqs{" if self.dialect == "sglang" else b"vllm:num_requests_running{"
            text = b"\n".join(ln.rsplit(b" ", 1)[0] + b" NaN" if ln.startswith(running) else ln
                               for ln in text.split(b"\n"))
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            raise web.HTTPServiceUnavailable(text="engine is down")
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        """vLLM 0.32's list (``OpenAIServingModels.show_available_models``): an adapter has its parent and no
        max_model_len of its own."""
        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict:
            return {"id": mid, "object": "model", "created": self.started, "owned_by": "warmroute-mock", "root": root,
                    "parent": parent, "max_model_len": max_len, "permission": [{
                        "id": f"modelperm-{hashlib.blake2b(mid.encode(), digest_size=8).hexdigest()}",
                        "object": "model_permission", "created": self.started, "allow_create_engine": False,
                        "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}]}

        return web.json_response({"object": "list", "data": [
            card(self.model, self.model, None, self.max_model_len),
            *(card(a, f"/adapters/{a}", self.model, None) for a in self.adapters)]})

    # ---- what other routers ask of a replica (vllm-router, sglang-router) --------------------

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "served_model_name": self.model,
                                  "tp_size": getattr(self.args, "tp", 1),
                                  "dp_size": self.dp,
                                  "max_total_num_tokens": self.engine_cfg.kv_tokens, "page_size": 16,
                                  "version": "mock"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True,
                                  "model_type": "mock"})

    async def tokenize(self, request: web.Request) -> web.Response:
        doc = await json_object(request)
        if doc is None:
            return error(400, "expected a JSON object")
        text = prompt_text(doc)
        ids = text_token_ids(text)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def render(self, request: web.Request) -> web.Response:
        doc = await json_object(request)
        if doc is None:
            return error(400, "expected a JSON object")
        text = prompt_text(doc)
        return web.json_response({"prompt": text, "prompt_token_ids": text_token_ids(text)})

    async def fault(self, request: web.Request) -> web.Response:
        doc = await json_object(request)
        if doc is None:
            return error(400, "expected a JSON object")
        if "healthy" in doc:
            self.healthy = bool(doc["healthy"])
        if "fail_rate" in doc:
            self.fail_rate = float(doc["fail_rate"])
        if "stall_s" in doc:
            self.stall_s = float(doc["stall_s"])
        if "metrics" in doc:
            self.metrics_fault = "nan" if doc["metrics"] == "nan" else None
        if "die_slowly_s" in doc or "die_for_s" in doc:
            asyncio.get_running_loop().create_task(self.die_for(float(doc.get("die_for_s", 0.0)),
                                                                float(doc.get("die_slowly_s", 0.0))))
        if "html" in doc:  # a misconfigured proxy or portal in front of the engine: 200 with an HTML page
            self.html = bool(doc["html"])
        if "kv_tokens_per_s" in doc:  # a slow KV link
            if self.kv is None or not isinstance(rate := doc["kv_tokens_per_s"], (int, float)) or not rate > 0:
                return error(400, "kv_tokens_per_s: a positive number, on a replica with --kv-transfer-tokens-per-s")
            self.kv.tokens_per_s = float(rate)
        return web.json_response({"healthy": self.healthy, "fail_rate": self.fail_rate, "stall_s": self.stall_s})

    async def die_for(self, seconds: float, slowly_s: float = 0.0) -> None:
        """Stop listening (connections are refused), lose in-flight work, return with a cold cache. ``slowly_s``:
        first that long of a dying process whose port still accepts and whose every request is reset unanswered
        (a killed vLLM's port closes 0.05-1.3 s after the kill: its front end outlives the engine a moment)."""
        if self.site is None:
            return
        if slowly_s > 0:
            self.dying = True
            for d in self.drivers:  # the engine is gone first: what ran is lost
                d.abort_all()
            await asyncio.sleep(slowly_s)
            self.dying = False
        await self.site.stop()
        # a crashed process takes its established (keep-alive) connections with it
        for conn in list(getattr(self.runner.server, "connections", [])):
            conn.force_close()
            if conn.transport is not None:
                conn.transport.abort()
        for d in self.drivers:
            d.abort_all()
            d.task.cancel()
        self.exporter.restarted()  # a new process: its counters start from 0
        if self.kv is not None:
            self.kv.forget_all()
        self.drivers = [self._driver(k) for k in range(self.dp)]
        self._logged = [(0, 0, 0, 0.0)] * self.dp
        for d in self.drivers:
            self._wire(d)
            d.start()
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
        embed = request.path in POOLING_PATHS  # a pooling runner: one forward pass, a vector instead of tokens
        try:
            doc = await request.json()
        except ValueError:  # what vLLM 0.32 (FastAPI) answers a body it cannot parse, a compressed one included
            return web.json_response({"detail": "There was an error parsing the body"}, status=400)
        if not isinstance(doc, dict):
            return error(400, "request body is not a JSON object")
        if not self.healthy or (self.fail_rate and self.rng.random() < self.fail_rate):
            return error(503, "injected failure", "ServiceUnavailableError")
        if self.html:
            return web.Response(text="<html><body>Welcome to nginx!</body></html>", content_type="text/html")
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        messages_api, responses_api = request.path == "/v1/messages", request.path == "/v1/responses"
        if (chat or messages_api) and not isinstance(doc.get("messages"), list):
            return error(400, "1 validation error: messages: Input should be a valid list", param="body.messages")
        model = doc.get("model")
        if model is not None and model != self.model and model not in self.adapters:  # OpenAIServing._check_model
            self.c_not_found.inc()
            body = not_found_body(str(model), [self.model])
            return web.json_response(anthropic_error_body(body) if messages_api else body, status=404)
        lora = model if model in self.adapters else None
        text = prompt_text(doc)
        shape = history = None
        if messages_api:
            text, shape = messages_prompt(doc), MessagesShape(self.model)
        elif responses_api:
            prev = doc.get("previous_response_id")
            if prev is not None:
                if self.store is None or self.store.get(str(prev)) is None:
                    status, body = not_found(str(prev))
                    return web.json_response(body, status=status)
                history = self.store.history[str(prev)]
            history = (history or "") + responses_input(doc)  # the conversation so far without the instructions
            text = (doc.get("instructions") or "") + history
            rid = doc.get("request_id") if isinstance(doc.get("request_id"), str) else f"resp_{uuid.uuid4().hex}"
            shape = ResponsesShape(self.model, rid, doc)
        max_tokens = 1 if embed else (doc.get("max_completion_tokens") or doc.get("max_tokens")
                                      or doc.get("max_output_tokens") or self.args.default_max_tokens)
        try:
            max_tokens = max(1, min(int(max_tokens), 32_768))
        except (TypeError, ValueError):
            return error(400, "1 validation error: max_tokens: Input should be a valid integer",
                         param="body.max_tokens")
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        rank = request.headers.get("X-data-parallel-rank")  # vLLM and SGLang read it case-insensitively
        if rank is not None and not (rank.isdigit() and int(rank) < self.dp):
            return error(400, f"X-data-parallel-rank {rank[:20]!r} is not a rank of this server's {self.dp} engines")
        if prompt_tokens > self.max_model_len:  # vLLM's renderer refuses it before the engine sees it
            return error(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                          f"prompt contains at least {prompt_tokens} input tokens, which exceeds this limit even "
                          f"without "
                          "any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                          f"value={prompt_tokens})", "BadRequestError", "input_tokens")
        if not self.driver.engine.fits(prompt_tokens, max_tokens):
            return error(400, f"prompt of {prompt_tokens} tokens does not fit this replica's KV cache")
        stream = bool(doc.get("stream")) and not embed
        pd = self.kv.role(doc.get("kv_transfer_params")) if self.kv is not None and shape is None and not embed \
            else None
        if pd == "prefill":  # NixlConnector: the prefill leg samples one token
            max_tokens = 1
        include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        keep = None
        if responses_api and self.store is not None and doc.get("store", True) is not False:
            keep = lambda response, out: self.store.put(response, history + out)  # noqa: E731
        if responses_api and doc.get("background"):
            if keep is None:  # vLLM: background mode needs the store
                return error(400, "This vLLM engine does not support `store=True` and therefore does not support "
                              "the background mode.", "invalid_request_error", "background")
            queued = shape.response("queued")
            self.store.put(queued, history)
            task = asyncio.get_running_loop().create_task(self._generate(
                request, chat, text, prompt_tokens, max_tokens, False, False, self.pick_engine(rank), lora, embed,
                shape, keep))
            self.background[shape.id] = task
            task.add_done_callback(lambda _: self.background.pop(shape.id, None))
            return web.json_response(queued)
        return await self._generate(request, chat, text, prompt_tokens, max_tokens, stream, include_usage,
                                    self.pick_engine(rank), lora, embed, shape, keep,
                                    (pd, doc.get("kv_transfer_params")) if pd else None)

    async def stored(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: only the process that made it has it."""
        rid = request.match_info["response_id"]
        response = self.store.get(rid) if self.store is not None else None
        if response is None:
            status, body = not_found(rid)
            return web.json_response(body, status=status)
        if request.method == "POST":
            if response.get("status") not in ("queued", "in_progress"):
                return error(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
            response["status"] = "cancelled"
            task = self.background.pop(rid, None)
            if task is not None:
                task.cancel()
        return web.json_response(response)

    async def count_tokens(self, request: web.Request) -> web.Response:
        doc = await json_object(request)
        text = messages_prompt(doc) if doc is not None else None
        if text is None:
            return error(400, "1 validation error: messages: Input should be a valid list", param="body.messages")
        return web.json_response({"input_tokens": max(1, len(text) // CHARS_PER_TOKEN)})

    async def _generate(self, request, chat, text, prompt_tokens, max_tokens, stream, include_usage, driver, lora=None,
                        embed=False, shape=None, keep=None, pd=None):
        t0 = time.monotonic()
        blocks = text_blocks(text)
        if lora is not None:  # vLLM puts the adapter in its block hashes: an adapter's prefix is its own
            salt = zlib.crc32(lora.encode()) << 16
            blocks = [b ^ salt for b in blocks]
        external, transfer = 0, None
        if pd is not None and pd[0] == "decode":
            try:
                external = await self.kv.load(pd[1], driver.engine.hit_tokens(blocks, prompt_tokens))
            except LoadFailed as e:
                if self.args.kv_load_failure_policy == "fail":  # vLLM's default: the request fails
                    return error(500, f"KV transfer from the prefill replica failed ({e})", "InternalServerError")
                external = 0  # "recompute": the engine computes the prompt itself
        waiter = driver.submit(blocks, prompt_tokens, max_tokens, lora, external=external,
                               keep=pd is not None and pd[0] == "prefill")
        rid = "cmpl-" + hashlib.md5(f"{t0}{self.rng.random()}".encode()).hexdigest()[:16]
        created = int(time.time())
        fp = self.args.name
        resp = None
        produced = 0
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   ENGINE_HEADER: str(driver.index), REPLICA_HEADER: self.args.name})
                await resp.prepare(request)
                if shape is not None:
                    for event in shape.start(prompt_tokens):
                        await resp.write(event)
            while True:
                ev = await waiter.queue.get()
                if isinstance(ev, Aborted):
                    raise ConnectionResetError("replica died")
                if ev is None:
                    break
                n, is_first = ev
                if stream:
                    piece = "".join(("" if produced + k == 0 else " ") + "tok" for k in range(n))
                    await resp.write(shape.piece(piece) if shape is not None
                                     else sse(chunk(chat, rid, created, self.model, piece, None, fp)))
                produced += n
            cached = waiter.req.cached_tokens
            if embed:
                vector = [round(b / 255 - 0.5, 6) for b in hashlib.blake2b(text.encode(), digest_size=8).digest()]
                return web.json_response({"id": rid, "object": "list", "created": created, "model": self.model,
                                          "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                                          "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}},
                                         headers={ENGINE_HEADER: str(driver.index)})
            if shape is not None:
                out = " ".join(["tok"] * max_tokens)
                if keep is not None:
                    keep(shape.body(out, prompt_tokens, max_tokens, cached), out)
                if not stream:
                    return web.json_response(shape.body(out, prompt_tokens, max_tokens, cached),
                                             headers={ENGINE_HEADER: str(driver.index), REPLICA_HEADER: self.args.name})
                for event in shape.end(out, prompt_tokens, max_tokens, cached):
                    await resp.write(event)
                await resp.write_eof()
                return resp
            if not stream:
                body = final_body(chat, rid, created, self.model, " ".join(["tok"] * max_tokens), prompt_tokens,
                                   max_tokens, cached, fp)
                if waiter.req.keep:
                    body["kv_transfer_params"] = transfer = self.kv.keep(driver, waiter.req.rid, prompt_tokens, blocks)
                return web.json_response(body, headers={ENGINE_HEADER: str(driver.index)})
            await resp.write(sse(chunk(chat, rid, created, self.model, "", "length", fp)))
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                # beside the usage, what the engine alone took (workload seconds): a benchmark subtracts nothing, but
                # can tell the engine's time to first token from the time the HTTP path and routers added
                er = waiter.req
                engine = {"ttft_s": round(waiter.first_at - er.arrival, 6), "e2e_s": round(er.finished_at - er.arrival,
                                                                                           6)}
                await resp.write(sse({"id": rid, "object": obj, "created": created, "model": self.model,
                                       "system_fingerprint": fp, "choices": [],
                                       "usage": usage(prompt_tokens, max_tokens, cached), "x_mock_engine": engine}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            # the replica died under the request: the client sees the connection cut, as with a real crash
            if request.transport is not None:
                request.transport.abort()
            raise
        finally:
            driver.abort(waiter)  # no-op once finished; frees KV when the client left early
            if waiter.req.keep and transfer is None:  # a prefill leg nobody will hear of: nothing to read
                driver.engine.free_kept(waiter.req.rid)


def build_app(rep: MockReplica) -> web.Application:
    @web.middleware
    async def dying(request: web.Request, handler):
        if rep.dying and request.transport is not None:
            request.transport.abort()  # the connection is reset before any byte of an answer
            raise asyncio.CancelledError
        return await handler(request)

    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[dying])
    app["replica"] = rep
    # vLLM registers its routes by the model's tasks (api_server.build_app: the generate routers only if "generate"
    # is supported, the pooling ones only for a pooling model): a path a replica lacks is FastAPI's 404
    for path in GENERATE_PATHS if rep.args.runner == "generate" else POOLING_PATHS:
        app.router.add_post(path, rep.completions)
    app.router.add_get("/v1/models", rep.models)
    app.router.add_get("/health", rep.health)
    if rep.dialect != "none":  # "none": a third-party OpenAI server, or vLLM with --disable-log-stats
        app.router.add_get("/metrics", rep.metrics)
    app.router.add_post("/admin/fault", rep.fault)
    if rep.kv is not None:
        app.router.add_post("/kv/read", rep.kv.read)
        app.router.add_post("/kv/release", rep.kv.release)
        app.router.add_get("/admin/kv_transfers", rep.kv.transfers)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, rep.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, rep.model_info)
    app.router.add_post("/tokenize", rep.tokenize)
    if rep.args.runner == "generate":
        app.router.add_post("/v1/messages/count_tokens", rep.count_tokens)
        app.router.add_get("/v1/responses/{response_id}", rep.stored)
        app.router.add_post("/v1/responses/{response_id}/cancel", rep.stored)
    app.router.add_post("/v1/chat/completions/render", rep.render)
    if not rep.args.disable_fastapi_docs:
        listed = sorted({(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})

        async def openapi(request: web.Request) -> web.Response:
            paths: dict[str, dict] = {}
            for method, path in listed:
                paths.setdefault(path, {})[method] = {"responses": {"200": {"description": "Successful Response"}}}
            return web.json_response({"openapi": "3.1.0", "info": {"title": "FastAPI", "version": "0.1.0"},
                                      "paths": paths})

        app.router.add_get("/openapi.json", openapi)

    async def unknown(request: web.Request) -> web.Response:
        print(f"mock-vllm {rep.args.name}: no route for {request.method} {request.path}", flush=True)
        return web.json_response({"detail": "Not Found"}, status=404)  # FastAPI's own answer

    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


def _no_request_content(record: logging.LogRecord) -> bool:
    """A log record of aiohttp's server, without the request bytes its exception quotes."""
    if record.exc_info and record.exc_info[1] is not None:
        kind = type(record.exc_info[1]).__name__
        record.msg, record.args, record.exc_info, record.exc_text = f"bad request refused: {kind}", (), None, None
    return True


async def serve(args: argparse.Namespace) -> None:
    rep = MockReplica(args)
    for d in rep.drivers:
        d.start()
    # aiohttp's parser logged a header it refused with its value (a session id in a replica log): accept what Envoy
    # lets through (60 KiB of headers), and log a refusal by its kind alone
    logging.getLogger("aiohttp.server").addFilter(_no_request_content)
    # auto_decompress off: vLLM reads the bytes as sent (a deflate body is its 400), and aiohttp's default inflated
    # a deflate upload to 614-745 MB
    rep.runner = web.AppRunner(build_app(rep), access_log=None, max_line_size=65536, max_field_size=65536,
                               keepalive_timeout=args.keep_alive_s, handler_cancellation=True, auto_decompress=False)
    await rep.runner.setup()
    rep.ssl = None
    if args.tls_cert:
        import ssl

        rep.ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        rep.ssl.load_cert_chain(args.tls_cert, args.tls_key)
    rep.site = web.TCPSite(rep.runner, args.host, args.port, reuse_address=True, ssl_context=rep.ssl)
    await rep.site.start()
    rep.port = rep.runner.addresses[0][1]
    if rep.kv is not None:
        rep.kv.port = rep.port
        asyncio.get_running_loop().create_task(rep.kv.lease_loop())
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

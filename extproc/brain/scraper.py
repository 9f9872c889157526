"""GET every replica's /metrics: health on the 3 s cadence (EJECTED ones too, their only way back, A2),
load in between every ``warm.load_refresh_s`` when the policy reads it (C6).

The parser reads only the vLLM series the router uses, line by line (the text of a vLLM with
histograms runs to tens of KiB; a full Prometheus parse of it at 2 Hz per replica would cost more
than the routing). A value that is not a finite number in its sane range makes the scrape fail
with the reason: a replica that reports nonsense is not believed, and is not routed to either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import orjson
from aiohttp import ClientSession, ClientTimeout

from ..core import LoadSample, Router
from ..core.models import MAX_PATH_CHARS, MAX_PATHS
from . import logs
from .stats import BrainStats

@dataclass(frozen=True, eq=False)  # hashed by identity: one wanted-name set per dialect
class Dialect:
    """The metric names of one engine's /metrics: the same load signals under each engine's names."""

    running: str
    waiting: str
    kv: tuple[str, ...]  # KV-cache usage, 0..1 (several: the highest of those present)
    counters: dict[str, str]  # counter -> LoadSample field, summed over every label set
    cache_info: str | None = None  # an info metric whose labels give the cache size (vLLM)
    cache_tokens: str | None = None  # a gauge whose value is the cache size in tokens (SGLang)
    # (metric, label, value) of a counter read from one label set only -> the LoadSample field it feeds
    by_label: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # a label whose values other than "0" mark copies of the same numbers (SGLang's tp_rank: with
    # --enable-metrics-for-all-schedulers every tensor-parallel rank exports its scheduler's gauges and counters)
    copy_label: str | None = None
    # the label that tells data-parallel engines apart (each has its own scheduler and KV cache)
    engine_label: str | None = None
    # older names of a counter, read only when the current name is absent (vLLM 0.9 exported both)
    fallback: dict[str, str] = field(default_factory=dict)
    lora_info: str | None = None  # an info gauge of the adapters in use, its newest label set the present one
    # counters that move whenever the engine works (first tokens, streamed tokens, finished requests); a dialect
    # that names them has gauges that move only at some scheduler steps (SGLang): see Scraper.unstale
    activity: tuple[str, ...] = ()
    # the LoadSample count of the requests whose tokens prompt_tokens holds (vLLM counts them at the first token,
    # SGLang when the request finishes): the prefill rate pairs the mean request of each side
    prompt_counted: str = "first_tokens"
    name: str = ""
    # what a /metrics without this engine's metrics most likely means, said in the scrape reason
    missing_hint: str = ""

    def wanted(self) -> frozenset[str]:
        return frozenset((self.running, self.waiting, *self.kv, *self.counters, *(k[0] for k in self.by_label),
                          *self.fallback, *self.activity,
                          *(n for n in (self.cache_info, self.cache_tokens, self.lora_info) if n)))


VLLM = Dialect(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # renamed in vLLM 0.10; accept both
    counters={
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "cached_tokens",
        "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:request_decode_time_seconds_sum": "decode_seconds",
        "vllm:e2e_request_latency_seconds_count": "requests_done",
        "vllm:time_to_first_token_seconds_count": "first_tokens",
        "vllm:request_prefill_time_seconds_count": "prefill_done",
        "vllm:request_prefill_kv_computed_tokens_sum": "computed_at_finish",
        "vllm:request_generation_tokens_sum": "generated_at_finish",
        "vllm:request_decode_time_seconds_count": "decode_done",
    },
    fallback={"vllm:gpu_prefix_cache_hits_total": "cached_tokens"},
    cache_info="vllm:cache_config_info",
    lora_info="vllm:lora_requests_info",
    by_label={("vllm:prompt_tokens_by_source_total", "source", "local_compute"): "computed_tokens"},
    engine_label="engine",
    name="vllm",
    # vLLM's async_llm.py builds its stat loggers only when log_stats is on: --disable-log-stats leaves /metrics
    # with the process and HTTP metrics and no vllm:* engine metrics
    missing_hint="a vLLM started with --disable-log-stats exports no engine metrics: drop the flag, or set the "
                 "replica's engine: none (or auto)",
)
# sgl-project/sglang python/sglang/srt/metrics/collector.py (docs/references/production_metrics.md)
SGLANG = Dialect(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv=("sglang:token_usage",),
    counters={
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "cached_tokens",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:e2e_request_latency_seconds_count": "requests_done",
        "sglang:time_to_first_token_seconds_count": "first_tokens",
        "sglang:inter_token_latency_seconds_sum": "itl_seconds",
        "sglang:inter_token_latency_seconds_count": "itl_tokens",
    },
    cache_tokens="sglang:max_total_num_tokens",
    # newer SGLang: each request's prefill, from its entry into the running batch (req_time_stats.py)
    by_label={("sglang:per_stage_req_latency_seconds_sum", "stage", "prefill_forward"): "prefill_seconds",
              ("sglang:per_stage_req_latency_seconds_count", "stage", "prefill_forward"): "prefill_done"},
    prompt_counted="requests_done",  # TokenizerMetricsCollector.observe_one_finished_request
    copy_label="tp_rank",  # dp_rank ranks are different schedulers: those are separate engines
    engine_label="dp_rank",
    activity=("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count",
              "sglang:e2e_request_latency_seconds_count"),
    name="sglang",
    missing_hint="SGLang exports engine metrics only when started with --enable-metrics: add it, or set the "
                 "replica's engine: none (or auto)",
)
DIALECTS = {"vllm": VLLM, "sglang": SGLANG}
# engine "none": no load metrics; health from GET /health, load from the brain's own reservations
HEALTH_PATH = "/health"

RUNNING, WAITING, KV_NAMES, CACHE_CONFIG, COUNTERS = VLLM.running, VLLM.waiting, VLLM.kv, VLLM.cache_info, VLLM.counters
MAX_REQUESTS = 100_000  # running or waiting beyond this on one replica is a broken exporter, not load
MAX_BLOCK_TOKENS = 1 << 16  # a block_size label beyond this is not one a cache uses
MODELS_PATH = "/v1/models"
OPENAPI_PATH = "/openapi.json"  # FastAPI's (vLLM, SGLang): the routes this process registered
MAX_MODELS = 1000  # a /v1/models longer than this is not believed (a replica serves a model and its adapters)
# what of a replica's model object is kept and shown in the union (the rest is the replica's business)
MODEL_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")
MAX_MODEL_FIELD_CHARS = 256  # a longer id or field is not a model name: the entry (or field) is dropped
# SGLang's gauges move at prefill batches and every decode_log_interval (40) decode steps, about once a second
# under load; activity counters that stood still this long while the gauges did too mean an idle engine
IDLE_AFTER_S = 5.0


_WANTED: dict[Dialect, frozenset[str]] = {}


@dataclass
class ScrapeResult:
    ok: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    error: str = ""
    sample: LoadSample | None = field(default=None, repr=False)
    missing: bool = False  # /metrics answered without this engine's metrics (another engine, or none exported)
    engine: str = ""  # engine "auto": the dialect that answered ("none": only /health did)
    activity: float | None = None  # the dialect's activity counters, summed (lazy gauges: see Scraper.unstale)


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split('",'):
        k, _, v = part.partition('="')
        out[k.strip()] = v.rstrip('"')
    return out


class _Engine:
    """One data-parallel engine's gauges while a text is parsed."""

    __slots__ = ("running", "waiting", "kv", "cache_tokens", "cache_blocks", "block")

    def __init__(self) -> None:
        self.running = self.waiting = 0.0
        self.kv: list[float] = []
        self.cache_tokens: int | None = None  # its own capacity (kv_cache_size_tokens, SGLang's max_total_num_tokens)
        self.cache_blocks: int | None = None  # vLLM's num_gpu_blocks x block_size: the front end's sum over engines
        self.block: int | None = None  # vLLM's block_size: what its prefix cache holds a whole number of


def parse_vllm_metrics(text: str) -> ScrapeResult:
    return parse_metrics(text, VLLM)


MAX_SERIES = 100_000  # health.max_metrics_series
MAX_ENGINES = 128  # health.max_engines
# a page this small parses in well under a millisecond: on the event loop; a larger one in the parse thread
INLINE_PARSE_BYTES = 256 * 1024


def parse_metrics(text: str, d: Dialect, max_series: int = MAX_SERIES, max_engines: int = MAX_ENGINES) -> ScrapeResult:
    """The load signals of one replica, or a failed result saying what was wrong with the text.

    Bounded in what it costs, not only in bytes: more than ``max_series`` sample lines, or more than
    ``max_engines`` data-parallel engines, fail the scrape at once with the cap named (90,000 engines took the
    brain to 937 MB and each decision to 80 ms)."""
    wanted = _WANTED.get(d) or _WANTED.setdefault(d, d.wanted())
    lines = text.count("\n")
    if lines > max_series:  # counted in C before any line is split: an upper bound on the series
        comments = text.count("\n#") + text.startswith("#")
        if lines - comments > max_series:
            return ScrapeResult(False, error=f"/metrics has {lines - comments:,} series: more than {max_series:,} "
                                             f"(health.max_metrics_series)")
    engines: dict[str, _Engine] = {}
    counters: dict[str, float] = {}
    fallback: dict[str, float] = {}
    activity = 0.0
    lora: tuple[float, dict[str, str]] | None = None
    prefix_caching = None
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            return ScrapeResult(False, error=f"unparsable metrics line: {line[:80]!r}")
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name not in wanted:
            continue
        lab = _labels(line[brace + 1:line.rfind("}")]) if brace == end else {}
        if d.copy_label is not None and lab.get(d.copy_label, "0") != "0":
            continue  # the same scheduler's numbers once more, from another tensor-parallel rank
        rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            return ScrapeResult(False, error=f"unparsable value of {name}")
        if not math.isfinite(value) or value < 0:
            return ScrapeResult(False, error=f"{name} is {value}: not a finite number >= 0")
        if name in d.activity:
            activity += value
        if name == d.lora_info:
            if lora is None or value >= lora[0]:
                lora = (value, lab)
            continue
        if name == d.running or name == d.waiting or name in d.kv or name == d.cache_info or name == d.cache_tokens:
            key = lab.get(d.engine_label, "0") if d.engine_label else "0"
            e = engines.get(key)
            if e is None:
                if len(engines) >= max_engines:
                    return ScrapeResult(False, error=f"/metrics names more than {max_engines} engines "
                                                     f"({d.engine_label} label; health.max_engines)")
                e = engines[key] = _Engine()
            if name == d.running:
                e.running += value
                seen = True
            elif name == d.waiting:
                e.waiting += value
            elif name in d.kv:
                e.kv.append(value)
            elif name == d.cache_tokens:
                e.cache_tokens = int(value) or None
            else:
                # newer vLLM says each engine's capacity itself; blocks x block size is the front end's sum over
                # its data-parallel engines, and on a hybrid model (sliding window, Mamba) not the capacity at all
                try:
                    if lab.get("kv_cache_size_tokens", "").isdigit():
                        e.cache_tokens = int(lab["kv_cache_size_tokens"])
                    else:
                        e.cache_blocks = int(lab["num_gpu_blocks"]) * int(lab.get("block_size", "16"))
                except (KeyError, ValueError):
                    pass
                bs = lab.get("block_size", "")
                if bs.isdigit() and 0 < int(bs) <= MAX_BLOCK_TOKENS:
                    e.block = int(bs)
                if lab.get("enable_prefix_caching") in ("True", "False"):  # CacheConfig's fields as str()
                    prefix_caching = lab["enable_prefix_caching"] == "True"
        elif name in d.counters:
            field_name = d.counters[name]
            counters[field_name] = counters.get(field_name, 0.0) + value
        elif name in d.fallback:
            field_name = d.fallback[name]
            fallback[field_name] = fallback.get(field_name, 0.0) + value
        elif name not in d.activity:  # a counter of by_label: only the label set it names
            for (metric, key, want), field_name in d.by_label.items():
                if metric == name and lab.get(key) == want:
                    counters[field_name] = counters.get(field_name, 0.0) + value
    if not seen:
        return ScrapeResult(False, error=f"no {d.running} in /metrics ({d.missing_hint})", missing=True)
    for k, v in fallback.items():
        counters.setdefault(k, v)
    running = sum(e.running for e in engines.values())
    waiting = sum(e.waiting for e in engines.values())
    if running > MAX_REQUESTS or waiting > MAX_REQUESTS:
        return ScrapeResult(False, error=f"{d.running}/{d.waiting} {running:g}/{waiting:g}: beyond {MAX_REQUESTS:,}")
    kv_usage = max((max(e.kv) for e in engines.values() if e.kv), default=0.0)
    if kv_usage > 1.0 + 1e-9:
        return ScrapeResult(False, error=f"KV cache usage {kv_usage:g}: beyond 1 (100%)")
    ranked = [engines[k] for k in sorted(engines, key=lambda k: (len(k), k))]
    n = len(ranked)
    caps = [e.cache_tokens or (e.cache_blocks // n if e.cache_blocks else None) for e in ranked]
    cache_tokens = sum(c for c in caps if c) or None
    per_engine = None
    if n > 1:
        per_engine = tuple(LoadSample(int(round(e.running)), int(round(e.waiting)), max(e.kv) if e.kv else 0.0,
                                      cache_tokens=c) for e, c in zip(ranked, caps))
    r, w = int(round(running)), int(round(waiting))
    if lora is not None:
        lab = lora[1]
        counters["lora_running"] = frozenset(a for a in lab.get("running_lora_adapters", "").split(",") if a)
        counters["lora_waiting"] = frozenset(a for a in lab.get("waiting_lora_adapters", "").split(",") if a)
        counters["max_lora"] = int(lab["max_lora"]) if lab.get("max_lora", "").isdigit() else None
    if d.prompt_counted in counters:
        counters["prompt_requests"] = counters[d.prompt_counted]
    engine_block = next((e.block for e in ranked if e.block), None)
    sample = LoadSample(r, w, kv_usage, cache_tokens=cache_tokens, prefix_caching=prefix_caching, engines=per_engine,
                        engine_block=engine_block, **counters)
    return ScrapeResult(True, r, w, kv_usage, sample=sample, engine=d.name, activity=activity if d.activity else None)


def _document(text: str):
    """A replica's JSON answer, nested at most 1,024 deep (orjson's limit): ``json`` would raise RecursionError on
    a document 100,000 deep, and kill the replica's scrape task at every scrape. ValueError when it is not JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ValueError(str(e)) from None


def _shown(v) -> bool:
    """A value the brain may keep and show (in /state, logs, GET /v1/models): printable, no escape codes or newlines."""
    return isinstance(v, int) or v.isprintable()


def parse_models(text: str) -> list[dict] | None:
    """The model objects of a /v1/models answer, each cut to MODEL_FIELDS of bounded size; None when the text is
    not such an answer or lists more than MAX_MODELS (what the brain keeps per replica stays small whatever a
    replica, or whoever answers in its place, sends)."""
    try:
        data = _document(text)["data"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, list) or len(data) > MAX_MODELS:
        return None
    out = []
    for m in data:
        mid = m.get("id") if isinstance(m, dict) else None
        if isinstance(mid, str) and 0 < len(mid) <= MAX_MODEL_FIELD_CHARS and mid.isprintable():
            out.append({k: m[k] for k in MODEL_FIELDS if isinstance(m.get(k), (str, int))
                        and not isinstance(m[k], bool) and len(str(m[k])) <= MAX_MODEL_FIELD_CHARS and _shown(m[k])})
    return out


def parse_openapi_paths(text: str) -> list[str] | None:
    """The paths an /openapi.json lists (bounded like /v1/models); None when it is not such a document."""
    try:
        paths = _document(text)["paths"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(paths, dict) or not paths or len(paths) > MAX_PATHS:
        return None
    return [p for p in paths if isinstance(p, str) and p.startswith("/") and len(p) <= MAX_PATH_CHARS
            and p.isprintable() and " " not in p]


def tls_context(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """What an https:// replica's scrape checks: its chain against ``ca_file`` (the system's by default), its name,
    and our client certificate when one is configured."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


class Scraper:
    """Feeds the router's health machines and load signals; remembers each replica's last error."""

    def __init__(self, router: Router, stats: BrainStats, clock: Callable[[], float], interval_s: float,
                 load_refresh_s: float | None = None, max_bytes: int = 4 * 1024 * 1024):
        self.max_bytes = max_bytes  # health.max_metrics_bytes: a /metrics past this is a failed scrape
        self.router = router
        self.stats = stats
        self.clock = clock
        self.interval_s = interval_s  # health cadence (A1: 3 s)
        self.load_refresh_s = load_refresh_s  # C6: faster load-only scrapes in between (None: none)
        self.urls: dict[str, str] = {}
        self.engines: dict[str, str] = {}  # replica -> "vllm" | "sglang" | "none" | "auto" (absent: vllm)
        self.detected: dict[str, str] = {}  # engine "auto": what its last good scrape found
        self.tls: dict[str, tuple[ssl.SSLContext, str]] = {}  # https:// replicas: (context, SNI)
        self.errors: dict[str, str] = {}
        self.models_wanted: set[str] = set()  # replicas whose models are read from /v1/models at each health scrape
        self.on_models: Callable[[str, "list[dict] | None"], bool] = lambda name, models: False
        # replicas whose API paths are read from /openapi.json, once after each start (or model change)
        self.paths_wanted: set[str] = set()
        self.paths_due: set[str] = set()  # ... and whose paths are to be read at the next good health scrape
        self.on_paths: Callable[[str, "list[str] | None"], None] = lambda name, paths: None
        # lazy gauges: replica -> (activity counters, gauges, since when both stood still)
        self._still: dict[str, tuple[float, tuple[int, int], float]] = {}
        self.loop_errors = 0
        self.seconds = None  # a prometheus Histogram, set by the brain
        self.max_series, self.max_engines = MAX_SERIES, MAX_ENGINES  # health.max_metrics_series, max_engines
        # One thread parses the large pages: a replica's 4 MiB page never holds the event loop (decisions, the other
        # replicas' scrapes), and a flood of them queues behind each other, not beside the loop
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="scrape-parse")
        # seconds the event loop was seen stalled (LoopWatch): a deadline that expired while the loop stood still
        # says nothing about the replica
        self.stalled_s = 0.0
        self.deferred = 0  # timeouts not counted against a replica because the loop had stalled meanwhile

    async def _parse(self, text: str, d: Dialect) -> ScrapeResult:
        if len(text) <= INLINE_PARSE_BYTES:
            return parse_metrics(text, d, self.max_series, self.max_engines)
        return await asyncio.get_running_loop().run_in_executor(
            self._parser, parse_metrics, text, d, self.max_series, self.max_engines)

    async def watch_loop(self, tick_s: float = 0.05) -> None:
        """Measure how long the event loop stood still (a tick that came late): what scrape deadlines discount."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(tick_s)
            late = time.monotonic() - t0 - tick_s
            if late > 0.02:
                self.stalled_s += late

    def engine_of(self, name: str) -> str:
        """The engine whose metrics the replica exports: the configured one, or what "auto" found."""
        engine = self.engines.get(name, "vllm")
        return self.detected.get(name, "vllm") if engine == "auto" else engine

    async def scrape_once(self, session: ClientSession, name: str, url: str, timeout: float | None = None) -> ScrapeResult:
        t0 = time.perf_counter()
        engine = self.engines.get(name, "vllm")
        stalled = self.stalled_s
        r = await self._fetch(session, url, timeout, engine, self.tls.get(name), self.detected.get(name))
        if timeout and not r.ok and r.error.startswith("timeout") and self.stalled_s - stalled > 0.25 * timeout:
            # the deadline ran out while the loop stood still (whatever held it): once more, on a fresh deadline
            self.deferred += 1
            self.stats.scrapes[(name, "deferred")] += 1
            r = await self._fetch(session, url, timeout, engine, self.tls.get(name), self.detected.get(name))
        if engine == "auto" and r.ok:
            if self.detected.get(name) != r.engine:
                logs.event("engine_detected", replica=name, engine=r.engine)
            self.detected[name] = r.engine
        if self.seconds is not None:
            self.seconds.observe(time.perf_counter() - t0)
        self.stats.scrapes[(name, "ok" if r.ok else "failed")] += 1
        return r

    async def _fetch(self, session: ClientSession, url: str, timeout: float | None, engine: str = "vllm",
                     tls: "tuple[ssl.SSLContext, str] | None" = None, prefer: str | None = None) -> ScrapeResult:
        if engine == "none":
            got = await self._get(session, url, HEALTH_PATH, timeout, tls, engine)
            return got if isinstance(got, ScrapeResult) else ScrapeResult(True)  # alive; its load is the brain's own
        got = await self._get(session, url, "/metrics", timeout, tls, engine)
        if engine != "auto":
            return got if isinstance(got, ScrapeResult) else await self._parse(got, DIALECTS[engine])
        # engine "auto": one read of /metrics, parsed as the engine found last first; with neither engine's
        # metrics in it (or no /metrics at all) the replica runs as "none", on /health
        if isinstance(got, str):
            order = [prefer] if prefer in DIALECTS else []
            for d in (*order, *(k for k in DIALECTS if k not in order)):
                r = await self._parse(got, DIALECTS[d])
                if not r.missing:
                    return r
        elif not got.error.startswith("HTTP 404 from /metrics"):
            return got
        health = await self._get(session, url, HEALTH_PATH, timeout, tls, "none")
        return health if isinstance(health, ScrapeResult) else ScrapeResult(True, engine="none")

    async def _get(self, session: ClientSession, url: str, path: str, timeout: float | None,
                   tls: "tuple[ssl.SSLContext, str] | None", engine: str) -> "ScrapeResult | str":
        """The text at ``url + path``, or the failed result that says why."""
        try:
            kw: dict = {"timeout": ClientTimeout(total=timeout)} if timeout else {}
            if tls is not None:
                kw["ssl"], kw["server_hostname"] = tls
            async with session.get(url + path, **kw) as resp:
                if resp.status != 200:
                    hint = ""
                    if resp.status == 404 and path == "/metrics":
                        hint = (f" ({SGLANG.missing_hint})" if engine == "sglang" else
                                " (no /metrics: set the replica's engine: sglang, none or auto)")
                    return ScrapeResult(False, error=f"HTTP {resp.status} from {path}{hint}")
                if path == HEALTH_PATH:
                    return ""
                # never more than max_bytes in memory: a /metrics that streams forever (or 50 MB of it) must not
                # grow the brain nor be parsed twice a second
                too_big = ScrapeResult(False, error=f"{path} larger than {self.max_bytes} bytes (health.max_metrics_bytes)")
                if resp.content_length is not None and resp.content_length > self.max_bytes:
                    return too_big
                buf = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    buf += chunk
                    if len(buf) > self.max_bytes:
                        return too_big
                return buf.decode("utf-8", "replace")
        except asyncio.TimeoutError:
            return ScrapeResult(False, error=f"timeout on {path}")
        except Exception as e:  # connection refused, reset, DNS...: every one means "failed scrape"
            return ScrapeResult(False, error=f"{type(e).__name__} on {path}")

    async def fetch_models(self, session: ClientSession, name: str, url: str, timeout: float) -> list[dict] | None:
        """The models a replica's /v1/models lists, or None when it cannot be read (the last list stays)."""
        got = await self._get(session, url, MODELS_PATH, timeout, self.tls.get(name), "models")
        return parse_models(got) if isinstance(got, str) else None

    def unstale(self, name: str, r: ScrapeResult, now: float) -> ScrapeResult:
        """An engine whose gauges move only at some steps (SGLang) keeps showing its last batch after it went
        idle, for up to ~30 s. When its activity counters (first tokens, streamed tokens, finished requests)
        and its gauges have all stood still for IDLE_AFTER_S, nothing runs there: read it as idle.

        A single prefill longer than that moves nothing either, and is then read as idle until it ends;
        the brain still counts its own requests in flight there."""
        if not r.ok or r.activity is None or r.sample is None:
            return r
        gauges = (r.running, r.waiting)
        prev = self._still.get(name)
        if prev is None or prev[0] != r.activity or prev[1] != gauges:
            self._still[name] = (r.activity, gauges, now)
            return r
        if now - prev[2] < IDLE_AFTER_S or gauges == (0, 0):
            return r
        s = r.sample
        engines = tuple(dataclasses.replace(e, running=0, waiting=0) for e in s.engines) if s.engines else None
        return dataclasses.replace(r, running=0, waiting=0,
                                   sample=dataclasses.replace(s, running=0, waiting=0, engines=engines))

    def apply(self, name: str, r: ScrapeResult, now: float) -> None:
        """A health scrape: its result moves the health machine."""
        r = self.unstale(name, r, now)
        before = self.errors.get(name)
        if r.ok:
            self.errors.pop(name, None)
            if before is not None:
                logs.event("scrape_recovered", replica=name, after=before)
        else:
            self.errors[name] = r.error
            if before != r.error:  # once per change of reason, not every scrape
                logs.event("scrape_failed", replica=name, reason=r.error)
        self.router.on_scrape(name, r.ok, now, r.running, r.waiting, r.kv_usage, sample=r.sample)

    def apply_load(self, name: str, r: ScrapeResult, now: float) -> None:
        """A load-only scrape: fresher signals; a failure waits for the next health scrape to count."""
        r = self.unstale(name, r, now)
        if r.ok and r.sample is not None:
            self.router.on_load(name, r.sample, now)

    async def loop(self) -> None:
        """One task per replica, so that a slow or huge /metrics delays only its own replica's scrapes; the
        set of tasks follows the replica list (a reload adds and removes replicas)."""
        async with ClientSession() as session:
            tasks: dict[str, asyncio.Task] = {"": asyncio.create_task(self.watch_loop(), name="scrape-loop-watch")}
            try:
                while True:
                    for name in [n for n in tasks if n and n not in self.urls]:
                        tasks.pop(name).cancel()
                        self._still.pop(name, None)
                    for name in self.urls:
                        if name not in tasks or tasks[name].done():
                            tasks[name] = asyncio.create_task(self._replica_loop(session, name), name=f"scrape-{name}")
                    await asyncio.sleep(min(0.5, self.interval_s))
            finally:
                for t in tasks.values():
                    t.cancel()

    async def fetch_paths(self, session: ClientSession, name: str, url: str,
                          timeout: float) -> "tuple[bool, list[str] | None]":
        """(read, paths): the paths its /openapi.json lists; (True, None) when it has none to give (a 4xx, or not
        an OpenAPI document: any path then); (False, None) when it could not be asked (ask again)."""
        got = await self._get(session, url, OPENAPI_PATH, timeout, self.tls.get(name), "paths")
        if isinstance(got, str):
            return True, parse_openapi_paths(got)
        return got.error.startswith("HTTP 4"), None

    async def _replica_loop(self, session: ClientSession, name: str) -> None:
        next_health = self.clock()
        was_ok = False  # a replica's routes are read at its first good scrape, and again after a failed one
        while name in self.urls:
            # read each round: a reload may change the cadence, the policy or the URL
            health_timeout = max(0.05, min(2.0, self.interval_s * 0.8))
            fast = self.load_refresh_s if self.load_refresh_s and self.load_refresh_s < self.interval_s else None
            started = self.clock()
            health = fast is None or started >= next_health - 1e-3
            # an engine without load metrics ("none") has nothing to refresh between health scrapes
            if health or self.engine_of(name) != "none":
                timeout = health_timeout if health else max(0.05, fast * 0.8)
                r = await self.scrape_once(session, name, self.urls[name], timeout)
                try:
                    if name in self.urls:
                        (self.apply if health else self.apply_load)(name, r, self.clock())
                except Exception as e:  # one replica's bad data must not stop its scraping
                    self.loop_errors += 1
                    logs.event("loop_error", loop="scrape", replica=name, error=f"{type(e).__name__}: {e}"[:200])
            if health and name in self.models_wanted and name in self.urls:
                models = await self.fetch_models(session, name, self.urls[name], health_timeout)
                try:
                    if self.on_models(name, models):  # another model list: another process, maybe another runner
                        self.paths_due.add(name)
                except Exception as e:
                    self.loop_errors += 1
                    logs.event("loop_error", loop="models", replica=name, error=f"{type(e).__name__}: {e}"[:200])
            if health:
                if r.ok and not was_ok:
                    self.paths_due.add(name)
                was_ok = r.ok
            if health and r.ok and name in self.paths_due and name in self.paths_wanted and name in self.urls:
                read, paths = await self.fetch_paths(session, name, self.urls[name], health_timeout)
                if read:
                    self.paths_due.discard(name)
                    try:
                        self.on_paths(name, paths)
                    except Exception as e:
                        self.loop_errors += 1
                        logs.event("loop_error", loop="paths", replica=name, error=f"{type(e).__name__}: {e}"[:200])
            if health:
                next_health = started + self.interval_s
            step = self.interval_s if fast is None else fast
            wake = min(started + step, next_health)
            await asyncio.sleep(max(0.0, wake - self.clock()))


__all__ = ["RUNNING", "WAITING", "KV_NAMES", "COUNTERS", "DIALECTS", "Dialect", "ScrapeResult", "parse_metrics",
           "parse_vllm_metrics", "Scraper"]

"""GET every replica's /metrics: health on the 3 s cadence (EJECTED ones too, their only way back, A2),
load in between every ``warm.load_refresh_s`` when the policy reads it (C6).

The parser reads only the vLLM series the router uses, line by line (the text of a vLLM with
histograms runs to tens of KiB; a full Prometheus parse of it at 2 Hz per replica would cost more
than the routing). A value that is not a finite number in its sane range makes the scrape fail
with the reason: a replica that reports nonsense is not believed, and is not routed to either.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import ClientSession, ClientTimeout

from ..core import LoadSample, Router
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
    name: str = ""
    # what a /metrics without this engine's metrics most likely means, said in the scrape reason
    missing_hint: str = ""

    def wanted(self) -> frozenset[str]:
        return frozenset((self.running, self.waiting, *self.kv, *self.counters, *(k[0] for k in self.by_label),
                          *(n for n in (self.cache_info, self.cache_tokens) if n)))


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
    },
    cache_info="vllm:cache_config_info",
    by_label={("vllm:prompt_tokens_by_source_total", "source", "local_compute"): "computed_tokens"},
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
    },
    cache_tokens="sglang:max_total_num_tokens",
    copy_label="tp_rank",  # dp_rank ranks are different schedulers: those are summed
    name="sglang",
    missing_hint="SGLang exports engine metrics only when started with --enable-metrics: add it, or set the "
                 "replica's engine: none (or auto)",
)
DIALECTS = {"vllm": VLLM, "sglang": SGLANG}
# engine "none": no load metrics; health from GET /health, load from the brain's own reservations
HEALTH_PATH = "/health"

RUNNING, WAITING, KV_NAMES, CACHE_CONFIG, COUNTERS = VLLM.running, VLLM.waiting, VLLM.kv, VLLM.cache_info, VLLM.counters
MAX_REQUESTS = 100_000  # running or waiting beyond this on one replica is a broken exporter, not load


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


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split('",'):
        k, _, v = part.partition('="')
        out[k.strip()] = v.rstrip('"')
    return out


def parse_vllm_metrics(text: str) -> ScrapeResult:
    return parse_metrics(text, VLLM)


def parse_metrics(text: str, d: Dialect) -> ScrapeResult:
    """The load signals of one replica, or a failed result saying what was wrong with the text."""
    wanted = _WANTED.get(d) or _WANTED.setdefault(d, d.wanted())
    running = waiting = 0.0
    kv: list[float] = []
    counters: dict[str, float] = {}
    cache_tokens = None
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
        if d.copy_label is not None and brace == end:
            copy = _labels(line[brace + 1:line.rfind("}")]).get(d.copy_label)
            if copy is not None and copy != "0":
                continue  # the same scheduler's numbers once more, from another tensor-parallel rank
        rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            return ScrapeResult(False, error=f"unparsable value of {name}")
        if not math.isfinite(value) or value < 0:
            return ScrapeResult(False, error=f"{name} is {value}: not a finite number >= 0")
        if name == d.running:
            running += value
            seen = True
        elif name == d.waiting:
            waiting += value
        elif name in d.kv:
            kv.append(value)
        elif name == d.cache_info:
            lab = _labels(line[brace + 1:line.rfind("}")])
            try:
                # newer vLLM says the capacity itself; on a hybrid model (sliding window, Mamba) the blocks x block
                # size product is not it (vLLM's own cache config says so)
                cache_tokens = (int(lab["kv_cache_size_tokens"]) if lab.get("kv_cache_size_tokens", "").isdigit()
                                else int(lab["num_gpu_blocks"]) * int(lab.get("block_size", "16")))
            except (KeyError, ValueError):
                pass
            if lab.get("enable_prefix_caching") in ("True", "False"):  # vLLM exports CacheConfig's fields as str()
                prefix_caching = lab["enable_prefix_caching"] == "True"
        elif name == d.cache_tokens:
            cache_tokens = int(value) or None
        elif name not in d.counters:  # a counter of by_label: only the label set it names
            lab = _labels(line[brace + 1:line.rfind("}")]) if brace == end else {}
            for (metric, key, want), field_name in d.by_label.items():
                if metric == name and lab.get(key) == want:
                    counters[field_name] = counters.get(field_name, 0.0) + value
        else:
            field_name = d.counters[name]
            counters[field_name] = counters.get(field_name, 0.0) + value
    if not seen:
        return ScrapeResult(False, error=f"no {d.running} in /metrics ({d.missing_hint})", missing=True)
    if running > MAX_REQUESTS or waiting > MAX_REQUESTS:
        return ScrapeResult(False, error=f"{d.running}/{d.waiting} {running:g}/{waiting:g}: beyond {MAX_REQUESTS:,}")
    kv_usage = max(kv) if kv else 0.0
    if kv_usage > 1.0 + 1e-9:
        return ScrapeResult(False, error=f"KV cache usage {kv_usage:g}: beyond 1 (100%)")
    r, w = int(round(running)), int(round(waiting))
    sample = LoadSample(r, w, kv_usage, cache_tokens=cache_tokens, prefix_caching=prefix_caching, **counters)
    return ScrapeResult(True, r, w, kv_usage, sample=sample, engine=d.name)


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
        self.loop_errors = 0
        self.seconds = None  # a prometheus Histogram, set by the brain

    def engine_of(self, name: str) -> str:
        """The engine whose metrics the replica exports: the configured one, or what "auto" found."""
        engine = self.engines.get(name, "vllm")
        return self.detected.get(name, "vllm") if engine == "auto" else engine

    async def scrape_once(self, session: ClientSession, name: str, url: str, timeout: float | None = None) -> ScrapeResult:
        t0 = time.perf_counter()
        engine = self.engines.get(name, "vllm")
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
            return got if isinstance(got, ScrapeResult) else parse_metrics(got, DIALECTS[engine])
        # engine "auto": one read of /metrics, parsed as the engine found last first; with neither engine's
        # metrics in it (or no /metrics at all) the replica runs as "none", on /health
        if isinstance(got, str):
            order = [prefer] if prefer in DIALECTS else []
            for d in (*order, *(k for k in DIALECTS if k not in order)):
                r = parse_metrics(got, DIALECTS[d])
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

    def apply(self, name: str, r: ScrapeResult, now: float) -> None:
        """A health scrape: its result moves the health machine."""
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
        if r.ok and r.sample is not None:
            self.router.on_load(name, r.sample, now)

    async def loop(self) -> None:
        """One task per replica, so that a slow or huge /metrics delays only its own replica's scrapes; the
        set of tasks follows the replica list (a reload adds and removes replicas)."""
        async with ClientSession() as session:
            tasks: dict[str, asyncio.Task] = {}
            try:
                while True:
                    for name in [n for n in tasks if n not in self.urls]:
                        tasks.pop(name).cancel()
                    for name in self.urls:
                        if name not in tasks or tasks[name].done():
                            tasks[name] = asyncio.create_task(self._replica_loop(session, name), name=f"scrape-{name}")
                    await asyncio.sleep(min(0.5, self.interval_s))
            finally:
                for t in tasks.values():
                    t.cancel()

    async def _replica_loop(self, session: ClientSession, name: str) -> None:
        next_health = self.clock()
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
            if health:
                next_health = started + self.interval_s
            step = self.interval_s if fast is None else fast
            wake = min(started + step, next_health)
            await asyncio.sleep(max(0.0, wake - self.clock()))


__all__ = ["RUNNING", "WAITING", "KV_NAMES", "COUNTERS", "DIALECTS", "Dialect", "ScrapeResult", "parse_metrics",
           "parse_vllm_metrics", "Scraper"]

"""GET every replica's /metrics: health on the 3 s cadence (EJECTED ones too, their only way back, A2),
load in between every ``warm.load_refresh_s`` when the policy reads it (C6). What the answers say is read in
``exposition``; here, when to ask, with what deadline, and what the router hears.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from aiohttp import ClientSession, ClientTimeout
from prometheus_client import Histogram

from ..core import Router
from . import logs
from .exposition import (  # noqa: F401 (also read from here by tools and tests)
    Dialect, VLLM, SGLANG, DIALECTS, HEALTH_PATH, RUNNING, WAITING, KV_NAMES, COUNTERS, MODELS_PATH, OPENAPI_PATH,
    MAX_MODELS, MAX_MODEL_FIELD_CHARS, IDLE_AFTER_S, ScrapeResult, parse_vllm_metrics, MAX_SERIES, MAX_ENGINES,
    INLINE_PARSE_BYTES, parse_metrics, parse_models, parse_openapi_paths,
)
from .stats import BrainStats

KV_SOURCES_PATH = "/kv_event_sources"  # vLLM 0.32: each engine's KV events publisher


def tls_context(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """What an https:// replica's scrape checks: its chain against ``ca_file`` (the system's by default), its name,
    and our client certificate when one is configured."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ScrapeListener:
    """What a replica's health scrape found beyond its metrics, for those who keep it (the brain's model catalog,
    exact mode's publishers); each hears what it overrides."""

    def on_models(self, name: str, models: "list[dict] | None") -> bool:
        """``/v1/models`` read (None: it failed); True when the replica serves another list than before."""
        return False

    def on_paths(self, name: str, paths: "list[str] | None") -> None:
        """``/openapi.json`` read (None: the replica does not publish one)."""

    def on_kv_sources(self, name: str, url: str, listed: "dict | None") -> None:
        """``/kv_event_sources`` read (None: not listed)."""


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
        # replicas whose API paths are read from /openapi.json, once after each start (or model change)
        self.paths_wanted: set[str] = set()
        self.paths_due: set[str] = set()  # ... and whose paths are to be read at the next good health scrape
        # replicas whose KV event publishers are read from /kv_event_sources after each start (exact_cache)
        self.kv_wanted: set[str] = set()
        self.kv_due: set[str] = set()
        self.listeners: list[ScrapeListener] = []  # told what a replica's scrapes found beyond its metrics
        # lazy gauges: replica -> (activity counters, gauges, since when both stood still)
        self._still: dict[str, tuple[float, tuple[int, int], float]] = {}
        self.loop_errors = 0
        self.seconds: Histogram | None = None  # set by the brain
        self.max_series, self.max_engines = MAX_SERIES, MAX_ENGINES  # health.max_metrics_series, max_engines
        # One thread parses the large pages: a replica's 4 MiB page never holds the event loop (decisions, the other
        # replicas' scrapes), and a flood of them queues behind each other, not beside the loop
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="scrape-parse")
        # seconds the event loop was seen stalled (LoopWatch): a deadline that expired while the loop stood still
        # says nothing about the replica
        self.stalled_s = 0.0
        self.deferred = 0  # timeouts not counted against a replica because the loop had stalled meanwhile

    def configure(self, health, load_refresh_s: float | None) -> None:
        """The cadence and the bounds from the config's ``router.health`` (at start and at each reload), and the
        load-only refresh between health scrapes (None: none)."""
        self.interval_s, self.load_refresh_s = health.scrape_interval_s, load_refresh_s
        self.max_bytes, self.max_series, self.max_engines = \
            health.max_metrics_bytes, health.max_metrics_series, health.max_engines

    async def _parse(self, text: str, d: Dialect) -> ScrapeResult:
        try:
            if len(text) <= INLINE_PARSE_BYTES:
                return parse_metrics(text, d, self.max_series, self.max_engines)
            return await asyncio.get_running_loop().run_in_executor(
                self._parser, parse_metrics, text, d, self.max_series, self.max_engines)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
            # a text the parser did not foresee fails this scrape, saying so: it never ends the replica's scraping
            return ScrapeResult(False, error=f"unreadable /metrics ({type(e).__name__})")

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

    async def scrape_once(self, session: ClientSession, name: str, url: str,
                          timeout: float | None = None) -> ScrapeResult:
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
                too_big = ScrapeResult(False,
                                       error=f"{path} larger than {self.max_bytes} bytes (health.max_metrics_bytes)")
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
        self.router.on_scrape(name, r.ok, now, r.running, r.waiting, r.kv_usage, sample=r.sample,
                              slow=not r.ok and r.error.startswith("timeout"))

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

    async def fetch_kv_sources(self, session: ClientSession, name: str, url: str,
                               timeout: float) -> "tuple[bool, dict | None]":
        """(read, sources): what its GET /kv_event_sources lists (vLLM 0.32: rank -> its KV events config);
        (True, None) when it has none (a 4xx: an engine without the route, or events off); (False, None) when it
        could not be asked (ask again)."""
        got = await self._get(session, url, KV_SOURCES_PATH, timeout, self.tls.get(name), "kv")
        if isinstance(got, str):
            try:
                listed = json.loads(got)
            except (ValueError, RecursionError):  # a page nested past Python's stack is no list of sources
                return True, None
            return True, listed if isinstance(listed, dict) else None
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
                if health or fast is None:
                    rep = self.router.find(name)
                    timeout = rep.health.scrape_deadline(started, health_timeout) if rep else health_timeout
                else:
                    timeout = max(0.05, fast * 0.8)
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
                    # another model list: another process, maybe another runner (every listener hears it)
                    if any([lst.on_models(name, models) for lst in self.listeners]):
                        self.paths_due.add(name)
                except Exception as e:
                    self.loop_errors += 1
                    logs.event("loop_error", loop="models", replica=name, error=f"{type(e).__name__}: {e}"[:200])
            if health:
                if r.ok and not was_ok:
                    self.paths_due.add(name)
                    self.kv_due.add(name)
                was_ok = r.ok
            if health and r.ok and name in self.kv_due and name in self.kv_wanted and name in self.urls:
                read, listed = await self.fetch_kv_sources(session, name, self.urls[name], health_timeout)
                if read:
                    self.kv_due.discard(name)
                    try:
                        for lst in self.listeners:
                            lst.on_kv_sources(name, self.urls[name], listed)
                    except Exception as e:
                        self.loop_errors += 1
                        logs.event("loop_error", loop="kv_sources", replica=name,
                                   error=f"{type(e).__name__}: {e}"[:200])
            if health and r.ok and name in self.paths_due and name in self.paths_wanted and name in self.urls:
                read, paths = await self.fetch_paths(session, name, self.urls[name], health_timeout)
                if read:
                    self.paths_due.discard(name)
                    try:
                        for lst in self.listeners:
                            lst.on_paths(name, paths)
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

"""GET every replica's /metrics on the health cadence, EJECTED ones too (their only way back, A2)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from aiohttp import ClientSession, ClientTimeout
from prometheus_client.parser import text_string_to_metric_families

from ..core import Router
from . import logs
from .stats import BrainStats

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; accept both.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass
class ScrapeResult:
    ok: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    error: str = ""


def parse_vllm_metrics(text: str) -> ScrapeResult:
    """Sum vLLM's gauges over every label set (one per engine / model)."""
    running = waiting = 0.0
    kv: list[float] = []
    seen = False
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == RUNNING:
                    running += s.value
                    seen = True
                elif s.name == WAITING:
                    waiting += s.value
                elif s.name in KV_NAMES:
                    kv.append(s.value)
    except ValueError as e:
        return ScrapeResult(False, error=f"unparsable metrics: {e}")
    if not seen:
        return ScrapeResult(False, error=f"no {RUNNING} in /metrics")
    return ScrapeResult(True, int(round(running)), int(round(waiting)), max(kv) if kv else 0.0)


class Scraper:
    """Feeds the router's health machines and load signals; remembers each replica's last error."""

    def __init__(self, router: Router, stats: BrainStats, clock: Callable[[], float], interval_s: float):
        self.router = router
        self.stats = stats
        self.clock = clock
        self.interval_s = interval_s
        self.urls: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.seconds = None  # a prometheus Histogram, set by the brain

    async def scrape_once(self, session: ClientSession, name: str, url: str) -> ScrapeResult:
        t0 = time.perf_counter()
        r = await self._fetch(session, url)
        if self.seconds is not None:
            self.seconds.observe(time.perf_counter() - t0)
        self.stats.scrapes[(name, "ok" if r.ok else "failed")] += 1
        return r

    async def _fetch(self, session: ClientSession, url: str) -> ScrapeResult:
        try:
            async with session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return ScrapeResult(False, error=f"HTTP {resp.status}")
                text = await resp.text()
        except asyncio.TimeoutError:
            return ScrapeResult(False, error="timeout")
        except Exception as e:  # connection refused, reset, DNS...: every one means "failed scrape"
            return ScrapeResult(False, error=type(e).__name__)
        return parse_vllm_metrics(text)

    def apply(self, name: str, r: ScrapeResult, now: float) -> None:
        if r.ok:
            self.errors.pop(name, None)
        else:
            self.errors[name] = r.error
        self.router.on_scrape(name, r.ok, now, r.running, r.waiting, r.kv_usage)

    async def loop(self) -> None:
        timeout = ClientTimeout(total=max(0.05, min(2.0, self.interval_s * 0.8)))
        async with ClientSession(timeout=timeout) as session:
            while True:
                started = self.clock()
                names = list(self.urls)
                results = await asyncio.gather(*(self.scrape_once(session, n, self.urls[n]) for n in names))
                now = self.clock()
                for n, r in zip(names, results):
                    self.apply(n, r, now)
                await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))


__all__ = ["RUNNING", "WAITING", "KV_NAMES", "ScrapeResult", "parse_vllm_metrics", "Scraper", "logs"]

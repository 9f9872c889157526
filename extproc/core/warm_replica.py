"""The warm policy's state of one replica (or data-parallel engine): its prefix index, learned rates, predicted
work, active sessions' contexts and arrivals."""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from .config import RouterConfig
from .engine_cache import Cleared, EngineCache
from .load import LoadSample, Rates, TokenScale
from .prefix_index import GONE, Holders, Mark, PrefixIndex
from .replica import Replica


class Marked(Protocol):
    """A session's pin as the index reads it (``Pin.mark``)."""
    mark: Mark | None


MAX_QUEUED = 4096  # bookings a replica's queue of first tokens to come holds at most (a counter that stopped moving)


class Overhead:
    """What a replica's first tokens took beyond the cost model's prediction, as Envoy saw them: its API server's own
    work (HTTP, the chat template, tokenizing and hashing the whole prompt, the first event), none of which is in the
    engine's prefill histogram the rates are learned from. On three real vLLMs: 20-25 ms a request, growing by ~20 us
    a prompt token, the cost model's predictions 24% short without it. A line in the prompt's tokens through the last
    ``WINDOW`` differences, robust to the odd outlier (the medians of the shorter and the longer half give the slope,
    never below 0; the median residual the intercept), counted once there are ``MIN_SAMPLES``; never below 0 at any
    size: a queue predicted too long is the queue model's error, not a negative overhead."""

    WINDOW = 64
    MIN_SAMPLES = 8
    __slots__ = ("samples", "line", "at")

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)  # (prompt tokens, seconds)
        self.line: tuple[float, float] | None = None  # (seconds at 0 tokens, seconds a token); None: not measured
        self.at = -math.inf  # the last sample's time

    def add(self, prompt_tokens: int, seconds: float, now: float) -> None:
        self.samples.append((prompt_tokens, seconds))
        self.at = now
        if len(self.samples) >= self.MIN_SAMPLES:
            pts = sorted(self.samples)
            half = len(pts) // 2
            (x0, y0), (x1, y1) = _medians(pts[:half]), _medians(pts[half:])
            slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
            self.line = (statistics.median(y - slope * x for x, y in pts), slope)


def _medians(pts: list[tuple[int, float]]) -> tuple[float, float]:
    return statistics.median(x for x, _ in pts), statistics.median(y for _, y in pts)


def overhead_at(line: tuple[float, float], prompt_tokens: int) -> float:
    return max(0.0, line[0] + line[1] * prompt_tokens)


class WarmReplica:
    """The warm policy's view of one replica: its prefix index, learned rates, and predicted work."""

    __slots__ = ("index", "rates", "prefill_busy_until", "work_s", "uncached_ewma", "cache_tokens", "pending",
                 "pending_tokens", "active_tokens", "active_whole", "returning", "arrivals", "prefix_caching",
                 "scraped", "lora", "lora_sent", "scale",
                 "engine_block", "exact", "promised", "overhead", "queued", "first_tokens")

    def __init__(self, cfg: RouterConfig, tokens_per_block: float, rates: Rates | None = None,
                 scale: TokenScale | None = None, holders: Holders | None = None):
        w = cfg.warm
        self.cache_tokens = w.cache_tokens
        self.index = PrefixIndex(int(w.cache_tokens / tokens_per_block), holders)
        # one data-parallel engine shares its replica's rates (same GPUs, same model)
        self.rates = rates or Rates(w.prefill_tokens_per_s, w.decode_s_per_token, w.output_tokens)
        # the engine's tokens per estimated token (its tokenizer and chat template); shared like the rates
        self.scale = scale or TokenScale()
        self.engine_block: int | None = None  # the engine caches whole blocks of this many tokens
        self.prefill_busy_until = 0.0  # when this router's predicted prefills on the replica are done
        self.work_s = 0.0  # predicted engine seconds of this router's requests in flight on it
        self.uncached_ewma = 0.0  # typical uncached prompt tokens of a request here (prices the scraped queue)
        # requests routed here still in their predicted prefill: (predicted first token, prompt tokens); their
        # KV is not yet in the scraped usage but will be taken before a request routed now gets any
        self.pending: deque[tuple[float, int]] = deque()
        self.pending_tokens = 0
        # the same requests' bookings in the order the engine takes them (first come, first served), and the engine's
        # count of first tokens at the last scrape: each first token it counts since ends the oldest one's prefill
        self.queued: deque = deque()
        self.first_tokens: float | None = None
        # context of the sessions under way here (quiet for less than WorkingSet.horizon), a prefix they share
        # counted once (flow control's fit rule); and each session's whole context (the routing terms')
        self.active_tokens = 0
        self.active_whole = 0
        self.returning = 0  # of those sessions, how many came back at least once (a flood keeps off their replica)
        self.arrivals: deque[float] = deque()  # when requests were routed here, over warm.arrival_window_s
        # False once the replica says it runs without prefix caching: nothing it served is there to be hit
        self.prefix_caching = True
        self.scraped: LoadSample | None = None  # one data-parallel engine's own gauges (None: the replica's)
        self.lora: LoadSample | None = None  # the last scrape that said which LoRA adapters it runs (None: no LoRA)
        # adapters this router sent here -> when, least recently first: the last max_lora of them are likely in its
        # slots, and those sent within warm.active_session_s have sessions that will be back for them
        self.lora_sent: OrderedDict[str, float] = OrderedDict()
        # what the engine's own KV events say it holds, None until its first batch
        self.exact: EngineCache | None = None
        # blocks of requests this router sent to an exact engine -> until when they count as held: the engine
        # publishes them once it computed them, and a request for the same prefix in between should find them
        # (llm-d's speculative index has the same gap to fill)
        self.promised: dict[int, float] = {}
        self.overhead = Overhead()  # the replica's (not one engine's: they share its API server)

    def waiting(self, r: Replica) -> int:
        return self.scraped.waiting if self.scraped is not None else r.scraped_waiting

    def running(self, r: Replica) -> int:
        return self.scraped.running if self.scraped is not None else r.scraped_running

    def kv_usage(self, r: Replica) -> float:
        return self.scraped.kv_usage if self.scraped is not None else r.kv_usage

    def book(self, start: float, prefill_s: float, prompt_tokens: int, work_s: float, estimated: int | None) -> None:
        """A request routed here, by this brain or another (shared state): its prefill queued behind those before
        it, its KV pending, its work in flight; ``estimated``: its tokens as counted from its text (None: a size
        from a header), which TokenScale compares with the engine's count of every brain's requests."""
        self.prefill_busy_until = max(start, self.prefill_busy_until) + prefill_s
        self.pending.append((self.prefill_busy_until, prompt_tokens))
        self.pending_tokens += prompt_tokens
        self.work_s += work_s
        if estimated is not None:
            self.scale.sent(estimated)

    def take_back(self, prefill_end: float, arrived_at: float | None, prefill_s: float, prompt_tokens: int,
                  provisional: bool, now: float) -> None:
        """A request booked here ended before its predicted prefill did (a 413, a reset, a cancel, a prediction too
        long): it no longer queues ahead of anyone, so its remaining prefill seconds and its pending KV go."""
        remaining = prefill_end - now
        if remaining <= 0 or prefill_s <= 0:
            return
        self.prefill_busy_until = max(now, self.prefill_busy_until - min(remaining, prefill_s))
        try:
            self.pending.remove((prefill_end, prompt_tokens))
            self.pending_tokens -= prompt_tokens
        except ValueError:  # already past, or cleared when the replica was ejected
            pass
        # a size declared in a header and gone before its prefill ended (a probe, a 413) never arrived at the engine:
        # nothing will queue behind it. Only those: the search is linear in the arrival window, and an ordinary
        # request that ends early did arrive
        if arrived_at is not None and provisional:
            try:
                self.arrivals.remove(arrived_at)
            except ValueError:
                pass

    def prefill_ended(self, b, now: float) -> None:
        """Booking ``b``'s prefill is over (its first token seen) before it was predicted to end: the rest of it and
        its pending KV leave the queue now."""
        if b.prefill_end > now and b.queued is not None:
            self.take_back(b.prefill_end, None, b.queued[0], b.queued[1], False, now)
            b.prefill_end = now

    def queue(self, b) -> None:
        """A booking whose first token the engine will count (when it counts them: see ``first_tokens_counted``)."""
        if self.first_tokens is not None and len(self.queued) < MAX_QUEUED:
            self.queued.append(b)

    def first_tokens_counted(self, count: float | None) -> list:
        """The engine's count of first tokens at a scrape: as many of the oldest requests booked here and not yet
        counted had theirs (the engine admits in arrival order). Those bookings, for the policy to end."""
        if count is not None and not math.isfinite(count):
            count = None  # a broken exporter's NaN would stop every count after it
        before, self.first_tokens = self.first_tokens, count
        q: deque = self.queued
        out: list = []
        if count is None:
            q.clear()  # an engine that counts no first tokens: nothing to match them with
            return out
        n = int(count - before) if before is not None and count > before else 0
        while q and n > 0:
            b = q.popleft()
            if b.queued is not None:  # ended before its first token was counted (an error, an abort): none to count
                out.append(b)
                n -= 1
        return out

    def exact_cached(self, hashes, now: float) -> int:
        """The engine's cached tokens for a prompt of these block hashes: the longest run from its start that its
        events say it holds or that requests sent to it are about to compute."""
        ex, promised = self.exact, self.promised
        assert ex is not None and ex.block_size is not None  # priced by its events: an exact engine
        n = 0
        for h in hashes:
            if not ex.holds(h) and promised.get(h, 0.0) <= now:
                break
            n += 1
        return n * ex.block_size

    def promise(self, hashes, until: float, now: float) -> None:
        p = self.promised
        for h in hashes:
            if p.get(h, 0.0) < until:
                p[h] = until
        ex = self.exact
        limit = 4 * max(1, self.cache_tokens // ((ex.block_size if ex is not None else None) or 16))
        if len(p) > limit:  # bounded: the expired go, and if that is not enough, all (the safe error: no hit)
            for h in [h for h, t in p.items() if t <= now]:
                del p[h]
            if len(p) > limit:
                p.clear()

    def routed(self, pin: Marked | None, chain: Sequence[int], prompt: int) -> None:
        """A request went here (``prompt`` engine tokens), its session's pin (if any) now pointing here: its chain
        inserted in the index when its body was read, else (a turn decided at its headers) its session touched."""
        if chain:
            self.index.insert(chain)
            if pin is not None:
                self.indexed(pin, chain, prompt)
        elif pin is not None:
            self.touched(pin, prompt)

    def indexed(self, pin: Marked, chain: Sequence[int], prompt: int) -> None:
        """A turn's whole chain was read and inserted here, where its session's pin now points: the mark that later
        turns decided at their headers touch. A chain read again settles what the last mark's turns left unseen."""
        old = pin.mark
        if old is not None and old.key != id(chain):
            self.index.settle(old.key, old.last)
        pin.mark = Mark(id(chain), chain[-1], len(chain), prompt)

    def touched(self, pin: Marked, prompt: int) -> None:
        """A turn decided at its headers (``prompt`` engine tokens, by its size) went to its home: its context is
        the most recently used there again (vLLM frees a request's blocks to the free queue's tail: the LRU end
        evicted last, `block_pool.py` `free_blocks`), grown by what the turns since the last read added."""
        m = pin.mark
        if m is not None:
            unseen = max(0, round((prompt - m.tokens) * m.blocks / m.tokens)) if m.tokens > 0 else 0
            if not self.index.touch(m.key, m.last, unseen):
                pin.mark = GONE

    def holds_session(self, pin: Marked) -> bool:
        """Whether the session's context is still here by the estimate (C2's LRU over what was routed): the block its
        last read turn ended with. A pin with no mark says what it always said; an engine priced by its own events
        answers for itself (the header path's tail check). A mark made on another replica (a pin another brain
        moved) finds its chain here only where the same chain was routed here too."""
        m = pin.mark
        return m is None or (self.exact is not None and self.exact.exact) or \
            m is not GONE and self.index.holds(m.last)

    def cache_reset(self, now: float) -> None:
        """Nothing the engine held is a hit any more, whatever its events or the estimate said (an idle engine
        publishes the clear only at its next step, after the next request was priced)."""
        self.index.clear()
        self.promised.clear()
        if self.exact is not None:
            self.exact.apply([Cleared()], now)

    def hold_cache(self, cache_tokens: int | None, tokens_per_block: float) -> None:
        """The engine's cache size as scraped: the index holds blocks of the profile's characters, so many of them
        fit the engine's tokens at the learned scale."""
        if cache_tokens:
            self.cache_tokens = cache_tokens
            self.index.resize(int(cache_tokens / (tokens_per_block * self.scale.value)))

    def engine_view(self, rank: int) -> dict:
        """One data-parallel engine as the policy sees it (/state)."""
        assert self.scraped is not None  # an engine's state exists from its first scrape
        return {"rank": rank, "running": self.scraped.running, "waiting": self.scraped.waiting,
                "kv_usage": round(self.scraped.kv_usage, 4), "cache_tokens": self.cache_tokens,
                "prefix_index_blocks": len(self.index), "in_flight_work_s": round(self.work_s, 3)}

    def kv_ahead(self, now: float, kv_usage: float) -> float:
        """Tokens of KV the requests ahead will hold: the scraped usage plus our pending prefills."""
        p = self.pending
        while p and p[0][0] <= now:
            self.pending_tokens -= p.popleft()[1]
        return kv_usage * self.cache_tokens + self.pending_tokens


def replica_view(st: WarmReplica, parts: list[WarmReplica], now: float) -> dict[str, float]:
    """What the policy believes of one replica, for metrics (keys: brain.metrics.WARM_VIEW); a replica with
    data-parallel engines: their sums (the longest predicted wait)."""
    return {
        "prefill_tokens_per_second": st.rates.prefill_tokens_per_s,
        "decode_seconds_per_token": st.rates.decode_s_per_token,
        "prefill_slowdown_per_running_request": st.rates.prefill_slope,
        "decode_slowdown_per_running_request": st.rates.decode_slope,
        "prefix_index_blocks": sum(len(p.index) for p in parts),
        "prefix_index_capacity_blocks": sum(p.index.capacity for p in parts),
        "predicted_wait_seconds": max(max(0.0, p.prefill_busy_until - now) for p in parts),
        "in_flight_work_seconds": sum(p.work_s for p in parts),
        "active_session_tokens": sum(p.active_tokens for p in parts),
        "cache_tokens": sum(p.cache_tokens for p in parts),
        "pending_kv_tokens": sum(p.pending_tokens for p in parts),
        "engine_tokens_per_estimated_token": st.scale.value,
        # an offloading connector's restores, once its counters measured one (warm.restore_cost_prior until then)
        **({"restore_seconds_per_token": st.rates.restore_s_per_token}
           if st.rates.restore_s_per_token is not None else {}),
    }


def peer_scale(states: list[WarmReplica]) -> float:
    learned = [st.scale.value for st in states if st.scale.learned]
    return sum(learned) / len(learned) if learned else 1.0

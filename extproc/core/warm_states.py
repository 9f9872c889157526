"""The warm policy's states of the fleet: one ``WarmReplica`` per replica, one per data-parallel engine of those that
export several, and the first-token overhead level their measured replicas share."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .config import RouterConfig
from .load import LoadSample
from .prefix_index import Holders
from .replica import Replica
from .decision import Reservation
from .room import TIE_S
from .warm_replica import WarmReplica, overhead_at, replica_view

# a replica's own first-token overhead counts half as much after this long without a sample (its peers' the rest)
OVERHEAD_HALF_LIFE_S = 120.0
# a first token this much later than predicted (times the prediction, and at least QUEUED_S) waited for something the
# queue model did not see: no API server's own work per request (tens of milliseconds) is that long
QUEUED, QUEUED_S = 3.0, 1.0


class WarmStates:
    def __init__(self, cfg: RouterConfig, tokens_per_block: float):
        self.cfg = cfg
        self.tokens_per_block = tokens_per_block
        self.replicas: dict[str, WarmReplica] = {}
        # replicas that export several data-parallel engines: one state per engine, in rank order
        self.engines: dict[str, list[WarmReplica]] = {}
        # who holds which sampled block, for big fleets' shortlists: kept from the first look at a fleet that big
        # (a small fleet does not pay for it: a megabyte's first turn adds ~17K blocks)
        self.holders: Holders | None = None
        self.overhead_level = (0.0, 0.0)  # the measured replicas' median first-token overhead line

    def of(self, r: Replica) -> WarmReplica:
        st = self.replicas.get(r.name)
        if st is None:
            st = self.replicas[r.name] = WarmReplica(self.cfg, self.tokens_per_block, holders=self.holders)
        return st

    def engine(self, name: str, engine: int | None) -> WarmReplica | None:
        if engine is not None:
            subs = self.engines.get(name)
            if subs is not None and engine < len(subs):
                return subs[engine]
        return self.replicas.get(name)

    def all(self) -> Iterator[WarmReplica]:
        return itertools.chain(self.replicas.values(), *self.engines.values())

    def track(self) -> Holders:
        """Start keeping who holds which sampled block (a big fleet's shortlist reads it)."""
        if self.holders is None:
            self.holders = Holders()
            for st in self.all():
                self.holders.track(st.index)
        return self.holders

    def parts(self, name: str) -> list[WarmReplica]:
        """The states that serve replica ``name``: its engines', else its own."""
        return self.engines.get(name) or [self.replicas[name]]

    def count(self, name: str) -> int:
        return len(self.engines.get(name) or ()) or 1

    def view(self, name: str) -> list[dict] | None:
        subs = self.engines.get(name)
        if not subs:
            return None
        return [s.engine_view(k) for k, s in enumerate(subs)]

    def caches_reset(self, name: str, now: float) -> None:
        for st in filter(None, (self.replicas.get(name), *self.engines.get(name, ()))):
            st.cache_reset(now)

    def forget(self, name: str) -> None:
        for st in (self.replicas.pop(name, None), *self.engines.pop(name, ())):
            if st is not None:
                st.index.close()

    def ejected(self, r: Replica) -> None:
        """An ejected replica may come back restarted, with a cold cache: forget what we thought it held."""
        for st in (self.of(r), *self.engines.get(r.name, ())):
            st.index.clear()
            st.prefill_busy_until = 0.0
            st.pending.clear()
            st.pending_tokens = 0
            st.queued.clear()  # what it counts when it is back starts a new count
            st.first_tokens = None

    def on_load(self, r: Replica, s: LoadSample, now: float) -> bool:
        """A scrape of ``r``; True when the candidates changed (engines came or went)."""
        st = self.of(r)
        if not s.engines:  # the engine's first tokens since the last scrape end the oldest prefills booked there
            for b in st.first_tokens_counted(s.first_tokens):
                st.prefill_ended(b, now)
        st.rates.update(s, now)
        st.scale.update(s)
        st.engine_block = s.engine_block
        if s.max_lora is not None:
            st.lora = s
        st.hold_cache(s.cache_tokens, self.tokens_per_block)
        if s.prefix_caching is not None and s.prefix_caching != st.prefix_caching:
            st.prefix_caching = s.prefix_caching
            st.index.clear()
        changed = False
        if not s.engines:
            for sub in self.engines.pop(r.name, ()):
                sub.index.close()
                changed = True
            return changed
        subs = self.engines.get(r.name)
        if subs is None or len(subs) != len(s.engines):  # new, or restarted with another engine count
            for sub in subs or ():
                sub.index.close()
            subs = self.engines[r.name] = [WarmReplica(self.cfg, self.tokens_per_block, st.rates, st.scale,
                                                       self.holders) for _ in s.engines]
            changed = True
        for sub, es in zip(subs, s.engines):
            sub.scraped = es
            sub.prefix_caching = st.prefix_caching
            sub.engine_block = st.engine_block
            sub.hold_cache(es.cache_tokens, self.tokens_per_block)
        return changed

    def candidates(self, pool: list[Replica]) -> list[tuple[Replica, WarmReplica, int | None]]:
        """(replica, state, engine) to price: each data-parallel engine on its own when the answer can name it;
        else the one the replica's front end will pick (vLLM: the least waiting x 4 + running, from the last
        scrape plus what this brain sent since, as its front end counts its own sends)."""
        out: list[tuple[Replica, WarmReplica, int | None]] = []
        for r in pool:
            subs = self.engines.get(r.name)
            if not subs:
                out.append((r, self.of(r), None))
            elif self.cfg.warm.steer_data_parallel:
                out.extend((r, sub, k) for k, sub in enumerate(subs))
            else:
                k = min(range(len(subs)), key=lambda i: (4 * subs[i].waiting(r) + subs[i].running(r)
                                                         + 4 * len(subs[i].pending), i))
                out.append((r, subs[k], k))
        return out

    def replica_view(self, r: Replica, now: float) -> dict[str, float]:
        st = self.of(r)
        parts = self.engines.get(r.name) or [st]
        for p in parts:
            p.kv_ahead(now, 0.0)  # prefills predicted done by now leave the pending KV
        line = st.overhead.line or self.overhead_level
        return {**replica_view(st, parts, now), "first_token_overhead_seconds": overhead_at(line, 0),
                "first_token_overhead_seconds_per_token": line[1]}

    # ------------------------------------------------------------ first-token overhead

    def first_token(self, res: Reservation, observed_s: float, now: float) -> None:
        """What the request's first token took beyond the cost model's part of its prediction: its replica's
        overhead (``warm_replica.Overhead``)."""
        if res.predicted_ttft_s is None or res.remote or res.transfer_tokens:
            return  # nothing predicted, another brain's, or a decode leg (its transfer is learned apart)
        if res.predicted_ttft_s - res.overhead_s - res.prefill_s > TIE_S:
            # predicted to wait: its error is the queue model's, not the replica's own overhead. Learned from those
            # too, an overloaded fleet's queue errors became a slope that changed what flow control held
            return
        if observed_s - res.predicted_ttft_s > max(QUEUED * res.predicted_ttft_s, QUEUED_S):
            return  # it waited for what the queue model did not see (a simulated fleet's overhead grew to seconds)
        self.observe_overhead(res.replica, res.pending_tokens, observed_s - (res.predicted_ttft_s - res.overhead_s),
                              now)

    def observe_overhead(self, r: Replica, prompt_tokens: int, seconds: float, now: float) -> None:
        self.of(r).overhead.add(prompt_tokens, seconds, now)
        lines = [x.overhead.line for x in self.replicas.values() if x.overhead.line is not None]
        if lines:
            mid = len(lines) // 2
            self.overhead_level = (sorted(a for a, _ in lines)[mid], sorted(b for _, b in lines)[mid])

    def overhead_of(self, r: Replica, now: float, prompt_tokens: int) -> float:
        """A replica's first-token overhead for a prompt this long: its own, drifting to its peers' level as its
        samples age (a replica that stopped getting traffic is not kept off by an old reading); its peers' until it
        has its own (one never measured is priced as they are, neither shunned nor trusted blindly)."""
        level = overhead_at(self.overhead_level, prompt_tokens)
        own = self.of(r).overhead
        if own.line is None:
            return level
        w = 0.5 ** ((now - own.at) / OVERHEAD_HALF_LIFE_S)
        return w * overhead_at(own.line, prompt_tokens) + (1.0 - w) * level

"""The cost terms of the warm policy, written once, and a row's price (``Estimate``): the price of a request on a
replica (``WarmPolicy.price_rows``) and the big-fleet shortlist's price of a typical request on each replica
(``Shortlist.look``) add the same terms, so that the shortlist ranks replicas as the price will.

Every quantity is in seconds of engine time (C1). Per candidate replica r:

    ttft(r) = wait(r) + prefill(prompt_tokens - cached_tokens(r), r)  [+ what KV pressure adds]
    cost(r) = ttft(r) + decode(r) + eviction(r) + idle x interference(r) + load x extra_work(r) + overload(r)
    (idle in [0, 1], load in [1, 2])

- ``cached_tokens``: the request's block chain matched against what was routed to r (C2, the prefix
  index); a session pin stands in when the request has no chain (C4); on an engine whose KV events verify
  (exact mode), what that engine holds of the prompt's blocks, in its own tokens;
- ``wait``: prefill work ahead on r: this router's requests still in their predicted prefill, or the
  scraped queue (fresh every 0.5 s, C6) if that says more, since it also holds other routers' work;
- ``prefill``: uncached tokens over r's prefill rate, learned from r's own counters (C3);
- KV pressure (C3): if the request does not fit beside what runs and what is queued ahead, it waits for
  KV to free and its cached blocks are likely evicted meanwhile: its ttft counts them as uncached;
- ``decode``: the decode slow-down the request would feel on r against the fastest candidate;
- ``eviction``: a session will be back with this context; the fuller r's working set of active
  sessions, the likelier LRU evicts it before then, priced as the expected re-prefill (Preble);
- ``interference``: vLLM runs a prefill to its end before it admits what arrives behind it, so a prefill of P
  seconds makes the requests arriving at r meanwhile wait P/2 on average: arrival rate x P^2 / 2 of others'
  waiting. Weighted by how idle the fleet is (with queues everywhere ``extra_work`` prices it instead);
- ``extra_work``: prefill beyond what the best-cached candidate would need: work the fleet does instead
  of serving someone. It counts once (``load`` 1), and up to twice as the candidates' queues grow
  (``load`` 2), since then it delays everybody behind it: a move must save more than it costs the fleet;
- ``overload`` (C5): in-flight work above Envoy's bounded-load share (balance_factor x the mean,
  rounded up to whole requests) counts as waiting; beyond ``hard_bound_factor`` x that share a
  replica takes nothing, so crystallization cannot happen;
- fit (C3): a replica where the request does not fit beside the active sessions' contexts is left out, unless
  it fits on none: the replicas few requests arrive at are the ones long sessions live on, and two of those
  contexts in one cache evict each other on every turn.
- LoRA: a request for an adapter adds the adapter's load where it is not in a slot (``_lora_s``), and the same
  load once more for each request running or queued there: the engine loads it before the step that needs it,
  so the whole batch waits for it;
- data parallelism: a replica that exports several engines is priced engine by engine (``_candidates``), each
  with its own queue, KV usage and prefix index; the answer names the engine (X-data-parallel-rank).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .replica import Replica
from .warm_replica import WarmReplica

if TYPE_CHECKING:
    from .config import WarmConfig

DECODE_NOISE = 0.2  # decode-rate differences below 20% are the estimate's noise, not a slower replica


def queue_wait(st: WarmReplica, r: Replica, rate: float, now: float) -> float:
    """``wait``: this router's requests still in their predicted prefill on r, or the scraped queue at r's typical
    uncached request if that says more (it also holds other routers' work)."""
    wait = max(0.0, st.prefill_busy_until - now)
    waiting = st.waiting(r)
    if waiting:
        wait = max(wait, waiting * max(st.uncached_ewma, 1.0) / rate)
    return wait


def evict_risk(pressure: float, w: "WarmConfig") -> float:
    """``eviction``: how likely LRU evicts a session's context before its next turn, at this share of the cache taken
    by the active sessions' contexts and the request (0 below warm.evict_start, 1 at warm.kv_pressure)."""
    if pressure <= w.evict_start:
        return 0.0
    return min(1.0, (pressure - w.evict_start) / (w.kv_pressure - w.evict_start))


def work_unit(total_s: float, in_flight: int, typical_s: float) -> float:
    """C5's unit of work: the mean request in flight, or a typical request's when nothing is."""
    return total_s / in_flight if in_flight and total_s > 0 else typical_s


def lora_cost(st: WarmReplica, adapter: str, dec: float, now: float, w: "WarmConfig") -> tuple[float, float]:
    """What bringing the request's LoRA adapter in costs on a replica (C3): nothing where it runs, waits or
    was sent lately (still in a slot, the slots being least-recently-used); else its load, once more when
    the slots already serve as many adapters with sessions here as there are slots (the one it evicts will
    be loaded again when its session is back), and the wait for a slot where every slot serves a running
    adapter (a typical decode). (loads' seconds, the wait's)."""
    s = st.lora
    if s is None:
        return 0.0, 0.0  # no LoRA metrics: nothing known, nothing priced
    busy = (s.lora_running or frozenset()) | (s.lora_waiting or frozenset())
    cap = max(1, s.max_lora or 1)
    if adapter in busy or adapter in itertools.islice(reversed(st.lora_sent), cap):
        return 0.0, 0.0
    since = now - w.active_session_s
    hosted = sum(1 for a, t in st.lora_sent.items() if t >= since and a != adapter)
    return w.lora_load_s * (2 if hosted >= cap else 1), (0.0 if len(busy) < cap else st.rates.output_tokens * dec)


def decode_penalty(weight: float, out_tokens: float, decode_s: float, fastest_s: float) -> float:
    """``decode``: the slow-down the request's output would feel on a replica against the fastest candidate."""
    slower = decode_s - fastest_s
    return weight * out_tokens * slower if slower > DECODE_NOISE * fastest_s else 0.0


def recent(arrivals: deque, since: float) -> int:
    """How many requests were routed to a replica since ``since`` (older ones are forgotten)."""
    while arrivals and arrivals[0] < since:
        arrivals.popleft()
    return len(arrivals)


def interference(idle: float, arrived: int, window_s: float, prefill_s: float) -> float:
    """``interference``: vLLM runs a prefill before admitting new requests, so what arrives during it waits for the
    rest of it, P/2 on average, at the replica's arrival rate (on an idle fleet; with queues everywhere the
    externality term prices the extra work instead)."""
    return idle * arrived / window_s * prefill_s * prefill_s / 2


def fair_share(total_s: float, unit_s: float, balance_factor: float, n: int) -> float:
    """C5's bound in work: with ``total_s / unit_s`` typical requests in flight a replica may hold
    max(1, ceil(ceil((k + 1) x c) / n)) of them (Envoy's bounded load, in work units)."""
    return max(1, math.ceil(math.ceil((total_s / unit_s + 1) * balance_factor) / n)) * unit_s


@dataclass(slots=True)
class Estimate:
    replica: Replica
    st: WarmReplica
    rate: float  # prefill tokens/s
    dec: float  # decode s/token
    cached: int
    wait: float
    prefill: float
    engine: int | None = None  # the data-parallel engine priced (None: the replica has one)
    lora: float = 0.0  # seconds to bring the request's LoRA adapter in
    lora_wait: float = 0.0  # of which waiting for a slot the adapters running there hold (the rest: its load)
    stall: float = 0.0  # seconds the others on the replica lose to that load
    fits: bool = True  # beside the active sessions' contexts, in the replica's cache
    room: bool = True  # the same, a prefix they share counted once: flow control's word
    prompt: int = 1  # the request's prompt in this replica's engine tokens (TokenScale)
    prefix: int | None = None  # the last block hash of its cached prefix there (what it shares: working set)
    ttft: float = 0.0
    cost: float = 0.0
    work: float = 0.0
    # KV risks of choosing it (its cache lost before or at this turn) that are no wait of this turn: in its cost, not
    # its predicted time to first token; a prefill elsewhere avoids them, so disaggregation weighs them too
    risk: float = 0.0
    restored: int = 0  # of the prompt past ``cached``, tokens an offloaded tier holds there: restored, not computed
    medium: str | None = None  # that tier (CPU, STORAGE)

    @property
    def noise_s(self) -> float:
        """How uncertain its prefill is: while its replica's rate stands on a few requests (``Rates.prefill_noise``)."""
        return self.prefill * self.st.rates.prefill_noise


@dataclass(slots=True)
class Booking:
    """What the warm policy priced for a decision (``Decision.booking``) and booked for its reservation
    (``Reservation.booking``): the fleet carries it and never reads it."""
    prefill_s: float = 0.0  # the request's predicted prefill on its replica (a decode leg's: one step there)
    prompt: int = 1  # its prompt in the engine's tokens, as priced
    estimate: Estimate | None = None  # the chosen row (what disaggregation weighs)
    prefill_end: float = 0.0  # when its prefill was predicted to end (its place in the replica's queue)
    arrived_at: float | None = None  # its place in the replica's arrivals (what queues behind a prefill)
    # a request decided while its body was arriving: (prefill seconds, prompt tokens, work seconds) to book once it
    # has arrived (None: booked, or nothing to book)
    deferred: tuple[float, int, float] | None = None
    # what was booked in its replica's queue: (prefill seconds, prompt tokens); None before it is booked and once the
    # request ended
    queued: tuple[float, int] | None = None
    session: bytes | None = None  # the session it placed in the working set, until its end says so

@dataclass(slots=True)
class Aggregates:
    """What pricing needs of the whole pool; None: computed from the priced rows (every candidate priced)."""
    out_tokens: float
    fastest_decode: float
    peer_scale: float
    busy: float | None = None
    total_work: float | None = None
    in_flight: int = 0
    n: int = 0


def guard(ests: "list[Estimate]", out_tokens: float, fastest_decode: float, total: float, in_flight: int, n: int,
          w: "WarmConfig") -> "list[Estimate]":
    """C5: Envoy's bounded-load rule in work units. With k typical requests in flight a replica may hold
    max(1, ceil(ceil((k + 1) x c) / n)) of them; what it holds beyond counts as waiting, and beyond
    hard_bound_factor x that it takes nothing (unless every replica is that far over). ``total``, ``in_flight``
    and ``n``: the whole pool's (of which ``ests`` may be a shortlist)."""
    if n < 2:
        return ests
    unit = work_unit(total, in_flight, ests[0].prompt / ests[0].rate + out_tokens * fastest_decode)
    bound = fair_share(total, unit, w.balance_factor, n)
    kept = []
    for e in ests:
        over = e.st.work_s - bound
        if over > 0:
            e.cost += over
            if e.st.work_s > w.hard_bound_factor * bound:
                continue
        kept.append(e)
    return kept or ests

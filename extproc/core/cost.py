"""The cost terms of the warm policy, written once, and a row's price (``Estimate``): the price of a request on a replica (``WarmPolicy._price``) and
the big-fleet shortlist's price of a typical request on each replica (``WarmPolicy._look``) add the same terms, so
that the shortlist ranks replicas as the price will. What each term means and why is in ``warm``'s docstring and
docs/routing.md."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .replica import Replica
from .warm_replica import WarmReplica

DECODE_NOISE = 0.2  # decode-rate differences below 20% are the estimate's noise, not a slower replica


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

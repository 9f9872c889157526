"""Flow control's queue: what is held while every replica is saturated, in the order it is let go.

A pure structure with ``now`` passed in (DESIGN.md: a held request is a state of the decision, not a second
router): the shell holds the stream open, the simulator holds the virtual request, and both ask this queue which
one goes next once a replica has room.

Order: the priority class first (critical, standard, sheddable, like the Inference Extension's objective
priorities); within a class, fairness across tenants by a virtual token counter (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024): each tenant's counter grows by the tokens it is served, the tenant with
the least goes next, and a tenant that comes back from idle is lifted to the least counter of those waiting, so
idleness earns no credit to flood with later; then arrival. Bounded in requests and bytes: when full, a newcomer
of a higher class takes the place of the youngest request of the lowest class queued (sheddable first, never a
critical one while a lower class is queued); otherwise the newcomer is refused.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from .decision import Decision
from .names import Hold, Reason
from .profile import RequestProfile

CLASSES = ("critical", "standard", "sheddable")
MAX_TENANTS = 100_000  # fairness counters kept before those that owe nothing are forgotten


def tenant_key(tenant: str | None) -> str | None:
    """What the queue counts a tenant by: a hash (several brains share the counters; no tenant name leaves one)."""
    if tenant is None:
        return None
    return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
CRITICAL, STANDARD, SHEDDABLE = range(3)


@dataclass(slots=True)
class Held:
    key: object  # the holder's handle (a stream, a simulated request)
    klass: int  # index into CLASSES
    tenant: str | None
    tokens: float  # what serving it costs in the counter's tokens (prompt + weighted output)
    size: int = 0  # bytes it holds (its body, in the shell)
    arrived: float = 0.0
    deadline: float | None = None  # when its time-to-first-token deadline passes (None: none)
    seq: int = field(default=0, compare=False)


class FlowQueue:
    def __init__(self, max_requests: int = 10_000, max_bytes: int = 1 << 30):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        # per class: tenant -> its requests in arrival order, by their seq (a cancel anywhere in it is O(1): a deque's
        # remove was a walk, 1.55 ms a cancel at 10,000 queued of one tenant)
        self._queues: list[dict[str | None, OrderedDict[int, Held]]] = [{} for _ in CLASSES]
        self._by_key: dict[object, Held] = {}
        self.counters: dict[str | None, float] = {}  # the virtual token counter of every tenant seen
        self.bytes = 0
        # per class: requests and tokens queued, kept as they come and go (asked on every arrival while any wait)
        self._n = [0] * len(CLASSES)
        self._tokens = [0.0] * len(CLASSES)
        self._seq = 0
        self._last = 0.0  # the counter of the tenant served last
        # what every arrival and every look needs, kept as it changes (it was a walk over every waiting tenant:
        # 57 ms a look at 10,000 tenants): each tenant's requests queued over all classes, and heaps with stale
        # entries skipped when they reach the top (a tenant's counter or head changed since)
        self._queued: dict[str | None, int] = {}
        self._least: list[tuple[float, int, str | None]] = []  # (counter, tie, tenant) of waiting tenants
        self._heads: list[list[tuple[float, int, str | None]]] = [[] for _ in CLASSES]  # (counter, head seq, tenant)
        self._tie = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def depth(self, klass: int) -> int:
        return self._n[klass]

    # ------------------------------------------------------------- admission

    def push(self, h: Held) -> tuple[bool, list[Held]]:
        """Queue ``h``: (queued, the requests it displaced). Not queued: the queue is full of its class or
        higher (nothing is displaced then)."""
        count, size = len(self._by_key) + 1, self.bytes + h.size
        victims: list[Held] = []
        if count > self.max_requests or size > self.max_bytes:
            for v in self._displaceable(h.klass):
                if count <= self.max_requests and size <= self.max_bytes:
                    break
                victims.append(v)
                count, size = count - 1, size - v.size
            if count > self.max_requests or size > self.max_bytes:
                return False, []
        for v in victims:
            self._take(v)
        self._insert(h)
        return True, victims

    def _displaceable(self, klass: int):
        """Requests of a lower class than ``klass``, the lowest class first, the youngest first."""
        for c in range(len(CLASSES) - 1, klass, -1):
            yield from sorted((x for q in self._queues[c].values() for x in q.values()), key=lambda x: -x.seq)

    def _insert(self, h: Held) -> None:
        if not self._waiting(h.tenant):
            self._lift(h.tenant)
        per = self._queues[h.klass]
        q = per.get(h.tenant)
        if q is None:
            q = per[h.tenant] = OrderedDict()
        self._seq += 1
        h.seq = self._seq
        q[h.seq] = h
        if len(q) == 1:
            self._push_head(h.klass, h.tenant)
        if self._queued.get(h.tenant, 0) == 0:
            self._push_least(h.tenant)
        self._queued[h.tenant] = self._queued.get(h.tenant, 0) + 1
        self._by_key[h.key] = h
        self.bytes += h.size
        self._n[h.klass] += 1
        self._tokens[h.klass] += h.tokens

    # ---------------------------------------------------------------- release

    def in_order(self, most: int) -> list[Held]:
        """Up to ``most`` queued requests in the order they would go (as ``peek`` then ``pop`` would give them,
        counters as they stand): per class, the tenants' next requests in a heap of their own (one heapify, then
        ``most`` pops), never a walk over every tenant for each request."""
        out: list[Held] = []
        for per in self._queues:
            if len(out) >= most:
                break
            heap = [(self.counters.get(t, 0.0), next(iter(q)), t) for t, q in per.items()]
            heapq.heapify(heap)
            later: dict[str | None, object] = {}  # each tenant's requests after the one in the heap
            while heap and len(out) < most:
                counter, seq, t = heapq.heappop(heap)
                h = per[t][seq]
                out.append(h)
                it = later.get(t)
                if it is None:
                    it = later[t] = iter(per[t].values())
                    next(it)
                nxt = next(it, None)  # type: ignore[call-overload]
                if nxt is not None:
                    heapq.heappush(heap, (counter + h.tokens, nxt.seq, t))
        return out

    def take(self, h: Held) -> None:
        """Let ``h`` go out of order (the ones before it must still wait): its tenant is charged."""
        self._take(h)
        self.charge(h.tenant, h.tokens)

    def peek(self) -> Held | None:
        """The request that goes next: the highest class with any, its tenant with the least counter, its oldest."""
        for klass, per in enumerate(self._queues):
            heap = self._heads[klass]
            while heap:
                counter, seq, tenant = heap[0]
                q = per.get(tenant)
                if q and next(iter(q)) == seq and self.counters.get(tenant, 0.0) == counter:
                    return q[seq]
                heapq.heappop(heap)  # stale: its head went, or its counter moved (a fresh entry was pushed then)
        return None

    def pop(self) -> Held | None:
        """Let the next request go; its tenant's counter is charged its tokens."""
        h = self.peek()
        if h is not None:
            self._take(h)
            self.charge(h.tenant, h.tokens)
        return h

    def charge(self, tenant: str | None, tokens: float) -> None:
        """Service a tenant got (a request let go, or placed at once without queueing: both count)."""
        if not self._waiting(tenant):
            self._lift(tenant)
        c = self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens
        self._last = c
        self._moved(tenant)
        if len(self.counters) > MAX_TENANTS:
            self._forget_even()

    def _forget_even(self) -> None:
        """Tenants as many as API keys (tenant_source: credential): forget those not waiting that owe nothing (at
        or below the counter a returning tenant is lifted to anyway)."""
        floor = self._last
        for t in [t for t, c in self.counters.items() if c <= floor and not self._queued.get(t)]:
            del self.counters[t]

    def _lift(self, tenant: str | None) -> None:
        """A tenant back from idle starts level with the least counter of those waiting (or, nobody waiting,
        with the last one served): idleness earns no credit to flood with later."""
        least = self._least_waiting_counter()
        floor = least if least is not None else self._last
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor
            self._moved(tenant)

    def remove(self, key: object) -> Held | None:
        """The request left (its client went away): gone from the queue at once."""
        h = self._by_key.get(key)
        if h is not None:
            self._take(h)
        return h

    def expired(self, now: float) -> list[Held]:
        """Requests whose deadline passed while queued: taken out, to be answered."""
        gone = [h for h in self._by_key.values() if h.deadline is not None and h.deadline <= now]
        for h in gone:
            self._take(h)
        return gone

    def ahead(self, klass: int) -> tuple[int, float]:
        """Requests and tokens that would go before a newcomer of ``klass`` (its class and above, fairness
        aside): what its wait in the queue is made of."""
        return sum(self._n[:klass + 1]), sum(self._tokens[:klass + 1])

    # ------------------------------------------------------------- internals

    def _take(self, h: Held) -> None:
        per = self._queues[h.klass]
        q = per[h.tenant]
        head = next(iter(q)) == h.seq
        del q[h.seq]
        if not q:
            del per[h.tenant]
        elif head:
            self._push_head(h.klass, h.tenant)
        n = self._queued[h.tenant] - 1
        if n:
            self._queued[h.tenant] = n
        else:
            del self._queued[h.tenant]
        del self._by_key[h.key]
        self.bytes -= h.size
        self._n[h.klass] -= 1
        self._tokens[h.klass] -= h.tokens
        if not self._n[h.klass]:
            self._tokens[h.klass] = 0.0  # no float drift left behind an empty class

    def _waiting(self, tenant: str | None) -> bool:
        return tenant in self._queued

    def _least_waiting_counter(self) -> float | None:
        heap = self._least
        while heap:
            counter, _, tenant = heap[0]
            if tenant in self._queued and self.counters.get(tenant, 0.0) == counter:
                return counter
            heapq.heappop(heap)  # stale: the tenant stopped waiting, or its counter moved
        return None

    def _push_least(self, tenant: str | None) -> None:
        self._tie += 1
        heapq.heappush(self._least, (self.counters.get(tenant, 0.0), self._tie, tenant))
        if len(self._least) > 4 * len(self._queued) + 64:  # mostly stale: rebuilt from what waits (amortised O(1))
            self._least = [(self.counters.get(t, 0.0), i, t) for i, t in enumerate(self._queued)]
            heapq.heapify(self._least)

    def _push_head(self, klass: int, tenant: str | None) -> None:
        per, heap = self._queues[klass], self._heads[klass]
        heapq.heappush(heap, (self.counters.get(tenant, 0.0), next(iter(per[tenant])), tenant))
        if len(heap) > 4 * len(per) + 64:
            heap[:] = [(self.counters.get(t, 0.0), next(iter(q)), t) for t, q in per.items()]
            heapq.heapify(heap)

    def _moved(self, tenant: str | None) -> None:
        """A tenant's counter changed: fresh entries where it waits (the old ones go stale)."""
        if tenant in self._queued:
            self._push_least(tenant)
            for klass, per in enumerate(self._queues):
                if tenant in per:
                    self._push_head(klass, tenant)




# how long each class may wait in the queue before it is refused: critical as long as it takes; standard the
# minute llm-d's flow control holds a request (its TTL); sheddable 10 s
DEADLINES_S: tuple[float | None, ...] = (None, 60.0, 10.0)


# how long a refusal at the look keeps flow control in its flood mode: a flood's looks come in bursts seconds apart
FLOOD_S = 5.0


class FlowControl:
    """The router's side of flow control (``Router.flow``): the queue, and what each held request needs to be
    decided again once a replica has room (``Router.offer``)."""

    def __init__(self, queue: FlowQueue | None = None, deadlines: tuple[float | None, ...] = DEADLINES_S,
                 hold_on_wait: bool = False):
        self.queue = queue if queue is not None else FlowQueue()  # an empty queue is falsy
        self.held: dict[object, tuple] = {}  # key -> (profile, the replicas it may go to)
        # keys to be refused (429 with Retry-After): pushed out by a higher class, or past their class's deadline
        self.refused: list[object] = []
        self.deadlines = deadlines  # per class: how long a request may be held (None: as long as it takes)
        # saturation by wait too, not only by KV (WarmPolicy._saturated): flow_control.hold_on_wait
        self.hold_on_wait = hold_on_wait
        self._expire_at = float("-inf")
        # until when new sessions are held by their own replica's queue alone (Hold.FLOODED): a flood's window
        self.flooded_until = float("-inf")

    def flooded(self, now: float) -> None:
        """The brain refused a new session for being behind (a flood): for the next ``FLOOD_S``, the ones it admits
        are held while their replica's queue is longer than their prefill (``room.saturated``)."""
        self.flooded_until = now + FLOOD_S

    def mode(self, now: float) -> Hold:
        """What may hold a request now (``Hold``)."""
        return Hold.WAITING if self.hold_on_wait else Hold.FLOODED if now < self.flooded_until else Hold.SATURATED

    def held_in(self, hold: Hold, now: float) -> None:
        if hold is Hold.FLOODED:  # the flood's backlog still held: its mode lasts while it drains
            self.flooded(now)

    def within(self, klass: int, slo_s: float | None) -> float | None:
        """How long a request may take to its first token, from now (None: as long as it takes): the client's own
        deadline, never longer than its class may be held; critical work's alone."""
        d = self.deadlines[klass]
        if slo_s is None:
            return d
        return slo_s if d is None else min(slo_s, d)

    def expire(self, now: float) -> None:
        # a scan of every held request: at most ten a second, however often offers run
        if now < self._expire_at:
            return
        self._expire_at = now + 0.1
        for h in self.queue.expired(now):
            self.held.pop(h.key, None)
            self.refused.append(h.key)

    def __len__(self) -> int:
        return len(self.queue)

    def hold(self, key: object, profile: RequestProfile, only: object, now: float, size: int,
             predicted_s: float | None) -> Decision:
        """Queue it, or refuse it at once (Reason.DEADLINE) when its predicted time to first token already passes
        its deadline: the client learns now, with Retry-After, what it would learn when the deadline passed."""
        within = self.within(profile.priority, profile.ttft_slo_s)
        if within is not None and predicted_s is not None and predicted_s > within:
            return Decision(None, Reason.DEADLINE, predicted_ttft_s=predicted_s)
        queued, displaced = self.queue.push(Held(key, profile.priority, tenant_key(profile.tenant),
                                                 float(profile.tokens), size, now,
                                                 None if within is None else now + within))
        if not queued:
            return Decision(None, Reason.QUEUE_FULL)
        for v in displaced:
            self.held.pop(v.key, None)
            self.refused.append(v.key)
        self.held[key] = (profile, only)
        return Decision(None, Reason.HELD, predicted_ttft_s=predicted_s)


__all__ = ["CLASSES", "CRITICAL", "STANDARD", "SHEDDABLE", "FlowControl", "FlowQueue", "Held", "tenant_key"]

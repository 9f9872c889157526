"""Soft-sticky pins (SPEC A3): key hash -> replica, with an idle TTL and a spill counter.

A pin is refreshed whenever its key is routed, so the table kept in
refresh order is also in expiry order: expiring walks from the oldest
end and stops at the first live pin, so its cost is proportional to what
expires, never to the number of pins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .decision import PinEvent
from .names import Cause, PinAction, PinKind, Reason
from .prefix_index import Mark
from .replica import LIVE, Replica

SESSION, PREFIX = PinKind.SESSION, PinKind.PREFIX


class Pin:
    __slots__ = ("replica", "last_used", "spills", "tokens", "engine", "unindexed", "tail", "mark")

    def __init__(self, replica: Replica, now: float):
        self.replica = replica
        self.last_used = now
        self.spills = 0
        self.tokens = 0  # warm policy: prompt tokens of the session's last turn there (C4 cache hint)
        self.engine: int | None = None  # warm policy: the data-parallel engine whose cache holds them
        # warm policy: a turn decided at its headers went there since its last body was read, so the prefix index
        # lacks that turn's blocks: the pin's tokens count as cached there even for a request with a chain
        self.unindexed = False
        # exact mode: (block size, the hash of the last full block) of the last turn priced by the engine's tokens,
        # which the header path checks the home still holds (None: none known)
        self.tail: tuple[int, int] | None = None
        # warm policy, estimate: the chain last read and inserted at the home, which turns decided at their headers
        # touch and check there (None: none)
        self.mark: Mark | None = None


class PinTable:
    """Pins of one kind (session or prefix)."""

    __slots__ = ("kind", "ttl_s", "_pins", "expired", "created", "_counts", "max_pins", "evicted")

    def __init__(self, kind: PinKind, ttl_s: float, max_pins: int = 500_000):
        self.kind = kind
        self.ttl_s = ttl_s  # float("inf") disables expiry (simulator ablation "no pin TTL")
        self._pins: OrderedDict[bytes, Pin] = OrderedDict()
        # past this many, the least recently used pin goes: a client inventing a session id per request must not
        # grow the brain without bound within the TTL (pins.max_pins)
        self.max_pins = max_pins
        self.evicted = 0
        self.expired = 0
        self.created = 0
        self._counts: dict[str, int] = {}  # pins per replica name, kept as pins come and go (admin views poll it)

    def _count(self, pin: Pin, delta: int) -> None:
        name = pin.replica.name
        n = self._counts.get(name, 0) + delta
        if n:
            self._counts[name] = n
        else:
            del self._counts[name]

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[tuple[bytes, Pin]]:
        return iter(self._pins.items())

    def get(self, key: bytes, now: float) -> Pin | None:
        """The live pin of ``key``, or None. An idle pin past its TTL dies here too."""
        pin = self._pins.get(key)
        if pin is not None and now - pin.last_used > self.ttl_s:
            del self._pins[key]
            self._count(pin, -1)
            self.expired += 1
            return None
        return pin

    def peek(self, key: bytes) -> Pin | None:
        """The pin of ``key`` as it stands, expired or not (no bookkeeping)."""
        return self._pins.get(key)

    def apply(self, key: bytes, replica: Replica, engine: int | None, tokens: int, at: float) -> None:
        """Another brain used the key at ``at`` on ``replica`` (shared state): the newest use wins."""
        pin = self._pins.get(key)
        if pin is None:
            pin = self.put(key, replica, at)
        elif pin.last_used > at:
            return
        elif pin.replica is not replica:
            self.move(pin, replica)
            pin.spills = 0
        pin.tokens, pin.engine, pin.last_used = tokens, engine, at
        self._pins.move_to_end(key)

    def touch(self, key: bytes, pin: Pin, now: float) -> None:
        """Restart the idle TTL of a pin that was just used."""
        pin.last_used = now
        self._pins.move_to_end(key)

    def put(self, key: bytes, replica: Replica, now: float) -> Pin:
        pin = Pin(replica, now)
        old = self._pins.get(key)
        if old is not None:
            self._count(old, -1)
        self._pins[key] = pin
        self._pins.move_to_end(key)
        self._count(pin, 1)
        self.created += 1
        while len(self._pins) > self.max_pins:
            _, lru = self._pins.popitem(last=False)
            self._count(lru, -1)
            self.evicted += 1
        return pin

    def move(self, pin: Pin, replica: Replica) -> None:
        """Rebind a pin in the table to another replica."""
        self._count(pin, -1)
        pin.replica = replica
        self._count(pin, 1)

    def delete(self, key: bytes) -> None:
        pin = self._pins.pop(key, None)
        if pin is not None:
            self._count(pin, -1)

    def expire(self, now: float) -> int:
        """Drop every pin idle for longer than the TTL; returns how many."""
        pins = self._pins
        ttl = self.ttl_s
        n = 0
        while pins:
            key, pin = next(iter(pins.items()))
            if now - pin.last_used <= ttl:
                break
            pins.popitem(last=False)
            self._count(pin, -1)
            n += 1
        self.expired += n
        return n

    def contexts_gone(self, name: str) -> None:
        """Replica ``name``'s cache was emptied: its pins' sessions hold no tokens there (an operator's action: a
        walk over the pins is affordable)."""
        for pin in self._pins.values():
            if pin.replica.name == name:
                pin.tokens = 0

    def count_by_replica(self) -> dict[str, int]:
        """Pins per replica name: O(replicas), kept up to date (not a walk over the pins)."""
        return dict(self._counts)

    def follow(self, key: bytes, pin: Pin | None, chosen: Replica, engine: int | None, prompt: int,
               tail: tuple[int, int] | None, header_path: bool,
               now: float) -> tuple[Reason, PinKind | None, list[PinEvent]]:
        """C4: a session's turn went to ``chosen``: its pin follows where its context now lives (a new one, or
        moved only because moving was cheaper, re-prefill included). (the decision's reason, the pin resolved, the
        pin events)."""
        live = chosen.health.state is LIVE and not chosen.drained
        events: list[PinEvent] = []
        if pin is None:
            if live:
                new = self.put(key, chosen, now)
                new.tokens, new.engine, new.tail = prompt, engine, tail
                events.append(PinEvent(PinAction.PIN, self.kind, Cause.NEW))
            return Reason.LOAD, None, events
        reason = Reason.LOAD
        if live:  # A2: a PROBING replica never takes a pin, nor refreshes one
            if pin.replica is chosen and pin.engine == engine:
                reason = Reason.AFFINITY
                pin.tail = tail or pin.tail  # a turn not priced by the engine's tokens leaves the last known
            else:
                dead = pin.replica.removed or pin.replica.health.state is not LIVE
                self.move(pin, chosen)
                events.append(PinEvent(PinAction.REBIND, self.kind, Cause.DEAD if dead else Cause.COST))
                pin.tail = tail
            pin.tokens, pin.engine = prompt, engine
            # a turn decided at its headers adds no blocks to the index: until a body is read again, the pin says how
            # much of the session the home holds
            pin.unindexed = header_path
            self.touch(key, pin, now)
        return reason, self.kind, events

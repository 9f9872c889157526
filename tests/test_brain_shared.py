"""The shell side of shared state without a Redis: what a brain does with entries, and with changes it cannot ship."""

from __future__ import annotations

import asyncio
import time

import orjson

from extproc.brain.shared import SharedState
from extproc.config import SharedStateConfig
from extproc.core import RouterConfig
from extproc.tools.redis_proc import free_port

from .helpers import live_router
from .test_shared import _turn


def _state(router, now: float) -> SharedState:
    return SharedState(SharedStateConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"), router, lambda: now)


def test_entries_from_others_are_applied_in_their_clock_and_our_own_and_strangers_skipped():
    a, now = live_router(4, RouterConfig())
    b, _ = live_router(4, RouterConfig())
    sa, sb = _state(a, now), _state(b, now)
    d = a.select(_turn(1, 0), now)
    events = orjson.dumps(a.outbox.take(), default=lambda x: x.hex())
    entry = {b"o": sa.id.encode(), b"t": repr(now).encode(), b"w": repr(time.time()).encode(), b"e": events}
    sb._apply_entries([(b"1-0", {**entry, b"o": sb.id.encode()}),  # our own: skipped
                       (b"2-0", {b"o": b"stranger", b"e": b"not json"}),  # skipped, nothing breaks
                       (b"3-0", entry)])
    assert sb.last_id == "3-0"
    assert b.replica(d.replica.name).in_flight_requests == 1  # only the one from brain a
    assert sb.stats.peers == 1 and sb.stats.applied_events == 3  # the reservation, the session's home, its blocks
    assert b.policy.session_pins.peek(_turn(1, 0).session_key).replica.name == d.replica.name


def test_a_brain_that_never_started_sharing_drops_what_it_would_ship_instead_of_holding_it():
    r, now = live_router(4, RouterConfig())
    s = _state(r, now)  # warm_start never ran (a discovery that never answered): nothing is shipped

    async def go():
        task = asyncio.create_task(s.run())
        for k in range(50):
            r.select(_turn(k, 0), now)
        deadline = time.monotonic() + 10
        while r.outbox.events and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert not r.outbox.events and s.stats.dropped_events >= 50

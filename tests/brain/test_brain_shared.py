"""The shell side of shared state without a Redis: what a brain does with entries, and with changes it cannot ship."""

from __future__ import annotations

import asyncio
import time

import orjson

from extproc.brain.shared import SharedState
from extproc.config import SharedStateConfig
from extproc.core import RouterConfig
from extproc.tools.stack.redis_server import free_port

from ..helpers import live_router
from ..core.test_shared import _turn


def _state(router, now: float) -> SharedState:
    return SharedState(SharedStateConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"), router, lambda: now)


def test_entries_from_others_are_applied_in_their_clock_and_our_own_and_strangers_skipped():
    a, now = live_router(4, RouterConfig())
    b, _ = live_router(4, RouterConfig())
    sa, sb = _state(a, now), _state(b, now)
    d = a.select(_turn(1, 0), now)
    entry = _entry(sa.id, now, a.outbox.take(), signer=sa)
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


# --- issue 43: shared state trusts nobody ---------------------------------------------------------------------

def _signed_state(router, now: float, tmp_path, **cfg) -> SharedState:
    import os

    secret = tmp_path / "secret"
    if not secret.exists():
        secret.write_text("k" * 32)
        os.chmod(secret, 0o600)
    return SharedState(SharedStateConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", secret_file=str(secret),
                                         **cfg), router, lambda: now)


def _entry(origin: str, now: float, events: list, key: bytes | None = None, signer: SharedState | None = None) -> dict:
    """A stream entry as Redis hands it over: ``signer`` (a brain) signs it as its own, with its fleet MAC if any."""
    from extproc.brain.shared import _mac

    if signer is not None:
        return {k.encode(): v for k, v in signer._fields(events, now)[0].items()}
    o, t, w = origin.encode(), repr(now).encode(), repr(time.time()).encode()
    e = orjson.dumps(events, default=lambda x: x.hex())
    fields = {b"o": o, b"t": t, b"w": w, b"e": e}
    if key is not None:
        fields[b"m"] = _mac(key, o, t, w, e)
    return fields


def test_with_a_secret_only_signed_entries_are_applied_and_the_rest_are_counted(tmp_path):
    a, now = live_router(4, RouterConfig())
    b, _ = live_router(4, RouterConfig())
    sa, sb = _signed_state(a, now, tmp_path), _signed_state(b, now, tmp_path)
    d = a.select(_turn(1, 0), now)
    events = a.outbox.take()
    forged = [("o", 7, name, None, 1000, False, 3333.0, 3333.0, 0, None, 0, now) for name in ("r0", "r1", "r2")]
    sb._apply_entries([(b"1-0", _entry("attacker", now, forged)),  # unsigned
                       (b"2-0", _entry("attacker", now, forged, key=b"another secret" * 2)),  # signed by another key
                       (b"3-0", _entry(sa.id, now, events, signer=sa))])
    assert sb.stats.rejected == {"entry_not_signed": 2}
    assert sum(r.in_flight_requests for r in b.replicas) == 1 and b.replica(d.replica.name).in_flight_requests == 1
    assert set(sb.peers) == {sa.id}


def test_a_reservation_no_request_can_make_is_not_applied():
    from extproc.core.shared import Remote

    b, now = live_router(4, RouterConfig())
    rem = Remote()
    ok = ("o", 1, "r0", None, 1000, False, 2.0, 1.0, 100, None, 100, now)
    for bad in (("o", 2, "r1", None, 1000, False, 1e9, 1.0, 100, None, 100, now),
                ("o", 3, "r1", None, 1000, False, float("nan"), 1.0, 100, None, 100, now),
                ("o", 4, "r1", None, 10**12, False, 2.0, 1.0, 100, None, 100, now),
                ("o", 5, "r1", None, 1000, False, 2.0, 1.0, -5, None, 100, now)):
        rem.apply(b, "x", [bad], 0.0, now)
    rem.apply(b, "x", [ok], 0.0, now)
    assert [r.in_flight_requests for r in b.replicas] == [1, 0, 0, 0]


def test_a_snapshot_bomb_is_refused_before_it_is_inflated(tmp_path):
    import zlib

    r, now = live_router(4, RouterConfig())
    s = _state(r, now)
    bomb = zlib.compress(orjson.dumps({"stream_id": "1-0", "state": {"pins": [], "pad": "0" * (64 * 2**20)}}), 9)
    assert len(bomb) < 200_000
    small = SharedState(SharedStateConfig(redis_url=s.cfg.redis_url, snapshot_max_bytes=2**20), r, lambda: now)
    assert small._read_snapshot(bomb) is None and small.stats.rejected == {"snapshot_unreadable": 1}
    fine = zlib.compress(orjson.dumps({"stream_id": "1-0", "state": {"pins": []}}))
    assert small._read_snapshot(fine)["stream_id"] == "1-0"
    # signed fleet: an unsigned snapshot (or one signed with another key) is not read at all
    signed = _signed_state(r, now, tmp_path)
    assert signed._read_snapshot(fine) is None and signed.stats.rejected == {"snapshot_not_signed": 1}


def test_a_malformed_snapshot_entry_is_skipped_not_raised():
    from extproc.core.shared import import_state

    r, now = live_router(4, RouterConfig())
    import_state(r, {"pins": [["session"], 5, None, ["session", "zz", "r0", None, 1, 0]],
                     "index": [["r0"], 7, ["r0", None, [[1, 2], ["x"], 3]], ["r0", "e", [[1]]]]}, now)
    assert r.policy.index_of(r.replica("r0"), None).holds(2)


class FakeRedis:
    """The commands SharedState uses, on one stream and strings, for the paths a real Redis cannot be made to take
    on cue (a planted largest id, a snapshot from the future)."""

    def __init__(self):
        self.entries: list[tuple[bytes, dict]] = []
        self.strings: dict[str, bytes] = {}
        self.deleted = 0

    @staticmethod
    def _key(eid: bytes):
        ms, _, sq = eid.decode().partition("-")
        return int(ms), int(sq or 0)

    async def xrange(self, stream, min="-", count=None):
        lo = (-1, -1) if min == "-" else self._key(min[1:].encode())
        out = [e for e in self.entries if self._key(e[0]) > lo]
        return out[:count] if count else out

    async def xrevrange(self, stream, count=None):
        return list(reversed(self.entries))[:count]

    async def get(self, key):
        return self.strings.get(key)

    async def xadd(self, stream, fields, **kw):
        top = self._key(self.entries[-1][0]) if self.entries else (0, 0)
        if top >= (2**64 - 1, 0):
            raise RuntimeError("ERR The ID specified in XADD is equal or smaller than the target stream top item")
        eid = f"{top[0] + 1}-0".encode()
        self.entries.append((eid, {k.encode() if isinstance(k, str) else k: v for k, v in fields.items()}))
        return eid

    async def delete(self, key):
        self.entries.clear()
        self.deleted += 1


def test_a_snapshot_that_claims_a_future_stream_id_is_not_adopted(tmp_path):
    import zlib

    from extproc.brain.shared import _SIGNED, _mac

    r, now = live_router(4, RouterConfig())
    s = _signed_state(r, now, tmp_path)
    fake = FakeRedis()
    s._redis = fake
    blob = zlib.compress(orjson.dumps({"stream_id": "99999999999999-0", "state": {
        "pins": [["session", "ab" * 8, "r2", None, 100, 1.0]], "index": []}}))
    fake.strings[s.snapshot_key] = _SIGNED + _mac(s.key, blob) + blob
    asyncio.run(fake.xadd(s.stream, _entry("peer", now, [], key=s.key)))
    asyncio.run(s._sync())
    assert s.stats.future_ids == 1 and s.last_id == "1-0"  # replayed the stream instead of waiting for 99999...
    assert r.policy.session_pins.peek(bytes.fromhex("ab" * 8)) is None


def test_a_stream_that_cannot_advance_is_started_again_and_a_brain_ahead_of_it_rewinds(tmp_path):
    r, now = live_router(4, RouterConfig())
    s = _signed_state(r, now, tmp_path, flush_ms=1.0, heartbeat_s=0.01, peer_timeout_s=1.0)
    fake = FakeRedis()
    s._redis = fake
    top = f"{2**64 - 1}-0".encode()
    fake.entries.append((top, _entry("attacker", now, [])))  # the planted largest id

    async def flush_once():
        task = asyncio.create_task(s._flusher())
        deadline = time.monotonic() + 10
        while not (s.stats.published_entries and fake.entries and fake.entries[-1][0] != top) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(flush_once())
    assert s.stats.stream_stuck == 1 and fake.deleted == 1 and fake.entries[-1][0] == b"1-0"
    # a brain that had read the planted entry is ahead of the new stream: it rewinds and resynchronises
    s.last_id = top.decode()
    s._last_check = -1e9

    async def read_once():
        fake.xread = lambda *a, **kw: _nothing()
        task = asyncio.create_task(s._reader())
        deadline = time.monotonic() + 10
        while not s.stats.future_ids and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(read_once())
    assert s.stats.future_ids == 1 and s.last_id == "1-0"


async def _nothing():
    await asyncio.sleep(0.01)
    return []


def test_a_flush_that_fails_keeps_closes_and_forwarded_ends_for_the_next_and_drops_the_rest():
    # a lost close holds load on every peer until its safety timeout; a lost forwarded end on its owner until the
    # liveness bound (~27 s): a turn not released on a loaded machine, where Redis answered a flush late once
    r, now = live_router(4, RouterConfig())
    s = _state(r, now)
    d = r.select(_turn(1, 0), now)
    r.release(d.reservation, now)
    s.outbox.events.append(("x", 41, "digest"))
    before = list(s.outbox.events)

    class Redis:
        def __init__(self, fail: bool):
            self.fail, self.added = fail, []

        async def xadd(self, stream, fields, **kw):
            if self.fail:
                raise ConnectionError("Redis away")
            self.added.append(orjson.loads(fields["e"]))

    async def flush(redis):
        s._redis = redis
        task = asyncio.create_task(s._flusher())
        deadline = time.monotonic() + 10
        while not task.done() and not getattr(redis, "added", None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(flush(Redis(fail=True)))
    kinds = [e[0] for e in before]
    assert "c" in kinds and "o" in kinds and not r.outbox.events
    assert s.stats.dropped_events == sum(k not in ("c", "x") for k in kinds)
    ok = Redis(fail=False)
    asyncio.run(flush(ok))
    shipped = [tuple(e) for e in ok.added[0]]
    assert ("c", d.reservation.id) in shipped and ("x", 41, "digest") in shipped
    assert not any(e[0] == "o" for e in shipped)


def test_a_flusher_cancelled_as_its_write_completes_stops():
    # Python 3.11's asyncio.wait_for returns a call's result when its task is cancelled as the call completes, and
    # the cancel is lost: the flusher looped on, and whatever awaited its end (a brain's shutdown; once in a make
    # test, the test above) waited for ever
    r, now = live_router(4, RouterConfig())
    s = _state(r, now)
    s.outbox.events.append(("x", 41, "digest"))
    task: asyncio.Task | None = None

    class Redis:
        async def xadd(self, stream, fields, **kw):
            assert task is not None
            task.cancel()

    async def run() -> bool:
        nonlocal task
        s._redis = Redis()
        task = asyncio.create_task(s._flusher())
        deadline = time.monotonic() + 10
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stopped = task.cancelled()
        task.cancel()  # asleep between flushes now: this one is not lost
        await asyncio.gather(task, return_exceptions=True)
        return stopped

    assert asyncio.run(run())

"""Shared state through Redis: ship this brain's state changes, apply the others'.

The core writes what each decision changes into ``router.outbox`` (``core.shared``); nothing on the request
path touches the network. Here, off the request path:

- **flush**: every ``flush_ms`` the outbox is taken and appended to one Redis Stream as one entry (origin,
  its clock, wall time, the events as JSON). A Stream, not Pub/Sub: entries stay for a brain that was away
  (a reconnect replays what it missed from its last entry id, in order), and a starting brain replays what
  came after the snapshot it read. Trimmed to about ``stream_max_entries``.
- **read**: a blocking XREAD from the last id; each other brain's entry is applied in its order, with its
  clock turned into ours. An entry is also that brain's heartbeat; a brain with nothing to say appends an
  empty entry every ``heartbeat_s``. A brain silent for ``peer_timeout_s`` is gone: its requests in flight
  no longer load the replicas here (``Remote.forget_origin``).
- **snapshot**: every ``snapshot_every_s`` one brain (whoever takes a short lock) writes the whole view
  (pins and prefix index, ``export_state``) with the stream id it reflects; a starting brain, or one whose
  missed entries were trimmed away, imports it and replays from that id before it reports SERVING.
- **Redis down, slow, refusing the password**: counted, logged once per change, retried with backoff up to
  30 s; meanwhile the brain routes on its own view and drops what it would have shipped (counted). When
  Redis is back the brain replays what it missed, or resynchronises from the snapshot.
- **Trusting nobody**: with ``secret_file`` every entry and snapshot carries an HMAC-SHA256 under the
  fleet's secret, and what does not verify is dropped and counted (whoever can write to Redis cannot steer routing
  or speak as another brain); entries and snapshots are bounded in size before they are parsed; a stream that
  cannot advance (an entry planted with the largest id) is deleted and started again, and a brain whose last id is
  ahead of the stream (or a snapshot that claims a future id) resynchronises instead of waiting forever.
- **A peer's blast radius**: the fleet's secret says an entry is the fleet's, not whose. Each brain also
  signs its entries with an Ed25519 key of its own, made at start and never stored; its origin names the key's
  fingerprint, and an entry whose signature does not verify under the key its origin names is dropped: a brain
  holding the fleet's secret cannot speak as another (forged under a live brain's id, reservations lasted past
  33 s). What one origin can claim is bounded (``core.shared.Remote``: open reservations, each one's work and KV,
  its chains' blocks), at most ``max_peers`` origins are heard at once, an entry is applied in slices between
  which decisions run (an 8 MiB entry stalled both brains 460 ms), and a snapshot is bounded in what it inflates to.
"""

from __future__ import annotations

from typing import Any

import asyncio
import hashlib
import hmac
import math
import os
import random
import socket
import time
import zlib

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ..config import SharedStateConfig
from ..core import Router
from ..core.shared import export_state, import_state
from . import logs
from ..core.bounded import within
from .stats import SharedStats

_BACKOFF_MAX_S = 30.0
_READ_BLOCK_MS = 1000
_READ_COUNT = 2000
_SNAPSHOT_MAX_BYTES = 512 * 1024 * 1024  # Redis's own limit for a string
_ENTRY_MAX_BYTES = 2 * 1024 * 1024  # one entry's events (20 ms of decisions: tens of KiB); larger is not parsed
_ENTRY_MAX_EVENTS = 100_000
_ORIGIN_MAX_CHARS = 200
_FINGERPRINT_CHARS = 32  # 128 bits of the origin's public key's SHA-256: no second key is found to match it
_SLICE_S = 0.005  # applying others' entries yields to the decisions this often
_SLICE_EVENTS = 256  # events applied between two looks at the time
_SIGNED = b"wr1s"  # a signed snapshot: this, then its 32-byte MAC, then the compressed view
# Redis's answers to an XADD after the largest id (7.x: "exhausted"; others: "equal or smaller")
_STUCK = ("exhausted the last possible ID", "equal or smaller than the target stream top item")
# what a flush that failed (or a Redis away for a moment) must not lose: a close (else every peer counts the
# reservation until its safety timeout) and an end forwarded to its owner (else the owner counts it until its
# liveness bound, ~27 s by default: seen as a turn not released on a loaded machine). The rest is a view
# that the next decisions or a snapshot repair
_CARRIED = ("c", "x")
_CARRY_MAX = 20_000


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, _signed_parts(*parts), hashlib.sha256).digest()


def inflate_bounded(raw: bytes, limit: int) -> bytes:
    """``zlib.decompress`` that stops at ``limit`` bytes: a 400 KB "bomb" took a starting brain to 1.28 GB."""
    d = zlib.decompressobj()
    out = d.decompress(raw, limit)
    if d.unconsumed_tail or not d.eof:
        raise ValueError(f"inflates past {limit} bytes (shared_state.snapshot_max_bytes)")
    return out


def brain_id(cfg: SharedStateConfig, public_key: bytes) -> str:
    """The configured name (or host and process) and the fingerprint of this start's own signing key: a restarted
    brain is a new origin, so that its predecessor's entries are replayed like any other's and its reservation ids,
    counted from 1 again, are its own; and only the holder of that key can write as it."""
    return f"{cfg.brain_id or socket.gethostname()[:40] + '-' + str(os.getpid())}~{fingerprint(public_key)}"


def fingerprint(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:_FINGERPRINT_CHARS]


def _signed_parts(*parts: bytes) -> bytes:
    """What an origin signs: each part's length first (no two splits of the same bytes sign alike)."""
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _password(cfg: SharedStateConfig) -> str | None:
    if cfg.password_file is None:
        return None
    with open(cfg.password_file, encoding="utf-8") as f:
        return f.read().strip()


def _failure_kind(e: BaseException) -> str:
    import redis.exceptions as rx

    if isinstance(e, (rx.AuthenticationError, rx.AuthorizationError)) or "NOAUTH" in str(e) or "WRONGPASS" in str(e):
        return "auth"
    if isinstance(e, (rx.TimeoutError, asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(e, (rx.ConnectionError, ConnectionError, OSError)):
        return "connect"
    return "error"


class SharedState:
    def __init__(self, cfg: SharedStateConfig, router: Router, clock, stats: SharedStats | None = None):
        self.cfg = cfg
        self.router = router
        self.clock = clock
        self.stats = stats or SharedStats()
        self.stats.enabled = 1
        self._signing = Ed25519PrivateKey.generate()  # this start's own: never stored, never shared
        self.public_key = self._signing.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.id = brain_id(cfg, self.public_key)
        self._peer_keys: dict[str, Ed25519PublicKey] = {}  # origin -> its verified key (the heard ones)
        p = cfg.key_prefix
        self.stream, self.snapshot_key, self.lock_key = f"{p}events", f"{p}snapshot", f"{p}snapshot:lock"
        outbox = router.share(True)
        assert outbox is not None
        self.outbox = outbox
        router.remote.max_open = cfg.peer_max_reservations
        self.last_id = "0-0"
        self.peers: dict[str, float] = {}  # brain id -> when we last heard from it (our clock)
        self._redis: Any = None  # redis.asyncio.Redis once connected (imported only with sharing on)
        self._down_logged: str | None = None  # the failure kind last logged (one line per change)
        self._connected = asyncio.Event()
        self._last_flush = 0.0
        self._synced = False  # a snapshot was imported (or found absent) once: later gaps replay or resync
        self.started = asyncio.Event()  # warm_start is over, warmed or not: run() may begin
        self.key: bytes | None = None  # the fleet's signing secret (secret_file); None: unsigned
        if cfg.secret_file:
            from .files import read_secret_file

            self.key = read_secret_file(cfg.secret_file, "shared_state.secret_file")
        else:
            logs.event("shared_state_unsigned", advice="set shared_state.secret_file: without it whoever can write to "
                                                       "Redis can steer routing")
        self.stats.signed = int(self.key is not None)
        self.stats.peer_seen = self.peers
        self._rejected_logged: dict[str, float] = {}  # reason -> when last logged (one line a minute per reason)
        self._last_check = 0.0
        self._carry: list[tuple] = []  # closes and forwarded ends not shipped yet (_CARRIED)

    def _keep(self, events: list[tuple]) -> None:
        """Events that could not be shipped: closes and forwarded ends wait for the next flush (bounded); the
        rest are dropped and counted."""
        keep = [e for e in events if e and e[0] in _CARRIED]
        self.stats.dropped_events += len(events) - len(keep)
        self._carry.extend(keep)
        if len(self._carry) > _CARRY_MAX:
            self.stats.dropped_events += len(self._carry) - _CARRY_MAX
            del self._carry[:-_CARRY_MAX]

    # ---------------------------------------------------------------- connection

    def _client(self):
        import redis.asyncio as aredis

        c = self.cfg
        kw = dict(socket_timeout=c.timeout_s + _READ_BLOCK_MS / 1000, socket_connect_timeout=c.timeout_s,
                  health_check_interval=0, retry_on_timeout=False, decode_responses=False)
        pw = _password(c)
        if pw is not None:
            kw["password"] = pw
        if c.username:
            kw["username"] = c.username
        if c.redis_url.startswith("rediss://"):
            kw.update(ssl_ca_certs=c.tls_ca_file, ssl_certfile=c.tls_cert_file, ssl_keyfile=c.tls_key_file)
        return aredis.Redis.from_url(c.redis_url, **kw)

    async def _connect(self) -> None:
        r = self._client()
        try:
            await within(r.ping(), self.cfg.timeout_s * 2)
        except BaseException:
            await r.aclose()
            raise
        self._redis = r

    async def _close(self) -> None:
        r, self._redis = self._redis, None
        self._connected.clear()
        if r is not None:
            try:
                await r.aclose()
            except Exception:
                pass

    def _down(self, e: BaseException) -> None:
        kind = _failure_kind(e)
        self.stats.failures[kind] += 1
        was_up = self.stats.up
        self.stats.up = 0
        if was_up or self._down_logged != kind:
            self._down_logged = kind
            msg = "the password or ACL user was refused" if kind == "auth" else f"{type(e).__name__}: {e}"[:200]
            logs.event("shared_state_down", kind=kind, error=msg, routing="local view only")

    def _up(self, how: str) -> None:
        if not self.stats.up:
            logs.event("shared_state_up", brain=self.id, how=how, peers=len(self.peers))
        self.stats.up = 1
        self._down_logged = None
        self._connected.set()

    # ---------------------------------------------------------------- start

    async def warm_start(self) -> bool:
        """Connect, import the snapshot and replay what came after it; bounded by warm_start_timeout_s. False:
        Redis could not be read in time (the brain starts on its own view and catches up when Redis answers)."""
        t0 = time.monotonic()
        try:
            await within(self._sync(), self.cfg.warm_start_timeout_s)
        except Exception as e:  # noqa: BLE001 - whatever Redis did, the brain starts
            self._down(e)
            await self._close()
            return False
        finally:
            self.stats.warm_start_seconds = round(time.monotonic() - t0, 3)
            self.started.set()
        self._up("warm start")
        logs.event("shared_state_warm", seconds=self.stats.warm_start_seconds, replayed=self.stats.replayed_entries,
                   pins=sum(len(t) for t in self.router.policy.pin_tables()))
        return True

    async def _sync(self) -> None:
        """(Re)connect, then catch up: from the last entry applied if Redis still holds it, else from the
        snapshot (and its stream id)."""
        if self._redis is None:
            await self._connect()
        r = self._redis
        first = await r.xrange(self.stream, count=1)
        # what this brain has not applied is gone from the stream (trimmed, or Redis restarted): the snapshot
        missed = not self._synced or (first and _id_lt(self.last_id, first[0][0].decode()))
        if missed:
            raw = await r.get(self.snapshot_key)
            doc = await asyncio.to_thread(self._read_snapshot, raw) if raw else None
            if doc is not None:
                top = await self._top_id(r)
                sid = doc["stream_id"]
                if _id_lt(top, sid):
                    # it claims entries the stream never had: adopting its id would skip every entry until then
                    self._reject("snapshot_from_the_future", f"snapshot at {sid}, stream at {top}")
                    self.stats.future_ids += 1
                else:
                    try:
                        import_state(self.router, doc["state"], self.clock())
                    except Exception as e:  # noqa: BLE001 - a snapshot we cannot read changes what it changed so far
                        self._reject("snapshot_unreadable", type(e).__name__)
                    if self._synced:
                        self.stats.resyncs += 1
                    if _id_lt(self.last_id, sid):
                        self.last_id = sid
            self._synced = True
        while True:  # replay in chunks; each chunk is applied before the next is read
            entries = await r.xrange(self.stream, min=f"({self.last_id}" if self.last_id != "0-0" else "-",
                                     count=_READ_COUNT)
            if not entries:
                break
            await self._apply_sliced(entries, replay=True)
            self.stats.replayed_entries += len(entries)

    # ---------------------------------------------------------------- loops

    async def run(self) -> None:
        """Forever: read, flush, heartbeat and snapshot while Redis answers; reconnect with backoff when not."""
        while not self.started.is_set():  # a brain not yet ready (discovery) ships nothing: what it changed is dropped
            try:
                await within(self.started.wait(), 1.0)
            except asyncio.TimeoutError:
                self._keep(self.outbox.take())
        backoff = 0.5
        while True:
            try:
                if self._redis is None or not self.stats.up:
                    await self._sync()
                    self._up("reconnected")
                    backoff = 0.5
                await self._serve()
            except asyncio.CancelledError:
                await self._close()
                raise
            except Exception as e:  # noqa: BLE001 - Redis failing in any way: local routing, retry
                self._down(e)
                await self._close()
                self._forget_silent()
                await self._sleep_dropping(backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)

    async def _sleep_dropping(self, seconds: float) -> None:
        """Wait out a backoff, dropping (and counting) what the decisions meanwhile changed."""
        end = time.monotonic() + seconds * random.uniform(0.8, 1.2)
        while True:
            self._keep(self.outbox.take())
            self._forget_silent()
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, self.cfg.flush_ms / 1000 * 20))

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(self._reader(), name="shared-read"),
                 asyncio.create_task(self._flusher(), name="shared-flush"),
                 asyncio.create_task(self._snapshotter(), name="shared-snapshot")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _reader(self) -> None:
        r = self._redis
        while True:
            got = await r.xread({self.stream: self.last_id}, count=_READ_COUNT, block=_READ_BLOCK_MS)
            for _, entries in got or ():
                await self._apply_sliced(entries)
            self._forget_silent()
            now = self.clock()
            if not got and now - self._last_check >= self.cfg.heartbeat_s:
                self._last_check = now
                top = await self._top_id(r)
                if _id_lt(top, self.last_id):
                    # this brain's last id is past the stream's newest (a planted entry deleted, Redis restarted empty,
                    # a snapshot's claim): nothing after it would ever come. Start again from the snapshot
                    self.stats.future_ids += 1
                    logs.event("shared_state_rewound", last_id=self.last_id[:40], stream_top=top[:40])
                    self.last_id, self._synced = "0-0", False
                    await self._sync()

    async def _top_id(self, r) -> str:
        top = await within(r.xrevrange(self.stream, count=1), self.cfg.timeout_s)
        return top[0][0].decode() if top else "0-0"

    def _admit(self, eid, fields, replay: bool, now: float, wall: float) -> tuple[str, list, float] | None:
        """An entry's origin, events and clock offset, once it is shown to be the fleet's (its MAC) and its
        origin's own (its signature); None (counted) for anything else, our own entries included."""
        self.last_id = eid.decode() if isinstance(eid, bytes) else eid
        try:
            o, t, w, e = fields[b"o"], fields[b"t"], fields[b"w"], fields.get(b"e", b"")
            if len(o) > _ORIGIN_MAX_CHARS or len(e) > _ENTRY_MAX_BYTES:
                self._reject("entry_too_large", f"{len(e)} bytes")
                return None
            if self.key is not None and not hmac.compare_digest(fields.get(b"m", b""), _mac(self.key, o, t, w, e)):
                self._reject("entry_not_signed", "no valid MAC under shared_state.secret_file")
                return None
            origin = o.decode()
            if origin == self.id:
                return None
            if not self._signed_by_origin(origin, fields, o, t, w, e):
                return None
            if origin not in self.peers and len(self.peers) >= self.cfg.max_peers and not replay:
                self._reject("too_many_peers", f"{len(self.peers)} heard from (shared_state.max_peers)")
                return None
            sent_wall, sent_clock = float(w), float(t)
            if not (math.isfinite(sent_wall) and math.isfinite(sent_clock)):
                raise ValueError("time")
            transit = min(max(0.0, wall - sent_wall), self.cfg.peer_timeout_s)
            # the origin's clock at the flush was now - transit here: that is the offset between the two
            offset = now - transit - sent_clock
            events = orjson.loads(e) if e else []
            if not isinstance(events, list) or len(events) > _ENTRY_MAX_EVENTS:
                raise ValueError("events")
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, orjson.JSONDecodeError):
            self._reject("entry_malformed", "")
            return None  # an entry from another version or a stranger: skipped
        if replay and transit >= self.cfg.peer_timeout_s:
            # an old entry: its pins and index count, its reservations ended long ago (or soon will)
            events = [e for e in events if e and e[0] in ("h", "i")]
        else:
            self.peers[origin] = now
            self.stats.lag_seconds = round(transit, 4)
        return origin, events, offset

    def _signed_by_origin(self, origin: str, fields, *parts: bytes) -> bool:
        """The entry's signature verifies under the key its origin names (the origin ends in the key's
        fingerprint): only the brain that made that key writes as that origin."""
        pub = self._peer_keys.get(origin)
        if pub is None:
            raw = fields.get(b"k", b"")
            if not isinstance(raw, bytes) or len(raw) != 32 or not origin.endswith("~" + fingerprint(raw)):
                self._reject("entry_not_signed_by_origin", "no key whose fingerprint the origin names")
                return False
            pub = Ed25519PublicKey.from_public_bytes(raw)
        try:
            pub.verify(fields.get(b"s", b""), _signed_parts(*parts))
        except (InvalidSignature, TypeError, ValueError):
            self._reject("entry_not_signed_by_origin", "the signature does not verify under the origin's key")
            return False
        if origin not in self._peer_keys:
            self._peer_keys[origin] = pub
            if len(self._peer_keys) > 4 * self.cfg.max_peers:  # keys of origins long gone
                for gone in [k for k in self._peer_keys if k not in self.peers][: len(self._peer_keys) // 2]:
                    del self._peer_keys[gone]
        return True

    def _apply_entries(self, entries, replay: bool = False) -> None:
        """Apply entries at once (a test, or a caller that may block)."""
        now, wall = self.clock(), time.time()
        for eid, fields in entries:
            got = self._admit(eid, fields, replay, now, wall)
            if got is not None:
                self._apply(*got, now)
        self._counted()

    async def _apply_sliced(self, entries, replay: bool = False) -> None:
        """Apply entries between decisions: at most ``_SLICE_S`` of work at a time, then the event loop runs what
        waits (an 8 MiB entry applied whole stalled the brain 460 ms)."""
        t0 = time.monotonic()
        for eid, fields in entries:
            now, wall = self.clock(), time.time()
            got = self._admit(eid, fields, replay, now, wall)
            if got is not None:
                origin, events, offset = got
                for k in range(0, len(events), _SLICE_EVENTS):
                    self._apply(origin, events[k:k + _SLICE_EVENTS], offset, self.clock())
                    if time.monotonic() - t0 >= _SLICE_S:
                        await asyncio.sleep(0)
                        t0 = time.monotonic()
            # a rejected entry costs its checks too (a signature, ~0.2 ms): 2,000 forged ones are slices as well
            if time.monotonic() - t0 >= _SLICE_S:
                await asyncio.sleep(0)
                t0 = time.monotonic()
        self._counted()

    def _apply(self, origin: str, events: list, offset: float, now: float) -> None:
        before = self.router.remote.applied
        self.router.apply(origin, events, offset, now)
        self.stats.applied_events += self.router.remote.applied - before

    def _counted(self) -> None:
        self.stats.index_gaps = self.router.remote.index_gaps
        self.stats.peers = len(self.peers)

    def _reject(self, reason: str, detail: str) -> None:
        """An entry or snapshot not applied: counted by reason, one log line a minute per reason."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._rejected_logged.get(reason, -1e9) >= 60:
            self._rejected_logged[reason] = now
            logs.event("shared_state_rejected", reason=reason, detail=detail[:120], count=self.stats.rejected[reason])

    def _read_snapshot(self, raw: bytes) -> dict | None:
        """The snapshot's document, verified and bounded; None (counted) when it cannot be trusted or read."""
        if self.key is not None:
            if not raw.startswith(_SIGNED) or not hmac.compare_digest(raw[4:36], _mac(self.key, raw[36:])):
                self._reject("snapshot_not_signed", "no valid MAC under shared_state.secret_file")
                return None
            raw = raw[36:]
        elif raw.startswith(_SIGNED):
            self._reject("snapshot_not_signed", "signed by a fleet with shared_state.secret_file; this brain has none")
            return None
        try:
            doc = orjson.loads(inflate_bounded(raw, self.cfg.snapshot_max_bytes))
            if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
                raise ValueError("not a snapshot")
            _id_lt("0-0", doc.setdefault("stream_id", "0-0"))  # a stream id, or ValueError
            return doc
        except (ValueError, TypeError, zlib.error, orjson.JSONDecodeError) as e:
            # the kind only: a foreign document's text is never echoed into the log
            self._reject("snapshot_unreadable", type(e).__name__)
            return None

    def _forget_silent(self) -> None:
        now = self.clock()
        for origin, seen in list(self.peers.items()):
            if now - seen > self.cfg.peer_timeout_s:
                del self.peers[origin]
                self.stats.peers_gone += 1
                n = self.router.remote.forget_origin(self.router, origin, now)
                logs.event("shared_state_peer_gone", peer=origin, released_reservations=n)
        if not self.stats.up:  # nobody is heard from while Redis is away: their load is not known any more
            for origin in list(self.router.remote.origins()):
                self.router.remote.forget_origin(self.router, origin, now)
        self.stats.peers = len(self.peers)

    async def _flusher(self) -> None:
        r = self._redis
        every = self.cfg.flush_ms / 1000
        while True:
            await asyncio.sleep(every)
            events = self.outbox.take()
            if self._carry:
                events, self._carry = self._carry + events, []
            now = self.clock()
            if not events and now - self._last_flush < self.cfg.heartbeat_s:
                continue
            try:
                for fields in self._fields(events, now):
                    await self._add(r, fields)
            except BaseException:
                self._keep(events)  # a timeout may have added it anyway: a close or an end applied twice is once
                raise
            self._last_flush = now
            self.stats.published_events += len(events)
            self.stats.published_entries += 1

    def _fields(self, events: list, now: float) -> list[dict]:
        """The stream entries that carry ``events``: signed by this brain (and the fleet, with a secret), each
        below the size a peer reads (a flood of new long sessions indexes tens of MB in one flush)."""
        e = orjson.dumps(events, default=_hex)
        if len(e) > _ENTRY_MAX_BYTES // 2 and len(events) > 1:
            half = len(events) // 2
            return self._fields(events[:half], now) + self._fields(events[half:], now)
        o, t, w = self.id.encode(), repr(now).encode(), repr(time.time()).encode()
        fields = {"o": o, "t": t, "w": w, "e": e, "k": self.public_key,
                  "s": self._signing.sign(_signed_parts(o, t, w, e))}
        if self.key is not None:
            fields["m"] = _mac(self.key, o, t, w, e)
        return [fields]

    async def _add(self, r, fields: dict) -> None:
        try:
            await within(r.xadd(self.stream, fields, maxlen=self.cfg.stream_max_entries,
                                          approximate=True), self.cfg.timeout_s)
        except Exception as exc:  # noqa: BLE001 - only Redis's "cannot advance" is ours to mend here
            if not any(m in str(exc) for m in _STUCK):
                raise
            # an entry with the largest id sits on top: no XADD can follow it, sharing would stop for good.
            # The stream goes (its entries are applied, or a snapshot covers them) and starts again
            self.stats.stream_stuck += 1
            logs.event("shared_state_stream_stuck", stream=self.stream, action="deleted and started again")
            await within(r.delete(self.stream), self.cfg.timeout_s)
            await within(r.xadd(self.stream, fields, maxlen=self.cfg.stream_max_entries,
                                          approximate=True), self.cfg.timeout_s)

    async def _snapshotter(self) -> None:
        r = self._redis
        every = self.cfg.snapshot_every_s
        await asyncio.sleep(every * random.uniform(0.5, 1.0))
        while True:
            if await within(r.set(self.lock_key, self.id, nx=True, ex=max(1, int(every))),
                                      self.cfg.timeout_s):
                await self.write_snapshot()
            await asyncio.sleep(every)

    async def write_snapshot(self) -> int:
        """The whole view with the id of the last entry applied into it; bytes written."""
        stream_id, now = self.last_id, self.clock()
        # the copy runs off the loop (a large view takes ~0.1 s to walk): requests are not held behind it
        state = await asyncio.to_thread(export_state, self.router, now)
        blob = await asyncio.to_thread(lambda: zlib.compress(orjson.dumps({"stream_id": stream_id, "state": state}), 1))
        if self.key is not None:
            blob = _SIGNED + _mac(self.key, blob) + blob
        if len(blob) > _SNAPSHOT_MAX_BYTES:
            logs.event("shared_state_snapshot_too_large", bytes=len(blob))
            return 0
        await within(self._redis.set(self.snapshot_key, blob), self.cfg.timeout_s * 5)
        self.stats.snapshots_written += 1
        return len(blob)

    async def close(self) -> None:
        await self._close()


def _hex(x):
    """Key hashes are bytes in the core; JSON carries them as hex (only hashes leave the brain)."""
    if isinstance(x, bytes):
        return x.hex()
    raise TypeError(type(x).__name__)


def _id_lt(a: str, b: str) -> bool:
    """Stream ids in order; a ValueError for anything that is not one (a snapshot's claim is not trusted)."""
    if not isinstance(a, str) or not isinstance(b, str) or len(a) > 41 or len(b) > 41:
        raise ValueError("not a stream id")
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    return (int(am), int(asq or 0)) < (int(bm), int(bsq or 0))


__all__ = ["SharedState", "SharedStats", "brain_id"]

"""Each engine's KV events: a source in DESIGN.md's sense. A reader per engine subscribes to its ZMQ
publisher, asks its replay socket for what it missed, and hands the core plain values (``core.engine_cache``);
the core never knows ZMQ, and a decision never waits on a reader.

vLLM 0.32 publishes frames ``[topic, seq (8 bytes, big-endian), payload]``, the payload msgpack ``[ts, [events],
dp_rank]``, each event a map with a ``type`` (older releases: a positional array led by the type). Its replay
socket (ROUTER) answers an 8-byte start sequence with every buffered batch from there, then ``[b"", -1, b""]``.
With ``tcp://*:PORT`` vLLM binds and a subscriber connects; a data-parallel engine r publishes on PORT + r.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..core.engine_cache import GPU, Cleared, Removed, Stored

log = logging.getLogger("warmroute.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# BlockStored's fields in the order an array-form event lists them after its type (vllm/distributed/kv_events.py)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                  "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
MAX_FRAME_BYTES = 16 * 2**20  # a batch bigger than this is no engine's: dropped, counted as lost
MAX_REPLAY_BATCHES = 20_000
_decoder = msgspec.msgpack.Decoder()


class BadBatch(ValueError):
    pass


def _as_map(ev: Any) -> dict:
    if isinstance(ev, dict):
        return ev
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(ev[0], ())
        return {"type": ev[0], **dict(zip(fields, ev[1:]))}
    raise BadBatch(f"an event of type {type(ev).__name__}")


def _text(v: Any) -> str | None:
    """A medium or locality: vLLM names them in capitals; another publisher's "cpu" is the same tier."""
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > 64:
        raise BadBatch("a medium or locality that is not a short string")
    return v.upper()


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise BadBatch("block_hashes is not a list")
    out = []
    for h in v:
        if isinstance(h, bytes):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the full digest
            h = int.from_bytes(h[-8:], "big")
        if not isinstance(h, int) or isinstance(h, bool):
            raise BadBatch("a block hash is neither an integer nor bytes")
        out.append(h)
    return tuple(out)


def decode_batch(payload: bytes) -> tuple[float, list, int | None]:
    """One published payload as ``(ts, [Stored | Removed | Cleared], dp_rank)``; anything else raises BadBatch."""
    if len(payload) > MAX_FRAME_BYTES:
        raise BadBatch(f"a batch of {len(payload)} bytes")
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise BadBatch(str(e)) from None
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], (list, tuple)):
        raise BadBatch("not [ts, events, dp_rank]")
    events: list = []
    for raw in obj[1]:
        ev = _as_map(raw)
        kind = ev.get("type")
        if kind == "BlockStored":
            parent = ev.get("parent_block_hash")
            if isinstance(parent, bytes):
                parent = int.from_bytes(parent[-8:], "big")
            tokens = ev.get("token_ids") or ()
            size = ev.get("block_size")
            medium, locality = _text(ev.get("medium")), _text(ev.get("locality"))
            # an offloading connector's store of a chunk it has no tokens for is a residency claim alone (vLLM's
            # placeholder: block_size 0, no tokens): a tier's blocks are never verified, only looked up
            offloaded = medium not in (None, GPU)
            if not isinstance(size, int) or size < (0 if offloaded else 1) or not all(isinstance(t,
                                                                                                 int) for t in tokens):
                raise BadBatch("a stored block without its size or tokens")
            extra = ev.get("extra_keys")
            events.append(Stored(_hashes(ev.get("block_hashes")), parent, tuple(tokens), size, medium,
                                 ev.get("lora_name"),
                                 tuple(tuple(k) if isinstance(k, (list,
                                                                  tuple)) else k for k in extra) if extra else None,
                                 ev.get("kv_cache_spec_kind"), locality))
        elif kind == "BlockRemoved":
            events.append(Removed(_hashes(ev.get("block_hashes")), _text(ev.get("medium")), _text(ev.get("locality"))))
        elif kind == "AllBlocksCleared":
            events.append(Cleared())
        # an event type a later vLLM adds is skipped: it cannot change what the three above say
    ts = obj[0] if isinstance(obj[0], (int, float)) else 0.0
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    return float(ts), events, rank


LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_RANKS = 128  # as health.max_engines: a replica listing more publishers is not believed past these


def endpoint_for(published: str, replica_url: str) -> str | None:
    """Where to connect for an endpoint a replica's ``/kv_event_sources`` names, or None when the brain must not:
    the brain connects only to the replica's own host (a wildcard there is the host vLLM bound; a data-parallel
    rank's port is already offset), and to an ipc:// path only for a replica on its own loopback. A replica's
    answer cannot send the brain elsewhere."""
    own = urlsplit(replica_url).hostname or "127.0.0.1"
    scheme, _, rest = published.partition("://")
    if scheme == "ipc":
        return published if own in LOOPBACK and rest.startswith("/") and len(rest) < 108 else None
    if scheme != "tcp":
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = host.strip("[]")
    if host not in ("*", "0.0.0.0", "", "::", own):
        return None
    return f"tcp://[{own}]:{port}" if ":" in own else f"tcp://{own}:{port}"


class EngineEvents:
    """One engine's publisher, read until stopped: each batch to ``on_batch(events, now)``; a gap the replay socket
    cannot fill, a restart of the engine or a dead publisher to ``on_lost(why, now)``. Reconnects by itself."""

    def __init__(self, name: str, endpoint: str, replay: str | None, on_batch: Callable[[list, float], None],
                 on_lost: Callable[[str, float], None], clock: Callable[[], float], silent_s: float = 5.0):
        self.name, self.endpoint, self.replay = name, endpoint, replay
        self.on_batch, self.on_lost, self.clock = on_batch, on_lost, clock
        self.silent_s = silent_s  # a publisher disconnected this long is lost (it may come back: replay then)
        self.next_seq: int | None = None
        self._last_digest = b""  # of the last batch taken: a replay that does not start with it is another stream
        self.connected = False
        self.batches = self.bad = self.replayed = 0
        self._ctx = zmq.asyncio.Context.instance()

    async def _replayed(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every batch the publisher still buffers from ``start``, through its replay socket; None when it cannot
        say (no replay socket, no answer within 2 s)."""
        if self.replay is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.replay)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(2000):
                    return None
                frames = await sock.recv_multipart()
                if len(frames) < 4:
                    return None
                if frames[-2] == END_SEQ:
                    return out
                if len(out) >= MAX_REPLAY_BATCHES:  # vLLM keeps 10,000 by default: more is not a replay
                    return None
                out.append((int.from_bytes(frames[-2], "big"), frames[-1]))
        finally:
            sock.close(0)

    async def _catch_up(self, upto: int | None, now: float) -> None:
        """What was missed before batch ``upto`` (None: after a reconnect), from the replay: the same engine's
        buffer carries on from the last batch taken (its payload the same), a new engine's starts again at 0."""
        if self.next_seq is None:  # a first connection: whatever the engine still buffers
            for seq, payload in await self._replayed(0) or ():
                self._take(seq, payload, replayed=True)
            return
        last = self.next_seq - 1
        got = await self._replayed(last)
        if got is None:
            self.on_lost("its replay did not answer" if upto is None else f"batches {self.next_seq}-{upto - 1} missed",
                         now)
            return
        if upto is None and (not got or got[0][0] != last or hashlib.blake2b(got[0][1]).digest() != self._last_digest):
            # not the stream it was: the engine started again (a new cache, a new sequence)
            self.next_seq = None
            self.on_lost("the engine restarted", now)
            for seq, payload in await self._replayed(0) or ():
                self._take(seq, payload, replayed=True)
            return
        first_new = next((s for s, _ in got if s > last), None)
        if first_new is not None and first_new > self.next_seq:
            self.on_lost(f"batches {self.next_seq}-{first_new - 1} no longer buffered", now)
        elif first_new is None and upto is not None and upto > self.next_seq:
            self.on_lost(f"batches {self.next_seq}-{upto - 1} missed", now)
        for seq, payload in got:
            self._take(seq, payload, replayed=True)

    def _take(self, seq: int, payload: bytes, replayed: bool = False) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            return  # seen already (the replay and the live stream overlap)
        try:
            _, events, _ = decode_batch(payload)
        except BadBatch as e:
            self.bad += 1
            self.on_lost(f"an unreadable batch ({str(e)[:80]})", self.clock())
        else:
            self.on_batch(events, self.clock())
        self.next_seq = seq + 1
        self._last_digest = hashlib.blake2b(payload).digest()
        self.batches += 1
        self.replayed += replayed

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        # at most so many batches queued unread, each at most MAX_FRAME_BYTES (ZMQ drops a larger message's
        # connection): past the queue, batches are dropped, seen as a gap and asked of the replay
        sub.setsockopt(zmq.RCVHWM, 1_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        down_since: float | None = self.clock()
        lost_said = False
        try:
            while True:
                events = await self._poll(sub, monitor)
                now = self.clock()
                for kind, frames in events:
                    if kind == "monitor":
                        ev = parse_monitor_message(frames)["event"]
                        if ev == zmq.EVENT_CONNECTED:
                            self.connected, down_since, lost_said = True, None, False
                            await self._catch_up(None, now)
                        elif ev == zmq.EVENT_DISCONNECTED:
                            self.connected, down_since = False, now
                    elif len(frames) >= 3:
                        seq = int.from_bytes(frames[-2], "big")
                        # a first batch past 0, or past the next one: what came before is in the replay (a PUB
                        # drops what it sends before a new subscription reached it)
                        if seq > (self.next_seq or 0):
                            await self._catch_up(seq, now)
                        self._take(seq, frames[-1])
                if down_since is not None and not lost_said and now - down_since >= self.silent_s:
                    lost_said = True
                    self.on_lost("the publisher is unreachable", now)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _poll(self, sub, monitor) -> list[tuple[str, list[bytes]]]:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(await poller.poll(500))
        out = []
        if monitor in ready:
            out.append(("monitor", await monitor.recv_multipart()))
        if sub in ready:
            for _ in range(256):  # a burst is taken in one go, the loop still yields between bursts
                try:
                    out.append(("batch", await sub.recv_multipart(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out


class KvEvents:
    """Every engine's event reader, following what the replicas list at GET /kv_event_sources (the scraper asks
    each replica when it comes up): one task per engine, started, moved or stopped as those lists change. Each
    batch goes to ``on_batch(replica, rank, events, now)``; a loss to ``on_lost(replica, rank, why)``."""

    def __init__(self, on_batch: Callable[[str, int, list, float], None], on_lost: Callable[[str, int, str], None],
                 clock: Callable[[], float]):
        self.on_batch, self.on_lost, self.clock = on_batch, on_lost, clock
        self.readers: dict[tuple[str, int], tuple[EngineEvents, asyncio.Task | None]] = {}
        self.sources: dict[str, dict[int, tuple[str, str | None]]] = {}  # replica -> rank -> (endpoint, replay)
        self.running = False

    def on_sources(self, name: str, url: str, listed: dict | None) -> None:
        """What replica ``name`` (at ``url``) lists at /kv_event_sources (None: nothing, or not an engine that
        publishes): its readers follow."""
        wanted: dict[int, tuple[str, str | None]] = {}
        for rank, src in (listed or {}).items():
            if not (isinstance(src, dict) and src.get("enable_kv_cache_events") and src.get("publisher") == "zmq"
                    and isinstance(src.get("endpoint"), str) and str(rank).isdigit()):
                continue
            endpoint = endpoint_for(src["endpoint"], url)
            replay = src.get("replay_endpoint")
            if endpoint is None or int(rank) >= MAX_RANKS:
                continue
            wanted[int(rank)] = (endpoint, endpoint_for(replay, url) if isinstance(replay, str) and replay else None)
        self.follow(name, wanted)

    def follow(self, name: str, wanted: dict[int, tuple[str, str | None]]) -> None:
        """Replica ``name``'s engines publish at these (publisher, replay) endpoints by rank: what it listed, or
        what the operator configured (``replicas[].kv_events``: their word, to any host)."""
        self.sources[name] = wanted
        for key in [k for k in self.readers if k[0] == name and wanted.get(k[1]) != (self.readers[k][0].endpoint,
                                                                                    self.readers[k][0].replay)]:
            self._stop(key)
        for rank, (endpoint, replay) in wanted.items():
            if (name, rank) not in self.readers:
                self._start(name, rank, endpoint, replay)

    def forget(self, name: str) -> None:
        self.sources.pop(name, None)
        for key in [k for k in self.readers if k[0] == name]:
            self._stop(key)

    def _start(self, name: str, rank: int, endpoint: str, replay: str | None) -> None:
        reader = EngineEvents(f"{name}/{rank}", endpoint, replay,
                              lambda events, now: self.on_batch(name, rank, events, now),
                              lambda why, now: self.on_lost(name, rank, why), self.clock)
        task = asyncio.get_running_loop().create_task(self._run(reader), name=f"kv-events-{name}-{rank}") \
            if self.running else None
        self.readers[(name, rank)] = (reader, task)

    async def _run(self, reader: EngineEvents) -> None:
        while True:  # a reader that fails is started again: a bad publisher costs its replica exact mode, no more
            try:
                await reader.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("kv events reader %s: %s", reader.name, f"{type(e).__name__}: {e}"[:200])
                reader.on_lost(f"reader failed: {type(e).__name__}", reader.clock())
                await asyncio.sleep(1.0)

    def _stop(self, key: tuple[str, int]) -> None:
        reader, task = self.readers.pop(key)
        if task is not None:
            task.cancel()

    async def loop(self) -> None:
        """Runs the readers until cancelled."""
        self.running = True
        for key, (reader, task) in list(self.readers.items()):
            if task is None:
                self.readers[key] = (reader, asyncio.get_running_loop().create_task(self._run(reader)))
        try:
            await asyncio.Event().wait()
        finally:
            self.running = False
            for key in list(self.readers):
                self._stop(key)

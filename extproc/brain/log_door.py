"""The log door: Envoy's access-log entries as msgpack records on a Unix socket beside the gRPC one.

Every request's end reaches the brain as an access-log entry (``release``): it releases the reservation, joins the
first token with its prediction, feeds passive health. Over gRPC each flush of entries is a message on a stream, and
grpcio's per-message work (its event-engine thread, the hop to asyncio, the protobuf) cost ~0.7 ms of the brain's CPU
a message here: at an agent's pace, one entry a message, more than the header door and the decision together. Where
Envoy reaches the brain by a Unix socket it sends the same entries with its fluentd access logger instead
(``envoy_config.filters.access_log``: the Fluentd Forward protocol, msgpack over a plain connection), read here by an
asyncio protocol: ~0.25 ms of CPU a request for a do-nothing msgpack reader, against ~0.7 ms for a do-nothing gRPC
one (this machine, Envoy's flush every 10 ms, requests 30 ms apart; docs/benchmarks.md).

The record's fields are ``contract.LOG_RECORD``, rendered by Envoy's formatters. Envoy connects when it has a first
entry to send and reconnects (with backoff) when the connection closes; its connections are the presence signal, as
the gRPC streams are (``release.EnvoyPresence``). Whoever reaches the socket (the gRPC one's permissions) can end
reservations, as on the gRPC socket. A stream that is not Fluentd Forward is closed, and what came before it stays.
What a caller holds: per connection (Envoy opens one per worker) a msgpack buffer of at most ``MAX_MESSAGE_BYTES``;
what an entry leaves in the brain is bounded by the ledger (``release.Ledger``), and an id past ``MAX_ID_CHARS`` is
not kept at all.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import msgpack

from . import logs
from .header_door import Door, serve_unix
from .release import ALIVE, ENDED, MAX_ID_CHARS, OTHER, EnvoyPresence, LogEntry, outcome
from .stats import BrainStats

# Envoy flushes at most buffer_size_bytes (1 MiB) of entries at a time: a message past this is no Envoy's
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_KINDS = {"DownstreamEnd": ENDED, "NotSet": ENDED, "DownstreamPeriodic": ALIVE}
_DAY_US = 10**11  # a duration past this many microseconds is not Envoy's


def _str(v: Any) -> str:
    return v if isinstance(v, str) and v != "-" else ""


def _id(v: Any) -> str:
    """A reservation, request id or address: past ``MAX_ID_CHARS`` it names nothing (and is kept nowhere)."""
    v = _str(v)
    return v if len(v) <= MAX_ID_CHARS else ""


def _int(v: Any) -> int:
    if isinstance(v, bool):
        return 0
    if isinstance(v, int):
        return v
    return int(v) if isinstance(v, str) and v.isdigit() and len(v) <= 12 else 0


def _us(v: Any) -> float | None:
    """A duration in microseconds, in seconds (Envoy writes ``-``, or nothing, when one end never happened)."""
    if isinstance(v, str) and v.isdigit() and len(v) <= 12:
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    return v / 1e6 if 0 <= v < _DAY_US else None


def entry_of_record(rec: dict) -> LogEntry:
    """One record (``contract.LOG_RECORD``'s fields, as Envoy's formatters typed them) as the brain reads it."""
    t = rec.get("t")
    kind = _KINDS.get(t, OTHER) if isinstance(t, str) else OTHER
    if kind != ENDED:
        return LogEntry(kind, _id(rec.get("res")), _id(rec.get("rid")), engine_first_s=_us(rec.get("ft")))
    flags = set(_str(rec.get("fl")).split(","))
    content_type = _str(rec.get("ct"))
    return LogEntry(
        kind, _id(rec.get("res")), _id(rec.get("rid")),
        upstream=_id(rec.get("up")),
        attempts=_int(rec.get("n")),
        outcome=outcome(_int(rec.get("code")), _str(rec.get("det")), content_type, "UF" in flags, "UR" in flags,
                        "UC" in flags, "UT" in flags),
        event_stream=content_type.startswith("text/event-stream"),
        engine_first_s=_us(rec.get("ft")),
        client_first_s=_us(rec.get("cft")),
        upstream_first_s=_us(rec.get("uft")),
    )


def _records(message: Any) -> list:
    """The records of one Forward-protocol message: Forward mode ``[tag, [[time, record], ...], option?]`` (what Envoy
    sends) or Message mode ``[tag, time, record, option?]``. ValueError: neither."""
    if not isinstance(message, (list, tuple)) or len(message) < 2 or not isinstance(message[0], str):
        raise ValueError("not a Forward-protocol message")
    if isinstance(message[1], (list, tuple)):
        return [e[1] for e in message[1] if isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[1], dict)]
    if len(message) >= 3 and isinstance(message[1], (int, float, msgpack.ExtType)) and isinstance(message[2], dict):
        return [message[2]]
    raise ValueError("not a Forward-protocol message")


class _LogConnection(asyncio.Protocol):
    """One connection from Envoy's fluentd logger (one per Envoy worker): entries, each handed on as it is read."""

    def __init__(self, on_entry: Callable[[LogEntry], None], presence: EnvoyPresence | None,
                 on_gone: Callable[[int], None] | None, stats: BrainStats | None, conns: set):
        self._on_entry, self._presence, self._on_gone, self._stats, self._open = (on_entry, presence, on_gone,
                                                                                  stats, conns)
        self._transport: asyncio.Transport | None = None
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE_BYTES)

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._open.add(self)
        if self._presence is not None:
            self._presence.opened()

    def connection_lost(self, exc) -> None:
        self._open.discard(self)
        if self._presence is not None:
            self._presence.stream_closed(self._on_gone)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for message in self._unpacker:
                self._take(_records(message))
        except (ValueError, msgpack.UnpackException) as e:  # BufferFull and msgpack's format errors are ValueErrors
            logs.event("log_door_refused", error=type(e).__name__)
            if self._stats is not None:
                self._stats.log_streams_refused += 1
            self.close()

    def _take(self, records: list) -> None:
        for rec in records:
            try:
                self._on_entry(entry_of_record(rec))
            except Exception as e:  # a bug costs one entry (its reservation then ends by its timeout), not the stream
                logs.event("loop_error", loop="log_door", error=type(e).__name__)
        if self._stats is not None:
            self._stats.count_log_entries("door", len(records))


async def serve_log_door(on_entry: Callable[[LogEntry], None], presence: EnvoyPresence | None,
                         on_gone: Callable[[int], None] | None, stats: BrainStats | None, path: str,
                         group_gid: int | None) -> Door:
    """The log door on the Unix socket ``path``; ``stats`` counts its entries, messages and refusals."""
    return await serve_unix(lambda conns: _LogConnection(on_entry, presence, on_gone, stats, conns), path,
                            group_gid)

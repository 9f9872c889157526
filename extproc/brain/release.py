"""The access-log side: each entry is the real end of a request.

Envoy closes the ext_proc stream as soon as it needs nothing more (Envoy >= 1.37), so the
stream's end is not the request's end. Envoy's gRPC access-log entry is written at the real
end (success, error, client disconnect, reset) and carries the reservation id the brain set,
Envoy's request id, the upstream address and the outcome. That releases the reservation and
feeds the upstream-failure rule (SPEC B) with no round trip on the response path.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from prometheus_client import Histogram

from envoy.data.accesslog.v3.accesslog_pb2 import AccessLogType

from ..contract import CLIENT_FIRST_TOKEN_TAG, FIRST_TOKEN_TAG, RESERVATION_HEADER
from ..core import Reservation, Router, UpstreamOutcome, upstream_failed, upstream_verdicts
from .outcomes import Outcomes, observed_us
from .stats import BrainStats


def token_digest(token: str) -> str:
    """What leaves the brain of a reservation's id: a hash (the id itself names the request to Envoy)."""
    return hashlib.blake2b(token.encode(), digest_size=12).hexdigest()


class Ledger:
    """Reservation ids handed to Envoy, and Envoy's request ids that back them up.

    The id is ``<number>.<64 random bits>``: nobody who has not been handed it can name it, so a call
    that reaches the brain cannot release another request's reservation, and ids from an earlier brain
    process never match ours. The request id is in every access-log entry, even when the client reset
    before Envoy applied our header (then the reservation id is missing) or our answer came after
    Envoy's timeout. It is Envoy's own (the shipped config drops a client's ``x-request-id`` at the
    edge); a pasted-in config may keep clients' ids, so an id seen on two open requests backs up
    neither: one request's end must never release another's reservation.
    """

    MAX_ENDED = 10_000  # request ids whose end came before their reservation, kept this many, oldest out first

    def __init__(self, router: Router):
        self.router = router
        self.by_request_id: dict[str, Reservation | int] = {}  # an int: the id is ambiguous, held by that many
        # a request that ended while the brain was still deciding it (a client gone at once): its access-log entry
        # came first, named nothing, and the reservation made after it is released as it is made
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.released_at_issue = 0
        self.superseded_at_headers = 0

    def note_ended(self, request_id: str) -> None:
        self.ended[request_id] = None
        self.ended.move_to_end(request_id)
        while len(self.ended) > self.MAX_ENDED:
            self.ended.popitem(last=False)

    def issue(self, res: Reservation, request_id: str | None) -> str:
        if request_id and request_id in self.ended:
            del self.ended[request_id]
            self.router.release(res, res.started_at)
            self.released_at_issue += 1
            res.token = f"{res.id}.{secrets.token_hex(8)}"
            return res.token
        if request_id:
            held = self.by_request_id.get(request_id)
            if isinstance(held, Reservation) and held.at_headers and not res.at_headers:
                # the same request's body call after its header call was answered: Envoy gave up on that answer (its
                # timer, a busy brain) and failed open into the body call, so the header route was never applied and
                # its reservation names no request. Kept, the body's booking made the id ambiguous and the end
                # released neither: a reservation open until its safety timeout (seen under make test's load)
                if not held.released:
                    self.router.release(held, res.started_at)
                self.superseded_at_headers += 1
                held = None
            if held is None:
                self.by_request_id[request_id] = res
            else:
                self.by_request_id[request_id] = (held if isinstance(held, int) else 1) + 1
        res.token = f"{res.id}.{secrets.token_hex(8)}"
        return res.token

    def named(self, reservation_id: str) -> Reservation | None:
        """The open reservation whose whole id this is (a guessed or stale one names none)."""
        num, _, _ = reservation_id.partition(".")
        if not num.isdigit():
            return None
        res = self.router.reservation(int(num))
        if res is None or not secrets.compare_digest(res.token.encode(), reservation_id.encode()):
            return None
        return res

    def alive(self, reservation_id: str, request_id: str) -> Reservation | None:
        """The reservation a periodic entry names, leaving the request id's backing in place."""
        res = self.named(reservation_id) if reservation_id else None
        if res is None:
            by_id = self.by_request_id.get(request_id)
            res = by_id if isinstance(by_id, Reservation) else None
        return res

    def find(self, reservation_id: str, request_id: str) -> Reservation | None:
        res = self.named(reservation_id) if reservation_id else None
        by_id = self.by_request_id.get(request_id)
        if isinstance(by_id, int):
            if by_id > 1:
                self.by_request_id[request_id] = by_id - 1
            else:
                del self.by_request_id[request_id]
        elif by_id is not None and (res is None or res is by_id):
            del self.by_request_id[request_id]
            res = res or by_id
        return res

    def forget_released(self) -> None:
        """Drop request ids of reservations released without their entry (safety timeout, Envoy gone), and
        ambiguous ids once nothing they could name is open."""
        for k in [k for k, r in self.by_request_id.items() if not isinstance(r, int) and r.released]:
            del self.by_request_id[k]
        if not self.router.open_reservations:
            self.by_request_id.clear()


# NotSet: an Envoy older than access-log types, whose every HTTP entry is the end
END_OF_REQUEST = frozenset({AccessLogType.NotSet, AccessLogType.DownstreamEnd})
DOWNSTREAM_PERIODIC = AccessLogType.DownstreamPeriodic
ENDED, ALIVE, OTHER = "ended", "alive", "other"  # LogEntry.kind: the request's end, a periodic entry, anything else
# an id longer than this names nothing: Envoy's request ids are UUIDs and our reservation ids ~30 characters, but a
# pasted config that keeps clients' x-request-id would have the ledger keep 10,000 of whatever length they send
MAX_ID_CHARS = 256


@dataclass(slots=True)
class LogEntry:
    """One access-log entry as the brain reads it, whichever way Envoy sent it: over gRPC (``entry_of_proto``) or to
    the log door (``log_door.entry_of_record``)."""

    kind: str  # ENDED, ALIVE or OTHER
    reservation: str = ""  # the reservation header's value ("" when the brain's answer was never applied)
    request_id: str = ""  # Envoy's request id
    upstream: str = ""  # "host:port" of the replica that served it ("" for none)
    attempts: int = 1  # upstream attempts (a retry went elsewhere)
    outcome: UpstreamOutcome = field(default_factory=UpstreamOutcome)
    event_stream: bool = False  # a text/event-stream response: its first body byte is the first token
    engine_first_s: float | None = None  # FIRST_TOKEN_TAG: last byte sent upstream -> first body byte back
    client_first_s: float | None = None  # CLIENT_FIRST_TOKEN_TAG: the request's first byte -> first body byte back
    upstream_first_s: float | None = None  # the request's start -> the upstream response's first byte


def outcome(code: int, details: str, content_type: str, connect_failure: bool, remote_reset: bool,
            connection_termination: bool, timeout: bool) -> UpstreamOutcome:
    return UpstreamOutcome(
        code=code,
        via_upstream=details == "via_upstream",
        connect_failure=connect_failure,
        # a 200 whose body the replica cut off (e.g. "upstream_reset_after_response_started{protocol_error}")
        # is a broken response, not a success
        remote_reset=remote_reset or details.startswith("upstream_reset_after_response_started"),
        connection_termination=connection_termination,
        timeout=timeout,
        # the OpenAI API answers JSON or an event stream; an HTML page with 200 is passed to the client as Envoy
        # got it, and counted against the replica
        wrong_content=code == 200 and content_type.startswith("text/html"),
    )


def _id(s: str) -> str:
    return s if len(s) <= MAX_ID_CHARS else ""


def entry_of_proto(entry) -> LogEntry:
    """Envoy's gRPC access-log entry (``HTTPAccessLogEntry``) as the brain reads it."""
    common = entry.common_properties
    t = common.access_log_type
    kind = ENDED if t in END_OF_REQUEST else ALIVE if t == DOWNSTREAM_PERIODIC else OTHER
    tags = common.custom_tags
    reservation, request_id = _id(entry.request.request_headers.get(RESERVATION_HEADER, "")), \
        _id(entry.request.request_id)
    if kind != ENDED:
        return LogEntry(kind, reservation, request_id, engine_first_s=observed_us(tags, FIRST_TOKEN_TAG))
    flags, response = common.response_flags, entry.response
    content_type = response.response_headers.get("content-type", "")
    sock = common.upstream_remote_address.socket_address
    first = common.time_to_first_upstream_rx_byte
    return LogEntry(
        kind, reservation, request_id,
        upstream=f"{sock.address}:{sock.port_value}" if sock.address else "",
        attempts=common.upstream_request_attempt_count,
        outcome=outcome(response.response_code.value, response.response_code_details, content_type,
                        flags.upstream_connection_failure, flags.upstream_remote_reset,
                        flags.upstream_connection_termination, flags.upstream_request_timeout),
        event_stream=content_type.startswith("text/event-stream"),
        engine_first_s=observed_us(tags, FIRST_TOKEN_TAG),
        client_first_s=observed_us(tags, CLIENT_FIRST_TOKEN_TAG),
        upstream_first_s=first.seconds + first.nanos / 1e9 if first.seconds or first.nanos else None)


class Releaser:
    """Access-log entry -> release the reservation, and count the outcome for passive health."""

    def __init__(self, router: Router, ledger: Ledger, stats: BrainStats, clock: Callable[[], float]):
        self.router = router
        self.ledger = ledger
        self.stats = stats
        self.clock = clock
        self.by_address: dict[str, str] = {}  # "host:port" -> replica name
        self.ttft_error: Histogram | None = None  # |predicted - observed| time to first token
        self.outcomes = Outcomes()  # each streamed request's first token joined with its prediction, per replica
        self.periodic_seen = False  # Envoy sends periodic entries of requests in flight (access_log_flush_interval)
        # shared state: hand an entry that names none of our reservations to the other brains (number, digest,
        # whether it ended: else it is alive, a periodic entry)
        self.forward: Callable[[int, str, bool], None] | None = None

    def on_entry(self, entry: LogEntry) -> None:
        now = self.clock()
        if entry.kind != ENDED:
            # a periodic (or start) entry: the request is alive, nothing ended
            if entry.kind == ALIVE:
                self.periodic_seen = True
                res = self.ledger.alive(entry.reservation, entry.request_id)
                if res is not None and not res.released:
                    # a streamed response's body has begun: its first token came, its prefill is over
                    self.router.touch(res, now, entry.engine_first_s is not None)
                elif res is None:
                    # another brain's request (several processes behind one Envoy, whose log stream is on one of
                    # them): without this its owner would take it for gone once its liveness bound passed
                    self._forward(entry.reservation, False)
            return
        res = self.ledger.find(entry.reservation, entry.request_id)
        served_by = self.by_address.get(entry.upstream) if entry.upstream else None
        chosen = None
        if res is not None and not res.released:
            chosen = res.replica.name
            if served_by in (None, chosen) and entry.outcome.code == 200 and entry.event_stream:
                self._join(res, entry)
            if res.transfer_tokens and entry.upstream_first_s is not None:
                self.router.transfer_observed(res, entry.upstream_first_s)
            self.router.release(res, now)
            self.stats.releases_by_log += 1
        if res is None and entry.request_id:
            self.ledger.note_ended(entry.request_id)
        if res is None:
            # several brains sharing state: an Envoy whose own brain was down logs to the one it failed over to,
            # and keeps that stream when its brain is back; several processes behind one Envoy get one log stream
            # between them: the entry's reservation is another brain's
            self._forward(entry.reservation, True)
        if res is not None and res.handoff is not None and not entry.upstream:
            res.handoff()  # a decode leg no replica got: its KV waits on the prefill replica for nobody
            res.handoff = None
        failed = upstream_failed(entry.outcome)
        for name, ok in upstream_verdicts(chosen, served_by, entry.attempts, failed):
            self.router.on_upstream(name, ok, now)
        if served_by is not None and entry.outcome.via_upstream and not failed:
            # it answered (a client gone before any answer is no failure of the replica, and no answer either)
            self._served(served_by, now)
        if chosen is None and served_by is None:
            self.stats.unmatched_log_entries += 1

    def _join(self, res: Reservation, entry: LogEntry) -> None:
        """A streamed response's first token, as Envoy timed it, beside what the brain predicted of it."""
        engine_s = entry.engine_first_s
        if engine_s is None:
            return  # an Envoy config rendered before the tags (or a request that never reached a replica)
        self.outcomes.join(res.replica.name, entry.request_id, res.predicted_ttft_s, engine_s, entry.client_first_s)
        self.router.first_token_observed(res, engine_s, self.clock())
        if res.predicted_ttft_s is not None and self.ttft_error is not None:
            self.ttft_error.observe(abs(engine_s - res.predicted_ttft_s))

    def _forward(self, token: str, ended: bool) -> None:
        num, _, secret = token.partition(".")
        if self.forward is not None and num.isdigit() and secret:
            self.forward(int(num), token_digest(token), ended)

    def end_forwarded(self, num: int, digest: str, ended: bool = True) -> None:
        """Another brain got the access-log entry of one of our reservations (shared state): release it (or note
        it alive), if the digest is our token's (a reservation with that number in another brain has another
        token)."""
        res = self.router.reservation(num)
        if res is not None and not res.released and res.token and \
                secrets.compare_digest(token_digest(res.token), digest):
            if ended:
                self.router.release(res, self.clock())
                self.stats.releases_by_log += 1
            else:
                self.router.touch(res, self.clock())

    def finish(self, res: Reservation, served_by: str | None, failed: bool | None, first_byte_s: float | None) -> None:
        """The end of a request whose front saw its response itself (the endpoint picker): the same release
        and the same passive-health rule as an access-log entry, with what that front can know. A retry is
        seen only as an endpoint served other than the one chosen. ``failed`` None: the stream ended before the
        response did (a client gone, or a replica that reset): nothing is counted, as nothing tells which."""
        if res.released:
            return
        now = self.clock()
        chosen = res.replica.name
        if first_byte_s is not None and served_by in (None, chosen):
            # the front's own clock, from its pick: the upload is in it, as it is in what the client saw (so it is
            # reported, and no overhead is learned from it)
            self.outcomes.join(chosen, None, res.predicted_ttft_s, first_byte_s, first_byte_s)
            if res.predicted_ttft_s is not None and self.ttft_error is not None:
                self.ttft_error.observe(abs(first_byte_s - res.predicted_ttft_s))
        self.router.release(res, now)
        self.stats.releases_by_response += 1
        if failed is None:
            return
        attempts = 2 if served_by is not None and served_by != chosen else 1
        for name, ok in upstream_verdicts(chosen, served_by or (None if failed else chosen), attempts, failed):
            self.router.on_upstream(name, ok, now)
        if not failed and first_byte_s is not None:
            self._served(served_by or chosen, now)

    def _served(self, name: str, now: float) -> None:
        """``name`` answered a user's request: busy, not dead (``HealthMachine.busy``)."""
        rep = self.router.find(name)
        if rep is not None:
            rep.health.served(now)


class EnvoyPresence:
    """Releases the reservations of an Envoy that went away (killed, crashed, restarted).

    The signal is the access-log streams: a running Envoy keeps each worker's stream open for its
    life, and every one of them closes when its process dies. When the last open stream closes,
    every reservation made up to that moment is released at once (their entries died with that
    Envoy). Nothing is released twice: a late entry for one of them finds it released. The price
    of a false alarm (all streams reset while Envoy lives) is bounded: requests then in flight
    count as finished early. Not covered: an Envoy that dies before its first entry ever opened a
    stream; the safety timeout (1 h) stays the backstop for that.
    """

    def __init__(self, router: Router, ledger: Ledger, stats: BrainStats, clock: Callable[[], float]):
        self.router = router
        self.ledger = ledger
        self.stats = stats
        self.clock = clock
        self.open_streams = 0

    def opened(self) -> None:
        self.open_streams += 1

    def stream_closed(self, on_gone: Callable[[int], None] | None) -> None:
        """One of Envoy's log streams (or log door connections) ended; ``on_gone`` hears of the last one's."""
        released = self.closed()
        if on_gone is not None and self.open_streams == 0:
            on_gone(released)

    def closed(self) -> int:
        self.open_streams -= 1
        if self.open_streams > 0:
            return 0
        now = self.clock()
        n = self.router.release_started_before(now, now)
        self.stats.released_envoy_gone += n
        self.ledger.forget_released()
        return n


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access-log streams (where no log door is rendered: a brain reached over TCP, a failover pair)."""

    def __init__(self, on_entry: Callable[[LogEntry], None], presence: EnvoyPresence | None = None,
                 on_gone: Callable[[int], None] | None = None, stats: BrainStats | None = None):
        self.on_entry = on_entry
        self.presence = presence
        self.on_gone = on_gone
        self.stats = stats  # counts the entries and messages

    async def StreamAccessLogs(self, request_iterator, context) -> als_pb2.StreamAccessLogsResponse:
        if self.presence is not None:
            self.presence.opened()
        try:
            async for msg in request_iterator:
                logged = msg.http_logs.log_entry
                for entry in logged:
                    self.on_entry(entry_of_proto(entry))
                if self.stats is not None:
                    self.stats.count_log_entries("grpc", len(logged))
        finally:  # also when the stream is cancelled: the Envoy at the other end is gone
            if self.presence is not None:
                self.presence.stream_closed(self.on_gone)
        return als_pb2.StreamAccessLogsResponse()

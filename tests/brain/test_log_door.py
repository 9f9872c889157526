"""The log door: Envoy's fluentd access-log records, read as the gRPC entries are (``brain.log_door``)."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from extproc.brain import log_door
from extproc.brain.log_door import entry_of_record, serve_log_door
from extproc.brain.release import ALIVE, ENDED, MAX_ID_CHARS, OTHER, entry_of_proto
from extproc.brain.stats import BrainStats
from extproc.contract import CLIENT_FIRST_TOKEN_TAG, FIRST_TOKEN_TAG, LOG_RECORD

from ..helpers import live_brain
from .test_predictions import CFG, decided
from .test_service import proto_entry


def record(**fields) -> dict:
    """A record as Envoy's fluentd logger types it: numbers as numbers, an absent header as None."""
    base = {"t": "DownstreamEnd", "res": "7.abc", "rid": "q1", "up": "127.0.0.1:8001", "n": 1, "code": 200,
            "det": "via_upstream", "fl": "-", "ct": "text/event-stream", "ft": 120000, "cft": 130500, "uft": 90000}
    return {**base, **fields}


# another value for each field of the record, each of which the brain must read differently
OTHER_VALUES = {"t": "DownstreamPeriodic", "res": "8.def", "rid": "q2", "up": "127.0.0.1:8002", "n": 2, "code": 503,
                "det": "upstream_reset_before_response_started", "fl": "UF", "ct": "application/json", "ft": 5,
                "cft": 6, "uft": 7}


@pytest.mark.parametrize("field", sorted(LOG_RECORD))
def test_every_field_envoy_is_asked_for_is_read_and_changes_the_entry(field):
    assert set(OTHER_VALUES) == set(LOG_RECORD)  # and nothing is read that Envoy is not asked for
    assert entry_of_record(record(**{field: OTHER_VALUES[field]})) != entry_of_record(record())


def test_a_record_reads_as_the_same_request_s_grpc_entry():
    e = proto_entry("q1", "7.abc", upstream=8001)
    e.response.response_headers["content-type"] = "text/event-stream"
    e.common_properties.custom_tags[FIRST_TOKEN_TAG] = "120000"
    e.common_properties.custom_tags[CLIENT_FIRST_TOKEN_TAG] = "130500"
    e.common_properties.time_to_first_upstream_rx_byte.nanos = 90_000_000
    assert entry_of_record(record()) == entry_of_proto(e)
    assert entry_of_record(record()).kind == ENDED and entry_of_record(record()).engine_first_s == 0.12


@pytest.mark.parametrize("flags, field", [("UF", "connect_failure"), ("UR", "remote_reset"),
                                          ("UC", "connection_termination"), ("UT", "timeout"),
                                          ("URX,UF", "connect_failure")])
def test_envoy_s_response_flags_read_as_the_grpc_entry_s(flags, field):
    got = entry_of_record(record(fl=flags, code=503, det="upstream_reset_before_response_started")).outcome
    e = proto_entry("q1", "7.abc", code=503, details="upstream_reset_before_response_started", upstream=8001,
                    **{{"connect_failure": "upstream_connection_failure", "remote_reset": "upstream_remote_reset",
                        "connection_termination": "upstream_connection_termination",
                        "timeout": "upstream_request_timeout"}[field]: True})
    assert getattr(got, field) and got == entry_of_proto(e).outcome
    assert not entry_of_record(record()).outcome.connect_failure  # "-": none


def test_a_periodic_record_is_alive_and_says_whether_its_first_token_came():
    alive = entry_of_record(record(t="DownstreamPeriodic", ft=None))
    assert alive.kind == ALIVE and alive.reservation == "7.abc" and alive.engine_first_s is None
    assert entry_of_record(record(t="DownstreamPeriodic", ft=40000)).engine_first_s == 0.04
    assert entry_of_record(record(t="DownstreamStart")).kind == OTHER
    assert entry_of_record(record(t=["not", "a", "type"])).kind == OTHER


def test_what_is_not_envoy_s_reads_as_nothing_never_as_a_number():
    e = entry_of_record(record(res=None, rid=None, up="-", n="x", code="200x", ft="-", cft="9" * 5000, uft=-3,
                               ct=None))
    assert (e.reservation, e.request_id, e.upstream, e.attempts, e.outcome.code) == ("", "", "", 0, 0)
    assert e.engine_first_s is None and e.client_first_s is None and e.upstream_first_s is None
    assert not e.event_stream
    assert entry_of_record(record(ft="120000")).engine_first_s == 0.12  # a string of digits is read
    assert entry_of_record(record(ft=86_400_000_000)).engine_first_s == 86_400.0  # a day is Envoy's
    assert entry_of_record(record(ft=10**12)).engine_first_s is None  # eleven days is not


def test_an_id_longer_than_any_envoy_or_the_brain_makes_names_nothing_and_is_kept_nowhere():
    long = "q" * (MAX_ID_CHARS + 1)
    e = entry_of_record(record(res=long, rid=long, up=long))
    assert (e.reservation, e.request_id, e.upstream) == ("", "", "")
    assert entry_of_record(record(rid="q" * MAX_ID_CHARS)).request_id == "q" * MAX_ID_CHARS
    assert entry_of_proto(proto_entry(long, long)).request_id == entry_of_proto(proto_entry(long, long)).reservation == ""
    b = live_brain(CFG)
    b.on_log_entry(entry_of_record(record(res="", rid=long)))
    assert not b.ledger.ended  # the ledger keeps 10,000 ended ids: none of this length


class Presence:
    def __init__(self):
        self.open_streams, self.gone = 0, []

    def opened(self):
        self.open_streams += 1

    def stream_closed(self, on_gone):
        self.open_streams -= 1
        if self.open_streams == 0:
            on_gone(0)


def forward(*records, tag="warmroute") -> bytes:
    """One flush as Envoy's fluentd logger sends it: Forward mode."""
    return msgpack.packb([tag, [[1_700_000_000, r] for r in records]])


class Counts(BrainStats):
    """The door's counts as the brain keeps them, and the entries of each message in order."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def count_log_entries(self, transport, n):
        assert transport == "door"
        super().count_log_entries(transport, n)
        self.seen.append(n)


async def _door(tmp_path, on_entry=None):
    got, counts, presence = [], Counts(), Presence()
    door = await serve_log_door(on_entry or got.append, presence, presence.gone.append, counts,
                                str(tmp_path / "brain.log.sock"), None)
    return door, got, counts, presence


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_entries_are_read_whatever_the_connection_s_chunks(tmp_path):
    async def run():
        door, got, counts, presence = await _door(tmp_path)
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        await _until(lambda: presence.open_streams == 1, "the connection to count as Envoy's")
        one, two = forward(record(rid="a"), record(rid="b")), forward(record(rid="c"))
        stream = one + two
        writer.write(stream[:7])  # a message split mid-record, then the rest of it with the next one
        await writer.drain()
        writer.write(stream[7:])
        await writer.drain()
        await _until(lambda: len(got) == 3, "three entries")
        assert [e.request_id for e in got] == ["a", "b", "c"] and counts.seen == [2, 1]
        writer.write(msgpack.packb(["warmroute", 1_700_000_000, record(rid="d")]))  # Message mode too
        await writer.drain()
        await _until(lambda: len(got) == 4, "a Message-mode entry")
        writer.close()
        await _until(lambda: presence.gone == [0], "the last connection's end to say Envoy is gone")
        await door.cleanup()

    asyncio.run(run())


def test_a_stream_that_is_not_fluentd_forward_is_closed_and_what_came_before_stays(tmp_path):
    async def run():
        door, got, counts, presence = await _door(tmp_path)
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        writer.write(forward(record(rid="kept")) + msgpack.packb({"not": "forward"}) + forward(record(rid="never")))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the door
        assert [e.request_id for e in got] == ["kept"] and (counts.seen, counts.log_streams_refused) == ([1], 1)
        await _until(lambda: presence.open_streams == 0, "the refused connection to end")
        await door.cleanup()

    asyncio.run(run())


def test_a_fault_handling_one_entry_costs_that_entry_not_the_connection(tmp_path):
    taken = []

    def on_entry(e):
        if e.request_id == "boom":
            raise RuntimeError("a bug")
        taken.append(e.request_id)

    async def run():
        door, _, counts, _ = await _door(tmp_path, on_entry)
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        writer.write(forward(record(rid="boom"), record(rid="after")) + forward(record(rid="next")))
        await writer.drain()
        await _until(lambda: taken == ["after", "next"], "the entries after the fault")
        writer.close()
        await door.cleanup()

    asyncio.run(run())


def test_the_log_door_is_born_private_as_the_grpc_socket_is(tmp_path):
    async def run():
        door, *_ = await _door(tmp_path)
        try:
            mode = (tmp_path / "brain.log.sock").stat().st_mode & 0o777
            assert mode == 0o600
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(tmp_path / "brain.log.sock"))
            s.close()
        finally:
            await door.cleanup()

    asyncio.run(run())


def test_a_message_past_the_door_s_bound_is_refused_and_one_within_it_read(tmp_path, monkeypatch):
    monkeypatch.setattr(log_door, "MAX_MESSAGE_BYTES", 64 * 1024)

    async def run():
        door, got, counts, _ = await _door(tmp_path)
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        writer.write(forward(record(rid="within", det="x" * 32 * 1024)))
        await writer.drain()
        await _until(lambda: [e.request_id for e in got] == ["within"], "the message within the bound")
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        writer.write(forward(record(rid="past", det="x" * 96 * 1024)))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the door
        assert (counts.seen, counts.log_streams_refused) == ([1], 1) and [e.request_id for e in got] == ["within"]
        await door.cleanup()

    asyncio.run(run())


def test_a_packed_forward_message_is_refused_its_option_never_read_as_a_record():
    with pytest.raises(ValueError):  # Envoy sends Forward mode: a stream of anything else is closed
        log_door._records(["warmroute", b"\x92\x01\x80", {"size": 1}])
    assert log_door._records(["warmroute", 1_700_000_000, record()]) == [record()]  # Message mode is read


def test_B_completion_an_entry_at_the_log_door_releases_its_reservation_and_joins_its_first_token(tmp_path):
    """SPEC B Completion by the log door: the request's end releases its reservation, its first token is joined."""
    b = live_brain(CFG)
    b.releaser.by_address = {"127.0.0.1:8001": "r0", "127.0.0.1:8002": "r1"}
    token, res = decided(b, "q1")
    port = 8001 + int(res.replica.name[1:])

    async def run():
        door = await serve_log_door(b.on_log_entry, b.envoy, None, b.stats, str(tmp_path / "brain.log.sock"), None)
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "brain.log.sock"))
        writer.write(forward(record(res=token, rid="q1", up=f"127.0.0.1:{port}", ft=120000)))
        await writer.drain()
        await _until(lambda: res.released, "the reservation released")
        writer.close()
        await door.cleanup()

    asyncio.run(run())
    assert b.router.open_reservations == 0 and b.stats.releases_by_log == 1
    assert b.releaser.outcomes.error(res.replica.name).joined == 1
    assert b.stats.log_entries["door"] == 1 and b.stats.log_messages["door"] == 1

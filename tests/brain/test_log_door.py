"""The log door: Envoy's fluentd access-log records, read as the gRPC entries are (``brain.log_door``)."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from extproc.brain.log_door import entry_of_record, serve_log_door
from extproc.brain.release import ALIVE, ENDED, OTHER, entry_of_proto
from extproc.contract import CLIENT_FIRST_TOKEN_TAG, FIRST_TOKEN_TAG, LOG_RECORD

from .test_service import proto_entry


def record(**fields) -> dict:
    """A record as Envoy's fluentd logger types it: numbers as numbers, an absent header as None."""
    base = {"t": "DownstreamEnd", "res": "7.abc", "rid": "q1", "up": "127.0.0.1:8001", "n": 1, "code": 200,
            "det": "via_upstream", "fl": "-", "ct": "text/event-stream", "ft": 120000, "cft": 130500, "uft": 90000}
    return {**base, **fields}


def test_every_field_the_brain_reads_of_an_entry_is_in_the_record():
    assert set(record()) == set(LOG_RECORD)


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


async def _door(tmp_path, on_entry=None):
    got, counts, presence = [], [], Presence()
    door = await serve_log_door(on_entry or got.append, presence, presence.gone.append, counts.append,
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
        assert [e.request_id for e in got] == ["a", "b", "c"] and counts == [2, 1]
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
        assert [e.request_id for e in got] == ["kept"] and counts == [1, -1]
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

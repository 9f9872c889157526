"""Bytes a client sends that are not UTF-8 never make Envoy's messages to the brain unreadable (issue 19, part 5)."""

from __future__ import annotations

from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
import pytest

from extproc.brain.decide import headers_from_attributes
from extproc.brain.wire import lenient

ATTR = "request.headers['x-session-id']"


def _request(session: bytes, body: bytes = b'{"messages": []}') -> bytes:
    r = ep.ProcessingRequest()
    r.attributes["envoy.filters.http.ext_proc"].fields[ATTR].string_value = "S" * len(session)
    r.request_body.body = body
    # what Envoy puts on the wire: the header's bytes as they came
    return r.SerializeToString().replace(b"S" * len(session), session)


def test_a_session_header_that_is_not_utf8_is_read_and_distinct_ones_stay_distinct():
    raw = _request(b"s-\xff\xfe")
    with pytest.raises(DecodeError):  # what the generated deserializer did: the request failed open
        ep.ProcessingRequest.FromString(raw)
    parse = lenient(ep.ProcessingRequest)
    a = headers_from_attributes(parse(raw))["x-session-id"]
    b = headers_from_attributes(parse(_request(b"s-\xfe\xff")))["x-session-id"]
    assert a.startswith("s-") and len(a) == 4 and a != b
    assert parse(raw).request_body.body == b'{"messages": []}'  # bytes fields are left alone


def test_valid_text_and_binary_bodies_are_untouched():
    parse = lenient(ep.ProcessingRequest)
    body = bytes(range(256)) * 4  # a body is bytes: whatever it holds stays as it came
    msg = parse(_request("s-é中".encode(), body))
    assert headers_from_attributes(msg)["x-session-id"] == "s-é中"
    assert msg.request_body.body == body


def test_an_access_log_batch_with_a_non_utf8_path_is_read_whole():
    msg = als_pb2.StreamAccessLogsMessage()
    for i in range(3):
        e = msg.http_logs.log_entry.add()
        e.request.path = "/v1/PPPP" if i == 1 else "/v1/chat/completions"
        e.request.request_id = f"q{i}"
    raw = msg.SerializeToString().replace(b"PPPP", b"\xc3\x28\xa0\xa1")
    with pytest.raises(DecodeError):
        als_pb2.StreamAccessLogsMessage.FromString(raw)
    got = lenient(als_pb2.StreamAccessLogsMessage)(raw)
    assert [e.request.request_id for e in got.http_logs.log_entry] == ["q0", "q1", "q2"]

"""Messages from Envoy parsed so that no byte a client sends can make them unreadable.

Envoy copies header values into protobuf ``string`` fields as they came (a session header ``s-\\xff``,
a path, a user agent), and protobuf refuses to parse a ``string`` that is not UTF-8: the whole
ext_proc message, or the whole access-log batch, would fail, and the request would fail open (or
the access-log stream break, which reads as Envoy gone). On that error the message's string fields
are made valid in place and parsed again: each byte of an invalid sequence keeps its low 7 bits,
so lengths do not change, distinct high bytes stay distinct, and only those fields' text changes.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(data: bytearray, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


# each byte of an invalid sequence (surrogateescape gives U+DC80..U+DCFF) becomes its low 7 bits: one byte for one
_LOW7 = {0xDC00 + b: b & 0x7F for b in range(0x80, 0x100)}


def _mend_text(data: bytearray, start: int, end: int) -> None:
    """Make data[start:end] valid UTF-8 without changing its length, in one pass."""
    text = bytes(data[start:end]).decode("utf-8", "surrogateescape")
    data[start:end] = text.translate(_LOW7).encode("utf-8")


def _mend(desc: Descriptor, data: bytearray, start: int, end: int) -> None:
    """Walk one message's wire form between start and end, mending the text of its string fields."""
    i = start
    while i < end:
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, i = _varint(data, i)
        elif wire == _I64:
            i += 8
        elif wire == _I32:
            i += 4
        elif wire == _LEN:
            size, i = _varint(data, i)
            field = desc.fields_by_number.get(number)
            if field is not None:
                if field.type == FieldDescriptor.TYPE_STRING:
                    _mend_text(data, i, i + size)
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    _mend(field.message_type, data, i, i + size)
            i += size
        else:  # groups: not in Envoy's API
            raise DecodeError(f"unsupported wire type {wire}")


def lenient(cls: type[M]) -> Callable[[bytes], M]:
    """A deserializer for ``cls`` that parses strictly, and on bad UTF-8 mends the strings and parses again."""

    def parse(data: bytes) -> M:
        try:
            return cls.FromString(data)
        except DecodeError:
            mended = bytearray(data)
            _mend(cls.DESCRIPTOR, mended, 0, len(mended))
            return cls.FromString(bytes(mended))

    return parse


def add_service(server, service: str, method: str, handler, kind: str, request_cls, response_cls) -> None:
    """Register one method as the generated ``add_*_to_server`` would, with the lenient deserializer."""
    import grpc

    make = {"stream_stream": grpc.stream_stream_rpc_method_handler,
            "stream_unary": grpc.stream_unary_rpc_method_handler}[kind]
    handlers = {method: make(handler, request_deserializer=lenient(request_cls),
                             response_serializer=response_cls.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


__all__ = ["add_service", "lenient"]

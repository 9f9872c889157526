"""The body's top-level ``model``, as the engine reads it, without parsing the whole body.

vLLM (and SGLang) read a request with Python's ``json.loads`` and then validate the object: the last of
duplicate keys wins, escapes are decoded, ``NaN`` and ``Infinity`` are accepted, and only the top-level
``model`` names the model (a ``metadata.model`` is somebody else's). The brain parses small bodies with
orjson, which agrees on all of that except ``NaN``; everything else (a body above the parse limit, or one
orjson refuses) is read here: a scanner that walks the top-level object's keys and skips every nested value
by counting brackets outside strings. Each string and bracket is one step of C-speed regex work; a body
that needs more than ``max_steps`` of them (a hostile ``[[[[...``) is given up on as ``UNKNOWN``, never
read for long on the event loop.
"""

from __future__ import annotations

import json
import re

UNKNOWN = object()  # the body is not JSON the scanner can read: its model cannot be known from it

_WS = re.compile(rb"[ \t\r\n]*")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_STRUCT = re.compile(rb'["\[\]{}]')
_SCALAR = re.compile(rb"[^ \t\r\n,\]}]+")
_MODEL = b'"model"'
MAX_STEPS = 200_000  # strings and brackets walked through; ~50 ms of the loop at worst
MAX_MODEL_CHARS = 256  # a longer "model" is no served name: vLLM's own names are paths of a few dozen characters


def _decode(raw: bytes):
    """A JSON string token's value, as ``json.loads`` gives it (UNKNOWN if it is not valid)."""
    try:
        if b"\\" not in raw:
            return raw[1:-1].decode("utf-8")
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return UNKNOWN


def _skip_container(body: bytes, i: int, steps: list[int]) -> int:
    """The position after the array or object that opens at ``i``; -1 if it never closes or costs too much."""
    depth = 0
    n = len(body)
    while i < n:
        m = _STRUCT.search(body, i)
        if m is None:
            return -1
        steps[0] += 1
        if steps[0] > MAX_STEPS:
            return -1
        c = body[m.start()]
        if c == 0x22:  # '"'
            s = _STRING.match(body, m.start())
            if s is None:
                return -1
            i = s.end()
            continue
        i = m.end()
        if c in (0x5B, 0x7B):  # [ {
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i
    return -1


def scan_model(body: bytes):
    """The top-level ``model`` of a JSON object body, the last one if the key repeats.

    Returns ``(model, span)``: ``model`` a string, None (no top-level ``model``, ``null``, not a string, or the
    body is not an object) or ``UNKNOWN`` (not readable as JSON); ``span`` the (start, end) of the winning
    value's string token (with its quotes), for rewriting it in place, or None."""
    steps = [0]
    i = _skip_ws(body, 0)
    if body[i:i + 1] != b"{":
        return None, None  # not an object: the engine refuses it (400), whatever it names
    model, span = None, None
    i = _skip_ws(body, i + 1)
    if body[i:i + 1] == b"}":
        return None, None
    n = len(body)
    while True:
        k = _STRING.match(body, i)
        if k is None:
            return UNKNOWN, None
        raw_key = k.group()
        is_model = raw_key == _MODEL or (b"\\" in raw_key and _decode(raw_key) == "model")
        i = _skip_ws(body, k.end())
        if body[i:i + 1] != b":":
            return UNKNOWN, None
        i = _skip_ws(body, i + 1)
        c = body[i:i + 1]
        if c == b'"':
            v = _STRING.match(body, i)
            if v is None:
                return UNKNOWN, None
            if is_model:
                model, span = _decode(v.group()), (v.start(), v.end())
                if model is UNKNOWN:
                    return UNKNOWN, None
            i = v.end()
        elif c in (b"{", b"["):
            end = _skip_container(body, i, steps)
            if end < 0:
                return UNKNOWN, None
            if is_model:
                model, span = None, None  # not a string: the engine refuses it, no served model is named
            i = end
        else:
            v = _SCALAR.match(body, i)
            if v is None:
                return UNKNOWN, None
            if is_model:
                model, span = None, None
            i = v.end()
        i = _skip_ws(body, i)
        c = body[i:i + 1]
        if c == b",":
            i = _skip_ws(body, i + 1)
            continue
        if c == b"}":
            if _skip_ws(body, i + 1) != n:
                return UNKNOWN, None  # trailing bytes: json.loads refuses it
            if isinstance(model, str) and (len(model) > MAX_MODEL_CHARS or not model):
                return None, None
            return model, span
        return UNKNOWN, None


_ANY_MODEL = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.){1,%d}")' % MAX_MODEL_CHARS)


def model_candidates(body: bytes, limit: int = 8) -> tuple[str, ...]:
    """Every string a ``"model":`` key names anywhere in an unreadable body (at most ``limit``, in order): the
    model it means is one of them, so a request is routed among the replicas that serve any of them."""
    out: list[str] = []
    for m in _ANY_MODEL.finditer(body):
        v = _decode(m.group(1))
        if isinstance(v, str) and v not in out:
            out.append(v)
            if len(out) >= limit:
                break
    return tuple(out)


__all__ = ["MAX_MODEL_CHARS", "MAX_STEPS", "UNKNOWN", "model_candidates", "scan_model"]


def _skip_ws(body: bytes, i: int) -> int:
    """Past the JSON whitespace at ``i`` (none: ``i``)."""
    m = _WS.match(body, i)
    return m.end() if m is not None else i

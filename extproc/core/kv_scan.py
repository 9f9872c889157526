"""A client's ``kv_transfer_params`` found in a body that streams past the brain unread.

The brain strips a client's top-level ``kv_transfer_params`` from every body it reads (``apis.without_kv_transfer``),
and Envoy's ``json_to_metadata`` flags them in a body too big to send it (answered 400). A body the endpoint picker
passes through as it comes (a turn decided at its headers, a body decided on its first bytes or its headers past
``brain_body_max_bytes``) reached the replica unchecked: a connector on it would connect where the client said. This
reads such a body chunk by chunk, as the engine's parser would read it whole, and says when its top-level object's
``kv_transfer_params`` names a field a connector acts on (``KV_TRANSFER_FIELDS``: Envoy's rule for big bodies): then
the picker answers 400 before the body's end reaches the replica.

Only the JSON structure is followed: quotes, escapes, brackets and commas, found with compiled searches (a string's
text is skipped by ``bytes.find`` where it has no escape, ~0.2 ms a MB, else by a regex, ~9 ms a MB); keys are
compared as the engine decodes them (escapes too), so the words in a prompt never match, whatever it quotes.
"""

from __future__ import annotations

import json
import re

from .apis import KV_TRANSFER_FIELDS, KV_TRANSFER_KEY

_STRUCTURE = re.compile(rb'["{}\[\],]')
# a string's text up to its closing quote: runs of plain bytes, each escape a backslash and the byte after it (the
# regex engine's loop, ~6 ns a byte: code full of escapes is read at ~9 ms a MB, 37 with a Python step per quote). A
# string with no backslash before its closing quote is skipped by two ``bytes.find`` instead (prose: ~0.2 ms a MB)
_STRING_TEXT = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_KEY_MAX_BYTES = 256  # longer keys are none of these, escaped letter by letter (6 bytes each) included
_FIELDS = frozenset(KV_TRANSFER_FIELDS)


class KvTransferScan:
    """``feed`` the body's chunks in order; True once its top-level ``kv_transfer_params`` has named a field a
    connector acts on (and from then on)."""

    __slots__ = ("depth", "top_object", "in_string", "escaped", "expect_key", "key", "pending_params", "in_params",
                 "params_depth", "found")

    def __init__(self) -> None:
        self.depth = 0
        self.top_object = False  # the body is a JSON object (what else it is, the engine refuses)
        self.in_string = False
        self.escaped = False  # the last chunk ended inside a string on an unpaired backslash
        self.expect_key = False  # the next string at this depth is a key (after '{' or ',')
        self.key: bytearray | None = None  # the key being read, where its name matters
        self.pending_params = False  # the last top-level key read was kv_transfer_params: its value comes next
        self.in_params = False  # inside the top-level kv_transfer_params object
        self.params_depth = 0
        self.found = False

    def feed(self, chunk: bytes) -> bool:
        if self.found:
            return True
        i, n = 0, len(chunk)
        while i < n:
            if self.in_string:
                i = self._string(chunk, i)
                continue
            m = _STRUCTURE.search(chunk, i)
            if m is None:
                break
            i = m.end()
            c = chunk[m.start()]
            if c == 0x22:  # '"'
                self.in_string = True
                watched = self.expect_key and (self.depth == 1 or (self.in_params and self.depth == self.params_depth))
                self.key = bytearray() if watched else None
                self.expect_key = False
            elif c == 0x7B or c == 0x5B:  # '{' '['
                self.depth += 1
                if self.depth == 1:
                    self.top_object = c == 0x7B
                self.expect_key = c == 0x7B and self.top_object
                if self.pending_params and c == 0x7B and self.depth == 2:
                    self.in_params, self.params_depth = True, 2
                self.pending_params = False
            elif c == 0x7D or c == 0x5D:  # '}' ']'
                if self.in_params and self.depth == self.params_depth:
                    self.in_params = False
                self.depth -= 1
                self.expect_key = False
            else:  # ','
                self.expect_key = (self.depth == 1 and self.top_object) or (self.in_params and
                                                                            self.depth == self.params_depth)
                self.pending_params = False
            if self.found:
                return True
        return self.found

    def _string(self, chunk: bytes, i: int) -> int:
        """Past the end of the string under way (or the chunk's end); a watched key is compared once it ends."""
        start = i
        if self.escaped:  # the character this chunk starts with is escaped: it ends nothing, nor pairs a backslash
            self.escaped = False
            i += 1
        q = chunk.find(b'"', i)
        if chunk.find(b"\\", i, q if q >= 0 else len(chunk)) < 0:  # no escape before it (prose): memchr's speed
            e = q if q >= 0 else len(chunk)
        else:
            e = _STRING_TEXT.match(chunk, i).end()  # type: ignore[union-attr]  # it matches the empty string at least
        if e == len(chunk) or chunk[e] == 0x5C:  # the chunk ends in the string (on a backslash: it escapes what's next)
            self.escaped = e < len(chunk)
            self._grow(chunk, start, len(chunk))
            return len(chunk)
        self._grow(chunk, start, e)
        self.in_string = False
        if self.key is not None:
            self._key_ended(bytes(self.key))
            self.key = None
        return e + 1

    def _grow(self, chunk: bytes, start: int, end: int) -> None:
        if self.key is not None:
            if len(self.key) + end - start > _KEY_MAX_BYTES:
                self.key = None  # no key that long is one of these
            else:
                self.key += chunk[start:end]

    def _key_ended(self, raw: bytes) -> None:
        try:
            name = json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode()
        except (ValueError, UnicodeDecodeError):
            return
        if self.depth == 1:
            self.pending_params = name == KV_TRANSFER_KEY
        elif self.in_params and name in _FIELDS:
            self.found = True


__all__ = ["KvTransferScan"]

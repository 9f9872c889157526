"""The picker's scan of a body it passes through unread (issue 59, finding 4): a client's top-level
kv_transfer_params naming a field a connector acts on is found however the body is cut into chunks and spelled, and
nothing else is (a prompt that quotes the words, the key deeper down, the key without such a field)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.apis import KV_TRANSFER_FIELDS, KV_TRANSFER_KEY
from extproc.core.kv_scan import KvTransferScan


def scan(body: bytes, cuts: list[int]) -> bool:
    s = KvTransferScan()
    last = 0
    found = False
    for c in sorted(set(cuts)) + [len(body)]:
        found = s.feed(body[last:c]) or found
        last = c
    return found


def engine_reads_them(body: bytes) -> bool:
    """Any top-level kv_transfer_params object (a duplicate too) with a field a connector acts on, as Python's json
    reads the body."""
    hit = [False]

    def pairs(kv):
        return kv

    doc = json.loads(body, object_pairs_hook=pairs)
    if not isinstance(doc, list) or not all(isinstance(p, tuple) for p in doc):
        return False
    for k, v in doc:
        if k == KV_TRANSFER_KEY and isinstance(v, list) and all(isinstance(p, tuple) for p in v):
            hit[0] = hit[0] or any(f in KV_TRANSFER_FIELDS for f, _ in v)
    return hit[0]


TEXT = st.lists(st.sampled_from(list('ab"\\{}[],: \n') + ["kv_transfer_params", "remote_host", "é", "中"]),
                max_size=20).map("".join)
LEAF = st.none() | st.booleans() | st.integers() | TEXT
VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(TEXT | st.sampled_from([KV_TRANSFER_KEY, *KV_TRANSFER_FIELDS]), inner, max_size=4),
                     max_leaves=12)
PARAMS = st.dictionaries(st.sampled_from([*KV_TRANSFER_FIELDS, "other", "lora"]), LEAF, max_size=3)
TOP = st.lists(st.tuples(st.sampled_from([KV_TRANSFER_KEY, "messages", "model", "kv", "old_kv_transfer_params"]),
                         PARAMS | VALUE), max_size=5)


def encode(pairs: list, ascii_only: bool, escape_keys: bool, spaced: bool) -> bytes:
    sep = (", ", ": ") if spaced else (",", ":")
    parts = []
    for k, v in pairs:
        key = json.dumps(k, ensure_ascii=ascii_only)
        if escape_keys:
            key = '"' + "".join(f"\\u{ord(ch):04x}" for ch in k) + '"'
        parts.append(key + sep[1] + json.dumps(v, ensure_ascii=ascii_only, separators=sep))
    return ("{" + sep[0].join(parts) + "}").encode()


@settings(max_examples=400, deadline=None)
@given(TOP, st.booleans(), st.booleans(), st.booleans(), st.lists(st.integers(0, 400), max_size=12))
def test_the_scan_agrees_with_the_engine_s_parser_however_the_body_is_cut(pairs, ascii_only, escape_keys, spaced,
                                                                          cuts):
    body = encode(pairs, ascii_only, escape_keys, spaced)
    cuts = [c % (len(body) + 1) for c in cuts]
    assert scan(body, cuts) == engine_reads_them(body), body


def test_a_connector_field_is_found_and_the_words_in_a_prompt_are_not():
    attack = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}],
                         KV_TRANSFER_KEY: {"remote_host": "10.9.9.9", "remote_port": 5600}}).encode()
    assert all(scan(attack, [c]) for c in range(0, len(attack), 997))
    quoted = json.dumps({"model": "m", "messages": [{"role": "user", "content": 'fix {"kv_transfer_params": '
                                                     '{"remote_host": "h"}} in vllm'}],
                         "metadata": {KV_TRANSFER_KEY: {"remote_host": "h"}},
                         KV_TRANSFER_KEY: {"lora": 1}}).encode()
    assert not any(scan(quoted, [c]) for c in range(len(quoted)))
    escaped = b'{"messages": [], "kv\\u005ftransfer_params": {"remote\\u005fhost": "10.9.9.9"}}'
    assert all(scan(escaped, [c, c + 7]) for c in range(len(escaped)))


def test_a_backslash_cut_from_the_quote_it_escapes_is_still_read_as_an_escape():
    body = b'{"messages": "a\\\\\\"b", "kv_transfer_params": {"do_remote_prefill": true}}'
    assert json.loads(body)["messages"] == 'a\\"b'
    assert all(scan(body, [c]) for c in range(len(body)))
    trap = b'{"messages": "a\\", \\"kv_transfer_params\\": {\\"do_remote_prefill\\": true}"}'
    assert json.loads(trap)["messages"].startswith('a", "kv_transfer_params')
    assert not any(scan(trap, [c, d]) for c in range(len(trap)) for d in range(c, len(trap), 5))

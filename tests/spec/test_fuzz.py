"""Generated hostile input against the three parsers a stranger can reach (issue 11, fuzzing).

- request bodies (random JSON, wrong types, deep nesting, huge strings, non-UTF-8, compressed bytes)
  against the brain's decide, on both policies: each yields a route or the 503 of an empty fleet;
- ``/metrics`` exposition text against the scrape parser, in both dialects: each yields load or a
  failed scrape with a reason;
- config documents against the config loader: each yields a config or one line naming the field.

CI runs a fixed number of cases with a fixed seed (``derandomize``), over 10,000 in total; ``make fuzz``
runs many more with fresh randomness (``WARMROUTE_FUZZ_EXAMPLES``, ``WARMROUTE_FUZZ_RANDOM=1``).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.brain.scraper import SGLANG, VLLM, parse_metrics
from extproc.config import ConfigError, parse_config

from ..helpers import envoy_decide, live_brain

SCALE = float(os.environ.get("WARMROUTE_FUZZ_EXAMPLES", "1")) if os.environ.get("WARMROUTE_FUZZ_EXAMPLES") else None


def fuzz(n: int):
    """``n`` cases with a fixed seed in CI; ``make fuzz`` sets WARMROUTE_FUZZ_EXAMPLES to a total to spread."""
    examples = n if SCALE is None else max(n, int(SCALE * n / 10_500))
    return settings(max_examples=examples, derandomize=not os.environ.get("WARMROUTE_FUZZ_RANDOM"), database=None,
                    deadline=None, suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ bodies

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False,
                                                                                             allow_infinity=False),
                         st.text(max_size=50))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner,
                                                                max_size=5) | st.dictionaries(st.text(max_size=10),
                                                                                              inner, max_size=5),
                           max_leaves=30)
message = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), json_values),
    "content": st.one_of(st.text(max_size=300), json_values,
                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=100)}),
                                  max_size=3)),
    "name": json_values,
})
chat_body = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.text(max_size=20), json_values),
    "messages": st.one_of(st.lists(st.one_of(message, json_values), max_size=6), json_values),
    "prompt": st.one_of(st.text(max_size=200), json_values),
    "conversation_id": json_values,
    "thread_id": json_values,
    "max_tokens": json_values,
    "stream": json_values,
})


def _deep(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def _deep_blocks(depth: int) -> bytes:
    inner = b'"x"'
    for _ in range(depth):
        inner = b'[{"type":"tool_result","cache_control":{},"content":' + inner + b"}]"
    return b'{"model":"m","system":"s","previous_response_id":"resp_1","input":' + inner + b',"messages":[{"role":"user","content":' + inner + b"}]}"


raw_bodies = st.one_of(
    chat_body.map(orjson.dumps),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers().map(lambda n: b'{"messages": [], "max_tokens": ' + str(n).encode() + b"}"),  # past 64 bits
    st.binary(max_size=2000),  # non-UTF-8, truncated, anything
    st.text(max_size=500).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 200_000).map(_deep),  # nesting far past any parser's recursion limit
    # huge strings
    st.integers(1, 3_000_000).map(lambda n: b'{"messages":[{"role":"user","content":"' + b"x" * n + b'"}]}'),
    chat_body.map(lambda d: gzip.compress(orjson.dumps(d))),  # compressed bytes the brain did not expect
    chat_body.map(lambda d: zlib.compress(orjson.dumps(d))[: len(orjson.dumps(d)) // 2]),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),  # a lone surrogate escape
    st.just(b"\xef\xbb\xbf" + b'{"messages": []}'),  # a BOM
    st.integers(1, 3_000).map(_deep_blocks),  # Messages content blocks nested in tool results
)
header_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
headers = st.dictionaries(
    st.sampled_from(["x-session-id", "x-kilo-session", "x-conversation-id", "x-warmroute-tenant", "x-request-id",
                     "content-encoding", "authorization"]),
    header_values, max_size=5) | st.tuples(
    st.dictionaries(st.sampled_from(["x-session-id", "x-request-id"]), header_values, max_size=2),
    # every API reads the body its own way (core/apis.py)
    st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                     "/v1/responses/resp_1", "/v1/responses/resp_1/cancel"])).map(lambda t: {**t[0], ":path": t[1]})


def _live_brain(policy: str):
    # flow control off: thousands of new sessions at one instant fill every cache's active set, and it would hold
    # them (tests/core/test_flow.py); here each case must be routed and taken back at once
    return live_brain(parse_config({"replicas": [{"name": f"r{i}",
                                                  "url": f"http://127.0.0.1:{8001 + i}"} for i in range(3)],
                                    "routing": {"policy": policy}, "flow_control": {"enabled": False}}))


BRAINS = {p: _live_brain(p) for p in ("warm", "seed")}


@pytest.mark.parametrize("policy", ["warm", "seed"])
@fuzz(2_500)
@given(h=headers, body=raw_bodies)
def test_any_body_is_routed_and_nothing_escapes(policy, h, body):
    b = BRAINS[policy]
    out = envoy_decide(b, h, body)
    if h.get("content-encoding", "identity").strip().lower() not in ("", "identity"):  # no replica reads it: 415
        assert out.immediate_response.status.code == 415
        return
    assert out.WhichOneof("response") == "request_body"  # a route (the fleet is LIVE: never the 503)
    answer = out.dynamic_metadata.fields["warmroute"].struct_value.fields
    assert answer["cluster"].string_value in ("r0", "r1", "r2")
    # release at once: the fleet's in-flight state stays what the next case expects
    res = b.ledger.named(answer["reservation"].string_value)
    assert res is not None
    b.router.release(res, b.clock())
    b.ledger.forget_released()


# ------------------------------------------------------------------ /metrics

NAMES = [VLLM.running, VLLM.waiting, *VLLM.kv, *VLLM.counters, VLLM.cache_info, SGLANG.running, SGLANG.waiting,
         *SGLANG.kv, *SGLANG.counters, SGLANG.cache_tokens, "process_cpu_seconds_total", "vllm:other"]
values = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str),
                   st.sampled_from(["NaN", "+Inf", "-Inf", "1e12", "-1", "0x10", "", "1 2 3", "nan"]),
                   st.text(max_size=8))
labels = st.one_of(st.just(""), st.dictionaries(st.sampled_from(["model_name", "engine", "num_gpu_blocks",
                                                                 "block_size", 'a"b']),
                                                st.text(max_size=8), max_size=3)
                   .map(lambda d: "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"),
                   st.text(max_size=12))
line = st.one_of(st.tuples(st.sampled_from(NAMES), labels, values).map(lambda t: f"{t[0]}{t[1]} {t[2]}"),
                 st.sampled_from(["# HELP x y", "# TYPE x gauge", "", "garbage", "{}", "  "]), st.text(max_size=40))


@pytest.mark.parametrize("dialect", [VLLM, SGLANG], ids=["vllm", "sglang"])
@fuzz(2_000)
@given(lines=st.lists(line, max_size=25))
def test_any_metrics_text_is_load_or_a_failed_scrape_with_a_reason(dialect, lines):
    r = parse_metrics("\n".join(lines), dialect)
    if r.ok:
        assert 0 <= r.running <= 100_000 and 0 <= r.waiting <= 100_000 and 0.0 <= r.kv_usage <= 1.0 + 1e-9
    else:
        assert r.error and "\n" not in r.error


# ------------------------------------------------------------------ config

SECTIONS = {
    "replicas": None, "routing": ["policy", "token_weight_unit", "reservation_timeout_s", "seed", "nope"],
    "health": ["scrape_interval_s", "good_scrapes_to_probe", "cooldown_base_s"], "pins": ["session_ttl_s",
                                                                                          "prefix_slack"],
    "profile": ["session_headers", "tenant_source", "tenant_header", "max_body_bytes", "chars_per_token",
                "block_chars"],
    "warm": ["balance_factor", "kv_pressure", "cache_tokens"], "brain": ["host", "grpc_port", "grpc_socket"],
    "envoy": ["listen_port", "allowed_paths", "fail_open_hash_balance_factor", "max_body_bytes"],
    "allow_no_replicas": None, "bogus": None,
}
scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=12),
                   st.lists(st.text(max_size=8), max_size=3))
replica = st.fixed_dictionaries({}, optional={"name": st.one_of(st.sampled_from(["r0", "r1", "warmroute_x",
                                                                                 "bad name"]), scalar),
                                              "url": st.one_of(st.sampled_from(["http://127.0.0.1:8000", "ftp://x",
                                                                                "http://h:99999"]), scalar),
                                              "engine": st.one_of(st.sampled_from(["vllm", "sglang", "none", "tgi"]),
                                                                  scalar),
                                              "extra": scalar})


@st.composite
def config_docs(draw):
    doc = {}
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS)), max_size=4, unique=True)):
        keys = SECTIONS[section]
        if section == "replicas":
            doc[section] = draw(st.one_of(st.lists(replica, max_size=4), scalar))
        elif keys is None:
            doc[section] = draw(scalar)
        else:
            doc[section] = draw(st.one_of(st.dictionaries(st.sampled_from(keys), scalar, max_size=3), scalar))
    return draw(st.one_of(st.just(doc), scalar))


@fuzz(2_500)
@given(doc=config_docs())
def test_any_config_document_loads_or_fails_with_one_line_naming_the_field(doc):
    try:
        parse_config(doc, "fuzz.yaml")
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg
        head = msg.split(":", 1)[0].split(".", 1)[0].split("[", 1)[0]
        assert head in SECTIONS or head == "fuzz", msg  # it names the field (or the file, for a non-mapping)
    # the same document through YAML text loads the same way (what load_config reads)
    yaml.safe_dump(doc)


# ------------------------------------------------------------------ issue 30's classes

def _idle(b) -> bool:
    """Nothing predicted left on any replica (the warm policy's queue, pending KV and in-flight work)."""
    pol = b.router.policy
    now = b.clock()
    views = [pol.replica_view(r, now) for r in b.router.replicas]
    return all(v["predicted_wait_seconds"] < 1e-6 and v["in_flight_work_seconds"] < 1e-6 and v["pending_kv_tokens"] == 0
               for v in views)


declared = st.one_of(st.integers(0, 10**30).map(str), st.text(max_size=30), st.just("9" * 5000), st.just("²"))


@fuzz(600)
@given(h=headers, size=declared, inflated=st.sampled_from([None, "gzip", "br"]), body=st.one_of(st.none(), raw_bodies))
def test_any_declared_size_or_encoding_is_bounded_and_taken_back_when_the_request_ends(h, size, inflated, body):
    b = BRAINS["warm"]
    h = {**h, "content-length": size, **({"x-warmroute-inflated-from": inflated} if inflated else {})}
    out = envoy_decide(b, h, body, "request_body" if body is not None else "request_headers")
    kind = out.WhichOneof("response")
    if kind == "immediate_response":  # only what Envoy inflated and no parser reads (413), or what it did not (415)
        enc = h.get("content-encoding", "identity").strip().lower()
        if enc not in ("", "identity"):
            assert out.immediate_response.status.code == 415
            return
        assert out.immediate_response.status.code == 413 and inflated
        return
    answer = out.dynamic_metadata.fields["warmroute"].struct_value.fields
    res = b.ledger.named(answer["reservation"].string_value)
    assert res.weight_milli <= b.router.weight_milli(b.router.profile_cfg.max_prompt_tokens)
    b.router.release(res, b.clock())
    b.ledger.forget_released()
    assert _idle(b)


@fuzz(800)
@given(body=chat_body | st.dictionaries(st.sampled_from(["model", "messages", "metadata", "x"]),
                                         json_values | st.floats(allow_nan=True), max_size=6))
def test_the_model_read_is_the_one_json_loads_reads(body):
    from extproc.core.profile import engine_model

    raw = json.dumps(body).encode()  # Python's writer: NaN and Infinity as the engine's reader takes them
    want = json.loads(raw).get("model")
    assert engine_model(raw) == (want if isinstance(want, str) and want else None)


replica_json = st.one_of(json_values.map(json.dumps), st.integers(1,
                                                                  120_000).map(lambda d: '{"data": ' + "[" * d + "]"
                                                                               * d + "}"),
                         st.integers(1, 120_000).map(lambda d: '{"paths": ' + '{"a":' * d + "1" + "}" * (d + 1)),
                         st.text(max_size=300),
                         st.lists(st.text(max_size=30), max_size=20).map(
                             lambda ids: json.dumps({"data": [{"id": i} for i in ids], "paths": {i: {} for i in ids}})))


@fuzz(300)
@given(text=replica_json)
def test_any_replica_answer_is_a_list_or_refused_never_a_crash(text):
    from extproc.brain.scraper import parse_models, parse_openapi_paths

    models, paths = parse_models(text), parse_openapi_paths(text)
    assert models is None or all(m["id"].isprintable() for m in models)
    assert paths is None or all(p.isprintable() and p.startswith("/") for p in paths)


@fuzz(400)
@given(status=st.text(max_size=12), subset=st.lists(st.text(max_size=30), max_size=50) | st.text(max_size=200))
def test_any_status_or_subset_a_gateway_sends_is_no_crash(status, subset):
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.contract import SUBSET_KEY, SUBSET_NAMESPACE
    from extproc.picker import EndpointPicker

    b = BRAINS["warm"]
    req = ep.ProcessingRequest()
    req.request_headers.headers.headers.add(key=":method", raw_value=b"POST")
    req.request_headers.end_of_stream = True
    f = req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY]
    if isinstance(subset, str):
        f.string_value = subset
    else:
        for s in subset:
            f.list_value.values.add().string_value = s
    rh = ep.ProcessingRequest()
    rh.response_headers.headers.headers.add(key=":status", raw_value=status.encode("utf-8", "surrogatepass"))
    rh.response_headers.end_of_stream = True
    msgs = [req, rh]

    class Ctx:
        async def read(self):
            return msgs.pop(0) if msgs else grpc.aio.EOF

        async def write(self, msg):
            pass

    asyncio.run(EndpointPicker(b.picks.pick, b.picks.end, 1 << 20, b.clock).Process(None, Ctx()))
    assert b.router.open_reservations == 0

"""Hardening, fifth round (issue 59), the parts that need no process: each test fails on the code before it."""

from __future__ import annotations

import pytest

from extproc.brain.scraper import parse_vllm_metrics

RUNNING = 'vllm:num_requests_running{model_name="m"} 1\n'


@pytest.mark.parametrize("label", ['block_size="²"', 'kv_cache_size_tokens="٣٣",block_size="16"',
                                   'num_gpu_blocks="10",block_size="１６"'])
def test_a_unicode_digit_in_a_label_is_no_number_and_no_crash(label):
    """``"²".isdigit()`` is true and ``int("²")`` raises: the label is ignored, the scrape still reads the load."""
    r = parse_vllm_metrics(RUNNING + f'vllm:cache_config_info{{{label},enable_prefix_caching="True"}} 1.0\n'
                           'vllm:lora_requests_info{max_lora="³",running_lora_adapters="",waiting_lora_adapters=""} 1\n')
    assert r.ok and r.running == 1
    assert r.sample.engine_block in (None, 16)


# ------------------------------------------------------------------ a client's own kv_transfer_params (finding 4)

def _brain(**extra):
    from extproc.config import parse_config

    from .helpers import live_brain

    return live_brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(2)],
                                    "flow_control": {"enabled": False}, **extra}))


def _sent_body(out, body: bytes) -> bytes:
    m = out.request_body.response.body_mutation
    return m.body if m.HasField("body") else body


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"remote_host": "10.9.9.9", '
    b'"remote_port": 5600, "remote_block_ids": [1, 2], "remote_request_id": "victim", "do_remote_prefill": true}}',
    # the same key as the engine's parser reads it: escaped, duplicated, beside a NaN only Python's json reads
    b'{"model": "m", "messages": [], "kv\\u005ftransfer_params": {"remote_host": "10.9.9.9"}}',
    b'{"kv_transfer_params": null, "temperature": NaN, "kv_transfer_params": {"remote_host": "10.9.9.9"}, "model": "m"}',
])
def test_a_client_s_own_kv_transfer_params_never_reach_an_engine(body):
    import json

    b = _brain()
    out = b.decide({"x-session-id": "s", ":path": "/v1/chat/completions"}, body)
    assert out.WhichOneof("response") == "request_body"
    sent = json.loads(_sent_body(out, body))
    assert "kv_transfer_params" not in sent and sent["model"] == "m"


def test_a_body_without_them_is_sent_as_it_came():
    b = _brain()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 \\u4e2d"}]}'
    out = b.decide({"x-session-id": "s", ":path": "/v1/chat/completions"}, body)
    assert not out.request_body.response.body_mutation.HasField("body")


def test_a_body_too_big_for_the_brain_that_names_them_is_refused_in_openai_s_shape():
    """Envoy's json_to_metadata reads a body above brain_body_max_bytes: the flag it sets is answered 400."""
    import json

    from extproc.core.profile import BODY_KV_TRANSFER_KEY

    b = _brain()
    out = b.decide({"x-session-id": "s", ":path": "/v1/chat/completions", "content-length": "5000000",
                    BODY_KV_TRANSFER_KEY: "1"}, None, "request_headers")
    assert out.immediate_response.status.code == 400
    assert json.loads(out.immediate_response.body)["error"]["code"] == "kv_transfer_params_not_allowed"

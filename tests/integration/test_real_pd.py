"""Prefill/decode disaggregation on real vLLM 0.32 engines (CPU, the tiny model), through Envoy (issue 48).

Two engines with vLLM's file-based ExampleConnector (both roles; the connector that runs on this CPU): r0 of role
prefill, r1 of role decode. The connector hands the KV over by the prompt itself (it returns no
kv_transfer_params: the params relay is tested on the mocks, test_disaggregation.py). What only the real engine
can say: that a prefill leg the brain sends makes the decode replica load the prompt's KV instead of computing it
(``prompt_tokens_by_source_total{source="external_kv_transfer"}``), for the blocks it reports cached, with no
client error; and that a prompt the brain keeps local never touches the prefill replica.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request

import pytest

from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Stack, wait_for
from extproc.tools.stack.real_vllm import VllmOptions, pd_extra

from .conftest import FAST
from .test_real_vllm import metrics_of, post, total

pytestmark = [pytest.mark.integration, pytest.mark.real_engine]

MODEL = "tiny-llama"
MAX_LEN = 8192
CONFIG = {**FAST, "health": {**FAST["health"], "scrape_interval_s": 0.5},
          # the transfer is a file on the same disk: priced as near free, what the prefill leg and the batch cost
          # decide; the connector's chunked prefill takes at most MAX_LEN tokens whole
          "disaggregation": {"transfer_tokens_per_s": 1e6, "max_transfer_tokens": MAX_LEN}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    why = real_vllm.available()
    if why:
        pytest.fail(f"the real-engine tests need the engine: {why}")
    storage = tmp_path_factory.mktemp("kv")
    s = Stack(2, config=CONFIG, real_vllm=VllmOptions(lora=(), max_model_len=MAX_LEN, extra=pd_extra(storage, MAX_LEN)))
    s.replica_config = {"r0": {"role": "prefill"}, "r1": {"role": "decode"}}
    try:
        s.start()
        s.wait_all_live(120)
        yield s
    finally:
        s.stop()


def port_of(stack: Stack, name: str) -> int:
    return next(r.port for r in stack.replicas if r.name == name)


def prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    return tag + " " + " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"))
                                for _ in range(words))


def chat(text: str, out: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": out, "stream": stream,
            "temperature": 0}


def decision(stack: Stack, rid: str) -> dict:
    return json.loads(stack.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]


FAILED_OPEN = "http.ingress.ext_proc.warmroute.failure_mode_allowed"


def decision_or_failed_open(stack: Stack, rid: str, failed_open_before: int) -> dict | None:
    """The brain's decision of a request, or None when Envoy routed it without one because the brain's answer came
    too late (a CI machine once starved the brain past the 3 s timer while two CPU engines ran 4 decodes and a
    prefill: the request succeeded by the ring hash, and the brain rightly remembered no decision for it)."""
    try:
        return decision(stack, rid)
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
    assert stack.envoy_stats().get(FAILED_OPEN, 0) > failed_open_before, f"no decision for {rid}, none failed open"
    # late, not broken: a decision that raised also fails open (every disaggregated round did so once, a bug the
    # rounds' tolerance hid for a session)
    with urllib.request.urlopen(stack.brain_metrics, timeout=5) as r:
        faults = [line for line in r.read().decode().splitlines()
                  if line.startswith("warmroute_call_faults_total") and not line.endswith(" 0.0")]
    assert not faults, f"the brain's decisions raised: {faults} (its log names the error)"
    return None


def test_a_prompt_that_stays_local_never_touches_the_prefill_replica(pd):
    # first in the module: nothing decoding and nothing arrived lately (a prefill also stalls the streams expected to
    # join during it)
    wait_for(lambda: all(r["effective_running"] == 0 for r in pd.state()["replicas"]) or None, 60, "an idle fleet")
    before = total(metrics_of(port_of(pd, "r0")), "vllm:prompt_tokens_total")
    status, headers, doc = post(pd.url, "/v1/chat/completions", chat(prompt(f"idle-{random.random()}", 800), 8))
    assert status == 200, doc
    assert decision(pd, headers["x-request-id"])["prefill_replica"] is None
    assert total(metrics_of(port_of(pd, "r0")), "vllm:prompt_tokens_total") == before
    with urllib.request.urlopen(pd.brain_metrics, timeout=5) as r:
        m = r.read().decode()
    assert 'warmroute_disaggregated_total{outcome="local_fallback"} 0.0' in m


def test_a_long_prompt_beside_running_decodes_is_prefilled_on_the_prefill_replica_and_loaded_by_the_decode_one(pd):
    # streams decoding on r1 (the only decode replica): a local prefill of a long prompt would stall each of them
    results: list[int] = []

    def stream(i: int) -> None:
        status, _, _ = post(pd.url, "/v1/chat/completions", chat(prompt(f"bg{i}-{random.random()}", 40), 400))
        results.append(status)

    seen = []
    # whether a remote prefill pays is the brain's prediction from rates learned on a machine other tests may load:
    # up to five rounds of streams and a long prompt, until one is disaggregated (alone: the first, every run; inside a
    # loaded `make test` two rounds of three once failed open past the brain's 3 s timer)
    for _ in range(5):
        results.clear()
        ttft0 = total(metrics_of(port_of(pd, "r1")), "vllm:time_to_first_token_seconds_count")
        bg = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in bg:
            t.start()
        # their prefills done (each counted its prompt's sources): what moves next is the long prompt's alone
        wait_for(lambda: total(metrics_of(port_of(pd, "r1")), "vllm:time_to_first_token_seconds_count") >= ttft0 + 4
                 or None, 60, "streams decoding on r1")
        before = total(metrics_of(port_of(pd, "r1")), "vllm:prompt_tokens_by_source_total",
                       source="external_kv_transfer")
        failed_open = pd.envoy_stats().get(FAILED_OPEN, 0)
        status, headers, doc = post(pd.url, "/v1/chat/completions", chat(prompt(f"long-{random.random()}", 1000), 8))
        for t in bg:
            t.join(120)
        assert status == 200, doc
        assert results == [200] * 4
        d = decision_or_failed_open(pd, headers["x-request-id"], failed_open)
        seen.append(d)
        if d is not None and d["prefill_replica"] is not None:
            break
    assert d is not None and d["prefill_replica"] == "r0" and d["replica"] == "r1", seen
    cached = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = total(metrics_of(port_of(pd, "r1")), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    # r1 never saw this prompt: all it reports cached it loaded from the prefill leg's KV, whole blocks
    with urllib.request.urlopen(pd.brain_metrics, timeout=5) as r:  # a leg that failed fell back to a local prefill
        legs = [line for line in r.read().decode().splitlines() if line.startswith("warmroute_disaggregated_total")]
    assert cached > 0.9 * doc["usage"]["prompt_tokens"] and cached % 128 == 0, (doc["usage"], d, legs)  # CPU blocks
    assert after - before == cached, (before, after, cached)

"""The mock vLLM replica (engine model in real time), driven with the official openai SDK."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.stack.local import http_get, http_post_json, wait_for

pytestmark = pytest.mark.integration

SYSTEM = "You are a coding agent for the billing service. Keep diffs small. " * 80  # ~1,300 tokens


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def metrics(url: str) -> dict[str, tuple[str, list]]:
    out = {}
    for fam in text_string_to_metric_families(http_get(url + "/metrics").decode()):
        out[fam.name] = (fam.type, fam.samples)
    return out


def value(url: str, sample_name: str) -> float:
    for fam in text_string_to_metric_families(http_get(url + "/metrics").decode()):
        for s in fam.samples:
            if s.name == sample_name:
                return s.value
    raise KeyError(sample_name)


def test_chat_streamed_and_not_with_usage_and_completions(replica):
    r = replica("--speedup", "20")
    c = client(r.url)
    out = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi " * 100}],
                                    max_tokens=12)
    assert out.choices[0].message.content.split() == ["tok"] * 12
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 75
    chunks = list(c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=7,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.split() == ["tok"] * 7
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    legacy = c.completions.create(model="mock-coder-30b", prompt="def f():", max_tokens=5)
    assert legacy.choices[0].text.split() == ["tok"] * 5
    assert [m.id for m in c.models.list().data] == ["mock-coder-30b"]
    assert http_get(r.url + "/health") == b""


def test_a_shared_prefix_hits_the_prefix_cache(replica):
    r = replica("--speedup", "20")
    c = client(r.url)
    first = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": "task one"}], max_tokens=2)
    second = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": "another task"}], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) // 4 - 16
    assert value(r.url, "vllm:prefix_cache_hits_total") == second.usage.prompt_tokens_details.cached_tokens
    assert value(r.url, "vllm:prefix_cache_queries_total") == first.usage.prompt_tokens + second.usage.prompt_tokens


def test_metrics_use_vllm_names_types_and_labels(replica):
    r = replica()
    m = metrics(r.url)
    want = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    for name, typ in want.items():
        assert m[name][0] == typ, name
        for sample in m[name][1]:
            assert sample.labels.get("model_name") == "mock-coder-30b" and sample.labels.get("engine") == "0"


def test_requests_queue_when_the_batch_is_full(replica):
    r = replica("--max-num-seqs", "1", "--speedup", "1")
    c = client(r.url)
    threads = [threading.Thread(target=lambda: c.chat.completions.create(
        model="mock-coder-30b", messages=[{"role": "user", "content": "x"}], max_tokens=40)) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: value(r.url, "vllm:num_requests_waiting") >= 1 and value(r.url, "vllm:num_requests_running") == 1,
             10, "a queue behind the single running request")
    for t in threads:
        t.join(30)
    assert value(r.url, "vllm:num_requests_waiting") == 0


def test_fault_injection_5xx_down_and_die_and_come_back(replica):
    r = replica("--speedup", "20")
    c = client(r.url)
    http_post_json(r.url + "/admin/fault", {"fail_rate": 1.0})
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.status_code == 503
    http_post_json(r.url + "/admin/fault", {"fail_rate": 0.0, "healthy": False})
    with pytest.raises(urllib.error.HTTPError) as e2:
        http_get(r.url + "/metrics")
    assert e2.value.code == 503
    http_post_json(r.url + "/admin/fault", {"healthy": True, "die_for_s": 1.5})

    def refused():
        try:
            http_get(r.url + "/health", timeout=0.5)
            return False
        except urllib.error.URLError as err:
            return isinstance(err.reason, ConnectionRefusedError)

    wait_for(refused, 5, "connections refused while dead")
    wait_for(lambda: http_get(r.url + "/health", timeout=0.5) == b"", 10, "the replica back")
    out = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert out.choices[0].message.content


def test_flap_flags_make_it_die_and_return_on_a_timer(replica):
    r = replica("--flap-every", "1.0", "--flap-down", "0.4")
    seen = set()

    def observe():
        try:
            http_get(r.url + "/health", timeout=0.3)
            seen.add("up")
        except urllib.error.URLError:
            seen.add("down")
        return seen == {"up", "down"}

    wait_for(observe, 10, "both up and down states", every=0.05)


def test_a_prompt_longer_than_the_kv_cache_is_refused_with_400(replica):
    r = replica("--kv-tokens", "1000")
    body = json.dumps({"model": "mock-coder-30b", "messages": [{"role": "user", "content": "x" * 8000}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(r.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400


def test_the_counters_a_router_learns_rates_from_and_a_slower_speed_shows_in_them(replica):
    """vLLM's prompt/generation token counters, per-phase latency histograms and cache_config_info, read by
    the brain's own parser; a replica at --speed 0.5 prefills at about half the rate of one at full speed."""
    from extproc.brain.scraper import parse_vllm_metrics

    fast, slow = replica("--speedup", "20"), replica("--speedup", "20", "--speed", "0.5", "--kv-tokens", "160000")
    rates = {}
    for r in (fast, slow):
        first = parse_vllm_metrics(http_get(r.url + "/metrics").decode())
        assert first.ok and first.sample.cache_tokens == (300_000 if r is fast else 160_000)
        c = client(r.url)
        for i in range(6):  # distinct long prompts: mostly uncached prefill
            c.chat.completions.create(model="mock-coder-30b", max_tokens=40, messages=[
                {"role": "user", "content": f"request {i} " + "new text to prefill. " * 3000}])
        last = parse_vllm_metrics(http_get(r.url + "/metrics").decode())
        s = last.sample
        assert s.prompt_tokens > 6 * 12_000 and s.prefill_seconds > 0 and s.generation_tokens >= 6 * 40
        assert s.decode_seconds > 0 and s.requests_done == 6
        rates[r.name] = (s.prompt_tokens - s.cached_tokens) / s.prefill_seconds  # what the warm policy learns
    assert 1.5 < rates[fast.name] / rates[slow.name] < 2.6


def test_the_mock_never_logs_what_a_request_carried(replica):
    import urllib.error
    import urllib.request

    r = replica()
    for n in (20_000, 70_000):  # within Envoy's 60 KiB of headers, and past it (refused)
        req = urllib.request.Request(r.url + "/v1/chat/completions", data=b'{"messages": []}',
                                     headers={"x-session-id": "SECRET-SESSION-" + "a" * n,
                                              "content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except urllib.error.HTTPError as e:
            assert e.code == 400
    wait_for(lambda: "bad request refused" in r.proc.log_tail(100_000), 10, "the refusal logged")
    assert "SECRET-SESSION" not in r.proc.log_tail(1_000_000)


def _samples(url: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(http_get(url + "/metrics").decode())
            for s in fam.samples if s.name == name]


def test_sglang_dialect_gauges_stay_at_the_last_batch_and_every_tp_rank_exports_a_copy(replica):
    r = replica("--speedup", "20", "--metrics", "sglang", "--tp", "2", "--metrics-all-ranks")
    c = client(r.url)
    c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x" * 4000}], max_tokens=3)
    running = _samples(r.url, "sglang:num_running_reqs")
    assert sorted(s.labels["tp_rank"] for s in running) == ["0", "1"]  # a copy per tensor-parallel rank
    # finished and idle, but SGLang last logged its stats at the prefill batch: the gauge still says 1
    assert [s.value for s in running] == [1.0, 1.0]
    assert _samples(r.url, "sglang:num_requests_total")[0].value == 1  # counted at finish


def test_vllm_counts_prefill_seconds_when_a_request_finishes_not_at_its_first_token(replica):
    r = replica("--speedup", "20")
    c = client(r.url)
    stream = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x" * 4000}],
                                       max_tokens=8000, stream=True)  # ~5 s of wall time after its first token
    next(iter(stream))  # the first token is out
    assert value(r.url, "vllm:prompt_tokens_total") == 1000  # counted at the first token
    assert value(r.url, "vllm:request_prefill_time_seconds_count") == 0  # observed when it finishes
    for _ in stream:
        pass
    wait_for(lambda: value(r.url, "vllm:request_prefill_time_seconds_count") == 1, 10, "the finish observed")


def test_data_parallel_engines_are_spread_by_vllm_s_rule_or_the_rank_header(replica):
    r = replica("--speedup", "20", "--data-parallel", "2")
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})

    def engine(headers: dict, max_tokens: int = 2) -> str:
        doc = json.loads(body) | {"max_tokens": max_tokens}
        req = urllib.request.Request(r.url + "/v1/chat/completions", data=json.dumps(doc).encode(),
                                     headers={"content-type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.headers["x-mock-engine"]

    assert {engine({"X-data-parallel-rank": "1"}) for _ in range(4)} == {"1"}
    with pytest.raises(urllib.error.HTTPError) as e:
        engine({"X-data-parallel-rank": "2"})
    assert e.value.code == 400
    info = _samples(r.url, "vllm:cache_config_info")
    assert sorted(s.labels["engine"] for s in info) == ["0", "1"]
    assert len({s.labels["num_gpu_blocks"] for s in info}) == 1  # the front end's sum, on both
    assert int(info[0].labels["num_gpu_blocks"]) * 16 == 2 * int(info[0].labels["kv_cache_size_tokens"])
    # concurrent requests without the header: the least waiting x 4 + running takes each
    results: list[str] = []
    # (each ~0.7 s of wall time, so they overlap)
    threads = [threading.Thread(target=lambda: results.append(engine({}, 1000))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {"0", "1"}


def test_a_compressed_body_is_read_as_sent_and_refused_as_vllm_refuses_it(replica):
    """vLLM 0.32 reads no Content-Encoding: a deflate or gzip chat body is its 400 {"detail": "There was an error
    parsing the body"} (seen on the real engine, 2026-12-04). aiohttp inflated it by default (a deflate upload
    grew to 614-745 MB in the mock)."""
    import gzip
    import zlib

    r = replica()
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": "hi"}]}).encode()
    for enc, data in (("deflate", zlib.compress(body)), ("gzip", gzip.compress(body))):
        req = urllib.request.Request(r.url + "/v1/chat/completions", data=data, method="POST",
                                     headers={"content-type": "application/json", "content-encoding": enc})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read()) == {"detail": "There was an error parsing the body"}

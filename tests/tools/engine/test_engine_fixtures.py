"""The scraper against /metrics texts in each engine's exact shape: names, types, label sets and buckets as
vLLM's and SGLang's code defines them (extproc/tools/engine/metrics.py, which cites where each comes from),
rendered after a known history of requests, so every number the parser reads is checked against what put it
there."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.brain.scraper import SGLANG, VLLM, parse_metrics
from extproc.tools.engine.metrics import FIXTURES, fixture

DIR = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
DIALECT = {"vllm": VLLM, "vllm-old": VLLM, "sglang": SGLANG}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_fixture_files_are_what_the_engine_definitions_render(name):
    """A definition changed without `python -m extproc.tools.engine.metrics --write` fails here."""
    assert (DIR / name).read_bytes() == fixture(*FIXTURES[name])[0]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_number_the_router_reads_is_the_one_the_history_put_there(name):
    dialect, dp, tp, *_ = FIXTURES[name]
    _, want = fixture(*FIXTURES[name])
    r = parse_metrics((DIR / name).read_text(), DIALECT[dialect])
    assert r.ok, r.error
    s = r.sample
    assert (r.running, r.waiting) == (want["running"], want["waiting"])  # TP copies counted once
    assert r.kv_usage == pytest.approx(max(want["kv"]))
    assert s.prompt_tokens == want["prompt"] and s.cached_tokens == want["cached"]
    assert s.requests_done == want["done"] and s.first_tokens == want["first"]
    if dialect == "sglang":
        # SGLang has no decode time: decode speed comes from its inter-token latency; its prefill stage is counted
        # once per request, whichever tensor-parallel ranks export a copy, and its prompt tokens at finish
        assert (s.itl_seconds, s.itl_tokens) == (pytest.approx(want["itl_s"]), want["itl_n"])
        assert s.prefill_seconds == pytest.approx(want["prefill_s"]) and s.prefill_done == want["first"]
        assert s.prompt_requests == want["done"] and s.generation_tokens == want["generated"]
    else:
        assert s.prefill_seconds == pytest.approx(want["prefill_s"]) and s.prefill_done == want["done"]
        assert s.prompt_requests == want["first"]
        assert s.decode_seconds == pytest.approx(want["decode_s"]) and s.decode_done == want["done"]
        assert s.generated_at_finish == want["generated"] and s.generation_tokens == want["generated"]
    if dialect == "vllm":
        assert s.computed_at_finish == want["computed"] and s.computed_tokens == want["computed"]
        # an offloading connector's restores: the tokens it loaded and its load seconds (none without one)
        assert s.restored_tokens == want["restored"]
        assert s.restore_seconds == (pytest.approx(want["restore_s"]) if want["restore_s"] else None)
    else:  # vLLM before 0.11 has neither
        assert s.computed_at_finish is None and s.computed_tokens is None
    # vLLM's cache holds whole blocks of cache_config_info's block_size (16 in these fixtures); SGLang's any count
    assert s.engine_block == (None if dialect == "sglang" else 16)
    # each engine's own cache; vLLM's num_gpu_blocks is the sum over its data-parallel engines
    assert s.cache_tokens == want["cache_tokens"] * dp
    if dp > 1:
        assert [e.cache_tokens for e in s.engines] == [want["cache_tokens"]] * dp
        assert [e.running for e in s.engines] == [3 + k for k in range(dp)]
        assert [e.kv_usage for e in s.engines] == pytest.approx(want["kv"])
    else:
        assert s.engines is None
    # LoRA: the newest of lora_requests_info's label sets is the present one
    assert (s.lora_running, s.lora_waiting, s.max_lora) == want.get("lora", (None, None, None))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_text_is_never_read_as_the_other_engine(name):
    dialect = FIXTURES[name][0]
    other = SGLANG if dialect != "sglang" else VLLM
    r = parse_metrics((DIR / name).read_text(), other)
    assert not r.ok and r.missing


@pytest.mark.parametrize("dialect,files", [(VLLM, ("vllm-0.32.txt", "vllm-0.8.txt", "vllm-0.32-lora.txt",
                                                   "vllm-0.32-offload.txt")), (SGLANG, ("sglang-0.5.txt",))])
def test_every_name_the_parser_wants_is_one_an_engine_exports(dialect, files):
    """A misspelt or invented metric name reads nothing, silently: each one must be in some engine's text."""
    names = set()
    for f in files:
        for line in (DIR / f).read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(line.split("{")[0].split(" ")[0])
    assert dialect.wanted() - names == set()


def test_a_vllm_with_an_old_and_a_new_name_for_the_hits_counts_them_once():
    """vLLM 0.9 exported gpu_prefix_cache_hits beside prefix_cache_hits: the newer is read, not both."""
    text = (DIR / "vllm-0.32.txt").read_text()
    old = "\n".join(line.replace("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
                    for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
    _, want = fixture("vllm")
    assert parse_metrics(text + old + "\n", VLLM).sample.cached_tokens == want["cached"]


@pytest.mark.parametrize("dialect", ["vllm", "vllm-old", "sglang"])
def test_the_mock_s_text_is_prometheus_client_s_byte_for_byte(dialect):
    """The mock formats each series' labels once (it is read ten times a second); the text must stay the engines'
    own exporter's, `_created` series and odd label values included."""
    from prometheus_client import generate_latest

    from extproc.tools.engine.metrics import CacheInfo, Exporter
    from extproc.tools.engine.model import EngineRequest

    ex = Exporter(dialect, 'odd "model"\\name\n', 2, CacheInfo(16, 100, True), max_loras=2)
    for k in range(2):
        er = EngineRequest(k, (), 1000, 50, 0.0)
        er.cached_tokens, er.generated = 400, 50
        ex.first_token(k, er, 0.25, 0.2)
        ex.chunk(k, 49, 1.5)
        ex.finished(k, er, queued_s=0.05, prefill_s=0.2, decode_s=1.5, e2e_s=1.75)
    first = ex.text()
    assert first == generate_latest(ex.registry) and b"_created" in first
    ex.chunk(0, 10, 0.3)  # a second rendering reads the cached labels
    assert ex.text() == generate_latest(ex.registry) != first


def test_sglang_s_prompt_tokens_are_paired_with_its_finished_requests_not_its_first_tokens():
    """SGLang counts prompt tokens when a request finishes (vLLM at its first token): the prefill rate's per-request
    mean must divide them by the finished requests. The fixture's history finishes every request it starts, so
    here some have only had their first token."""
    text = (DIR / "sglang-0.5.txt").read_text()
    line = next(x for x in text.splitlines() if x.startswith("sglang:time_to_first_token_seconds_count"))
    s = parse_metrics(text.replace(line, line.rsplit(" ", 1)[0] + " 99.0"), DIALECT["sglang"]).sample
    assert s.first_tokens == 99 and s.prompt_requests == s.requests_done != 99

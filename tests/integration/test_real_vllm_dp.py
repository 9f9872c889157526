"""A real vLLM 0.32 replica of two data-parallel engines behind one port (~3.9 GB) behind warmroute, and one
started with --disable-log-stats."""

from __future__ import annotations

import json

import pytest

from extproc.brain.scraper import VLLM, parse_metrics
from extproc.tools import real_vllm
from extproc.tools.real_vllm import VllmOptions
from extproc.tools.stack import Stack, wait_for

from .test_real_vllm import CONFIG, MODEL, metrics_of, post, total

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data_parallel():
    """One replica of two data-parallel engines behind one port (~3.9 GB), and beside it a replica started with
    --disable-log-stats (no brain needs it: its /metrics is what is read)."""
    s = Stack(1, config=CONFIG, real_vllm=VllmOptions(data_parallel=2, lora=()))
    try:
        quiet_proc, quiet_port = real_vllm.start_vllm("nostats", s.dir, VllmOptions(log_stats=False, lora=()),
                                                       wait=False)
        s._started.append(quiet_proc)
        s.start()
        real_vllm.wait_ready(quiet_proc, quiet_port)
        s.wait_all_live(120)
        yield s, quiet_port
    finally:
        s.stop()


def test_the_engine_the_brain_names_is_the_one_whose_counters_move(data_parallel):
    s, _ = data_parallel
    port = s.replicas[0].port
    assert [e["rank"] for e in s.replica_state("r0")["engines"]] == [0, 1]
    named = []
    for k in range(8):
        before = metrics_of(port)
        status, headers, doc = post(s.url, "/v1/completions", {"model": MODEL, "prompt": f"dp {k} " * 50, "max_tokens": 2})
        assert status == 200, doc
        rid = headers.get("x-request-id") or headers.get("X-Request-Id")
        engine = json.loads(s.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]["engine"]
        done_before = total(before, "vllm:request_success_total")

        def moved_on() -> str | None:
            t = metrics_of(port)
            return t if total(t, "vllm:request_success_total") > done_before else None

        after = wait_for(moved_on, 10, "the counters")
        moved = [e for e in (0, 1) if total(after, "vllm:request_success_total", engine=str(e))
                 > total(before, "vllm:request_success_total", engine=str(e))]
        assert moved == [engine], (k, engine, moved)
        named.append(engine)
    assert set(named) == {0, 1}  # both engines were chosen: the header steered, not a default


def test_a_vllm_without_log_stats_gives_the_documented_scrape_reason(data_parallel):
    _, port = data_parallel
    r = parse_metrics(metrics_of(port), VLLM)
    assert not r.ok and r.missing
    assert "--disable-log-stats" in r.error and "engine: none (or auto)" in r.error


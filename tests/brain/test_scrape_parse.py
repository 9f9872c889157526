"""What the scraper believes of a replica's /metrics: only finite, sane numbers; everything else is a
failed scrape that says why (a replica reporting nonsense is neither believed nor routed to)."""

from __future__ import annotations

import pytest

from extproc.brain.scraper import parse_vllm_metrics

from ..helpers import serving

BASE = """# HELP vllm:num_requests_running Requests in model execution batches
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 120000.0
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 80000.0
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} 8.0
vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} 20.0
vllm:generation_tokens_total{{engine="0",model_name="m"}} 5000.0
vllm:request_decode_time_seconds_sum{{engine="0",model_name="m"}} 100.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} 20.0
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",num_gpu_blocks="18750"}} 1.0
"""


def text(running="2", waiting="1", kv="0.25"):
    return BASE.format(running=running, waiting=waiting, kv=kv)


def test_the_load_signals_and_counters_a_router_learns_from():
    r = parse_vllm_metrics(text())
    assert r.ok and (r.running, r.waiting, r.kv_usage) == (2, 1, 0.25)
    s = r.sample
    assert (s.prompt_tokens, s.cached_tokens, s.prefill_seconds) == (120000, 80000, 8.0)
    assert (s.generation_tokens, s.decode_seconds, s.requests_done) == (5000, 100.0, 20)
    assert s.cache_tokens == 18750 * 16


def test_two_engines_add_up_and_kv_usage_is_the_fuller_one():
    two = text() + text(running="3", waiting="0", kv="0.5").replace('engine="0"', 'engine="1"')
    r = parse_vllm_metrics(two)
    assert (r.running, r.waiting, r.kv_usage) == (5, 1, 0.5)
    assert r.sample.prompt_tokens == 240000


@pytest.mark.parametrize("field,value,reason", [
    ("running", "NaN", "not a finite number"),
    ("waiting", "+Inf", "not a finite number"),
    ("kv", "-0.5", "not a finite number >= 0"),
    ("running", "-3", "not a finite number >= 0"),
    ("running", "1e12", "beyond 100,000"),
    ("kv", "3.5", "beyond 1"),
    ("waiting", "many", "unparsable value"),
])
def test_a_value_out_of_its_sane_range_fails_the_scrape_with_the_reason(field, value, reason):
    r = parse_vllm_metrics(text(**{field: value}))
    assert not r.ok and reason in r.error


def test_no_running_gauge_is_a_failed_scrape():
    r = parse_vllm_metrics("# only comments\nsome_other_metric 1\n")
    assert not r.ok and "no vllm:num_requests_running" in r.error


def test_a_replica_without_the_counters_still_gives_load():
    r = parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting 0\n')
    assert r.ok and r.running == 1 and r.sample.prompt_tokens is None and r.sample.cache_tokens is None


SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
sglang:num_running_reqs{model_name="m",dp="0"} 3.0
sglang:num_queue_reqs{model_name="m",dp="0"} 2.0
sglang:token_usage{model_name="m"} 0.42
sglang:max_total_num_tokens{model_name="m"} 161721.0
sglang:prompt_tokens_total{model_name="m"} 1000.0
sglang:cached_tokens_total{model_name="m"} 600.0
sglang:generation_tokens_total{model_name="m"} 50.0
sglang:cache_hit_rate{model_name="m"} 0.6
vllm:num_requests_running{model_name="m"} 99.0
"""


def test_an_sglang_replica_is_read_under_sglang_names():
    from extproc.brain.scraper import SGLANG, parse_metrics

    r = parse_metrics(SGLANG_TEXT, SGLANG)
    assert r.ok and (r.running, r.waiting, r.kv_usage) == (3, 2, 0.42)
    assert r.sample.cache_tokens == 161721 and r.sample.prompt_tokens == 1000 and r.sample.cached_tokens == 600
    # the same text read as vLLM sees only the vLLM series (a misconfigured engine is visible, not mixed)
    assert parse_vllm_metrics(SGLANG_TEXT).running == 99
    bad = parse_metrics("sglang:num_running_reqs 1\nsglang:token_usage NaN\n", SGLANG)
    assert not bad.ok and "sglang:token_usage" in bad.error


def test_a_vllm_without_engine_metrics_and_an_sglang_without_enable_metrics_are_named_as_such():
    from extproc.brain.scraper import SGLANG, parse_metrics

    process_only = "# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 12.5\n"
    r = parse_vllm_metrics(process_only)
    assert not r.ok and r.missing and "--disable-log-stats" in r.error and "engine: none" in r.error
    r = parse_metrics(process_only, SGLANG)
    assert not r.ok and r.missing and "--enable-metrics" in r.error


def test_cache_config_info_tells_whether_prefix_caching_is_on():
    base = 'vllm:num_requests_running{model_name="m"} 0\n'
    for flag, want in (("True", True), ("False", False)):
        info = f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="{flag}",num_gpu_blocks="10"}} 1.0\n'
        assert parse_vllm_metrics(base + info).sample.prefix_caching is want
    assert parse_vllm_metrics(base).sample.prefix_caching is None  # not exported: nothing is assumed


def test_the_cache_size_is_vllms_own_kv_cache_size_tokens_where_it_says_it():
    base = 'vllm:num_requests_running{model_name="m"} 0\n'
    # a hybrid model: 320 blocks of 8 are not its capacity, the label is (as a newer vLLM exports it)
    hybrid = ('vllm:cache_config_info{block_size="8",enable_prefix_caching="True",kv_cache_size_tokens="463459",'
              'num_gpu_blocks="320"} 1.0\n')
    assert parse_vllm_metrics(base + hybrid).sample.cache_tokens == 463459
    older = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="1000"} 1.0\n'
    assert parse_vllm_metrics(base + older).sample.cache_tokens == 16000


def test_computed_prompt_tokens_come_from_their_own_source_where_vllm_says_it():
    base = ('vllm:num_requests_running{model_name="m"} 0\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0\n')
    by_source = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 300.0\n'
                 'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 200.0\n'
                 'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 500.0\n')
    s = parse_vllm_metrics(base + by_source).sample
    assert s.computed_tokens == 300.0 and s.prompt_tokens == 1000.0  # not 800: 500 came from a KV connector
    assert parse_vllm_metrics(base).sample.computed_tokens is None  # an older vLLM: the rate falls back


def test_sglangs_tensor_parallel_copies_count_once_and_data_parallel_ranks_add_up():
    from extproc.brain.scraper import SGLANG, parse_metrics

    lines = []
    for dp in ("0", "1"):  # two schedulers (data parallel), each exported by its 4 tensor-parallel ranks
        for tp in ("0", "1", "2", "3"):
            lab = f'dp_rank="{dp}",engine_type="unified",model_name="m",tp_rank="{tp}"'
            lines += [f"sglang:num_running_reqs{{{lab}}} 3.0", f"sglang:num_queue_reqs{{{lab}}} 1.0",
                      f"sglang:prompt_tokens_total{{{lab}}} 100.0"]
    s = parse_metrics("\n".join(lines) + "\n", SGLANG).sample
    assert (s.running, s.waiting, s.prompt_tokens) == (6, 2, 200.0)  # not 24, 8, 800


def test_engine_auto_reads_metrics_once_whatever_engine_answers():
    """One GET of /metrics per scrape, parsed as each engine in turn; /health only when /metrics has neither."""
    import asyncio

    from aiohttp import ClientSession, web

    from extproc.brain.scraper import Scraper

    async def scenario(metrics: str | None) -> tuple[str, list[str]]:
        seen: list[str] = []

        async def handle(request):
            seen.append(request.path)
            if request.path == "/metrics" and metrics is not None:
                return web.Response(text=metrics)
            if request.path == "/health":
                return web.Response(text="")
            raise web.HTTPNotFound()

        async with serving(handle) as url, ClientSession() as session:
            r = await Scraper(None, None, lambda: 0.0, 1.0)._fetch(session, url, 2.0, "auto")
        assert r.ok
        return r.engine, seen

    sglang = 'sglang:num_running_reqs{model_name="m"} 1.0\n'
    assert asyncio.run(scenario(sglang)) == ("sglang", ["/metrics"])
    assert asyncio.run(scenario("process_cpu_seconds_total 1.0\n")) == ("none", ["/metrics", "/health"])
    assert asyncio.run(scenario(None)) == ("none", ["/metrics", "/health"])


def _sglang(running: int, waiting: int, first: int, tokens: int, done: int) -> str:
    lab = 'engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"'
    return (f'sglang:num_running_reqs{{{lab}}} {running}\nsglang:num_queue_reqs{{{lab}}} {waiting}\n'
            f'sglang:token_usage{{{lab}}} 0.3\n'
            f'sglang:time_to_first_token_seconds_count{{model_name="m"}} {first}\n'
            f'sglang:inter_token_latency_seconds_count{{model_name="m"}} {tokens}\n'
            f'sglang:e2e_request_latency_seconds_count{{model_name="m"}} {done}\n')


def test_sglang_gauges_that_stood_still_with_no_work_counted_read_as_idle():
    """SGLang moves its gauges only at batches: an engine that went idle keeps showing its last one."""
    from extproc.brain.scraper import IDLE_AFTER_S, SGLANG, Scraper, parse_metrics

    sc = Scraper.__new__(Scraper)
    sc._still = {}
    busy = parse_metrics(_sglang(3, 1, 10, 500, 7), SGLANG)
    assert sc.unstale("r", busy, 0.0).running == 3
    moving = parse_metrics(_sglang(3, 1, 10, 540, 7), SGLANG)  # tokens still streaming: busy, however long
    assert sc.unstale("r", moving, IDLE_AFTER_S + 1).running == 3
    assert sc.unstale("r", moving, IDLE_AFTER_S + 3).running == 3  # still within the window since it last moved
    idle = sc.unstale("r", moving, 2 * IDLE_AFTER_S + 2)
    assert (idle.running, idle.waiting, idle.sample.running) == (0, 0, 0)
    vllm = parse_vllm_metrics(text(running="3"))  # vLLM's gauges move every step: never second-guessed
    assert sc.unstale("v", vllm, 0.0).running == 3 and sc.unstale("v", vllm, 100.0).running == 3


def test_a_replicas_kv_event_sources_are_read_bounded_and_anything_else_is_none():
    """GET /kv_event_sources: a mapping is the list; a 4xx, a non-mapping, unreadable JSON or JSON nested past the
    parser's stack is "none" (read: not asked again until the replica restarts); a 5xx is asked again; past
    health.max_metrics_bytes it is not read whole."""
    import asyncio
    import json

    from aiohttp import ClientSession, web

    from extproc.brain.scraper import Scraper

    async def scenario(status: int, text: str) -> tuple[bool, dict | None]:
        async def handle(request):
            return web.Response(status=status, text=text)

        async with serving(handle) as url, ClientSession() as session:
            return await Scraper(None, None, lambda: 0.0, 1.0, max_bytes=64 * 1024).fetch_kv_sources(
                session, "r0", url, 2.0)

    listed = {"0": {"endpoint": "tcp://*:5557"}}
    assert asyncio.run(scenario(200, json.dumps(listed))) == (True, listed)
    assert asyncio.run(scenario(404, "")) == (True, None)
    assert asyncio.run(scenario(503, "")) == (False, None)
    assert asyncio.run(scenario(200, "[1, 2]")) == (True, None)
    assert asyncio.run(scenario(200, "{not json")) == (True, None)
    assert asyncio.run(scenario(200, "[" * 10_000 + "]" * 10_000)) == (True, None)  # deeper than the stack
    assert asyncio.run(scenario(200, json.dumps({"0": "x" * 100_000}))) == (False, None)  # past max_bytes


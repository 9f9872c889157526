"""`make bench` runs the workload faster than real time: warmroute's time constants must shrink with it."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core.config import HealthConfig, PinConfig, WarmConfig
from bench.harness import scaled_warmroute_config


@pytest.mark.parametrize("section,cls", [("warm", WarmConfig), ("health", HealthConfig), ("pins", PinConfig)])
def test_every_time_constant_is_divided_by_the_speedup(section, cls):
    # a constant left at its real-time value sees 20x too few events in its window (e.g. a busy-fleet threshold
    # of 1 s reads as 20 s of workload time, so the fleet never looks busy)
    scaled = scaled_warmroute_config(20.0)[section]
    seconds = [f for f in dataclasses.fields(cls) if f.name.endswith("_s") and not f.name.endswith("_per_s")]
    assert seconds
    for f in seconds:
        assert scaled.get(f.name) == pytest.approx(f.default / 20.0), f.name


def test_the_access_log_flush_that_releases_reservations_shrinks_too():
    assert scaled_warmroute_config(5.0)["envoy"]["access_log_flush_s"] == pytest.approx(0.002)
    assert scaled_warmroute_config(20.0)["envoy"]["access_log_flush_s"] == pytest.approx(0.001)  # Envoy's floor: 1 ms


def test_flow_control_s_holds_shrink_too_and_only_warmroute_no_flow_turns_it_off():
    from bench.contenders import WARMROUTE
    from bench.runs.live import FLOW_CONTENDERS

    scaled = scaled_warmroute_config(5.0)["flow_control"]
    assert scaled == {"wait_s": pytest.approx(6.0), "sheddable_wait_s": pytest.approx(2.0)}
    assert WARMROUTE["warmroute_flow"]["flow_control"]["enabled"] is True
    # the default (on) everywhere else, "warmroute" as shipped; its scenarios' baseline is warmroute without it
    assert WARMROUTE["warmroute"] == {}
    off = [c for c in WARMROUTE if WARMROUTE[c].get("flow_control", {}).get("enabled") is False]
    assert off == ["warmroute_no_flow"] and "warmroute_no_flow" in FLOW_CONTENDERS


def test_the_ttft_only_variant_runs_on_the_plain_workload_alone():
    from bench.contenders import WARMROUTE
    from bench.runs.live import SCENARIOS, runs

    assert WARMROUTE["warmroute_ttft_only"] == {"warm": {"decode_weight": 0.0}}
    assert [s for s in SCENARIOS if runs("warmroute_ttft_only", s)] == ["workload"]
    assert runs("warmroute", "replica_dies_and_returns")  # the others keep their scenarios


def _replay_against(chat, cfg, **kw):
    """``replay`` of ``cfg`` at 10x against a fake chat endpoint ``chat`` on a port the OS picks."""
    import asyncio

    from extproc.tools.workload.http_replay import replay

    from ..helpers import serving

    async def main():
        async with serving(chat, "POST", "/v1/chat/completions") as url:
            return await replay(url, cfg, seed=2, speedup=10.0, timeout=30, **kw)

    return asyncio.run(main())


async def _answer(request):
    import json

    from aiohttp import web

    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    chunk = {"choices": [{"delta": {"content": "hi"}}], "system_fingerprint": "r0"}
    last = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
    await resp.write(f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
    return resp


def test_the_replay_sends_the_noisy_tenant_s_sessions_as_sessions_with_a_system_prompt_of_their_own():
    from extproc.tools.workload.generate import WorkloadConfig

    seen = []

    async def chat(request):
        doc = await request.json()
        seen.append((request.headers.get("x-session-id"), request.headers.get("x-warmroute-tenant"),
                     doc["messages"][0]["content"][:40]))
        return await _answer(request)

    cfg = WorkloadConfig(minutes=1.0, sessions_per_min=6, oneshots_per_min=0, noisy_tenant_x=30)
    res = _replay_against(chat, cfg, extra_headers=lambda r: {"x-warmroute-tenant": r.tenant})
    noisy = [x for x in seen if x[1] == "noisy"]
    assert noisy and all(x[0] for x in noisy) and res.lost == 0 and not res.errors  # session turns, answered
    assert {x[2] for x in noisy}.isdisjoint({x[2] for x in seen if x[1] != "noisy"})  # its own project's prompt


def test_the_replay_sends_a_429_again_after_its_retry_after_and_counts_from_the_first_attempt():
    import time

    from aiohttp import web

    from extproc.tools.workload.generate import WorkloadConfig

    calls: list[tuple[float, dict]] = []

    async def chat(request):
        calls.append((time.monotonic(), dict(request.headers)))
        if len(calls) == 1:
            return web.json_response({"error": {"type": "rate_limit_error"}}, status=429, headers={"Retry-After": "1"})
        if len(calls) == 3:  # no Retry-After: a client cannot know when to come back, an error
            return web.json_response({"error": {}}, status=429)
        return await _answer(request)

    # three one-shots, nothing else, ~1 s apart at 10x: Retry-After 1 s of workload time is 0.1 s of it
    cfg = WorkloadConfig(minutes=0.5, sessions_per_min=0, oneshots_per_min=6)
    res = _replay_against(chat, cfg, extra_headers=lambda r: {"x-warmroute-tenant": r.tenant}, retry_429=True)
    assert res.refused == 1 and res.errors == {"429 without Retry-After": 1}
    first = next(r for r in res.requests if r.extra.get("refused"))
    assert first.error is None and first.ttft is not None
    assert first.ttft >= 0.1 - 0.02  # from its first attempt: the Retry-After wait is in it
    assert calls[1][0] - calls[0][0] >= 0.1 - 0.02 and calls[0][1]["x-warmroute-tenant"].startswith("p")

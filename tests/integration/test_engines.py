"""Replicas that are not vLLM: SGLang's metric names, and servers with no engine metrics at all (issue 11 #7)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from extproc.tools.stack.local import Stack, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration


def post(stack, session: str, text: str) -> str:
    return post_engine(stack, session, text)[0]


def r3_failed_scrapes(s) -> float:
    for line in urllib.request.urlopen(s.brain_metrics, timeout=5).read().decode().splitlines():
        if line.startswith('warmroute_scrapes_total{replica="r3",result="failed"}'):
            return float(line.split()[-1])
    return 0.0


def test_sglang_and_metricless_replicas_go_live_and_keep_sessions_sticky_while_a_misconfigured_one_says_why():
    # health scrapes slower than the load refresh, as in production (3 s / 0.5 s), so load-only rounds happen
    config = {**FAST, "health": {**FAST["health"], "scrape_interval_s": 0.6}, "warm": {"load_refresh_s": 0.1}}
    s = Stack(4, config=config, mock_args=["--speedup", "20"])
    s.replica_args = {"r1": ["--metrics", "sglang"], "r2": ["--metrics", "none"], "r3": ["--metrics", "none"]}
    s.engines = {"r1": "sglang", "r2": "none"}  # r3: a foreign server left at the default engine (vllm)
    with s:
        wait_for(lambda: [r["state"] for r in s.state()["replicas"]][:3] == ["LIVE"] * 3, 30, "r0-r2 LIVE")
        r3 = s.replica_state("r3")
        assert r3["state"] == "EJECTED" and r3["engine"] == "vllm"
        assert "HTTP 404 from /metrics" in r3["scrape_error"] and "engine" in r3["scrape_error"]
        # said once per change of reason, not at every scrape
        said = '"event":"scrape_failed","replica":"r3"'
        wait_for(lambda: said in s.brain.log_tail(200_000), 10, "the scrape failure logged")
        failed_before = r3_failed_scrapes(s)
        wait_for(lambda: r3_failed_scrapes(s) >= failed_before + 4, 20, "four more failed scrapes of r3")
        served = {}
        for sid in ("e1", "e2", "e3", "e4", "e5", "e6"):
            served[sid] = {post(s, sid, f"{sid} turn {k}") for k in range(3)}
        assert all(len(v) == 1 for v in served.values()), served  # sticky on every engine
        assert {"r3"}.isdisjoint(set().union(*served.values()))
        st = s.state()
        fallbacks = {k: v for k, v in st["decisions_by_reason"].items() if k.endswith("/fallback") and v}
        assert not fallbacks  # decided by cost, not the random fallback
        sg = s.replica_state("r1")
        assert sg["engine"] == "sglang" and sg["scrape_error"] is None
        log = s.brain.log_tail(200_000)
        assert log.count(said) == 1
        assert '"loop_error"' not in log  # an engine without load metrics is not fed to the load refresh


def test_engine_auto_finds_each_replicas_metrics_and_runs_one_without_them_as_none():
    """engine: auto on a vLLM, an SGLang and a server with no engine metrics: each is read by what it exports,
    the last one runs on /health alone; and a vLLM with no engine metrics left at engine: vllm says why."""
    config = {**FAST, "health": {**FAST["health"], "scrape_interval_s": 0.4}}
    s = Stack(4, config=config, mock_args=["--speedup", "20"])
    s.replica_args = {"r1": ["--metrics", "sglang"], "r2": ["--metrics", "none"], "r3": ["--metrics", "none"]}
    s.engines = {"r0": "auto", "r1": "auto", "r2": "auto"}
    with s:
        wait_for(lambda: [r["state"] for r in s.state()["replicas"]][:3] == ["LIVE"] * 3, 30, "r0-r2 LIVE")
        assert [s.replica_state(n)["engine"] for n in ("r0", "r1", "r2")] == ["auto (vllm)", "auto (sglang)",
                                                                              "auto (none)"]
        r3 = s.replica_state("r3")
        assert r3["state"] == "EJECTED" and "engine: sglang, none or auto" in r3["scrape_error"]
        assert post(s, "a1", "hello") in ("r0", "r1", "r2")
        log = s.brain.log_tail(200_000)
        assert log.count('"event":"engine_detected","replica":"r1","engine":"sglang"') == 1  # said once


def test_a_replica_without_prefix_caching_gets_no_predicted_hits():
    """vllm:cache_config_info says enable_prefix_caching="False": the brain stops predicting cache hits there, so a
    session's next turn is priced as a full prefill on it (and its home is not held for a cache it lacks)."""
    s = Stack(2, config=FAST, mock_args=["--speedup", "20"])
    s.replica_args = {"r1": ["--prefix-caching", "off"]}
    with s:
        s.wait_all_live(30)
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.replicas[1].port}/metrics", timeout=5).read().decode()
        assert 'enable_prefix_caching="False"' in text
        for i in range(8):
            post(s, f"s{i}", "a long shared system prompt " * 200 + f" turn {i}")
        blocks = {}
        for line in urllib.request.urlopen(s.brain_metrics, timeout=5).read().decode().splitlines():
            if line.startswith("warmroute_prefix_index_blocks{"):
                blocks[line.split('replica="')[1].split('"')[0]] = float(line.split()[-1])
        # the replica without prefix caching indexes nothing; the other one holds the prompt's blocks
        assert blocks["r1"] == 0 and blocks["r0"] > 0, blocks


def post_engine(stack, session: str, text: str) -> tuple[str, str]:
    """(replica, data-parallel engine) that served one turn."""
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": text}]}).encode()
    req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": session})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["system_fingerprint"], r.headers["x-mock-engine"]


def test_a_data_parallel_replica_s_engines_are_chosen_by_the_brain_and_a_session_keeps_its_engine():
    """Two replicas of two engines each, through Envoy: the brain names the engine (X-data-parallel-rank), each
    session stays on one (its cache is there), and the four engines all take sessions."""
    s = Stack(2, config=FAST, mock_args=["--speedup", "20", "--data-parallel", "2"])
    with s:
        wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"]), 30, "both LIVE")
        wait_for(lambda: all(len(r.get("engines") or []) == 2 for r in s.state()["replicas"]), 10,
                 "both replicas' two engines seen")
        served = {}
        prompt = "x" * 8000
        for k in range(3):
            for sid in [f"s{i}" for i in range(8)]:
                served.setdefault(sid, set()).add(post_engine(s, sid, f"{sid} {prompt} turn {k}"))
        assert all(len(v) == 1 for v in served.values()), served
        assert len(set().union(*served.values())) == 4  # every engine of both replicas took a session

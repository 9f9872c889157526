"""make bench-real's statistics: bootstrap intervals over a run's requests, warmroute against the best peer, and
runs that measured the machine kept out (no engine is started here)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.harness import metric_total
from bench.runs.real import Row, compare, machine_times, pin_replicas, served_by, sessions_cpu_s
from extproc.tools.stack.procs import wait_for


def _row(contender: str, scale: float, n: int = 300, seed: int = 1, hit: float = 0.8, pace: str = "") -> Row:
    # a str seeds the same numbers in every process (hash() of a str does not: PYTHONHASHSEED differs per
    # pytest-xdist worker, and one draw in a few made the 1.2x claim's interval cross 1)
    rng = random.Random(f"{contender}:{seed}")
    ttfts = [scale * rng.lognormvariate(-3.0, 0.5) for _ in range(n)]
    hits = [(int(1000 * hit) if rng.random() < 0.9 else 0, 1000) for _ in range(n)]
    return Row(contender, seed, ttfts=ttfts, hits=hits, pace=pace)


def test_each_statistic_has_an_interval_around_it_and_warmroute_a_ratio_to_the_best_peer():
    rows = [_row("warmroute", 1.0), _row("envoy_least_request", 1.5), _row("sglang_router_cache_aware", 1.2, hit=0.9)]
    out = compare(rows, 1)
    for c in ("warmroute", "envoy_least_request", "sglang_router_cache_aware"):
        for k in ("p50", "p99", "hit"):
            value, lo, hi = out[c][k]
            assert lo <= value <= hi and lo < hi
    ratio, lo, hi, best = out["warmroute"]["vs_p50"]
    assert best == "sglang_router_cache_aware"  # the faster peer, not the first
    assert ratio == pytest.approx(out["warmroute"]["p50"][0] / out[best]["p50"][0])
    assert lo < ratio < hi and hi < 1.0  # 1.2x faster on 300 requests: the interval says so
    diff, lo, hi, best = out["warmroute"]["vs_hit"]
    assert best == "sglang_router_cache_aware" and lo < diff < hi < 0.0  # ~9 points fewer hits, and said so
    assert "vs_p50" not in out["envoy_least_request"]


def test_a_run_that_measured_the_machine_is_kept_out_and_seeds_pool():
    rows = [_row("warmroute", 1.0), _row("envoy_least_request", 0.5, pace="the client lagged"),
            _row("envoy_ring_hash_bounded_150", 1.1), _row("warmroute", 1.0, seed=2),
            _row("envoy_ring_hash_bounded_150", 1.1, seed=2)]
    out = compare(rows, 1)
    assert "envoy_least_request" not in out
    assert out["warmroute"]["vs_p50"][3] == "envoy_ring_hash_bounded_150"
    pooled = compare(rows, None)
    # pooled: every seed's requests of a router together (the refused run still out)
    both = sorted(rows[0].ttfts + rows[3].ttfts)
    assert pooled["warmroute"]["p50"][0] == both[round(0.5 * (len(both) - 1))]
    assert "envoy_least_request" not in pooled


def test_a_metric_s_total_is_every_series_of_that_name_and_no_other():
    text = ('# HELP x\nwarmroute_flow_wait_seconds_total{class="standard"} 1.5\n'
            'warmroute_flow_wait_seconds_total{class="sheddable"} 2.0\n'
            'warmroute_flow_wait_seconds_created{class="standard"} 99.0\n'
            'vllm:time_to_first_token_seconds_sum 3.0\nvllm:time_to_first_token_seconds_sum_other 7.0\n')
    assert metric_total(text, "warmroute_flow_wait_seconds_total") == 3.5
    assert metric_total(text, "vllm:time_to_first_token_seconds_sum") == 3.0
    assert metric_total(text, "absent") == 0.0
    # one label's series (bench-real's share of decisions at the headers read 0% while it named the label in the name)
    assert metric_total(text, "warmroute_flow_wait_seconds_total", **{"class": "sheddable"}) == 2.0
    assert metric_total(text, "warmroute_flow_wait_seconds_total", **{"class": "critical"}) == 0.0


def test_the_prediction_error_is_read_from_the_brain_s_joined_decisions():
    from bench.runs.real import joined_predictions, prediction_error, table

    decisions = [{"predicted_ttft_s": 0.2, "observed_ttft_s": 0.1}, {"predicted_ttft_s": 0.1, "observed_ttft_s": 0.1},
                 {"predicted_ttft_s": 0.3, "observed_ttft_s": None},  # not ended yet, or not streamed: not joined
                 {"predicted_ttft_s": None, "observed_ttft_s": 0.1}]  # decided by no prediction (seed policy)
    pairs = joined_predictions(decisions)
    assert pairs == [(0.2, 0.1), (0.1, 0.1)]
    mape, bias = prediction_error(pairs)
    assert mape == pytest.approx(0.5) and bias == pytest.approx(0.5)
    row = _row("warmroute", 1.0)
    row.predictions = pairs
    assert "| 1 | warmroute | 2 | 0.50 | +50% |" in table([row])


def test_learned_rates_are_also_read_at_the_run_s_mean_batch_the_engine_s_means_were_measured_over():
    """On CPU engines the decode line's rate beside no request (12.9 ms) was printed beside the engine's mean over
    batches of ~8 (123 ms) as if 10x off; the line read at the run's mean batch is what the engine's mean is."""
    from bench.runs.real import learned_rates, table

    mine = {"prefill_tokens_per_second": 1500.0, "decode_seconds_per_token": 0.0129,
            "prefill_slowdown_per_running_request": 0.1, "decode_slowdown_per_running_request": 1.0}
    # 60 s of run: 30 s of prefill and 450 s of decode summed over its requests: 8 running at once on average
    d = {"prefill_tokens": 36_000.0, "prefill_seconds": 30.0, "decode_tokens": 3_700.0, "decode_seconds": 450.0}
    lp, tp, ld, td, batch, bp, bd = learned_rates(mine, d, 60.0)
    assert (lp, ld) == (1500.0, 0.0129) and tp == pytest.approx(1200.0) and td == pytest.approx(450 / 3700)
    assert batch == pytest.approx(8.0)
    assert bp == pytest.approx(1500 / 1.8) and bd == pytest.approx(0.0129 * 9)
    row = Row("warmroute", 1)
    row.rates = [(lp, tp, ld, td, batch, bp, bd)]
    assert "decode 116.1 / 121.6 at batch 8.0 (none: 1500, 12.9)" in table([row])


def test_a_pooled_ratio_compares_only_the_seeds_both_routers_ran():
    # seed 2 was a slow spell for everyone, and ring hash's run of it was refused for the client's pace: pooling
    # warmroute's three seeds against ring hash's two would charge warmroute the slow spell
    rows = [_row("warmroute", 1.0), _row("envoy_ring_hash_bounded_150", 1.0),
            _row("warmroute", 3.0, seed=2), _row("envoy_ring_hash_bounded_150", 3.0, seed=2, pace="the client lagged"),
            _row("warmroute", 1.0, seed=3), _row("envoy_ring_hash_bounded_150", 1.0, seed=3)]
    ratio, lo, hi, best = compare(rows, None)["warmroute"]["vs_p50"]
    assert best == "envoy_ring_hash_bounded_150"
    assert ratio == pytest.approx(1.0, rel=0.05) and lo < 1.0 < hi


def test_the_queue_floor_knows_who_is_ahead_and_only_that():
    """A replica computing 1,000 prompt tokens a second, first come first served: each request's first token after
    the uncached tokens of those still ahead of it and its own. The floor finds that (MAPE near 0) where a model that
    ignores the queue does not; and noise it cannot know of is left in it."""
    from bench.runs.real import queue_floor

    rng = random.Random(7)
    joined, free_at, at = [], 0.0, 0.0
    for _ in range(200):
        at += rng.expovariate(1.5)
        prompt, cached = rng.randint(800, 3000), rng.choice((0, 512, 768))
        free_at = max(free_at, at) + (prompt - cached) / 1000
        joined.append({"replica": "r0", "at": at, "observed_ttft_s": free_at - at, "predicted_prompt_tokens": prompt,
                       "predicted_cached_tokens": cached, "predicted_ttft_s": (prompt - cached) / 1000})
    mape, bias, mape5, bias5 = queue_floor(joined)
    # (not 0: the one in progress counts whole, and R is searched 7.5% apart)
    assert mape < 0.08 and abs(bias) < 0.05 and mape5 < 0.08
    own_only = sum(abs(d["predicted_ttft_s"] - d["observed_ttft_s"]) / d["observed_ttft_s"] for d in joined) / 200
    assert own_only > 0.2  # the queue was there to know of
    noisy = [{**d, "observed_ttft_s": d["observed_ttft_s"] * rng.choice((0.5, 2.0))} for d in joined]
    assert queue_floor(noisy)[0] > 0.2
    assert queue_floor([]) is None


def test_an_out_directory_that_cannot_be_made_is_one_line_before_any_engine_starts(tmp_path, capsys):
    """Ten minutes of runs used to end in a traceback when ``--out`` did not exist; now it is made first, and a path
    that cannot be one ends the command at once with one line naming it."""
    from bench.runs.real import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "runs"), "--seeds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(blocker / "runs") in err[0]


def test_a_process_tree_s_cpu_counts_the_children_it_started_and_no_other_session():
    """The router's cores over a run: warmroute's tokenizer worker is the brain's child, vLLM's engine core the API
    server's; a process of another session (the bench itself) is not theirs."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    parent = ("import subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {spin!r}])\n"  # the child spins, the parent waits on it
              "print('reaped', flush=True)\n"
              "sys.stdin.read()\n")  # then stays, until told, for its session to be read
    p = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        before, idle_before = machine_times(), _uptime_idle_s()
        assert p.stdout is not None and p.stdout.readline() == b"reaped\n"
        # the child is gone: its seconds are in the parent's (cutime), the parent's own are its import's
        assert sessions_cpu_s([p.pid]) >= 0.6
        assert sessions_cpu_s([p.pid + 10_000_000]) == 0  # no such session
        after, idle_after = machine_times(), _uptime_idle_s()
        tick = os.sysconf("SC_CLK_TCK")
        total, idle = after[0] - before[0], after[1] - before[1]
        # the machine was busy at least for the spin, and idle at least as long as the kernel's other count of idle
        # time says (/proc/uptime: idle alone, so iowait may only add to ours)
        assert total - idle >= 0.5 * tick
        assert idle >= (idle_after - idle_before - 0.1) * tick
        assert 0 <= after[2] - before[2] <= total
    finally:
        p.communicate(b"", timeout=30)


def _uptime_idle_s() -> float:
    return float(open("/proc/uptime").read().split()[1])  # noqa: SIM115 (one read of a proc file)


def test_pinned_replicas_have_every_thread_of_their_session_on_a_core_of_their_own():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: every process is on it, pinned or not")
    # a process with a second thread (as vLLM's API server has), in a session of its own as the stack starts replicas
    code = "import sys, threading\nthreading.Thread(target=sys.stdin.read).start()\nsys.stdin.read()\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: len(os.listdir(f"/proc/{p.pid}/task")) >= 2, 30, "the second thread")
        fake = SimpleNamespace(name="r0", proc=SimpleNamespace(popen=p))
        pin_replicas([fake])
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == {cores[0]}
        assert os.sched_getaffinity(0) == set(cores)  # the bench itself is not pinned
        with pytest.raises(SystemExit, match="a core a replica"):
            pin_replicas([fake] * (len(cores) + 1))
    finally:
        p.communicate(b"", timeout=30)


def test_which_replica_served_is_read_from_what_each_engine_logged_since_the_run_began(tmp_path):
    """vLLM's own line with --enable-log-requests (the id its answers carry); an id logged before the run (the replica
    served the same id in an earlier run) is not this run's."""
    from extproc.tools.stack.real_vllm import VllmOptions, available, vllm_argv

    def engine(name, before, during):
        log = tmp_path / f"{name}.log"
        log.write_bytes(before)
        size = log.stat().st_size
        with open(log, "ab") as f:
            f.write(during)
        return SimpleNamespace(name=name, proc=SimpleNamespace(log_path=log)), size

    line = b"(APIServer pid=7) INFO 12-07 23:59:01 [request_logger.py:65] Received request %s: params: " \
           b"SamplingParams(n=1, max_tokens=64), lora_request: None.\n"
    a, a0 = engine("r0", line % b"chatcmpl-old", line % b"chatcmpl-1a2b" + b"INFO Avg prompt throughput\n")
    b, b0 = engine("r1", b"", line % b"chatcmpl-3c4d" + line % b"chatcmpl-5e6f_0")
    assert served_by([a, b], [a0, b0]) == {"chatcmpl-1a2b": "r0", "chatcmpl-3c4d": "r1", "chatcmpl-5e6f_0": "r1"}
    if available() is None:  # the engine is told to log each request's id and none of its prompt
        argv = vllm_argv(8000, VllmOptions(log_requests=True))
        assert argv[argv.index("--max-log-len") + 1] == "0" and "--enable-log-requests" in argv

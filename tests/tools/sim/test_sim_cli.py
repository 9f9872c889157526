"""`warmroute sim --compare` prints one table of every policy and writes the PNG."""

from __future__ import annotations

import subprocess
import sys

from extproc.tools.sim.policies import COMPARE, POLICIES


def test_sim_compare_prints_every_compared_policy_and_writes_a_png(tmp_path):
    png = tmp_path / "share.png"
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "sim", "--compare", "--minutes", "4", "--png", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split()[0] for line in p.stdout.splitlines() if line and line.split()[0] in POLICIES]
    assert rows == COMPARE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_with_a_flap_prints_the_transitions():
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "sim", "--minutes", "6", "--flap", "1:60:5:15:300",
                        "--transitions"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "r1: PROBING -> EJECTED" in p.stdout and "cooldown 60s" in p.stdout


def test_versus_peers_reuses_cached_peer_results_and_runs_only_the_rows_asked_for(tmp_path, monkeypatch, capsys):
    import argparse

    from extproc.tools.sim import cli
    from extproc.tools.sim.policies import PEERS

    ran = []
    real = cli._summary_at

    def counting(policy, args, seed, load):
        ran.append(policy)
        return real(policy, args, seed, load)

    monkeypatch.setattr(cli, "_summary_at", counting)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    argv = ["--versus-peers", "0.25", "--seed", "1", "--minutes", "4", "--mine", "warmroute",
            "--peers-cache", str(tmp_path / "peers.pkl")]
    cli.run(ap.parse_args(argv))
    first = capsys.readouterr().out
    assert sorted(ran) == sorted(["warmroute", *PEERS])
    ran.clear()
    cli.run(ap.parse_args(argv))
    assert ran == ["warmroute"]  # the peers came from the cache
    assert capsys.readouterr().out.splitlines()[-2:] == first.splitlines()[-2:]  # the same comparison
    assert first.splitlines()[-1].lstrip().startswith("floor")


def test_versus_peers_does_not_reuse_a_peers_cache_made_by_another_simulator(tmp_path, monkeypatch, capsys):
    import argparse
    import pickle

    from extproc.tools.sim import cli
    from extproc.tools.sim.policies import PEERS

    ran = []
    real = cli._summary_at
    monkeypatch.setattr(cli, "_summary_at", lambda policy, *a: ran.append(policy) or real(policy, *a))
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    cache = tmp_path / "peers.pkl"
    argv = ["--versus-peers", "0.25", "--seed", "1", "--minutes", "2", "--mine", "warmroute", "--peers-cache",
            str(cache)]
    cli.run(ap.parse_args(argv))
    doc = pickle.loads(cache.read_bytes())
    assert doc["fingerprint"] == cli.simulator_fingerprint() and len(doc["runs"]) == len(PEERS)
    for stale in ({"fingerprint": "another", "runs": doc["runs"]}, doc["runs"], b"not a pickle"):
        cache.write_bytes(stale if isinstance(stale, bytes) else pickle.dumps(stale))
        ran.clear()
        cli.run(ap.parse_args(argv))
        assert sorted(ran) == sorted(["warmroute", *PEERS])  # simulated again, not read from the stale file
        err = capsys.readouterr().err
        assert err.startswith(f"--peers-cache {cache}: ") and err.rstrip().endswith("again")  # one line, saying why


def test_several_seeds_print_each_policy_s_p99_as_a_geometric_mean_over_them(capsys):
    import argparse
    import math
    import re

    import pytest

    from extproc.tools.sim import cli

    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    args = ap.parse_args(["--seeds", "1,2", "--minutes", "3", "--policies", "warmroute,envoy_round_robin",
                          "--replica-speeds", "1,0.5"])
    cli.run(args)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("TTFT p99, geometric mean"))
    got = dict(re.findall(r"(\w+) ([\d.]+) s", line.split(": ", 1)[1]))
    for p in ("warmroute", "envoy_round_robin"):
        p99 = [cli.simulate(p, args, seed).summary()["ttft_p99"] for seed in (1, 2)]
        assert float(got[p]) == pytest.approx(math.sqrt(p99[0] * p99[1]), abs=0.006)


def test_seeds_take_ranges_and_lists_and_a_bad_one_is_one_clear_line():
    import argparse

    import pytest

    from extproc.tools.sim.cli import seed_list, seeds_text

    assert seed_list("1-5") == [1, 2, 3, 4, 5]
    assert seed_list("7,18") == [7, 18]
    assert seed_list("1-3,9") == [1, 2, 3, 9]
    assert seeds_text([1, 2, 3, 4]) == "1-4" and seeds_text([7, 18]) == "7,18"
    with pytest.raises(argparse.ArgumentTypeError, match="seeds: '1-x'"):
        seed_list("1-x")


def test_anatomy_counts_sessions_moved_between_replicas():
    from extproc.tools.sim.anatomy import moves

    def moved(policy):
        rows = moves(policy, load=1.0, seed=2, replicas=4, every_s=60.0, minutes=5)
        assert sum(r[1] for r in rows) > 50
        return sum(r[2] for r in rows), sum(r[3] for r in rows)

    assert moved("envoy_ring_hash") == (0, 0)  # a session's hash never changes while every replica is up
    n, carried = moved("envoy_round_robin")
    assert n > 20 and carried > 0


def test_anatomy_tail_sorts_the_slowest_turns_by_what_made_them():
    from extproc.tools.sim.anatomy import WARM_UP_S, tail_kinds
    from extproc.tools.workload.generate import Request

    t0 = WARM_UP_S + 1
    reqs = []

    def turn(sid, replica, ttft, prompt, cached, at, oneshot=False):
        r = Request(len(reqs), sid, 0, prompt, 100, 10, at, oneshot=oneshot)
        r.replica, r.ttft, r.cached_tokens = replica, ttft, cached
        reqs.append(r)

    for sid in range(1, 5):  # each session's first turn, quick
        turn(sid, 0, 0.1, 1000, 0, t0 + sid)
    turn(1, 1, 40.0, 50_000, 100, t0 + 10)  # moved: slowest
    turn(2, 0, 30.0, 50_000, 100, t0 + 11)  # same replica, its context gone: lost at home
    turn(3, 0, 20.0, 50_000, 49_000, t0 + 12)  # same replica, cached: it only waited
    turn(9, 2, 99.0, 50_000, 0, t0 + 13, oneshot=True)  # one-shots are not session turns
    turn(4, 0, 0.2, 2000, 1000, t0 + 14)
    got = tail_kinds(reqs, share=0.5)  # 8 session turns: the slowest 4
    assert [t for t, _ in got["moved"]] == [40.0] and got["moved"][0][1] == 49_900
    assert [t for t, _ in got["lost_at_home"]] == [30.0]
    assert sorted(t for t, _ in got["cached"]) == [0.2, 20.0]
    assert sum(len(v) for v in got.values()) == 4 and got["first"] == []


def test_anatomy_tail_says_per_replica_speed_how_much_of_the_work_and_of_the_tail_ran_there():
    from extproc.tools.sim.anatomy import WARM_UP_S, tail_by_speed
    from extproc.tools.workload.generate import Request

    t0 = WARM_UP_S + 1
    reqs = []

    def turn(sid, replica, ttft, prompt, cached, at):
        r = Request(len(reqs), sid, 0, prompt, 100, 10, at)
        r.replica, r.ttft, r.cached_tokens = replica, ttft, cached
        reqs.append(r)

    for k in range(6):  # the fast replica serves most turns, quickly
        turn(k, 0, 0.1, 1000, 900, t0 + k)
    turn(10, 1, 50.0, 120_000, 0, t0 + 10)  # the slow replica: a long first turn
    turn(10, 1, 0.2, 121_000, 120_000, t0 + 11)
    got = tail_by_speed(reqs, (1.0, 0.4), share=0.25)  # 8 turns: the slowest 2
    assert got[1.0]["turns"] == 6 and got[0.4]["turns"] == 2
    assert got[0.4]["tail"] == 2 and got[0.4]["kinds"]["first"] == 1 and got[0.4]["kinds"]["cached"] == 1
    assert got[1.0]["tail"] == 0
    again = tail_by_speed(reqs, (1.0, 0.4), share=0.25, into=got)  # a second seed's, added to the first's
    assert again is got and got[0.4]["tail"] == 4 and got[1.0]["turns"] == 12


def test_sim_and_anatomy_refuse_replica_speeds_that_are_not_positive_numbers_in_one_line():
    for cmd, bad in ((["extproc.tools.sim.anatomy", "--tail"], "1,x"), (["extproc.cli", "sim"], "1,0"),
                     (["extproc.cli", "sim"], "1,,2")):
        r = subprocess.run([sys.executable, "-m", *cmd, "--replica-speeds", bad], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and f"replica speeds: '{bad}' is not like 1,1,0.5,0.5" in r.stderr, (cmd, r.stderr)
        assert "Traceback" not in r.stderr


def test_unknown_policy_names_and_bench_live_speeds_are_refused_in_one_line():
    for cmd in (["extproc.cli", "sim", "--policies", "warmroute,nope"], ["extproc.tools.sim.anatomy", "--policies",
                                                                         "nope"],
                ["bench", "live", "--replica-speeds", "1,x"]):
        r = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert "no policy named 'nope'" in r.stderr or "replica speeds: '1,x'" in r.stderr, (cmd, r.stderr)


def test_sim_brains_prints_one_brain_each_k_and_delay_and_llmds_pickers_and_sharing_keeps_hits():
    import re

    p = subprocess.run([sys.executable, "-m", "extproc.cli", "sim", "--brains", "1,4", "--sync-delay-ms", "10,off",
                        "--replicas", "8", "--load", "2", "--minutes", "6"], capture_output=True, text=True,
                        timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split()[0] for line in p.stdout.splitlines() if line and re.match(r"^(warmroute|llmd_epp_2025)\S* ",
                                                                                   line)
            and "hits" not in line]
    assert rows[:5] == ["warmroute", "llmd_epp_2025", "warmroute:4:10", "warmroute:4:off", "llmd_epp_2025:4:off"]
    hits = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+hits\s+([-+]\d+\.\d)", p.stdout, re.M)}
    # four brains that share lose nothing of one brain's hits; alone, each knows a quarter of each session
    assert hits["warmroute:4:10"] > -3.0 and hits["warmroute:4:off"] < -10.0


def test_noisy_versus_prints_each_policy_s_ratio_of_the_others_tail_with_and_without_the_noisy_tenant(capsys):
    from extproc.tools.sim import cli

    import argparse

    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    # L=2: the noisy tenant's flood lands on a busy fleet, so the others feel it under some policy
    rc = cli.run(ap.parse_args(["--noisy-versus", "5", "--seeds", "2", "--minutes", "5", "--load", "2",
                                "--tenant-cap", "noisy:30000"]))
    assert rc == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: float(line.split()[2].rstrip("x")) for line in out.splitlines()
            if line.startswith("  ") and "median" in line}
    assert set(rows) >= {"warmroute", "warmroute_no_flow", "llmd_epp_2025", "llmd_token_aware", "llmd_epp_flowcontrol",
                         "warmroute_tenant_capped"}
    assert all(r > 0 for r in rows.values()) and max(rows.values()) > 1.0  # the flood is felt somewhere


def test_llm_d_s_older_default_keeps_running_under_its_former_name_and_both_defaults_are_peers():
    from extproc.tools.sim import cli
    from extproc.tools.sim.policies import COMPARE, PEERS, make_policy

    assert cli.policy_list("warmroute,llmd_epp") == "warmroute,llmd_epp_2025"
    import argparse

    import pytest

    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    assert ap.parse_args(["--policy", "llmd_epp"]).policy == "llmd_epp"  # read as llmd_epp_2025 by make_policy
    for bad in ("", "noisy:", "x:-5", "3e4", "noisy:²"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.tenant_cap(bad)
    assert cli.tenant_cap("noisy:30000") == "noisy:30000" and cli.tenant_cap("40000") == "40000"
    assert make_policy("llmd_epp", 4, 1).name == "llmd_epp_2025"
    assert {"llmd_epp_2025", "llmd_token_aware"} <= set(PEERS) and {"llmd_epp_2025", "llmd_token_aware"} <= set(COMPARE)


def test_anatomy_lists_the_worst_predictions_with_their_parts_and_the_engine_s_state():
    from extproc.tools.sim.anatomy import worst_predictions
    from extproc.tools.sim.simulator import Simulation
    from extproc.tools.workload.generate import WorkloadConfig

    reqs = Simulation("warmroute", replicas=4, workload=WorkloadConfig(minutes=4).at_load(1.0), seed=3).run().requests
    rows = worst_predictions(reqs, 10)
    assert len(rows) == 10 and [x["error"] for x in rows] == sorted((x["error"] for x in rows), reverse=True)
    for x in rows:
        assert x["error"] == abs(x["predicted"] - x["observed"]) / x["observed"]
        assert x["predicted"] >= x["prefill"] + x["overhead"] - 1e-9 or x["wait"] == 0.0
        assert x["waiting"] is not None and 0.0 <= x["kv_usage"] <= 1.0
    # a peer predicts nothing: nothing to list
    ring = Simulation("envoy_ring_hash", replicas=4, workload=WorkloadConfig(minutes=3).at_load(1.0), seed=3).run()
    assert worst_predictions(ring.requests) == []


def test_a_request_with_no_first_token_when_the_run_ends_counts_as_waiting_until_then():
    """A router that holds and refuses its slowest requests again and again (flow control past capacity) would have
    its tail left out of the percentiles if only requests with a first token counted: 25 of a seed's requests on
    four replicas 1,1,0.5,0.5 at load 1.5, p99 130 s counted so against 177 s (docs/routing.md)."""
    from extproc.tools.sim.simulator import SimResult
    from extproc.tools.workload.generate import Request

    def req(i, arrival, ttft=None, error=None):
        return Request(rid=i, sid=i, project=0, prompt_tokens=1000, system_tokens=0, max_tokens=10, arrival=arrival,
                       oneshot=True, ttft=ttft, e2e=None if ttft is None else ttft + 1.0, error=error)

    served = [req(i, 200.0 + i, ttft=1.0) for i in range(97)]
    failed = [req(97, 300.0, error="replica_died")]  # an error is counted apart, not as waiting
    held = [req(98, 300.0), req(99, 400.0)]  # no first token by the run's end (minute 10)
    empty = [[0]] * 10
    s = SimResult("p", served + failed + held, minutes=10, n=1, share_per_minute=empty, routable_per_minute=empty,
                  prefix_queries=0, prefix_hits=0, preemptions=0, output_tokens=0).summary()
    assert s["unfinished"] == 2
    assert s["ttft_p99"] == 300.0  # 600 - 300: at least that long
    assert s["ttft_p50"] == 1.0

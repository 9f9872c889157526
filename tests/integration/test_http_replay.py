"""The simulator's workload replayed over HTTP against a live replica (the benchmark's driver)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.generate import WorkloadConfig
from extproc.tools.stack.local import Stack

pytestmark = pytest.mark.integration

W = WorkloadConfig(minutes=1.5, sessions_per_min=8, oneshots_per_min=8, projects=2, long_share=0.0,
                   system_tokens=(1500, 2500), turns_median=6, think_s_mean=2.0)


def turns(res):
    out = defaultdict(list)
    for r in res.requests:
        out[(r.sid, r.oneshot)].append(r.prompt_tokens)
    return out


def test_replay_drives_a_live_replica_with_the_same_stream_every_time():
    s = Stack(0)
    try:
        rep = s.start_replica("r0", extra=["--speedup", "30"])
        a = asyncio.run(replay(rep.url, W, seed=7, speedup=30))
        b = asyncio.run(replay(rep.url, W, seed=7, speedup=30))
    finally:
        s.stop()
    assert a.sent > 20 and a.lost == 0 and not a.errors
    assert a.served_by == {"r0": a.answered}
    assert all(r.ttft is not None and r.ttft <= r.e2e for r in a.requests)
    ta, tb = turns(a), turns(b)
    assert set(ta) == set(tb)  # the same sessions and one-shots
    for k in ta:  # each session's turns have the same prompts, however fast answers came back
        n = min(len(ta[k]), len(tb[k]))
        assert ta[k][:n] == tb[k][:n]

"""The demo's and ``warmroute top --once``'s closing table: columns apart at any width, and a low share explained."""

from __future__ import annotations

import pytest

from extproc.tools.stack.top import HEAD, SHORT, Row, Snapshot, text_table

from ...helpers import envoy_decide, envoy_let_go, live_router, prof, scrape_until


def _snap(shares=(0.33, 0.33, 0.33, 0.01), *, drained=(), candidate=None, selects=300, error=None):
    rows = []
    for i, share in enumerate(shares):
        rows.append(Row(f"r{i}", "LIVE", f"r{i}" in drained, 0.0, 12.0, 3.0, 1234.5, 10_000, 0, share, share,
                        error if i == 0 else None, "sglang", selects if candidate is None else candidate[i]))
    return Snapshot(rows, selects, selects, 0, 0, 0, {}, [], "warm", selects)


@pytest.mark.parametrize("width", [80, 160])
def test_every_column_stands_apart_and_no_line_is_wider_than_the_terminal(width):
    text = text_table(_snap(error="connect: connection refused " * 4), width)
    lines = text.splitlines()
    assert all(len(x) <= width for x in lines), max(lines, key=len)
    header = (SHORT if width == 80 else HEAD[:-1])
    # every header word and every row cell is its own whitespace-separated token
    assert lines[0].split() == " ".join(header).split()
    for row in lines[1:5]:
        assert len(row.split()) == len(header)
        assert row.split()[-1] == "sglang"
    assert any("last scrape error" in x for x in lines)


def test_a_replica_under_5_percent_gets_a_line_saying_it_was_passed_over():
    text = text_table(_snap(), 160)
    why = [x for x in text.splitlines() if x.startswith("r3 took")]
    assert len(why) == 1 and "could have taken all 300" in why[0]
    assert not any(x.startswith(("r0 took", "r1 took", "r2 took")) for x in text.splitlines())


def test_a_replica_out_of_the_pool_or_drained_is_said_so():
    text = text_table(_snap(candidate=(300, 300, 300, 120)), 160)
    assert "out of the pool (EJECTED or drained) for 180 of the 300 decisions" in text
    text = text_table(_snap(drained=("r3",)), 160)
    assert "r3 took 1% of the decisions: it is drained" in text


def test_the_router_counts_the_decisions_each_replica_could_have_taken():
    router, t = live_router(3)
    for i in range(5):
        router.select(prof(session=f"s{i}", tokens=100), t)
    router.drain("r1")
    # r2 fails its scrapes until EJECTED
    t = scrape_until(router, t + 3, lambda: router.replica("r2").state.value == "EJECTED", failing=frozenset({"r2"}))
    for i in range(4):
        router.select(prof(session=f"s{i}", tokens=100), t)
    assert router.selects == 9
    assert [router.candidate_decisions(r) for r in router.replicas] == [9, 5, 5]
    assert [d["candidate_decisions"] for d in router.snapshot()] == [9, 5, 5]
    router.drain("r1", False)
    router.select(prof(session="s9", tokens=100), t)
    assert [router.candidate_decisions(r) for r in router.replicas] == [10, 6, 5]


def test_flow_control_gets_a_line_with_each_class_held_and_its_mean_wait_and_none_while_off():
    from ...core.test_flow import _body, _flow_brain

    b, clock = _flow_brain()
    assert b.state()["flow_control"]["held"] == 0
    for i in range(3):
        envoy_decide(b, {"x-request-id": f"big{i}"}, _body(2_000_000, f"big{i}"))
    envoy_decide(b, {"x-request-id": "small"}, _body(3000, "small"))
    snap = _snap()
    snap.flow = b.state()["flow_control"]
    line = next(x for x in text_table(snap, 400).splitlines() if x.startswith("flow control:"))
    assert "held 1 (critical 0, standard 1, sheddable 0)" in line and "waited_too_long 0" in line
    clock.t += 2
    b.router.release(b.router.reservation(1), clock.t)
    envoy_let_go(b)
    snap.flow = b.state()["flow_control"]
    assert "standard 0 (mean wait 2.0s)" in text_table(snap, 400)
    assert "flow control" not in text_table(_snap(), 400)


def test_the_flow_line_shows_each_replica_s_active_contexts_against_its_cache():
    """What a held new session waits for, as /state counts it: the sessions placed fill their replicas' working
    sets, and the flow line says so per replica."""
    from extproc.tools.stack.top import _working_set

    from ...core.test_flow import _body, _flow_brain

    b, _ = _flow_brain()
    envoy_decide(b, {"x-request-id": "s1", "x-session-id": "one"}, _body(40_000, "first turn"))
    reps = b.state()["replicas"]
    sets = {r["name"]: _working_set(r["predicted"]) for r in reps}
    assert sum(a for a, _ in sets.values()) > 0 and all(c > 0 for _, c in sets.values())
    snap = _snap(shares=(0.5,) * len(reps))
    for row, r in zip(snap.rows, reps):
        row.name, row.working_set = r["name"], sets[r["name"]]
    snap.flow = b.state()["flow_control"]
    line = next(x for x in text_table(snap, 400).splitlines() if x.startswith("flow control:"))
    busy = next(n for n, (a, _) in sets.items() if a > 0)
    assert f"{busy} {sets[busy][0] / 1000:.1f}K/{sets[busy][1] / 1000:.1f}K" in line

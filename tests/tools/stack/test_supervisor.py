"""``warmroute up`` restarts its brain with a backoff (issue 19, part 7): the timing, on a fake clock."""

from __future__ import annotations

from extproc.tools.stack.local import Supervisor


class Fake:
    def __init__(self):
        self.t = 0.0
        self.up = True
        self.restarted_at: list[float] = []

    def restart(self):
        self.restarted_at.append(self.t)
        self.up = True


def run(f: Fake, s: Supervisor, until: float, die_after: float | None = None) -> list[str]:
    said = []
    alive_since = f.t
    while f.t < until:
        if f.up and die_after is not None and f.t - alive_since >= die_after:
            f.up = False
        before = len(f.restarted_at)
        msg = s.check()
        if msg:
            said.append(msg)
        if len(f.restarted_at) > before:
            alive_since = f.t
        f.t += 0.25
    return said


def test_a_brain_that_keeps_dying_is_restarted_with_a_doubling_backoff_up_to_the_ceiling():
    f = Fake()
    s = Supervisor("brain", lambda: f.up, lambda: -9, f.restart, clock=lambda: f.t, max_backoff_s=8.0)
    said = run(f, s, 60.0, die_after=0.0)  # dies as soon as it starts
    gaps = [b - a for a, b in zip(f.restarted_at, f.restarted_at[1:])]
    assert [round(g) for g in gaps[:4]] == [2, 4, 8, 8]  # 1 s before the first restart, then 2, 4, 8, 8
    assert any("exited (code -9); restarting in 1s" in m for m in said)
    assert sum("restarted" in m for m in said) == len(f.restarted_at)


def test_the_backoff_resets_once_the_brain_has_run_stably():
    f = Fake()
    s = Supervisor("brain", lambda: f.up, lambda: 1, f.restart, clock=lambda: f.t, stable_s=10.0)
    f.up = False
    run(f, s, 3.0)
    assert f.restarted_at == [1.0] and s.restarts == 1
    run(f, s, 20.0)  # stays up past stable_s
    assert s.restarts == 0
    f.up = False
    said = run(f, s, 22.0)
    assert "restarting in 1s" in said[0]

"""SPEC B's upstream-failure rule as a pure function: the brain and the simulator both call it."""

from __future__ import annotations

import pytest

from extproc.core import UpstreamOutcome, upstream_failed, upstream_verdicts


@pytest.mark.parametrize("outcome,failed", [
    (UpstreamOutcome(code=200, via_upstream=True), False),
    (UpstreamOutcome(code=404, via_upstream=True), False),
    (UpstreamOutcome(code=503, via_upstream=True), True),  # unavailable, from the replica
    (UpstreamOutcome(code=502, via_upstream=True), True),
    (UpstreamOutcome(code=504, via_upstream=True), True),
    # a 500 can be one request's content (a body nested 100,000 deep): no lever to eject a healthy replica
    (UpstreamOutcome(code=500, via_upstream=True), False),
    (UpstreamOutcome(code=413, via_upstream=True), False),
    (UpstreamOutcome(code=504, timeout=True), True),  # Envoy gave up on the replica
    (UpstreamOutcome(code=503, via_upstream=False), False),  # Envoy's own 503 says nothing of a replica
    (UpstreamOutcome(code=503, connect_failure=True), True),  # connect failure
    (UpstreamOutcome(code=200, via_upstream=True, remote_reset=True), True),  # reset
    (UpstreamOutcome(connection_termination=True), True),
])
def test_B_what_counts_as_an_upstream_failure_a_500_or_4xx_does_not(outcome, failed):
    assert upstream_failed(outcome) is failed


@pytest.mark.parametrize("chosen,served_by,attempts,failed,verdicts", [
    ("r0", "r0", 1, False, [("r0", True)]),
    ("r0", "r0", 1, True, [("r0", False)]),
    # Envoy retried on r1 after r0 refused: r0 failed, r1 counts by the outcome
    ("r0", "r1", 2, False, [("r0", False), ("r1", True)]),
    # the connection never came up: only the chosen replica's failure is known
    ("r0", None, 1, True, [("r0", False)]),
    ("r0", None, 1, False, []),
    # fail-open traffic: the brain chose nothing, the replica that served counts
    (None, "r2", 1, True, [("r2", False)]),
    (None, None, 1, True, []),
])
def test_which_replica_an_outcome_counts_for(chosen, served_by, attempts, failed, verdicts):
    assert upstream_verdicts(chosen, served_by, attempts, failed) == verdicts

"""How a user request's end counts for passive health (SPEC B), as pure functions.

The brain reads these facts from Envoy's access-log entry; the simulator produces them from its
engines. Both then apply the same rule: 5xx from the replica, a connect failure, or a reset
counts as a failure of the replica that served (or refused) the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, TypeVar

Name = TypeVar("Name", bound=Hashable)


@dataclass(frozen=True, slots=True)
class UpstreamOutcome:
    """What Envoy saw of the upstream side of one request."""

    code: int = 0  # the response code the client got
    via_upstream: bool = False  # the code came from the replica (not from Envoy itself)
    connect_failure: bool = False
    remote_reset: bool = False  # the replica reset the stream
    connection_termination: bool = False  # the replica's connection ended under the request


def upstream_failed(o: UpstreamOutcome) -> bool:
    """B: 5xx from the replica, a connect failure, or a reset before (or during) the response."""
    return o.connect_failure or o.remote_reset or o.connection_termination or (o.via_upstream and o.code >= 500)


def upstream_verdicts(chosen: Name | None, served_by: Name | None, attempts: int, failed: bool) -> list[tuple[Name, bool]]:
    """Which replicas the outcome counts for, and whether as a success.

    ``chosen`` is the replica the router picked; ``served_by`` the one whose address Envoy
    finally talked to. When Envoy retried elsewhere, the chosen replica refused or reset and
    counts as failed; the one that served counts by the outcome. With no served-by address
    (the connection never came up) only a failure is known, and it is the chosen replica's.
    """
    out: list[tuple[Name, bool]] = []
    if chosen is not None and attempts > 1 and served_by != chosen:
        out.append((chosen, False))
    if served_by is not None:
        out.append((served_by, not failed))
    elif chosen is not None and failed:
        out.append((chosen, False))
    return out

"""How a user request's end counts for passive health (SPEC B), as pure functions.

The brain reads these facts from Envoy's access-log entry; the simulator produces them from its
engines. Both then apply the same rule: what is the replica's fault whatever the request was (a
connect failure, a reset or a dropped connection, 502/503/504 from it, a timeout) counts as a failure of
the replica that served (or refused) the request. A 500 or a 4xx can be caused by one request's
content (a body nested 100,000 deep made the mock answer 500): counting them would let any client
eject a healthy replica.
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
    timeout: bool = False  # Envoy gave up waiting for the replica (upstream request timeout)
    # a success whose body is not what the API promises (an HTML page: a proxy or portal in front of the engine)
    wrong_content: bool = False


REPLICA_FAULT_CODES = frozenset({502, 503, 504})  # bad gateway, unavailable, gateway timeout: not the request's doing


def upstream_failed(o: UpstreamOutcome) -> bool:
    """B: a connect failure, a reset before (or during) the response, a timeout, or 502/503/504 from the replica."""
    return (o.connect_failure or o.remote_reset or o.connection_termination or o.timeout or o.wrong_content
            or (o.via_upstream and o.code in REPLICA_FAULT_CODES))


def upstream_verdicts(chosen: Name | None, served_by: Name | None, attempts: int, failed: bool) -> list[tuple[Name,
                                                                                                              bool]]:
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

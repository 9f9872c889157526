"""Derived numbers for dashboards and the simulator (not used by the choice: A7)."""

from __future__ import annotations

from typing import Iterable, Mapping


def imbalance_index(decisions: Mapping[str, int], routable: Iterable[str]) -> float:
    """B: max(share_i) / mean(share_i) over the replicas that were routable.

    1 is perfect balance, N means everything went to one of N replicas.
    With no decisions in the window the index is 1 (nothing is imbalanced).
    """
    names = list(dict.fromkeys(routable))
    total = sum(decisions.get(n, 0) for n in names)
    if not names or total == 0:
        return 1.0
    return max(decisions.get(n, 0) for n in names) * len(names) / total

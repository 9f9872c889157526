"""The fleet as one request may see it (``FleetView``s beside the router's own): the pool cut to the replicas a
gateway allows, or the one replica that holds what a request reads."""

from __future__ import annotations

from collections.abc import Collection
from .decision import FleetView
from .replica import Replica


class Subset:
    """The fleet as one request may see it: the pool cut to the names a gateway allows."""

    __slots__ = ("_router", "_only")

    def __init__(self, router: FleetView, only: Collection[str]):
        self._router = router
        self._only = only

    @property
    def replicas_view(self) -> list[Replica]:
        return self._router.replicas_view  # round-robin positions stay the fleet's

    @property
    def pool_epoch(self) -> int | None:
        return self._router.pool_epoch

    @property
    def only(self) -> Collection[str]:
        """The names allowed (a model's replicas, usually the same set object from one request to the next)."""
        return self._only

    def pool(self) -> tuple[list[Replica], list[Replica]]:
        live, probing = self._router.pool()
        return [r for r in live if r.name in self._only], [r for r in probing if r.name in self._only]


class Pinned(Subset):
    """The fleet as a request that only one replica can serve sees it: that replica, whatever its state."""

    __slots__ = ("_replica",)

    def __init__(self, router: FleetView, replica: Replica):
        super().__init__(router, (replica.name,))
        self._replica = replica

    @property
    def replica(self) -> Replica:
        return self._replica

    @property
    def pool_epoch(self) -> None:
        return None  # one replica: nothing to shortlist

    def pool(self) -> tuple[list[Replica], list[Replica]]:
        return [self._replica], []

"""What one replica probably holds in its prefix cache: the block chains routed to it, LRU-bounded (C2).

An approximation built from our own decisions, as llm-d's approximate prefix scorer and Dynamo's
router without KV events do: a chain routed to the replica is assumed cached there until enough
other blocks have been routed there to evict it. The bound is the replica's cache size in blocks
(from ``vllm:cache_config_info`` when the replica exports it, else config).

Every block of a routed chain gets the batch's stamp (one C-level dict update); batches are kept
in routing order, and eviction drops the oldest batch's blocks that no later batch re-stamped.
"""

from __future__ import annotations

from collections import deque


class PrefixIndex:
    __slots__ = ("capacity", "_stamp_of", "_batches", "_queued", "_next")

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, int(capacity_blocks))
        self._stamp_of: dict[int, int] = {}
        self._batches: deque[tuple[int, list[int], int]] = deque()  # (stamp, chain, length used)
        self._queued = 0  # blocks referenced by the batches, re-stamped ones included
        self._next = 0

    def __len__(self) -> int:
        return len(self._stamp_of)

    def match(self, chain: list[int]) -> int:
        """How many blocks from the start of ``chain`` the replica probably holds.

        Chains are inserted whole, so what is present is a prefix: a binary search finds its end.
        """
        d = self._stamp_of
        if not chain or chain[0] not in d:
            return 0
        lo, hi = 1, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in d:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, chain: list[int], n: int | None = None) -> None:
        """The first ``n`` blocks of ``chain`` were just routed here (they are the most recently used)."""
        n = len(chain) if n is None else n
        if n <= 0:
            return
        stamp = self._next
        self._next += 1
        self._stamp_of.update(dict.fromkeys(chain[:n] if n < len(chain) else chain, stamp))
        self._batches.append((stamp, chain, n))
        self._queued += n
        self._evict()

    def _evict(self) -> None:
        d = self._stamp_of
        # The batch queue also holds blocks re-stamped by later batches; keep it within a few capacities.
        while self._batches and (len(d) > self.capacity or self._queued > 4 * self.capacity):
            stamp, chain, n = self._batches.popleft()
            self._queued -= n
            get = d.get
            for h in chain[:n]:
                if get(h) == stamp:
                    del d[h]

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = max(1, int(capacity_blocks))
        self._evict()

    def clear(self) -> None:
        """The replica restarted (or its cache was reset): it holds nothing."""
        self._stamp_of.clear()
        self._batches.clear()
        self._queued = 0

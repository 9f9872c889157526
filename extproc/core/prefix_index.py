"""What one replica probably holds in its prefix cache: the block chains routed to it, LRU-bounded (C2).

An approximation built from our own decisions, as llm-d's approximate prefix scorer and Dynamo's
router without KV events do: a chain routed to the replica is assumed cached there until enough
other blocks have been routed there to evict it. The bound is the replica's cache size in blocks
(from ``vllm:cache_config_info`` when the replica exports it, else config).

Each routed chain is one batch, kept in routing order; every block maps to the stamp of the batch
that used it last, and eviction drops the oldest batch's blocks that no later batch re-stamped. A
session's next turn usually arrives as the same chain list, extended (``ChainCache``): its batch
moves to the newest end and only its new blocks and its head (where a shared system prompt lives,
last used by whichever session came before) are stamped, so a turn of a 1 MB conversation costs
the blocks it adds, not the 16K it carries.
"""

from __future__ import annotations

from collections import OrderedDict

# blocks at the head of a re-routed chain that are stamped again: 32 KiB, a long shared system prompt
_HEAD_BLOCKS = 512


class PrefixIndex:
    __slots__ = ("capacity", "_stamp_of", "_batches", "_queued", "_next")

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, int(capacity_blocks))
        self._stamp_of: dict[int, int] = {}
        # id(chain) -> [stamp, chain, length used], oldest first. The batch holds the list, so its id
        # stays unique while the entry exists.
        self._batches: OrderedDict[int, list] = OrderedDict()
        self._queued = 0  # blocks referenced by the batches, re-stamped ones included
        self._next = 0

    def __len__(self) -> int:
        return len(self._stamp_of)

    def match(self, chain: list[int]) -> int:
        """How many blocks from the start of ``chain`` the replica probably holds.

        Chains are inserted from their start, so what is present is a prefix: a binary search finds its end.
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

    def holds(self, block: int) -> bool:
        return block in self._stamp_of

    def insert(self, chain: list[int], n: int | None = None) -> None:
        """The first ``n`` blocks of ``chain`` were just routed here (they are the most recently used)."""
        n = len(chain) if n is None else n
        if n <= 0:
            return
        d = self._stamp_of
        b = self._batches.get(id(chain))
        if b is not None and b[1] is chain and n >= b[2]:
            stamp, old = b[0], b[2]
            # the batch's own blocks keep its stamp; the head may have been stamped by others since
            d.update(dict.fromkeys(chain[:min(old, _HEAD_BLOCKS)], stamp))
            if n > old:
                d.update(dict.fromkeys(chain[old:n], stamp))
            self._queued += n - old
            b[2] = n
            self._batches.move_to_end(id(chain))
        else:
            if b is not None:  # the same list, shorter than before: a new batch replaces the old one
                self._drop(self._batches.pop(id(chain)))
            stamp = self._next
            self._next += 1
            d.update(dict.fromkeys(chain[:n] if n < len(chain) else chain, stamp))
            self._batches[id(chain)] = [stamp, chain, n]
            self._queued += n
        self._evict()

    def _drop(self, batch: list) -> None:
        stamp, chain, n = batch
        self._queued -= n
        d = self._stamp_of
        get = d.get
        for h in chain[:n]:
            if get(h) == stamp:
                del d[h]

    def _evict(self) -> None:
        # The batch queue also holds blocks re-stamped by later batches; keep it within a few capacities.
        while self._batches and (len(self._stamp_of) > self.capacity or self._queued > 4 * self.capacity):
            self._drop(self._batches.popitem(last=False)[1])

    def batches(self) -> list[list[int]]:
        """The blocks held, as the batches that last used them, oldest first (a snapshot for another brain:
        inserted in this order they make the same set, each batch's blocks a prefix-closed run)."""
        d = self._stamp_of
        out = []
        for stamp, chain, n in list(self._batches.values()):  # a copy: a snapshot may be taken off the loop
            own = [h for h in chain[:n] if d.get(h) == stamp]
            if own:
                out.append(own)
        return out

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = max(1, int(capacity_blocks))
        self._evict()

    def clear(self) -> None:
        """The replica restarted (or its cache was reset): it holds nothing."""
        self._stamp_of.clear()
        self._batches.clear()
        self._queued = 0

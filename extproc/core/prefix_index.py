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

``Holders`` answers the other question, who holds a chain, for a fleet of hundreds: one map from a
block to the indexes that hold it, kept for one block in eight (by the hash's low bits, so every index
and every request agree on which without knowing positions) and as a bit mask, one bit per index. A
request's sampled blocks, deepest first, name the replicas that hold most of its chain without
matching it on each replica (``levels``).
"""

from __future__ import annotations

from collections.abc import Sequence

from collections import OrderedDict
from typing import NamedTuple

# blocks at the head of a re-routed chain that are stamped again: 32 KiB, a long shared system prompt
_HEAD_BLOCKS = 512
# a block is sampled into Holders when these hash bits are 0: one in 8 (a turn adds tens of blocks)
_SAMPLE = 7
_MAX_ANCHORS = 1_000_000  # requests' sampled blocks remembered (~100 MB at most), the least recently used dropped


class Holders:
    """Sampled block -> bit mask of the prefix indexes holding it (see the module's note)."""

    __slots__ = ("of", "_free", "_next", "_anchors", "_anchored")

    def __init__(self) -> None:
        self.of: dict[int, int] = {}
        self._free: list[int] = []
        self._next = 0
        # id(a request's chain) -> (blocks scanned, the last of them, [(position, block)] sampled): a session's next
        # turn extends the same list, so only its new blocks are scanned. The chain itself is not kept (a megabyte
        # conversation is 17K ints): a block's hash covers everything before it, so a chain whose block at the same
        # position is the same has the same prefix, whichever list it is
        self._anchors: dict[int, tuple[int, int, list[tuple[int, int]]]] = {}
        self._anchored = 0  # sampled blocks those lists hold, bounded by _MAX_ANCHORS

    def bit(self) -> int:
        """A bit for a new index (reused once its index is gone)."""
        if self._free:
            return self._free.pop()
        b = 1 << self._next
        self._next += 1
        return b

    def free(self, bit: int) -> None:
        self._free.append(bit)

    def add(self, blocks, bit: int) -> None:
        of = self.of
        get = of.get
        for h in [h for h in blocks if not h & _SAMPLE]:
            of[h] = get(h, 0) | bit

    def remove(self, blocks, bit: int) -> None:
        of, keep = self.of, ~bit
        for h in [h for h in blocks if not h & _SAMPLE]:
            m = of.get(h, 0) & keep
            if m:
                of[h] = m
            else:
                of.pop(h, None)

    def track(self, index: "PrefixIndex") -> None:
        """Start keeping ``index``'s sampled blocks (a fleet that just grew big enough to need the map)."""
        if index.holders is None:
            index.holders, index.bit = self, self.bit()
            self.add(index._stamp_of, index.bit)

    def anchors(self, chain: Sequence[int]) -> list[tuple[int, int]]:
        """The chain's sampled blocks with their positions, shallowest first."""
        got = self._anchors.get(id(chain))
        if got is not None and 0 < got[0] <= len(chain) and chain[got[0] - 1] == got[1]:
            done, _, out = got
        else:
            done, out = 0, []
        if done < len(chain):
            out = out + [(i, h) for i, h in enumerate(chain[done:], done) if not h & _SAMPLE]
            old = self._anchors.pop(id(chain), None)
            self._anchored += len(out) - (len(old[2]) if old is not None else 0)
            self._anchors[id(chain)] = (len(chain), chain[-1], out)
            while self._anchored > _MAX_ANCHORS and len(self._anchors) > 1:  # the least recently extended first
                self._anchored -= len(self._anchors.pop(next(iter(self._anchors)))[2])
        return out

    def levels(self, chain: Sequence[int], most: int = 8) -> list[tuple[int, int]]:
        """Who holds the chain, deepest first: (bit mask, depth in blocks at least) per level, at most ``most``
        levels. An index's blocks of a chain are a prefix of it, so the masks only grow towards the chain's
        start: each next level is a binary search away."""
        a = self.anchors(chain)
        of = self.of
        out: list[tuple[int, int]] = []
        seen = 0
        hi = len(a)  # anchors [0, hi) may still name someone new
        while hi and len(out) < most and of.get(a[0][1], 0) & ~seen:
            # the deepest anchor below hi whose holders include someone not yet named
            lo, top = 0, hi
            while top - lo > 1:
                mid = (lo + top) // 2
                if of.get(a[mid][1], 0) & ~seen:
                    lo = mid
                else:
                    top = mid
            new = of.get(a[lo][1], 0) & ~seen
            seen |= new
            out.append((new, a[lo][0] + 1))
            hi = lo
        return out


class Mark(NamedTuple):
    """Where a session's last read chain went (``Pin.mark``): what a turn decided at its headers touches there."""
    key: int  # id() of the chain inserted (its batch's key); GONE's 0: no list has it
    last: int  # its last block
    blocks: int
    tokens: int  # its prompt in the engine's tokens


GONE = Mark(0, 0, 1, 0)  # the home let the chain go: held again only once a body is read and inserted


class PrefixIndex:
    __slots__ = ("capacity", "_stamp_of", "_batches", "_queued", "_next", "holders", "bit", "_unseen")

    def __init__(self, capacity_blocks: int, holders: Holders | None = None):
        self.capacity = max(1, int(capacity_blocks))
        self.holders = holders  # the fleet's map of who holds which sampled block, if it keeps one
        self.bit = holders.bit() if holders is not None else 0
        self._stamp_of: dict[int, int] = {}
        # id(chain) -> [stamp, chain, length used, blocks unseen], oldest first. The batch holds the list, so its id
        # stays unique while the entry exists.
        self._batches: OrderedDict[int, list] = OrderedDict()
        self._queued = 0  # blocks referenced by the batches, re-stamped ones included
        self._next = 0
        # blocks routed here whose hashes were never seen: turns decided at their headers (``touch``) grow a
        # session's context by what their bodies add. They fill the cache as much as seen blocks do
        self._unseen = 0

    def __len__(self) -> int:
        return len(self._stamp_of)

    def match(self, chain: Sequence[int]) -> int:
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

    def insert(self, chain: Sequence[int], n: int | None = None) -> None:
        """The first ``n`` blocks of ``chain`` were just routed here (they are the most recently used)."""
        n = len(chain) if n is None else n
        if n <= 0:
            return
        d = self._stamp_of
        b = self._batches.get(id(chain))
        hs = self.holders
        if b is not None and b[1] is chain and n >= b[2]:
            stamp, old = b[0], b[2]
            self._stamp_head(chain, old, stamp)
            if n > old:
                d.update(dict.fromkeys(chain[old:n], stamp))
                if hs is not None:
                    hs.add(chain[old:n], self.bit)
            self._queued += n - old
            b[2] = n
            self._batches.move_to_end(id(chain))
        else:
            if b is not None:  # the same list, shorter than before: a new batch replaces the old one
                self._drop(self._batches.pop(id(chain)))
            stamp = self._next
            self._next += 1
            d.update(dict.fromkeys(chain[:n] if n < len(chain) else chain, stamp))
            if hs is not None:
                hs.add(chain[:n] if n < len(chain) else chain, self.bit)
            self._batches[id(chain)] = [stamp, chain, n, 0]
            self._queued += n
        self._evict()

    def _stamp_head(self, chain: Sequence[int], n: int, stamp: int) -> None:
        """A batch's own blocks keep its stamp; its head may have been stamped by others since (or evicted: a request
        that carries it brings it back)."""
        d, head = self._stamp_of, chain[:min(n, _HEAD_BLOCKS)]
        held = len(d)
        d.update(dict.fromkeys(head, stamp))
        if self.holders is not None and len(d) > held:
            self.holders.add(head, self.bit)

    def touch(self, key: int, last: int, unseen: int) -> bool:
        """A turn decided at its headers went here on the chain inserted as ``key`` (``id`` of the list) whose last
        block was ``last``: the chain is the most recently used again (the engine's LRU keeps what a turn reads), and
        ``unseen`` blocks more than it hold what the turns since added, hashes unknown. False when the chain is no
        longer held here: the cache let it go, and the turn recomputes it."""
        b = self._batches.get(key)
        d = self._stamp_of
        if b is None or b[1][b[2] - 1] != last or last not in d:
            return False
        stamp, chain = b[0], b[1]
        if d[last] != stamp:
            # another request with the same prefix (a retry, a fork, a client without the session's header) stamped
            # these blocks since: this session's turn makes them its own again, the newest, as far as they are held
            for h in chain[:b[2]]:
                if h in d:
                    d[h] = stamp
        # the turn carries its head (a system prompt other sessions share) as a read one does: the newest there too
        # (left to whichever session stamped it last, it went with that one while the sessions using it stayed)
        self._stamp_head(chain, b[2], stamp)
        self._unseen += unseen - b[3]
        b[3] = unseen
        self._batches.move_to_end(key)
        self._evict()
        return key in self._batches

    def settle(self, key: int, last: int) -> None:
        """The chain inserted as ``key`` ending in ``last`` was read whole again (a newer batch holds its blocks): its
        unseen blocks are seen now, counted there. ``last`` as in ``touch``: an evicted chain's id may be another's."""
        b = self._batches.get(key)
        if b is not None and b[1][b[2] - 1] == last:
            self._unseen -= b[3]
            b[3] = 0

    def _drop(self, batch: list) -> None:
        stamp, chain, n, unseen = batch
        self._queued -= n
        self._unseen -= unseen
        d = self._stamp_of
        get = d.get
        hs = self.holders
        if hs is None:
            for h in chain[:n]:
                if get(h) == stamp:
                    del d[h]
            return
        gone = [h for h in chain[:n] if get(h) == stamp]
        for h in gone:
            del d[h]
        hs.remove(gone, self.bit)

    def _evict(self) -> None:
        # The batch queue also holds blocks re-stamped by later batches; keep it within a few capacities.
        while self._batches and (len(self._stamp_of) + self._unseen > self.capacity or
                                 self._queued > 4 * self.capacity):
            self._drop(self._batches.popitem(last=False)[1])

    def batches(self) -> list[list[int]]:
        """The blocks held, as the batches that last used them, oldest first (a snapshot for another brain:
        inserted in this order they make the same set, each batch's blocks a prefix-closed run)."""
        d = self._stamp_of
        out = []
        for stamp, chain, n, _ in list(self._batches.values()):  # a copy: a snapshot may be taken off the loop
            own = [h for h in chain[:n] if d.get(h) == stamp]
            if own:
                out.append(own)
        return out

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = max(1, int(capacity_blocks))
        self._evict()

    def clear(self) -> None:
        """The replica restarted (or its cache was reset): it holds nothing."""
        self._unhold()
        self._stamp_of.clear()
        self._batches.clear()
        self._queued = self._unseen = 0

    def _unhold(self) -> None:
        if self.holders is not None:
            self.holders.remove(self._stamp_of, self.bit)

    def close(self) -> None:
        """The index is dropped (its replica or engine forgotten): its bit goes back to the fleet's map."""
        if self.holders is not None:
            self._unhold()
            self.holders.free(self.bit)
            self.holders = None

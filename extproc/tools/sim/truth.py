"""What the engines' KV events say, in the simulator (issue 45): each engine model's resident blocks as exact mode
and llm-d's precise scorer have them. Events reach a router within milliseconds of the engine's step; the
simulator gives them at once. A dead engine publishes nothing: its view is lost, as the brain's is."""

from __future__ import annotations

from collections import deque

from extproc.core.blocks import BLOCK_TOKENS as BLOCK


def held_run(engine, blocks) -> int:
    """How many of ``blocks``, from the first, the engine holds (in use or cached): vLLM reuses a prefix only."""
    refs, cached = engine.refs, engine.cached
    n = 0
    for h in blocks:
        if h not in refs and h not in cached:
            break
        n += 1
    return n


class EngineTruth:
    """``WarmReplica.exact`` for replica ``i`` of a simulation: an engine whose events verified."""

    block_size = BLOCK

    def __init__(self, sim, i: int):
        self.sim, self.i = sim, i

    @property
    def exact(self) -> bool:
        return self.sim.alive[self.i]

    def holds(self, h: int) -> bool:
        e = self.sim.engines[self.i]
        return h in e.refs or h in e.cached

    def cached_tokens(self, hashes) -> int:
        return held_run(self.sim.engines[self.i], hashes) * BLOCK

    @property
    def tiers(self) -> dict:
        """The engine's offloaded tier as its events would list it (an offloading connector's CPU stores)."""
        cpu = self.sim.engines[self.i].cpu
        return {"CPU": cpu} if cpu else {}

    def restorable(self, hashes, start: int, medium: str) -> int:
        cpu = self.sim.engines[self.i].cpu if medium == "CPU" else None
        n = 0
        for h in hashes[start:] if cpu else ():
            if h not in cpu:
                break
            n += 1
        return n


class Speculative:
    """llm-d's speculative index entries (``speculativeIndexing``): the blocks of a request sent to a pod count as
    held there for ``ttl_s`` (its default, 2 s), until the engine's own events take over."""

    def __init__(self, ttl_s: float = 2.0):
        self.ttl_s = ttl_s
        self._due: deque[tuple[float, tuple]] = deque()
        self.held: dict[int, int] = {}

    def add(self, blocks, now: float) -> None:
        self._expire(now)
        blocks = tuple(blocks)
        self._due.append((now + self.ttl_s, blocks))
        for h in blocks:
            self.held[h] = self.held.get(h, 0) + 1

    def _expire(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            _, blocks = self._due.popleft()
            for h in blocks:
                n = self.held[h] - 1
                if n:
                    self.held[h] = n
                else:
                    del self.held[h]

    def run(self, engine, blocks, now: float, cpu_weight: float = 0.8) -> float:
        """The longest prefix of ``blocks`` the engine holds on any tier or this index says it will, each block
        weighted by the best tier that holds it (llm-d-router ``LongestPrefixScorer``: GPU 1.0, CPU 0.8 by
        default, ``DefaultKVCacheBackendConfig``)."""
        self._expire(now)
        refs, cached, spec, cpu = engine.refs, engine.cached, self.held, engine.cpu
        n = 0.0
        for h in blocks:
            if h in refs or h in cached or h in spec:
                n += 1.0
            elif h in cpu:
                n += cpu_weight
            else:
                break
        return n

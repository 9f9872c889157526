"""Shared state between brains: the core's state changes as values, emitted and applied.

Each brain decides alone on its local view, in one synchronous call, as with one brain; what a decision
changes is written out as an event, and another brain applies it to its own view (DESIGN "Shared state":
xDS's shape, every proxy decides on its snapshot, only changes travel). The events are plain tuples of
hashes, replica names and numbers (never prompt text or a raw session id), so the transport (Redis in the
shell, a delayed queue in the simulator, a shuffling list in the tests) ships them as they are:

- ``("h", kind, key, replica, engine, tokens, at)``: a pin of ``kind`` ("session"/"prefix") for the key
  hash now lives on ``replica`` (None: it was deleted). Last writer wins by ``at``: the newest use of a
  session is where its context is, whichever brain saw it.
- ``("o", rid, replica, engine, weight_milli, provisional, work_s, prefill_s, pending_tokens, session, prompt,
  at, estimated, prefix, cached)``: a reservation opened (in-flight work the receiver counts on the replica like its
  own); ``estimated``: the request's tokens as estimated from its text (None: provisional, or a brain older than
  it), so that every brain compares the engine's prompt tokens with all that was sent, not its own share
  (TokenScale); ``prefix``, ``cached``: the block hash that ends what it found cached there and its tokens (None, 0:
  none, or an older brain), so that every brain's working set counts a prefix sessions share once.
- ``("x", rid, digest)``: the end of a reservation reached this brain but not its owner (an Envoy's access log
  kept on a brain it failed over to, or one log stream for several processes behind one Envoy); the owner, whose
  id's digest it is, releases it. ``("a", rid, digest)``: the same for a periodic entry: the request is alive.
- ``("v", tenant, tokens)``: flow control served a tenant (its hash) so many tokens: every brain's fairness
  counters count it.
- ``("t", tenant, tokens)``: a request of a tenant (its hash) was placed, costing so many engine tokens: every brain's
  token cap for it counts them (``core.caps``).
- ``("c", rid)``: that reservation closed. Another brain's reservations also end when that brain stops
  being heard from (``forget_origin``) or after the safety timeout, so a lost close never holds load.
- ``("i", replica, engine, tag, start, parent, blocks)``: blocks ``start..`` of the origin's chain ``tag`` were
  indexed on the replica. A session's next turn sends only the blocks it added (the origin's ``ChainCache``
  extends one list; so does the receiver). A delta whose start the receiver lacks (a lost message, a brain
  that started since) is applied as its own batch when its ``parent`` block is indexed there (the blocks are
  chained hashes: the parent stands for the whole prefix), else dropped and counted: the prefix index is an
  estimate that the next turn or a snapshot repairs.

Times are in the origin's clock; the transport passes the offset to the receiver's (0 in the simulator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from collections import OrderedDict
from typing import TYPE_CHECKING

from .decision import Decision, Reservation
from .names import PinAction
from .pins import SESSION, PinTable

if TYPE_CHECKING:
    from .profile import RequestProfile

_MAX_WORK_S = 3600.0  # predicted seconds of one request's work (a 1M-token prefill on a slow engine: ~10 min)
_MAX_WEIGHT_MILLI = 10_000_000  # one request's load weight, in thousandths
_MAX_TOKENS = 10_000_000  # one request's prompt or pending tokens
_HEX = frozenset("0123456789abcdef")
_MAX_CHAINS = 200_000  # chains whose published length each side remembers (a turn of a known chain sends its delta)
# one chain's blocks at most: a 1M-token context at 16 tokens a block (a brain's own chains stop at chain_max_bytes,
# 16,384 blocks; an exact engine's at its context). 20 entries of longer ones added +557 MB to each brain
_MAX_CHAIN_BLOCKS = 65_536
_ORIGIN_MAX_BLOCKS = 2_000_000  # one origin's chains kept for their next delta (a brain's own ChainCache: the same)
_MAX_BLOCKS = 4_000_000  # every origin's together: past it the least recently extended chains are forgotten


class Outbox:
    """What this brain's decisions changed since the transport last took it (``take``)."""

    __slots__ = ("events", "_tags", "_next_tag")

    def __init__(self) -> None:
        self.events: list[tuple] = []
        # id(chain) -> [chain, tag, blocks published]: the chain object is held so that its id stays its own
        self._tags: OrderedDict[int, list] = OrderedDict()
        self._next_tag = 0

    def take(self) -> list[tuple]:
        ev, self.events = self.events, []
        return ev

    def indexed(self, replica: str, engine: int | None, chain: Sequence[int], n: int) -> None:
        t = self._tags.get(id(chain))
        if t is not None and t[0] is chain and t[2] <= n:
            start = t[2]
            if start == n:
                return
            t[2] = n
            self._tags.move_to_end(id(chain))
            self.events.append(("i", replica, engine, t[1], start, chain[start - 1] if start else None,
                                chain[start:n]))
            return
        tag = self._next_tag
        self._next_tag += 1
        self._tags[id(chain)] = [chain, tag, n]
        self._tags.move_to_end(id(chain))
        if len(self._tags) > _MAX_CHAINS:
            self._tags.popitem(last=False)
        self.events.append(("i", replica, engine, tag, 0, None, chain[:n]))

    def decided(self, router, d: Decision, profile: "RequestProfile", now: float) -> None:
        # on the request path: plain tuples; keys as hex (bytes.hex is cheaper than a JSON encoder's callback)
        res = d.reservation
        sk = profile.session_key.hex() if profile.session_key is not None else None
        if res is not None:
            self.events.append(("o", res.id, res.replica.name, res.engine, res.weight_milli, res.provisional,
                                res.work_s, res.prefill_s, res.pending_tokens, None if profile.provisional else sk,
                                d.prompt_tokens, now, None if profile.provisional else profile.tokens,
                                d.prefix, d.cached_tokens))
        for table in router.policy.pin_tables():
            key = profile.session_key if table.kind is SESSION else profile.prefix_key
            if key is None:
                continue
            pin = table.peek(key)
            if pin is not None:
                if pin.last_used == now:
                    self.events.append(("h", table.kind.value, sk if table.kind is SESSION else key.hex(),
                                        pin.replica.name, pin.engine, pin.tokens, now))
            elif d.events and any(e.action is PinAction.UNPIN and e.kind is table.kind for e in d.events):
                self.events.append(("h", table.kind.value, key.hex(), None, None, 0, now))


class Remote:
    """What the other brains told this one: their open reservations and the chains they indexed."""

    __slots__ = ("reservations", "closed", "chains", "applied", "index_gaps", "unknown_replicas", "expired",
                 "on_foreign_end", "max_open", "refused", "_open", "_claimed", "_blocks", "blocks")

    def __init__(self, max_open: int = 8192) -> None:
        # (origin, rid) -> the reservation, oldest first
        self.reservations: OrderedDict[tuple[str, int], Reservation] = OrderedDict()
        # reservations whose close came first (messages reordered): their open, when it comes, opens nothing
        self.closed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.chains: OrderedDict[tuple[str, int], list[int]] = OrderedDict()  # (origin, tag) -> blocks so far
        self.applied = 0  # events applied
        self.index_gaps = 0  # index deltas dropped: their prefix is unknown here
        self.unknown_replicas = 0  # events naming a replica this brain does not know (discovery differs)
        self.expired = 0  # reservations ended by their origin's silence or the safety timeout
        # ("x"/"a", number, digest): another brain got the end (or a periodic entry) of a reservation that may be
        # ours (the shell's access log, which names it by a token the core does not keep); the shell sets this:
        # (number, digest, ended)
        self.on_foreign_end: Callable[[int, str, bool], None] | None = None
        # A peer's blast radius: what one origin may claim. Its open reservations at most ``max_open``;
        # on one replica, pending tokens at most what that replica's KV holds (the policy's view of it); its
        # chains at most _ORIGIN_MAX_BLOCKS. What is past a bound is not applied, and counted by kind
        self.max_open = max_open
        self.refused: dict[str, int] = {"reservations": 0, "pending_tokens": 0, "blocks": 0}
        self._open: dict[str, int] = {}  # origin -> its open reservations here
        self._claimed: dict[tuple[str, str], int] = {}  # (origin, replica) -> its pending tokens there
        self._blocks: dict[str, int] = {}  # origin -> blocks of its chains kept here
        self.blocks = 0  # blocks of every origin's chains kept here

    def _pop(self, router, key: tuple[str, int], now: float) -> Reservation | None:
        """A remote reservation ends (closed, its origin silent, or timed out): released, and its claims given back."""
        res = self.reservations.pop(key, None)
        if res is None:
            return None
        origin = key[0]
        n = self._open.get(origin, 0) - 1
        if n > 0:
            self._open[origin] = n
        else:
            self._open.pop(origin, None)
        ck = (origin, res.replica.name)
        left = self._claimed.get(ck, 0) - res.claimed
        if left > 0:
            self._claimed[ck] = left
        else:
            self._claimed.pop(ck, None)
        router.release(res, now)
        return res

    def apply(self, router, origin: str, events: list, offset: float, now: float) -> None:
        """Apply one origin's events, in its order; ``offset`` turns its clock into ours."""
        for ev in events:
            try:
                kind = ev[0]
                if kind == "o":
                    self._opened(router, origin, ev, offset, now)
                elif kind == "c":
                    if self._pop(router, (origin, ev[1]), now) is None:
                        self.closed[(origin, ev[1])] = None
                        if len(self.closed) > _MAX_CHAINS:
                            self.closed.popitem(last=False)
                elif kind == "h":
                    self._home(router, ev, offset, now)
                elif kind == "i":
                    self._indexed(router, origin, ev)
                elif kind == "v":
                    if router.flow is not None:  # another brain served a tenant: fairness holds across brains
                        router.flow.queue.charge(None if ev[1] is None else str(ev[1]), float(ev[2]))
                elif kind == "t":
                    tokens, tenant = float(ev[2]), ev[1]
                    # a tenant's hash (flow.tenant_key: 16 hex digits) and a bounded cost, or nothing happened
                    if router.caps is not None and 0 < tokens <= _MAX_TOKENS and isinstance(tenant, str) \
                            and len(tenant) == 16 and all(c in _HEX for c in tenant):
                        # another brain placed a tenant's request: its cap holds across brains
                        router.caps.spend(tenant, tokens, now)
                elif kind == "x" or kind == "a":
                    if self.on_foreign_end is not None:
                        self.on_foreign_end(int(ev[1]), str(ev[2]), kind == "x")
                else:
                    continue
            except (TypeError, ValueError, IndexError, KeyError, AttributeError):
                continue  # a malformed event (another version, a corrupt entry) changes nothing
            self.applied += 1

    def _replica(self, router, name: str):
        r = router.find(name)
        if r is None:
            self.unknown_replicas += 1
        return r

    def _opened(self, router, origin: str, ev: tuple, offset: float, now: float) -> None:
        _, rid, name, engine, weight, provisional, work_s, prefill_s, pending, sk, prompt, at = ev[:12]
        estimated = ev[12] if len(ev) > 12 and ev[12] is not None else None  # an older brain sends none
        prefix, cached = (ev[13], int(ev[14])) if len(ev) > 14 and ev[13] is not None else (None, 0)
        if not (prefix is None or isinstance(prefix, int) and 0 < cached <= int(prompt)):
            raise ValueError("a shared prefix no request can have")
        # what one request can be: nine forged reservations put 29,996 s of predicted wait on three replicas
        if not (0 <= float(work_s) <= _MAX_WORK_S and 0 <= float(prefill_s) <= _MAX_WORK_S
                and 0 <= int(weight) <= _MAX_WEIGHT_MILLI and 0 <= int(pending) <= _MAX_TOKENS
                and 0 <= int(prompt) <= _MAX_TOKENS and (estimated is None or 0 <= int(estimated) <= _MAX_TOKENS)):
            raise ValueError("a reservation no request can make")
        r = self._replica(router, name)
        if r is None or (origin, rid) in self.reservations:
            return
        if self.closed.pop((origin, rid), 0) is None:  # closed already
            return
        if self._open.get(origin, 0) >= self.max_open:
            self.refused["reservations"] += 1
            return
        kv = router.policy.kv_tokens(r, None if engine is None else int(engine))
        claimed = self._claimed.get((origin, name), 0)
        if kv is not None and claimed + int(pending) > kv:
            # more KV pending on one replica than it holds: no brain's requests can be that
            self.refused["pending_tokens"] += 1
            return
        at = min(now, float(at) + offset)
        res = router.reserve_remote(r, int(weight), at, bool(provisional))
        res.engine = engine if engine is None else int(engine)
        res.work_s = float(work_s)
        router.policy.on_remote_reserved(res, float(prefill_s), int(pending), _key(sk) if sk else None, int(prompt),
                                         at, now, None if estimated is None else int(estimated),
                                         None if prefix is None else (prefix, cached))
        res.claimed = int(pending)
        self._claimed[(origin, name)] = claimed + res.claimed
        self._open[origin] = self._open.get(origin, 0) + 1
        self.reservations[(origin, rid)] = res

    def _home(self, router, ev: tuple, offset: float, now: float) -> None:
        _, kind, key, name, engine, tokens, at = ev
        table = _table(router, kind)
        if table is None:
            return
        at = min(now, float(at) + offset)
        k = _key(key)
        if name is None:
            pin = table.peek(k)
            if pin is not None and pin.last_used <= at:
                table.delete(k)
            return
        r = self._replica(router, name)
        if r is not None:
            table.apply(k, r, None if engine is None else int(engine), int(tokens), at)

    def _indexed(self, router, origin: str, ev: tuple) -> None:
        _, name, engine, tag, start, parent, blocks = ev
        r = self._replica(router, name)
        if r is None:
            return
        st = router.policy.index_of(r, None if engine is None else int(engine))
        if st is None:  # the policy keeps no index (seed), or the engine is unknown here yet
            return
        if not isinstance(blocks, list) or len(blocks) > _MAX_CHAIN_BLOCKS \
                or not all(type(h) is int for h in blocks):
            self.refused["blocks"] += 1
            return
        key = (origin, int(tag))
        chains = self.chains
        chain = chains.get(key)
        extend = start != 0 and chain is not None and len(chain) == start
        if start != 0 and not extend and not (parent is not None and st.holds(parent)):
            self.index_gaps += 1
            return
        had = len(chain) if chain is not None else 0
        grown = start + len(blocks) - had if extend else len(blocks) - had
        if (start + len(blocks) if extend else len(blocks)) > _MAX_CHAIN_BLOCKS \
                or self._blocks.get(origin, 0) + grown > _ORIGIN_MAX_BLOCKS:
            self.refused["blocks"] += 1
            return
        if extend and chain is not None:
            chain.extend(blocks)
        else:  # a new chain, or a delta whose prefix is indexed here already: a batch of its own
            chain = list(blocks)
        self._keep_chain(key, chain, grown)
        st.insert(chain)

    def _keep_chain(self, key: tuple[str, int], chain: list[int], grown: int) -> None:
        chains = self.chains
        self._count_blocks(key[0], grown)
        chains[key] = chain
        chains.move_to_end(key)
        while chains and (len(chains) > _MAX_CHAINS or self.blocks > _MAX_BLOCKS):
            (origin, _), gone = chains.popitem(last=False)
            self._count_blocks(origin, -len(gone))

    def _count_blocks(self, origin: str, delta: int) -> None:
        self.blocks += delta
        n = self._blocks.get(origin, 0) + delta
        if n > 0:
            self._blocks[origin] = n
        else:
            self._blocks.pop(origin, None)

    def forget_origin(self, router, origin: str, now: float) -> int:
        """The origin is gone (no heartbeat): its in-flight work no longer exists."""
        gone = [k for k in self.reservations if k[0] == origin]
        for k in gone:
            self._pop(router, k, now)
        self.expired += len(gone)
        return len(gone)

    def expire(self, router, now: float, timeout_s: float) -> None:
        limit = now - timeout_s
        res = self.reservations
        while res:
            k, r = next(iter(res.items()))
            if r.started_at > limit:
                break
            self._pop(router, k, now)
            self.expired += 1

    def origins(self) -> set[str]:
        return {k[0] for k in self.reservations}


def export_state(router, now: float) -> dict:
    """This brain's view for a brain that starts (or resynchronises): every live pin with its age, and every
    replica's prefix index as batches. Hashes and replica names only. Reservations are not in it: they are
    short, and the events bring the ones opened from now on."""
    pins = []
    for table in router.policy.pin_tables():
        for key, pin in list(table):
            if now - pin.last_used <= table.ttl_s and not pin.replica.removed:
                pins.append((table.kind.value, key.hex(), pin.replica.name, pin.engine, pin.tokens,
                             round(now - pin.last_used, 3)))
    index = []
    for r in router.replicas_view:
        n = router.policy.engine_count(r.name)
        for engine in (None, *range(n)) if n > 1 else (None,):
            idx = router.policy.index_of(r, engine)
            if idx is not None and len(idx):
                index.append((r.name, engine, idx.batches()))
    return {"pins": pins, "index": index}


def import_state(router, state: dict, now: float) -> None:
    """Fold another brain's ``export_state`` into this view (pins: the newest use wins; the index: its batches
    are added, oldest first). Unknown replicas and malformed entries are skipped."""
    for entry in state.get("pins", ()):
        try:
            kind, key, name, engine, tokens, age = entry
            table, r = _table(router, kind), router.find(name)
            if table is not None and r is not None:
                table.apply(bytes.fromhex(key), r, None if engine is None else int(engine), int(tokens),
                            now - float(age))
        except (TypeError, ValueError):
            continue
    for entry in state.get("index", ()):
        try:
            name, engine, batches = entry
            r = router.find(name) if isinstance(name, str) else None
            idx = router.policy.index_of(r, None if engine is None else int(engine)) if r is not None else None
        except (TypeError, ValueError):
            continue
        if idx is None or not isinstance(batches, list):
            continue
        for b in batches:
            if isinstance(b, list) and b and all(isinstance(h, int) for h in b):
                idx.insert(list(b))


def _key(k) -> bytes:
    """A key hash as the core keeps it: bytes in the simulator and tests, hex once it went through JSON."""
    if isinstance(k, bytes):
        return k
    if isinstance(k, str) and len(k) <= 64:
        return bytes.fromhex(k)
    raise ValueError("not a key hash")


def _table(router, kind: str) -> PinTable | None:
    for t in router.policy.pin_tables():
        if t.kind == kind:
            return t
    return None


__all__ = ["Outbox", "Remote", "export_state", "import_state"]

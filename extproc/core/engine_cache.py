"""The engine's own word on its cache: vLLM's block hash, and one engine's residency from its KV events,
each event re-hashed and compared before the residency is believed.

vLLM 0.32 hashes a prompt's full blocks as a chain (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``):
``digest_i = H((digest_{i-1} or NONE_HASH, tuple(block_tokens_i), extra_keys_i or None))``, where ``H`` is SHA-256
over ``pickle.dumps(obj, HIGHEST_PROTOCOL)`` with the default ``--prefix-caching-hash-algo sha256`` and ``NONE_HASH``
is ``H`` of the seed (``$PYTHONHASHSEED`` if the engine has it, else ``"vllm-none-hash"``). Its KV events publish
the low 64 bits of each digest (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default), so a child's digest can
only be recomputed from its parent's full digest: this keeps the full digest of every block it verified.

An engine is **exact** once a stored block's published hash equals the one computed here from its tokens; one
mismatch (another seed, another algorithm, a different block size in the hash) makes it **estimated** for good (until
its events start again from a new engine), with the reason. Only what a hit needs counts as resident: blocks of
full-attention cache groups (``kv_cache_spec_kind``: a sliding-window group's blocks do not make a prefix hit), each
on its ``medium``. The GPU's blocks are a hit; an offloading connector's (vLLM's ``OffloadingConnector``, LMCache)
publish the same hashes with ``medium`` CPU or STORAGE: a prefix past the GPU's hit that such a tier holds is restored
instead of computed, which the policy prices by what a restore takes (``restorable``). A store on another instance
(``locality`` REMOTE) is no hit here. An offloading connector announces a block once per chunk that holds it and
removes it as many times: a tier counts announcements, not blocks. No I/O here: a reader in the shell turns the wire
into these values (``brain/kv_events.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256",)  # sha256_cbor needs cbor2; xxhash seeds itself at random per process: never reproducible
EXACT, ESTIMATED = "exact", "estimated"
GPU = "GPU"
LOCAL = "LOCAL"
FULL_ATTENTION = "full_attention"
# more resident blocks than any engine's cache holds (an 80 GB cache of 16-token blocks is ~10^6): events were lost
MAX_BLOCKS = 4_000_000
# media an engine's events may name besides the GPU (vLLM: CPU, STORAGE): a publisher naming more is not believed past
# these, so that one replica's events cannot grow the brain by a dictionary per name
MAX_MEDIA = 4


def vllm_hash(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 over the object pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str = NONE_HASH_SEED) -> bytes:
    """The parent of every chain's first block."""
    return vllm_hash(seed)


def external(digest: bytes) -> int:
    """The hash an event publishes for a digest: its low 64 bits, read big-endian."""
    return int.from_bytes(digest[-8:], "big")


def chain(tokens: Sequence[int], block_size: int, root: bytes, parent: bytes | None = None,
          extra: Sequence[tuple | None] | None = None) -> list[bytes]:
    """The digests of the full blocks of ``tokens`` (a partial last block is not cached), after ``parent`` (None: the
    prompt's start, whose parent is ``root``). ``extra``: each block's tagged extra keys (LoRA, cache salt), or None."""
    out = []
    prev = parent or root
    for k in range(len(tokens) // block_size):
        prev = vllm_hash((prev, tuple(tokens[k * block_size:(k + 1) * block_size]), extra[k] if extra else None))
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class Stored:
    """vLLM's ``BlockStored``: consecutive blocks of one request, the first after ``parent`` (None: a prompt's
    start)."""

    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[int, ...]
    block_size: int
    medium: str | None = GPU
    lora_name: str | None = None
    extra_keys: tuple | None = None  # per block, untagged as events publish them
    kind: str | None = FULL_ATTENTION  # kv_cache_spec_kind (None: a publisher older than 0.32, full attention)
    locality: str | None = None  # LOCAL or REMOTE to the publisher (None: unspecified, as the GPU's own stores)


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str | None = GPU
    locality: str | None = None


def _local(locality: str | None) -> bool:
    return locality is None or locality == LOCAL


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


class Unverifiable(Exception):
    pass


class EngineCache:
    """One engine's resident prefix blocks as its events say, and whether its events prove this module's hash."""

    def __init__(self, seed: str = NONE_HASH_SEED, algo: str = "sha256", lora_paths: dict[str, str] | None = None):
        self.root = none_hash(seed)
        self.seed, self.algo = seed, algo
        self.lora_paths = lora_paths or {}  # adapter name -> path: vLLM hashes both, its events name the first
        self.gpu: dict[int, bytes | None] = {}  # published hash -> full digest (None: held, its chain unknown here)
        # blocks of other media on this instance (CPU, STORAGE): medium -> published hash -> announcements held
        self.tiers: dict[str, dict[int, int]] = {}
        self.remote = 0  # blocks announced on another instance's tier: not this engine's to restore
        self.ignored = 0  # blocks of a medium past MAX_MEDIA, or of a tier forgotten past MAX_BLOCKS
        self.block_size: int | None = None
        self.mode, self.reason = ESTIMATED, "no KV events yet"
        self.verified = self.mismatched = self.unverifiable = 0
        self.stored = self.removed = self.cleared = 0
        self.last_event_at: float | None = None
        if algo not in HASH_ALGOS:
            self.reason = f"--prefix-caching-hash-algo {algo} cannot be reproduced here (only {', '.join(HASH_ALGOS)})"

    @property
    def exact(self) -> bool:
        return self.mode == EXACT

    def _mismatch(self, why: str) -> None:
        self.mismatched += 1
        if self.mode == EXACT or not self.reason.startswith("block hash mismatch"):
            self.mode = ESTIMATED
            self.reason = f"block hash mismatch: {why}"

    def _tagged(self, extra: tuple | None, lora_name: str | None, first: bool) -> tuple | None:
        """An event's untagged extra keys for one block, tagged again as vLLM hashes them."""
        if not extra:
            return None
        out: list[tuple] = []
        rest = list(extra)
        if lora_name is not None:
            name = rest.pop(0) if rest else lora_name
            path = self.lora_paths.get(name)
            if path is None:
                raise Unverifiable(f"adapter {name!r}: its path is not known here")
            out.append(("lora", name, path))
        for key in rest:
            if first and isinstance(key, str):
                out.append(("cache_salt", key))
            else:  # multimodal placeholders and prompt embeddings: not reproduced
                raise Unverifiable("multimodal or prompt-embeds keys")
        return tuple(out) or None

    def _store(self, ev: Stored) -> None:
        if ev.kind not in (None, FULL_ATTENTION):
            return  # a sliding-window or mamba group: its blocks make no prefix hit
        medium = ev.medium
        if medium is not None and medium != GPU:
            if not _local(ev.locality):
                self.remote += len(ev.hashes)
                return
            tier = self.tiers.get(medium)
            if tier is None:
                if len(self.tiers) >= MAX_MEDIA:
                    self.ignored += len(ev.hashes)
                    return
                tier = self.tiers[medium] = {}
            for h in ev.hashes:
                tier[h] = tier.get(h, 0) + 1
            if len(tier) > MAX_BLOCKS:
                # removals were missed, or a tier bigger than any this bounds: that tier alone is forgotten (priced
                # as computed); the GPU's blocks and the engine's proof stand
                del self.tiers[medium]
                self.ignored += MAX_BLOCKS
            return
        self.stored += len(ev.hashes)
        if self.block_size is None:
            self.block_size = ev.block_size
        elif ev.block_size != self.block_size:
            self._mismatch(f"block size {ev.block_size} after {self.block_size}")
        digests: list[bytes | None] = [None] * len(ev.hashes)
        if self.mode == EXACT or self.reason.startswith(("no KV events", "events lost")):
            try:
                prev: bytes | None
                if ev.parent is None:
                    prev = self.root
                else:
                    prev = self.gpu.get(ev.parent)
                    if prev is None:
                        raise Unverifiable("parent block unknown here")
                extra = ev.extra_keys or ()
                bs = ev.block_size
                if len(ev.tokens) < bs * len(ev.hashes):
                    raise Unverifiable("fewer tokens than blocks")
                for k, h in enumerate(ev.hashes):
                    keys = self._tagged(extra[k] if k < len(extra) else None, ev.lora_name,
                                        ev.parent is None and k == 0)
                    prev = vllm_hash((prev, tuple(ev.tokens[k * bs:(k + 1) * bs]), keys))
                    if external(prev) != h:
                        self._mismatch(f"the engine's hash of a block is not vLLM {self.algo} with seed {self.seed!r} "
                                       "(another PYTHONHASHSEED or --prefix-caching-hash-algo?)")
                        digests = [None] * len(ev.hashes)
                        break
                    digests[k] = prev
                    self.verified += 1
                else:
                    if self.mode != EXACT and self.algo in HASH_ALGOS:
                        self.mode, self.reason = EXACT, "every stored block verified"
            except Unverifiable:
                self.unverifiable += len(ev.hashes)
        for h, d in zip(ev.hashes, digests):
            self.gpu[h] = d if d is not None else self.gpu.get(h)
        if len(self.gpu) > MAX_BLOCKS:
            self.lost(f"more than {MAX_BLOCKS:,} blocks resident: removals were missed")

    def apply(self, events: Sequence[Stored | Removed | Cleared], now: float) -> None:
        """One batch of the engine's events, in its order."""
        self.last_event_at = now
        for ev in events:
            if isinstance(ev, Stored):
                self._store(ev)
            elif isinstance(ev, Removed):
                if ev.medium in (None, GPU):
                    for h in ev.hashes:
                        if self.gpu.pop(h, 0) != 0:
                            self.removed += 1
                elif ev.medium is not None and _local(ev.locality) and (tier := self.tiers.get(ev.medium)) is not None:
                    for h in ev.hashes:
                        n = tier.get(h, 0) - 1
                        if n > 0:
                            tier[h] = n
                        else:
                            tier.pop(h, None)
            elif isinstance(ev, Cleared):
                # vLLM publishes one clear for a prefix-cache reset, whatever its connector keeps: an offloaded
                # block believed gone is the safe error (priced as computed)
                self.gpu.clear()
                self.tiers.clear()
                self.cleared += 1

    def lost(self, why: str = "events lost") -> None:
        """Events were missed and not replayed: what is resident is unknown. Nothing is believed resident (the safe
        error: a request is priced as uncached), and the engine is estimated until a stored block verifies again."""
        self.gpu.clear()
        self.tiers.clear()
        if self.mode == EXACT or not self.reason.startswith("block hash mismatch"):
            self.mode, self.reason = ESTIMATED, f"events lost: {why}" if not why.startswith("events lost") else why

    def holds(self, h: int) -> bool:
        return h in self.gpu

    def cached_tokens(self, hashes: Sequence[int]) -> int:
        """The engine's cached tokens for a prompt whose full blocks publish ``hashes``: the longest run from its
        start that the engine holds (vLLM reuses a prefix, never a block past a missing one)."""
        n = 0
        gpu = self.gpu
        for h in hashes:
            if h not in gpu:
                break
            n += 1
        return n * (self.block_size or 0)

    def restorable(self, hashes: Sequence[int], start: int, medium: str) -> int:
        """How many of ``hashes`` from index ``start`` (where the GPU's hit ends) tier ``medium`` holds in a run: vLLM's
        connector looks up what follows the GPU's hit and loads the run it finds."""
        tier = self.tiers.get(medium)
        if not tier:
            return 0
        n = 0
        for h in itertools.islice(hashes, start, None):
            if h not in tier:
                break
            n += 1
        return n

    def resident(self) -> dict[str, int]:
        """Blocks held per medium (the GPU's first)."""
        return {GPU: len(self.gpu), **{m: len(t) for m, t in sorted(self.tiers.items()) if t}}

    def view(self) -> dict:
        return {"cache_mode": self.mode, "reason": self.reason, "resident_blocks": len(self.gpu),
                "resident_by_medium": self.resident(), "remote_blocks": self.remote, "ignored_blocks": self.ignored,
                "block_size": self.block_size, "verified_blocks": self.verified, "mismatched_blocks": self.mismatched,
                "unverifiable_blocks": self.unverifiable, "cleared": self.cleared}


def mode_of(engines: list[dict] | None) -> tuple[str, str]:
    """(``exact`` or ``estimated``, why) for a replica whose engines' ``view`` is ``engines``: exact when every engine
    that sent events is."""
    if not engines:
        return "estimated", "no KV events (none configured, or the engine publishes none)"
    off = [e for e in engines if e["cache_mode"] != "exact"]
    return ("estimated", off[0]["reason"]) if off else ("exact", "every stored block verified")

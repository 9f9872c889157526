"""Chained block hashes of a prompt (SPEC C2): the one function that says what "the same prefix" means.

A prompt is cut into blocks of ``BLOCK_CHARS`` bytes (about 16 tokens at 4 characters a token,
vLLM's block size); block k's hash covers everything from the start through block k, so two
prompts share block k's hash exactly when they share their first k+1 blocks. Each block gets a
64-bit digest (its eight 64-bit words multiplied by odd constants, mixed and summed), and the
chain is the polynomial H_k = H_(k-1) * P + d_k mod 2^64, started from the seed (model and
tenant). Both steps are vectorised with numpy: H over a run of t blocks is P^t * (H_start +
cumsum(d_m * P^-m)), P being odd and so invertible mod 2^64. A megabyte is hashed in about a
millisecond, and any run of a stored chain can be re-checked from the hash before it. The router
hashes request bodies with it, and the mock vLLM hashes its prompts with it. Not a cryptographic
hash: a collision can only send a request where its prefix is not cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK_CHARS = 64
# vLLM's default --block-size: the tokens of one cache block (the engine caches and evicts whole blocks)
BLOCK_TOKENS = 16
_WORDS = BLOCK_CHARS // 8
_U64 = np.uint64
_P = 0x9E3779B97F4A7C15  # odd, so P^-1 exists mod 2^64
_Q = pow(_P, -1, 1 << 64)
_K = np.array([0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3,
               0x1D8E4E27C47D124F, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93], dtype=_U64)
_MIX = _U64(0xFF51AFD7ED558CCD)
_powers_p = np.ones(0, dtype=_U64)
_powers_q = np.ones(0, dtype=_U64)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P^1..P^n and P^-1..P^-n mod 2^64 (grown by doubling, kept)."""
    global _powers_p, _powers_q
    if len(_powers_p) < n:
        size = max(n, 2 * len(_powers_p), 1024)
        _powers_p = np.cumprod(np.full(size, _P, dtype=_U64), dtype=_U64)
        _powers_q = np.cumprod(np.full(size, _Q, dtype=_U64), dtype=_U64)
    return _powers_p[:n], _powers_q[:n]


def chain_seed(*parts: str | None) -> int:
    """The hash a chain starts from: model and tenant, so equal text in two tenants never matches."""
    b = "\x00".join(p or "" for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little")


def _digests(x: np.ndarray) -> np.ndarray:
    """One 64-bit digest per block, from its rows of eight little-endian 64-bit words."""
    y = x * _K
    y ^= y >> _U64(31)
    d = y.sum(axis=1, dtype=_U64)
    d *= _MIX
    d ^= d >> _U64(29)
    return d


def _words(data, start: int, n: int) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8", count=n * _WORDS, offset=start).reshape(n, _WORDS)


def _run(data, start: int, n: int, state: int) -> np.ndarray:
    """The chain's next ``n`` hashes over the full blocks of ``data`` from byte ``start``, after ``state``."""
    p, q = _powers(n)
    s = np.cumsum(_digests(_words(data, start, n)) * q, dtype=_U64)
    s += np.array(state, dtype=_U64)
    return p * s


def extend_chain(chain: list[int], data, start: int, end: int, state: int) -> int:
    """Append the hashes of the full blocks of ``data[start:end]`` to ``chain``; returns the running state."""
    n = max(0, (end - start) // BLOCK_CHARS)
    if n == 0:
        return state
    h = _run(data, start, n, state)
    chain.extend(h.tolist())
    return chain[-1]


def block_hashes(data, seed: int = 0) -> list[int]:
    """Hashes of every full block of ``data`` (bytes-like), each covering the prefix through that block."""
    chain: list[int] = []
    extend_chain(chain, data, 0, len(data), seed)
    return chain


_CHECK_WINDOW = 16  # blocks (1 KiB) per sampled window when a reused chain is checked
_CHECK_WINDOWS = 16


def _verify(chain: list[int], data, start: int, seed: int, keep: int | None = None) -> bool:
    """Whether ``data[start:]`` still begins with the bytes of ``chain``'s first ``keep`` blocks (default: all).

    Any run of blocks can be re-checked on its own, because the chain holds the state at every
    block boundary: continue from the hash before the run and compare with the hash at its end.
    Short chains are checked whole; long ones at their head, their tail and evenly spaced windows
    between (a history that was rewritten or shifted differs in nearly all of them), all windows in
    one vectorised pass, so a 1 MB conversation's next turn costs ~18 KB of hashing instead of 1 MB.
    The windows are placed by the whole chain's length, so checking a few blocks fewer (``keep``)
    checks the same places.
    """
    n = len(chain)
    keep = n if keep is None else keep
    w, k = _CHECK_WINDOW, _CHECK_WINDOWS
    if n <= (k + 2) * w:
        return int(_run(data, start, keep, seed)[-1]) == chain[keep - 1]
    step = (n - 2 * w) // k
    firsts = [0, keep - w, *(w + i * step for i in range(k))]
    rows = (np.array(firsts)[:, None] + np.arange(w)).ravel()
    d = _digests(_words(data, start, keep)[rows]).reshape(len(firsts), w)
    p, q = _powers(w)
    before = np.array([chain[i - 1] if i else seed for i in firsts], dtype=_U64)
    after = p[w - 1] * ((d * q).sum(axis=1, dtype=_U64) + before)
    return after.tolist() == [chain[i + w - 1] for i in firsts]


# A body's last blocks may hold what follows its last message (closing brackets, parameters after the messages),
# which the next turn rewrites: a chain whose tail no longer matches is reused without its last few blocks
_TAIL_RETRIES = (1, 2, 4)


class ChainCache:
    """A session's chain from its previous turn, so a turn that extends it hashes only what is new (C2).

    The previous chain is reused when the new body still starts with the bytes it was computed from
    (``_verify``). Bounded: the least recently used sessions are forgotten beyond ``max_sessions`` or
    ``max_blocks`` in total.
    """

    def __init__(self, max_sessions: int = 4096, max_blocks: int = 2_000_000):
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks
        self._entries: OrderedDict[bytes, tuple[int, list[int]]] = OrderedDict()
        self._blocks = 0
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Blocks held over every session (bounded by ``max_blocks``)."""
        return self._blocks

    def follow(self, key: bytes, data, seed: int, end: int | None = None,
               max_len: int | None = None) -> tuple[list[int], int]:
        """A turn that sends only what is new (a Responses follow-up: the engine prepends the conversation it
        stored): ``key``'s last chain extended by the full blocks of ``data[:end]``, at most ``max_len`` blocks in
        all (as a chat conversation's chain stops at chain_max_bytes), kept for the next turn. Returns the chain
        and how many of its blocks came before (0: no earlier turn known, or another seed)."""
        entry = self._entries.get(key)
        before = list(entry[1]) if entry is not None and entry[0] == seed else []
        chain = list(before)
        end = len(data) if end is None else min(end, len(data))
        if max_len is not None:
            end = min(end, max(0, max_len - len(chain)) * BLOCK_CHARS)
        extend_chain(chain, data, 0, end, chain[-1] if chain else seed)
        self.hashed_blocks += len(chain) - len(before)
        self._keep(key, entry, seed, chain, len(entry[1]) if entry is not None else 0)
        return chain, len(before)

    def _keep(self, key: bytes, entry, seed: int, chain: list[int], counted: int) -> None:
        """``chain`` as ``key``'s newest (``counted``: the blocks its old entry was counted for), the least recently
        used sessions forgotten past the bounds."""
        if entry is not None:
            self._blocks -= counted
            del self._entries[key]
        self._entries[key] = (seed, chain)
        self._blocks += len(chain)
        while self._entries and (len(self._entries) > self.max_sessions or self._blocks > self.max_blocks):
            _, (_, old) = self._entries.popitem(last=False)
            self._blocks -= len(old)

    def chain(self, key: bytes | None, data, start: int, seed: int, end: int | None = None,
              step: int | None = None) -> list[int]:
        """Hashes of the full blocks of ``data[start:end]`` seeded by ``seed``; reuses ``key``'s last chain.

        With ``step``, at most that many new bytes are hashed by this call: a long conversation seen for
        the first time is covered over its next turns, and no one request holds the event loop for long.
        """
        end = len(data) if end is None else min(end, len(data))
        entry = self._entries.get(key) if key is not None else None
        chain: list[int] = []
        state = seed
        done = start
        if entry is not None:
            old_seed, old = entry
            n = len(old)
            for keep in (n, *(n - t for t in _TAIL_RETRIES)) if old_seed == seed else ():
                if keep > 0 and start + keep * BLOCK_CHARS <= end and _verify(old, data, start, seed, keep):
                    # extended in place (index batches that hold it keep their own length), or a shorter copy
                    chain = old if keep == n else old[:keep]
                    state = chain[-1]
                    done = start + keep * BLOCK_CHARS
                    self.reused_blocks += keep
                    break
        before = len(chain)
        if step is not None:
            end = min(end, done + step)
        extend_chain(chain, data, done, end, state)
        self.hashed_blocks += len(chain) - before
        if key is not None:  # an entry extended in place was counted for its length before
            self._keep(key, entry, seed, chain,
                       0 if entry is None else len(entry[1]) if entry[1] is not chain else before)
        return chain

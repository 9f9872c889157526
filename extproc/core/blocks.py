"""Chained block hashes of a prompt (SPEC C2): the one function that says what "the same prefix" means.

A prompt is cut into blocks of ``BLOCK_CHARS`` bytes (about 16 tokens at 4 characters a token,
vLLM's block size); block k's hash covers everything from the start through block k, so two
prompts share block k's hash exactly when they share their first k+1 blocks. The hash is the
pair (CRC-32, Adler-32) of the whole prefix, computed incrementally: both checksums continue
over concatenated input in C, so re-checking a long prefix is one call, not a loop. The router
hashes request bodies with it, and the mock vLLM hashes its prompts with it.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

BLOCK_CHARS = 64


def chain_seed(*parts: str | None) -> tuple[int, int]:
    """The (crc, adler) a chain starts from: model and tenant, so equal text in two tenants never matches."""
    b = "\x00".join(p or "" for p in parts).encode("utf-8", "surrogatepass")
    return zlib.crc32(b), zlib.adler32(b)


def extend_chain(chain: list[int], data, start: int, end: int, crc: int, adler: int) -> tuple[int, int]:
    """Append the hashes of the full blocks of ``data[start:end]`` to ``chain``; returns the running (crc, adler)."""
    mv = memoryview(data)
    c32, a32 = zlib.crc32, zlib.adler32
    append = chain.append
    for i in range(start, end - BLOCK_CHARS + 1, BLOCK_CHARS):
        blk = mv[i:i + BLOCK_CHARS]
        crc = c32(blk, crc)
        adler = a32(blk, adler)
        append(crc << 32 | adler)
    return crc, adler


def block_hashes(data, seed: tuple[int, int] = (0, 1)) -> list[int]:
    """Hashes of every full block of ``data`` (bytes-like), each covering the prefix through that block."""
    chain: list[int] = []
    extend_chain(chain, data, 0, len(data), *seed)
    return chain


_CHECK_WINDOW = 16  # blocks (1 KiB) per sampled window when a reused chain is checked
_CHECK_WINDOWS = 16


def _verify(chain: list[int], data, start: int, seed: tuple[int, int]) -> bool:
    """Whether ``data[start:]`` still begins with the bytes ``chain`` was computed from.

    Any run of blocks can be re-checked on its own, because the chain holds the (crc, adler) state
    at every block boundary: continue both from the state before the run and compare with the state
    after it. Short chains are checked whole; long ones at their head, their tail and evenly spaced
    windows between (a history that was rewritten or shifted differs in nearly all of them), so a
    1 MB conversation's next turn costs ~50 KB of checksums instead of 1 MB.
    """
    n = len(chain)
    w, k = _CHECK_WINDOW, _CHECK_WINDOWS
    if n <= (k + 2) * w:
        runs = [(0, n)]
    else:
        step = (n - 2 * w) // k
        runs = [(0, w), (n - w, n), *((w + i * step, w + i * step + w) for i in range(k))]
    mv = memoryview(data)
    c32, a32 = zlib.crc32, zlib.adler32
    for i, j in runs:
        if i:
            h = chain[i - 1]
            crc, adler = h >> 32, h & 0xFFFFFFFF
        else:
            crc, adler = seed
        piece = mv[start + i * BLOCK_CHARS:start + j * BLOCK_CHARS]
        if (c32(piece, crc) << 32 | a32(piece, adler)) != chain[j - 1]:
            return False
    return True


class ChainCache:
    """A session's chain from its previous turn, so a turn that extends it hashes only what is new (C2).

    The previous chain is reused when the new body still starts with the bytes it was computed from
    (``_verify``). Bounded: the least recently used sessions are forgotten beyond ``max_sessions`` or
    ``max_blocks`` in total.
    """

    def __init__(self, max_sessions: int = 4096, max_blocks: int = 2_000_000):
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks
        self._entries: OrderedDict[bytes, tuple[tuple[int, int], list[int]]] = OrderedDict()
        self._blocks = 0
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Blocks held over every session (bounded by ``max_blocks``)."""
        return self._blocks

    def chain(self, key: bytes | None, data, start: int, seed: tuple[int, int], end: int | None = None,
              step: int | None = None) -> list[int]:
        """Hashes of the full blocks of ``data[start:end]`` seeded by ``seed``; reuses ``key``'s last chain.

        With ``step``, at most that many new bytes are hashed by this call: a long conversation seen for
        the first time is covered over its next turns, and no one request holds the event loop for long.
        """
        end = len(data) if end is None else min(end, len(data))
        entry = self._entries.get(key) if key is not None else None
        chain: list[int] = []
        crc, adler = seed
        done = start
        if entry is not None:
            old_seed, old = entry
            n = len(old)
            if old_seed == seed and n and start + n * BLOCK_CHARS <= end and _verify(old, data, start, seed):
                chain = old  # extended in place: index batches that hold it keep their own length
                crc, adler = old[-1] >> 32, old[-1] & 0xFFFFFFFF
                done = start + n * BLOCK_CHARS
                self.reused_blocks += n
        before = len(chain)
        if step is not None:
            end = min(end, done + step)
        crc, adler = extend_chain(chain, data, done, end, crc, adler)
        self.hashed_blocks += len(chain) - before
        if key is not None:
            if entry is not None:
                self._blocks -= len(entry[1]) if entry[1] is not chain else before
                del self._entries[key]
            self._entries[key] = (seed, chain)
            self._blocks += len(chain)
            while self._entries and (len(self._entries) > self.max_sessions or self._blocks > self.max_blocks):
                _, (_, old) = self._entries.popitem(last=False)
                self._blocks -= len(old)
        return chain

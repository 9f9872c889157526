"""The mock's KV connector: prefill/decode disaggregation as vLLM 0.32's NIXL connector exchanges it.

A request whose ``kv_transfer_params`` say ``do_remote_decode`` is a prefill leg: the engine computes the prompt
and one token, keeps the prompt's blocks, and answers with the ``kv_transfer_params`` a decode replica needs
(``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
``remote_block_ids``, ``remote_num_tokens``, ``tp_size``: ``NixlConnectorScheduler.request_finished``). The blocks
stay held until a decode replica reads them, a decode replica's aborted request tells it to let them go, or the
lease runs out (``kv_lease_duration``, 30 s).

A request whose ``kv_transfer_params`` say ``do_remote_prefill`` is a decode leg: the replica loads what its own
cache lacks of the prompt from the named replica (its side channel here is the mock's HTTP port: ``POST
/kv/read``, ``POST /kv/release``), at ``--kv-transfer-tokens-per-s``, and computes only the rest. A load that fails
fails the request (vLLM's ``kv_load_failure_policy`` default, ``fail``). The loaded tokens are counted as
``prompt_tokens_by_source_total{source="external_kv_transfer"}`` and as the usage's ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

LEASE_S = 30.0  # NixlConnector's kv_lease_duration default
READ_TIMEOUT_S = 30.0  # vLLM's decode side gives a remote load this long (VLLM_NIXL_ABORT_REQUEST_TIMEOUT's role)


class LoadFailed(Exception):
    """The decode leg could not load the prefill's KV (its replica died, or the lease ran out)."""


@dataclass(slots=True)
class Kept:
    driver: object  # the Driver whose engine holds the blocks
    rid: int  # the engine request that computed them
    tokens: int
    until: float  # monotonic: the lease's end


class KvConnector:
    """One replica's side of the exchange (both roles: vLLM's ``kv_role: kv_both``)."""

    def __init__(self, name: str, host: str, tokens_per_s: float, speedup: float, lease_s: float = LEASE_S):
        self.name, self.host = name, host
        self.port = 0  # set once the server listens
        self.tokens_per_s, self.speedup, self.lease_s = tokens_per_s, speedup, lease_s
        self.kept: dict[str, Kept] = {}
        self.loaded_tokens = 0
        self.load_failures = 0
        self.released = 0  # kept blocks let go without a read (an aborted decode, a lease run out)
        self._session: aiohttp.ClientSession | None = None
        self._seq = 0

    # ----------------------------------------------------------- the prefill side

    @staticmethod
    def role(params) -> str | None:
        """"prefill", "decode" or None for a request's kv_transfer_params."""
        if not isinstance(params, dict):
            return None
        if params.get("do_remote_decode"):
            return "prefill"
        if params.get("do_remote_prefill") and params.get("remote_request_id") and params.get("remote_host"):
            return "decode"
        return None

    def keep(self, driver, rid: int, tokens: int, blocks: list[int]) -> dict:
        """A prefill leg ended: hold its blocks under a lease and say where to read them."""
        self._seq += 1
        rrid = f"{self.name}-{self._seq}-{rid}"
        self.kept[rrid] = Kept(driver, rid, tokens, time.monotonic() + self.lease_s)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(len(blocks)))],
                "remote_engine_id": self.name, "remote_request_id": rrid, "remote_host": self.host,
                "remote_port": self.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": tokens,
                "remote_blocks_expiry_time": None, "transfer_mode": "pull"}

    def _let_go(self, rrid: str) -> Kept | None:
        k = self.kept.pop(rrid, None)
        if k is not None:
            k.driver.engine.free_kept(k.rid)
        return k

    def expire(self) -> None:
        now = time.monotonic()
        for rrid in [r for r, k in self.kept.items() if k.until <= now]:
            self._let_go(rrid)
            self.released += 1

    def forget_all(self) -> None:
        """The replica died: what it kept is gone with its engine."""
        self.kept.clear()

    async def read(self, request: web.Request) -> web.Response:
        """The side channel: a decode replica reads a kept prefill (and so frees it)."""
        doc = await request.json()
        k = self._let_go(str(doc.get("remote_request_id")))
        if k is None:
            return web.json_response({"error": "unknown or expired transfer"}, status=404)
        return web.json_response({"tokens": k.tokens})

    async def release(self, request: web.Request) -> web.Response:
        """The side channel: a decode replica's request ended before it read (vLLM notifies with no blocks)."""
        doc = await request.json()
        if self._let_go(str(doc.get("remote_request_id"))) is not None:
            self.released += 1
        return web.json_response({})

    async def transfers(self, request: web.Request) -> web.Response:
        """Not vLLM's: what it holds for decode replicas, for tests that nothing is stranded."""
        self.expire()
        return web.json_response({"held": len(self.kept), "tokens": sum(k.tokens for k in self.kept.values()),
                                  "loaded_tokens": self.loaded_tokens, "load_failures": self.load_failures,
                                  "released": self.released})

    # ------------------------------------------------------------ the decode side

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S))
        return self._session

    async def load(self, params: dict, local_tokens: int) -> int:
        """Load a prefill's KV beyond the ``local_tokens`` this replica's cache holds: the tokens loaded. The
        transfer takes its time first (vLLM's request waits in WAITING_FOR_REMOTE_KVS, the engine runs on)."""
        base = f"http://{params.get('remote_host')}:{params.get('remote_port')}"
        rrid = str(params.get("remote_request_id"))
        try:
            tokens = max(0, int(params.get("remote_num_tokens") or 0))
        except (TypeError, ValueError):
            tokens = 0
        n = max(0, tokens - local_tokens)
        try:
            if n and self.tokens_per_s > 0:
                await asyncio.sleep(n / self.tokens_per_s / self.speedup)
            async with self._http().post(base + "/kv/read", json={"remote_request_id": rrid}) as r:
                if r.status != 200:
                    raise LoadFailed(f"kv read answered {r.status}")
        except asyncio.CancelledError:
            # the client left before the load: tell the prefill replica, so its blocks do not wait out the lease
            asyncio.get_running_loop().create_task(self._release(base, rrid))
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self.load_failures += 1
            raise LoadFailed(type(e).__name__) from None
        except LoadFailed:
            self.load_failures += 1
            raise
        self.loaded_tokens += n
        return tokens

    async def _release(self, base: str, rrid: str) -> None:
        try:
            async with self._http().post(base + "/kv/release", json={"remote_request_id": rrid}):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass  # the lease frees it

    async def lease_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.expire()

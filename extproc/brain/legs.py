"""Prefill/decode disaggregation's two legs (docs/architecture.md "Who sends the prefill leg").

The brain sends the prefill leg itself: it holds the request's body already (Envoy sent it to be routed), so the
leg costs one HTTP request from the brain and no new proxy in the client's path. The leg is the client's request
with ``max_tokens`` 1, no stream and ``kv_transfer_params: {do_remote_decode: true}`` under the client's request id
(vLLM's ``toy_proxy_server.py``, llm-d's sidecar); the brain **awaits** it (both legs at once made vLLM's decode
wait out its KV load deadline: llm-d-router PR #2451), time-boxed by ``disaggregation.prefill_timeout_s``. Then
its answer to Envoy routes the client's request to the decode replica with the returned ``kv_transfer_params`` in
the body: Envoy carries the decode leg and the client's stream as any request.

What can go wrong, and what happens:
- the prefill leg fails or runs out of time: the decode replica computes the prompt itself (a local prefill is
  always possible); the client sees a slower first token, never an error;
- the client leaves (Envoy closes the call, or its access log says the decode leg never reached a replica): the
  leg runs to its end and the brain sends the decode replica the decode leg itself, one token, no stream: the
  decode replica takes the KV off the prefill replica's hands, so no blocks wait out their lease there (vLLM #50425:
  orphaned transfers exhaust a prefill replica). The leg is not cut short: a prefill can finish in the engine
  while the brain closes the connection, and vLLM then keeps its blocks for a reader that never comes (Dynamo PR
  #13855 and #14507 learned the same). Both reservations are released.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Callable

import aiohttp

from ..contract import REQUEST_ID_HEADER
from ..core.bounded import within
from . import logs
from ..picker.messages import path_of

if TYPE_CHECKING:
    from ..answers import Placed
    from ..core.decision import Decision

# what a prefill leg asks for (vLLM's toy proxy sends the same nulls: NIXL's scheduler reads them as "not yet")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
FORWARDED = ("authorization", "openai-organization", "openai-project")  # what the engine may check on a request
RELEASE_TIMEOUT_S = 30.0
# a prefill leg's answer is one token and the connector's kv_transfer_params (NIXL: block ids, a few KB at 100K
# tokens); read no more, so a replica's answer costs the brain a bounded parse
ANSWER_MAX_BYTES = 1 << 20


def prefill_body(doc: dict) -> bytes:
    """The prefill leg's body: the client's request, one token, no stream."""
    leg = dict(doc, max_tokens=1, stream=False)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return json.dumps(leg, separators=(",", ":")).encode()


def decode_body(doc: dict, params: dict, one_token: bool = False) -> bytes:
    """The decode leg's body: the client's request and the prefill's kv_transfer_params (``one_token``: the
    brain's own leg for a client gone, which only makes the decode replica take the KV off the prefill's hands)."""
    leg = dict(doc)
    leg["kv_transfer_params"] = params
    if one_token:
        leg.update(max_tokens=1, stream=False)
        leg.pop("max_completion_tokens", None)
        leg.pop("stream_options", None)
    return json.dumps(leg, separators=(",", ":")).encode()


class Legs:
    """One disaggregated request: ``run`` sends and awaits the prefill leg and returns the decode leg's placement;
    ``abandon`` when the call ends before that answer reached Envoy."""

    def __init__(self, brain, d: "Decision", headers: dict[str, str], doc: dict, path: str,
                 answer: "Callable[[bytes | None], Placed]"):
        self.brain, self.d, self.headers, self.doc, self.path = brain, d, headers, doc, path
        assert d.prefill is not None and d.reservation is not None  # a planned and reserved prefill leg
        self.plan, self.res = d.prefill, d.reservation
        self.answer = answer  # the decode replica's route answer, with this body (None: the client's own)
        self.params: dict | None = None

    async def run(self) -> "Placed":
        b, d = self.brain, self.d
        t0 = b.clock()
        self._leg = asyncio.ensure_future(within(self._prefill(), b.cfg.router.disaggregation.prefill_timeout_s))
        try:
            self.params = await asyncio.shield(self._leg)  # the client leaving does not cut it (see the docstring)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, _Refused) as e:
            # the decode replica prefills it itself: slower, never an error
            self._end_prefill(b.clock())
            b.stats.disaggregated["local_fallback"] += 1
            logs.event("prefill_leg_failed", replica=self.plan.replica.name, decode=d.replica_name,
                       error=type(e).__name__ if not isinstance(e, _Refused) else str(e))
            self.res.transfer_tokens = 0
            return self.answer(None)
        now = b.clock()
        self._end_prefill(now)
        self.res.leg_s = now - t0
        if self.params:
            self.res.handoff = self.never_sent
        b.stats.disaggregated["remote"] += 1
        # no params: a connector that finds the KV by the prompt itself (vLLM's ExampleConnector, shared storage)
        return self.answer(decode_body(self.doc, self.params) if self.params else None)

    def _end_prefill(self, now: float) -> None:
        self.brain.router.release(self.d.prefill_reservation, now)

    async def _prefill(self) -> dict | None:
        b = self.brain
        name = self.plan.replica.name
        url = b.scraper.urls.get(name)
        if url is None:
            raise _Refused("replica gone")
        headers = {"content-type": "application/json"}
        rid = self.headers.get(REQUEST_ID_HEADER)
        if rid:
            headers["x-request-id"] = rid  # one id for both legs
        for h in FORWARDED:
            if h in self.headers:
                headers[h] = self.headers[h]
        ctx = b.scraper.tls.get(name)
        async with b.legs_http().post(url + self.path, data=prefill_body(self.doc), headers=headers,
                                      ssl=ctx[0] if ctx else None,
                                      server_hostname=ctx[1] if ctx else None) as r:
            if r.status != 200:
                raise _Refused(f"status {r.status}")
            raw = await r.content.read(ANSWER_MAX_BYTES + 1)
        if len(raw) > ANSWER_MAX_BYTES:  # one token and the connector's params: a few KB; more is no prefill answer
            raise _Refused("answer too large")
        out = json.loads(raw)
        if not isinstance(out, dict):
            raise _Refused("not a JSON object")
        params = out.get("kv_transfer_params")
        return params if isinstance(params, dict) and params else None

    def abandon(self) -> None:
        """The call ended before Envoy took the answer: release what Envoy will never log, and let the prefill's
        blocks wait for no decode that never comes."""
        b = self.brain
        b.router.release(self.d.reservation, b.clock())
        b.stats.disaggregated["abandoned"] += 1
        leg = getattr(self, "_leg", None)
        if leg is None:  # the call ended before the leg was sent: nothing on the prefill replica but its booking
            self._end_prefill(b.clock())
            return
        _background(self._after(leg))

    def never_sent(self) -> None:
        """Envoy logged the request's end and no replica got the decode leg (the client left just after the answer)."""
        if self.params:
            self.brain.stats.disaggregated["abandoned"] += 1
            _background(self._release())

    async def _after(self, leg: asyncio.Future) -> None:
        try:
            self.params = await leg
        except BaseException:  # it failed or ran out of time: nothing to hand over
            self.params = None
        self._end_prefill(self.brain.clock())
        if self.params:
            await self._release()

    async def _release(self) -> None:
        """The decode leg for a client gone: one token, read and dropped (the decode replica takes the KV)."""
        b, name, params = self.brain, self.d.replica_name, self.params
        if not params or name is None:
            return
        url = b.scraper.urls.get(name)
        if url is None:
            return
        ctx = b.scraper.tls.get(name)
        headers = {"content-type": "application/json", **{h: self.headers[h] for h in FORWARDED if h in self.headers}}
        try:
            async with b.legs_http().post(url + self.path, data=decode_body(self.doc, params, one_token=True),
                                          headers=headers, ssl=ctx[0] if ctx else None,
                                          server_hostname=ctx[1] if ctx else None,
                                          timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)) as r:
                async for _ in r.content.iter_chunked(64 << 10):  # read to its end (the KV taken), kept nowhere
                    pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass  # the prefill replica's lease frees it


_TASKS: set[asyncio.Task] = set()  # hand-overs under way: a task nobody holds may be collected before it ends


def legs_of(brain, d: "Decision", headers: dict[str, str], body: bytes | None, phase: str,
            answer: "Callable[[bytes | None], Placed]") -> "Legs | None":
    """The two legs of a request the policy disaggregated (None: it is prefilled where it goes after all: no body to
    send, one that does not read, or a client doing its own disaggregation)."""
    doc = None
    if body is not None and phase == "request_body":
        try:
            doc = json.loads(body)
        except ValueError:
            pass
    if not isinstance(doc, dict) or "kv_transfer_params" in doc:
        brain.router.release(d.prefill_reservation, brain.clock())
        if d.reservation is not None:
            d.reservation.transfer_tokens = 0
        return None
    return Legs(brain, d, headers, doc, path_of(headers), answer)


def _background(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


class _Refused(Exception):
    """The prefill replica answered, but not with KV to hand over."""


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))


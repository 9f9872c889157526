"""Big bodies do not freeze the brain (issue 11 #5): its own stack, since it moves hundreds of MiB."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc.contract import FALLBACK_CLUSTER

pytestmark = pytest.mark.integration

SMALL_PER_S = 50
SMALL_SECONDS = 4.0
BIG = 8


def _stats(s) -> tuple[int, int, int]:
    st = s.envoy_stats()
    return (sum(r["decisions"] for r in s.state()["replicas"]),
            st.get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0),
            st.get(f"cluster.{FALLBACK_CLUSTER}.upstream_rq_total", 0))


def test_small_requests_are_all_decided_by_the_brain_while_8_bodies_of_32_mib_arrive(own_stack):
    s = own_stack(2)
    s.wait_all_live(30)
    big = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [
        {"role": "system", "content": "agent " * 100}, {"role": "user",
                                                        "content": "lorem ipsum " * (32 * 2**20 // 12)}]}).encode()
    assert len(big) >= 32 * 2**20
    small = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                  "content": "quick question"}]}).encode()
    before = _stats(s)
    headers_only = s.state()["bodies"].get("headers_only", 0)

    refused: list[bytes] = []

    async def run() -> tuple[list[int], list[int]]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async def post(body: bytes, session: str) -> int:
                async with http.post(s.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "x-session-id": session}) as r:
                    text = await r.read()
                    if r.status == 429:
                        refused.append(text[:300])
                    return r.status

            bigs = [asyncio.ensure_future(post(big, f"big-{i}")) for i in range(BIG)]
            smalls = []
            for i in range(int(SMALL_PER_S * SMALL_SECONDS)):
                smalls.append(asyncio.ensure_future(post(small, f"small-{i % 20}")))
                await asyncio.sleep(1 / SMALL_PER_S)  # the arrival rate, not synchronisation
            return list(await asyncio.gather(*bigs)), list(await asyncio.gather(*smalls))

    big_status, small_status = asyncio.run(run())
    # answered by a replica; beside a flood on the other test worker, flow control may refuse a few with 429 and
    # Retry-After (its design: a brain starved of CPU predicts long waits), never many
    assert set(small_status) <= {200, 429} and small_status.count(429) <= len(small_status) // 20, refused
    # 8M tokens fit no replica: the replica's own 400, which means the body got through Envoy and the brain
    assert big_status == [400] * BIG
    decided, allowed, fallback = _stats(s)
    # nothing failed open but what a busy machine's scheduling may: a small request past Envoy's 1 s message
    # timeout once in a while (seen once on CI beside the other tests). Copying big bodies onto the brain's loop
    # failed 67 of these 200 open
    opened = allowed - before[1]
    assert opened <= len(small_status) // 50 and fallback - before[2] == opened
    # ...the rest, big and small, the brain decided (a late answer Envoy no longer waited for may count too)
    assert BIG + len(small_status) - opened <= decided - before[0] <= BIG + len(small_status)
    # the big ones by their headers and size: their bytes never crossed to the brain
    assert s.state()["bodies"].get("headers_only", 0) - headers_only == BIG


def test_a_body_too_big_for_the_brain_keeps_its_session_from_a_body_field(own_stack):
    """A body past envoy.brain_body_max_bytes is decided on its headers and what Envoy reads of it: its model, and now
    its session field (a conversation_id here; Claude Code's metadata.user_id on the Messages API). Before, such a
    turn was routed as a one-shot: a long conversation's turns went wherever load sent them."""
    from extproc.tools.stack.local import wait_for

    from .test_envoy_stack import raw_post

    s = own_stack(3, config={"envoy": {"brain_body_max_bytes": 16384}})
    s.wait_all_live(30)
    served: dict[int, set[str]] = {k: set() for k in range(4)}
    for turn in range(3):
        for k in range(4):  # interleaved, so that load alone would spread each conversation
            body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "conversation_id": f"conv-{k}",
                               "messages": [{"role": "user", "content": f"conversation {k} turn {i} " * 900}
                                            for i in range(turn + 1)]}).encode()
            assert 16384 < len(body) < 64 * 1024  # past the brain's limit, under the look's size
            status, _, out = raw_post(s, body)
            assert status == 200, out[:300]
            served[k].add(json.loads(out)["system_fingerprint"])
    assert all(len(v) == 1 for v in served.values()), served
    st = wait_for(lambda: (x := s.state())["open_reservations"] == 0 and x, 20, "every reservation released")
    assert st["bodies"].get("headers_only", 0) >= 12  # each decided without its body

"""Prefill/decode disaggregation through Envoy, on mock replicas that exchange KV as vLLM's NIXL connector does
(issue 48): r0 and r1 of role prefill, r2 and r3 of role decode.

A prompt's prefill goes to a prefill replica only when the cost model says so: here, when the decode replicas run
long streams that a local prefill would stall. Each test makes that load itself and reads the decision of its own
request (GET /decisions by the x-request-id Envoy gave it), never a cumulative counter of the shared stack.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import aiohttp
import pytest

from extproc.tools.stack.local import Stack, http_post_json, wait_for
from extproc.tools.stack.procs import StackError

from .conftest import FAST

pytestmark = pytest.mark.integration

SPEEDUP = 4.0
KV = ["--kv-transfer-tokens-per-s", "100000", "--kv-lease-s", "600", "--kv-load-failure-policy", "recompute",
      "--speedup", str(SPEEDUP), "--kv-tokens", "400000"]
ROLES = {"r0": "prefill", "r1": "prefill", "r2": "decode", "r3": "decode"}
CONFIG = {**FAST, "disaggregation": {"transfer_tokens_per_s": 100000 * SPEEDUP}}
MODEL = "mock-coder-30b"


@pytest.fixture(scope="module")
def pd():
    s = Stack(4, config=CONFIG, mock_args=KV)
    s.replica_config = {name: {"role": role} for name, role in ROLES.items()}
    with s:
        s.wait_all_live(60)
        yield s


def body(tag: str, tokens: int, out: int, stream: bool = True) -> dict:
    # the mock counts 4 characters a token; a tag first so no two prompts share a cached prefix
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} " + "abcd" * tokens}], "max_tokens": out,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


async def send(session: aiohttp.ClientSession, url: str, doc: dict) -> dict:
    """One request: status, Envoy's request id, who served it, the usage, whether the stream ended properly."""
    async with session.post(url + "/v1/chat/completions", json=doc) as r:
        out = {"status": r.status, "rid": r.headers.get("x-request-id"), "usage": None, "done": False}
        if not doc.get("stream"):
            got = await r.json(content_type=None)
            out.update(usage=got.get("usage"), replica=got.get("system_fingerprint"), done=r.status == 200)
            return out
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                out["done"] = True
            elif line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                out["replica"] = chunk.get("system_fingerprint")
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
        return out


def decision(stack: Stack, rid: str) -> dict:
    return json.loads(stack.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]


def disaggregated(stack: Stack, outcome: str) -> float:
    """The brain's count of disaggregated requests that ended so (this module's tests run one at a time)."""
    text = urllib.request.urlopen(stack.brain_metrics, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'warmroute_disaggregated_total{{outcome="{outcome}"}}'))


def replica_url(stack: Stack, name: str) -> str:
    return next(r.url for r in stack.replicas if r.name == name)


def replica_json(stack: Stack, name: str, path: str) -> dict:
    with urllib.request.urlopen(replica_url(stack, name) + path, timeout=5) as r:
        return json.loads(r.read())


async def busy_decoders(session: aiohttp.ClientSession, url: str, n: int = 8, tag: str = "bg") -> list[asyncio.Task]:
    """Long streams on the decode replicas: what a local prefill of a long prompt would stall."""
    tasks = [asyncio.create_task(send(session, url, body(f"{tag}{i}-{random.random()}", 300, 1500))) for i in range(n)]
    await asyncio.sleep(1.0)
    return tasks


def test_on_an_idle_fleet_a_long_prompt_stays_where_it_is_decoded(pd):
    # first in the module: nothing decoding and nothing arrived lately (a prefill also stalls the streams expected to
    # join during it)
    wait_for(lambda: all(r["effective_running"] == 0 for r in pd.state()["replicas"]), 30, "an idle fleet")

    async def run():
        async with aiohttp.ClientSession() as s:
            return await send(s, pd.url, body(f"idle-{random.random()}", 12000, 8))

    got = asyncio.run(run())
    assert got["status"] == 200 and decision(pd, got["rid"])["prefill_replica"] is None


def test_a_long_prompt_beside_running_decodes_is_prefilled_remotely_and_decoded_from_its_kv(pd):
    async def run():
        async with aiohttp.ClientSession() as s:
            bg = await busy_decoders(s, pd.url)
            got = await send(s, pd.url, body(f"long-{random.random()}", 12000, 16))
            # a dozen tokens: a prefill below a decode step's tie at any rate a loaded machine's mocks are learned at
            # (40 tokens were priced worth a leg once: 8 streams decoding beside a mock learned at ~3K tokens/s)
            short = await send(s, pd.url, body(f"short-{random.random()}", 12, 8))
            rest = await asyncio.gather(*bg)
            return got, short, rest

    got, short, rest = asyncio.run(run())
    assert got["status"] == 200 and got["done"], got
    d = decision(pd, got["rid"])
    assert d["prefill_replica"] in ("r0", "r1") and d["replica"] in ("r2", "r3"), d
    assert got["replica"] == d["replica"]
    # the decode replica never saw this prompt: what it counts cached it loaded from the prefill replica
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.95 * got["usage"]["prompt_tokens"], got
    # a short prompt is not worth a transfer: prefilled where it is decoded
    assert short["status"] == 200 and decision(pd, short["rid"])["prefill_replica"] is None
    assert all(r["status"] == 200 and r["done"] for r in rest)
    # the prefill replica let go of the blocks once the decode replica read them
    wait_for(lambda: replica_json(pd, d["prefill_replica"], "/admin/kv_transfers")["held"] == 0, 10, "KV handed over")
    # the decode leg's first byte, timed by Envoy and read from its access-log entry (the log door's "uft"), taught the
    # transfer rate: it is no longer the configured prior
    prior = CONFIG["disaggregation"]["transfer_tokens_per_s"]
    wait_for(lambda: transfer_rate(pd) != prior, 10, "the transfer rate learned from the decode leg")


def transfer_rate(stack: Stack) -> float:
    text = urllib.request.urlopen(stack.brain_metrics, timeout=5).read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("warmroute_kv_transfer_tokens_per_second"))


def test_a_prefill_replica_killed_mid_leg_fails_no_client(pd):
    """Both prefill replicas die while legs run: every request is answered by the decode replica it was routed to,
    which prefills it itself (not by Envoy's fail-open route: the brain answered)."""
    fallbacks = disaggregated(pd, "local_fallback")

    async def run():
        async with aiohttp.ClientSession() as s:
            bg = await busy_decoders(s, pd.url, tag="kill-p")
            long = [asyncio.create_task(send(s, pd.url, body(f"kp{i}-{random.random()}", 12000, 8))) for i in range(4)]

            def leg_under_way():  # a prefill leg holds its reservation on its replica while it runs
                return any(r["wlc_in_flight"] > 0 for r in pd.state()["replicas"] if r["name"] in ("r0", "r1")) or None

            await asyncio.to_thread(wait_for, leg_under_way, 20, "a prefill leg under way")
            pd.kill_replica("r0")
            pd.kill_replica("r1")
            return await asyncio.gather(*long), await asyncio.gather(*bg)

    try:
        long, rest = asyncio.run(run())
        assert all(r["status"] == 200 and r["done"] for r in long + rest), [r["status"] for r in long + rest]
        split = [(r, decision(pd, r["rid"])) for r in long]
        assert any(d["prefill_replica"] for _, d in split)
        assert all(r["replica"] == d["replica"] for r, d in split)
        assert disaggregated(pd, "local_fallback") > fallbacks
    finally:
        pd.restart_replica("r0")
        pd.restart_replica("r1")
        pd.wait_all_live(60)


def test_a_decode_replica_killed_after_its_prefill_fails_no_client(pd):
    """The decode replica dies while it loads the KV: Envoy retries the decode leg on the other decode replica, which
    loads it (the prefill replica still holds it) or computes it."""
    decoders = ("r2", "r3")
    fast = {"kv_tokens_per_s": float(KV[KV.index("--kv-transfer-tokens-per-s") + 1])}
    # a slow KV link on the decode side holds a load open for seconds (30,000 tokens at 2,500 tok/s, 4x sped up: 3 s),
    # so the kill lands inside it however loaded the machine is (at the module's rate it lasts 75 ms)
    for n in decoders:
        http_post_json(replica_url(pd, n) + "/admin/fault", {"kv_tokens_per_s": 2500})

    async def run():
        async with aiohttp.ClientSession() as s:
            # streams sent to each decode replica directly (as the brain would place them, they may all land on one,
            # and the other, idle, then prefills the long prompt itself: nothing to kill), seen by the brain's scrapes
            bg = [asyncio.create_task(send(s, replica_url(pd, n), body(f"kill-d{n}{i}-{random.random()}", 300, 1500)))
                  for n in decoders for i in range(4)]
            await asyncio.to_thread(wait_for, lambda: all(r["scraped_running"] >= 4 for r in pd.state()["replicas"]
                                                          if r["name"] in decoders), 20, "both decode replicas busy")

            def leg_done():
                if not any(replica_json(pd, n, "/admin/kv_transfers")["held"] for n in ("r0", "r1")):
                    return None
                last = json.loads(pd.admin_get("/decisions?last=1"))["decisions"][-1]
                return last if last["prefill_replica"] else None

            # the cost model decides whether a prompt's prefill goes to a prefill replica: on a loaded machine it
            # may compute one locally (nothing to kill then), so a few requests are sent until one is disaggregated
            for attempt in range(3):
                task = asyncio.create_task(send(s, pd.url, body(f"kd-{random.random()}", 30000, 8)))
                try:
                    d = await asyncio.to_thread(wait_for, leg_done, 20, "a prefill leg handed over")
                    break
                except StackError:
                    if attempt == 2:
                        raise
                    await task
            # the retry loads at the usual speed
            for n in decoders:
                if n != d["replica"]:
                    await asyncio.to_thread(http_post_json, replica_url(pd, n) + "/admin/fault", fast)
            pd.kill_replica(d["replica"])
            got = await task
            rest = await asyncio.gather(*bg, return_exceptions=True)
            return d, got, rest

    killed = None
    try:
        d, got, rest = asyncio.run(run())
        killed = d["replica"]
        assert got["status"] == 200 and got["done"], got
        assert got["replica"] != killed
    finally:
        if killed:
            pd.restart_replica(killed)
        pd.wait_all_live(60)
        for n in decoders:
            http_post_json(replica_url(pd, n) + "/admin/fault", fast)


def test_clients_that_leave_between_the_legs_leave_nothing_behind(pd):
    """200 clients give up at random moments around their prefill legs: every reservation is released and no
    prefill replica keeps KV for a decode that never comes (the mocks' lease is 600 s: only a release frees it)."""
    async def run():
        async with aiohttp.ClientSession() as s:
            bg = await busy_decoders(s, pd.url, n=10, tag="leave")

            async def leave(i):
                try:
                    await asyncio.wait_for(send(s, pd.url, body(f"lv{i}-{random.random()}", 3000, 8)),
                                           random.uniform(0.05, 0.6))
                except asyncio.TimeoutError:
                    return "left"
                return "answered"

            outcomes = []
            for k in range(0, 200, 20):
                outcomes += await asyncio.gather(*(leave(i) for i in range(k, k + 20)))
            await asyncio.gather(*bg)
            return outcomes

    outcomes = asyncio.run(run())
    assert outcomes.count("left") >= 100, outcomes.count("left")
    wait_for(lambda: pd.state()["open_reservations"] == 0, 30, "every reservation released")
    wait_for(lambda: sum(replica_json(pd, n, "/admin/kv_transfers")["held"] for n in ("r0", "r1")) == 0, 30,
             "no KV left on the prefill replicas")
    m = urllib.request.urlopen(pd.brain_metrics, timeout=5).read().decode()
    assert any(line.startswith("warmroute_disaggregated_total") and "abandoned" not in line
               and float(line.rsplit(" ", 1)[1]) > 0 for line in m.splitlines()), "no request was disaggregated"

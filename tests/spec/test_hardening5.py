"""Hardening, fifth round (issue 59), the parts that need no process: each test fails on the code before it."""

from __future__ import annotations

import pytest

from extproc.brain.scraper import parse_vllm_metrics
from ..helpers import envoy_decide

RUNNING = 'vllm:num_requests_running{model_name="m"} 1\n'


@pytest.mark.parametrize("label", ['block_size="²"', 'kv_cache_size_tokens="٣٣",block_size="16"',
                                   'num_gpu_blocks="10",block_size="１６"'])
def test_a_unicode_digit_in_a_label_is_no_number_and_no_crash(label):
    """``"²".isdigit()`` is true and ``int("²")`` raises: the label is ignored, the scrape still reads the load."""
    r = parse_vllm_metrics(RUNNING + f'vllm:cache_config_info{{{label},enable_prefix_caching="True"}} 1.0\n'
                           'vllm:lora_requests_info{max_lora="³",running_lora_adapters="",waiting_lora_adapters=""} 1\n')
    assert r.ok and r.running == 1
    assert r.sample.engine_block in (None, 16)



def test_a_metrics_text_the_parser_did_not_foresee_fails_that_scrape_and_never_ends_the_scraping(monkeypatch):
    """Whatever the parser raises on a replica's text is that scrape's failure, with its kind: the replica's scrape
    task (which died every 0.5 s on block_size="²") keeps running."""
    import asyncio

    from extproc.brain import scraper as sc
    from extproc.brain.exposition import DIALECTS
    from extproc.brain.stats import BrainStats

    from ..helpers import live_router

    def boom(*a, **k):
        raise OverflowError("a text nobody foresaw")

    monkeypatch.setattr(sc, "parse_metrics", boom)
    router, t = live_router(1)
    s = sc.Scraper(router, BrainStats(), lambda: t, 3.0)
    r = asyncio.run(s._parse(RUNNING, DIALECTS["vllm"]))
    assert not r.ok and r.error == "unreadable /metrics (OverflowError)"

# ------------------------------------------------------------------ a client's own kv_transfer_params (finding 4)

def _brain(**extra):
    from extproc.config import parse_config

    from ..helpers import live_brain

    return live_brain(parse_config({"replicas": [{"name": f"r{i}",
                                                  "url": f"http://127.0.0.1:{8001 + i}"} for i in range(2)],
                                    "flow_control": {"enabled": False}, **extra}))


def _sent_body(out, body: bytes) -> bytes:
    m = out.request_body.response.body_mutation
    return m.body if m.HasField("body") else body


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"remote_host": '
    b'"10.9.9.9", '
    b'"remote_port": 5600, "remote_block_ids": [1, 2], "remote_request_id": "victim", "do_remote_prefill": true}}',
    # the same key as the engine's parser reads it: escaped, duplicated, beside a NaN only Python's json reads
    b'{"model": "m", "messages": [], "kv\\u005ftransfer_params": {"remote_host": "10.9.9.9"}}',
    b'{"kv_transfer_params": null, "temperature": NaN, "kv_transfer_params": {"remote_host": "10.9.9.9"}, "model": "m"}',
])
def test_a_client_s_own_kv_transfer_params_never_reach_an_engine(body):
    import json

    b = _brain()
    out = envoy_decide(b, {"x-session-id": "s", ":path": "/v1/chat/completions"}, body)
    assert out.WhichOneof("response") == "request_body"
    sent = json.loads(_sent_body(out, body))
    assert "kv_transfer_params" not in sent and sent["model"] == "m"


def test_a_body_too_big_to_parse_is_searched_for_them_and_on_a_prefill_fleet_for_escaped_spellings_too():
    """Above the warm policy's parse limit (256 KiB) the brain reads no document: the key is searched in the bytes;
    an escaped spelling is searched for where a connector certainly reads the field (a fleet with prefill replicas)."""
    import json

    big = "x" * 400_000
    literal = json.dumps({"model": "m", "messages": [{"role": "user", "content": big}],
                          "kv_transfer_params": {"remote_host": "10.9.9.9"}}).encode()
    escaped = literal.replace(b'"kv_transfer_params"', b'"kv\\u005ftransfer_params"')
    b = _brain()
    out = envoy_decide(b, {"x-session-id": "s", ":path": "/v1/chat/completions"}, literal)
    assert "kv_transfer_params" not in json.loads(_sent_body(out, literal))
    pd = _brain(replicas=[{"name": "p0", "url": "http://127.0.0.1:8001", "role": "prefill"},
                          {"name": "d0", "url": "http://127.0.0.1:8002"}])
    out = envoy_decide(pd, {"x-session-id": "s", ":path": "/v1/chat/completions"}, escaped)
    if not hasattr(out, "WhichOneof"):  # the brain disaggregated it: the prefill leg's document is what it sends
        assert "kv_transfer_params" not in out.doc
        out.abandon()
    else:
        assert "kv_transfer_params" not in json.loads(_sent_body(out, escaped))


def test_a_body_without_them_is_sent_as_it_came():
    b = _brain()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 \\u4e2d"}]}'
    out = envoy_decide(b, {"x-session-id": "s", ":path": "/v1/chat/completions"}, body)
    assert not out.request_body.response.body_mutation.HasField("body")


def test_a_body_too_big_for_the_brain_that_names_them_is_refused_in_openai_s_shape():
    """Envoy's json_to_metadata reads a body above brain_body_max_bytes: the flag it sets is answered 400."""
    import json

    from extproc.core.profile import BODY_KV_TRANSFER_KEY

    b = _brain()
    out = envoy_decide(b, {"x-session-id": "s", ":path": "/v1/chat/completions", "content-length": "5000000",
                    BODY_KV_TRANSFER_KEY: "1"}, None, "request_headers")
    assert out.immediate_response.status.code == 400
    assert json.loads(out.immediate_response.body)["error"]["code"] == "kv_transfer_params_not_allowed"


# ------------------------------------------------------------------ stored responses (finding 5)

def test_a_client_chosen_response_id_is_scoped_by_the_credential_by_default():
    """No tenant configured: an attacker that stored under the victim's chosen id first made the victim's follow-ups
    read the attacker's response (4 of 12 rounds). Each credential's ids are its own now."""
    import orjson

    from extproc.contract import METADATA_NAMESPACE

    def cluster(out) -> str:
        return out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields["cluster"].string_value

    def create(who: dict, session: str, text: str):
        return envoy_decide(b, {":path": "/v1/responses", "x-session-id": session, **who},
                        orjson.dumps({"model": "m", "input": text, "request_id": "shared-id"}))

    def read(who: dict) -> str:
        return cluster(envoy_decide(b, {":path": "/v1/responses/shared-id", ":method": "GET", **who}, None, "request_headers"))

    b = _brain(replicas=[{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(4)])
    attacker, victim = {"authorization": "Bearer attacker"}, {"authorization": "Bearer victim"}
    attacker_home = cluster(create(attacker, "a", "mine " * 500))
    # the attacker's replica takes no new work: where the victim's create goes is the victim's own choice, not the
    # id's first writer's (without the scope the brain sent it to the attacker's response, or its follow-ups there)
    b.router.drain(attacker_home)
    victim_home = cluster(create(victim, "v", "the victim's own"))
    assert victim_home != attacker_home
    assert read(victim) == victim_home and read(attacker) == attacker_home
    # a retry of the victim's create under its own id goes where its response lives, whatever the session says
    assert cluster(create(victim, "elsewhere", "retry " * 800)) == victim_home


def test_follow_ups_of_one_stored_response_are_held_like_any_request_bound_to_one_replica():
    """40 follow-ups of one response were all placed on its replica at once, 20.6 s predicted there, none held."""
    from extproc.core import Reason
    from extproc.core.flow import FlowControl

    from ..helpers import chain, live_router, prof
    from ..core.test_warm import WARM

    router, t = live_router(2, WARM)
    router.flow = FlowControl(hold_on_wait=True)
    # a long prefill on r0: r0 is saturated for a while
    router.select(prof(session="big", tokens=200_000, blocks=chain("big", "x", 200_000)), t, only=["r0"])
    held = [router.select(prof(session=f"f{k}", tokens=4000, blocks=chain("big", f"f{k}", 4000)), t + 0.1,
                          holder="r0", hold_key=f"f{k}") for k in range(5)]
    assert all(d.reason is Reason.HELD and d.reservation is None for d in held)
    # when r0 has room, they go there, and only there, whatever else has room
    router.release_started_before(t + 0.05, t + 0.2)
    placed = router.offer(t + 0.2)
    assert placed and all(d.replica.name == "r0" and d.reason is Reason.HOLDER and d.reservation is not None
                          for _, d in placed)


# ------------------------------------------------------------------ the picker's held-open uploads (finding 2)

def test_the_picker_books_an_upload_decided_past_its_byte_limit_only_once_its_body_has_arrived():
    """Four 2.5 MB uploads declaring 15 MB each, held open, left ~291K pending KV tokens per replica and every new
    session refused for ~55 s: a body still arriving reaches no engine. Booked when its last byte has passed."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.config import parse_config
    from extproc.picker import EndpointPicker

    from ..helpers import live_brain

    b = live_brain(parse_config({"replicas": [{"name": f"r{i}",
                                               "url": f"http://127.0.0.{i + 1}:8000"} for i in range(2)],
                                 "brain": {"protocol": "endpoint-picker"},
                                 # KV for four million tokens: a declared 15 MB (a million by its size) is a prompt
                                 # these replicas take
                                 "warm": {"cache_tokens": 4_000_000}}))

    def pending() -> int:
        return sum(b.router.policy.state_of(r).pending_tokens for r in b.router.replicas)

    class Held:
        def __init__(self, msgs):
            self.q: asyncio.Queue = asyncio.Queue()
            for m in msgs:
                self.q.put_nowait(m)
            self.out: list = []

        async def read(self):
            return await self.q.get()

        async def write(self, msg):
            self.out.append(msg)

    def head(i: int) -> ep.ProcessingRequest:
        req = ep.ProcessingRequest()
        for k, v in {":method": "POST", ":path": "/v1/chat/completions", "x-session-id": f"up{i}",
                     "content-length": "15000000"}.items():
            req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
        return req

    chunk = b"x" * (512 * 1024)

    async def scenario():
        front = EndpointPicker(b.picks.pick, b.picks.end, b.cfg.envoy.brain_body_max_bytes, b.clock,
                               arrived=lambda res: b.router.arrived(res, b.clock()))
        ctxs = [Held([head(i), *(ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk)) for _ in range(5))])
                for i in range(4)]
        tasks = [asyncio.create_task(front.Process(None, c)) for c in ctxs]
        for _ in range(200):
            await asyncio.sleep(0)
            if all(c.out for c in ctxs):
                break
        assert all(c.out and c.out[0].WhichOneof("response") == "request_headers" for c in ctxs)  # decided, on its way
        held_open = pending()
        ctxs[0].q.put_nowait(ep.ProcessingRequest(request_body=ep.HttpBody(body=b"}", end_of_stream=True)))
        for _ in range(200):
            await asyncio.sleep(0)
            if pending() > held_open:
                break
        arrived = pending()
        for c in ctxs:
            c.q.put_nowait(grpc.aio.EOF)
        await asyncio.gather(*tasks)
        return held_open, arrived

    held_open, arrived = asyncio.run(scenario())
    assert held_open == 0  # four uploads held open: nothing pending on any replica
    assert arrived > 100_000  # the one that arrived is booked at its declared size
    assert b.router.open_reservations == 0 and pending() == 0  # and everything goes when the streams end


# --- finding 3: a peer's blast radius ---------------------------------------------------------------------------

def _brains(tmp_path, n: int = 2, **cfg):
    """``n`` brains' shared-state shells over their own routers, one fleet secret between them."""
    import os

    from extproc.brain.shared import SharedState
    from extproc.config import SharedStateConfig
    from extproc.core import RouterConfig
    from extproc.tools.stack.redis_server import free_port

    from ..helpers import live_router

    secret = tmp_path / "secret"
    secret.write_text("k" * 32)
    os.chmod(secret, 0o600)
    out = []
    for _ in range(n):
        router, now = live_router(4, RouterConfig())
        out.append(SharedState(SharedStateConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0",
                                                 secret_file=str(secret), **cfg), router, lambda now=now: now))
    return out, now


def _signed(brain, now: float, events: list, origin: str | None = None) -> dict:
    """An entry ``brain`` signs (its own key, and the fleet's MAC), optionally claiming another ``origin``."""
    import time

    import orjson

    from extproc.brain.shared import _mac, _signed_parts

    if origin is None:
        return {k.encode(): v for k, v in brain._fields(events, now)[0].items()}
    o, t, w = origin.encode(), repr(now).encode(), repr(time.time()).encode()
    e = orjson.dumps(events)
    return {b"o": o, b"t": t, b"w": w, b"e": e, b"k": brain.public_key,
            b"s": brain._signing.sign(_signed_parts(o, t, w, e)), b"m": _mac(brain.key, o, t, w, e)}


def test_a_brain_with_the_fleet_secret_cannot_write_as_another(tmp_path):
    """Each brain signs with a key of its own, named in its origin: an entry under a live brain's id that its key did
    not sign is dropped (the fleet's MAC on it verifies: the secret alone said nothing of who wrote it)."""
    (victim, attacker, reader), now = _brains(tmp_path, 3)
    forged = [("o", k, f"r{k % 3}", None, 1000, False, 3333.0, 3333.0, 0, None, 0, now) for k in range(9)]
    reader._apply_entries([(b"1-0", _signed(attacker, now, forged, origin=victim.id)),
                           (b"2-0", _signed(victim, now, []))])
    assert reader.stats.rejected == {"entry_not_signed_by_origin": 1}
    assert sum(r.in_flight_requests for r in reader.router.replicas) == 0
    assert set(reader.peers) == {victim.id}  # the real one is heard
    # a key whose fingerprint the origin does not name is no better
    o = attacker.id.rsplit("~", 1)[0] + "~" + victim.id.rsplit("~", 1)[1]
    reader._apply_entries([(b"3-0", _signed(attacker, now, forged, origin=o))])
    assert reader.stats.rejected == {"entry_not_signed_by_origin": 2}
    # under its own origin its entries are applied: bounded by what one brain may claim (below)
    reader._apply_entries([(b"4-0", _signed(attacker, now, forged[:1]))])
    assert sum(r.in_flight_requests for r in reader.router.replicas) == 1


def test_what_one_origin_claims_is_bounded_by_what_a_brain_can_do(tmp_path):
    """An hour of work per reservation on every replica refused every new session; 20 index entries added +557 MB.
    Another brain's reservation is priced at most as one request can be on that replica (by this brain's own view),
    its pending tokens on one replica at most that replica's KV, its open reservations at most
    peer_max_reservations, its chains at most a context's blocks each."""
    from extproc.core.shared import _MAX_CHAIN_BLOCKS

    (attacker, reader), now = _brains(tmp_path, 2, peer_max_reservations=6)
    router = reader.router
    forged = [("o", k, f"r{k % 4}", None, 1000, False, 3333.0, 3333.0, 0, None, 0, now) for k in range(4)]
    reader._apply_entries([(b"1-0", _signed(attacker, now, forged))])
    for r in router.replicas:
        st = router.policy.state_of(r)
        assert st.prefill_busy_until - now <= 1.0 + 1e-9  # no tokens: no prefill to speak of
        assert st.work_s <= 2.0 + 4 * 8192 * st.rates.decode_s_per_token
    # a prefill of P tokens claimed as an hour: booked as at most 4 x P at the learned rate, + 1 s
    st3 = router.policy.state_of(router.replicas[3])
    reader._apply_entries([(b"1-1", _signed(attacker, now, [("c", 3)]))])
    before = st3.prefill_busy_until
    reader._apply_entries([(b"1-2", _signed(attacker, now, [("o", 3, "r3", None, 1000, False, 3333.0, 3333.0, 10_000,
                                                             None, 10_000, now)]))])
    assert st3.prefill_busy_until - max(before, now) == pytest.approx(
        4 * 10_000 / st3.rates.prefill_tokens_per_s + 1.0, rel=1e-6)
    kv = router.policy.state_of(router.replicas[0]).cache_tokens
    more = [("o", 10, "r0", None, 1000, False, 1.0, 1.0, kv, None, kv, now),  # a whole KV's worth: fits alone
            ("o", 11, "r0", None, 1000, False, 1.0, 1.0, 1, None, 1, now),  # one token past it: refused
            ("o", 12, "r1", None, 1000, False, 1.0, 1.0, 0, None, 0, now),  # the 6th open
            ("o", 13, "r1", None, 1000, False, 1.0, 1.0, 0, None, 0, now),  # the 7th: refused
            ("i", "r0", None, 1, 0, None, list(range(_MAX_CHAIN_BLOCKS + 1)))]  # a chain no context has
    reader._apply_entries([(b"2-0", _signed(attacker, now, more))])
    assert router.remote.refused == {"reservations": 1, "pending_tokens": 1, "blocks": 1}
    assert sum(r.in_flight_requests for r in router.replicas) == 6 and router.remote.blocks == 0
    # closes give the room back
    reader._apply_entries([(b"3-0", _signed(attacker, now, [("c", 10), ("c", 0)]))])
    reader._apply_entries([(b"4-0", _signed(attacker, now, [more[1], more[3]]))])
    assert sum(r.in_flight_requests for r in router.replicas) == 6 and router.remote.refused["reservations"] == 1


def test_past_max_peers_a_new_origin_is_not_heard_until_one_falls_silent(tmp_path):
    brains, now = _brains(tmp_path, 4, max_peers=2)
    reader = brains[-1]
    for k, b in enumerate(brains[:3]):
        reader._apply_entries([(f"{k + 1}-0".encode(), _signed(b, now, []))])
    assert set(reader.peers) == {brains[0].id, brains[1].id}
    assert reader.stats.rejected == {"too_many_peers": 1}


def test_a_large_entry_is_applied_in_slices_with_decisions_between_them(tmp_path):
    """An 8 MiB entry applied whole stalled both brains 460 ms: now the event loop runs what waits between slices
    of it (counted here as the turns another task gets while one entry is applied)."""
    import asyncio

    (origin, reader), now = _brains(tmp_path, 2)
    events = [("i", f"r{k % 4}", None, k, 0, None, list(range(k * 1000, k * 1000 + 1000))) for k in range(600)]
    entries = [(f"{k + 1}-0".encode(), f) for k, f in enumerate(origin._fields(events, now))]
    entries = [(eid, {k.encode(): v for k, v in f.items()}) for eid, f in entries]

    async def run(entries) -> int:
        turns = 0
        done = False

        async def other() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        t0 = turns
        await reader._apply_sliced(entries)
        done = True
        await task
        return turns - t0

    assert asyncio.run(run(entries)) >= 3
    assert reader.router.remote.blocks == 600_000 and reader.stats.rejected == {}
    # entries rejected for their signature cost ~0.2 ms each to check: a batch of them yields between slices too
    forged = []
    for k in range(400):
        f = _signed(origin, now, [])
        forged.append((f"{1000 + k}-0".encode(), {**f, b"s": bytes(64)}))
    assert asyncio.run(run(forged)) >= 2
    assert reader.stats.rejected == {"entry_not_signed_by_origin": 400}


def test_a_flush_of_more_than_a_peer_reads_goes_as_several_entries(tmp_path):
    from extproc.brain.shared import _ENTRY_MAX_BYTES

    (brain, reader), now = _brains(tmp_path, 2)
    events = [("i", "r0", None, k, 0, None, list(range(10**12, 10**12 + 4000))) for k in range(200)]  # ~11 MB
    fields = brain._fields(events, now)
    assert len(fields) > 4 and all(len(f["e"]) <= _ENTRY_MAX_BYTES for f in fields)
    reader._apply_entries([(f"{k + 1}-0".encode(), {a.encode(): v for a, v in f.items()}) for k,
                           f in enumerate(fields)])
    assert reader.stats.rejected == {} and reader.router.remote.blocks == 800_000


def test_the_brain_gives_a_burst_s_freed_c_heap_back_on_its_tick(monkeypatch):
    """After a flood the brain stayed at 218 MB from 78, its objects long gone: glibc kept the pages. Every ~10 s
    (40 ticks) the tick loop gives them back with malloc_trim, off the event loop (glibc here; elsewhere there is
    nothing to call and nothing is done)."""
    import asyncio
    import threading
    import time
    import types

    from extproc.brain import server

    real = server._libc_trim()
    assert real is not None and real(0) in (0, 1)  # glibc's, callable as the tick calls it
    calls: list[str] = []
    monkeypatch.setattr(server, "_libc_trim", lambda: lambda pad: calls.append(threading.current_thread().name) or 1)
    monkeypatch.setattr(server, "TICK_S", 0.0)
    brain = types.SimpleNamespace(tick=lambda: None, ledger=types.SimpleNamespace(forget_released=lambda: None))

    async def go() -> None:
        task = asyncio.create_task(server._tick_loop(brain))
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert len(calls) >= 2 and threading.main_thread().name not in calls

"""Hardening, third round (issue 30), on a live stack: upstreams that behave as real servers do."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc.tools.stack.local import http_post_json, wait_for

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def _body(session: str) -> bytes:
    return json.dumps({"model": "mock-coder-30b", "max_tokens": 2,
                       "messages": [{"role": "user", "content": f"{session} question"}]}).encode()


async def _posts(url: str, sessions: list[str]) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def one(session: str) -> tuple[int, str]:
            async with http.post(url + CHAT, data=_body(session), headers={
                    "content-type": "application/json", "x-session-id": session}) as r:
                text = await r.text()
                return r.status, json.loads(text).get("system_fingerprint", "") if r.status == 200 else text

        return list(await asyncio.gather(*(one(s) for s in sessions)))


def _retries(s) -> int:
    return sum(v for k, v in s.envoy_stats().items() if k.startswith("cluster.") and k.endswith(".upstream_rq_retry"))


def test_a_replica_that_dies_slowly_loses_no_request_it_had_not_answered(own_stack):
    """A killed vLLM's port stays open up to 1.3 s, resetting every request that reaches it: Envoy retries them
    elsewhere (any reset before the first response byte), so a session pinned there, six requests at once, all
    succeed."""
    s = own_stack(3)
    s.wait_all_live(30)
    [(status, home)] = asyncio.run(_posts(s.url, ["pinned"]))
    assert status == 200
    victim = next(r for r in s.replicas if r.name == home)
    retries = _retries(s)
    http_post_json(victim.url + "/admin/fault", {"die_slowly_s": 3.0, "die_for_s": 2.0})
    got = asyncio.run(_posts(s.url, ["pinned"] * 6))
    assert [st for st, _ in got] == [200] * 6, got
    assert all(fp != home for _, fp in got)  # each answered by another replica...
    assert _retries(s) > retries  # ...after Envoy's retry of the reset it met on the dying one


_AS_ANOTHER_USER = r'''
import json, os, socket, sys, urllib.error, urllib.request
admin_sock, brain_admin = sys.argv[1], sys.argv[2]
out = {"mode": oct(os.stat(admin_sock).st_mode & 0o777)}  # reached: the socket's own mode is what refuses
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(admin_sock)
    s.sendall(b"POST /quitquitquit HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    out["envoy_admin"] = s.recv(100).decode(errors="replace")
except OSError as e:
    out["envoy_admin"] = type(e).__name__
for path in ("/state", "/pins/session/x"):
    try:
        urllib.request.urlopen(brain_admin + path, timeout=5)
        out[path] = 200
    except urllib.error.HTTPError as e:
        out[path] = e.code
print(json.dumps(out))
'''


def test_another_local_user_can_neither_stop_envoy_nor_read_the_brain_s_state(own_stack):
    """As uid nobody, POST /quitquitquit to Envoy's admin stopped the data plane, and /state and /pins answered."""
    import os
    import subprocess

    s = own_stack(2)
    s.wait_all_live(30)
    # the socket's own mode is what refuses: its directory is left open to others for this test
    os.chmod(os.path.dirname(s.envoy_admin_path), 0o755)
    p = subprocess.run(["/usr/bin/python3", "-c", _AS_ANOTHER_USER, s.envoy_admin_path, s.brain_admin],
                       capture_output=True, text=True, timeout=60, user="nobody", cwd="/")
    got = json.loads(p.stdout)
    assert got == {"mode": "0o600", "envoy_admin": "PermissionError", "/state": 401, "/pins/session/x": 401}, \
        (got, p.stderr)
    assert s.envoy.alive() and [st for st, _ in asyncio.run(_posts(s.url, ["after"]))] == [200]
    assert s.state()["replicas"]  # the owner, with the token, reads it


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_twenty_gzip_bombs_at_once_cost_envoy_a_bounded_amount_and_other_clients_nothing(own_stack):
    """20 uploads of 61 KB inflating 1,032:1 took Envoy from 177 MB to 1.2 GB. At envoy.max_inflate_ratio each
    inflates at most 100x, so together they cost Envoy a few hundred MB at most, and the clients beside them are
    all served."""
    import gzip

    s = own_stack(2, config={"profile": {"max_body_bytes": 32 * 2**20}, "envoy": {"max_body_bytes": 32 * 2**20}})
    s.wait_all_live(30)
    before = _peak_rss_mib(s.envoy.popen.pid)
    decided = sum(r["decisions"] for r in s.state()["replicas"])
    bomb = gzip.compress(b"0" * (60 * 2**20), 9)
    assert len(bomb) < 100_000

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async def one(data: bytes, headers: dict) -> int:
                async with http.post(s.url + CHAT, data=data, headers={"content-type": "application/json",
                                                                       **headers}) as r:
                    await r.read()
                    return r.status

            bombs = [one(bomb, {"content-encoding": "gzip"}) for _ in range(20)]
            normal = [one(_body(f"n{i}"), {"x-session-id": f"n{i}"}) for i in range(20)]
            return await asyncio.gather(*bombs, *normal)

    got = asyncio.run(run())
    assert got[20:] == [200] * 20, got  # every other client served
    assert all(400 <= c < 500 for c in got[:20]), got  # each bomb refused (cut off at the ratio, never JSON)
    grown = _peak_rss_mib(s.envoy.popen.pid) - before
    assert grown < 512, f"Envoy's peak memory grew {grown:.0f} MiB"  # 20 x 6 MiB inflated, a few copies each
    # no bomb reached a replica: the brain sent the 20 clients there, nothing else
    assert sum(r["decisions"] for r in s.state()["replicas"]) - decided == 20
    # and both replicas serve on (a scrape that a busy machine delayed past its bound may eject one for a moment)
    wait_for(lambda: [r["state"] for r in s.state()["replicas"]] == ["LIVE", "LIVE"], 30, "both replicas LIVE")


def test_sixteen_compressed_uploads_inside_the_ratio_are_refused_at_the_edge_and_cost_envoy_a_bounded_amount(own_stack):
    """Issue 43: sixteen 1 MB uploads of ordinary JSON compressed ~62:1 took Envoy from 72 MB to 3.2 GB (three times
    max_heap_bytes), its overload manager answered other clients 503, and each 60 MiB body failed open past the
    brain to a replica. An upload now inflates no further than the brain accepts (envoy.brain_body_max_bytes):
    Envoy answers 413 in the API's shape, nothing reaches a replica, and the clients beside them are all served."""
    s = own_stack(2)
    s.wait_all_live(30)
    from bench.faults.probes import ordinary_upload

    upload = ordinary_upload()
    assert 0.7 * 2**20 < len(upload) < 1.3 * 2**20
    before = _peak_rss_mib(s.envoy.popen.pid)
    decided = sum(r["decisions"] for r in s.state()["replicas"])

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async def one(data: bytes, headers: dict) -> tuple[int, dict]:
                async with http.post(s.url + CHAT, data=data, headers={"content-type": "application/json",
                                                                       **headers}) as r:
                    return r.status, json.loads(await r.read())

            uploads = [one(upload, {"content-encoding": "gzip", "x-session-id": f"u{i}"}) for i in range(16)]
            normal = [one(_body(f"n{i}"), {"x-session-id": f"n{i}"}) for i in range(40)]
            return await asyncio.gather(*uploads, *normal)

    got = asyncio.run(run())
    assert [st for st, _ in got[16:]] == [200] * 40, [st for st, _ in got[16:]]
    assert [st for st, _ in got[:16]] == [413] * 16, [st for st, _ in got[:16]]
    assert all(doc["error"]["code"] and doc["error"]["message"] for _, doc in got[:16]), got[0]
    grown = _peak_rss_mib(s.envoy.popen.pid) - before
    print(f"Envoy's peak memory grew {grown:.0f} MiB under sixteen 62:1 uploads")
    assert grown < 400, f"Envoy's peak memory grew {grown:.0f} MiB"
    # no upload was decided for (nor failed open to a replica): the brain placed the 40 clients, nothing else
    assert sum(r["decisions"] for r in s.state()["replicas"]) - decided == 40
    assert not any(v for k, v in s.envoy_stats().items() if k.endswith("ext_proc.failure_mode_allowed")
                   or k.endswith("ext_proc.failure_mode_allowed_total"))


def test_every_probe_at_once_beside_normal_clients_leaves_no_reservation_and_drops_no_log_entry(own_stack):
    """Normal clients (a third streamed) beside every probe of the round for 12 s. On the ext_proc connection the
    bodies the probes send filled the write buffer, Envoy's access logger dropped entries it could not flush
    (logs_dropped: 4-5 in such a run) and each was a reservation open for an hour: the access log has a connection
    of its own now (warmroute_brain_log). The normal clients are all served."""
    import time

    from bench.faults.chaos import Load
    from bench.faults.probes import Probes, unexpected
    from extproc.tools.stack.local import wait_for

    s = own_stack(4, mock_args=["--speedup", "10"])
    s.wait_all_live(30)
    probes = Probes(s.url, s.envoy_admin_path, s.brain_admin)
    load = Load(s, 8.0).start()
    probes.start()
    time.sleep(12)  # how long the mix runs, not a synchronisation
    probes.stop()
    load.stop()
    assert [r.error for r in load.since(0) if r.error] == []
    assert unexpected(probes.counts) == {}
    wait_for(lambda: s.state()["open_reservations"] == 0, 20, "every reservation released by its entry")
    # the stack logs to the brain's log door (Envoy's fluentd logger): it buffered entries and lost none
    stats = s.envoy_stats()
    assert sum(v for k, v in stats.items() if k.endswith("entries_buffered")) > 0, stats
    assert [k for k, v in stats.items() if v and (k.endswith("entries_lost") or k.endswith("logs_dropped"))] == []
    assert all(r["ejections"] == 0 for r in s.state()["replicas"])


def test_a_flood_of_new_sessions_is_refused_before_the_brain_reads_it_and_nothing_fails_open_into_the_engines(own_stack):
    """Issue 43, finding 5: 1,500 new sessions of ~100 KB at once are more than one brain reads within Envoy's
    timer; those it could not read failed open into the engines, ahead of the sessions under way (at 1,000 and 2,000
    at once, 411 and 1,996 did). The look at their headers refuses new sessions while the brain is behind: every
    flood request gets 200 or 429 from the brain, none fails open past it, and a session under way keeps every turn."""
    from bench.runs.flood import _flood, _turn

    s = own_stack(4, mock_args=["--speedup", "10"])
    s.wait_all_live(30)

    async def scene() -> tuple[dict, list]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            history: list[dict] = []

            async def turns(n: int) -> list:
                out = []
                for k in range(n):
                    history.append({"role": "user", "content": f"step {k}: fix the failing test " * 40})
                    out.append(await _turn(http, s.url, "under-way", history))
                    history.append({"role": "assistant", "content": "done " * 20})
                return out

            assert None not in await turns(2)  # under way before the flood
            flood, during = await asyncio.gather(_flood(s.url, 1500, 25_000), turns(4))
            return flood, during

    before = s.envoy_stats()
    flood, during = asyncio.run(scene())
    after = s.envoy_stats()
    # past the brain unseen: a body or look call that failed open. A header call at the door that failed open (a
    # starved machine: 755 of 1,500 once, inside a parallel `make test`) goes on to those calls, seen there
    failed_open = {k: after[k] - before.get(k, 0) for k in after
                   if k.endswith(".failure_mode_allowed") and ".ext_proc." in k}
    door_open = after.get("http.ingress.ext_authz.warmroute_headers.failure_mode_allowed", 0) - before.get(
        "http.ingress.ext_authz.warmroute_headers.failure_mode_allowed", 0)
    assert set(flood) <= {"200", "429"} and sum(flood.values()) == 1500, flood
    assert flood.get("429", 0) > 0
    # (almost) nothing passed the brain unseen: before the look 411 of 1,000 and 1,996 of 2,000 did. A brain starved of
    # its core answers some message after Envoy's timer and that request fails open, as designed for a brain too slow
    # to answer (15 of 1,500 once, in CI beside another stack's test; 0 in every run alone or beside CPU hogs here)
    why = {k: after[k] - before.get(k, 0) for k in after if ".ext_proc." in k
           and k.rsplit(".", 1)[-1] in ("message_timeouts", "streams_failed", "failure_mode_allowed")}
    assert sum(failed_open.values()) <= 1500 * 0.03, why
    assert None not in during  # the session under way: every turn answered
    # each flood request's headers were looked at before their bodies were read: at its header call (the header path
    # gives the look's word for a new session): at the brain's header door (ext_authz, answered or refused) ...
    looked = sum(after[k] - before.get(k, 0) for k in after
                 if k in ("http.ingress.ext_authz.warmroute_headers.ok", "http.ingress.ext_authz.warmroute_headers.denied"))
    bodies = sum(after[k] - before.get(k, 0) for k in after if ".ext_proc.warmroute.stream_msgs_sent" in k)
    assert looked + door_open >= 1500
    # ... and those the brain could not have read in time were refused there, their bodies never sent to it. How many
    # depends on how far behind this machine's brain fell (seen: 24 to 817 bodies read), not on the rule: without the
    # look every body reaches the brain or fails open past it. Which rule refuses them at their headers depends on the
    # race too: the look's (router_behind), or the queue's deadline at the header door (deadline_unmeetable; once
    # every refusal, inside a parallel make test: 0 behind, 528 bodies read). The look's own rule is tested apart, by
    # its clock (tests/brain/test_look.py)
    refused = s.state()["flow_control"]["refused"]
    behind = refused["router_behind"]
    assert bodies <= 1500 - max(1, behind) + 6, (refused, bodies)  # + the session under way's six turns


async def _declare(host: str, port: int, size: int, session: str) -> asyncio.StreamWriter:
    """A request's headers declaring ``size`` bytes of body, and a few of them: the rest never comes."""
    _, w = await asyncio.open_connection(host, port)
    w.write(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-session-id: {session}\r\n"
            f"content-length: {size}\r\n\r\n{{\"model\": \"mock-coder-30b\"".encode())
    await w.drain()
    return w


async def _slow_post(host: str, port: int, body: bytes, seconds: float) -> int:
    """A new session's upload spread over ``seconds`` (a slow client): its status."""
    r, w = await asyncio.open_connection(host, port)
    w.write(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-session-id: slow-{len(body)}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode())
    parts = 6
    step = -(-len(body) // parts)
    try:
        for k in range(parts):
            w.write(body[k * step:(k + 1) * step])
            await w.drain()
            await asyncio.sleep(seconds / parts)
    except ConnectionError:
        pass  # answered before the upload ended (a refusal): its status is read below
    try:
        return int((await asyncio.wait_for(r.readline(), 60)).split()[1])
    except (ConnectionError, IndexError, ValueError):
        return -1
    finally:
        w.close()


def test_declared_bodies_that_never_come_and_slow_uploads_do_not_make_the_brain_look_behind(own_stack):
    """Issue 59, finding 1: 8 requests declaring 2 MB each and sending none of it, renewed every 4.5 s, made the
    look count 16 MB the brain never read and refuse 24-25 of 40 new sessions with 429 router_behind (default config,
    a session under way: half a second behind refuses). Here 48 of them (96 MB: three seconds behind, past any bound
    this stack's config sets), and 30 small ones after them. Envoy now looks only once it holds the whole body, and
    counts the look's lateness
    from the upload's end: neither the declarations nor three uploads of 3 s each are refused, and the look still
    looked at every new session."""
    s = own_stack(4, mock_args=["--speedup", "10"])
    s.wait_all_live(30)
    host, port = s.url.split("//")[1].split(":")
    port = int(port)

    def big(session: str) -> bytes:
        return json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [
            {"role": "user", "content": f"{session}: " + "def handler(event):\n    return event\n" * 2500}]}).encode()

    async def scene() -> tuple[list[int], list[int]]:
        stop = asyncio.Event()

        async def declarations() -> None:
            n = 0
            while not stop.is_set():
                # the large ones, then small ones to fill what they leave below the bound: whatever that bound, a
                # new session's look would find the brain as far behind as it may be
                held = [await _declare(host, port, 2_000_000 if k < 48 else 70_000, f"declared-{n + k}")
                        for k in range(78)]
                n += 78
                try:
                    await asyncio.wait_for(stop.wait(), 4.5)
                except asyncio.TimeoutError:
                    pass
                for w in held:
                    w.close()

        task = asyncio.create_task(declarations())
        await asyncio.sleep(0.5)  # the first declarations are in; a scene's pace, not a wait for state
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async def one(k: int) -> int:
                async with http.post(s.url + CHAT, data=big(f"new-{k}"), headers={
                        "content-type": "application/json", "x-session-id": f"new-{k}"}) as r:
                    await r.read()
                    return r.status

            statuses = []
            for k in range(0, 40, 4):
                statuses += await asyncio.gather(*(one(k + j) for j in range(4)))
        slow = await asyncio.gather(*(_slow_post(host, port, big(f"slow-{k}"), 3.0) for k in range(3)))
        stop.set()
        await task
        return statuses, list(slow)

    before = s.envoy_stats()
    statuses, slow = asyncio.run(scene())
    after = s.envoy_stats()
    looked = sum(after[k] - before.get(k, 0) for k in after if ".ext_proc.warmroute_look.stream_msgs_received" in k)
    assert statuses == [200] * 40, statuses
    assert slow == [200] * 3, slow
    assert s.state()["flow_control"]["refused"].get("router_behind", 0) == 0
    assert looked >= 43  # the look is on: each new session's headers went to the brain

"""The hardening round's probes (issue 30), as a hostile client and a local user send them: ``make chaos`` runs
them all at once beside normal clients.

Each probe is sent over and over at a low rate until stopped, and counts what it got. None of them may cost a
normal client anything: no error, no slower first token, no replica ejected, no prediction left behind."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import threading
import zlib
from collections import Counter
from typing import Callable

import aiohttp

from extproc.tools.workload.generate import MOCK_MODEL
from bench.faults.hostile import connect_as

MODEL = MOCK_MODEL
CHAT = "/v1/chat/completions"


def sdk_body(size: int, model: str = MODEL) -> bytes:
    """A coding agent's turn as the OpenAI Python SDK lays it out: messages first, the model after, tools last."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 200,
                                               "parameters": {"type": "object", "properties": {}}}} for i in range(40)]
    turns = [{"role": "user" if k % 2 else "assistant", "content": "def f(x):\n    return x * 2\n" * 70}
             for k in range(max(1, size // 2000))]
    return json.dumps({"messages": [{"role": "system", "content": "You are a coding agent."}, *turns],
                       "model": model, "max_tokens": 2, "tools": tools}).encode()


class Probes:
    """Every probe of the round, each in its own loop, until ``stop()``; ``counts`` says what each one got."""

    def __init__(self, url: str, envoy_admin_path: str, brain_admin: str, every_s: float = 1.0):
        self.url, self.envoy_admin_path, self.brain_admin = url, envoy_admin_path, brain_admin
        self.every_s = every_s
        self.counts: dict[str, Counter] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True),
                         threading.Thread(target=self._local_user, daemon=True)]
        self._bomb = gzip.compress(b"0" * (60 * 2**20), 9)
        self._long = sdk_body(300_000)
        self._ordinary = ordinary_upload()
        self._deflated = zlib.compress(sdk_body(20_000))

    def start(self) -> "Probes":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _count(self, probe: str, outcome) -> None:
        self.counts.setdefault(probe, Counter())[str(outcome)] += 1

    async def _post(self, http: aiohttp.ClientSession, probe: str, data: bytes, headers: dict | None = None,
                    path: str = CHAT) -> None:
        try:
            async with http.post(self.url + path, data=data, headers={"content-type": "application/json",
                                                                      **(headers or {})}) as r:
                await r.read()
                self._count(probe, r.status)
        except Exception as e:
            self._count(probe, type(e).__name__)

    async def _declared_size(self, i: int) -> None:
        """Headers declaring 60 MB, a few bytes of body, then gone: the brain is asked on the headers alone."""
        host, port = self.url.rsplit("/", 1)[1].rsplit(":", 1)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write((f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"x-session-id: probe-size-{i}\r\nContent-Length: {60_000_000 if i % 2 else 10 ** 15}\r\n\r\n"
                          '{"model": "').encode())
            await writer.drain()
            writer.close()
            self._count("declared_size_then_gone", "sent")
        except OSError as e:
            self._count("declared_size_then_gone", type(e).__name__)

    async def _run(self) -> None:
        rnd = random.Random(30)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            i = 0
            while not self._stop.is_set():
                tricky = [b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                          b'"model": "' + MODEL.encode() + b'"}',
                          b'{"metadata": {"model": "nope"}, "max_tokens": 2, "temperature": NaN, "messages": '
                          b'[{"role": "user", "content": "hi"}], "model": "' + MODEL.encode() + b'"}']
                await asyncio.gather(
                    self._declared_size(i),
                    self._post(http, "gzip_bomb", self._bomb, {"content-encoding": "gzip"}),
                    self._post(http, "long_sdk_body_300kb", self._long, {"x-session-id": f"probe-long-{i % 4}"}),
                    self._post(http, "duplicate_nested_nan_model", tricky[i % 2]),
                    self._post(http, "client_data_parallel_rank", json.dumps(
                        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "r"}]}).encode(),
                        {"x-data-parallel-rank": "7"}),
                    self._post(http, "compressed_inside_the_ratio", self._ordinary, {"content-encoding": "gzip"}),
                    self._post(http, "forged_response_id", json.dumps(
                        {"model": MODEL, "input": "x",
                         "previous_response_id": forged_response_id(f"r{i % 4}")}).encode(),
                        path="/v1/responses"),
                    # issue 59: an encoding Envoy does not inflate reaches no replica; a client's own
                    # kv_transfer_params are dropped and the request served
                    self._post(http, "deflate_body", self._deflated, {"content-encoding": "deflate"}),
                    self._post(http, "client_kv_transfer_params", json.dumps(
                        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "k"}],
                         "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.9",
                                                "remote_port": 9, "remote_request_id": f"victim-{i}"}}).encode()),
                    self._post(http, "invented_session_ids", json.dumps(
                        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "s"}]}).encode(),
                        {"x-session-id": f"invented-{rnd.random()}"}),
                )
                i += 1
                await asyncio.sleep(self.every_s)

    def _local_user(self) -> None:
        """Another local user: Envoy's admin socket and the brain's admin, without the token."""
        import urllib.error
        import urllib.request

        while not self._stop.wait(self.every_s * 5):
            try:
                self._count("local_user_envoy_admin", connect_as(self.envoy_admin_path))
            except Exception as e:  # not root: no other user to be
                self._count("local_user_envoy_admin", type(e).__name__)
            try:
                urllib.request.urlopen(self.brain_admin + "/state", timeout=5)
                self._count("local_user_brain_state", 200)
            except urllib.error.HTTPError as e:
                self._count("local_user_brain_state", e.code)
            except OSError as e:
                self._count("local_user_brain_state", type(e).__name__)


def ordinary_upload() -> bytes:
    """~62 MB of chat JSON that gzip makes ~1 MB of: inside max_inflate_ratio (100), an ordinary long context
    (issue 43: sixteen of these took Envoy to 3.2 GB and reached replicas whole)."""
    rng = random.Random(43)
    words = ["def", "return", "self", "value", "index", "for", "in", "range", "if", "else", "import", "class", "x"]
    block = " ".join(rng.choice(words) for _ in range(300))
    msgs = [{"role": "user" if i % 2 else "assistant",
             "content": block + " " + " ".join(str(rng.randrange(10**6)) for _ in range(4))} for i in range(44_000)]
    return gzip.compress(json.dumps({"model": MODEL, "max_tokens": 2, "messages": msgs}).encode(), 6)


def forged_response_id(replica: str) -> str:
    """A stored-response id in the brain's public layout, naming ``replica``, signed with a key no brain has."""
    from extproc.core.apis import mint_response_id

    return mint_response_id(replica, None, key=b"a key no brain of the fleet has")


# what a probe must never get: a normal answer where it should be refused, or an error where it should be served
EXPECTED: dict[str, Callable[[str], bool]] = {
    "declared_size_then_gone": lambda o: o == "sent",
    "gzip_bomb": lambda o: o in ("400", "413"),
    "compressed_inside_the_ratio": lambda o: o == "413",  # inflates past the brain's limit: refused at the edge
    "forged_response_id": lambda o: o == "404",  # the layout without the fleet's MAC: no replica is asked
    "long_sdk_body_300kb": lambda o: o == "200",
    "duplicate_nested_nan_model": lambda o: o == "200",
    "client_data_parallel_rank": lambda o: o == "200",
    "invented_session_ids": lambda o: o == "200",
    "deflate_body": lambda o: o == "415",
    "client_kv_transfer_params": lambda o: o == "200",
    "local_user_envoy_admin": lambda o: o == "PermissionError",
    "local_user_brain_state": lambda o: o == "401",
}


def unexpected(counts: dict[str, Counter]) -> dict[str, dict[str, int]]:
    return {p: {o: n for o, n in c.items() if not EXPECTED[p](o)} for p, c in counts.items()
            if any(not EXPECTED[p](o) for o in c)}


__all__ = ["EXPECTED", "Probes", "forged_response_id", "ordinary_upload", "sdk_body", "unexpected"]

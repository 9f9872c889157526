"""An open-loop load in a thread of its own: one request coroutine started every 1/rate seconds."""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable

import aiohttp


class OpenLoop:
    """``send(http, i)`` is started at ``rate`` per second until ``stop()``, which waits for those in flight."""

    def __init__(self, rate: float, send: Callable[[aiohttp.ClientSession, int], Awaitable[None]],
                 timeout_s: float = 60.0):
        self.rate = rate
        self.send = send
        self.timeout_s = timeout_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "OpenLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s * 2)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as http:
            tasks: set[asyncio.Future] = set()
            while not self._stop.is_set():
                t = asyncio.ensure_future(self.send(http, self.sent))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                self.sent += 1
                await asyncio.sleep(1 / self.rate)  # the arrival rate
            await asyncio.gather(*tasks)


class OpenLoad:
    """A load whose requests arrive at ``rate`` per second whatever the answers (an open loop), each sent by
    ``_one(http, i)``: what the benches' loads are made of."""

    def __init__(self, rate: float):
        self._loop = OpenLoop(rate, self._one)

    async def _one(self, http: aiohttp.ClientSession, i: int) -> None:
        raise NotImplementedError

    @property
    def sent(self) -> int:
        return self._loop.sent

    def start(self) -> "OpenLoad":
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()


def write_report(out: str, title: str, intro: str, text: str) -> None:
    """Print ``text`` and, with a path, write it as a markdown page (docs/) under ``title`` and ``intro``."""
    import time
    from pathlib import Path

    print("\n" + text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(f"# {title}\n\nWritten by `{title.split('`')[1]}` ({time.strftime('%Y-%m-%d')}, a 2-core "
                             f"machine). {intro}\n\n{text.rstrip()}\n")
        print(f"\nwritten to {out}")

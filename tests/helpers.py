"""Helpers shared by the core tests: build routers whose replicas are already LIVE."""

from __future__ import annotations

import contextlib

from extproc.core import LIVE, RequestProfile, Router, RouterConfig, hash_key


def names(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def live_router(n: int = 4, cfg: RouterConfig | None = None) -> tuple[Router, float]:
    """A router whose ``n`` replicas went through start-up (2 good scrapes + 15 s) and are LIVE (seed policy
    unless ``cfg`` says otherwise: the rule tests of Parts A+B use it)."""
    router = Router(cfg or RouterConfig(policy="seed"), names(n), 0.0)
    t = 0.0
    while True:
        scrape_all(router, t)
        if all(r.state is LIVE for r in router.replicas):
            return router, t  # the time of the last scrape
        t += 3.0


def scrape_all(router: Router, now: float, loads: dict[str, tuple[int, int]] | None = None, ok: bool = True) -> None:
    loads = loads or {}
    for r in router.replicas:
        running, waiting = loads.get(r.name, (0, 0))
        router.on_scrape(r.name, ok, now, running=running, waiting=waiting)


def prof(session: str | None = None, prefix: str | None = None, tokens: int = 0,
         blocks: list[int] = ()) -> RequestProfile:
    return RequestProfile(
        session_key=hash_key("session", None, session) if session else None,
        prefix_key=hash_key("prefix", None, prefix) if prefix else None,
        tokens=tokens,
        body_status="ok",
        blocks=list(blocks),
    )


def chain(system: str, session: str | None, tokens: int, system_tokens: int = 4000) -> list[int]:
    """Block ids of a prompt of ``tokens`` (16 a block): a system prompt shared by name, then the session's own."""
    n = tokens // 16
    k = min(n, system_tokens // 16)
    return [hash((system, i)) for i in range(k)] + [hash((system, session, i)) for i in range(k, n)]


def scrape_until(router: Router, t: float, done, loads=None, failing: frozenset[str] = frozenset(),
                 limit_s: float = 3600.0) -> float:
    """Scrape every 3 s from ``t`` (replicas in ``failing`` fail) until ``done()``; returns the time reached."""
    end = t + limit_s
    while not done():
        if t > end:
            raise AssertionError("condition not reached within the deadline")
        for r in router.replicas:
            if r.name in failing:
                router.on_scrape(r.name, False, t)
            else:
                running, waiting = (loads or {}).get(r.name, (0, 0))
                router.on_scrape(r.name, True, t, running=running, waiting=waiting)
        if done():
            break
        t += 3.0
    return t


def live_brain(cfg, t: list[float] | None = None):
    """A Brain on ``cfg`` (an AppConfig) whose replicas are all LIVE, on a clock the caller does not move (or moves
    through ``t[0]``, which this leaves at the last start-up scrape)."""
    from extproc.brain.brain import Brain

    t = [1000.0] if t is None else t
    b = Brain(cfg, clock=lambda: t[0])
    for k in range(7):
        t[0] = 1000.0 + 3 * k
        for r in cfg.replicas:
            b.router.on_scrape(r.name, True, t[0])
    assert all(r.state is LIVE for r in b.router.replicas)
    return b


def stop_group(p, sig: int, timeout: float) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started: ``sig`` to the group,
    SIGKILL if it is not gone within ``timeout``."""
    import os
    import signal
    import subprocess

    if p.poll() is not None:
        return
    os.killpg(p.pid, sig)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@contextlib.asynccontextmanager
async def serving(handle, method: str = "GET", path: str = "/{tail:.*}"):
    """A server on 127.0.0.1 (a port the OS picks) answering ``method path`` with ``handle``: its URL, stopped
    after."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route(method, path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ the brain's outcomes as Envoy receives them

def envoy(out, phase: str = "request_body"):
    """The brain's outcome as its ext_proc front renders it for Envoy (a held request and prefill legs as they are)."""
    from extproc.answers import Answered, Placed
    from extproc.brain.decide import envoy_answer

    return envoy_answer(out, phase) if isinstance(out, (Placed, Answered)) else out


def envoy_decide(b, headers: dict, body: bytes | None, phase: str = "request_body"):
    """``Brain.decide``, answered as Envoy gets it."""
    return envoy(b.decide(headers, body, phase), phase)


def envoy_at_headers(b, headers: dict):
    """``Brain.at_headers``, answered as Envoy gets it (None: its body decides)."""
    out = b.at_headers(headers)
    return None if out is None else envoy(out, "request_headers")


def envoy_look(b, headers: dict, read_wait_s: float):
    """``Brain.look``, answered as Envoy gets it (None: the body may come)."""
    out = b.look(headers, read_wait_s)
    return None if out is None else envoy(out, "request_headers")


def envoy_let_go(b) -> list:
    """``Brain.let_go``: each held request that goes, by its key, with its answer as Envoy gets it."""
    return [(h.key, envoy(answer, h.phase)) for h, answer in b.let_go()]

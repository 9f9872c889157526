"""The brain's background loops survive one bad round, and a dead loop takes the brain out of service."""

from __future__ import annotations

import asyncio

from aiohttp import web

from extproc.brain.brain import Brain
from extproc.brain.server import supervise
from extproc.config import parse_config

METRICS = 'vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting{model_name="m"} 0\n'


async def serve_metrics(handler) -> tuple[web.AppRunner, int]:
    """A replica whose /metrics is ``handler``, on a port the OS picks; the caller cleans the runner up."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def metrics_server() -> tuple[web.AppRunner, int]:
    """A replica that only serves /metrics."""
    async def metrics(_):
        return web.Response(text=METRICS)

    return await serve_metrics(metrics)


def test_an_exception_while_applying_one_scrape_is_logged_and_scraping_goes_on(caplog):
    async def main():
        runner, port = await metrics_server()
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
                            "health": {"scrape_interval_s": 0.05}, "routing": {"policy": "seed"}})
        brain = Brain(cfg)
        calls = []
        real = brain.router.on_scrape

        def flaky(name, ok, now, *a, **kw):
            calls.append(ok)
            if len(calls) == 1:
                raise ValueError("a bad sample")
            return real(name, ok, now, *a, **kw)

        brain.router.on_scrape = flaky
        task = asyncio.create_task(brain.scraper.loop())
        deadline = asyncio.get_running_loop().time() + 10
        while len(calls) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await runner.cleanup()
        return brain, calls

    with caplog.at_level("INFO", logger="warmroute"):
        brain, calls = asyncio.run(main())
    assert len(calls) >= 3 and brain.scraper.loop_errors == 1
    assert any('"loop_error"' in r.getMessage() and "a bad sample" in r.getMessage() for r in caplog.records)


def test_when_a_background_task_dies_the_supervisor_reports_it_at_once():
    async def main():
        async def forever():
            await asyncio.Event().wait()

        async def dies():
            await asyncio.sleep(0.01)
            raise RuntimeError("scraper broke")

        tasks = [asyncio.create_task(forever(), name="tick"), asyncio.create_task(dies(), name="scraper")]
        seen = []

        async def on_death(t):
            seen.append((t.get_name(), str(t.exception())))

        await asyncio.wait_for(supervise(tasks, on_death), 5)
        for t in tasks:
            t.cancel()
        return seen

    assert asyncio.run(main()) == [("scraper", "scraper broke")]


def test_C6_load_is_scraped_between_health_scrapes_and_only_health_scrapes_move_the_health_machine():
    async def main():
        runner, port = await metrics_server()
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
                            "health": {"scrape_interval_s": 0.6}, "warm": {"load_refresh_s": 0.1}})
        brain = Brain(cfg)
        assert brain.scraper.load_refresh_s == 0.1  # the warm policy reads load: fast scrapes are on
        calls = {"health": 0, "load": 0}
        on_scrape, on_load = brain.router.on_scrape, brain.router.on_load

        def health(*a, **kw):
            calls["health"] += 1
            return on_scrape(*a, **kw)

        def load(*a, **kw):
            calls["load"] += 1
            return on_load(*a, **kw)

        brain.router.on_scrape, brain.router.on_load = health, load
        task = asyncio.create_task(brain.scraper.loop())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while calls["health"] < 3 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await runner.cleanup()
        return calls

    calls = asyncio.run(main())
    assert calls["health"] >= 3
    # about 5 load scrapes between two health scrapes (0.6 s / 0.1 s); a busy machine may fit fewer
    assert calls["load"] >= calls["health"]


def test_the_seed_policy_reads_no_load_between_health_scrapes():
    cfg = parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}], "routing": {"policy": "seed"}})
    assert Brain(cfg).scraper.load_refresh_s is None


def test_a_replica_whose_metrics_never_answer_delays_no_other_replica_s_scrapes():
    from extproc.brain.scraper import ScrapeResult

    async def main():
        cfg = parse_config({"replicas": [{"name": "good", "url": "http://127.0.0.1:1"},
                                         {"name": "slow", "url": "http://127.0.0.1:2"}],
                            "health": {"scrape_interval_s": 3.0}, "warm": {"load_refresh_s": 0.05}})
        brain = Brain(cfg)
        release = asyncio.Event()
        calls = {"good": 0, "slow": 0}

        async def scrape_once(session, name, url, timeout=None):
            calls[name] += 1
            if name == "slow":
                await release.wait()  # a /metrics that does not answer while the test looks
            return ScrapeResult(True, 0, 0, 0.0)

        brain.scraper.scrape_once = scrape_once
        task = asyncio.create_task(brain.scraper.loop())
        deadline = asyncio.get_running_loop().time() + 30
        while calls["good"] < 5 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        good, slow_pending = calls["good"], calls["slow"] == 1 and not release.is_set()
        release.set()
        task.cancel()
        return good, slow_pending

    good, slow_pending = asyncio.run(main())
    # 5 scrapes of the good replica while the slow one's first has not returned (a round that waits for every
    # replica gets 1)
    assert good >= 5 and slow_pending


def test_a_metrics_page_past_the_size_cap_is_a_failed_scrape_read_no_further():
    async def main():
        sent = [0]

        async def endless(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            line = b'vllm:num_requests_running{model_name="m"} 1\n' * 1000
            try:
                while True:
                    await resp.write(line)
                    sent[0] += len(line)
            except (ConnectionResetError, asyncio.CancelledError):
                pass
            return resp

        runner, port = await serve_metrics(endless)
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
                            "health": {"max_metrics_bytes": 1024 * 1024}})
        brain = Brain(cfg)
        from aiohttp import ClientSession

        async with ClientSession() as s:
            r = await brain.scraper.scrape_once(s, "r0", cfg.replicas[0].url, timeout=10)
        await runner.cleanup()
        return r

    r = asyncio.run(main())
    assert not r.ok and "larger than 1048576 bytes" in r.error


def _engines_page(n: int) -> str:
    return "".join(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 1\n'
                   f'vllm:num_requests_waiting{{engine="{i}",model_name="m"}} 0\n' for i in range(n))


def test_a_page_naming_more_engines_or_series_than_the_caps_fails_its_scrape_with_the_cap_named():
    from extproc.brain.scraper import VLLM, parse_metrics

    assert parse_metrics(_engines_page(4), VLLM, max_engines=4).ok
    many = parse_metrics(_engines_page(5), VLLM, max_engines=4)
    assert not many.ok and "health.max_engines" in many.error
    # the finding's page: 90,000 engines in ~4 MB, under the byte cap; refused at the default cap
    huge = parse_metrics(_engines_page(90_000)[: 4 * 2**20], VLLM)
    assert not huge.ok and "more than 128 engines" in huge.error
    lines = _engines_page(1) + "".join(f'vllm:prompt_tokens_total{{x="{i}"}} 1\n' for i in range(50))
    assert parse_metrics(lines, VLLM, max_series=60).ok
    over = parse_metrics(lines, VLLM, max_series=40)
    assert not over.ok and "health.max_metrics_series" in over.error
    # comment lines are not series
    assert parse_metrics("# HELP x\n# TYPE x gauge\n" * 40 + lines, VLLM, max_series=60).ok


def test_the_caps_come_from_the_config():
    cfg = parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}],
                        "health": {"max_engines": 2, "max_metrics_series": 7}})
    brain = Brain(cfg)
    assert (brain.scraper.max_engines, brain.scraper.max_series) == (2, 7)


def test_a_large_page_is_parsed_off_the_event_loop(monkeypatch):
    import threading

    from extproc.brain import scraper as sc

    seen = []
    real = sc.parse_metrics

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(sc, "parse_metrics", spy)
    page = _engines_page(1) + "# padding\n" * 40_000  # ~400 KB

    async def main():
        s = sc.Scraper(None, None, lambda: 0.0, 3.0)
        small = await s._parse(_engines_page(1), sc.VLLM)
        large = await s._parse(page, sc.VLLM)
        return small, large

    small, large = asyncio.run(main())
    assert small.ok and large.ok
    assert seen[0] == threading.main_thread().name and seen[1].startswith("scrape-parse"), seen


def test_a_deadline_that_ran_out_while_the_event_loop_stood_still_is_tried_again_not_counted():
    import time

    async def main():
        async def slowish(_):
            await asyncio.sleep(0.05)
            return web.Response(text=METRICS)

        runner, port = await serve_metrics(slowish)
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}]})
        brain = Brain(cfg)
        watch = asyncio.create_task(brain.scraper.watch_loop(0.01))
        await asyncio.sleep(0.05)

        def neighbour_holds_the_loop():
            time.sleep(1.5)  # what a 4 MB page parsed on the loop did (4.2 s in the finding)

        from aiohttp import ClientSession

        async with ClientSession() as s:
            asyncio.get_running_loop().call_later(0.01, neighbour_holds_the_loop)
            r = await brain.scraper.scrape_once(s, "r0", cfg.replicas[0].url, timeout=0.5)
        watch.cancel()
        await runner.cleanup()
        return r, brain.scraper.deferred, brain.stats.scrapes

    r, deferred, scrapes = asyncio.run(main())
    assert r.ok, r.error
    assert deferred == 1 and scrapes[("r0", "deferred")] == 1 and scrapes[("r0", "ok")] == 1


def test_B_eject_a_busy_replica_whose_metrics_answer_late_stays_live_and_one_that_never_answers_goes_stale():
    """A vLLM API server busy with its requests answers /metrics late (over 0.8 of an interval on three CPU engines):
    its health scrape waits for the answer while its last good scrape is fresh, so it stays LIVE. One that stops
    answering is ejected by the stale rule (3 intervals), not sooner and not never."""
    from extproc.core.replica import EJECTED, LIVE

    async def main():
        mode = {"delay": 0.0, "answered": 0}
        hang = asyncio.Event()

        async def metrics(_):
            if mode["delay"] < 0:
                await hang.wait()
            await asyncio.sleep(mode["delay"])
            mode["answered"] += 1
            return web.Response(text=METRICS)

        runner, port = await serve_metrics(metrics)
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
                            "health": {"scrape_interval_s": 1.0, "probing_clean_window_s": 0.2},
                            "warm": {"load_refresh_s": 5.0}})  # health scrapes alone
        brain = Brain(cfg)
        health = brain.router.find("r0").health
        task = asyncio.create_task(brain.scraper.loop())
        loop = asyncio.get_running_loop()

        async def until(cond, seconds: float) -> bool:
            deadline = loop.time() + seconds
            while not cond() and loop.time() < deadline:
                brain.router.tick(brain.clock())  # the brain's timers: the stale rule
                await asyncio.sleep(0.02)
            return cond()

        try:
            live = await until(lambda: health.state is LIVE, 30)
            mode["delay"], start = 1.5, mode["answered"]  # twice the 0.8 s a health scrape waited before
            slow = await until(lambda: mode["answered"] >= start + 3 or health.state is not LIVE, 30)
            slow_state, slow_ejections = health.state, health.ejections
            mode["delay"], t0 = -1.0, loop.time()
            gone = await until(lambda: health.state is EJECTED, 30)
            return live, slow, slow_state, slow_ejections, gone, loop.time() - t0
        finally:
            hang.set()
            task.cancel()
            await runner.cleanup()

    live, slow, slow_state, slow_ejections, gone, gone_after = asyncio.run(main())
    assert live and slow
    assert slow_state is LIVE and slow_ejections == 0  # three answers of 1.5 s each, none counted a failure
    assert gone and gone_after >= 1.5  # the stale rule's 3 s from the last answer, which was up to 1.5 s before


def test_B_scrape_timeout_spares_a_replica_answering_users_and_the_stale_rule_takes_it_once_it_stops():
    """A replica whose /metrics never answers while it answers users (Envoy's word, fed here as the release path
    does) stays LIVE through its timed-out scrapes; once it answers nobody, the stale rule takes it 3 intervals
    after its last answer."""
    from extproc.core.replica import EJECTED, LIVE

    async def main():
        hang, mode = asyncio.Event(), {"hang": False}

        async def metrics(_):
            if mode["hang"]:
                await hang.wait()
            return web.Response(text=METRICS)

        runner, port = await serve_metrics(metrics)
        cfg = parse_config({"replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
                            "health": {"scrape_interval_s": 0.5, "probing_clean_window_s": 0.2},
                            "warm": {"load_refresh_s": 5.0}})
        brain = Brain(cfg)
        health = brain.router.find("r0").health
        task = asyncio.create_task(brain.scraper.loop())
        loop = asyncio.get_running_loop()

        async def until(cond, seconds: float, serving: bool = False) -> bool:
            deadline = loop.time() + seconds
            while not cond() and loop.time() < deadline:
                if serving:
                    health.served(brain.clock())
                brain.router.tick(brain.clock())
                await asyncio.sleep(0.02)
            return cond()

        try:
            live = await until(lambda: health.state is LIVE, 30)
            mode["hang"], failed0 = True, brain.scraper.stats.scrapes[("r0", "failed")]
            # serving for 5 stale windows, while at least two scrapes time out
            await until(lambda: brain.scraper.stats.scrapes[("r0", "failed")] >= failed0 + 2 and
                        health.state is not LIVE, 7.5, serving=True)
            timed_out = brain.scraper.stats.scrapes[("r0", "failed")] - failed0
            busy_state = health.state
            t0 = loop.time()
            gone = await until(lambda: health.state is EJECTED, 30)
            return live, timed_out, busy_state, gone, loop.time() - t0
        finally:
            hang.set()
            task.cancel()
            await runner.cleanup()

    live, timed_out, busy_state, gone, gone_after = asyncio.run(main())
    assert live and timed_out >= 1 and busy_state is LIVE  # its scrapes timed out, and it stayed
    assert gone and gone_after >= 1.0  # 1.5 s after its last answer (not at once)


async def _cancelled_as_woken(make_task, event: asyncio.Event) -> bool:
    """Start a loop, and once it waits on ``event`` set the event and cancel the loop in one step: Python 3.11's
    wait_for returned the wait's result there and lost the cancel, so the loop ran on and whatever awaited its end
    (a brain's shutdown) waited for ever."""
    task = asyncio.create_task(make_task())
    deadline = asyncio.get_running_loop().time() + 10
    while not event._waiters and asyncio.get_running_loop().time() < deadline:  # type: ignore[attr-defined]
        await asyncio.sleep(0.005)
    assert event._waiters, "the loop never waited"  # type: ignore[attr-defined]
    event.set()
    task.cancel()
    while not task.done() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    stopped = task.cancelled()
    task.cancel()  # asleep again if the cancel was lost: this one is not
    await asyncio.gather(task, return_exceptions=True)
    return stopped


def test_the_flow_loop_cancelled_as_a_request_end_wakes_it_stops():
    from extproc.brain.server import FlowWaits

    async def main() -> bool:
        waits = FlowWaits(Brain(parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]})))
        return await _cancelled_as_woken(waits.loop, waits.woken)

    assert asyncio.run(main())


def test_discovery_cancelled_as_its_source_changes_stops():
    from extproc.config import ReplicaSpec
    from extproc.discovery import StaticSource, follow

    async def main() -> bool:
        source = StaticSource((ReplicaSpec("r0", "http://127.0.0.1:9"),))
        return await _cancelled_as_woken(lambda: follow(source, 3600.0, lambda found: None, lambda msg: None),
                                         source.changed)

    assert asyncio.run(main())

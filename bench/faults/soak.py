"""``make soak``: a steady load of unique sessions for a bounded time; does anything grow past its bound?

Every request is a new session (the worst case for the pin table, the prefix index and the chain
cache), bodies of a few KiB with one of a few shared system prompts. Pin TTLs are shortened (2 min
session, 1 min prefix) so that the run reaches the steady state where pins expire as fast as they
are made; the prefix index is bounded by each replica's cache size, the chain cache by its own
limits. Printed at the start, the middle and the end: the brain's RSS, pins, index blocks, chain
cache, request ids held and open reservations, each with its bound.
"""

from __future__ import annotations

import argparse
import time
import urllib.request

from extproc.tools.workload.generate import MOCK_MODEL
from extproc.tools.stack.local import Stack
from extproc.tools.stack.procs import rss_mib
from extproc.tools.workload.open_loop import OpenLoad, write_report

SESSION_TTL_S, PREFIX_TTL_S = 120.0, 60.0



def index_blocks(metrics_url: str) -> tuple[int, int]:
    used = cap = 0
    for line in urllib.request.urlopen(metrics_url, timeout=5).read().decode().splitlines():
        if line.startswith("warmroute_prefix_index_blocks{"):
            used += int(float(line.split()[-1]))
        elif line.startswith("warmroute_prefix_index_capacity_blocks{"):
            cap += int(float(line.split()[-1]))
    return used, cap


def sample(stack: Stack, label: str, rate: float, t0: float) -> dict:
    st = stack.state()
    used, cap = index_blocks(stack.brain_metrics)
    cc = st["chain_cache"]
    return {"at": label, "t_s": round(time.monotonic() - t0), "rss_mib": round(rss_mib(stack.brain.popen.pid), 1),
            "session_pins": st["session_pins"], "session_pin_bound": int(rate * SESSION_TTL_S * 1.1) + 16,
            "prefix_pins": st["prefix_pins"], "index_blocks": used, "index_bound": cap,
            "chain_sessions": cc["sessions"], "chain_bound": cc["max_sessions"],
            "request_ids": st["request_ids_held"], "open_reservations": st["open_reservations"]}


class Load(OpenLoad):
    """Every request a new session: the worst case for pins, the prefix index and the chain cache."""

    def __init__(self, url: str, rate: float):
        super().__init__(rate)
        self.url = url
        self.ok = self.failed = 0

    async def _one(self, http, i: int) -> None:
        body = {"model": MOCK_MODEL, "max_tokens": 8, "messages": [
            {"role": "system", "content": f"You are agent {i % 4} for the monorepo. " * 60},
            {"role": "user", "content": f"unique session {i}: " + "context line\n" * 40}]}
        try:
            async with http.post(self.url + "/v1/chat/completions", json=body,
                                 headers={"x-session-id": f"soak-{i}"}) as r:
                await r.read()
                self.ok += r.status == 200
                self.failed += r.status != 200
        except Exception:
            self.failed += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="load duration (at most 90)")
    ap.add_argument("--probes", action="store_true", help="every hardening probe beside the load (make chaos's round): "
                    "the brain's RSS must stay flat after its first step")
    ap.add_argument("--rate", type=float, default=20.0, help="new sessions (requests) per second")
    ap.add_argument("--out", default="docs/soak.md", help="where the table is written ('': print only)")
    args = ap.parse_args(argv)
    minutes = min(args.minutes, 90.0)
    config = {"pins": {"session_ttl_s": SESSION_TTL_S, "prefix_ttl_s": PREFIX_TTL_S}}
    rows = []
    with Stack(4, config=config, mock_args=["--speedup", "20", "--kv-tokens", "200000"]) as stack:
        stack.wait_all_live(120)
        t0 = time.monotonic()
        rows.append(sample(stack, "start", args.rate, t0))
        load = Load(stack.url, args.rate).start()
        probes = None
        if args.probes:
            from bench.faults.probes import Probes, unexpected

            probes = Probes(stack.url, stack.envoy_admin_path, stack.brain_admin).start()
        end = t0 + minutes * 60
        # the first step (caches, tables and allocator arenas filling) is over by a tenth of the run; flat after it
        marks = {"first step": t0 + minutes * 6, "middle": t0 + minutes * 30, "end": end}
        for label, at in marks.items():
            while time.monotonic() < at:
                time.sleep(min(30.0, max(0.0, at - time.monotonic())))  # the soak's own clock, not synchronisation
                print(f"  t={time.monotonic() - t0:5.0f}s sent {load.sent} ok {load.ok} failed {load.failed}  "
                      f"{sample(stack, 'now', args.rate, t0)}", flush=True)
            if label == "end":
                load.stop()
                if probes is not None:
                    probes.stop()
            rows.append(sample(stack, label, args.rate, t0))
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    grown = [c for c, b in (("session_pins", "session_pin_bound"), ("index_blocks", "index_bound"),
                            ("chain_sessions", "chain_bound")) if any(r[c] > r[b] for r in rows)]
    first, last = next(r for r in rows if r["at"] == "first step"), rows[-1]
    # flat: what the brain holds past its first step grew by less than a tenth (allocator noise is a few MiB)
    if last["rss_mib"] > first["rss_mib"] * 1.10 + 4:
        grown.append(f"rss_mib ({first['rss_mib']} after the first step, {last['rss_mib']} at the end)")
    verdict = ("nothing grew past its bound, RSS flat after the first step" if not grown
               else f"PAST ITS BOUND: {', '.join(grown)}")
    if probes is not None:
        bad = unexpected(probes.counts)
        verdict += f"; probes: {sum(sum(c.values()) for c in probes.counts.values())} answered, " + (
            "each as designed" if not bad else f"UNEXPECTED {bad}")
        grown += ["probes"] if bad else []
    text = "\n".join(lines) + (f"\n\n{load.sent} requests ({load.ok} ok, {load.failed} failed) in {minutes:g} min: "
                               f"{verdict}.\n")
    write_report(args.out, "`make soak`: unique sessions at a steady rate",
                 f"{args.rate:g} new sessions/s for {minutes:g} min through Envoy + brain + 4 mock replicas (pin TTLs "
                 f"{SESSION_TTL_S:g} s / {PREFIX_TTL_S:g} s so that the run reaches the steady state). Bounds: session "
                 f"pins "
                 "= rate x TTL (+10%); index = the replicas' cache sizes in blocks; chain cache = its max_sessions.",
                 text)
    return 1 if grown else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``warmroute top``: a live terminal view of the brain and the data plane.

Per replica: health state, cooldown, effective load, in-flight weight,
pins, and traffic share both as the brain decided it and as Envoy's admin
stats count it (``cluster.<replica>.upstream_rq_total``); totals; the last
state changes. ``warmroute up`` prints the same table as text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

from extproc.contract import EXT_PROC_STAT_PREFIX, FALLBACK_CLUSTER
from extproc.tools.stack import admin_http


@dataclass
class Row:
    name: str
    state: str
    drained: bool
    cooldown_left: float
    effective_running: float
    effective_waiting: float
    wlc_in_flight: float
    session_pins: int
    prefix_pins: int
    brain_share: float
    envoy_share: float
    scrape_error: str | None
    engine: str = "vllm"
    candidate_decisions: int = 0  # decisions made while it was LIVE or PROBING and not drained
    # the active sessions' context and the cache it must fit in (engine tokens; None: not the warm policy). Flow
    # control holds a new session that fits beside no replica's
    working_set: tuple[float, float] | None = None
    role: str = "both"  # prefill/decode disaggregation: a prefill replica takes prefill legs, never a decision
    prediction_error: dict | None = None  # predicted time to first token against Envoy's (bias, mape, ...)


@dataclass
class Snapshot:
    rows: list[Row]
    decisions: int
    envoy_requests: int
    fail_open: int
    failure_mode_allowed: int
    open_reservations: int
    by_reason: dict[str, int]
    transitions: list[dict] = field(default_factory=list)
    policy: str = "warm"
    selects: int = 0  # decisions the router made (fallbacks included)
    flow: dict | None = None  # flow control's state (None: off)


def _get_json(url: str, timeout: float = 2.0, token: str | None = None) -> dict:
    return json.loads(admin_http.request(url, timeout=timeout,
                                         headers={"Authorization": f"Bearer {token}"} if token else None))


def snapshot(brain_admin: str, envoy_admin: str | None, token: str | None = None) -> Snapshot:
    """``envoy_admin``: a TCP URL or ``http+unix://`` (Envoy's admin socket); ``token``: the brain's admin token."""
    st = _get_json(brain_admin + "/state", token=token)
    stats: dict[str, int] = {}
    if envoy_admin:
        try:
            stats = {s["name"]: s["value"] for s in _get_json(envoy_admin + "/stats?format=json")["stats"] if "value"
                     in s}
        except OSError:
            stats = {}
    names = [r["name"] for r in st["replicas"]]
    envoy = {n: stats.get(f"cluster.{n}.upstream_rq_total", 0) for n in names}
    tot_d = sum(r["decisions"] for r in st["replicas"]) or 0
    tot_e = sum(envoy.values())
    rows = [
        Row(r["name"], r["state"], r["drained"], r["cooldown_remaining_s"], r["effective_running"],
            r["effective_waiting"],
            r["wlc_in_flight"], r["session_pins"], r["prefix_pins"], r["decisions"] / tot_d if tot_d else 0.0,
            envoy[r["name"]] / tot_e if tot_e else 0.0, r.get("scrape_error"), r.get("engine", "vllm"),
            r.get("candidate_decisions", 0), _working_set(r.get("predicted")), r.get("role", "both"),
            r.get("prediction_error"))
        for r in st["replicas"]
    ]
    allowed = sum(v for k, v in stats.items() if k.endswith(f"ext_proc.{EXT_PROC_STAT_PREFIX}.failure_mode_allowed"))
    return Snapshot(rows, tot_d, tot_e, stats.get(f"cluster.{FALLBACK_CLUSTER}.upstream_rq_total", 0), allowed,
                    st["open_reservations"], st["decisions_by_reason"], st.get("recent_transitions", []),
                    st.get("policy", "warm"), st.get("selects", tot_d), st.get("flow_control"))


def _working_set(predicted: dict | None) -> tuple[float, float] | None:
    if not predicted or "active_session_tokens" not in predicted:
        return None
    return predicted["active_session_tokens"], predicted["cache_tokens"]


def _k(tokens: float) -> str:
    return f"{tokens / 1000:.1f}K"


HEAD = ("replica", "state", "cooldown", "eff_run", "eff_wait", "in_flight", "sess_pins", "pfx_pins", "brain share",
        "envoy share",
        "ttft bias/err", "engine", "last scrape error")
# the same columns in a narrow terminal; LEGEND says what they are
SHORT = ("replica", "state", "cool", "run", "wait", "infl", "spin", "ppin", "brain", "envoy", "ttft", "engine")
LEGEND = ("cool: cooldown left; run/wait: effective running/waiting; infl: in-flight weight; spin/ppin: session/prefix "
          "pins; brain/envoy: traffic share as the brain decided it / as Envoy counted it; ttft: the predicted time "
          "to first token against Envoy's, bias/mean absolute error")
LOW_SHARE = 0.05  # below this share of the decisions a replica's row gets a line saying why
_WHY_PASSED_OVER = {
    "warm": "the policy's cost estimate was lower elsewhere each time: sessions stay on the replica that holds their "
            "context, and this load fit on the others",
    "seed": "the seed pipeline chose elsewhere each time: the others held the sessions' and prefixes' pins, or were "
            "as little loaded",
}


def _cells(r: Row) -> list[str]:
    return [r.name, r.state + ("*" if r.drained else ""), f"{r.cooldown_left:.0f}s", f"{r.effective_running:.1f}",
            f"{r.effective_waiting:.1f}", f"{r.wlc_in_flight:.1f}", str(r.session_pins), str(r.prefix_pins),
            f"{r.brain_share:.0%}", f"{r.envoy_share:.0%}", _prediction(r.prediction_error), r.engine,
            (r.scrape_error or "")[:60]]


def _prediction(e: dict | None) -> str:
    """The bias and the mean absolute error of the predicted time to first token, e.g. ``+12%/25%`` (-: none)."""
    return f"{e['bias']:+.0%}/{e['mape']:.0%}" if e else "-"


def _totals(s: Snapshot) -> str:
    # the fallback route carries two kinds of request: those the brain failed to answer (fail-open) and
    # those it is never asked about (no body: GET /v1/models, probes), which are not a failure
    bodyless = max(0, s.fail_open - s.failure_mode_allowed)
    return (f"decisions {s.decisions}; Envoy upstream requests {s.envoy_requests}; fail-open (brain did not answer) "
            f"{s.failure_mode_allowed}; without a body (brain not asked) {bodyless}; open reservations "
            f"{s.open_reservations}")


def flow_line(s: Snapshot) -> str | None:
    """Flow control in one line: held now and mean wait per class, refusals by reason."""
    f = s.flow
    if f is None:
        return None
    per = ", ".join(f"{name} {c['held']}" + (f" (mean wait {c['mean_wait_s']:.1f}s)" if c["mean_wait_s"] is not None
                                             else "") for name, c in f["classes"].items())
    refused = ", ".join(f"{why} {n}" for why, n in sorted(f["refused"].items()))
    sets = ", ".join(f"{r.name} {_k(r.working_set[0])}/{_k(r.working_set[1])}" for r in s.rows if r.working_set)
    return f"flow control: held {f['held']} ({per}); refused {refused}" + (
        f"; active contexts / cache: {sets}" if sets else "")


def low_share_reasons(s: Snapshot) -> list[str]:
    """One line per replica that took under LOW_SHARE of the decisions, saying why from the brain's own view."""
    out = []
    if not s.selects:
        return out
    for r in s.rows:
        if r.brain_share >= LOW_SHARE:
            continue
        head = f"{r.name} took {r.brain_share:.0%} of the decisions:"
        if r.drained:
            out.append(f"{head} it is drained (operator), so it takes no new requests")
        elif r.role == "prefill":
            out.append(f"{head} it is of role prefill: it takes the prefill legs of requests decoded elsewhere, "
                       "never a whole request")
        elif r.candidate_decisions < s.selects:
            out.append(f"{head} it was out of the pool (EJECTED or drained) for {s.selects - r.candidate_decisions} "
                       f"of the {s.selects} decisions; it is {r.state} now")
        else:
            why = _WHY_PASSED_OVER.get(s.policy, f"the {s.policy} policy chose elsewhere each time")
            out.append(f"{head} it could have taken all {s.selects}; {why}")
    return out


def _grid(header, rows, sep: str) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    # names and words left, numbers right
    left = {0, 1, len(header) - 1}

    def line(cells):
        return sep.join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header)] + [line(r) for r in rows]


def text_table(s: Snapshot, width: int | None = None) -> str:
    """The table as text, fitted to ``width`` columns (the terminal's by default): full headers where they fit,
    short ones with a legend where not; scrape errors and the why of a low share as lines below."""
    import shutil
    import textwrap

    width = width or shutil.get_terminal_size((100, 24)).columns
    rows = [_cells(r)[:-1] for r in s.rows]
    out = _grid(HEAD[:-1], rows, "  ")
    legend = False
    if max(len(x) for x in out) > width:
        out = _grid(SHORT, rows, " ")
        legend = True
    notes = [f"{r.name} last scrape error: {r.scrape_error}" for r in s.rows if r.scrape_error]
    notes.append(_totals(s) + ("  (* drained)" if any(r.drained for r in s.rows) else ""))
    if s.flow is not None:
        notes.append(flow_line(s))
    notes += low_share_reasons(s)
    if legend:
        notes.append(LEGEND)
    for n in notes:
        out += textwrap.wrap(n, width, subsequent_indent="  ") or [""]
    return "\n".join(out)


_COLOR = {"LIVE": "green", "PROBING": "yellow", "EJECTED": "red"}


def rich_view(s: Snapshot, title: str):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, expand=False)
    for i, h in enumerate(HEAD):
        t.add_column(h, justify="left" if i < 2 or i >= 11 else "right")
    for r in s.rows:
        cells = _cells(r)
        cells[1] = f"[{_COLOR.get(r.state, 'white')}]{cells[1]}[/]"
        t.add_row(*cells)
    changes = Table(title="last state changes", expand=False, show_edge=False)
    for h in ("ago", "replica", "change", "reason", "cooldown"):
        changes.add_column(h)
    for tr in reversed(s.transitions[-8:]):
        changes.add_row(f"{tr['at_s_ago']:.0f}s", tr["replica"], f"{tr['old']} -> {tr['new']}", tr["reason"],
                        f"{tr['cooldown_s']:.0f}s" if tr["new"] == "EJECTED" else "")
    flow = [Text(flow_line(s))] if s.flow is not None else []
    return Group(t, Text(_totals(s)), *flow, *(Text(x) for x in low_share_reasons(s)), changes)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="read the brain's admin port and token file and Envoy's admin socket from this "
                    "config file")
    ap.add_argument("--brain-admin", help="e.g. http://127.0.0.1:9101 (default: from --config)")
    ap.add_argument("--envoy-admin", help="Envoy's admin socket, e.g. /run/warmroute/envoy-admin.sock (default: from "
                    "--config)")
    ap.add_argument("--token-file", help="the brain's admin token (default: brain.admin_token_file from --config)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    brain, envoy, token_file = args.brain_admin, args.envoy_admin, args.token_file
    if args.config:
        from extproc.config import load_config

        cfg = load_config(args.config)
        brain = brain or f"http://127.0.0.1:{cfg.brain.admin_port}"
        envoy = envoy or cfg.envoy.admin_path
        token_file = token_file or cfg.brain.admin_token_file
    brain = brain or "http://127.0.0.1:9101"
    if envoy and envoy.startswith("/"):
        envoy = admin_http.unix_url(envoy)
    token = None
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            print(f"warmroute top: cannot read the admin token {token_file} ({e.strerror})", file=sys.stderr)
            return 2
    console = Console()
    title = f"warmroute top  (brain {brain}, Envoy {envoy or '-'})"
    if args.once:
        console.print(rich_view(snapshot(brain, envoy, token), title))
        return 0
    try:
        with Live(rich_view(snapshot(brain, envoy, token), title), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(rich_view(snapshot(brain, envoy, token), title))
                except OSError as e:
                    from rich.text import Text

                    live.update(Text(f"cannot reach the brain at {brain}: {e}", style="red"))
    except KeyboardInterrupt:
        return 0

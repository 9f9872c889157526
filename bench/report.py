"""The live benchmark's report: one row per contender and scenario, its tables and its plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# flow control's scenarios (issue 34): their own table, per class
FLOW_SCENARIOS = ("burst", "noisy_tenant")


@dataclass(kw_only=True)
class Measured:
    """What every bench's row says of one contender's run, as its clients saw it (the benches' rows extend it)."""
    sent: int = 0
    errors: int = 0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    out_tok_s: float = 0.0
    client_lag_ms: float = float("nan")  # the client's own event-loop lag, p99, wall ms
    pace: str = ""  # why this run measured the machine, not the replicas (harness.pace_check); "": it did not
    refused: int = 0  # 429s with Retry-After, each sent again
    classes: dict = field(default_factory=dict)  # measure.per_class of the measured window
    note: str = ""
    ttfts: list[float] = field(default_factory=list)  # every answered request's, as the client saw it


@dataclass
class Row(Measured):
    contender: str
    scenario: str
    speedup: float = 0.0
    e2e_p50: float = float("nan")
    e2e_p99: float = float("nan")
    prefix_hit: float = 0.0
    imbalance: float = float("nan")
    fleet_hit: float = 0.0  # the mocks' own counters, warm-up included (what the replicas' dashboards show)
    not_engine_p50: float = float("nan")  # of each TTFT, what was not the engine's: client, Envoy, brain, HTTP
    brain_ms: float = float("nan")  # the brain's mean decision time, workload milliseconds
    lost: int = 0
    paces: list[str] = field(default_factory=list)  # the faster paces tried before this one, and why each was left
    others_p99: float = float("nan")  # noisy_tenant: the other tenants' TTFT p99
    share: list[list[float]] = field(default_factory=list)



def table(rows: list[Row]) -> str:
    head = ("| contender | scenario | pace | TTFT p50 s | TTFT p99 s | not-engine p50 s | brain ms | e2e p50 s | e2e "
            "p99 s | "
            "out tok/s | prefix hit | imbalance | sent | errors | lost "
            "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if r.note:
            lines.append(f"| {r.contender} | {r.scenario} | {r.note} ||||||||||||| ")
            continue
        brain = f"{r.brain_ms:.1f}" if r.brain_ms == r.brain_ms else "—"
        pace = f"{r.speedup:g}x" + (f" (measured the machine: {r.pace})" if r.pace else "") + \
            "".join(f" (left {p})" for p in r.paces)
        lines.append(f"| {r.contender} | {r.scenario} | {pace} | {r.ttft_p50:.2f} | {r.ttft_p99:.1f} | "
                     f"{r.not_engine_p50:.3f} | {brain} | "
                     f"{r.e2e_p50:.1f} | {r.e2e_p99:.1f} | "
                     f"{r.out_tok_s:.0f} | {r.prefix_hit:.1%} | {r.imbalance:.2f} | {r.sent} | {r.errors} | {r.lost} |")
    return "\n".join(lines)


def flow_table(rows: list[Row]) -> str:
    """Flow control's scenarios, per class (issue 34): TTFT from a request's first attempt, goodput (requests per
    minute that met their class's deadline: measure.GOODPUT_TTFT_S), 429s; with the noisy tenant, the other
    tenants' p99 over the same contender's on the plain workload (the same requests without the noisy tenant)."""
    plain = {r.contender: r for r in rows if r.scenario == "workload" and not r.note}
    head = ("| contender | scenario | pace | standard TTFT p50 s | standard p99 s | critical p99 s | sheddable p99 s | "
            "goodput /min | 429s | errors | lost | other tenants' p99 s (/ without the noisy tenant) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if r.scenario not in FLOW_SCENARIOS:
            continue
        if r.note:
            lines.append(f"| {r.contender} | {r.scenario} | {r.note} |||||||||| ")
            continue
        c = r.classes
        num = lambda k, f="{:.1f}", c=c: f.format(c[k]) if k in c else "—"  # noqa: E731
        others = "—"
        if r.scenario == "noisy_tenant":
            base = plain.get(r.contender)
            others = f"{r.others_p99:.1f}" + (f" ({r.others_p99 / base.ttft_p99:.2f}x)" if base else "")
        lines.append(f"| {r.contender} | {r.scenario} | {r.speedup:g}x{' (' + r.pace + ')' if r.pace else ''} | "
                     f"{num('standard_ttft_p50', '{:.2f}')} | {num('standard_ttft_p99')} | {num('critical_ttft_p99')} "
                     f"| "
                     f"{num('sheddable_ttft_p99')} | {c.get('goodput', 0.0):.1f} | {r.refused} | {r.errors} | {r.lost} "
                     f"| "
                     f"{others} |")
    return "\n".join(lines) if len(lines) > 1 else ""


def plots(rows: list[Row], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    main = [r for r in rows if r.scenario == "workload" and r.ttfts]
    if not main:
        return files
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in main:
        ys = [(i + 1) / len(r.ttfts) for i in range(len(r.ttfts))]
        ax.plot(r.ttfts, ys, label=r.contender, lw=2.2 if r.contender == "warmroute" else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, seconds of workload time (log)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF per contender (same workload, fresh replicas each)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "bench-ttft-cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)

    n = len(main)
    cols = 2
    rws = -(-n // cols)
    fig, axes = plt.subplots(rws, cols, figsize=(12, 2.4 * rws), sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes.flat, main):
        used = [(m, row) for m, row in enumerate(r.share) if sum(row) > 0]  # the last bucket may be empty
        if used:
            mins = [m for m, _ in used]
            ax.stackplot(mins, list(zip(*[row for _, row in used])), labels=[f"r{i}" for i in range(len(used[0][1]))])
        ax.set_title(f"{r.contender}: imbalance {r.imbalance:.2f}", fontsize=9)
        ax.set_ylim(0, 1)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7, ncol=4, loc="upper right")
    fig.suptitle("Traffic share per replica over workload minutes", fontsize=11)
    fig.tight_layout()
    p = out / "bench-share.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)
    return files

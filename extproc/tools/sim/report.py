"""Tables and plots of simulator results."""

from __future__ import annotations

from extproc.tools.sim.simulator import SimResult

COLUMNS = [
    ("policy", "policy", "{:<30}"),
    ("ttft_p50", "TTFT p50", "{:>9.2f}"),
    ("ttft_p90", "p90", "{:>8.2f}"),
    ("ttft_p99", "p99", "{:>8.1f}"),
    ("e2e_p50", "e2e p50", "{:>8.1f}"),
    ("e2e_p99", "p99", "{:>8.1f}"),
    ("output_tok_s", "out tok/s", "{:>10.0f}"),
    ("prefix_hit_rate", "prefix hit", "{:>11.1%}"),
    ("imbalance_mean", "imbalance", "{:>10.2f}"),
    ("imbalance_max", "worst", "{:>6.2f}"),
    ("max_share", "max share", "{:>10.1%}"),
    ("requests", "requests", "{:>9}"),
    ("errors", "errors", "{:>7}"),
    ("ttft_pred_err_p50", "pred err", "{:>9.2f}"),
    ("ttft_pred_mape", "MAPE", "{:>6.2f}"),
    ("ttft_pred_bias", "bias", "{:>+6.0%}"),
]


def table(results: list, title: str | None = None) -> str:
    """One row per result (anything with ``summary()``)."""
    sums = [r.summary() for r in results]
    cols = COLUMNS
    if any(x.get("restore_hit_rate") for x in sums):  # engines with an offloaded tier: hits by tier
        k = next(i for i, c in enumerate(COLUMNS) if c[0] == "prefix_hit_rate") + 1
        cols = [*COLUMNS[:k], ("restore_hit_rate", "CPU hit", "{:>8.1%}"), *COLUMNS[k:]]
    head = "".join(f"{label:<30}" if key == "policy" else f"{label:>{_width(fmt)}}" for key, label, fmt in cols)
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for s in sums:
        lines.append("".join(fmt.format(s[key]) if key in s else f"{'-':>{_width(fmt)}}" for key, _, fmt in cols))
    lines.append("TTFT and e2e in seconds (after a 2 min warm-up); imbalance = max share / mean share per minute, "
                 "mean and worst minute; prefix hit = the replicas' own prefix-cache hit rate in tokens (CPU hit: "
                 "restored from an offloaded tier); "
                 "pred err = median |predicted - observed| TTFT of the warm policy, MAPE its mean absolute "
                 "percentage error, bias summed predicted over summed observed, minus one")
    return "\n".join(lines)


def _width(fmt: str) -> int:
    spec = fmt.split(":")[1].rstrip("}")
    digits = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
    return int(digits) if digits else 8


def share_plot(results: list[SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = 2 if n > 1 else 1
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes.flat, results):
        minutes = [m for m, row in enumerate(r.share_per_minute) if sum(row)]
        shares = [[r.share_per_minute[m][i] / sum(r.share_per_minute[m]) for m in minutes] for i in range(r.n)]
        ax.stackplot(minutes, shares, labels=[f"r{i}" for i in range(r.n)])
        s = r.summary()
        ax.set_title(f"{r.policy}: TTFT p99 {s['ttft_p99']:.1f}s, hit {s['prefix_hit_rate']:.0%}, "
                     f"imbalance {s['imbalance_mean']:.2f}", fontsize=9)
        ax.set_ylim(0, 1)
        ax.axhline(1 / r.n, color="white", lw=0.8, ls="--")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(loc="upper right", fontsize=7, ncol=r.n)
    for ax in axes[-1]:
        ax.set_xlabel("simulated minute")
    for ax in axes[:, 0]:
        ax.set_ylabel("traffic share")
    fig.suptitle("Traffic share per replica over time (same workload and seed for every policy)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

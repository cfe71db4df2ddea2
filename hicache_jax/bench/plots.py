"""One PNG per workload: throughput and TTFT per configuration, the TTFT distribution
(CDF) of each, and cached prompt tokens per tier in each round (matplotlib, Agg backend: no
display needed)."""

from __future__ import annotations

import os

from hicache_jax.tiers import Tier

TIER_COLORS = {Tier.DEVICE: "#1f77b4", Tier.HOST: "#ff7f0e", Tier.STORAGE: "#2ca02c"}
HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")  # one per configuration and phase


def plot_workload(results: dict, workload: str, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(cfg["label"], ph) for cfg in results.values() for ph in cfg.get(workload, [])]
    names = [label if ph["phase"] == "run" else f"{label}\n{ph['phase']}" for label, ph in rows]
    fig, (ax_tp, ax_ttft, ax_cdf, ax_tier) = plt.subplots(1, 4, figsize=(21, 4.6))
    x = range(len(rows))

    ax_tp.bar([i - 0.2 for i in x], [ph["input_tok_s"] or 0 for _, ph in rows], 0.4, label="input")
    ax_tp.bar([i + 0.2 for i in x], [ph["output_tok_s"] or 0 for _, ph in rows], 0.4, label="output")
    ax_tp.set_title("throughput (tokens/s)")
    ax_tp.legend()

    for k, q in enumerate(("p50", "p90", "p99")):
        ax_ttft.bar([i + (k - 1) * 0.27 for i in x], [ph["ttft_ms"][q] or 0 for _, ph in rows], 0.27, label=q)
    ax_ttft.set_title("time to first token (ms)")
    ax_ttft.legend()
    for ax in (ax_tp, ax_ttft):
        ax.set_xticks(list(x), names, fontsize=8)

    for name, (_, ph) in zip(names, rows, strict=True):
        ttfts = ph.get("ttft_ms_sorted") or []
        if ttfts:
            n = len(ttfts)
            ax_cdf.step(ttfts, [(i + 1) / n for i in range(n)], where="post", label=name.replace("\n", " "))
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (ms)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT distribution")
    ax_cdf.legend(fontsize=7)

    # Cached tokens per tier per round: one stacked bar per configuration in each round.
    width = 0.8 / max(1, len(rows))
    top = 0
    for i, (_, ph) in enumerate(rows):
        for r in ph["per_round"]:
            pos = r["round"] + (i - (len(rows) - 1) / 2) * width
            bottom = 0
            for tier, color in TIER_COLORS.items():
                hatch = HATCHES[i % len(HATCHES)]
                ax_tier.bar(pos, r[tier], width, bottom=bottom, color=color, hatch=hatch, edgecolor="white")
                bottom += r[tier]
            top = max(top, bottom)
    # Zero-height bars on top of a stack pin the autoscale below the stack's top: set it.
    ax_tier.set_ylim(0, 1.1 * top if top else 1)
    ticks = sorted({r["round"] for _, ph in rows for r in ph["per_round"]})
    ax_tier.set_xticks(ticks, [str(t) for t in ticks])
    ax_tier.set_xlabel("round")
    ax_tier.set_title("cached prompt tokens per tier")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in TIER_COLORS.values()]
    handles += [
        plt.Rectangle((0, 0), 1, 1, facecolor="#bbbbbb", hatch=HATCHES[i % len(HATCHES)], edgecolor="white")
        for i in range(len(rows))
    ]
    labels = list(TIER_COLORS) + [n.replace("\n", " ") for n in names]
    ax_tier.legend(handles=handles, labels=labels, fontsize=7)
    fig.suptitle(workload.replace("_", " "))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

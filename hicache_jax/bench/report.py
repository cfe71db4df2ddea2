"""From records to numbers: one summary per phase, and the Markdown tables.

Throughput is tokens over the phase's wall time (first send to last reply). The hit rate
is cached prompt tokens over prompt tokens; ``max_hit_rate`` is the theoretical maximum
(``theoretical.py``) and ``capacity_max_hit_rate`` the one under the server's configured
capacity; ``achieved_over_max`` is cached tokens over the theoretical maximum. A phase
whose prompt ids are not all known (chat requests the benchmark could not render as the
server did: ``Record.exact_ids``) has hit rates but no maximum (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache_jax.bench.client import Record, ServerInfo
from hicache_jax.bench.theoretical import SeqRecord, capacity_max, theoretical_max
from hicache_jax.tiers import TIERS

QUANTILES = (50, 90, 99)


def _quantiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in QUANTILES}
    return {f"p{q}": 1000 * float(np.percentile(values, q)) for q in QUANTILES}


def _ratio(a: float, b: float) -> float | None:
    return a / b if a is not None and b else None


def summarize(
    phase: str,
    records: list[Record],
    seconds: float,
    info: ServerInfo,
    seen: Sequence[SeqRecord] = (),
    seen_capacity: Sequence[SeqRecord] = (),
) -> dict:
    """``seen``: sequences of an earlier phase (the maximum counts hits on them);
    ``seen_capacity``: those the configured cache still holds (L3 across a restart)."""
    ok = [r for r in records if r.ok]
    seqs = [r.seq() for r in ok]
    exact = all(r.exact_ids for r in ok)
    if exact:
        best = theoretical_max(seqs, info.rules, info.chunk, seen=seen)
        best_cap = capacity_max(seqs, info.rules, info.chunk, info.capacity_pages, seen=seen_capacity)
    prompt = sum(len(r.prompt) for r in ok)
    cached = sum(r.cached for r in ok)
    rounds = sorted({r.round for r in ok})
    lengths = [len(r.prompt) for r in ok]
    out = {
        "phase": phase,
        "requests": len(records),
        "errors": [r.error for r in records if not r.ok][:5],
        "num_errors": len(records) - len(ok),
        "seconds": seconds,
        "input_tokens": prompt,
        "output_tokens": sum(len(r.output) for r in ok),
        "input_tok_s": prompt / seconds if seconds else None,
        "output_tok_s": sum(len(r.output) for r in ok) / seconds if seconds else None,
        "ttft_ms": _quantiles_ms([r.ttft for r in ok]),
        "ttft_ms_sorted": sorted(round(1000 * r.ttft, 3) for r in ok),  # the CDF's points
        "ttft_parts_ms": ttft_parts(ok),
        "tpot_ms": _quantiles_ms([t for r in ok if (t := r.tpot) is not None]),
        "cached_tokens": cached,
        "cached_tokens_per_tier": {t: sum(r.cached_tiers[t] for r in ok) for t in TIERS},
        "prompt_tokens_per_request": {
            "min": min(lengths, default=None),
            "p50": float(np.median(lengths)) if lengths else None,
            "max": max(lengths, default=None),
        },
        "exact_ids": exact,
        "hit_rate": _ratio(cached, prompt),
        "per_round": [
            {
                "round": k,
                "requests": sum(r.round == k for r in ok),
                "input_tokens": sum(len(r.prompt) for r in ok if r.round == k),
                **{t: sum(r.cached_tiers[t] for r in ok if r.round == k) for t in TIERS},
                "ttft_ms_p50": _quantiles_ms([r.ttft for r in ok if r.round == k])["p50"],
            }
            for k in rounds
        ],
    }
    if exact:
        out |= {
            "max_cached_tokens": sum(best),
            "capacity_max_cached_tokens": sum(best_cap),
            "max_hit_rate": _ratio(sum(best), prompt),
            "capacity_max_hit_rate": _ratio(sum(best_cap), prompt),
            "achieved_over_max": _ratio(cached, sum(best)),
            "achieved_over_capacity_max": _ratio(cached, sum(best_cap)),
            "requests_over_max": sum(r.cached > b for r, b in zip(ok, best)),
        }
    else:
        out |= dict.fromkeys(
            ("max_cached_tokens", "capacity_max_cached_tokens", "max_hit_rate", "capacity_max_hit_rate")
            + ("achieved_over_max", "achieved_over_capacity_max", "requests_over_max")
        )
    return out


# Where a request's time to first token went, from the server's meta_info "timing" (medians
# over the requests that have the part; the others never waited on it).
TTFT_PARTS = ("loop_wait_s", "l3_probe_s", "l3_read_s", "l3_landed_s", "l2_load_s", "admitted_s")


def ttft_parts(records: list[Record]) -> dict:
    """Median milliseconds of each part (``TTFT_PARTS``), of the server's TTFT, of what came
    after admission (``after_admission``: the L2 -> L1 loads, the prefill steps and the first
    token's read-back), and the client's TTFT beyond the engine's (``client_extra``: HTTP,
    ``loop_wait`` included, and the first event's delivery)."""
    out = {}
    for part in TTFT_PARTS:
        vals = [r.server_timing[part] for r in records if part in r.server_timing]
        out[part.removesuffix("_s")] = (1000 * float(np.median(vals)), len(vals)) if vals else (None, 0)
    served = [r for r in records if r.server_ttft is not None]
    if served:
        out["server_ttft"] = (1000 * float(np.median([r.server_ttft for r in served])), len(served))
        after = [
            r.server_ttft - r.server_timing["admitted_s"] for r in served if "admitted_s" in r.server_timing
        ]
        out["after_admission"] = (1000 * float(np.median(after)), len(after)) if after else (None, 0)
        out["client_extra"] = (1000 * float(np.median([r.ttft - r.server_ttft for r in served])), len(served))
    return {k: {"p50_ms": v[0], "requests": v[1]} for k, v in out.items()}


def _fmt(x, digits: int = 0, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else f"{x:,.{digits}f}"


HEADER = (
    "| config | phase | in tok/s | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
    "| cached device/host/storage | hit rate | max | max (capacity) | achieved/max |"
)


def markdown(results: dict, workload: str) -> str:
    """One table for one workload: a row per configuration and phase."""
    lines = [f"### {workload}", "", HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for cfg in results.values():
        for ph in cfg.get(workload, []):
            t, p = ph["ttft_ms"], ph["tpot_ms"]
            tiers = ph["cached_tokens_per_tier"]
            lines.append(
                f"| {cfg['label']} | {ph['phase']} "
                f"| {_fmt(ph['input_tok_s'])} | {_fmt(ph['output_tok_s'], 1)} "
                f"| {_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} "
                f"| {_fmt(p['p50'], 1)} / {_fmt(p['p90'], 1)} / {_fmt(p['p99'], 1)} "
                f"| {tiers['device']:,} / {tiers['host']:,} / {tiers['storage']:,} "
                f"| {_fmt(ph['hit_rate'], 1, True)} | {_fmt(ph['max_hit_rate'], 1, True)} "
                f"| {_fmt(ph['capacity_max_hit_rate'], 1, True)} | {_fmt(ph['achieved_over_max'], 2)} |"
            )
    lines += _restart_lines(results) if workload == "warm_restart" else []
    lines += _agent_lines(results) if workload == "agent" else []
    return "\n".join(lines)


def _agent_lines(results: dict, baseline: str = "none") -> list[str]:
    """The prompt each request sent, and each configuration's TTFT against no cache's."""
    out = []
    for cfg in results.values():
        for ph in cfg.get("agent", []):
            n = ph["prompt_tokens_per_request"]
            ids = "rendered here as the server did" if ph["exact_ids"] else "not known here: no maximum"
            out.append(
                f"- {cfg['label']}: prompt tokens per request {_fmt(n['min'])} / {_fmt(n['p50'])} / "
                f"{_fmt(n['max'])} (min / median / max; ids {ids})"
            )
    base = (results.get(baseline) or {}).get("agent")
    if base:
        b = base[0]["ttft_ms"]
        for name, cfg in results.items():
            if name == baseline or not cfg.get("agent"):
                continue
            t = cfg["agent"][0]["ttft_ms"]
            out.append(
                f"- {cfg['label']} over {results[baseline]['label']}: TTFT p50 "
                f"{_fmt(_ratio(t['p50'], b['p50']), 2)}x, p90 {_fmt(_ratio(t['p90'], b['p90']), 2)}x"
            )
    return ["", *out] if out else []


def _restart_lines(results: dict) -> list[str]:
    out = []
    for cfg in results.values():
        phases = {ph["phase"]: ph for ph in cfg.get("warm_restart", [])}
        if "cold" in phases and "warm" in phases:
            cold, warm = phases["cold"]["ttft_ms"]["p50"], phases["warm"]["ttft_ms"]["p50"]
            how = "process restart" if phases["warm"].get("restart") == "process" else "flush"
            out.append(f"- {cfg['label']}: TTFT p50 after the {how}: {_fmt(_ratio(warm, cold), 2)}x cold")
            for phase in ("cold", "warm"):
                parts = phases[phase].get("ttft_parts_ms") or {}
                shown = ", ".join(
                    f"{k} {_fmt(v['p50_ms'], 1)} ms ({v['requests']})"
                    for k, v in parts.items()
                    if v["requests"]
                )
                out.append(f"  - {phase} TTFT parts (p50, requests): {shown or '-'}")
            starts = cfg.get("startup_s") or []
            if len(starts) > 1:
                out.append(f"  - server start-up: first {starts[0]:.1f} s, restart {starts[-1]:.1f} s")
    return ["", *out] if out else []


def speedups(results: dict, workload: str, baseline: str = "none") -> dict[str, float | None]:
    """Input-token throughput of each configuration over the baseline's."""
    base = results.get(baseline, {}).get(workload)
    if not base:
        return {}
    b = base[0]["input_tok_s"]
    return {n: _ratio(cfg[workload][0]["input_tok_s"], b) for n, cfg in results.items() if workload in cfg}

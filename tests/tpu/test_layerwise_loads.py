"""L2 pages loaded layer by layer (``models/page_loads.py``), compiled for a TPU slice: the
scheduled step starts the host-to-device copies of later layers' pages before it waits
for them, so they run while earlier layers compute.

The order is read from the compiled program's scheduled entry computation: each host copy
is a ``copy-start`` whose source lies in host memory (memory space ``S(5)``) and its
``copy-done``; the layers' compute is marked by their tensor-parallel all-reduces (two per
layer at tp 4: after the attention output and after the MLP)."""

from __future__ import annotations

import re

from hicache_jax.config import EngineConfig
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.target import target

LAYERS = 3


def schedule(program) -> list[tuple[str, str, str]]:
    """(name, opcode, line) of each instruction of the entry computation, in order."""
    text = program.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?(%\S+) = .*? ([a-z][\w-]*)\(", line)
        if m:
            out.append((m.group(1), m.group(2), line))
    return out


def host_copies(ops) -> dict[str, tuple[int, int]]:
    """Host-to-device copies: copy-start name -> (its position, its copy-done's position)."""
    starts = {}
    for n, (name, op, line) in enumerate(ops):
        if op == "copy-start":
            shapes = re.match(r".*? = \((\S+), (\S+), ", line)
            if shapes and "S(5)" in shapes.group(2) and "S(5)" not in shapes.group(1):
                starts[name] = n
    done = {}
    for n, (_, op, line) in enumerate(ops):
        if op == "copy-done":
            src = re.search(r"copy-done\((%[\w.\-]+)\)", line).group(1)
            if src in starts:
                done[src] = (starts[src], n)
    return done


def test_layer_pages_arrive_while_earlier_layers_compute():
    cfg = EngineConfig(
        tp_size=4,
        dtype="bfloat16",
        page_size=16,
        chunked_prefill_size=128,
        max_running_requests=8,
        max_total_tokens=65536,
        enable_hierarchical_cache=True,  # on TPU, -1 (auto) takes a chunk's pages layer by layer
    )
    server = AbstractServer.build(real_config("llama-3-8b", num_layers=LAYERS), cfg, target("v5e:2x2"))
    pages = server.transfer.step_pages
    assert pages == 128 // 16
    T, S = server.builder.buckets[-1], server.builder.max_running
    want = f"prefill step T={T} S={S} R={S} top=0 +{pages} pages layer by layer"
    ((_, program),) = list(server.compile(lambda name: name == want))
    ops = schedule(program)
    copies = host_copies(ops)
    assert len(copies) == 2 * LAYERS, copies  # each layer's k and v pages
    reduces = [n for n, (_, op, _) in enumerate(ops) if op in ("all-reduce", "all-reduce-start")]
    # Waited for one layer at a time: between consecutive layers' waits the earlier layer ran.
    waits = sorted(d for _, d in copies.values())
    for a, b in zip(waits[1::2], waits[2::2]):
        assert any(a < r < b for r in reduces), (a, b, reduces)
    # In flight together with compute: the last layer's copies started before the earlier
    # layers' reductions and were waited for after them.
    last = sorted(copies.values(), key=lambda sd: sd[1])[-2:]
    for start, done in last:
        between = [r for r in reduces if start < r < done]
        assert len(between) >= 2 * (LAYERS - 1), (start, done, reduces)

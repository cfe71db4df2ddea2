"""Compile-only: the Pallas attention and KV-write kernels compile for TPU v5e, v6e and v5p at
the shapes the supported model families produce per shard, read the page pools in place,
count in ``cost_analysis()``, and plan tiles inside the VMEM budget (``tests/tpu/conftest.py``
skips all without libtpu).

The matrix rotates parameters rather than multiplying them (``_matrix``): each chip sees
every head dim, KV head count, dtype and kind (decode, prefill), while query heads per KV
head (1..8), page sizes, windows (some ending mid-page), the soft cap, token buckets and
page-table widths (up to 65,536 tokens a sequence) rotate through them; v5p, the smallest
VMEM, takes a few. ``HICACHE_TPU_FULL=1`` compiles every (head dim, KV heads, dtype) as
both kinds on both v5e and v6e (96 compiles, a few minutes).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from hicache_jax.models.kernels import vmem
from hicache_jax.models.kernels.ragged_paged_attention import kernel, kv_write
from hicache_jax.tpu import target

V5E, V6E, V5P = target.TOPOLOGIES[0], target.TOPOLOGIES[1], target.TOPOLOGIES[2]
HEAD_DIMS = (64, 128, 256)
KV_HEADS = (1, 2, 4, 8)
DTYPES = ("bfloat16", "float32")
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
PAGE_SIZES = (16, 32, 64, 128)
WINDOWS = (None, 128, 512, 1024, 1000, 100)  # 1000 and 100 end mid-page
DECODE_SEQS = (8, 32, 64)
PREFILL_TOKENS = (16, 128, 512, 2048)
NUM_PAGES = 4096
LONGEST = 65536  # tokens a sequence's page-table row can reach, at the widest
FULL = os.environ.get("HICACHE_TPU_FULL") == "1"


@dataclasses.dataclass(frozen=True)
class Case:
    head_dim: int
    kv_heads: int  # per shard
    dtype: str
    group: int = 2  # query heads per KV head
    page_size: int = 16
    window: int | None = None
    soft_cap: float | None = None
    tokens: int = 64
    seqs: int = 32
    q_block: int | None = None  # 1: decode; None: the kernel's plan()
    max_pages: int = 256

    def __str__(self):
        s = self
        parts = [f"d{s.head_dim}", f"h{s.kv_heads}", f"g{s.group}", s.dtype, f"ps{s.page_size}"]
        parts += [f"w{s.window}", f"T{s.tokens}", f"S{s.seqs}", f"qb{s.q_block}", f"mp{s.max_pages}"]
        return "-".join(parts + (["cap"] if s.soft_cap else []))

    def shapes(self) -> kernel.Shapes:
        dt = jnp.dtype(self.dtype)
        Hq = self.kv_heads * self.group
        args = (self.tokens, self.seqs, Hq, self.kv_heads, self.head_dim, self.page_size, self.max_pages)
        return kernel.Shapes(*args, dt, dt, self.window)


def _matrix() -> list[tuple[str, Case]]:
    """(topology, case). Each (head dim, KV heads) compiles on one of v5e / v6e, alternating
    with both, its two dtypes as opposite kinds (decode, prefill): so each chip sees every
    head dim, KV head count, dtype and kind. The rest rotates with strides that keep the
    combinations apart. ``HICACHE_TPU_FULL=1``: every case on both chips, both kinds."""
    out = []
    for i, (D, Hkv, dtype) in enumerate(itertools.product(HEAD_DIMS, KV_HEADS, DTYPES)):
        ps = PAGE_SIZES[(i // 2) % 4]
        common = dict(head_dim=D, kv_heads=Hkv, dtype=dtype, page_size=ps, group=GROUPS[(3 * i) % 8])
        wide = LONGEST // ps if i % 3 else 1024 // ps
        n = DECODE_SEQS[i % 3]
        cap = dict(soft_cap=50.0) if (i // 2) % 3 == 1 else {}
        decode = Case(**common, **cap, q_block=1, tokens=n, seqs=n, window=WINDOWS[i % 6], max_pages=wide)
        prefill = Case(
            **common,
            **cap,
            q_block=8 if (i // 2) % 3 == 0 else None,  # 8: what models/layers/attention.py passes
            tokens=PREFILL_TOKENS[(i // 2) % 4],
            window=WINDOWS[(i + 3) % 6],
            max_pages=wide,
        )
        d_i, h_i, t_i = HEAD_DIMS.index(D), KV_HEADS.index(Hkv), DTYPES.index(dtype)
        if FULL:
            out += [(chip, case) for chip in (V5E, V6E) for case in (decode, prefill)]
        else:
            out.append(((V5E, V6E)[(d_i + h_i) % 2], (decode, prefill)[(h_i + t_i) % 2]))
    return out


# The smallest VMEM (its largest tiles compile below): wide heads, the longest table.
V5P_CASES = [
    Case(256, 4, "float32", group=2, tokens=512, max_pages=LONGEST // 16, window=1024),
    Case(256, 8, "bfloat16", group=2, tokens=64, seqs=64, q_block=1, max_pages=LONGEST // 16, window=1000),
    Case(128, 8, "bfloat16", group=4, tokens=512, page_size=64, window=512, soft_cap=30.0),
    Case(64, 2, "float32", group=7, tokens=32, seqs=32, q_block=1, page_size=128, max_pages=512),
]


def attention_args(mesh, case: Case) -> tuple:
    a = functools.partial(target.abstract, mesh)
    dt, i32 = jnp.dtype(case.dtype), jnp.int32
    pages = (NUM_PAGES, case.page_size, case.kv_heads, case.head_dim)
    return (
        a((case.tokens, case.kv_heads * case.group, case.head_dim), dt),
        a(pages, dt),
        a(pages, dt),
        a((case.seqs,), i32),
        a((case.seqs, case.max_pages), i32),
        a((case.seqs + 1,), i32),
        a((), i32),
    )


def compile_attention(topology: str, case: Case, fn=kernel.ragged_paged_attention):
    mesh = target.target(topology).mesh(1)
    static = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.window, soft_cap=case.soft_cap)
    attend = functools.partial(fn, **static, q_block=case.q_block)
    return target.compile_for(mesh, attend, *attention_args(mesh, case))


def pool_relayouts(compiled) -> list[str]:
    """Ops other than bitcasts and the kernel that read the page pools: a copy of a whole
    pool per call, where the kernel's view of the pages is not XLA's layout of them."""
    text = compiled.as_text()
    pools, bad = set(), []
    for line in text[text.index("ENTRY") :].splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = .*? ([\w-]+)\((.*)", line)  # name, op, the rest
        if not m:
            continue
        name, op, rest = m.groups()
        if op == "parameter" and re.search(r'op_name="(?:[kv]_pages|latent)"', rest):
            pools.add(name)
        elif pools & set(re.findall(r"%[\w.-]+", rest)):
            if op == "bitcast":
                pools.add(name)
            elif "tpu_custom_call" not in rest:
                bad.append(line.strip()[:200])
    return bad


@pytest.mark.parametrize("topology, case", _matrix() + [(V5P, c) for c in V5P_CASES], ids=str)
def test_attention_compiles(topology: str, case: Case):
    compiled = compile_attention(topology, case)
    # D >= 128: pages are read where they lie. (At D = 64 XLA stores a pool with the page
    # axis minor, [.., 64] being half a lane row, and relays it out for any Pallas kernel.)
    if case.head_dim >= 128:
        assert not pool_relayouts(compiled)


@pytest.mark.parametrize(
    "shapes",
    [
        dict(num_q_heads=6, num_kv_heads=3, head_dim=256, dtype="bfloat16"),
        dict(num_q_heads=8, num_kv_heads=2, head_dim=192, dtype="float32"),
    ],
    ids=["bf16-odd-heads", "d192"],
)
def test_refused_shapes_are_named_before_mosaic(shapes: dict):
    """What ``check_shapes`` refuses fails in Mosaic otherwise; the kernel checks first."""
    group = shapes["num_q_heads"] // shapes["num_kv_heads"]
    case = Case(shapes["head_dim"], shapes["num_kv_heads"], shapes["dtype"], group=group)
    with pytest.raises(ValueError, match=kernel.unsupported_reason(**shapes).split(":")[0]):
        compile_attention(V5E, case)


# The largest tiles plan() picks: the widest heads in float32 (most bytes per token) with
# one query head per KV head (most query rows on the MXU), many (GQA 8) and decode.
LARGEST = [
    Case(256, 8, "float32", group=1, tokens=2048, seqs=1, max_pages=LONGEST // 16),
    Case(256, 8, "float32", group=8, tokens=2048, seqs=32, max_pages=LONGEST // 16),
    Case(256, 8, "float32", group=8, tokens=64, seqs=64, q_block=1, max_pages=LONGEST // 16),
    Case(128, 8, "bfloat16", group=1, tokens=2048, seqs=1, page_size=128, max_pages=LONGEST // 128),
]


@pytest.mark.parametrize("topology", [V5E, V6E, V5P])
def test_planned_tiles_fit_the_vmem_budget(topology: str):
    """The footprint rule (``kernel.vmem_bytes``) of the tiles ``plan()`` picks stays in the
    budget at the largest shapes; the largest footprint compiles under ``vmem_limit_bytes``."""
    chip = target.target(topology)
    with target.tracing_for(chip.mesh(1)):
        budget = vmem.tile_budget()
        planned = [(case, *kernel.plan(case.shapes(), case.q_block)) for case in LARGEST]
        used = [kernel.vmem_bytes(case.shapes(), q_block, kbp) for case, q_block, kbp in planned]
    assert budget == chip.chip.vmem_bytes // 4 * 3 // 4
    for (case, q_block, kbp), n in zip(planned, used, strict=True):
        assert n <= budget, (str(case), q_block, kbp, n, budget)
        assert kbp * case.page_size >= kernel.KV_TOKENS[0]  # halving stopped at the floor, if at all
    case, q_block, _ = planned[used.index(max(used))]
    compile_attention(topology, dataclasses.replace(case, q_block=q_block))


def _kernel_cost(compiled) -> dict:
    """The CostEstimate the Pallas call carries in its backend config."""
    m = re.search(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})', compiled.as_text())
    return {k: int(v) for k, v in json.loads(m.group(1).replace('\\"', '"')).items()}


def test_attention_cost_is_counted():
    """``cost_analysis()`` adds the kernel's estimate to XLA's own ops (which, with the
    estimate zeroed, account for the rest), and the estimate is the static bound."""
    case = Case(128, 2, "bfloat16", group=4, tokens=64, seqs=32, window=1000, max_pages=128, soft_cap=30.0)
    mesh = target.target(V5E).mesh(1)
    compiled = compile_attention(V5E, case)
    got = compiled.cost_analysis()
    with target.tracing_for(mesh):
        q_block, kbp = kernel.plan(case.shapes())
    # Every block real and full: q_block rows x G heads over the pages its window spans,
    # computed in whole KV steps of kbp pages.
    NB, R = pl.cdiv(case.tokens, q_block) + case.seqs, q_block * case.group
    ps, D = case.page_size, case.head_dim
    pages = -(-(case.window - 1 + q_block + ps - 1) // ps)
    keys = pl.cdiv(pages, kbp) * kbp * ps
    scores = NB * case.kv_heads * R * keys
    kv_bytes = NB * 2 * pages * ps * case.kv_heads * D * 2
    q_bytes = NB * 2 * case.kv_heads * R * D * 2
    assert got["flops"] >= 4 * scores * D > 0
    assert got["transcendentals"] >= 2 * scores > 0
    assert got["bytes accessed"] >= kv_bytes + q_bytes > 0

    def zero_cost(*_):
        return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel, "cost", zero_cost)
        # A fresh function: jit would reuse the module function's trace, estimate included.
        static = ("sm_scale", "sliding_window", "soft_cap", "q_block")
        unjitted = kernel.ragged_paged_attention.__wrapped__
        fresh = jax.jit(lambda *a, **kw: unjitted(*a, **kw), static_argnames=static)
        xla_only = compile_attention(V5E, case, fn=fresh).cost_analysis()
    est = _kernel_cost(compiled)
    assert est["flops"] == 4 * scores * D and est["transcendentals"] == 2 * scores
    table = case.seqs * case.max_pages  # scalar-prefetched whole
    assert est["bytes_accessed"] == kv_bytes + q_bytes + 4 * (table + 3 * NB)
    approx = functools.partial(pytest.approx, rel=1e-6)  # cost_analysis() sums in float32
    assert got["flops"] - xla_only["flops"] == approx(est["flops"])
    assert got["transcendentals"] - xla_only.get("transcendentals", 0) == approx(est["transcendentals"])
    assert got["bytes accessed"] - xla_only["bytes accessed"] == approx(est["bytes_accessed"])


# Every head dim, KV head count and dtype, page size and token bucket, on each chip.
KV_WRITE_CASES = [
    (V5E, 64, 1, "bfloat16", 16, 8),
    (V5E, 128, 4, "float32", 64, 2048),
    (V5E, 256, 8, "bfloat16", 32, 512),
    (V6E, 64, 8, "float32", 128, 64),
    (V6E, 128, 2, "bfloat16", 16, 2048),
    (V6E, 256, 1, "float32", 16, 8),
    (V5P, 256, 4, "bfloat16", 16, 2048),
    (V5P, 128, 8, "float32", 128, 64),
    # One bf16 KV head per shard (Gemma-3-4B at tp 4, Llama-3-8B at tp 8): XLA's scatter.
    (V5E, 256, 1, "bfloat16", 16, 512),
    (V6E, 128, 1, "bfloat16", 16, 2048),
    (V5P, 128, 1, "bfloat16", 64, 8),
]


def compile_kv_write(topology: str, D: int, Hkv: int, dtype: str, ps: int, T: int):
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    pages = a((NUM_PAGES, ps, Hkv, D), jnp.dtype(dtype))
    new = a((T, Hkv, D), jnp.dtype(dtype))
    # Pages donated, as the engine does: the write is in place, no copy of the pools.
    args = (pages, pages, new, new, a((T,), jnp.int32))
    return target.compile_for(mesh, kv_write.write_kv, *args, donate_argnums=(0, 1))


@pytest.mark.parametrize("topology, D, Hkv, dtype, ps, T", KV_WRITE_CASES)
def test_kv_write_compiles(topology: str, D: int, Hkv: int, dtype: str, ps: int, T: int):
    compiled = compile_kv_write(topology, D, Hkv, dtype, ps, T)
    if kv_write.scatter_in_place(Hkv, D, dtype):
        # XLA's scatter, in place: no kernel, no temporaries, nothing else reads the pools,
        # and fewer bytes than reading both pools once (a relayout moves each in and out).
        assert "tpu_custom_call" not in compiled.as_text()
        assert all("scatter" in op for op in pool_relayouts(compiled)), pool_relayouts(compiled)
        assert compiled.memory_analysis().temp_size_in_bytes == 0
        pool = NUM_PAGES * ps * Hkv * D * jnp.dtype(dtype).itemsize
        assert 0 < compiled.cost_analysis()["bytes accessed"] < 2 * pool
        return
    if D >= 128:  # in place (D = 64: see test_attention_compiles)
        assert not pool_relayouts(compiled) and compiled.memory_analysis().temp_size_in_bytes == 0
    # Each token's K and V read once and written once, and its slot read.
    expected = 2 * 2 * T * Hkv * D * jnp.dtype(dtype).itemsize + 4 * T
    est = _kernel_cost(compiled)
    assert est["bytes_accessed"] == expected and est["flops"] == 0
    assert compiled.cost_analysis()["bytes accessed"] >= expected > 0


# MLA: one latent row per token (512 + 64 wide, bfloat16), read by every query head of the
# chip (16 to 128), the pool kept as [pages, page_size, 576] (``LatentPages``). A known
# defect, asserted so that its fix shows: 576 is not a multiple of 128 lanes, so XLA:TPU lays
# the pool out page-index-minor and copies it whole into the kernel's row layout on every
# call. Holding the pool row-major (a ``Layout((0, 1, 2))`` for the cache) would remove the
# copy at the cost of 576 lanes padding to 640 in HBM.
LATENT_CASES = [
    (V5E, 16, 1, 64),  # decode, 64-token pages
    (V5E, 128, None, 16),  # a prefill chunk with the kernel's planned blocks
    (V6E, 128, 1, 32),
    (V6E, 64, None, 16),
]


@pytest.mark.parametrize("topology, heads, q_block, page_size", LATENT_CASES)
def test_latent_attention_compiles_and_its_pool_copy_is_known(topology, heads, q_block, page_size):
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    bf16, i32 = jnp.bfloat16, jnp.int32
    seqs, tokens = (32, 32) if q_block == 1 else (8, 512)
    args = (
        a((tokens, heads, 576), bf16),
        a((NUM_PAGES, page_size, 576), bf16),
        a((seqs,), i32),
        a((seqs, 256), i32),
        a((seqs + 1,), i32),
        a((), i32),
    )

    def attend(q, latent, kv_lens, tables, cu_q_lens, num_seqs):
        rows = latent[:, :, None, :]  # one KV head: keys and values are the latent rows
        return kernel.ragged_paged_attention(
            q, rows, rows, kv_lens, tables, cu_q_lens, num_seqs, sm_scale=192**-0.5, q_block=q_block
        )

    compiled = target.compile_for(mesh, attend, *args)
    assert pool_relayouts(compiled), "the latent pool is no longer copied: assert it is read in place"

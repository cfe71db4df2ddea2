"""Compile-only: DeepSeek V4's attention kernel over per-token row lists
(``models/kernels/paged_row_attention``) compiles for TPU v5e and v6e at V4 Flash's per-chip
widths (tp 8: 8 query heads of 512 per chip over one shared K=V row of 512, bfloat16), for
decode (64 sequences) and a prefill chunk (2,048 tokens), over each source a token reads:
the window (128 rows of the ``swa`` pool) and the compressed entries (``csa``: the indexer's
top 512; ``hca``: every entry the table holds). Its cost estimate counts at least the bytes
the rows must move. (``tests/tpu/conftest.py`` skips all without libtpu.)
"""

from __future__ import annotations

import functools
import json
import re

import jax.numpy as jnp
import pytest

from hicache_jax.models.kernels.paged_row_attention import kernel
from hicache_jax.models.kernels.ragged_paged_attention import kernel as ragged
from hicache_jax.tpu import target

V5E, V6E = target.TOPOLOGIES[0], target.TOPOLOGIES[1]
HEADS, WIDTH = 8, 512  # per chip at tp 8
NUM_PAGES = 2048

# (topology, tokens, sequences, rows a token lists, rows per page, pages per sequence)
CASES = [
    (V5E, 64, 64, 128, 128, 64),  # decode, the window: 128-token pages
    (V6E, 64, 64, 512, 64, 128),  # decode, csa top 512: 256-token pages, 4 tokens an entry
    (V5E, 2048, 1, 512, 32, 256),  # prefill, csa top 512: 128-token pages
    (V6E, 2048, 1, 128, 256, 16),  # prefill, the window: 256-token pages
    (V6E, 64, 64, 1024, 2, 512),  # decode, hca: every entry, 256-token pages, 128 an entry
]


def compile_rows(topology: str, T: int, S: int, N: int, rows: int, max_pages: int):
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    bf16, i32 = jnp.bfloat16, jnp.int32
    args = (
        a((T, HEADS, WIDTH), bf16),
        a((NUM_PAGES, rows, WIDTH), bf16),
        a((S, max_pages), i32),
        a((T,), i32),
        a((T, N), i32),
    )
    fn = functools.partial(kernel.paged_row_attention, sm_scale=WIDTH**-0.5)
    return target.compile_for(mesh, fn, *args)


def _kernel_cost(compiled) -> dict:
    m = re.search(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})', compiled.as_text())
    return {k: int(v) for k, v in json.loads(m.group(1).replace('\\"', '"')).items()}


@pytest.mark.parametrize("topology, T, S, N, rows, max_pages", CASES, ids=str)
def test_row_attention_compiles(topology, T, S, N, rows, max_pages):
    compiled = compile_rows(topology, T, S, N, rows, max_pages)
    est = _kernel_cost(compiled)
    moved = T * N * WIDTH * 2  # each listed row, bfloat16, once per token
    G = kernel.group_rows(jnp.bfloat16)  # a bfloat16 row comes with its pair partner
    ids_and_queries = T * N * 4 * (1 + G) + T * HEADS * WIDTH * (2 + 4) + T * HEADS * 4
    assert est["bytes_accessed"] == G * moved + ids_and_queries
    assert est["flops"] == 4 * T * HEADS * N * G * WIDTH
    # The pool is read in place: no copy of it before the kernel.
    assert compiled.memory_analysis().temp_size_in_bytes < NUM_PAGES * rows * WIDTH * 2 // 4


# The window as DeepSeek V4 runs it on the pallas backend: the ragged paged attention kernel
# over the ``swa`` pool (one K=V head, a bitcast to [pages, page_size, 1, 512]), 128 keys a
# query, its log-sum-exp out. (topology, tokens, sequences, page size, q_block)
WINDOW_CASES = [
    (V5E, 64, 64, 128, 1),
    (V6E, 64, 64, 256, 1),
    (V5E, 2048, 1, 256, None),
    (V6E, 2048, 1, 128, None),
]


@pytest.mark.parametrize("topology, T, S, page_size, q_block", WINDOW_CASES, ids=str)
def test_window_compiles_with_its_log_sum_exp(topology, T, S, page_size, q_block):
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    bf16, i32 = jnp.bfloat16, jnp.int32
    args = (
        a((T, HEADS, WIDTH), bf16),
        a((NUM_PAGES, page_size, WIDTH), bf16),
        a((S,), i32),
        a((S, 65536 // page_size), i32),
        a((S + 1,), i32),
        a((), i32),
    )

    def attend(q, window, kv_lens, tables, cu_q_lens, num_seqs):
        rows = window[:, :, None, :]
        static = dict(sm_scale=WIDTH**-0.5, sliding_window=128, q_block=q_block, return_lse=True)
        return ragged.ragged_paged_attention(q, rows, rows, kv_lens, tables, cu_q_lens, num_seqs, **static)

    compiled = target.compile_for(mesh, attend, *args)
    assert compiled.memory_analysis().temp_size_in_bytes < NUM_PAGES * page_size * WIDTH * 2 // 4  # in place


# DeepSeek Sparse Attention (GLM-5's ``mla.py`` picks): 16 query heads a chip over the
# 576-wide latent rows (512 + 64 rope, not a multiple of 128 lanes), the indexer's top 2,048.
DSA_CASES = [(V5E, 64, 64, 64), (V6E, 2048, 1, 64)]


@pytest.mark.parametrize("topology, T, S, page_size", DSA_CASES, ids=str)
def test_picked_latent_rows_compile(topology, T, S, page_size):
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    bf16, i32 = jnp.bfloat16, jnp.int32
    args = (
        a((T, 16, 576), bf16),
        a((NUM_PAGES, page_size, 576), bf16),
        a((S, 2048), i32),
        a((T,), i32),
        a((T, 2048), i32),
    )
    fn = functools.partial(kernel.paged_row_attention, sm_scale=192**-0.5)
    compiled = target.compile_for(mesh, fn, *args)
    # A known defect, asserted so that its fix shows (as the latent case of
    # test_attention_kernels.py): 576 is not a multiple of 128 lanes, so XLA:TPU lays the pool
    # out page-index-minor and copies it whole into the kernel's row layout on every call.
    pool = NUM_PAGES * page_size * 576 * 2
    assert compiled.memory_analysis().temp_size_in_bytes >= pool, "no pool copy now: assert none"


# DeepSeek V4 Flash's lightning indexer (``models/kernels/index_scores``): 64 heads of 128
# (replicated under tp), bfloat16 keys, one per compressed entry (rate 4), 32K context.
# (topology, tokens, sequences, entries a page: 128- or 256-token pages, pages a sequence)
INDEX_HEADS, INDEX_DIM, INDEX_PAGES = 64, 128, 4096
INDEX_CASES = [
    (V5E, 64, 64, 32, 256),  # decode, 64 sequences at 32K, 128-token pages
    (V6E, 64, 64, 64, 128),  # decode, 256-token pages
    (V5E, 2048, 1, 64, 128),  # a 2,048-token prefill chunk at 32K
    (V6E, 2048, 1, 32, 256),
]


@pytest.mark.parametrize("topology, T, S, rows, max_pages", INDEX_CASES, ids=str)
def test_index_scores_compile(topology, T, S, rows, max_pages):
    from hicache_jax.models.kernels.index_scores import kernel as index

    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    args = (
        a((T, INDEX_HEADS, INDEX_DIM), bf16),
        a((T, INDEX_HEADS), f32),
        a((INDEX_PAGES, rows, INDEX_DIM), bf16),
        a((S, max_pages), i32),
        a((T,), i32),
        a((T,), i32),
    )
    compiled = target.compile_for(mesh, index.index_scores, *args)
    est = _kernel_cost(compiled)
    N = rows * max_pages
    bq = 1 if T <= S else index.BLOCK_Q  # decode: a token a query block
    W = T // bq + S  # work items: (query block, sequence)
    keys = W * N * INDEX_DIM * 2  # each item reads its sequence's keys once (the static bound)
    assert est["bytes_accessed"] >= keys
    assert est["bytes_accessed"] - keys == W * bq * (INDEX_HEADS * (INDEX_DIM * 2 + 4) + 8 + N * 4)
    # The pool is read in place: no copy of it before the kernel.
    assert compiled.memory_analysis().temp_size_in_bytes < INDEX_PAGES * rows * INDEX_DIM * 2 // 4
    print(f"{T=} {S=} {rows=}: estimate {est['bytes_accessed']} B, the keys seen {S * N * INDEX_DIM * 2} B")

"""Compile-only: quantized KV pages (float8_e4m3fn, float8_e5m2, int8) in the Pallas kernels
on TPU v5e and v6e, each dtype ``models/kernels/kv_dtypes.py`` lets the chip take; a decode
step at Llama-3-8B's widths reads half the KV bytes of bfloat16 pages
(``tests/tpu/conftest.py`` skips all without libtpu).

One compile per chip, dtype and kernel, at small shapes; the kernels' equality with their
references on the same 8-bit pages is ``tests/models/kernels/test_kv_quant_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax.numpy as jnp
import pytest

from hicache_jax.models.kernels import kv_dtypes
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.kernels.index_scores import kernel as index
from hicache_jax.models.kernels.paged_row_attention import kernel as rows
from hicache_jax.models.kernels.ragged_paged_attention import kernel, kv_write
from hicache_jax.tpu import target
from tests.tpu.test_attention_kernels import compile_kv_write, pool_relayouts

V5E, V6E = target.TOPOLOGIES[0], target.TOPOLOGIES[1]
CHIPS = {V5E: "v5e", V6E: "v6e"}
NUM_PAGES = 2048
# (chip, dtype): every 8-bit dtype each chip takes (kv_dtypes.CHIP_DTYPES).
MATRIX = [
    (t, d) for t, chip in CHIPS.items() for d in kv_dtypes.CHIP_DTYPES[chip] if d in kv_dtypes.QUANTIZED
]


def _kernel_bytes(compiled) -> list[int]:
    """Each Pallas call's declared ``bytes_accessed`` (its ``CostEstimate``)."""
    found = re.findall(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})', compiled.as_text())
    return [int(json.loads(m.replace('\\"', '"'))["bytes_accessed"]) for m in found]


def test_the_matrix_has_every_quantized_dtype_on_each_chip():
    for chip in CHIPS.values():
        assert set(kv_dtypes.QUANTIZED) <= set(kv_dtypes.CHIP_DTYPES[chip])


@pytest.mark.parametrize("topology, dtype", MATRIX)
def test_quantized_kernels_compile(topology: str, dtype: str):
    """Paged attention (decode at Llama-3-8B's per-chip heads on one chip, a windowed prefill
    of one 256-wide head on the other, rotating), the KV write, row attention over 512-wide
    rows and the indexer over 128-wide keys: all with 8-bit pages, read in place."""
    mesh = target.target(topology).mesh(1)
    a = functools.partial(target.abstract, mesh)
    kv, bf16, i32 = jnp.dtype(dtype), jnp.bfloat16, jnp.int32
    i = [t for t, _ in MATRIX].index(topology) + list(kv_dtypes.QUANTIZED).index(dtype)
    Hkv, D, T, S, q_block, window = [(8, 128, 32, 32, 1, None), (1, 256, 256, 4, None, 100)][i % 2]
    pages = a((NUM_PAGES, 16, Hkv, D), kv)
    static = dict(sm_scale=D**-0.5, sliding_window=window, q_block=q_block)
    lens = (a((S,), i32), a((S, 128), i32), a((S + 1,), i32), a((), i32))
    args = (a((T, 4 * Hkv, D), bf16), pages, pages, *lens)
    compiled = target.compile_for(mesh, functools.partial(kernel.ragged_paged_attention, **static), *args)
    assert not pool_relayouts(compiled)  # the 8-bit pool is read where it lies
    assert "tpu_custom_call" in compiled.as_text()

    write = compile_kv_write(topology, D, Hkv, dtype, 16, 64)
    assert not pool_relayouts(write) or kv_write.scatter_in_place(Hkv, D, kv)
    assert write.memory_analysis().temp_size_in_bytes == 0  # in place, no copy of the pools

    row_args = (a((64, 8, 512), bf16), a((NUM_PAGES, 64, 512), kv), a((64, 64), i32), a((64,), i32))
    compiled = target.compile_for(
        mesh, functools.partial(rows.paged_row_attention, sm_scale=512**-0.5), *row_args, a((64, 128), i32)
    )
    assert compiled.memory_analysis().temp_size_in_bytes < NUM_PAGES * 64 * 512 // 4  # no pool copy

    index_args = (a((64, 64, 128), bf16), a((64, 64), jnp.float32), a((NUM_PAGES, 32, 128), kv))
    index_args += (a((64, 64), i32), a((64,), i32), a((64,), i32))
    compiled = target.compile_for(mesh, index.index_scores, *index_args)
    assert compiled.memory_analysis().temp_size_in_bytes < NUM_PAGES * 32 * 128 // 4


def test_a_dtype_the_kernels_cannot_read_is_refused_naming_the_flag():
    """float16 pages (no kernel reads them) with the Pallas attention, at start-up."""
    from hicache_jax.tpu.configs import real_config

    cfg = real_config("llama-3-8b", 1)
    with pytest.raises(ValueError, match="--kv_cache_dtype=float16"):
        KernelConfig(attention="pallas").check_model(cfg, jnp.bfloat16, kv_dtype=jnp.float16, chip="v6e")
    for name in kv_dtypes.QUANTIZED:
        KernelConfig(attention="pallas").check_model(cfg, jnp.bfloat16, kv_dtype=jnp.dtype(name), chip="v5e")
    KernelConfig(attention="xla").check_model(cfg, jnp.bfloat16, kv_dtype=jnp.float16, chip="v6e")


# Llama-3-8B's unembedding and sampler over its 128,256-token vocabulary were half of each
# step's compile here and are the same bytes in both dtypes: a 2,048-token vocabulary.
VOCAB = 2048


def decode_step_kv_bytes(kv_cache_dtype: str, num_layers: int = 1, batch: int = 8, context: int = 256):
    """Llama-3-8B's widths (its vocabulary cut to ``VOCAB``), ``num_layers`` deep, on one v6e
    chip: the decode step of ``batch`` sequences at ``context`` tokens, compiled. Returns the
    KV bytes its Pallas calls declare (the attention kernels read the pages, the KV writes
    store the new rows), the step's HBM bytes (``hbm.py``) and the server."""
    from hicache_jax.config import EngineConfig
    from hicache_jax.tpu.abstract import AbstractServer
    from hicache_jax.tpu.configs import real_config
    from hicache_jax.tpu.hbm import hbm_bytes

    cfg = EngineConfig(
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        tp_size=1,
        page_size=16,
        context_length=context,
        max_running_requests=batch,
        max_total_tokens=batch * context,
    )
    model_cfg = dataclasses.replace(real_config("llama-3-8b", num_layers), vocab_size=VOCAB)
    server = AbstractServer.build(model_cfg, cfg, target.target(V6E))
    compiled = server.compile_step((batch, batch, batch, True))
    return sum(_kernel_bytes(compiled)), hbm_bytes(compiled), server


def test_decode_step_reads_half_the_kv_bytes_in_fp8():
    """Issue 46's acceptance: the KV bytes of a Llama-3-8B decode step with float8_e4m3fn pages
    are at most 0.55x bfloat16's; the step's HBM bytes drop by at least that much less 10%;
    the pool holds twice the tokens per byte."""
    kv16, hbm16, s16 = decode_step_kv_bytes("bfloat16")
    kv8, hbm8, s8 = decode_step_kv_bytes("float8_e4m3fn")
    assert s8.model.kv_dtype == jnp.float8_e4m3fn and s16.model.kv_dtype == jnp.bfloat16
    assert kv8 <= 0.55 * kv16, (kv8, kv16)
    assert hbm16 - hbm8 >= 0.9 * (kv16 - kv8), (hbm16, hbm8, kv16, kv8)
    assert s8.cache_bytes_by_kind()["kv"] * 2 == s16.cache_bytes_by_kind()["kv"]

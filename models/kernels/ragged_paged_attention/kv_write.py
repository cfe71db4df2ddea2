"""The KV page write as a Pallas TPU kernel: each new token's K and V go to their page
slot by DMA, in place (the pages are aliased in and out). Reference: ``reference.write_kv``.

The kernel DMAs a token's ``[Hkv, D]`` slab into ``[num_pages, page_size, Hkv, D]``, so it
needs the pages row-major, tiled on ``(Hkv, D)``. XLA:TPU stores a pool with one bfloat16
(or 8-bit) KV head (per shard: every model at a tensor-parallel size equal to its KV head count) tiled
on ``(page_size, D)`` instead, the size-1 head axis moved out of the tile. A Pallas operand
there makes XLA copy the whole pool to row-major and back, every layer of every step (three
times the pool in temporaries for Gemma-3-4B at tp 4), so that write is XLA's own scatter,
in place in XLA's layout (``scatter_in_place``). At ``D < 128`` XLA puts the page axis
minor; its scatter then copies the pool too, so the kernel stays (the pool's relayout
remains, for attention as well).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem
from hicache_jax.models.kernels.ragged_paged_attention import reference
from hicache_jax.models.kv_quant import store


def _write_kv_kernel(
    slots_ref,  # [T] int32 SMEM, page * page_size + offset; -1 writes nothing
    k_hbm,  # [T, Hkv, D] ANY
    v_hbm,  # [T, Hkv, D] ANY
    k_pages_in,  # [num_pages, page_size, Hkv, D] ANY, aliased to k_pages_out
    v_pages_in,  # [num_pages, page_size, Hkv, D] ANY, aliased to v_pages_out
    k_pages_out,  # [num_pages, page_size, Hkv, D] ANY
    v_pages_out,  # [num_pages, page_size, Hkv, D] ANY
    sem,  # DMA semaphore
    *,
    page_size: int,
    tokens_per_step: int,
):
    del k_pages_in, v_pages_in  # the outputs alias them: untouched slots keep their KV
    num_tokens = k_hbm.shape[0]
    first = pl.program_id(0) * tokens_per_step
    n = jnp.minimum(tokens_per_step, num_tokens - first)

    def copies(t):
        slot = slots_ref[t]
        page, offset = slot // page_size, slot % page_size
        return (
            pltpu.make_async_copy(k_hbm.at[t], k_pages_out.at[page, offset], sem),
            pltpu.make_async_copy(v_hbm.at[t], v_pages_out.at[page, offset], sem),
        )

    def each_token(action):
        def body(i, carry):
            t = first + i

            @pl.when(slots_ref[t] >= 0)
            def _():
                for copy in copies(t):
                    action(copy)

            return carry

        lax.fori_loop(0, n, body, 0)

    # All of this step's copies are in flight together; then drain them.
    each_token(lambda c: c.start())
    each_token(lambda c: c.wait())


def scatter_in_place(num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether XLA's scatter writes these per-shard pages in place where the kernel would
    make XLA relayout the pool (the module docstring; ``tests/tpu`` checks both sides)."""
    return num_kv_heads == 1 and head_dim % 128 == 0 and jnp.dtype(dtype).itemsize <= 2


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset; -1 writes nothing
    *,
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V into their page slots, in place (donate the pages under jit)."""
    T, Hkv, D = k.shape
    if not interpret and scatter_in_place(Hkv, D, k_pages.dtype):
        return reference.write_kv(k_pages, v_pages, k, v, slot_mapping)  # see the module docstring
    page_size = k_pages.shape[1]
    # Each token's K and V: read from k / v, written to its page slot (exact when no slot is -1).
    token_bytes = Hkv * D * jnp.dtype(k_pages.dtype).itemsize
    cost = pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * 2 * T * token_bytes + 4 * T)
    tokens_per_step = 256  # bounds the copies in flight at once
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_write_kv_kernel, page_size=page_size, tokens_per_step=tokens_per_step)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(T, tokens_per_step),),
            in_specs=[any_space] * 4,
            out_specs=[any_space] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        # Operand indices count the scalar-prefetch slot mapping: pages are operands 3 and 4.
        input_output_aliases={3: 0, 4: 1},
        compiler_params=vmem.compiler_params(("arbitrary",)),
        cost_estimate=cost,
        interpret=interpret,
    )(
        slot_mapping.astype(jnp.int32),
        store(k, k_pages.dtype),
        store(v, v_pages.dtype),
        vmem.in_hbm(k_pages, interpret),
        vmem.in_hbm(v_pages, interpret),
    )
    # The pools come back in pinned HBM; returned straight from a program whose donated
    # arguments they alias, XLA's verifier refuses the memory-space mismatch. The barrier
    # hands them on as they are (no copy: the write stays in place).
    return out if interpret else jax.lax.optimization_barrier(out)

"""How much VMEM a Pallas kernel may plan for, on the chip it is being traced for.

Each TPU kernel here sizes its tiles from ``budget()`` and declares the same number as its
scoped VMEM limit (``compiler_params()``), so the rule that picks a tile and the limit the
compiler checks it against are one number:

    budget = VMEM per TensorCore / 4     v5e, v6e: 32 MiB of 128   v5p: 16 MiB of 64
    tiles  <= budget * TILE_SHARE        the rest is Mosaic's own scratch and spills

Traced for a TPU (on a chip, or under ``hicache_jax.tpu.target.tracing_for`` without one)
the chip is known; elsewhere (interpret mode on CPU) the smallest chip's figure is used, so
a tile chosen on CPU also fits every supported TPU.
"""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

SMALLEST_VMEM = 64 << 20  # v5p's VMEM per core, the least of v5e, v6e, v5p
TILE_SHARE = 0.75


def capacity() -> int:
    """VMEM bytes per TensorCore of the chip being traced for (``SMALLEST_VMEM`` off TPU)."""
    try:
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except Exception:  # not tracing for a TPU (CPU, interpret mode)
        return SMALLEST_VMEM


def budget() -> int:
    """The scoped VMEM limit kernels declare."""
    return capacity() // 4


def tile_budget() -> int:
    """Bytes a kernel's blocks, double buffers and scratch may add up to."""
    return int(budget() * TILE_SHARE)


def compiler_params(dimension_semantics: tuple[str, ...]) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=budget())


def in_hbm(x, interpret):
    """``x``, held in HBM for the Pallas call it is passed to.

    A page or state pool goes to a kernel as a ``pl.ANY`` operand that the kernel reads and
    writes a few pages of by DMA. Left to itself, XLA:TPU's memory-space assignment may place
    such an operand in VMEM when it fits (a 32 MiB pool does, in v5e's 128 MiB): it then
    copies the whole pool in before the call and back after it, moving in HBM many times the
    bytes the kernel touches. Pinning the operand to HBM forbids that. Interpret mode (CPU)
    has no memory spaces: ``x`` is returned as it is."""
    if interpret:
        return x
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)

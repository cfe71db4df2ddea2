"""``hicache_jax/tpu/hbm.py``: HBM bytes from the scheduled HLO count a weight once where
``cost_analysis`` counts its VMEM prefetch and its use as well."""

import jax.numpy as jnp

from hicache_jax.tpu import target
from hicache_jax.tpu.hbm import hbm_bytes


def test_a_matmul_reads_its_weight_from_hbm_once():
    mesh = target.target(target.TOPOLOGIES[0]).mesh(1)
    w = target.abstract(mesh, (4096, 4096), jnp.bfloat16)
    x = target.abstract(mesh, (8, 4096), jnp.bfloat16)
    compiled = target.compile_for(mesh, lambda w, x: x @ w, w, x)
    weight = 4096 * 4096 * 2
    floor = weight + 2 * 8 * 4096 * 2  # the weight, x in, the product out
    got = hbm_bytes(compiled)
    assert floor <= got <= 1.01 * floor, (got, floor)
    assert compiled.cost_analysis()["bytes accessed"] >= got


def test_an_embedding_gather_reads_its_rows_not_the_table():
    mesh = target.target(target.TOPOLOGIES[0]).mesh(1)
    table = target.abstract(mesh, (32000, 4096), jnp.bfloat16)
    ids = target.abstract(mesh, (8,), jnp.int32)
    compiled = target.compile_for(mesh, lambda t, i: t[i], table, ids)
    rows = 8 * 4096 * 2
    got = hbm_bytes(compiled)
    assert rows <= got <= 2 * rows + 4096, got  # the rows read and written, the ids
    assert got <= compiled.cost_analysis()["bytes accessed"]  # which also counts the rows only


class _Text:
    """A compiled program's HLO text, as ``hbm_bytes`` reads it."""

    def __init__(self, entry: str):
        self.text = "HloModule m\n\nENTRY %main () -> () {\n" + entry + "\n}\n"

    def as_text(self) -> str:
        return self.text


def test_a_weight_prefetched_in_slices_is_read_once():
    """XLA prefetches a large weight into VMEM as several ``slice-start``s of it: each reads
    its slice of the weight from HBM and writes VMEM (not counted)."""
    hbm = "{1,0:T(8,128)(2,1)}"
    vmem = "{1,0:T(8,128)(2,1)S(1)}"
    lines = [f"  %w = bf16[4096,1024]{hbm} parameter(0)"]
    for i in range(4):
        lines.append(
            f"  %s{i} = ((bf16[4096,1024]{hbm}), bf16[1024,1024]{vmem}, s32[]{{:S(2)}}) "
            f"slice-start(%w), slice={{[{1024 * i}:{1024 * (i + 1)}], [0:1024]}}"
        )
        lines.append(f"  %d{i} = bf16[1024,1024]{vmem} slice-done(%s{i})")
    assert hbm_bytes(_Text("\n".join(lines))) == 4096 * 1024 * 2


def test_a_skip_conditional_moves_nothing():
    """A ``lax.cond`` with a branch that hands its operand on (the penalties of a batch
    without any) aliases it: the program moves what producing the operand does, no more. A
    conditional without such a branch counts its operands and results."""
    import jax

    mesh = target.target(target.TOPOLOGIES[0]).mesh(1)
    a = target.abstract(mesh, (8192, 4096), jnp.float32)  # 128 MiB: stays in HBM
    on = target.abstract(mesh, (), jnp.bool_)
    plain = hbm_bytes(target.compile_for(mesh, lambda a, on: a * 2, a, on))

    def skip(a, on):
        return jax.lax.cond(on, lambda y: jnp.tanh(y) * 3, lambda y: y, a * 2)

    def both(a, on):
        return jax.lax.cond(on, lambda y: jnp.tanh(y) * 3, lambda y: y - 1, a * 2)

    skipped = hbm_bytes(target.compile_for(mesh, skip, a, on))
    assert plain <= skipped <= plain + 16  # the predicate, to the scalar core
    assert hbm_bytes(target.compile_for(mesh, both, a, on)) >= plain + 2 * 8192 * 4096 * 4

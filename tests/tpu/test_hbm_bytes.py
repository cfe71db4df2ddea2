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

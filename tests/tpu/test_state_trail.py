"""Compile-only: a verify step (``ForwardBatch.state_trail``) through one recurrent layer
at a real width, with the Pallas backend, for v5e and v6e: Bamba-9B's Mamba2 mixer (128
heads of 64 x 128) and Qwen3-Next-80B's Gated DeltaNet (32 value heads of 128 x 128), whole
on one chip, through the verify kernels (``models/kernels/trail_kernel.py``). The state
pools are donated, as the engine does, and updated in place: they alias the outputs and
the step's temporaries stay below one pool's bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hicache_jax.models import KernelConfig
from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import state_shapes
from hicache_jax.models.layers.gated_deltanet import GatedDeltaNet
from hicache_jax.models.layers.mamba2 import Mamba2Mixer
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.target import abstract, compile_for, target

LAYERS = {"bamba-9b": ("mamba", Mamba2Mixer), "qwen3-next-80b-a3b": ("gdn", GatedDeltaNet)}
NUM_SLOTS = 64
# (model, topology, sequences, tokens per sequence at most: the last sampled one + drafts)
CASES = [
    ("bamba-9b", "v5e:2x2", 8, 4),
    ("bamba-9b", "v6e:2x4", 8, 4),
    ("qwen3-next-80b-a3b", "v5e:2x2", 8, 4),
    ("qwen3-next-80b-a3b", "v6e:2x4", 8, 8),  # 7 drafts: the decode kernel runs 8 times
]


def verify_batch(mesh, S: int, Q: int) -> ForwardBatch:
    i32 = jnp.int32
    f = lambda shape, dt=i32: abstract(mesh, shape, dt)
    T = S * Q
    return ForwardBatch(
        input_ids=f((T,)),
        positions=f((T,)),
        cu_q_lens=f((S + 1,)),
        kv_lens=f((S,)),
        num_seqs=f(()),
        page_tables={},
        slot_mappings={},
        state_slots=f((S,)),
        has_initial_state=f((S,), jnp.bool_),
        logits_indices=f((T,)),
        state_trail=f((S, Q)),
    )


@pytest.mark.parametrize("model,topology,S,Q", CASES)
def test_verify_layer_compiles(model, topology, S, Q):
    mesh = target(topology).mesh(1)
    cfg = real_config(model, num_layers=1)
    kind, layer_cls = LAYERS[model]
    kernels = KernelConfig(attention="pallas", ssd="pallas")
    layer = nnx.eval_shape(lambda: layer_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=kernels))
    graphdef, params = nnx.split(layer)
    params = jax.tree.map(lambda a: abstract(mesh, a.shape, a.dtype), params)
    pools = [abstract(mesh, (NUM_SLOTS, *shape), dt) for shape, dt in state_shapes(cfg, kind, jnp.bfloat16)]
    cache = type(state_shapes(cfg, kind, jnp.bfloat16))(*pools)
    x = abstract(mesh, (S * Q, cfg.hidden_size), jnp.bfloat16)

    def step(params, cache, x, batch):
        return nnx.merge(graphdef, params)(cache, x, batch)

    compiled = compile_for(mesh, step, params, cache, x, verify_batch(mesh, S, Q), donate_argnums=(1,))
    pool_bytes = [int(np.prod(p.shape)) * p.dtype.itemsize for p in pools]
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= sum(pool_bytes), "the state pools are not updated in place"
    # The trail's copies gather the step's working slots ([S, heads, ...]), never a pool.
    temp = memory.temp_size_in_bytes
    assert temp < max(pool_bytes), f"{temp} temporary bytes: a state pool ({max(pool_bytes)} bytes) is copied"

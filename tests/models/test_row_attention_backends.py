"""The Pallas row-attention kernel (interpret mode) in the models equals the xla backend:
DeepSeek V4's attention (window, CSA and HCA layers, each source merged with the sink) and
DeepSeek Sparse Attention's picked latent rows (GLM-5, ``index_topk`` below the context).
A prompt in chunks over NaN-filled pools, then ragged steps mixing one sequence's decode
with another's prefill chunk.
"""

import numpy as np
import pytest

from hicache_jax.models import KernelConfig, load_hf
from tests.hf_checkpoints import PAGE, make
from tests.models.steps import build_step, jit_forward, kv_groups, logits_of, sequence

LENGTH = 40  # > 2 pages; past the first compressed entries of every V4 layer kind
WIDTH = 34  # every step's tokens, padded


def run(model, ids_a, ids_b):
    params, step = jit_forward(model)
    n = -(-len(ids_a) // PAGE)
    cache = model.allocate_cache(num_pages=2 * n + 1, page_size=PAGE, num_state_slots=2, fill=np.nan)
    a = sequence(ids_a, pages=range(1, n + 1), state_slot=0)  # page 0 unused (NaN)
    b = sequence(ids_b, pages=range(n + 1, 2 * n + 1), state_slot=1)
    groups, out = kv_groups(model), []
    # a: a chunk of 33 tokens beside b's first; then a decodes its 34th while b prefills 19;
    # then both go on. Every step pads to the first's width (as the engine's buckets do) and
    # holds both sequences: one program (each costs tens of seconds in interpret mode).
    for work in (
        [(a, 0, 33), (b, 0, 1)],
        [(a, 33, 34), (b, 1, 20)],
        [(b, 20, 21), (a, 34, 40)],
    ):
        batch, rows = build_step(
            work, groups=groups, page_size=PAGE, max_pages=n, num_tokens=WIDTH, all_logits=True
        )
        cache, logits = step(params, cache, batch)
        out.append(logits_of(logits, rows))
    return np.concatenate(out)


@pytest.mark.parametrize("family, overrides", [("deepseek_v4", None), ("glm_moe_dsa", {"index_topk": 8})])
def test_pallas_rows_match_xla(tmp_path, checkpoint_dir, family, overrides):
    path = make(family, str(tmp_path), overrides=overrides) if overrides else checkpoint_dir(family)
    rng = np.random.RandomState(3)
    xla = load_hf(path, kernels=KernelConfig(attention="xla"))
    ids_a, ids_b = (rng.randint(0, xla.cfg.vocab_size, LENGTH) for _ in range(2))
    want = run(xla, ids_a, ids_b)
    got = run(load_hf(path, kernels=KernelConfig(attention="pallas", interpret=True)), ids_a, ids_b)
    assert not np.isnan(got).any(), "NaN leaked from unused pages"
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)

"""The sliding window really bites: a token outside the window cannot reach a local layer."""

import numpy as np

from hicache_jax.models import load_hf
from hicache_jax.models.causal_lm import CausalLM
from tests.models.steps import build_step, sequence

WINDOW = 20


def layer_outputs(model: CausalLM, layer: int, x: np.ndarray) -> np.ndarray:
    """Run one attention layer on hidden states ``x [T, hidden]`` of one sequence."""
    T = x.shape[0]
    cache = model.allocate_cache(num_pages=1, page_size=T, num_state_slots=1)
    work = [(sequence(np.zeros(T, np.int32), pages=[0]), 0, T)]
    batch, _ = build_step(work, groups=("full", "swa"), page_size=T, max_pages=1)
    _, out = model.layers[layer].mixer(cache[layer], x, batch)
    return np.asarray(out)


def test_token_outside_window_changes_only_global_layers(checkpoint_dir):
    model = load_hf(checkpoint_dir("gemma3"))
    assert model.cfg.layer_kinds[:2] == ("sliding", "attention")
    T = 3 * WINDOW
    x = np.random.RandomState(0).randn(T, model.cfg.hidden_size).astype(np.float32)
    x2 = x.copy()
    x2[5] += 1.0  # position 5 is outside the window of every query at >= 5 + WINDOW
    for layer, kind in ((0, "sliding"), (1, "attention")):
        a, b = layer_outputs(model, layer, x), layer_outputs(model, layer, x2)
        far = slice(5 + WINDOW, T)  # queries whose window excludes position 5
        near = slice(5, 5 + WINDOW)  # queries that see it
        assert np.abs(a[near] - b[near]).max() > 1e-3, kind
        if kind == "sliding":
            np.testing.assert_array_equal(a[far], b[far])
        else:
            assert np.abs(a[far] - b[far]).min() > 0, "a global layer must see every earlier token"

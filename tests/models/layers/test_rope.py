"""YaRN frequencies equal transformers' (``ROPE_INIT_FUNCTIONS["yarn"]``) for the settings
published checkpoints use and for the defaults."""

import numpy as np
import pytest
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hicache_jax.models.config import YarnConfig
from hicache_jax.models.layers.rope import rope_frequencies

CASES = [  # (head_dim, theta, rope_parameters)
    (
        64,
        150000.0,
        dict(
            factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
        ),
    ),
    (128, 500000.0, dict(factor=8.0, original_max_position_embeddings=8192, attention_factor=1.2079)),
    (16, 10000.0, dict(factor=4.0, original_max_position_embeddings=64)),
    (96, 1e6, dict(factor=2.0, original_max_position_embeddings=32768, beta_fast=16.0, beta_slow=2.0)),
]


@pytest.mark.parametrize("head_dim,theta,params", CASES)
def test_yarn_matches_transformers(head_dim, theta, params):
    cfg = tf.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params},
    )
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    yarn = YarnConfig(
        factor=params["factor"],
        original_max_position=params["original_max_position_embeddings"],
        beta_fast=params.get("beta_fast", 32.0),
        beta_slow=params.get("beta_slow", 1.0),
        attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True),
    )
    got, scale = rope_frequencies(theta, head_dim, yarn=yarn)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-9)
    plain, _ = rope_frequencies(theta, head_dim)
    assert not np.allclose(got, plain), "the case leaves every channel as trained: it tests nothing"

"""``real_config``'s cut keeps the depth asked for (or one layer per kind) and every kind."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.tpu.configs import HF_CONFIGS, cut_layers, real_config

KINDS = st.lists(st.sampled_from(["attention", "sliding", "mamba"]), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(KINDS, st.integers(1, 14))
def test_cut_keeps_every_kind_at_the_depth_asked(layer_kinds, num_layers):
    kinds = tuple(layer_kinds)
    cut = cut_layers(kinds, num_layers)
    every = set(kinds)
    assert set(cut) == every
    assert len(cut) == max(min(num_layers, len(kinds)), len(every))
    changed = [i for i, (a, b) in enumerate(zip(cut, kinds)) if a != b]
    assert len(changed) == len(every - set(kinds[: len(cut)]))  # one swap per kind lacking


def test_published_configs_cut_to_one_layer_per_kind():
    for name in HF_CONFIGS:
        full = real_config(name).layer_kinds
        assert sorted(real_config(name, num_layers=1).layer_kinds) == sorted(set(full)), name

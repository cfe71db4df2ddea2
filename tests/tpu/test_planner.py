"""The planner refuses, before compiling anything, a configuration whose weights and cache
alone exceed a chip's HBM (the compiler would refuse each of its programs, after minutes at
full depth): DeepSeek V4 Flash in bfloat16 on v6e:2x4 at tp 8 (67.6 GiB of weights per chip
against 31.25 GiB)."""

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.tpu import planner
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.target import target


def test_weights_past_hbm_are_refused_before_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled a program for a configuration that cannot fit")

    monkeypatch.setattr(planner, "_temporaries", no_compile)
    cfg = EngineConfig(tp_size=8, dtype="bfloat16", page_size=128)
    over = r"weights 67\.64, cache [\d.]+, before temporaries\), v6e has [\d.]+ GiB: [\d.]+ GiB over"
    with pytest.raises(planner.DoesNotFit, match=over):
        planner.plan(real_config("deepseek-v4-flash"), cfg, target("v6e:2x4"), progress=lambda _: None)

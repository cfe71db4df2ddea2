"""``--kv_cache_dtype`` at engine start-up (``engine/build.py``'s ``set_kv_dtype``): pages the
Pallas kernels cannot read are refused naming the flag before anything is allocated; every
other dtype becomes the pages' dtype."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine.build import set_kv_dtype
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.presets import build_preset


def model(attention: str):
    return build_preset("tiny", kernels=KernelConfig(attention=attention, interpret=attention == "pallas"))


def test_pages_the_pallas_kernels_cannot_read_are_refused_naming_the_flag():
    cfg = EngineConfig(preset="tiny", kv_cache_dtype="float16", attention_backend="pallas")
    with pytest.raises(ConfigError, match=r"^--kv_cache_dtype=float16: float16 pages are not read"):
        set_kv_dtype(cfg, model("pallas"))
    xla = model("xla")  # the plain-JAX kernels read any dtype
    set_kv_dtype(EngineConfig(preset="tiny", kv_cache_dtype="float16"), xla)
    assert xla.kv_dtype == jnp.float16


@pytest.mark.parametrize(
    "name,want", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("auto", "float32")]
)
def test_the_peers_names_resolve_to_the_pages_dtype(name, want):
    m = model("pallas")
    set_kv_dtype(EngineConfig(preset="tiny", kv_cache_dtype=name, attention_backend="pallas"), m)
    assert m.kv_dtype.name == want and m.kv_scales is None  # 8-bit floats: scale 1

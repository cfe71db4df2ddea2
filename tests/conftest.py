"""Test-wide setup: 8 emulated CPU devices and float32 matmuls, before any JAX backend starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from tests import hf_checkpoints  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """A factory: ``checkpoint_dir(family)`` -> directory of a tiny random HF checkpoint."""
    made = {}

    def make(family: str) -> str:
        if family not in made:
            made[family] = hf_checkpoints.make(family, str(tmp_path_factory.mktemp(family)))
        return made[family]

    return make

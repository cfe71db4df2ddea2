"""Compile-only TPU tests: libtpu compiles for TPU topologies on this CPU machine. Without
libtpu every test here skips, naming the install command."""

import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers each load libtpu

from hicache_jax.tpu import target  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_libtpu():
    reason = target.missing_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    """TPU programs compiled without a chip cannot be loaded back from JAX's persistent cache
    (no client to deserialize onto: a warning, then a compile anyway), so writing them there
    is wasted time: off for these modules."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)

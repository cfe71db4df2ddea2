"""The scheduler and the cache import without JAX: a process where ``import jax``,
``import jaxlib`` and ``import flax`` raise ``ImportError`` can still import every module of
``hicache_jax.scheduler`` and ``hicache_jax.cache``. The device side (batch building, the
runner, the sampler) lives in ``hicache_jax.runtime``; this test keeps it there."""

from __future__ import annotations

import subprocess
import sys

from tests.waits import wait

# Run in a fresh interpreter: the test process has imported JAX already (tests/conftest.py).
SCRIPT = r"""
import importlib
import importlib.abc
import pkgutil
import sys

BLOCKED = {"jax", "jaxlib", "flax"}


class NoJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"import {name} is blocked: this module must import without JAX")
        return None


sys.meta_path.insert(0, NoJax())
for name in sorted(BLOCKED):  # the block itself works, or this test proves nothing
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"import {name} was not blocked")

for package in ("hicache_jax.scheduler", "hicache_jax.cache"):
    importlib.import_module(package)
    for info in pkgutil.iter_modules(sys.modules[package].__path__, package + "."):
        importlib.import_module(info.name)
        print(info.name)
"""

MUST_IMPORT = {
    "hicache_jax.scheduler.scheduler",
    "hicache_jax.scheduler.plan",
    "hicache_jax.scheduler.cache_adapter",
    "hicache_jax.scheduler.l3_prefetch",
    "hicache_jax.cache.prefix_cache",
    "hicache_jax.cache.radix",
    "hicache_jax.cache.storage_tier",
}


def test_scheduler_and_cache_import_without_jax():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=wait(120))
    assert out.returncode == 0, out.stderr
    imported = set(out.stdout.split())
    assert MUST_IMPORT <= imported, sorted(MUST_IMPORT - imported)

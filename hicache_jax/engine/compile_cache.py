"""JAX's persistent compilation cache for serving (``--compilation_cache_dir``).

A step program for a real model takes seconds to compile, and warm-up compiles every shape
serving can run: without a cache every start pays for all of them again. With one, a second
start loads them from disk. ``auto`` keeps a cache the user already gave JAX
(``JAX_COMPILATION_CACHE_DIR``, ``jax.config``) and otherwise uses one under the user's cache
directory; ``none`` turns it off. Where this sets the directory, it also caches programs of
any compile time (JAX's default skips those under a second, which on CPU are most of them).
JAX reads the setting at its first compile, so the first engine of a process decides.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

AUTO, OFF = "auto", "none"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache-jax", "jax")


def configure(setting: str) -> str | None:
    """Point JAX's persistent cache at ``setting`` (see the module docstring); returns the
    directory in use, or None when the cache is off."""
    current = jax.config.jax_compilation_cache_dir
    if setting == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if setting == AUTO and current:
        return current  # the user's (or a test run's) own cache
    path = default_dir() if setting == AUTO else setting
    if "://" not in path:
        path = os.path.expanduser(path)
        os.makedirs(path, exist_ok=True)
    if path != current:
        jax.config.update("jax_compilation_cache_dir", path)
        if MIN_TIME_ENV not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        log.info("compilation cache: %s", path)
    return path

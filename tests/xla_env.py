"""XLA_FLAGS for the test process (8 emulated devices) and for the child processes it starts
(one device: faster for a single-device server or notebook kernel), and the persistent
compilation cache those servers share."""

from __future__ import annotations

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
SERVER_JAX_CACHE = "HICACHE_TEST_SERVER_JAX_CACHE"  # set by tests/conftest.py for the run


def without_device_count(flags: str) -> str:
    """``flags`` with every device-count setting removed (and no stray whitespace: XLA reads a
    non-empty value that does not start with ``--`` as a file name)."""
    return " ".join(f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG))


def with_device_count(flags: str, n: int) -> str:
    """``flags`` asking for exactly ``n`` emulated host devices (idempotent: pytest-xdist
    workers inherit the controller's environment)."""
    return f"{without_device_count(flags)} {DEVICE_COUNT_FLAG}={n}".strip()


def server_compile_cache_env(environ) -> dict[str, str]:
    """The environment that points a server process at the run's shared compilation cache
    (empty outside a pytest run)."""
    path = environ.get(SERVER_JAX_CACHE)
    if not path:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": path,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }

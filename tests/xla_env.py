"""XLA_FLAGS for the test process (8 emulated devices) and for the child processes it starts
(one device: faster for a single-device server or notebook kernel), and the persistent
compilation cache those servers share."""

from __future__ import annotations

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU compiles the tests' programs cheaply: on 2 cores the suite's time is mostly backend
# compiles of tiny programs (55% of all test time, counted with jax.monitoring). Level 0
# skips LLVM's optimisations (tests/engine + tests/runtime: 820 s -> 437 s; levels 1 and 2
# save little); the loop-fusion emitters off (XLA's older elemental emitter) halve what is
# left for the tiny presets' step programs (28 s -> 14-19 s for the 19 programs of one
# engine, ``tiny`` and ``tiny-mamba``) and leave the steps of the real SmolLM2 weights as
# fast to run, but compile them 1.5-2x slower (their decode steps: 4-6 s -> 5-9 s each), so
# tests that serve those weights compile with the emitters on (``REAL_WEIGHTS_COMPILE``,
# ``for_real_weights``). The programs stay exact; only float32 rounding moves (no fused
# multiply-adds, other loop orders), which every comparison's tolerance absorbs but those
# at the noise floor, which compile with ``SERVING_COMPILE``. Servers and notebook kernels
# the tests start inherit the flags.
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", FUSION_EMITTERS_OFF)
REAL_WEIGHTS_COMPILE = {"xla_cpu_use_fusion_emitters": True}  # ``compiler_options``: level 0 still
# ``jax.jit(..., compiler_options=)`` / ``Lowered.compile`` options: XLA's defaults, as a server compiles
SERVING_COMPILE = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
SERVER_JAX_CACHE = "HICACHE_TEST_SERVER_JAX_CACHE"  # set by tests/conftest.py for the run


def without_device_count(flags: str) -> str:
    """``flags`` with every device-count setting removed (and no stray whitespace: XLA reads a
    non-empty value that does not start with ``--`` as a file name)."""
    return " ".join(f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG))


def with_device_count(flags: str, n: int) -> str:
    """``flags`` asking for exactly ``n`` emulated host devices (idempotent: pytest-xdist
    workers inherit the controller's environment)."""
    return f"{without_device_count(flags)} {DEVICE_COUNT_FLAG}={n}".strip()


def for_real_weights(flags: str) -> str:
    """``flags`` for a process that serves real weights: the loop-fusion emitters on."""
    return " ".join(f for f in flags.split() if f != FUSION_EMITTERS_OFF)


def with_fast_compiles(flags: str) -> str:
    """``flags`` plus ``FAST_COMPILE_FLAGS`` (idempotent; a flag the caller set wins)."""
    names = {f.split("=", 1)[0] for f in flags.split()}
    extra = [f for f in FAST_COMPILE_FLAGS if f.split("=", 1)[0] not in names]
    return " ".join([*flags.split(), *extra])


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

"""Test-wide setup: 8 emulated CPU devices, cheap XLA:CPU compiles and float32 matmuls, before any
JAX backend starts; persistent compilation caches shared by the run's workers."""

import os
import time

from tests.xla_env import REAL_WEIGHTS_COMPILE, SERVER_JAX_CACHE, with_device_count, with_fast_compiles

os.environ["XLA_FLAGS"] = with_fast_compiles(with_device_count(os.environ.get("XLA_FLAGS", ""), 8))
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


@pytest.fixture(scope="session", autouse=True)
def server_compile_cache(tmp_path_factory):
    """One persistent JAX compilation cache for every server process this run starts, and one
    for the test processes themselves, each shared by all pytest-xdist workers (their base
    temp directories are siblings): a program one worker (or an earlier module, whose compiled
    programs ``_release_compiled_programs`` drops) compiled is loaded, not compiled again."""
    base = tmp_path_factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = run / "server-jax-cache"
    path.mkdir(exist_ok=True)
    os.environ[SERVER_JAX_CACHE] = str(path)
    tests = run / "test-jax-cache"
    tests.mkdir(exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(tests))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs and traces. A worker runs
    hundreds of modules, each compiling its own models' steps; kept for the whole run, they
    grew the workers until XLA:CPU aborted inside a later compile (seen twice, in
    unrelated tests, late in a run)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def real_weights_compiles():
    """For a module serving real weights: the engine's step programs compile with XLA:CPU's
    loop-fusion emitters on (``REAL_WEIGHTS_COMPILE``, tests/xla_env.py), which the suite's
    cheap flags turn off for the tiny models (whose steps compile in half the time; these
    compile 1.5-2x slower without them)."""
    from hicache_jax.runtime import runner

    cheap = runner._step_jit
    runner._step_jit = runner.step_jit(REAL_WEIGHTS_COMPILE)
    yield
    runner._step_jit = cheap


PROGRESS_EVERY_S = float(os.environ.get("HICACHE_TEST_PROGRESS_S", "60"))


class _Progress:
    """In a long run, a line a minute between the dots: how many tests are done and the groups
    (folders under tests/) running now, so a slow run says where it is. Written by the process
    that reports (pytest-xdist's controller, or the only one)."""

    def __init__(self, config):
        self.config = config
        self.start = self.last = time.monotonic()
        self.running: dict[str, str] = {}  # nodeid -> group
        self.done = 0

    @staticmethod
    def group(nodeid: str) -> str:
        parts = nodeid.split("::")[0].split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else parts[0]

    def pytest_runtest_logstart(self, nodeid, location):
        self.running[nodeid] = self.group(nodeid)

    def pytest_runtest_logreport(self, report):
        if report.when != "teardown":
            return
        self.running.pop(report.nodeid, None)
        self.done += 1
        now = time.monotonic()
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")  # registered after us
        if now - self.last >= PROGRESS_EVERY_S and reporter is not None:
            self.last = now
            groups = ", ".join(sorted(set(self.running.values()))) or "-"
            minutes = (now - self.start) / 60
            clock = time.strftime("%H:%M")
            reporter.write("\n")  # after the dots so far
            reporter.write_line(f"[{clock}] {self.done} done in {minutes:.1f} min; running: {groups}")


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_Progress(config), "hicache-progress")

"""``--compilation_cache_dir``: a second start loads every program the first compiled.

Each start is its own process, as a user's are: an engine with warm-up on the tiny preset,
JAX's cache left to the setting (no ``JAX_COMPILATION_CACHE_DIR``), ``XDG_CACHE_HOME`` a
fresh directory so ``auto`` lands there. It prints how many programs its process compiled
and how many it loaded from the cache (``runtime/compiles.py``)."""

import json
import os
import subprocess
import sys

from tests.waits import wait
from tests.xla_env import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START = """
import json
from hicache_jax.engine.engine import Engine
from hicache_jax.config import EngineConfig
from hicache_jax.runtime import compiles
cfg = EngineConfig(preset="tiny", page_size=8, chunked_prefill_size=8, max_running_requests=2,
                   max_total_tokens=128, warmup=True, compilation_cache_dir={setting!r})
engine = Engine(cfg)
engine.close()
print(json.dumps({{"total": compiles.total(), "loaded": compiles.loaded()}}))
"""


def start(setting: str, cache_home) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(cache_home))
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-c", START.format(setting=setting)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=wait(600),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_what_the_first_compiled_and_none_turns_it_off(tmp_path):
    cache = tmp_path / "hicache-jax" / "jax"  # where auto puts it under XDG_CACHE_HOME
    first = start(str(cache), tmp_path)  # a directory named outright
    assert first["total"] > 10 and first["loaded"] == 0, first  # warm-up compiled, nothing to load
    assert len(os.listdir(cache)) >= first["total"] // 2, os.listdir(cache)
    second = start("auto", tmp_path)  # the default finds the same directory
    assert second["loaded"] == second["total"] >= first["total"] - 2, (first, second)  # nothing compiled
    off = start("none", tmp_path)
    assert off["loaded"] == 0 and off["total"] >= first["total"] - 2, off

"""``python -m hicache_jax.generate`` as a user runs it: ids or text in, the text (the ids
without a tokenizer) or, with ``--json``, the whole result out; bad input ends with one line
naming the problem, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

from tests.waits import wait
from tests.xla_env import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, platforms: str | None = "cpu") -> subprocess.CompletedProcess:
    flags = without_device_count(os.environ.get("XLA_FLAGS", ""))  # one device is enough
    env = dict(os.environ, XLA_FLAGS=flags)
    env.pop("JAX_PLATFORMS", None)
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    cmd = [sys.executable, "-m", "hicache_jax.generate", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=wait(300))


def test_ids_generate_and_text_without_tokenizer_is_one_line(checkpoint_dir):
    path = checkpoint_dir("mistral")  # a checkpoint with no tokenizer.json
    ok = _run(f"--model_path={path}", "--input_ids=5,6,7,8,9", "--max_new_tokens=3", "--json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    out = json.loads(ok.stdout)
    assert len(out["output_ids"]) == 3 and out["meta_info"]["completion_tokens"] == 3
    plain = _run(f"--model_path={path}", "--input_ids=5,6,7,8,9", "--max_new_tokens=3")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.split() == [str(t) for t in out["output_ids"]]  # no tokenizer: the ids
    bad = _run(f"--model_path={path}", "--prompt=hello", "--max_new_tokens=3")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "generate: this model has no tokenizer.json: send input_ids instead of text"
    )
    assert "Traceback" not in bad.stderr


def test_text_out_by_default_and_the_result_with_json():
    args = ("--preset=tiny", "--prompt=hello world", "--max_new_tokens=4")  # the preset has a tokenizer
    full = _run(*args, "--json")
    assert full.returncode == 0, full.stderr[-2000:]
    out = json.loads(full.stdout)
    plain = _run(*args)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout == out["text"] + "\n"  # greedy: the same text, and nothing else


def test_nothing_from_libtpu_on_a_machine_without_a_tpu():
    """JAX's platforms left to choose, as a user's shell leaves them: with libtpu installed
    (the tpu extra), its TPU probe on this chipless machine printed an E0000 block; now the
    CPU is chosen before any backend starts, and stderr has nothing from libtpu or JAX."""
    pytest.importorskip("libtpu")  # without it there is no probe to silence
    from hicache_jax import accelerators

    assert accelerators.attached() == []  # this test machine: no TPU, no GPU
    run = _run("--preset=tiny", "--prompt=Hi", "--max_new_tokens=2", platforms=None)
    assert run.returncode == 0, run.stderr[-2000:]
    for noise in ("E0000", "TPU", "libtpu", "Unable to initialize backend"):
        assert noise not in run.stderr, run.stderr[-2000:]

"""``python -m hicache_jax.generate`` as a user runs it: ids or text in, JSON out; bad input
ends with one line naming the problem, not a traceback."""

import json
import os
import subprocess
import sys

from tests.xla_env import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    flags = without_device_count(os.environ.get("XLA_FLAGS", ""))  # one device is enough
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    cmd = [sys.executable, "-m", "hicache_jax.generate", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_ids_generate_and_text_without_tokenizer_is_one_line(checkpoint_dir):
    path = checkpoint_dir("mistral")  # a checkpoint with no tokenizer.json
    ok = _run(f"--model_path={path}", "--input_ids=5,6,7,8,9", "--max_new_tokens=3")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert len(json.loads(ok.stdout)["output_ids"]) == 3
    bad = _run(f"--model_path={path}", "--prompt=hello", "--max_new_tokens=3")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "generate: this model has no tokenizer.json: send input_ids instead of text"
    )
    assert "Traceback" not in bad.stderr

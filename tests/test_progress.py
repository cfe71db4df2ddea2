"""Progress bars: off unless stderr is a terminal or ``HICACHE_JAX_PROGRESS`` asks; weight
loading advances one step per checkpoint tensor, and the load time is still logged."""

from __future__ import annotations

import json
import logging
import os
import re
import struct

import pytest

from hicache_jax import progress


@pytest.mark.parametrize(
    ("env", "tty", "shown"),
    [(None, False, False), (None, True, True), ("1", False, True), ("0", True, False), ("on", False, True)],
)
def test_enabled(monkeypatch, env, tty, shown):
    if env is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, env)
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    assert progress.enabled() is shown


def _tensors(model_dir: str) -> int:
    """Tensors in the checkpoint's safetensors files, counted from their headers."""
    n = 0
    for fn in os.listdir(model_dir):
        if fn.endswith(".safetensors"):
            with open(os.path.join(model_dir, fn), "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                n += sum(1 for k in json.loads(f.read(size)) if k != "__metadata__")
    return n


def test_weight_loading_bar(checkpoint_dir, monkeypatch, capsys, caplog):
    from hicache_jax.models.loader import load_hf

    path = checkpoint_dir("llama")
    monkeypatch.setenv(progress.ENV, "1")
    with caplog.at_level(logging.INFO, logger="hicache_jax.models.loader"):
        load_hf(path)
    err = capsys.readouterr().err
    n = _tensors(path)
    assert "loading weights" in err and f"{n}/{n}" in err, err[-500:]
    assert any(re.search(r"loaded \w+ from .* in \d+\.\d+s", r.getMessage()) for r in caplog.records)

    monkeypatch.setenv(progress.ENV, "0")
    with progress.bar(total=3, desc="hidden") as b:
        b.update(3)
    assert b.disable and "hidden" not in capsys.readouterr().err

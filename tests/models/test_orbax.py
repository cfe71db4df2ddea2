"""Convert a Hugging Face checkpoint to orbax (CLI) and restore it: identical logits."""

import os
import subprocess
import sys

import numpy as np
import pytest

from hicache_jax.models import load_hf, load_model
from hicache_jax.models.orbax_io import read_config
from tests.waits import wait


@pytest.mark.parametrize("family", ["bamba"])
def test_convert_cli_then_restore(checkpoint_dir, tmp_path, family):
    src, out = checkpoint_dir(family), str(tmp_path / "orbax")
    cmd = [sys.executable, "-m", "hicache_jax.convert", f"--model_path={src}", f"--out={out}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=wait(300))
    assert read_config(out) == load_hf(src).cfg
    ids = np.random.RandomState(0).randint(0, 512, (1, 40))
    want = np.asarray(load_hf(src).forward_full(ids))
    np.testing.assert_array_equal(np.asarray(load_model(out).forward_full(ids)), want)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=wait(300))
    assert again.returncode != 0 and "already exists" in again.stderr
    assert os.path.isfile(os.path.join(out, "hicache_model.json"))

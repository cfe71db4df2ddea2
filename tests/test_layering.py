"""The import contracts in ``pyproject.toml`` hold (the layers of ``docs/architecture.md``, no
JAX where it says none, no import cycles), checked as ``.ci/run`` checks them, so that a
plain pytest run also catches an import that points the wrong way."""

import subprocess
import sys
from pathlib import Path

from tests.waits import wait

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    run = subprocess.run(
        [sys.executable, ".ci/lint_imports.py", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=wait(120),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

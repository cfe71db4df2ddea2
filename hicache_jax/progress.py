"""tqdm progress bars for the slow start-up phases (weight loading, orbax conversion,
warm-up compiles), on stderr.

Shown only when stderr is a terminal, so logs and CI output stay clean; set
``HICACHE_JAX_PROGRESS=1`` to show them anyway (a log file you ``tail -f``), ``=0`` to
never show them. Each phase still logs its time: the bars are extra, never the record."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

ENV = "HICACHE_JAX_PROGRESS"


def enabled() -> bool:
    asked = os.environ.get(ENV, "").strip().lower()
    if asked in ("1", "true", "yes", "on"):
        return True
    if asked in ("0", "false", "no", "off"):
        return False
    return sys.stderr.isatty()


def bar(total: int | None = None, desc: str = "", unit: str = "it") -> tqdm:
    """A bar on stderr (disabled, and free, unless ``enabled()``)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled(), dynamic_ncols=True)

"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer from one file.

A path is a GGUF checkpoint when it is a ``*.gguf`` file, or a directory without a
``config.json`` that holds exactly one ``*.gguf`` file.
"""

from __future__ import annotations

import os

from hicache_jax.models.hf.safetensors_io import CheckpointError

SUFFIX = ".gguf"


def gguf_file(path: str | None) -> str | None:
    """The GGUF file ``path`` names (itself, or the one in its directory), else None.

    A directory with several ``*.gguf`` files and no ``config.json`` is ambiguous: an error
    naming them, not a guess."""
    if not path:
        return None
    if os.path.isfile(path):
        return path if path.endswith(SUFFIX) else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))
    if len(found) > 1:
        raise CheckpointError(f"{path}: holds {len(found)} GGUF files ({', '.join(found)}); name one of them")
    return os.path.join(path, found[0]) if found else None


def is_gguf(path: str | None) -> bool:
    return gguf_file(path) is not None

"""Weights identity for L3 namespaces: two models never read each other's pages.

A checkpoint's fingerprint hashes ``config.json``, and for every ``*.safetensors`` file its
name, size, header and four 64 KiB samples of its data (start, thirds, end): cheap on a
multi-GB checkpoint, and any retrained or re-quantised weights change it. A converted
orbax checkpoint carries its source's fingerprint, so servers loading either form share L3.
"""

from __future__ import annotations

import hashlib
import os
import struct

import jax
import numpy as np

SAMPLE = 64 << 10


def checkpoint_fingerprint(model_dir: str) -> str:
    h = hashlib.sha256(b"hicache-jax checkpoint v1")
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        h.update(name.encode() + struct.pack("<Q", size))
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, size)))
            for frac in (0.0, 1 / 3, 2 / 3, 1.0):
                f.seek(max(0, min(size - SAMPLE, int(frac * size))))
                h.update(f.read(SAMPLE))
    return h.hexdigest()[:32]


def params_fingerprint(params, label: str = "") -> str:
    """Hash every parameter's bytes (for models built in memory: presets, tests)."""
    h = hashlib.sha256(b"hicache-jax params v1" + label.encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        a = np.asarray(leaf)
        h.update(jax.tree_util.keystr(path).encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:32]

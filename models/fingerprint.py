"""Weights identity for L3 namespaces: two models never read each other's pages.

A checkpoint's fingerprint is a SHA-256 over ``config.json`` and, for every safetensors file
the loader reads (or its one GGUF file), its name, size and a digest of ALL its bytes
(``file_digest``): any change to any weight, however small or wherever it lies, gives
another fingerprint. Digests are computed once per file and remembered beside the
checkpoint, so only the first load of a checkpoint pays for hashing (about 1 GB/s per
core). A converted orbax checkpoint carries its source's fingerprint (``orbax_io``), so
servers loading either form share L3.
"""

from __future__ import annotations

import hashlib
import os
import struct

import jax
import numpy as np

from hicache_jax.models.file_digest import file_digests
from hicache_jax.models.gguf import gguf_file
from hicache_jax.models.hf.safetensors_io import Checkpoint, CheckpointError

VERSION = 2  # 1 sampled four 64 KiB windows per file: blind to most of a fine-tune


def _field(h, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)) + data)  # length-prefixed: fields never run together


def checkpoint_fingerprint(model_dir: str) -> str:
    """64 hex chars naming ``config.json`` and every byte of the checkpoint's weights."""
    h = hashlib.sha256(f"hicache-jax checkpoint v{VERSION}".encode())
    gguf = gguf_file(model_dir)
    if gguf:  # config, weights and tokenizer are all in the file's bytes
        directory, name = os.path.split(os.path.abspath(gguf))
        try:
            digest = file_digests(directory, [name])[name]
        except OSError as e:
            raise CheckpointError(f"{gguf}: cannot fingerprint the checkpoint ({e})") from e
        _field(h, b"gguf")
        _field(h, name.encode())
        _field(h, bytes.fromhex(digest))
        return h.hexdigest()
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            _field(h, f.read())
        names = sorted(Checkpoint(model_dir).files)  # exactly the files the loader reads
        digests = file_digests(model_dir, names)
    except OSError as e:
        raise CheckpointError(f"{model_dir}: cannot fingerprint the checkpoint ({e})") from e
    for name in names:
        _field(h, name.encode())
        _field(h, bytes.fromhex(digests[name]))
    return h.hexdigest()


def params_fingerprint(params, label: str = "") -> str:
    """Hash every parameter's bytes (for models built in memory: presets, tests)."""
    h = hashlib.sha256(b"hicache-jax params v1" + label.encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        a = _whole(leaf)
        h.update(jax.tree_util.keystr(path).encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:32]


def _whole(leaf) -> np.ndarray:
    """A parameter's whole value; over several processes a sharded one is gathered (every
    process must call this, in the same order)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)

"""Orbax checkpoints: convert a Hugging Face checkpoint once, restore it fast (and sharded).

Layout of a converted checkpoint directory::

    out/hicache_model.json   ModelConfig, dtype, and where it came from
    out/params/              orbax StandardCheckpointer tree of the parameters
    out/tokenizer*.json ...  copied from the source, so the directory is self-contained
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import jax
import orbax.checkpoint as ocp
from flax import nnx

from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.dtypes import resolve_dtype
from hicache_jax.models.hf.safetensors_io import CheckpointError
from hicache_jax.models.hf.weights import abstract_state
from hicache_jax.models.kernels.backend import KernelConfig

log = logging.getLogger(__name__)

META = "hicache_model.json"
LAYOUT_VERSION = 1
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def _str_keys(tree):
    """Orbax wants string keys; NNX lists index layers by int."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _int_keys_like(tree, like):
    if isinstance(like, dict):
        return {k: _int_keys_like(tree[str(k)], v) for k, v in like.items()}
    return tree


def save(model: CausalLM, out_dir: str, *, source: str | None = None) -> None:
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; choose a new directory")
    os.makedirs(out_dir)
    params = nnx.to_pure_dict(nnx.state(model))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(out_dir, "params"), _str_keys(params))
    ckptr.wait_until_finished()
    from hicache_jax.models.fingerprint import VERSION, checkpoint_fingerprint

    meta = {
        "layout_version": LAYOUT_VERSION,
        "config": model.cfg.to_dict(),
        "dtype": str(model.dtype),
        "source": source,
        "fingerprint": checkpoint_fingerprint(source) if source else None,
        "fingerprint_version": VERSION,
    }
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f, indent=2)
    from hicache_jax.models.gguf import gguf_file

    if gguf := gguf_file(source):  # its tokenizer lives in its metadata: write it out
        from hicache_jax.models.gguf.tokenizer import write_tokenizer_files

        write_tokenizer_files(gguf, out_dir)
    elif source:
        for name in COPIED:
            if os.path.exists(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), out_dir)


def _read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from e
    if meta.get("layout_version") != LAYOUT_VERSION:
        raise CheckpointError(
            f"{meta_path}: layout_version {meta.get('layout_version')} is not {LAYOUT_VERSION}; "
            "convert the checkpoint again"
        )
    return meta


def read_fingerprint(path: str) -> str | None:
    """The source checkpoint's fingerprint; None (the caller then hashes the restored
    parameters) if there was no source or it was taken by an older, weaker scheme."""
    from hicache_jax.models.fingerprint import VERSION

    meta = _read_meta(path)
    if meta.get("fingerprint") and meta.get("fingerprint_version") != VERSION:
        log.warning(
            "%s: its weights fingerprint predates fingerprint v%d; L3 is keyed by its "
            "parameters instead (convert again to share L3 with the source checkpoint)",
            path,
            VERSION,
        )
        return None
    return meta.get("fingerprint")


def read_config(path: str) -> ModelConfig:
    return ModelConfig.from_dict(_read_meta(path)["config"])


def restore(path: str, *, dtype=None, kernels: KernelConfig | None = None, sharding=None) -> CausalLM:
    """Restore a converted model; ``sharding(path, abstract_leaf)`` may place each leaf."""
    t0 = time.perf_counter()
    meta = _read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"])
    dtype = resolve_dtype(dtype or meta["dtype"])
    graphdef, state = abstract_state(lambda: CausalLM(cfg, dtype=dtype, kernels=kernels))
    target = nnx.to_pure_dict(state)

    def abstract(kp, leaf):
        s = sharding(kp, leaf) if sharding else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)

    target = jax.tree_util.tree_map_with_path(abstract, target)
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), _str_keys(target))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/params: cannot restore ({e})") from e
    nnx.replace_by_pure_dict(state, _int_keys_like(restored, target))
    log.info("restored %s from %s in %.2fs", cfg.architecture, path, time.perf_counter() - t0)
    return nnx.merge(graphdef, state)

"""Load a model from a Hugging Face directory or from an orbax checkpoint made by ``convert``."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
from flax import nnx

from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.dtypes import resolve_dtype
from hicache_jax.models.fingerprint import checkpoint_fingerprint
from hicache_jax.models.gguf import gguf_file
from hicache_jax.models.gguf.tensors import GGUFCheckpoint
from hicache_jax.models.hf.safetensors_io import Checkpoint, CheckpointError
from hicache_jax.models.hf.weights import abstract_state, load_params
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.registry import architecture, config_from_hf
from hicache_jax.progress import bar

log = logging.getLogger(__name__)


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: not found (is {model_dir} a model directory?)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e


def load_hf(model_dir: str, *, dtype=None, kernels: KernelConfig | None = None) -> CausalLM:
    """Build the model named by ``config.json`` and fill it from ``*.safetensors`` (or all
    three from a GGUF file: ``model_dir`` may name one, or a directory holding one).

    The weights' fingerprint (``model_fingerprint``) is hashed alongside, in a thread: the
    load and the hash share the first read of a cold file, and the digests are remembered
    beside the checkpoint, so a later ``model_fingerprint`` costs a few ``stat`` calls.
    """
    t0 = time.perf_counter()
    gguf = gguf_file(model_dir)
    if gguf:  # one file holds config, weights and tokenizer
        ckpt = GGUFCheckpoint(gguf)
        hf, where = ckpt.hf, gguf
    else:
        hf, where = read_hf_config(model_dir), os.path.join(model_dir, "config.json")
    cfg = config_from_hf(hf, where)
    dtype = resolve_dtype(dtype, hf)
    names = architecture(cfg.architecture).names
    ckpt = ckpt if gguf else Checkpoint(model_dir)
    pool = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
    hashing = pool.submit(checkpoint_fingerprint, model_dir)
    try:
        graphdef, state = abstract_state(lambda: CausalLM(cfg, dtype=dtype, kernels=kernels))
        tensors = len(jax.tree_util.tree_leaves(nnx.to_pure_dict(state)))
        with bar(total=tensors, desc="loading weights", unit="tensor") as shown:
            counted, place = _Counted(ckpt, shown), _placer(cfg, kernels)
            pure = load_params(counted, names, cfg, nnx.to_pure_dict(state), dtype, sharding=place)
        nnx.replace_by_pure_dict(state, pure)
    except BaseException:
        pool.shutdown(wait=False)  # report the load error now; the hash ends on its own
        raise
    pool.shutdown(wait=True)  # no thread outlives a successful load
    if hashing.exception() is not None:  # model_fingerprint will say what is wrong
        log.warning("could not fingerprint %s: %s", model_dir, hashing.exception())
    log.info("loaded %s from %s in %.2fs", cfg.architecture, model_dir, time.perf_counter() - t0)
    return nnx.merge(graphdef, state)


class _Counted:
    """A ``Checkpoint`` whose reads advance a progress bar (postfix: the shard being read)."""

    def __init__(self, ckpt: Checkpoint, shown):
        self.ckpt, self.bar = ckpt, shown

    def get(self, name: str):
        out = self.ckpt.get(name)
        self.bar.set_postfix_str(os.path.basename(self.ckpt.file_of(name)), refresh=False)
        self.bar.update()
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def __getattr__(self, attr):
        return getattr(self.ckpt, attr)


def _placer(cfg, kernels: KernelConfig | None):
    """``sharding(keypath, leaf)`` for the kernels' mesh, or None without one."""
    mesh = kernels.mesh if kernels else None
    if mesh is None:
        return None
    from hicache_jax.models.sharding import param_sharding

    return lambda kp, leaf: param_sharding(kp, leaf, cfg, mesh)


def load_model(path: str, *, dtype=None, kernels: KernelConfig | None = None) -> CausalLM:
    """A Hugging Face directory, or an orbax checkpoint written by ``convert``."""
    from hicache_jax.models import orbax_io

    if orbax_io.is_orbax_checkpoint(path):
        cfg = orbax_io.read_config(path)
        return orbax_io.restore(path, dtype=dtype, kernels=kernels, sharding=_placer(cfg, kernels))
    return load_hf(path, dtype=dtype, kernels=kernels)


def model_fingerprint(path: str) -> str | None:
    """The weights identity of a model directory (None when it cannot be told)."""
    from hicache_jax.models import orbax_io

    if orbax_io.is_orbax_checkpoint(path):
        return orbax_io.read_fingerprint(path)
    return checkpoint_fingerprint(path)

"""Flax NNX models, layers, kernels and weight I/O (imported as ``hicache_jax.models``)."""

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.config import MambaConfig, ModelConfig
from hicache_jax.models.hf.safetensors_io import CheckpointError
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.loader import load_hf, load_model

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ForwardBatch",
    "KernelConfig",
    "MambaConfig",
    "ModelConfig",
    "load_hf",
    "load_model",
]

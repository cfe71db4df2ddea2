"""Page copies between the device cache and host (L2) pools, in the host pools' layout.

The number of pages per call is padded to a power of two so a handful of programs
serve every transfer; padding reads page 0 and writes nowhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.models.cache import MambaState


def _bucket(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


class PageTransfer:
    def __init__(self, runner):
        self.runner = runner
        kinds = runner.cfg.layer_kinds
        self.layers = {
            "full": [i for i, k in enumerate(kinds) if k == "attention"],
            "swa": [i for i, k in enumerate(kinds) if k == "sliding"],
            "mamba": [i for i, k in enumerate(kinds) if k == "mamba"],
        }

    def layout(self, kind: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shapes of one host row of ``kind`` (see host_pool.py)."""
        layers = self.layers[kind]
        first = self.runner.cache[layers[0]]
        if kind == "mamba":
            return {
                "conv": ((len(layers),) + first.conv.shape[1:], first.conv.dtype),
                "ssm": ((len(layers),) + first.ssm.shape[1:], first.ssm.dtype),
            }
        return {"kv": ((len(layers), 2) + first.k.shape[1:], first.k.dtype)}

    def read(self, kind: str, idx: list[int]) -> dict[str, np.ndarray]:
        n = len(idx)
        padded = np.zeros(_bucket(n), np.int32)
        padded[:n] = idx
        out = _gather_jit(self.runner.cache, padded, layers=tuple(self.layers[kind]), mamba=kind == "mamba")
        return {k: np.asarray(v)[:n] for k, v in out.items()}

    def write(self, kind: str, idx: list[int], data: dict[str, np.ndarray]) -> None:
        n, b = len(idx), _bucket(len(idx))
        padded = np.full(b, np.iinfo(np.int32).max, np.int32)  # out of range: dropped
        padded[:n] = idx
        full = {k: np.concatenate([v, np.zeros((b - n,) + v.shape[1:], v.dtype)]) for k, v in data.items()}
        self.runner.cache = _scatter_jit(
            self.runner.cache, padded, full, layers=tuple(self.layers[kind]), mamba=kind == "mamba"
        )


def _gather(cache, idx, *, layers, mamba):
    if mamba:
        return {
            "conv": jnp.stack([cache[i].conv[idx] for i in layers], axis=1),
            "ssm": jnp.stack([cache[i].ssm[idx] for i in layers], axis=1),
        }
    return {"kv": jnp.stack([jnp.stack([cache[i].k[idx], cache[i].v[idx]], axis=1) for i in layers], axis=1)}


def _scatter(cache, idx, data, *, layers, mamba):
    cache = list(cache)
    for j, i in enumerate(layers):
        e = cache[i]
        if mamba:
            cache[i] = MambaState(
                conv=e.conv.at[idx].set(data["conv"][:, j].astype(e.conv.dtype), mode="drop"),
                ssm=e.ssm.at[idx].set(data["ssm"][:, j].astype(e.ssm.dtype), mode="drop"),
            )
        else:
            kv = data["kv"][:, j]
            cache[i] = type(e)(
                e.k.at[idx].set(kv[:, 0].astype(e.k.dtype), mode="drop"),
                e.v.at[idx].set(kv[:, 1].astype(e.v.dtype), mode="drop"),
            )
    return tuple(cache)


# Module-level jits: engines in one process share compiled transfers.
_gather_jit = jax.jit(_gather, static_argnames=("layers", "mamba"))
_scatter_jit = jax.jit(_scatter, static_argnames=("layers", "mamba"), donate_argnums=(0,))

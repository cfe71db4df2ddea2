"""Tensor parallelism on a one-axis JAX mesh: where every weight and cache array lives.

The mesh is ``jax.devices()[:tp_size]`` on one axis, ``"tp"``. Megatron-style splits, so
each layer needs one all-reduce (its row-parallel output) and XLA's partitioner inserts it::

    attention   q_proj, k_proj, v_proj   [hidden, heads * D]  columns split   (by head)
                o_proj                   [heads * D, hidden]  rows split      -> all-reduce
                KV pages        [pages, page_size, kv_heads, D]  split by KV head
    MLA         q_b_proj (q_proj)        [.., heads * D]  columns split  (by head)
                w_uk, w_uv (kv_b_proj)   [heads, ..]  split by head
                o_proj                   rows split -> all-reduce; q_a_proj, kv_a_proj,
                their norms and the indexer replicated
                latent and indexer pages  [pages, page_size, D]  replicated: every head
                reads every row (and every device holds the same page, so one writes L3)
    MLP         gate_proj, up_proj       columns split; down_proj rows split  -> all-reduce
    MoE         experts (gate_up, down and their biases) split whole by expert; the router
                and its correction bias replicated; a shared expert split as the MLP is,
                its gate (hidden -> 1) replicated
    Mamba2      in_proj    [hidden, z|xBC|dt]  rows split (its columns interleave z, x, B,
                           C and dt, so an even column split would cut across them)
                SSD scan and state   [slots, heads, P, N]  split by Mamba head
                out_proj   [heads * P, hidden]  rows split -> all-reduce
    GDN         in_proj    [hidden, groups * (q|k|v|z|b|a)]  columns split: grouped by key
                           head (``layers/gated_deltanet.py``), so each device gets whole
                           groups; the conv weight and conv state split the same way
                delta rule and state   [slots, v_heads, Dk, Dv]  split by value head
                out_proj   [v_heads * Dv, hidden]  rows split -> all-reduce
    DeepSeek V4 (one K=V head; ``layers/dsv4.py``)
                q_b_proj   [q_lora_rank, heads * D]  columns split (by head); sinks by head
                o_a        [o_groups, heads * D / o_groups, o_lora_rank]  split by group
                o_b_proj   [o_groups * o_lora_rank, hidden]  rows split -> all-reduce
                (more devices than groups: o_a and o_b_proj replicated, and XLA splits each
                group's rows over its devices as the head-split attention output lies);
                kv_proj (the K=V rows), the compressors, the indexer, q_a_proj and the mHC
                mixes replicated (every device computes them); window rows, compressed
                entries, indexer keys and compressor state replicated (``heads=False``);
                MoE as above, hash layers' tid2eid replicated
    embedding / lm_head   split by vocabulary; logits are gathered (replicated) for sampling
    everything else (norms, conv, biases of row-parallel layers)  replicated

The attention and SSD kernels (both backends) run per shard under ``shard_map``: a shard
sees its own query heads and the KV heads they read, and never talks to another shard.
DeepSeek V4's attention is plain JAX, which XLA partitions: the layer pins its queries and
output to the head split, and every device gathers the (replicated) rows its heads read.

Fewer KV heads than ``tp_size``: KV heads are *replicated*, not refused. ``k_proj`` and
``v_proj`` stay whole, and each shard stores the one KV head its query heads read, so the
device KV pool holds ``tp_size`` heads (``tp_size / kv_heads`` copies of each). That costs
device memory for the copies, but no shard ever waits on another for a KV head. Host (L2)
and storage (L3) pages keep each KV head once (see ``hicache_jax/runtime/transfer.py``).

Split sizes must divide: query heads, intermediate size (of dense MLPs and shared experts),
experts, Mamba heads and (with Mamba layers) hidden size, GDN key (so also value) heads by
``tp_size``; KV heads, Mamba groups and DeepSeek V4's output groups must divide ``tp_size``
or be divided by it.
``check_tp`` names the one that does not.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hicache_jax.kinds import RECURRENT, LayerKind
from hicache_jax.models.cache import RecurrentState, join, paged_specs
from hicache_jax.models.config import ModelConfig

AXIS = "tp"


def make_mesh(tp_size: int, devices=None) -> Mesh:
    """The first ``tp_size`` devices (of all processes: ``jax.devices()``, or those given,
    e.g. a TPU topology's to compile for), on one axis."""
    devices = jax.devices() if devices is None else list(devices)
    if tp_size > len(devices):
        raise ValueError(f"tp_size={tp_size} needs {tp_size} devices; there are {len(devices)}")
    return Mesh(np.array(devices[:tp_size]), (AXIS,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the first size that ``tp`` cannot split."""
    split = []
    either = []  # sizes that may also be smaller than tp (then replicated)
    dense = set(range(cfg.num_layers)) - set(cfg.sparse_layers) - set(cfg.mlp_free_layers)
    if dense:
        split.append(("intermediate_size", cfg.intermediate_size))
    if cfg.attention_layers:
        split.append(("num_heads", cfg.num_heads))
        either.append(("num_kv_heads", cfg.num_kv_heads))
    if cfg.moe is not None and cfg.sparse_layers:
        split.append(("moe.num_experts", cfg.moe.num_experts))  # whole experts per device
        if cfg.moe.shared_intermediate:
            split.append(("moe.shared_intermediate", cfg.moe.shared_intermediate))
    if cfg.mamba is not None and cfg.mamba_layers:
        split.append(("mamba.num_heads", cfg.mamba.num_heads))
        split.append(("hidden_size", cfg.hidden_size))  # in_proj's rows
        either.append(("mamba.num_groups", cfg.mamba.num_groups))
    if cfg.dsv4 is not None:  # o_a split by group, or (more devices) each group's rows
        either.append(("dsv4.o_groups", cfg.dsv4.o_groups))
    if cfg.gdn is not None and cfg.gdn_layers:  # whole key-head groups per device
        split.append(("gdn.num_k_heads", cfg.gdn.num_k_heads))
        split.append(("gdn.num_v_heads", cfg.gdn.num_v_heads))
    for name, value in split:
        if value % tp:
            raise ValueError(
                f"tp_size={tp} cannot split {cfg.architecture}: {name}={value} is not a multiple of {tp}"
            )
    for name, value in either:
        if value % tp and tp % value:
            raise ValueError(
                f"tp_size={tp} cannot split {cfg.architecture}: "
                f"{name}={value} must divide or be divided by {tp}"
            )


def kv_heads_on_device(cfg: ModelConfig, tp: int) -> int:
    """KV heads the device pool holds: the model's, or ``tp`` when they are replicated."""
    return max(cfg.num_kv_heads, tp)


def param_spec(path: tuple, shape: tuple, cfg: ModelConfig, tp: int) -> P:
    """The PartitionSpec of one parameter, by its path in the model's state."""
    p = tuple(str(x) for x in path)
    vocab_ok = cfg.vocab_size % tp == 0
    if p == ("embed", "embedding"):
        return P(AXIS, None) if vocab_ok else P()
    if p == ("lm_head", "kernel"):
        return P(None, AXIS) if vocab_ok else P()
    if p[0] == "mtp" and p[2:] == ("head", "kernel") and cfg.nextn is not None:  # a block's own LM head
        return P(None, AXIS) if vocab_ok else P()
    if p[0] == "mtp" and len(p) >= 5 and p[2] == "layer":  # an MTP block's layer
        kind = cfg.dsv4.mtp_kind if cfg.dsv4 is not None else cfg.nextn.kind
        p = ("layers", *p[1:2], *p[3:])  # split as a main layer is
    elif p[0] != "layers" or len(p) < 4:
        return P()
    else:
        kind = cfg.layer_kinds[int(p[1])]
    part, name, leaf = p[2], p[3], p[-1]
    column = P(None, AXIS) if leaf == "kernel" else P(AXIS)
    row = P(AXIS, None) if leaf == "kernel" else P()
    if part == "mlp":
        if name in ("gate_up", "down", "gate_up_bias", "down_bias"):  # MoE: whole experts per device
            return P(AXIS, *([None] * (len(shape) - 1)))
        if name == "shared_expert":  # MoE: a dense MLP beside the experts
            name = p[4]
        if name in ("gate_proj", "up_proj"):
            return column
        if name == "down_proj":
            return row
        return P()  # the router, its correction bias, the shared expert's gate
    if part != "mixer":
        return P()
    if kind == LayerKind.GDN:
        if name == "in_proj":
            return column
        if name == "conv_weight":  # [K, channels], grouped like in_proj's columns
            return P(None, AXIS)
        return row if name == "out_proj" else P()
    if name in ("q_proj", "q_b_proj"):  # MLA's low-rank query's up-projection too
        return column
    if name in ("w_uk", "w_uv"):  # MLA's kv_b_proj halves [heads, ...]: split by head
        return P(AXIS, None, None)
    if name == "sinks":  # one per query head, split as the heads are
        return P(AXIS)
    if name in ("o_a", "o_b_proj"):  # DeepSeek V4's grouped output: by group, when tp divides them
        if cfg.dsv4.o_groups % tp:
            return P()
        return P(AXIS, None, None) if name == "o_a" else row
    if name in ("k_proj", "v_proj"):
        return column if cfg.num_kv_heads % tp == 0 else P()
    if name in ("o_proj", "in_proj", "out_proj"):
        return row
    return P()


def shard_model(model) -> None:
    """Move a built model's weights onto its mesh (``model.mesh``), each to its split."""
    if model.mesh is None:
        return
    state = nnx.state(model)
    pure = jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.device_put(x, param_sharding(kp, x, model.cfg, model.mesh)),
        nnx.to_pure_dict(state),
    )
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def abstract_weights(model, placement: Mesh) -> None:
    """Give a model built by ``nnx.eval_shape`` (``jax.ShapeDtypeStruct`` weights) the
    shardings ``shard_model`` would: on its mesh, or replicated on ``placement`` (one device,
    for tp_size=1). Nothing is allocated."""
    mesh = model.mesh or placement
    state = nnx.state(model)
    pure = jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=param_sharding(kp, x, model.cfg, mesh)),
        nnx.to_pure_dict(state),
    )
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def param_sharding(keypath, leaf, cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    path = tuple(_key(k) for k in keypath)
    return NamedSharding(mesh, param_spec(path, leaf.shape, cfg, tp_size(mesh)))


def _key(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def cache_shardings(cfg: ModelConfig, mesh: Mesh) -> tuple:
    """One entry per cache layer (``ModelConfig.cache_layer_kinds``), shaped like the cache:
    pages split by KV head where their ``PagedSpec`` has heads (else replicated: a latent
    every head reads), a recurrent layer's state by head; Mamba's conv state (a few rows
    per slot) replicated, GDN's split by channel (its channels are grouped by key head, as
    the device's heads are)."""
    out = []
    for kind in cfg.cache_layer_kinds:
        if kind in RECURRENT:
            conv = P(None, None, AXIS) if kind == LayerKind.GDN else P()  # [slots, K - 1, channels]
            out.append(RecurrentState(conv=NamedSharding(mesh, conv), ssm=NamedSharding(mesh, P(None, AXIS))))
            continue
        specs = paged_specs(cfg, kind)
        made = []
        for s in specs:
            split = P(None, None, AXIS, *([None] * (len(s.per_row) - 1))) if s.heads else P()
            made.append(s.entry(*(NamedSharding(mesh, split) for _ in s.entry._fields)))
        out.append(join(made, specs))
    return tuple(out)


def vocab_sharding(cfg: ModelConfig, mesh: Mesh | None):
    """Logits ``[rows, vocab]`` split by vocabulary, as the LM head computes them."""
    if mesh is None or cfg.vocab_size % tp_size(mesh):
        return None
    return NamedSharding(mesh, P(None, AXIS))


def replicated(mesh: Mesh | None):
    return None if mesh is None else NamedSharding(mesh, P())


def vocab_rows(replicated_on: NamedSharding | None, vocab: int):
    """Where logits rows live: split by vocabulary as the output layer splits them (when the
    vocabulary divides over the mesh), else whole on every device."""
    if replicated_on is None:
        return None
    mesh = replicated_on.mesh
    return NamedSharding(mesh, P(None, AXIS) if vocab % mesh.shape[AXIS] == 0 else P())


def constrain(tree, shardings):
    """``with_sharding_constraint`` that is a no-op without a mesh (``shardings=None``)."""
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)

"""Loading an EAGLE-3 draft checkpoint (``LlamaForCausalLMEagle3``, ``layers/eagle3.py``) from
safetensors, under the names SGLang and vLLM read:

- ``fc.weight [h, 3h]``; ``norm.weight [h]``; ``lm_head.weight [draft_vocab, h]`` (absent: the
  target's LM head, config ``draft_vocab_size`` unset);
- ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [h]``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [heads * head_dim, 2h]``, ``o_proj [h, H * D]``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``;
- ``d2t [draft_vocab]`` int64 offsets (target id = draft id + d2t[draft id]) and ``t2d
  [vocab]`` bool (the target ids covered), checked against each other;
- ``embed_tokens.weight`` when a trainer saved it: read for its shape only, as SGLang does
  (the draft embeds with the target's embedding).

A ``model.`` prefix on the names is accepted. A tensor no parameter reads is refused, named.
On a tensor-parallel mesh (``kernels.mesh``) each device reads only its own slice of each
tensor, split as ``layers/eagle3.param_spec`` says (a main layer's split).
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hicache_jax.models.config import ModelConfig
from hicache_jax.models.hf.safetensors_io import Checkpoint, CheckpointError
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.layers.eagle3 import Eagle3Config, Eagle3Draft, draft_targets, param_sharding

log = logging.getLogger(__name__)

# Our parameter path -> (published tensor name, transposed: torch Linear [out, in]).
TENSORS = {
    ("fc", "kernel"): ("fc.weight", True),
    ("input_norm", "weight"): ("midlayer.input_layernorm.weight", False),
    ("hidden_norm", "weight"): ("midlayer.hidden_norm.weight", False),
    ("post_attention_norm", "weight"): ("midlayer.post_attention_layernorm.weight", False),
    ("attn", "q_proj", "kernel"): ("midlayer.self_attn.q_proj.weight", True),
    ("attn", "k_proj", "kernel"): ("midlayer.self_attn.k_proj.weight", True),
    ("attn", "v_proj", "kernel"): ("midlayer.self_attn.v_proj.weight", True),
    ("attn", "o_proj", "kernel"): ("midlayer.self_attn.o_proj.weight", True),
    ("mlp", "gate_proj", "kernel"): ("midlayer.mlp.gate_proj.weight", True),
    ("mlp", "up_proj", "kernel"): ("midlayer.mlp.up_proj.weight", True),
    ("mlp", "down_proj", "kernel"): ("midlayer.mlp.down_proj.weight", True),
    ("norm", "weight"): ("norm.weight", False),
    ("head", "kernel"): ("lm_head.weight", True),
}


def read_config(path: str) -> tuple[Eagle3Config, str]:
    where = os.path.join(path, "config.json")
    try:
        with open(where) as f:
            hf = json.load(f)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: not JSON ({e})") from e
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    try:
        return Eagle3Config.from_hf(hf, where), where
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def load_eagle3(
    path: str,
    target_cfg: ModelConfig,
    dtype=jnp.bfloat16,
    kernels: KernelConfig | None = None,
    *,
    shapes_on: Mesh | None = None,
):
    """The draft in ``path`` (config.json and safetensors) for the target ``target_cfg``:
    refuses a draft whose hidden size or vocabulary is not the target's, naming both.

    ``shapes_on``: read config.json only, and give the draft ``jax.ShapeDtypeStruct``
    weights placed as loading would place them, on the kernels' mesh (or replicated on
    this one): what the TPU compile path (``hicache_jax/tpu/abstract.py``) compiles. The
    draft then has its own LM head, and a vocabulary map unless the vocabularies are equal
    (what the published drafts ship)."""
    cfg, where = read_config(path)
    for name, got, want in (
        ("hidden_size", cfg.hidden_size, target_cfg.hidden_size),
        ("vocab_size", cfg.vocab_size, target_cfg.vocab_size),
    ):
        if got != want:
            raise CheckpointError(
                f"{where}: the draft's {name} is {got} but the target's ({target_cfg.architecture}) is "
                f"{want}: this EAGLE-3 draft was not trained for this model"
            )
    try:
        cfg.aux_boundaries(target_cfg.num_layers)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e

    if shapes_on is not None:
        mesh = (kernels.mesh if kernels else None) or shapes_on
        identity = cfg.draft_vocab_size == cfg.vocab_size
        graphdef, state = nnx.split(
            nnx.eval_shape(lambda: _build(cfg, where, True, identity, dtype, kernels))
        )

        def shaped(kp, leaf):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_sharding(kp, leaf, cfg, mesh))

        return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(shaped, state))

    ckpt = Checkpoint(path)
    prefixed = {n.removeprefix("model."): n for n in ckpt.names()}

    def tensor(name: str) -> np.ndarray:
        if name not in prefixed:
            raise CheckpointError(f"{path}: tensor {name} is missing from the checkpoint")
        return ckpt.get(prefixed[name])

    read = {name for name, _ in TENSORS.values()} | {"t2d"}  # t2d: checked against d2t only
    own_head = "lm_head.weight" in prefixed
    targets = None
    if "d2t" in prefixed:
        t2d = tensor("t2d") if "t2d" in prefixed else None
        try:
            targets = draft_targets(tensor("d2t"), cfg.vocab_size, t2d)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.file_of(prefixed['d2t'])}: {e}") from e
        if targets.shape[0] != cfg.draft_vocab_size:
            raise CheckpointError(
                f"{ckpt.file_of(prefixed['d2t'])}: d2t has {targets.shape[0]} entries but "
                f"draft_vocab_size is {cfg.draft_vocab_size}"
            )
        read.add("d2t")
    elif cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} but the "
            "checkpoint holds no d2t (the draft ids' target ids)"
        )
    if "embed_tokens.weight" in prefixed:
        shape = tuple(tensor("embed_tokens.weight").shape)
        if shape != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(
                f"{path}: tensor embed_tokens.weight has shape {shape}, expected "
                f"{(cfg.vocab_size, cfg.hidden_size)}"
            )
        log.info("%s: embed_tokens.weight left unread: the draft embeds with the target's embedding", path)
        read.add("embed_tokens.weight")
    left = sorted(set(prefixed) - read)
    if left:
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        raise CheckpointError(f"{path}: {len(left)} tensor(s) no EAGLE-3 parameter reads: {shown}")

    identity = targets is None or bool((targets == np.arange(targets.shape[0])).all())
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: _build(cfg, where, own_head, identity, dtype, kernels))
    )

    mesh = kernels.mesh if kernels else None

    def place(kp, leaf, arr: np.ndarray) -> jax.Array:
        if mesh is None:
            return jnp.asarray(arr)
        where = param_sharding(kp, leaf, cfg, mesh)
        return jax.make_array_from_callback(arr.shape, where, lambda index: arr[index])

    def load(kp, leaf):
        key = tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey))
        if key == ("targets",):
            ids = np.arange(cfg.draft_vocab_size) if targets is None else targets
            return place(kp, leaf, np.asarray(ids, np.int32))
        name, transposed = TENSORS[key]
        raw = tensor(name)
        if not (np.issubdtype(raw.dtype, np.floating) or raw.dtype == jnp.bfloat16):
            raise CheckpointError(
                f"{ckpt.file_of(prefixed[name])}: tensor {name} has dtype {raw.dtype}, expected floats"
            )
        want = tuple(reversed(leaf.shape)) if transposed else tuple(leaf.shape)
        if tuple(raw.shape) != want:
            raise CheckpointError(
                f"{ckpt.file_of(prefixed[name])}: tensor {name} has shape {tuple(raw.shape)}, expected {want}"
            )
        return place(kp, leaf, np.asarray(raw.T if transposed else raw, dtype=jnp.dtype(dtype)))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(load, abstract))


def _build(cfg: Eagle3Config, where: str, own_head: bool, identity: bool, dtype, kernels) -> Eagle3Draft:
    try:
        return Eagle3Draft(
            cfg, own_head=own_head, identity_map=identity, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0)
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e

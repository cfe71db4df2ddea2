"""The EAGLE-3 drafter: a separate one-layer draft model (``architectures:
["LlamaForCausalLMEagle3"]``, as SGLang's and vLLM's ``llama_eagle3.py`` load it) that drafts
from three of the target model's hidden states.

One step, for each token ``t`` fed (``batch.input_ids``: the token after the position whose
hidden state is given)::

    x      = fc(concat([low, mid, high]))        # first step: [T, 3h] -> [T, h]; chained: x = hidden
    a      = attn(concat([input_norm(embed(t)), hidden_norm(x)]))   # q, k, v read [T, 2h]
    r      = x + a                               # norm_before_residual: hidden_norm(x) + a
    out    = r + mlp(post_attention_norm(r))     # fed to the next chained step as ``hidden``
    logits = lm_head(norm(out))                  # [R, draft_vocab], placed at target ids

The embedding comes first in the concat (both peers). The embedding is the target's (SGLang
always uses it; vLLM when the draft holds none). Draft id ``d`` is target id ``d + d2t[d]``;
the target ids no draft id maps to get ``-inf``, so the logits are over the target's
vocabulary and the engine can take their argmax as it does the target's. Without its own
LM head (config ``draft_vocab_size`` unset) the draft uses the target's (``unembed``).

The three hidden states are the target's residual stream (the layer's residual add
included, before any norm) at three layer boundaries: ``Eagle3Config.aux_boundaries``.

Under tensor parallelism (``models/sharding.py``) the layer splits as a main layer does
(``param_spec``): q, k, v by head (k and v whole when the KV heads are fewer than the
devices), ``o_proj`` by rows, the MLP Megatron-style, its own LM head by draft vocabulary;
``fc`` is replicated (vLLM's ``ReplicatedLinear``), as are the norms and the vocabulary map.
Its KV heads are the target's (``cache_mismatch``), so its cache entry splits as theirs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hicache_jax.kinds import LayerKind
from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import layer_specs, paged_specs
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.layers.attention import Attention
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.mlp import MLP
from hicache_jax.models.layers.norms import RMSNorm
from hicache_jax.models.sharding import AXIS, check_tp, tp_size
from hicache_jax.models.sharding import param_spec as model_param_spec

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's alias


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of the draft's LM head
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0
    max_position_embeddings: int = 131072
    # ``eagle_config.eagle_aux_hidden_state_layer_ids`` as written (None: not given).
    aux_layer_ids: tuple[int, ...] | None = None
    # vLLM's ``norm_before_residual``: the residual is hidden_norm(x), not x.
    norm_before_residual: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Eagle3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Eagle3Config.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"Eagle3Config.head_dim {self.head_dim} must be even (RoPE rotates halves)")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config.draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size "
                f"{self.vocab_size}]"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(
                f"Eagle3Config.aux_layer_ids {self.aux_layer_ids}: the fc layer reads three hidden "
                f"states, got {len(self.aux_layer_ids)} layer ids"
            )

    @classmethod
    def from_hf(cls, hf: dict, where: str = "config.json") -> Eagle3Config:
        """From a draft checkpoint's config.json; every refusal names the field."""

        def field(name: str, default=None, *, kind=int):
            value = hf.get(name, default)
            if value is None:
                raise ValueError(f"{where}: missing field {name!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{where}: {name}={value!r} must be a positive integer")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{where}: {name}={value!r} must be a number")
            return kind(value)

        archs = hf.get("architectures")
        if not isinstance(archs, list) or not archs or archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"{where}: architectures={archs!r}, want [{ARCHITECTURES[0]!r}] (an EAGLE-3 draft)"
            )
        for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if hf.get(name, want) != want:
                raise ValueError(f"{where}: {name}={hf[name]!r} is not supported (expected {want!r})")
        if field("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"{where}: num_hidden_layers={hf['num_hidden_layers']}: only one-layer EAGLE-3 drafts "
                "(the published 'midlayer' layout) are supported"
            )
        eagle = hf.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config={eagle!r} must be an object")
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError(
                f"{where}: eagle_config.use_aux_hidden_state false (no fc layer) is not supported"
            )
        if hf.get("norm_before_fc") or eagle.get("norm_before_fc"):
            raise ValueError(
                f"{where}: norm_before_fc (a norm over the three hidden states) is not supported"
            )
        h, heads = field("hidden_size"), field("num_attention_heads")
        target_h = hf.get("target_hidden_size")
        if target_h is not None and target_h != h:
            raise ValueError(
                f"{where}: target_hidden_size={target_h!r} differs from hidden_size={h}: a draft "
                "narrower than its target (fc reading 3 x target_hidden_size) is not supported"
            )
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(
                    f"{where}: eagle_aux_hidden_state_layer_ids={ids!r} must be a list of layer indices"
                )
            ids = tuple(ids)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(f"{where}: rope_scaling rope_type {kind!r} is not supported (default, linear)")
        vocab = field("vocab_size")
        draft_vocab = hf.get("draft_vocab_size")
        try:
            return cls(
                hidden_size=h,
                num_heads=heads,
                num_kv_heads=field("num_key_value_heads", heads),
                head_dim=field("head_dim", h // heads),
                intermediate_size=field("intermediate_size"),
                vocab_size=vocab,
                draft_vocab_size=vocab if draft_vocab is None else field("draft_vocab_size"),
                rms_norm_eps=field("rms_norm_eps", 1e-6, kind=float),
                rope_theta=float(rope.get("rope_theta", field("rope_theta", 10000.0, kind=float))),
                rope_linear_factor=float(rope.get("factor", 1.0)) if kind == "linear" else 1.0,
                max_position_embeddings=field("max_position_embeddings", 131072),
                aux_layer_ids=ids,
                norm_before_residual=bool(hf.get("norm_before_residual", False)),
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e

    def aux_boundaries(self, num_target_layers: int) -> tuple[int, int, int]:
        """The target's residual-stream boundaries whose hidden states ``fc`` reads, in its
        input order: boundary ``b`` is the input of layer ``b`` (the output of layer ``b - 1``
        after its residual add; ``num_target_layers``: the last layer's output, before the
        final norm). Without layer ids: ``(2, L // 2, L - 3)`` (vLLM's and SGLang's default,
        the inputs of those layers). With ids the peers disagree: SGLang reads them as layer
        outputs (boundary ``id + 1``; since its PR #25454 only when the first id is 1,
        otherwise as boundaries), vLLM as boundaries; this follows SGLang's current rule."""
        L = num_target_layers
        if self.aux_layer_ids is None:
            out = (2, L // 2, L - 3)
        elif self.aux_layer_ids[0] == 1:
            out = tuple(i + 1 for i in self.aux_layer_ids)
        else:
            out = self.aux_layer_ids
        if not all(1 <= b <= L for b in out):
            raise ValueError(
                f"EAGLE-3 hidden-state boundaries {out} (layer ids {self.aux_layer_ids}) are not all "
                f"within the target's {L} layers"
            )
        return out

    @property
    def layer_config(self) -> ModelConfig:
        """The draft's attention as a one-layer ``ModelConfig``: what its ``Attention`` is
        built from and its cache entry is allocated from (``allocate_cache``)."""
        return ModelConfig(
            architecture=ARCHITECTURES[0],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            layer_kinds=(LayerKind.ATTENTION,),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_linear_factor=self.rope_linear_factor,
            max_position_embeddings=self.max_position_embeddings,
        )


def cache_mismatch(cfg: Eagle3Config, target: ModelConfig) -> str | None:
    """Why the draft's KV cannot be one more layer of the target's full-attention pages
    (``layer_specs`` requires every layer of a page group to page it alike), or None when
    it can: the target pages a ``full`` group with the draft's KV heads and head_dim. Else
    the draft needs a pool of its own: its own ``[pages, page_size, kv_heads, head_dim]``
    arrays (``allocate_cache(cfg.layer_config, ...)``), sized and counted apart from the
    target's (page bytes, host rows), though it may share the target's page tables: the
    draft's position ``p`` holds the same token as the target's."""
    (draft,) = paged_specs(cfg.layer_config, LayerKind.ATTENTION)
    target_specs = [s for specs in layer_specs(target) for s in specs if s.kind == draft.kind]
    if not target_specs:
        return f"the target ({target.architecture}) has no {draft.kind} attention pages"
    if target_specs[0].per_row != draft.per_row:
        return (
            f"the draft's KV rows are [kv_heads, head_dim] = {list(draft.per_row)}, the target's "
            f"{draft.kind} pages {list(target_specs[0].per_row)}"
        )
    return None


def param_spec(path: tuple, shape: tuple, cfg: Eagle3Config, tp: int) -> P:
    """The PartitionSpec of one of the draft's parameters, by its path in ``Eagle3Draft``'s
    state: its attention and MLP as a main layer's (``models/sharding.py``), its LM head by
    draft vocabulary when that divides, the rest replicated."""
    p = tuple(str(x) for x in path)
    if p[0] in ("attn", "mlp"):
        part = "mixer" if p[0] == "attn" else "mlp"
        return model_param_spec(("layers", 0, part, *p[1:]), shape, cfg.layer_config, tp)
    if p == ("head", "kernel"):  # [h, draft_vocab]
        return P(None, AXIS) if cfg.draft_vocab_size % tp == 0 else P()
    return P()  # fc [3h, h], the norms, the vocabulary map


def param_sharding(keypath, leaf, cfg: Eagle3Config, mesh) -> NamedSharding:
    """``param_spec`` on ``mesh`` for a leaf of the draft's pure-dict state."""
    path = tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))
    return NamedSharding(mesh, param_spec(path, leaf.shape, cfg, tp_size(mesh)))


class VocabMap(nnx.Variable):
    """Draft id -> target id (``[draft_vocab]`` int32): state, not a trained parameter."""


class Eagle3Draft(nnx.Module):
    def __init__(
        self,
        cfg: Eagle3Config,
        *,
        own_head: bool = True,
        identity_map: bool = True,
        dtype,
        rngs: nnx.Rngs,
        kernels: KernelConfig | None = None,
    ):
        """``own_head``: the checkpoint holds ``lm_head`` (else the target's is used, and the
        draft vocabulary must be the target's). ``identity_map``: draft id ``d`` is target id
        ``d`` (no ``d2t``, or one of zeros), so equal vocabularies need no placing."""
        kernels = kernels or KernelConfig()
        h = cfg.hidden_size
        if not own_head and cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(
                f"an EAGLE-3 draft without its own lm_head uses the target's, so draft_vocab_size "
                f"{cfg.draft_vocab_size} must equal vocab_size {cfg.vocab_size}"
            )
        layer = cfg.layer_config
        check_tp(layer, tp_size(kernels.mesh))  # its heads and MLP split as a main layer's
        kernels.check_model(layer, jnp.dtype(dtype))

        def norm():
            return RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)

        self.cfg = cfg
        self.hidden_size, self.vocab_size = h, cfg.vocab_size
        self.norm_before_residual = cfg.norm_before_residual
        self.fc = Linear(3 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.input_norm = norm()  # the embedding's
        self.hidden_norm = norm()
        self.post_attention_norm = norm()
        self.norm = norm()  # the output's, before the head
        self.attn = Attention(layer, LayerKind.ATTENTION, dtype=dtype, rngs=rngs, kernels=kernels)
        # q, k and v read [embedding | hidden], twice the width Attention built them for.
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.attn.q_proj = Linear(2 * h, H * D, bias=False, dtype=dtype, rngs=rngs)
        self.attn.k_proj = Linear(2 * h, Hkv * D, bias=False, dtype=dtype, rngs=rngs)
        self.attn.v_proj = Linear(2 * h, Hkv * D, bias=False, dtype=dtype, rngs=rngs)
        self.mlp = MLP(h, cfg.intermediate_size, activation="silu", dtype=dtype, rngs=rngs)
        self.head = Linear(h, cfg.draft_vocab_size, bias=False, dtype=dtype, rngs=rngs) if own_head else None
        # Identity until a checkpoint's d2t is loaded; static: whether the ids need placing.
        self.targets = VocabMap(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))
        self.mapped = cfg.draft_vocab_size != cfg.vocab_size or not identity_map

    @property
    def kind(self) -> str:
        """The cache kind of the draft's layer (its entry is allocated as a main layer's)."""
        return LayerKind.ATTENTION

    def __call__(self, entry, hidden: jax.Array, batch: ForwardBatch, embed, unembed):
        """``hidden``: ``[T, 3h]`` the target's three hidden states of each token's previous
        position, concatenated low, mid, high (a first draft step), or ``[T, h]`` this
        draft's output of the previous chained step; ``batch.input_ids``: the tokens after
        them. ``embed``: the target's ``Embed``; ``unembed``: the target's LM head (used only
        by a draft without its own). Returns (new entry, the output ``[T, h]`` for the next
        chained step, logits ``[R, vocab]`` float32 over the target's vocabulary for the rows
        ``batch.logits_indices``), as ``NextNBlock`` does."""
        h = self.hidden_size
        if hidden.shape[-1] == 3 * h:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != h:
            raise ValueError(f"EAGLE-3 hidden has width {hidden.shape[-1]}: want {3 * h} (fc input) or {h}")
        e = self.input_norm(embed(batch.input_ids))
        x = hidden.astype(e.dtype)
        normed = self.hidden_norm(x)
        residual = normed if self.norm_before_residual else x
        entry, a = self.attn(entry, jnp.concatenate([e, normed], axis=-1), batch)
        r = residual + a
        out = r + self.mlp(self.post_attention_norm(r))
        rows = self.norm(out[batch.logits_indices])
        logits = (self.head(rows) if self.head is not None else unembed(rows)).astype(jnp.float32)
        if self.mapped:
            full = jnp.full((logits.shape[0], self.vocab_size), -jnp.inf, jnp.float32)
            logits = full.at[:, self.targets[...]].set(logits)
        return entry, out, logits


def draft_targets(d2t: np.ndarray, vocab_size: int, t2d: np.ndarray | None = None) -> np.ndarray:
    """The target id of each draft id (``d + d2t[d]``), refusing a map that leaves the
    target's vocabulary, maps two draft ids to one target id, or disagrees with ``t2d`` (the
    target ids the draft covers), naming the first offender."""
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"d2t has shape {d2t.shape} and dtype {d2t.dtype}: want [draft_vocab] integers")
    targets = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((targets < 0) | (targets >= vocab_size))
    if bad.size:
        d = int(bad[0])
        raise ValueError(
            f"d2t maps draft id {d} to {targets[d]}, outside the target vocabulary [0, {vocab_size})"
        )
    values, counts = np.unique(targets, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"d2t maps {counts[counts > 1][0]} draft ids to target id {values[counts > 1][0]}")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (vocab_size,):
            raise ValueError(f"t2d has shape {t2d.shape}: want [{vocab_size}] (the target vocabulary)")
        covered = np.zeros(vocab_size, bool)
        covered[targets] = True
        wrong = np.flatnonzero(covered != t2d.astype(bool))
        if wrong.size:
            t = int(wrong[0])
            raise ValueError(
                f"t2d and d2t disagree on target id {t}: t2d says {'' if t2d[t] else 'not '}covered, "
                f"d2t {'maps' if covered[t] else 'maps no draft id'} to it"
            )
    return targets.astype(np.int32)

"""Model configuration: one frozen dataclass that describes every supported architecture.

A model is a stack of layers, each of one ``LayerKind`` (``hicache_jax/kinds.py``):

- ``attention``: full causal attention over the whole prefix;
- ``sliding``: causal attention over the last ``sliding_window`` tokens (the token itself
  included, so query position ``q`` sees keys ``q - sliding_window + 1 .. q``);
- ``mamba``: a Mamba2 (SSD) mixer with a recurrent state;
- ``gdn``: a Gated DeltaNet linear-attention mixer with a recurrent state;
- ``mla``: multi-head latent attention (DeepSeek V3, ``MlaConfig``);
- ``dsa``: MLA over the positions its lightning indexer picks (DeepSeek V3.2, GLM-5);
- ``dsa_shared``: MLA over the positions the previous ``dsa`` layer picked (GLM-5's
  ``indexer_types: shared``).

A layer is ``x += mixer(norm(x)); x += mlp(norm(x))``; the layers in ``mlp_free_layers`` stop
after the mixer (Nemotron-H, whose checkpoints hold mixers and MLPs as separate blocks).

Architecture-specific details (Gemma's norm offset, Bamba's partial rotary, Granite's
multipliers) are plain fields, so the layers read a single config and never branch on an
architecture name.
"""

from __future__ import annotations

import dataclasses
import math

from hicache_jax.kinds import RECURRENT, LayerKind

LAYER_KINDS = tuple(LayerKind)
ACTIVATIONS = ("silu", "gelu_tanh", "relu2")  # relu2: relu(x) ** 2 (Nemotron-H)


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    num_heads: int
    head_dim: int
    state_size: int  # N
    num_groups: int  # G: B and C are shared by num_heads // num_groups heads
    conv_kernel: int  # K
    chunk_size: int  # the checkpoint's SSD chunk size (the scan result does not depend on it)
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = math.inf

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MambaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"MambaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_groups ({self.num_groups})"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels that go through the causal conv: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size


@dataclasses.dataclass(frozen=True)
class GdnConfig:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5 linear-attention layers): ``num_k_heads`` query
    and key heads of ``head_k_dim``, ``num_v_heads`` value heads of ``head_v_dim`` (a
    multiple: q and k are shared by ``num_v_heads // num_k_heads`` value heads), a causal
    conv of ``conv_kernel`` taps over q, k and v."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GdnConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GdnConfig.num_v_heads ({self.num_v_heads}) must be a multiple of "
                f"num_k_heads ({self.num_k_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels that go through the causal conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (``layers/mla.py``). Per head a query of
    ``qk_nope_head_dim + qk_rope_head_dim`` (through a ``q_lora_rank`` bottleneck, or
    directly when it is 0); per token one latent of ``kv_lora_rank`` (normed) and one rope
    key of ``qk_rope_head_dim`` shared by every head, which is what the cache keeps; keys
    and values of ``qk_nope_head_dim`` / ``v_head_dim`` per head are the latent times
    ``kv_b_proj``. ``rope_interleave``: rope rotates channel pairs (0, 1), (2, 3) ...
    (DeepSeek's weights) instead of halves. ``softmax_scale``: ``(qk head dim) ** -0.5``,
    times YaRN's ``mscale(mscale_all_dim) ** 2`` when the checkpoint sets it.

    The sparse-attention indexer (``dsa`` layers): ``index_n_heads`` heads of
    ``index_head_dim`` score every cached position (the first ``qk_rope_head_dim`` channels
    rotated, interleaved when ``index_rope_interleave``); each query attends to its top
    ``index_topk`` positions among those it can see."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    q_lora_rank: int = 0
    rope_interleave: bool = True
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleave: bool = False

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MlaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"MlaConfig.q_lora_rank must be >= 0, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MlaConfig.qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.index_n_heads and (self.index_head_dim < self.qk_rope_head_dim or self.index_topk <= 0):
            raise ValueError(
                f"MlaConfig: an indexer needs index_head_dim >= qk_rope_head_dim "
                f"({self.index_head_dim} < {self.qk_rope_head_dim}?) and index_topk > 0 ({self.index_topk})"
            )

    @property
    def latent_dim(self) -> int:
        """Values one token's cache row holds: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class Dsv4Config:
    """DeepSeek V4's attention (``layers/dsv4.py``) and residual streams. Every layer attends
    with ``ModelConfig.num_heads`` query heads over one K=V head of ``head_dim`` (its last
    ``qk_rope_head_dim`` channels rotated, pairs interleaved) in a ``sliding_window``, plus
    in ``csa`` / ``hca`` layers compressed entries: one per ``csa_rate`` tokens (windows
    overlapping by one, a lightning indexer of ``index_n_heads`` x ``index_head_dim``
    picking ``index_topk`` per query) or per ``hca_rate`` tokens (every one attended).
    Queries go through a ``q_lora_rank`` bottleneck; the output through ``o_groups`` groups
    of ``o_lora_rank``. Compressed layers rotate with ``compress_rope_theta`` (and
    ``compress_yarn``), sliding ones with ``ModelConfig.rope_theta``. ``hc_mult`` residual
    streams are mixed around each block by Sinkhorn-normalised matrices (``layers/hyper.py``).
    The MoE layers in ``hash_layers`` choose experts by token id (``tid2eid``).
    ``num_nextn_predict_layers`` multi-token-prediction blocks (``layers/mtp.py``, for
    speculative decoding) each hold one more layer, of ``mtp_kind``."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    qk_rope_head_dim: int
    csa_rate: int = 4
    hca_rate: int = 128
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnConfig | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    mtp_kind: str = LayerKind.SWA_MQA

    def __post_init__(self):
        for name in ("q_lora_rank", "o_groups", "o_lora_rank", "qk_rope_head_dim", "csa_rate", "hca_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Dsv4Config.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"Dsv4Config.qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ValueError(f"Dsv4Config: hc_mult {self.hc_mult} and hc_sinkhorn_iters must be >= 1")
        object.__setattr__(self, "hash_layers", tuple(self.hash_layers))
        if self.num_nextn_predict_layers < 0:
            raise ValueError(
                f"Dsv4Config.num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}"
            )
        kinds = (LayerKind.SWA_MQA, LayerKind.CSA, LayerKind.HCA)
        if self.mtp_kind not in kinds:
            raise ValueError(f"Dsv4Config.mtp_kind {self.mtp_kind!r}: want one of {[str(k) for k in kinds]}")
        object.__setattr__(self, "mtp_kind", LayerKind(self.mtp_kind))

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a ``csa`` or ``hca`` layer."""
        return self.csa_rate if kind == LayerKind.CSA else self.hca_rate


@dataclasses.dataclass(frozen=True)
class NextNConfig:
    """The multi-token-prediction blocks of DeepSeek V3 / V3.2 and GLM-5 (``style``
    "deepseek") and of Qwen3-Next / Qwen3.5 ("qwen"), for drafting (``layers/mtp_nextn.py``):
    ``num_layers`` blocks, each one decoder layer of ``kind`` with an MoE MLP if ``sparse``.
    DeepSeek V4's blocks are ``Dsv4Config``'s."""

    num_layers: int
    kind: str
    sparse: bool
    style: str

    def __post_init__(self):
        if self.num_layers <= 0:
            raise ValueError(f"NextNConfig.num_layers must be positive, got {self.num_layers}")
        if self.style not in NEXTN_STYLES:
            raise ValueError(f"NextNConfig.style {self.style!r}: want one of {NEXTN_STYLES}")
        if self.kind not in LAYER_KINDS or self.kind in RECURRENT:
            raise ValueError(f"NextNConfig.kind {self.kind!r}: want an attention kind")
        object.__setattr__(self, "kind", LayerKind(self.kind))


NEXTN_STYLES = ("deepseek", "qwen")


ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "sqrtsoftplus_topk")
# relu2: not gated; silu_clamped: silu(min(gate, limit)) * clip(up, -limit, limit) (DeepSeek V4)
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped", "relu2", "silu_clamped")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate: int  # per expert
    router: str = "softmax_topk"  # ROUTERS (``layers/moe.py`` describes each)
    norm_topk_prob: bool = False  # softmax_topk, sigmoid_topk: the chosen weights sum to 1
    router_bias: bool = False
    expert_bias: bool = False  # gate_up and down biases per expert (gpt-oss)
    activation: str = "silu"  # EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # sigmoid_topk (DeepSeek-V3, Nemotron-H) and sqrtsoftplus_topk (DeepSeek V4):
    # experts chosen within the best ``topk_groups``
    # of ``num_groups`` equal groups; the chosen weights multiplied by ``routed_scaling``.
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # A shared expert: a dense MLP of this width (0: none), with the experts' activation,
    # run on every token and added to the routed experts' output (Granite's shared_mlp,
    # Nemotron-H's shared_experts); with ``shared_gate`` its output is first multiplied by
    # sigmoid(Linear(hidden -> 1)(x)) (Qwen3-Next's shared_expert_gate).
    shared_intermediate: int = 0
    shared_gate: bool = False

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}: must be one of {ROUTERS}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: must be one of {EXPERT_ACTIVATIONS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, num_experts={self.num_experts}]")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_groups={self.num_groups}: must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups}: must be in [1, num_groups={self.num_groups}]")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("num_groups: a group ranks by its top two experts, so needs at least two")
        if self.num_groups > 1 and self.router not in ("sigmoid_topk", "sqrtsoftplus_topk"):
            raise ValueError(f"num_groups={self.num_groups}: only the sigmoid_topk router groups experts")
        if self.top_k > self.topk_groups * self.num_experts // self.num_groups:
            raise ValueError(f"top_k={self.top_k}: more than the experts of topk_groups={self.topk_groups}")
        if self.shared_intermediate < 0:
            raise ValueError(f"shared_intermediate={self.shared_intermediate}: must be >= 0")
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("shared_gate without a shared expert (shared_intermediate=0)")
        if self.shared_intermediate and self.activation == "swiglu_clamped":
            raise ValueError("a shared expert with swiglu_clamped experts is not supported")

    @property
    def gated(self) -> bool:
        """Experts (and the shared expert) compute ``act(gate) * up``; ``relu2`` ones ``act(up)``."""
        return self.activation != "relu2"


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling (``layers/rope.py``), as checkpoints' ``rope_parameters`` give it."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1
    truncate: bool = True  # round the blend's channel range outwards


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_kinds: tuple[LayerKind, ...]  # plain strings are accepted and converted
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    activation: str = "silu"
    mlp_gated: bool = True  # the dense MLP: down(act(gate(x)) * up(x)), or down(act(up(x)))
    # Layers without an MLP: ``x += mixer(norm(x))`` only (Nemotron-H's lone mixer blocks).
    mlp_free_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    # Attention.
    rope: bool = True  # False: no position encoding in attention (NoPE; Nemotron-H, Granite 4.0-H)
    rope_theta: float = 10000.0
    rope_theta_sliding: float | None = None  # Gemma3 local layers use their own base
    rope_linear_factor: float = 1.0  # "linear" rope scaling (positions / factor)
    rope_yarn: YarnConfig | None = None  # YaRN scaling, for every layer or (below) full ones only
    rope_yarn_sliding: bool = True
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None  # scale = this ** -0.5; default head_dim
    attention_multiplier: float | None = None  # the softmax scale itself, when set (Granite)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    qk_norm: bool = False
    attention_bias: bool = False  # q, k, v and o projections with biases
    attention_sinks: bool = False  # a learned logit per query head joins the softmax (gpt-oss)
    # q_proj gives each head its query and, beside it, a gate: the attention output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3-Next, Qwen3.5).
    attention_output_gate: bool = False
    qk_norm_over: str = "head"  # RMSNorm q and k per head ("head") or over the whole projection ("all")
    # Gemma conventions: RMSNorm multiplies by (1 + w); embeddings scaled by sqrt(hidden);
    # a norm after attention and after the MLP as well as before.
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    # Granite: each sub-layer's output times this before the residual add; logits divided
    # by ``logits_scaling``.
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # False: no norm before attention and the MLP, only after each (Olmo 2 and 3).
    pre_norms: bool = True
    mamba: MambaConfig | None = None
    gdn: GdnConfig | None = None
    mla: MlaConfig | None = None
    dsv4: Dsv4Config | None = None
    # Mixture-of-experts MLPs (``layers/moe.py``) in the layers ``sparse_layers`` lists; the
    # others keep the dense MLP of ``intermediate_size``.
    moe: MoEConfig | None = None
    sparse_layers: tuple[int, ...] = ()
    nextn: NextNConfig | None = None
    # Cache entries past the main layers' for the drafting block's layer (0 or 1; 1 needs
    # ``nextn``): the speculative engine sets it, so that block's KV is paged with the main
    # layers' (same pages, L2 rows and L3 pages; ``cache_layer_kinds``).
    mtp_cache_layers: int = 0
    # An EAGLE-3 draft in place of ``nextn``'s blocks (``layers/eagle3.py``): the residual-
    # stream boundaries it reads (``Eagle3Config.aux_boundaries``; boundary ``b`` is layer
    # ``b``'s input). Set with ``mtp_cache_layers=1``: the draft's KV is one more full-
    # attention layer, and ``CausalLM(hidden=True)`` returns those three states.
    eagle3_aux: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    max_position_embeddings: int = 131072

    def __post_init__(self):
        if not self.layer_kinds:
            raise ValueError("ModelConfig.layer_kinds is empty")
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"ModelConfig.layer_kinds has unknown kinds {bad}; known: {LAYER_KINDS}")
        object.__setattr__(self, "layer_kinds", tuple(LayerKind(k) for k in self.layer_kinds))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation {self.activation!r} not in {ACTIVATIONS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError("ModelConfig has sliding layers but no sliding_window")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be positive, got {self.sliding_window}")
        if LayerKind.MAMBA in self.layer_kinds and self.mamba is None:
            raise ValueError("ModelConfig has mamba layers but no MambaConfig")
        if LayerKind.GDN in self.layer_kinds and self.gdn is None:
            raise ValueError("ModelConfig has gdn layers but no GdnConfig")
        latent = {LayerKind.MLA, LayerKind.DSA, LayerKind.DSA_SHARED} & set(self.layer_kinds)
        if latent and self.mla is None:
            raise ValueError(f"ModelConfig has {sorted(latent)} layers but no MlaConfig")
        if LayerKind.DSA in self.layer_kinds and not self.mla.index_n_heads:
            raise ValueError("ModelConfig has dsa layers but MlaConfig.index_n_heads is 0 (no indexer)")
        first = next((k for k in self.layer_kinds if k in (LayerKind.DSA, LayerKind.DSA_SHARED)), None)
        if first == LayerKind.DSA_SHARED:
            raise ValueError(
                "ModelConfig: a dsa_shared layer reuses the previous dsa layer's picks; none comes first"
            )
        v4 = {LayerKind.SWA_MQA, LayerKind.CSA, LayerKind.HCA} & set(self.layer_kinds)
        if v4 and (self.dsv4 is None or not self.sliding_window):
            raise ValueError(f"ModelConfig has {sorted(v4)} layers but no Dsv4Config or sliding_window")
        if v4 and self.sliding_window < 2:  # the window rule keeps the state page before a prefix's end
            raise ValueError(
                f"ModelConfig: DeepSeek V4 layers need sliding_window >= 2, got {self.sliding_window}"
            )
        if LayerKind.CSA in self.layer_kinds and not (self.dsv4.index_n_heads and self.dsv4.index_topk):
            raise ValueError(
                "ModelConfig has csa layers but Dsv4Config has no indexer (index_n_heads, index_topk)"
            )
        if self.qk_norm_over not in ("head", "all"):
            raise ValueError(f"ModelConfig.qk_norm_over {self.qk_norm_over!r} not in ('head', 'all')")
        if self.sparse_layers and self.moe is None:
            raise ValueError("ModelConfig has sparse_layers but no MoEConfig")
        if self.nextn is not None and self.nextn.sparse and self.moe is None:
            raise ValueError("ModelConfig.nextn has an MoE layer but the model no MoEConfig")
        if any(not 0 <= i < len(self.layer_kinds) for i in self.sparse_layers):
            raise ValueError(
                f"ModelConfig.sparse_layers {self.sparse_layers}: not all in [0, {len(self.layer_kinds)})"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even")
        if any(not 0 <= i < len(self.layer_kinds) for i in self.mlp_free_layers):
            raise ValueError(
                f"ModelConfig.mlp_free_layers {self.mlp_free_layers}: not all in [0, {len(self.layer_kinds)})"
            )
        if set(self.mlp_free_layers) & set(self.sparse_layers):
            raise ValueError(
                f"ModelConfig: layers {sorted(set(self.mlp_free_layers) & set(self.sparse_layers))} "
                "are both MLP-free and sparse"
            )
        if self.logits_scaling == 0:
            raise ValueError("ModelConfig.logits_scaling must not be 0 (logits are divided by it)")
        if self.mtp_cache_layers not in (0, 1):
            raise ValueError(f"ModelConfig.mtp_cache_layers must be 0 or 1, got {self.mtp_cache_layers!r}")
        if self.eagle3_aux is not None:
            object.__setattr__(self, "eagle3_aux", tuple(self.eagle3_aux))
            if len(self.eagle3_aux) != 3 or not all(1 <= b <= self.num_layers for b in self.eagle3_aux):
                raise ValueError(
                    f"ModelConfig.eagle3_aux {self.eagle3_aux}: want three layer boundaries in "
                    f"1..{self.num_layers}"
                )
        if self.mtp_cache_layers and self.nextn is None and self.eagle3_aux is None and not self.v4_blocks:
            raise ValueError(
                "ModelConfig.mtp_cache_layers=1 needs nextn, DeepSeek V4's blocks or eagle3_aux "
                "(a model without a drafter)"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def cache_layer_kinds(self) -> tuple[LayerKind, ...]:
        """The kind of each cache entry: the main layers', then ``mtp_cache_layers`` of the
        drafting block's layer. What allocates, shards, moves, stores or counts the cache
        iterates these; what runs the main layers, ``layer_kinds``."""
        if not self.mtp_cache_layers:
            return self.layer_kinds
        if self.eagle3_aux is not None:
            kind = LayerKind.ATTENTION
        else:
            kind = self.nextn.kind if self.nextn is not None else self.dsv4.mtp_kind
        return self.layer_kinds + (kind,) * self.mtp_cache_layers

    @property
    def v4_blocks(self) -> int:
        """DeepSeek V4's multi-token-prediction blocks (``layers/mtp.py``), 0 elsewhere."""
        return self.dsv4.num_nextn_predict_layers if self.dsv4 is not None else 0

    @property
    def page_multiple(self) -> int:
        """What ``page_size`` must be a multiple of: pages hold whole compressed entries."""
        if self.dsv4 is None:
            return 1
        rates = [self.dsv4.rate(k) for k in self.layer_kinds if k in (LayerKind.CSA, LayerKind.HCA)]
        return math.lcm(*rates) if rates else 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.rope else 0

    @property
    def attn_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_base(self, kind: str) -> float:
        if kind == "sliding" and self.rope_theta_sliding is not None:
            return self.rope_theta_sliding
        return self.rope_theta

    def rope_factor(self, kind: str) -> float:
        if kind == "sliding" and self.rope_theta_sliding is not None:
            return 1.0  # Gemma3 scales only its global layers
        return self.rope_linear_factor

    def yarn(self, kind: str) -> YarnConfig | None:
        return None if kind == "sliding" and not self.rope_yarn_sliding else self.rope_yarn

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding" else None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k not in RECURRENT)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in RECURRENT)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LayerKind.MAMBA)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LayerKind.GDN)

    def state_shapes(self, kind: str) -> tuple[tuple[tuple[int, ...], str | None], ...]:
        """The declaration of one state slot of a recurrent layer kind: ``(shape, dtype)`` of
        each ``RecurrentState`` field (conv inputs, then the recurrence's state), the slot
        axis left out; dtype None is the cache's dtype. Everything that allocates, copies,
        stores or counts recurrent state reads it from here (``models/cache.py``); a new
        recurrent kind adds its entry."""
        if kind == LayerKind.MAMBA:
            m = self.mamba
            ssm = (m.num_heads, m.head_dim, m.state_size)
            return ((m.conv_kernel - 1, m.conv_dim), None), (ssm, "float32")
        if kind == LayerKind.GDN:
            g = self.gdn
            ssm = (g.num_v_heads, g.head_k_dim, g.head_v_dim)
            return ((g.conv_kernel - 1, g.conv_dim), None), (ssm, "float32")
        raise ValueError(f"layer kind {kind!r} has no recurrent state")

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one snapshot: every recurrent layer's state, conv inputs at
        ``dtype_bytes`` per value."""
        n = 0
        for kind in self.layer_kinds:
            if kind in RECURRENT:
                for shape, dtype in self.state_shapes(kind):
                    n += math.prod(shape) * (4 if dtype == "float32" else dtype_bytes)
        return n

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        if d.get("mamba") is not None:
            d["mamba"] = MambaConfig(**d["mamba"])
        if d.get("gdn") is not None:
            d["gdn"] = GdnConfig(**d["gdn"])
        if d.get("mla") is not None:
            d["mla"] = MlaConfig(**d["mla"])
        if d.get("dsv4") is not None:
            v4 = dict(d["dsv4"])
            if v4.get("compress_yarn") is not None:
                v4["compress_yarn"] = YarnConfig(**v4["compress_yarn"])
            d["dsv4"] = Dsv4Config(**v4)
        if d.get("rope_yarn") is not None:
            d["rope_yarn"] = YarnConfig(**d["rope_yarn"])
        if d.get("moe") is not None:
            d["moe"] = MoEConfig(**d["moe"])
        if d.get("nextn") is not None:
            d["nextn"] = NextNConfig(**d["nextn"])
        d["sparse_layers"] = tuple(d.get("sparse_layers", ()))
        d["mlp_free_layers"] = tuple(d.get("mlp_free_layers", ()))
        d["layer_kinds"] = tuple(LayerKind(k) for k in d["layer_kinds"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def num_params(self) -> int:
        """Parameter count (for presets and benchmarks), as transformers and DeepSeek's model
        cards count it: without DeepSeek V4's multi-token-prediction blocks (``mtp_params``;
        transformers' model has none, and V4 Flash's published 284B is 284.3B here, its one
        block another 6.6B that the checkpoint holds and the model keeps)."""
        return self._outer_params() + self._layer_params(active=False)

    def active_params(self) -> int:
        """Parameters one token's forward reads (its ``top_k`` experts of each MoE layer;
        not the multi-token-prediction blocks, which only drafting runs)."""
        return self._outer_params() + self._layer_params(active=True)

    def mtp_params(self) -> int:
        """The multi-token-prediction blocks. DeepSeek V4's: each three norms, ``e_proj`` and
        ``h_proj``, its layer (a score-routed MoE) and its own stream-collapsing head; the
        embedding and LM head are the model's. A ``NextNConfig``'s: each three norms, the
        ``[2h, h]`` input projection, its layer and (DeepSeek-style) its own LM head."""
        if self.nextn is not None:
            x, h = self.nextn, self.hidden_size
            one = self.nextn_block_config()
            head = self.vocab_size * h if x.style == "deepseek" else 0
            return x.num_layers * (3 * h + 2 * h * h + one._layer_params(active=False) + head)
        v = self.dsv4
        if v is None or not v.num_nextn_predict_layers:
            return 0
        h, hc = self.hidden_size, v.hc_mult
        layer = 2 * h + self.mlp_params(self.num_layers) + self._dsv4_params(v.mtp_kind)
        block = 3 * h + 2 * h * h + layer + hc * (hc * h + 1) + 1
        return v.num_nextn_predict_layers * block

    def nextn_block_config(self) -> ModelConfig:
        """The one-layer config of a ``NextNConfig`` block's layer alone (its own cache is
        allocated from it: ``layers/mtp_nextn.py``, ``block_config``)."""
        x = self.nextn
        return dataclasses.replace(
            self,
            layer_kinds=(x.kind,),
            sparse_layers=(0,) if x.sparse else (),
            mlp_free_layers=(),
            nextn=None,
            mtp_cache_layers=0,
        )

    def _outer_params(self) -> int:
        """Embeddings, LM head, final norm (and DeepSeek V4's stream-collapsing head)."""
        h, v = self.hidden_size, self.vocab_size
        n = v * h * (1 if self.tie_word_embeddings else 2) + h
        if self.dsv4 is not None:
            hc = self.dsv4.hc_mult
            n += hc * (hc * h + 1) + 1  # hc_head: fn, base, scale
        return n

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """The MLP's parameters in layer ``layer`` (with ``active``, those one token uses;
        DeepSeek V4's layers past ``num_layers`` are its MTP blocks')."""
        h = self.hidden_size
        if layer in self.mlp_free_layers:
            return 0
        mtp = self.dsv4 is not None and layer >= self.num_layers  # an MTP block's layer: MoE
        if layer not in self.sparse_layers and not mtp:
            return (3 if self.mlp_gated else 2) * h * self.intermediate_size
        m = self.moe
        experts = m.top_k if active else m.num_experts
        matrices = 3 if m.gated else 2
        up = (2 if m.gated else 1) * m.intermediate
        per_expert = matrices * h * m.intermediate + ((up + h) if m.expert_bias else 0)
        router = h * m.num_experts + (m.num_experts if m.router_bias else 0)
        hashed = self.dsv4 is not None and layer in self.dsv4.hash_layers
        if hashed:  # experts chosen by token id: the tid2eid table, no correction bias
            router += self.vocab_size * m.top_k
        elif m.router in ("sigmoid_topk", "sqrtsoftplus_topk"):  # the choice's correction bias
            router += m.num_experts
        shared = matrices * h * m.shared_intermediate + (h if m.shared_gate else 0)
        return router + experts * per_expert + shared

    def _layer_params(self, active: bool) -> int:
        h, n = self.hidden_size, 0
        for i, kind in enumerate(self.layer_kinds):
            norms = (1 if self.pre_norms else 0) + (1 if self.sandwich_norms or not self.pre_norms else 0)
            n += norms * h * (1 if i in self.mlp_free_layers else 2) + self.mlp_params(i, active)
            if kind == "mamba":
                m = self.mamba
                proj = m.intermediate_size + m.conv_dim + m.num_heads
                n += h * proj + m.conv_dim * m.conv_kernel + m.intermediate_size * (h + 1)
                n += 3 * m.num_heads + (m.conv_dim if m.conv_bias else 0)
            elif kind in ("mla", "dsa", "dsa_shared"):
                n += self._mla_params(kind)
            elif kind in ("swa_mqa", "csa", "hca"):
                n += self._dsv4_params(kind)
            elif kind == "gdn":
                g = self.gdn
                # in_proj (q, k, v, z, then b, a), conv (no bias), dt_bias, A_log, norm, out_proj
                n += h * (g.conv_dim + g.value_dim + 2 * g.num_v_heads) + g.conv_dim * g.conv_kernel
                n += 2 * g.num_v_heads + g.head_v_dim + g.value_dim * h
            else:
                q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                qk = (2 * self.head_dim if self.qk_norm_over == "head" else q + kv) if self.qk_norm else 0
                q_out = 2 * q if self.attention_output_gate else q  # each head's query and gate
                bias = (q_out + 2 * kv + h) if self.attention_bias else 0
                sinks = self.num_heads if self.attention_sinks else 0
                n += h * (q_out + 2 * kv) + q * h + qk + bias + sinks
        return n

    def _dsv4_params(self, kind: str) -> int:
        """A DeepSeek V4 layer's attention and both hyper-connections (its norms are counted
        with every layer's)."""
        v, h, H, D = self.dsv4, self.hidden_size, self.num_heads, self.head_dim
        n = (h + 1) * v.q_lora_rank + v.q_lora_rank * H * D + h * D + D  # q_a, q_a_norm, q_b, kv, kv_norm
        n += H * D * v.o_lora_rank + v.o_groups * v.o_lora_rank * h + H  # o_a (grouped), o_b, sinks
        hc = v.hc_mult
        n += 2 * ((2 + hc) * hc * (hc * h + 1) + 3)  # attn_hc and ffn_hc: fn, base, scale
        if kind == "swa_mqa":
            return n
        overlap = 2 if kind == "csa" else 1  # CSA's windows overlap: two series
        rate = v.rate(kind)
        n += 2 * h * overlap * D + rate * overlap * D + D  # kv, gate, position_bias, kv_norm
        if kind == "csa":
            d, nh = v.index_head_dim, v.index_n_heads
            n += 2 * h * 2 * d + rate * 2 * d + d + v.q_lora_rank * nh * d + h * nh
        return n

    def _mla_params(self, kind: str) -> int:
        m, h, H = self.mla, self.hidden_size, self.num_heads
        q = h * H * m.qk_head_dim if not m.q_lora_rank else (h + H * m.qk_head_dim + 1) * m.q_lora_rank
        kv = h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        n = q + kv + H * m.v_head_dim * h
        if kind == "dsa":  # wq_b, wk, k_norm (weight and bias), weights_proj
            d, nh = m.index_head_dim, m.index_n_heads
            n += m.q_lora_rank * nh * d + h * d + 2 * d + h * nh
        return n

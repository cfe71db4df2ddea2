"""The EAGLE-3 drafter (``models/layers/eagle3.py``, loaded by ``models/hf/eagle3.py``): a tiny
random draft checkpoint written under the published names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``) loads, and its logits over two ragged sequences in a paged
cache (pages of 4 tokens, scattered, unused ones NaN), then two chained steps each feeding
the draft's own output, equal a float64 numpy recompute of the published math from the
file's tensors: whole-sequence causal attention with RoPE, no cache. Bad checkpoints are
refused with the field or tensor named."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hicache_jax.models.batch import page_groups
from hicache_jax.models.cache import allocate_cache
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.hf.eagle3 import load_eagle3
from hicache_jax.models.hf.safetensors_io import CheckpointError
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.layers.eagle3 import Eagle3Config, cache_mismatch
from hicache_jax.models.layers.linear import Embed
from tests.models.steps import build_step, sequence
from tests.models.test_mtp_families import write  # safetensors and config.json in a folder


class Widths(NamedTuple):
    h: int
    heads: int
    kv_heads: int
    d: int
    inter: int
    vocab: int
    draft_vocab: int


WIDTHS = Widths(32, 4, 2, 8, 48, 96, 40)
H, HEADS, KV_HEADS, D, INTER, VOCAB, DRAFT_VOCAB = WIDTHS
EPS, THETA, PAGE = 1e-5, 10000.0, 4
TARGET = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=H,
    intermediate_size=64,
    layer_kinds=("attention",) * 8,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=D,
)
# Two sequences: their prompts (aux hidden states given) and two chained drafts each.
PROMPTS, CHAINED = (7, 10), 2


def draft_config(
    shared_head: bool = False, norm_before_residual: bool = False, *, w: Widths | None = None
) -> dict:
    w = w or WIDTHS
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": w.h,
        "intermediate_size": w.inter,
        "num_attention_heads": w.heads,
        "num_key_value_heads": w.kv_heads,
        "head_dim": w.d,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 2048,
        "vocab_size": w.vocab,
        "draft_vocab_size": w.draft_vocab,
        "tie_word_embeddings": False,
    }
    if shared_head:  # SGLang: no draft_vocab_size -> the target's LM head, full vocabulary
        del cfg["draft_vocab_size"]
    if norm_before_residual:  # vLLM's option: the residual is the normed hidden state
        cfg["norm_before_residual"] = True
    return cfg


def draft_tensors(seed: int = 0, shared_head: bool = False, *, w: Widths | None = None) -> dict:
    H, HEADS, KV_HEADS, D, INTER, VOCAB, DRAFT_VOCAB = w or WIDTHS
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def w(out, inp):
        return (rng.standard_normal((out, inp)) * inp**-0.5).astype(f32)

    def norm():  # away from 1, so a norm read into the wrong place shows
        return (1.0 + 0.3 * rng.standard_normal(H)).astype(f32)

    t = {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * D),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": norm(),
    }
    if not shared_head:
        targets = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
        t["lm_head.weight"] = w(DRAFT_VOCAB, H) * 4
        t["d2t"] = (targets - np.arange(DRAFT_VOCAB)).astype(np.int64)
        t2d = np.zeros(VOCAB, bool)
        t2d[targets] = True
        t["t2d"] = t2d
    return t


# -- the recompute -------------------------------------------------------------------------


def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope(x, positions):  # [T, heads, D], rotate-half
    half = D // 2
    inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_step(t: dict, embed: np.ndarray, head: np.ndarray, ids, x: np.ndarray, normed_residual: bool):
    """The draft over one whole sequence: ``x [T, h]`` each token's hidden input (after
    fc), ``ids`` its tokens. Returns (out [T, h], logits [T, vocab]) in float64."""
    g = {k: v.astype(np.float64) for k, v in t.items() if k not in ("d2t", "t2d")}
    T = len(ids)
    e = rms(embed[ids], g["midlayer.input_layernorm.weight"])
    hn = rms(x, g["midlayer.hidden_norm.weight"])
    cat = np.concatenate([e, hn], axis=-1)  # embedding first
    pos = np.arange(T, dtype=np.float64)
    q = rope((cat @ g["midlayer.self_attn.q_proj.weight"].T).reshape(T, HEADS, D), pos)
    k = rope((cat @ g["midlayer.self_attn.k_proj.weight"].T).reshape(T, KV_HEADS, D), pos)
    v = (cat @ g["midlayer.self_attn.v_proj.weight"].T).reshape(T, KV_HEADS, D)
    k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.einsum("hqk,khd->qhd", p, v).reshape(T, HEADS * D) @ g["midlayer.self_attn.o_proj.weight"].T
    r = (hn if normed_residual else x) + a
    m = rms(r, g["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ g["midlayer.mlp.gate_proj.weight"].T, m @ g["midlayer.mlp.up_proj.weight"].T
    out = r + (gate / (1 + np.exp(-gate)) * up) @ g["midlayer.mlp.down_proj.weight"].T
    drafted = rms(out, g["norm.weight"]) @ head.T
    if "d2t" not in t:
        return out, drafted
    logits = np.full((T, VOCAB), -np.inf)
    logits[:, np.arange(DRAFT_VOCAB) + t["d2t"]] = drafted
    return out, logits


def reference(t: dict, embed, head, ids, aux, normed_residual: bool = False) -> list[np.ndarray]:
    """Per step, the logits of the rows it drafts: the prompt's rows (hidden = fc(aux)), then
    each chained token (hidden = the previous position's output), recomputed from scratch."""
    x = aux.astype(np.float64) @ t["fc.weight"].astype(np.float64).T
    out, logits = reference_step(t, embed, head, ids[: len(x)], x, normed_residual)
    steps = [logits]
    for _ in range(CHAINED):
        x = np.concatenate([x, out[-1:]])
        out, logits = reference_step(t, embed, head, ids[: len(x)], x, normed_residual)
        steps.append(logits[-1:])
    return steps


# -- the module in paged steps -------------------------------------------------------------


def run_draft(draft, embed: Embed, unembed, ids_per_seq, aux_per_seq) -> list[list[np.ndarray]]:
    """The prompts in one ragged step, then ``CHAINED`` one-token steps each fed the previous
    step's output at the sequence's last row, jitted with the weights an argument as the
    runner does. Per step, per sequence, its logits rows."""
    graphdef, params = nnx.split(draft)
    step = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a, embed, unembed))
    layer = draft.cfg.layer_config
    (entry,) = allocate_cache(layer, num_pages=10, page_size=PAGE, fill=np.nan)  # unused pages NaN
    pages = ([7, 2, 5], [1, 8, 4, 9])  # scattered; pages 0, 3, 6 and (past seq 1's end) 9 unwritten
    seqs = [sequence(ids, pages=p) for ids, p in zip(ids_per_seq, pages)]
    spans, hidden_rows, got = [(0, n) for n in PROMPTS], list(aux_per_seq), []
    for _ in range(1 + CHAINED):
        work = [(s, a, b) for s, (a, b) in zip(seqs, spans)]
        batch, rows = build_step(
            work, groups=page_groups(layer.layer_kinds), page_size=PAGE, max_pages=4, all_logits=True
        )
        hidden = np.zeros((batch.input_ids.shape[0], hidden_rows[0].shape[-1]), np.float32)
        for r, x in zip(rows, hidden_rows):
            hidden[r] = x
        entry, out, logits = step(params, entry, jnp.asarray(hidden), batch)
        out, logits = np.asarray(out), np.asarray(logits)
        got.append([logits[r] for r in rows])
        hidden_rows = [out[r][-1:] for r in rows]
        spans = [(b, b + 1) for _, b in spans]
    return got


@pytest.fixture(scope="module", params=["own_head", "shared_head", "norm_before_residual"])
def checkpoint(request, tmp_path_factory):
    """(path, tensors, config): ``own_head`` has a 40-id draft vocabulary mapped by d2t;
    ``shared_head`` no lm_head, d2t or draft_vocab_size (the target's head, as SGLang loads);
    ``norm_before_residual`` is ``own_head`` with vLLM's option set."""
    shared = request.param == "shared_head"
    config = draft_config(shared, norm_before_residual=request.param == "norm_before_residual")
    tensors = draft_tensors(shared_head=shared)
    return write(tmp_path_factory.mktemp(request.param), tensors, config), tensors, config


@pytest.fixture(scope="module")
def target():
    """The target's embedding (an ``Embed``) and LM head ``[vocab, h]``."""
    rng = np.random.default_rng(7)
    embed = Embed(VOCAB, H, dtype=jnp.float32, rngs=nnx.Rngs(0))
    embed.embedding[...] = jnp.asarray(rng.standard_normal((VOCAB, H)), jnp.float32)
    return embed, (rng.standard_normal((VOCAB, H)) * H**-0.5 * 4).astype(np.float32)


def inputs(seed: int = 3):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, VOCAB, n + CHAINED) for n in PROMPTS]
    aux = [(rng.standard_normal((n, 3 * H)) * 2).astype(np.float32) for n in PROMPTS]
    return ids, aux


def compare(got, want, label: str) -> None:
    for step, (g_step, w_step) in enumerate(zip(got, want)):
        for s, (g, w) in enumerate(zip(g_step, w_step)):
            assert not np.isnan(g).any(), f"{label}: step {step} seq {s}: NaN leaked from unused pages"
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"{label}: step {step} seq {s}")


def expected(checkpoint, target, ids, aux) -> list[list[np.ndarray]]:
    """The recompute's logits, per step, per sequence (``run_draft``'s layout)."""
    _, tensors, config = checkpoint
    embed, target_head = target
    head = (tensors["lm_head.weight"] if "lm_head.weight" in tensors else target_head).astype(np.float64)
    table = np.asarray(embed.embedding[...], np.float64)
    normed = config.get("norm_before_residual", False)
    per_seq = [reference(tensors, table, head, i, a, normed) for i, a in zip(ids, aux)]
    return [list(step) for step in zip(*per_seq)]


def unembed_of(target):
    return lambda rows: rows @ jnp.asarray(target[1]).T


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_draft_logits_equal_the_recompute(checkpoint, target, backend):
    """Prompt step (fc over the three hidden states) and two chained steps, against the
    recompute: finite exactly at the draft vocabulary's target ids (``-inf`` elsewhere)."""
    path, tensors, _ = checkpoint
    kernels = KernelConfig(attention=backend, interpret=backend == "pallas")
    draft = load_eagle3(path, TARGET, dtype=jnp.float32, kernels=kernels)
    ids, aux = inputs()
    got = run_draft(draft, target[0], unembed_of(target), ids, aux)
    compare(got, expected(checkpoint, target, ids, aux), backend)
    mapped = "d2t" in tensors
    assert (np.isfinite(got[0][0]).sum(-1) == (DRAFT_VOCAB if mapped else VOCAB)).all()
    if mapped:  # the argmax is a target id the draft covers
        assert set(np.argmax(got[0][1], -1)) <= set(np.flatnonzero(tensors["t2d"]))


def test_mutations_are_caught(checkpoint, target):
    """The test can fail: the embedding and hidden halves of q, k, v swapped (the concat
    order reversed), or draft ids placed without d2t (at their own index), miss the recompute."""
    path, tensors, _ = checkpoint
    draft = load_eagle3(path, TARGET, dtype=jnp.float32)
    ids, aux = inputs()
    want = expected(checkpoint, target, ids, aux)

    def misses() -> bool:
        got = run_draft(draft, target[0], unembed_of(target), ids, aux)
        return not all(
            np.allclose(g, w, rtol=1e-4, atol=1e-4) for gs, ws in zip(got, want) for g, w in zip(gs, ws)
        )

    assert not misses()
    for proj in (draft.attn.q_proj, draft.attn.k_proj):
        kept = proj.kernel[...]
        proj.kernel[...] = jnp.concatenate([kept[H:], kept[:H]], axis=0)  # [2h, out]: hidden first
        try:
            assert misses()
        finally:
            proj.kernel[...] = kept
    if "d2t" in tensors:
        kept = draft.targets[...]
        draft.targets[...] = jnp.arange(DRAFT_VOCAB, dtype=jnp.int32)  # d2t ignored
        try:
            assert misses()
        finally:
            draft.targets[...] = kept


def test_aux_boundaries():
    """Which target hidden states fc reads: the default (2, L//2, L-3) layer inputs; layer ids
    starting at 1 read as layer outputs (SGLang), others as boundaries."""
    cfg = Eagle3Config.from_hf(draft_config())
    assert cfg.aux_boundaries(32) == (2, 16, 29)
    assert cfg.aux_boundaries(8) == (2, 4, 5)
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert Eagle3Config.from_hf(draft_config() | ids).aux_boundaries(32) == (2, 16, 29)
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}
    assert Eagle3Config.from_hf(draft_config() | ids).aux_boundaries(32) == (2, 16, 29)
    with pytest.raises(ValueError, match=r"boundaries \(2, 16, 29\).*within the target's 20 layers"):
        Eagle3Config.from_hf(draft_config() | ids).aux_boundaries(20)


def test_cache_mismatch_names_the_layouts():
    """The draft's KV fits the target's full-attention pages only with the same KV heads and
    head_dim, and only if the target has such pages."""
    cfg = Eagle3Config.from_hf(draft_config())
    assert cache_mismatch(cfg, TARGET) is None
    wider = dataclasses.replace(TARGET, num_kv_heads=4)
    assert cache_mismatch(cfg, wider) == (
        f"the draft's KV rows are [kv_heads, head_dim] = [2, {D}], the target's full pages [4, {D}]"
    )
    sliding = dataclasses.replace(TARGET, layer_kinds=("sliding",) * 8, sliding_window=16)
    assert "has no full attention pages" in cache_mismatch(cfg, sliding)


def _without(key):
    return lambda c: {k: v for k, v in c.items() if k != key}


BAD_CONFIGS = [
    (_without("hidden_size"), "missing field 'hidden_size'"),
    (_without("num_attention_heads"), "missing field 'num_attention_heads'"),
    (lambda c: c | {"num_attention_heads": "4"}, "num_attention_heads='4' must be a positive integer"),
    (lambda c: c | {"intermediate_size": 0}, "intermediate_size=0 must be a positive integer"),
    (lambda c: c | {"architectures": ["LlamaForCausalLM"]}, "architectures=.*an EAGLE-3 draft"),
    (lambda c: c | {"num_hidden_layers": 2}, "num_hidden_layers=2: only one-layer"),
    (lambda c: c | {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    (lambda c: c | {"draft_vocab_size": VOCAB + 1}, f"draft_vocab_size {VOCAB + 1} must be in"),
    (lambda c: c | {"num_key_value_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (lambda c: c | {"rope_scaling": {"rope_type": "llama3"}}, "rope_type 'llama3' is not supported"),
    (lambda c: c | {"target_hidden_size": 2 * H}, f"target_hidden_size={2 * H} differs from hidden_size={H}"),
    (lambda c: c | {"hidden_size": 48, "head_dim": D}, f"hidden_size is 48 but the target's .* is {H}"),
    (lambda c: c | {"vocab_size": 128}, f"vocab_size is 128 but the target's .* is {VOCAB}"),
    (
        lambda c: c | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 9]}},
        "boundaries .* within the target's 8 layers",
    ),
    (lambda c: c | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "three hidden states"),
]


@pytest.mark.parametrize("edit,message", BAD_CONFIGS, ids=[m[:30] for _, m in BAD_CONFIGS])
def test_bad_configs_are_refused(tmp_path, edit, message):
    path = write(tmp_path, draft_tensors(), edit(draft_config()))
    with pytest.raises(CheckpointError, match=message):
        load_eagle3(path, TARGET, dtype=jnp.float32)


def _d2t_out_of_range(t):
    t["d2t"] = t["d2t"].copy()
    t["d2t"][-1] += VOCAB
    return t


def _t2d_disagrees(t):
    t["t2d"] = t["t2d"].copy()
    first = int(np.flatnonzero(t["t2d"])[0])
    t["t2d"][first] = False
    return t


BAD_TENSORS = [
    (
        lambda t: t | {"midlayer.extra.weight": np.zeros(H, np.float32)},
        "no EAGLE-3 parameter reads: midlayer.extra",
    ),
    (_without("midlayer.hidden_norm.weight"), "tensor midlayer.hidden_norm.weight is missing"),
    (
        lambda t: t | {"fc.weight": t["fc.weight"][:, : 2 * H].copy()},
        rf"fc.weight has shape \({H}, {2 * H}\), expected \({H}, {3 * H}\)",
    ),
    (
        lambda t: (
            t | {"midlayer.self_attn.q_proj.weight": t["midlayer.self_attn.q_proj.weight"][:, :H].copy()}
        ),
        rf"q_proj.weight has shape \({HEADS * D}, {H}\), expected \({HEADS * D}, {2 * H}\)",
    ),
    (_without("d2t"), f"draft_vocab_size {DRAFT_VOCAB} < vocab_size {VOCAB} but the checkpoint holds no d2t"),
    (_d2t_out_of_range, "d2t maps draft id 39 to .* outside the target vocabulary"),
    (_t2d_disagrees, "t2d and d2t disagree on target id"),
    (lambda t: t | {"d2t": t["d2t"].astype(np.float32)}, "d2t has shape .* want \\[draft_vocab\\] integers"),
    (
        lambda t: t | {"norm.weight": t["norm.weight"].astype(np.int32)},
        "norm.weight has dtype int32, expected floats",
    ),
]


@pytest.mark.parametrize("edit,message", BAD_TENSORS, ids=[m[:30] for _, m in BAD_TENSORS])
def test_bad_tensors_are_refused(tmp_path, edit, message):
    path = write(tmp_path, edit(draft_tensors()), draft_config())
    with pytest.raises(CheckpointError, match=message):
        load_eagle3(path, TARGET, dtype=jnp.float32)


def test_a_prefixed_checkpoint_with_an_embedding_loads(tmp_path):
    """``model.``-prefixed names, and an ``embed_tokens`` a trainer saved (unread: the draft
    embeds with the target's), load as the plain names do."""
    tensors = draft_tensors()
    plain = load_eagle3(write(tmp_path / "plain", tensors, draft_config()), TARGET, dtype=jnp.float32)
    extra = {"embed_tokens.weight": np.zeros((VOCAB, H), np.float32)}
    prefixed = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in (tensors | extra).items()}
    other = load_eagle3(write(tmp_path / "prefixed", prefixed, draft_config()), TARGET, dtype=jnp.float32)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(plain)), jax.tree_util.tree_leaves(nnx.state(other)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

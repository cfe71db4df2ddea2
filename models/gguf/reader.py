"""A GGUF file's metadata -> the Hugging Face ``config.json`` dict ``config_from_hf`` reads.

Only the key names differ between the formats, so the model code stays one: llama.cpp's
``{arch}.*`` hyperparameters become the fields transformers would have written.
"""

from __future__ import annotations

import functools
import os

from hicache_jax.models.gguf import granitehybrid
from hicache_jax.models.hf.safetensors_io import CheckpointError

# general.architecture -> the transformers class this project builds for it. llama.cpp
# writes Mistral checkpoints as "llama" (same layers, rotary layout and tensor names), and
# Bamba ones as "granitehybrid" (see granitehybrid.py).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    granitehybrid.ARCH: "BambaForCausalLM",
}


@functools.lru_cache(maxsize=4)  # the loader, the tokenizer and the fingerprint each open it
def _reader(path: str, signature: tuple):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    except Exception as e:  # the reader fails with ValueError, IndexError, struct errors...
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def open_gguf(path: str):
    """The ``gguf.GGUFReader`` of ``path`` (memory-mapped; cached while the file is unchanged)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    return _reader(os.path.realpath(path), (st.st_size, st.st_mtime_ns))


def field(reader, key: str, default=None, *, path: str = "", required: bool = False):
    """A metadata value (scalar, string or list); ``required`` ones missing are an error."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise CheckpointError(f"{path}: GGUF metadata has no {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is unreadable ({e})") from e


def architecture(reader, path: str) -> str:
    arch = field(reader, "general.architecture", path=path, required=True)
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return arch


def hf_config(path: str) -> dict:
    """The ``config.json`` transformers would hold for this GGUF."""
    reader = open_gguf(path)
    arch = architecture(reader, path)

    def get(key, default=None, required=False):
        return field(reader, f"{arch}.{key}", default, path=path, required=required)

    names = {t.name: t for t in reader.tensors}
    embed = names.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing from the GGUF file")
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    eos = field(reader, "tokenizer.ggml.eos_token_id", path=path)
    eot = field(reader, "tokenizer.ggml.eot_token_id", path=path)
    eos_ids = [int(i) for i in dict.fromkeys(x for x in (eos, eot) if x is not None)]
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": int(embed.shape[-1]),  # ne order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 131072)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", path=path),
    }
    theta = get("rope.freq_base")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported (linear)")
    rope = {"rope_type": "default"}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if arch == granitehybrid.ARCH:
        hf.update(granitehybrid.hf_fields(get, names, hf, theta, rope, path))
        return hf
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    hf.update(num_key_value_heads=int(get("attention.head_count_kv") or heads), head_dim=int(head_dim))
    if arch == "llama":
        hf.update(hidden_act="silu", rope_theta=float(theta or 10000.0), rope_parameters=rope)
    else:
        hf.update(_gemma3(get, hf, theta, rope))
    return hf


def _gemma3(get, hf: dict, theta, rope: dict) -> dict:
    """What llama.cpp assumes for Gemma3 where the file is silent (local RoPE base 10000,
    one global layer in six, query scale 1/sqrt(head_dim) except the 62-layer 27B model's
    1/sqrt(hidden/heads))."""
    layers = hf["num_hidden_layers"]
    pattern = int(get("attention.sliding_window_pattern", 6) or 6)
    scalar = hf["head_dim"]
    if layers == 62:
        scalar = hf["hidden_size"] // hf["num_attention_heads"]
    softcap = get("final_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "sliding_window": int(get("attention.sliding_window", 4096)),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": float(softcap) if softcap else None,
        "rope_parameters": {
            "full_attention": {**rope, "rope_theta": float(theta or 1e6)},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }

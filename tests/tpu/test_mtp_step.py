"""Compile-only: the serving step with multi-token-prediction drafting
(``--speculative_algorithm NEXTN``, ``runtime/mtp_drafts.py``, three drafts a step), for a
DeepSeek-V3-style MLA model and a Qwen3.5-style Gated DeltaNet hybrid, each with the one
MTP block its published config.json declares (``num_nextn_predict_layers`` /
``mtp_num_hidden_layers``), at real widths, cut to one layer of each main kind, with the
Pallas backends, as the engine builds it (``hicache_jax/tpu/abstract.py``): the verify step
(the main model over every draft row, the GDN layers' verify kernels writing a state per
row, sampling, then the block over the rows and its chain), whose block KV is one more
paged cache entry.

DeepSeek V3's block is MLA with an MoE of 256 experts; Qwen3.5's a gated attention layer
with a dense MLP. Each verify program costs about 22 s of CPU to compile, the block and
its chain about 40% of it (three unrolled calls of the block, each with its LM head:
DeepSeek V3's on v5e took 17.5 s without drafting and 30 s with, on a busy machine), so
the hybrid compiles on v6e only: MLA covers both chips, and the hybrid's layer kinds compile
on v5e through ``test_serving_step.py`` and the trail kernels through
``test_state_trail.py``. The smallest verify bucket (one sequence, four rows) is compiled:
the kernels are the same at every bucket. ``HICACHE_TPU_FULL=1`` adds the hybrid on v5e and
the largest verify bucket (eight sequences).

An EAGLE-3 draft (``--speculative_algorithm EAGLE3``) compiles in the block's place over
Llama 3 8B cut to four layers, split over v6e's eight chips (its 32 query heads four per
chip, its 8 KV heads the model's, one per chip): the compile path reads the draft's
config.json only (``load_eagle3(shapes_on=)``), at the widths of the published EAGLE-3
drafts for Llama 3.1 8B (one layer, a 32,000-token draft vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import pytest
from flax import nnx

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.registry import config_from_hf
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import HF_CONFIGS, real_config
from hicache_jax.tpu.hbm import in_vmem
from hicache_jax.tpu.target import target
from tests.tpu.test_serving_step import SERVING, TP, V5E, V6E

FULL = os.environ.get("HICACHE_TPU_FULL") == "1"
DRAFTS = 3  # SGLang's --speculative_num_steps: verify steps of 4 rows per sequence
CASES = [("deepseek-v3", V5E), ("deepseek-v3", V6E), ("qwen3.5-27b", V6E)]
if FULL:
    CASES.append(("qwen3.5-27b", V5E))
SEQS = (1, 8) if FULL else (1,)


def mtp_config(family: str) -> ModelConfig:
    """The family cut to one layer of each kind, with the one MTP block its checkpoint
    ships (parsed from config.json's key, as loading it does)."""
    hf = dict(HF_CONFIGS[family])
    if "text_config" in hf:  # Qwen3.5: the text model's config nests
        hf["text_config"] = hf["text_config"] | {"mtp_num_hidden_layers": 1}
    else:
        hf["num_nextn_predict_layers"] = 1
    nextn = config_from_hf(hf, f"{family} config").nextn
    return dataclasses.replace(real_config(family, num_layers=1), nextn=nextn)


@pytest.mark.parametrize("family,topology", CASES)
def test_verify_step_with_mtp_drafts_compiles(family, topology):
    model_cfg = mtp_config(family)
    cfg = EngineConfig(
        tp_size=TP[topology], speculative_algorithm="NEXTN", speculative_num_steps=DRAFTS, **SERVING
    )
    server = AbstractServer.build(model_cfg, cfg, target(topology))
    # As the engine builds it for NEXTN: the block drafts in the step, its KV one more entry.
    assert server.runner.draft_steps == DRAFTS
    assert server.model.cfg.mtp_cache_layers == 1
    assert len(server.runner.cache) == len(model_cfg.layer_kinds) + 1
    want = {f"verify step T={(DRAFTS + 1) * S} S={S} top=0" for S in SEQS}
    compiled = dict(server.compile(lambda name: name in want))  # raises naming what fails
    assert set(compiled) == want
    for name, program in compiled.items():
        # The kernels, the block's included, read a few pages of each pool by DMA: no pool
        # is moved into VMEM around them.
        moved = in_vmem(program, server.kernel_pool_shapes())
        assert not moved, (name, moved[:4])
        # Donated and updated in place, the block's entry included: no pool is copied.
        aliased = program.memory_analysis().alias_size_in_bytes
        assert aliased >= server.cache_bytes(), (name, aliased, server.cache_bytes())


def test_a_model_without_a_block_is_refused_as_the_engine_refuses_it():
    cfg = EngineConfig(tp_size=TP[V5E], speculative_algorithm="NEXTN", **SERVING)
    with pytest.raises(ConfigError, match="speculative_algorithm='NEXTN'.*has none"):
        AbstractServer.build(real_config("deepseek-v3", num_layers=1), cfg, target(V5E))


EAGLE3_DRAFT = {  # config.json of a draft for Llama 3.1 8B, at the published drafts' widths
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
}


def test_verify_step_with_an_eagle3_draft_compiles_split_over_v6e(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EAGLE3_DRAFT))
    model_cfg = real_config("llama-3-8b", num_layers=4)  # default boundaries 2, 2 and 1
    cfg = EngineConfig(
        tp_size=TP[V6E],
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(tmp_path),
        speculative_num_steps=DRAFTS,
        **SERVING,
    )
    server = AbstractServer.build(model_cfg, cfg, target(V6E))
    assert server.runner.draft_steps == DRAFTS
    assert server.model.cfg.eagle3_aux == (2, 2, 1)
    assert len(server.runner.cache) == len(model_cfg.layer_kinds) + 1
    attn = server.model.mtp[0].attn
    (q,), (k,) = (jax.tree_util.tree_leaves(nnx.state(p)) for p in (attn.q_proj, attn.k_proj))
    assert q.sharding.shard_shape(q.shape) == (2 * 4096, 32 * 128 // TP[V6E])  # by head
    assert k.sharding.shard_shape(k.shape) == (2 * 4096, 128)  # one KV head per chip
    name = "verify step T=4 S=1 top=0"
    compiled = dict(server.compile(lambda n: n == name))
    assert set(compiled) == {name}
    moved = in_vmem(compiled[name], server.kernel_pool_shapes())
    assert not moved, moved[:4]
    aliased = compiled[name].memory_analysis().alias_size_in_bytes
    assert aliased >= server.cache_bytes(), (aliased, server.cache_bytes())

"""Greedy generation through the engine equals transformers' greedy ``generate``.

Where the two first differ, the test demands a near-tie in transformers' own logits (top
two within 1e-4); any other difference fails.
"""

import numpy as np
import pytest
import torch

from hicache_jax import LLM
from tests.hf_checkpoints import load_reference

NEW = 32


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@pytest.mark.parametrize("family", ["mistral", "gemma3", "bamba"])
def test_greedy_matches_transformers(checkpoint_dir, family):
    path = checkpoint_dir(family)
    ref = load_reference(path)
    rng = np.random.RandomState(7)
    # Mistral's prompt is longer than its window (20); chunked prefill (32) splits it.
    prompts = [rng.randint(0, 512, 45).tolist(), rng.randint(0, 512, 13).tolist()]
    llm = LLM(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=32, max_running_requests=4)
    outs = llm.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    )
    for prompt, out in zip(prompts, outs):
        assert len(out["output_ids"]) == NEW
        with torch.no_grad():
            # An explicit mask: generate() would otherwise mask any token equal to pad_token_id.
            want = ref.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        k = first_difference(out["output_ids"], want)
        if k is None:
            continue
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + want[:k]])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        gap = float(top2[0] - top2[1])
        assert gap < 1e-4, f"{family}: first difference at output {k} is not a near-tie (gap {gap})"


def test_input_logprobs_match_transformers_with_a_cached_prefix(checkpoint_dir):
    path = checkpoint_dir("gemma3")
    ref = load_reference(path)
    prompt = np.random.RandomState(1).randint(0, 512, 60).tolist()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0], -1).numpy()
    want = [logp[i - 1, prompt[i]] for i in range(41, 60)]
    llm = LLM(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=32)
    sp = {"max_new_tokens": 2, "temperature": 0}
    for attempt in range(2):  # the second pass reuses the prefix, but not past 40
        out = llm.generate(
            input_ids=[prompt],
            sampling_params=sp,
            return_logprob=True,
            logprob_start_len=40,
            top_logprobs_num=3,
        )[0]
        meta = out["meta_info"]
        assert meta["cached_tokens"] == (32 if attempt else 0)
        lps = meta["input_token_logprobs"]
        assert len(lps) == 20 and lps[0][0] is None and [x[1] for x in lps] == prompt[40:]
        np.testing.assert_allclose([x[0] for x in lps[1:]], want, atol=2e-5)
        tops = meta["input_top_logprobs"][1]
        assert [t[1] for t in tops] == np.argsort(-logp[40])[:3].tolist()


# Nemotron-H and Granite 4.0-H: Mamba state carried across the chunks, MLP-free layers,
# attention without RoPE, Granite's multipliers, shared experts.
HYBRIDS = ["nemotron_h", "nemotron_h_moe", "granite_h", "granite_h_moe"]
# Qwen3.5, Qwen3-Next, Qwen3.5-MoE: Gated DeltaNet state across the chunks, gated attention.
GDN = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]


# DeepSeek V3 (MLA), V3.2 and GLM-5 (MLA with an indexer; GLM-5 sharing its picks); V4
# (window, compressed sparse and heavily compressed attention, hyper-connections, hash MoE).
LATENT = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "olmo3", "gpt_oss", *HYBRIDS, *GDN, *LATENT])
def test_prompt_logprobs_match_transformers(checkpoint_dir, family):
    """Every prompt token's logprob through ``LLM`` (chunked prefill over paged windows,
    MoE, sinks) against transformers' log-softmax: at most 1e-4 apart, in float32."""
    path = checkpoint_dir(family)
    # 90 tokens: chunks of 32, 32 and 26 (mid-page), all in LLM's 64-token step bucket (a
    # last chunk of 16 or fewer would compile the 16-token one too).
    prompt = np.random.RandomState(2).randint(0, 512, 90).tolist()
    with torch.no_grad():
        logp = torch.log_softmax(load_reference(path)(torch.tensor([prompt])).logits[0], -1).numpy()
    want = [logp[i - 1, prompt[i]] for i in range(1, len(prompt))]
    llm = LLM(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=32)
    out = llm.generate(
        input_ids=[prompt], sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
    )[0]
    got = [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]
    assert len(got) == len(want)
    assert np.abs(np.array(got) - np.array(want)).max() <= 1e-4

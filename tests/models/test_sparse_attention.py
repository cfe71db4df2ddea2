"""DeepSeek Sparse Attention below the sequence length: each query attends to its
``index_topk`` best positions among those it can see.

transformers' full forward ranks every position of the sequence, later ones included, so
it is not causal there (its logits move by 0.1-0.2 against each prefix's own forward). The
causal reference is transformers itself fed one token at a time with its cache: each step's
indexer then sees exactly the positions before and at the token, in every layer.
"""

import jax
import numpy as np
import pytest
import torch

from hicache_jax import LLM
from hicache_jax.models.layers import mla
from tests.hf_checkpoints import load_reference, make

LENGTH = 48
TOPK = 8  # well below LENGTH: most queries drop most positions
HEADS = 16  # indexer heads: an exact tie in the scores (every head's relu at 0) is ~1e-5 likely


def _stepwise_logprobs(model, prompt: list[int]) -> np.ndarray:
    """transformers' log-softmax for every position, decoding one token at a time."""
    out, cache = [], None
    with torch.no_grad():
        for t in prompt:
            r = model(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = r.past_key_values
            out.append(torch.log_softmax(r.logits[0, -1], -1).numpy())
    return np.stack(out)


@pytest.mark.parametrize("family, block", [("deepseek_v32", 2048), ("glm_moe_dsa", 16)])
def test_prompt_logprobs_match_the_causal_reference(tmp_path, monkeypatch, family, block):
    """``block``: positions the indexer scores at a time; 16 (a page) merges the running
    top-k across blocks at every page."""
    monkeypatch.setattr(mla, "INDEX_BLOCK", block)
    sparse = make(family, str(tmp_path / "sparse"), overrides={"index_topk": TOPK, "index_n_heads": HEADS})
    dense = make(family, str(tmp_path / "dense"), overrides={"index_topk": 128, "index_n_heads": HEADS})
    prompt = np.random.RandomState(3).randint(0, 512, LENGTH).tolist()
    logp = _stepwise_logprobs(load_reference(sparse), prompt)
    want = np.array([logp[i - 1, prompt[i]] for i in range(1, LENGTH)])
    kw = dict(sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
    got = {}
    for name, path in (("sparse", sparse), ("dense", dense)):
        llm = LLM(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=16)
        out = llm.generate(input_ids=[prompt], **kw)[0]
        got[name] = np.array([x[0] for x in out["meta_info"]["input_token_logprobs"][1:]])
        llm.engine.close()
    assert np.abs(got["sparse"] - want).max() <= 1e-4
    # The selection matters: attending densely gives other logprobs past the first TOPK.
    assert np.abs(got["dense"] - want)[TOPK:].max() > 1e-2


def test_deepseek_v4_compressed_sparse_attention_is_causal(tmp_path, monkeypatch):
    """DeepSeek V4's CSA layer with ``index_topk`` 4 among up to 24 compressed entries (one
    per 4 tokens, each visible once its window is complete): prompt logprobs through ``LLM``
    equal transformers' decoding one token at a time, and its full forward (both causal
    here), with the indexer's block at 2,048 and at 16 (it merges its running top-k every 16
    entries, four pages); attending to every entry instead moves them by > 1e-2. One
    checkpoint and one reference serve both blocks (the reference decoding is most of the
    cost)."""
    topk = {"index_n_heads": HEADS}
    sparse = make("deepseek_v4", str(tmp_path / "sparse"), overrides=topk | {"index_topk": 4})
    dense = make("deepseek_v4", str(tmp_path / "dense"), overrides=topk | {"index_topk": 128})
    length = 96
    prompt = np.random.RandomState(3).randint(0, 512, length).tolist()
    reference = load_reference(sparse)
    logp = _stepwise_logprobs(reference, prompt)
    want = np.array([logp[i - 1, prompt[i]] for i in range(1, length)])
    with torch.no_grad():
        full = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1).numpy()
    full = np.array([full[i - 1, prompt[i]] for i in range(1, length)])
    kw = dict(sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)

    def served(path):
        llm = LLM(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=16)
        out = llm.generate(input_ids=[prompt], **kw)[0]
        llm.engine.close()
        return np.array([x[0] for x in out["meta_info"]["input_token_logprobs"][1:]])

    for block in (2048, 16):
        monkeypatch.setattr(mla, "INDEX_BLOCK", block)
        # The step is traced anew with this block: jit's caches key on shapes, not on the
        # module's INDEX_BLOCK, and would hand back the previous block's program.
        jax.clear_caches()
        got = served(sparse)
        assert np.abs(got - want).max() <= 1e-4, block
        assert np.abs(got - full).max() <= 1e-4, block
    assert np.abs(served(dense) - want).max() > 1e-2

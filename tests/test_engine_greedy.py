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

"""Checks on a request before it is queued: every failure names the field at fault."""

from __future__ import annotations

import numpy as np

from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.sampling_params import MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams


def validate_prompt(
    input_ids,
    text,
    sp: SamplingParams,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    context_len: int,
    capacity: int,
    logprob_start_len,
    top_logprobs_num,
) -> list[int]:
    """The prompt's token ids, or InvalidRequest."""
    if (input_ids is None) == (text is None):
        raise InvalidRequest("give exactly one of text or input_ids")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequest("text must be a string")
        if not tokenizer.has_text:
            raise InvalidRequest("this model has no tokenizer.json: send input_ids instead of text")
        input_ids = tokenizer.encode(text)
    if not isinstance(input_ids, (list, tuple)) or any(
        not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in input_ids
    ):
        raise InvalidRequest("input_ids must be a list of integers")
    input_ids = [int(t) for t in input_ids]
    if not input_ids:
        raise InvalidRequest("the prompt is empty")
    V = vocab_size
    bad = [t for t in input_ids if not 0 <= t < V]
    if bad:
        raise InvalidRequest(f"input_ids: token ids {bad[:5]} outside the vocabulary [0, {V})")
    n = len(input_ids)
    if n + sp.max_new_tokens > context_len:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds "
            f"the context length {context_len}"
        )
    if n + sp.max_new_tokens > capacity:
        raise InvalidRequest(
            f"prompt + max_new_tokens ({n + sp.max_new_tokens}) exceeds the KV cache ({capacity} tokens)"
        )
    if not isinstance(logprob_start_len, int) or logprob_start_len < -1 or logprob_start_len >= max(n, 1):
        raise InvalidRequest(f"logprob_start_len must be -1 or in [0, {n}), got {logprob_start_len!r}")
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}")
    return input_ids

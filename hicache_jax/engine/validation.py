"""Checks on a request before it is queued: every failure names the field at fault."""

from __future__ import annotations

import numpy as np

from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.runtime.penalties import held_back
from hicache_jax.sampling_params import MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams, show

MAX_RID_CHARS = 256
MAX_SALT_CHARS = 1024


def validate_rid(rid) -> None:
    """None (the engine names the request) or a non-empty string of at most MAX_RID_CHARS."""
    if rid is None:
        return
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest(f"rid must be a non-empty string, got {show(rid)}")
    if len(rid) > MAX_RID_CHARS:
        raise InvalidRequest(f"rid is {len(rid)} characters long; at most {MAX_RID_CHARS}")


def validate_cache_salt(salt) -> None:
    """None or a string of at most MAX_SALT_CHARS. Any characters are fine: a salt only ever
    enters a hash (the L3 namespace) and a dict key (its radix tree), never a path."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise InvalidRequest(f"cache_salt must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidRequest(f"cache_salt is {len(salt)} characters long; at most {MAX_SALT_CHARS}")


def validate_sampling(sp: SamplingParams, *, vocab_size: int, eos_token_ids) -> None:
    """What ``SamplingParams`` cannot check without the model: stop token ids inside its
    vocabulary, and no more stop tokens than ``min_new_tokens`` can hold back."""
    V = vocab_size
    bad = [t for t in sp.stop_token_ids if not 0 <= t < V]
    if bad:
        raise InvalidRequest(
            f"sampling_params.stop_token_ids: token ids {show(bad[:5])} outside the vocabulary [0, {V})"
        )
    if sp.min_new_tokens:
        held_back(sp, eos_token_ids)  # raises if too many to hold back


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
    if not isinstance(input_ids, (list, tuple)):
        raise InvalidRequest("input_ids must be a list of integers")
    n = len(input_ids)
    if not n:
        raise InvalidRequest("the prompt is empty")
    # Lengths first: a prompt too long for the context is refused before any per-token work
    # (this runs on the engine thread).
    if n + sp.max_new_tokens > context_len:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_new_tokens ({show(sp.max_new_tokens)}) exceeds "
            f"the context length {context_len}"
        )
    if n + sp.max_new_tokens > capacity:
        raise InvalidRequest(
            f"prompt + max_new_tokens ({show(n + sp.max_new_tokens)}) exceeds the KV cache "
            f"({capacity} tokens)"
        )
    if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in input_ids):
        raise InvalidRequest("input_ids must be a list of integers")
    input_ids = [int(t) for t in input_ids]
    V = vocab_size
    bad = [t for t in input_ids if not 0 <= t < V]
    if bad:
        raise InvalidRequest(f"input_ids: token ids {show(bad[:5])} outside the vocabulary [0, {V})")
    if not _integer(logprob_start_len) or logprob_start_len < -1 or logprob_start_len >= max(n, 1):
        raise InvalidRequest(f"logprob_start_len must be -1 or in [0, {n}), got {show(logprob_start_len)}")
    if not _integer(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        got = show(top_logprobs_num)
        raise InvalidRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {got}")
    return input_ids


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

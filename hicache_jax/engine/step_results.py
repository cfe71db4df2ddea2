"""What one step's results do to a request: its new token with its logprobs, its prompt
logprobs, and whether it stops. Plain functions of the request and the step's host arrays
(``SamplingOutputs`` read back), so ``Engine._postprocess`` only puts them in order."""

from __future__ import annotations

from hicache_jax import finish
from hicache_jax.request import Req

# The engine's counters (``Engine.stats``), all starting at 0. overlapped_steps: steps
# planned before the previous step's tokens were read; cached_tokens_<tier>: prompt tokens a
# finished request found in that tier; request_errors: requests failed alone because their
# own host-side work in a step raised (the others went on); failed_steps: steps that failed
# every running request and rebuilt the device state.
ENGINE_COUNTERS = (
    "steps",
    "overlapped_steps",
    "requests_finished",
    "prompt_tokens",
    "generated_tokens",
    "cached_tokens",
    "cached_tokens_device",
    "cached_tokens_host",
    "cached_tokens_storage",
    "host_loads_layerwise",  # L2 pages a step wrote layer by layer (the rest: before it)
    "request_errors",
    "failed_steps",
    # Speculative decoding: requests fed a draft in a verify step, draft tokens fed, and
    # draft tokens accepted (``spec_accept_length`` in /metrics derives from them).
    "spec_verifications",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def append_token(req: Req, out, row: int, now: float) -> int:
    """Append the token sampled in ``row`` (with its logprob and top logprobs) to ``req``."""
    tok = int(out.next_ids[row])
    req.output_ids.append(tok)
    top = None
    if req.top_logprobs_num:
        top = list(zip(out.next_top_logprobs[row].tolist(), out.next_top_ids[row].tolist()))
    req.output_logprobs.append((float(out.next_logprobs[row]), top))
    if req.first_token_time is None:
        req.first_token_time = now
    return tok


def record_input_logprobs(req: Req, item, out, row0: int) -> None:
    """The prompt logprobs of ``item``'s chunk (its rows start at ``row0``)."""
    lsl = req.logprob_start_len
    for q in range(max(item.start, lsl), min(item.end, req.input_len - 1)):
        row = row0 + q - item.start
        top = None
        if req.top_logprobs_num:
            top = list(zip(out.row_top_logprobs[row].tolist(), out.row_top_ids[row].tolist()))
        req.input_logprobs[q + 1] = (float(out.target_logprobs[row]), top)
    if lsl < req.input_len and lsl not in req.input_logprobs:
        req.input_logprobs[lsl] = (None, None)  # the first scored token has no context row


def stop_reason(req: Req, tok: int, *, eos_token_ids, tokenizer, context_len: int) -> dict | None:
    """Why ``req`` stops after its newest token ``tok`` (SGLang's ``finish_reason``), or None."""
    sp = req.sampling
    if len(req.output_ids) < sp.min_new_tokens:  # stop tokens and strings do not count yet
        pass
    elif tok in sp.stop_token_ids:
        return finish.stop(tok)
    elif not sp.ignore_eos and tok in eos_token_ids:
        return finish.stop(tok)
    elif sp.stop and tokenizer.has_text:
        # A new match ends in the newest token. A character is at most 4 UTF-8 bytes and
        # a token at least one, so the last 4 tokens per character hold any match (one
        # more in front: a window's first token may lose its leading space).
        window = 4 * max(len(s) for s in sp.stop) + 1
        text = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False) or ""
        for s in sp.stop:
            if s in text:
                return finish.stop(s)
    if len(req.output_ids) >= sp.max_new_tokens:
        return finish.length(sp.max_new_tokens)
    if req.input_len + len(req.output_ids) >= context_len:
        return finish.length(len(req.output_ids))
    return None

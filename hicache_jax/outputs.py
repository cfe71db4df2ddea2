"""Request results in SGLang's response format."""

from __future__ import annotations

import time

from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req


def _triples(pairs, tok: Tokenizer):
    return [[lp, t, tok.token_text(t)] for lp, t in pairs]


def _tops(tops, num: int, tok: Tokenizer):
    return [None if top is None else [[lp, t, tok.token_text(t)] for lp, t in top[:num]] for top in tops]


def output_text(req: Req, tok: Tokenizer) -> str | None:
    text = tok.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    reason = req.finish_reason or {}
    if text is not None and isinstance(reason.get("matched"), str):
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]  # SGLang drops the stop string and what follows
    return text


def format_output(req: Req, tok: Tokenizer) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": req.input_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": dict(req.cached_details),
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finish_time or time.monotonic()) - req.arrival,
    }
    if req.first_token_time is not None:
        meta["ttft"] = req.first_token_time - req.arrival
    if req.return_logprob:
        out_pairs = [(lp, t) for (lp, _), t in zip(req.output_logprobs, req.output_ids)]
        meta["output_token_logprobs"] = _triples(out_pairs, tok)
        if req.logprob_start_len >= 0:
            positions = range(req.logprob_start_len, req.input_len)
            pairs = [(req.input_logprobs.get(i, (None, None))[0], req.input_ids[i]) for i in positions]
            meta["input_token_logprobs"] = _triples(pairs, tok)
            if req.top_logprobs_num:
                tops = [req.input_logprobs.get(i, (None, None))[1] for i in positions]
                meta["input_top_logprobs"] = _tops(tops, req.top_logprobs_num, tok)
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = _tops(
                [top for _, top in req.output_logprobs], req.top_logprobs_num, tok
            )
    return {"text": output_text(req, tok), "output_ids": list(req.output_ids), "meta_info": meta}

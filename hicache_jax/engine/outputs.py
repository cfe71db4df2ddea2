"""Request results in SGLang's response format: whole (``format_output``), or as the deltas a
streaming request sends (``OutputStream``), each costing O(new tokens)."""

from __future__ import annotations

import dataclasses
import time

from hicache_jax.engine.detokenizer import IncrementalDetokenizer
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req


def _triples(pairs, tok: Tokenizer):
    return [[lp, t, tok.token_text(t)] for lp, t in pairs]


def _tops(tops, num: int, tok: Tokenizer):
    return [None if top is None else [[lp, t, tok.token_text(t)] for lp, t in top[:num]] for top in tops]


def output_text(req: Req, tok: Tokenizer) -> str | None:
    text = tok.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    stop = matched_stop(req)
    if text is not None and stop is not None:
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]  # SGLang drops the stop string and what follows
    return text


def matched_stop(req: Req) -> str | None:
    """The stop string that finished ``req``, if one did."""
    matched = (req.finish_reason or {}).get("matched")
    return matched if isinstance(matched, str) else None


def _meta(req: Req) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": req.input_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": {str(t): n for t, n in req.cached_details.items()},  # plain names
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finish_time or time.monotonic()) - req.arrival,
    }
    if req.first_token_time is not None:
        meta["ttft"] = req.first_token_time - req.arrival
    if req.drafter_state is not None:  # speculative decoding: its verify steps, tokens per one
        n = req.spec_verifications
        meta["spec_verify_ct"] = n
        meta["spec_accept_length"] = (req.spec_accepted_tokens + n) / n if n else 0.0
    if req.handover is not None:
        meta["disaggregation"] = dict(req.handover)
    if req.timing:
        meta["timing"] = {k: round(v, 6) for k, v in req.timing.items()}
    return meta


def _input_logprobs(req: Req, tok: Tokenizer) -> dict:
    if req.logprob_start_len < 0:
        return {}
    positions = range(req.logprob_start_len, req.input_len)
    pairs = [(req.input_logprobs.get(i, (None, None))[0], req.input_ids[i]) for i in positions]
    out = {"input_token_logprobs": _triples(pairs, tok)}
    if req.top_logprobs_num:
        tops = [req.input_logprobs.get(i, (None, None))[1] for i in positions]
        out["input_top_logprobs"] = _tops(tops, req.top_logprobs_num, tok)
    return out


def _output_logprobs(req: Req, tok: Tokenizer, start: int) -> tuple[list, list]:
    """Output tokens [start:]: their logprob triples, and top logprobs (empty unless asked)."""
    lps = req.output_logprobs[start:]
    triples = _triples([(lp, t) for (lp, _), t in zip(lps, req.output_ids[start:])], tok)
    tops = _tops([top for _, top in lps], req.top_logprobs_num, tok) if req.top_logprobs_num else []
    return triples, tops


def format_output(req: Req, tok: Tokenizer) -> dict:
    meta = _meta(req)
    if req.return_logprob:
        meta["output_token_logprobs"], tops = _output_logprobs(req, tok, 0)
        meta.update(_input_logprobs(req, tok))
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = tops
    return {"text": output_text(req, tok), "output_ids": list(req.output_ids), "meta_info": meta}


@dataclasses.dataclass
class OutputDelta:
    """What a streaming request made since its previous delta: new text, new output ids and
    their logprobs. ``meta`` holds the request's current counters and finish reason (and, in
    its first delta, the input logprobs). Deltas in a row ``extend`` into one."""

    pieces: list[str] | None  # the new text, in pieces; None without a tokenizer
    output_ids: list[int]
    logprobs: list | None  # output_token_logprobs triples of output_ids; None unless asked
    top_logprobs: list | None  # output_top_logprobs of output_ids; None unless asked
    meta: dict

    @property
    def text(self) -> str | None:
        return None if self.pieces is None else "".join(self.pieces)

    def extend(self, later: OutputDelta) -> None:
        """Append ``later`` (the next delta), in place; O(size of ``later``)."""
        if self.pieces is not None and later.pieces is not None:
            self.pieces.extend(later.pieces)
        self.output_ids.extend(later.output_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        if self.top_logprobs is not None and later.top_logprobs is not None:
            self.top_logprobs.extend(later.top_logprobs)
        self.meta.update(later.meta)

    def as_dict(self) -> dict:
        """SGLang's output dict of this delta: the whole output, for the first delta extended
        by all the others."""
        meta = dict(self.meta)
        if self.logprobs is not None:
            meta["output_token_logprobs"] = list(self.logprobs)
        if self.top_logprobs is not None:
            meta["output_top_logprobs"] = list(self.top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class OutputStream:
    """Follows one streaming request: each ``next`` returns the ``OutputDelta`` since the
    previous one, at O(new tokens); the last (once the request finished) closes the text."""

    def __init__(self, req: Req, tok: Tokenizer):
        self._tok = tok
        self._detok = None
        if tok.has_text:
            sp = req.sampling
            self._detok = IncrementalDetokenizer(
                tok, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop
            )
        self.sent = 0  # output ids already in a delta
        self.closed = False
        self._first = True

    def has_news(self, req: Req) -> bool:
        return not self.closed and (len(req.output_ids) > self.sent or req.finished)

    def next(self, req: Req) -> OutputDelta:
        if self.closed:
            raise RuntimeError(f"{req.rid}: the stream already sent its last delta")
        start, self.sent = self.sent, len(req.output_ids)
        ids = req.output_ids[start:]
        pieces = None
        if self._detok is not None:
            pieces = [self._detok.push(ids)]
            if req.finished:
                pieces.append(self._detok.finish(matched_stop(req)))
        meta = _meta(req)
        triples = tops = None
        if req.return_logprob:
            triples, tops = _output_logprobs(req, self._tok, start)
            tops = tops if req.top_logprobs_num else None
            if self._first:
                meta.update(_input_logprobs(req, self._tok))  # complete once a token is out
        self._first, self.closed = False, req.finished
        return OutputDelta(pieces, ids, triples, tops, meta)

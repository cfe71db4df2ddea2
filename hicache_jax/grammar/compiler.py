"""Grammars compiled once per spec, and a matcher per request.

``compile`` builds and checks a spec's matcher (llguidance parses the grammar and builds
its lexer; for a large schema that is 100 ms or more) and keeps it, keyed by the spec's
text; a request then gets a ``deep_copy`` of it (about 0.3 ms). The HTTP layer calls
``compile`` on a worker thread before it queues the request (``server/engine_loop.py``), so
the engine thread only ever finds it compiled and no step waits on a grammar. Thread-safe.

The tokenizer llguidance needs is built once, lazily, from the model's ``tokenizer.json``,
sized to the model's vocabulary (ids past the tokenizer's are never allowed) with the
model's EOS tokens (allowed once the grammar is complete).
"""

from __future__ import annotations

import collections
import threading

from hicache_jax.grammar.spec import GrammarSpec, spec_of
from hicache_jax.sampling_params import InvalidRequest

CACHE_SIZE = 256  # compiled specs kept (least recently used dropped)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[GrammarSpec, object] = collections.OrderedDict()
        self.stats = {"grammar_compiles": 0, "grammar_cache_hits": 0}

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self):
        import llguidance

        source = self._tokenizer.to_json() if self._tokenizer is not None else None
        if source is None:
            raise InvalidRequest("this model has no tokenizer.json: structured output needs one")
        return llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self._eos or None)

    def compile(self, spec: GrammarSpec):
        """The spec's compiled matcher (do not advance it: ``matcher`` copies it);
        InvalidRequest naming the problem when the grammar is invalid."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                self.stats["grammar_cache_hits"] += 1
                return self._compiled[spec]
        import llguidance

        grammar = spec.grammar()
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"sampling_params.{spec.kind}: invalid grammar: {_first_lines(matcher.get_error())}"
            )
        why = self._cannot_start(matcher)
        if why is not None:
            raise InvalidRequest(f"sampling_params.{spec.kind}: the grammar allows no output ({why})")
        with self._lock:
            self._compiled[spec] = matcher
            self.stats["grammar_compiles"] += 1
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def _cannot_start(self, matcher) -> str | None:
        """Why no token (EOS included) can begin the output, or None when one can. A grammar
        that parses but matches nothing (``{"$ref": "#"}``, a rule defined only by itself) is
        found here, at compile time, rather than as a dead end at the request's first step.
        On a copy: the check leaves a failed matcher in error."""
        import llguidance.numpy

        probe = matcher.deep_copy()
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error():
            return _first_lines(probe.get_error(), 1) or "the grammar is in error"
        return None if mask.any() else "no token can start it"

    def compile_params(self, sp) -> None:
        """Compile the grammar of sampling params ``sp`` (a ``SamplingParams`` or SGLang's
        dict), if it has one."""
        from hicache_jax.sampling_params import SamplingParams

        spec = spec_of(SamplingParams.from_dict(sp))
        if spec is not None:
            self.compile(spec)

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for one request."""
        return self.compile(spec).deep_copy()


def _first_lines(message: str, n: int = 6) -> str:
    """llguidance's errors end in a long parser-state dump; the first lines name the problem."""
    return "\n".join(message.strip().splitlines()[:n])
